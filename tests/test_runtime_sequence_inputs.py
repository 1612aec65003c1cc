"""Sequence and optional graph inputs through the public API (issue 30): a list of arrays feeds a
sequence, None an empty optional; what does not fit is one line naming the input."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from edgeflow.errors import EdgeflowError
from edgeflow.runtime.session import load


def _model(nodes, inputs, outputs, opset=18):
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _optional_has_element():
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2]))
    return _model([helper.make_node("OptionalHasElement", ["x"], ["y"])],
                  [helper.make_value_info("x", opt)], [helper.make_tensor_value_info("y", TensorProto.BOOL, [])])


def _sequence_sum():
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, ["L"]))
    return _model([helper.make_node("SequenceLength", ["s"], ["n"]),
                   helper.make_node("ConcatFromSequence", ["s"], ["c"], axis=0),
                   helper.make_node("Identity", ["s"], ["same"])],
                  [helper.make_value_info("s", seq)],
                  [helper.make_tensor_value_info("n", TensorProto.INT64, []),
                   helper.make_tensor_value_info("c", TensorProto.FLOAT, ["N"]),
                   helper.make_value_info("same", seq)])


def test_an_empty_optional_input_is_none_and_reads_as_empty():
    rt = load(_optional_has_element(), "x86-gateway", backend="numpy")
    assert rt.inputs[0].kind == "optional-tensor"
    assert bool(rt.run({"x": None})["y"]) is False  # was True: None became a present object array
    assert bool(rt.run({"x": np.ones(2, np.float32)})["y"]) is True


def test_a_sequence_input_is_a_list_of_arrays_and_comes_back_as_one():
    rt = load(_sequence_sum(), "x86-gateway", backend="numpy")
    assert rt.inputs[0].kind == "sequence" and rt.inputs[0].to_dict()["kind"] == "sequence"
    parts = [np.arange(3, dtype=np.float32), np.arange(5, dtype=np.float64)]  # ragged, and one cast losslessly
    out = rt.run({"s": parts})
    assert int(out["n"]) == 2 and out["c"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert isinstance(out["same"], list) and [a.dtype for a in out["same"]] == [np.float32, np.float32]


@pytest.mark.parametrize("model, feeds, line", [
    (_sequence_sum, {"s": np.zeros((2, 3), np.float32)}, "input 's' is a sequence of tensors: pass a list of arrays"),
    (_sequence_sum, {"s": [np.zeros(3, np.float32), "text"]}, "input 's[1]' has dtype <U4, expected float32"),
    (_optional_has_element, {"x": np.zeros(3, np.float32)}, "input 'x' has shape (3,), expected [2] (dim 0)"),
])
def test_what_does_not_fit_a_sequence_or_optional_is_one_line(model, feeds, line):
    rt = load(model(), "x86-gateway", backend="numpy")
    with pytest.raises(EdgeflowError) as e:
        rt.run(feeds)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_none_or_a_ragged_list_for_a_tensor_input_is_one_line():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    rt = load(m, "x86-gateway", backend="numpy")
    with pytest.raises(EdgeflowError, match="input 'x' is a tensor: None is only an empty optional input"):
        rt.run({"x": None})
    with pytest.raises(EdgeflowError, match="input 'x' is not an array"):
        rt.run({"x": [[1.0], [1.0, 2.0]]})
