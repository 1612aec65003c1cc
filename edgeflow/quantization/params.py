"""Scales and zero points: activations (asymmetric), weights (symmetric,
per channel or per tensor), biases (int32 in accumulator units).

The conventions are onnxruntime's, so that a model quantized here and one
quantized by ``onnxruntime.quantization`` are interchangeable:

- activation range always contains 0 (so real 0 — padding, Relu's floor —
  is exactly representable): ``scale = (hi - lo) / (qmax - qmin)``,
  ``zero_point = round(qmin - lo / scale)``;
- weights symmetric in [-127, 127] (zero point 0; -128 unused so that the
  range is symmetric and u8 x s8 products never saturate int16 pairs);
- bias ``round(b / (x_scale * w_scale))`` as int32, zero point 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import QuantizationError
from .calibration import Range

ACT_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}
_TINY = np.float32(1e-12)


@dataclass(frozen=True)
class TensorQParams:
    scale: np.float32
    zero_point: np.integer  # np.uint8 / np.int8 scalar

    @property
    def dtype(self) -> np.dtype:
        return np.asarray(self.zero_point).dtype


def activation_qparams(r: Range, dtype: str = "uint8", symmetric: bool = False) -> TensorQParams:
    if dtype not in ACT_RANGES:
        raise QuantizationError(f"activation type must be uint8 or int8, got {dtype!r}")
    qmin, qmax = ACT_RANGES[dtype]
    lo, hi = min(float(r.lo), 0.0), max(float(r.hi), 0.0)
    if symmetric:
        a = max(-lo, hi)
        lo, hi = -a, a
    scale = np.float32((hi - lo) / (qmax - qmin))
    if not np.isfinite(scale):
        raise QuantizationError(f"calibrated range {r} is not finite")
    if symmetric:
        zp = 0 if qmin < 0 else (qmin + qmax + 1) // 2
    elif scale < _TINY:
        zp = qmin  # a constant-zero tensor: any scale represents it
    else:
        zp = int(np.clip(np.rint(qmin - lo / float(scale)), qmin, qmax))
    if scale < _TINY:
        scale = np.float32(1.0)
    return TensorQParams(scale, np.dtype(dtype).type(zp))


@dataclass(frozen=True)
class QuantizedWeight:
    values: np.ndarray  # int8, same shape as the float weight
    scale: np.ndarray  # float32, (channels,) or ()
    axis: int


#: Largest |bias| in accumulator units: keeps the bias exact in float32 (and
#: far inside int32) — see :func:`bias_safe_scale`.
BIAS_LIMIT = 2**24


def bias_safe_scale(bias: np.ndarray, x_scale: float) -> np.ndarray:
    """The smallest weight scale per channel at which ``bias`` fits BIAS_LIMIT.

    A dead or nearly-zero channel (max|w| ~ 1e-9) next to an ordinary bias
    would otherwise need a bias of ~1e12 accumulator units: int32 overflows
    and the layer's output is wrong. Raising that channel's weight scale
    costs nothing measurable: its weights then contribute at most
    127 * 255 / 2**24 = 0.2% of its (bias-dominated) output.
    """
    return (np.abs(np.asarray(bias, np.float64)) / (float(x_scale) * BIAS_LIMIT)).astype(np.float32)


def quantize_weight(w: np.ndarray, axis: int, per_channel: bool = True, min_scale: np.ndarray | None = None) -> QuantizedWeight:
    """Symmetric int8 weights: ``rint(w / s)`` in [-127, 127], s = max|w| / 127
    (or ``min_scale`` where that is larger)."""
    w = np.asarray(w, dtype=np.float32)
    if not np.all(np.isfinite(w)):
        raise QuantizationError("the model has NaN/Inf weights; they cannot be quantized")
    if per_channel:
        red = tuple(i for i in range(w.ndim) if i != axis)
        amax = np.max(np.abs(w), axis=red) if red else np.abs(w)
        scale = (amax / np.float32(127.0)).astype(np.float32)
        if min_scale is not None:
            scale = np.maximum(scale, np.broadcast_to(min_scale, scale.shape)).astype(np.float32)
        scale[scale == 0] = np.float32(1.0)  # an all-zero channel: any scale
        shape = [1] * w.ndim
        shape[axis] = -1
        s = scale.reshape(shape)
    else:
        amax = np.float32(np.max(np.abs(w))) if w.size else np.float32(0)
        s0 = amax / np.float32(127.0)
        if min_scale is not None and np.size(min_scale):
            s0 = max(s0, np.float32(np.max(min_scale)))
        scale = np.asarray(s0 if s0 > 0 else np.float32(1.0), np.float32)
        s = scale
    q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    return QuantizedWeight(q, scale, axis)


def quantize_bias(b: np.ndarray, x_scale: np.float32, w_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """int32 bias, its scale (x_scale * w_scale, per channel), and whether it clipped."""
    scale = (np.float32(x_scale) * np.asarray(w_scale, np.float32)).astype(np.float32)
    scale = np.broadcast_to(scale, np.shape(b)).astype(np.float32)
    q = np.rint(np.asarray(b, np.float64) / scale.astype(np.float64))
    lim = float(2**31 - 1)
    clipped = bool(np.any(np.abs(q) > lim))
    return np.clip(q, -lim, lim).astype(np.int32), scale, clipped
