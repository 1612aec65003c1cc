"""FedBuff (asynchronous buffered rounds) against synchronous rounds: final accuracy and time to 0.84.

    python benchmarks/fedbuff.py                          # defaults, seeds 0-2: sync vs async
    python benchmarks/fedbuff.py --seeds 1 --async K=10,lr=1.0 --async K=15,lr=1.3
    python benchmarks/fedbuff.py --json out.json

The fleet of ``edgeflow simulate``: 20 devices (each a real MQTT client on a Mosquitto this script
starts), digits MLP, Dirichlet 0.3, int8 updates, 30 rounds (sync) or 30 model versions (async), and
a quarter of the devices are stragglers that take 3 s more per local training. Synchronous rounds wait
for them (every device reports every round); FedBuff publishes a version every K updates and weights
each by its staleness. Reported per arm and seed: the final accuracy (held-out digits, last version),
the seconds until the accuracy first reaches 0.84 (sum of the versions' ``round_s``), the updates
used; then per async arm the mean over seeds of final - sync's final (points) and time-to-0.84 / sync's.

``--async K=..,lr=..,a=..,max_staleness=..``: an async arm (``async_buffer``, ``async_server_lr``,
staleness exponent: 0 for ``constant`` or 0.5 for ``polynomial``, the two ``[rounds] staleness`` gives,
``max_staleness`` or ``none``); unset keys keep the gateway's defaults. Timings
depend on the machine's load (a shared 2-core machine here): compare arms of the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path
from typing import Any

TARGET = 0.84


def _arm(spec: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        k, _, v = part.partition("=")
        if k not in ("K", "lr", "a", "max_staleness"):
            raise SystemExit(f"--async: unknown key {k!r}; use K, lr, a, max_staleness")
        out[k] = None if v == "none" else (int(v) if k in ("K", "max_staleness") else float(v))
    if out.get("a", 0.5) not in (0.0, 0.5):
        raise SystemExit("--async: a must be 0 (staleness = \"constant\") or 0.5 (\"polynomial\", FedBuff's)")
    return out


def one_run(mode: str, seed: int, arm: dict[str, Any], *, devices: int, rounds: int, stragglers: float,
            delay_s: float) -> dict[str, Any]:
    from edgeflow.sim.demo import select_broker
    from edgeflow.sim.simulation import SimConfig, SimulatedFleet

    knobs: dict[str, Any] = {"devices": devices, "rounds": rounds, "mode": mode, "seed": seed,
                             "stragglers": stragglers, "straggler_delay_s": delay_s, "deadline_s": 10.0}
    if "K" in arm:
        knobs["async_buffer"] = arm["K"]
    broker = select_broker("mosquitto")
    try:
        with SimulatedFleet(SimConfig(**knobs), broker.url) as fleet:
            rc = fleet.rounds.config
            if "lr" in arm:
                rc.async_server_lr = arm["lr"]
            if "a" in arm:
                rc.staleness = "polynomial" if arm["a"] else "constant"
            if "max_staleness" in arm:
                rc.max_staleness = arm["max_staleness"]
            settings = {"K": rc.async_buffer, "lr": getattr(rc, "async_server_lr", 1.0), "staleness": rc.staleness,
                        "max_staleness": rc.max_staleness}
            history = fleet.run()
    finally:
        broker.stop()
    elapsed, reached = 0.0, None
    for m in history:
        elapsed += m.round_s
        if reached is None and m.accuracy is not None and m.accuracy >= TARGET:
            reached = elapsed
    return {"mode": mode, "seed": seed, **({} if mode == "sync" else settings),
            "final": round(history[-1].accuracy, 4), "time_to_target_s": None if reached is None else round(reached, 2),
            "total_s": round(elapsed, 1), "versions": len(history), "updates": sum(m.participants for m in history)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--stragglers", type=float, default=0.25)
    ap.add_argument("--straggler-delay", type=float, default=3.0)
    ap.add_argument("--async", dest="arms", action="append", default=None, metavar="K=..,lr=..",
                    help="an async arm (repeatable); default: the gateway's defaults")
    ap.add_argument("--json", help="write every run and the summary as JSON to this path")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    arms = [_arm(a) for a in (args.arms or [""])]
    common = {"devices": args.devices, "rounds": args.rounds, "stragglers": args.stragglers,
              "delay_s": args.straggler_delay}
    runs = []
    for seed in range(args.seeds):
        runs.append(one_run("sync", seed, {}, **common))
        print(json.dumps(runs[-1]), flush=True)
        for i, arm in enumerate(arms):
            runs.append({"arm": i, **one_run("async", seed, arm, **common)})
            print(json.dumps(runs[-1]), flush=True)
    sync = {r["seed"]: r for r in runs if r["mode"] == "sync"}
    summary = []
    for i, arm in enumerate(arms):
        mine = [r for r in runs if r.get("arm") == i]
        gaps = [100 * (r["final"] - sync[r["seed"]]["final"]) for r in mine]
        ratios = [r["time_to_target_s"] / sync[r["seed"]]["time_to_target_s"] for r in mine
                  if r["time_to_target_s"] and sync[r["seed"]]["time_to_target_s"]]
        summary.append({"arm": arm or "defaults", "K": mine[0]["K"], "lr": mine[0]["lr"],
                        "async_final_mean": round(statistics.mean(r["final"] for r in mine), 4),
                        "sync_final_mean": round(statistics.mean(s["final"] for s in sync.values()), 4),
                        "final_gap_points": round(statistics.mean(gaps), 2),
                        "time_to_target_ratio": round(statistics.mean(ratios), 3) if ratios else None})
        print(json.dumps(summary[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
