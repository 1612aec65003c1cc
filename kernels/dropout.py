"""Dropout: identity at inference; seeded inverted dropout in training mode.

Training mode draws the keep-mask from a seeded generator
when a seed is given, so a training step can be replayed exactly.
(``numpy.random.RandomState(seed).uniform`` — the ONNX reference's stream.)

The backward scales the gradient by the same mask: from the mask output when
the node produced it (the trainer asks for it), else replayed from the seed.
"""

from __future__ import annotations

import numpy as np

from .registry import FLOAT_TYPES, register


@register("Dropout", dtypes=FLOAT_TYPES, since=12)
def dropout(
    x: np.ndarray,
    ratio: np.ndarray | None = None,
    training_mode: np.ndarray | None = None,
    *,
    seed: int | None = None,
    n_outputs: int = 1,
):
    r = 0.5 if ratio is None else float(np.asarray(ratio))
    training = bool(training_mode) if training_mode is not None else False
    if not training or r == 0.0:
        out = x.copy() if n_outputs > 1 else x
        return out if n_outputs == 1 else (out, np.ones(x.shape, dtype=bool))
    if not 0.0 <= r < 1.0:
        raise ValueError(f"Dropout ratio must be in [0, 1), got {r}")
    # The legacy RandomState stream with the node's seed is what the ONNX
    # reference uses, so a seeded Dropout replays identically across runtimes.
    rng = np.random.RandomState(seed) if seed is not None else np.random.RandomState()
    mask = rng.uniform(0.0, 1.0, x.shape) >= r
    y = (x * mask / (1.0 - r)).astype(x.dtype, copy=False)
    return y if n_outputs == 1 else (y, mask)


@dropout.backward(uses="all")
def _(grads, inputs, outputs, *, seed=None):
    dy = grads[0]
    nones = (None,) * (len(inputs) - 1)
    if dy is None:
        return (None,) + nones
    ratio = inputs[1] if len(inputs) > 1 else None
    training_mode = inputs[2] if len(inputs) > 2 else None
    r = 0.5 if ratio is None else float(np.asarray(ratio))
    training = bool(training_mode) if training_mode is not None else False
    if not training or r == 0.0:
        return (dy,) + nones
    mask = outputs[1] if len(outputs) > 1 and outputs[1] is not None else None
    if mask is None:
        if seed is None:
            raise ValueError(
                "Dropout backward needs the mask: request the node's mask output or give it a seed"
            )
        mask = np.random.RandomState(seed).uniform(0.0, 1.0, dy.shape) >= r
    return ((dy * mask / (1.0 - r)).astype(dy.dtype, copy=False),) + nones


@register("Dropout", dtypes=FLOAT_TYPES, since=7)
def dropout_v7(x: np.ndarray, *, ratio: float = 0.5, n_outputs: int = 1):
    return x if n_outputs == 1 else (x, np.ones(x.shape, dtype=bool))


@dropout_v7.backward(uses="none")
def _(grads, inputs, outputs, *, ratio=0.5):
    return (grads[0],)  # opset < 12 Dropout is the identity at inference
