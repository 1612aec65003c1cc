"""The optimizer inside subgraphs (edgeflow.runtime.optimize.passes.subgraphs): If
branches and Loop bodies get the main graph's passes, an If whose condition
folds to a constant is inlined; outputs are checked before and after on
onnxruntime (its own optimizations off) and on the numpy backend."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from _graphs import assert_same_on_ort, const, make, rand, run_numpy
from edgeflow.runtime.optimize import from_model, optimize_model, to_model
from edgeflow.runtime.optimize.ir import PassOptions
from edgeflow.runtime.optimize.passes import inline_constant_if, optimize_subgraphs

pytest.importorskip("onnxruntime")

F = TensorProto.FLOAT


def _all_ops(g: onnx.GraphProto) -> list[str]:
    out = []
    for n in g.node:
        out.append(n.op_type)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                out += _all_ops(a.g)
    return out


def _branch(name: str, rng, w_outer: str, scale: float) -> onnx.GraphProto:
    """y = x * Slice(w_outer, [0], [4]) + Concat(c1, c2): Constant nodes, Slice of an outer weight."""
    nodes = [
        const(f"{name}_s", np.array([0], np.int64)), const(f"{name}_e", np.array([4], np.int64)),
        helper.make_node("Slice", [w_outer, f"{name}_s", f"{name}_e"], [f"{name}_ws"]),
        const(f"{name}_c1", rand(rng, 2, scale=scale)), const(f"{name}_c2", rand(rng, 2, scale=scale)),
        helper.make_node("Concat", [f"{name}_c1", f"{name}_c2"], [f"{name}_c"], axis=0),
        helper.make_node("Mul", ["x", f"{name}_ws"], [f"{name}_m"]),
        helper.make_node("Add", [f"{name}_m", f"{name}_c"], [f"{name}_y"]),
    ]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_y", F, [1, 4])])


def _shape_if_model(rng):
    """If (dim 0 of x == 1) -- the kind of batch check exporters write -- over two branches."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"]),
        const("zero", np.array(0, np.int64)),
        helper.make_node("Gather", ["shp", "zero"], ["d0"], axis=0),
        const("one", np.array(1, np.int64)),
        helper.make_node("Equal", ["d0", "one"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=_branch("then", rng, "w", 1.0),
                         else_branch=_branch("else", rng, "w", 2.0)),
    ]
    return make(nodes, [("x", ["N", 4])], [("y", [1, 4])], {"w": rand(rng, 6)})


def test_an_if_on_a_fixed_shape_is_inlined_and_its_constants_fold():
    rng = np.random.default_rng(0)
    m = _shape_if_model(rng)
    x = rand(rng, 1, 4)
    out = optimize_model(m, shapes={"x": [1, 4]})
    ops = _all_ops(out.graph)
    assert "If" not in ops and "Slice" not in ops and "Concat" not in ops and "Constant" not in ops, ops
    assert ops == ["Mul", "Add"]
    assert_same_on_ort(m, out, {"x": x}, rtol=0, atol=0)
    np.testing.assert_array_equal(run_numpy(m, {"x": x}, optimize=True)[0],
                                  run_numpy(m, {"x": x}, optimize=False)[0])


def test_an_if_on_a_dynamic_dim_stays_but_its_branches_fold():
    rng = np.random.default_rng(1)
    m = _shape_if_model(rng)
    out = optimize_model(m)  # x's batch stays symbolic: the condition is not a constant
    if_node = next(n for n in out.graph.node if n.op_type == "If")
    for a in if_node.attribute:
        assert [n.op_type for n in a.g.node] == ["Mul", "Add"]  # Constant, Slice and Concat folded
        # the sliced weight became the branch's own initializer; nothing else was copied in
        assert sorted(t.name for t in a.g.initializer) == sorted([f"{a.g.name}_ws", f"{a.g.name}_c"])
    for batch in (1, 3):
        x = rand(rng, batch, 4)
        if batch == 1:
            assert_same_on_ort(m, out, {"x": x}, rtol=0, atol=0)
        np.testing.assert_array_equal(run_numpy(m, {"x": x}, optimize=True)[0],
                                      run_numpy(m, {"x": x}, optimize=False)[0])


def test_a_loop_body_reads_unfolded_outer_weights_from_the_enclosing_scope():
    """A Loop body: Constant-node bias folds; the outer weight it multiplies by stays outside."""
    rng = np.random.default_rng(2)
    body = helper.make_graph(
        [const("b_c1", rand(rng, 3)), helper.make_node("Neg", ["b_c1"], ["b_bias"]),
         helper.make_node("MatMul", ["acc_in", "W"], ["b_m"]),
         helper.make_node("Add", ["b_m", "b_bias"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", F, [1, 3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", F, [1, 3])])
    nodes = [const("trips", np.array(3, np.int64)), const("go", np.array(True)),
             helper.make_node("Loop", ["trips", "go", "x"], ["y"], body=body)]
    m = make(nodes, [("x", [1, 3])], [("y", [1, 3])], {"W": rand(rng, 3, 3, scale=0.5)})
    g = optimize_subgraphs(from_model(m), PassOptions())
    out = to_model(g)
    loop = next(n for n in out.graph.node if n.op_type == "Loop")
    b = loop.attribute[0].g
    assert [n.op_type for n in b.node] == ["MatMul", "Add", "Identity"]  # input -> output Identity stays
    assert [t.name for t in b.initializer] == ["b_bias"]  # W is read from the main graph, not copied
    assert [i.name for i in b.input] == ["i", "cond_in", "acc_in"]
    x = rand(rng, 1, 3)
    assert_same_on_ort(m, out, {"x": x})


def test_inline_leaves_an_if_whose_condition_is_not_constant():
    rng = np.random.default_rng(3)
    m = _shape_if_model(rng)
    g = from_model(m)
    assert inline_constant_if(g, PassOptions()) is g
    assert optimize_subgraphs(from_model(optimize_model(m)), PassOptions()).nodes  # idempotent, still valid


# ------------------------------------------------------------------ numpy-backend passes

def _decomposed_layernorm(x="x", out="y", p="", pow_=True, relu=True):
    """PyTorch's export of nn.LayerNorm below opset 17 (+ a Relu after it)."""
    nodes = [
        helper.make_node("ReduceMean", [x], [f"{p}m"], axes=[-1]),
        helper.make_node("Sub", [x, f"{p}m"], [f"{p}d"]),
        helper.make_node("Pow", [f"{p}d", "two"], [f"{p}q"]) if pow_ else helper.make_node("Mul", [f"{p}d", f"{p}d"], [f"{p}q"]),
        helper.make_node("ReduceMean", [f"{p}q"], [f"{p}v"], axes=[-1]),
        helper.make_node("Add", [f"{p}v", "eps"], [f"{p}ve"]),
        helper.make_node("Sqrt", [f"{p}ve"], [f"{p}s"]),
        helper.make_node("Div", [f"{p}d", f"{p}s"], [f"{p}n"]),
        helper.make_node("Mul", ["gamma", f"{p}n"], [f"{p}g"]),  # gamma first: either order is matched
        helper.make_node("Add", [f"{p}g", "beta"], [f"{p}b" if relu else out]),
    ]
    if relu:
        nodes.append(helper.make_node("Relu", [f"{p}b"], [out]))
    return nodes


def _ln_inits(rng, n=16):
    return {"two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32),
            "gamma": rand(rng, n), "beta": rand(rng, n)}


@pytest.mark.parametrize("pow_", [True, False])
def test_decomposed_layernorm_is_one_node_with_the_same_results(pow_):
    from edgeflow.runtime.graph import compile_graph

    rng = np.random.default_rng(4)
    m = make(_decomposed_layernorm(pow_=pow_), [("x", [3, 16])], [("y", [3, 16])], _ln_inits(rng))
    g = compile_graph(m)
    assert [n.kernel.op_type for n in g.nodes] == ["LayerNorm(fused)+Relu"]
    x = rand(rng, 3, 16, scale=3.0) + 1.0
    np.testing.assert_allclose(run_numpy(m, {"x": x}, True)[0], run_numpy(m, {"x": x}, False)[0], rtol=1e-6, atol=1e-6)
    from _graphs import run_ort

    np.testing.assert_allclose(run_numpy(m, {"x": x}, True)[0], run_ort(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_layernorm_chain_read_elsewhere_is_not_fused():
    from edgeflow.runtime.graph import compile_graph

    rng = np.random.default_rng(5)
    nodes = _decomposed_layernorm(relu=False) + [helper.make_node("Add", ["y", "d"], ["z"])]  # d read outside
    m = make(nodes, [("x", [2, 16])], [("z", [2, 16])], _ln_inits(rng))
    assert "LayerNorm(fused)" not in [n.kernel.op_type for n in compile_graph(m).nodes]


def test_numpy_passes_run_inside_subgraphs_with_outer_weights():
    """An If branch: Gemm(transB) on an outer weight is prepacked, the layer norm and the
    activations fused; the enclosing graph keeps its weights; results unchanged."""
    from edgeflow.runtime.graph import compile_graph

    rng = np.random.default_rng(6)
    body_nodes = [helper.make_node("Gemm", ["x", "W", "bias"], ["h"], transB=1)] + \
        _decomposed_layernorm(x="h", out="t", p="b_")
    then_g = helper.make_graph(body_nodes, "then", [], [helper.make_tensor_value_info("t", F, [2, 16])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x16"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, [2, 16])])
    nodes = [helper.make_node("Tile", ["x", "reps"], ["x16"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    inits = {**_ln_inits(rng), "W": rand(rng, 16, 8), "bias": rand(rng, 16), "reps": np.array([1, 2], np.int64)}
    m = make(nodes, [("x", [2, 8]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])], [("y", [2, 16])], inits)
    g = compile_graph(m)
    if_node = next(n for n in g.nodes if n.op_type == "If")
    sub = if_node.subgraphs["then_branch"]
    assert [n.kernel.op_type for n in sub.nodes] == ["Gemm", "LayerNorm(fused)+Relu"]
    assert sub.nodes[0].attrs.get("transB", 0) == 0 and sub.initializers["W"].shape == (8, 16)
    assert g.initializers["W"].shape == (16, 8)  # the enclosing graph's copy is untouched
    assert not set(sub.initializers) & {"gamma", "beta", "eps", "bias"}  # outer values are not copied in
    from _graphs import run_ort

    x = rand(rng, 2, 8)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        np.testing.assert_allclose(run_numpy(m, feeds, True)[0], run_numpy(m, feeds, False)[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(run_numpy(m, feeds, True)[0], run_ort(m, feeds)[0], rtol=1e-5, atol=1e-5)
