"""Resize (opsets 10, 11, 13, 18, 19) and Upsample (7, 9).

Interpolation is separable, so an N-d resize is one 1-d pass per resized
axis. Each pass is driven by a table precomputed for the axis (and memoised:
a model resizes the same shapes on every run): for every output position the
``taps`` input positions it reads (already clamped, i.e. edge-padded) and
their weights. Nearest is then one ``np.take``; linear / cubic / antialiased
filters are ``taps`` vectorised multiply-adds of gathered slabs. No Python
loop over pixels.

The tables follow the spec (and onnx.reference): the source coordinate of
output ``y`` comes from ``coordinate_transformation_mode``; with
``base = ceil(x) - 1`` and ``r = x - base`` in (0, 1], a filter of ``n``
taps reads ``base - n/2 + 1 ...``; ``exclude_outside`` zeroes the weights of
taps outside the input and renormalises; ``tf_crop_and_resize`` writes
``extrapolation_value`` where the coordinate leaves the input. Before opset
11 (Resize-10, Upsample) coordinates are ``asymmetric`` and nearest rounds
the way onnxruntime's legacy mode does (floor when upsampling, ceil when
downsampling).

Backward (nearest and linear, the modes a fine-tuned decoder uses): the
transpose of each pass, scattering the output gradient back through the
same tables.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ._nn import OpError, choice, ints, text
from .registry import ANY_TYPE, register

_COORD_MODES = (
    "half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
    "asymmetric", "tf_crop_and_resize", "tf_half_pixel_for_nn",
)
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "legacy")
_MODES = ("nearest", "linear", "cubic")


def _source_coords(ctm, n_in, n_out, scale, roi_lo, roi_hi):
    """Source coordinate of every output position and the extrapolation
    mask of tf_crop_and_resize (None otherwise).

    float32 arithmetic in onnxruntime's order of operations, so that a
    coordinate landing exactly on a rounding boundary (say 1.5 / 0.6 = 2.5)
    rounds the same way; ``length_resized`` is the integer output length.
    """
    f = np.float32
    y = np.arange(n_out, dtype=f)
    s, li, lo_ = f(scale), f(n_in), f(n_out)
    # align_corners divides by (length_resized - 1): the ONNX test data (and
    # onnx.reference) take the fractional length scale * length_original
    # there when scales are given, onnxruntime the integer output length. The
    # two agree whenever scale * length is whole; elsewhere the conformance
    # data decides. tf_crop_and_resize uses the integer length in both.
    length = f(scale * n_in)
    half = f(0.5)
    if ctm == "asymmetric":
        x = y / s
    elif ctm == "half_pixel":
        x = (y + half) / s - half
    elif ctm == "tf_half_pixel_for_nn":
        x = (y + half) / s
    elif ctm == "pytorch_half_pixel":
        x = (y + half) / s - half if n_out > 1 else np.zeros(n_out, f)
    elif ctm == "align_corners":
        x = y * (li - 1) / (length - 1) if length != 1 else np.zeros(n_out, f)
    elif ctm == "half_pixel_symmetric":
        adjustment = lo_ / (s * li)
        offset = li / 2 * (1 - adjustment)
        # onnxruntime sums this one in double (double 0.5 literals), then rounds to float
        x = (np.float64(offset) + (y.astype(np.float64) + 0.5) / np.float64(s) - 0.5).astype(f)
    else:  # tf_crop_and_resize
        a, b = f(roi_lo), f(roi_hi)
        if n_out > 1:
            x = a * (li - 1) + (y * (b - a) * (li - 1)) / (lo_ - 1)
        else:
            x = np.full(n_out, half * (a + b) * (li - 1), dtype=f)
        return x.astype(np.float64), (x < 0) | (x > li - 1)
    return x.astype(np.float64), None


def _cubic(t: np.ndarray, a: float) -> np.ndarray:
    t = np.abs(t)
    t2, t3 = t * t, t * t * t
    near = (a + 2) * t3 - (a + 3) * t2 + 1
    far = a * t3 - 5 * a * t2 + 8 * a * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


@functools.lru_cache(maxsize=256)
def axis_table(n_in: int, n_out: int, scale: float, mode: str, ctm: str, roi_lo: float, roi_hi: float,
               nearest_mode: str, cubic_a: float, exclude_outside: int, antialias: int):
    """(indices (n_out, taps), weights (n_out, taps) or None, extrapolated mask or None)."""
    x, extrap = _source_coords(ctm, n_in, n_out, scale, roi_lo, roi_hi)
    if mode == "nearest":
        fl = np.floor(x)
        frac = x - fl
        if nearest_mode == "round_prefer_floor":
            up = frac > 0.5
        elif nearest_mode == "round_prefer_ceil":
            up = frac >= 0.5
        elif nearest_mode == "floor":
            up = np.zeros(n_out, dtype=bool)
        elif nearest_mode == "ceil":
            up = frac > 0
        else:  # legacy (before opset 11): truncate when upsampling, ceil when downsampling
            up = (frac > 0) if scale < 1 else np.zeros(n_out, dtype=bool)
        idx = (fl + up).astype(np.int64)
        return np.clip(idx, 0, n_in - 1)[:, None], None, extrap
    base = np.ceil(x) - 1
    r = x - base  # in (0, 1]
    s = min(scale, 1.0) if antialias else 1.0
    if mode == "linear":
        start = int(math.floor(-1 / s) + 1) if antialias else 0
        k = np.arange(start, 2 - start, dtype=np.float64)  # tap offsets relative to base
        w = np.clip(1 - np.abs((k[None, :] - r[:, None]) * s), 0, 1)
    else:  # cubic
        start = int(math.floor(-2 / s) + 1) if antialias else -1
        k = np.arange(start, 2 - start, dtype=np.float64)
        w = _cubic((k[None, :] - r[:, None]) * s, cubic_a)
    idx = base[:, None].astype(np.int64) + k[None, :].astype(np.int64)
    if antialias:
        w = w / w.sum(axis=1, keepdims=True)
    if exclude_outside:
        w = np.where((idx < 0) | (idx >= n_in), 0.0, w)
        tot = w.sum(axis=1, keepdims=True)
        w = w / np.where(tot == 0, 1.0, tot)
    return np.clip(idx, 0, n_in - 1), w, extrap


def _repeat_factor(src: np.ndarray, n_in: int) -> int:
    """k when output position i reads input i // k (an integer nearest upsample), else 0."""
    n_out = src.shape[0]
    if n_in == 0 or n_out % n_in or n_out == n_in:
        return 0
    k = n_out // n_in
    return k if np.array_equal(src, np.arange(n_out) // k) else 0


_DENSE: dict = {}


def _dense(table, n_in: int, wd) -> np.ndarray:
    """The (n_in, n_out) matrix of a weight table (memoised per table)."""
    key = (id(table), n_in, np.dtype(wd).name)
    hit = _DENSE.get(key)
    if hit is not None and hit[0] is table:
        return hit[1]
    idx, w, _ = table
    m = np.zeros((n_in, idx.shape[0]), dtype=np.float64)
    np.add.at(m, (idx.reshape(-1), np.repeat(np.arange(idx.shape[0]), idx.shape[1])), w.reshape(-1))
    m = m.astype(wd)
    if len(_DENSE) > 256:
        _DENSE.clear()
    _DENSE[key] = (table, m)
    return m


def _apply_axis(x: np.ndarray, axis: int, table, extrapolation_value: float, wd) -> np.ndarray:
    idx, w, extrap = table
    if w is None:
        k = _repeat_factor(idx[:, 0], x.shape[axis])
        if k and axis == x.ndim - 1 and (extrap is None or not extrap.any()):
            # an integer nearest upsample of the innermost axis: k strided
            # assignments beat a gather along it ~4x (np.take of whole rows,
            # the other axes, is fast already)
            out = np.empty(x.shape[: axis + 1] + (k,) + x.shape[axis + 1:], dtype=x.dtype)
            head = (slice(None),) * (axis + 1)
            for t in range(k):
                out[head + (t,)] = x
            return out.reshape(x.shape[:axis] + (x.shape[axis] * k,) + x.shape[axis + 1:])
        out = np.take(x, idx[:, 0].astype(np.intp, copy=False), axis=axis)
    elif axis == x.ndim - 1 and x.shape[axis] <= 100 * idx.shape[1] and np.isfinite(x).all():
        # Along the innermost axis a gather is slow; a short axis is faster
        # as one BLAS product with the dense (n_in, n_out) weight matrix
        # (finite inputs only: 0 * inf would spread NaN over the row).
        out = (x.reshape(-1, x.shape[axis]) @ _dense(table, x.shape[axis], wd)).reshape(x.shape[:-1] + (-1,))
    else:
        bshape = (1,) * axis + (idx.shape[0],) + (1,) * (x.ndim - axis - 1)
        out = None
        for t in range(idx.shape[1]):
            wt = w[:, t]
            if not wt.any():
                continue
            term = np.take(x, idx[:, t].astype(np.intp, copy=False), axis=axis)
            term *= wt.astype(wd).reshape(bshape)
            out = term if out is None else np.add(out, term, out=out)
        if out is None:
            shape = list(x.shape)
            shape[axis] = idx.shape[0]
            out = np.zeros(shape, dtype=wd)
    if extrap is not None and extrap.any():
        bshape = (1,) * axis + (idx.shape[0],) + (1,) * (x.ndim - axis - 1)
        out = np.where(extrap.reshape(bshape), out.dtype.type(extrapolation_value), out)
    return out


def _apply_axis_backward(dy: np.ndarray, axis: int, n_in: int, table) -> np.ndarray:
    """Transpose of :func:`_apply_axis` (extrapolated positions get no gradient)."""
    idx, w, extrap = table
    taps = idx.shape[1]
    wm = np.ones(idx.shape) if w is None else np.array(w)
    if extrap is not None:
        wm[extrap] = 0
    m = np.zeros((idx.shape[0], n_in), dtype=dy.dtype)
    np.add.at(m, (np.repeat(np.arange(idx.shape[0]), taps), idx.reshape(-1)), wm.reshape(-1))
    return np.moveaxis(np.tensordot(dy, m, axes=([axis], [0])), -1, axis)


def _plan(x_shape, roi, scales, sizes, axes, keep_aspect_ratio_policy, ctm):
    """Per-axis (scale, n_out, roi_lo, roi_hi) for the full rank."""
    r = len(x_shape)
    ax = ints(axes)
    if ax is None:
        ax = tuple(range(r))
    ax = tuple(a + r if a < 0 else a for a in ax)
    if any(not 0 <= a < r for a in ax) or len(set(ax)) != len(ax):
        raise OpError(f"Resize: axes {list(ax)} are not distinct axes of a rank-{r} input")
    scale_v = None if scales is None or np.size(scales) == 0 else np.asarray(scales, dtype=np.float32).reshape(-1)
    size_v = None if sizes is None or np.size(sizes) == 0 else ints(sizes)
    if (scale_v is None) == (size_v is None):
        raise OpError("Resize needs exactly one of the scales and sizes inputs (the other empty or omitted)")
    full_scale = [1.0] * r
    out = list(x_shape)
    if scale_v is not None:
        if len(scale_v) != len(ax):
            raise OpError(f"Resize: scales has {len(scale_v)} values for {len(ax)} axes")
        if np.any(scale_v <= 0):
            raise OpError(f"Resize: scales must be positive, got {scale_v.tolist()}")
        for a, s in zip(ax, scale_v):
            full_scale[a] = float(s)
            out[a] = int(np.floor(np.float32(x_shape[a]) * s))
    else:
        if len(size_v) != len(ax):
            raise OpError(f"Resize: sizes has {len(size_v)} values for {len(ax)} axes")
        if any(s < 0 for s in size_v):
            raise OpError(f"Resize: sizes must be non-negative, got {list(size_v)}")
        policy = choice("Resize", "keep_aspect_ratio_policy", keep_aspect_ratio_policy or "stretch",
                        ("stretch", "not_larger", "not_smaller"))
        ratios = [float(np.float32(s) / np.float32(x_shape[a])) if x_shape[a] else 1.0
                  for a, s in zip(ax, size_v)]
        if policy == "stretch":
            for a, s, q in zip(ax, size_v, ratios):
                full_scale[a], out[a] = q, int(s)
        else:
            q = min(ratios) if policy == "not_larger" else max(ratios)
            for a in ax:
                full_scale[a], out[a] = q, int(q * x_shape[a] + 0.5)
    lo, hi = [0.0] * r, [1.0] * r
    if ctm == "tf_crop_and_resize":
        roi_v = None if roi is None or np.size(roi) == 0 else np.asarray(roi, dtype=np.float64).reshape(-1)
        if roi_v is None:
            raise OpError("Resize: coordinate_transformation_mode 'tf_crop_and_resize' needs the roi input")
        if len(roi_v) != 2 * len(ax):
            raise OpError(f"Resize: roi has {len(roi_v)} values; {len(ax)} axes need {2 * len(ax)}")
        for i, a in enumerate(ax):
            lo[a], hi[a] = float(roi_v[i]), float(roi_v[len(ax) + i])
    return [(full_scale[a], out[a], lo[a], hi[a]) for a in range(r)], ax


def _work_dtype(dtype: np.dtype) -> np.dtype:
    if dtype == np.float64 or np.issubdtype(dtype, np.integer):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def _finish(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if y.dtype == dtype:
        return y
    if np.issubdtype(dtype, np.integer):
        # onnxruntime converts back with a C cast (truncation), then saturates;
        # computed in float64 and snapped, a whole value is not cut to the one below
        info = np.iinfo(dtype)
        return np.clip(np.trunc(y + np.copysign(1e-4, y)), info.min, info.max).astype(dtype)
    return y.astype(dtype)


def _tables(x_shape, plan, axes, mode, ctm, nearest_mode, cubic_a, exclude_outside, antialias):
    out = []
    for a in axes:
        scale, n_out, lo, hi = plan[a]
        n_in = x_shape[a]
        if n_out == n_in and scale == 1.0 and (ctm != "tf_crop_and_resize" or (lo == 0.0 and hi == 1.0)):
            continue
        if n_in == 0 and n_out:
            raise OpError(f"Resize: cannot resize the empty axis {a} to {n_out}")
        out.append((a, n_in, axis_table(n_in, n_out, scale, mode, ctm, lo, hi, nearest_mode,
                                        float(cubic_a), int(exclude_outside), int(antialias))))
    return out


def resize_array(x, plan, axes, *, mode, ctm, nearest_mode, cubic_a=-0.75, exclude_outside=0,
                 antialias=0, extrapolation_value=0.0):
    tables = _tables(x.shape, plan, axes, mode, ctm, nearest_mode, cubic_a, exclude_outside, antialias)
    if any(plan[a][1] == 0 for a in range(x.ndim)):
        return np.zeros(tuple(p[1] for p in plan), dtype=x.dtype)
    if mode == "nearest":
        y = x
        for a, _, t in reversed(tables):  # innermost first: the cheap row gathers then copy more
            y = _apply_axis(y, a, t, extrapolation_value, y.dtype)
        return y if y is not x else x.copy()
    wd = _work_dtype(x.dtype)
    y = x.astype(wd, copy=False)
    # shrinking axes first, growing ones last (innermost first among equals):
    # each pass then works on the smallest array it can
    for a, _, t in sorted(tables, key=lambda e: (e[2][0].shape[0] / max(e[1], 1), -e[0])):
        y = _apply_axis(y, a, t, extrapolation_value, wd)
    return _finish(y if y is not x else x.copy(), x.dtype)


def resize_backward(dy, x_shape, plan, axes, *, mode, ctm, nearest_mode, cubic_a=-0.75, exclude_outside=0,
                    antialias=0):
    tables = _tables(x_shape, plan, axes, mode, ctm, nearest_mode, cubic_a, exclude_outside, antialias)
    g = dy
    for a, n_in, t in reversed(tables):
        g = _apply_axis_backward(g, a, n_in, t)
    return np.ascontiguousarray(g, dtype=dy.dtype)


def _attrs_11(mode, coordinate_transformation_mode, nearest_mode, antialias):
    m = choice("Resize", "mode", mode, _MODES)
    ctm = choice("Resize", "coordinate_transformation_mode", coordinate_transformation_mode, _COORD_MODES)
    nm = choice("Resize", "nearest_mode", nearest_mode, _NEAREST_MODES[:4])
    if antialias and m == "nearest":
        raise OpError("Resize: antialias applies to the linear and cubic modes, not nearest")
    return m, ctm, nm


_RESIZE_TYPES = ANY_TYPE


@register("Resize", dtypes=_RESIZE_TYPES, since=11)
def resize(
    x: np.ndarray,
    roi: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    sizes: np.ndarray | None = None,
    *,
    antialias: int = 0,
    axes=None,
    coordinate_transformation_mode: str = "half_pixel",
    cubic_coeff_a: float = -0.75,
    exclude_outside: int = 0,
    extrapolation_value: float = 0.0,
    keep_aspect_ratio_policy: str = "stretch",
    mode: str = "nearest",
    nearest_mode: str = "round_prefer_floor",
) -> np.ndarray:
    m, ctm, nm = _attrs_11(mode, coordinate_transformation_mode, nearest_mode, antialias)
    plan, ax = _plan(x.shape, roi, scales, sizes, axes, keep_aspect_ratio_policy, ctm)
    return resize_array(x, plan, ax, mode=m, ctm=ctm, nearest_mode=nm, cubic_a=cubic_coeff_a,
                        exclude_outside=exclude_outside, antialias=antialias,
                        extrapolation_value=extrapolation_value)


@resize.backward(uses="inputs")
def _(grads, inputs, outputs, *, antialias=0, axes=None, coordinate_transformation_mode="half_pixel",
      cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0, keep_aspect_ratio_policy="stretch",
      mode="nearest", nearest_mode="round_prefer_floor"):
    dy, x = grads[0], inputs[0]
    rest = list(inputs[1:]) + [None] * (4 - len(inputs))
    if dy is None:
        return (None,) * len(inputs)
    m, ctm, nm = _attrs_11(mode, coordinate_transformation_mode, nearest_mode, antialias)
    plan, ax = _plan(x.shape, rest[0], rest[1], rest[2], axes, keep_aspect_ratio_policy, ctm)
    dx = resize_backward(dy, x.shape, plan, ax, mode=m, ctm=ctm, nearest_mode=nm, cubic_a=cubic_coeff_a,
                         exclude_outside=exclude_outside, antialias=antialias)
    return (dx,) + (None,) * (len(inputs) - 1)


def _legacy(op: str, x: np.ndarray, scales, mode: str):
    m = text(mode, "nearest")
    if m in ("bilinear", "trilinear"):
        m = "linear"
    m = choice(op, "mode", m, ("nearest", "linear"))
    if scales is None:
        raise OpError(f"{op} needs scales")
    s = np.asarray(scales, dtype=np.float32).reshape(-1)
    if s.size != x.ndim:
        raise OpError(f"{op}: scales has {s.size} values for a rank-{x.ndim} input")
    if np.any(s < 1) and op == "Upsample":
        raise OpError(f"Upsample: scales must be >= 1, got {s.tolist()}")
    plan, ax = _plan(x.shape, None, s, None, None, "stretch", "asymmetric")
    return plan, ax, m


@register("Resize", dtypes=_RESIZE_TYPES, since=10)
def resize_v10(x: np.ndarray, scales: np.ndarray, *, mode: str = "nearest") -> np.ndarray:
    plan, ax, m = _legacy("Resize", x, scales, mode)
    return resize_array(x, plan, ax, mode=m, ctm="asymmetric", nearest_mode="legacy")


@resize_v10.backward(uses="inputs")
def _(grads, inputs, outputs, *, mode="nearest"):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None, None)
    plan, ax, m = _legacy("Resize", x, inputs[1], mode)
    return resize_backward(dy, x.shape, plan, ax, mode=m, ctm="asymmetric", nearest_mode="legacy"), None


@register("Upsample", dtypes=_RESIZE_TYPES, since=9)
def upsample(x: np.ndarray, scales: np.ndarray, *, mode: str = "nearest") -> np.ndarray:
    plan, ax, m = _legacy("Upsample", x, scales, mode)
    return resize_array(x, plan, ax, mode=m, ctm="asymmetric", nearest_mode="legacy")


@upsample.backward(uses="inputs")
def _(grads, inputs, outputs, *, mode="nearest"):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None, None)
    plan, ax, m = _legacy("Upsample", x, inputs[1], mode)
    return resize_backward(dy, x.shape, plan, ax, mode=m, ctm="asymmetric", nearest_mode="legacy"), None


@register("Upsample", dtypes=_RESIZE_TYPES, since=7)
def upsample_v7(x: np.ndarray, *, mode: str = "nearest", scales=None) -> np.ndarray:
    plan, ax, m = _legacy("Upsample", x, scales, mode)
    return resize_array(x, plan, ax, mode=m, ctm="asymmetric", nearest_mode="legacy")


@upsample_v7.backward(uses="inputs")
def _(grads, inputs, outputs, *, mode="nearest", scales=None):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    plan, ax, m = _legacy("Upsample", x, scales, mode)
    return (resize_backward(dy, x.shape, plan, ax, mode=m, ctm="asymmetric", nearest_mode="legacy"),)
