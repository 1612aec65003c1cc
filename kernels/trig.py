"""Trigonometric and hyperbolic functions: Sin, Cos, Tan, Asin, Acos, Atan,
Sinh, Cosh, Asinh, Acosh, Atanh (float tensors, opset 7 on; the later
versions only widened the type lists).

Out-of-domain inputs (``Asin(2)``, ``Acosh(0.5)``, ``Atanh(1)``) give NaN or
infinity as in C's libm, silently, like onnxruntime.

Each has its derivative beside it (``uses="inputs"``, or ``"outputs"`` where
the derivative is a function of the result).
"""

from __future__ import annotations

import numpy as np

from .registry import register


def _unary(op: str, fn, grad=None, uses: str = "inputs"):
    @register(op, since=7)
    def forward(x: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return fn(x)

    forward.forward.__name__ = op.lower()
    if grad is not None:

        @forward.backward(uses=uses)
        def _(grads, inputs, outputs):
            dy = grads[0]
            if dy is None:
                return (None,)
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                return ((dy * grad(inputs[0], outputs[0])).astype(dy.dtype, copy=False),)

    return forward


sin = _unary("Sin", np.sin, lambda x, y: np.cos(x))
cos = _unary("Cos", np.cos, lambda x, y: -np.sin(x))
tan = _unary("Tan", np.tan, lambda x, y: 1 + y * y, uses="outputs")
asin = _unary("Asin", np.arcsin, lambda x, y: 1 / np.sqrt(1 - x * x))
acos = _unary("Acos", np.arccos, lambda x, y: -1 / np.sqrt(1 - x * x))
atan = _unary("Atan", np.arctan, lambda x, y: 1 / (1 + x * x))
sinh = _unary("Sinh", np.sinh, lambda x, y: np.cosh(x))
cosh = _unary("Cosh", np.cosh, lambda x, y: np.sinh(x))
asinh = _unary("Asinh", np.arcsinh, lambda x, y: 1 / np.sqrt(x * x + 1))
acosh = _unary("Acosh", np.arccosh, lambda x, y: 1 / np.sqrt(x * x - 1))
atanh = _unary("Atanh", np.arctanh, lambda x, y: 1 / (1 - x * x))
