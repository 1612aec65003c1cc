"""Helpers shared by the NN-layer kernels (normalization, resize, pad,
recurrent, attention, detection): one error type, attribute decoding,
working precision and gradient un-broadcasting.

A module whose name starts with ``_`` is not an op module: discovery in
``kernels/__init__.py`` skips it, the op modules import it.
"""

from __future__ import annotations

import numpy as np

from .registry import KernelError


class OpError(KernelError, ValueError):
    """An attribute or input an op cannot accept.

    A ``ValueError`` too, so the executor reports it with the node's name and
    input shapes like any other kernel failure.
    """


def text(value, default: str = "") -> str:
    """A string attribute (bytes from a direct caller, str from the executor)."""
    if value is None:
        return default
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def choice(op: str, name: str, value, allowed: tuple[str, ...]) -> str:
    v = text(value)
    if v not in allowed:
        raise OpError(f"{op}: attribute {name}={v!r} is not one of {', '.join(map(repr, allowed))}")
    return v


def work_dtype(dtype: np.dtype, stash_type: int = 1) -> np.dtype:
    """Precision of a normalization's statistics: float32 for float16 inputs
    (ONNX's ``stash_type=1``), float64 when the input or the stash asks for it."""
    if np.dtype(dtype) == np.float64 or stash_type == 11:
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def unbroadcast(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``grad`` over the axes that numpy broadcasting added to ``shape``."""
    shape = tuple(shape)
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    g = grad.sum(axis=tuple(range(lead))) if lead > 0 else grad
    axes = tuple(i for i, (s, gs) in enumerate(zip(shape, g.shape)) if s == 1 and gs != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def norm_axes(axis: int, ndim: int, op: str) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise OpError(f"{op}: axis {axis} is out of range for a rank-{ndim} input")
    return axis % ndim if ndim else 0


def ints(value) -> tuple[int, ...] | None:
    """An INTS attribute or int64 input as a tuple (None stays None)."""
    if value is None:
        return None
    return tuple(int(v) for v in np.asarray(value).reshape(-1))
