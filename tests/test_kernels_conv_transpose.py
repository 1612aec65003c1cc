"""ConvTranspose and Col2Im against onnxruntime and against Conv (the
transposed convolution is Conv's input gradient), plus backwards."""

from __future__ import annotations

import numpy as np
import pytest
from _nn_check import assert_matches_ort, one_node_model
from test_backward_kernels import check_backward

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(11)
F = np.float32

CASES = [
    dict(x=(1, 3, 5, 5), w=(3, 2, 3, 3), attrs={}),
    dict(x=(2, 4, 4, 6), w=(4, 3, 3, 3), attrs=dict(strides=[2, 2])),
    dict(x=(1, 4, 4, 4), w=(4, 2, 2, 2), attrs=dict(strides=[2, 2])),  # the U-Net up-convolution
    dict(x=(1, 4, 5, 4), w=(4, 3, 3, 2), attrs=dict(strides=[2, 3], pads=[1, 0, 1, 1])),
    dict(x=(1, 4, 5, 5), w=(4, 1, 3, 3), attrs=dict(group=4, strides=[2, 2], pads=[1, 1, 1, 1],
                                                    output_padding=[1, 1])),
    dict(x=(1, 6, 3, 4), w=(6, 2, 3, 3), attrs=dict(group=3, dilations=[2, 1])),
    dict(x=(1, 2, 4, 4), w=(2, 3, 3, 3), attrs=dict(strides=[2, 2], output_shape=[9, 10])),
    dict(x=(1, 2, 4, 4), w=(2, 3, 3, 3), attrs=dict(strides=[2, 2], output_shape=[7, 8])),
    dict(x=(1, 2, 4, 4), w=(2, 3, 3, 3), attrs=dict(strides=[3, 2], output_shape=[12, 7])),
    dict(x=(1, 2, 3, 4), w=(2, 3, 3, 3), attrs=dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    dict(x=(1, 2, 3, 4), w=(2, 3, 4, 3), attrs=dict(strides=[2, 3], auto_pad="SAME_LOWER")),
    dict(x=(1, 2, 3, 4), w=(2, 3, 3, 3), attrs=dict(strides=[2, 2], auto_pad="VALID")),
    dict(x=(1, 3, 7), w=(3, 2, 4), attrs=dict(strides=[3], pads=[1, 2])),
    dict(x=(1, 2, 3, 3, 4), w=(2, 2, 2, 3, 2), attrs=dict(strides=[2, 1, 2], pads=[0, 1, 0, 0, 1, 1])),
    dict(x=(2, 4, 3, 3), w=(4, 2, 1, 1), attrs={}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c["attrs"]) + str(c["w"]))
@pytest.mark.parametrize("bias", [False, True])
def test_matches_onnxruntime(case, bias):
    x = RNG.standard_normal(case["x"]).astype(F)
    w = RNG.standard_normal(case["w"]).astype(F)
    consts = {"w": w}
    if bias:
        consts["b"] = RNG.standard_normal(case["w"][1] * case["attrs"].get("group", 1)).astype(F)
    m = one_node_model("ConvTranspose", {"x": x}, consts, opset=22, **case["attrs"])
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES[:6] + CASES[12:], ids=lambda c: str(c["attrs"]) + str(c["w"]))
def test_is_the_adjoint_of_conv(case):
    """<ConvTranspose(x), y> == <x, Conv(y)> with the same weights and geometry."""
    a = dict(case["attrs"])
    if "output_padding" in a:
        return
    x = RNG.standard_normal(case["x"])
    w = RNG.standard_normal(case["w"])
    ct = get_kernel("ConvTranspose", opset=22)(x, w, **a)
    y = RNG.standard_normal(ct.shape)
    conv = get_kernel("Conv", opset=22)(y, w, **{k: v for k, v in a.items() if k != "output_shape"})
    assert conv.shape == x.shape
    np.testing.assert_allclose(np.sum(ct * y), np.sum(x * conv), rtol=1e-10)


def test_float64_and_float16():
    x = RNG.standard_normal((1, 2, 3, 3))
    w = RNG.standard_normal((2, 2, 3, 3))
    k = get_kernel("ConvTranspose", opset=22, dtype="float64")
    assert k(x, w, strides=(2, 2)).dtype == np.float64
    y16 = get_kernel("ConvTranspose", opset=22, dtype="float16")(x.astype(np.float16), w.astype(np.float16))
    assert y16.dtype == np.float16
    np.testing.assert_allclose(y16, k(x, w), rtol=1e-2, atol=2e-2)


def test_bad_attributes():
    k = get_kernel("ConvTranspose", opset=22)
    x, w = np.zeros((1, 4, 3, 3), F), np.zeros((4, 2, 3, 3), F)
    with pytest.raises(KernelError, match="channel mismatch"):
        k(x, w, group=3)
    with pytest.raises(KernelError, match="auto_pad='SAME'"):
        k(x, w, auto_pad="SAME")
    with pytest.raises(KernelError, match="negative output size"):
        k(x, w, pads=(4, 4, 4, 4))
    with pytest.raises(KernelError, match="strides"):
        k(x, w, strides=(2,))


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[5], CASES[6], CASES[7], CASES[10], CASES[12]],
                         ids=lambda c: str(c["attrs"]))
def test_backward(case):
    x = RNG.standard_normal(case["x"])
    w = RNG.standard_normal(case["w"])
    b = RNG.standard_normal(case["w"][1] * case["attrs"].get("group", 1))
    check_backward("ConvTranspose", [x, w, b], case["attrs"], opset=22)


# ------------------------------------------------------------------- Col2Im

@pytest.mark.parametrize("image,block,attrs", [
    ((5, 5), (2, 2), {}),
    ((6, 7), (3, 2), dict(strides=(2, 1), pads=(1, 0, 1, 1), dilations=(1, 2))),
    ((4, 5, 6), (2, 2, 3), dict(strides=(1, 2, 2))),
])
def test_col2im_is_the_adjoint_of_im2col(image, block, attrs):
    """Col2Im sums the blocks im2col cuts out: <Col2Im(c), x> == <c, im2col(x)>."""
    from edgeflow.kernels import spatial
    from edgeflow.kernels.conv import im2col

    n = len(image)
    g = spatial.resolve(image, block, strides=attrs.get("strides"), dilations=attrs.get("dilations"),
                        pads=attrs.get("pads"))
    c = 2
    cols = RNG.standard_normal((1, c * int(np.prod(block)), int(np.prod(g.out_shape))))
    x = RNG.standard_normal((1, c) + image)
    got = get_kernel("Col2Im", opset=18)(cols, np.array(image), np.array(block), **attrs)
    assert got.shape == (1, c) + image
    ref = im2col(x, g, 1).reshape(cols.shape)
    np.testing.assert_allclose(np.sum(got * x), np.sum(cols * ref), rtol=1e-10)
    assert n == len(got.shape) - 2


def test_col2im_block_count_is_checked():
    with pytest.raises(KernelError, match="blocks given"):
        get_kernel("Col2Im", opset=18)(np.zeros((1, 4, 5), F), np.array([4, 4]), np.array([2, 2]))


# ------------------------------------------------------------------- DeformConv

@pytest.mark.parametrize("attrs,og,with_mask", [
    ({}, 1, False),
    (dict(pads=[1, 1, 1, 1]), 2, True),
    (dict(strides=[2, 1], dilations=[1, 2], pads=[0, 1, 1, 0]), 1, True),
    (dict(group=2, pads=[1, 1, 1, 1]), 2, False),
], ids=str)
def test_deform_conv_matches_onnxruntime(attrs, og, with_mask):
    x = RNG.standard_normal((2, 4, 6, 7)).astype(F)
    group = attrs.get("group", 1)
    w = RNG.standard_normal((6, 4 // group, 3, 3)).astype(F)
    kh = kw = 3
    sh, sw = attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    pt, pl, pb, pr = attrs.get("pads", [0, 0, 0, 0])
    oh = (6 + pt + pb - ((kh - 1) * dh + 1)) // sh + 1
    ow = (7 + pl + pr - ((kw - 1) * dw + 1)) // sw + 1
    off = (RNG.standard_normal((2, og * 2 * kh * kw, oh, ow)) * 1.5).astype(F)
    consts = {"w": w, "off": off, "b": RNG.standard_normal(6).astype(F)}
    order = ["x", "w", "off", "b"]
    if with_mask:
        consts["m"] = RNG.random((2, og * kh * kw, oh, ow)).astype(F)
        order.append("m")
    m = one_node_model("DeformConv", {"x": x}, consts, opset=19, input_order=order, offset_group=og, **attrs)
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-4)


def test_deform_conv_with_zero_offsets_is_conv():
    x = RNG.standard_normal((1, 3, 5, 5))
    w = RNG.standard_normal((4, 3, 3, 3))
    off = np.zeros((1, 18, 5, 5))
    y = get_kernel("DeformConv", opset=19, dtype="float64")(x, w, off, pads=(1, 1, 1, 1))
    np.testing.assert_allclose(y, get_kernel("Conv", opset=19, dtype="float64")(x, w, pads=(1, 1, 1, 1)), rtol=1e-12)
