"""Ops that make tensors from shapes and scalars: ConstantOfShape, Range,
EyeLike, OneHot, Trilu.
"""

from __future__ import annotations

import math

import numpy as np

from .registry import ANY_TYPE, KernelError, register
from .shape_ops import TENSOR_TYPES


def _dtype_attr(op: str, code: int | None, default) -> np.dtype:
    if code is None or int(code) == 0:
        return np.dtype(default)
    try:
        return TENSOR_TYPES[int(code)]
    except KeyError:
        raise KernelError(f"{op}: tensor type {code} is not supported by the numpy kernels") from None


@register("ConstantOfShape", since=9, dtypes={"int64"})
def constant_of_shape(shape: np.ndarray, *, value: np.ndarray | None = None) -> np.ndarray:
    dims = tuple(int(d) for d in np.asarray(shape).reshape(-1))
    if any(d < 0 for d in dims):
        raise KernelError(f"ConstantOfShape: negative dimension in shape {list(dims)}")
    if value is None:
        return np.zeros(dims, dtype=np.float32)
    value = np.asarray(value)
    if value.size != 1:
        raise KernelError(f"ConstantOfShape: value must hold one element, it holds {value.size}")
    return np.full(dims, value.reshape(-1)[0], dtype=value.dtype)


def _scalar(op: str, name: str, v: np.ndarray):
    v = np.asarray(v)
    if v.size != 1:
        raise KernelError(f"{op}: {name} must be a scalar, got shape {v.shape}")
    return v.reshape(-1)[0]


def _range(start, limit, delta, compute_dtype=None) -> np.ndarray:
    dtype = np.asarray(start).dtype
    s, l_, d = (_scalar("Range", n, v) for n, v in (("start", start), ("limit", limit), ("delta", delta)))
    if d == 0:
        raise KernelError("Range: delta must be non-zero")
    if np.issubdtype(dtype, np.integer):
        s, l_, d = int(s), int(l_), int(d)
        n = max(-((s - l_) // d), 0)  # ceil((limit - start) / delta), exactly
        return (s + d * np.arange(n, dtype=np.int64)).astype(dtype)
    work = np.dtype(compute_dtype or np.float64)
    s, l_, d = work.type(s), work.type(l_), work.type(d)
    n = max(math.ceil((float(l_) - float(s)) / float(d)), 0)
    return (s + d * np.arange(n, dtype=work)).astype(dtype)


@register("Range", since=27, dtypes=ANY_TYPE)
def range_(start: np.ndarray, limit: np.ndarray, delta: np.ndarray, *, stash_type: int = 1) -> np.ndarray:
    # stash_type only matters for float16/bfloat16: compute in float32 (1) or float64 (11)
    work = None
    if np.asarray(start).dtype == np.float16:
        work = _dtype_attr("Range", stash_type, np.float32)
        if work not in (np.float32, np.float64):
            raise KernelError(f"Range: stash_type must be FLOAT (1) or DOUBLE (11), got {stash_type}")
    return _range(start, limit, delta, work)


@register("Range", since=11, dtypes=ANY_TYPE)
def range_v11(start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> np.ndarray:
    return _range(start, limit, delta)


@register("EyeLike", since=9, dtypes=ANY_TYPE)
def eye_like(x: np.ndarray, *, dtype: int | None = None, k: int = 0) -> np.ndarray:
    if x.ndim != 2:
        raise KernelError(f"EyeLike: input must be 2-D, got shape {x.shape}")
    return np.eye(x.shape[0], x.shape[1], k=int(k), dtype=_dtype_attr("EyeLike", dtype, x.dtype))


@register("OneHot", since=9, dtypes=ANY_TYPE)
def one_hot(indices: np.ndarray, depth: np.ndarray, values: np.ndarray, *, axis: int = -1) -> np.ndarray:
    d = int(_scalar("OneHot", "depth", depth))
    if d < 1:
        raise KernelError(f"OneHot: depth must be positive, got {d}")
    values = np.asarray(values).reshape(-1)
    if values.size != 2:
        raise KernelError(f"OneHot: values must be [off_value, on_value], got {values.size} elements")
    rank = indices.ndim + 1
    if not -rank <= axis < rank:
        raise KernelError(f"OneHot: axis {axis} is out of range for an output of rank {rank}")
    axis %= rank
    idx = indices.astype(np.int64) if np.issubdtype(indices.dtype, np.integer) else np.trunc(indices).astype(np.int64)
    idx = np.where(idx < 0, idx + d, idx)  # out of [-depth, depth) matches nothing: all off
    idx = np.expand_dims(idx, axis)
    positions = np.arange(d).reshape((d,) + (1,) * (rank - 1 - axis))
    return np.where(idx == positions, values[1], values[0])


@register("Trilu", since=14, dtypes=ANY_TYPE)
def trilu(x: np.ndarray, k: np.ndarray | None = None, *, upper: int = 1) -> np.ndarray:
    if x.ndim < 2:
        raise KernelError(f"Trilu: input must have rank >= 2, got shape {x.shape}")
    kk = 0 if k is None else int(_scalar("Trilu", "k", k))
    rows, cols = x.shape[-2:]
    # the triangle to keep, broadcast over the batch dims
    keep = ~np.tri(rows, cols, kk - 1, dtype=bool) if upper else np.tri(rows, cols, kk, dtype=bool)
    out = np.zeros_like(x)
    np.copyto(out, x, where=keep)
    return out
