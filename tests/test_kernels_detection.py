"""NonMaxSuppression and RoiAlign against onnxruntime on random boxes."""

from __future__ import annotations

import numpy as np
import pytest
from _nn_check import assert_matches_ort, one_node_model

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(17)
F = np.float32


def _boxes(b, n, center):
    xy = RNG.uniform(0, 10, (b, n, 2))
    wh = RNG.uniform(0.5, 4, (b, n, 2))
    if center:
        return np.concatenate([xy, wh], axis=2).astype(F)
    # (y1, x1, y2, x2), some with the corners flipped
    y1x1 = xy[..., ::-1]
    y2x2 = y1x1 + wh[..., ::-1]
    flip = RNG.random((b, n, 1)) < 0.3
    return np.where(flip, np.concatenate([y2x2, y1x1], 2), np.concatenate([y1x1, y2x2], 2)).astype(F)


@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("max_out,iou,score", [(5, 0.3, None), (50, 0.5, 0.4), (3, 0.0, 0.2), (100, 0.7, None)])
def test_nms_matches_onnxruntime(center, max_out, iou, score):
    b, c, n = 2, 3, 40
    boxes = _boxes(b, n, center)
    scores = RNG.random((b, c, n)).astype(F)
    scores[0, 0, 5:9] = scores[0, 0, 4]  # ties: the lower index goes first
    consts = {"m": np.array([max_out], np.int64), "i": np.array([iou], F)}
    order = ["boxes", "scores", "m", "i"]
    if score is not None:
        consts["s"] = np.array([score], F)
        order.append("s")
    m = one_node_model("NonMaxSuppression", {"boxes": boxes, "scores": scores}, consts, opset=11, input_order=order,
                       center_point_box=center, out_types=[np.int64])
    assert_matches_ort(m, {"boxes": boxes, "scores": scores})


def test_nms_defaults_select_nothing():
    k = get_kernel("NonMaxSuppression", opset=11)
    out = k(_boxes(1, 4, 0), RNG.random((1, 1, 4)).astype(F))
    assert out.shape == (0, 3) and out.dtype == np.int64


def test_nms_zero_area_boxes_never_suppress():
    k = get_kernel("NonMaxSuppression", opset=11)
    boxes = np.array([[[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1]]], F)
    scores = np.array([[[0.9, 0.8, 0.7]]], F)
    sel = k(boxes, scores, np.array([10]), np.array([0.5], F))
    assert sel[:, 2].tolist() == [0, 1]


def test_nms_bad_shapes():
    with pytest.raises(KernelError, match="boxes"):
        get_kernel("NonMaxSuppression", opset=11)(np.zeros((1, 4, 3), F), np.zeros((1, 1, 4), F))


@pytest.mark.parametrize("opset,ctm", [(10, None), (16, "half_pixel"), (16, "output_half_pixel")])
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("sampling", [0, 2])
def test_roi_align_matches_onnxruntime(opset, ctm, mode, sampling):
    x = RNG.standard_normal((2, 3, 10, 12)).astype(F)
    rois = np.array([[0, 0, 9, 9], [1.5, 2.2, 7.1, 8.9], [3, 3, 3.5, 4], [-2, -1, 13, 11], [5, 5, 30, 25]], F)
    bidx = np.array([0, 1, 1, 0, 1], np.int64)
    attrs = dict(mode=mode, output_height=3, output_width=4, sampling_ratio=sampling, spatial_scale=0.8)
    if ctm:
        attrs["coordinate_transformation_mode"] = ctm
    m = one_node_model("RoiAlign", {"x": x}, {"r": rois, "b": bidx}, opset=opset, **attrs)
    assert_matches_ort(m, {"x": x}, rtol=1e-4, atol=1e-5)


def test_roi_align_bad_batch_index():
    with pytest.raises(KernelError, match="batch_indices"):
        get_kernel("RoiAlign", opset=16)(np.zeros((1, 1, 4, 4), F), np.zeros((1, 4), F), np.array([3]))
