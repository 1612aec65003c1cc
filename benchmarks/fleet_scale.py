"""Fleet scale benchmark: N simulated devices on one machine, real MQTT connections to Mosquitto
started with the generated fleet config (TLS listener, per-device passwords, ACL), each sending a
signed birth and then telemetry every second; the gateway's FleetManager keeps the registry in
SQLite (or ``--store`` PostgreSQL). Reports what the gateway handled (messages/s), the end-to-end telemetry lag (device
timestamp -> committed to SQLite) and the cost (threads, memory, CPU).

    python benchmarks/fleet_scale.py                       # 500 devices, 60 s, TLS
    python benchmarks/fleet_scale.py --devices 100 --seconds 20 --plain --json

Why this shape: a simulated device is what the fleet side of an agent costs on the wire — one
MqttTransport (2 threads) with a last will, a signed retained birth, QoS 1 telemetry — without
loading a model. 500 transports are 1,000 threads; they run in ``--workers`` processes so the
device side does not share one GIL with the gateway it is measuring.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def device_worker(ids: list[str], fleet_dir: str, url: str, start: Any, t0_value: Any, seconds: float,
                  interval: float, out: Any) -> None:
    """One process of simulated devices: connect all, then telemetry every ``interval`` from ``t0``."""
    import random

    from edgeflow.broker.mosquitto import FleetDir
    from edgeflow.device.credentials import DeviceCredentials
    from edgeflow.protocol.fleet import Birth, Death
    from edgeflow.transport.message import TlsConfig, Will
    from edgeflow.transport.mqtt import MqttTransport
    from edgeflow.transport.topics import device_topic

    fd = FleetDir(fleet_dir)
    fleet = fd.fleet
    devices = []
    started = time.monotonic()
    for d in ids:
        creds = DeviceCredentials.load(fd.device_dir(d))
        bdseq = int(time.time() * 1000)
        tls = TlsConfig(ca_file=str(creds.directory / "ca.crt")) if url.startswith("mqtts") else None
        t = MqttTransport.from_url(
            url, client_id=d, username=creds.username, password=creds.password, tls=tls, name=d,
            will=Will(device_topic(fleet, d, "death").value, Death(d, bdseq).sign(creds.key)), keepalive=30,
            connect_timeout_s=120, reconnect_min_s=0.5, reconnect_max_s=5,
        )
        birth = Birth(d, fleet, "raspberry-pi-4", bdseq, creds.key.public_key.hex, model_version=1,
                      telemetry_interval_s=interval, seq=1).sign(creds.key)
        topics = {ch: device_topic(fleet, d, ch).value for ch in ("birth", "death", "telemetry")}

        def on_conn(ev: Any, t: MqttTransport = t, birth: bytes = birth, topics: dict = topics) -> None:
            if ev.connected:
                t.publish(topics["death"], b"", retain=True)
                t.publish(topics["birth"], birth, retain=True)

        t.add_connection_listener(on_conn)
        t.connect(wait=False)
        devices.append((d, t, topics, bdseq))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all(t.is_connected for _, t, _, _ in devices):
        time.sleep(0.05)
    connected = sum(t.is_connected for _, t, _, _ in devices)
    connect_s = time.monotonic() - started
    out.put(("ready", os.getpid()))
    start.wait()
    t0 = t0_value.value
    while time.time() < t0:
        time.sleep(0.01)
    rng = random.Random(ids[0])
    phase = {d: rng.random() * interval for d, _, _, _ in devices}
    sent = errors = 0
    seq = {d: 0 for d, _, _, _ in devices}
    tick = 0
    end = t0 + seconds
    schedule = sorted(((t0 + phase[d], i) for i, (d, _, _, _) in enumerate(devices)))
    import heapq

    heapq.heapify(schedule)
    late = 0.0
    while schedule:
        due, i = heapq.heappop(schedule)
        if due >= end:
            continue
        now = time.time()
        if due > now:
            time.sleep(due - now)
        else:
            late = max(late, now - due)
        d, t, topics, bdseq = devices[i]
        seq[d] += 1
        body = {"device": d, "ts": time.time(), "seq": seq[d], "bdseq": bdseq, "model_version": 1,
                "inferences": 10, "latency_p50_ms": 1.2, "latency_p95_ms": 2.5, "rss_bytes": 50_000_000,
                "cpu_percent": 3.0, "queue_depth": 0, "battery": 0.9}
        try:
            t.publish(topics["telemetry"], json.dumps(body, separators=(",", ":")), qos=1)
            sent += 1
        except Exception:  # noqa: BLE001 - counted and reported
            errors += 1
        heapq.heappush(schedule, (due + interval, i))
        tick += 1
    for _, t, _, _ in devices:
        t.flush(5)
    stats = [t.stats() for _, t, _, _ in devices]
    out.put({
        "pid": os.getpid(), "devices": len(devices), "connected": connected, "connect_s": connect_s, "sent": sent,
        "errors": errors, "threads": threading.active_count(), "rss_bytes": _rss(os.getpid()),
        "max_schedule_lag_s": late, "resent_frames": sum(s.get("resent_frames", 0) for s in stats),
        "reconnects": sum(s.get("reconnects", 0) for s in stats),
        "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime,
    })
    for _, t, _, _ in devices:
        t.close(timeout=1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=1.0, help="telemetry interval per device (s)")
    ap.add_argument("--workers", type=int, default=4, help="device processes")
    ap.add_argument("--plain", action="store_true", help="use the loopback plain listener instead of TLS")
    ap.add_argument("--dir", help="work directory (default: a temp dir)")
    ap.add_argument("--store", default=None, help="gateway state URL (default: SQLite in the work dir), e.g. "
                    "postgresql://postgres@127.0.0.1:5432/test")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from edgeflow.broker.mosquitto import FleetDir, ListenerSettings
    from edgeflow.gateway.fleet import FleetManager, FleetOptions
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.transport.broker import find_mosquitto, free_port, wait_for_port
    from edgeflow.transport.message import TlsConfig
    from edgeflow.transport.mqtt import MqttTransport

    root = Path(args.dir or tempfile.mkdtemp(prefix="edgeflow-fleet-scale-"))
    if not args.dir:
        os.chmod(root, 0o711)  # the broker (user mosquitto when run as root) must be able to enter it
    t_setup = time.monotonic()
    fd = FleetDir(root / "fleet").init("scale")
    ids = [f"sim-{i:04d}" for i in range(args.devices)]
    for d in ids:
        if not (fd.device_dir(d) / "device.json").exists():
            fd.provision(d, profile="raspberry-pi-4")
    port, plain = free_port(), free_port()
    files = fd.write_broker_config(ListenerSettings(host="127.0.0.1", port=port, plain_port=plain),
                                   tls_hosts=["localhost", "127.0.0.1"])
    broker = subprocess.Popen([find_mosquitto() or "mosquitto", "-c", str(files.config)],
                              stdout=open(root / "mosquitto.out", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        if not wait_for_port("127.0.0.1", port, 10):
            print((root / "mosquitto.out").read_text(), file=sys.stderr)
            return 1
        url = f"mqtt://127.0.0.1:{plain}" if args.plain else f"mqtts://127.0.0.1:{port}"
        op = fd.operator("gateway")
        gt = MqttTransport.from_url(url, client_id="gateway", username="gateway", password=op["password"],
                                    tls=None if args.plain else TlsConfig(ca_file=str(fd.ca_file())),
                                    max_pending_messages=100_000)
        store_url = args.store
        if store_url and store_url.startswith("postgres"):
            store_url = f"{store_url}{'&' if '?' in store_url else '?'}schema=ef_fleet_{os.getpid()}"
        store = GatewayStore(store_url or (root / "gateway.db"))
        fm = FleetManager(gt, store, "scale", fd.fleet_key(),
                          FleetOptions(lag_window=2_000_000, heartbeat_min_s=10), keyring=fd.keyring())
        fm.start()
        gt.connect()
        setup_s = time.monotonic() - t_setup

        ctx = mp.get_context("spawn")
        out, start, t0_value = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
        shares = [ids[i::args.workers] for i in range(args.workers)]
        procs = [ctx.Process(target=device_worker,
                             args=(s, str(fd.path), url, start, t0_value, args.seconds, args.interval, out))
                 for s in shares if s]
        cpu_broker0 = _cpu_seconds(broker.pid)
        t_connect = time.monotonic()
        for p in procs:
            p.start()
        for _ in procs:  # every worker connected all its devices
            out.get(timeout=600)
        births_deadline = time.monotonic() + 60
        while fm.stats().get("births", 0) < args.devices and time.monotonic() < births_deadline:
            time.sleep(0.1)
        births_at = fm.stats().get("births", 0)
        fleet_up_s = time.monotonic() - t_connect
        t0 = time.time() + 1.0
        t0_value.value = t0
        start.set()
        while time.time() < t0:
            time.sleep(0.05)
        fm.reset_lag()
        s0 = fm.stats()
        cpu_gw0 = resource.getrusage(resource.RUSAGE_SELF)
        cpu_b0 = _cpu_seconds(broker.pid)
        peak_backlog = 0
        threads_gw = threading.active_count()
        while time.time() < t0 + args.seconds:
            time.sleep(0.5)
            peak_backlog = max(peak_backlog, fm.stats().get("telemetry_backlog", 0))
        # let the tail arrive and commit
        tail_deadline = time.time() + 10
        while time.time() < tail_deadline:
            st = fm.stats()
            if st.get("telemetry_backlog", 0) == 0 and st.get("telemetry_stored", 0) >= st.get("telemetry", 0):
                time.sleep(0.5)
                break
            time.sleep(0.1)
        s1 = fm.stats()
        cpu_gw1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu_b1 = _cpu_seconds(broker.pid)
        workers = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        sent = sum(w["sent"] for w in workers)
        received = s1.get("telemetry", 0) - s0.get("telemetry", 0)
        stored = s1.get("telemetry_stored", 0) - s0.get("telemetry_stored", 0)
        lag = s1.get("telemetry_lag_ms", {})
        gw_cpu = (cpu_gw1.ru_utime + cpu_gw1.ru_stime) - (cpu_gw0.ru_utime + cpu_gw0.ru_stime)
        rows = store.telemetry_count()
        result = {
            "devices": args.devices, "seconds": args.seconds, "interval_s": args.interval,
            "transport": "mqtt (plain loopback)" if args.plain else "mqtts (TLS)", "workers": len(procs),
            "setup_s": round(setup_s, 1), "fleet_up_s": round(fleet_up_s, 1),
            "connected": sum(w["connected"] for w in workers), "connect_s_max": round(max(w["connect_s"] for w in workers), 1),
            "births_registered": births_at, "online_at_end": s1.get("online"),
            "telemetry_sent": sent, "telemetry_received": received, "telemetry_stored": stored,
            "telemetry_lost": sent - received, "messages_per_s": round(received / args.seconds, 1),
            "stored_per_s": round(stored / args.seconds, 1),
            "lag_ms_p50": round(lag.get("p50", float("nan")), 1), "lag_ms_p95": round(lag.get("p95", float("nan")), 1),
            "lag_ms_max": round(lag.get("max", float("nan")), 1), "lag_samples": lag.get("n", 0),
            "gateway_peak_backlog": peak_backlog, "gaps": s1.get("telemetry_gaps", 0) - s0.get("telemetry_gaps", 0),
            "telemetry_rows_in_store": rows, "telemetry_rows_in_sqlite": rows,
            "gateway_cpu_percent": round(100 * gw_cpu / args.seconds, 1),
            "broker_cpu_percent": round(100 * (cpu_b1 - cpu_b0) / args.seconds, 1),
            "broker_rss_mb": round(_rss(broker.pid) / 2**20, 1),
            "gateway_rss_mb": round(_rss(os.getpid()) / 2**20, 1), "gateway_threads": threads_gw,
            "device_threads": sum(w["threads"] for w in workers),
            "device_rss_mb_total": round(sum(w["rss_bytes"] for w in workers) / 2**20, 1),
            "device_cpu_s_total": round(sum(w["cpu_s"] for w in workers), 1),
            "device_schedule_lag_s_max": round(max(w["max_schedule_lag_s"] for w in workers), 3),
            "reconnects": sum(w["reconnects"] for w in workers), "resent_frames": sum(w["resent_frames"] for w in workers),
            "cpus": os.cpu_count(), "broker_cpu_total_s": round(cpu_b1 - cpu_broker0, 1),
        }
        result["store"] = store.engine
        fm.stop()
        gt.close(timeout=2)
        if store.engine == "postgresql":
            store.drop_schema()
        store.close()
    finally:
        broker.terminate()
        try:
            broker.wait(10)
        except subprocess.TimeoutExpired:
            broker.kill()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        r = result
        print(f"{r['devices']} devices over {r['transport']}, telemetry every {r['interval_s']} s for {r['seconds']} s "
              f"({r['cpus']} CPUs, {r['workers']} device processes)")
        print(f"  connected {r['connected']}/{r['devices']}; all births registered {r['fleet_up_s']} s after the "
              f"device processes started ({r['births_registered']} births); online at end {r['online_at_end']}")
        print(f"  telemetry sent {r['telemetry_sent']}, received {r['telemetry_received']}, stored {r['telemetry_stored']}"
              f" -> {r['messages_per_s']} msg/s handled ({r['stored_per_s']} stored/s), lost {r['telemetry_lost']}")
        print(f"  end-to-end lag (device ts -> SQLite commit): p50 {r['lag_ms_p50']} ms, p95 {r['lag_ms_p95']} ms, "
              f"max {r['lag_ms_max']} ms; peak writer backlog {r['gateway_peak_backlog']}")
        print(f"  CPU: gateway {r['gateway_cpu_percent']}% of a core, broker {r['broker_cpu_percent']}%; "
              f"RSS: broker {r['broker_rss_mb']} MB, gateway {r['gateway_rss_mb']} MB, devices "
              f"{r['device_rss_mb_total']} MB total; threads: devices {r['device_threads']}, gateway {r['gateway_threads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
