"""GridSample and AffineGrid against onnxruntime over modes, padding modes,
align_corners and ranks, with grids reaching well outside the image."""

from __future__ import annotations

import numpy as np
import pytest
from _nn_check import assert_matches_ort, one_node_model

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(3)
F = np.float32


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_2d(mode, padding, align):
    x = RNG.standard_normal((2, 3, 5, 7)).astype(F)
    grid = (RNG.uniform(-1.6, 1.6, (2, 4, 6, 2))).astype(F)
    m = one_node_model("GridSample", {"x": x, "g": grid}, opset=20, mode=mode, padding_mode=padding,
                       align_corners=align)
    assert_matches_ort(m, {"x": x, "g": grid}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_opset_16_names(mode):
    x = RNG.standard_normal((1, 2, 4, 4)).astype(F)
    grid = RNG.uniform(-1.2, 1.2, (1, 3, 3, 2)).astype(F)
    m = one_node_model("GridSample", {"x": x, "g": grid}, opset=16, mode=mode)
    assert_matches_ort(m, {"x": x, "g": grid}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_3d(mode, padding, align):
    x = RNG.standard_normal((1, 2, 3, 4, 5)).astype(F)
    grid = RNG.uniform(-1.4, 1.4, (1, 2, 3, 4, 3)).astype(F)
    m = one_node_model("GridSample", {"x": x, "g": grid}, opset=20, mode=mode, padding_mode=padding,
                       align_corners=align)
    assert_matches_ort(m, {"x": x, "g": grid}, rtol=1e-4, atol=1e-5)


def test_grid_sample_identity_grid_returns_the_input():
    x = RNG.standard_normal((1, 2, 4, 5)).astype(F)
    theta = np.array([[[1, 0, 0], [0, 1, 0]]], F)
    grid = get_kernel("AffineGrid", opset=20)(theta, np.array([1, 2, 4, 5]), align_corners=0)
    y = get_kernel("GridSample", opset=20)(x, grid, mode="linear")
    np.testing.assert_allclose(y, x, atol=1e-6)


def test_grid_sample_errors():
    k = get_kernel("GridSample", opset=20)
    with pytest.raises(KernelError, match="needs a grid"):
        k(np.zeros((1, 1, 4, 4), F), np.zeros((1, 3, 3, 3), F))
    with pytest.raises(KernelError, match="mode='bilinear'"):
        k(np.zeros((1, 1, 4, 4), F), np.zeros((1, 3, 3, 2), F), mode="bilinear")


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 1, 3, 4, 2)])
def test_affine_grid(align, size):
    n_sp = len(size) - 2
    theta = RNG.standard_normal((2, n_sp, n_sp + 1)).astype(F)
    m = one_node_model("AffineGrid", {"t": theta}, {"s": np.array(size, np.int64)}, opset=20, align_corners=align)
    assert_matches_ort(m, {"t": theta}, rtol=1e-5, atol=1e-6)
