"""Exponential reconnect backoff with jitter.

Without jitter, a broker restart makes the whole fleet reconnect in lock
step, every retry a thundering herd; with "equal jitter" each wait is drawn
uniformly from the upper half of the exponential step, so clients spread
out while the step still bounds how long any of them waits.
"""

from __future__ import annotations

import random

__all__ = ["Backoff"]


class Backoff:
    """Delays ``initial * factor**n`` capped at ``maximum``, each scaled by U(1 - jitter, 1)."""

    def __init__(
        self, initial: float = 0.5, maximum: float = 30.0, *, factor: float = 2.0, jitter: float = 0.5,
        rng: random.Random | None = None,
    ) -> None:
        if initial <= 0 or maximum < initial or factor < 1 or not 0 <= jitter <= 1:
            msg = "backoff needs 0 < initial <= maximum, factor >= 1 and 0 <= jitter <= 1"
            raise ValueError(msg)
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.jitter = jitter
        self.attempts = 0
        self._rng = rng or random.Random()

    def step(self) -> float:
        """The un-jittered delay for the current attempt."""
        return min(self.maximum, self.initial * self.factor ** min(self.attempts, 64))

    def next(self) -> float:
        delay = self.step() * (1.0 - self.jitter * self._rng.random())
        self.attempts += 1
        return delay

    def reset(self) -> None:
        self.attempts = 0
