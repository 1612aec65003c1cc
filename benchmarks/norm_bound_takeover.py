"""Can one device take the default norm bound over? Rounds that close with few updates, one attacker.

    python benchmarks/norm_bound_takeover.py              # 6 devices, 2 per round, 15 rounds, 3 seeds
    python benchmarks/norm_bound_takeover.py --json out.json

Default FedAvg clips each delta to 1.5x its reference median norm. Issue 29's finding: with rounds
that close with 2 updates (``min_clients = 2``), the attacker's huge norm was half of every median
of two, the bound rose 732x and accuracy fell from 0.92 to 0.10 for good. Here: a real RoundManager
and 6 real federated Clients (digits MLP) over the loopback transport; each round takes 2 devices
(``max_clients = 2``); device 0 sends its real delta times ``-scale`` every round (flipped and blown up). Reported per
seed: the largest norm bound over the run relative to the first one, the accuracy (held-out digits,
mean of the last 5 rounds), and the same run without the attacker. A round of 2 with one attacker is
half Byzantine whatever the bound does: the figure that shows the takeover is the bound's growth. Runs unchanged on older edgeflow versions (only
public settings), so before/after figures come from the same command.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback_fleet import loopback_fleet, shut_down  # noqa: E402


def one_run(seed: int, rounds: int, scale: float | None) -> dict[str, Any]:
    transform = None
    if scale is not None:
        transform = {0: lambda delta, round_id: {k: -scale * v for k, v in delta.items()}}
    config = {"strategy": "fedavg", "max_clients": 2, "min_clients": 2, "seed": seed}
    with tempfile.TemporaryDirectory() as tmp:
        fl = loopback_fleet(str(Path(tmp) / "gw.sqlite"), config, rounds, seed, devices=6, transform=transform)
        rm, gt = fl["manager"]()
        try:
            history = rm.run()
        finally:
            shut_down(fl, rm, gt)
    bounds = [m.extra["norm_bound"] for m in history if "norm_bound" in m.extra]
    last = [m.accuracy for m in history[-5:]]
    return {"final_accuracy": sum(last) / len(last), "rounds": len(history),
            "bound_growth": max(bounds) / bounds[0] if bounds and bounds[0] > 0 else None,
            "bounds": bounds, "accuracies": [m.accuracy for m in history]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1000.0, help="the attacker sends -scale times its real delta")
    ap.add_argument("--json", help="write the figures as JSON to this path")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = []
    for seed in range(args.seeds):
        clean = one_run(seed, args.rounds, None)
        attacked = one_run(seed, args.rounds, args.scale)
        row = {"seed": seed, "clean_accuracy": clean["final_accuracy"],
               "attacked_accuracy": attacked["final_accuracy"], "attacked_bound_growth": attacked["bound_growth"],
               "clean_bound_growth": clean["bound_growth"], "attacked_accuracies": attacked["accuracies"],
               "attacked_bounds": attacked["bounds"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {k: statistics.mean(r[k] for r in rows if r[k] is not None)
               for k in ("clean_accuracy", "attacked_accuracy", "attacked_bound_growth")}
    print(json.dumps({"mean": summary}))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "mean": summary, "args": vars(args)}, indent=2),
                                   encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
