"""The detection-box loss of the quantize gate (``--loss boxes`` / ``--loss yolox``).

A detector's int8 output can keep a cosine of 0.99 to fp32 while boxes move,
appear or vanish. This measure reads the boxes the way the detector's own
post-processing does and compares the detections, not the numbers:

1. per sample, the output (A, 5 + C) is read as (cx, cy, w, h, objectness,
   class scores...): a box's score is objectness x its best class score (just
   objectness when C = 0), boxes scoring under ``score`` (0.25) are dropped,
   the rest go through class-agnostic NMS at IoU 0.45 (YOLOX's demo and
   ddddocr's detector post-process this way);
2. "yolox" first decodes YOLOX's raw head (what its ONNX export emits): anchor
   i of the stride-8, -16, -32 grids (row-major, in that order) gets
   ``cx = (x + gx) * s``, ``w = exp(w) * s``; the input is taken square, its
   side found from A (A = 21 S^2 / 1024, e.g. 3549 anchors for 416x416);
3. the fp32 and int8 detections of a sample are matched one to one, highest
   IoU first, a pair counting when its IoU is >= 0.5.

The loss, in points, is ``100 - 100 * matched / max(fp32 boxes, int8 boxes)``
over all samples: a box of fp32 lost and a box int8 made up both cost; a
sample where neither finds anything costs nothing. :func:`box_agreement`
also gives the share of fp32 boxes kept and the mean IoU of the matched pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import QuantizationError

BOX_MEASURES = ("boxes", "yolox")
SCORE_THRESHOLD = 0.25
NMS_IOU = 0.45
MATCH_IOU = 0.5
YOLOX_STRIDES = (8, 16, 32)


def _check(out: np.ndarray, measure: str) -> np.ndarray:
    out = np.asarray(out)
    if out.ndim != 3 or out.shape[-1] < 5:
        raise QuantizationError(
            f"--loss {measure} needs detections (N, anchors, 5 + classes) laid out as cx, cy, w, h, objectness, "
            f"class scores; the model's first output is {out.shape}")
    return out.astype(np.float64, copy=False)


def yolox_grid(anchors: int) -> tuple[np.ndarray, np.ndarray]:
    """(grid xy (A, 2), stride (A, 1)) of a square YOLOX input with ``anchors`` anchors."""
    side = int(round(np.sqrt(anchors * 1024 / 21)))
    sizes = [side // s for s in YOLOX_STRIDES]
    if side % 32 or sum(n * n for n in sizes) != anchors:
        raise QuantizationError(
            f"--loss yolox: {anchors} anchors are not the stride-8/16/32 grids of a square input (416x416 has "
            "3549); use --loss boxes for an output already decoded to pixels")
    grids, strides = [], []
    for n, s in zip(sizes, YOLOX_STRIDES):
        xv, yv = np.meshgrid(np.arange(n), np.arange(n))
        grids.append(np.stack((xv, yv), 2).reshape(-1, 2))
        strides.append(np.full((n * n, 1), s))
    return np.concatenate(grids).astype(np.float64), np.concatenate(strides).astype(np.float64)


def decode_yolox(out: np.ndarray) -> np.ndarray:
    """YOLOX's raw head (N, A, 5 + C) decoded to pixel (cx, cy, w, h), as its demo_postprocess does."""
    out = _check(out, "yolox").copy()
    grid, stride = yolox_grid(out.shape[1])
    out[..., :2] = (out[..., :2] + grid) * stride
    with np.errstate(over="ignore"):
        out[..., 2:4] = np.exp(out[..., 2:4]) * stride
    return out


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of ``a`` (n, 4) with every box of ``b`` (m, 4), both x1, y1, x2, y2."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=-1)
    area = lambda x: np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), axis=-1)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def detections(sample: np.ndarray, score: float = SCORE_THRESHOLD, nms_iou: float = NMS_IOU) -> np.ndarray:
    """The boxes (k, 4) x1, y1, x2, y2 kept from one sample's decoded (A, 5 + C), best first."""
    s = sample[:, 4] * (sample[:, 5:].max(axis=1) if sample.shape[1] > 5 else 1.0)
    keep = np.flatnonzero(np.isfinite(s) & (s >= score) & np.all(np.isfinite(sample[:, :4]), axis=1))
    if keep.size == 0:
        return np.zeros((0, 4))
    c, wh = sample[keep, :2], sample[keep, 2:4]
    boxes = np.concatenate([c - wh / 2, c + wh / 2], axis=1)
    order = np.argsort(-s[keep], kind="stable")
    boxes = boxes[order]
    ious = iou_matrix(boxes, boxes)
    alive = np.ones(len(boxes), bool)
    for i in range(len(boxes)):
        if alive[i]:
            alive[i + 1:] &= ious[i, i + 1:] <= nms_iou
    return boxes[alive]


def match(ref: np.ndarray, got: np.ndarray, iou: float = MATCH_IOU) -> np.ndarray:
    """IoUs of the one-to-one pairs of ``ref`` and ``got`` boxes with IoU >= ``iou`` (highest first)."""
    m = iou_matrix(ref, got)
    pairs = []
    while m.size:
        i, j = np.unravel_index(np.argmax(m), m.shape)
        if m[i, j] < iou:
            break
        pairs.append(m[i, j])
        m[i, :], m[:, j] = -1.0, -1.0
    return np.array(pairs)


@dataclass(frozen=True)
class BoxAgreement:
    """The int8 detections against fp32's over an evaluation set."""

    ref_boxes: int  # fp32's detections, all samples
    got_boxes: int  # int8's
    matched: int  # one-to-one pairs with IoU >= 0.5
    mean_iou: float  # over the matched pairs (nan: none)
    samples_changed: int  # samples where a box was lost or made up

    @property
    def kept_pct(self) -> float:
        """% of fp32's boxes int8 also finds (100 where fp32 found none)."""
        return 100.0 * self.matched / self.ref_boxes if self.ref_boxes else 100.0

    @property
    def loss(self) -> float:
        """Points lost: 100 - % of boxes matched, over the larger of the two counts."""
        n = max(self.ref_boxes, self.got_boxes)
        return 100.0 - 100.0 * self.matched / n if n else 0.0

    def format(self) -> str:
        iou = f", mean IoU {self.mean_iou:.3f}" if self.matched else ""
        return (f"{self.kept_pct:.1f}% of fp32's {self.ref_boxes} boxes kept (IoU >= {MATCH_IOU}), int8 found "
                f"{self.got_boxes}{iou}: loss {self.loss:.2f} points")


def box_agreement(ref: np.ndarray, got: np.ndarray, measure: str = "boxes",
                  score: float = SCORE_THRESHOLD) -> BoxAgreement:
    """fp32 (``ref``) against int8 (``got``) detections, both (N, A, 5 + C); ``measure``: "boxes"
    (already pixel cx, cy, w, h) or "yolox" (the raw head, grid-decoded first)."""
    if measure not in BOX_MEASURES:
        raise QuantizationError(f"unknown box measure {measure!r}; use one of {', '.join(BOX_MEASURES)}")
    if np.shape(ref) != np.shape(got):
        raise QuantizationError(f"fp32 and int8 outputs differ in shape: {np.shape(ref)} vs {np.shape(got)}")
    dec = decode_yolox if measure == "yolox" else (lambda o: _check(o, measure))
    r, g = dec(ref), dec(got)
    n_ref = n_got = n_match = changed = 0
    ious: list[float] = []
    for rs, gs in zip(r, g):
        a, b = detections(rs, score), detections(gs, score)
        pairs = match(a, b)
        n_ref, n_got, n_match = n_ref + len(a), n_got + len(b), n_match + len(pairs)
        changed += len(pairs) != max(len(a), len(b))
        ious.extend(pairs.tolist())
    return BoxAgreement(n_ref, n_got, n_match, float(np.mean(ious)) if ious else float("nan"), changed)
