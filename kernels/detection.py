"""Detection ops: NonMaxSuppression (10, 11) and RoiAlign (10, 16, 22).

NonMaxSuppression is greedy by nature; the loop here runs once per *kept*
box (at most ``max_output_boxes_per_class``), each pass suppressing every
remaining candidate whose IoU with the kept box exceeds the threshold in one
vectorised step. Ties in score keep the lower box index first, as the
reference and onnxruntime do.

RoiAlign loops over ROIs only. Bilinear sampling is separable, so for
``mode="avg"`` each ROI is two small matrix products ``My @ X[b] @ Mx^T``
(the sampling weights averaged over each bin folded into My and Mx); for
``mode="max"`` (onnxruntime's definition: the max over a bin's samples of
the largest weighted corner) the four corners are gathered for every sample
at once.
"""

from __future__ import annotations

import numpy as np

from ._nn import OpError, choice
from .registry import FLOAT_TYPES, register


def _corners(boxes: np.ndarray, center_point_box: int):
    """(x_min, y_min, x_max, y_max) of (..., 4) boxes."""
    if center_point_box:
        xc, yc, w, h = boxes[..., 0], boxes[..., 1], boxes[..., 2], boxes[..., 3]
        return xc - w / 2, yc - h / 2, xc + w / 2, yc + h / 2
    y1, x1, y2, x2 = boxes[..., 0], boxes[..., 1], boxes[..., 2], boxes[..., 3]
    return np.minimum(x1, x2), np.minimum(y1, y2), np.maximum(x1, x2), np.maximum(y1, y2)


def _scalar(v, default, kind):
    if v is None or np.size(v) == 0:
        return default
    return kind(np.asarray(v).reshape(-1)[0])


@register("NonMaxSuppression", dtypes=FLOAT_TYPES, since=10)
def non_max_suppression(
    boxes: np.ndarray,
    scores: np.ndarray,
    max_output_boxes_per_class: np.ndarray | None = None,
    iou_threshold: np.ndarray | None = None,
    score_threshold: np.ndarray | None = None,
    *,
    center_point_box: int = 0,
) -> np.ndarray:
    """boxes (B, N, 4), scores (B, C, N) -> selected (K, 3) int64 rows of
    (batch, class, box), per batch and class in order of selection."""
    if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or scores.shape[0] != boxes.shape[0] \
            or scores.shape[2] != boxes.shape[1]:
        raise OpError(f"NonMaxSuppression: boxes (B, N, 4) and scores (B, C, N) expected, got {boxes.shape} and "
                      f"{scores.shape}")
    if center_point_box not in (0, 1):
        raise OpError(f"NonMaxSuppression: center_point_box must be 0 or 1, got {center_point_box}")
    max_out = max(_scalar(max_output_boxes_per_class, 0, int), 0)
    iou_thr = _scalar(iou_threshold, 0.0, float)
    has_score_thr = score_threshold is not None and np.size(score_threshold) > 0
    score_thr = _scalar(score_threshold, 0.0, float)
    rows: list[np.ndarray] = []
    if max_out == 0:
        return np.zeros((0, 3), dtype=np.int64)
    x0, y0, x1, y1 = (a.astype(np.float64) for a in _corners(boxes, center_point_box))
    area = (x1 - x0) * (y1 - y0)
    for b in range(boxes.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[b, c]
            cand = np.flatnonzero(s > score_thr) if has_score_thr else np.arange(s.shape[0])
            if cand.size == 0:
                continue
            cand = cand[np.lexsort((cand, -s[cand].astype(np.float64)))]  # score desc, index asc
            alive = np.ones(cand.size, dtype=bool)
            cx0, cy0, cx1, cy1, ca = x0[b, cand], y0[b, cand], x1[b, cand], y1[b, cand], area[b, cand]
            kept = []
            pos = 0
            while len(kept) < max_out:
                nxt = np.flatnonzero(alive[pos:])
                if nxt.size == 0:
                    break
                i = pos + int(nxt[0])
                kept.append(cand[i])
                alive[i] = False
                pos = i + 1
                if pos >= cand.size:
                    break
                # IoU of the kept box with every later candidate
                iw = np.minimum(cx1[i], cx1[pos:]) - np.maximum(cx0[i], cx0[pos:])
                ih = np.minimum(cy1[i], cy1[pos:]) - np.maximum(cy0[i], cy0[pos:])
                inter = np.where((iw > 0) & (ih > 0), iw * ih, 0.0)
                union = ca[i] + ca[pos:] - inter
                valid = (inter > 0) & (ca[i] > 0) & (ca[pos:] > 0) & (union > 0)
                with np.errstate(divide="ignore", invalid="ignore"):
                    iou = np.where(valid, inter / np.where(union > 0, union, 1), 0.0)
                alive[pos:] &= ~(valid & (iou > iou_thr))
            if kept:
                k = np.asarray(kept, dtype=np.int64)
                rows.append(np.stack([np.full_like(k, b), np.full_like(k, c), k], axis=1))
    return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)


def _sample_axis(start, bin_size, pooled, grid, size):
    """Per sample along one axis: (low, high, w_low, w_high, inside) arrays of length pooled * grid."""
    f = type(start)
    p = np.arange(pooled, dtype=f)[:, None]
    g = np.arange(grid, dtype=f)[None, :]
    v = (start + p * bin_size + (g + f(0.5)) * bin_size / f(grid)).reshape(-1)
    inside = (v >= -1.0) & (v <= size)
    v = np.maximum(v, 0)
    low = v.astype(np.int64)
    at_edge = low >= size - 1
    low = np.where(at_edge, size - 1, low)
    high = np.where(at_edge, size - 1, low + 1)
    v = np.where(at_edge, low.astype(v.dtype), v)
    lw = v - low
    return low, high, 1.0 - lw, lw, inside


def _roi_align(x, rois, batch_indices, mode, output_height, output_width, sampling_ratio, spatial_scale, half_pixel):
    if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 4:
        raise OpError(f"RoiAlign: X (N, C, H, W) and rois (R, 4) expected, got {x.shape} and {rois.shape}")
    bidx = np.asarray(batch_indices).reshape(-1).astype(np.int64)
    if bidx.shape[0] != rois.shape[0] or np.any((bidx < 0) | (bidx >= x.shape[0])):
        raise OpError(f"RoiAlign: batch_indices must hold {rois.shape[0]} indices into a batch of {x.shape[0]}")
    _, c, h, w = x.shape
    oh, ow = int(output_height), int(output_width)
    wd = np.float64 if x.dtype == np.float64 else np.float32
    out = np.zeros((rois.shape[0], c, oh, ow), dtype=wd)
    off = 0.5 if half_pixel else 0.0
    f = wd  # geometry in the input's precision, in onnxruntime's order: the
    # adaptive sample count ceil(roi / bins) flips on the last bit otherwise
    for r in range(rois.shape[0]):
        x0, y0, x1, y1 = (f(v) * f(spatial_scale) - f(off) for v in rois[r])
        rw, rh = x1 - x0, y1 - y0
        if not half_pixel:
            rw, rh = max(rw, f(1)), max(rh, f(1))
        bh, bw = rh / f(oh), rw / f(ow)
        gh = int(sampling_ratio) if sampling_ratio > 0 else int(np.ceil(rh / f(oh)))
        gw = int(sampling_ratio) if sampling_ratio > 0 else int(np.ceil(rw / f(ow)))
        if gh <= 0 or gw <= 0:
            continue
        ylo, yhi, wyl, wyh, iny = _sample_axis(y0, bh, oh, gh, h)
        xlo, xhi, wxl, wxh, inx = _sample_axis(x0, bw, ow, gw, w)
        wyl, wyh = wyl * iny, wyh * iny
        wxl, wxh = wxl * inx, wxh * inx
        img = x[bidx[r]].astype(wd, copy=False)
        if mode == "avg":
            my = np.zeros((oh * gh, h), dtype=wd)
            rows = np.arange(oh * gh)
            np.add.at(my, (rows, ylo), wyl)
            np.add.at(my, (rows, yhi), wyh)
            mx = np.zeros((ow * gw, w), dtype=wd)
            cols = np.arange(ow * gw)
            np.add.at(mx, (cols, xlo), wxl)
            np.add.at(mx, (cols, xhi), wxh)
            my = my.reshape(oh, gh, h).sum(axis=1) / gh
            mx = mx.reshape(ow, gw, w).sum(axis=1) / gw
            out[r] = my @ img @ mx.T  # (C, oh, ow)
        else:
            corners = [
                img[:, ylo[:, None], xlo[None, :]] * (wyl[:, None] * wxl[None, :]),
                img[:, ylo[:, None], xhi[None, :]] * (wyl[:, None] * wxh[None, :]),
                img[:, yhi[:, None], xlo[None, :]] * (wyh[:, None] * wxl[None, :]),
                img[:, yhi[:, None], xhi[None, :]] * (wyh[:, None] * wxh[None, :]),
            ]
            v = np.maximum(np.maximum(corners[0], corners[1]), np.maximum(corners[2], corners[3]))
            out[r] = v.reshape(c, oh, gh, ow, gw).max(axis=(2, 4))
    return out.astype(x.dtype)


@register("RoiAlign", dtypes=FLOAT_TYPES, since=16)
def roi_align(
    x: np.ndarray, rois: np.ndarray, batch_indices: np.ndarray, *, coordinate_transformation_mode: str = "half_pixel",
    mode: str = "avg", output_height: int = 1, output_width: int = 1, sampling_ratio: int = 0,
    spatial_scale: float = 1.0,
) -> np.ndarray:
    ctm = choice("RoiAlign", "coordinate_transformation_mode", coordinate_transformation_mode,
                 ("half_pixel", "output_half_pixel"))
    m = choice("RoiAlign", "mode", mode, ("avg", "max"))
    return _roi_align(x, rois, batch_indices, m, output_height, output_width, sampling_ratio, spatial_scale,
                      ctm == "half_pixel")


@register("RoiAlign", dtypes=FLOAT_TYPES, since=10)
def roi_align_10(
    x: np.ndarray, rois: np.ndarray, batch_indices: np.ndarray, *, mode: str = "avg", output_height: int = 1,
    output_width: int = 1, sampling_ratio: int = 0, spatial_scale: float = 1.0,
) -> np.ndarray:
    """Opset 10: no pixel offset (what opset 16 calls output_half_pixel)."""
    m = choice("RoiAlign", "mode", mode, ("avg", "max"))
    return _roi_align(x, rois, batch_indices, m, output_height, output_width, sampling_ratio, spatial_scale, False)
