"""Pad, CenterCropPad, DepthToSpace and SpaceToDepth against onnxruntime,
and their backwards against float64 finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from _nn_check import assert_matches_ort, one_node_model, run_numpy
from test_backward_kernels import check_backward

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(13)
F = np.float32
PADS = [[0, 2, 1, 0, 1, 3], [1, 0, 0, 2, 1, 1], [0, -1, 2, 0, 3, -2], [0, 0, 0, 0, 0, 0], [-1, 1, 0, 1, 0, 0]]


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", PADS, ids=str)
def test_pad_matches_onnxruntime(mode, pads):
    x = RNG.standard_normal((3, 4, 5)).astype(F)
    consts = {"p": np.array(pads, np.int64)}
    if mode == "constant":
        consts["v"] = np.array(1.5, F)
    m = one_node_model("Pad", {"x": x}, consts, opset=19, mode=mode)
    if mode == "reflect" and pads == PADS[2]:
        # onnxruntime refuses a reflection wider than the (cropped) axis; the
        # numpy backend keeps reflecting, np.pad's rule (which onnx.reference uses)
        crop = x[:, 1:, :3]  # the negative pads first
        want = np.pad(crop, [(0, 0), (0, 3), (2, 0)], mode="reflect")
        np.testing.assert_array_equal(run_numpy(m, {"x": x})[0], want)
        return
    assert_matches_ort(m, {"x": x})


@pytest.mark.parametrize("axes", [[1], [0, 2], [-1, -3]], ids=str)
def test_pad_axes_input(axes):
    x = RNG.standard_normal((3, 4, 5)).astype(F)
    pads = np.array([1] * len(axes) + [2] * len(axes), np.int64)
    m = one_node_model("Pad", {"x": x}, {"p": pads, "v": np.array(0, F), "a": np.array(axes, np.int64)}, opset=18,
                       mode="edge")
    assert_matches_ort(m, {"x": x})


def test_pad_attribute_form_and_integer_types():
    x = RNG.integers(-5, 5, (2, 3)).astype(np.int32)
    m = one_node_model("Pad", {"x": x}, {"p": np.array([1, 0, 0, 2], np.int64), "v": np.array(7, np.int32)},
                       opset=11)
    assert_matches_ort(m, {"x": x})
    xf = x.astype(F)
    m = one_node_model("Pad", {"x": xf}, opset=2, pads=[1, 0, 0, 2], value=7.0, mode="constant")
    assert_matches_ort(m, {"x": xf})
    b = RNG.random((2, 3)) > 0.5
    y = get_kernel("Pad", opset=13, dtype="bool")(b, np.array([0, 1, 0, 1]))
    assert y.dtype == np.bool_ and y.shape == (2, 5) and not y[:, 0].any()


def test_pad_errors():
    k = get_kernel("Pad", opset=18)
    x = np.zeros((2, 3), F)
    with pytest.raises(KernelError, match="pads has 3 values"):
        k(x, np.array([1, 1, 1]))
    with pytest.raises(KernelError, match="mode='mirror'"):
        k(x, np.array([1, 1, 1, 1]), mode="mirror")
    with pytest.raises(KernelError, match="below zero"):
        k(x, np.array([-2, 0, -1, 0]))
    with pytest.raises(KernelError, match="empty after cropping"):
        k(x, np.array([-2, 0, 1, 0]), mode="edge")


@pytest.mark.parametrize("shape", [[4, 4], [2, 7], [5, 2]], ids=str)
def test_center_crop_pad(shape):
    x = RNG.standard_normal((3, 4, 5)).astype(F)
    m = one_node_model("CenterCropPad", {"x": x}, {"s": np.array(shape, np.int64)}, opset=18, axes=[1, 2])
    got = get_kernel("CenterCropPad", opset=18)(x, np.array(shape), axes=(1, 2))
    assert got.shape == (3, *shape)
    assert_matches_ort(m, {"x": x})


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("bs", [2, 3])
def test_depth_space_round_trip_and_onnxruntime(mode, bs):
    x = RNG.standard_normal((2, 2 * bs * bs, 3, 4)).astype(F)
    m = one_node_model("DepthToSpace", {"x": x}, opset=13, blocksize=bs, mode=mode)
    assert_matches_ort(m, {"x": x})
    y = get_kernel("DepthToSpace", opset=13)(x, blocksize=bs, mode=mode)
    np.testing.assert_array_equal(get_kernel("SpaceToDepth", opset=28)(y, blocksize=bs, mode=mode), x)
    m2 = one_node_model("SpaceToDepth", {"y": y}, opset=13, blocksize=bs)
    assert_matches_ort(m2, {"y": y})


# ------------------------------------------------------------------- backward

@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", [[1, 2, 0, 3], [0, -1, 2, 1], [2, 0, 1, 0]], ids=str)
def test_pad_backward(mode, pads):
    x = RNG.standard_normal((3, 4))
    check_backward("Pad", [x, np.array(pads)], dict(mode=mode), opset=19, wrt=[0])
    check_backward("Pad", [x], dict(mode=mode, pads=tuple(pads)), opset=2, wrt=[0])


def test_pad_backward_axes():
    check_backward("Pad", [RNG.standard_normal((2, 3, 4)), np.array([1, 2]), None, np.array([2])],
                   dict(mode="reflect"), opset=18, wrt=[0])


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_space_backward(mode):
    check_backward("DepthToSpace", [RNG.standard_normal((1, 8, 2, 3))], dict(blocksize=2, mode=mode), opset=13)
    check_backward("SpaceToDepth", [RNG.standard_normal((1, 2, 4, 6))], dict(blocksize=2, mode=mode), opset=28)
