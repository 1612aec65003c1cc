"""Exact integer GEMM and convolution on float BLAS, plus requantization.

numpy has no integer BLAS: ``np.matmul`` on int32 runs a plain loop about
50-100x slower than sgemm. The int8 kernels therefore hold their integer
operands in float32 and call sgemm, *only* where the result is provably the
exact integer result, and split the reduction (or fall back to float64 or
int64) where it would not be.

Why float32 BLAS is exact on small integers
-------------------------------------------
float32 has a 24-bit significand, so every integer ``n`` with
``|n| <= 2**24`` is exactly representable. Let ``a`` (M x K) and ``b``
(K x N) hold integers with ``|a_ik| <= A`` and ``|b_kj| <= B``.

1. Every product ``a_ik * b_kj`` is an integer of magnitude ``<= A*B``.
2. Every partial sum sgemm forms — in whatever order it blocks, vectorises
   or fuses (FMA) the reduction — is a sum of a subset of the K products of
   one output, so an integer of magnitude ``<= K*A*B``.
3. IEEE-754 addition, multiplication and FMA round only when the exact
   result is not representable.

Hence if ``K*A*B <= 2**24`` every intermediate value is an exactly
representable integer, no operation rounds, and the float32 result equals
the exact integer result. For a longer reduction we split K into blocks of
``kb = 2**24 // (A*B)`` (each block exact by the argument above) and sum the
block results in float64, which is exact while ``K*A*B <= 2**53`` (the same
argument with a 53-bit significand). Past that we use int64. This holds for
CPU sgemm (OpenBLAS, MKL, Accelerate, BLIS); it would *not* hold for a BLAS
that computes in reduced precision (TF32, bf16) or uses Strassen-type
algorithms, which no CPU numpy build does.

For uint8 activations (``A <= 255``) and int8 weights (``B <= 128``):
``kb = 2**24 // 32640 = 514``, so layers with K <= 514 run as one sgemm.

Integer results are returned as int32 with wrap-around (two's complement)
semantics, i.e. exactly what an int32 accumulator produces: the exact sum is
computed (float64 / int64) and reduced modulo 2**32.
"""

from __future__ import annotations

import numpy as np

from . import spatial
from .conv import check_conv_shapes, conv_geometry, im2col
from .quantize_linear import saturate_round

F32_EXACT = 1 << 24
F64_EXACT = 1 << 53
#: Below this block length a K-split costs more in numpy calls than float64 BLAS.
MIN_F32_BLOCK = 32


def int_bound(dtype: np.dtype | type, zero_point=None) -> int:
    """The largest ``|x - zero_point|`` over every value ``x`` of an integer dtype."""
    info = np.iinfo(dtype)
    zp = np.asarray(0 if zero_point is None else zero_point, dtype=np.int64)
    return int(max(np.max(np.abs(info.max - zp)), np.max(np.abs(info.min - zp))))


def f32_block(a_bound: int, b_bound: int, offset: int = 0) -> int:
    """The longest reduction whose float32 sums stay exact.

    ``offset`` bounds a constant added to every result (a bias or a
    zero-point correction) that must stay exact as well:
    ``kb * a_bound * b_bound + offset <= 2**24``.
    """
    prod = int(a_bound) * int(b_bound)
    if prod == 0:
        return F32_EXACT if offset <= F32_EXACT else 0
    return max(0, (F32_EXACT - int(offset)) // prod)


def shifted_f32(x: np.ndarray, zero_point=None) -> np.ndarray:
    """``x - zero_point`` as float32 (exact: |values| < 2**17 for 16-bit types)."""
    if zero_point is None or not np.any(zero_point):
        return x.astype(np.float32)
    return np.subtract(x, zero_point, dtype=np.float32)


def _wrap_int32(total: np.ndarray) -> np.ndarray:
    if total.dtype == np.float64:
        total = total.astype(np.int64)
    return total.astype(np.int32)


def exact_matmul(a: np.ndarray, b: np.ndarray, a_bound: int, b_bound: int) -> np.ndarray:
    """``a @ b`` as exact int32 (wrapping), for float32 arrays holding integers.

    ``a_bound`` / ``b_bound`` bound the magnitudes of the entries of ``a`` and
    ``b``; the method (one sgemm, K-blocked sgemm, float64, int64) is chosen
    from them so that the result is exact (see the module docstring).
    """
    k = a.shape[-1]
    kb = f32_block(a_bound, b_bound)
    if kb >= k:
        return np.matmul(a, b).astype(np.int32)
    total_bound = k * int(a_bound) * int(b_bound)
    if kb >= MIN_F32_BLOCK and total_bound <= F64_EXACT:
        total = None
        for k0 in range(0, k, kb):
            blk = np.matmul(a[..., k0:k0 + kb], b[..., k0:k0 + kb, :])
            if total is None:
                total = blk.astype(np.float64)
            else:
                total += blk
        return _wrap_int32(total)
    if total_bound <= F64_EXACT:
        return _wrap_int32(np.matmul(a.astype(np.float64), b.astype(np.float64)))
    return _wrap_int32(np.matmul(a.astype(np.int64), b.astype(np.int64)))


def int_matmul(a: np.ndarray, b: np.ndarray, a_zero_point=None, b_zero_point=None) -> np.ndarray:
    """``(a - a_zp) @ (b - b_zp)`` with int32 accumulation, for integer inputs.

    ``a_zero_point`` is a scalar or per row of ``a`` (M,); ``b_zero_point`` a
    scalar or per column of ``b`` (N,), as MatMulInteger / QLinearMatMul allow.
    """
    a_zp = _row_param(a_zero_point, a)
    b_zp = None if b_zero_point is None else np.asarray(b_zero_point)
    return exact_matmul(
        shifted_f32(a, a_zp), shifted_f32(b, b_zp),
        int_bound(a.dtype, a_zp), int_bound(b.dtype, b_zp),
    )


def _row_param(p, a: np.ndarray):
    """A per-row parameter (M,) of a (..., M, K) operand, shaped to broadcast."""
    if p is None:
        return None
    p = np.asarray(p)
    if p.ndim == 1 and p.size > 1:
        if a.ndim < 2 or p.size != a.shape[-2]:
            raise ValueError(f"a per-row zero point / scale of {p.size} entries needs {p.size} rows; input is {a.shape}")
        return p.reshape(-1, 1)
    return p.reshape(()) if p.size == 1 else p


def conv_columns(x: np.ndarray, g: spatial.WindowGeometry, group: int, pad_value: int = 0) -> np.ndarray:
    """Integer im2col: (N, C, *S) -> (N, group, C/group * prod(kernel), prod(out)).

    Padding uses ``pad_value`` — the zero point, i.e. the quantized real 0.
    A 1x1, unit-stride, unpadded convolution needs no im2col at all.
    """
    if all(k == 1 for k in g.kernel) and all(s == 1 for s in g.strides) and not g.padded:
        return x.reshape(x.shape[0], group, x.shape[1] // group, -1)
    return im2col(x, g, group, pad_value)


def int_conv(
    x: np.ndarray,
    w: np.ndarray,
    x_zero_point=None,
    w_zero_point=None,
    *,
    auto_pad: str = "NOTSET",
    dilations=None,
    group: int = 1,
    kernel_shape=None,
    pads=None,
    strides=None,
) -> np.ndarray:
    """Exact ``conv(x - x_zp, w - w_zp)`` as int32 (N, M, *out).

    ``x_zero_point`` is per tensor; ``w_zero_point`` per tensor or per output
    channel (M,).
    """
    check_conv_shapes(x, w, group)
    g = conv_geometry(x.shape, w.shape, auto_pad=auto_pad, dilations=dilations,
                      kernel_shape=kernel_shape, pads=pads, strides=strides)
    xzp = 0
    if x_zero_point is not None:
        if np.size(x_zero_point) != 1:
            raise ValueError("the input zero point of an integer convolution must be a scalar (per tensor)")
        xzp = int(np.asarray(x_zero_point).reshape(-1)[0])
    m = w.shape[0]
    wzp = None
    if w_zero_point is not None:
        wzp = np.asarray(w_zero_point)
        if wzp.size > 1:
            if wzp.size != m:
                raise ValueError(f"a per-channel weight zero point needs {m} entries, got {wzp.size}")
            wzp = wzp.reshape((m,) + (1,) * (w.ndim - 1))
    wf = shifted_f32(w, wzp).reshape(group, m // group, -1)
    cols = conv_columns(x, g, group, pad_value=xzp)
    cf = shifted_f32(cols, xzp)
    acc = exact_matmul(wf, cf, int_bound(w.dtype, wzp), int_bound(x.dtype, xzp))
    return acc.reshape((x.shape[0], m) + g.out_shape)


def requantize(acc: np.ndarray, multiplier: np.ndarray, zero_point, dtype: np.dtype) -> np.ndarray:
    """``saturate(rint(float32(acc) * multiplier) + zero_point)``.

    This is onnxruntime's (MLAS) requantization: the int32 accumulator is
    converted to float32 and multiplied by the float32 multiplier
    ``x_scale * w_scale / y_scale``, then rounded half-to-even.
    """
    y = acc.astype(np.float32)
    y *= multiplier
    return saturate_round(y, zero_point, np.dtype(dtype))
