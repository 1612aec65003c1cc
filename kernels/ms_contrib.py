"""com.microsoft float ops that onnxruntime's transformer optimizer and
fusions write into exported models: Gelu, BiasGelu, FastGelu,
SkipLayerNormalization and FusedConv (Conv + optional sum + activation).

Each is the composition of ai.onnx ops it replaces, computed as onnxruntime's
CPU kernels define it (the contrib op schemas), so a model saved after
onnxruntime's graph optimizations still runs on the numpy backend.
"""

from __future__ import annotations

import math

import numpy as np

from ._nn import OpError, text
from .registry import FLOAT_TYPES, get_kernel, register
from .special import gelu as _gelu

MS = "com.microsoft"


@register("Gelu", domain=MS, dtypes=FLOAT_TYPES)
def ms_gelu(x):
    """``0.5 x (1 + erf(x / sqrt 2))``."""
    return _gelu(np.asarray(x))


@register("BiasGelu", domain=MS, dtypes=FLOAT_TYPES)
def bias_gelu(a, b):
    """Gelu(A + B); B is 1-D, the size of A's last axis."""
    a, b = np.asarray(a), np.asarray(b)
    if b.ndim != 1 or a.ndim < 1 or b.shape[0] != a.shape[-1]:
        raise OpError(f"BiasGelu: the bias must be 1-D of A's last dimension {a.shape[-1:]}, got {b.shape}")
    return _gelu((a + b).astype(a.dtype, copy=False))


_C = math.sqrt(2.0 / math.pi)


@register("FastGelu", domain=MS, dtypes=FLOAT_TYPES)
def fast_gelu(x, bias=None):
    """The tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` of Gelu(X + bias)."""
    x = np.asarray(x)
    if bias is not None:
        bias = np.asarray(bias)
        if bias.ndim != 1 or bias.shape[0] != x.shape[-1]:
            raise OpError(f"FastGelu: the bias must be 1-D of X's last dimension {x.shape[-1:]}, got {bias.shape}")
        x = x + bias
    w = x.astype(np.float64 if x.dtype == np.float64 else np.float32, copy=False)
    y = 0.5 * w * (1.0 + np.tanh(_C * w * (1.0 + 0.044715 * w * w)))
    return y.astype(x.dtype, copy=False)


@register("SkipLayerNormalization", domain=MS, dtypes=FLOAT_TYPES)
def skip_layer_normalization(x, skip, gamma, beta=None, bias=None, *, epsilon: float = 1e-12, n_outputs: int = 1):
    """LayerNormalization over the last axis of ``x + skip (+ bias)``; outputs (y, mean, inv_std_dev,
    the sum x + skip + bias), the last three optional."""
    x, skip, gamma = np.asarray(x), np.asarray(skip), np.asarray(gamma)
    if x.ndim not in (2, 3):
        raise OpError(f"SkipLayerNormalization: input must be 2-D or 3-D, got {x.shape}")
    h = x.shape[-1]
    if skip.shape[-1:] != (h,) or skip.ndim > x.ndim or x.shape[x.ndim - skip.ndim:] != skip.shape:
        raise OpError(f"SkipLayerNormalization: skip {skip.shape} does not broadcast to input {x.shape}")
    for name, v in (("gamma", gamma), ("beta", beta), ("bias", bias)):
        if v is not None and np.shape(v) != (h,):
            raise OpError(f"SkipLayerNormalization: {name} must be 1-D of the hidden size {h}, got {np.shape(v)}")
    s = x + skip
    if bias is not None:
        s = s + np.asarray(bias)
    s = s.astype(x.dtype, copy=False)
    w = s.astype(np.float64 if x.dtype == np.float64 else np.float32)
    mean = w.mean(axis=-1, keepdims=True)
    d = w - mean
    inv = 1.0 / np.sqrt((d * d).mean(axis=-1, keepdims=True) + float(epsilon))
    y = d * inv * gamma
    if beta is not None:
        y = y + np.asarray(beta)
    outs = (y.astype(x.dtype, copy=False), mean.astype(np.float32), inv.astype(np.float32), s)
    return outs[0] if n_outputs <= 1 else outs[:n_outputs]


def _activation(name: str, params):
    p = [float(v) for v in (params or ())]

    def need(k: int):
        if len(p) != k:
            raise OpError(f"FusedConv: activation {name!r} takes {k} activation_params, got {len(p)}")
        return p

    if name == "Relu":
        return lambda y: np.maximum(y, 0)
    if name == "Tanh":
        return np.tanh
    if name == "Sigmoid":
        return lambda y: 1.0 / (1.0 + np.exp(-y))
    if name == "LeakyRelu":
        (alpha,) = need(1)
        return lambda y: np.where(y >= 0, y, alpha * y)
    if name == "Clip":
        lo, hi = need(2)
        return lambda y: np.clip(y, lo, hi)
    if name == "HardSigmoid":
        alpha, beta = need(2)
        return lambda y: np.clip(alpha * y + beta, 0, 1)
    raise OpError(f"FusedConv: activation {name!r} is not one of Relu, Tanh, Sigmoid, LeakyRelu, Clip, HardSigmoid")


@register("FusedConv", domain=MS, dtypes=FLOAT_TYPES)
def fused_conv(x, w, b=None, z=None, *, activation=None, activation_params=None, auto_pad="NOTSET",
               dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """``activation(Conv(X, W, B) + Z)``: onnxruntime's Conv + Add + activation fusion."""
    act = None if activation is None else _activation(text(activation), activation_params)
    conv = get_kernel("Conv", "", None, np.asarray(x).dtype)
    y = conv(x, w, b, auto_pad=auto_pad, dilations=dilations, group=group, kernel_shape=kernel_shape,
             pads=pads, strides=strides)
    if z is not None:
        if np.shape(z) != y.shape:
            raise OpError(f"FusedConv: Z {np.shape(z)} must have the convolution's output shape {y.shape}")
        y = y + z
    if act is not None:
        with np.errstate(over="ignore"):
            y = act(y)
    return np.asarray(y).astype(np.asarray(x).dtype, copy=False)
