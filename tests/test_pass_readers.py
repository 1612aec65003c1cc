"""The numpy-backend passes' reader index (edgeflow.runtime.optimize.passes.readers):
one entry per read, omitted optional inputs skipped, a graph output listed only where
a node reads it, and a value a subgraph captures read by its control-flow node."""

from __future__ import annotations

from onnx import TensorProto, helper

from edgeflow.runtime.graph import compile_graph
from edgeflow.runtime.optimize.passes.readers import readers

from _graphs import make


def _names(index):
    return {k: [n.name for n in v] for k, v in index.items()}


def test_a_value_read_twice_by_one_node_and_a_graph_output():
    m = make([helper.make_node("Mul", ["x", "x"], ["sq"], name="mul"),
              helper.make_node("Relu", ["sq"], ["y"], name="relu"),
              helper.make_node("Neg", ["y"], ["z"], name="neg"),
              helper.make_node("Clip", ["z", "", "hi"], ["w"], name="clip")],
             [("x", [2]), ("hi", [])], [("sq", [2]), ("y", [2]), ("w", [2])])
    index = _names(readers(compile_graph(m, optimize=False)))
    # Mul(x, x) reads x twice: x has two reads, not one reader
    assert index == {"x": ["mul", "mul"], "sq": ["relu"], "y": ["neg"], "z": ["clip"], "hi": ["clip"]}
    assert "" not in index and "w" not in index  # an omitted input; a graph output nobody reads


def test_an_outer_value_a_subgraph_reads_is_read_by_its_node():
    then_g = helper.make_graph([helper.make_node("Neg", ["t"], ["a"])], "then", [],
                               [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])])
    else_g = helper.make_graph([helper.make_node("Identity", ["t"], ["b"])], "else", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    m = make([helper.make_node("Relu", ["x"], ["t"], name="relu"),
              helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_g, else_branch=else_g)],
             [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), ("x", [2])], [("y", [2])])
    g = compile_graph(m, optimize=False)
    assert _names(readers(g)) == {"x": ["relu"], "cond": ["if"], "t": ["if"]}
