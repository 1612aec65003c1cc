"""The kernel registry: lookup by op, opset and dtype, with errors that say what exists."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.kernels import KernelError, UnknownOpError, get_kernel, register, supported_ops
from edgeflow.kernels import registry


def test_opset_versions_pick_highest_not_above_model():
    assert get_kernel("Softmax", opset=11).since == 1
    assert get_kernel("Softmax", opset=13).since == 13
    assert get_kernel("Squeeze", opset=12).attributes == ("axes",)
    assert get_kernel("Squeeze", opset=13).attributes == ()


def test_softmax_semantics_differ_across_opsets():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    old = get_kernel("Softmax", opset=11)(x)  # over the flattened (3, 4) block
    new = get_kernel("Softmax", opset=13)(x)  # over the last axis
    np.testing.assert_allclose(old.reshape(2, -1).sum(1), 1, rtol=1e-6)
    np.testing.assert_allclose(new.sum(-1), 1, rtol=1e-6)
    assert not np.allclose(old, new)


def test_errors_say_what_exists():
    with pytest.raises(UnknownOpError, match="no kernel for op ai.onnx::Frobnicate"):
        get_kernel("Frobnicate")
    with pytest.raises(UnknownOpError, match="has no kernel for dtype complex64; implemented for: float16, float32, float64"):
        get_kernel("Conv", opset=17, dtype=np.complex64)


def test_duplicate_registration_refused():
    with pytest.raises(KernelError, match="registered twice"):
        register("Relu")(lambda x: x)


def test_attributes_are_keyword_only_params():
    k = get_kernel("Conv", opset=17)
    assert set(k.attributes) == {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"}


def test_kernels_import_only_numpy():
    # the kernel library stands alone: check the modules' globals
    for op in supported_ops():
        for k in registry.kernels_for(op):
            mod = k.forward.__module__
            # the library is numpy-only; ImageDecoder needs Pillow, so it registers itself from
            # edgeflow.data.image_decoder (outside the library) where Pillow is installed
            assert mod.startswith("edgeflow.kernels") or mod == "edgeflow.data.image_decoder", mod
