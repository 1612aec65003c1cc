"""Inference latency: edgeflow's numpy backend vs onnxruntime fp32, one run.

MLP 784-512-512-10 and the small CNN (1x28x28, conv 32/64) at batch 1 and 32,
single thread on both sides (numpy's BLAS limited with threadpoolctl,
onnxruntime with intra_op_num_threads=1). Both are timed in the same process,
interleaved in rounds, so machine noise hits both alike.

Targets (issue 2): numpy/ort <= 2x on the MLP, <= 4x on the CNN.

    python benchmarks/inference.py [--runs 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from edgeflow import zoo
from edgeflow.runtime.session import load

TARGETS = {"mlp": 2.0, "cnn": 4.0}


def _time(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench(runs: int, rounds: int = 5) -> list[dict]:
    models = {"mlp": (zoo.mlp((784, 512, 512, 10)), (784,)), "cnn": (zoo.small_cnn(), (1, 28, 28))}
    rows = []
    rng = np.random.default_rng(0)
    for name, (model, shape) in models.items():
        for batch in (1, 32):
            x = rng.standard_normal((batch, *shape)).astype(np.float32)
            rts = {b: load(model, "x86-gateway", backend=b, threads=1, batch_size=batch) for b in ("numpy", "ort")}
            np.testing.assert_allclose(rts["numpy"](x), rts["ort"](x), rtol=1e-3, atol=1e-3)
            samples: dict[str, list[float]] = {"numpy": [], "ort": []}
            for b, rt in rts.items():  # warm up
                _time(lambda: rt.run(x), 20)
            for _ in range(rounds):  # interleave so noise hits both
                for b, rt in rts.items():
                    samples[b] += _time(lambda: rt.run(x), max(1, runs // rounds))
            med = {b: float(np.median(s)) for b, s in samples.items()}
            p95 = {b: float(np.percentile(s, 95)) for b, s in samples.items()}
            ratio = med["numpy"] / med["ort"]
            rows.append({
                "model": name, "batch": batch,
                "numpy_p50_ms": med["numpy"], "ort_p50_ms": med["ort"],
                "numpy_p95_ms": p95["numpy"], "ort_p95_ms": p95["ort"],
                "ratio": ratio, "target": TARGETS[name], "meets_target": ratio <= TARGETS[name],
            })
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import onnxruntime

    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}, "
            f"onnxruntime {onnxruntime.__version__}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200, help="timed runs per backend per case")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    rows = bench(args.runs)
    print(f"# inference: numpy backend vs onnxruntime fp32, 1 thread\n# {machine()}")
    print(f"{'model':6} {'batch':>5} {'numpy p50 ms':>13} {'ort p50 ms':>11} {'ratio':>6} {'target':>7}  ok")
    for r in rows:
        print(f"{r['model']:6} {r['batch']:>5} {r['numpy_p50_ms']:>13.3f} {r['ort_p50_ms']:>11.3f} "
              f"{r['ratio']:>6.2f} {'<=' + str(r['target']):>7}  {'yes' if r['meets_target'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
