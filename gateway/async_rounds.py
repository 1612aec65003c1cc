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
        """A full buffer's aggregate, not yet adopted (set under the open round's lock by the update path)."""

    def ready(self, result: AggregateResult) -> None:
        """The update path filled a buffer (called with the open round's lock held; it notifies)."""
        self.result = result

    def run(self, versions: int) -> list[Any]:  # list[RoundMetrics]
        """One FedBuff session: ``versions`` new model versions (fewer if the manager stops)."""
        rm = self.rm
        cfg = rm.config
        pool = rm.wait_for_pool()
        selected = rm.select(pool)
        buf = BufferedAggregator(rm.strategy, buffer_size=self.buffer_size(len(selected)),
                                 staleness_fn=make_staleness(cfg.staleness), max_staleness=cfg.max_staleness,
                                 server_lr=cfg.async_server_lr)
        buf.start(rm.weights, version=rm.version)
        round_id = rm.store.last_round_id() + 1
        ann = RoundAnnouncement(round_id=round_id, model_version=rm.version, deadline=time.time() + 1e9,
                                selected=tuple(selected), config=cfg.train, mode="async", issued=time.time(),
                                epoch=rm.epoch, nonce=secrets.token_hex(8))
        rm.store.open_round(round_id, rm.version, ann.deadline,
                            {**asdict(cfg.train), "_nonce": ann.nonce, "_mode": "async"}, selected)
        rnd = rm.open
        with rnd.cv:
            rnd.begin(ann, buf)
            self.result = None
        rm.publish_round(ann)
        out: list[Any] = []
        t_start = time.perf_counter()
        while len(out) < versions and not rm.stopping.is_set():
            with rnd.cv:
                end = time.time() + cfg.deadline_s
                while self.result is None and not rm.stopping.is_set() and time.time() < end:
                    rnd.wait(0.1)
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
            m = rm.round_metrics(ann, result, 0.0, t_start)
            rnd.restart_intake()
            t_start = time.perf_counter()
            out.append(m)
            rm.report(m)
        rm.publish_round(rnd.close())
        rm.store.finish_round(round_id, {"versions": len(out)})
        return out

    def buffer_size(self, selected: int) -> int:
        """K: ``async_buffer``, at most the session's devices (a buffer takes one update per device, so a
        larger one could only fill by its deadline)."""
        k = self.rm.config.async_buffer
        if k > selected >= 1:
            log.info("async session: async_buffer %d > the %d devices selected; buffers of %d", k, selected, selected)
            return selected
        return k

    def adopt(self, result: AggregateResult, round_id: int) -> None:
        """Each buffered aggregate becomes a version at once (the session stays open)."""
        rm = self.rm
        staged = rm.stage(result, hold=False)
        rm.version = rm.store.add_model(staged.onnx_bytes, staged.sha256, round_id=round_id, version=staged.version)
        rm.weights = staged.weights
        rm.publish_model()
