"""The graph optimizer (edgeflow.runtime.optimize): each pass on models built here and on
third-party and zoo models, checked by running the graph before and after —
on onnxruntime (with its own optimizations off) and on the numpy backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from _graphs import assert_same_on_ort, const, dynamic_cnn, make, rand, run_numpy, run_ort
from edgeflow import zoo
from edgeflow.runtime.graph import compile_graph
from edgeflow.runtime.model import load_model, model_info
from edgeflow.runtime.optimize import from_model, optimize, optimize_model, to_model
from edgeflow.runtime.optimize.ir import PassOptions
from edgeflow.runtime.optimize.passes import (
    constants_to_initializers,
    fold_constants,
    fuse_batchnorm,
    fuse_conv_affine,
    fuse_hardswish,
    remove_dead_nodes,
    remove_identity,
)

pytest.importorskip("onnxruntime")


def _apply(fn, model, **opts):
    return to_model(fn(from_model(model), PassOptions(**opts)))


def _ops(model) -> list[str]:
    return [n.op_type for n in model.graph.node]


# ------------------------------------------------------------------ Constant nodes

def _constant_weight_cnn(rng):
    """Conv + Gemm whose weights are Constant nodes, as Paddle exports them."""
    nodes = [
        const("w", rand(rng, 4, 1, 3, 3, scale=0.3)), const("b", rand(rng, 4, scale=0.1)),
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Constant", [], ["shape"], value_ints=[0, -1]),
        helper.make_node("Reshape", ["r", "shape"], ["f"]),
        const("fw", rand(rng, 4 * 6 * 6, 3, scale=0.05)),
        helper.make_node("Constant", [], ["fb"], value_floats=[0.5, -0.5, 1.0]),
        helper.make_node("MatMul", ["f", "fw"], ["m"]),
        helper.make_node("Add", ["m", "fb"], ["y"]),
    ]
    return make(nodes, [("x", ["N", 1, 6, 6])], [("y", ["N", 3])])


def test_constant_nodes_become_initializers_and_count_as_parameters():
    rng = np.random.default_rng(0)
    m = _constant_weight_cnn(rng)
    out = _apply(constants_to_initializers, m)
    assert "Constant" not in _ops(out)
    assert {t.name for t in out.graph.initializer} == {"w", "b", "shape", "fw", "fb"}
    assert model_info(m).num_parameters == model_info(out).num_parameters == 4 * 9 + 4 + 2 + 144 * 3 + 3
    assert_same_on_ort(m, out, {"x": rand(rng, 2, 1, 6, 6)}, rtol=0, atol=0)


def test_a_constant_that_is_a_graph_output_stays_a_node():
    m = make([const("y", np.ones(3, np.float32))], [], [("y", [3])])
    assert _ops(_apply(constants_to_initializers, m)) == ["Constant"]


# ------------------------------------------------------------------ Identity / Dropout

def test_identity_and_inference_dropout_are_removed():
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Identity", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Dropout", ["b", "ratio"], ["d"]),
        helper.make_node("Identity", ["d"], ["e"]),
        helper.make_node("Sigmoid", ["e"], ["s"]),
        helper.make_node("Identity", ["s"], ["y"]),  # y is the graph output: s is renamed to y
    ]
    m = make(nodes, [("x", [3, 4])], [("y", [3, 4])], {"ratio": np.array(0.5, np.float32)})
    out = _apply(remove_identity, m)
    assert _ops(out) == ["Relu", "Sigmoid"]
    assert out.graph.node[1].output[0] == "y"
    assert_same_on_ort(m, out, {"x": rand(rng, 3, 4)}, rtol=0, atol=0)


def test_dropout_stays_when_its_mask_is_read_in_training_or_for_training():
    x = [("x", [3, 4])]
    used_mask = make([helper.make_node("Dropout", ["x"], ["y", "mask"])], x,
                     [("y", [3, 4]), helper.make_tensor_value_info("mask", TensorProto.BOOL, [3, 4])])
    assert _ops(_apply(remove_identity, used_mask)) == ["Dropout"]
    live = make([helper.make_node("Dropout", ["x", "r", "t"], ["y"])], x, [("y", [3, 4])],
                {"r": np.array(0.5, np.float32), "t": np.array(True)})
    assert _ops(_apply(remove_identity, live)) == ["Dropout"]
    plain = make([helper.make_node("Dropout", ["x"], ["d"]), helper.make_node("Relu", ["d"], ["y"])], x, [("y", [3, 4])])
    assert _ops(_apply(remove_identity, plain)) == ["Relu"]
    assert _ops(_apply(remove_identity, plain, for_training=True)) == ["Dropout", "Relu"]


def test_identity_between_graph_input_and_output_stays():
    m = make([helper.make_node("Identity", ["x"], ["y"])], [("x", [2])], [("y", [2])])
    assert _ops(_apply(remove_identity, m)) == ["Identity"]


# ------------------------------------------------------------------ constant folding

def test_constant_subgraphs_fold_and_the_rest_stays():
    rng = np.random.default_rng(2)
    inits = {"wt": rand(rng, 4, 3), "two": np.array(2.0, np.float32), "shape": np.array([3, 4], np.int64)}
    nodes = [
        helper.make_node("Transpose", ["wt"], ["w"], perm=[1, 0]),  # a weight stored transposed
        helper.make_node("Mul", ["w", "two"], ["w2"]),
        helper.make_node("MatMul", ["x", "w2"], ["m"]),
        helper.make_node("RandomNormal", [], ["noise"], shape=[3, 4], seed=1.0),  # never folded
        helper.make_node("Mul", ["noise", "two"], ["n2"]),
        helper.make_node("Add", ["m", "n2"], ["y"]),
    ]
    m = make(nodes, [("x", [2, 3])], [("y", [2, 4])], inits)
    out = _apply(fold_constants, m)
    assert _ops(out) == ["MatMul", "RandomNormal", "Mul", "Add"]
    folded = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    np.testing.assert_array_equal(folded["w2"], inits["wt"].T * 2)
    # with the noise taken out, both graphs compute the same thing
    nodes_det = nodes[:3] + [helper.make_node("Identity", ["m"], ["y"])]
    det = make(nodes_det, [("x", [2, 3])], [("y", [2, 4])], inits)
    assert_same_on_ort(det, _apply(fold_constants, det), {"x": rand(rng, 2, 3)}, rtol=0, atol=0)


def test_folding_respects_keep_overridable_initializers_and_the_size_limit():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [helper.make_node("Neg", ["w"], ["nw"]), helper.make_node("MatMul", ["x", "nw"], ["y"])]
    m = make(nodes, [("x", [1, 2])], [("y", [1, 3])], {"w": w})
    assert _ops(_apply(fold_constants, m)) == ["MatMul"]
    assert _ops(_apply(fold_constants, m, keep=frozenset({"w"}))) == ["Neg", "MatMul"]
    assert _ops(_apply(fold_constants, m, for_training=True)) == ["Neg", "MatMul"]
    # an initializer that is also a graph input may be fed by the caller: not a constant
    over = make(nodes, [("x", [1, 2]), ("w", [2, 3])], [("y", [1, 3])], {"w": w})
    assert _ops(_apply(fold_constants, over)) == ["Neg", "MatMul"]
    # an Expand that would write a large tensor from a tiny one stays a node
    big = make([helper.make_node("Expand", ["one", "shape"], ["e"]), helper.make_node("Add", ["x", "e"], ["y"])],
               [("x", [64, 64])], [("y", [64, 64])],
               {"one": np.ones(1, np.float32), "shape": np.array([64, 64], np.int64)})
    assert _ops(_apply(fold_constants, big, fold_limit=1024)) == ["Expand", "Add"]
    assert _ops(_apply(fold_constants, big)) == ["Add"]


def test_an_op_without_a_kernel_is_left_unfolded():
    # GlobalLpPool has no numpy kernel (check below, so the test notices when one is added)
    from edgeflow.kernels import has_kernel

    assert not has_kernel("GlobalLpPool", "", 17)
    m = make([helper.make_node("GlobalLpPool", ["a"], ["d"]), helper.make_node("Add", ["x", "d"], ["y"])],
             [("x", [1, 1, 1, 1])], [("y", [1, 1, 1, 1])], {"a": np.ones((1, 1, 2, 2), dtype=np.float32)})
    assert _ops(_apply(fold_constants, m)) == ["GlobalLpPool", "Add"]


def test_shape_subgraphs_fold_once_input_shapes_are_fixed():
    m = dynamic_cnn()
    x = np.random.default_rng(3).standard_normal((2, 3, 7, 5)).astype(np.float32)
    # dynamic N: only the channel branch (Gather(1) of a known dim) folds
    partial = optimize(m).model
    assert _ops(partial).count("Gather") == 1 and "Shape" in _ops(partial)
    assert_same_on_ort(m, partial, {"x": x})
    # fixed shapes: the whole Shape -> Gather -> Unsqueeze -> Concat subgraph is one constant
    fixed = optimize(m, shapes={"x": (2, 3, 7, 5)})
    assert _ops(fixed.model) == ["Conv", "Relu", "GlobalAveragePool", "Reshape", "Gemm"]
    assert fixed.report.nodes_before == 11 and fixed.report.nodes_after == 5
    shp = next(t for t in fixed.model.graph.initializer if t.name == "shp")
    assert numpy_helper.to_array(shp).tolist() == [2, 4]
    assert_same_on_ort(m, fixed.model, {"x": x})
    np.testing.assert_allclose(run_numpy(fixed.model, {"x": x}, True)[0], run_ort(m, {"x": x})[0], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ BatchNormalization folding

def _bn(rng, c, name="bn", x="c", y="y"):
    inits = {f"{name}.s": rng.uniform(0.5, 1.5, c).astype(np.float32), f"{name}.b": rand(rng, c),
             f"{name}.m": rand(rng, c), f"{name}.v": rng.uniform(0.5, 2.0, c).astype(np.float32)}
    node = helper.make_node("BatchNormalization", [x, *inits], [y], epsilon=1e-3, name=name)
    return node, inits


@pytest.mark.parametrize("bias,group", [(True, 1), (False, 1), (True, 2)])
def test_conv_batchnorm_folds(bias, group):
    rng = np.random.default_rng(4)
    bn, inits = _bn(rng, 6)
    inits["w"] = rand(rng, 6, 4 // group, 3, 3)
    ins = ["x", "w"]
    if bias:
        inits["b"] = rand(rng, 6)
        ins.append("b")
    nodes = [helper.make_node("Conv", ins, ["c"], pads=[1, 1, 1, 1], group=group), bn]
    m = make(nodes, [("x", [2, 4, 5, 5])], [("y", [2, 6, 5, 5])], inits)
    out = _apply(fuse_batchnorm, m)
    assert _ops(out) == ["Conv"] and len(out.graph.node[0].input) == 3
    assert {t.name for t in out.graph.initializer} <= {"w", "b", "w_bias_bn"}
    x = rand(rng, 2, 4, 5, 5)
    assert_same_on_ort(m, out, {"x": x}, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(run_numpy(out, {"x": x}, True)[0], run_ort(m, {"x": x})[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("trans_b,with_c", [(1, True), (0, True), (1, False)])
def test_gemm_batchnorm_folds(trans_b, with_c):
    rng = np.random.default_rng(5)
    bn, inits = _bn(rng, 3)
    inits["w"] = rand(rng, 3, 4) if trans_b else rand(rng, 4, 3)
    ins = ["x", "w"]
    if with_c:
        inits["cb"] = rand(rng, 3)
        ins.append("cb")
    m = make([helper.make_node("Gemm", ins, ["c"], transB=trans_b, beta=0.5, alpha=1.5), bn],
             [("x", [5, 4])], [("y", [5, 3])], inits)
    out = _apply(fuse_batchnorm, m)
    assert _ops(out) == ["Gemm"]
    assert_same_on_ort(m, out, {"x": rand(rng, 5, 4)}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_add", [True, False])
def test_matmul_add_batchnorm_folds(with_add):
    rng = np.random.default_rng(6)
    bn, inits = _bn(rng, 3, x="a" if with_add else "mm")
    inits.update(w=rand(rng, 4, 3), bias=rand(rng, 3))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"])]
    if with_add:
        nodes.append(helper.make_node("Add", ["mm", "bias"], ["a"]))
    else:
        del inits["bias"]
    m = make(nodes + [bn], [("x", [5, 4])], [("y", [5, 3])], inits)
    out = optimize_model(m)
    assert _ops(out) == ["MatMul", "Add"]
    assert_same_on_ort(m, out, {"x": rand(rng, 5, 4)}, rtol=1e-4, atol=1e-5)


def test_batchnorm_folding_leaves_what_it_cannot_fold():
    rng = np.random.default_rng(7)
    # the Conv output is read twice: folding BN into it would change the other reader
    bn, inits = _bn(rng, 2)
    inits["w"] = rand(rng, 2, 2, 1, 1)
    shared = make([helper.make_node("Conv", ["x", "w"], ["c"]), bn, helper.make_node("Add", ["y", "c"], ["z"])],
                  [("x", [1, 2, 3, 3])], [("z", [1, 2, 3, 3])], inits)
    assert "BatchNormalization" in _ops(_apply(fuse_batchnorm, shared))
    # a weight two Convs share gets a new name for each folded copy
    bn1, i1 = _bn(rng, 2, "bn1", "c1", "y1")
    bn2, i2 = _bn(rng, 2, "bn2", "c2", "y2")
    two = make([helper.make_node("Conv", ["x", "w"], ["c1"]), bn1, helper.make_node("Conv", ["x", "w"], ["c2"]), bn2,
                helper.make_node("Add", ["y1", "y2"], ["z"])],
               [("x", [1, 2, 3, 3])], [("z", [1, 2, 3, 3])], {"w": inits["w"], **i1, **i2})
    out = _apply(fuse_batchnorm, two)
    assert _ops(out) == ["Conv", "Conv", "Add"] and out.graph.node[0].input[1] != out.graph.node[1].input[1]
    assert_same_on_ort(two, out, {"x": rand(rng, 1, 2, 3, 3)}, rtol=1e-4, atol=1e-5)
    # training keeps BN (its parameters train)
    assert "BatchNormalization" in _ops(_apply(fuse_batchnorm, two, for_training=True))


@pytest.mark.parametrize("shape", [(1,), (), (6, 1, 1), (1, 6, 1, 1)])
def test_conv_mul_add_by_a_per_channel_constant_folds(shape):
    # PP-OCRv4's "learnable affine block": Conv -> Mul(scale) -> Add(bias), then an activation
    rng = np.random.default_rng(8)
    inits = {"w": rand(rng, 6, 4, 3, 3), "b": rand(rng, 6), "s": rand(rng, *shape) + 1.5, "d": rand(rng, *shape)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["s", "c"], ["m"]), helper.make_node("Add", ["m", "d"], ["a"]),
             helper.make_node("HardSigmoid", ["a"], ["y"])]
    m = make(nodes, [("x", [2, 4, 5, 5])], [("y", [2, 6, 5, 5])], inits)
    out = _apply(fuse_conv_affine, m)
    assert _ops(out) == ["Conv", "HardSigmoid"]
    x = rand(rng, 2, 4, 5, 5)
    assert_same_on_ort(m, out, {"x": x}, rtol=1e-4, atol=1e-5)
    assert _ops(optimize_model(m)) == ["Conv", "HardSigmoid"]  # in the pipeline


def test_conv_affine_folding_leaves_what_it_cannot_fold():
    rng = np.random.default_rng(9)
    inits = {"w": rand(rng, 2, 2, 1, 1), "s": rand(rng, 1, 2, 3, 1), "t": rand(rng, 2)}
    x = [("x", [1, 2, 3, 3])]
    # a constant that varies over the spatial axes, or over the last axis (not the channels), stays a Mul
    for c in ("s", "t"):
        m = make([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Mul", ["c", c], ["y"])],
                 x, [("y", [1, 2, 3, 3])], inits)
        assert _ops(_apply(fuse_conv_affine, m)) == ["Conv", "Mul"]
    # a Conv output read twice, or a Mul of two activations
    two = make([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Mul", ["c", "t3"], ["m"]),
                helper.make_node("Add", ["m", "c"], ["y"])], x, [("y", [1, 2, 3, 3])],
               {"w": inits["w"], "t3": rand(rng, 2, 1, 1)})
    assert _ops(_apply(fuse_conv_affine, two)) == ["Conv", "Mul", "Add"]
    # training keeps them (the conv weights train)
    one = make([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Mul", ["c", "t3"], ["y"])],
               x, [("y", [1, 2, 3, 3])], {"w": inits["w"], "t3": rand(rng, 2, 1, 1)})
    assert _ops(_apply(fuse_conv_affine, one)) == ["Conv"]
    assert _ops(_apply(fuse_conv_affine, one, for_training=True)) == ["Conv", "Mul"]


# ------------------------------------------------------------------ HardSwish in four ops

def _paddle_hardswish(opset, *, by_mul=False, swap=False, extra_reader=False):
    """Conv -> x * Clip(x + 3, 0, 6) / 6 -> Conv, the way Paddle exports hard_swish."""
    rng = np.random.default_rng(11)
    inits = {"w": rand(rng, 4, 3, 3, 3), "w2": rand(rng, 2, 4, 1, 1), "three": np.float32(3.0),
             "six": np.float32(6.0), "sixth": np.float32(1 / 6), "zero": np.float32(0.0)}
    clip = (helper.make_node("Clip", ["a"], ["r"], min=0.0, max=6.0) if opset < 11
            else helper.make_node("Clip", ["a", "zero", "six"], ["r"]))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["three", "c"] if swap else ["c", "three"], ["a"]), clip,
             helper.make_node("Mul", ["r", "c"] if swap else ["c", "r"], ["m"]),
             helper.make_node("Mul", ["m", "sixth"], ["h"]) if by_mul else helper.make_node("Div", ["m", "six"], ["h"]),
             helper.make_node("Conv", ["h", "w2"], ["y"])]
    outputs = [("y", [1, 2, 5, 5])] + ([("r", [1, 4, 5, 5])] if extra_reader else [])
    return make(nodes, [("x", [1, 3, 5, 5])], outputs, inits, opset=opset)


@pytest.mark.parametrize("opset,by_mul,swap", [(14, False, False), (14, True, True), (13, False, True),
                                               (10, False, False)])
def test_hardswish_in_four_ops_becomes_one(opset, by_mul, swap):
    m = _paddle_hardswish(opset, by_mul=by_mul, swap=swap)
    out = _apply(fuse_hardswish, m)
    want = ["Conv", "HardSwish", "Conv"] if opset >= 14 else ["Conv", "HardSigmoid", "Mul", "Conv"]
    assert _ops(out) == want
    x = {"x": np.random.default_rng(1).standard_normal((1, 3, 5, 5)).astype(np.float32) * 3}
    np.testing.assert_allclose(run_ort(out, x)[0], run_ort(m, x)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run_numpy(out, x, optimize=False)[0], run_ort(m, x)[0], rtol=1e-5, atol=1e-6)
    assert "HardSwish" in _ops(optimize_model(m)) or opset < 14  # part of the optimizer's pipeline


def test_hardswish_fusion_leaves_what_it_cannot_fuse():
    # the Clip's output is also a graph output; training graphs keep their ops
    assert "Clip" in _ops(_apply(fuse_hardswish, _paddle_hardswish(14, extra_reader=True)))
    assert "Clip" in _ops(_apply(fuse_hardswish, _paddle_hardswish(14), for_training=True))
    m = _paddle_hardswish(14)
    for t in m.graph.initializer:
        if t.name == "three":
            t.CopyFrom(numpy_helper.from_array(np.float32(2.5), "three"))  # not HardSwish
    assert "Clip" in _ops(_apply(fuse_hardswish, m))


# ------------------------------------------------------------------ dead nodes, subgraphs, purity

def test_dead_nodes_and_unused_initializers_are_removed():
    m = make([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Mul", ["x", "k"], ["unused"]),
              helper.make_node("Neg", ["unused"], ["unused2"])],
             [("x", [2])], [("y", [2])], {"k": np.ones(2, np.float32), "spare": np.zeros(1, np.float32)})
    out = _apply(remove_dead_nodes, m)
    assert _ops(out) == ["Relu"] and not out.graph.initializer


def _if_model():
    """y = If(c, then: a * w, else: a + 1) where a = Identity(Relu(x)), read only inside the branches."""
    then_g = helper.make_graph([helper.make_node("Mul", ["a", "w"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [3])])
    else_g = helper.make_graph([helper.make_node("Add", ["a", "one"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [3])],
                               [numpy_helper.from_array(np.ones(3, np.float32), "one")])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["a"]),
             helper.make_node("Neg", ["w0"], ["w"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    return make(nodes, [("x", [3]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])], [("y", [3])],
                {"w0": np.array([1.0, -2.0, 3.0], np.float32)})


def test_values_read_inside_subgraphs_survive_and_bodies_stay_intact():
    m = _if_model()
    out = optimize_model(m)
    ops = _ops(out)
    assert "If" in ops and "Relu" in ops
    assert "a" in {o for n in out.graph.node for o in n.output}  # the branches read 'a' by name: it stays
    assert "Neg" not in ops and "w" in {t.name for t in out.graph.initializer}  # folded; the branch still sees 'w'
    before_if = next(n for n in m.graph.node if n.op_type == "If")
    after_if = next(n for n in out.graph.node if n.op_type == "If")
    assert [a.SerializeToString() for a in after_if.attribute] == [a.SerializeToString() for a in before_if.attribute]
    x = np.array([-1.0, 2.0, 3.0], np.float32)
    for c in (True, False):
        assert_same_on_ort(m, out, {"x": x, "c": np.array(c)}, rtol=0, atol=0)


def test_the_given_model_is_not_changed():
    m = zoo.small_cnn(batch_norm=True)
    before = m.SerializeToString()
    optimize(m, shapes={"input": (1, 1, 28, 28)})
    compile_graph(m)
    assert m.SerializeToString() == before


def test_unknown_pass_is_named():
    from edgeflow.errors import InputError

    with pytest.raises(InputError, match="unknown optimizer pass.*'nope'.*fold"):
        optimize(zoo.mlp(), passes=["fold", "nope"])


# ------------------------------------------------------------------ numpy-backend passes

@pytest.mark.parametrize("act", ["Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid"])
def test_activation_fusion_gives_identical_results(act):
    rng = np.random.default_rng(8)
    inits = {"w": rand(rng, 4, 2, 3, 3), "b": rand(rng, 4), "fw": rand(rng, 4 * 25, 3),
             "lo": np.array(0.0, np.float32), "hi": np.array(0.5, np.float32)}
    extra = ["lo", "hi"] if act == "Clip" else []
    attrs = {"alpha": 0.2} if act == "LeakyRelu" else {}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node(act, ["c", *extra], ["a"], **attrs),
             helper.make_node("Flatten", ["a"], ["f"]),
             helper.make_node("MatMul", ["f", "fw"], ["m"]),
             helper.make_node(act, ["m", *extra], ["y"], **attrs)]
    m = make(nodes, [("x", [3, 2, 5, 5])], [("y", [3, 3])], inits)
    g = compile_graph(m)
    assert [n.kernel.op_type for n in g.nodes] == [f"Conv+{act}", "Flatten", f"MatMul+{act}"]
    x = rand(rng, 3, 2, 5, 5)
    np.testing.assert_array_equal(run_numpy(m, {"x": x}, True)[0], run_numpy(m, {"x": x}, False)[0])
    np.testing.assert_allclose(run_numpy(m, {"x": x}, True)[0], run_ort(m, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_activation_is_not_fused_into_a_value_read_elsewhere_or_computed_bounds():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Add", ["r", "m"], ["a"]), helper.make_node("Clip", ["a", "x0"], ["y"])]
    m = make(nodes, [("x", [2, 2]), ("x0", [])], [("y", [2, 2])], {"w": np.eye(2, dtype=np.float32)})
    assert [n.kernel.op_type for n in compile_graph(m).nodes] == ["MatMul", "Relu", "Add", "Clip"]


def test_gemm_weights_are_prepacked_once():
    m = zoo.mlp((8, 6, 4))
    g = compile_graph(m)
    assert all(n.attrs.get("transB", 0) == 0 for n in g.nodes)
    assert g.initializers["fc0.weight"].shape == (8, 6) and g.initializers["fc0.weight"].flags.c_contiguous
    x = np.random.default_rng(9).standard_normal((5, 8)).astype(np.float32)
    np.testing.assert_allclose(run_numpy(m, {"input": x}, True)[0], run_ort(m, {"input": x})[0], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ zoo and third-party models

def _with_bn_stats(m: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """The zoo's BN nets start at identity statistics; give them real ones."""
    rng = np.random.default_rng(seed)
    m2 = onnx.ModelProto()
    m2.CopyFrom(m)
    for t in m2.graph.initializer:
        if t.name.startswith("bn"):
            a = numpy_helper.to_array(t)
            kind = t.name.rsplit(".", 1)[1]
            new = rng.uniform(0.5, 2.0, a.shape) if kind in ("scale", "var") else rng.normal(0, 0.5, a.shape)
            t.CopyFrom(numpy_helper.from_array(new.astype(np.float32), t.name))
    return m2


@pytest.mark.parametrize("name", ["small_cnn", "small_cnn_bn", "digits_cnn_bn", "mlp"])
def test_zoo_models_give_the_same_outputs(name):
    m = {"small_cnn": lambda: zoo.small_cnn(), "small_cnn_bn": lambda: _with_bn_stats(zoo.small_cnn(batch_norm=True), 1),
         "digits_cnn_bn": lambda: _with_bn_stats(zoo.digits_cnn(batch_norm=True), 2), "mlp": lambda: zoo.mlp()}[name]()
    shape = [d if isinstance(d, int) else 4 for d in model_info(m).inputs[0].shape]
    x = np.random.default_rng(10).standard_normal(shape).astype(np.float32)
    r = optimize(m)
    assert "BatchNormalization" not in r.report.after
    assert_same_on_ort(m, r.model, {"input": x}, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(run_numpy(m, {"input": x}, True)[0], run_numpy(m, {"input": x}, False)[0],
                               rtol=1e-4, atol=1e-5)


_LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


@pytest.mark.parametrize("name", ["light_squeezenet", "light_inception_v2", "light_vgg19"])
def test_onnx_wheel_models_give_the_same_outputs(name):
    """The onnx wheel's own model-zoo graphs (Caffe2 exports, IR 3, opset 9)."""
    path = _LIGHT / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} is not in this onnx wheel")
    m = load_model(path)
    r = optimize(m)
    assert r.report.nodes_after < r.report.nodes_before
    x = np.random.default_rng(11).standard_normal((1, 3, 224, 224)).astype(np.float32)
    assert_same_on_ort(m, r.model, {model_info(m).inputs[0].name: x}, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ training

def test_for_training_turns_constant_weights_into_trainable_initializers():
    from edgeflow.train import Trainer

    rng = np.random.default_rng(12)
    m = _constant_weight_cnn(rng)
    out = optimize_model(m, for_training=True)
    assert "Constant" not in _ops(out)
    tr = Trainer(out, loss="mse", optimizer="sgd", lr=0.01)
    assert {"w", "b", "fw", "fb"} <= set(tr.trainable_names)
    x, y = rand(rng, 16, 1, 6, 6), rand(rng, 16, 3)
    h = tr.fit((x, y), epochs=3)
    assert h.loss[-1] < h.loss[0]


def test_the_optimizer_sits_below_graph_quantization_and_training():
    """No cycle: optimize imports only the kernels, model loading and errors (in-function imports
    included), and graph.py no longer imports quantization."""
    import ast
    import sys

    root = Path(__file__).resolve().parents[1]
    allowed = {"numpy", "onnx", "edgeflow.kernels", "edgeflow.runtime.model", "edgeflow.errors", "edgeflow.runtime.optimize"}

    def imports(path: Path) -> set[str]:
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(path.relative_to(root).with_suffix("").parts[: -node.level])
                    out.add(f"{base}.{node.module}" if node.module else base)
                else:
                    out.add(node.module)
        return out

    for f in sorted((root / "edgeflow" / "runtime" / "optimize").rglob("*.py")):
        for mod in imports(f):
            top = mod.split(".")[0]
            ok = top in sys.stdlib_module_names or top == "__future__" or any(
                mod == a or mod.startswith(a + ".") for a in allowed)
            assert ok, f"{f.relative_to(root)} imports {mod}"
    assert not any("quantization" in m for m in imports(root / "edgeflow" / "runtime" / "graph.py"))


@pytest.mark.parametrize("name,bn", [("light_resnet50", 53), ("light_shufflenet", 49)])
def test_onnx_wheel_cnns_fold_their_batchnorms(name, bn):
    """Their weights are ConstantOfShape fills: once folded (given a ConstantOfShape kernel),
    every BN folds. Weights are then randomized and the logits compared on onnxruntime
    and on the numpy backend."""
    from edgeflow.kernels import has_kernel

    path = _LIGHT / f"{name}.onnx"
    if not path.exists() or not has_kernel("ConstantOfShape", "", 9):
        pytest.skip("needs the onnx wheel's light models and a ConstantOfShape kernel")
    m = load_model(path)
    r = optimize(m)
    assert r.report.before["BatchNormalization"] == bn and "BatchNormalization" not in r.report.after
    assert "ConstantOfShape" not in r.report.after
    base = optimize(m, passes=["constants", "fold"]).model
    rng = np.random.default_rng(1)
    for t in base.graph.initializer:
        a = numpy_helper.to_array(t)
        if a.dtype == np.float32 and a.size > 1:
            scale = (2.0 / max(1, a[0].size)) ** 0.5 if a.ndim > 1 else 0.1
            new = rng.uniform(0.5, 1.5, a.shape) if "_s_" in t.name or "riv" in t.name else rng.normal(0, scale, a.shape)
            t.CopyFrom(numpy_helper.from_array(new.astype(np.float32), t.name))
    softmax = next(n for n in base.graph.node if n.op_type == "Softmax")
    base.graph.node.remove(softmax)  # compare logits: a saturated softmax would hide differences
    del base.graph.output[:]
    base.graph.output.append(helper.make_tensor_value_info(softmax.input[0], TensorProto.FLOAT, None))
    folded = optimize(base)
    assert folded.report.removed_by_pass["fuse_bn"] == bn
    x = np.random.default_rng(2).standard_normal((1, 3, 224, 224)).astype(np.float32)
    feeds = {model_info(base).inputs[0].name: x}
    ref = run_ort(base, feeds)[0]
    scale = np.abs(ref).max()
    np.testing.assert_allclose(run_ort(folded.model, feeds)[0] / scale, ref / scale, atol=1e-5)
    np.testing.assert_allclose(run_numpy(base, feeds, True)[0] / scale, ref / scale, atol=1e-5)
