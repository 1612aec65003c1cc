"""Scalar Mul/Add chains folded into the scale and zero point of the integers they read
(edgeflow.quantization.affine), and the output Softmax kept float (edgeflow.quantization.readout),
through the whole quantize() on onnxruntime: the float meaning stays within quantization noise,
and onnxruntime's fused int8 graph computes what the QDQ graph means."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import edgeflow
from _graphs import make, rand, run_ort
from edgeflow.quantization.affine import fold_scalar_affine
from edgeflow.quantization.readout import dequantize_readouts, float_readouts

ort = pytest.importorskip("onnxruntime")


def _lab(a: float, b: float, act: str = "Relu", seed: int = 0) -> onnx.ModelProto:
    """Conv -> act -> Mul(a) -> Add(b) -> padded 3x3 Conv: PP-OCRv4's "learnable affine block"."""
    rng = np.random.default_rng(seed)
    inits = {"w1": rand(rng, 8, 8, 3, 3, scale=0.3), "b1": rand(rng, 8), "a": np.array([a], np.float32),
             "b": np.array([b], np.float32), "w2": rand(rng, 8, 8, 3, 3, scale=0.3), "b2": rand(rng, 8)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node(act, ["c"], ["h"]),
             helper.make_node("Mul", ["h", "a"], ["m"]), helper.make_node("Add", ["m", "b"], ["l"]),
             helper.make_node("Conv", ["l", "w2", "b2"], ["y"], pads=[1, 1, 1, 1])]
    return make(nodes, [("x", [1, 8, 12, 12])], [("y", [1, 8, 12, 12])], inits, opset=14)


def _quantize(m: onnx.ModelProto, seed: int = 1):
    x = np.random.default_rng(seed).standard_normal((24, 8, 12, 12)).astype(np.float32)
    return edgeflow.quantize(m, "x86-gateway", calibration=x, backend="ort", batch_size=1, latency_runs=0,
                             sensitivity=False, max_loss=None)


def _ort(m: onnx.ModelProto, x: np.ndarray, optimized: bool = True) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _cos(a, b) -> float:
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("a,b,act", [(1.3, -0.25, "Relu"), (0.7, -0.4, "HardSwish"), (1.0, 0.05, "HardSwish")])
def test_a_scalar_affine_after_an_activation_costs_no_int8_op(a, b, act):
    m = _lab(a, b, act)
    q = _quantize(m)
    ops = [n.op_type for n in q.model.graph.node]
    assert "Mul" not in ops or act == "HardSwish"  # HardSwish's own Mul (int8 x * HardSigmoid(x)) stays
    assert sum(n.op_type == "Add" for n in q.model.graph.node) == (1 if act == "HardSwish" else 0)
    assert any("1 Mul/Add by a scalar" in note for note in q.report.notes), q.report.notes
    x = np.random.default_rng(7).standard_normal((1, 8, 12, 12)).astype(np.float32)
    ref = run_ort(m, {"x": x})[0]
    assert _cos(ref, _ort(q.model, x)) > 0.999
    # onnxruntime's fused QLinearConv reads the requantized int32 bias as the QDQ graph means it
    np.testing.assert_allclose(_ort(q.model, x), _ort(q.model, x, optimized=False), atol=0.05 * np.abs(ref).max())


def test_the_fold_is_within_quantization_noise_of_the_chain_it_replaces():
    m = _lab(1.3, -0.25)
    x = np.random.default_rng(3).standard_normal((1, 8, 12, 12)).astype(np.float32)
    q = _quantize(m).model
    assert "Add" not in [n.op_type for n in q.graph.node]
    ref = run_ort(m, {"x": x})[0]  # the QDQ graph's own meaning (no fusion) against fp32
    err = np.abs(_ort(q, x, optimized=False) - ref)
    assert np.median(err) < 0.02 * np.abs(ref).max()


def test_chains_that_clamp_or_flip_sign_or_shift_out_of_range_stay():
    # a negative scale would need a negative zero-point step: left as int8 Mul
    q = _quantize(_lab(-1.5, 0.1)).model
    assert "Mul" in [n.op_type for n in q.graph.node]
    # after a Relu the integers' zero point is 0: + 2.0 would need it at -53, outside uint8
    q = _quantize(_lab(1.0, 2.0)).model
    assert "Add" in [n.op_type for n in q.graph.node]
    # HardSwish's own x + 3 before its clamp (edgeflow.quantization.hardswish) must keep its QuantizeLinear:
    # folding it would drop the clamp. The model still matches fp32.
    m = _lab(1.0, 0.0, "HardSwish")
    q = _quantize(m)
    x = np.random.default_rng(5).standard_normal((1, 8, 12, 12)).astype(np.float32)
    assert _cos(run_ort(m, {"x": x})[0], _ort(q.model, x)) > 0.999
    again, n = fold_scalar_affine(q.model)
    assert n == 0 and again is q.model  # nothing left to fold, and the clamp chain was not taken


def _classifier() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    inits = {"w": rand(rng, 8, 8, 3, 3, scale=0.3), "fc": rand(rng, 8 * 12 * 12, 10, scale=0.05)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]), helper.make_node("MatMul", ["f", "fc"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["s"], axis=-1, name="readout"), helper.make_node("Reshape", ["s", "shape"], ["y"])]
    inits["shape"] = np.array([1, 10], np.int64)
    return make(nodes, [("x", [1, 8, 12, 12])], [("y", [1, 10])], inits, opset=14)


def test_the_softmax_that_writes_the_output_stays_float():
    m = _classifier()
    assert float_readouts(m) == ["readout"]  # through the Reshape to the output
    q = _quantize(m)
    prod = {o: n for n in q.model.graph.node for o in n.output}
    soft = next(n for n in q.model.graph.node if n.op_type == "Softmax")
    readers = [n for n in q.model.graph.node if soft.output[0] in n.input]
    assert [r.op_type for r in readers] == ["Reshape"] and prod["y"].op_type == "Reshape"  # no Q after it
    assert any("Softmax writing a model output kept float" in note for note in q.report.notes)
    x = np.random.default_rng(4).standard_normal((1, 8, 12, 12)).astype(np.float32)
    assert np.argmax(_ort(q.model, x)) == np.argmax(run_ort(m, {"x": x})[0])
    # a Softmax whose output is read further on is not a readout
    inner = _classifier()
    inner.graph.node.append(helper.make_node("Relu", ["s"], ["z"]))
    inner.graph.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1, 10]))
    assert float_readouts(inner) == []
    assert dequantize_readouts(q.model, []) == (q.model, 0)
