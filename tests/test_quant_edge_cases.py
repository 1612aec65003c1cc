"""Quantization on models as users bring them: old opsets, fixed batches, onnxruntime's errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import edgeflow
from edgeflow import zoo
from edgeflow.runtime.session import load
from edgeflow.errors import QuantizationError
from edgeflow.runtime.model import model_opset
from edgeflow.quantization import quantize
from edgeflow.quantization.data import CalibrationSet, full_batches

ort = pytest.importorskip("onnxruntime")


def _x(n: int, d: int = 64) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)


def _dq_axes(model: onnx.ModelProto) -> list[int | None]:
    out = []
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear":
            out.append(next((a.i for a in n.attribute if a.name == "axis"), None))
    return out


@pytest.mark.parametrize("engine", ["ort", "numpy"])
def test_opset_11_model_is_upgraded_for_per_channel_weights(engine):
    m = zoo.mlp((64, 32, 10), opset=11)
    q = quantize(m, "x86-gateway", _x(64), engine=engine, latency_runs=0, max_loss=None)
    onnx.checker.check_model(q.model)  # before: "Unrecognized attribute: axis for operator DequantizeLinear"
    assert model_opset(q.model) >= 13
    assert any("upgraded from opset 11 to 13" in n for n in q.report.notes), q.report.notes
    # per-channel weights: a weight DequantizeLinear with a per-channel scale
    scales = {t.name: numpy_helper.to_array(t) for t in q.model.graph.initializer}
    per_channel = [n for n in q.model.graph.node if n.op_type == "DequantizeLinear"
                   and n.input[1] in scales and scales[n.input[1]].size > 1]
    assert per_channel, "weights were quantized per tensor"
    sess = ort.InferenceSession(q.model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": _x(8)})[0]
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": _x(8)})[0]
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.99


@pytest.mark.parametrize("engine", ["ort", "numpy"])
def test_a_failed_opset_upgrade_falls_back_to_per_tensor_weights(engine, monkeypatch):
    """The converter cannot upgrade the model: per-tensor QDQ at the model's own opset,
    and the report says per-tensor (before: the numpy engine failed with "QDQ quantization
    needs opset >= 13"; the ort engine's report said "int8 per-channel")."""
    from onnx import version_converter

    def fail(*a, **k):
        raise RuntimeError("no adapter for this op")

    monkeypatch.setattr(version_converter, "convert_version", fail)
    m = zoo.small_cnn((2, 8, 8), channels=(8, 16), hidden=16, opset=11)
    x = np.random.default_rng(0).random((40, 2, 8, 8), dtype=np.float32)
    q = quantize(m, "x86-gateway", x, engine=engine, latency_runs=0, min_int8_channels=0, max_loss=None)
    onnx.checker.check_model(q.model)
    assert model_opset(q.model) == 11
    assert q.report.weights == "int8 per-tensor"
    assert any("upgrade failed" in n and "per tensor" in n for n in q.report.notes), q.report.notes
    assert all(a is None for a in _dq_axes(q.model))  # no per-axis DequantizeLinear below opset 13
    scales = {t.name: numpy_helper.to_array(t) for t in q.model.graph.initializer}
    assert all(scales[n.input[1]].size == 1 for n in q.model.graph.node
               if n.op_type in ("DequantizeLinear", "QuantizeLinear") and n.input[1] in scales)
    assert "int8 per-tensor" in q.report.format()
    assert q.report.error.cosine > 0.99
    from edgeflow.runtime.session import load

    ref = load(m, "x86-gateway", backend="numpy")(x[:8])
    for backend in ("numpy", "ort"):
        got = load(q.model, "x86-gateway", backend=backend)(x[:8])
        assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.99, backend


@pytest.mark.parametrize("engine", ["ort", "numpy"])
@pytest.mark.parametrize("n", [66, 3])
def test_a_fixed_batch_model_calibrates_in_whole_batches(engine, n):
    m = zoo.mlp((64, 32, 10))
    for vi in (m.graph.input[0], m.graph.output[0]):
        vi.type.tensor_type.shape.dim[0].dim_value = 4
    # before: onnxruntime's raw "Got invalid dimensions for input: ... Got: 3 Expected: 4"
    q = quantize(m, "x86-gateway", _x(n), engine=engine, latency_runs=0, holdout=0, max_loss=None)
    if n == 66:  # the default hold-out (20%) leaves 53 for calibration: also not whole batches
        q2 = quantize(m, "x86-gateway", _x(n), engine=engine, latency_runs=0, max_loss=None)
        assert any("batch is fixed at 4" in note for note in q2.report.notes)
    onnx.checker.check_model(q.model)
    assert any("batch is fixed at 4" in note for note in q.report.notes), q.report.notes


def test_full_batches_drops_the_remainder_or_fills_one_batch():
    cs = CalibrationSet({"x": np.arange(10, dtype=np.float32)[:, None]})
    kept, note = full_batches(cs, 4)
    assert kept.n == 8 and "8 of 10" in note
    small, note = full_batches(cs.take(slice(0, 3)), 4)
    assert small.n == 4 and small.arrays["x"][:, 0].tolist() == [0, 1, 2, 0] and "repeated" in note
    same, note = full_batches(cs.take(slice(0, 8)), 4)
    assert same.n == 8 and note is None


def test_onnxruntime_errors_become_one_line_with_the_cause():
    from edgeflow.quantization.ort_backend import ort_error

    m = zoo.mlp((64, 32, 10))
    for vi in (m.graph.input[0],):
        vi.type.tensor_type.shape.dim[0].dim_value = 4
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as info:  # a real onnxruntime exception, multi-line
        sess.run(None, {"input": _x(3)})
    assert "\n" in str(info.value)
    err = ort_error("quantize_static", info.value)
    assert isinstance(err, QuantizationError)
    assert "\n" not in str(err)
    assert str(err).startswith("the calibration samples do not match the model's input shape")


def _batch_one_inside(features: int = 16, batch: int = 1):
    """An export whose input batch is free but whose graph reshapes to a constant batch of 1
    (issue 30: a transformer failed because calibration fed batches of 8)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((features, features)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal((features, 10)).astype(np.float32), "W2"),
             numpy_helper.from_array(np.array([batch, features], np.int64), "shape")]
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("MatMul", ["r", "W1"], ["m"]),
             helper.make_node("Relu", ["m"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["y"])]
    g = helper.make_graph(nodes, "batch1", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("engine", ["ort", "numpy"])
def test_a_graph_that_fixes_batch_1_inside_is_calibrated_one_sample_at_a_time(engine):
    if engine == "ort":
        pytest.importorskip("onnxruntime")
    x = np.random.default_rng(1).standard_normal((40, 16)).astype(np.float32)
    r = edgeflow.quantize(_batch_one_inside(), "x86-gateway", calibration=x, engine=engine, latency_runs=2,
                          sensitivity=False, gate_rounds=1)
    assert any("runs only one sample at a time" in n and "reshape" in n.lower() and "batches of 1" in n
               for n in r.report.notes), r.report.notes
    assert r.report.n_eval == 8 and r.report.error.cosine > 0.99
    got = load(r.model, "x86-gateway")(x[:1])
    assert got.shape == (1, 10)


def test_calibration_data_the_model_cannot_run_is_one_line_naming_it():
    x = np.random.default_rng(1).standard_normal((40, 16)).astype(np.float32)
    with pytest.raises(QuantizationError, match="does not run on the calibration data") as e:
        edgeflow.quantize(_batch_one_inside(batch=3), "x86-gateway", calibration=x, latency_runs=0,
                          sensitivity=False)
    assert "\n" not in str(e.value)
