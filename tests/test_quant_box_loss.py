"""The quantize gate's detection-box loss (``--loss boxes`` / ``--loss yolox``): synthetic box
arrays with answers worked out by hand, hostile outputs refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.errors import QuantizationError
from edgeflow.quantization.boxes import box_agreement, decode_yolox, detections, yolox_grid
from edgeflow.quantization.gate import LOSS_MEASURES, agreement_evidence, changed_samples, loss_percent


def _out(*boxes, anchors=8, classes=1):
    """(1, anchors, 5 + classes): the given (cx, cy, w, h, score) rows, the rest background."""
    o = np.zeros((1, anchors, 5 + classes), np.float32)
    o[0, :, :4] = [500, 500, 1, 1]  # background rows: tiny boxes far away, score 0
    for i, (cx, cy, w, h, s) in enumerate(boxes):
        o[0, i, :5] = [cx, cy, w, h, 1.0]
        o[0, i, 5:] = s
    return o


FOUR = [(20, 20, 10, 10, 0.9), (60, 20, 10, 10, 0.8), (20, 60, 10, 10, 0.7), (60, 60, 10, 10, 0.6)]


def test_the_measures_are_offered():
    assert {"boxes", "yolox"} <= set(LOSS_MEASURES)


def test_identical_detections_lose_nothing():
    a = box_agreement(_out(*FOUR), _out(*FOUR))
    assert (a.ref_boxes, a.got_boxes, a.matched, a.kept_pct, a.loss, a.mean_iou) == (4, 4, 4, 100.0, 0.0, 1.0)
    assert loss_percent(_out(*FOUR), _out(*FOUR), measure="boxes") == 0.0


def test_a_box_moved_past_iou_half_is_lost_a_small_shift_is_kept_with_its_iou():
    moved = list(FOUR)
    moved[1] = (66, 20, 10, 10, 0.8)  # 6 px right: overlap 4 x 10 = 40, union 160 -> IoU 0.25 < 0.5
    moved[2] = (22, 60, 10, 10, 0.7)  # 2 px right: overlap 80, union 120 -> IoU 2/3
    a = box_agreement(_out(*FOUR), _out(*moved))
    assert (a.matched, a.kept_pct, a.loss) == (3, 75.0, 25.0)
    assert a.mean_iou == pytest.approx((1 + 1 + 2 / 3) / 3)
    assert a.samples_changed == 1
    assert "75.0% of fp32's 4 boxes kept" in a.format() and "mean IoU 0.889" in a.format()


def test_a_box_int8_makes_up_costs_as_much_as_one_it_loses():
    extra = FOUR + [(150, 150, 10, 10, 0.9)]
    a = box_agreement(_out(*FOUR), _out(*extra))
    assert (a.ref_boxes, a.got_boxes, a.matched, a.kept_pct, a.loss) == (4, 5, 4, 100.0, 20.0)


def test_scores_under_the_threshold_and_nms_duplicates_are_not_boxes():
    ref = _out(*FOUR)
    got = _out(*FOUR[:3], (60, 60, 10, 10, 0.2),  # the 4th box's score fell under 0.25: lost
               (21, 20, 10, 10, 0.5))  # a duplicate of box 1 (IoU 0.82 > 0.45): suppressed by NMS
    assert len(detections(decode_yolox(np.zeros((1, 3549, 6)))[0])) == 0
    a = box_agreement(ref, got)
    assert (a.got_boxes, a.matched, a.loss) == (3, 3, 25.0)


def test_objectness_times_the_best_class_is_the_score():
    o = _out((20, 20, 10, 10, 0.9), classes=3)
    o[0, 0, 4] = 0.3  # objectness 0.3 x class 0.9 = 0.27 >= 0.25: kept
    assert len(detections(o[0])) == 1
    o[0, 0, 4] = 0.2  # 0.18: dropped
    assert len(detections(o[0])) == 0


def test_the_loss_pools_boxes_over_samples_and_empty_samples_cost_nothing():
    ref = np.concatenate([_out(*FOUR), _out(), _out(*FOUR[:2])])
    got = np.concatenate([_out(*FOUR), _out(), _out(*FOUR[:1])])
    assert loss_percent(ref, got, measure="boxes") == pytest.approx(100 - 100 * 5 / 6)
    assert changed_samples(ref, got, "boxes") == 1
    ev = agreement_evidence(3, changed_samples(ref, got, "boxes"), 1.0)
    assert ev.failed == 1 and not ev.enough


def test_yolox_raw_head_is_grid_decoded_with_strides_8_16_32():
    grid, stride = yolox_grid(3549)  # 416 x 416: 52^2 + 26^2 + 13^2
    assert grid.shape == (3549, 2) and stride[0, 0] == 8 and stride[-1, 0] == 32
    raw = np.zeros((1, 3549, 6), np.float32)
    i = 2 * 52 + 3  # stride-8 cell x = 3, y = 2
    raw[0, i] = [0.5, 0.25, np.log(4.0), np.log(2.0), 1.0, 0.9]
    j = 52 * 52 + 26 * 26 + 12 * 13 + 12  # the last stride-32 cell, x = y = 12
    raw[0, j] = [0.0, 0.0, 0.0, 0.0, 1.0, 0.9]
    d = decode_yolox(raw)[0]
    np.testing.assert_allclose(d[i, :4], [(0.5 + 3) * 8, (0.25 + 2) * 8, 32, 16], rtol=1e-6)
    np.testing.assert_allclose(d[j, :4], [12 * 32, 12 * 32, 32, 32], rtol=1e-6)
    moved = raw.copy()
    moved[0, i, 0] += 3.0  # 24 px to the right of a 32 px wide box: IoU (8 * 16) / (2 * 512 - 128) = 1/7
    a = box_agreement(raw, moved, "yolox")
    assert (a.ref_boxes, a.matched, a.loss) == (2, 1, 50.0)
    assert loss_percent(raw, raw, measure="yolox") == 0.0


@pytest.mark.parametrize("measure, out, words", [
    ("boxes", np.zeros((2, 4), np.float32), "needs detections (N, anchors, 5 + classes)"),
    ("boxes", np.zeros((2, 10, 4), np.float32), "the model's first output is (2, 10, 4)"),
    ("yolox", np.zeros((1, 3548, 6), np.float32), "3548 anchors are not the stride-8/16/32 grids"),
])
def test_outputs_that_are_not_detections_are_refused_in_one_line(measure, out, words):
    with pytest.raises(QuantizationError) as ei:
        loss_percent(out, out, measure=measure)
    assert words in str(ei.value) and "\n" not in str(ei.value)


def test_the_cli_refuses_boxes_on_a_classifier_in_one_line(tmp_path):
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from _cli import one_clear_line

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((10, 16)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 10])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "m.onnx")
    np.save(tmp_path / "cal.npy", rng.standard_normal((12, 10)).astype(np.float32))
    out = subprocess.run([sys.executable, "-m", "edgeflow", "quantize", str(tmp_path / "m.onnx"), "--profile",
                          "raspberry-pi-4", "--calibration", str(tmp_path / "cal.npy"), "--loss", "boxes",
                          "-o", str(tmp_path / "q.onnx")], capture_output=True, text=True, timeout=600)
    one_clear_line(out, "--loss boxes needs detections (N, anchors, 5 + classes)", "(2, 16)")
    assert not (tmp_path / "q.onnx").exists()
