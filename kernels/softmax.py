"""Softmax, LogSoftmax and Hardmax.

Opset 13 changed the semantics: before it, the input is coerced to 2-D at
``axis`` (default 1) and the softmax runs over the flattened trailing block;
from 13 it runs over the single ``axis`` (default -1). The backwards follow
the same two semantics (the coerced form reshapes to 2-D and back).
"""

from __future__ import annotations

import numpy as np

from .registry import register


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    # the ufuncs' reduce methods: what np.max / np.sum call, without their Python wrappers
    # (~2 us each: a third of a (1, 9) softmax, thai2rom-decoder's attention)
    e = np.subtract(x, np.maximum.reduce(x, axis=axis, keepdims=True), out=np.empty_like(x))
    np.exp(e, out=e)
    return np.divide(e, np.add.reduce(e, axis=axis, keepdims=True), out=e)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    s = np.subtract(x, np.max(x, axis=axis, keepdims=True), out=np.empty_like(x))
    return np.subtract(s, np.log(np.sum(np.exp(s), axis=axis, keepdims=True)), out=s)


def _coerced(fn, x: np.ndarray, axis: int) -> np.ndarray:
    axis = axis % x.ndim if x.ndim else 0
    lead = int(np.prod(x.shape[:axis], dtype=np.int64))
    return fn(x.reshape(lead, -1), 1).reshape(x.shape)


@register("Softmax", since=13)
def softmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    return _softmax(x, axis)


@register("Softmax", since=1)
def softmax_v1(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    return _coerced(_softmax, x, axis)


@register("LogSoftmax", since=13)
def log_softmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    return _log_softmax(x, axis)


@register("LogSoftmax", since=1)
def log_softmax_v1(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    return _coerced(_log_softmax, x, axis)


def _softmax_grad(dy: np.ndarray, y: np.ndarray, axis: int) -> np.ndarray:
    # J^T dy for y = softmax(x): y * (dy - <dy, y>)
    return y * (dy - np.sum(dy * y, axis=axis, keepdims=True))


def _log_softmax_grad(dy: np.ndarray, y: np.ndarray, axis: int) -> np.ndarray:
    # y = x - logsumexp(x): dx = dy - softmax(x) * sum(dy)
    return dy - np.exp(y) * np.sum(dy, axis=axis, keepdims=True)


def _coerced_grad(fn, dy: np.ndarray, y: np.ndarray, axis: int) -> np.ndarray:
    axis = axis % y.ndim if y.ndim else 0
    lead = int(np.prod(y.shape[:axis], dtype=np.int64))
    return fn(dy.reshape(lead, -1), y.reshape(lead, -1), 1).reshape(y.shape)


@softmax.backward(uses="outputs")
def _(grads, inputs, outputs, *, axis=-1):
    dy = grads[0]
    return (None if dy is None else _softmax_grad(dy, outputs[0], axis),)


@softmax_v1.backward(uses="outputs")
def _(grads, inputs, outputs, *, axis=1):
    dy = grads[0]
    return (None if dy is None else _coerced_grad(_softmax_grad, dy, outputs[0], axis),)


@log_softmax.backward(uses="outputs")
def _(grads, inputs, outputs, *, axis=-1):
    dy = grads[0]
    return (None if dy is None else _log_softmax_grad(dy, outputs[0], axis),)


@log_softmax_v1.backward(uses="outputs")
def _(grads, inputs, outputs, *, axis=1):
    dy = grads[0]
    return (None if dy is None else _coerced_grad(_log_softmax_grad, dy, outputs[0], axis),)


def _hardmax(x: np.ndarray, axis: int) -> np.ndarray:
    y = np.zeros_like(x)
    if x.size == 0:
        return y
    first = np.expand_dims(np.argmax(x, axis=axis), axis)  # ties: the first maximum wins
    np.put_along_axis(y, first, 1, axis=axis)
    return y


@register("Hardmax", since=13)
def hardmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    return _hardmax(x, axis)


@register("Hardmax", since=1)
def hardmax_v1(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    return _coerced(_hardmax, x, axis)
