"""Reductions: ReduceMean, ReduceSum, ReduceMax, ReduceMin, ArgMax.

``axes`` was an attribute until opset 18 (13 for ReduceSum) and is an
optional input since; an empty ``axes`` reduces everything unless
``noop_with_empty_axes`` is set.
"""

from __future__ import annotations

import numpy as np

from .registry import FLOAT_TYPES, NUMERIC_TYPES, register


def _reduce(fn, x: np.ndarray, axes, keepdims: int, noop_with_empty_axes: int = 0) -> np.ndarray:
    if axes is None or np.asarray(axes).size == 0:
        if noop_with_empty_axes:
            return x
        ax = None
    else:
        ax = tuple(int(a) % max(x.ndim, 1) for a in np.asarray(axes).reshape(-1))
    if x.size == 0 and fn in _IDENTITY:
        # The reduction of an empty set is the operation's identity.
        out = fn(x, axis=ax, keepdims=bool(keepdims), initial=_IDENTITY[fn](x.dtype))
    else:
        out = fn(x, axis=ax, keepdims=bool(keepdims))
    return np.asarray(out, dtype=x.dtype)


def _lowest(dtype):
    if dtype == np.bool_:
        return False
    return -np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min


def _highest(dtype):
    if dtype == np.bool_:
        return True
    return np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).max


_IDENTITY = {np.max: _lowest, np.min: _highest}


def _define(op: str, fn, since_input: int, dtypes) -> None:
    @register(op, since=since_input, dtypes=dtypes)
    def with_input(x, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
        return _reduce(fn, x, axes, keepdims, noop_with_empty_axes)

    @register(op, since=1, dtypes=dtypes)
    def with_attr(x, *, axes: list[int] | None = None, keepdims: int = 1):
        return _reduce(fn, x, axes, keepdims)


_define("ReduceMean", np.mean, 18, FLOAT_TYPES)
_define("ReduceSum", np.sum, 13, NUMERIC_TYPES)
_define("ReduceMax", np.max, 18, NUMERIC_TYPES | {"bool"})
_define("ReduceMin", np.min, 18, NUMERIC_TYPES | {"bool"})


@register("ArgMax", dtypes=NUMERIC_TYPES)
def argmax(x: np.ndarray, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> np.ndarray:
    if select_last_index:
        flipped = np.flip(x, axis=axis)
        out = x.shape[axis] - 1 - np.argmax(flipped, axis=axis)
    else:
        out = np.argmax(x, axis=axis)
    if keepdims:
        out = np.expand_dims(out, axis)
    return out.astype(np.int64)
