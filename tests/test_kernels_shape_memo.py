"""Squeeze, Unsqueeze and Slice work out their output shape / index once per (input
shape, constant inputs) and reuse it: a reused answer must never leak into a call
with another shape or other constants, and bad axes must still be refused each call."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.kernels import get_kernel

squeeze = get_kernel("Squeeze", opset=13).forward
unsqueeze = get_kernel("Unsqueeze", opset=13).forward
slice_ = get_kernel("Slice", opset=13).forward


def test_unsqueeze_and_squeeze_follow_each_call_shape():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(4, dtype=np.float32).reshape(4, 1)
    for _ in range(2):  # the second round answers from the memo
        assert unsqueeze(a, np.array([0, -1])).shape == (1, 2, 3, 1)
        assert unsqueeze(b, np.array([0, -1])).shape == (1, 4, 1, 1)
        assert unsqueeze(a, np.array([1])).shape == (2, 1, 3)
        assert squeeze(b, np.array([1])).shape == (4,)
        assert squeeze(b[None], None).shape == (4,)
        assert squeeze(b[None], np.array([0])).shape == (4, 1)
    np.testing.assert_array_equal(unsqueeze(a, np.array([1]))[:, 0], a)
    assert np.shares_memory(squeeze(b, np.array([1])), b)  # a view, as np.squeeze gives


def test_bad_axes_are_refused_on_every_call():
    b = np.zeros((4, 1), np.float32)
    for _ in range(2):
        with pytest.raises(ValueError):
            squeeze(b, np.array([0]))  # dim 0 is 4, not 1
        with pytest.raises(ValueError):
            unsqueeze(b, np.array([1, 1]))  # repeated axis


def test_slice_follows_each_call_shape_and_constants():
    x = np.arange(2 * 5 * 4).reshape(2, 5, 4)
    y = np.arange(3 * 7 * 4).reshape(3, 7, 4)
    big = np.iinfo(np.int64).max
    for _ in range(2):
        np.testing.assert_array_equal(slice_(x, np.array([1]), np.array([big]), np.array([1])), x[:, 1:])
        np.testing.assert_array_equal(slice_(y, np.array([1]), np.array([big]), np.array([1])), y[:, 1:])
        np.testing.assert_array_equal(slice_(y, np.array([-1]), np.array([-big]), np.array([1]), np.array([-2])),
                                      y[:, ::-2])
        np.testing.assert_array_equal(slice_(x, np.array([0, 1]), np.array([1, 3])), x[0:1, 1:3])


def test_split_follows_each_call_shape_and_constants():
    split13 = get_kernel("Split", opset=13).forward
    split11 = get_kernel("Split", opset=11).forward
    a = np.arange(2 * 12, dtype=np.float32).reshape(2, 12)
    b = np.arange(3 * 9, dtype=np.float32).reshape(3, 9)
    for _ in range(2):
        for x in (a, b):
            for got, want in zip(split13(x, axis=1, n_outputs=3), np.array_split(x, 3, axis=1)):
                np.testing.assert_array_equal(got, want)
            got = split13(x, np.array([2, x.shape[1] - 2]), axis=-1, n_outputs=2)
            assert [g.shape[1] for g in got] == [2, x.shape[1] - 2]
            assert [g.shape for g in split11(x, axis=0, split=[1, x.shape[0] - 1], n_outputs=2)] == [
                (1, x.shape[1]), (x.shape[0] - 1, x.shape[1])]
        with pytest.raises(IndexError):
            split13(a, axis=2, n_outputs=2)


def test_gather_of_one_index_is_np_take_on_any_layout():
    gather = get_kernel("Gather", opset=13).forward
    base = np.arange(4 * 3 * 5, dtype=np.float32).reshape(4, 3, 5)
    for x in (base, base.transpose(2, 1, 0), base[:, :, ::2]):  # contiguous, transposed, strided
        for axis in range(-x.ndim, x.ndim):
            for i in (0, 1, -1, -x.shape[axis]):
                got = gather(x, np.array(i, np.int64), axis=axis)
                want = np.take(x, i, axis=axis)
                assert got.shape == want.shape and got.flags.c_contiguous
                np.testing.assert_array_equal(got, want)
                assert not np.shares_memory(got, x)  # a fresh array, as np.take gives
        with pytest.raises(IndexError):
            gather(x, np.array(x.shape[0], np.int64), axis=0)
        with pytest.raises(IndexError):
            gather(x, np.array(-x.shape[0] - 1, np.int64), axis=0)
