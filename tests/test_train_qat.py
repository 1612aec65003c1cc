"""Quantization-aware fine-tuning: the fake-quant primitives, the straight-
through estimator, and that a QAT-fine-tuned model quantizes cleanly (our
simulated int8 scheme and onnxruntime's quantize_static)."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow import zoo
from edgeflow.data.datasets import load_digits
from edgeflow.errors import TrainingError
from edgeflow.train import Trainer
from edgeflow.train.qat import QATConfig, fake_quant_activation, fake_quant_weight


def test_weight_fake_quant_is_per_channel_symmetric_int8():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 3, 3, 3)).astype(np.float32)
    w[2] *= 100  # one wide channel must not coarsen the others
    q = fake_quant_weight(w, axis=0)
    for c in range(6):
        scale = np.abs(w[c]).max() / 127
        levels = q[c] / scale
        np.testing.assert_allclose(levels, np.rint(levels), atol=1e-3)
        assert np.abs(levels).max() <= 127.001
        assert np.abs(q[c] - w[c]).max() <= scale / 2 + 1e-6
    assert np.abs(fake_quant_weight(w, axis=None)[0] - w[0]).max() > np.abs(q[0] - w[0]).max()


def test_activation_fake_quant_grid_and_ste_mask():
    x = np.linspace(-2, 5, 50).astype(np.float32)
    xq, mask = fake_quant_activation(x, -1.0, 4.0)
    scale = 5.0 / 255
    inside = (x >= -1) & (x <= 4)
    np.testing.assert_array_equal(mask, inside)
    assert np.abs(xq[inside] - x[inside]).max() <= scale / 2 + 1e-6
    assert xq.min() >= -1 - 1e-6 and xq.max() <= 4 + 1e-6  # clipped outside the range
    assert len(np.unique(np.rint(xq / scale))) <= 256


def test_straight_through_gradients():
    """Weight grads under QAT = grads of the float graph evaluated at the quantized weights."""
    model = zoo.mlp((6, 5, 3), seed=0)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 6)), rng.integers(0, 3, 8)
    qat = Trainer(model, dtype="float64", qat=QATConfig(activations=False))
    g_qat = qat.gradients(x, y)
    plain = Trainer(model, dtype="float64")
    plain.set_weights({k: fake_quant_weight(v.astype(np.float64), axis=0) if k.endswith("weight") else v
                       for k, v in plain.get_weights().items()})
    g_ref = plain.gradients(x, y)
    for k in g_ref:
        np.testing.assert_allclose(g_qat[k], g_ref[k], rtol=1e-6, atol=1e-7)
    # the stored weights stay float (only the forward sees the grid)
    w = qat.get_weights()["fc0.weight"]
    assert not np.allclose(w, fake_quant_weight(w, axis=0))


def test_qat_needs_something_to_quantize():
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph([helper.make_node("Mul", ["x", "s"], ["y"])], "m",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
                          [numpy_helper.from_array(np.ones(2, np.float32), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(TrainingError, match="nothing to quantize"):
        Trainer(m, loss="mse", qat=True)


@pytest.fixture(scope="module")
def float_and_qat():
    d = load_digits()
    base = Trainer(zoo.digits_cnn(seed=0), lr=0.05, momentum=0.9, seed=0)
    base.fit((d.x_train, d.y_train), epochs=8)
    float_model = base.to_onnx()
    qat = Trainer(float_model, qat=True, lr=0.01, momentum=0.9, seed=0)
    qat.fit((d.x_train, d.y_train), epochs=3)
    return d, base, float_model, qat


def _simulated_int8_accuracy(model, d) -> float:
    sim = Trainer(model, qat=True)
    ranges = sim.qat.calibrate(sim, d.x_train)
    assert ranges and all(lo <= 0 <= hi for lo, hi in ranges.values())
    return sim.evaluate(d.x_test, d.y_test)[1]


def test_qat_model_quantizes_with_the_simulated_int8_scheme(float_and_qat):
    d, base, float_model, qat = float_and_qat
    float_acc = base.evaluate(d.x_test, d.y_test)[1]
    ptq_acc = _simulated_int8_accuracy(float_model, d)
    qat_acc = _simulated_int8_accuracy(qat.to_onnx(), d)
    assert qat_acc >= ptq_acc or qat_acc >= float_acc - 0.01, (float_acc, ptq_acc, qat_acc)
    assert qat_acc >= float_acc - 0.01


def test_qat_model_quantizes_with_onnxruntime_quantize_static(float_and_qat, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    q = pytest.importorskip("onnxruntime.quantization")
    import onnx

    d, _, _, qat = float_and_qat
    fp32 = tmp_path / "qat_fp32.onnx"
    int8 = tmp_path / "qat_int8.onnx"
    qat.export(fp32)

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"input": d.x_train[i:i + 64]} for i in range(0, 512, 64)])

        def get_next(self):
            return next(self.batches, None)

    q.quantize_static(str(fp32), str(int8), Reader(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                      activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8)
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(int8).graph.node)

    def acc(path):
        s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return float((s.run(None, {"input": d.x_test})[0].argmax(1) == d.y_test).mean())

    assert acc(int8) >= acc(fp32) - 0.01
