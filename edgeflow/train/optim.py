"""Optimizers (SGD with momentum / Nesterov / weight decay, Adam, AdamW) and
gradient clipping by global norm, with PyTorch's update rules.

Matching PyTorch exactly (not just "an Adam") matters: a model fine-tuned on
a device and one trained on a workstation with the same hyper-parameters
should follow the same trajectory, and the tests compare step by step.

Parameters are updated in place (the trainer's arrays are the model's
weights); gradients are never modified, so a caller may keep them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import TrainingError


def global_norm(grads: dict[str, np.ndarray]) -> float:
    """sqrt(sum of squares) over every gradient (a dot product per array: BLAS speed)."""
    total = 0.0
    for g in grads.values():
        flat = g.reshape(-1)
        total += float(np.dot(flat, flat))
    return math.sqrt(total)


def clip_by_global_norm(grads: dict[str, np.ndarray], max_norm: float, norm: float | None = None
                        ) -> tuple[dict[str, np.ndarray], float]:
    """Scale all gradients by ``max_norm / norm`` when the norm exceeds it.

    Returns the (possibly new) gradients and the norm before clipping.
    Like ``torch.nn.utils.clip_grad_norm_`` (scale = max_norm / (norm + 1e-6)).
    """
    if max_norm <= 0:
        raise TrainingError(f"clip_norm must be > 0, got {max_norm}")
    norm = global_norm(grads) if norm is None else norm
    scale = max_norm / (norm + 1e-6)
    if scale >= 1.0:
        return grads, norm
    return {k: g * g.dtype.type(scale) for k, g in grads.items()}, norm


@dataclass
class Optimizer:
    """Base: ``step(params, grads)`` updates params in place."""

    lr: float = 0.01
    state: dict[str, dict[str, np.ndarray]] = field(default_factory=dict, repr=False)
    steps: int = 0

    #: Arrays of optimizer state per parameter (for memory planning).
    slots: int = 0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise TrainingError(f"learning rate must be > 0, got {self.lr}")

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        self.steps += 1
        for name, g in grads.items():
            self._update(name, params[name], g)

    def _update(self, name: str, w: np.ndarray, g: np.ndarray) -> None:  # pragma: no cover - abstract
        raise NotImplementedError("need _update")

    def reset(self) -> None:
        """Forget momentum / moment estimates (e.g. at the start of a federated round)."""
        self.state.clear()
        self.steps = 0


@dataclass
class SGD(Optimizer):
    """torch.optim.SGD: buf = m*buf + (1-dampening)*g; w -= lr * (g + m*buf if nesterov else buf)."""

    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    dampening: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.momentum < 1.0:
            raise TrainingError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise TrainingError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise TrainingError("Nesterov momentum needs momentum > 0 and dampening 0")
        self.slots = 1 if self.momentum else 0

    def _update(self, name: str, w: np.ndarray, g: np.ndarray) -> None:
        t = w.dtype.type
        if self.weight_decay:
            g = g + t(self.weight_decay) * w
        if self.momentum:
            st = self.state.get(name)
            if st is None:
                buf = g.copy()
                self.state[name] = {"momentum": buf}
            else:
                buf = st["momentum"]
                buf *= t(self.momentum)
                if self.dampening:
                    buf += t(1 - self.dampening) * g
                else:
                    buf += g
            g = g + t(self.momentum) * buf if self.nesterov else buf
        w -= t(self.lr) * g


@dataclass
class Adam(Optimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False  # AdamW

    def __post_init__(self) -> None:
        super().__post_init__()
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise TrainingError(f"Adam betas must be in [0, 1), got {self.betas}")
        if self.weight_decay < 0:
            raise TrainingError(f"weight_decay must be >= 0, got {self.weight_decay}")
        self.slots = 2

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        self.steps += 1
        b1, b2 = self.betas
        self._bc1 = 1 - b1 ** self.steps
        self._bc2 = 1 - b2 ** self.steps
        for name, g in grads.items():
            self._update(name, params[name], g)

    def _update(self, name: str, w: np.ndarray, g: np.ndarray) -> None:
        t = w.dtype.type
        b1, b2 = self.betas
        if self.weight_decay:
            if self.decoupled:
                w *= t(1 - self.lr * self.weight_decay)
            else:
                g = g + t(self.weight_decay) * w
        st = self.state.get(name)
        if st is None:
            st = self.state[name] = {"m": np.zeros_like(w), "v": np.zeros_like(w)}
        m, v = st["m"], st["v"]
        m *= t(b1)
        m += t(1 - b1) * g
        v *= t(b2)
        v += t(1 - b2) * (g * g)
        denom = np.sqrt(v)
        denom /= t(math.sqrt(self._bc2))
        denom += t(self.eps)
        w -= t(self.lr / self._bc1) * (m / denom)


def AdamW(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,  # noqa: N802
          weight_decay: float = 0.01) -> Adam:
    """torch.optim.AdamW: Adam with decoupled weight decay (w *= 1 - lr*wd)."""
    return Adam(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=True)


OPTIMIZERS = ("sgd", "adam", "adamw")


def make_optimizer(name: str, lr: float | None = None, *, momentum: float = 0.0, weight_decay: float | None = None,
                   nesterov: bool = False, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> Optimizer:
    """An optimizer by name ("sgd", "adam", "adamw") with PyTorch's defaults."""
    key = name.lower()
    if key == "sgd":
        return SGD(lr=0.01 if lr is None else lr, momentum=momentum, weight_decay=weight_decay or 0.0,
                   nesterov=nesterov)
    if key == "adam":
        return Adam(lr=1e-3 if lr is None else lr, betas=betas, eps=eps, weight_decay=weight_decay or 0.0)
    if key == "adamw":
        return AdamW(lr=1e-3 if lr is None else lr, betas=betas, eps=eps,
                     weight_decay=0.01 if weight_decay is None else weight_decay)
    raise TrainingError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
