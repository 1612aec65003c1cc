"""Conv's im2col-free plans (stride-1 2-d: depthwise, few output channels,
large images) give what the im2col path gives, over a grid of shapes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edgeflow.kernels import get_kernel
from edgeflow.kernels.conv import _conv2d_shifted, _conv_columns, conv_geometry

RNG = np.random.default_rng(41)
GRID = list(itertools.product(
    [(8, 8, 8), (8, 3, 1), (32, 40, 1), (16, 4, 1), (3, 16, 1), (6, 6, 2)],  # (C, M, group)
    [(3, 3), (1, 3), (5, 5), (2, 2)],
    [(0, 0, 0, 0), (1, 1, 1, 1), (2, 0, 1, 3)],
    [(1, 1), (2, 1)],
    [(2, (7, 9)), (1, (36, 40))],
))


@pytest.mark.parametrize("cmg,kernel,pads,dil,nhw", GRID, ids=str)
def test_plans_match_im2col(cmg, kernel, pads, dil, nhw):
    c, m, group = cmg
    n, hw = nhw
    x = RNG.standard_normal((n, c) + hw).astype(np.float32)
    w = RNG.standard_normal((m, c // group) + kernel).astype(np.float32)
    b = RNG.standard_normal(m).astype(np.float32)
    attrs = dict(auto_pad="NOTSET", dilations=dil, kernel_shape=None, pads=pads, strides=None)
    ref = _conv_columns(x, w, b, group, attrs)[0]
    got = get_kernel("Conv", opset=13)(x, w, b, group=group, dilations=dil, pads=pads)
    assert got.shape == ref.shape and got.flags.c_contiguous
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_the_plans_are_taken():
    """Depthwise convolutions on large images, few-output-channel and large-image
    convolutions skip im2col; a strided one, a small grouped one and a depthwise
    one on a small image (<= 2500 outputs: the batched GEMV is faster) do not."""
    def plan(x_shape, w_shape, group=1, strides=None):
        x = np.zeros(x_shape, np.float32)
        w = np.zeros(w_shape, np.float32)
        g = conv_geometry(x.shape, w.shape, pads=(1, 1, 1, 1), strides=strides)
        return _conv2d_shifted(x, w, group, g) is not None

    assert plan((1, 16, 60, 60), (16, 1, 3, 3), group=16)
    assert not plan((1, 16, 20, 20), (16, 1, 3, 3), group=16)
    assert plan((1, 96, 12, 16), (24, 96, 3, 3))
    assert plan((1, 64, 40, 40), (64, 64, 3, 3))
    assert not plan((1, 16, 40, 40), (64, 16, 3, 3))  # K-starved per-offset GEMMs: im2col
    assert not plan((1, 32, 40, 40), (32, 32, 3, 3), strides=(2, 2))
    assert not plan((1, 8, 6, 6), (8, 4, 3, 3), group=2)
    assert not plan((1, 32, 8, 8), (64, 32, 3, 3))


TOEPLITZ = list(itertools.product(
    [(5, 5), (3, 3), (3, 5)], [(1, 1), (2, 2), (1, 2), (2, 1)], [(1, 1), (1, 2)],
    [(1, (14, 14)), (2, (7, 9)), (1, (30, 6))]))


@pytest.mark.parametrize("kernel,strides,dil,nhw", TOEPLITZ, ids=str)
def test_depthwise_toeplitz_matches_im2col(kernel, strides, dil, nhw):
    """Depthwise convs on narrow images (padded width <= 4x the kernel's) take the banded
    Toeplitz GEMM; it gives im2col's result, strides, width dilation and batches included."""
    from edgeflow.kernels.conv import _plan

    n, hw = nhw
    c = 12
    pads = tuple(k // 2 for k in kernel) * 2
    x = RNG.standard_normal((n, c) + hw).astype(np.float32)
    w = RNG.standard_normal((c, 1) + kernel).astype(np.float32)
    b = RNG.standard_normal(c).astype(np.float32)
    attrs = dict(auto_pad="NOTSET", dilations=dil, kernel_shape=None, pads=pads, strides=strides)
    mode = _plan(x.shape, w.shape, c, "NOTSET", dil, None, pads, strides)[1]
    assert mode == ("depthwise_toeplitz" if hw[1] + 2 * pads[1] <= 4 * kernel[1] else mode)
    ref = _conv_columns(x, w, b, c, attrs)[0]
    conv = get_kernel("Conv", opset=13)
    got = conv(x, w, b, group=c, dilations=dil, pads=pads, strides=strides)
    assert got.shape == ref.shape and got.flags.c_contiguous
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    # the Toeplitz matrices are kept per weight: a weight changed in place must be seen
    w *= -0.5
    ref2 = _conv_columns(x, w, b, c, attrs)[0]
    np.testing.assert_allclose(conv(x, w, b, group=c, dilations=dil, pads=pads, strides=strides), ref2,
                               rtol=1e-5, atol=1e-5)


def test_depthwise_toeplitz_is_taken_only_on_narrow_images():
    from edgeflow.kernels.conv import _plan

    def mode(hw, k=5):
        p = k // 2
        return _plan((1, 256) + hw, (256, 1, k, k), 256, "NOTSET", None, None, (p, p, p, p), None)[1]

    assert mode((14, 14)) == mode((7, 7)) == "depthwise_toeplitz"  # PP-LCNet
    assert mode((2, 96)) == "depthwise_short"  # the PP-OCR classifier's wide strips (Toeplitz: 20x the flops)
    assert mode((28, 28), k=3) == "depthwise_columns"


SHORT = [(k, s, d, p, nh) for k, s, d, p, nh in itertools.product(
    [(5, 5), (3, 3), (3, 5), (5, 1), (1, 3)], [(1, 1), (2, 1), (1, 2), (2, 2)], [(1, 1), (2, 1), (1, 2)],
    [(2, 2, 2, 2), (0, 0, 0, 0), (1, 0, 2, 3)], [(1, 1), (2, 3), (1, 4), (2, 12)])
    if nh[1] + p[0] + p[2] >= (k[0] - 1) * d[0] + 1]  # an output row at least


@pytest.mark.parametrize("kernel,strides,dil,pads,nh", SHORT, ids=str)
def test_depthwise_short_matches_im2col(kernel, strides, dil, pads, nh):
    """Depthwise convs on short images (height <= 4x the kernel's) take the row-Toeplitz
    GEMM; it gives im2col's result over strides, dilations, asymmetric pads and batches,
    and sees a weight changed in place."""
    from edgeflow.kernels.conv import _plan

    n, h = nh
    c, wd = 6, 23
    x = RNG.standard_normal((n, c, h, wd)).astype(np.float32)
    w = RNG.standard_normal((c, 1) + kernel).astype(np.float32)
    b = RNG.standard_normal(c).astype(np.float32)
    attrs = dict(auto_pad="NOTSET", dilations=dil, kernel_shape=None, pads=pads, strides=strides)
    mode = _plan(x.shape, w.shape, c, "NOTSET", dil, None, pads, strides)[1]
    assert mode == ("depthwise_short" if h <= 4 * kernel[0] else mode)
    conv = get_kernel("Conv", opset=13)
    for xi in (x, x[..., ::-1]):  # a non-contiguous input too
        ref = _conv_columns(np.ascontiguousarray(xi), w, b, c, attrs)[0]
        got = conv(xi, w, b, group=c, dilations=dil, pads=pads, strides=strides)
        assert got.shape == ref.shape and got.flags.c_contiguous
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    w *= -0.5  # the matrices are kept per weight: a weight changed in place must be seen
    ref2 = _conv_columns(x, w, b, c, attrs)[0]
    np.testing.assert_allclose(conv(x, w, b, group=c, dilations=dil, pads=pads, strides=strides), ref2,
                               rtol=1e-5, atol=1e-5)
