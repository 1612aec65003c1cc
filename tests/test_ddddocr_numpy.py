"""ddddocr's default captcha OCR (a dynamically quantized CNN + BiLSTM with
com.microsoft::DynamicQuantizeLSTM) runs on the numpy backend and reads what
onnxruntime reads (issue 30: it used to be refused for that one op)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edgeflow.runtime.backends import SessionOptions, get_backend

from _ddddocr import captcha, charset_old, ctc_text, fetch

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def model():
    return onnx.load(str(fetch("ddddocr-ocr-old")))


def test_the_default_model_is_the_one_with_dynamic_quantize_lstm(model):
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert ("com.microsoft", "DynamicQuantizeLSTM") in ops and ("", "ConvInteger") in ops


def test_numpy_reads_the_captchas_as_onnxruntime_does(model):
    charset = charset_old()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    ref_sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ours = get_backend("numpy").load(model, SessionOptions(threads=1))
    out = ref_sess.get_outputs()[0].name
    for text in ("a3k9x", "pyth0n", "edge42"):
        x = captcha(text)
        ref = ref_sess.run(None, {"input1": x})[0]
        got = ours.run({"input1": x})[out]
        assert got.shape == ref.shape
        assert ctc_text(ref, charset) == text  # the input is real: onnxruntime reads it right
        assert ctc_text(got, charset) == text
        # the ConvInteger/DynamicQuantizeLinear chain may round one activation step differently
        assert np.abs(got - ref).max() <= 0.01 * np.abs(ref).max()
