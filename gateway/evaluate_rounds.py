"""Federated evaluate rounds: Flower's ``fraction_evaluate`` on edgeflow's fleet.

After a synchronous round has published its model (vN), the gateway draws
``fraction_evaluate`` of the online devices that can train (at least
``min_evaluate_clients``; fewer online: the evaluation is skipped, and the
round's metrics say so), announces an *evaluate* round on ``gateway/round``
(``mode`` "evaluate", the round's id, model vN, a fresh nonce, a deadline of
``evaluate_deadline_s``), and waits for the selected devices' signed
:class:`~edgeflow.protocol.rounds.EvaluationReport` on their ``evaluate``
channel: loss, examples and metrics of vN on their own data. Each report
passes :func:`edgeflow.gateway.intake.check_evaluation` (open, selected, not
yet reported, the device's signature, the round's id, nonce and model version,
every number in range) before it counts.

The figures join the round's own metrics (in the store and in metrics.jsonl),
as Flower's ``losses_distributed`` / ``metrics_distributed``:
``dist_eval_loss`` (weighted by examples), ``dist_eval_<name>`` (each metric
aggregated by examples, or by the user's ``evaluate_metrics_fn``),
``dist_eval_clients``, ``dist_eval_examples``, ``dist_eval_selected`` and
``dist_eval_rejected``. The selection is drawn from a generator seeded by
(``seed``, round id): a restarted gateway draws the same devices and the
round selection's own generator is untouched. An evaluate round interrupted by
a gateway restart is not repeated (its round already stored its model).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from edgeflow.errors import CodecError, SignatureError
from edgeflow.protocol.rounds import EvaluationReport, RoundAnnouncement
from edgeflow.transport.topics import device_filter, parse_topic

from .aggregate import weighted_metrics
from .intake import RoundView, check_evaluation

log = logging.getLogger("edgeflow.gateway.evaluate")

__all__ = ["EvaluateRounds", "aggregate_evaluations"]


def aggregate_metrics(results: list[tuple[int, Mapping[str, Any]]]) -> dict[str, Any]:
    """The default aggregation of client metrics (pure): numbers by their example-weighted mean
    (:func:`~edgeflow.gateway.aggregate.weighted_metrics`), true/false as the example-weighted share of true,
    text as the value reported for the most examples (ties: the first in sorted order)."""
    numbers = [(n, {k: v for k, v in m.items() if not isinstance(v, str)}) for n, m in results]
    out: dict[str, Any] = dict(weighted_metrics(numbers))
    texts: dict[str, dict[str, int]] = {}
    for n, m in results:
        for k, v in m.items():
            if isinstance(v, str):
                texts.setdefault(k, {})[v] = texts.setdefault(k, {}).get(v, 0) + int(n)
    for k, votes in texts.items():
        out[k] = min(votes, key=lambda v: (-votes[v], v))
    return dict(sorted(out.items()))


def metric_value(v: Any) -> Any:
    """A metric as the round's record keeps it: text as it is, anything else as a float."""
    return v if isinstance(v, str) else float(v)


def aggregate_evaluations(reports: list[EvaluationReport], metrics_fn: Any = None) -> dict[str, float]:
    """Flower's weighted loss average and metrics aggregation over the reports (pure)."""
    if not reports:
        return {}
    out = {"dist_eval_clients": float(len(reports)),
           "dist_eval_examples": float(sum(r.num_examples for r in reports)),
           "dist_eval_loss": weighted_metrics([(r.num_examples, {"loss": r.loss}) for r in reports])["loss"]}
    with_metrics = [(r.num_examples, r.metrics) for r in reports if r.metrics]
    if with_metrics:
        agg = (metrics_fn or aggregate_metrics)(with_metrics)
        out.update({f"dist_eval_{k}": metric_value(v) for k, v in dict(agg).items()})
    return out


class EvaluateRounds:
    """The evaluate round of a :class:`~edgeflow.gateway.rounds.RoundManager` (one open at a time)."""

    def __init__(self, manager: Any) -> None:  # the RoundManager (which imports this module)
        self.m = manager
        self._cv = threading.Condition()
        self._rnd: RoundView | None = None
        self._reports: dict[str, EvaluationReport] = {}
        self._counters: Counter[str] = Counter()
        self._sub: Any = None

    def attach(self) -> None:
        """Subscribe to every device's evaluate channel (once)."""
        if self._sub is None:
            self._sub = self.m.transport.subscribe(str(device_filter(self.m.fleet, "evaluate")), self.on_report)

    def on_report(self, msg: Any) -> None:
        try:
            self._handle(msg)
        except Exception:  # noqa: BLE001 - one message must never take the transport's worker thread down
            with self._cv:
                self._counters["rejected_internal"] += 1
            log.exception("evaluation report on %s dropped after an unexpected failure (a bug: please report it)",
                          msg.topic)

    def _handle(self, msg: Any) -> None:
        info = parse_topic(msg.topic)
        sender = info.device if info else None
        with self._cv:
            try:
                rep = check_evaluation(msg.payload, self._rnd, sender, keyring=self.m.keyring,
                                       reported=self._reports.__contains__)
            except (CodecError, SignatureError) as exc:
                reason = getattr(exc, "reason", "invalid")
                self._counters[reason if reason in ("late", "not_selected", "duplicates") else f"rejected_{reason}"] += 1
                log.warning("evaluation report from %s refused (%s): %s", sender, reason, exc)
                return
            self._reports[sender] = rep  # type: ignore[index]
            self._cv.notify_all()

    def select(self, round_id: int) -> tuple[list[str], int]:
        """The devices drawn for the evaluate round after ``round_id``, and how many were eligible."""
        cfg = self.m.config
        eligible = sorted(c.device_id for c in self.m.candidates() if c.can_train)
        n = min(len(eligible), max(cfg.min_evaluate_clients, math.ceil(cfg.fraction_evaluate * len(eligible))))
        rng = np.random.default_rng([cfg.seed, round_id, 0xE7A1])
        return sorted(eligible[i] for i in rng.choice(len(eligible), n, replace=False)), len(eligible)

    def run(self, round_id: int) -> dict[str, float]:
        """Evaluate the current global model on ``fraction_evaluate`` of the fleet; the round's extra metrics."""
        cfg = self.m.config
        selected, eligible = self.select(round_id)
        if eligible < cfg.min_evaluate_clients:
            log.warning("round %d: evaluate round skipped: %d device(s) can evaluate, min_evaluate_clients is %d",
                        round_id, eligible, cfg.min_evaluate_clients)
            return {"dist_eval_skipped": 1.0, "dist_eval_selected": 0.0}
        now = time.time()
        ann = RoundAnnouncement(round_id=round_id, model_version=self.m.version,
                                deadline=now + (cfg.evaluate_deadline_s or cfg.deadline_s), selected=tuple(selected),
                                config=cfg.train, mode="evaluate", issued=now, epoch=self.m.epoch,
                                nonce=secrets.token_hex(8))
        with self._cv:
            self._rnd = RoundView(round_id, ann.model_version, frozenset(selected), ann.nonce, "evaluate", True)
            self._reports, self._counters = {}, Counter()
        self.m.publish_round(ann)
        with self._cv:
            while (not self.m.stopping.is_set() and len(self._reports) < len(selected)
                   and time.time() < ann.deadline):
                self._cv.wait(min(0.2, max(0.0, ann.deadline - time.time())))
            self._rnd = replace(self._rnd, open=False)
            reports, counters = [self._reports[d] for d in sorted(self._reports)], dict(self._counters)
        self.m.publish_round(replace(ann, state="closed"))
        out = aggregate_evaluations(reports, self.m.evaluate_metrics_fn)
        out["dist_eval_selected"] = float(len(selected))
        out["dist_eval_rejected"] = float(sum(v for k, v in counters.items() if k.startswith("rejected_")))
        if len(reports) < len(selected):
            log.info("round %d: evaluate round closed with %d of %d reports", round_id, len(reports), len(selected))
        return out
