"""Bytes uploaded vs final accuracy of federated digits, per codec (issue 34, the communication moonshot).

Each point is one ``edgeflow simulate`` run (a real gateway and 20 devices
over a Mosquitto the simulation starts; digits, Dirichlet 0.3, 30 rounds by
default) with one codec setting and one seed. ``upload_ratio`` is what the
simulation reports: every byte the devices published as updates (envelope,
names, metadata, signature included) over dense fp32 of the same updates
(4 bytes per value per update). The target: upload ratio <= 0.005 and final
accuracy >= dense's final accuracy - 0.005 (seed by seed, and on the mean).

    python benchmarks/codec_moonshot.py [--seeds 0 1 2] [--model mlp] [--rounds 30] [--json out.json]
    python benchmarks/codec_moonshot.py --overhead [--model mlp]   # bytes per update before any value

Run it with ``nice -n 10`` and OMP_NUM_THREADS=1 on a shared machine: about
10 s per run for the MLP (2-core EPYC), 27 settings x seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from statistics import mean

TARGET_RATIO = 0.005
TARGET_DROP = 0.005

SETTINGS: list[tuple[str, str, dict[str, object]]] = [
    ("dense", "dense", {}),
    ("int8", "int8", {}),
    ("topk-int8 1%", "topk-int8", {"ratio": 0.01}),
    ("topk-int8 3%", "topk-int8", {"ratio": 0.03}),
    ("topk-packed 0.5% 2b", "topk-packed", {"ratio": 0.005, "bits": 2}),
    ("topk-packed 1% 1b", "topk-packed", {"ratio": 0.01, "bits": 1}),
    ("topk-packed 1% 2b", "topk-packed", {"ratio": 0.01, "bits": 2}),
    ("topk-packed 2% 1b", "topk-packed", {"ratio": 0.02, "bits": 1}),
    ("topk-packed 2% 2b", "topk-packed", {"ratio": 0.02, "bits": 2}),
    ("topk-packed 2% 2b min_k 8", "topk-packed", {"ratio": 0.02, "bits": 2, "min_k": 8}),
    ("topk-packed 3% 1b", "topk-packed", {"ratio": 0.03, "bits": 1}),
    ("topk-packed 3% 2b", "topk-packed", {"ratio": 0.03, "bits": 2}),
    ("topk-packed 5% 4b", "topk-packed", {"ratio": 0.05, "bits": 4}),
    ("auto", "auto", {}),
]


def run_one(codec: str, opts: dict[str, object], seed: int, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="moonshot-") as out:
        cmd = [sys.executable, "-m", "edgeflow", "simulate", "--devices", str(args.devices), "--rounds",
               str(args.rounds), "--model", args.model, "--seed", str(seed), "--codec", codec, "--out", out, "--json"]
        for k, v in opts.items():
            cmd += ["--codec-opt", f"{k}={v}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        d = json.loads(proc.stdout)
    updates = d["dense_bytes"] / (4 * args.params) if args.params else 0
    return {"accuracy": d["final_accuracy"], "ratio": d["upload_ratio"], "bytes": d["uploaded_bytes"],
            "bytes_per_update": d["uploaded_bytes"] / updates if updates else 0.0}


def model_params(model: str) -> int:
    from edgeflow import zoo
    from onnx import numpy_helper

    build = {"mlp": zoo.digits_mlp, "cnn": zoo.digits_cnn}.get(model)
    if build is None:
        return 0
    return sum(int(numpy_helper.to_array(t).size) for t in build(seed=0).graph.initializer)


def overhead_table(model: str) -> None:
    """Bytes of one signed update of ``model`` with the metadata a simulated device sends, by part:
    the least a top-k update costs (one value per tensor), in both envelope versions."""
    import numpy as np
    from onnx import numpy_helper

    from edgeflow import zoo
    from edgeflow.codecs import encode_update
    from edgeflow.codecs.metadata import pack_metadata
    from edgeflow.signing import Signer

    build = {"mlp": zoo.digits_mlp, "cnn": zoo.digits_cnn}[model]
    shapes = {t.name: numpy_helper.to_array(t).shape for t in build(seed=0).graph.initializer}
    zeros = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    dense = 4 * sum(int(np.prod(s)) for s in shapes.values())
    signer = Signer.generate("sim-007")
    meta = {"loss": 0.19933363285071554, "base_version": 12, "round_nonce": "9f3c0a1b2c3d4e5f"}
    full = {**meta, "num_samples": 72}
    kw = {"round_id": 12, "device_id": "sim-007", "seq": 12, "signer": signer, "metadata": meta, "num_samples": 72}
    v1 = len(encode_update(zeros, "topk-int8", k=1, **kw))
    v2 = len(encode_update(zeros, "topk-packed", k=1, **kw))
    names = sum(len(n) for n in shapes)
    json_meta = len(json.dumps(full, separators=(",", ":"), sort_keys=True))
    print(f"{model}: {len(shapes)} tensors, dense fp32 {dense} B; 0.5% of it = {dense * 0.005:.0f} B per update\n")
    print("| part | version 1 | version 2 |")
    print("| --- | ---: | ---: |")
    print(f"| whole update with one value per tensor (topk-int8 / topk-packed, k=1) | {v1} | {v2} |")
    print("| of which Ed25519 signature + key id | 72 | 72 |")
    print(f"| of which metadata | {json_meta} | {len(pack_metadata(full))} |")
    print(f"| of which tensor names | {names} | {names} |")
    print(f"| as a share of dense | {v1 / dense:.4f} | {v2 / dense:.4f} |")


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    """The curve as a markdown table; rows[0] is dense, the reference of every seed."""
    dense = {s: r["accuracy"] for s, r in zip(args.seeds, rows[0]["runs"])}
    print(f"{args.model} ({args.params} values, {4 * args.params} B dense), {args.devices} devices, {args.rounds} "
          f"rounds, seeds {' '.join(map(str, args.seeds))}; target: upload ratio <= {TARGET_RATIO} and final "
          f"accuracy >= dense's - {TARGET_DROP} on every seed\n")
    print("| setting | upload ratio | B/update | final accuracy per seed | mean | vs dense (pt) | accuracy ok | target |")
    print("| --- | ---: | ---: | --- | ---: | ---: | --- | --- |")
    for row in rows:
        runs = row["runs"]
        ratio = mean(r["ratio"] for r in runs)
        acc = mean(r["accuracy"] for r in runs)
        drop = acc - mean(dense.values())
        acc_ok = all(r["accuracy"] >= dense[s] - TARGET_DROP for s, r in zip(args.seeds, runs))
        per_seed = " ".join(f"{r['accuracy']:.4f}" for r in runs)
        print(f"| {row['setting']} | {ratio:.4f} | {mean(r['bytes_per_update'] for r in runs):,.0f} | {per_seed} | "
              f"{acc:.4f} | {100 * drop:+.2f} | {'yes' if acc_ok else 'no'} | "
              f"{'met' if acc_ok and ratio <= TARGET_RATIO else 'no'} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--devices", type=int, default=20)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--model", default="mlp")
    p.add_argument("--only", nargs="*", help="setting labels to run (default: all)")
    p.add_argument("--json", help="write every run here")
    p.add_argument("--overhead", action="store_true", help="only print the per-update bytes before any value")
    p.add_argument("--table", help="print the table of a --json file again, without running")
    args = p.parse_args()
    if args.table:
        with open(args.table, encoding="utf-8") as f:
            saved = json.load(f)
        print_table(saved["rows"], argparse.Namespace(**saved["args"]))
        return 0
    if args.overhead:
        overhead_table(args.model)
        return 0
    args.params = model_params(args.model)
    rows = []
    for label, codec, opts in SETTINGS:
        if args.only and label not in args.only and label != "dense":
            continue
        runs = [run_one(codec, opts, s, args) for s in args.seeds]
        rows.append({"setting": label, "codec": codec, "options": opts, "runs": runs})
        print(f"  {label}: " + ", ".join(f"{r['accuracy']:.4f}@{r['ratio']:.4f}" for r in runs), file=sys.stderr)
    print_table(rows, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
