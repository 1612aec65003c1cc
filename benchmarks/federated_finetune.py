"""Federated fine-tuning of a real pretrained model vs training the same tensors centrally.

    python benchmarks/federated_finetune.py [--model ocr-cls-ppocr-mobile-v2] [--mode bias]
        [--devices 10] [--rounds 6] [--epochs 1] [--codec int8] [--alpha 0.5]
        [--strategy fedavg] [--strategy-param K=V ...] [--proximal-mu 0] [--fraction 1]
        [--recommended] [--drift] [--json]

A pretrained suite model (default: PP-OCR's MobileNetV3 text-direction
classifier, weights in Constant nodes) gets a fresh 10-class head and is
adapted to scikit-learn's digits (resized to ``--input-size`` squared, grey
to RGB) by ``--devices`` simulated devices, each a real MQTT client on
Mosquitto (127.0.0.1:1883 unless ``--broker``), on Dirichlet label-skewed
shards (``--alpha``), sending signed updates compressed with ``--codec``.
Only the mode's tensors (``head``: the last layer; ``bias``: every bias plus
the head) travel: the gateway federates just those.

The peer, in the same run: one Trainer on the union of the shards, same
mode, lr, batch and number of passes over the data (rounds x epochs).
Reported: test accuracy of both, bytes uploaded per round (all devices) vs
what sending the whole model would cost (the .onnx file size x devices),
and vs the dense fp32 of the federated tensors.

Data passes are counted as samples trained / training-set size (the
devices' rounds trained x shard size x ``--epochs``; the shards partition
the training set): with every device in every round that is rounds x
epochs, with ``--fraction`` 0.5 about half that. The central peer trains
that many epochs (rounded).

``--strategy``/``--strategy-param`` pick the gateway's aggregator and its
settings (e.g. ``--strategy fedavgm --strategy-param server_lr=3``,
``--strategy-param clip=off``), ``--proximal-mu`` FedProx's term on the
devices. ``--recommended`` is FedAvgM with Nesterov server momentum, the
setting measured to close the gap (within 5 points from 24 passes, head).
``--drift`` measures client drift after the run: each device trains one
more round from the final global model, offline, and reports
its local model's accuracy on the global test set, the accuracy of the
sample-weighted mean of those local models, and each shard's label skew.
See docs/training.md, "Closing the gap to central training".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from edgeflow.errors import EdgeflowError
from edgeflow.cli._common import parse_key_values


RECOMMENDED = ("--strategy", "fedavgm", "--strategy-param", "nesterov=true")
"""FedAvgM (server_lr 1, server_momentum 0.9) with Nesterov: within 5 points of central training
from 24 data passes on the head-only fine-tune (docs/training.md). The gateway's default stays fedavg."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except EdgeflowError as exc:  # a bad --strategy, --strategy-param or mode: one line, not a traceback
        print(f"federated_finetune: {exc}", file=sys.stderr)
        return 2
    report(args, result)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--strategy-param`` parsed and ``--recommended`` resolved."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ocr-cls-ppocr-mobile-v2")
    ap.add_argument("--mode", default="bias", help="head, bias or last:N")
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--input-size", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    ap.add_argument("--deadline", type=float, default=600.0)
    ap.add_argument("--recommended", action="store_true",
                    help=f"the setting that closes the gap to central training: {' '.join(RECOMMENDED)} "
                         "(docs/training.md, 'Closing the gap to central training'); give >= 24 rounds")
    ap.add_argument("--strategy", default=None, help="gateway aggregator: fedavg (default), fedavgm, fedadam, fedprox...")
    ap.add_argument("--strategy-param", action="append", default=[], metavar="K=V",
                    help="aggregator setting, e.g. server_lr=3 or clip=off (repeatable; values parsed as JSON)")
    ap.add_argument("--fraction", type=float, default=1.0,
                    help="share of the devices selected each round (0.5 with twice the rounds: same data passes)")
    ap.add_argument("--proximal-mu", type=float, default=0.0, help="FedProx's mu on the devices (0: off)")
    ap.add_argument("--drift", action="store_true",
                    help="after the run, each device's local model (one more round from the final global) "
                         "on the test set, and each shard's label skew")
    ap.add_argument("--no-central", action="store_true", help="skip the central peer")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.strategy_params = parse_key_values(args.strategy_param, "--strategy-param")
    except ValueError as exc:
        ap.error(str(exc))
    if args.recommended:
        if args.strategy not in (None, "fedavgm"):
            ap.error(f"--recommended is FedAvgM with Nesterov server momentum; drop --strategy {args.strategy} "
                     "or --recommended")
        args.strategy = "fedavgm"
        args.strategy_params = {"nesterov": True, **args.strategy_params}
    args.strategy = args.strategy or "fedavg"
    return args


def report(args: argparse.Namespace, result: dict) -> None:
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        f, c = result["federated"], result.get("central")
        print(f"{args.model}, mode {args.mode}, {args.devices} devices (alpha {args.alpha}), {args.rounds} rounds "
              f"x {args.epochs} epoch(s), codec {args.codec}: {result['trainable_tensors']} tensors "
              f"({result['trainable_values']:,} values) federated; strategy {args.strategy} {args.strategy_params or ''}")
        print(f"  federated accuracy {100 * f['accuracy']:.1f}% (per round: "
              f"{', '.join(f'{100 * a:.1f}' for a in f['accuracy_per_round'])})")
        if c:
            print(f"  central accuracy   {100 * c['accuracy']:.1f}% (same tensors, lr, batch, {c['epochs']} epochs; "
                  f"per epoch: {', '.join(f'{100 * a:.1f}' for a in c['accuracy_per_epoch'])})")
            print(f"  gap to central     {result['gap_points']:.1f} points at {result['data_passes']:.2f} data passes; "
                  f"central reached the federated accuracy after {c['passes_to_federated_accuracy']} pass(es)")
        b = result["bytes"]
        print(f"  uploaded per round {b['uploaded_per_round']:,} B; whole model {b['whole_model_per_round']:,} B "
              f"({b['ratio_vs_whole_model']:.4f}x); dense fp32 of the federated tensors "
              f"{b['dense_per_round']:,} B ({b['ratio_vs_dense']:.3f}x)")
        d = result.get("drift")
        if d:
            print(f"  drift: local models {100 * d['local_accuracy_mean']:.1f}% on average "
                  f"(min {100 * min(d['local_accuracy']):.1f}, max {100 * max(d['local_accuracy']):.1f}); "
                  f"their weighted mean {100 * d['mean_model_accuracy']:.1f}%; classes per shard "
                  f"holding 90% of its samples: {d['classes_for_90pct']}")
        print(f"  {result['seconds']:.0f} s")


def label_skew(shards: list[tuple], classes: int = 10) -> list[int]:
    """Per shard: how many classes it takes to cover 90% of its samples (10 = no skew on digits)."""
    out = []
    for _, y in shards:
        counts = np.sort(np.bincount(y, minlength=classes))[::-1]
        out.append(int(np.searchsorted(np.cumsum(counts), 0.9 * len(y)) + 1))
    return out


def measure_drift(final_model, shards: list[tuple], split, args) -> dict:
    """Each device's local model after one more round from ``final_model``, on the global test set,
    and the sample-weighted mean of those local models (FedAvg's next step, uncompressed, unclipped)."""
    from edgeflow.train import Trainer

    local_acc, weights, sizes = [], [], []
    for x, y in shards:
        t = Trainer(final_model, mode=args.mode, lr=args.lr, momentum=args.momentum, batch_size=args.batch_size,
                    seed=args.seed)
        start = t.get_weights(trainable_only=True)
        t.proximal_mu = args.proximal_mu
        t.fit((x, y), args.epochs, anchor=start)
        local_acc.append(t.evaluate(split.x_test, split.y_test)[1])
        weights.append(t.get_weights(trainable_only=True))
        sizes.append(len(y))
    share = np.asarray(sizes, dtype=np.float64) / sum(sizes)
    mean = {k: sum(s * w[k] for s, w in zip(share, weights)).astype(weights[0][k].dtype) for k in weights[0]}
    t.set_weights(mean)
    return {"local_accuracy": local_acc, "local_accuracy_mean": float(np.mean(local_acc)),
            "mean_model_accuracy": t.evaluate(split.x_test, split.y_test)[1],
            "shard_sizes": sizes, "classes_for_90pct": label_skew(shards)}


def run(args) -> dict:
    from edgeflow.sim.simulation import SimConfig, SimulatedFleet
    from edgeflow.train import Trainer

    t0 = time.perf_counter()
    cfg = SimConfig(devices=args.devices, rounds=args.rounds, model=args.model, train_mode=args.mode,
                    input_size=args.input_size, alpha=args.alpha, seed=args.seed, codec=args.codec,
                    epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                    deadline_s=args.deadline, quorum=1.0, min_clients=max(1, round(args.devices * args.fraction)),
                    strategy=args.strategy, strategy_params=args.strategy_params, proximal_mu=args.proximal_mu, fraction=args.fraction,
                    fleet=f"finetune{os.getpid()}x{time.time_ns() % 10**9}")  # runs side by side share a broker
    with SimulatedFleet(cfg, args.broker) as fleet:
        metrics = fleet.run()
        up, dense = fleet.upload_bytes()
        names = fleet.trainable_names
        model = fleet.model
        split = fleet.split
        shards = [(d.client.x, d.client.y) for d in fleet.devices]
        trained = sum(d.client.stats.rounds_trained * len(d.client.y) for d in fleet.devices) * args.epochs
        final = fleet.rounds.current_model()
    whole = len(model.SerializeToString())
    inits = {t.name: t for t in model.graph.initializer}
    n_values = sum(int(np.prod(inits[n].dims)) for n in names)
    out = {
        "model": args.model, "mode": args.mode, "devices": args.devices, "rounds": args.rounds,
        "epochs": args.epochs, "codec": args.codec, "alpha": args.alpha, "input_size": args.input_size,
        "strategy": args.strategy, "strategy_params": args.strategy_params, "proximal_mu": args.proximal_mu,
        "lr": args.lr, "momentum": args.momentum, "fraction": args.fraction,
        "data_passes": trained / sum(len(s[1]) for s in shards),
        "trainable_tensors": len(names), "trainable_values": n_values,
        "federated": {"accuracy": metrics[-1].accuracy, "accuracy_per_round": [m.accuracy for m in metrics],
                      "participants": [m.participants for m in metrics]},
        "bytes": {"uploaded_per_round": up // max(1, len(metrics)), "dense_per_round": dense // max(1, len(metrics)),
                  "whole_model_per_round": whole * args.devices,
                  "ratio_vs_whole_model": up / max(1, len(metrics)) / (whole * args.devices),
                  "ratio_vs_dense": up / max(1, dense)},
    }
    if not args.no_central:
        x = np.concatenate([s[0] for s in shards])
        y = np.concatenate([s[1] for s in shards])
        t = Trainer(model, mode=args.mode, lr=args.lr, momentum=args.momentum, batch_size=args.batch_size,
                    seed=args.seed)
        assert t.trainable_names == names, "central and federated train different tensors"
        epochs = max(1, round(out["data_passes"]))  # the federated run's passes (exact when --fraction is 1)
        hist = t.fit((x, y), epochs, validation=(split.x_test, split.y_test))
        _, acc = t.evaluate(split.x_test, split.y_test)
        curve = [e.val_accuracy for e in hist.epochs]
        fed = out["federated"]["accuracy"]
        out["central"] = {"accuracy": acc, "epochs": epochs, "accuracy_per_epoch": curve,
                          # how many passes central training needed to reach the federated run's final accuracy
                          "passes_to_federated_accuracy": next((i + 1 for i, a in enumerate(curve) if a >= fed), None)}
        out["gap_points"] = 100 * (acc - out["federated"]["accuracy"])
    if args.drift:
        out["drift"] = measure_drift(final, shards, split, args)
    out["seconds"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    sys.exit(main())
