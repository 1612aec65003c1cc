"""Whole-graph gradients through the tape against finite differences (float64).

One graph mixes most trainable ops — Conv, BatchNorm (training mode),
LeakyRelu, AveragePool, Transpose, broadcasting Add/Mul/Sub, Concat,
GlobalAveragePool, Reshape, Tanh, Sigmoid, MatMul, Dropout, (Log)Softmax — so
fan-out accumulation, value freeing and training-mode rewrites are exercised
together, at two opsets (Softmax semantics differ before 13; Dropout's ratio
was an attribute before 12).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeflow.train import Trainer


def _graph(opset: int):
    rng = np.random.default_rng(0)
    p = {
        "w1": rng.standard_normal((4, 2, 3, 3)) * 0.5, "b1": rng.standard_normal(4) * 0.1,
        "g": 1 + 0.1 * rng.standard_normal(4), "beta": 0.1 * rng.standard_normal(4),
        "rm": np.zeros(4), "rv": np.ones(4),
        "shift": rng.standard_normal((1, 4, 1, 1)) * 0.1, "scale": 1 + 0.1 * rng.standard_normal(8),
        "w2": rng.standard_normal((8, 3)) * 0.5, "b2": rng.standard_normal(3) * 0.1,
    }
    shape = np.array([0, 8], np.int64)
    drop = (helper.make_node("Dropout", ["t"], ["td"], ratio=0.3) if opset < 12 else
            helper.make_node("Dropout", ["t", "ratio"], ["td"], seed=11))
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "beta", "rm", "rv"], ["bn"]),
        helper.make_node("LeakyRelu", ["bn"], ["lr"], alpha=0.2),
        helper.make_node("AveragePool", ["lr"], ["ap"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Transpose", ["ap"], ["tp"], perm=[0, 1, 3, 2]),
        helper.make_node("Add", ["tp", "shift"], ["sh"]),
        helper.make_node("Mul", ["sh", "ap"], ["prod"]),  # 'ap' fans out: gradients accumulate
        helper.make_node("Concat", ["ap", "prod"], ["cat"], axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gap"]),
        helper.make_node("Reshape", ["gap", "shape"], ["flat"]),
        helper.make_node("Mul", ["flat", "scale"], ["sc"]),
        helper.make_node("Tanh", ["sc"], ["t"]),
        drop,
        helper.make_node("MatMul", ["td", "w2"], ["mm"]),
        helper.make_node("Sub", ["mm", "b2"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["s"]),
        helper.make_node("Softmax", ["s"], ["sm"], axis=1),
        helper.make_node("LogSoftmax", ["sm"], ["y"], axis=1),
    ]
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in p.items()]
    inits.append(numpy_helper.from_array(shape, "shape"))
    if opset >= 12:
        inits.append(numpy_helper.from_array(np.array(0.3, np.float32), "ratio"))
    g = helper.make_graph(nodes, "mix", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 6, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [11, 17])
def test_mixed_graph_gradients_match_finite_differences(opset):
    tr = Trainer(_graph(opset), loss="mse", dtype="float64", seed=3)
    assert "rm" not in tr.trainable_names and "shape" not in tr.trainable_names
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 2, 6, 6))
    target = rng.standard_normal((5, 3))
    _, _, grads = tr.compute_gradients(x, target)
    eps = 1e-6
    for name in tr.trainable_names:
        w = tr.params[name]
        flat = w.reshape(-1)
        num = np.zeros(flat.size)
        for j in range(flat.size):
            orig = flat[j]
            flat[j] = orig + eps
            fp = tr.compute_gradients(x, target)[0]
            flat[j] = orig - eps
            fm = tr.compute_gradients(x, target)[0]
            flat[j] = orig
            num[j] = (fp - fm) / (2 * eps)
        np.testing.assert_allclose(grads[name].reshape(-1), num, rtol=1e-5, atol=1e-9, err_msg=name)


def test_mixed_graph_trains_and_exports(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    tr = Trainer(_graph(17), loss="mse", optimizer="adam", lr=1e-2, seed=0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 2, 6, 6)).astype(np.float32)
    target = np.log(np.full((64, 3), 1 / 3, np.float32)) + 0.05 * rng.standard_normal((64, 3)).astype(np.float32)
    h = tr.fit((x, target), epochs=15, batch_size=16)
    assert h.loss[-1] < h.loss[0]
    tr.export(tmp_path / "m.onnx")
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], tr.predict(x), rtol=1e-4, atol=1e-5)
