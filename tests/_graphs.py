"""Small ONNX graphs built with onnx.helper for the optimizer and shape tests,
and the before/after checks they share."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeflow.runtime.backends.numpy_backend import execute
from edgeflow.runtime.graph import compile_graph

F = TensorProto.FLOAT


def make(nodes, inputs, outputs, inits=None, *, opset=13, ir=8, check=True) -> onnx.ModelProto:
    """A model from nodes, (name, shape) inputs/outputs and {name: array} initializers."""
    ins = [i if isinstance(i, onnx.ValueInfoProto) else helper.make_tensor_value_info(i[0], F, i[1]) for i in inputs]
    outs = [o if isinstance(o, onnx.ValueInfoProto) else helper.make_tensor_value_info(o[0], F, o[1]) for o in outputs]
    g = helper.make_graph(nodes, "g", ins, outs,
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir
    if check:
        onnx.checker.check_model(m)
    return m


def const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value)))


def rand(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # compare ours, not ort's
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_numpy(model: onnx.ModelProto, feeds: dict, optimize: bool) -> list[np.ndarray]:
    g = compile_graph(model, optimize=optimize)
    env = execute(g, feeds)
    return [env[n] for n in g.output_names]


def assert_same_on_ort(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict, rtol=1e-5, atol=1e-6) -> None:
    onnx.checker.check_model(after)
    for a, b in zip(run_ort(before, feeds), run_ort(after, feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)


def dynamic_cnn(seed: int = 0) -> onnx.ModelProto:
    """x [N, 3, H, W] -> Conv -> Relu -> GlobalAveragePool -> Reshape to (N, C) through a
    Shape -> Gather -> Unsqueeze -> Concat subgraph (as torch exports ``y.view(y.size(0), y.size(1))``) -> Gemm."""
    rng = np.random.default_rng(seed)
    inits = {
        "w": rand(rng, 4, 3, 3, 3, scale=0.3), "b": rand(rng, 4), "fc.w": rand(rng, 5, 4), "fc.b": rand(rng, 5),
        "i0": np.array(0, np.int64), "i1": np.array(1, np.int64), "ax": np.array([0], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
        helper.make_node("Shape", ["p"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0, name="gather_n"),
        helper.make_node("Gather", ["s", "i1"], ["ch"], axis=0, name="gather_c"),
        helper.make_node("Unsqueeze", ["n", "ax"], ["n1"], name="unsq_n"),
        helper.make_node("Unsqueeze", ["ch", "ax"], ["c1"], name="unsq_c"),
        helper.make_node("Concat", ["n1", "c1"], ["shp"], axis=0, name="concat"),
        helper.make_node("Reshape", ["p", "shp"], ["flat"], name="reshape"),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["y"], transB=1, name="fc"),
    ]
    return make(nodes, [("x", ["N", 3, "H", "W"])], [("y", ["N", 5])], inits)
