"""numpy backend: int8 vs fp32 on the real conv nets of the model suite.

Per model (fixed at the manifest's input shapes), on the numpy backend, one
thread, batch 1, CPU time per run (median of ``--runs`` after warm-up; the
three variants alternate ``--rounds`` times so that machine noise hits all):

- fp32: the model as shipped;
- static int8: ``edgeflow.quantize(..., engine="numpy")`` for ``--profile``
  (QDQ, per-channel int8 weights, calibrated on the model's real inputs,
  ``build_inputs(name, sample=k)``), which the numpy backend runs as fused
  integer kernels (QConv/QGemm: exact integer GEMMs on float32 sgemm, then
  requantization passes);
- weight-only int8 (``edgeflow.quantization.weight_only.weight_only_int8``):
  int8 weights in the file behind DequantizeLinear, float activations; the
  numpy backend folds the dequantization into float32 weights at load.

Reported: latency of each and its ratio to fp32, the serialized size ratio
int8 / fp32, and the fidelity against fp32 on a held-out real input (cosine
of the first output).

    python benchmarks/numpy_int8.py [--runs 10] [--rounds 2] [--only NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

CONV_NETS = ("orientation-pplcnet", "ocr-cls-ppocr-mobile-v2", "ocr-rec-ppocrv4", "ocr-det-ppocrv4",
             "nudenet-yolov8n-320")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    den = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / den) if den else float(np.array_equal(a, b))


def bench_model(name: str, profile: str, runs: int, rounds: int, calib_samples: int) -> dict:
    import edgeflow
    from edgeflow import model_suite as ms
    from edgeflow.runtime.backends import SessionOptions, get_backend
    from edgeflow.errors import EdgeflowError
    from edgeflow.runtime.model import fix_input_shapes
    from edgeflow.runtime.optimize import optimize_model
    from edgeflow.quantization.weight_only import weight_only_int8

    model = fix_input_shapes(ms.load(name), ms.get(name).input_shapes, source="the manifest")
    feeds = ms.build_inputs(name)
    held_out = ms.build_inputs(name, sample=calib_samples)
    row: dict = {"model": name, "profile": profile, "fp32_bytes": model.ByteSize()}
    variants = {"fp32": model, "weight_only": weight_only_int8(model)}
    try:
        samples = [ms.build_inputs(name, sample=k) for k in range(calib_samples)]
        (inp,) = [k for k in feeds]
        calib = np.concatenate([s[inp] for s in samples])
        q = edgeflow.quantize(optimize_model(model), profile, calibration=calib, engine="numpy", method="static",
                              latency_runs=0)
        variants["static"] = q.model
    except (EdgeflowError, ValueError) as exc:
        row["static_error"] = str(exc).splitlines()[0][:200]
    sessions = {k: get_backend("numpy").load(m, SessionOptions(threads=1)) for k, m in variants.items()}
    ref = sessions["fp32"].run(held_out)
    first = next(iter(ref))
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(rounds):
        for k, s in sessions.items():
            s.run(feeds)
            for _ in range(runs):
                c = time.process_time()
                s.run(feeds)
                times[k].append((time.process_time() - c) * 1e3)
    for k, m in variants.items():
        row[f"{k}_ms"] = float(np.median(times[k]))
        row[f"{k}_bytes"] = m.ByteSize()
        if k != "fp32":
            row[f"{k}_vs_fp32"] = row[f"{k}_ms"] / row["fp32_ms"]
            row[f"{k}_size_ratio"] = m.ByteSize() / row["fp32_bytes"]
            row[f"{k}_cosine"] = _cosine(sessions[k].run(held_out)[first], ref[first])
    return row


def markdown(rows: list[dict]) -> str:
    f = lambda r, k, spec=".2f": format(r[k], spec) if k in r else "-"  # noqa: E731
    lines = ["| model | fp32 ms | static int8 ms (x fp32) | size | cosine | weight-only int8 ms (x fp32) | size | cosine |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        static = (f"{f(r, 'static_ms')} ({f(r, 'static_vs_fp32')}x)" if "static_ms" in r
                  else f"fails: {r.get('static_error', '?')}")
        lines.append(f"| {r['model']} | {f(r, 'fp32_ms')} | {static} | {f(r, 'static_size_ratio', '.3f')} | "
                     f"{f(r, 'static_cosine', '.4f')} | {f(r, 'weight_only_ms')} ({f(r, 'weight_only_vs_fp32')}x) | "
                     f"{f(r, 'weight_only_size_ratio', '.3f')} | {f(r, 'weight_only_cosine', '.4f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", default="x86-gateway")
    ap.add_argument("--calibration-samples", type=int, default=8)
    ap.add_argument("--only", nargs="+", metavar="NAME")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    for name in args.only or CONV_NETS:
        t0 = time.monotonic()
        rows.append(bench_model(name, args.profile, args.runs, args.rounds, args.calibration_samples))
        r = rows[-1]
        print(f"[numpy_int8] {name}: fp32 {r['fp32_ms']:.2f} ms, static {r.get('static_ms', float('nan')):.2f}, "
              f"weight-only {r['weight_only_ms']:.2f} [{time.monotonic() - t0:.0f} s]", file=sys.stderr, flush=True)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
