"""MatMul and Gemm: the two BLAS-backed ops that dominate MLP cost.

Their backwards are two more GEMMs each; they skip the gradients the caller
does not need (``needs_grad``) because the first layer's input gradient alone
is a quarter of an MLP training step.
"""

from __future__ import annotations

import numpy as np

from .elementwise import reduce_to_shape
from .registry import NUMERIC_TYPES, register


def _needs(needs_grad, i: int, x) -> bool:
    return x is not None and np.issubdtype(x.dtype, np.floating) and (needs_grad is None or needs_grad[i])


@register("MatMul", dtypes=NUMERIC_TYPES)
def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.matmul(a, b)


@matmul.backward(uses="inputs")
def _(grads, inputs, outputs, *, needs_grad=None):
    (dy,), (a, b) = grads[:1], inputs[:2]
    if dy is None:
        return (None, None)
    # Promote 1-D operands the way matmul does, so one rule covers all ranks.
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    y_shape = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1])
    dy2 = dy.reshape(y_shape)
    da = db = None
    if _needs(needs_grad, 0, a):
        da = reduce_to_shape(np.matmul(dy2, np.swapaxes(b2, -1, -2)), a2.shape).reshape(a.shape)
    if _needs(needs_grad, 1, b):
        if b2.ndim == 2 and a2.ndim > 2:
            # A batch of rows times one weight: one GEMM over the flattened batch.
            k = a2.shape[-1]
            db = a2.reshape(-1, k).T @ dy2.reshape(-1, dy2.shape[-1])
        else:
            db = reduce_to_shape(np.matmul(np.swapaxes(a2, -1, -2), dy2), b2.shape)
        db = db.reshape(b.shape)
    return (da, db)


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


@gemm.backward(uses="inputs")
def _(grads, inputs, outputs, *, alpha=1.0, beta=1.0, transA=0, transB=0, needs_grad=None):
    dy = grads[0]
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    if dy is None:
        return (None, None, None)[: len(inputs)]
    g = dy if alpha == 1.0 else dy * dy.dtype.type(alpha)
    a_eff = a.T if transA else a  # (M, K)
    b_eff = b.T if transB else b  # (K, N)
    da = db = dc = None
    if _needs(needs_grad, 0, a):
        # d(A_eff) = G @ B_eff^T; written directly in A's stored layout.
        da = b_eff @ g.T if transA else g @ b_eff.T
    if _needs(needs_grad, 1, b):
        db = g.T @ a_eff if transB else a_eff.T @ g
    if c is not None and beta != 0.0 and _needs(needs_grad, 2, c):
        gc = dy if beta == 1.0 else dy * dy.dtype.type(beta)
        dc = reduce_to_shape(gc, c.shape)
    return (da, db, dc)[: len(inputs)]
