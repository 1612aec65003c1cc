"""Loss selection for the trainer: a name -> the loss kernel (from
``kernels/losses.py``), its attributes, and how accuracy is scored.

The loss kernels live in the kernel library (forward and backward side by
side, finite-difference tested like every op); this module only binds them
to the trainer's vocabulary and to a metric.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError, ShapeError, TrainingError
from ..kernels import Kernel, get_kernel
from ..kernels.losses import DOMAIN

_ALIASES = {
    "cross_entropy": "cross_entropy", "ce": "cross_entropy", "softmax_cross_entropy": "cross_entropy",
    "mse": "mse", "mean_squared_error": "mse",
    "bce": "bce", "binary_cross_entropy": "bce", "bce_logits": "bce",
    "bce_probs": "bce_probs",
}
_KERNELS = {
    "cross_entropy": ("SoftmaxCrossEntropy", {}),
    "mse": ("MeanSquaredError", {}),
    "bce": ("BinaryCrossEntropy", {"from_logits": 1}),
    "bce_probs": ("BinaryCrossEntropy", {"from_logits": 0}),
}
LOSSES = tuple(sorted(_ALIASES))


@dataclass(frozen=True)
class Loss:
    """A bound loss: ``value_and_grad(output, target, scale)``."""

    name: str
    kernel: Kernel
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def classifies(self) -> bool:
        return self.name == "cross_entropy"

    def value_and_grad(self, out: np.ndarray, target: np.ndarray, scale: float = 1.0
                       ) -> tuple[float, np.ndarray]:
        """Loss value and d(scale * loss)/d(out)."""
        try:
            value = self.kernel.forward(out, target, **self.attrs)
        except ValueError as exc:
            raise ShapeError(f"{self.name} loss: {exc}") from exc
        dl = np.asarray(scale, dtype=out.dtype)
        grad = self.kernel.backward_fn([dl], [out, target], (value,), **self.attrs)[0]
        return float(value), grad

    def value(self, out: np.ndarray, target: np.ndarray) -> float:
        try:
            return float(self.kernel.forward(out, target, **self.attrs))
        except ValueError as exc:
            raise ShapeError(f"{self.name} loss: {exc}") from exc

    def correct(self, out: np.ndarray, target: np.ndarray) -> int | None:
        """Correctly classified samples, or None where accuracy means nothing (regression)."""
        if self.name == "cross_entropy":
            pred = out.argmax(axis=1)
            truth = target if target.ndim == 1 else target.argmax(axis=1)
            return int((pred == truth).sum())
        if self.name in ("bce", "bce_probs"):
            thr = 0.0 if self.name == "bce" else 0.5
            hits = (out > thr) == (target > 0.5)
            per_sample = hits.reshape(len(hits), -1).all(axis=1)
            return int(per_sample.sum())
        return None


def get_loss(name: str, **attrs: Any) -> Loss:
    """A loss by name: cross_entropy (logits + class indices), mse, bce (logits), bce_probs."""
    key = _ALIASES.get(str(name).lower())
    if key is None:
        raise TrainingError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    op, fixed = _KERNELS[key]
    kernel = get_kernel(op, DOMAIN)
    bad = sorted(set(attrs) - set(kernel.attributes))
    if bad:
        raise InputError(f"loss {key!r} has no option(s) {bad}; it takes {list(kernel.attributes)}")
    return Loss(key, kernel, {**fixed, **attrs})
