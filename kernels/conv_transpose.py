"""ConvTranspose (N-d, groups, strides, dilations, pads, output_padding,
output_shape, auto_pad) and Col2Im, by GEMM + col2im.

The transposed convolution is the adjoint of Conv: one BLAS matmul per group
turns every input pixel into its ``C_out/group * prod(kernel)`` contributions
(the column matrix), then col2im adds each kernel offset's slab into the
output at that offset's strided slice — prod(kernel) vectorised adds into a
"full" buffer of size ``(in - 1) * stride + (kernel - 1) * dilation + 1``,
which the pads crop (negative total padding, from an ``output_shape`` larger
than the full size, leaves zeros at the end). When the stride covers the
dilated kernel the slabs do not overlap and are assigned instead of added.

Backward: the input gradient is a Conv of the output gradient with the same
weights (im2col of the full-size gradient, one matmul per group), the weight
gradient the matmul of that column matrix with the input.
"""

from __future__ import annotations

import numpy as np

from . import spatial
from ._nn import OpError, ints, text
from .conv import im2col
from .registry import FLOAT_TYPES, register


def _geometry(x_shape, w_shape, group, *, auto_pad, dilations, kernel_shape, output_padding, output_shape,
              pads, strides):
    """(full-buffer geometry, pads_begin, output spatial shape)."""
    n = len(x_shape) - 2
    if n < 1 or len(w_shape) != n + 2:
        raise OpError(
            f"ConvTranspose expects input (N, C, *spatial) and weight (C, M/group, *kernel) of the same rank; "
            f"got {tuple(x_shape)} and {tuple(w_shape)}"
        )
    if group < 1 or x_shape[1] % group or w_shape[0] != x_shape[1]:
        raise OpError(
            f"ConvTranspose channel mismatch: input {tuple(x_shape)} and weight {tuple(w_shape)} with group={group} "
            f"(weight dim 0 must equal the input channels, divisible by group)"
        )
    kernel = ints(kernel_shape) or tuple(w_shape[2:])
    s = ints(strides) or (1,) * n
    d = ints(dilations) or (1,) * n
    op = ints(output_padding) or (0,) * n
    if any(len(v) != n for v in (kernel, s, d, op)):
        raise OpError(f"ConvTranspose: kernel_shape/strides/dilations/output_padding need {n} values each")
    in_sp = tuple(x_shape[2:])
    eff = tuple((k - 1) * di + 1 for k, di in zip(kernel, d))
    full = tuple((i - 1) * st + e for i, st, e in zip(in_sp, s, eff))
    mode = text(auto_pad, "NOTSET")
    if mode not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise OpError(f"ConvTranspose: auto_pad={mode!r} is not NOTSET, SAME_UPPER, SAME_LOWER or VALID")
    target = ints(output_shape)
    if target is not None and len(target) == n + 2:
        target = target[2:]
    if target is None and mode in ("SAME_UPPER", "SAME_LOWER"):
        target = tuple(i * st for i, st in zip(in_sp, s))
    if target is not None:
        if len(target) != n:
            raise OpError(f"ConvTranspose: output_shape needs {n} spatial values, got {list(target)}")
        total = [max(0, f + o - t) for f, o, t in zip(full, op, target)]
        # the spec (and onnxruntime): the odd cell goes to the end for SAME_UPPER only
        begin = tuple(t // 2 if mode == "SAME_UPPER" else t - t // 2 for t in total)
        out = tuple(target)
    else:
        p = ints(pads) or (0,) * (2 * n)
        if len(p) != 2 * n:
            raise OpError(f"ConvTranspose: pads needs {2 * n} values, got {list(p)}")
        if mode == "VALID":
            p = (0,) * (2 * n)
        begin = tuple(p[:n])
        out = tuple(f + o - b - e for f, o, b, e in zip(full, op, p[:n], p[n:]))
    if any(o < 0 for o in out):
        raise OpError(f"ConvTranspose: pads {list(pads or ())} leave a negative output size {list(out)}")
    g = spatial.WindowGeometry(kernel, s, d, (0,) * n, (0,) * n, in_sp)
    return g, begin, out


def _place(full_buf: np.ndarray, begin, out) -> np.ndarray:
    """Crop (or zero-extend at the end) the spatial dims of the full buffer to ``out`` from ``begin``."""
    n = len(out)
    if all(b == 0 for b in begin) and full_buf.shape[2:] == tuple(out):
        return full_buf
    res = np.zeros(full_buf.shape[:2] + tuple(out), dtype=full_buf.dtype)
    src, dst = [slice(None)] * 2, [slice(None)] * 2
    for a in range(n):
        lo = begin[a]
        hi = min(full_buf.shape[2 + a], lo + out[a])
        src.append(slice(lo, max(lo, hi)))
        dst.append(slice(0, max(0, hi - lo)))
    res[tuple(dst)] = full_buf[tuple(src)]
    return res


def _col2im_full(cols: np.ndarray, n_batch: int, channels: int, g: spatial.WindowGeometry, dtype) -> np.ndarray:
    """(N, C * prod(k), prod(in)) columns -> the (N, C, *full) buffer (overlaps add)."""
    full = tuple((o - 1) * st + (k - 1) * d + 1 for o, st, k, d in zip(g.out_shape, g.strides, g.kernel, g.dilations))
    c = cols.reshape((n_batch, channels) + g.kernel + g.out_shape)
    disjoint = all(st >= (k - 1) * d + 1 for st, k, d in zip(g.strides, g.kernel, g.dilations))
    tiles = all(st == k and d == 1 for st, k, d in zip(g.strides, g.kernel, g.dilations))  # every cell written once
    buf = (np.empty if tiles else np.zeros)((n_batch, channels) + full, dtype=dtype)
    head = (slice(None), slice(None))
    for k_idx, sl in enumerate(g.offset_slices):
        off = tuple(int(o) for o in np.unravel_index(k_idx, g.kernel))
        if disjoint:
            buf[sl] = c[head + off]
        else:
            buf[sl] += c[head + off]
    return buf


def _depthwise_full(x: np.ndarray, w: np.ndarray, g: spatial.WindowGeometry) -> np.ndarray:
    """One input and one output channel per group: each kernel offset adds the
    per-channel-scaled input into its strided slice (no column matrix)."""
    full = tuple((o - 1) * st + (k - 1) * d + 1 for o, st, k, d in zip(g.out_shape, g.strides, g.kernel, g.dilations))
    buf = np.zeros(x.shape[:2] + full, dtype=np.result_type(x, w))
    wk = w.reshape(w.shape[0], -1)  # (C, K)
    bshape = (1, x.shape[1]) + (1,) * len(full)
    for k_idx, sl in enumerate(g.offset_slices):
        buf[sl] += x * wk[:, k_idx].reshape(bshape)
    return buf


def _forward(x, w, b, group, attrs):
    g, begin, out = _geometry(x.shape, w.shape, group, **attrs)
    n_batch, c_in = x.shape[:2]
    m = w.shape[1] * group
    k = int(np.prod(g.kernel))
    if group == c_in and m == group:
        full = _depthwise_full(x, w, g)
    else:
        # (g, C/g, M/g * K) -> (g, M/g * K, C/g)
        wt = np.swapaxes(w.reshape(group, c_in // group, -1), 1, 2)
        xg = x.reshape(n_batch, group, c_in // group, -1)
        cols = np.matmul(wt, xg)  # (N, g, M/g * K, P_in)
        full = _col2im_full(cols.reshape(n_batch, m * k, -1), n_batch, m, g, cols.dtype)
    y = _place(full, begin, out)
    if b is not None:
        y += b.reshape((1, m) + (1,) * len(out)).astype(y.dtype, copy=False)
    return y.astype(x.dtype, copy=False)


@register("ConvTranspose", dtypes=FLOAT_TYPES, since=1)
def conv_transpose(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations=None,
    group: int = 1,
    kernel_shape=None,
    output_padding=None,
    output_shape=None,
    pads=None,
    strides=None,
) -> np.ndarray:
    attrs = dict(auto_pad=auto_pad, dilations=dilations, kernel_shape=kernel_shape, output_padding=output_padding,
                 output_shape=output_shape, pads=pads, strides=strides)
    return _forward(x, w, b, group, attrs)


@conv_transpose.backward(uses="inputs")
def _(grads, inputs, outputs, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
      output_padding=None, output_shape=None, pads=None, strides=None, needs_grad=None):
    attrs = dict(auto_pad=auto_pad, dilations=dilations, kernel_shape=kernel_shape, output_padding=output_padding,
                 output_shape=output_shape, pads=pads, strides=strides)
    dy = grads[0]
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    if dy is None:
        return (None,) * len(inputs)
    want = needs_grad or (True,) * len(inputs)
    g, begin, out = _geometry(x.shape, w.shape, group, **attrs)
    n_batch, c_in = x.shape[:2]
    m = w.shape[1] * group
    # adjoint of _place: the gradient of the full buffer
    full = tuple((o - 1) * st + (k - 1) * d + 1 for o, st, k, d in zip(g.out_shape, g.strides, g.kernel, g.dilations))
    dfull = np.zeros((n_batch, m) + full, dtype=dy.dtype)
    src, dst = [slice(None)] * 2, [slice(None)] * 2
    for a in range(len(out)):
        lo = begin[a]
        hi = min(full[a], lo + out[a])
        dst.append(slice(lo, max(lo, hi)))
        src.append(slice(0, max(0, hi - lo)))
    dfull[tuple(dst)] = dy[tuple(src)]
    cols = im2col(dfull, g, group)  # (N, g, M/g * K, P_in)
    dx = dw = db = None
    if want[0]:
        wg = w.reshape(group, c_in // group, -1)  # (g, C/g, M/g * K)
        dx = np.matmul(wg, cols).reshape(x.shape).astype(x.dtype, copy=False)
    if want[1]:
        xg = x.reshape(n_batch, group, c_in // group, -1)
        dw = np.matmul(xg, np.swapaxes(cols, -1, -2)).sum(axis=0).reshape(w.shape).astype(w.dtype, copy=False)
    if b is not None and len(want) > 2 and want[2]:
        db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim))).astype(b.dtype, copy=False)
    return (dx, dw, db)[: len(inputs)]


@conv_transpose.workspace
def _conv_transpose_workspace(shapes: list, attrs: dict) -> int:
    """The column matrix plus the full-size buffer (4-byte estimate)."""
    x, w = shapes[0], shapes[1]
    if x is None or w is None:
        return 0
    group = int(attrs.get("group", 1))
    kw = {k: attrs.get(k) for k in ("dilations", "kernel_shape", "output_padding", "output_shape", "pads", "strides")}
    g, _, _ = _geometry(tuple(x), tuple(w), group, auto_pad=attrs.get("auto_pad", "NOTSET"), **kw)
    m = int(w[1]) * group
    cols = int(x[0]) * m * int(np.prod(g.kernel)) * int(np.prod(g.out_shape))
    full = int(x[0]) * m * int(np.prod([(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in
                                        zip(g.out_shape, g.strides, g.kernel, g.dilations)]))
    return 4 * (cols + full)


@register("Col2Im", dtypes=FLOAT_TYPES, since=18)
def col2im_op(
    x: np.ndarray, image_shape: np.ndarray, block_shape: np.ndarray, *, dilations=None, pads=None, strides=None
) -> np.ndarray:
    """(N, C * prod(block), L) columns -> (N, C, *image_shape), overlaps summed."""
    img = ints(image_shape)
    blk = ints(block_shape)
    n = len(img)
    if len(blk) != n or x.ndim != 3:
        raise OpError(f"Col2Im: input {x.shape} must be (N, C * prod(block), L) and block_shape rank {n}")
    kprod = int(np.prod(blk))
    if x.shape[1] % kprod:
        raise OpError(f"Col2Im: input dim 1 ({x.shape[1]}) is not divisible by prod(block_shape) = {kprod}")
    g = spatial.resolve(img, blk, strides=ints(strides), dilations=ints(dilations), pads=ints(pads))
    if int(np.prod(g.out_shape)) != x.shape[2]:
        raise OpError(
            f"Col2Im: {x.shape[2]} blocks given, but image {list(img)} with these pads/strides/dilations "
            f"has {int(np.prod(g.out_shape))}"
        )
    channels = x.shape[1] // kprod
    g0 = spatial.WindowGeometry(g.kernel, g.strides, g.dilations, (0,) * n, (0,) * n, g.out_shape)
    full = _col2im_full(x, x.shape[0], channels, g0, x.dtype)
    # the full buffer spans pads_begin .. ; crop it to the image (zeros where it falls short)
    padded = tuple(i + b + e for i, b, e in zip(img, g.pads_begin, g.pads_end))
    if full.shape[2:] != padded:
        buf = np.zeros(full.shape[:2] + padded, dtype=x.dtype)
        buf[(slice(None), slice(None)) + tuple(slice(0, f) for f in full.shape[2:])] = full
        full = buf
    inner = tuple(slice(b, b + i) for b, i in zip(g.pads_begin, img))
    return np.ascontiguousarray(full[(slice(None), slice(None)) + inner])


@register("DeformConv", dtypes=FLOAT_TYPES, since=19)
def deform_conv(
    x: np.ndarray,
    w: np.ndarray,
    offset: np.ndarray,
    b: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    *,
    dilations=None,
    group: int = 1,
    kernel_shape=None,
    offset_group: int = 1,
    pads=None,
    strides=None,
) -> np.ndarray:
    """2-d deformable convolution: every kernel tap samples the input
    bilinearly at its offset position (taps outside the image read 0),
    optionally scaled by ``mask``; the sampled columns then meet the weights
    in one matmul per group, as in Conv."""
    if x.ndim != 4 or w.ndim != 4:
        raise OpError(f"DeformConv supports 2-d inputs (N, C, H, W), got {x.shape} and weight {w.shape}")
    n, c, ih, iw = x.shape
    oc = w.shape[0]
    if group < 1 or c != w.shape[1] * group or oc % group:
        raise OpError(f"DeformConv channel mismatch: input {x.shape}, weight {w.shape}, group={group}")
    kh, kw = ints(kernel_shape) or w.shape[2:]
    sh, sw = ints(strides) or (1, 1)
    dh, dw = ints(dilations) or (1, 1)
    pt, pl, pb, pr = ints(pads) or (0, 0, 0, 0)
    og = int(offset_group)
    if og < 1 or c % og:
        raise OpError(f"DeformConv: offset_group={og} must divide the {c} input channels")
    oh = (ih + pt + pb - ((kh - 1) * dh + 1)) // sh + 1
    ow = (iw + pl + pr - ((kw - 1) * dw + 1)) // sw + 1
    k = kh * kw
    if offset.shape != (n, og * 2 * k, oh, ow):
        raise OpError(f"DeformConv: offset must be ({n}, {og * 2 * k}, {oh}, {ow}), got {offset.shape}")
    if mask is not None and mask.shape != (n, og * k, oh, ow):
        raise OpError(f"DeformConv: mask must be ({n}, {og * k}, {oh}, {ow}), got {mask.shape}")
    wd = np.float64 if x.dtype == np.float64 else np.float32
    off = offset.astype(wd).reshape(n, og, kh, kw, 2, oh * ow)
    base_h = (np.arange(kh) * dh)[:, None, None] + (np.arange(oh) * sh - pt)[None, None, :, None].repeat(ow, 3)\
        .reshape(1, 1, oh * ow)
    base_w = (np.arange(kw) * dw)[None, :, None] + np.tile(np.arange(ow) * sw - pl, oh)[None, None, :]
    ph = off[:, :, :, :, 0, :] + base_h[None, None, :, :, :]  # (N, G, kh, 1|kw, P) -> broadcast
    pw = off[:, :, :, :, 1, :] + base_w[None, None, :, :, :]
    ph = np.broadcast_to(ph, (n, og, kh, kw, oh * ow)).reshape(n, og, k * oh * ow)
    pw = np.broadcast_to(pw, (n, og, kh, kw, oh * ow)).reshape(n, og, k * oh * ow)
    h0, w0 = np.floor(ph), np.floor(pw)
    th, tw = ph - h0, pw - w0
    h0, w0 = h0.astype(np.int64), w0.astype(np.int64)
    m = None if mask is None else mask.astype(wd).reshape(n, og, k * oh * ow)
    xg = x.astype(wd, copy=False).reshape(n, og, c // og, ih * iw)
    cols = np.zeros((n, og, c // og, k * oh * ow), dtype=wd)
    for dy, wy in ((0, 1 - th), (1, th)):
        for dx, wx in ((0, 1 - tw), (1, tw)):
            hh, ww = h0 + dy, w0 + dx
            valid = (hh >= 0) & (hh < ih) & (ww >= 0) & (ww < iw)
            weight = np.where(valid, wy * wx, 0)
            if m is not None:
                weight = weight * m
            idx = np.clip(hh, 0, ih - 1) * iw + np.clip(ww, 0, iw - 1)  # (N, G, K*P)
            vals = np.take_along_axis(xg, idx[:, :, None, :], axis=3)  # (N, G, C/G, K*P)
            cols += vals * weight[:, :, None, :]
    cols = cols.reshape(n, group, (c // group) * k, oh * ow)
    wg = w.astype(wd).reshape(group, oc // group, -1)
    y = np.matmul(wg, cols).reshape(n, oc, oh, ow)
    if b is not None:
        y += b.astype(wd).reshape(1, oc, 1, 1)
    return y.astype(x.dtype)


@deform_conv.workspace
def _(shapes, attrs):
    """The sampled columns: N * C * prod(kernel) * prod(out), plus the four
    corner gathers (4-byte estimate)."""
    x, w, off = shapes[0], shapes[1], shapes[2] if len(shapes) > 2 else None
    if x is None or w is None or off is None:
        return 0
    cols = int(x[0]) * int(x[1]) * int(np.prod(w[2:])) * int(np.prod(off[2:]))
    return 4 * 2 * cols
