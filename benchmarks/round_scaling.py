"""Federated round time and gateway memory vs device count, measured end to end over Mosquitto.

    python benchmarks/round_scaling.py                     # 10, 100, 1000 devices; hierarchy; ingest workers
    python benchmarks/round_scaling.py --devices 10 100 --rounds 2 --json out.json

What one round is here: the real gateway (:class:`~edgeflow.gateway.rounds.RoundManager`, SQLite
state on disk, its own process) selects every device, announces the round (signed, retained),
collects one signed update per device over real MQTT connections, verifies, stores, decodes and
folds each one, aggregates and publishes the new global model (retained, every device receives
and verifies it). ``round_s`` is the gateway's own measure (announce -> new model acknowledged by
the broker); gateway memory is its process's peak RSS (VmHWM) above its RSS before connecting.

The devices are real MQTT clients, lightened: each is one
:class:`~edgeflow.transport.MqttTransport` (its own TCP connection, session and two threads)
that verifies the global model and the announcement and answers with a signed, codec-encoded
update - but its "training" is a fixed random delta, so the curve shows the federation's cost
(broker fan-out, gateway ingest, aggregation), not N times a local training step (that is
benchmarks/training.py per device, and runs in parallel on real devices). 1,000 devices are
2,000 threads; they run in ``--device-procs`` processes so the device side does not share one
GIL with the gateway it is measuring. On a 2-core machine the devices, the broker and the
gateway compete for the same cores: the figures are an upper bound for the gateway alone.

Also measured: the same round with two site gateways under a root, through two bridged site
brokers (``--hier N``), against the flat round at N; and the ingestion throughput of 1 vs 2
ingestion workers sharing the update stream (``--ingest N``; each worker's share is queued in
its persistent session first, then drained: updates/s from the first stored update to the last).
"""

from __future__ import annotations

import argparse
import hashlib
import dataclasses
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

FLEET = "scale"


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 16
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "Threads"):
                out[k] = int(v.split()[0]) * (1024 if k != "Threads" else 1)
    except OSError:
        pass
    return out


def _cpu_s(pid: int | str = "self") -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# ---------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------


class LightDevice:
    """One simulated device: a real MQTT connection, signature checks, a fixed delta."""

    def __init__(self, transport: Any, device_id: str, signer: Any, fleet_key: Any, delta: dict, n: int) -> None:
        from edgeflow.signing import KeyRing

        self.t, self.device_id, self.signer = transport, device_id, signer
        self.fleet_key = fleet_key
        self.keyring = KeyRing({"gateway": fleet_key})
        self.delta, self.n = delta, n
        self.version = -1
        self.pending = None
        self.done: set[int] = set()
        self.sent = self.bytes_sent = self.models = 0
        self.seq = time.time_ns() // 1000

    def start(self) -> None:
        self.t.subscribe(f"edgeflow/{FLEET}/gateway/model", self.on_model)
        self.t.subscribe(f"edgeflow/{FLEET}/gateway/round", self.on_round)

    def on_model(self, msg: Any) -> None:
        from edgeflow.codecs import decode_update

        upd = decode_update(msg.payload, verifier=self.keyring, require_signature=True)
        self.version = max(self.version, int(upd.metadata.get("model_version", upd.round_id)))
        self.models += 1
        if self.pending is not None and self.version >= self.pending.model_version:
            ann, self.pending = self.pending, None
            self.send(ann)

    def on_round(self, msg: Any) -> None:
        from edgeflow.protocol.rounds import RoundAnnouncement

        if not msg.payload:
            return
        ann = RoundAnnouncement.verify(msg.payload, self.fleet_key)
        if ann.state != "open" or ann.round_id in self.done or self.device_id not in ann.selected:
            return
        if self.version >= ann.model_version:
            self.send(ann)
        else:
            self.pending = ann

    def send(self, ann: Any) -> None:
        from edgeflow.codecs import encode_update

        self.done.add(ann.round_id)
        self.seq += 1
        payload = encode_update(self.delta, ann.config.codec, round_id=ann.round_id, device_id=self.device_id,
                                seq=self.seq, signer=self.signer, num_samples=self.n,
                                metadata={"base_version": ann.model_version, "loss": 0.0}, **ann.config.codec_opts)
        self.t.publish(f"edgeflow/{FLEET}/{self.device_id}/update", payload, qos=1)
        self.sent += 1
        self.bytes_sent += len(payload)


def device_worker(ids: list[str], keys: dict[str, str], urls: dict[str, str], fleet_pub: str, seed: int,
                  ready: Any, stop: Any, out: Any) -> None:
    """Host ``ids`` as LightDevices, each on the broker ``urls[id]``; report when all are connected."""
    _raise_nofile()
    import numpy as np

    from edgeflow import zoo
    from edgeflow.gateway.rounds import model_weights
    from edgeflow.signing import PrivateKey, PublicKey, Signer
    from edgeflow.transport import MqttTransport

    shapes = {k: v.shape for k, v in model_weights(zoo.digits_mlp(seed=0)).items()}
    fk = PublicKey.from_hex(fleet_pub)
    devs = []
    t0 = time.monotonic()
    for i, did in enumerate(ids):
        rng = np.random.default_rng(seed + i)
        delta = {k: (rng.standard_normal(s) * 0.01).astype(np.float32) for k, s in shapes.items()}
        host, port = urls[did].rsplit("://", 1)[1].split(":")
        t = MqttTransport(host, int(port), client_id=f"{FLEET}-{did}", clean_start=True, session_expiry_s=0,
                          keepalive=120, connect_timeout_s=60, reconnect_min_s=0.5, reconnect_max_s=5)
        d = LightDevice(t, did, Signer(did, PrivateKey.from_bytes(bytes.fromhex(keys[did]))), fk, delta,
                        int(rng.integers(10, 60)))
        d.start()
        t.connect(wait=False)
        devs.append(d)
    end = time.monotonic() + 600
    while time.monotonic() < end and not all(d.t.is_connected for d in devs):
        time.sleep(0.05)
    ready.put({"pid": os.getpid(), "connected": sum(d.t.is_connected for d in devs),
               "connect_s": round(time.monotonic() - t0, 2)})
    stop.wait()
    st = _status()
    out.put({"sent": sum(d.sent for d in devs), "models": sum(d.models for d in devs),
             "bytes_sent": sum(d.bytes_sent for d in devs), "rss": st.get("VmRSS", 0),
             "threads": st.get("Threads", 0), "cpu_s": _cpu_s()})
    for d in devs:
        d.t.close(timeout=0.2, flush=False)


# ---------------------------------------------------------------------------
# The gateway
# ---------------------------------------------------------------------------


def gateway_worker(spec: dict[str, Any], out: Any) -> None:
    """One flat gateway (or, with spec["sites"], two site gateways and a root) running rounds."""
    _raise_nofile()
    from edgeflow import zoo
    from edgeflow.protocol.rounds import TrainConfig
    from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.signing import KeyRing, PrivateKey
    from edgeflow.transport import MqttTransport

    model = zoo.digits_mlp(seed=0)
    fk = PrivateKey.from_bytes(bytes.fromhex(spec["fleet_key"]))
    ring = KeyRing({d: k for d, k in spec["public_keys"].items()})
    train = TrainConfig(codec=spec["codec"], codec_opts=spec.get("codec_opts", {}))
    state = Path(spec["state_dir"])
    n = len(spec["public_keys"])

    def transport(url: str, cid: str) -> MqttTransport:
        host, port = url.rsplit("://", 1)[1].split(":")
        return MqttTransport(host, int(port), client_id=cid, clean_start=True, max_pending_messages=100_000,
                             connect_timeout_s=60)

    if not spec.get("sites"):
        gt = transport(spec["url"], f"{FLEET}-gateway")
        rm = RoundManager(gt, GatewayStore(state / "gateway.sqlite"), fleet=FLEET, fleet_key=fk, keyring=ring,
                          model=model, config=RoundConfig(rounds=spec["rounds"], min_clients=n, quorum=1.0,
                                                          deadline_s=600, train=train, wait_for_devices_s=1),
                          candidates=lambda: [Candidate(d) for d in ring.devices()])
        base = _status()
        cpu0 = _cpu_s()
        rm.start()
        gt.connect(timeout=60)
        history = rm.run()
        st = _status()
        out.put({"rounds": [m.to_dict() for m in history], "rss_base": base.get("VmRSS", 0),
                 "rss_peak": st.get("VmHWM", 0), "threads": st.get("Threads", 0), "cpu_s": _cpu_s() - cpu0})
        gt.close(timeout=2)
        return

    from edgeflow.gateway.hierarchy import SiteGateway, Uplink, root_manager, site_manager
    from edgeflow.signing import Signer

    sites = []
    for site_id, site in spec["sites"].items():
        st = transport(site["url"], f"{FLEET}-{site_id}-gateway")
        sring = KeyRing({d: spec["public_keys"][d] for d in site["devices"]})
        rm = site_manager(st, GatewayStore(state / f"{site_id}.sqlite"), fleet=FLEET, fleet_key=fk, keyring=sring,
                          model=model, config=RoundConfig(min_clients=len(site["devices"]), quorum=1.0,
                                                          deadline_s=600, wait_for_devices_s=1),
                          candidates=lambda r=sring: [Candidate(d) for d in r.devices()],
                          uplink=Uplink(st, FLEET), signer=Signer(site_id, PrivateKey.from_bytes(bytes.fromhex(site["key"]))))
        sites.append(SiteGateway(rm, Uplink(st, FLEET), site_id=site_id, root_key=fk.public_key, forward_margin_s=5))
    rt = transport(spec["url"], f"{FLEET}-root")
    site_keys = KeyRing({s: Signer(s, PrivateKey.from_bytes(bytes.fromhex(v["key"]))).public_key
                         for s, v in spec["sites"].items()})
    root = root_manager(rt, GatewayStore(state / "root.sqlite"), fleet=FLEET, fleet_key=fk, site_keys=site_keys,
                        model=model, sites=list(spec["sites"]),
                        config=RoundConfig(rounds=spec["rounds"], min_clients=len(sites), quorum=1.0,
                                           deadline_s=600, train=train, wait_for_devices_s=1))
    base = _status()
    threads = []
    for s in sites:
        s.start()
        s.rounds.transport.connect(timeout=60)
        threads.append(threading.Thread(target=s.run, daemon=True))
        threads[-1].start()
    root.start()
    rt.connect(timeout=60)
    time.sleep(1.0)  # the site gateways have the root's retained model before round 1
    history = root.run()
    st = _status()
    out.put({"rounds": [m.to_dict() for m in history], "rss_base": base.get("VmRSS", 0),
             "rss_peak": st.get("VmHWM", 0), "threads": st.get("Threads", 0), "cpu_s": _cpu_s()})
    for s in sites:
        s.stop()


# ---------------------------------------------------------------------------
# One measurement
# ---------------------------------------------------------------------------


def _pub_hex(pk: Any) -> str:
    return pk.hex() if callable(getattr(pk, "hex", None)) else pk.hex


def measure(n: int, *, rounds: int, codec: str, procs: int, hier: bool = False, workdir: Path) -> dict[str, Any]:
    from edgeflow.broker.bridge import BridgeSpec, render_bridge
    from edgeflow.signing import PrivateKey
    from edgeflow.transport.broker import MosquittoBroker

    ctx = mp.get_context("spawn")
    ids = [f"sim-{i:04d}" for i in range(n)]
    priv = {d: PrivateKey.generate() for d in ids}
    keys = {d: k.raw().hex() for d, k in priv.items()}
    pubs = {d: _pub_hex(k.public_key) for d, k in priv.items()}
    fk = PrivateKey.generate()
    brokers = []
    common = {"max_queued_messages": 100_000, "max_inflight_messages": 20}
    central = MosquittoBroker(**common).start()
    brokers.append(central)
    spec: dict[str, Any] = {"fleet_key": fk.raw().hex(), "public_keys": pubs, "codec": codec, "rounds": rounds,
                            "url": central.url}
    urls = {d: central.url for d in ids}
    if hier:
        spec["sites"] = {}
        for k, site_id in enumerate(("site-a", "site-b")):
            sb = MosquittoBroker(extra_config=render_bridge(BridgeSpec(FLEET, site_id, "127.0.0.1", central.port,
                                                                       restart_timeout=(1, 2))), **common).start()
            brokers.append(sb)
            members = ids[k::2]
            spec["sites"][site_id] = {"url": sb.url, "devices": members, "key": PrivateKey.generate().raw().hex()}
            urls.update({d: sb.url for d in members})
        time.sleep(1.5)  # bridges connected
    state = Path(tempfile.mkdtemp(prefix=f"rounds-{n}-", dir=workdir))
    spec["state_dir"] = str(state)
    ready, out, gw_out, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [ids[i::procs] for i in range(procs) if ids[i::procs]]
    workers = [ctx.Process(target=device_worker, args=(s, {d: keys[d] for d in s}, {d: urls[d] for d in s},
                                                      _pub_hex(fk.public_key), 1000 * i, ready, stop, out))
               for i, s in enumerate(shares)]
    t0 = time.monotonic()
    result: dict[str, Any] = {"devices": n, "mode": "hierarchical (2 sites, bridged)" if hier else "flat",
                              "codec": codec, "device_procs": len(workers)}
    try:
        for w in workers:
            w.start()
        readies = [ready.get(timeout=900) for _ in workers]
        result["connect_s"] = round(time.monotonic() - t0, 1)
        result["connected"] = sum(r["connected"] for r in readies)
        b_cpu0 = sum(_cpu_s(b.pid) for b in brokers)
        gw = ctx.Process(target=gateway_worker, args=(spec, gw_out))
        t1 = time.monotonic()
        gw.start()
        g = gw_out.get(timeout=1800)
        gw.join(60)
        result["gateway_wall_s"] = round(time.monotonic() - t1, 1)
        stop.set()
        devs = [out.get(timeout=120) for _ in workers]
        for w in workers:
            w.join(60)
        rs = [r["round_s"] for r in g["rounds"]]
        result.update({
            "rounds": len(rs), "participants": [r["participants"] for r in g["rounds"]],
            "round_s": [round(x, 3) for x in rs], "round_s_median": round(statistics.median(rs), 3),
            "aggregation_s_median": round(statistics.median(r["aggregation_s"] for r in g["rounds"]), 4),
            "bytes_in_per_round": g["rounds"][0]["bytes_in"],
            "gateway_rss_base_mb": round(g["rss_base"] / 2**20, 1), "gateway_rss_peak_mb": round(g["rss_peak"] / 2**20, 1),
            "gateway_mem_mb": round((g["rss_peak"] - g["rss_base"]) / 2**20, 1),
            "gateway_cpu_s": round(g["cpu_s"], 2), "gateway_threads": g["threads"],
            "broker_rss_mb": round(sum(_status(b.pid).get("VmHWM", 0) for b in brokers) / 2**20, 1),
            "broker_cpu_s": round(sum(_cpu_s(b.pid) for b in brokers) - b_cpu0, 2),
            "updates_sent": sum(d["sent"] for d in devs), "models_received": sum(d["models"] for d in devs),
            "device_threads": sum(d["threads"] for d in devs),
            "device_cpu_s": round(sum(d["cpu_s"] for d in devs), 2),
            "device_rss_mb": round(sum(d["rss"] for d in devs) / 2**20, 1),
        })
    finally:
        stop.set()
        for w in workers:
            if w.is_alive():
                w.join(10)
            if w.is_alive():
                w.kill()
        for b in brokers:
            b.stop()
    return result


def measure_ingest(n: int, workers: int, *, codec: str, workdir: Path, store_url: str | None = None) -> dict[str, Any]:
    """Ingestion workers draining ``n`` queued updates; updates/s between the first and last store.
    ``store_url``: the shared state on PostgreSQL (a fresh schema in it) instead of a SQLite file."""
    from edgeflow import zoo
    import numpy as np

    from edgeflow.codecs import encode_update
    from edgeflow.gateway.ingest import IngestPool, IngestStore, WorkerConfig
    from edgeflow.gateway.rounds import model_weights
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.signing import KeyRing, Signer
    from edgeflow.transport import MqttTransport
    from edgeflow.transport.broker import MosquittoBroker

    d = Path(tempfile.mkdtemp(prefix=f"ingest-{workers}-", dir=workdir))
    broker = MosquittoBroker(max_queued_messages=100_000).start()
    model = zoo.digits_mlp(seed=0)
    weights = model_weights(model)
    if store_url:
        state = f"{store_url}{'&' if '?' in store_url else '?'}schema=ef_ingest_{os.getpid()}_{workers}"
    else:
        state = d / "gw.sqlite"
    store = GatewayStore(state)
    blob = model.SerializeToString()
    store.add_model(blob, hashlib.sha256(blob).hexdigest())
    ring = KeyRing()
    rng = np.random.default_rng(0)
    payloads = []
    for i in range(n):
        s = Signer.generate(f"d{i:04d}")
        ring.register(s.device_id, s.public_key)
        delta = {k: (rng.standard_normal(v.shape) * 0.01).astype(np.float32) for k, v in weights.items()}
        payloads.append((s.device_id, encode_update(delta, codec, round_id=1, device_id=s.device_id, seq=1,
                                                    signer=s, num_samples=20, metadata={"base_version": 1})))
    ring.save(d / "ring.json")
    store.open_round(1, 1, time.time() + 3600, {}, ring.devices())
    base = WorkerConfig(name="w0", broker=broker.url, state=str(state), fleet=FLEET, keyring=str(d / "ring.json"),
                        log_level="WARNING")
    names = [f"w{i}" for i in range(workers)]
    try:
        pool = IngestPool(base, names, workdir=d, restart=False).start()
        assert pool.wait_ready(60), pool.logs()
        pool.stop()  # the sessions persist: the broker queues each member's share while it is away
        pub = MqttTransport.from_url(broker.url, client_id="pub", clean_start=True)
        pub.connect()
        for did, p in payloads:
            pub.publish(f"edgeflow/{FLEET}/{did}/update", p, qos=1)
        pub.flush(120)
        pub.close()
        db = IngestStore(state)
        go = dataclasses.replace(base, connect_at=time.time() + 3.0)  # all workers imported, then connect together
        pool = IngestPool(go, names, workdir=d, restart=False).start()
        end = time.time() + 600
        while len(db.reported(1)) < n and time.time() < end:
            time.sleep(0.1)
        got = len(db.reported(1))
        first, last = db.store._one("SELECT MIN(received), MAX(received) FROM round_updates WHERE round_id=1")
        pool.stop()
        db.close()
    finally:
        broker.stop()
        if store_url:
            store.drop_schema()
        store.close()
    span = max(1e-6, (last or 0) - (first or 0))
    return {"workers": workers, "updates": n, "stored": got, "span_s": round(span, 3),
            "updates_per_s": round(got / span, 1), "store": store.engine}


def measure_root_fold(sites: int = 100, params: int = 1_000_000) -> dict[str, Any]:
    """What a root does per round beyond a flat gateway: fold ``sites`` partial sums
    (FedAvg.add_partial) of a ``params``-parameter model, and finish. In process, no broker."""
    import numpy as np

    from edgeflow.gateway.strategies import FedAvg

    rng = np.random.default_rng(0)
    g = {"w": np.zeros(params, np.float32)}
    parts = [{"w": rng.standard_normal(params).astype(np.float32)} for _ in range(min(sites, 8))]
    agg = FedAvg()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        agg.begin_round(g, 1)
        for i in range(sites):
            agg.add_partial(parts[i % len(parts)], total_samples=1000, num_clients=1000, client_id=f"s{i}")
        agg.finish()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"sites": sites, "params": params, "fold_s": round(t, 4), "ms_per_partial": round(1e3 * t / sites, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--device-procs", type=int, default=4, help="device processes for the largest fleets")
    ap.add_argument("--hier", type=int, default=100, help="devices in the hierarchical comparison (0: skip)")
    ap.add_argument("--ingest", type=int, default=1000, help="updates in the ingestion-worker comparison (0: skip)")
    ap.add_argument("--ingest-pg", default=None, metavar="URL",
                    help="also run the ingestion comparison with the state on this PostgreSQL "
                         "(e.g. postgresql://postgres@127.0.0.1:5432/test)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    nofile = _raise_nofile()
    workdir = Path(tempfile.mkdtemp(prefix="edgeflow-round-scaling-"))
    rows = []
    for n in args.devices:
        procs = 1 if n <= 20 else min(args.device_procs, 2 if n <= 200 else args.device_procs)
        rows.append(measure(n, rounds=args.rounds, codec=args.codec, procs=procs, workdir=workdir))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    hier = None
    if args.hier:
        procs = 1 if args.hier <= 20 else 2
        flat = next((r for r in rows if r["devices"] == args.hier), None)
        if flat is None:
            flat = measure(args.hier, rounds=args.rounds, codec=args.codec, procs=procs, workdir=workdir)
        h = measure(args.hier, rounds=args.rounds, codec=args.codec, procs=procs, hier=True, workdir=workdir)
        print(json.dumps(h), file=sys.stderr, flush=True)
        hier = {"flat": flat, "hierarchical": h, "ratio": round(h["round_s_median"] / flat["round_s_median"], 2)}
    ingest = None
    if args.ingest:
        one = measure_ingest(args.ingest, 1, codec=args.codec, workdir=workdir)
        two = measure_ingest(args.ingest, 2, codec=args.codec, workdir=workdir)
        ingest = {"one": one, "two": two, "speedup": round(two["updates_per_s"] / one["updates_per_s"], 2)}
        if args.ingest_pg:
            pg1 = measure_ingest(args.ingest, 1, codec=args.codec, workdir=workdir, store_url=args.ingest_pg)
            pg2 = measure_ingest(args.ingest, 2, codec=args.codec, workdir=workdir, store_url=args.ingest_pg)
            ingest["postgresql"] = {"one": pg1, "two": pg2,
                                    "speedup": round(pg2["updates_per_s"] / pg1["updates_per_s"], 2)}
        print(json.dumps(ingest), file=sys.stderr, flush=True)
    root_fold = measure_root_fold()
    result = {"cpus": os.cpu_count(), "nofile": nofile, "rows": rows, "hier": hier, "ingest": ingest,
              "root_fold": root_fold}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"# round time and gateway memory vs devices ({args.codec} updates, {args.rounds} rounds each, "
          f"{os.cpu_count()} CPUs, devices + broker + gateway on this machine)")
    print("| devices | round s (median) | s per 1k updates | gateway CPU ms / update | gateway peak RSS MB "
          "| above base MB | broker RSS MB | broker CPU ms / update | device-side CPU s (all, whole run) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        per = r["rounds"] * r["devices"]
        print(f"| {r['devices']} | {r['round_s_median']:.2f} | {1000 * r['round_s_median'] / r['devices']:.2f} | "
              f"{1000 * r['gateway_cpu_s'] / per:.2f} | {r['gateway_rss_peak_mb']} | {r['gateway_mem_mb']} | "
              f"{r['broker_rss_mb']} | {1000 * r['broker_cpu_s'] / per:.2f} | {r['device_cpu_s']} |")
    if hier:
        print(f"hierarchical ({args.hier} devices, 2 bridged sites + root): {hier['hierarchical']['round_s_median']:.2f} s"
              f" vs flat {hier['flat']['round_s_median']:.2f} s ({hier['ratio']}x)")
    print(f"root: folding {root_fold['sites']} site partials of {root_fold['params']:,} parameters: "
          f"{root_fold['fold_s'] * 1e3:.0f} ms ({root_fold['ms_per_partial']} ms per partial)")
    if ingest:
        print(f"ingestion: 1 worker {ingest['one']['updates_per_s']} updates/s, 2 workers "
              f"{ingest['two']['updates_per_s']} updates/s ({ingest['speedup']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
