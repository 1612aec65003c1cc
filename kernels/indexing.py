"""Index-driven reads and writes: GatherElements, GatherND, ScatterElements,
ScatterND, Scatter (deprecated alias of ScatterElements without reduction)
and TensorScatter (KV-cache writes, opset 24).

Indices may be negative (counted from the end of their axis) and are
checked against the data's shape: one out-of-range index is an error naming
the axis, never a silent wrap or a write outside the tensor.

Scatter reductions (``none``, ``add``, ``mul``, ``max``, ``min``) run as one
unbuffered ``ufunc.at`` call, so duplicate indices accumulate as the spec
requires; with ``none`` duplicates are undefined in ONNX (the last write
wins here). The gathers' backwards scatter-add the gradient into the data's
shape; ScatterElements/ScatterND (reduction none) route it to the data where
it was not overwritten and to the updates where it was.
"""

from __future__ import annotations

import numpy as np

from .registry import ANY_TYPE, KernelError, register

_REDUCE_UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _normalize(op: str, indices: np.ndarray, dim, what: str) -> np.ndarray:
    """int64 indices with negatives resolved, checked against ``dim`` (a size,
    or one size per entry of the last axis)."""
    idx = np.asarray(indices).astype(np.int64, copy=False)
    if idx.size:
        bad = (idx < -dim) | (idx >= dim)
        if bad.any():
            raise KernelError(f"{op}: index {int(idx[bad][0])} is out of range for {what}")
        if idx.min() < 0:
            idx = np.where(idx < 0, idx + dim, idx)
    return idx


def _axis(op: str, axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise KernelError(f"{op}: axis {axis} is out of range for rank {ndim}")
    return axis % ndim


# -- element-wise (same-rank) indexing ---------------------------------------------------------


def _element_index(op: str, data: np.ndarray, indices: np.ndarray, axis: int) -> tuple:
    """The full index tuple addressing data[.., indices[i, j, ..], ..] for every i, j, ..."""
    if indices.ndim != data.ndim:
        raise KernelError(f"{op}: indices of rank {indices.ndim} for data of rank {data.ndim}; the ranks must match")
    ax = _axis(op, axis, data.ndim)
    for d, (n, m) in enumerate(zip(indices.shape, data.shape)):
        if d != ax and n > m:
            raise KernelError(f"{op}: indices shape {indices.shape} exceeds the data shape {data.shape} on axis {d}")
    idx = _normalize(op, indices, data.shape[ax], f"axis {ax} of size {data.shape[ax]}")
    grids = list(np.ogrid[tuple(slice(n) for n in indices.shape)]) if indices.ndim else []
    grids[ax] = idx
    return tuple(grids)


@register("GatherElements", since=11, dtypes=ANY_TYPE)
def gather_elements(data: np.ndarray, indices: np.ndarray, *, axis: int = 0) -> np.ndarray:
    if data.ndim == 0:
        raise KernelError("GatherElements: data must have rank >= 1")
    return data[_element_index("GatherElements", data, indices, axis)]


@gather_elements.backward(uses="inputs")
def _(grads, inputs, outputs, *, axis=0):
    dy, (data, indices) = grads[0], inputs[:2]
    if dy is None:
        return (None, None)
    g = np.zeros(data.shape, dtype=dy.dtype)
    np.add.at(g, _element_index("GatherElements", data, indices, axis), dy)
    return (g, None)


def _check_reduction(op: str, reduction: str) -> None:
    if reduction != "none" and reduction not in _REDUCE_UFUNCS:
        raise KernelError(f"{op}: reduction must be one of none, add, mul, max, min; got {reduction!r}")


def _scatter_into(out: np.ndarray, index: tuple, updates: np.ndarray, reduction: str) -> np.ndarray:
    updates = updates.astype(out.dtype, copy=False)
    if reduction == "none":
        out[index] = updates
    else:
        _REDUCE_UFUNCS[reduction].at(out, index, updates)
    return out


def _scatter_elements(op: str, data, indices, updates, axis: int, reduction: str) -> np.ndarray:
    _check_reduction(op, reduction)
    if updates.shape != indices.shape:
        raise KernelError(f"{op}: updates shape {updates.shape} must equal the indices shape {indices.shape}")
    index = _element_index(op, data, indices, axis)
    return _scatter_into(data.copy(), index, updates, reduction)


@register("ScatterElements", since=11, dtypes=ANY_TYPE)
def scatter_elements(
    data: np.ndarray, indices: np.ndarray, updates: np.ndarray, *, axis: int = 0, reduction: str = "none"
) -> np.ndarray:
    return _scatter_elements("ScatterElements", data, indices, updates, axis, reduction)


@scatter_elements.backward(uses="inputs")
def _(grads, inputs, outputs, *, axis=0, reduction="none"):
    dy, (data, indices, _updates) = grads[0], inputs[:3]
    if dy is None:
        return (None, None, None)
    if reduction not in ("none", "add"):
        raise KernelError(f"ScatterElements: no gradient for reduction {reduction!r} (only none and add)")
    index = _element_index("ScatterElements", data, indices, axis)
    d_updates = dy[index]
    if reduction == "add":
        return (dy, None, d_updates)
    d_data = dy.copy()
    d_data[index] = 0
    return (d_data, None, d_updates)


@register("Scatter", since=9, dtypes=ANY_TYPE)
def scatter(data: np.ndarray, indices: np.ndarray, updates: np.ndarray, *, axis: int = 0) -> np.ndarray:
    return _scatter_elements("Scatter", data, indices, updates, axis, "none")


# -- N-dimensional (tuple) indexing -----------------------------------------------------------


def _nd_index(op: str, data: np.ndarray, indices: np.ndarray, batch_dims: int = 0) -> tuple:
    if indices.ndim < 1:
        raise KernelError(f"{op}: indices must have rank >= 1")
    k = indices.shape[-1]
    if k > data.ndim - batch_dims:
        raise KernelError(
            f"{op}: index tuples of length {k} for data of rank {data.ndim} (batch_dims {batch_dims})"
        )
    dims = np.array(data.shape[batch_dims:batch_dims + k], dtype=np.int64)
    idx = _normalize(op, indices, dims, f"data dims {tuple(dims.tolist())}")
    return tuple(idx[..., j] for j in range(k))


@register("GatherND", since=11, dtypes=ANY_TYPE)
def gather_nd(data: np.ndarray, indices: np.ndarray, *, batch_dims: int = 0) -> np.ndarray:
    b = int(batch_dims)
    if b < 0 or b >= min(data.ndim, indices.ndim):
        raise KernelError(f"GatherND: batch_dims {b} must be below the ranks of data and indices")
    if data.shape[:b] != indices.shape[:b]:
        raise KernelError(f"GatherND: the batch dims of data {data.shape[:b]} and indices {indices.shape[:b]} differ")
    tup = _nd_index("GatherND", data, indices, b)
    if b == 0:
        return data[tup]
    nb = int(np.prod(data.shape[:b], dtype=np.int64))
    d = data.reshape((nb,) + data.shape[b:])
    t = tuple(x.reshape(nb, -1) for x in tup)
    out = d[(np.arange(nb)[:, None],) + t]
    return out.reshape(indices.shape[:-1] + data.shape[b + indices.shape[-1]:])


@gather_nd.backward(uses="inputs")
def _(grads, inputs, outputs, *, batch_dims=0):
    dy, (data, indices) = grads[0], inputs[:2]
    if dy is None:
        return (None, None)
    b = int(batch_dims)
    tup = _nd_index("GatherND", data, indices, b)
    nb = int(np.prod(data.shape[:b], dtype=np.int64))
    g = np.zeros((nb,) + data.shape[b:], dtype=dy.dtype)
    k = indices.shape[-1]
    t = tuple(x.reshape(nb, -1) for x in tup)
    np.add.at(g, (np.arange(nb)[:, None],) + t, dy.reshape((nb, -1) + data.shape[b + k:]))
    return (g.reshape(data.shape), None)


@register("ScatterND", since=11, dtypes=ANY_TYPE)
def scatter_nd(
    data: np.ndarray, indices: np.ndarray, updates: np.ndarray, *, reduction: str = "none"
) -> np.ndarray:
    _check_reduction("ScatterND", reduction)
    want = indices.shape[:-1] + data.shape[indices.shape[-1]:] if indices.ndim else None
    if updates.shape != want:
        raise KernelError(f"ScatterND: updates shape {updates.shape} must be {want}")
    return _scatter_into(data.copy(), _nd_index("ScatterND", data, indices), updates, reduction)


@scatter_nd.backward(uses="inputs")
def _(grads, inputs, outputs, *, reduction="none"):
    dy, (data, indices, _updates) = grads[0], inputs[:3]
    if dy is None:
        return (None, None, None)
    if reduction not in ("none", "add"):
        raise KernelError(f"ScatterND: no gradient for reduction {reduction!r} (only none and add)")
    tup = _nd_index("ScatterND", data, indices)
    if reduction == "add":
        return (dy, None, dy[tup])
    d_data = dy.copy()
    d_data[tup] = 0
    return (d_data, None, dy[tup])


# -- KV-cache writes --------------------------------------------------------------------------


@register("TensorScatter", since=24, dtypes=ANY_TYPE)
def tensor_scatter(
    past_cache: np.ndarray,
    update: np.ndarray,
    write_indices: np.ndarray | None = None,
    *,
    axis: int = -2,
    mode: str = "linear",
) -> np.ndarray:
    """Write ``update`` into the cache along ``axis`` from each batch's write index.

    Dimension 0 is the batch; ``mode="circular"`` wraps positions modulo the
    cache length, ``"linear"`` requires them to fit.
    """
    if mode not in ("linear", "circular"):
        raise KernelError(f"TensorScatter: mode must be 'linear' or 'circular', got {mode!r}")
    nd = past_cache.ndim
    ax = _axis("TensorScatter", axis, nd)
    if ax == 0:
        raise KernelError("TensorScatter: axis must not be the batch axis 0")
    if update.ndim != nd or any(u != p for i, (u, p) in enumerate(zip(update.shape, past_cache.shape)) if i != ax):
        raise KernelError(
            f"TensorScatter: update shape {update.shape} must match the cache shape {past_cache.shape} "
            f"except on axis {ax}"
        )
    max_len, seq = past_cache.shape[ax], update.shape[ax]
    if seq > max_len:
        raise KernelError(f"TensorScatter: update length {seq} exceeds the cache length {max_len} on axis {ax}")
    batch = past_cache.shape[0]
    w = np.zeros(batch, dtype=np.int64) if write_indices is None else np.asarray(write_indices).astype(np.int64).reshape(-1)
    if w.size != batch:
        raise KernelError(f"TensorScatter: write_indices has {w.size} entries for a batch of {batch}")
    pos = w[:, None] + np.arange(seq)[None, :]  # (batch, seq)
    if mode == "circular":
        pos %= max_len
    elif pos.size and (pos.min() < 0 or pos.max() >= max_len):
        raise KernelError(
            f"TensorScatter: writing {seq} positions from indices {w.tolist()} overruns the cache length {max_len}"
        )
    out = past_cache.copy()
    # Advanced indices on dims 0..ax (adjacent), slices after: the indexed block
    # has exactly update's shape.
    lead = past_cache.shape[:ax]
    shape = lead + (seq,)
    index = []
    for d in range(ax):
        n = lead[d]
        index.append(np.arange(n).reshape((1,) * d + (n,) + (1,) * (ax - d)))
    index.append(pos.reshape((batch,) + (1,) * (ax - 1) + (seq,)))
    index = [np.broadcast_to(i, shape) for i in index]
    out[tuple(index)] = update
    return out
