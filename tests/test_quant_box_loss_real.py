"""The quantize gate's box loss on a real detector: ddddocr's YOLOX-style text detector
(common_det.onnx, raw head (1, 3549, 6)) quantized with ``loss="yolox"`` on pages of drawn digits."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edgeflow.quantization import quantize
from edgeflow.quantization.boxes import box_agreement, decode_yolox, detections, iou_matrix

from _ddddocr import digits_page, fetch

ort = pytest.importorskip("onnxruntime")


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return np.concatenate([s.run(None, {"images": x[i:i + 1]})[0] for i in range(len(x))])


def test_the_gate_judges_a_yolox_detector_by_its_boxes():
    path = fetch("ddddocr-det")
    fp32 = onnx.load(str(path))
    cal = np.concatenate([digits_page(100 + i)[0] for i in range(6)])
    pages = [digits_page(i) for i in range(6)]
    ev = np.concatenate([p[0] for p in pages])
    ref = _run(fp32, ev)
    # the input is real: fp32 finds at least 4 of the 5 drawn digits on every page, each box on a digit
    found = 0
    for out, (_, truth) in zip(decode_yolox(ref), pages):
        det = detections(out)
        assert len(det) >= 4 and np.all(iou_matrix(det, truth).max(axis=1) >= 0.5)
        found += len(det)

    r = quantize(str(path), "raspberry-pi-4", {"images": cal}, eval_data={"images": ev}, loss="yolox",
                 backend="ort", batch_size=1)
    gate = r.report.gate
    assert gate.choice == "int8" and gate.loss <= gate.max_loss
    # the loss the gate reports is the boxes' loss of the model it wrote, recomputed here
    got = _run(r.model, ev)
    agreement = box_agreement(ref, got, "yolox")
    assert agreement.ref_boxes == found and gate.loss == pytest.approx(agreement.loss)
    assert gate.evidence is not None and gate.evidence.samples == 6
    assert gate.evidence.detail == agreement.format()
    lines = gate.format()
    print("\n".join(lines))  # the figures docs/quantization.md quotes
    assert "boxes kept (IoU >= 0.5)" in "\n".join(lines)
