"""Point-wise activations: Relu, LeakyRelu, Sigmoid, Tanh, Clip, Elu,
HardSigmoid, Softplus, Selu.

Sigmoid is computed in the numerically stable split form so that large
negative inputs do not overflow ``exp``.

Backwards of Relu, Sigmoid and Tanh read only the output (``uses="outputs"``),
so the trainer need not keep their inputs alive until the backward pass.
"""

from __future__ import annotations

import numpy as np

from .registry import FLOAT_TYPES, NUMERIC_TYPES, register


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
    return np.where(x >= 0, x, x * x.dtype.type(alpha))


@leaky_relu.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=0.01):
    (dy,), (x,) = grads[:1], inputs[:1]
    if dy is None:
        return (None,)
    return (np.where(x >= 0, dy, dy * dy.dtype.type(alpha)),)


@register("Sigmoid")
def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-|x|) never overflows; pick the branch by sign.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


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


@register("Elu")
def elu(x: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    return np.where(x > 0, x, alpha * (np.exp(np.minimum(x, 0)) - 1)).astype(x.dtype)


@register("Selu")
def selu(
    x: np.ndarray, *, alpha: float = 1.67326319217681884765625, gamma: float = 1.05070102214813232421875
) -> np.ndarray:
    return (gamma * np.where(x > 0, x, alpha * (np.exp(np.minimum(x, 0)) - 1))).astype(x.dtype)


@register("HardSigmoid")
def hard_sigmoid(x: np.ndarray, *, alpha: float = 0.2, beta: float = 0.5) -> np.ndarray:
    return np.clip(x * alpha + beta, 0, 1).astype(x.dtype)


@register("Softplus")
def softplus(x: np.ndarray) -> np.ndarray:
    return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype)
