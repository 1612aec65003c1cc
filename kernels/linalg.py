"""MatMul and Gemm: the two BLAS-backed ops that dominate MLP cost."""

from __future__ import annotations

import numpy as np

from .registry import NUMERIC_TYPES, register


@register("MatMul", dtypes=NUMERIC_TYPES)
def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.matmul(a, b)


@register("Gemm", dtypes=NUMERIC_TYPES)
def gemm(
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,
    transB: int = 0,
) -> np.ndarray:
    if transA:
        a = a.T
    if transB:
        b = b.T
    y = a @ b
    if alpha != 1.0:
        y *= y.dtype.type(alpha)
    if c is not None and beta != 0.0:
        if beta != 1.0:
            c = c * c.dtype.type(beta)
        y += c  # c broadcasts to (M, N); y is a fresh array
    return y
