"""Federated fine-tuning of a real pretrained model vs training the same tensors centrally.

    python benchmarks/federated_finetune.py [--model ocr-cls-ppocr-mobile-v2] [--mode bias]
        [--devices 10] [--rounds 6] [--epochs 1] [--codec int8] [--alpha 0.5] [--json]

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
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
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
    ap.add_argument("--no-central", action="store_true", help="skip the central peer")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        f, c = result["federated"], result.get("central")
        print(f"{args.model}, mode {args.mode}, {args.devices} devices (alpha {args.alpha}), {args.rounds} rounds "
              f"x {args.epochs} epoch(s), codec {args.codec}: {result['trainable_tensors']} tensors "
              f"({result['trainable_values']:,} values) federated")
        print(f"  federated accuracy {100 * f['accuracy']:.1f}% (per round: "
              f"{', '.join(f'{100 * a:.1f}' for a in f['accuracy_per_round'])})")
        if c:
            print(f"  central accuracy   {100 * c['accuracy']:.1f}% (same tensors, lr, batch, {c['epochs']} epochs)")
        b = result["bytes"]
        print(f"  uploaded per round {b['uploaded_per_round']:,} B; whole model {b['whole_model_per_round']:,} B "
              f"({b['ratio_vs_whole_model']:.4f}x); dense fp32 of the federated tensors "
              f"{b['dense_per_round']:,} B ({b['ratio_vs_dense']:.3f}x)")
        print(f"  {result['seconds']:.0f} s")
    return 0


def run(args) -> dict:
    import numpy as np

    from edgeflow.sim.simulation import SimConfig, SimulatedFleet
    from edgeflow.train import Trainer

    t0 = time.perf_counter()
    cfg = SimConfig(devices=args.devices, rounds=args.rounds, model=args.model, train_mode=args.mode,
                    input_size=args.input_size, alpha=args.alpha, seed=args.seed, codec=args.codec,
                    epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                    deadline_s=args.deadline, quorum=1.0, min_clients=args.devices)
    with SimulatedFleet(cfg, args.broker) as fleet:
        metrics = fleet.run()
        up, dense = fleet.upload_bytes()
        names = fleet.trainable_names
        model = fleet.model
        split = fleet.split
        shards = [(d.client.x, d.client.y) for d in fleet.devices]
    whole = len(model.SerializeToString())
    inits = {t.name: t for t in model.graph.initializer}
    n_values = sum(int(np.prod(inits[n].dims)) for n in names)
    out = {
        "model": args.model, "mode": args.mode, "devices": args.devices, "rounds": args.rounds,
        "epochs": args.epochs, "codec": args.codec, "alpha": args.alpha, "input_size": args.input_size,
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
        epochs = args.rounds * args.epochs
        t.fit((x, y), epochs)
        _, acc = t.evaluate(split.x_test, split.y_test)
        out["central"] = {"accuracy": acc, "epochs": epochs}
    out["seconds"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    sys.exit(main())
