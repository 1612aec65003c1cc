"""Error-feedback state for sparsifying codecs, kept on the device.

The residual is what a device has *not yet* sent: ``topk`` adds it to the
next round's update before selecting. It must live as long as the device's
participation in a federation (rounds are minutes to hours apart), so it
is an explicit object the device agent owns and may persist across restarts
with :meth:`save`/:meth:`load` (``.npz`` without pickle).

A codec may keep more than the residual per tensor (``Codec.state_size``):
``topk-packed`` with ``momentum`` keeps ``[residual, velocity]``; a stored
state whose size no longer matches (the model or that option changed) is
dropped with a warning, as below.

Updates to the state are all-or-nothing per encode: :func:`encode_update`
computes every tensor's new residual first and commits them together, so a
failed encode (NaN in the third tensor, say) leaves the state untouched.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np

from edgeflow.errors import ConfigError

__all__ = ["ErrorFeedback"]

log = logging.getLogger("edgeflow.codecs")


class ErrorFeedback:
    """Per-tensor residuals (flat float32 arrays) carried from round to round."""

    def __init__(self) -> None:
        self._residual: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def residual(self, name: str, size: int) -> np.ndarray | None:
        """The residual for ``name`` if it matches ``size`` elements, else None.

        A size change means the model changed shape; the stale residual is
        dropped (and logged) rather than added to unrelated weights.
        """
        with self._lock:
            res = self._residual.get(name)
            if res is not None and res.size != size:
                log.warning(
                    "error-feedback residual for %r has %d values but the tensor now has %d; resetting it",
                    name, res.size, size,
                )
                del self._residual[name]
                res = None
            return res

    def get(self, name: str) -> np.ndarray | None:
        """The stored residual for ``name`` (flat float32), without a size check."""
        with self._lock:
            return self._residual.get(name)

    def commit(self, residuals: dict[str, np.ndarray]) -> None:
        with self._lock:
            for name, res in residuals.items():
                self._residual[name] = np.ascontiguousarray(res, dtype=np.float32).reshape(-1)

    def reset(self, name: str | None = None) -> None:
        with self._lock:
            if name is None:
                self._residual.clear()
            else:
                self._residual.pop(name, None)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._residual)

    def __len__(self) -> int:
        with self._lock:
            return len(self._residual)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._residual

    def norm(self) -> float:
        """L2 norm of the state -- everything not yet sent (and a momentum codec's velocity): a health signal
        (it should stay bounded)."""
        with self._lock:
            return float(np.sqrt(sum(float(np.dot(r, r)) for r in self._residual.values())))

    def copy(self) -> ErrorFeedback:
        """A snapshot, e.g. to roll back if the encoded update could not be sent."""
        other = ErrorFeedback()
        with self._lock:
            other._residual = {k: v.copy() for k, v in self._residual.items()}
        return other

    def save(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        with self._lock:
            arrays = {f"r{i}": v for i, v in enumerate(self._residual.values())}
            names = np.array(list(self._residual), dtype=np.str_)
        tmp = p.with_name(p.name + ".tmp.npz")
        np.savez(tmp, names=names, **arrays)
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ErrorFeedback:
        p = Path(path)
        try:
            with np.load(p, allow_pickle=False) as data:
                names = [str(n) for n in data["names"]]
                arrays = [np.asarray(data[f"r{i}"], dtype=np.float32) for i in range(len(names))]
        except (OSError, KeyError, ValueError) as exc:
            msg = f"cannot load error-feedback state from {p}: {exc}; delete the file to start from zero"
            raise ConfigError(msg) from exc
        state = cls()
        state.commit(dict(zip(names, arrays)))
        return state
