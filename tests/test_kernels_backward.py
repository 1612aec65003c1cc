"""Backwards of the math, reduction and indexing kernels against float64
central finite differences (the checker of tests/test_backward_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest
from test_backward_kernels import check_backward

RNG = np.random.default_rng(99)


def r(*shape, lo=-2.0, hi=2.0):
    return RNG.uniform(lo, hi, shape)


def _away_from(x, points, margin=0.05):
    for p in points:
        x = np.where(np.abs(x - p) < margin, x + 2 * margin, x)
    return x


@pytest.mark.parametrize("op,lo,hi", [
    ("Sin", -3, 3), ("Cos", -3, 3), ("Tan", -1.2, 1.2), ("Asin", -0.9, 0.9), ("Acos", -0.9, 0.9), ("Atan", -3, 3),
    ("Sinh", -2, 2), ("Cosh", -2, 2), ("Asinh", -3, 3), ("Acosh", 1.2, 3), ("Atanh", -0.9, 0.9), ("Erf", -3, 3),
    ("Softsign", -3, 3), ("Mish", -4, 4),
])
def test_unary(op, lo, hi):
    check_backward(op, [r(3, 4, lo=lo, hi=hi)], opset=22)


@pytest.mark.parametrize("op,attrs,kinks", [
    ("Gelu", {}, []), ("Gelu", {"approximate": "tanh"}, []), ("Swish", {"alpha": 1.7}, []),
    ("HardSwish", {}, [-3, 3]), ("ThresholdedRelu", {"alpha": 0.4}, [0.4]),
])
def test_activations(op, attrs, kinks):
    check_backward(op, [_away_from(r(4, 5, lo=-4, hi=4), kinks)], attrs, opset=24)


def test_swiglu():
    check_backward("SwiGLU", [r(3, 4), r(3, 4)], {"alpha": 1.3}, opset=28)


@pytest.mark.parametrize("slope_shape", [(1,), (3, 1, 1), (5,), (2, 3, 4, 5)])
def test_prelu(slope_shape):
    check_backward("PRelu", [_away_from(r(2, 3, 4, 5), [0]), r(*slope_shape)], opset=16)


def test_prelu_per_channel_slope():
    check_backward("PRelu", [_away_from(r(2, 3, 4), [0]), r(3)], opset=16)


REDUCTIONS = ["ReduceSum", "ReduceMean", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "ReduceLogSum"]


@pytest.mark.parametrize("op", REDUCTIONS)
@pytest.mark.parametrize("axes", [None, (1,), (0, -1)])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reductions(op, axes, keepdims):
    x = r(2, 3, 4, lo=0.3, hi=2.0) if op == "ReduceLogSum" else _away_from(r(2, 3, 4), [0])
    ax = None if axes is None else np.array(axes, np.int64)
    check_backward(op, [x, ax], {"keepdims": keepdims}, opset=18, wrt=[0])
    check_backward(op, [x], {"keepdims": keepdims, "axes": axes}, opset=13 if op != "ReduceSum" else 11)


@pytest.mark.parametrize("op", REDUCTIONS)
def test_reduction_over_no_axes(op):
    x = r(2, 3, lo=0.3, hi=2.0) if op == "ReduceLogSum" else _away_from(r(2, 3), [0])
    check_backward(op, [x, np.array([], np.int64)], {"noop_with_empty_axes": 1}, opset=18, wrt=[0])


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, -1])
def test_cumsum(exclusive, reverse, axis):
    check_backward("CumSum", [r(3, 4), np.array(axis)], {"exclusive": exclusive, "reverse": reverse}, opset=14)


def test_gather_elements_with_repeated_indices():
    idx = np.array([[0, 2, 2], [1, 1, 0]])
    check_backward("GatherElements", [r(2, 3), idx], {"axis": 1}, opset=13)


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd(batch_dims):
    idx = np.array([[[1], [1]], [[0], [2]]]) if batch_dims else np.array([[1, 0], [1, 0], [0, 2]])
    check_backward("GatherND", [r(2, 3, 4), idx], {"batch_dims": batch_dims}, opset=13)


@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_elements(reduction):
    idx = np.array([[2, 0], [1, 2]]) if reduction == "none" else np.array([[2, 2], [0, 0]])
    check_backward("ScatterElements", [r(2, 3), idx, r(2, 2)], {"axis": 1, "reduction": reduction}, opset=18)


@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_nd(reduction):
    idx = np.array([[1], [0]]) if reduction == "none" else np.array([[1], [1]])
    check_backward("ScatterND", [r(3, 4), idx, r(2, 4)], {"reduction": reduction}, opset=18)


@pytest.mark.parametrize("largest", [0, 1])
def test_topk(largest):
    x = RNG.permutation(20).reshape(4, 5).astype(np.float64)  # distinct values: no ties at the cut
    check_backward("TopK", [x, np.array([2])], {"axis": 1, "largest": largest}, opset=11)


@pytest.mark.parametrize("axis,idx", [(0, np.array([[1, 0], [1, -1]])), (1, np.array([2, 2, 0])), (-1, np.array(1))])
def test_gather_embeddings_accumulate(axis, idx):
    check_backward("Gather", [r(3, 4), idx], {"axis": axis}, opset=13)


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore", [None, 1])
def test_onnx_losses(op, reduction, weighted, ignore):
    x = r(3, 4, 2)
    target = np.array([[0, 1], [3, 2], [1, 1]])
    inputs = [x, target] + ([RNG.uniform(0.5, 2.0, 4)] if weighted else [])
    attrs = {"reduction": reduction} | ({} if ignore is None else {"ignore_index": ignore})
    check_backward(op, inputs, attrs, opset=13, wrt=[0])
