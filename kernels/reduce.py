"""Reductions: ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceProd,
ReduceL1, ReduceL2, ReduceSumSquare, ReduceLogSum, ReduceLogSumExp, and
ArgMax, ArgMin.

``axes`` was an attribute until opset 18 (13 for ReduceSum) and is an
optional input since; an empty ``axes`` reduces everything unless
``noop_with_empty_axes`` is set: then the reduction runs over the empty set
of axes (numpy's ``axis=()``), so ReduceSum/Max/... pass the input through
while the composite ones still apply their element-wise steps (ReduceL1 is
Abs, ReduceSumSquare is Square, ReduceLogSum is Log). A
reduction over an empty set gives the operation's identity: 0 for sums and
norms, 1 for the product, -inf for ReduceMax and the log-sums (the type's
lowest value for integers), +inf for ReduceMin.

float16 inputs are accumulated in float32 where squares or exponentials
could overflow (L2, SumSquare, LogSumExp); every result has the input's
dtype. The backwards of the sums, mean, norms and log-sum-exp broadcast the
gradient back over the reduced axes.
"""

from __future__ import annotations

import numpy as np

from .registry import FLOAT_TYPES, NUMERIC_TYPES, KernelError, register

_BOOL_NUMERIC = NUMERIC_TYPES | {"bool"}


def _norm_axes(axes, ndim: int, noop: int = 0) -> tuple[int, ...] | None:
    """None (reduce all), () (reduce nothing: noop_with_empty_axes) or sorted
    non-negative axes; validated."""
    ax = [] if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
    if not ax:
        return () if noop else None
    rank = max(ndim, 1)
    for a in ax:
        if not -rank <= a < rank:
            raise KernelError(f"reduction axis {a} is out of range for an input of rank {ndim}")
    return tuple(sorted({a % rank for a in ax})) if ndim else None


def _lowest(dtype):
    if dtype == np.bool_:
        return False
    return -np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min


def _highest(dtype):
    if dtype == np.bool_:
        return True
    return np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).max


def _wide(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _max(x, ax, keep):
    return np.max(x, axis=ax, keepdims=keep, initial=_lowest(x.dtype)) if x.size == 0 else np.max(x, axis=ax, keepdims=keep)


def _min(x, ax, keep):
    return np.min(x, axis=ax, keepdims=keep, initial=_highest(x.dtype)) if x.size == 0 else np.min(x, axis=ax, keepdims=keep)


def _mean(x, ax, keep):
    if x.size == 0:  # the mean of nothing: NaN (for floats), without numpy's warning
        return np.full(np.sum(x, axis=ax, keepdims=keep).shape, np.nan)
    return np.mean(x, axis=ax, keepdims=keep)


def _l2(x, ax, keep):
    w = _wide(x)
    if np.issubdtype(w.dtype, np.integer):
        w = w.astype(np.float64)
    return np.sqrt(np.sum(w * w, axis=ax, keepdims=keep))


def _sum_square(x, ax, keep):
    w = _wide(x)
    return np.sum(w * w, axis=ax, keepdims=keep)


def _log_sum(x, ax, keep):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(np.sum(_wide(x), axis=ax, keepdims=keep))


def _log_sum_exp(x, ax, keep):
    w = _wide(x)
    if w.size == 0:
        return np.full(np.sum(w, axis=ax, keepdims=keep).shape, -np.inf)
    m = np.max(w, axis=ax, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)  # all -inf (or +inf) slices: shift by 0
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        out = np.log(np.sum(np.exp(w - m), axis=ax, keepdims=True)) + m
    return out if keep else out.reshape(np.sum(w, axis=ax, keepdims=False).shape)


# reductions with no element-wise step: over no axes they are the identity
_PLAIN = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd")

_FNS = {
    "ReduceSum": lambda x, ax, keep: np.add.reduce(x, axis=ax, keepdims=keep, dtype=x.dtype),  # np.sum, unwrapped
    "ReduceMean": _mean,
    "ReduceMax": _max,
    "ReduceMin": _min,
    "ReduceProd": lambda x, ax, keep: np.prod(x, axis=ax, keepdims=keep, dtype=x.dtype),
    "ReduceL1": lambda x, ax, keep: np.sum(np.abs(x), axis=ax, keepdims=keep, dtype=x.dtype),
    "ReduceL2": _l2,
    "ReduceSumSquare": _sum_square,
    "ReduceLogSum": _log_sum,
    "ReduceLogSumExp": _log_sum_exp,
}


def _reduce(op: str, x: np.ndarray, axes, keepdims: int, noop_with_empty_axes: int = 0) -> np.ndarray:
    ax = _norm_axes(axes, x.ndim, noop_with_empty_axes)
    if ax == () and op in _PLAIN:
        return x
    out = _FNS[op](x, ax, bool(keepdims))
    return np.asarray(out).astype(x.dtype, copy=False)


def _keepdims_grad(dy: np.ndarray, x: np.ndarray, ax, keepdims: int) -> np.ndarray:
    """dy reshaped so it broadcasts against x (the reduced axes as size 1)."""
    if not keepdims:
        shape = [1 if ax is None or i in ax else d for i, d in enumerate(x.shape)]
        dy = dy.reshape(shape)
    return dy


def _count(x: np.ndarray, ax) -> int:
    return x.size if ax is None else int(np.prod([x.shape[a] for a in ax]))


def _local_grads(op: str, x: np.ndarray, y: np.ndarray, ax, keepdims: int):
    """d(reduced)/dx for one element, broadcastable to x (y with kept dims)."""
    yk = _keepdims_grad(y, x, ax, keepdims)
    if op == "ReduceSum":
        return 1.0
    if op == "ReduceMean":
        return 1.0 / max(_count(x, ax), 1)
    if op == "ReduceL1":
        return np.sign(x)
    if op == "ReduceL2":
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(yk == 0, 0.0, x / yk)
    if op == "ReduceSumSquare":
        return 2 * x
    if op == "ReduceLogSumExp":
        return np.exp(x - yk)
    if op == "ReduceLogSum":
        return 1.0 / np.exp(yk)
    return None


_TRAINABLE = ("ReduceSum", "ReduceMean", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "ReduceLogSum")


def _attach_backward(op: str, kernel, with_input: bool) -> None:
    if op not in _TRAINABLE:
        return

    @kernel.backward(uses="all")
    def _(grads, inputs, outputs, *, axes=None, keepdims=1, noop_with_empty_axes=0):
        dy, x = grads[0], inputs[0]
        extra = (None,) * (len(inputs) - 1)
        if dy is None:
            return (None,) + extra
        if with_input:
            axes = inputs[1] if len(inputs) > 1 else None
        ax = _norm_axes(axes, x.ndim, noop_with_empty_axes)
        local = _local_grads(op, x, outputs[0], ax, keepdims)
        g = _keepdims_grad(dy, x, ax, keepdims) * local
        return (np.broadcast_to(g, x.shape).astype(x.dtype),) + extra


def _define(op: str, since_input: int, dtypes) -> None:
    @register(op, since=since_input, dtypes=dtypes)
    def with_input(x, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
        return _reduce(op, x, axes, keepdims, noop_with_empty_axes)

    @register(op, since=1, dtypes=dtypes)
    def with_attr(x, *, axes: list[int] | None = None, keepdims: int = 1):
        return _reduce(op, x, axes, keepdims)

    with_input.forward.__name__ = with_attr.forward.__name__ = op
    _attach_backward(op, with_input, True)
    _attach_backward(op, with_attr, False)


_define("ReduceSum", 13, NUMERIC_TYPES)
_define("ReduceMean", 18, NUMERIC_TYPES)
_define("ReduceMax", 18, _BOOL_NUMERIC)
_define("ReduceMin", 18, _BOOL_NUMERIC)
_define("ReduceProd", 18, NUMERIC_TYPES)
_define("ReduceL1", 18, NUMERIC_TYPES)
_define("ReduceL2", 18, NUMERIC_TYPES)
_define("ReduceSumSquare", 18, NUMERIC_TYPES)
_define("ReduceLogSum", 18, FLOAT_TYPES)
_define("ReduceLogSumExp", 18, FLOAT_TYPES)


def _arg(fn, x: np.ndarray, axis: int, keepdims: int, select_last_index: int) -> np.ndarray:
    if not -max(x.ndim, 1) <= axis < max(x.ndim, 1):
        raise KernelError(f"axis {axis} is out of range for an input of rank {x.ndim}")
    if x.ndim and x.shape[axis] == 0:
        raise KernelError(f"cannot take the arg-extremum over the empty axis {axis} of shape {x.shape}")
    if select_last_index:
        out = x.shape[axis] - 1 - fn(np.flip(x, axis=axis), axis=axis)
    else:
        out = fn(x, axis=axis)
    out = np.asarray(out, dtype=np.int64)
    return np.expand_dims(out, axis) if keepdims else out


@register("ArgMax", dtypes=NUMERIC_TYPES)
def argmax(x: np.ndarray, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> np.ndarray:
    return _arg(np.argmax, x, axis, keepdims, select_last_index)


@register("ArgMin", dtypes=NUMERIC_TYPES)
def argmin(x: np.ndarray, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> np.ndarray:
    return _arg(np.argmin, x, axis, keepdims, select_last_index)


# ---------------------------------------------------------------- backwards (transfer learning)
# ReduceMax / ReduceMin: the gradient goes to the extreme elements, ties sharing it
# evenly (torch.amax / amin's rule).


def _attach_extreme_backward(kernel, with_input: bool) -> None:
    @kernel.backward(uses="all")
    def _(grads, inputs, outputs, *, axes=None, keepdims=1, noop_with_empty_axes=0):
        dy, x = grads[0], inputs[0]
        extra = (None,) * (len(inputs) - 1)
        if dy is None:
            return (None,) + extra
        if with_input:
            axes = inputs[1] if len(inputs) > 1 else None
        ax = _norm_axes(axes, x.ndim, noop_with_empty_axes)
        hit = x == _keepdims_grad(outputs[0], x, ax, keepdims)
        count = hit.sum(axis=ax, keepdims=True) if ax != () else np.ones_like(x, dtype=np.int64)
        g = _keepdims_grad(dy, x, ax, keepdims) / np.maximum(count, 1)
        return (np.multiply(hit, g, dtype=dy.dtype),) + extra


def _extreme_backwards() -> None:
    from .registry import kernels_for

    for op in ("ReduceMax", "ReduceMin"):
        for k in kernels_for(op):
            _attach_extreme_backward(k, k.since >= 18)


_extreme_backwards()
