"""Asynchronous (FedBuff) rounds for the :class:`~edgeflow.gateway.rounds.RoundManager`.

A collaborator, not a mode branch inside the manager, shaped like
:class:`~edgeflow.gateway.secure_rounds.SecureRounds`: one long-running
"round" (a session) whose announcement stays open while devices train on
whatever version they last received and report when they are done. The
manager's update path (``_accept``) folds each accepted update into this
session's :class:`~edgeflow.gateway.buffered.BufferedAggregator`; every
``async_buffer`` updates (or, after ``deadline_s`` without a full buffer,
what the buffer holds) becomes a new model version at once, published and
reported like a round. The manager owns selection, the announcement, the
update path, metrics and reporting; this owns the session's loop.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import asdict
from typing import Any

from edgeflow.errors import AggregationError
from edgeflow.protocol.rounds import RoundAnnouncement

from .aggregation import AggregateResult
from .buffered import BufferedAggregator, make_staleness

__all__ = ["AsyncRounds"]

log = logging.getLogger("edgeflow.gateway.rounds")


class AsyncRounds:
    """The asynchronous half of a RoundManager (``rm.async_rounds``)."""

    def __init__(self, rm: Any) -> None:  # the RoundManager (which imports this module)
        self.rm = rm
        self.result: AggregateResult | None = None
        """A full buffer's aggregate, not yet adopted (set under ``rm._cv`` by the update path)."""

    def ready(self, result: AggregateResult) -> None:
        """The update path filled a buffer (called with ``rm._cv`` held; the caller notifies)."""
        self.result = result

    def run(self, versions: int) -> list[Any]:  # list[RoundMetrics]
        """One FedBuff session: ``versions`` new model versions (fewer if the manager stops)."""
        rm = self.rm
        cfg = rm.config
        buf = BufferedAggregator(rm._strategy, buffer_size=cfg.async_buffer,
                                 staleness_fn=make_staleness(cfg.staleness), max_staleness=cfg.max_staleness)
        buf.start(rm.weights, version=rm.version)
        pool = rm._wait_for_pool()
        selected = rm.select(pool)
        round_id = rm.store.last_round_id() + 1
        ann = RoundAnnouncement(round_id=round_id, model_version=rm.version, deadline=time.time() + 1e9,
                                selected=tuple(selected), config=cfg.train, mode="async", issued=time.time(),
                                epoch=rm.epoch, nonce=secrets.token_hex(8))
        rm.store.open_round(round_id, rm.version, ann.deadline,
                            {**asdict(cfg.train), "_nonce": ann.nonce, "_mode": "async"}, selected)
        with rm._cv:
            rm._ann = ann
            rm._agg = buf
            rm._reported, rm._counters, rm._losses = set(), {}, []
            rm._bytes_in = rm._dense_bytes = 0
            self.result = None
        rm._publish_round(ann)
        out: list[Any] = []
        t_start = time.perf_counter()
        while len(out) < versions and not rm._stop.is_set():
            with rm._cv:
                end = time.time() + cfg.deadline_s
                while self.result is None and not rm._stop.is_set() and time.time() < end:
                    rm._cv.wait(0.1)
                result, self.result = self.result, None
                if result is None:
                    result = buf.flush()
                if result is None:
                    continue
            try:
                self.adopt(result, round_id)
            except AggregationError as exc:
                log.error("async session %d: buffered aggregate refused (%s); the model stays v%d",
                          round_id, exc, rm.version)
                continue
            m = rm._metrics(ann, result, 0.0, t_start)
            with rm._lock:
                rm._reported, rm._counters, rm._losses = set(), {}, []
                rm._bytes_in = rm._dense_bytes = 0
            t_start = time.perf_counter()
            out.append(m)
            rm._report(m)
        closed = RoundAnnouncement(**{**ann.__dict__, "state": "closed"})
        with rm._cv:
            rm._ann = closed
        rm._publish_round(closed)
        rm.store.finish_round(round_id, {"versions": len(out)})
        return out

    def adopt(self, result: AggregateResult, round_id: int) -> None:
        """Each buffered aggregate becomes a version at once (the session stays open)."""
        rm = self.rm
        rm._stage(result)
        staged, rm._staged = rm._staged, None
        assert staged is not None
        rm.version = rm.store.add_model(staged.onnx_bytes, staged.sha256, round_id=round_id, version=staged.version)
        rm.weights = staged.weights
        rm.publish_model()
