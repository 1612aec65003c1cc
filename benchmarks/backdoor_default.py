"""Could ``strategy = "auto"`` (krum-reputation where the gateway sees each update) be the default?
Issue 29 item 4's bar: neither ``edgeflow demo`` nor ``edgeflow simulate --devices 20 --rounds 30`` may lose more
than 0.5 point of final accuracy against plain FedAvg (the default).

    python benchmarks/backdoor_default.py                 # every arm below, JSON lines then a table
    python benchmarks/backdoor_default.py --only demo     # only the demo arms (about 45 s each)
    python benchmarks/backdoor_default.py --json out.json

Arms, each run as a user runs it:
- ``demo``: ``edgeflow demo`` (8 boards, CNN, 15 rounds, top-k int8 3% updates, seeds 0 and 1) and the same with
  ``--codec int8``. The demo names ``strategy="fedavg"`` itself (edgeflow/sim/demo.py); here its RoundConfig is
  built with the strategy of the arm instead, nothing else changes.
- ``demo-why``: the demo (seed 0) with FedAvgM (server momentum 0.9, no defence) and with krum-reputation without
  momentum: which part of krum-reputation costs accuracy on top-k updates.
- ``simulate``: ``edgeflow simulate --devices 20 --rounds 30 --seed 0 --strategy S`` with the default codec (int8)
  and with ``--codec topk-int8``.

The figures of docs/security.md section 14 ("Status") come from this script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

DEMO = [(s, seed, codec, {}) for codec in ("topk-int8", "int8") for seed in ((0, 1) if codec == "topk-int8" else (0,))
        for s in ("fedavg", "auto")]
DEMO_WHY = [("fedavgm", 0, "topk-int8", {"server_momentum": 0.9}),
            ("krum-reputation", 0, "topk-int8", {"server_momentum": 0.0})]
SIMULATE = [(s, 0, codec, {}) for codec in ("int8", "topk-int8") for s in ("fedavg", "auto")]


def run_demo(strategy: str, seed: int, codec: str, params: dict[str, Any]) -> dict[str, Any]:
    """``edgeflow demo --seed SEED --codec CODEC`` with ``[rounds] strategy = STRATEGY`` (and ``strategy_params``)."""
    import edgeflow.gateway.rounds as rounds_mod
    from edgeflow.sim.demo import Demo, DemoConfig

    original = rounds_mod.RoundConfig

    class WithStrategy(original):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **{**kw, "strategy": strategy, "strategy_params": dict(params)})

    rounds_mod.RoundConfig = WithStrategy  # the demo imports it from here when it builds its gateway
    try:
        with Demo(DemoConfig(seed=seed, codec=codec), say=lambda s: None) as demo:
            res = demo.run()
            chosen = demo.gateway.rounds.strategy_name
    finally:
        rounds_mod.RoundConfig = original
    return {"arm": "demo", "strategy": strategy, "resolved": chosen, "params": params, "seed": seed, "codec": codec,
            "final_accuracy": round(res.final_fp32_accuracy, 4),
            "accuracy_per_round": [round(a, 3) for a in res.accuracy_per_round]}


def run_simulate(strategy: str, seed: int, codec: str, params: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "edgeflow.cli.main", "simulate", "--devices", "20", "--rounds", "30", "--seed",
               str(seed), "--strategy", strategy, "--codec", codec, "--out", tmp, "--json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[2:])} failed: {proc.stderr.strip().splitlines()[-1:]}")
        s = json.loads((Path(tmp) / "summary.json").read_text())
    return {"arm": "simulate", "strategy": strategy, "resolved": s["strategy"], "params": params, "seed": seed,
            "codec": codec, "final_accuracy": s["final_accuracy"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["demo", "demo-why", "simulate"], action="append")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    args = ap.parse_args(argv)
    arms = args.only or ["demo", "demo-why", "simulate"]
    rows = []
    for arm, runs, fn in (("demo", DEMO, run_demo), ("demo-why", DEMO_WHY, run_demo),
                          ("simulate", SIMULATE, run_simulate)):
        if arm not in arms:
            continue
        for strategy, seed, codec, params in runs:
            row = {**fn(strategy, seed, codec, params), "arm": arm}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| arm | codec | seed | strategy (resolved) | final accuracy |\n|---|---|---:|---|---:|")
    for r in rows:
        extra = f" {r['params']}" if r["params"] else ""
        print(f"| {r['arm']} | {r['codec']} | {r['seed']} | {r['strategy']} ({r['resolved']}){extra} | "
              f"{r['final_accuracy']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
