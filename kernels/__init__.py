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


def _import_op_modules() -> None:
    """Import every module of this package: importing registers its kernels.

    Discovery (rather than a list) lets a new op file register itself
    without touching this one.
    """
    import importlib
    import pkgutil

    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name not in ("registry", "spatial") and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_import_op_modules()

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
