"""Running sums and products along one axis: CumSum (opset 11), CumProd
(opset 26).

``exclusive=1`` leaves each element out of its own result (the first is the
identity, 0 or 1), ``reverse=1`` runs from the end of the axis. The axis is
a scalar input (int32 or int64), negative counting from the end.
"""

from __future__ import annotations

import numpy as np

from .registry import NUMERIC_TYPES, KernelError, register


def _axis(op: str, axis: np.ndarray, ndim: int) -> int:
    a = np.asarray(axis)
    if a.size != 1:
        raise KernelError(f"{op}: axis must be a scalar, got shape {a.shape}")
    ax = int(a.reshape(-1)[0])
    if not -ndim <= ax < ndim:
        raise KernelError(f"{op}: axis {ax} is out of range for an input of rank {ndim}")
    return ax % ndim


def _cumulative(fn, identity, x: np.ndarray, axis: int, exclusive: int, reverse: int) -> np.ndarray:
    if reverse:
        x = np.flip(x, axis)
    if exclusive and x.shape[axis]:
        # shift by one along the axis, the identity first: exact, unlike cumsum - x
        pad = np.full(x.shape[:axis] + (1,) + x.shape[axis + 1:], identity, dtype=x.dtype)
        head = [slice(None)] * x.ndim
        head[axis] = slice(0, -1)
        x = np.concatenate([pad, x[tuple(head)]], axis=axis)
    out = fn(x, axis=axis, dtype=x.dtype)
    return np.flip(out, axis) if reverse else out


@register("CumSum", since=11, dtypes=NUMERIC_TYPES)
def cumsum(x: np.ndarray, axis: np.ndarray, *, exclusive: int = 0, reverse: int = 0) -> np.ndarray:
    return _cumulative(np.cumsum, 0, x, _axis("CumSum", axis, x.ndim), exclusive, reverse)


@cumsum.backward(uses="inputs")
def _(grads, inputs, outputs, *, exclusive=0, reverse=0):
    dy, (x, axis) = grads[0], inputs[:2]
    if dy is None:
        return (None, None)
    # the adjoint of a running sum is the running sum the other way round
    ax = _axis("CumSum", axis, x.ndim)
    return (_cumulative(np.cumsum, 0, dy, ax, exclusive, 1 - reverse), None)


@register("CumProd", since=26, dtypes=NUMERIC_TYPES)
def cumprod(x: np.ndarray, axis: np.ndarray, *, exclusive: int = 0, reverse: int = 0) -> np.ndarray:
    return _cumulative(np.cumprod, 1, x, _axis("CumProd", axis, x.ndim), exclusive, reverse)
