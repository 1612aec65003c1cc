"""Round time with and without the web view (dashboard + /metrics) at 1,000 devices, ratio in one run.

    python benchmarks/web_overhead.py                       # 1000 devices, 12 measured rounds
    python benchmarks/web_overhead.py --devices 100 --rounds 8 --json out.json

The round is benchmarks/round_scaling.py's (the real RoundManager in its own process, SQLite state on disk,
every device a real MQTT client on Mosquitto answering with a signed int8 update: its ``device_worker``
is reused here). Beside it the gateway process keeps a fleet registry of the same devices (a
FleetManager on the gateway's connection, one registry row with a birth per device and 5 telemetry rows
each), so the dashboard has 1,000 rows to show and /metrics 1,000 devices to count.

After one warm-up round, the measured rounds alternate web view off and on in ABBA order (off, on, on,
off, ...), so drift (the 2-core machine's other load, SQLite growth) falls on both sides. "On" is a
``WebServer`` started on the gateway (its ``on_round`` hook and rollout wrapper included) and, in this
driver process, a client that does what a Prometheus server and one open dashboard do, faster than
either usually would: GET /metrics every 1 s and GET /api/state every 2 s (the page's poll). "Off" is no
server, no hook. ``round_s`` is the gateway's own measure (announce -> new model acknowledged).

Also reported, because round time on a shared machine moves by tens of percent from round to round: the
gateway process's CPU seconds per round (``time.process_time``, all its threads, the web server's
included) on and off, and the CPU seconds it spent answering the web requests (thread CPU time inside the
handler) per second of "on" round time: the share of one core the view took.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_scaling as rs  # noqa: E402

PROFILES = ("raspberry-pi-4", "raspberry-pi-5", "jetson-orin-nano", "x86-gateway")


def schedule(n: int) -> list[bool]:
    """ABBA: False (off), True (on), True, False, ... ``n`` rounds."""
    return [bool((i % 4) in (1, 2)) for i in range(n)]


def gateway_worker(spec: dict[str, Any], out: Any) -> None:
    rs._raise_nofile()
    from types import SimpleNamespace

    from edgeflow import zoo
    from edgeflow.gateway.fleet import FleetManager, FleetOptions
    from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.gateway.web import WebServer
    from edgeflow.gateway.web import server as web_server
    from edgeflow.protocol.rounds import TrainConfig
    from edgeflow.signing import KeyRing, PrivateKey
    from edgeflow.transport import MqttTransport

    model = zoo.digits_mlp(seed=0)
    fk = PrivateKey.from_bytes(bytes.fromhex(spec["fleet_key"]))
    ring = KeyRing(dict(spec["public_keys"]))
    ids = sorted(spec["public_keys"])
    n = len(ids)
    store = GatewayStore(Path(spec["state_dir"]) / "gateway.sqlite")
    now = time.time()
    for i, d in enumerate(ids):
        store.upsert_birth(d, {"profile": PROFILES[i % 4], "backend": "ort", "can_train": True, "training": True,
                               "telemetry_interval_s": 10.0}, profile=PROFILES[i % 4], model_version=1)
    store.add_telemetry_batch([(d, {"battery": 0.9 - 0.01 * k, "latency_ms": 3.0 + k, "memory_mb": 50.0},
                                now - 10 * (5 - k)) for d in ids for k in range(5)])
    host, port = spec["url"].rsplit("://", 1)[1].split(":")
    gt = MqttTransport(host, int(port), client_id=f"{rs.FLEET}-gateway", clean_start=True,
                       max_pending_messages=100_000, connect_timeout_s=60)
    fm = FleetManager(gt, store, rs.FLEET, fk, FleetOptions(heartbeat_timeout_s=3600), keyring=ring)
    rm = RoundManager(gt, store, fleet=rs.FLEET, fleet_key=fk, keyring=ring, model=model,
                      config=RoundConfig(rounds=10_000, min_clients=n, quorum=1.0, deadline_s=600,
                                         train=TrainConfig(codec=spec["codec"]), wait_for_devices_s=1),
                      candidates=lambda: [Candidate(d) for d in ids])
    target = SimpleNamespace(rounds=rm, fleet=fm, store=store, transport=gt, fleet_id=rs.FLEET)

    served = {"cpu_s": 0.0, "requests": 0}
    lock = threading.Lock()
    inner_get = web_server._Handler.do_GET

    def timed_get(self: Any) -> None:
        c0 = time.thread_time()
        try:
            inner_get(self)
        finally:
            with lock:
                served["cpu_s"] += time.thread_time() - c0
                served["requests"] += 1

    web_server._Handler.do_GET = timed_get  # the benchmark's own stopwatch around the handler
    fm.start()
    rm.start()
    gt.connect(timeout=60)
    rows: list[dict[str, Any]] = []
    warm = rm.run(1)
    for on in schedule(spec["rounds"]):
        srv = None
        saved = (rm.on_round, fm.deploy)
        if on:
            srv = WebServer(target, f"127.0.0.1:{spec['http_port']}").start()
            end = time.monotonic() + 5
            while served["requests"] == 0 and time.monotonic() < end:  # the client found it (first on-window)
                time.sleep(0.05)
        with lock:
            before = dict(served)
        t0, c0 = time.perf_counter(), time.process_time()
        m = rm.run(1)[0]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if srv is not None:
            srv.stop()
            rm.on_round, fm.deploy = saved  # detach: "off" rounds run without the hook
        with lock:
            rows.append({"web": on, "round_s": m.round_s, "wall_s": wall, "cpu_s": cpu, "participants": m.participants,
                         "web_cpu_s": served["cpu_s"] - before["cpu_s"],
                         "requests": served["requests"] - before["requests"]})
    out.put({"done": True, "rows": rows, "warmup_s": warm[0].round_s if warm else None,
             "devices_shown": len(target.store.devices())})
    fm.stop()
    rm.stop()
    gt.close(timeout=2)


def scraper(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    """A Prometheus scrape every 1 s and a dashboard poll every 2 s while the server answers."""
    tick = 0
    while not stop.wait(1.0):
        tick += 1
        for path in ("metrics",) + (("api/state",) if tick % 2 == 0 else ()):
            try:
                with urllib.request.urlopen(url + path, timeout=30) as r:
                    r.read()
                counts[path] = counts.get(path, 0) + 1
            except OSError:
                pass  # off: nothing listens


def measure(n: int, rounds: int, codec: str, procs: int, workdir: Path) -> dict[str, Any]:
    import socket

    from edgeflow.signing import PrivateKey
    from edgeflow.transport.broker import MosquittoBroker

    ctx = mp.get_context("spawn")
    ids = [f"sim-{i:04d}" for i in range(n)]
    priv = {d: PrivateKey.generate() for d in ids}
    fk = PrivateKey.generate()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    broker = MosquittoBroker(max_queued_messages=100_000, max_inflight_messages=20).start()
    spec = {"fleet_key": fk.raw().hex(), "public_keys": {d: rs._pub_hex(k.public_key) for d, k in priv.items()},
            "codec": codec, "rounds": rounds, "url": broker.url, "http_port": http_port,
            "state_dir": tempfile.mkdtemp(prefix=f"web-{n}-", dir=workdir)}
    ready, dev_out, gw_out, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [ids[i::procs] for i in range(procs) if ids[i::procs]]
    workers = [ctx.Process(target=rs.device_worker, args=(s, {d: priv[d].raw().hex() for d in s},
                                                         {d: broker.url for d in s}, rs._pub_hex(fk.public_key),
                                                         1000 * i, ready, stop, dev_out))
               for i, s in enumerate(shares)]
    counts: dict[str, int] = {}
    halt = threading.Event()
    scrape = threading.Thread(target=scraper, args=(f"http://127.0.0.1:{http_port}/", halt, counts), daemon=True)
    try:
        for w in workers:
            w.start()
        connected = sum(ready.get(timeout=900)["connected"] for _ in workers)
        gw = ctx.Process(target=gateway_worker, args=(spec, gw_out))
        gw.start()
        scrape.start()
        msg = gw_out.get(timeout=3600)
        gw.join(60)
    finally:
        halt.set()
        stop.set()
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
        broker.stop()
    rows = msg["rows"]
    off = [r["round_s"] for r in rows if not r["web"]]
    on = [r["round_s"] for r in rows if r["web"]]
    on_time = sum(on)
    off_cpu = [r["cpu_s"] for r in rows if not r["web"]]
    on_cpu = [r["cpu_s"] for r in rows if r["web"]]
    web_cpu = sum(r["web_cpu_s"] for r in rows if r["web"])
    return {
        "devices": n, "connected": connected, "codec": codec, "rounds_measured": len(rows),
        "warmup_round_s": msg["warmup_s"], "devices_shown": msg["devices_shown"],
        "off_round_s": [round(x, 3) for x in off], "on_round_s": [round(x, 3) for x in on],
        "off_median_s": round(statistics.median(off), 3), "on_median_s": round(statistics.median(on), 3),
        "ratio_median": round(statistics.median(on) / statistics.median(off), 4),
        "ratio_mean": round(statistics.mean(on) / statistics.mean(off), 4),
        "off_cpu_s": [round(x, 3) for x in off_cpu], "on_cpu_s": [round(x, 3) for x in on_cpu],
        "cpu_ratio_median": round(statistics.median(on_cpu) / statistics.median(off_cpu), 4),
        "participants": sorted({r["participants"] for r in rows}),
        "requests_served_on": sum(r["requests"] for r in rows if r["web"]),
        "requests_during_off": sum(r["requests"] for r in rows if not r["web"]),
        "web_cpu_s": round(web_cpu, 3), "web_cpu_share": round(web_cpu / on_time, 4) if on_time else None,
        "client_requests": counts,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds (ABBA order), after one warm-up")
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--device-procs", type=int, default=4)
    ap.add_argument("--json", help="also write the result to this JSON file")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="web-overhead-") as tmp:
        r = measure(args.devices, args.rounds, args.codec, args.device_procs, Path(tmp))
    print(json.dumps(r), file=sys.stderr)
    print(f"# web view overhead: {r['devices']} devices ({r['connected']} connected), {r['codec']} updates, "
          f"{r['rounds_measured']} rounds ABBA, /metrics every 1 s + /api/state every 2 s while on")
    print("| web view | rounds | round s (median) | round s (mean) | gateway CPU s per round (median) | round s, all |")
    print("|---|---:|---:|---:|---:|---|")
    for name, xs, cs in (("off", r["off_round_s"], r["off_cpu_s"]), ("on", r["on_round_s"], r["on_cpu_s"])):
        print(f"| {name} | {len(xs)} | {statistics.median(xs):.3f} | {statistics.mean(xs):.3f} | "
              f"{statistics.median(cs):.3f} | {', '.join(f'{x:.2f}' for x in xs)} |")
    print(f"round time on/off: {r['ratio_median']:.4f} (medians), {r['ratio_mean']:.4f} (means); gateway CPU per "
          f"round on/off: {r['cpu_ratio_median']:.4f} (medians); "
          f"{r['requests_served_on']} requests served while on, {r['web_cpu_s']:.3f} s of gateway CPU in them = "
          f"{100 * (r['web_cpu_share'] or 0):.2f}% of one core over the 'on' rounds; dashboard rows "
          f"{r['devices_shown']}")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
