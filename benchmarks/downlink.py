"""Downlink: bytes each round sends the devices, full model vs model delta, and what it costs in accuracy.

    nice -n 10 OMP_NUM_THREADS=1 python benchmarks/downlink.py [--downlinks full,delta-int8] [--devices 20]
        [--rounds 30] [--seeds 0] [--alpha 0.3] [--codec int8] [--json out.json]

For each seed and ``[rounds] downlink`` setting: one ``edgeflow.sim.SimulatedFleet`` run (a gateway and
``--devices`` MQTT clients on a private Mosquitto, digits MLP, every device every round: quorum 1,
``min_clients`` = devices, as benchmarks/fl_vs_flower.py). Bytes down are counted as fl_vs_flower.py counts
them: the payload of every message the devices' transports hand a handler (global model, model delta,
round announcements), split by topic. Reported: bytes down per round (mean over the rounds), final test
accuracy (450 held-out digits), and a check that every device ends holding the gateway's model bit for bit
(the run fails otherwise). Updates (uplink) use ``--codec`` in every run, so the runs differ only in the
downlink.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_one(downlink: str, *, devices: int, rounds: int, seed: int, alpha: float, codec: str) -> dict:
    from fl_vs_flower import count_deliveries, per_round_bytes_down

    from edgeflow.sim.simulation import SimConfig, SimulatedFleet
    from edgeflow.transport.broker import MosquittoBroker, find_mosquitto

    binary = find_mosquitto()
    if binary is None:
        raise SystemExit("benchmarks/downlink.py: no mosquitto binary: apt install mosquitto")
    cfg = SimConfig(devices=devices, rounds=rounds, seed=seed, alpha=alpha, codec=codec, downlink=downlink,
                    quorum=1.0, min_clients=devices, deadline_s=900.0)
    down: dict = {"bytes": 0}
    lock = threading.Lock()
    rows: list[dict] = []
    with MosquittoBroker(binary=binary).start() as broker:
        fleet = SimulatedFleet(cfg, broker.url, on_round=lambda m: rows.append(
            {"round": m.round_id, "accuracy": m.accuracy, "down_total": down["bytes"]}))
        try:
            for d in fleet.devices:
                count_deliveries(d.transport, down, lock)
            t0 = time.perf_counter()
            fleet.start()
            fleet.run()
            wall = time.perf_counter() - t0
            gw, version = fleet.rounds.weights, fleet.rounds.version
            end = time.monotonic() + 60.0  # the last model is acknowledged by the broker, maybe not yet delivered
            while any(d.client._version != version for d in fleet.devices) and time.monotonic() < end:
                time.sleep(0.05)
            for d in fleet.devices:
                c = d.client
                same = c._version == version and all(
                    np.array_equal(np.asarray(c._weights[k]).view(np.uint32), gw[k].view(np.uint32)) for k in gw)
                if not same:
                    raise SystemExit(f"{downlink}: device {c.device_id} holds v{c._version}, not the gateway's "
                                     f"v{version} bit for bit")
            applied = sum(d.client.stats.deltas_applied for d in fleet.devices)
            refused = sum(d.client.stats.deltas_refused for d in fleet.devices)
            fulls = sum(d.client.stats.full_models for d in fleet.devices)
        finally:
            fleet.close()
    per_round_bytes_down(rows)
    n = max(1, len(rows))
    return {"downlink": downlink, "seed": seed, "rounds": rows, "final_accuracy": rows[-1]["accuracy"] if rows else None,
            "bytes_down_per_round": round(sum(r["bytes_down"] for r in rows) / n),
            "by_topic": {k: v for k, v in down.items() if k != "bytes"}, "deltas_applied": applied,
            "deltas_refused": refused, "full_models_received": fulls, "wall_s": round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--downlinks", default="full,delta-int8")
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    runs = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        for dl in a.downlinks.split(","):
            r = run_one(dl, devices=a.devices, rounds=a.rounds, seed=seed, alpha=a.alpha, codec=a.codec)
            runs.append(r)
            print(f"seed {seed} {dl:12s} bytes down/round {r['bytes_down_per_round']:>9,}  final accuracy "
                  f"{r['final_accuracy']:.4f}  deltas applied {r['deltas_applied']}, refused {r['deltas_refused']}, "
                  f"full models received {r['full_models_received']}  ({r['wall_s']} s)", flush=True)
    print()
    print("| seed | downlink | bytes down/round | vs full | final accuracy | vs full (points) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in runs:
        base = next(x for x in runs if x["seed"] == r["seed"] and x["downlink"] == "full") \
            if any(x["seed"] == r["seed"] and x["downlink"] == "full" for x in runs) else r
        print(f"| {r['seed']} | {r['downlink']} | {r['bytes_down_per_round']:,} | "
              f"{r['bytes_down_per_round'] / base['bytes_down_per_round']:.3f}x | {r['final_accuracy']:.4f} | "
              f"{100 * (r['final_accuracy'] - base['final_accuracy']):+.1f} |")
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
