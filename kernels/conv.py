"""Conv (N-d, groups, strides, pads, dilations, auto_pad) by im2col + GEMM.

The input is padded once, viewed as sliding windows without copying
(:func:`spatial.windows`), and reshaped into a column matrix — the single
copy — so each group is one BLAS matmul whose result is already in NCHW
order. A 1x1 convolution with unit stride skips im2col entirely, and so do
stride-1 2-d convolutions with few output or many input channels on a large
image: over the flattened padded image every kernel offset's input is one
contiguous shifted slice (:func:`_conv2d_shifted`). Depthwise convolutions
are batched GEMVs over columns built ~1 MiB (a band of channels) at a time,
and a batch-1 im2col whose columns would be over 16 MiB is built a band of
output rows at a time: columns that stay in cache between the copy and the
GEMM that reads them.

Backward: the weight gradient is one batched GEMM of the output gradient
with the same columns (the training forward saves them rather than copying
the input a second time); the input gradient is the transposed GEMM followed
by col2im, which adds each kernel offset's slab back into the padded input
with strided slices — prod(kernel) vectorised adds, no ``np.add.at``.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import spatial
from .registry import FLOAT_TYPES, register


def im2col(x: np.ndarray, g: spatial.WindowGeometry, group: int, pad_value: float = 0) -> np.ndarray:
    """(N, C, *S) -> (N, group, C/group * prod(kernel), prod(out)) columns."""
    n_batch, channels = x.shape[:2]
    xp = spatial.pad_spatial(x, g, pad_value)
    win = spatial.windows(xp, g)  # (N, C, *k, *out)
    return win.reshape(n_batch, group, (channels // group) * math.prod(g.kernel), math.prod(g.out_shape))


def conv_geometry(
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    *,
    auto_pad: str = "NOTSET",
    dilations: list[int] | None = None,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> spatial.WindowGeometry:
    return spatial.resolve(
        tuple(x_shape[2:]),
        kernel_shape or w_shape[2:],
        strides=strides,
        dilations=dilations,
        pads=pads,
        auto_pad=auto_pad,
    )


def check_conv_shapes(x: np.ndarray, w: np.ndarray, group: int) -> None:
    if x.ndim < 3 or w.ndim != x.ndim:
        raise ValueError(
            f"Conv expects input (N, C, *spatial) and weight (M, C/group, *kernel) of the "
            f"same rank; got input {x.shape} and weight {w.shape}"
        )
    if x.shape[1] != w.shape[1] * group or w.shape[0] % group:
        raise ValueError(
            f"Conv channel mismatch: input has {x.shape[1]} channels, weight {w.shape} "
            f"with group={group} expects {w.shape[1] * group}"
        )


def _direct(g: spatial.WindowGeometry) -> bool:
    """1x1 kernel, unit stride, no padding: the input already is the column matrix."""
    return all(k == 1 for k in g.kernel) and all(s == 1 for s in g.strides) and not g.padded


def _conv_columns(x, w, b, group, attrs) -> tuple[np.ndarray, np.ndarray]:
    check_conv_shapes(x, w, group)
    g = conv_geometry(x.shape, w.shape, **attrs)
    n_batch = x.shape[0]
    m = w.shape[0]
    w_g = w.reshape(group, m // group, -1)  # (g, M/g, C/g * k)
    if _direct(g):
        cols = x.reshape(n_batch, group, x.shape[1] // group, -1)
    else:
        cols = im2col(x, g, group)
    if group == 1 and n_batch == 1:
        y = w.reshape(m, -1) @ cols[0, 0]  # the plain forward's 2-d GEMM, bit for bit
    else:
        y = np.matmul(w_g, cols)  # (N, g, M/g, P)
    y = y.reshape((n_batch, m) + g.out_shape)
    if b is not None:
        y += b.reshape((1, m) + (1,) * len(g.out_shape))
    return y, cols


@functools.lru_cache(maxsize=1024)
def _plan(x_shape, w_shape, group, auto_pad, dilations, kernel_shape, pads, strides):
    """(geometry, mode) of one Conv call, mode "shifted", "direct" or "im2col".

    Memoised on the shapes and attributes: a model calls each Conv with the
    same ones every run, and deciding costs more Python than a small GEMM."""
    if len(x_shape) < 3 or len(w_shape) != len(x_shape) or x_shape[1] != w_shape[1] * group or w_shape[0] % group:
        return None, "check"
    g = conv_geometry(x_shape, w_shape, auto_pad=auto_pad, dilations=dilations, kernel_shape=kernel_shape,
                      pads=pads, strides=strides)
    if len(x_shape) == 4 and x_shape[0] * x_shape[1] and not all(k == 1 for k in g.kernel):
        if _toeplitz_applies(x_shape, w_shape, group, g):
            return g, "depthwise_toeplitz"
        if _short_applies(x_shape, w_shape, group, g):
            return g, "depthwise_short"
        if _depthwise_stride1(x_shape, w_shape, group, g):
            return g, "depthwise_columns"
        if _shifted_applies(x_shape, w_shape, group, g):
            return g, "shifted"
    return g, "direct" if _direct(g) else "im2col"


def _depthwise_stride1(x_shape, w_shape, group: int, g: spatial.WindowGeometry) -> bool:
    """A stride-1 2-d depthwise conv: batched GEMVs over banded columns at every image size
    (measured 1.4-2.4x faster than the shifted multiply-adds on 61x61 to 244x244 images)."""
    return (len(x_shape) == 4 and group == x_shape[1] == w_shape[0] and w_shape[1] == 1
            and all(s == 1 for s in g.strides) and min(g.out_shape) > 0)


def _depthwise_columns(x: np.ndarray, w: np.ndarray, g: spatial.WindowGeometry) -> np.ndarray:
    """Stride-1 depthwise convolution on a small image: one batched GEMV.

    The columns come from the flattened padded image (:func:`_flat_padded`)
    as a strided view (N, C, kh, kw, out_h * Wp) whose copy moves contiguous
    runs, measured 1.2-2x faster than gathering im2col's windows; the junk
    columns past out_w are dropped at the end. The columns are built for a
    band of channels at a time, ~1 MiB of them (:data:`_DW_BAND_BYTES`), so
    that the GEMV reads them back from cache."""
    n, c = x.shape[:2]
    kh, kw = g.kernel
    dh, dw = g.dilations
    oh, ow = g.out_shape
    flat, wp, length = _flat_padded(x, g)
    sn, sc, se = flat.strides
    wr = w.reshape(c, 1, kh * kw).astype(flat.dtype, copy=False)
    y = np.empty((n, c, 1, length), flat.dtype)
    band = _dw_band(kh * kw * length * flat.itemsize)
    for c0 in range(0, c, band):  # bands of channels: the columns of all of them at once
        c1 = min(c, c0 + band)    # (C x kernel x image) would not stay in cache (2-3x slower)
        view = np.ndarray((n, c1 - c0, kh, kw, length), flat.dtype, buffer=flat, offset=c0 * sc,
                          strides=(sn, sc, dh * wp * se, dw * se, se))
        np.matmul(wr[c0:c1], view.reshape(n, c1 - c0, kh * kw, length), out=y[:, c0:c1])
    return np.ascontiguousarray(y.reshape(n, c, oh, wp)[:, :, :, :ow])


def _toeplitz_applies(x_shape, w_shape, group: int, g: spatial.WindowGeometry) -> bool:
    """A 2-d depthwise conv on a narrow image: padded width at most 4x the kernel's."""
    kh, kw = g.kernel
    wp = x_shape[3] + g.pads_begin[1] + g.pads_end[1]
    return (group == x_shape[1] == w_shape[0] and w_shape[1] == 1 and g.dilations[0] == 1
            and min(g.out_shape) > 0 and kw > 1 and wp <= 4 * kw)


_TOEPLITZ: dict = {}  # (id(w), geometry, padded width) -> (copy of w, matrices): rebuilt if w's values change


def _toeplitz_weights(w: np.ndarray, g: spatial.WindowGeometry, wp: int, dtype) -> np.ndarray:
    """(C, kh * Wp, out_w) per channel: column x holds the kernel's row i at padded
    columns x * s_w + j * d_w of block i, zeros elsewhere (a banded Toeplitz matrix).
    Built once per weight and geometry; kept while the weight's values are the same
    (compared on every call: ~1 us for a model's depthwise kernels, against a rebuild
    that would cost a Python loop over the kernel)."""
    def build() -> np.ndarray:
        c = w.shape[0]
        kh, kw = g.kernel
        ow = g.out_shape[1]
        sw, dw = g.strides[1], g.dilations[1]
        t = np.zeros((c, kh, wp, ow), dtype)
        cols = np.arange(ow)
        wk = w.reshape(c, kh, kw).astype(dtype, copy=False)
        for i in range(kh):
            for j in range(kw):
                t[:, i, cols * sw + j * dw, cols] = wk[:, i, j][:, None]
        return t.reshape(c, kh * wp, ow)

    return _kept_for(w, (id(w), g, wp, np.dtype(dtype).str), build)


def _kept_for(w: np.ndarray, key: tuple, build) -> np.ndarray:
    """``build()``'s matrices for weight ``w`` under ``key``, kept in :data:`_TOEPLITZ` while ``w``'s values
    are the same (compared on every call; at most 256 entries, then the cache starts over)."""
    hit = _TOEPLITZ.get(key)
    if hit is not None and hit[0].shape == w.shape and np.array_equal(hit[0], w):
        return hit[1]
    out = build()
    if len(_TOEPLITZ) >= 256:
        _TOEPLITZ.clear()
    _TOEPLITZ[key] = (w.copy(), out)
    return out


def _depthwise_toeplitz(x: np.ndarray, w: np.ndarray, g: spatial.WindowGeometry) -> np.ndarray:
    """Depthwise conv on a narrow image as one batched GEMM per call.

    Output row r of channel c is the kh padded input rows from r * s_h on, laid end to
    end (kh * Wp values: one contiguous run of the flattened padded image), times that
    channel's banded Toeplitz matrix (:func:`_toeplitz_weights`). The rows are copied
    once (kh times the image instead of im2col's kh * kw) and each channel is a small
    GEMM instead of a GEMV over kh * kw times the image: 1.6-1.7x faster where the
    padded width is at most 4x the kernel's (PP-LCNet's 256x14x14 and 512x7x7 5x5:
    0.29 -> 0.18 ms); on wider images the zeros of the band cost more than that saves.
    The sums run in another order than the columns' GEMV (rounding: ~1e-7 relative)."""
    n, c = x.shape[:2]
    kh = g.kernel[0]
    oh, ow = g.out_shape
    flat, wp, _ = _flat_padded(x, g)
    dtype = np.result_type(x, w)
    t = _toeplitz_weights(w, g, wp, dtype)
    sn, sc, se = flat.strides
    rows = np.ndarray((n, c, oh, kh * wp), flat.dtype, buffer=flat,
                      strides=(sn, sc, g.strides[0] * wp * se, se))
    return np.matmul(np.ascontiguousarray(rows, dtype=dtype), t).reshape(n, c, oh, ow)


def _short_applies(x_shape, w_shape, group: int, g: spatial.WindowGeometry) -> bool:
    """A 2-d depthwise conv on a short image: at most 4x the kernel's height (unpadded).

    Measured against the columns' batched GEMVs (64 channels, 40 and 96 wide, one
    thread): 0.3-0.5x the time at 4 rows, 0.5-0.9x at 12, even at 16 rows of a 3x3
    and 32 of a 5x5 (the zeros of the band grow with the height over the kernel's)."""
    return (group == x_shape[1] == w_shape[0] and w_shape[1] == 1 and min(g.out_shape) > 0
            and x_shape[2] <= 4 * g.kernel[0])


def _short_weights(w: np.ndarray, g: spatial.WindowGeometry, h: int, dtype) -> np.ndarray:
    """(C, out_h, kw * H) per channel: row o holds, at column j * H + r, the weight
    w[i, j] of the kernel row i that reads input row r = o * s_h - pad_top + i * d_h,
    zeros where no kernel row does (the padding rows are never stored). Kept like
    :func:`_toeplitz_weights`: per weight and geometry, rebuilt when its values change."""
    def build() -> np.ndarray:
        c = w.shape[0]
        kh, kw = g.kernel
        oh = g.out_shape[0]
        sh, dh, pt = g.strides[0], g.dilations[0], g.pads_begin[0]
        a = np.zeros((c, oh, kw, h), dtype)
        wk = w.reshape(c, kh, kw).astype(dtype, copy=False)
        for o in range(oh):
            for i in range(kh):
                r = o * sh - pt + i * dh
                if 0 <= r < h:
                    a[:, o, :, r] = wk[:, i, :]
        return a.reshape(c, oh, kw * h)

    return _kept_for(w, ("short", id(w), g, h, np.dtype(dtype).str), build)


def _depthwise_short(x: np.ndarray, w: np.ndarray, g: spatial.WindowGeometry) -> np.ndarray:
    """Depthwise conv on a short image (PP-OCR's strips, 2-12 rows by 96) as one batched GEMM.

    Per channel, the output (out_h, out_w) is that channel's (out_h, kw * H) matrix
    (:func:`_short_weights`: the kernel laid out as a banded Toeplitz matrix over the
    image's rows) times the kw horizontal shifts of its H rows (kw * H, out_w), copied
    once from the width-padded image: kw times the image instead of the columns'
    kh * kw times the padded one, and no multiply-add by a padding row. Where H is at
    most the kernel's height there are no zeros in the band at all.
    200x2x96 5x5: 0.19 -> 0.06 ms, 88x3x96 5x5: 0.12 -> 0.04 ms (one thread).
    The sums run in another order than the columns' GEMV (rounding: ~1e-7 relative)."""
    n, c, h, wd = x.shape
    kw = g.kernel[1]
    ow = g.out_shape[1]
    sw, dw = g.strides[1], g.dilations[1]
    pl, pr = g.pads_begin[1], g.pads_end[1]
    dtype = np.result_type(x, w)
    a = _short_weights(w, g, h, dtype)
    wp = wd + pl + pr
    if pl or pr or not x.flags.c_contiguous:
        xp = np.zeros((n, c, h, wp), x.dtype)
        xp[..., pl:pl + wd] = x
    else:
        xp = x
    sn, sc, sr, se = xp.strides
    shifts = np.ndarray((n, c, kw, h, ow), xp.dtype, buffer=xp, strides=(sn, sc, dw * se, sr, sw * se))
    cols = np.ascontiguousarray(shifts, dtype=dtype).reshape(n, c, kw * h, ow)
    return np.matmul(a, cols)


_DW_BAND_BYTES = 1 << 20
# depthwise columns built per band of channels: ~1 MiB stays in a core's L2 between the
# copy and the GEMV. (A fixed 64 channels was 1.6 MiB at 14x14 5x5 and 24 MiB at
# 122x122 5x5 stride 2; by bytes: 1.3-2x faster there, the same on small images.) Sized
# per sample: batch 1 is what it is tuned for; a batch multiplies the band's bytes.


def _dw_band(bytes_per_channel: int) -> int:
    return max(1, _DW_BAND_BYTES // max(1, bytes_per_channel))


def _depthwise_im2col_banded(x: np.ndarray, w: np.ndarray, g: spatial.WindowGeometry) -> np.ndarray:
    """Depthwise im2col (strided ones) in bands of channels, for the same cache reason;
    each channel's GEMV is the one the unbanded batched matmul makes."""
    n, c = x.shape[:2]
    xp = spatial.pad_spatial(x, g)
    k, p = math.prod(g.kernel), math.prod(g.out_shape)
    wr = w.reshape(c, 1, k)
    y = np.empty((n, c, 1, p), np.result_type(x, w))
    band = _dw_band(k * p * x.itemsize)
    for c0 in range(0, c, band):
        c1 = min(c, c0 + band)
        cols = spatial.windows(xp[:, c0:c1], g).reshape(n, c1 - c0, k, p)
        np.matmul(wr[c0:c1], cols, out=y[:, c0:c1])
    return y.reshape((n, c) + g.out_shape)


_BAND_OVER = 16 << 20  # im2col columns larger than this are built a band of output rows at a time
_BAND_BYTES = 1 << 20  # columns per band: well inside a core's L2


def _im2col_row_banded(x: np.ndarray, w: np.ndarray, g: spatial.WindowGeometry) -> np.ndarray:
    """Batch-1, group-1 2-d im2col + GEMM over bands of output rows.

    Where the whole column matrix would be many times the cache (basic-pitch's
    8 -> 8 channel 3x39 conv on 172x264: 162 MiB of columns, a K = 936 by
    45,408 matrix), its copy and the GEMM that reads it back both stream from
    memory; built ~1 MiB at a time the columns stay in L2 between the copy
    and the GEMM: measured 2.3-3x faster there. Each band is the same GEMM on
    a subset of the output columns."""
    c = x.shape[1]
    m = w.shape[0]
    kh, kw = g.kernel
    sh_, sw_ = g.strides
    dh, dw = g.dilations
    oh, ow = g.out_shape
    xp = np.ascontiguousarray(spatial.pad_spatial(x, g)[0])
    sc, sh, sw = xp.strides
    k = c * kh * kw
    rows = max(1, _BAND_BYTES // (k * ow * xp.itemsize))
    wm = w.reshape(m, k)
    y = np.empty((m, oh * ow), np.result_type(x, w))
    for r0 in range(0, oh, rows):
        r1 = min(oh, r0 + rows)
        win = np.ndarray((c, kh, kw, r1 - r0, ow), xp.dtype, buffer=xp, offset=r0 * sh_ * sh,
                         strides=(sc, dh * sh, dw * sw, sh_ * sh, sw_ * sw))
        np.matmul(wm, win.reshape(k, (r1 - r0) * ow), out=y[:, r0 * ow:r1 * ow])
    return y.reshape(1, m, oh, ow)


def _hashable(v):
    return None if v is None else tuple(int(i) for i in v)


@register("Conv", dtypes=FLOAT_TYPES)
def conv(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: list[int] | None = None,
    group: int = 1,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> np.ndarray:
    try:
        g, mode = _plan(x.shape, w.shape, group, auto_pad, dilations, kernel_shape, pads, strides)
    except TypeError:  # lists from a direct caller
        g, mode = _plan(x.shape, w.shape, group, auto_pad, _hashable(dilations), _hashable(kernel_shape),
                        _hashable(pads), _hashable(strides))
    if mode == "check":
        check_conv_shapes(x, w, group)
    if mode == "shifted" or mode in _DEPTHWISE_PLANS:
        y = _conv2d_shifted(x, w, group, g) if mode == "shifted" else _DEPTHWISE_PLANS[mode](x, w, g)
        if b is not None:
            y += b.reshape(1, -1, 1, 1).astype(y.dtype, copy=False)
        return y
    n_batch, m = x.shape[0], w.shape[0]
    if mode == "im2col" and group == x.shape[1] == m > 1 and w.shape[1] == 1:
        y = _depthwise_im2col_banded(x, w, g)
        if b is not None:
            y += b.reshape((1, m) + (1,) * len(g.out_shape))
        return y
    if mode == "direct":
        cols = x.reshape(n_batch, group, x.shape[1] // group, -1)
    elif (group == 1 and n_batch == 1 and x.ndim == 4
          and x.itemsize * w[0].size * math.prod(g.out_shape) > _BAND_OVER):
        y = _im2col_row_banded(x, w, g)
        if b is not None:
            y += b.reshape(1, m, 1, 1)
        return y
    else:
        cols = im2col(x, g, group)
    if group == 1 and n_batch == 1:
        y = w.reshape(m, -1) @ cols[0, 0]  # one 2-d GEMM
    else:
        y = np.matmul(w.reshape(group, m // group, -1), cols)  # (N, g, M/g, P)
    y = y.reshape((n_batch, m) + g.out_shape)
    if b is not None:
        y += b.reshape((1, m) + (1,) * len(g.out_shape))
    return y


def _conv_without_columns(x, w, b, group, attrs):
    """The shifted-slice plan of :func:`_conv2d_shifted` where it applies, else None."""
    if x.ndim != 4 or w.ndim != 4 or x.shape[0] * x.shape[1] == 0:
        return None
    check_conv_shapes(x, w, group)
    g = conv_geometry(x.shape, w.shape, **attrs)
    if all(k == 1 for k in g.kernel) or _depthwise_stride1(x.shape, w.shape, group, g):
        return None  # (stride-1 depthwise: the plain forward's batched GEMVs, see the caller)
    y = _conv2d_shifted(x, w, group, g)
    if y is not None and b is not None:
        y += b.reshape(1, -1, 1, 1).astype(y.dtype, copy=False)
    return y


def _shifted_applies(x_shape, w_shape, group: int, g: spatial.WindowGeometry) -> bool:
    """Whether :func:`_conv2d_shifted` is the better plan for these shapes."""
    c, m = x_shape[1], w_shape[0]
    oh, ow = g.out_shape
    if oh <= 0 or ow <= 0 or any(s != 1 for s in g.strides):
        return False
    depthwise = group == c and m == c and w_shape[1] == 1
    if depthwise:
        return oh * ow > 2500  # smaller images: batched GEMVs over the columns beat prod(kernel) passes (2-4x)
    if group != 1:
        return False
    # per-offset GEMMs with few input channels are K-starved: im2col's one GEMM is 2.5-3x faster at C = 16
    return 2 * m <= c or (oh * ow >= 1024 and c >= 64)


def _flat_padded(x: np.ndarray, g: spatial.WindowGeometry) -> tuple[np.ndarray, int, int]:
    """The padded input flattened per (n, c), with one spare row so every
    shifted slice of length out_h * Wp stays in bounds; returns (flat, Wp, length)."""
    n, c, h, w = x.shape
    (pt, pl), (pb, pr) = g.pads_begin, g.pads_end
    hp, wp = h + pt + pb, w + pl + pr
    xp = np.zeros((n, c, hp + 1, wp), dtype=x.dtype)
    xp[:, :, pt:pt + h, pl:pl + w] = x
    return xp.reshape(n, c, -1), wp, g.out_shape[0] * wp


def _conv2d_shifted(x: np.ndarray, w: np.ndarray, group: int, g: spatial.WindowGeometry):
    """Stride-1 2-d convolution without im2col, or None where im2col is the better plan.

    With the padded image flattened per channel, the input under kernel
    offset (i, j) for every output pixel at once is one contiguous slice
    starting at ``i * d_h * Wp + j * d_w`` (output rows then carry
    Wp - out_w junk columns, dropped at the end). So:

    - depthwise on a large image (> 2500 outputs; on smaller ones the
      batched GEMV of :func:`_depthwise_columns` is 2-4x faster): one multiply-add of each offset's slice
      by its weight;
    - out channels <= in / 2: one GEMM of all offsets' weights with the
      image, then each offset's output slab shifted and summed;
    - otherwise, for a large image and >= 64 input channels: one GEMM per
      offset on its slice (BLAS reads the strided slice in place).

    Each avoids the prod(kernel)-times-larger column matrix; measured 1.4x
    to 5x faster than im2col at such shapes on one thread. Strided
    convolutions stay on im2col (a phase split measured no faster).
    """
    if not _shifted_applies(x.shape, w.shape, group, g):
        return None
    n, c, _, _ = x.shape
    m = w.shape[0]
    oh, ow = g.out_shape
    kh, kw = g.kernel
    dh, dw = g.dilations
    depthwise = group == c and m == c and w.shape[1] == 1
    gemm_then_shift = 2 * m <= c
    flat, wp, length = _flat_padded(x, g)
    offsets = [i * dh * wp + j * dw for i in range(kh) for j in range(kw)]
    dtype = np.result_type(x, w)
    if depthwise:
        wk = w.reshape(c, -1).astype(dtype, copy=False)
        y = np.empty((n, c, length), dtype=dtype)
        tmp = np.empty_like(y)
        for k, off in enumerate(offsets):
            dst = y if k == 0 else tmp
            np.multiply(flat[:, :, off:off + length], wk[:, k][None, :, None], out=dst)
            if k:
                y += tmp
    elif gemm_then_shift:
        w_all = np.ascontiguousarray(w.transpose(2, 3, 0, 1).reshape(kh * kw * m, c), dtype=dtype)
        y = np.empty((n, m, length), dtype=dtype)
        for b_i in range(n):
            z = (w_all @ flat[b_i]).reshape(kh * kw, m, -1)
            acc = y[b_i]
            acc[...] = z[0, :, offsets[0]:offsets[0] + length]
            for k in range(1, len(offsets)):
                acc += z[k, :, offsets[k]:offsets[k] + length]
    else:
        wk = np.ascontiguousarray(w.transpose(2, 3, 0, 1), dtype=dtype).reshape(kh * kw, m, c)
        y = np.empty((n, m, length), dtype=dtype)
        for b_i in range(n):
            acc = y[b_i]
            np.matmul(wk[0], flat[b_i, :, offsets[0]:offsets[0] + length], out=acc)
            for k in range(1, len(offsets)):
                acc += wk[k] @ flat[b_i, :, offsets[k]:offsets[k] + length]
    return np.ascontiguousarray(y.reshape(n, y.shape[1], oh, wp)[:, :, :, :ow])


@conv.saving
def _(x, w, b=None, *, group=1, **attrs):
    """Training forward: also return the im2col columns for the weight gradient.

    Where the plain forward skips im2col it does here too (the output must
    be the plain forward's, bit for bit) and saves nothing: the backward then
    builds the columns itself, which also keeps them out of memory between
    the passes."""
    y = _conv_without_columns(x, w, b, group, attrs)
    if y is not None:
        return y, None
    if x.ndim == 4 and w.ndim == 4:
        t = {k: (None if v is None or isinstance(v, str) else tuple(int(i) for i in v)) if k != "auto_pad" else v
             for k, v in attrs.items()}
        g, mode = _plan(x.shape, w.shape, group, t.get("auto_pad", "NOTSET"), t.get("dilations"),
                        t.get("kernel_shape"), t.get("pads"), t.get("strides"))
        if mode in _DEPTHWISE_PLANS:
            y = _DEPTHWISE_PLANS[mode](x, w, g)
            if b is not None:
                y += b.reshape(1, -1, 1, 1).astype(y.dtype, copy=False)
            return y, None
    return _conv_columns(x, w, b, group, attrs)


_DEPTHWISE_PLANS = {"depthwise_columns": _depthwise_columns, "depthwise_toeplitz": _depthwise_toeplitz,
                    "depthwise_short": _depthwise_short}


def col2im(
    dcols: np.ndarray, x_shape: tuple[int, ...], g: spatial.WindowGeometry
) -> np.ndarray:
    """Adjoint of :func:`im2col`: (N, group, C/group * k, P) -> (N, C, *S).

    Each kernel offset's slab is added into the padded input at that offset's
    strided slice; overlapping windows simply add up.
    """
    n_sp = len(g.kernel)
    cols = dcols.reshape(tuple(x_shape[:2]) + g.kernel + g.out_shape)
    padded = tuple(x_shape[:2]) + tuple(
        s + b + e for s, b, e in zip(x_shape[2:], g.pads_begin, g.pads_end)
    )
    dxp = np.zeros(padded, dtype=dcols.dtype)
    head = (slice(None), slice(None))
    for k_idx, sl in enumerate(g.offset_slices):
        off = np.unravel_index(k_idx, g.kernel)
        dxp[sl] += cols[head + tuple(int(o) for o in off)]
    if not g.padded:
        return dxp
    inner = tuple(slice(b, b + s) for b, s in zip(g.pads_begin, x_shape[2:]))
    assert len(inner) == n_sp
    return dxp[head + inner]


@conv.backward(uses="inputs")
def _(grads, inputs, outputs, *, group=1, needs_grad=None, saved=None, **attrs):
    dy = grads[0]
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    if dy is None:
        return (None, None, None)[: len(inputs)]
    want = needs_grad or (True, True, True)
    g = conv_geometry(x.shape, w.shape, **attrs)
    if _depthwise_backward_applies(x, w, group, g):
        return _depthwise_backward(dy, x, w, b, g, want)[: len(inputs)]
    n_batch, m = x.shape[0], w.shape[0]
    dy_g = dy.reshape(n_batch, group, m // group, -1)  # (N, g, M/g, P)
    dx = dw = db = None
    if want[1]:
        cols = saved
        if cols is None:
            cols = (x.reshape(n_batch, group, x.shape[1] // group, -1) if _direct(g)
                    else im2col(x, g, group))
        # (N, g, M/g, P) @ (N, g, P, CK) summed over the batch -> (g, M/g, CK)
        dw = np.matmul(dy_g, np.swapaxes(cols, -1, -2)).sum(axis=0).reshape(w.shape)
    if want[0]:
        w_g = w.reshape(group, m // group, -1)
        dcols = np.matmul(np.swapaxes(w_g, -1, -2), dy_g)  # (N, g, CK, P)
        dx = dcols.reshape(x.shape) if _direct(g) else col2im(dcols, x.shape, g)
    if b is not None and len(want) > 2 and want[2]:
        db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)))
    return (dx, dw, db)[: len(inputs)]


@conv.workspace
def _conv_workspace(shapes: list, attrs: dict) -> int:
    """im2col columns: N * C * prod(kernel) * prod(out) values (4-byte estimate)."""
    x, w = shapes[0], shapes[1]
    if x is None or w is None:
        return 0
    g = conv_geometry(
        tuple(x), tuple(w), auto_pad=attrs.get("auto_pad", "NOTSET"),
        dilations=attrs.get("dilations"), kernel_shape=attrs.get("kernel_shape"),
        pads=attrs.get("pads"), strides=attrs.get("strides"),
    )
    if all(k == 1 for k in g.kernel) and all(s == 1 for s in g.strides) and not g.padded:
        return 0
    return 4 * int(x[0]) * int(x[1]) * int(np.prod(g.kernel)) * int(np.prod(g.out_shape))


# ---------------------------------------------------------------- depthwise backward (transfer learning)
# MobileNets are mostly depthwise convolutions. Their backward through im2col
# builds (N, C, k*k, P) columns and column gradients, k*k times the input;
# looping over the k*k offsets instead needs one dy-sized temporary and no
# batched matmul of 1-row matrices.


def _depthwise_backward_applies(x, w, group, g) -> bool:
    c = x.shape[1]
    return x.ndim >= 3 and group == c and w.shape[0] == c and w.shape[1] == 1 and len(g.kernel) == x.ndim - 2


def _depthwise_backward(dy, x, w, b, g, want):
    n, c = x.shape[:2]
    axes = (0,) + tuple(range(2, dy.ndim))
    wk = w.reshape(c, -1).astype(dy.dtype, copy=False)
    bshape = (1, c) + (1,) * (dy.ndim - 2)
    dx = dw = db = None
    if want[1]:
        xp = spatial.pad_spatial(x, g)
        dw = np.empty((c, len(g.offset_slices)), dtype=dy.dtype)
        sub = "nc" + "hwdefg"[: dy.ndim - 2]
        for k, sl in enumerate(g.offset_slices):
            # sum over batch and positions of dy * x at this offset, per channel
            dw[:, k] = np.einsum(f"{sub},{sub}->c", dy, xp[sl])
        dw = dw.reshape(w.shape)
    if want[0]:
        padded = (n, c) + tuple(s + p0 + p1 for s, p0, p1 in zip(x.shape[2:], g.pads_begin, g.pads_end))
        dxp = np.zeros(padded, dtype=dy.dtype)
        tmp = np.empty_like(dy)
        for k, sl in enumerate(g.offset_slices):
            np.multiply(dy, wk[:, k].reshape(bshape), out=tmp)
            dxp[sl] += tmp
        inner = (slice(None), slice(None)) + tuple(slice(p0, p0 + s) for p0, s in zip(g.pads_begin, x.shape[2:]))
        dx = dxp[inner] if g.padded or dxp.shape != x.shape else dxp
    if b is not None and len(want) > 2 and want[2]:
        db = dy.sum(axis=axes)
    return (dx, dw, db)
