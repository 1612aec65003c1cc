"""LpPool and MaxUnpool against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from _nn_check import assert_matches_ort, one_node_model
from onnx import TensorProto, helper

RNG = np.random.default_rng(8)
F = np.float32


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[3, 3]),
    dict(kernel_shape=[2, 3], strides=[2, 1], pads=[1, 0, 1, 2]),
    dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2]),
    dict(kernel_shape=[3, 2], ceil_mode=1, strides=[2, 2]),
    dict(kernel_shape=[2, 2], dilations=[2, 2]),
], ids=str)
def test_lp_pool(p, attrs):
    x = RNG.standard_normal((2, 3, 7, 8)).astype(F)
    m = one_node_model("LpPool", {"x": x}, opset=18, p=p, **attrs)
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-5)


def test_lp_pool_1d_and_3d():
    for shape, k in (((1, 2, 9), [3]), ((1, 2, 4, 5, 6), [2, 2, 3])):
        x = RNG.standard_normal(shape).astype(F)
        assert_matches_ort(one_node_model("LpPool", {"x": x}, opset=18, kernel_shape=k), {"x": x}, rtol=1e-4)


@pytest.mark.parametrize("out_shape", [None, [1, 2, 6, 8]])
def test_max_unpool_after_max_pool(out_shape):
    """MaxPool's indices drive MaxUnpool, the way a SegNet decoder uses them."""
    x = RNG.standard_normal((1, 2, 6, 8)).astype(F)
    nodes = [helper.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("MaxUnpool", ["p", "i"] + (["s"] if out_shape else []), ["y"],
                              kernel_shape=[2, 2], strides=[2, 2])]
    inits = [helper.make_tensor("s", TensorProto.INT64, [4], out_shape)] if out_shape else []
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    assert_matches_ort(m, {"x": x})


def test_max_unpool_larger_output_shape_follows_the_onnx_data():
    """With an output_shape larger than the unpooled shape the ONNX test data
    (and onnx.reference) keep the indices' coordinates in the unpooled shape
    and zero-extend; onnxruntime re-reads them as flat indices of the larger
    shape. The numpy backend follows the conformance data."""
    from edgeflow.kernels import get_kernel

    x = np.array([5, 6, 7, 8], F).reshape(1, 1, 2, 2)
    i = np.array([5, 7, 13, 15], np.int64).reshape(1, 1, 2, 2)
    y = get_kernel("MaxUnpool", opset=11)(x, i, np.array([1, 1, 5, 5]), kernel_shape=[2, 2], strides=[2, 2])
    want = np.zeros((5, 5), F)
    want[1, 1], want[1, 3], want[3, 1], want[3, 3] = 5, 6, 7, 8
    np.testing.assert_array_equal(y[0, 0], want)
