"""Logical, comparison and bitwise kernels: dtypes, broadcasting, and the
shift rules of BitShift-28 (negative and over-wide shifts)."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.kernels import KernelError, UnknownOpError, get_kernel


def k(op, opset=28, dtype=None):
    return get_kernel(op, opset=opset, dtype=dtype)


def test_logical_ops_broadcast():
    a = np.array([[True], [False]])
    b = np.array([True, False, True])
    assert k("And")(a, b).tolist() == [[True, False, True], [False, False, False]]
    assert k("Or")(a, b).tolist() == [[True, True, True], [True, False, True]]
    assert k("Xor")(a, b).tolist() == [[False, True, False], [True, False, True]]
    assert k("Not")(b).tolist() == [False, True, False]
    assert k("And")(a, b).dtype == np.bool_


def test_logical_ops_refuse_non_bool_inputs():
    with pytest.raises(UnknownOpError, match="bool"):
        k("And", dtype="float32")


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                                   "float16", "float32", "float64"])
def test_comparisons_cover_every_dtype(dtype):
    a = np.array([0, 1, 1], dtype=dtype)
    b = np.array([1, 1, 0], dtype=dtype)
    assert k("Less", 13, dtype)(a, b).tolist() == [True, False, False]
    assert k("LessOrEqual", 16, dtype)(a, b).tolist() == [True, True, False]
    assert k("Greater", 13, dtype)(a, b).tolist() == [False, False, True]
    assert k("GreaterOrEqual", 16, dtype)(a, b).tolist() == [False, True, True]
    assert k("Equal", 19, dtype)(a, b).tolist() == [False, True, False]


def test_comparisons_with_nan_are_false():
    a = np.array([np.nan, 1.0], np.float32)
    assert not k("LessOrEqual", 16)(a, a)[0] and k("LessOrEqual", 16)(a, a)[1]
    assert not k("GreaterOrEqual", 16)(a, a)[0]


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64"])
def test_bitshift_signed(dtype):
    bits = np.dtype(dtype).itemsize * 8
    x = np.array([-8, -8, 5, 5, -1, 3], dtype)
    y = np.array([1, bits, -1, bits + 3, 2, 1], dtype)
    right = k("BitShift", 28, dtype)(x, y, direction="RIGHT")
    assert right.dtype == np.dtype(dtype)
    # arithmetic shift; negative or >= width: the sign fill alone (-1 or 0)
    assert right.tolist() == [-4, -1, 0, 0, -1, 1]
    left = k("BitShift", 28, dtype)(x, y, direction="LEFT")
    assert left.tolist() == [-16, 0, 0, 0, -4, 6]


def test_bitshift_left_drops_bits_past_the_sign_bit():
    x = np.array([64, 127, -128], np.int8)
    y = np.array([1, 1, 1], np.int8)
    assert k("BitShift", 28, "int8")(x, y, direction="LEFT").tolist() == [-128, -2, 0]


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64"])
def test_bitshift_unsigned_at_opset_11(dtype):
    bits = np.dtype(dtype).itemsize * 8
    x = np.array([16, 1, 255], dtype)
    y = np.array([2, bits, 0], dtype)
    kern = k("BitShift", 11, dtype)
    assert kern(x, y, direction="RIGHT").tolist() == [4, 0, 255]
    assert kern(x, y, direction="LEFT").tolist() == [64, 0, 255]
    with pytest.raises(KernelError, match="direction"):
        kern(x, y, direction="UP")


def test_bitshift_signed_needs_opset_28():
    with pytest.raises(UnknownOpError):
        k("BitShift", 13, "int32")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"])
def test_bitwise_ops(dtype):
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, 0b1010], dtype)
    b = np.array([[0b0110], [info.max]], dtype)
    ref = a.astype(object)
    got = k("BitwiseAnd", 18, dtype)(a, b)
    assert got.dtype == np.dtype(dtype) and got.shape == (2, 3)
    np.testing.assert_array_equal(got, np.bitwise_and(a, b))
    np.testing.assert_array_equal(k("BitwiseOr", 18, dtype)(a, b), np.bitwise_or(a, b))
    np.testing.assert_array_equal(k("BitwiseXor", 18, dtype)(a, b), np.bitwise_xor(a, b))
    nt = k("BitwiseNot", 18, dtype)(a)
    assert [int(v) for v in nt] == [(~int(v)) & ((1 << info.bits) - 1) if info.min == 0 else ~int(v) for v in ref]
