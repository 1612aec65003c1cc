"""Mul(x, HardSigmoid(x)) and Mul(x, Sigmoid(x)) become one node on the numpy backend
(then fused into the Conv before them); the outputs must be the unfused graph's, bit
for bit, whichever side of the Mul the gate is on; a gate read elsewhere is left alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeflow.runtime.backends.numpy_backend import execute
from edgeflow.runtime.graph import compile_graph


def _model(gate: str, gate_first: bool, extra_reader: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    w = numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.5).astype(np.float32), "w")
    attrs = {"alpha": 1 / 6, "beta": 0.5} if gate == "HardSigmoid" else {}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node(gate, ["c"], ["g"], **attrs),
             helper.make_node("Mul", ["g", "c"] if gate_first else ["c", "g"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["g"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              outputs, [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("gate", ["HardSigmoid", "Sigmoid"])
@pytest.mark.parametrize("gate_first", [False, True])
def test_same_bits_as_the_two_nodes(gate, gate_first):
    x = (np.random.default_rng(1).standard_normal((1, 3, 8, 8)) * 4).astype(np.float32)
    m = _model(gate, gate_first)
    fused, plain = compile_graph(m), compile_graph(m, optimize=False)
    labels = [n.kernel.op_type for n in fused.nodes]
    assert labels == [f"Conv+{gate}*x"], labels  # the Mul and the gate folded into the Conv
    np.testing.assert_array_equal(execute(fused, {"x": x})["y"], execute(plain, {"x": x})["y"])


def test_a_gate_read_elsewhere_stays():
    x = np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)
    m = _model("Sigmoid", False, extra_reader=True)
    fused, plain = compile_graph(m), compile_graph(m, optimize=False)
    assert "Mul" in [n.op_type for n in fused.nodes]
    got, want = execute(fused, {"x": x}), execute(plain, {"x": x})
    for k in ("y", "z"):
        np.testing.assert_array_equal(got[k], want[k])
