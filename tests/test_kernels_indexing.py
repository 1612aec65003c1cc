"""Gather/Scatter families, TensorScatter, TopK, Unique, CumSum/CumProd,
against small loop references (the ONNX definitions written out)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(5)


def k(op, opset=18, dtype=None):
    return get_kernel(op, opset=opset, dtype=dtype)


# ---------------------------------------------------------------- gathers


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_gather_elements_against_the_definition(axis):
    data = RNG.standard_normal((3, 4, 5))
    ax = axis % 3
    shape = list(data.shape)
    shape[ax] = 6
    idx = RNG.integers(-data.shape[ax], data.shape[ax], size=shape)
    out = k("GatherElements", 13)(data, idx, axis=axis)
    for pos in itertools.product(*map(range, shape)):
        src = list(pos)
        src[ax] = idx[pos] % data.shape[ax]
        assert out[pos] == data[tuple(src)]
    with pytest.raises(KernelError, match="out of range"):
        k("GatherElements", 13)(data, np.full(shape, data.shape[ax]), axis=axis)


def test_gather_elements_smaller_index_shape_and_int32():
    data = np.arange(12).reshape(3, 4)
    idx = np.array([[2], [0]], np.int32)
    assert k("GatherElements", 13)(data, idx, axis=1).tolist() == [[2], [4]]


@pytest.mark.parametrize("batch_dims", [0, 1, 2])
def test_gather_nd_against_the_definition(batch_dims):
    data = RNG.standard_normal((2, 3, 4, 5))
    kk = 4 - batch_dims - 1
    idx_shape = data.shape[:batch_dims] + (2, 2, kk)
    dims = data.shape[batch_dims:batch_dims + kk]
    idx = np.stack([RNG.integers(-d, d, size=idx_shape[:-1]) for d in dims], axis=-1)
    out = k("GatherND", 13)(data, idx, batch_dims=batch_dims)
    assert out.shape == idx_shape[:-1] + data.shape[batch_dims + kk:]
    for pos in itertools.product(*map(range, idx_shape[:-1])):
        src = pos[:batch_dims] + tuple(int(i) % d for i, d in zip(idx[pos], dims))
        np.testing.assert_array_equal(out[pos], data[src])


def test_gather_nd_errors():
    data = np.zeros((2, 3))
    with pytest.raises(KernelError, match="out of range"):
        k("GatherND", 13)(data, np.array([[0, 3]]))
    with pytest.raises(KernelError, match="batch_dims"):
        k("GatherND", 13)(data, np.array([[0]]), batch_dims=2)
    with pytest.raises(KernelError, match="length 3"):
        k("GatherND", 13)(data, np.array([[0, 0, 0]]))


def test_gather_negative_indices_and_dtypes():
    for dtype in (np.bool_, np.int8, np.uint64, np.float16):
        data = np.arange(6).astype(dtype).reshape(2, 3)
        out = get_kernel("Gather", opset=13, dtype=np.dtype(dtype).name)(data, np.array([-1, 0]), axis=1)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, data[:, [2, 0]])


# ---------------------------------------------------------------- scatters


def _scatter_elements_loop(data, idx, upd, axis, reduction):
    out = data.copy()
    fn = {"none": lambda a, b: b, "add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[reduction]
    for pos in itertools.product(*map(range, idx.shape)):
        dst = list(pos)
        dst[axis] = idx[pos] % data.shape[axis]
        out[tuple(dst)] = fn(out[tuple(dst)], upd[pos])
    return out


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8])
@pytest.mark.parametrize("axis", [0, -1])
def test_scatter_elements_duplicates_accumulate(reduction, dtype, axis):
    data = RNG.integers(1, 5, size=(3, 4)).astype(dtype)
    idx = RNG.integers(-3 if axis == 0 else -4, 3 if axis == 0 else 4, size=(3, 4))
    upd = RNG.integers(1, 4, size=(3, 4)).astype(dtype)
    out = k("ScatterElements", 18, np.dtype(dtype).name)(data, idx, upd, axis=axis, reduction=reduction)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, _scatter_elements_loop(data, idx, upd, axis % 2, reduction))
    assert not np.shares_memory(out, data)


def test_scatter_elements_none_and_errors():
    data = np.zeros((2, 3))
    out = k("ScatterElements", 11)(data, np.array([[2, 0]]), np.array([[5.0, 6.0]]), axis=1)
    assert out.tolist() == [[6, 0, 5], [0, 0, 0]]
    assert k("Scatter", 9)(data, np.array([[1]]), np.array([[4.0]]), axis=0).tolist() == [[0, 0, 0], [4, 0, 0]]
    with pytest.raises(KernelError, match="reduction"):
        k("ScatterElements", 18)(data, np.array([[0]]), np.array([[1.0]]), reduction="avg")
    with pytest.raises(KernelError, match="out of range"):
        k("ScatterElements", 18)(data, np.array([[3]]), np.array([[1.0]]), axis=1)
    with pytest.raises(KernelError, match="updates shape"):
        k("ScatterElements", 18)(data, np.array([[0]]), np.array([[1.0, 2.0]]))


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_nd(reduction):
    data = RNG.integers(1, 5, size=(4, 3, 2)).astype(np.int32)
    idx = np.array([[[1, 0], [-1, 2]], [[1, 0], [0, 1]]])  # a duplicate (1, 0)
    upd = RNG.integers(1, 4, size=(2, 2, 2)).astype(np.int32)
    if reduction == "none":
        idx = idx[:, :1]
        upd = upd[:, :1]
        idx[1, 0] = [2, 2]
    out = k("ScatterND", 18, "int32")(data, idx, upd, reduction=reduction)
    ref = data.copy()
    fn = {"none": lambda a, b: b, "add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[reduction]
    for pos in itertools.product(*map(range, idx.shape[:-1])):
        dst = tuple(int(i) % d for i, d in zip(idx[pos], data.shape))
        ref[dst] = fn(ref[dst], upd[pos])
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(KernelError, match="updates shape"):
        k("ScatterND", 18, "int32")(data, idx, upd[..., :1])


@pytest.mark.parametrize("mode", ["linear", "circular"])
@pytest.mark.parametrize("axis", [-2, 1, 2])
def test_tensor_scatter_against_a_loop(mode, axis):
    cache = RNG.standard_normal((2, 3, 6, 4))
    ax = axis % 4
    ushape = list(cache.shape)
    ushape[ax] = 3
    update = RNG.standard_normal(ushape)
    w = np.array([1, 3]) if mode == "linear" or ax != 2 else np.array([4, 5])
    w = np.minimum(w, cache.shape[ax] - 3) if mode == "linear" else w
    out = k("TensorScatter", 24)(cache, update, w, mode=mode, axis=axis)
    ref = cache.copy()
    for prefix in itertools.product(*map(range, cache.shape[:ax])):
        for s in range(3):
            pos = (w[prefix[0]] + s) % cache.shape[ax]
            ref[prefix + (pos,)] = update[prefix + (s,)]
    np.testing.assert_array_equal(out, ref)


def test_tensor_scatter_errors():
    cache = np.zeros((2, 4, 3))
    with pytest.raises(KernelError, match="overruns"):
        k("TensorScatter", 24)(cache, np.ones((2, 2, 3)), np.array([0, 3]))
    with pytest.raises(KernelError, match="mode"):
        k("TensorScatter", 24)(cache, np.ones((2, 2, 3)), mode="ring")
    with pytest.raises(KernelError, match="update shape"):
        k("TensorScatter", 24)(cache, np.ones((2, 2, 2)))


# ---------------------------------------------------------------- TopK, Unique


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.uint64])
def test_topk_ties_come_in_index_order(largest, axis, dtype):
    x = RNG.integers(0, 4, size=(5, 6, 7)).astype(dtype)  # many ties
    kk = 3
    vals, idx = k("TopK", 11, np.dtype(dtype).name)(x, np.array([kk]), axis=axis, largest=largest)
    ax = axis % 3
    assert vals.dtype == dtype and idx.dtype == np.int64
    xm, vm, im = (np.moveaxis(a, ax, -1) for a in (x, vals, idx))
    for pos in itertools.product(*map(range, xm.shape[:-1])):
        row = xm[pos].tolist()
        order = sorted(range(len(row)), key=lambda i: (-row[i] if largest else row[i], i))[:kk]
        assert im[pos].tolist() == order
        assert vm[pos].tolist() == [row[i] for i in order]


def test_topk_k_bounds_and_old_opsets():
    x = np.array([[3.0, 1.0, 2.0]])
    v, i = k("TopK", 11)(x, np.array([0]))
    assert v.shape == (1, 0) and i.shape == (1, 0)
    with pytest.raises(KernelError, match="K=4"):
        k("TopK", 11)(x, np.array([4]))
    assert k("TopK", 1)(x, k=2)[1].tolist() == [[0, 2]]
    assert k("TopK", 10)(x, np.array([1]))[0].tolist() == [[3.0]]


@pytest.mark.parametrize("sorted_", [1, 0])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_unique_outputs_reconstruct_the_input(sorted_, axis):
    x = RNG.integers(0, 3, size=(4, 5))
    x[2] = x[0]
    x[:, 3] = x[:, 1]
    y, first, inverse, counts = k("Unique", 11, "int64")(x, axis=axis, sorted=sorted_)
    if axis is None:
        flat = x.reshape(-1)
        np.testing.assert_array_equal(y[inverse], flat)
        np.testing.assert_array_equal(flat[first], y)
        assert counts.tolist() == [int((flat == v).sum()) for v in y]
        if not sorted_:
            assert first.tolist() == sorted(first.tolist())  # first-occurrence order
        else:
            assert y.tolist() == sorted(y.tolist())
    else:
        np.testing.assert_array_equal(np.take(y, inverse, axis=axis), x)
        np.testing.assert_array_equal(np.take(x, first, axis=axis), y)
        assert counts.sum() == x.shape[axis]
        if not sorted_:
            assert first.tolist() == sorted(first.tolist())


def test_unique_only_y_and_floats():
    x = np.array([2.0, np.nan, 1.0, 2.0])
    y = k("Unique", 11)(x, n_outputs=1)
    assert y[:2].tolist() == [1.0, 2.0] and np.isnan(y[2])


# ---------------------------------------------------------------- CumSum, CumProd


@pytest.mark.parametrize("op,fn,identity", [("CumSum", np.add, 0), ("CumProd", np.multiply, 1)])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cumulative_against_a_loop(op, fn, identity, exclusive, reverse, axis):
    x = RNG.integers(-3, 4, size=(3, 4)).astype(np.int32)
    out = k(op, 26, "int32")(x, np.array(axis, np.int32), exclusive=exclusive, reverse=reverse)
    assert out.dtype == np.int32
    ax = axis % 2
    xm, om = np.moveaxis(x, ax, -1), np.moveaxis(out, ax, -1)
    for pos in itertools.product(*map(range, xm.shape[:-1])):
        row = xm[pos].tolist()
        n = len(row)
        for j in range(n):
            span = range(j + 1, n) if reverse else range(j)
            if not exclusive:
                span = range(j, n) if reverse else range(j + 1)
            acc = identity
            for t in span:
                acc = fn(acc, row[t])
            assert om[pos][j] == acc


def test_cumulative_empty_and_bad_axis():
    assert k("CumSum", 14)(np.zeros((2, 0)), np.array(1), exclusive=1).shape == (2, 0)
    with pytest.raises(KernelError, match="axis 2"):
        k("CumSum", 14)(np.zeros((2, 3)), np.array(2))


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("values", ["distinct", "ties", "nan"])
def test_topk_partitioned_path_keeps_the_tie_rule(largest, values):
    """Long rows with a small k take the argpartition path; ties at the cut and NaN fall back."""
    if values == "distinct":
        x = RNG.permutation(3 * 300).reshape(3, 300).astype(np.float32)
    else:
        x = RNG.integers(0, 12, size=(3, 300)).astype(np.float32)
        if values == "nan":
            x[1, 7] = np.nan
    vals, idx = k("TopK", 11)(x, np.array([20]), axis=1, largest=largest)
    for row in range(3):
        r_ = x[row].tolist()
        key = [(float("inf") if np.isnan(v) else v) for v in r_]  # NaN sorts as the largest
        order = sorted(range(300), key=lambda i: (-key[i] if largest else key[i], i))[:20]
        if values != "nan" or row != 1:
            assert idx[row].tolist() == order
            np.testing.assert_array_equal(vals[row], x[row, order])


@pytest.mark.parametrize("shape,axis", [((1,), 0), ((3, 1), 1), ((1, 4), 0), ((2, 1, 3), -2)])
@pytest.mark.parametrize("largest", [1, 0])
def test_topk_of_a_one_element_axis_is_the_input_without_a_sort(monkeypatch, shape, axis, largest):
    """K = 1 over an axis of one element (thai2rom's batch-1 length sorts, 3 per run): the
    values are a copy of the input, the indices 0, and no sort runs (~5 us each)."""
    from edgeflow.kernels import selection

    def no_sort(*a, **kw):
        raise AssertionError("sorted a one-element axis")

    monkeypatch.setattr(selection, "_sorted_order", no_sort)
    for dtype in (np.float32, np.int64):
        x = RNG.standard_normal(shape).astype(dtype)
        vals, idx = k("TopK", 11, np.dtype(dtype).name)(x, np.array([1]), axis=axis, largest=largest)
        assert vals.dtype == dtype and idx.dtype == np.int64 and vals.shape == idx.shape == x.shape
        np.testing.assert_array_equal(vals, x)
        np.testing.assert_array_equal(idx, np.zeros(shape, np.int64))
        vals[...] = 7
        assert not np.any(x == 7)  # a copy, not the input
