"""Quantization-aware training: fake-quantize weights and activations in the
forward, pass gradients straight through (STE) in the backward.

The scheme is the one the deployed int8 model uses, so what the network
learns to tolerate is exactly the rounding it will meet:

- weights of Conv / Gemm / MatMul: symmetric, per output channel,
  ``scale = max|w| / 127``, zero point 0 (no clipping: the STE is exact
  identity for weights);
- activations entering those ops: asymmetric uint8 per tensor over an
  observed range (EMA of batch min/max while training, always containing
  0); the STE passes the gradient only where ``x`` fell inside the range.

Quantization stays simulated: the tape sees float arrays on the int8 grid.
The exported model is an ordinary float model whose weights already sit on
(or next to) that grid, so post-training quantization of it loses little.
:meth:`FakeQuantizer.calibrate` plus ``Trainer.evaluate`` on a QAT trainer
gives the simulated int8 accuracy of any float model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import TrainingError
from .autograd import Tape


@dataclass(frozen=True)
class QATConfig:
    """What to fake-quantize and how."""

    ops: tuple[str, ...] = ("Conv", "Gemm", "MatMul")
    weight_bits: int = 8
    activation_bits: int = 8
    per_channel: bool = True
    activations: bool = True
    observer_momentum: float = 0.9  # EMA of the batch range; the first batch initialises it

    def __post_init__(self) -> None:
        for k in ("weight_bits", "activation_bits"):
            if not 2 <= getattr(self, k) <= 16:
                raise TrainingError(f"QAT {k} must be in [2, 16], got {getattr(self, k)}")
        if not 0.0 <= self.observer_momentum < 1.0:
            raise TrainingError(f"observer_momentum must be in [0, 1), got {self.observer_momentum}")


def fake_quant_weight(w: np.ndarray, axis: int | None, bits: int = 8) -> np.ndarray:
    """Symmetric fake quantization, per channel along ``axis`` (None: per tensor)."""
    qmax = 2 ** (bits - 1) - 1
    if axis is None or w.ndim == 0:
        amax = np.abs(w).max(keepdims=True) if w.size else np.ones((), w.dtype)
    else:
        axis = axis % w.ndim
        other = tuple(i for i in range(w.ndim) if i != axis)
        amax = np.abs(w).max(axis=other, keepdims=True)
    scale = np.where(amax > 0, amax / qmax, 1).astype(w.dtype)
    return (np.clip(np.rint(w / scale), -qmax, qmax) * scale).astype(w.dtype, copy=False)


def fake_quant_activation(x: np.ndarray, lo: float, hi: float, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric (uint) fake quantization over [lo, hi]; returns the value and the STE mask."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    qmax = 2**bits - 1
    scale = (hi - lo) / qmax if hi > lo else 1.0
    zp = np.rint(-lo / scale)
    q = np.clip(np.rint(x / x.dtype.type(scale)) + zp, 0, qmax)
    xq = ((q - zp) * scale).astype(x.dtype, copy=False)
    mask = (x >= lo) & (x <= hi)
    return xq, mask


def _weight_axis(op: str, attrs: dict, ndim: int) -> int:
    """The output-channel axis of a weight: Conv 0; Gemm 0 if transB else 1; MatMul last."""
    if op == "Conv":
        return 0
    if op == "Gemm":
        return 0 if attrs.get("transB") else 1
    return ndim - 1


class FakeQuantizer:
    """Installs fake-quant hooks on a tape and holds the activation observers."""

    def __init__(self, tape: Tape, config: QATConfig, trainable: list[str] | None = None) -> None:
        self.config = config
        self.enabled = True
        self.observing = False  # calibration: widen ranges (union) during inference
        self.ranges: dict[str, list[float]] = {}
        weights = set(tape.constants) | set(trainable or ())
        self.weights: list[str] = []
        self.activation_values: list[str] = []
        for i, st in enumerate(tape.steps):
            op = st.node.op_type
            if st.node.domain or op not in config.ops or len(st.inputs) < 2:
                continue
            w = st.inputs[1]
            if w in weights:
                ndim = tape.graph.initializers[w].ndim if w in tape.graph.initializers else 2
                axis = _weight_axis(op, st.node.attrs, ndim) if config.per_channel else None
                tape.add_hook(i, 1, self._weight_hook(axis))
                self.weights.append(w)
            x = st.inputs[0]
            if config.activations and x and x not in weights:
                tape.add_hook(i, 0, self._activation_hook(x))
                self.activation_values.append(x)
        if not self.weights and not self.activation_values:
            raise TrainingError(f"QAT found nothing to quantize: the model has no {'/'.join(config.ops)} ops")

    def _weight_hook(self, axis: int | None):
        bits = self.config.weight_bits

        def hook(w: np.ndarray, training: bool):
            if not self.enabled:
                return w, None
            return fake_quant_weight(w, axis, bits), None  # STE: identity gradient

        return hook

    def _activation_hook(self, name: str):
        bits, mom = self.config.activation_bits, self.config.observer_momentum

        def hook(x: np.ndarray, training: bool):
            if not self.enabled:
                return x, None
            lo, hi = float(x.min()), float(x.max())
            r = self.ranges.get(name)
            if r is None:
                if not (training or self.observing):
                    return x, None  # nothing observed yet: leave float
                r = self.ranges[name] = [lo, hi]
            elif self.observing:
                r[0], r[1] = min(r[0], lo), max(r[1], hi)
            elif training:
                r[0] = mom * r[0] + (1 - mom) * lo
                r[1] = mom * r[1] + (1 - mom) * hi
            xq, mask = fake_quant_activation(x, r[0], r[1], bits)
            return xq, (mask if training else None)

        return hook

    def calibrate(self, trainer, x: np.ndarray, *, batch_size: int = 256) -> dict[str, tuple[float, float]]:
        """Set activation ranges to the min/max over ``x`` (post-training calibration)."""
        self.ranges.clear()
        self.observing = True
        try:
            trainer.predict(x, batch_size=batch_size)
        finally:
            self.observing = False
        return self.activation_ranges()

    def activation_ranges(self) -> dict[str, tuple[float, float]]:
        return {k: (min(v[0], 0.0), max(v[1], 0.0)) for k, v in self.ranges.items()}
