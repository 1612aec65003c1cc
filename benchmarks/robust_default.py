"""Default robustness A/B: FedAvg with the default norm bound and sample cap vs unbounded FedAvg.

    python benchmarks/robust_default.py                 # 4 devices, 3 seeds, 15 rounds each
    python benchmarks/robust_default.py --quick         # 2 seeds, 12 rounds
    python benchmarks/robust_default.py --json out.json

Each run is a real federated fleet (:class:`edgeflow.sim.simulation.SimulatedFleet`):
a gateway and 4 devices, each with its own MQTT connection to a private
Mosquitto, training the digits MLP on label-skewed (Dirichlet alpha 0.3)
shards of scikit-learn's digits, dense updates. Three scenarios, each with
the same seeds for both arms:

- **clean**: every device honest. The figure is the clean accuracy the default
  bound costs (or gains): default minus unbounded, in points;
- **scaled x10**: one device of four sends 10x its real delta every round;
- **claims x1000**: one device of four claims 1000x its real sample count;
- **clean (20 devices)**: the clean comparison again on a fleet of 20 (more
  spread in shard sizes and update norms, so more honest updates meet the bound).

The arms: ``unbounded`` = ``strategy_params = {clip = "off", sample_multiplier = "off"}``
(FedAvg before the default existed), ``default`` = FedAvg as shipped. The
accuracy of a run is the mean over its last 3 rounds (held-out digits), then
averaged over seeds.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ARMS = {"unbounded": {"clip": "off", "sample_multiplier": "off"}, "default": {}}
SCENARIOS = ("clean", "scaled x10", "claims x1000", "clean (20 devices)")


def _claim_more(client: Any, factor: int) -> None:
    """Make ``client`` report ``factor`` times its real sample count (its delta is honest)."""
    real = client._train

    def train(weights, cfg, round_id):
        delta, n, loss = real(weights, cfg, round_id)
        return delta, n * factor, loss

    client._train = train


def one_run(broker_url: str, scenario: str, arm: str, seed: int, rounds: int, devices: int) -> dict[str, Any]:
    from edgeflow.sim.simulation import SimConfig, SimulatedFleet

    if scenario == "clean (20 devices)":
        devices = 20
    byz = 0.0 if scenario.startswith("clean") else 1.0 / devices
    cfg = SimConfig(devices=devices, rounds=rounds, alpha=0.3, seed=seed, codec="dense", epochs=2, lr=0.1,
                    deadline_s=20, byzantine=byz, attack="scale",
                    attack_scale=10.0 if scenario == "scaled x10" else 1.0,
                    strategy="fedavg", strategy_params=dict(ARMS[arm]), min_clients=devices)
    t0 = time.perf_counter()
    with SimulatedFleet(cfg, broker_url) as fleet:
        if scenario == "claims x1000":
            for d in fleet.devices:
                if d.byzantine:
                    _claim_more(d.client, 1000)
        metrics = fleet.run()
    accs = [m.accuracy for m in metrics if m.accuracy is not None]
    tail = accs[-3:]
    return {"scenario": scenario, "arm": arm, "seed": seed, "rounds": len(metrics),
            "accuracy": statistics.fmean(tail) if tail else None, "final": accs[-1] if accs else None,
            "curve": [round(a, 4) for a in accs],
            "clipped": sum(int(m.extra.get("clipped", 0)) for m in metrics),
            "capped": sum(int(m.extra.get("capped", 0)) for m in metrics),
            "seconds": round(time.perf_counter() - t0, 1)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, dict[str, float | None]] = {}
    for sc in SCENARIOS:
        table[sc] = {}
        for arm in ARMS:
            accs = [r["accuracy"] for r in runs if r["scenario"] == sc and r["arm"] == arm and r["accuracy"] is not None]
            table[sc][arm] = statistics.fmean(accs) if accs else None
    clean = table["clean"]
    big = table["clean (20 devices)"]
    return {
        "accuracy": table,
        "clean_cost_points": None if None in clean.values() else 100 * (clean["default"] - clean["unbounded"]),
        "clean_cost_points_20": None if None in big.values() else 100 * (big["default"] - big["unbounded"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 seeds x 12 rounds instead of 3 x 15")
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--broker", help="broker URL (default: a private Mosquitto started here)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    ap.add_argument("--json", help="write the figures as JSON to this path")
    ap.add_argument("--default-params", default="{}",
                    help="JSON strategy_params for the default arm (to explore other multipliers; default: none)")
    args = ap.parse_args(argv)
    ARMS["default"] = json.loads(args.default_params)
    seeds = args.seeds or (2 if args.quick else 3)
    rounds = args.rounds or (12 if args.quick else 15)
    logging.basicConfig(level=logging.ERROR)
    broker = None
    url = args.broker
    if url is None:
        from edgeflow.transport.broker import MosquittoBroker

        broker = MosquittoBroker().start()
        url = broker.url
    runs = []
    try:
        for sc in [s.strip() for s in args.scenarios.split(",") if s.strip()]:
            if sc not in SCENARIOS:
                ap.error(f"unknown scenario {sc!r}; known: {', '.join(SCENARIOS)}")
            for seed in range(seeds):
                for arm in ARMS:
                    r = one_run(url, sc, arm, seed, rounds, args.devices)
                    runs.append(r)
                    print(f"  {sc:13s} {arm:9s} seed {seed}: accuracy {r['accuracy']:.3f} (last 3 rounds), "
                          f"{r['clipped']} clipped, {r['capped']} capped, {r['seconds']} s", file=sys.stderr,
                          flush=True)
    finally:
        if broker is not None:
            broker.stop()
    out = {"devices": args.devices, "seeds": seeds, "rounds": rounds, "alpha": 0.3, "runs": runs, **summarize(runs)}
    print(f"# default robustness A/B: {args.devices} devices (one scenario 20), digits MLP, Dirichlet 0.3, "
          f"{seeds} seeds x {rounds} rounds, accuracy = mean of the last 3 rounds")
    print("| scenario | unbounded FedAvg | default FedAvg |")
    print("|---|---:|---:|")
    for sc, row in out["accuracy"].items():
        cells = ["n/a" if v is None else f"{v:.3f}" for v in row.values()]
        print(f"| {sc} | {' | '.join(cells)} |")
    if out["clean_cost_points"] is not None:
        print(f"clean accuracy, default minus unbounded: {out['clean_cost_points']:+.1f} points (4 devices)")
    if out["clean_cost_points_20"] is not None:
        print(f"clean accuracy, default minus unbounded: {out['clean_cost_points_20']:+.1f} points (20 devices)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
