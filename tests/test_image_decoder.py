"""ImageDecoder through Pillow (registered only where Pillow is installed)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from edgeflow.data import image_decoder
from edgeflow.runtime.backends.numpy_backend import NumpyBackend
from edgeflow.errors import BackendError
from edgeflow.runtime.graph import unsupported_ops
from edgeflow.runtime.model import load_model

pytest.importorskip("PIL")


def decoder_model(pixel_format):
    g = h.make_graph([h.make_node("ImageDecoder", ["data"], ["img"], name="dec", pixel_format=pixel_format)], "g",
                     [h.make_tensor_value_info("data", T.UINT8, ["n"])],
                     [h.make_tensor_value_info("img", T.UINT8, ["h", "w", "c"])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 20)])


def test_frozen_onnx_images_decode_exactly():
    # onnx ships these encoded images with their decoded pixels (made by
    # its own tooling); they are independent of the Pillow installed here.
    from onnx.backend.test.case.node import _image_decoder_data as frozen

    names = [n for n in dir(frozen) if n.startswith("image_decoder_")]
    assert len(names) >= 8
    sessions = {f: NumpyBackend().load(load_model(decoder_model(f))) for f in ("RGB", "BGR", "Grayscale")}
    for name in names:
        case = getattr(frozen, name)
        fmt = "BGR" if name.endswith("_bgr") else "Grayscale" if name.endswith("_grayscale") else "RGB"
        got = sessions[fmt].run({"data": np.asarray(case.data, np.uint8)})["img"]
        np.testing.assert_array_equal(got, np.asarray(case.output), err_msg=name)


def test_undecodable_bytes_fail_with_one_line():
    sess = NumpyBackend().load(load_model(decoder_model("RGB")))
    with pytest.raises(BackendError) as ei:
        sess.run({"data": np.frombuffer(b"not an image", np.uint8)})
    msg = str(ei.value)
    assert msg.startswith("node 'dec' (ImageDecoder) failed") and "cannot decode the 12-byte input" in msg
    assert "\n" not in msg


def test_the_op_is_supported_exactly_when_pillow_is_there():
    assert image_decoder.AVAILABLE
    assert unsupported_ops(decoder_model("RGB")) == []
