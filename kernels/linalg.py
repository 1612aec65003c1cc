"""MatMul and Gemm (the two BLAS-backed ops that dominate MLP cost), Einsum, Det.

Their backwards are two more GEMMs each; they skip the gradients the caller
does not need (``needs_grad``) because the first layer's input gradient alone
is a quarter of an MLP training step.
"""

from __future__ import annotations

import numpy as np

from .elementwise import reduce_to_shape
from .registry import NUMERIC_TYPES, KernelError, register


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


def _einsum_operands(equation: str, n_inputs: int) -> str:
    eq = equation.replace(" ", "")
    if not eq:
        raise KernelError("Einsum: the equation is empty")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != n_inputs:
        raise KernelError(f"Einsum: equation {equation!r} has {len(terms)} operand terms for {n_inputs} inputs")
    for part in terms + ([rhs] if arrow else []):
        letters = part.replace("...", "")
        if "." in letters or not all(c.isascii() and c.isalpha() for c in letters):
            raise KernelError(f"Einsum: term {part!r} of {equation!r} may hold only letters and one '...'")
    if arrow and "->" in rhs:
        raise KernelError(f"Einsum: equation {equation!r} has more than one '->'")
    return eq


def _implicit_output(terms: list[str]) -> str:
    letters = "".join(terms).replace("...", "")
    once = sorted(c for c in set(letters) if letters.count(c) == 1)  # ASCII order: A-Z before a-z
    return ("..." if any("..." in t for t in terms) else "") + "".join(once)


def _expand_ellipsis(terms: list[str], out_term: str, inputs) -> tuple[list[str] | None, str]:
    """'...' spelled out as fresh letters, right-aligned per operand (None if it cannot be)."""
    used = set("".join(terms) + out_term)
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in used]
    widths = []
    for t, x in zip(terms, inputs):
        named = len(t.replace("...", ""))
        widths.append(x.ndim - named if "..." in t else 0)
    width = max(widths, default=0)
    if width > len(free) or min(widths) < 0:
        return None, out_term
    letters = "".join(free[:width])
    terms = [t.replace("...", letters[width - w:]) for t, w in zip(terms, widths)]
    return terms, out_term.replace("...", letters)


def _einsum_as_matmul(ta: str, tb: str, to: str, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """A two-operand einsum as one batched matmul (BLAS), or None if it is not one.

    Letters split into batch (a, b, out), contracted (a, b), kept from a or
    from b; letters only in one operand and not in the output are summed
    first. Repeated letters in a term (diagonals) and ellipses go to
    np.einsum.
    """
    if "..." in ta + tb + to or len(set(ta)) != len(ta) or len(set(tb)) != len(tb) or len(set(to)) != len(to):
        return None
    if a.ndim != len(ta) or b.ndim != len(tb):
        return None
    size = {}
    for t, x in ((ta, a), (tb, b)):
        for c, n in zip(t, x.shape):
            if size.setdefault(c, n) != n:
                return None  # mismatched (or broadcast) sizes: let np.einsum decide
    if any(c not in size for c in to):
        return None
    sum_a = [c for c in ta if c not in tb and c not in to]
    sum_b = [c for c in tb if c not in ta and c not in to]
    if sum_a:
        a = a.sum(axis=tuple(ta.index(c) for c in sum_a))
        ta = "".join(c for c in ta if c not in sum_a)
    if sum_b:
        b = b.sum(axis=tuple(tb.index(c) for c in sum_b))
        tb = "".join(c for c in tb if c not in sum_b)
    batch = [c for c in to if c in ta and c in tb]
    contract = [c for c in ta if c in tb and c not in to]
    keep_a = [c for c in to if c in ta and c not in tb]
    keep_b = [c for c in to if c in tb and c not in ta]

    def n(cs):
        return int(np.prod([size[c] for c in cs], dtype=np.int64))

    a3 = np.transpose(a, [ta.index(c) for c in batch + keep_a + contract]).reshape(n(batch), n(keep_a), n(contract))
    b3 = np.transpose(b, [tb.index(c) for c in batch + contract + keep_b]).reshape(n(batch), n(contract), n(keep_b))
    y = np.matmul(a3, b3).reshape([size[c] for c in batch + keep_a + keep_b])
    order = batch + keep_a + keep_b
    return np.transpose(y, [order.index(c) for c in to])


@register("Einsum", since=12, dtypes=NUMERIC_TYPES)
def einsum(*inputs: np.ndarray, equation: str) -> np.ndarray:
    eq = _einsum_operands(equation, len(inputs))
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(inputs) == 2:
        out_term = rhs if arrow else _implicit_output(terms)
        if "..." in eq:
            terms, out_term = _expand_ellipsis(terms, out_term, inputs)
        out = None if terms is None else _einsum_as_matmul(terms[0], terms[1], out_term, *inputs)
        if out is not None:
            return np.asarray(out, dtype=inputs[0].dtype)
    try:
        out = np.einsum(eq, *inputs, optimize=len(inputs) > 2)
    except ValueError as exc:
        shapes = [x.shape for x in inputs]
        raise KernelError(f"Einsum: equation {equation!r} does not fit the input shapes {shapes}: {exc}") from None
    return np.asarray(out, dtype=inputs[0].dtype)


@register("Det", since=11)
def det(x: np.ndarray) -> np.ndarray:
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise KernelError(f"Det: input must be (..., M, M), got shape {x.shape}")
    work = x.astype(np.float32) if x.dtype == np.float16 else x
    return np.linalg.det(work).astype(x.dtype, copy=False)
