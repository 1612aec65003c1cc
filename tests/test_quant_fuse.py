"""The numpy backend's QDQ rewrite: which patterns become integer kernels,
that the fused result equals onnxruntime's (within one quantization step —
in practice bit for bit), and that what does not match stays correct."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeflow import zoo
from edgeflow.runtime.backends.numpy_backend import execute
from edgeflow.runtime.graph import compile_graph
from edgeflow.runtime.memory import plan_memory
from edgeflow.runtime.optimize.passes import fuse_qdq

ort = pytest.importorskip("onnxruntime")


def _ort_qdq(model: onnx.ModelProto, shape: tuple[int, ...], n: int = 64, seed: int = 0) -> onnx.ModelProto:
    """onnxruntime's own quantize_static output (QDQ, per channel, u8/s8)."""
    from edgeflow.quantization.data import CalibrationSet
    from edgeflow.quantization.ort_backend import quantize_static_ort

    rng = np.random.default_rng(seed)
    data = CalibrationSet({"input": rng.random((n, *shape), dtype=np.float32)})
    return quantize_static_ort(model, data, method="minmax", activations="uint8", per_channel=True, exclude=[])


def _ort_run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    # exact u8 x s8 on x86 without VNNI (else int16 pair sums saturate), as edgeflow's ort backend sets it
    so.add_session_config_entry("session.x64quantprecision", "1")
    return ort.InferenceSession(model.SerializeToString(), so).run(None, {"input": x})[0]


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def test_float_models_are_left_alone():
    g = compile_graph(zoo.digits_cnn())
    assert [n.op_type for n in g.nodes] == ["Conv", "MaxPool", "Conv", "MaxPool", "Flatten", "Gemm", "Gemm"]
    assert fuse_qdq(g) is g


def test_onnxruntime_qdq_cnn_runs_as_integer_kernels_and_matches_onnxruntime():
    q = _ort_qdq(zoo.small_cnn((1, 12, 12), channels=(8, 16), hidden=32), (1, 12, 12))
    g = compile_graph(q)
    assert [(n.domain, n.op_type) for n in g.nodes] == [
        ("", "QuantizeLinear"), ("edgeflow.fused", "QConv"), ("", "MaxPool"), ("edgeflow.fused", "QConv"),
        ("", "MaxPool"), ("", "Flatten"), ("edgeflow.fused", "QGemm"), ("edgeflow.fused", "QGemm"),
        ("", "DequantizeLinear"),
    ]
    # MaxPool and Flatten now run on uint8; every initializer is read by some node
    x = np.random.default_rng(1).random((16, 1, 12, 12), dtype=np.float32)
    env = execute(g, {"input": x})
    assert env["logits"].dtype == np.float32
    read = {i for n in g.nodes for i in n.inputs}
    assert set(g.initializers) <= read
    step = _init(q, "logits_scale")
    y_ort = _ort_run(q, x)
    y_unfused = execute(compile_graph(q, optimize=False), {"input": x})["logits"]
    assert np.abs(env["logits"] - y_ort).max() <= step * 1.001
    assert np.abs(env["logits"] - y_unfused).max() <= step * 1.001
    assert np.mean(env["logits"] == y_ort) > 0.99  # the same integer arithmetic as onnxruntime


def test_long_reductions_are_split_into_exact_blocks():
    q = _ort_qdq(zoo.small_cnn(), (1, 28, 28), n=32)  # fc0: K = 64 * 7 * 7 = 3136
    g = compile_graph(q)
    fc0 = next(n for n in g.nodes if n.name.startswith("fc0"))
    assert fc0.op_type == "QGemm" and len(fc0.attrs["blocks"]) > 2
    x = np.random.default_rng(2).random((8, 1, 28, 28), dtype=np.float32)
    y = execute(g, {"input": x})["logits"]
    assert np.abs(y - _ort_run(q, x)).max() <= _init(q, "logits_scale") * 1.001


def test_oversized_int32_bias_is_added_exactly():
    """A dead hidden unit (weights ~1e-9, bias 1) makes onnxruntime write an
    int32 bias near 2**31: the fused kernel adds it in float64, wrapping like int32."""
    m = zoo.mlp((16, 8, 4), seed=3)
    w = numpy_helper.to_array(m.graph.initializer[0]).copy()
    w[2] = 1e-9
    b = np.zeros(8, np.float32)
    b[2] = 1.0
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, m.graph.initializer[0].name))
    m.graph.initializer[1].CopyFrom(numpy_helper.from_array(b, m.graph.initializer[1].name))
    q = _ort_qdq(m, (16,))
    assert np.abs(_init(q, "fc0.bias_quantized")).max() > 2**24
    g = compile_graph(q)
    fc0 = next(n for n in g.nodes if n.name.startswith("fc0"))
    assert fc0.op_type == "QGemm" and fc0.attrs["c64"] is not None
    x = np.random.default_rng(4).random((32, 16), dtype=np.float32)
    y = execute(g, {"input": x})["logits"]
    assert np.abs(y - _ort_run(q, x)).max() <= _init(q, "logits_scale") * 1.001


def _qdq_gemm(bias_scale_factor: float, pool_out_scale: float | None = None) -> onnx.ModelProto:
    """x -> Q -> DQ -> Gemm(DQ(w), DQ(b)) -> Q -> DQ -> y, built by hand."""
    rng = np.random.default_rng(5)
    xs, ws, ys = np.float32(0.02), np.full(3, 0.01, np.float32), np.float32(0.05)
    inits = {
        "xs": xs, "xz": np.uint8(7), "ys": ys, "yz": np.uint8(128),
        "wq": rng.integers(-127, 128, (3, 4)).astype(np.int8), "ws": ws, "wz": np.zeros(3, np.int8),
        "bq": rng.integers(-500, 500, 3).astype(np.int32), "bs": (xs * ws * bias_scale_factor).astype(np.float32),
        "bz": np.zeros(3, np.int32),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["bd"], axis=0),
        helper.make_node("Gemm", ["xd", "wd", "bd"], ["g"], transB=1),
        helper.make_node("QuantizeLinear", ["g", "ys", "yz"], ["gq"]),
        helper.make_node("DequantizeLinear", ["gq", "ys", "yz"], ["y"]),
    ]
    if pool_out_scale is not None:  # ... -> DQ -> Reshape -> Q(other scale) -> DQ
        inits["ps"] = np.float32(pool_out_scale)
        inits["shape"] = np.array([-1, 3], np.int64)
        nodes[-1] = helper.make_node("DequantizeLinear", ["gq", "ys", "yz"], ["gd"])
        nodes += [
            helper.make_node("Reshape", ["gd", "shape"], ["r"]),
            helper.make_node("QuantizeLinear", ["r", "ps", "yz"], ["rq"]),
            helper.make_node("DequantizeLinear", ["rq", "ps", "yz"], ["y"]),
        ]
    g = helper.make_graph(nodes, "h", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def test_patterns_that_do_not_match_stay_float_and_exact():
    x = np.random.default_rng(6).standard_normal((10, 4)).astype(np.float32)
    ok = compile_graph(_qdq_gemm(1.0))
    assert any(n.op_type == "QGemm" for n in ok.nodes)
    # a bias whose scale is not x_scale * w_scale cannot be added to the accumulator
    m = _qdq_gemm(3.0)
    g = compile_graph(m)
    assert not any(n.domain for n in g.nodes) and any(n.op_type == "Gemm" for n in g.nodes)
    np.testing.assert_array_equal(execute(g, {"x": x})["y"], execute(compile_graph(m, optimize=False), {"x": x})["y"])
    # a Reshape between different scales is not a pass-through
    m2 = _qdq_gemm(1.0, pool_out_scale=0.07)
    g2 = compile_graph(m2)
    reshape = next(n for n in g2.nodes if n.op_type == "Reshape")
    assert reshape.inputs[0] == "gd"  # still on the dequantized floats
    np.testing.assert_allclose(execute(g2, {"x": x})["y"], execute(compile_graph(m2, optimize=False), {"x": x})["y"],
                               atol=0.07 * 1.001)


def test_memory_plan_counts_the_packed_weights():
    q = _ort_qdq(zoo.small_cnn((1, 12, 12), channels=(8, 16), hidden=32), (1, 12, 12))
    g = compile_graph(q)
    plan = plan_memory(g, batch_size=4)
    assert plan.weights_bytes == sum(a.nbytes for a in g.initializers.values())
    assert plan.peak_activation_bytes > 0 and not plan.unknown
