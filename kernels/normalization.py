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
    xhat = (x - mean.reshape(cs)) * inv.reshape(cs)
    dbias = dy.sum(axis=axes)
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
