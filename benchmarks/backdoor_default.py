"""Could ``strategy = "auto"`` (krum-reputation where the gateway sees each update) be the default?
Issue 29 item 4's bar: neither ``edgeflow demo`` nor ``edgeflow simulate --devices 20 --rounds 30`` may lose more
than 0.5 point of final accuracy against plain FedAvg (the default).

    python benchmarks/backdoor_default.py                 # every arm below, JSON lines then a table
    python benchmarks/backdoor_default.py --only demo     # only the demo arms (about 45 s each)
    python benchmarks/backdoor_default.py --json out.json
    python benchmarks/backdoor_default.py --auto-param server_momentum=0.5 --strategy auto   # auto's params
    python benchmarks/backdoor_default.py --only demo --demo-seeds 3 4 --codec topk-int8     # other seeds

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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backdoor import check_auto_params, parse_params  # noqa: E402  (one --auto-param parser for both scripts)

DEMO_SEEDS = {"topk-int8": (0, 1), "int8": (0,)}
DEMO = [(s, seed, codec, {}) for codec in DEMO_SEEDS for seed in DEMO_SEEDS[codec] for s in ("fedavg", "auto")]
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
        cmd += [f"--strategy-param={k}={json.dumps(v)}" for k, v in params.items()]
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
    ap.add_argument("--auto-param", action="append", metavar="NAME=VALUE",
                    help="a strategy_params entry for the auto arms, e.g. server_momentum=0.5 (repeatable)")
    ap.add_argument("--strategy", choices=["fedavg", "auto"], action="append",
                    help="only these strategies' demo and simulate arms (default both)")
    ap.add_argument("--demo-seeds", type=int, nargs="+", metavar="SEED",
                    help="the demo arms' seeds (default: 0 and 1 for top-k, 0 for int8)")
    ap.add_argument("--codec", choices=["int8", "topk-int8"], action="append",
                    help="only the demo and simulate arms with this codec (default both)")
    args = ap.parse_args(argv)
    arms = args.only or ["demo", "demo-why", "simulate"]
    auto_params = parse_params(args.auto_param)
    if auto_params:
        check_auto_params(auto_params)
    demo = DEMO if args.demo_seeds is None else [
        (s, seed, codec, {}) for codec in DEMO_SEEDS for seed in args.demo_seeds for s in ("fedavg", "auto")]
    rows = []
    for arm, runs, fn in (("demo", demo, run_demo), ("demo-why", DEMO_WHY, run_demo),
                          ("simulate", SIMULATE, run_simulate)):
        if arm not in arms:
            continue
        if arm != "demo-why":
            runs = [(s, seed, codec, {**params, **auto_params} if s == "auto" else params)
                    for s, seed, codec, params in runs
                    if (not args.strategy or s in args.strategy) and (not args.codec or codec in args.codec)]
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
