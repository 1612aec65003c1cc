"""MqttTransport publish/subscribe throughput, against a baseline revision in the same run.

One sender and one receiver transport on a private Mosquitto (loopback TCP):
the sender publishes ``count`` QoS 1 messages of ``size`` bytes as fast as its
outbox takes them, the receiver's handler counts them; the time runs from the
first publish to the last message handled. Three loads: many small messages
(1 KiB), medium ones (64 KiB) and chunked payloads (1 MiB in 256 KiB chunks).

The peer is the same transport at a baseline git revision (default: the last
revision whose ``edgeflow/transport/mqtt.py`` was a single module), loaded from
``git show`` into a temporary module that uses today's helper modules
(outbox, chunking, topics), so only the MqttTransport code differs. Runs
alternate baseline/current ``--rounds`` times; the median of each is reported
with the ratio current/baseline (>= 1 means no slower), and the ratio of the
best runs (less sensitive to other processes on a shared machine), and the
CPU time this process spent per message (both transports' threads; the
broker is another process), which contention on a shared machine barely
moves: a CPU ratio <= 1 means the current code costs no more per message.

``--calls`` adds a figure no other process can disturb: the Python function
calls made per 1 KiB message in the transport's own code (the baseline module,
or edgeflow/transport/mqtt/), counted in every thread with a profile hook.

    python benchmarks/transport_throughput.py [--rounds 5] [--baseline-rev REV] [--calls] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
LOADS = [  # name, payload bytes, messages, max_payload
    ("1 KiB x 3000", 1024, 3000, 256 * 1024),
    ("64 KiB x 400", 64 * 1024, 400, 256 * 1024),
    ("1 MiB x 24 (chunked)", 1024 * 1024, 24, 256 * 1024),
]


def baseline_rev() -> str:
    path = "edgeflow/transport/mqtt.py"
    head = subprocess.run(["git", "cat-file", "-e", f"HEAD:{path}"], cwd=ROOT, capture_output=True)
    if head.returncode == 0:
        return "HEAD"
    last = subprocess.run(["git", "rev-list", "-n", "1", "HEAD", "--", path], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    return f"{last}^"


def load_baseline(rev: str, tmp: Path) -> ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:edgeflow/transport/mqtt.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    f = tmp / "edgeflow_baseline_mqtt.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location("edgeflow_baseline_mqtt", f)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_once(cls: type, port: int, size: int, count: int, max_payload: int, tag: str) -> tuple[float, float]:
    """(wall seconds from the first publish to the last message handled, CPU seconds this
    process spent meanwhile: both transports' threads, not the broker)."""
    got = 0
    done = threading.Event()

    def on(msg: object) -> None:
        nonlocal got
        got += 1
        if got >= count:
            done.set()

    opts = {"reconnect_min_s": 0.05, "max_payload": max_payload, "clean_start": True}
    rx = cls("127.0.0.1", port, client_id=f"rx-{tag}", **opts)
    tx = cls("127.0.0.1", port, client_id=f"tx-{tag}", max_queued_bytes=1 << 30, **opts)
    try:
        rx.subscribe(f"bench/{tag}", on)
        rx.connect(10)
        tx.connect(10)
        payload = os.urandom(size)
        t0, c0 = time.perf_counter(), time.process_time()
        last = None
        for _ in range(count):
            last = tx.publish(f"bench/{tag}", payload, qos=1)
        assert last is not None
        if not done.wait(120):
            raise RuntimeError(f"{cls.__module__}: {got} of {count} messages arrived")
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        last.wait(30)
        return elapsed, cpu
    finally:
        tx.close(timeout=2, flush=False)
        rx.close(timeout=2, flush=False)


def count_calls(cls: type, port: int, tag: str, count: int = 2000) -> float:
    """Python calls per message made in ``cls``'s own modules (all threads)."""
    import collections

    module_file = sys.modules[cls.__module__].__file__ or ""
    ours = str(Path(module_file).parent) if "transport/mqtt" in module_file else module_file
    hits: collections.Counter[str] = collections.Counter()

    def hook(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call" and frame.f_code.co_filename.startswith(ours):
            hits["n"] += 1

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        run_once(cls, port, 1024, count, 256 * 1024, tag)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return hits["n"] / count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline-rev", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--calls", action="store_true", help="also count Python calls per message in the transport")
    args = ap.parse_args()

    from edgeflow.transport.broker import MosquittoBroker, find_mosquitto
    from edgeflow.transport.mqtt import MqttTransport

    if find_mosquitto() is None:
        print("mosquitto is not installed", file=sys.stderr)
        return 2
    rev = args.baseline_rev or baseline_rev()
    with tempfile.TemporaryDirectory() as tmp:
        base = load_baseline(rev, Path(tmp)).MqttTransport
        impls = {"baseline": base, "current": MqttTransport}
        rows = []
        # a subscriber's queue must hold a whole burst: Mosquitto drops QoS 1 messages beyond max_queued_messages
        with MosquittoBroker(max_queued_messages=1_000_000).start() as broker:
            for name, size, count, max_payload in LOADS:
                times: dict[str, list[float]] = {"baseline": [], "current": []}
                cpus: dict[str, list[float]] = {"baseline": [], "current": []}
                for r in range(args.rounds):
                    order = ("baseline", "current") if r % 2 == 0 else ("current", "baseline")
                    for which in order:
                        wall, cpu = run_once(impls[which], broker.port, size, count, max_payload, f"{which}-{r}")
                        times[which].append(wall)
                        cpus[which].append(cpu)
                row = {"load": name, "size": size, "count": count}
                for which, ts in times.items():
                    med, best = statistics.median(ts), min(ts)
                    row[which] = {"seconds": med, "msgs_per_s": count / med, "mb_per_s": count * size / med / 1e6,
                                  "best_msgs_per_s": count / best, "runs": ts,
                                  "cpu_us_per_msg": statistics.median(cpus[which]) / count * 1e6, "cpu_runs": cpus[which]}
                row["ratio"] = row["current"]["msgs_per_s"] / row["baseline"]["msgs_per_s"]
                row["best_ratio"] = row["current"]["best_msgs_per_s"] / row["baseline"]["best_msgs_per_s"]
                row["cpu_ratio"] = row["current"]["cpu_us_per_msg"] / row["baseline"]["cpu_us_per_msg"]
                rows.append(row)
            calls = {w: count_calls(impls[w], broker.port, f"calls-{w}") for w in ("baseline", "current")} \
                if args.calls else None
    print(f"MqttTransport throughput, median of {args.rounds} alternating runs; baseline = {rev}")
    print(f"{'load':24} {'baseline msg/s':>15} {'current msg/s':>14} {'baseline MB/s':>14} {'current MB/s':>13} "
          f"{'ratio':>6} {'best-run ratio':>15} {'CPU us/msg b/c':>15} {'CPU ratio':>10}")
    for row in rows:
        b, c = row["baseline"], row["current"]
        print(f"{row['load']:24} {b['msgs_per_s']:15.0f} {c['msgs_per_s']:14.0f} {b['mb_per_s']:14.1f} "
              f"{c['mb_per_s']:13.1f} {row['ratio']:6.2f} {row['best_ratio']:15.2f} "
              f"{b['cpu_us_per_msg']:7.0f}/{c['cpu_us_per_msg']:<7.0f} {row['cpu_ratio']:10.2f}")
    if calls:
        print(f"Python calls per 1 KiB message in the transport's own code: baseline {calls['baseline']:.1f}, "
              f"current {calls['current']:.1f} (ratio {calls['current'] / calls['baseline']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline_rev": rev, "rounds": args.rounds, "rows": rows,
                                               "calls_per_message": calls}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
