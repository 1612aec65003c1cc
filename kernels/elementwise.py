"""Element-wise arithmetic with numpy (multidirectional) broadcasting.

Add, Sub, Mul, Div, Pow, Neg, Abs, Exp, Log, Sqrt, Reciprocal, Sum, Max,
Min, Mean, Equal, Less, Greater, Where.
"""

from __future__ import annotations

import numpy as np

from .registry import FLOAT_TYPES, NUMERIC_TYPES, register

_BOOL_NUMERIC = NUMERIC_TYPES | {"bool"}


@register("Add", dtypes=NUMERIC_TYPES)
def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.add(a, b, dtype=a.dtype)


@register("Sub", dtypes=NUMERIC_TYPES)
def sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.subtract(a, b, dtype=a.dtype)


@register("Mul", dtypes=NUMERIC_TYPES)
def mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.multiply(a, b, dtype=a.dtype)


@register("Div", dtypes=NUMERIC_TYPES)
def div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        # ONNX integer division truncates toward zero (C semantics).
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.trunc(np.divide(a.astype(np.float64), b.astype(np.float64)))
        return q.astype(a.dtype)
    return np.divide(a, b, dtype=a.dtype)


@register("Pow", dtypes=NUMERIC_TYPES)
def pow_(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):
        return np.power(x.astype(np.float64), y.astype(np.float64)).astype(x.dtype)
    return np.power(x, y.astype(x.dtype, copy=False))


@register("Neg", dtypes=NUMERIC_TYPES)
def neg(x: np.ndarray) -> np.ndarray:
    return np.negative(x)


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


@register("Less", dtypes=NUMERIC_TYPES)
def less(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.less(a, b)


@register("Greater", dtypes=NUMERIC_TYPES)
def greater(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.greater(a, b)


@register("Where", dtypes={"bool"})
def where(cond: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.where(cond, x, y)
