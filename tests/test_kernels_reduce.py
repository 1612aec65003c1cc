"""Reductions: every Reduce* on every axes form (attribute, input, empty,
noop), negative axes, empty tensors, integer dtypes; ArgMax/ArgMin."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(11)

REF = {
    "ReduceSum": lambda x, ax, kd: np.sum(x, axis=ax, keepdims=kd),
    "ReduceMean": lambda x, ax, kd: np.mean(x, axis=ax, keepdims=kd),
    "ReduceMax": lambda x, ax, kd: np.max(x, axis=ax, keepdims=kd),
    "ReduceMin": lambda x, ax, kd: np.min(x, axis=ax, keepdims=kd),
    "ReduceProd": lambda x, ax, kd: np.prod(x, axis=ax, keepdims=kd),
    "ReduceL1": lambda x, ax, kd: np.sum(np.abs(x), axis=ax, keepdims=kd),
    "ReduceL2": lambda x, ax, kd: np.sqrt(np.sum(x * x, axis=ax, keepdims=kd)),
    "ReduceSumSquare": lambda x, ax, kd: np.sum(x * x, axis=ax, keepdims=kd),
    "ReduceLogSum": lambda x, ax, kd: np.log(np.sum(x, axis=ax, keepdims=kd)),
    "ReduceLogSumExp": lambda x, ax, kd: np.log(np.sum(np.exp(x), axis=ax, keepdims=kd)),
}
OPS = sorted(REF)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("axes", [None, (0,), (-1,), (0, 2), (-3, -1, 1)])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_input_and_attribute_forms_agree_with_numpy(op, axes, keepdims):
    x = RNG.uniform(0.5, 2.0, (2, 3, 4))
    want = REF[op](x, None if axes is None else tuple(a % 3 for a in axes), bool(keepdims))
    new = get_kernel(op, opset=18)(x, None if axes is None else np.array(axes, np.int64), keepdims=keepdims)
    old = get_kernel(op, opset=13 if op != "ReduceSum" else 11)(x, axes=axes, keepdims=keepdims)
    for got in (new, old):
        assert got.dtype == x.dtype and got.shape == np.shape(want)
        np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_noop_with_empty_axes_reduces_over_no_axes(op):
    """The reduction step is the identity; composite reductions keep their
    element-wise steps (ReduceSumSquare squares, ReduceLogSum takes the log)."""
    x = RNG.uniform(-2.0, 2.0, (2, 3))
    if op == "ReduceLogSum":
        x = np.abs(x)
    k = get_kernel(op, opset=18)
    want = REF[op](x, (), True)
    for axes in (np.array([], np.int64), None):
        got = k(x, axes, noop_with_empty_axes=1)
        assert got.shape == x.shape
        np.testing.assert_allclose(got, want, rtol=1e-12)
    if op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"):
        assert k(x, None, noop_with_empty_axes=1) is x
    assert k(x, np.array([], np.int64)).shape == (1, 1)  # empty axes without noop: reduce all


EMPTY_SET = {
    "ReduceSum": 0, "ReduceMean": np.nan, "ReduceMax": -np.inf, "ReduceMin": np.inf, "ReduceProd": 1,
    "ReduceL1": 0, "ReduceL2": 0, "ReduceSumSquare": 0, "ReduceLogSum": -np.inf, "ReduceLogSumExp": -np.inf,
}


@pytest.mark.parametrize("op", OPS)
def test_reduction_over_an_empty_axis_is_the_identity(op):
    x = np.zeros((2, 0, 3), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = get_kernel(op, opset=18)(x, np.array([1], np.int64), keepdims=1)
    assert y.shape == (2, 1, 3) and y.dtype == np.float32
    np.testing.assert_array_equal(y, np.full((2, 1, 3), EMPTY_SET[op], np.float32))


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_empty_integer_max_min_use_the_type_limits(op):
    y = get_kernel(op, opset=18, dtype="int32")(np.zeros((0, 2), np.int32), np.array([0], np.int64), keepdims=0)
    info = np.iinfo(np.int32)
    assert y.tolist() == [info.min] * 2 if op == "ReduceMax" else [info.max] * 2


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceMax",
                                "ReduceMean"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32])
def test_integer_reductions_keep_the_dtype(op, dtype):
    x = np.array([[1, 2, 3], [4, 5, 6]], dtype)
    y = get_kernel(op, opset=18, dtype=np.dtype(dtype).name)(x, np.array([1], np.int64), keepdims=0)
    assert y.dtype == dtype
    want = REF[op](x.astype(np.float64), (1,), False)
    np.testing.assert_array_equal(y, want.astype(dtype))


def test_log_sum_exp_is_stable():
    x = np.array([[1000.0, 1000.0], [-np.inf, -np.inf], [-np.inf, 0.0], [np.inf, 1.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = get_kernel("ReduceLogSumExp", opset=18)(x, np.array([1], np.int64), keepdims=0)
    np.testing.assert_allclose(y[:3], [1000 + np.log(2), -np.inf, 0.0])
    assert y[3] == np.inf


def test_float16_sum_square_and_l2_do_not_overflow():
    x = np.full((4,), 300.0, np.float16)  # 300^2 overflows float16
    assert get_kernel("ReduceL2", opset=18)(x, keepdims=0) == np.float16(600)
    assert get_kernel("ReduceLogSumExp", opset=18)(np.full(3, 20.0, np.float16), keepdims=0).dtype == np.float16


def test_axis_out_of_range_is_a_clear_error():
    with pytest.raises(KernelError, match="axis 3 is out of range"):
        get_kernel("ReduceSum", opset=13)(np.ones((2, 3)), np.array([3]))


@pytest.mark.parametrize("op,fn", [("ArgMax", np.argmax), ("ArgMin", np.argmin)])
def test_arg_extrema(op, fn):
    x = np.array([[1, 5, 5, 0], [7, 7, 2, 2]], np.int32)
    k = get_kernel(op, opset=13, dtype="int32")
    assert k(x, axis=1, keepdims=0).tolist() == fn(x, axis=1).tolist()
    last = k(x, axis=1, keepdims=0, select_last_index=1).tolist()
    assert last == ([2, 1] if op == "ArgMax" else [3, 3])
    assert k(x, axis=-2).shape == (1, 4)
    assert k(x, axis=0).dtype == np.int64
    with pytest.raises(KernelError, match="out of range"):
        k(x, axis=2)
    with pytest.raises(KernelError, match="empty axis"):
        k(np.zeros((2, 0), np.int32), axis=1)
