"""Bitwise ops on integer tensors: BitShift, BitwiseAnd, BitwiseOr,
BitwiseXor, BitwiseNot (numpy broadcasting, results in the input's type).

BitShift (opset 11: unsigned types; opset 28: every integer type): a shift
by a negative amount or by at least the type's width gives 0, or -1 for a
right shift of a negative value (numpy's shifts define exactly that); a
right shift of a signed value is arithmetic.
"""

from __future__ import annotations

import numpy as np

from .registry import INT_TYPES, KernelError, register

_UNSIGNED = {"uint8", "uint16", "uint32", "uint64"}


def _shift(x: np.ndarray, y: np.ndarray, direction: str) -> np.ndarray:
    y = y.astype(x.dtype, copy=False)
    if direction == "LEFT":
        return np.left_shift(x, y)
    if direction == "RIGHT":
        return np.right_shift(x, y)
    raise KernelError(f"BitShift: direction must be 'LEFT' or 'RIGHT', got {direction!r}")


@register("BitShift", since=28, dtypes=INT_TYPES)
def bit_shift(x: np.ndarray, y: np.ndarray, *, direction: str) -> np.ndarray:
    return _shift(x, y, direction)


@register("BitShift", since=11, dtypes=_UNSIGNED)
def bit_shift_v11(x: np.ndarray, y: np.ndarray, *, direction: str) -> np.ndarray:
    return _shift(x, y, direction)


@register("BitwiseAnd", since=18, dtypes=INT_TYPES)
def bitwise_and(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.bitwise_and(a, b.astype(a.dtype, copy=False))


@register("BitwiseOr", since=18, dtypes=INT_TYPES)
def bitwise_or(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.bitwise_or(a, b.astype(a.dtype, copy=False))


@register("BitwiseXor", since=18, dtypes=INT_TYPES)
def bitwise_xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.bitwise_xor(a, b.astype(a.dtype, copy=False))


@register("BitwiseNot", since=18, dtypes=INT_TYPES)
def bitwise_not(x: np.ndarray) -> np.ndarray:
    return np.invert(x)
