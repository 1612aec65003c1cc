"""Logical ops on bool tensors: And, Or, Xor, Not (numpy broadcasting).

The comparisons that produce bools (Equal, Less, LessOrEqual, ...) live
with the arithmetic in :mod:`.elementwise`.
"""

from __future__ import annotations

import numpy as np

from .registry import register

_BOOL = {"bool"}


@register("And", since=7, dtypes=_BOOL)
def and_(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.logical_and(a, b)


@register("Or", since=7, dtypes=_BOOL)
def or_(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.logical_or(a, b)


@register("Xor", since=7, dtypes=_BOOL)
def xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.logical_xor(a, b)


@register("Not", dtypes=_BOOL)
def not_(x: np.ndarray) -> np.ndarray:
    return np.logical_not(x)
