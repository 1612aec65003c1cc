"""BatchNormalization (inference, and training mode with running stats).

The backward covers both modes. In training mode the batch statistics depend
on ``x``, which adds the two mean terms of the classic formula; the running
mean and variance are statistics, not parameters, and get no gradient.
"""

from __future__ import annotations

import numpy as np

from .registry import FLOAT_TYPES, register


def _channel_shape(x: np.ndarray) -> tuple[int, ...]:
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _reduce_axes(x: np.ndarray) -> tuple[int, ...]:
    return (0,) + tuple(range(2, x.ndim))


@register("BatchNormalization", dtypes=FLOAT_TYPES, since=9)
def batch_normalization(
    x: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray,
    mean: np.ndarray,
    var: np.ndarray,
    *,
    epsilon: float = 1e-5,
    momentum: float = 0.9,
    training_mode: int = 0,
    n_outputs: int = 1,
):
    """Normalise per channel (axis 1).

    In training mode the batch's own statistics normalise ``x`` and the
    running statistics are updated as ``running = old * momentum +
    batch * (1 - momentum)`` (ONNX semantics: the batch variance is the
    biased one), returned as the optional 2nd and 3rd outputs.
    """
    cs = _channel_shape(x)
    if training_mode:
        axes = _reduce_axes(x)
        b_mean = x.mean(axis=axes)
        b_var = x.var(axis=axes)
        inv = 1.0 / np.sqrt(b_var + epsilon)
        y = (x - b_mean.reshape(cs)) * (inv * scale).reshape(cs) + bias.reshape(cs)
        y = y.astype(x.dtype, copy=False)
        if n_outputs == 1:
            return y
        run_mean = (mean * momentum + b_mean * (1 - momentum)).astype(mean.dtype)
        run_var = (var * momentum + b_var * (1 - momentum)).astype(var.dtype)
        return y, run_mean, run_var
    k = (scale / np.sqrt(var + epsilon)).astype(x.dtype, copy=False)
    y = x * k.reshape(cs)
    y += (bias - mean * k).astype(x.dtype, copy=False).reshape(cs)
    if n_outputs == 1:
        return y
    return (y, mean, var)[:n_outputs]


@batch_normalization.backward(uses="inputs")
def _(grads, inputs, outputs, *, epsilon=1e-5, momentum=0.9, training_mode=0, needs_grad=None):
    dy = grads[0]
    x, scale = inputs[0], inputs[1]
    if dy is None:
        return (None,) * 5
    want = needs_grad or (True,) * 5
    cs, axes = _channel_shape(x), _reduce_axes(x)
    if training_mode:
        mean = x.mean(axis=axes)
        var = x.var(axis=axes)
    else:
        mean, var = inputs[3], inputs[4]
    inv = (1.0 / np.sqrt(var + epsilon)).astype(dy.dtype, copy=False)
    dbias = dy.sum(axis=axes)
    xhat = dscale = None
    if training_mode or want[1]:  # frozen statistics: x's values matter only for the scale's gradient
        xhat = (x - mean.reshape(cs)) * inv.reshape(cs)
        dscale = (dy * xhat).sum(axis=axes)
    dx = None
    if want[0]:
        k = (scale * inv).reshape(cs)
        if training_mode:
            m = x.size // x.shape[1]
            dx = k * (dy - (dbias / m).reshape(cs) - xhat * (dscale / m).reshape(cs))
        else:
            dx = dy * k
        dx = dx.astype(dy.dtype, copy=False)
    return (dx, dscale if want[1] else None, dbias if want[2] else None, None, None)


# --------------------------------------------------------------------------
# Normalizations over per-sample groups of elements: LayerNormalization,
# InstanceNormalization, GroupNormalization, RMSNormalization, plus
# MeanVarianceNormalization, LpNormalization and LRN.
#
# Statistics are computed in float32 for float16 inputs (ONNX's stash_type=1)
# and in the input's precision otherwise; the scale/bias stage runs in the
# input's dtype. The backwards share one formula: with xhat = (x - mean) * inv
# over a reduction group of m elements and g = dy * scale,
#     dx = inv * (g - mean(g) - xhat * mean(g * xhat))
# (RMSNormalization drops the mean terms: dx = inv * (g - xhat * mean(g * xhat))).

from ._nn import OpError, ints, norm_axes, unbroadcast, work_dtype  # noqa: E402


def _standardize(x: np.ndarray, axes: tuple[int, ...], epsilon: float, wd: np.dtype):
    """(xhat, mean, inv_std) over ``axes``, all in the working dtype ``wd``."""
    xw = x.astype(wd, copy=False)
    mean = xw.mean(axis=axes, keepdims=True)
    d = xw - mean
    var = np.mean(d * d, axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(var + wd.type(epsilon))
    d *= inv
    return d, mean, inv


def _normalized_backward(dy, xhat, inv, scale_b, axes, *, centered=True):
    g = dy if scale_b is None else dy * scale_b
    m = int(np.prod([xhat.shape[a] for a in axes]))
    s2 = np.sum(g * xhat, axis=axes, keepdims=True) / m
    dx = g - xhat * s2
    if centered:
        dx -= np.sum(g, axis=axes, keepdims=True) / m
    return dx * inv


@register("LayerNormalization", dtypes=FLOAT_TYPES, since=17)
def layer_normalization(
    x: np.ndarray,
    scale: np.ndarray,
    b: np.ndarray | None = None,
    *,
    axis: int = -1,
    epsilon: float = 1e-5,
    stash_type: int = 1,
    n_outputs: int = 1,
):
    """Normalise over dims ``axis..rank-1``; optional outputs Mean and InvStdDev
    (shape ``d[0..axis-1] + 1...``, in the working precision)."""
    ax = norm_axes(axis, x.ndim, "LayerNormalization")
    axes = tuple(range(ax, x.ndim))
    xhat, mean, inv = _standardize(x, axes, epsilon, work_dtype(x.dtype, stash_type))
    y = xhat.astype(x.dtype, copy=False) * scale
    if b is not None:
        y += b
    y = y.astype(x.dtype, copy=False)
    if n_outputs == 1:
        return y
    return (y, mean, inv)[:n_outputs]


@layer_normalization.backward(uses="inputs")
def _(grads, inputs, outputs, *, axis=-1, epsilon=1e-5, stash_type=1, needs_grad=None):
    dy = grads[0]
    x, scale = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    if dy is None:
        return (None,) * len(inputs)
    ax = norm_axes(axis, x.ndim, "LayerNormalization")
    axes = tuple(range(ax, x.ndim))
    xhat, _, inv = _standardize(x, axes, epsilon, work_dtype(x.dtype, stash_type))
    want = needs_grad or (True,) * len(inputs)
    dx = _normalized_backward(dy, xhat, inv, scale, axes).astype(x.dtype, copy=False) if want[0] else None
    dscale = unbroadcast(dy * xhat, scale.shape).astype(scale.dtype, copy=False) if want[1] else None
    out = [dx, dscale]
    if len(inputs) > 2:
        out.append(None if b is None or not want[2] else unbroadcast(dy, b.shape).astype(b.dtype, copy=False))
    return tuple(out)


@register("RMSNormalization", dtypes=FLOAT_TYPES, since=23)
def rms_normalization(
    x: np.ndarray, scale: np.ndarray, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1
) -> np.ndarray:
    ax = norm_axes(axis, x.ndim, "RMSNormalization")
    axes = tuple(range(ax, x.ndim))
    xw = x.astype(work_dtype(x.dtype, stash_type), copy=False)
    inv = 1.0 / np.sqrt(np.mean(xw * xw, axis=axes, keepdims=True) + xw.dtype.type(epsilon))
    return ((xw * inv).astype(x.dtype, copy=False) * scale).astype(x.dtype, copy=False)


@rms_normalization.backward(uses="inputs")
def _(grads, inputs, outputs, *, axis=-1, epsilon=1e-5, stash_type=1):
    dy = grads[0]
    x, scale = inputs[0], inputs[1]
    if dy is None:
        return (None, None)
    ax = norm_axes(axis, x.ndim, "RMSNormalization")
    axes = tuple(range(ax, x.ndim))
    xw = x.astype(work_dtype(x.dtype, stash_type), copy=False)
    inv = 1.0 / np.sqrt(np.mean(xw * xw, axis=axes, keepdims=True) + xw.dtype.type(epsilon))
    xhat = xw * inv
    dx = _normalized_backward(dy, xhat, inv, scale, axes, centered=False).astype(x.dtype, copy=False)
    return dx, unbroadcast(dy * xhat, scale.shape).astype(scale.dtype, copy=False)


def _per_channel(v: np.ndarray, x: np.ndarray) -> np.ndarray:
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


@register("InstanceNormalization", dtypes=FLOAT_TYPES, since=6)
def instance_normalization(x: np.ndarray, scale: np.ndarray, b: np.ndarray, *, epsilon: float = 1e-5):
    if x.ndim < 3:
        raise OpError(f"InstanceNormalization expects an (N, C, D1, ...) input, got shape {x.shape}")
    axes = tuple(range(2, x.ndim))
    xhat, _, _ = _standardize(x, axes, epsilon, work_dtype(x.dtype))
    y = xhat.astype(x.dtype, copy=False) * _per_channel(scale, x)
    y += _per_channel(b, x)
    return y.astype(x.dtype, copy=False)


@instance_normalization.backward(uses="inputs")
def _(grads, inputs, outputs, *, epsilon=1e-5, needs_grad=None):
    dy = grads[0]
    x, scale = inputs[0], inputs[1]
    if dy is None:
        return (None, None, None)
    axes = tuple(range(2, x.ndim))
    xhat, _, inv = _standardize(x, axes, epsilon, work_dtype(x.dtype))
    want = needs_grad or (True, True, True)
    red = (0,) + axes
    dx = (_normalized_backward(dy, xhat, inv, _per_channel(scale, x), axes).astype(x.dtype, copy=False)
          if want[0] else None)
    dscale = np.sum(dy * xhat, axis=red).astype(scale.dtype, copy=False) if want[1] else None
    db = np.sum(dy, axis=red).astype(scale.dtype, copy=False) if want[2] else None
    return dx, dscale, db


def _group_view(x: np.ndarray, num_groups: int) -> np.ndarray:
    if x.ndim < 2 or num_groups <= 0 or x.shape[1] % num_groups:
        raise OpError(
            f"GroupNormalization: num_groups={num_groups} must be positive and divide the "
            f"channel count of input shape {x.shape}"
        )
    return x.reshape((x.shape[0], num_groups, -1))


def _group_norm(x, scale_c, bias_c, num_groups, epsilon, stash_type):
    xg = _group_view(x, num_groups)
    xhat, _, _ = _standardize(xg, (2,), epsilon, work_dtype(x.dtype, stash_type))
    y = xhat.astype(x.dtype, copy=False).reshape(x.shape) * _per_channel(scale_c, x)
    y += _per_channel(bias_c, x)
    return y.astype(x.dtype, copy=False)


def _group_norm_backward(dy, x, scale_c, num_groups, epsilon, stash_type):
    """(dx, dscale per channel, dbias per channel)."""
    xg = _group_view(x, num_groups)
    xhat, _, inv = _standardize(xg, (2,), epsilon, work_dtype(x.dtype, stash_type))
    gy = (dy * _per_channel(scale_c, x)).reshape(xg.shape)
    dx = _normalized_backward(gy, xhat, inv, None, (2,)).reshape(x.shape).astype(x.dtype, copy=False)
    red = (0,) + tuple(range(2, x.ndim))
    dscale = np.sum(dy * xhat.reshape(x.shape), axis=red)
    dbias = np.sum(dy, axis=red)
    return dx, dscale, dbias


@register("GroupNormalization", dtypes=FLOAT_TYPES, since=21)
def group_normalization(
    x: np.ndarray, scale: np.ndarray, bias: np.ndarray, *, epsilon: float = 1e-5,
    num_groups: int | None = None, stash_type: int = 1,
) -> np.ndarray:
    """Opset 21: ``scale`` and ``bias`` are per channel."""
    if num_groups is None:
        raise OpError("GroupNormalization needs the num_groups attribute")
    return _group_norm(x, scale, bias, num_groups, epsilon, stash_type)


@group_normalization.backward(uses="inputs")
def _(grads, inputs, outputs, *, epsilon=1e-5, num_groups=None, stash_type=1):
    dy, (x, scale, bias) = grads[0], inputs
    if dy is None:
        return (None, None, None)
    dx, ds, db = _group_norm_backward(dy, x, scale, num_groups, epsilon, stash_type)
    return dx, ds.astype(scale.dtype), db.astype(bias.dtype)


@register("GroupNormalization", dtypes=FLOAT_TYPES, since=18)
def group_normalization_18(
    x: np.ndarray, scale: np.ndarray, bias: np.ndarray, *, epsilon: float = 1e-5,
    num_groups: int | None = None,
) -> np.ndarray:
    """Opset 18: ``scale`` and ``bias`` are per group (deprecated form)."""
    if num_groups is None:
        raise OpError("GroupNormalization needs the num_groups attribute")
    _group_view(x, num_groups)
    rep = x.shape[1] // num_groups
    return _group_norm(x, np.repeat(scale, rep), np.repeat(bias, rep), num_groups, epsilon, 1)


@group_normalization_18.backward(uses="inputs")
def _(grads, inputs, outputs, *, epsilon=1e-5, num_groups=None):
    dy, (x, scale, bias) = grads[0], inputs
    if dy is None:
        return (None, None, None)
    rep = x.shape[1] // num_groups
    dx, ds, db = _group_norm_backward(dy, x, np.repeat(scale, rep), num_groups, epsilon, 1)
    return (dx, ds.reshape(num_groups, rep).sum(axis=1).astype(scale.dtype),
            db.reshape(num_groups, rep).sum(axis=1).astype(bias.dtype))


@register("MeanVarianceNormalization", dtypes=FLOAT_TYPES, since=9)
def mean_variance_normalization(x: np.ndarray, *, axes: tuple[int, ...] = (0, 2, 3)) -> np.ndarray:
    """(X - E[X]) / (sqrt(E[X^2] - E[X]^2) + 1e-9), as the ONNX function body."""
    ax = tuple(sorted({norm_axes(a, x.ndim, "MeanVarianceNormalization") for a in ints(axes)}))
    xw = x.astype(work_dtype(x.dtype), copy=False)
    mean = xw.mean(axis=ax, keepdims=True)
    var = np.maximum(np.mean(xw * xw, axis=ax, keepdims=True) - mean * mean, 0)
    return ((xw - mean) / (np.sqrt(var) + xw.dtype.type(1e-9))).astype(x.dtype, copy=False)


@register("LpNormalization", dtypes=FLOAT_TYPES, since=1)
def lp_normalization(x: np.ndarray, *, axis: int = -1, p: int = 2) -> np.ndarray:
    """x / ||x||_p along ``axis`` (0 where the norm is 0)."""
    ax = norm_axes(axis, x.ndim, "LpNormalization")
    if p == 1:
        norm = np.sum(np.abs(x), axis=ax, keepdims=True)
    elif p == 2:
        norm = np.sqrt(np.sum(x * x, axis=ax, keepdims=True))
    else:
        raise OpError(f"LpNormalization: p={p} is not supported (ONNX allows 1 or 2)")
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm))
    return y.astype(x.dtype, copy=False)


@register("LRN", dtypes=FLOAT_TYPES, since=1)
def lrn(
    x: np.ndarray, *, alpha: float = 1e-4, beta: float = 0.75, bias: float = 1.0, size: int | None = None
) -> np.ndarray:
    """Local response normalisation across channels (axis 1): a window sum of
    squares by a cumulative sum, so the cost does not grow with ``size``."""
    if size is None or size < 1:
        raise OpError(f"LRN needs a positive size attribute, got {size}")
    if x.ndim < 3:
        raise OpError(f"LRN expects an (N, C, D1, ...) input, got shape {x.shape}")
    wd = work_dtype(x.dtype)
    sq = np.square(x, dtype=wd)
    c = x.shape[1]
    lo = (size - 1) // 2
    hi = -(-(size - 1) // 2)  # ceil
    cs = np.zeros((x.shape[0], c + 1) + x.shape[2:], dtype=wd)
    np.cumsum(sq, axis=1, out=cs[:, 1:])
    idx = np.arange(c)
    begin = np.clip(idx - lo, 0, c)
    end = np.clip(idx + hi + 1, 0, c)
    square_sum = cs[:, end] - cs[:, begin]
    y = x / (wd.type(bias) + wd.type(alpha / size) * square_sum) ** wd.type(beta)
    return y.astype(x.dtype, copy=False)


# ---------------------------------------------------------------- backwards (transfer learning)


def _window_sum(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """out[:, c] = sum of v[:, c - lo : c + hi + 1] over the channel axis (clipped to the edges)."""
    c = v.shape[1]
    cs = np.zeros((v.shape[0], c + 1) + v.shape[2:], dtype=v.dtype)
    np.cumsum(v, axis=1, out=cs[:, 1:])
    idx = np.arange(c)
    return cs[:, np.clip(idx + hi + 1, 0, c)] - cs[:, np.clip(idx - lo, 0, c)]


@lrn.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=1e-4, beta=0.75, bias=1.0, size=None):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    wd = work_dtype(x.dtype)
    xw = x.astype(wd, copy=False)
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    d = wd.type(bias) + wd.type(alpha / size) * _window_sum(np.square(xw), lo, hi)
    dpow = d ** wd.type(-beta)
    t = dy * xw * dpow / d  # dy_c x_c d_c^(-beta-1)
    # x_j sits in the window of channel c when c - lo <= j <= c + hi: the transposed window swaps lo, hi.
    dx = dy * dpow - wd.type(2 * beta * alpha / size) * xw * _window_sum(t, hi, lo)
    return (dx.astype(x.dtype, copy=False),)
