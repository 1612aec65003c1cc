"""Pad (constant / reflect / edge / wrap; pads as attribute before opset 11,
as inputs from 11, ``axes`` from 18), CenterCropPad, DepthToSpace and
SpaceToDepth.

Negative pads crop. Constant padding allocates the output and assigns the
(cropped) input into it; the other modes gather with one index table per
padded axis, ``src[i]`` = the input position output position ``i`` copies,
which is also what the backward scatters the gradient back through.
"""

from __future__ import annotations

import numpy as np

from ._nn import OpError, choice, ints
from .registry import ANY_TYPE, register

_MODES = ("constant", "reflect", "edge", "wrap")


def _pad_widths(ndim: int, pads, axes) -> list[tuple[int, int]]:
    p = ints(pads) or ()
    ax = ints(axes)
    if ax is None:
        ax = tuple(range(ndim))
    ax = tuple(a + ndim if a < 0 else a for a in ax)
    if any(not 0 <= a < ndim for a in ax) or len(set(ax)) != len(ax):
        raise OpError(f"Pad: axes {list(ints(axes))} are not distinct axes of a rank-{ndim} input")
    if len(p) != 2 * len(ax):
        raise OpError(
            f"Pad: pads has {len(p)} values; a rank-{ndim} input padded on {len(ax)} axes needs {2 * len(ax)}"
        )
    widths = [(0, 0)] * ndim
    for i, a in enumerate(ax):
        widths[a] = (p[i], p[len(ax) + i])
    return widths


def source_index(n: int, begin: int, end: int, mode: str) -> np.ndarray:
    """Input position read by each output position along one axis (length n + begin + end)."""
    i = np.arange(-begin, n + end, dtype=np.int64)
    if mode == "edge":
        return np.clip(i, 0, n - 1)
    if mode == "wrap":
        return i % n
    # reflect: mirror on the first and last element, period 2(n-1)
    if n == 1:
        return np.zeros_like(i)
    period = 2 * (n - 1)
    j = i % period
    return np.where(j < n, j, period - j)


def _check(x: np.ndarray, widths, mode: str) -> None:
    for a, (b, e) in enumerate(widths):
        kept = x.shape[a] + min(b, 0) + min(e, 0)
        if kept < 0:
            raise OpError(f"Pad: pads ({b}, {e}) crop axis {a} of size {x.shape[a]} below zero")
        if mode != "constant" and (b > 0 or e > 0) and kept == 0:
            raise OpError(f"Pad: mode {mode!r} cannot pad axis {a}: it is empty after cropping")


def _crop(widths, shape) -> tuple[slice, ...]:
    return tuple(slice(max(-b, 0), n - max(-e, 0)) for n, (b, e) in zip(shape, widths))


def pad_array(x: np.ndarray, widths, mode: str = "constant", value=0) -> np.ndarray:
    """Crop by the negative pads first, then pad by the positive ones (so
    ``wrap`` and ``reflect`` see the cropped tensor, as onnxruntime does)."""
    _check(x, widths, mode)
    inner = x[_crop(widths, x.shape)]
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    if mode == "constant":
        shape = tuple(s + b + e for s, (b, e) in zip(inner.shape, grow))
        out = np.full(shape, value, dtype=x.dtype) if value else np.zeros(shape, dtype=x.dtype)
        out[tuple(slice(b, b + s) for s, (b, _) in zip(inner.shape, grow))] = inner
        return out
    out = inner
    for a, (b, e) in enumerate(grow):
        if b or e:
            out = np.take(out, source_index(inner.shape[a], b, e, mode).astype(np.intp, copy=False), axis=a)
    return out if out is not x else x.copy()


def pad_backward(dy: np.ndarray, x_shape, widths, mode: str) -> np.ndarray:
    """Adjoint of :func:`pad_array`: each output cell's gradient goes back to
    the input cell it copied (padding constants get none)."""
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    g = dy
    if mode == "constant":
        g = dy[tuple(slice(b, dy.shape[a] - e) for a, (b, e) in enumerate(grow))]
    else:
        inner_shape = tuple(n + min(b, 0) + min(e, 0) for n, (b, e) in zip(x_shape, widths))
        for a in reversed(range(len(x_shape))):
            b, e = grow[a]
            if not (b or e):
                continue
            idx = source_index(inner_shape[a], b, e, mode)
            # (n_out, n_in) one-hot matrix: the scatter-add is one tensordot
            onehot = np.zeros((idx.size, inner_shape[a]), dtype=g.dtype)
            onehot[np.arange(idx.size), idx] = 1
            g = np.moveaxis(np.tensordot(g, onehot, axes=([a], [0])), -1, a)
    dx = np.zeros(x_shape, dtype=dy.dtype)
    dx[_crop(widths, x_shape)] = g
    return dx


@register("Pad", dtypes=ANY_TYPE, since=11)
def pad(
    data: np.ndarray,
    pads: np.ndarray,
    constant_value: np.ndarray | None = None,
    axes: np.ndarray | None = None,
    *,
    mode: str = "constant",
) -> np.ndarray:
    m = choice("Pad", "mode", mode, _MODES)
    value = 0 if constant_value is None or np.size(constant_value) == 0 else np.asarray(constant_value).reshape(-1)[0]
    return pad_array(data, _pad_widths(data.ndim, pads, axes), m, value)


@pad.backward(uses="inputs")
def _(grads, inputs, outputs, *, mode="constant"):
    dy, data = grads[0], inputs[0]
    axes = inputs[3] if len(inputs) > 3 else None
    if dy is None:
        return (None,) * len(inputs)
    m = choice("Pad", "mode", mode, _MODES)
    dx = pad_backward(dy, data.shape, _pad_widths(data.ndim, inputs[1], axes), m)
    return (dx,) + (None,) * (len(inputs) - 1)


@register("Pad", dtypes=ANY_TYPE, since=2)
def pad_v2(data: np.ndarray, *, mode: str = "constant", pads=None, value: float = 0.0) -> np.ndarray:
    if pads is None:
        raise OpError("Pad (opset < 11) needs the pads attribute")
    m = choice("Pad", "mode", mode, _MODES)
    return pad_array(data, _pad_widths(data.ndim, pads, None), m, value)


@pad_v2.backward(uses="inputs")
def _(grads, inputs, outputs, *, mode="constant", pads=None, value=0.0):
    dy, data = grads[0], inputs[0]
    if dy is None:
        return (None,)
    m = choice("Pad", "mode", mode, _MODES)
    return (pad_backward(dy, data.shape, _pad_widths(data.ndim, pads, None), m),)


@register("CenterCropPad", dtypes=ANY_TYPE, since=18)
def center_crop_pad(x: np.ndarray, shape: np.ndarray, *, axes=None) -> np.ndarray:
    """Centre crop (start rounded down) or zero-pad (extra cell at the end) to ``shape``."""
    target = ints(shape)
    ax = ints(axes) if axes is not None else tuple(range(x.ndim))
    if len(target) != len(ax):
        raise OpError(f"CenterCropPad: shape has {len(target)} values for {len(ax)} axes")
    widths = [(0, 0)] * x.ndim
    for a, t in zip(ax, target):
        a = a + x.ndim if a < 0 else a
        if not 0 <= a < x.ndim:
            raise OpError(f"CenterCropPad: axis {a} is out of range for a rank-{x.ndim} input")
        d = t - x.shape[a]
        if d >= 0:
            widths[a] = (d // 2, d - d // 2)
        else:  # crop: the window starts at floor((dim - t) / 2)
            c = -d
            widths[a] = (-(c // 2), -(c - c // 2))
    return pad_array(x, widths, "constant", 0)


def _block(op: str, x: np.ndarray, blocksize) -> int:
    if x.ndim != 4:
        raise OpError(f"{op} expects an (N, C, H, W) input, got shape {x.shape}")
    if blocksize is None or int(blocksize) < 1:
        raise OpError(f"{op} needs a positive blocksize attribute, got {blocksize}")
    return int(blocksize)


@register("DepthToSpace", dtypes=ANY_TYPE, since=1)
def depth_to_space(x: np.ndarray, *, blocksize: int | None = None, mode: str = "DCR") -> np.ndarray:
    bs = _block("DepthToSpace", x, blocksize)
    m = choice("DepthToSpace", "mode", mode, ("DCR", "CRD"))
    b, c, h, w = x.shape
    if c % (bs * bs):
        raise OpError(f"DepthToSpace: {c} channels are not divisible by blocksize^2 = {bs * bs}")
    if m == "DCR":
        t = x.reshape(b, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = x.reshape(b, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
    return t.reshape(b, c // (bs * bs), h * bs, w * bs)


@depth_to_space.backward(uses="none")
def _(grads, inputs, outputs, *, blocksize=None, mode="DCR"):
    dy = grads[0]
    if dy is None:
        return (None,)
    return (space_to_depth(dy, blocksize=blocksize, mode=mode),)


@register("SpaceToDepth", dtypes=ANY_TYPE, since=1)
def space_to_depth(x: np.ndarray, *, blocksize: int | None = None, mode: str = "DCR") -> np.ndarray:
    """The inverse of DepthToSpace in the same mode (``mode`` exists from opset 28)."""
    bs = _block("SpaceToDepth", x, blocksize)
    m = choice("SpaceToDepth", "mode", mode, ("DCR", "CRD"))
    b, c, h, w = x.shape
    if h % bs or w % bs:
        raise OpError(f"SpaceToDepth: spatial size {h}x{w} is not divisible by blocksize {bs}")
    t = x.reshape(b, c, h // bs, bs, w // bs, bs)
    t = t.transpose(0, 3, 5, 1, 2, 4) if m == "DCR" else t.transpose(0, 1, 3, 5, 2, 4)
    return t.reshape(b, c * bs * bs, h // bs, w // bs)


@space_to_depth.backward(uses="none")
def _(grads, inputs, outputs, *, blocksize=None, mode="DCR"):
    dy = grads[0]
    if dy is None:
        return (None,)
    return (depth_to_space(dy, blocksize=blocksize, mode=mode),)
