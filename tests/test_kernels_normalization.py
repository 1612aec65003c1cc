"""Normalization kernels against onnxruntime (all outputs, axes, opset forms)
and their backwards against float64 finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from _nn_check import assert_matches_ort, one_node_model
from test_backward_kernels import check_backward

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(31)
F = np.float32


@pytest.mark.parametrize("shape,axis", [((2, 3, 4, 5), -1), ((2, 3, 4, 5), 1), ((2, 3, 4, 5), 0), ((6, 7), -1),
                                        ((3, 5, 8), 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_layer_normalization_all_outputs(shape, axis, bias):
    x = RNG.standard_normal(shape).astype(F)
    norm = shape[axis % len(shape):]
    consts = {"s": RNG.standard_normal(norm).astype(F)}
    if bias:
        consts["b"] = RNG.standard_normal(norm).astype(F)
    m = one_node_model("LayerNormalization", {"x": x}, consts, opset=17, n_outputs=3, axis=axis, epsilon=1e-3)
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-5)


def test_layer_normalization_float16_keeps_float32_statistics():
    x = RNG.standard_normal((2, 8)).astype(np.float16)
    y, mean, inv = get_kernel("LayerNormalization", opset=17, dtype="float16")(
        x, np.ones(8, np.float16), n_outputs=3)
    assert y.dtype == np.float16 and mean.dtype == np.float32 and inv.dtype == np.float32
    m = one_node_model("LayerNormalization", {"x": x}, {"s": np.ones(8, np.float16)}, opset=17)
    assert_matches_ort(m, {"x": x}, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("opset,groups", [(18, 2), (18, 4), (21, 2), (21, 1)])
def test_group_normalization_both_forms(opset, groups):
    x = RNG.standard_normal((2, 4, 3, 5)).astype(F)
    n = groups if opset == 18 else 4
    consts = {"s": RNG.standard_normal(n).astype(F), "b": RNG.standard_normal(n).astype(F)}
    m = one_node_model("GroupNormalization", {"x": x}, consts, opset=opset, num_groups=groups, epsilon=1e-4)
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-5)


def test_instance_and_rms_normalization():
    x = RNG.standard_normal((2, 3, 4, 5)).astype(F)
    m = one_node_model("InstanceNormalization", {"x": x},
                       {"s": RNG.standard_normal(3).astype(F), "b": RNG.standard_normal(3).astype(F)}, opset=6)
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-5)
    m = one_node_model("RMSNormalization", {"x": x}, {"s": RNG.standard_normal((4, 5)).astype(F)}, opset=23, axis=2)
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", [1, 3, 5, 9])
def test_lrn(size):
    x = RNG.standard_normal((2, 6, 3, 4)).astype(F)
    m = one_node_model("LRN", {"x": x}, opset=13, size=size, alpha=0.3, beta=0.6, bias=1.5)
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-5)


def test_lrn_even_size_window():
    """onnxruntime takes odd sizes only; the spec's window for size 4 is c-1 .. c+2."""
    x = RNG.standard_normal((1, 6, 2, 2))
    y = get_kernel("LRN", opset=13, dtype="float64")(x, size=4, alpha=0.4, beta=0.7, bias=1.2)
    sq = np.stack([np.sum(x[:, max(0, c - 1):c + 3] ** 2, axis=1) for c in range(6)], axis=1)
    np.testing.assert_allclose(y, x / (1.2 + 0.4 / 4 * sq) ** 0.7, rtol=1e-12)


@pytest.mark.parametrize("axes", [(0, 2, 3), (1,), (2, 3)])
def test_mean_variance_normalization(axes):
    x = RNG.standard_normal((2, 3, 4, 5)).astype(F)
    m = one_node_model("MeanVarianceNormalization", {"x": x}, opset=13, axes=list(axes))
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_lp_normalization(p, axis):
    x = RNG.standard_normal((3, 4, 5)).astype(F)
    x[0, 0] = 0  # a zero row stays zero
    m = one_node_model("LpNormalization", {"x": x}, opset=1, p=p, axis=axis)
    assert_matches_ort(m, {"x": x}, rtol=1e-5, atol=1e-6)


def test_bad_attributes():
    with pytest.raises(KernelError, match="axis 3 is out of range"):
        get_kernel("LayerNormalization", opset=17)(np.zeros((2, 3), F), np.ones(3, F), axis=3)
    with pytest.raises(KernelError, match="num_groups=3"):
        get_kernel("GroupNormalization", opset=21)(np.zeros((1, 4, 2), F), np.ones(4, F), np.ones(4, F), num_groups=3)
    with pytest.raises(KernelError, match="p=3"):
        get_kernel("LpNormalization", opset=1)(np.zeros((2, 3), F), p=3)
    with pytest.raises(KernelError, match="size"):
        get_kernel("LRN", opset=13)(np.zeros((1, 3, 2, 2), F))


# ------------------------------------------------------------------- backward

def r(*shape):
    return np.asarray(RNG.standard_normal(shape))


@pytest.mark.parametrize("shape,axis", [((3, 5), -1), ((2, 3, 4), 1), ((2, 3, 4), -1)])
def test_layer_normalization_backward(shape, axis):
    norm = shape[axis % len(shape):]
    check_backward("LayerNormalization", [r(*shape), r(*norm), r(*norm)], dict(axis=axis, epsilon=1e-3))
    check_backward("LayerNormalization", [r(*shape), r(*norm)], dict(axis=axis))


def test_layer_normalization_backward_broadcast_scale():
    check_backward("LayerNormalization", [r(2, 3, 4), r(1, 4), r(4)], dict(axis=1))


def test_rms_instance_group_backward():
    check_backward("RMSNormalization", [r(2, 3, 4), r(4)], dict(axis=-1), opset=23)
    check_backward("InstanceNormalization", [r(2, 3, 4, 2), r(3), r(3)], dict(epsilon=1e-3), opset=17)
    check_backward("GroupNormalization", [r(2, 4, 3), r(4), r(4)], dict(num_groups=2, epsilon=1e-3), opset=21)
    check_backward("GroupNormalization", [r(2, 4, 3), r(2), r(2)], dict(num_groups=2, epsilon=1e-3), opset=18)
