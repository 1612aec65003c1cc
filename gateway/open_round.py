"""The open round: one value that every round protocol shares with the round manager.

A round's intake state -- its announcement, the aggregator it folds into, who
reported, why others were refused, the bytes and losses and fit metrics it
took in -- lives here, behind one lock and one condition, instead of in the
:class:`~edgeflow.gateway.rounds.RoundManager`'s private fields. The
protocols that run a round (synchronous, secure aggregation, FedBuff, the
partial sums of ingestion workers and site gateways) receive this object and
use its methods; none of them reads the manager's privates.

Thread model: transport worker threads call :meth:`record`/:meth:`count`
while the round's own thread waits on :attr:`cv`; every method takes the lock
itself (it is re-entrant, so a caller holding it may call them too).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from edgeflow.protocol.rounds import RoundAnnouncement

from .intake import CheckedUpdate, RoundView

__all__ = ["KEEP_BYTES", "Intake", "OpenRound"]

KEEP_BYTES = 8 << 20
"""The default budget of :meth:`OpenRound.keep`. It was 256 MiB: a round of 1,000 devices then held
every decoded update (the gateway grew 40.7 MB instead of 7.8 MB, benchmarks/round_scaling.py); what
keeping saves is one decode per update at the close (measured there: 0.90 against 0.99 ms of gateway
CPU per update)."""


@dataclass(frozen=True)
class Intake:
    """A snapshot of what a round took in (for its metrics and explanations)."""

    reported: frozenset[str]
    counters: Mapping[str, int]
    losses: tuple[float, ...]
    fit_metrics: tuple[tuple[int, Mapping[str, Any]], ...]
    evaluations: tuple[tuple[float, int, Mapping[str, Any]], ...]
    bytes_in: int
    dense_bytes: int

    @property
    def rejected(self) -> int:
        return sum(v for k, v in self.counters.items() if k.startswith("rejected"))


class OpenRound:
    """The round being collected (see the module docstring)."""

    def __init__(self, *, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = int(keep_bytes)
        """How many bytes of checked updates (decoded tensors and envelope) the round keeps for its close;
        the rest is re-read from the state there. A fixed bound: the gateway's memory follows the model,
        not the number of devices."""
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.ann: RoundAnnouncement | None = None
        self.agg: Any = None
        """The aggregator the round folds into (a strategy, or FedBuff's buffer)."""
        self.totals: dict[str, int] = {}
        """Every counter since the process started (across rounds)."""
        self._reset()

    def _reset(self) -> None:
        self.reported: set[str] = set()
        self.counters: dict[str, int] = {}
        self.losses: list[float] = []
        self.fit_metrics: list[tuple[int, Mapping[str, Any]]] = []
        self.evaluations: list[tuple[float, int, Mapping[str, Any]]] = []
        self.bytes_in = 0
        self.dense_bytes = 0
        self._kept: dict[str, CheckedUpdate] = {}
        self._kept_bytes = 0

    # -- lifecycle ------------------------------------------------------------
    def begin(self, ann: RoundAnnouncement, agg: Any) -> None:
        """A new round: its announcement and aggregator; the intake starts empty."""
        with self.cv:
            self.ann = ann
            self.agg = agg
            self._reset()
            self.cv.notify_all()

    def restart_intake(self) -> None:
        """Empty the intake but keep the round (FedBuff: each new version starts counting anew)."""
        with self.cv:
            self._reset()

    def announce(self, ann: RoundAnnouncement) -> None:
        """Replace the announcement (a deadline extended; the round closed)."""
        with self.cv:
            self.ann = ann
            self.cv.notify_all()

    def close(self) -> RoundAnnouncement:
        """Stop the intake: updates that arrive from now on are late. Returns the closed announcement."""
        with self.cv:
            assert self.ann is not None, "close() with no round"
            self.ann = replace(self.ann, state="closed")
            self.cv.notify_all()
            return self.ann

    def view(self) -> RoundView | None:
        """The round as the rulebook (:mod:`edgeflow.gateway.intake`) sees it; None without a round."""
        with self.lock:
            a = self.ann
            if a is None:
                return None
            return RoundView(a.round_id, a.model_version, frozenset(a.selected), a.nonce, a.mode, a.state == "open")

    def is_open(self, round_id: int) -> bool:
        with self.lock:
            return self.ann is not None and self.ann.state == "open" and self.ann.round_id == round_id \
                and self.agg is not None

    # -- intake -----------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counters[key] = self.counters.get(key, 0) + n
            self.totals[key] = self.totals.get(key, 0) + n

    def has_reported(self, device_id: str) -> bool:
        with self.lock:
            return device_id in self.reported

    def record(self, device_id: str, *, nbytes: int, dense_elements: int = 0, num_samples: int = 1,
               loss: float | None = None, metrics: Mapping[str, Any] | None = None,
               evaluation: tuple[float, int, Mapping[str, Any]] | None = None) -> None:
        """Count one accepted contribution (its fit metrics, and its evaluation of the model it trained
        from) and wake the round's thread."""
        with self.cv:
            self.reported.add(device_id)
            self.bytes_in += int(nbytes)
            self.dense_bytes += 4 * int(dense_elements)
            if loss is not None:
                self.losses.append(float(loss))
            if metrics:
                self.fit_metrics.append((int(num_samples), dict(metrics)))
            if evaluation is not None:
                self.evaluations.append(evaluation)
            self.cv.notify_all()

    def forget(self, device_id: str) -> None:
        """A stored contribution turned out unusable at the fold: it no longer counts as reported."""
        with self.lock:
            self.reported.discard(device_id)

    def replace_intake(self, *, reported: set[str], losses: list[float], bytes_in: int, dense_bytes: int,
                       fit_metrics: list[tuple[int, Mapping[str, Any]]] | None = None) -> None:
        """What the round took in, as rebuilt elsewhere (ingestion workers' partials and the store)."""
        with self.cv:
            self.reported = set(reported)
            self.losses = list(losses)
            self.bytes_in = int(bytes_in)
            self.dense_bytes = int(dense_bytes)
            if fit_metrics is not None:
                self.fit_metrics = list(fit_metrics)

    def set_reported(self, reported: set[str]) -> None:
        with self.cv:
            self.reported = set(reported)
            self.cv.notify_all()

    def keep(self, upd: CheckedUpdate) -> None:
        """Hold a checked update's decoded tensors for the fold at the close (each update is decoded
        once), while they fit in :attr:`keep_bytes`; a round over the budget re-reads the rest."""
        size = _held_bytes(upd)
        with self.lock:
            if upd.device_id not in self._kept and self._kept_bytes + size <= self.keep_bytes:
                self._kept[upd.device_id] = upd
                self._kept_bytes += size

    def take(self, device_id: str) -> CheckedUpdate | None:
        """The kept update of ``device_id`` (released), or None: decode it from the state."""
        with self.lock:
            upd = self._kept.pop(device_id, None)
            if upd is not None:
                self._kept_bytes -= _held_bytes(upd)
            return upd

    @property
    def kept_bytes(self) -> int:
        """Bytes of checked updates held for the close now (at most :attr:`keep_bytes`)."""
        with self.lock:
            return self._kept_bytes

    def release(self) -> None:
        """Drop every kept update (the round closed, or failed)."""
        with self.lock:
            self._kept, self._kept_bytes = {}, 0

    def snapshot(self) -> Intake:
        with self.lock:
            return Intake(frozenset(self.reported), dict(self.counters), tuple(sorted(self.losses)),
                          tuple(self.fit_metrics), tuple(self.evaluations), self.bytes_in, self.dense_bytes)

    def wait(self, timeout: float) -> None:
        """Wait (lock held by the caller, as with a Condition) until something is recorded or timeout."""
        self.cv.wait(timeout)


def _held_bytes(upd: CheckedUpdate) -> int:
    """What keeping a checked update holds: its decoded tensors and its envelope."""
    return sum(int(v.nbytes) for v in upd.tensors.values()) + len(upd.payload)
