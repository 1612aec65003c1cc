"""What the graph optimizer buys on the numpy backend: latency of each model
compiled without it (``compile_graph(optimize=False)``: the graph as exported)
and with it (BN folding, activation fusion, Gemm pre-packing, folding), with
onnxruntime fp32 (its own optimizations on) as the peer — all measured in one
process, interleaved in rounds, one thread.

Models: the MLP and small CNN of benchmarks/inference.py, the CNN with
BatchNormalization (real statistics), and a MobileNetV2-style block
(1x1 expand, depthwise 3x3, 1x1 project, Conv+BN+ReLU6, residual add).

Target: optimized / unoptimized <= 1.0 on every model (the optimizer never
slows a model down).

    python benchmarks/optimizer.py [--runs 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeflow import zoo
from edgeflow.runtime.backends.numpy_backend import _set_blas_threads, execute
from edgeflow.runtime.graph import compile_graph

TARGET = 1.0


def _bn_stats(m: onnx.ModelProto, seed: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    for t in m.graph.initializer:
        if t.name.startswith("bn"):
            a = numpy_helper.to_array(t)
            kind = t.name.rsplit(".", 1)[1]
            new = rng.uniform(0.5, 2.0, a.shape) if kind in ("scale", "var") else rng.normal(0, 0.5, a.shape)
            t.CopyFrom(numpy_helper.from_array(new.astype(np.float32), t.name))
    return m


def mobile_block(c: int = 32, expand: int = 4, hw: int = 28, seed: int = 0) -> onnx.ModelProto:
    """x -> [1x1 Conv+BN+ReLU6] -> [3x3 depthwise Conv+BN+ReLU6] -> [1x1 Conv+BN] -> + x."""
    rng = np.random.default_rng(seed)
    e = c * expand
    inits: dict[str, np.ndarray] = {"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    nodes = []

    def conv_bn(x, cin, cout, k, group, name, relu6):
        inits[f"{name}.w"] = (rng.standard_normal((cout, cin // group, k, k)) * (2 / (cin // group * k * k)) ** 0.5
                              ).astype(np.float32)
        for p, v in (("s", rng.uniform(0.5, 1.5, cout)), ("b", rng.normal(0, 0.1, cout)),
                     ("m", rng.normal(0, 0.1, cout)), ("v", rng.uniform(0.5, 2, cout))):
            inits[f"{name}.bn.{p}"] = v.astype(np.float32)
        nodes.append(helper.make_node("Conv", [x, f"{name}.w"], [f"{name}.c"], kernel_shape=[k, k],
                                      pads=[k // 2] * 4, group=group, name=name))
        nodes.append(helper.make_node("BatchNormalization", [f"{name}.c"] + [f"{name}.bn.{p}" for p in "sbmv"],
                                      [f"{name}.bn"], name=f"{name}.bn"))
        if not relu6:
            return f"{name}.bn"
        nodes.append(helper.make_node("Clip", [f"{name}.bn", "lo", "hi"], [f"{name}.r"], name=f"{name}.relu6"))
        return f"{name}.r"

    y = conv_bn("input", c, e, 1, 1, "expand", True)
    y = conv_bn(y, e, e, 3, e, "dw", True)
    y = conv_bn(y, e, c, 1, 1, "project", False)
    nodes.append(helper.make_node("Add", [y, "input"], ["output"], name="residual"))
    g = helper.make_graph(nodes, "mobile_block",
                          [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", c, hw, hw])],
                          [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", c, hw, hw])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def models() -> dict[str, tuple[onnx.ModelProto, tuple[int, ...]]]:
    return {
        "mlp": (zoo.mlp((784, 512, 512, 10)), (784,)),
        "cnn": (zoo.small_cnn(), (1, 28, 28)),
        "cnn_bn": (_bn_stats(zoo.small_cnn(batch_norm=True)), (1, 28, 28)),
        "mobile_block": (mobile_block(), (32, 28, 28)),
    }


def _time(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench(runs: int, rounds: int = 10) -> list[dict]:
    import onnxruntime as ort

    _set_blas_threads(1)
    rng = np.random.default_rng(0)
    rows = []
    for name, (m, shape) in models().items():
        for batch in (1, 32):
            x = rng.standard_normal((batch, *shape)).astype(np.float32)
            plain, opt = compile_graph(m, optimize=False), compile_graph(m)
            so = ort.SessionOptions()
            so.intra_op_num_threads = so.inter_op_num_threads = 1
            so.log_severity_level = 3
            sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            iname, oname = plain.input_names[0], plain.output_names[0]
            ref = sess.run(None, {iname: x})[0]
            for g in (plain, opt):
                np.testing.assert_allclose(execute(g, {iname: x})[oname], ref, rtol=1e-3, atol=1e-3)
            fns = {"plain": lambda: execute(plain, {iname: x}), "optimized": lambda: execute(opt, {iname: x}),
                   "ort": lambda: sess.run(None, {iname: x})}
            samples: dict[str, list[float]] = {k: [] for k in fns}
            for f in fns.values():
                _time(f, 10)
            for _ in range(rounds):  # interleaved so that machine noise hits all three alike
                for k, f in fns.items():
                    samples[k] += _time(f, max(1, runs // rounds))
            med = {k: float(np.median(v)) for k, v in samples.items()}
            ratio = med["optimized"] / med["plain"]
            rows.append({
                "model": name, "batch": batch, "nodes_plain": len(plain.nodes), "nodes_optimized": len(opt.nodes),
                "plain_p50_ms": med["plain"], "optimized_p50_ms": med["optimized"], "ort_p50_ms": med["ort"],
                "plain_vs_ort": med["plain"] / med["ort"], "optimized_vs_ort": med["optimized"] / med["ort"],
                "ratio": ratio, "target": TARGET, "meets_target": ratio <= TARGET * 1.03,  # 3% timing noise
            })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300, help="timed runs per variant per case")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    rows = bench(args.runs)
    print("# numpy backend without / with the graph optimizer, onnxruntime fp32 as the peer, 1 thread")
    print(f"{'model':13} {'batch':>5} {'nodes':>7} {'plain ms':>9} {'opt ms':>8} {'ort ms':>8} "
          f"{'plain/ort':>9} {'opt/ort':>8} {'opt/plain':>9}  ok")
    for r in rows:
        print(f"{r['model']:13} {r['batch']:>5} {r['nodes_plain']:>3}->{r['nodes_optimized']:<3} "
              f"{r['plain_p50_ms']:>9.3f} {r['optimized_p50_ms']:>8.3f} {r['ort_p50_ms']:>8.3f} "
              f"{r['plain_vs_ort']:>9.2f} {r['optimized_vs_ort']:>8.2f} {r['ratio']:>9.2f}  "
              f"{'yes' if r['meets_target'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
