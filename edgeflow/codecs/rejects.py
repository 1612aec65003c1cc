"""Counting and logging of rejected updates.

A gateway facing a fleet must be able to answer "how many updates did we
drop, and why?" without grepping logs, so every rejection increments a
counter keyed by a short reason code and logs one line that says what to fix.
The reason codes are stable strings (tests and dashboards use them):

``oversized``, ``truncated``, ``bad_magic``, ``unsupported_version``,
``unknown_codec``, ``malformed``, ``checksum``, ``shape_mismatch``,
``too_large``, ``non_finite``, ``out_of_range``, ``unsigned``, ``unknown_device``,
``wrong_key``, ``bad_signature``, ``replay``, ``stale``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from edgeflow.errors import CodecError

__all__ = ["RejectStats", "codec_error", "reason_of", "rejections"]

log = logging.getLogger("edgeflow.codecs")


def codec_error(reason: str, message: str, cls: type[CodecError] = CodecError) -> CodecError:
    """Build a CodecError (or subclass) carrying a machine-readable ``reason``."""
    err = cls(message)
    err.reason = reason  # type: ignore[attr-defined]
    return err


def reason_of(err: BaseException) -> str:
    return str(getattr(err, "reason", "malformed"))


class RejectStats:
    """Thread-safe counters of rejected updates by reason."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def record(self, reason: str, message: str, *, source: str = "") -> None:
        with self._lock:
            self._counts[reason] += 1
        where = f" from {source}" if source else ""
        log.warning("rejected update%s (%s): %s", where, reason, message)

    def count(self, reason: str) -> int:
        with self._lock:
            return self._counts[reason]

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()


rejections = RejectStats()
"""Process-wide default counters used by :func:`edgeflow.codecs.decode_update`."""
