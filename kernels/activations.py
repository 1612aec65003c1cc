"""Point-wise activations: Relu, LeakyRelu, PRelu, Sigmoid, Tanh, Clip, Elu,
Celu, Selu, HardSigmoid, HardSwish, Softplus, Softsign, Gelu, Swish, Mish,
SwiGLU, ThresholdedRelu, Shrink.

Sigmoid is ``1 / (1 + exp(-x))`` computed in place: for very negative x
``exp(-x)`` overflows to inf and the result is the correct limit 0 (the
overflow is silenced), and the relative accuracy of tiny results is kept,
which ``0.5 + 0.5 tanh(x / 2)`` would lose. The hot activations are written
as in-place ufunc chains without ``np.where``: a fresh full-size temporary
per step is what makes a numpy activation slow, not the arithmetic.

Backwards of Relu, Sigmoid and Tanh read only the output (``uses="outputs"``),
so the trainer need not keep their inputs alive until the backward pass.
"""

from __future__ import annotations

import numpy as np

from .elementwise import reduce_to_shape
from .registry import FLOAT_TYPES, NUMERIC_TYPES, KernelError, register
from .special import erf, gelu as _gelu_exact


@register("Relu", dtypes=NUMERIC_TYPES)
def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, x.dtype.type(0))


@relu.backward(uses="outputs")
def _(grads, inputs, outputs):
    (dy,), (y,) = grads[:1], outputs[:1]
    if dy is None:
        return (None,)
    # y > 0 exactly where x > 0; the gradient at 0 is 0 (as in PyTorch).
    return (np.multiply(dy, y > 0, dtype=dy.dtype),)


@register("LeakyRelu")
def leaky_relu(x: np.ndarray, *, alpha: float = 0.01) -> np.ndarray:
    y = np.multiply(x, x.dtype.type(alpha), out=np.empty_like(x))
    # x >= 0 keeps x, x < 0 takes alpha x: the larger of the two when alpha <= 1
    return np.maximum(x, y, out=y) if alpha <= 1 else np.minimum(x, y, out=y)


@leaky_relu.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=0.01):
    (dy,), (x,) = grads[:1], inputs[:1]
    if dy is None:
        return (None,)
    return (np.where(x >= 0, dy, dy * dy.dtype.type(alpha)),)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # every step writes into y (out=): in place, and an array even for 0-d inputs
    y = np.negative(x, out=np.empty_like(x))
    with np.errstate(over="ignore"):
        np.exp(y, out=y)
    np.add(y, 1, out=y)
    return np.reciprocal(y, out=y)


@register("Sigmoid")
def sigmoid(x: np.ndarray) -> np.ndarray:
    return _sigmoid(x)


@sigmoid.backward(uses="outputs")
def _(grads, inputs, outputs):
    (dy,), (y,) = grads[:1], outputs[:1]
    if dy is None:
        return (None,)
    return (dy * y * (1 - y),)


@register("Tanh")
def tanh(x: np.ndarray) -> np.ndarray:
    return np.tanh(x)


@tanh.backward(uses="outputs")
def _(grads, inputs, outputs):
    (dy,), (y,) = grads[:1], outputs[:1]
    if dy is None:
        return (None,)
    return (dy * (1 - y * y),)


@register("Clip", dtypes=NUMERIC_TYPES, since=11)
def clip(x: np.ndarray, min: np.ndarray | None = None, max: np.ndarray | None = None) -> np.ndarray:  # noqa: A002
    lo = None if min is None else x.dtype.type(min)
    hi = None if max is None else x.dtype.type(max)
    if lo is None and hi is None:
        return x.copy()
    return np.clip(x, lo, hi)


@register("Clip", dtypes=FLOAT_TYPES, since=6)
def clip_v6(x: np.ndarray, *, min: float = -3.4028234663852886e38, max: float = 3.4028234663852886e38) -> np.ndarray:  # noqa: A002
    return np.clip(x, x.dtype.type(min), x.dtype.type(max))


def _elu(x: np.ndarray, alpha: float, scale: float = 1.0) -> np.ndarray:
    # max(x, 0) + alpha * expm1(min(x, 0)): each term is 0 where the other applies
    zero = x.dtype.type(0)
    neg = np.minimum(x, zero, out=np.empty_like(x))
    np.expm1(neg, out=neg)
    np.multiply(neg, x.dtype.type(alpha), out=neg)
    out = np.maximum(x, zero, out=np.empty_like(x))
    np.add(out, neg, out=out)
    if scale != 1.0:
        np.multiply(out, x.dtype.type(scale), out=out)
    return out


@register("Elu")
def elu(x: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    return _elu(x, alpha)


@register("Selu")
def selu(
    x: np.ndarray, *, alpha: float = 1.67326319217681884765625, gamma: float = 1.05070102214813232421875
) -> np.ndarray:
    return _elu(x, alpha, gamma)


@register("HardSigmoid")
def hard_sigmoid(x: np.ndarray, *, alpha: float = 0.2, beta: float = 0.5) -> np.ndarray:
    y = np.multiply(x, x.dtype.type(alpha), out=np.empty_like(x))
    np.add(y, x.dtype.type(beta), out=y)
    return np.clip(y, 0, 1, out=y)


@register("Softplus")
def softplus(x: np.ndarray) -> np.ndarray:
    return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype)


@register("Celu", since=12)
def celu(x: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    if alpha == 0:
        raise KernelError("Celu: alpha must be non-zero")
    a = x.dtype.type(alpha)
    neg = np.minimum(x, x.dtype.type(0), out=np.empty_like(x))
    np.divide(neg, a, out=neg)
    np.expm1(neg, out=neg)
    np.multiply(neg, a, out=neg)
    out = np.maximum(x, x.dtype.type(0), out=np.empty_like(x))
    return np.add(out, neg, out=out)


@register("ThresholdedRelu", since=10)
def thresholded_relu(x: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    return np.where(x > x.dtype.type(alpha), x, x.dtype.type(0))


@thresholded_relu.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=1.0):
    dy, x = grads[0], inputs[0]
    return (None if dy is None else np.where(x > alpha, dy, 0).astype(dy.dtype, copy=False),)


@register("Shrink", since=9, dtypes=NUMERIC_TYPES)
def shrink(x: np.ndarray, *, bias: float = 0.0, lambd: float = 0.5) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):
        # compare and shift in float64, then back (int inputs, float attributes)
        xf = x.astype(np.float64)
        return np.where(xf < -lambd, xf + bias, np.where(xf > lambd, xf - bias, 0)).astype(x.dtype)
    lam, b = x.dtype.type(lambd), x.dtype.type(bias)
    return np.where(x < -lam, x + b, np.where(x > lam, x - b, x.dtype.type(0)))


@register("Softsign")
def softsign(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.abs(x))


@softsign.backward(uses="inputs")
def _(grads, inputs, outputs):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    d = 1 + np.abs(x)
    return (dy / (d * d),)


@register("HardSwish", since=14)
def hard_swish(x: np.ndarray) -> np.ndarray:
    y = np.multiply(x, x.dtype.type(1 / 6), out=np.empty_like(x))
    np.add(y, x.dtype.type(0.5), out=y)
    np.clip(y, 0, 1, out=y)
    return np.multiply(y, x, out=y)


@hard_swish.backward(uses="inputs")
def _(grads, inputs, outputs):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    g = np.where(x <= -3, 0.0, np.where(x >= 3, 1.0, x / 3 + 0.5))
    return ((dy * g).astype(dy.dtype, copy=False),)


@register("Swish", since=24)
def swish(x: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    y = _sigmoid(x * x.dtype.type(alpha) if alpha != 1.0 else x)
    return np.multiply(y, x, out=y)


@swish.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=1.0):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    s = _sigmoid(alpha * x)
    return ((dy * (s + alpha * x * s * (1 - s))).astype(dy.dtype, copy=False),)


@register("SwiGLU", since=28)
def swiglu(a: np.ndarray, b: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    if a.shape != b.shape:
        raise KernelError(f"SwiGLU: gate {a.shape} and value {b.shape} must have one shape (no broadcasting)")
    y = _sigmoid(a * a.dtype.type(alpha) if alpha != 1.0 else a)
    np.multiply(y, a, out=y)
    return np.multiply(y, b.astype(a.dtype, copy=False), out=y)


@swiglu.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=1.0):
    dy, (a, b) = grads[0], inputs[:2]
    if dy is None:
        return (None, None)
    s = _sigmoid(alpha * a)
    swish_a = a * s
    da = dy * b * (s + alpha * a * s * (1 - s))
    return (da.astype(dy.dtype, copy=False), (dy * swish_a).astype(dy.dtype, copy=False))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


@register("Mish", since=18)
def mish(x: np.ndarray) -> np.ndarray:
    t = np.tanh(_softplus(x), out=np.empty_like(x))
    return np.multiply(t, x, out=t)


@mish.backward(uses="inputs")
def _(grads, inputs, outputs):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    t = np.tanh(_softplus(x))
    return ((dy * (t + x * (1 - t * t) * _sigmoid(x))).astype(dy.dtype, copy=False),)


_SQRT_2_OVER_PI = float(np.sqrt(2 / np.pi))


@register("Gelu", since=20)
def gelu(x: np.ndarray, *, approximate: str = "none") -> np.ndarray:
    if approximate == "none":
        return _gelu_exact(x)
    if approximate == "tanh":
        w = x.astype(np.float32) if x.dtype == np.float16 else x  # x**3 overflows float16
        with np.errstate(over="ignore"):  # |x| > 1e12: x**3 is inf, tanh(inf) = 1
            inner = w.dtype.type(_SQRT_2_OVER_PI) * (w + w.dtype.type(0.044715) * w * w * w)
        return (0.5 * w * (1 + np.tanh(inner))).astype(x.dtype, copy=False)
    raise KernelError(f"Gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


@gelu.backward(uses="inputs")
def _(grads, inputs, outputs, *, approximate="none"):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    if approximate == "tanh":
        u = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
        t = np.tanh(u)
        du = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
        g = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du
    else:
        g = 0.5 * (1 + erf(x / np.sqrt(2))) + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)
    return ((dy * g).astype(dy.dtype, copy=False),)


def _prelu_slope(x: np.ndarray, slope: np.ndarray) -> np.ndarray:
    slope = slope.astype(x.dtype, copy=False)
    try:
        np.broadcast_shapes(x.shape, slope.shape)
    except ValueError:
        # Older exporters give a per-channel slope (C,) for (N, C, ...) inputs.
        if x.ndim >= 2 and slope.size == x.shape[1]:
            return slope.reshape((1, -1) + (1,) * (x.ndim - 2))
        raise KernelError(
            f"PRelu: slope of shape {slope.shape} does not broadcast to the input's shape {x.shape}"
        ) from None
    return slope


@register("PRelu", since=6, dtypes=NUMERIC_TYPES)
def prelu(x: np.ndarray, slope: np.ndarray) -> np.ndarray:
    s = _prelu_slope(x, slope)
    if x.dtype.kind == "f" and s.size and np.isfinite(s).all():
        # min(x, 0) * s + max(x, 0): the same values as the where() below, exactly (one term
        # is 0 at every element, NaN stays NaN; -0.0 comes out +0.0), in place with no
        # mask: 3.8x faster on MTCNN's (8, 32, 46, 46) (0.54 vs 2.08 ms). A slope that is
        # not finite would turn the 0 * s term into NaN, so it keeps the where().
        y = np.minimum(x, x.dtype.type(0))
        try:
            np.multiply(y, s, out=y)
        except ValueError:  # the slope broadcasts x to a larger shape: not in place
            pass
        else:
            return np.add(y, np.maximum(x, x.dtype.type(0)), out=y)
    return np.where(x > 0, x, x * s).astype(x.dtype, copy=False)


@prelu.backward(uses="inputs")
def _(grads, inputs, outputs, *, needs_grad=None):
    dy, (x, slope) = grads[0], inputs[:2]
    if dy is None:
        return (None, None)
    s = _prelu_slope(x, slope)
    pos = x > 0
    dx = np.where(pos, dy, dy * s) if needs_grad is None or needs_grad[0] else None
    ds = None
    if needs_grad is None or needs_grad[1]:
        ds = reduce_to_shape(np.where(pos, 0, dy * x), s.shape).reshape(slope.shape)
    return (dx, ds)


# ---------------------------------------------------------------- backwards (transfer learning)
# Kept apart from the forwards above; each names its forward.


def _clip_grad(dy, y, lo, hi):
    # From the output, so the input need not be kept (a HardSwish written as x * Clip(x + 3, 0, 6) / 6
    # keeps x and the Clip's output anyway): the gradient passes where lo < y < hi. Exactly at a bound
    # it is 0 (PyTorch's clamp passes it there; Relu's rule at 0 is the same as this one).
    keep = np.ones(y.shape, dtype=bool)
    if lo is not None:
        keep &= y > y.dtype.type(lo)
    if hi is not None:
        keep &= y < y.dtype.type(hi)
    return np.multiply(dy, keep, dtype=dy.dtype)


@clip.backward(uses="all")
def _(grads, inputs, outputs):
    dy, y = grads[0], outputs[0]
    lo = inputs[1] if len(inputs) > 1 else None
    hi = inputs[2] if len(inputs) > 2 else None
    rest = (None,) * (len(inputs) - 1)
    if dy is None:
        return (None,) + rest
    return (_clip_grad(dy, y, lo, hi),) + rest


@clip_v6.backward(uses="outputs")
def _(grads, inputs, outputs, *, min=-3.4028234663852886e38, max=3.4028234663852886e38):  # noqa: A002
    dy, y = grads[0], outputs[0]
    return (None if dy is None else _clip_grad(dy, y, min, max),)


@hard_sigmoid.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=0.2, beta=0.5):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    t = x * x.dtype.type(alpha) + x.dtype.type(beta)
    inside = (t > 0) & (t < 1)
    return (np.multiply(dy, inside, dtype=dy.dtype) * dy.dtype.type(alpha),)


@elu.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=1.0):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    return (np.where(x > 0, dy, dy * x.dtype.type(alpha) * np.exp(np.minimum(x, 0))),)


@selu.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    g = x.dtype.type(gamma)
    return (np.where(x > 0, dy * g, dy * g * x.dtype.type(alpha) * np.exp(np.minimum(x, 0))),)


@softplus.backward(uses="inputs")
def _(grads, inputs, outputs):
    dy, x = grads[0], inputs[0]
    return (None if dy is None else dy * _sigmoid(x),)
