"""Ops that pick elements by value: TopK and Unique.

TopK returns the k largest (or smallest) values along an axis with their
indices; equal values come out in index order, as ONNX requires, because the
sort is stable. ``sorted=0`` lets ONNX return any order: the sorted order is
returned then too.

Unique returns the distinct values (or sub-tensors along ``axis``), sorted
or in order of first occurrence, with the first-occurrence indices, the
inverse mapping and the counts.
"""

from __future__ import annotations

import numpy as np

from .registry import ANY_TYPE, NUMERIC_TYPES, KernelError, register


def _topk(x: np.ndarray, k, axis: int, largest: int) -> tuple[np.ndarray, np.ndarray]:
    kk = np.asarray(k)
    if kk.size != 1:
        raise KernelError(f"TopK: K must hold one value, got shape {kk.shape}")
    kk = int(kk.reshape(-1)[0])
    if x.ndim == 0:
        raise KernelError("TopK: the input must have rank >= 1")
    if not -x.ndim <= axis < x.ndim:
        raise KernelError(f"TopK: axis {axis} is out of range for rank {x.ndim}")
    axis %= x.ndim
    n = x.shape[axis]
    if not 0 <= kk <= n:
        raise KernelError(f"TopK: K={kk} must be in [0, {n}] (the size of axis {axis})")
    if n == 1 and kk == 1:  # a one-element axis (batch-1 length sorts): itself, index 0 (a sort is ~5 us)
        return x.copy(), np.zeros(x.shape, np.int64)
    if 0 < kk and kk * 4 <= n and n >= 64:
        fast = _topk_partitioned(x, kk, axis, largest)
        if fast is not None:
            return fast
    order = _sorted_order(x, axis, largest)
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(0, kk)
    order = order[tuple(idx)]
    return np.take_along_axis(x, order, axis=axis), order.astype(np.int64, copy=False)


def _sorted_order(x: np.ndarray, axis: int, largest: int) -> np.ndarray:
    """Indices sorting x along axis, descending if largest; ties in index order."""
    if largest:
        # a stable ascending sort of the reversed axis, read backwards
        n = x.shape[axis]
        return n - 1 - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
    return np.argsort(x, axis=axis, kind="stable")


def _topk_partitioned(x: np.ndarray, kk: int, axis: int, largest: int):
    """TopK by argpartition (O(n)) and a sort of the k picked, or None on a tie at the cut.

    A partition picks arbitrarily among values equal to the k-th; ONNX wants
    the lowest indices among them, so when the k-th value is tied with an
    element left out, the caller falls back to the full stable sort.
    """
    n = x.shape[axis]
    if np.issubdtype(x.dtype, np.floating) and np.isnan(x).any():
        return None  # NaN ordering: leave it to the full sort
    kth = n - kk if largest else kk - 1
    part = np.argpartition(x, kth, axis=axis)
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(n - kk, n) if largest else slice(0, kk)
    picked = np.sort(part[tuple(idx)], axis=axis)  # index order, so the stable sort below breaks ties by index
    vals = np.take_along_axis(x, picked, axis=axis)
    cut = vals.min(axis=axis, keepdims=True) if largest else vals.max(axis=axis, keepdims=True)
    inside = (x >= cut) if largest else (x <= cut)
    if np.any(inside.sum(axis=axis) != kk):
        return None
    order = _sorted_order(vals, axis, largest)
    return np.take_along_axis(vals, order, axis=axis), np.take_along_axis(picked, order, axis=axis).astype(np.int64)


@register("TopK", since=11, dtypes=NUMERIC_TYPES)
def topk(x: np.ndarray, k: np.ndarray, *, axis: int = -1, largest: int = 1, sorted: int = 1):  # noqa: A002
    return _topk(x, k, axis, largest)


@topk.backward(uses="all")
def _(grads, inputs, outputs, *, axis=-1, largest=1, sorted=1):  # noqa: A002
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None, None)
    g = np.zeros(x.shape, dtype=dy.dtype)
    np.put_along_axis(g, outputs[1], dy, axis=axis)  # top-k indices are distinct
    return (g, None)


@register("TopK", since=10, dtypes=NUMERIC_TYPES)
def topk_v10(x: np.ndarray, k: np.ndarray, *, axis: int = -1):
    return _topk(x, k, axis, 1)


@register("TopK", since=1, dtypes=NUMERIC_TYPES)
def topk_v1(x: np.ndarray, *, k: int, axis: int = -1):
    return _topk(x, k, axis, 1)


@register("Unique", since=11, dtypes=ANY_TYPE)
def unique(x: np.ndarray, *, axis: int | None = None, sorted: int = 1, n_outputs: int = 4):  # noqa: A002
    if axis is not None:
        if not -x.ndim <= axis < x.ndim:
            raise KernelError(f"Unique: axis {axis} is out of range for rank {x.ndim}")
        axis %= x.ndim
        y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    else:
        y, first, inverse, counts = np.unique(x.reshape(-1), return_index=True, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    if not sorted:
        # reorder by first occurrence; remap the inverse through the new ranks
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        y = np.take(y, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    out = (y, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64))
    return out[:n_outputs] if n_outputs > 1 else y
