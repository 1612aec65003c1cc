"""Tensor-making and data-moving kernels added for real models: edge cases
(empty shapes, exact integer ranges, out-of-range one-hot indices, ...)."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(3)


def k(op, opset=28, dtype=None):
    return get_kernel(op, opset=opset, dtype=dtype)


# ---------------------------------------------------------------- generators


def test_constant_of_shape():
    f = k("ConstantOfShape", 9)
    z = f(np.array([2, 3], np.int64))
    assert z.dtype == np.float32 and z.shape == (2, 3) and not z.any()
    v = f(np.array([4], np.int64), value=np.array([7], np.int8))
    assert v.dtype == np.int8 and v.tolist() == [7] * 4
    assert f(np.array([], np.int64), value=np.array([1.5])).shape == ()  # an empty shape: a scalar
    assert f(np.array([3, 0], np.int64)).shape == (3, 0)
    with pytest.raises(KernelError, match="negative"):
        f(np.array([-1], np.int64))
    with pytest.raises(KernelError, match="one element"):
        f(np.array([2], np.int64), value=np.array([1, 2]))


@pytest.mark.parametrize("start,limit,delta", [(0, 10, 3), (10, 0, -3), (5, 5, 1), (3, 1, 1), (-7, 8, 4)])
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64, np.float32, np.float64])
def test_range_count_and_values(start, limit, delta, dtype):
    y = k("Range", 11)(*(np.array(v, dtype) for v in (start, limit, delta)))
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, np.arange(start, limit, delta).astype(dtype))


def test_range_int64_is_exact_beyond_float53():
    big = 2**62
    y = k("Range", 11)(np.array(big, np.int64), np.array(big + 10, np.int64), np.array(3, np.int64))
    assert y.tolist() == [big, big + 3, big + 6, big + 9]


def test_range_float16_stash_type():
    args = (np.array(2000, np.float16), np.array(2010, np.float16), np.array(1, np.float16))
    y = k("Range", 27)(*args)
    assert y.dtype == np.float16 and y.shape == (10,)
    assert k("Range", 27)(*args, stash_type=11).shape == (10,)
    with pytest.raises(KernelError, match="stash_type"):
        k("Range", 27)(*args, stash_type=6)
    with pytest.raises(KernelError, match="delta"):
        k("Range", 11)(np.array(0), np.array(3), np.array(0))


def test_eye_like():
    f = k("EyeLike", 22)
    x = np.zeros((3, 5), np.int32)
    np.testing.assert_array_equal(f(x, k=2), np.eye(3, 5, 2, dtype=np.int32))
    assert f(x).dtype == np.int32
    assert f(x, dtype=1).dtype == np.float32
    assert not f(x, k=9).any() and not f(x, k=-3).any()
    with pytest.raises(KernelError, match="2-D"):
        f(np.zeros(3))


@pytest.mark.parametrize("axis", [-1, 0, 1, -2])
def test_one_hot(axis):
    idx = np.array([[0, 2], [-1, 5]], np.int64)  # -1 wraps to depth-1; 5 is out of range: all off
    values = np.array([-1.0, 3.0], np.float32)
    y = k("OneHot", 11)(idx, np.array(3.0), values, axis=axis)
    assert y.dtype == np.float32 and y.ndim == 3
    hot = np.moveaxis(y, axis, -1)
    np.testing.assert_array_equal(hot[0, 0], [3, -1, -1])
    np.testing.assert_array_equal(hot[0, 1], [-1, -1, 3])
    np.testing.assert_array_equal(hot[1, 0], [-1, -1, 3])
    np.testing.assert_array_equal(hot[1, 1], [-1, -1, -1])
    with pytest.raises(KernelError, match="axis"):
        k("OneHot", 11)(idx, np.array(3), values, axis=3)


def test_one_hot_float_indices_and_int_values():
    y = k("OneHot", 11, "float32")(np.array([1.7, 0.2], np.float32), np.array([2], np.int64), np.array([0, 9], np.int8))
    assert y.dtype == np.int8 and y.tolist() == [[0, 9], [9, 0]]


def test_trilu_batched_and_k():
    x = RNG.standard_normal((2, 3, 4, 5))
    f = k("Trilu", 14)
    for kk in (-7, -1, 0, 2, 9):
        np.testing.assert_array_equal(f(x, np.array(kk)), np.triu(x, kk))
        np.testing.assert_array_equal(f(x, np.array(kk), upper=0), np.tril(x, kk))
    np.testing.assert_array_equal(f(x), np.triu(x))
    with pytest.raises(KernelError, match="rank"):
        f(np.ones(3))


# ---------------------------------------------------------------- shape ops


def test_tile():
    x = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(k("Tile", 13)(x, np.array([2, 1])), np.tile(x, (2, 1)))
    assert k("Tile", 13)(x, np.array([0, 2])).shape == (0, 6)
    with pytest.raises(KernelError, match="repeats"):
        k("Tile", 13)(x, np.array([2]))


def test_compress():
    x = np.arange(12).reshape(3, 4)
    f = k("Compress", 11)
    np.testing.assert_array_equal(f(x, np.array([True, False, True]), axis=0), x[[0, 2]])
    np.testing.assert_array_equal(f(x, np.array([False, True]), axis=-1), x[:, [1]])  # a short condition
    np.testing.assert_array_equal(f(x, np.array([1, 0, 0, 1, 1], bool)), [0, 3, 4])  # flattened
    with pytest.raises(KernelError, match="condition"):
        f(x, np.ones(5, bool), axis=1)


def test_nonzero():
    f = k("NonZero", 13)
    x = np.array([[0, 2], [3, 0]])
    np.testing.assert_array_equal(f(x), [[0, 1], [1, 0]])
    assert f(np.zeros((2, 0))).shape == (2, 0)
    assert f(np.array(5)).shape == (0, 1) and f(np.array(0)).shape == (0, 0)
    assert f(x).dtype == np.int64


@pytest.mark.parametrize("time_axis,batch_axis", [(0, 1), (1, 0)])
def test_reverse_sequence_against_a_loop(time_axis, batch_axis):
    x = RNG.standard_normal((5, 4, 3)) if time_axis == 0 else RNG.standard_normal((4, 5, 3))
    lens = np.array([5, 0, 1, 3])
    y = k("ReverseSequence", 10)(x, lens, time_axis=time_axis, batch_axis=batch_axis)
    ref = x.copy()
    for b, n in enumerate(lens):
        sl = [slice(None)] * 3
        sl[batch_axis] = b
        sl[time_axis] = slice(0, n)
        ref[tuple(sl)] = np.flip(x[tuple(sl)], axis=0)
    np.testing.assert_array_equal(y, ref)
    with pytest.raises(KernelError, match="sequence_lens"):
        k("ReverseSequence", 10)(x, np.array([6, 1, 1, 1]), time_axis=time_axis, batch_axis=batch_axis)


def test_cast_like_and_bit_cast():
    x = np.array([1.7, -2.5, 300.0], np.float32)
    y = k("CastLike", 21)(x, np.zeros(1, np.int16))
    assert y.dtype == np.int16 and y.tolist() == [1, -2, 300]  # truncation toward zero
    assert k("CastLike", 21)(x, np.zeros(1, bool)).tolist() == [True, True, True]
    b = k("BitCast", 26)(np.array([1.0], np.float32), to=6)
    assert b.dtype == np.int32 and b.tolist() == [0x3F800000]
    t = np.arange(6, dtype=np.int32).reshape(2, 3).T  # a non-contiguous view
    assert k("BitCast", 26)(t, to=12).shape == (3, 2)
    with pytest.raises(KernelError, match="width"):
        k("BitCast", 26)(np.ones(2, np.float32), to=11)
    with pytest.raises(KernelError, match="not supported"):
        k("Cast", 21)(x, to=16)  # bfloat16
