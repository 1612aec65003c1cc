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
    python benchmarks/codec_moonshot.py --table out.json           # the table of a saved run again

Settings may add ``edgeflow simulate`` arguments (the FedAvgM rows: server momentum on the gateway; the
``dgc`` rows instead set topk-packed's ``momentum``, DGC's momentum correction on the device, with FedAvg);
``accuracy ok`` is always against the first row, dense with FedAvg. ``payload B`` is B/update less the
envelope of a simulated device's update (its real metadata, device id and sequence number).

Run it with ``nice -n 10`` and OMP_NUM_THREADS=1 on a shared machine: about
10 s per run for the MLP (2-core EPYC) when the machine is idle, 37 settings x seeds.
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

FEDAVGM = ["--strategy", "fedavgm", "--strategy-param", "server_lr=1.0", "--strategy-param"]
"""Server momentum (FedAvgM, Hsu et al. 2019) on the gateway: the sparse rows with it keep what top-k sends
moving across rounds, as DGC's momentum correction does on the device."""

SETTINGS: list[tuple] = [
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
    ("randk-packed 5% 1b", "randk-packed", {"ratio": 0.05, "bits": 1}),
    ("randk-packed 10% 1b", "randk-packed", {"ratio": 0.1, "bits": 1}),
    ("randk-packed 20% 1b", "randk-packed", {"ratio": 0.2, "bits": 1}),
    ("randk-packed 40% 1b", "randk-packed", {"ratio": 0.4, "bits": 1}),
    ("randk-packed 10% 2b", "randk-packed", {"ratio": 0.1, "bits": 2}),
    ("topk-packed 2% 2b digest", "topk-packed", {"ratio": 0.02, "bits": 2, "layout": "digest"}),
    ("topk-packed 2.5% 2b digest", "topk-packed", {"ratio": 0.025, "bits": 2, "layout": "digest"}),
    ("topk-packed 3% 1b digest", "topk-packed", {"ratio": 0.03, "bits": 1, "layout": "digest"}),
    ("topk-packed 3% 2b digest", "topk-packed", {"ratio": 0.03, "bits": 2, "layout": "digest"}),
    ("auto digest", "auto", {"layout": "digest"}),
    ("dense fedavgm 0.5", "dense", {}, [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 2% 2b digest fedavgm 0.5", "topk-packed", {"ratio": 0.02, "bits": 2, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 2% 1b digest fedavgm 0.5", "topk-packed", {"ratio": 0.02, "bits": 1, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 1.5% 2b digest fedavgm 0.5", "topk-packed", {"ratio": 0.015, "bits": 2, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 1.5% 1b digest fedavgm 0.5", "topk-packed", {"ratio": 0.015, "bits": 1, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 1.25% 2b digest fedavgm 0.5", "topk-packed", {"ratio": 0.0125, "bits": 2, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 1.25% 1b digest fedavgm 0.5", "topk-packed", {"ratio": 0.0125, "bits": 1, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 1% 1b digest fedavgm 0.5", "topk-packed", {"ratio": 0.01, "bits": 1, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 0.75% 1b digest fedavgm 0.5", "topk-packed", {"ratio": 0.0075, "bits": 1, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 1% 2b digest fedavgm 0.5", "topk-packed", {"ratio": 0.01, "bits": 2, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 0.5% 1b digest fedavgm 0.5", "topk-packed", {"ratio": 0.005, "bits": 1, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.5"]),
    ("topk-packed 0.5% 2b digest fedavgm 0.7", "topk-packed", {"ratio": 0.005, "bits": 2, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.7"]),
    ("topk-packed 0.25% 1b digest fedavgm 0.7", "topk-packed", {"ratio": 0.0025, "bits": 1, "layout": "digest"},
     [*FEDAVGM, "server_momentum=0.7"]),
    # DGC's momentum correction on the device (topk-packed's momentum option), FedAvg on the gateway
    *[(f"topk-packed {r}% {b}b digest dgc {m}", "topk-packed",
       {"ratio": float(r) / 100, "bits": b, "layout": "digest", "momentum": m})
      for r, b, m in [("3", 2, 0.5), ("2", 2, 0.5), ("2", 1, 0.5), ("1.5", 2, 0.5), ("1.5", 1, 0.5), ("1", 2, 0.5),
                      ("1", 1, 0.5), ("0.5", 1, 0.5), ("1", 2, 0.3), ("1.5", 2, 0.3), ("1", 1, 0.7), ("0.5", 1, 0.7),
                      ("1", 1, 0.9)]],
]
"""(label, codec, codec options[, more `edgeflow simulate` arguments]); the first is every seed's reference."""


def run_one(codec: str, opts: dict[str, object], seed: int, args: argparse.Namespace,
            extra: list[str] | None = None) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="moonshot-") as out:
        cmd = [sys.executable, "-m", "edgeflow", "simulate", "--devices", str(args.devices), "--rounds",
               str(args.rounds), "--model", args.model, "--seed", str(seed), "--codec", codec, "--out", out, "--json"]
        for k, v in opts.items():
            cmd += ["--codec-opt", f"{k}={v}"]
        cmd += extra or []
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
    """Bytes of one signed update of ``model`` with the metadata a simulated device sends, field by field,
    in envelope versions 2 (names) and 3 (layout digest): what a top-k update costs before its values."""
    import numpy as np
    from onnx import numpy_helper

    from edgeflow import zoo
    from edgeflow.codecs import encode_update
    from edgeflow.codecs.envelope import SIG_BLOCK, SectionInput, build_envelope
    from edgeflow.codecs.metadata import pack_metadata
    from edgeflow.codecs.packing import varint
    from edgeflow.signing import Signer

    build = {"mlp": zoo.digits_mlp, "cnn": zoo.digits_cnn}[model]
    shapes = {t.name: numpy_helper.to_array(t).shape for t in build(seed=0).graph.initializer}
    zeros = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    dense = 4 * sum(int(np.prod(s)) for s in shapes.values())
    budget = dense * TARGET_RATIO
    signer = Signer.generate(SIM_DEVICE)
    meta = {k: v for k, v in SIM_META.items() if k != "num_samples"}
    kw = {"round_id": 12, "device_id": SIM_DEVICE, "seq": SIM_SEQ, "signer": signer, "metadata": meta,
          "num_samples": SIM_META["num_samples"]}
    packed_meta = pack_metadata(SIM_META)
    empty = [SectionInput(n, 2, s, []) for n, s in shapes.items()]
    bare = {v: len(build_envelope(codec_id=6, round_id=12, seq=SIM_SEQ, device_id=SIM_DEVICE,
                                  metadata_json=packed_meta, sections=empty, version=v)) for v in (2, 3)}
    k1 = {v: len(encode_update(zeros, "topk-packed", k=1, layout=lay, **kw)) for v, lay in ((2, "names"), (3, "digest"))}
    names = sum(len(varint(len(n))) + len(n) + 2 + sum(len(varint(d)) for d in s) for n, s in shapes.items())
    parts = {
        "prefix: magic, version, flags, codec id": (7, 7),
        f"device id (length + {len(SIM_DEVICE)} B)": (1 + len(SIM_DEVICE),) * 2,
        f"metadata ({', '.join(SIM_META)}; binary)": (len(varint(len(packed_meta))) + len(packed_meta),) * 2,
        "tensor names, dtypes, shapes (v2) / layout digest + one dtype (v3)": (names, 9),
        "CRC-32": (4, 4),
        "key id + Ed25519 signature": (SIG_BLOCK, SIG_BLOCK),
    }
    rest = tuple(bare[v] + SIG_BLOCK - sum(p[i] for p in parts.values()) for i, v in enumerate((2, 3)))
    parts["header length, round id, seq (from the clock), tensor count, section lengths (varints)"] = rest
    floor = (bare[2] + SIG_BLOCK, bare[3] + SIG_BLOCK)
    print(f"{model}: {len(shapes)} tensors, dense fp32 {dense} B; 0.5% of it = {budget:.0f} B per update\n")
    print("| part | version 2 | version 3 |")
    print("| --- | ---: | ---: |")
    for name, (a, b) in parts.items():
        print(f"| {name} | {a} | {b} |")
    print(f"| **envelope, no values** | **{floor[0]}** | **{floor[1]}** |")
    print(f"| whole update with one value per tensor (topk-packed, k=1) | {k1[2]} | {k1[3]} |")
    print(f"| left for values under the {budget:.0f} B target | {budget - floor[0]:.0f} | {budget - floor[1]:.0f} |")
    import math

    print("\nIndex bytes of one update at each density, topk-packed's gap varints (mean over 20 random index sets)"
          " against the information bound log2 C(n, k) / 8 (no index code can do better on average):\n")
    print("| density | entries | gap varints B | bound B |")
    print("| ---: | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    for ratio in (0.005, 0.01, 0.02, 0.03):
        ks = {n: max(1, math.ceil(ratio * int(np.prod(s)))) for n, s in shapes.items()}
        varints = bound = 0.0
        for n, s in shapes.items():
            size, k = int(np.prod(s)), ks[n]
            bound += (math.lgamma(size + 1) - math.lgamma(k + 1) - math.lgamma(size - k + 1)) / math.log(2) / 8
            for _ in range(20):
                idx = np.sort(rng.choice(size, k, replace=False))
                varints += sum(len(varint(int(g))) for g in np.diff(idx, prepend=-1)) / 20
        print(f"| {ratio:.1%} | {sum(ks.values())} | {varints:.0f} | {bound:.0f} |")
    mac = floor[1] - SIG_BLOCK - 4 + 16
    print(f"\nNot built (a 16-byte HMAC tag instead of key id, signature and CRC): version 3 would be {mac} B "
          f"before values, leaving {budget - mac:.0f} B of the {budget:.0f}.")


SIM_META = {"loss": 1.1944174921315018, "base_version": 1, "train_s": 0.0389, "clock_skew_s": 0.036,
            "round_nonce": "b8a8c04ec6b23ccc", "num_samples": 362}
"""What a simulated device sends (edgeflow/federated/client.py ``_send``, read off a real run): its metadata,
device id and a sequence number started from the clock."""
SIM_DEVICE, SIM_SEQ = "dev002", 1796515999907


def envelope_bytes(model: str, codec: str, layout: str = "names") -> int:
    """Bytes of one signed update of ``model`` in ``codec``'s envelope with empty sections (names, shapes,
    section lengths, metadata of a simulated device, CRC, key id, signature): all but the codec's payload."""
    from onnx import numpy_helper

    from edgeflow import zoo
    from edgeflow.codecs.envelope import SIG_BLOCK, SectionInput, build_envelope
    from edgeflow.codecs.metadata import pack_metadata
    from edgeflow.codecs.registry import get_codec

    build = {"mlp": zoo.digits_mlp, "cnn": zoo.digits_cnn}[model]
    version = 3 if layout == "digest" else 2 if codec == "auto" else get_codec(codec).envelope_version
    meta = pack_metadata(SIM_META) if version >= 2 else json.dumps(SIM_META, separators=(",", ":")).encode()
    empty = [SectionInput(t.name, 2, tuple(numpy_helper.to_array(t).shape), [])
             for t in build(seed=0).graph.initializer]
    data = build_envelope(codec_id=1, round_id=12, seq=SIM_SEQ, device_id=SIM_DEVICE, metadata_json=meta,
                          sections=empty, version=version)
    return len(data) + SIG_BLOCK


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    """The curve as a markdown table; rows[0] is dense, the reference of every seed. ``payload B``: B/update
    less :func:`envelope_bytes` (what the codec's sections carry; within a few bytes: device ids, losses
    and sequence numbers differ in length between updates)."""
    dense = {s: r["accuracy"] for s, r in zip(args.seeds, rows[0]["runs"])}
    print(f"{args.model} ({args.params} values, {4 * args.params} B dense), {args.devices} devices, {args.rounds} "
          f"rounds, seeds {' '.join(map(str, args.seeds))}; target: upload ratio <= {TARGET_RATIO} and final "
          f"accuracy >= dense's - {TARGET_DROP} on every seed\n")
    print("| setting | upload ratio | B/update | payload B | final accuracy per seed | mean | vs dense (pt) | "
          "accuracy ok | target |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | --- | --- |")
    envelopes: dict[str, int] = {}
    for row in rows:
        runs = row["runs"]
        ratio = mean(r["ratio"] for r in runs)
        acc = mean(r["accuracy"] for r in runs)
        drop = acc - mean(dense.values())
        acc_ok = all(r["accuracy"] >= dense[s] - TARGET_DROP for s, r in zip(args.seeds, runs))
        per_seed = " ".join(f"{r['accuracy']:.4f}" for r in runs)
        per_update = mean(r["bytes_per_update"] for r in runs)
        key = f"{row['codec']} {row['options'].get('layout', 'names')}"
        if key not in envelopes:
            envelopes[key] = envelope_bytes(args.model, row["codec"], row["options"].get("layout", "names"))
        payload = per_update - envelopes[key]
        print(f"| {row['setting']} | {ratio:.4f} | {per_update:,.0f} | {payload:,.0f} | {per_seed} | "
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
    for label, codec, opts, *more in SETTINGS:
        if args.only and label not in args.only and label != "dense":
            continue
        extra = more[0] if more else []
        runs = [run_one(codec, opts, s, args, extra) for s in args.seeds]
        rows.append({"setting": label, "codec": codec, "options": opts, "simulate_args": extra, "runs": runs})
        print(f"  {label}: " + ", ".join(f"{r['accuracy']:.4f}@{r['ratio']:.4f}" for r in runs), file=sys.stderr)
    print_table(rows, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
