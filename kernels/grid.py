"""GridSample (opsets 16, 20, 22: nearest / linear / cubic, zeros / border /
reflection padding, align_corners, 2-d and N-d) and AffineGrid (20).

GridSample is vectorised over every output location: per spatial axis the
grid is denormalised to pixel coordinates, padded (clamped or reflected),
and split into taps (1 nearest, 2 linear, 4 cubic) with weights. Every
combination of taps across axes is one gather from the flattened input plus
a weighted add — 4 gathers for bilinear 2-d, 16 for bicubic — with no loop
over pixels. Semantics follow torch.nn.functional.grid_sample (the spec's
reference): nearest rounds half to even, cubic uses A = -0.75.
"""

from __future__ import annotations

import itertools

import numpy as np

from ._nn import OpError, choice, ints
from .registry import FLOAT_TYPES, register


def _reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Reflect coordinates by the near border until inside [lo, hi]."""
    rng = hi - lo
    if rng <= 0:
        return np.full_like(x, lo)
    below, above = x < lo, x > hi
    d = np.where(below, lo - x, np.where(above, x - hi, 0.0))
    n = np.floor(d / rng)
    r = d - n * rng
    even = (n % 2) == 0
    low_side = np.where(even, lo + r, hi - r)
    high_side = np.where(even, hi - r, lo + r)
    return np.where(below, low_side, np.where(above, high_side, x))


def _cubic_weights(t: np.ndarray) -> list[np.ndarray]:
    a = -0.75
    t1, t2 = t + 1, 1 - t
    return [
        ((a * t1 - 5 * a) * t1 + 8 * a) * t1 - 4 * a,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        ((a + 2) * t2 - (a + 3)) * t2 * t2 + 1,
        ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a,
    ]


def _axis_taps(coord, size, mode, padding_mode, align_corners):
    """[(index (N, *out) int, weight or None, valid mask or None), ...] for one axis."""
    x = ((coord + 1) / 2 * (size - 1)) if align_corners else (((coord + 1) * size - 1) / 2)
    lo, hi = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
    if mode == "nearest":
        x = np.rint(x)
    if padding_mode == "border" and mode != "cubic":
        # (cubic clamps each of its four taps instead, as torch and onnxruntime do)
        x = np.where((x < lo) | (x > hi), np.clip(x, 0, size - 1), x)
    elif padding_mode == "reflection":
        x = _reflect(x, lo, hi)

    def at(i):
        """Index of an integer tap, and whether it reads a real pixel (zeros padding)."""
        if padding_mode == "zeros":
            valid = (i >= 0) & (i < size)
            return np.clip(i, 0, size - 1), valid
        if padding_mode == "border":
            return np.clip(i, 0, size - 1), None
        return np.clip(_reflect(i.astype(np.float64), lo, hi).astype(np.int64), 0, size - 1), None

    if mode == "nearest":
        i, valid = at(x.astype(np.int64))
        return [(i, None, valid)]
    x0 = np.floor(x)
    t = x - x0
    x0 = x0.astype(np.int64)
    if mode == "linear":
        taps, weights = [x0, x0 + 1], [1 - t, t]
    else:
        taps, weights = [x0 - 1, x0, x0 + 1, x0 + 2], _cubic_weights(t)
    out = []
    for i, w in zip(taps, weights):
        idx, valid = at(i)
        out.append((idx, w, valid))
    return out


def grid_sample_array(x, grid, mode, padding_mode, align_corners):
    n_sp = x.ndim - 2
    if grid.ndim != x.ndim or grid.shape[0] != x.shape[0] or grid.shape[-1] != n_sp:
        raise OpError(
            f"GridSample: input {x.shape} needs a grid (N, *out, {n_sp}) with N = {x.shape[0]}, got {grid.shape}"
        )
    n, c = x.shape[:2]
    sizes = x.shape[2:]
    out_sp = grid.shape[1:-1]
    wd = np.float64 if x.dtype == np.float64 else np.float32
    if n * c * int(np.prod(out_sp)) == 0:
        return np.zeros((n, c) + out_sp, dtype=x.dtype)
    g = grid.astype(np.float64)
    # grid's last axis lists (x, y[, z]): the innermost spatial axis first
    per_axis = [_axis_taps(g[..., n_sp - 1 - a], sizes[a], mode, padding_mode, align_corners) for a in range(n_sp)]
    flat = x.reshape(n, c, -1).astype(wd, copy=False)
    strides = np.cumprod((1,) + tuple(sizes[::-1]))[:-1][::-1]
    acc = np.zeros((n, c, int(np.prod(out_sp))), dtype=wd)
    for combo in itertools.product(*per_axis):
        idx = np.zeros((n,) + out_sp, dtype=np.int64)
        w = None
        valid = None
        for a, (i, wt, v) in enumerate(combo):
            idx += i * int(strides[a])
            if wt is not None:
                w = wt if w is None else w * wt
            if v is not None:
                valid = v if valid is None else valid & v
        if valid is not None:
            w = valid.astype(wd) if w is None else np.where(valid, w, 0)
        vals = np.take_along_axis(flat, idx.reshape(n, 1, -1), axis=2)
        if w is None:
            acc += vals
        else:
            acc += vals * w.reshape(n, 1, -1).astype(wd)
    return acc.reshape((n, c) + out_sp).astype(x.dtype)


@register("GridSample", dtypes=FLOAT_TYPES, since=20)
def grid_sample(
    x: np.ndarray, grid: np.ndarray, *, align_corners: int = 0, mode: str = "linear", padding_mode: str = "zeros"
) -> np.ndarray:
    m = choice("GridSample", "mode", mode, ("linear", "nearest", "cubic"))
    p = choice("GridSample", "padding_mode", padding_mode, ("zeros", "border", "reflection"))
    return grid_sample_array(x, grid, m, p, align_corners)


@register("GridSample", dtypes=FLOAT_TYPES, since=16)
def grid_sample_16(
    x: np.ndarray, grid: np.ndarray, *, align_corners: int = 0, mode: str = "bilinear", padding_mode: str = "zeros"
) -> np.ndarray:
    """Opset 16: 4-d input only, modes named bilinear / nearest / bicubic."""
    m = choice("GridSample", "mode", mode, ("bilinear", "nearest", "bicubic"))
    p = choice("GridSample", "padding_mode", padding_mode, ("zeros", "border", "reflection"))
    if x.ndim != 4:
        raise OpError(f"GridSample (opset 16) takes a 4-d input, got shape {x.shape}; use opset 20 for N-d")
    return grid_sample_array(x, grid, {"bilinear": "linear", "bicubic": "cubic"}.get(m, m), p, align_corners)


@register("AffineGrid", dtypes=FLOAT_TYPES, since=20)
def affine_grid(theta: np.ndarray, size: np.ndarray, *, align_corners: int = 0) -> np.ndarray:
    """theta (N, 2, 3) / (N, 3, 4) and size (N, C, H, W) / (N, C, D, H, W) ->
    grid (N, H, W, 2) / (N, D, H, W, 3) of normalised (x, y[, z])."""
    sz = ints(size)
    n_sp = len(sz) - 2
    if n_sp not in (2, 3) or theta.shape != (sz[0], n_sp, n_sp + 1):
        raise OpError(f"AffineGrid: size {list(sz)} needs theta ({sz[0]}, {n_sp}, {n_sp + 1}), got {theta.shape}")
    spatial = sz[2:]
    axes = []
    for s in spatial:
        if align_corners:
            axes.append(np.linspace(-1, 1, s) if s > 1 else np.zeros(s))
        else:
            axes.append((np.arange(s) * 2 + 1) / s - 1)
    mesh = np.meshgrid(*axes, indexing="ij")  # spatial order (D,) H, W
    base = np.stack([m.reshape(-1) for m in mesh[::-1]] + [np.ones(mesh[0].size)], axis=0)  # (x, y[, z], 1)
    wd = np.float64 if theta.dtype == np.float64 else np.float32
    out = np.matmul(theta.astype(wd), base.astype(wd))  # (N, n_sp, P)
    return np.ascontiguousarray(np.swapaxes(out, 1, 2).reshape((sz[0],) + tuple(spatial) + (n_sp,))).astype(theta.dtype)
