"""Fused QDQ kernels: ``DQ -> Conv/Gemm/MatMul [-> Relu] [-> Q]`` as one
integer kernel (domain ``edgeflow.fused``; created by the graph rewrite in
``edgeflow.quantization.fuse``, never found in a model file).

A QDQ model written for onnxruntime dequantizes int8 activations and
weights to float, runs the float op, and quantizes again. Executed literally
in numpy that costs a float GEMM *plus* three extra passes per layer. The
fused kernel runs what the QDQ pattern means — onnxruntime's QLinearConv /
QGemm arithmetic:

    acc = sum_k x_q[k] * (w_q[k] - w_zp) + (b_q - x_zp * sum_k (w_q[k] - w_zp))
    y_q = saturate(rint(float32(acc) * (x_scale * w_scale / y_scale)) + y_zp)

The integer accumulation is exact. Inputs stay raw (no zero-point
subtraction pass): the zero-point correction is folded with the bias into
one per-channel constant ``c``, and ``c`` rides in the GEMM as an extra
reduction row of ones (so the GEMM adds it — no separate bias pass). The
reduction runs as one float32 sgemm when the rewrite proved it exact for
this layer: every partial sum of output channel ``m`` is bounded by
``x_bound * ||w_m||_1 + |c_m|``, and that bound must be <= 2**24 (see
:mod:`.int_gemm`; the L1 norm of real weights is far below K * 127, so one
sgemm covers much longer reductions than the worst case K <= 514).
Otherwise the rewrite precomputes K-block boundaries (:func:`k_blocks`)
inside which the same bound holds, and the blocks' exact float32 products
are summed in float64.

Outputs are either quantized (``y_zero_point`` given: the Q that followed)
or float (``out_scale``: the layer feeds a float op, e.g. the logits).
"""

from __future__ import annotations

import numpy as np

from . import spatial
from .conv import conv_geometry
from .int_gemm import F32_EXACT
from .quantize_linear import QUANT_RANGES
from .registry import register

FUSED_DOMAIN = "edgeflow.fused"
_INT8 = frozenset({"int8", "uint8"})


def _epilogue(
    acc: np.ndarray,
    multiplier: np.ndarray | None,
    y_zero_point: int,
    y_dtype: str,
    out_scale: np.ndarray | None,
    relu: int,
) -> np.ndarray:
    """Requantize (or dequantize) a float32 accumulator in place, in 4 passes.

    Clamping to ``[lo - zp, hi - zp]`` before rounding equals saturating
    after it (the bounds are integers and rint is monotonic) and lets the
    final add of the zero point write the output type directly.
    """
    if multiplier is None:
        acc *= out_scale
        if relu:
            np.maximum(acc, 0, out=acc)
        return acc
    dtype = np.dtype(y_dtype)
    lo, hi = QUANT_RANGES[dtype]
    if relu:
        lo = y_zero_point  # Q(relu(v)) = max(Q(v), Q(0)) and Q(0) = zp
    acc *= multiplier
    np.clip(acc, lo - y_zero_point, hi - y_zero_point, out=acc)
    np.rint(acc, out=acc)
    out = np.empty(acc.shape, dtype)
    np.add(acc, y_zero_point, out=out, casting="unsafe")  # exact: in-range integers
    return out


def k_blocks(term_bounds: np.ndarray, limit: int = F32_EXACT) -> tuple[int, ...]:
    """Split a reduction into float32-exact blocks; ``()`` when one block suffices.

    ``term_bounds`` (M, K) bounds ``|x_k * w_mk|`` for each output channel
    and reduction term. Greedy: a block grows while every channel's sum of
    term bounds stays <= ``limit``. Returns the boundaries ``(0, k1, ..., K)``.
    Computed once, at load.
    """
    m, k = term_bounds.shape
    if k == 0 or m == 0:
        return ()
    cum = np.cumsum(term_bounds.astype(np.float64), axis=1)
    bounds = [0]
    base = np.zeros(m)
    while bounds[-1] < k:
        start = bounds[-1]
        over = (cum[:, start:] - base[:, None]).max(axis=0) > limit
        stop = start + (int(np.argmax(over)) if over.any() else k - start)
        if stop == start:
            raise ValueError("one reduction term alone exceeds the float32-exact bound")
        bounds.append(stop)
        base = cum[:, stop - 1]
    return () if len(bounds) == 2 else tuple(bounds)


def _blocked(prod, blocks: tuple[int, ...], c64: np.ndarray | None, wrap: int) -> np.ndarray:
    """Sum float32-exact block products in float64 (exact below 2**53).

    ``prod(k0, k1)`` multiplies one block. The exact total is rounded to
    float32 the way onnxruntime converts its int32 accumulator — through
    int32 (wrapping) only when the total can leave the int32 range.
    """
    total = None
    for k0, k1 in zip(blocks[:-1], blocks[1:]):
        part = prod(k0, k1)
        if total is None:
            total = part.astype(np.float64)
        else:
            total += part
    if c64 is not None:
        total += c64
    if wrap:
        return total.astype(np.int64).astype(np.int32).astype(np.float32)
    return total.astype(np.float32)


@register("QGemm", domain=FUSED_DOMAIN, dtypes=_INT8)
def qgemm(
    x: np.ndarray,
    w: np.ndarray,
    *,
    multiplier: np.ndarray | None = None,
    y_zero_point: int = 0,
    y_dtype: str = "uint8",
    out_scale: np.ndarray | None = None,
    relu: int = 0,
    blocks: tuple[int, ...] = (),
    c64: np.ndarray | None = None,
    wrap: int = 0,
) -> np.ndarray:
    """Fused quantized Gemm / MatMul: x (..., K) integer, w packed float32.

    ``w`` is (K + 1, N) with the per-channel constant as its last row (or
    (K, N) with the constant in ``c64`` when it is too large for float32).
    ``blocks`` empty means one sgemm is exact; otherwise the reduction is
    split at those boundaries.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rows = w.shape[0]
    a = np.empty((int(np.prod(lead, dtype=np.int64)), rows), np.float32)
    a[:, :k] = x.reshape(-1, k)
    if rows > k:
        a[:, k] = 1.0
    if not blocks:
        acc = a @ w
    else:
        acc = _blocked(lambda k0, k1: a[:, k0:k1] @ w[k0:k1], blocks, c64, wrap)
    y = _epilogue(acc, multiplier, y_zero_point, y_dtype, out_scale, relu)
    return y.reshape(lead + (w.shape[1],))


def _columns(x: np.ndarray, g: spatial.WindowGeometry, group: int, pad_value: int, ones_row: bool) -> np.ndarray:
    """im2col into float32: (N, group, C/group * k (+1), P).

    The (small) input is converted to float32 first and the windows gathered
    float to float into the GEMM's buffer — measured faster than gathering
    the integers and converting the (k times larger) columns. With
    ``ones_row`` the last reduction row is 1 so that the GEMM adds the
    packed per-channel constant.
    """
    n, ch = x.shape[:2]
    cg = ch // group
    k = int(np.prod(g.kernel))
    p = int(np.prod(g.out_shape))
    ck = cg * k
    buf = np.empty((n, group, ck + int(ones_row), p), np.float32)
    if ones_row:
        buf[:, :, ck, :] = 1.0
    dst = buf[:, :, :ck, :].view()
    if all(kk == 1 for kk in g.kernel) and all(s == 1 for s in g.strides) and not g.padded:
        dst[...] = x.reshape(n, group, cg, p)
        return buf
    dst.shape = (n, group, cg) + g.kernel + g.out_shape  # a view: raises rather than copies
    xf = spatial.pad_spatial(x.astype(np.float32), g, float(pad_value))
    win = spatial.windows(xf, g)  # (N, C, *k, *out)
    np.copyto(dst, win.reshape((n, group, cg) + win.shape[2:]))
    return buf


@register("QConv", domain=FUSED_DOMAIN, dtypes=_INT8)
def qconv(
    x: np.ndarray,
    w: np.ndarray,
    *,
    x_zero_point: int = 0,
    multiplier: np.ndarray | None = None,
    y_zero_point: int = 0,
    y_dtype: str = "uint8",
    out_scale: np.ndarray | None = None,
    relu: int = 0,
    blocks: tuple[int, ...] = (),
    c64: np.ndarray | None = None,
    wrap: int = 0,
    auto_pad: str = "NOTSET",
    dilations: tuple[int, ...] | None = None,
    group: int = 1,
    kernel_shape: tuple[int, ...] = (),
    pads: tuple[int, ...] | None = None,
    strides: tuple[int, ...] | None = None,
) -> np.ndarray:
    """Fused quantized Conv: x (N, C, *S) integer, w packed (group, M/group, Ck (+1))."""
    m = w.shape[0] * w.shape[1]
    g = conv_geometry(x.shape, (m, 0) + tuple(kernel_shape), auto_pad=auto_pad, dilations=dilations,
                      kernel_shape=tuple(kernel_shape), pads=pads, strides=strides)
    ck = (x.shape[1] // group) * int(np.prod(g.kernel))
    cols = _columns(x, g, group, x_zero_point, ones_row=w.shape[2] > ck)
    if not blocks:
        acc = np.matmul(w, cols)  # (N, group, M/group, P)
    else:
        c = None if c64 is None else c64.reshape(group, -1, 1)
        acc = _blocked(lambda k0, k1: np.matmul(w[:, :, k0:k1], cols[:, :, k0:k1, :]), blocks, c, wrap)
    n = x.shape[0]
    acc = acc.reshape(n, m, -1)
    mult = None if multiplier is None else multiplier.reshape(m, 1)
    scale = None if out_scale is None else out_scale.reshape(m, 1)
    y = _epilogue(acc, mult, y_zero_point, y_dtype, scale, relu)
    return y.reshape((n, m) + g.out_shape)


@qconv.workspace
def _qconv_workspace(shapes: list, attrs: dict) -> int:
    """The float32 column buffer: N * group * (C/group * k + 1) * P values."""
    x = shapes[0]
    if x is None or not attrs.get("kernel_shape"):
        return 0
    g = conv_geometry(tuple(x), (1, 1) + tuple(attrs["kernel_shape"]), auto_pad=attrs.get("auto_pad", "NOTSET"),
                      dilations=attrs.get("dilations"), kernel_shape=tuple(attrs["kernel_shape"]),
                      pads=attrs.get("pads"), strides=attrs.get("strides"))
    return 4 * int(x[0]) * (int(x[1]) * int(np.prod(g.kernel)) + attrs.get("group", 1)) * int(np.prod(g.out_shape))
