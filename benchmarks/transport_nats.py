"""NATS vs MQTT in one run: the same federated round at 1,000 devices, messages/s, memory per connection.

    python benchmarks/transport_nats.py                          # 1000 devices, 3 rounds, ABBA (4 fleets)
    python benchmarks/transport_nats.py --devices 50 100 --json out.json
    python benchmarks/transport_nats.py --devices 20 --rounds 2 --messages 200   # CI-sized

The round is benchmarks/round_scaling.py's, run through its own ``device_worker`` and
``gateway_worker`` (imported, not copied): the real gateway (RoundManager, SQLite state on disk, its
own process) announces a signed round to every device, collects one signed int8 update from each
over its own connection, aggregates and publishes the new global model, which every device
receives and verifies; ``round_s`` is the gateway's own measure. The devices are real transport
clients (a TCP connection, a session and two threads each) in ``--device-procs`` processes. On
NATS the same two workers run with every ``MqttTransport`` they build replaced, in their own
process, by a :class:`~edgeflow.transport.nats.NatsTransport` with the same options (the MQTT
session options have no NATS meaning and NatsTransport ignores them; ``max_pending_messages``, an
MQTT inbound QoS 0 bound, is dropped). Servers: a private Mosquitto (persistence on, round_scaling's
queue limits) and a private nats-server with JetStream (streams on disk), each started here on a free
loopback port, a fresh one per fleet.

One fleet is: start the server, connect ``--devices`` devices, run ``--rounds`` rounds, stop. The
fleets run in ABBA order (MQTT, NATS, NATS, MQTT, ... ``--reps`` of each), so drift on a shared
machine falls on both. Per fleet:

- ``round_s``: every round's time; the table shows the median over all rounds of all fleets of a
  transport, and NATS/MQTT of the medians. Every round must collect every device (else exit 1).
- ``server_kb_per_conn``: the server's RSS with every device connected and subscribed, minus its
  RSS before the first device connected, per device; ``server_peak_mb``: its VmHWM after the rounds.
- ``client_kb_per_conn``: the device processes' RSS once every device is connected and subscribed,
  minus their RSS before the first device was built (after every import), per device. That
  includes each device's own state (its signing key, its fixed delta), the same on both transports;
  ``--control`` (default on) measures that part alone once per device count, with a transport that
  never opens a connection, and the table subtracts it ("transport KB per connection").
- ``msgs_per_s``: one publisher, one subscriber, ``--messages`` QoS 1 messages of 1 KiB on one
  topic, on a server of its own started in the fleet's slot (so the fleet's memory is not the
  burst's); from the first publish to the last message handled. On NATS each is a JetStream
  publish (stored on disk, PubAck); on MQTT a PUBLISH/PUBACK with Mosquitto.

A NATS device subscribes after it connects (a core subscription, then a read of the retained stream);
a fleet waits until every device's subscriptions are made. A setup the server did not answer in time
(at 1,000 devices connecting at once a read of the retained stream can outlast the default 5 s
``ack_timeout_s``, which is also the JetStream API timeout) is retried by the transport with backoff
until it is made: ``subscribe_timeouts`` (timed-out tries, all fleets' devices) and
``subscribe_retried`` (subscriptions made by a retry) say how often. One that was refused (the
transport counts ``subscribe_errors`` and logs "subscription ... not made"), or still not made after
300 s, leaves that device deaf to rounds, so the fleet runs no round and is reported as failed (exit 1).
``--nats-ack-timeout S`` sets ``ack_timeout_s`` on every NATS connection.

``--faults clean partition broker_restart model_cut lossy`` instead runs the scenarios of
benchmarks/network_faults.py (the real gateway and real federated devices, two sites behind
fault-injecting TCP proxies) with NATS in Mosquitto's place: its ``run_scenario`` is called with
:class:`~edgeflow.transport.broker.NatsServer` for the broker and NatsTransport for every
connection; ``lost`` and ``counted_twice`` must be 0 as on MQTT.

Devices, servers and the gateway share this machine's cores: read the figures as NATS/MQTT ratios
from one run, not absolutes; the load average at the start and the end is in the output.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_scaling as rs  # noqa: E402

from edgeflow.transport.factory import transport_from_url  # noqa: E402

KINDS = ("mqtt", "nats")
LABEL = {"mqtt": "MQTT (Mosquitto)", "nats": "NATS (JetStream)"}


def abba(reps: int) -> list[str]:
    """mqtt, nats, nats, mqtt, mqtt, nats, ... (``reps`` fleets of each)."""
    return [KINDS[(i % 4) in (1, 2)] for i in range(2 * reps)]


# ---------------------------------------------------------------------------
# The workers: round_scaling's, on the transport of ``kind``
# ---------------------------------------------------------------------------


_MADE: list[Any] = []
"""The NatsTransports this worker process built (to see their subscriptions settle)."""
_NATS_OPTIONS: dict[str, Any] = {}


def _nats_transport(host: str, port: int, *, max_pending_messages: int | None = None, **options: Any) -> Any:
    """MqttTransport's call, answered by a NatsTransport with the same options (and ``--nats-ack-timeout``)."""
    from edgeflow.transport.nats import NatsTransport

    t = NatsTransport(host, port, **{**options, **_NATS_OPTIONS})
    _MADE.append(t)
    return t


def _settle_subscriptions(timeout: float = 300.0) -> dict[str, int]:
    """NATS subscribes once connected (core subscription, then a read of the retained stream): wait until
    every device's subscriptions are made or one was refused (``subscribe_errors``: the transport logs
    "subscription ... not made"); one that timed out is retried by the transport meanwhile
    (``subscribe_timeouts``). MQTT: nothing to wait for (SUBSCRIBE follows CONNACK)."""
    end = time.monotonic() + timeout
    while True:
        made = sum(1 for t in _MADE if all(h.nats_subs for h in t._handlers.all()))
        failed = sum(1 for t in _MADE if t.stats().get("subscribe_errors"))
        if made + failed >= len(_MADE) or time.monotonic() > end:
            stats = [t.stats() for t in _MADE]
            return {"subscribed": made, "subscribe_failed": failed, "unsettled": len(_MADE) - made - failed,
                    "subscribe_timeouts": sum(st.get("subscribe_timeouts", 0) for st in stats),
                    "subscribe_retried": sum(st.get("subscribe_retried", 0) for st in stats),
                    "devices_retried": sum(1 for st in stats if st.get("subscribe_retried"))}
        time.sleep(0.1)


class _NoLink:
    """``--control``: a device's transport that never connects (is_connected at once, nothing sent)."""

    is_connected = True

    def __init__(self, host: str, port: int, **options: Any) -> None:
        self.client_id = options.get("client_id")

    def subscribe(self, *a: Any, **kw: Any) -> None:
        return None

    def connect(self, *a: Any, **kw: Any) -> _NoLink:
        return self

    def close(self, *a: Any, **kw: Any) -> None:
        return None


def _use(kind: str, nats_options: dict[str, Any]) -> None:
    """In this (worker) process, make ``from edgeflow.transport import MqttTransport`` give ``kind``'s."""
    import edgeflow.transport as tp

    if kind == "nats":
        _NATS_OPTIONS.update(nats_options)
        import edgeflow.transport.nats.link  # noqa: F401  (nats-py loaded before the memory baseline)

        tp.MqttTransport = _nats_transport  # type: ignore[attr-defined]
    elif kind == "none":
        tp.MqttTransport = _NoLink  # type: ignore[attr-defined]
    else:
        import edgeflow.transport.mqtt  # noqa: F401  (paho loaded before the memory baseline)


class _ReadyWithMemory:
    """round_scaling's ``ready`` queue, with this process's RSS before and after connecting added."""

    def __init__(self, queue: Any, base: dict[str, int]) -> None:
        self.queue, self.base = queue, base

    def put(self, msg: dict[str, Any]) -> None:
        msg.update(_settle_subscriptions())
        st = rs._status()
        msg.update({"rss_base": self.base.get("VmRSS", 0), "rss_connected": st.get("VmRSS", 0),
                    "threads_connected": st.get("Threads", 0)})
        self.queue.put(msg)


def device_worker(kind: str, nats_options: dict[str, Any], ids: list[str], keys: dict[str, str], urls: dict[str, str], fleet_pub: str,
                  seed: int, ready: Any, stop: Any, out: Any) -> None:
    _use(kind, nats_options)
    # everything rs.device_worker imports and builds before its first device, so the baseline has it
    import numpy  # noqa: F401

    from edgeflow import zoo
    from edgeflow.codecs import decode_update, encode_update  # noqa: F401
    from edgeflow.gateway.rounds import model_weights
    from edgeflow.protocol.rounds import RoundAnnouncement  # noqa: F401
    from edgeflow.signing import KeyRing, PrivateKey, PublicKey, Signer  # noqa: F401

    model_weights(zoo.digits_mlp(seed=0))
    base = rs._status()
    rs.device_worker(ids, keys, urls, fleet_pub, seed, _ReadyWithMemory(ready, base), stop, out)


def gateway_worker(kind: str, nats_options: dict[str, Any], spec: dict[str, Any], out: Any) -> None:
    _use(kind, nats_options)
    rs.gateway_worker(spec, out)


# ---------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------


def start_server(kind: str, workdir: Path) -> Any:
    from edgeflow.transport.broker import MosquittoBroker, NatsServer

    if kind == "mqtt":
        return MosquittoBroker(persistence=True, max_queued_messages=1_000_000, max_inflight_messages=20,
                               workdir=tempfile.mkdtemp(prefix="mosq-", dir=workdir)).start()
    srv = NatsServer(workdir=tempfile.mkdtemp(prefix="nats-", dir=workdir)).start()
    # the edgeflow streams exist before anything is timed (the first transport creates them)
    transport_from_url(srv.url, client_id="bench-setup").connect(10).close()
    return srv


def server_pid(srv: Any) -> int:
    pid = getattr(srv, "pid", None)
    return int(pid if pid is not None else srv._state["proc"].pid)  # NatsServer keeps its Popen there


def messages_per_s(url: str, n: int, size: int = 1024) -> float:
    sub = transport_from_url(url, client_id=f"bench-sub-{time.monotonic_ns()}").connect(10)
    pub = transport_from_url(url, client_id=f"bench-pub-{time.monotonic_ns()}").connect(10)
    done = threading.Event()
    count = [0]

    def handler(_msg: Any) -> None:
        count[0] += 1
        if count[0] >= n:
            done.set()

    topic = f"bench/{time.monotonic_ns()}/m"
    sub.subscribe(topic, handler)
    payload = os.urandom(size)
    start = time.perf_counter()
    for _ in range(n):
        pub.publish(topic, payload, qos=1)
    if not done.wait(120):
        raise SystemExit(f"{url}: only {count[0]} of {n} messages arrived within 120 s")
    elapsed = time.perf_counter() - start
    pub.close()
    sub.close()
    return n / elapsed


# ---------------------------------------------------------------------------
# One fleet
# ---------------------------------------------------------------------------


def fleet(kind: str, n: int, *, rounds: int, procs: int, messages: int, workdir: Path, codec: str = "int8",
          nats_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start ``kind``'s server, connect ``n`` devices, run ``rounds`` rounds; the figures of the docstring.
    ``kind`` "none": the devices alone with a transport that never connects (memory control, no rounds).
    A fleet where a device's subscription was not made runs no round (its gateway would wait for that
    device until the round's 600 s deadline): ``failed`` says so."""
    opts = dict(nats_options or {})
    from edgeflow.signing import PrivateKey

    row: dict[str, Any] = {"kind": kind, "devices": n, "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    if messages and kind != "none":
        srv = start_server(kind, workdir)
        try:
            row["msgs_per_s"] = round(messages_per_s(srv.url, messages), 1)
        finally:
            srv.stop()
    ctx = mp.get_context("spawn")
    ids = [f"sim-{i:04d}" for i in range(n)]
    priv = {d: PrivateKey.generate() for d in ids}
    fk = PrivateKey.generate()
    srv = start_server(kind, workdir) if kind != "none" else None
    url = srv.url if srv is not None else "mqtt://127.0.0.1:9"
    spid = server_pid(srv) if srv is not None else None
    spec = {"fleet_key": fk.raw().hex(), "public_keys": {d: rs._pub_hex(k.public_key) for d, k in priv.items()},
            "codec": codec, "rounds": rounds, "url": url,
            "state_dir": tempfile.mkdtemp(prefix=f"{kind}-{n}-", dir=workdir)}
    ready, dev_out, gw_out, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [ids[i::procs] for i in range(procs) if ids[i::procs]]
    workers = [ctx.Process(target=functools.partial(device_worker, kind, opts),
                           args=(s, {d: priv[d].raw().hex() for d in s}, {d: url for d in s},
                                 rs._pub_hex(fk.public_key), 1000 * i, ready, stop, dev_out))
               for i, s in enumerate(shares)]
    try:
        srv_base = rs._status(spid) if spid else {}
        t0 = time.monotonic()
        for w in workers:
            w.start()
        readies = [ready.get(timeout=900) for _ in workers]
        row["connect_s"] = round(time.monotonic() - t0, 2)
        row["connected"] = sum(r["connected"] for r in readies)
        client_kb = sum(r["rss_connected"] - r["rss_base"] for r in readies) / 1024
        row["client_kb_per_conn"] = round(client_kb / max(1, row["connected"]), 2)
        row["client_threads"] = sum(r["threads_connected"] for r in readies)
        row["subscribe_failed"] = sum(r["subscribe_failed"] for r in readies)
        row["subscribe_unsettled"] = sum(r["unsettled"] for r in readies)
        for key in ("subscribe_timeouts", "subscribe_retried", "devices_retried"):
            row[key] = sum(r.get(key, 0) for r in readies)
        if row["subscribe_failed"] or row["subscribe_unsettled"]:
            row["failed"] = (f"{row['subscribe_failed']} of {n} devices had a subscription refused "
                             f"({row['subscribe_unsettled']} still not made after 300 s); no round run")
        if srv is not None and "failed" not in row:
            idle = rs._status(spid)
            row["server_rss_base_mb"] = round(srv_base.get("VmRSS", 0) / 2**20, 2)
            row["server_rss_connected_mb"] = round(idle.get("VmRSS", 0) / 2**20, 2)
            row["server_kb_per_conn"] = round((idle.get("VmRSS", 0) - srv_base.get("VmRSS", 0)) / 1024 / n, 2)
            s_cpu0 = rs._cpu_s(spid)
            gw = ctx.Process(target=functools.partial(gateway_worker, kind, opts), args=(spec, gw_out))
            t1 = time.monotonic()
            gw.start()
            g = gw_out.get(timeout=3600)
            gw.join(60)
            row["gateway_wall_s"] = round(time.monotonic() - t1, 2)
            after = rs._status(spid)
            row.update({
                "round_s": [round(r["round_s"], 4) for r in g["rounds"]],
                "participants": [r["participants"] for r in g["rounds"]],
                "gateway_cpu_s": round(g["cpu_s"], 3),
                "server_peak_mb": round(after.get("VmHWM", 0) / 2**20, 2),
                "server_cpu_s": round(rs._cpu_s(spid) - s_cpu0, 3),
            })
        stop.set()
        devs = [dev_out.get(timeout=300) for _ in workers]
        row["updates_sent"] = sum(d["sent"] for d in devs)
        row["models_received"] = sum(d["models"] for d in devs)
        row["device_cpu_s"] = round(sum(d["cpu_s"] for d in devs), 2)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
            if w.is_alive():
                w.kill()
        if srv is not None:
            srv.stop()
    row["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return row


def summarize(rows: list[dict[str, Any]], control: dict[str, Any] | None) -> dict[str, Any]:
    """Per transport: medians over its fleets that ran (round_s over all their rounds); NATS/MQTT ratios."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind and "failed" not in r]
        s: dict[str, Any] = {"fleets": len(mine), "failed_fleets": sum(r["kind"] == kind and "failed" in r
                                                                       for r in rows)}
        rounds = [x for r in mine for x in r["round_s"]]
        s["every_device_every_round"] = bool(mine) and s["failed_fleets"] == 0 and all(
            p == r["devices"] for r in mine for p in r["participants"])
        s["updates_sent"] = sum(r.get("updates_sent", 0) for r in mine)
        s["updates_expected"] = sum(r["devices"] * len(r["round_s"]) for r in mine)
        s["subscribe_timeouts"] = sum(r.get("subscribe_timeouts", 0) for r in rows if r["kind"] == kind)
        s["devices_retried"] = sum(r.get("devices_retried", 0) for r in rows if r["kind"] == kind)
        if rounds:
            s.update({
                "rounds": len(rounds),
                "round_s_median": statistics.median(rounds), "round_s_mean": statistics.mean(rounds),
                "connect_s": statistics.median(r["connect_s"] for r in mine),
                "server_kb_per_conn": statistics.median(r["server_kb_per_conn"] for r in mine),
                "server_rss_connected_mb": statistics.median(r["server_rss_connected_mb"] for r in mine),
                "server_peak_mb": statistics.median(r["server_peak_mb"] for r in mine),
                "client_kb_per_conn": statistics.median(r["client_kb_per_conn"] for r in mine),
                "gateway_cpu_s_per_round": statistics.median(r["gateway_cpu_s"] / len(r["round_s"]) for r in mine),
                "server_cpu_s_per_round": statistics.median(r["server_cpu_s"] / len(r["round_s"]) for r in mine)})
            if control is not None:
                s["transport_kb_per_conn"] = s["client_kb_per_conn"] - control["client_kb_per_conn"]
        if mine and all("msgs_per_s" in r for r in mine):
            s["msgs_per_s"] = statistics.median(r["msgs_per_s"] for r in mine)
        out[kind] = s
    counts = ("fleets", "failed_fleets", "rounds", "every_device_every_round", "updates_sent", "updates_expected",
              "subscribe_timeouts", "devices_retried")
    out["nats_over_mqtt"] = {k: out["nats"][k] / out["mqtt"][k] for k in out["mqtt"]
                             if k in out["nats"] and out["mqtt"][k] and k not in counts}
    return out


ROWS = (("round_s_median", "round s (median of all rounds)", ".3f"),
        ("round_s_mean", "round s (mean)", ".3f"),
        ("msgs_per_s", "QoS 1 messages/s (1 KiB, 1 pub -> 1 sub)", ",.0f"),
        ("connect_s", "fleet connect s", ".2f"),
        ("server_kb_per_conn", "server KB per connection", ".1f"),
        ("server_rss_connected_mb", "server RSS, all connected (MB)", ".1f"),
        ("server_peak_mb", "server peak RSS after the rounds (MB)", ".1f"),
        ("client_kb_per_conn", "device-process KB per connection", ".1f"),
        ("transport_kb_per_conn", "  of which the transport (minus control)", ".1f"),
        ("gateway_cpu_s_per_round", "gateway CPU s per round", ".3f"),
        ("server_cpu_s_per_round", "server CPU s per round", ".3f"))


def table(n: int, summary: dict[str, Any], control: dict[str, Any] | None) -> list[str]:
    lines = [f"| {n} devices | {LABEL['mqtt']} | {LABEL['nats']} | NATS/MQTT |", "|---|---:|---:|---:|"]
    for key, name, fmt in ROWS:
        vals = [f"{summary[k][key]:{fmt}}" if key in summary[k] else "-" for k in KINDS]
        if vals == ["-", "-"]:
            continue
        ratio = summary["nats_over_mqtt"].get(key)
        r = f"{ratio:.2f}" if ratio is not None and math.isfinite(ratio) else "-"
        lines.append(f"| {name} | {vals[0]} | {vals[1]} | {r} |")
    lines.append(f"| fleets that ran / failed | {summary['mqtt']['fleets']} / {summary['mqtt']['failed_fleets']} | "
                 f"{summary['nats']['fleets']} / {summary['nats']['failed_fleets']} | |")
    yes = {True: "yes", False: "NO"}
    lines.append("| every device trained in every round; updates sent / devices x rounds | "
                 + " | ".join(f"{yes[summary[k]['every_device_every_round']]}; {summary[k]['updates_sent']:,} / "
                              f"{summary[k]['updates_expected']:,}" for k in KINDS) + " | |")
    lines.append(f"| NATS subscription setups timed out and retried (devices) | | "
                 f"{summary['nats']['subscribe_timeouts']} ({summary['nats']['devices_retried']}) | |")
    if control is not None:
        lines.append(f"(control, no connection: {control['client_kb_per_conn']:.1f} KB per device for the "
                     f"device's own state)")
    return lines


def run(devices: int, *, rounds: int, reps: int, procs: int, messages: int, control: bool,
        workdir: Path, nats_options: dict[str, Any] | None = None) -> dict[str, Any]:
    rows = []
    for kind in abba(reps):
        rows.append(fleet(kind, devices, rounds=rounds, procs=procs, messages=messages, workdir=workdir,
                          nats_options=nats_options))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    ctl = fleet("none", devices, rounds=rounds, procs=procs, messages=0, workdir=workdir) if control else None
    if ctl is not None:
        print(json.dumps(ctl), file=sys.stderr, flush=True)
    bad = [(r["kind"], r.get("failed") or r["participants"]) for r in rows
           if "failed" in r or any(p != devices for p in r["participants"]) or len(r["round_s"]) != rounds]
    return {"devices": devices, "rows": rows, "control": ctl, "summary": summarize(rows, ctl), "incomplete": bad}


def faults_on_nats(scenarios: list[str], devices: int, rounds: int, partition_s: float,
                   layers: tuple[int, ...]) -> list[dict[str, Any]]:
    """benchmarks/network_faults.py's scenarios with NATS as the broker and the transport."""
    import edgeflow.transport as transport_pkg
    import edgeflow.transport.broker as broker_mod
    from edgeflow.transport.broker import NatsServer
    from edgeflow.transport.nats import NatsTransport

    import network_faults

    def nats_transport(host: str, port: int, *, clean_start: bool = False, **kw: Any) -> NatsTransport:
        return NatsTransport(host, port, **kw)  # clean_start has no NATS meaning: resume is a stream replay

    class NatsInMosquittosPlace(NatsServer):
        def __init__(self, *, binary: str | None = None, persistence: bool = True, workdir: Any = None) -> None:
            super().__init__(workdir=workdir)

    saved = (transport_pkg.__dict__.get("MqttTransport"), broker_mod.MosquittoBroker)
    transport_pkg.MqttTransport = nats_transport  # type: ignore[attr-defined]
    broker_mod.MosquittoBroker = NatsInMosquittosPlace  # type: ignore[misc]
    rows = []
    try:
        for sc in scenarios:
            r = network_faults.run_scenario(sc, devices=devices, rounds=rounds, partition_s=partition_s, layers=layers)
            keys = ("scenario", "rounds_completed", "time_to_target_s", "total_s", "participants", "lost",
                    "counted_twice", "aggregate_max_abs_error", "device_resent_frames", "device_reconnects")
            print(json.dumps({k: r.get(k) for k in keys}), flush=True)
            rows.append(r)
    finally:
        if saved[0] is None:
            transport_pkg.__dict__.pop("MqttTransport", None)
        else:
            transport_pkg.MqttTransport = saved[0]  # type: ignore[attr-defined]
        broker_mod.MosquittoBroker = saved[1]  # type: ignore[misc]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[1000], help="fleet sizes, each its own ABBA run")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per fleet")
    ap.add_argument("--reps", type=int, default=2, help="fleets of each transport, in ABBA order")
    ap.add_argument("--messages", type=int, default=3000, help="QoS 1 messages for msgs/s per fleet (0: skip)")
    ap.add_argument("--device-procs", type=int, default=4, help="device processes for fleets over 200")
    ap.add_argument("--nats-ack-timeout", type=float, metavar="S",
                    help="NatsTransport's ack_timeout_s (its JetStream API timeout too) for every NATS connection; "
                         "default: the transport's own (5 s)")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="skip the no-connection memory control")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    ap.add_argument("--faults", nargs="+", metavar="SCENARIO",
                    help="run benchmarks/network_faults.py's scenarios on NATS instead (see the docstring)")
    ap.add_argument("--partition-s", type=float, default=30.0)
    ap.add_argument("--layers", default="64,64,32,10", help="--faults: the MLP (network_faults.py's default)")
    args = ap.parse_args(argv)
    for name in ("rounds", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if min(args.devices) < 1:
        ap.error("--devices must be at least 1")
    if args.faults:
        rows = faults_on_nats(args.faults, args.devices[0], args.rounds, args.partition_s,
                              tuple(int(x) for x in args.layers.split(",")))
        if args.json:
            args.json.write_text(json.dumps({"benchmark": "network_faults on NATS", "rows": rows}, indent=2, default=str))
        return 0

    if args.nats_ack_timeout is not None and args.nats_ack_timeout <= 0:
        ap.error("--nats-ack-timeout must be above 0")
    nats_options = {} if args.nats_ack_timeout is None else {"ack_timeout_s": args.nats_ack_timeout}
    nofile = rs._raise_nofile()
    load0 = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="edgeflow-transport-nats-") as tmp:
        for n in args.devices:
            procs = 1 if n <= 20 else min(args.device_procs, 2 if n <= 200 else args.device_procs)
            results.append(run(n, rounds=args.rounds, reps=args.reps, procs=procs, messages=args.messages,
                               control=args.control, workdir=Path(tmp), nats_options=nats_options))
    load1 = os.getloadavg()
    cpu = sorted(set(Path("/proc/cpuinfo").read_text().split()) & {"avx512_vnni", "amx_int8", "avx2"})
    out = {"benchmark": "transport_nats", "rounds": args.rounds, "nats_options": nats_options, "reps": args.reps, "messages": args.messages,
           "order": abba(args.reps), "cpu_count": os.cpu_count(), "cpu_flags": cpu, "nofile": nofile,
           "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in load1],
           "results": results}
    print(f"# NATS vs MQTT: round_scaling's round ({args.rounds} rounds per fleet, int8 updates), fleets in ABBA "
          f"order ({', '.join(out['order'])}), {os.cpu_count()} CPUs {cpu}, load average "
          f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end"
          + (f"; NatsTransport options {nats_options}" if nats_options else ""))
    for r in results:
        print()
        print("\n".join(table(r["devices"], r["summary"], r["control"])))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    bad = [(r["devices"], r["incomplete"]) for r in results if r["incomplete"]]
    if bad:
        print(f"error: rounds that did not collect every device: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
