"""Max/Min with a constant rewritten as Clip before int8 quantization
(edgeflow.quantization.analysis.clamps_as_clip): exact in float, and onnxruntime then
folds the clamp into the int8 range of the op before it instead of running it in float
between a DequantizeLinear and a QuantizeLinear."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from onnx import helper

from _graphs import make, rand, run_numpy
from edgeflow.quantization.analysis import clamps_as_clip


def _net(rng, opset=13):
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("LeakyRelu", ["c0"], ["l0"], alpha=0.2),
        helper.make_node("Max", ["l0", "lo"], ["m0"]),  # TF's tf.math.maximum(x, -0.4): a clamp
        helper.make_node("Conv", ["m0", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Min", ["hi", "c1"], ["m1"]),  # constant first
        helper.make_node("Max", ["m1", "m0"], ["m2"]),  # two activations: not a clamp
        helper.make_node("Flatten", ["m2"], ["f"]),
        helper.make_node("Max", ["f", "wide"], ["g"]),  # a rank-3 constant would broadcast a rank-2 x up
        helper.make_node("MatMul", ["g", "fw"], ["y"]),
    ]
    inits = {"w0": rand(rng, 8, 4, 3, 3, scale=0.3), "b0": rand(rng, 8, scale=0.1),
             "w1": rand(rng, 8, 8, 3, 3, scale=0.2), "b1": rand(rng, 8, scale=0.1),
             "lo": np.full((1, 1, 1, 1), -0.4, np.float32), "hi": np.float32(1.5),
             "wide": np.zeros((1, 1, 1), np.float32), "fw": rand(rng, 8 * 6 * 6, 10, scale=0.05)}
    return make(nodes, [("x", [1, 4, 6, 6])], [("y", [1, 1, 10])], inits, opset=opset, check=False)


def test_a_clamp_by_a_constant_becomes_clip_and_the_outputs_are_identical():
    rng = np.random.default_rng(0)
    m = _net(rng)
    x = {"x": rand(rng, 1, 4, 6, 6)}
    ref = run_numpy(m, x, optimize=False)[0]
    out, n = clamps_as_clip(copy.deepcopy(m))
    assert n == 2
    ops = [(nd.op_type, list(nd.input)) for nd in out.graph.node]
    assert ops[2][0] == "Clip" and ops[2][1][0] == "l0" and len(ops[2][1]) == 2  # Max(x, c) -> Clip(x, min=c)
    assert ops[4][0] == "Clip" and ops[4][1][0] == "c1" and ops[4][1][1] == "" and len(ops[4][1]) == 3  # max=c
    assert ops[5][0] == "Max" and ops[7][0] == "Max"  # two activations; a constant of higher rank
    assert not {"lo", "hi"} & {t.name for t in out.graph.initializer}  # replaced by scalars
    np.testing.assert_array_equal(run_numpy(out, x, optimize=False)[0], ref)
    pytest.importorskip("onnxruntime")
    from _graphs import run_ort

    np.testing.assert_array_equal(run_ort(out, x)[0], run_ort(m, x)[0])


def test_below_opset_11_nothing_changes():
    m = _net(np.random.default_rng(0), opset=10)
    out, n = clamps_as_clip(copy.deepcopy(m))
    assert n == 0 and [nd.op_type for nd in out.graph.node] == [nd.op_type for nd in m.graph.node]


def test_onnxruntime_int8_folds_the_clamp_into_the_range_before_it():
    pytest.importorskip("onnxruntime")
    import edgeflow

    rng = np.random.default_rng(1)
    m = _net(rng)
    x = rng.standard_normal((48, 4, 6, 6)).astype(np.float32)
    r = edgeflow.quantize(m, "x86-gateway", calibration=x, engine="ort", latency_runs=0, min_int8_channels=0, max_loss=None)
    assert any("2 Max/Min with a constant rewritten as Clip" in n for n in r.report.notes), r.report.notes
    ops = [nd.op_type for nd in r.model.graph.node]
    assert "Clip" not in ops and ops.count("Max") == 2  # the clamps live in the int8 ranges; the others stay
    assert r.report.error.cosine > 0.99
