"""Element-wise arithmetic with numpy (multidirectional) broadcasting.

Add, Sub, Mul, Div, Pow, Mod, Neg, Abs, Sign, Exp, Log, Sqrt, Reciprocal,
Ceil, Floor, Round, IsInf, IsNaN, Sum, Max, Min, Mean, Equal, Less,
Greater, LessOrEqual, GreaterOrEqual, Where.

Backwards (Add, Sub, Mul, Div, Neg) reduce each gradient back to its
input's shape with :func:`reduce_to_shape`: broadcasting in the forward is a
sum in the backward.
"""

from __future__ import annotations

import numpy as np

from .registry import FLOAT_TYPES, NUMERIC_TYPES, KernelError, register

_BOOL_NUMERIC = NUMERIC_TYPES | {"bool"}


def reduce_to_shape(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a broadcast gradient back down to ``shape`` (numpy broadcasting rules)."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1
    )
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _float(x: np.ndarray | None) -> bool:
    return x is not None and np.issubdtype(x.dtype, np.floating)


def _wanted(needs_grad, i: int, x: np.ndarray | None) -> bool:
    return _float(x) and (needs_grad is None or needs_grad[i])


@register("Add", dtypes=NUMERIC_TYPES)
def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(np.add(a, b, dtype=a.dtype))  # an array even for 0-d inputs


@add.backward(uses="inputs")
def _(grads, inputs, outputs, *, needs_grad=None):
    (dy,), (a, b) = grads[:1], inputs[:2]
    if dy is None:
        return (None, None)
    return (
        reduce_to_shape(dy, a.shape) if _wanted(needs_grad, 0, a) else None,
        reduce_to_shape(dy, b.shape) if _wanted(needs_grad, 1, b) else None,
    )


@register("Sub", dtypes=NUMERIC_TYPES)
def sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(np.subtract(a, b, dtype=a.dtype))  # an array even for 0-d inputs


@sub.backward(uses="inputs")
def _(grads, inputs, outputs, *, needs_grad=None):
    (dy,), (a, b) = grads[:1], inputs[:2]
    if dy is None:
        return (None, None)
    return (
        reduce_to_shape(dy, a.shape) if _wanted(needs_grad, 0, a) else None,
        -reduce_to_shape(dy, b.shape) if _wanted(needs_grad, 1, b) else None,
    )


@register("Mul", dtypes=NUMERIC_TYPES)
def mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(np.multiply(a, b, dtype=a.dtype))  # an array even for 0-d inputs


@mul.backward(uses="inputs")
def _(grads, inputs, outputs, *, needs_grad=None):
    (dy,), (a, b) = grads[:1], inputs[:2]
    if dy is None:
        return (None, None)
    return (
        reduce_to_shape(dy * b, a.shape) if _wanted(needs_grad, 0, a) else None,
        reduce_to_shape(dy * a, b.shape) if _wanted(needs_grad, 1, b) else None,
    )


@register("Div", dtypes=NUMERIC_TYPES)
def div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        # ONNX integer division truncates toward zero (C semantics).
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.trunc(np.divide(a.astype(np.float64), b.astype(np.float64)))
        return q.astype(a.dtype)
    return np.asarray(np.divide(a, b, dtype=a.dtype))


@div.backward(uses="inputs")
def _(grads, inputs, outputs, *, needs_grad=None):
    (dy,), (a, b) = grads[:1], inputs[:2]
    if dy is None:
        return (None, None)
    da = db = None
    if _wanted(needs_grad, 0, a):
        da = reduce_to_shape(dy / b, a.shape)
    if _wanted(needs_grad, 1, b):
        db = reduce_to_shape(-dy * a / (b * b), b.shape)
    return (da, db)


@register("Pow", dtypes=NUMERIC_TYPES)
def pow_(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):
        return np.power(x.astype(np.float64), y.astype(np.float64)).astype(x.dtype)
    return np.power(x, y.astype(x.dtype, copy=False))


@register("Neg", dtypes=NUMERIC_TYPES)
def neg(x: np.ndarray) -> np.ndarray:
    return np.negative(x)


@neg.backward(uses="none")
def _(grads, inputs, outputs):
    dy = grads[0]
    return (None if dy is None else np.negative(dy),)


@register("Abs", dtypes=NUMERIC_TYPES)
def abs_(x: np.ndarray) -> np.ndarray:
    return np.abs(x)


@register("Exp")
def exp(x: np.ndarray) -> np.ndarray:
    return np.exp(x)


@register("Log")
def log(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(x)


@register("Sqrt")
def sqrt(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.sqrt(x)


@register("Reciprocal")
def reciprocal(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.reciprocal(x)


def _variadic(fn, inputs: tuple[np.ndarray, ...]) -> np.ndarray:
    out = inputs[0]
    for x in inputs[1:]:
        out = fn(out, x)
    return np.asarray(out, dtype=inputs[0].dtype)


@register("Sum", dtypes=NUMERIC_TYPES)
def sum_(*inputs: np.ndarray) -> np.ndarray:
    return _variadic(np.add, inputs)


@register("Max", dtypes=NUMERIC_TYPES)
def max_(*inputs: np.ndarray) -> np.ndarray:
    return _variadic(np.maximum, inputs)


@register("Min", dtypes=NUMERIC_TYPES)
def min_(*inputs: np.ndarray) -> np.ndarray:
    return _variadic(np.minimum, inputs)


@register("Mean", dtypes=FLOAT_TYPES)
def mean(*inputs: np.ndarray) -> np.ndarray:
    return (_variadic(np.add, inputs) / len(inputs)).astype(inputs[0].dtype)


@register("Equal", dtypes=_BOOL_NUMERIC)
def equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.equal(a, b)


@register("Less", dtypes=_BOOL_NUMERIC)
def less(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.less(a, b)


@register("Greater", dtypes=_BOOL_NUMERIC)
def greater(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.greater(a, b)


@register("LessOrEqual", since=12, dtypes=_BOOL_NUMERIC)
def less_or_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.less_equal(a, b)


@register("GreaterOrEqual", since=12, dtypes=_BOOL_NUMERIC)
def greater_or_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.greater_equal(a, b)


@register("Where", dtypes={"bool"})
def where(cond: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.where(cond, x, y)


@register("Mod", since=10, dtypes=NUMERIC_TYPES)
def mod(a: np.ndarray, b: np.ndarray, *, fmod: int = 0) -> np.ndarray:
    """``fmod=0``: the remainder takes the divisor's sign (floor division);
    ``fmod=1``: the dividend's sign (C ``fmod``, truncating division)."""
    if fmod not in (0, 1):
        raise KernelError(f"Mod: fmod must be 0 or 1, got {fmod}")
    b = b.astype(a.dtype, copy=False)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.fmod(a, b) if fmod else np.mod(a, b)
    return out.astype(a.dtype, copy=False)


@register("Sign", since=9, dtypes=NUMERIC_TYPES)
def sign(x: np.ndarray) -> np.ndarray:
    return np.sign(x)


@register("Ceil")
def ceil(x: np.ndarray) -> np.ndarray:
    return np.ceil(x)


@register("Floor")
def floor(x: np.ndarray) -> np.ndarray:
    return np.floor(x)


@register("Round", since=11)
def round_(x: np.ndarray) -> np.ndarray:
    # numpy rounds halves to even, as ONNX requires
    return np.round(x)


@register("IsNaN", since=9)
def isnan(x: np.ndarray) -> np.ndarray:
    return np.isnan(x)


@register("IsInf", since=10)
def isinf(x: np.ndarray, *, detect_negative: int = 1, detect_positive: int = 1) -> np.ndarray:
    if detect_negative and detect_positive:
        return np.isinf(x)
    if detect_negative:
        return np.isneginf(x)
    if detect_positive:
        return np.isposinf(x)
    return np.zeros(x.shape, dtype=bool)


# ---------------------------------------------------------------- backwards (transfer learning)
# Added apart from the forwards above so that forward speed-ups and these
# backwards can change independently; each names its forward.


@pow_.backward(uses="all")
def _(grads, inputs, outputs, *, needs_grad=None):
    (dy,), (x, p), (y,) = grads[:1], inputs[:2], outputs[:1]
    if dy is None:
        return (None, None)
    dx = dp = None
    if _wanted(needs_grad, 0, x):
        pf = p.astype(x.dtype, copy=False)
        with np.errstate(divide="ignore", invalid="ignore"):
            local = pf * np.power(x, pf - 1)
        dx = reduce_to_shape(dy * np.where(pf == 0, 0, local), x.shape)
    if _wanted(needs_grad, 1, p):
        with np.errstate(divide="ignore", invalid="ignore"):
            logx = np.where(x > 0, np.log(np.where(x > 0, x, 1)), 0)
        dp = reduce_to_shape(dy * y * logx, p.shape).astype(p.dtype, copy=False)
    return (dx, dp)


@exp.backward(uses="outputs")
def _(grads, inputs, outputs):
    dy, y = grads[0], outputs[0]
    return (None if dy is None else dy * y,)


@log.backward(uses="inputs")
def _(grads, inputs, outputs):
    dy, x = grads[0], inputs[0]
    return (None if dy is None else dy / x,)


@sqrt.backward(uses="outputs")
def _(grads, inputs, outputs):
    dy, y = grads[0], outputs[0]
    if dy is None:
        return (None,)
    with np.errstate(divide="ignore"):
        return (dy / (y.dtype.type(2) * y),)


@reciprocal.backward(uses="outputs")
def _(grads, inputs, outputs):
    dy, y = grads[0], outputs[0]
    return (None if dy is None else -dy * y * y,)


@abs_.backward(uses="inputs")
def _(grads, inputs, outputs):
    dy, x = grads[0], inputs[0]
    return (None if dy is None else dy * np.sign(x),)


@sum_.backward(uses="inputs")
def _(grads, inputs, outputs, *, needs_grad=None):
    dy = grads[0]
    return tuple(reduce_to_shape(dy, x.shape) if dy is not None and _wanted(needs_grad, i, x) else None
                 for i, x in enumerate(inputs))


@mean.backward(uses="inputs")
def _(grads, inputs, outputs, *, needs_grad=None):
    dy = grads[0]
    if dy is None:
        return (None,) * len(inputs)
    g = dy / dy.dtype.type(len(inputs))
    return tuple(reduce_to_shape(g, x.shape) if _wanted(needs_grad, i, x) else None for i, x in enumerate(inputs))


def _select_backward(grads, inputs, outputs, needs_grad):
    # The gradient goes to the input that won; ties share it evenly (torch.maximum's rule for two inputs).
    dy, y = grads[0], outputs[0]
    if dy is None:
        return (None,) * len(inputs)
    hits = [np.broadcast_to(x == y, y.shape) for x in inputs]
    count = np.sum(hits, axis=0, dtype=dy.dtype)
    share = dy / np.maximum(count, 1)
    return tuple(reduce_to_shape(share * h, x.shape) if _wanted(needs_grad, i, x) else None
                 for i, (x, h) in enumerate(zip(inputs, hits)))


@max_.backward(uses="all")
def _(grads, inputs, outputs, *, needs_grad=None):
    return _select_backward(grads, inputs, outputs, needs_grad)


@min_.backward(uses="all")
def _(grads, inputs, outputs, *, needs_grad=None):
    return _select_backward(grads, inputs, outputs, needs_grad)


@where.backward(uses="inputs")
def _(grads, inputs, outputs, *, needs_grad=None):
    dy, (cond, x, y) = grads[0], inputs[:3]
    if dy is None:
        return (None, None, None)
    zero = dy.dtype.type(0)
    return (
        None,
        reduce_to_shape(np.where(cond, dy, zero), x.shape) if _wanted(needs_grad, 1, x) else None,
        reduce_to_shape(np.where(cond, zero, dy), y.shape) if _wanted(needs_grad, 2, y) else None,
    )
