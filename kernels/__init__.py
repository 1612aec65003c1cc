"""edgeflow.kernels: the numpy kernel library.

One op = a pure forward function of arrays (+ its backward where trainable,
+ int8 variants), registered by op name, opset version and dtype. It imports
nothing but numpy, so it can be used (and vendored) on its own::

    from edgeflow.kernels import get_kernel
    relu = get_kernel("Relu", opset=17)
    y = relu(x)
"""

from __future__ import annotations

from .registry import (
    ANY_TYPE,
    FLOAT_TYPES,
    INT_TYPES,
    NUMERIC_TYPES,
    Kernel,
    KernelError,
    UnknownOpError,
    get_kernel,
    has_kernel,
    kernels_for,
    register,
    supported_ops,
)

# Importing the op modules registers their kernels.
from . import (  # noqa: E402,F401  (import for side effect)
    activations,
    conv,
    dropout,
    elementwise,
    linalg,
    normalization,
    pool,
    reduce,
    shape_ops,
    softmax,
)

__all__ = [
    "ANY_TYPE",
    "FLOAT_TYPES",
    "INT_TYPES",
    "NUMERIC_TYPES",
    "Kernel",
    "KernelError",
    "UnknownOpError",
    "get_kernel",
    "has_kernel",
    "kernels_for",
    "register",
    "supported_ops",
]
