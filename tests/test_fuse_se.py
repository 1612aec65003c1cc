"""The numpy backend's fuse_se pass: Mul(x, A2(Conv(A1(Conv(GlobalAveragePool(x)))))) (the
squeeze-and-excitation block of MobileNetV3 / PP-LCNet) is one node that gives the unfused
graph's result bit for bit, and other chains are left alone."""

from __future__ import annotations

import numpy as np
import pytest
from _nn_check import run_ort
from onnx import TensorProto, helper, numpy_helper

from edgeflow.runtime.backends.numpy_backend import execute
from edgeflow.runtime.graph import compile_graph

F = np.float32


def _se_model(rng, *, c=12, mid=3, batch=1, gate="HardSigmoid", act="Relu", bias=True, swap=False, kernel=1,
              extra_reader=False, weights_as_inputs=False):
    w1 = (rng.standard_normal((mid, c, kernel, kernel)) * 0.5).astype(F)
    w2 = (rng.standard_normal((c, mid, 1, 1)) * 0.5).astype(F)
    inits = {"w1": w1, "w2": w2}
    if bias:
        inits["b1"] = (rng.standard_normal(mid) * 0.3).astype(F)
        inits["b2"] = (rng.standard_normal(c) * 0.3).astype(F)
    pads = [kernel // 2] * 4
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["p"]),
        helper.make_node("Conv", ["p", "w1"] + (["b1"] if bias else []), ["c1"], kernel_shape=[kernel, kernel],
                         pads=pads),
        helper.make_node(act, ["c1"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2"] + (["b2"] if bias else []), ["c2"], kernel_shape=[1, 1]),
        helper.make_node(gate, ["c2"], ["s"], **({"alpha": 1 / 6} if gate == "HardSigmoid" else {})),
        helper.make_node("Mul", ["s", "x"] if swap else ["x", "s"], ["y"]),
    ]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, None))
    x = rng.standard_normal((batch, c, 5, 7)).astype(F)
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))]
    feeds = {"x": x}
    if weights_as_inputs:
        ins += [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in inits.items()]
        feeds.update(inits)
        inits = {}
    g = helper.make_graph(nodes, "se", ins, outs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), feeds


def _run(model, feeds, optimize=True):
    g = compile_graph(model, optimize=optimize)
    env = execute(g, feeds)
    return g, env["y"]


@pytest.mark.parametrize("gate", ["HardSigmoid", "Sigmoid"])
@pytest.mark.parametrize("act", ["Relu", "LeakyRelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_se_block_is_one_node_and_the_unfused_result_bit_for_bit(gate, act, bias, swap, batch):
    rng = np.random.default_rng(1)
    m, feeds = _se_model(rng, gate=gate, act=act, bias=bias, swap=swap, batch=batch)
    g, got = _run(m, feeds)
    assert [n.kernel.op_type for n in g.nodes] == ["SE(fused)"]
    _, want = _run(m, feeds, optimize=False)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, run_ort(m, feeds)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("why", [dict(extra_reader=True), dict(kernel=3), dict(weights_as_inputs=True),
                                 dict(act="Softmax")], ids=str)
def test_other_chains_are_left_alone(why):
    m, feeds = _se_model(np.random.default_rng(2), **why)
    g, got = _run(m, feeds)
    assert "SE(fused)" not in [n.kernel.op_type for n in g.nodes]
    np.testing.assert_allclose(got, run_ort(m, feeds)[0], rtol=1e-5, atol=1e-6)
