"""Weight-only int8 (edgeflow.quantization.weight_only): int8 weights behind a
dequantization, float activations; the numpy backend folds the dequantization
at load and runs the fp32 graph on the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from _graphs import make, rand, run_ort
from edgeflow.runtime.graph import compile_graph
from edgeflow.runtime.backends.numpy_backend import execute
from edgeflow.quantization.weight_only import quantize_weights, weight_only_int8

pytest.importorskip("onnxruntime")


def _cnn(rng, opset):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Gemm", ["f", "fw"], ["y"], transB=1)]
    inits = {"w": rand(rng, 16, 3, 3, 3, scale=0.3), "b": rand(rng, 16, scale=0.1),
             "fw": rand(rng, 10, 16 * 6 * 6, scale=0.05)}
    return make(nodes, [("x", [1, 3, 6, 6])], [("y", [1, 10])], inits, opset=opset)


def test_quantize_weights_is_symmetric_per_channel():
    rng = np.random.default_rng(0)
    w = rand(rng, 4, 8) * np.array([[1.0], [10.0], [0.01], [0.0]], np.float32)
    q, s = quantize_weights(w, 0)
    assert q.dtype == np.int8 and s.shape == (4,) and np.abs(q).max() <= 127
    np.testing.assert_array_equal(np.abs(q[:3]).max(axis=1), [127, 127, 127])  # each row uses the full range
    assert not q[3].any()  # an all-zero channel stays zero (scale 1, no division by 0)
    err = np.abs(q * s[:, None] - w).max(axis=1)
    assert (err <= s / 2 + 1e-9).all()


@pytest.mark.parametrize("opset", [11, 13])
def test_weights_are_int8_and_the_numpy_backend_runs_the_fp32_graph(opset):
    rng = np.random.default_rng(1)
    m = _cnn(rng, opset)
    wo = weight_only_int8(m)
    ints = {t.name: t for t in wo.graph.initializer}
    assert ints["w_int8"].data_type == 3 and ints["fw_int8"].data_type == 3  # int8
    assert "w" not in ints and "fw" not in ints
    assert wo.ByteSize() < 0.4 * m.ByteSize()
    ops = [n.op_type for n in wo.graph.node]
    assert ("DequantizeLinear" in ops) == (opset >= 13) and (("Cast" in ops) == (opset < 13))
    g = compile_graph(wo)
    # the dequantization folds at load: the same kernels as the fp32 model's, nothing per run
    assert [n.kernel.op_type for n in g.nodes] == [n.kernel.op_type for n in compile_graph(m).nodes]
    x = rand(rng, 1, 3, 6, 6)
    got = execute(g, {"x": x})["y"]
    np.testing.assert_allclose(got, run_ort(wo, {"x": x})[0], rtol=1e-5, atol=1e-5)  # onnxruntime agrees
    ref = run_ort(m, {"x": x})[0]
    cos = float(got.ravel() @ ref.ravel() / (np.linalg.norm(got) * np.linalg.norm(ref)))
    assert cos > 0.999  # int8 weights, float activations: close to fp32
    assert not np.array_equal(got, ref)  # but it did quantize
