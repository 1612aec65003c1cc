"""Secure aggregation rounds for the :class:`~edgeflow.gateway.rounds.RoundManager`.

A collaborator, not a mode flag inside the manager: it holds the round's
:class:`~edgeflow.gateway.secagg.SecAggServer`, receives the devices' sealed
SecAgg frames, drives the four phases of Bonawitz et al. over MQTT and hands
the unmasked sum to the manager's aggregator. The manager owns the round
(selection, announcement, deadline, commit); this owns the protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgeflow.errors import AggregationError, CodecError, SignatureError
from edgeflow.protocol.rounds import RoundAnnouncement
from edgeflow.transport.topics import gateway_topic, parse_topic

from .aggregation import AggregateResult

log = logging.getLogger("edgeflow.gateway.rounds")

DEFAULT_WEIGHT_CAP = 10_000
"""A client's weight (claimed samples) in a secure round is at most ``[rounds.secagg] weight_cap``, else the
round's ``max_samples``, else this."""

DEFAULT_COMPACT_CLIP = 4.0
"""Without a norm bound, the compact fixed point holds weighted values ``(w / weight_cap) * x`` within +-this:
a client at the full weight cap may send delta coordinates up to 4, one with a tenth of it up to 40; a larger
value is refused by its client, never clipped. Set ``[rounds.secagg] clip`` (or ``ring_bits = 64``) for models
whose deltas are larger. Each halving of it is one more fractional bit."""


def session_config(num_clients: int, secagg: Mapping[str, Any], max_samples: int | None = None,
                   strategy_clip: Any = None) -> Any:  # SecAggConfig
    """The SecAggConfig of a session of ``num_clients`` from ``[rounds] secagg``.

    What the gateway can check: each client's weight at most ``weight_cap`` (else the round's sample cap,
    else :data:`DEFAULT_WEIGHT_CAP`) and, when configured (``norm_bound``, or a fixed ``strategy_params.clip``),
    each delta within a norm bound; the server checks the unmasked sum against both. The fixed point: with
    none of ``ring_bits``, ``frac_bits``, ``clip`` set, the compact encoding (issue 34): a 32-bit ring with as
    many fractional bits as the sum of ``num_clients`` values within +-``clip`` leaves, ``clip`` =
    ``max(1, norm_bound)`` with a norm bound (exact: no honest value exceeds it) else
    :data:`DEFAULT_COMPACT_CLIP`; set any of the three for :meth:`SecAggConfig.for_clients` as before.
    """
    from edgeflow.protocol.secagg import SecAggConfig

    opts = dict(secagg)
    opts.pop("phase_timeout_s", None)
    frac = float(opts.pop("max_dropout_fraction", 0.3))
    opts.setdefault("weight_cap", float(max_samples or DEFAULT_WEIGHT_CAP))
    if "norm_bound" not in opts and isinstance(strategy_clip, (int, float)) and not isinstance(strategy_clip, bool):
        opts["norm_bound"] = float(strategy_clip)
    if not {"ring_bits", "frac_bits", "clip"} & set(opts):
        bound = opts.get("norm_bound")
        clip = max(1.0, float(bound)) if bound is not None else DEFAULT_COMPACT_CLIP
        return SecAggConfig.compact(num_clients, frac, clip=clip, **opts)
    return SecAggConfig.for_clients(num_clients, frac, **opts)


class SecureRounds:
    """The secure half of a RoundManager (``rm.secure``)."""

    def __init__(self, rm: Any) -> None:  # the RoundManager (which imports this module): its open round and
        # public methods (open, weights, keyring, fleet, fleet_key, config, stopping, publish_reliably,
        # publish_round, fail_round, finish_round)
        self.rm = rm
        self.server: Any = None  # SecAggServer of the open round, if any
        self.seen: dict[str, set[str]] = {}  # message kind -> devices it came from, this round

    def on_frame(self, msg: Any) -> None:
        try:
            self._handle(msg)
        except Exception:  # noqa: BLE001 - one message must never take the transport's worker thread down
            self.rm.open.count("rejected_internal")
            log.exception("secagg frame on %s dropped after an unexpected failure (a bug: please report it)",
                          msg.topic)

    def _handle(self, msg: Any) -> None:
        from edgeflow.protocol import secagg_wire as secure

        from edgeflow.protocol.secagg import AdvertiseKeys, MaskedInput, SecAggError, ShareCheck, ShareKeys, UnmaskResponse

        info = parse_topic(msg.topic)
        sender = info.device if info else None
        if sender is None:
            return  # our own broadcast on gateway/secagg also matches +/secagg
        try:
            m = secure.decode(secure.unseal_from(msg.payload, self.rm.keyring, sender))
            if getattr(m, "client_id", None) != sender:
                raise SignatureError(f"secagg frame names {getattr(m, 'client_id', None)!r} but came from {sender!r}")
            rnd = self.rm.open
            with rnd.cv:
                server = self.server
                if server is None:
                    rnd.count("late")
                    return
                if isinstance(m, AdvertiseKeys):
                    if rnd.ann is None or sender not in rnd.ann.selected:
                        rnd.count("not_selected")
                        return
                    server.receive_advertise(m)
                elif isinstance(m, ShareKeys):
                    server.receive_share_keys(m)
                elif isinstance(m, MaskedInput):
                    server.receive_masked_input(m)
                    rnd.record(sender, nbytes=len(msg.payload))
                elif isinstance(m, ShareCheck):
                    server.receive_share_check(m)
                elif isinstance(m, UnmaskResponse):
                    server.receive_unmask(m)
                else:
                    raise SecAggError(f"unexpected secagg message {type(m).__name__}")
                self.seen.setdefault(type(m).__name__, set()).add(sender)
                rnd.cv.notify_all()
        except (CodecError, SignatureError, SecAggError) as exc:
            self.rm.open.count("rejected_secagg")
            log.warning("secagg frame from %s refused: %s", sender, exc)

    def _phase(self, kind: str, expected: set[str], until: float) -> set[str]:
        rnd = self.rm.open
        with rnd.cv:
            while not self.rm.stopping.is_set() and time.time() < until:
                if expected <= self.seen.get(kind, set()):
                    break
                rnd.wait(0.05)
            return set(self.seen.get(kind, set()))

    def _broadcast(self, frame: bytes) -> None:
        from edgeflow.protocol import secagg_wire as secure

        self.rm.publish_reliably(str(gateway_topic(self.rm.fleet, "secagg")), secure.seal(frame, self.rm.fleet_key),
                              "secure-aggregation broadcast", retain=False, until=time.time() + 60.0)

    def prepare(self, ann: RoundAnnouncement) -> None:
        """Install the round's SecAgg server *before* the announcement goes out.

        Devices advertise their keys as soon as the announcement reaches them
        and never re-send; a server installed only after the announcement's
        PUBACK (a busy gateway, a PUBACK lost in a reconnect) dropped every
        advert as late and failed the round.
        """
        if not ann.config.secagg:
            return
        from .secagg import SecAggServer

        config = session_config(len(ann.selected), self.rm.config.secagg or {}, ann.config.max_samples,
                                self.rm.config.strategy_params.get("clip"))
        server = SecAggServer(config, self.rm.weights, round_id=ann.round_id)
        with self.rm.open.cv:
            self.server = server
            self.seen = {}

    def run(self, ann: RoundAnnouncement, t_start: float) -> Any:  # RoundMetrics
        """Bonawitz et al. over MQTT; the aggregator only ever receives the unmasked sum."""
        rnd = self.rm.open
        with rnd.cv:
            server = self.server if self.server is not None and self.server.round_id == ann.round_id else None
        if server is None:  # not prepared before the announcement (e.g. a caller of _collect_and_close)
            self.prepare(ann)
            server = self.server
        result = None
        reason = "stopped"
        final, guilty = None, {}
        try:
            sa_result, final, guilty = self._phases(ann, server)
            t0 = time.perf_counter()
            result = self._fold_sum(sa_result)
            agg_s = time.perf_counter() - t0
        except AggregationError as exc:  # SecAggError, or a non-finite sum
            log.error("round %d: secure aggregation failed: %s", ann.round_id, exc)
            reason = str(exc)
            agg_s = 0.0
        finally:
            with rnd.cv:
                self.server = None
                closed = rnd.close()
        self.rm.publish_round(closed)
        if result is None:
            return self.rm.fail_round(ann, t_start, f"secure aggregation failed: {reason}", 0)
        if sa_result.num_clients < self.rm.config.min_clients:
            return self.rm.fail_round(ann, t_start, f"{sa_result.num_clients} masked input(s) unmasked, below "
                                                    f"min_clients {self.rm.config.min_clients}", sa_result.num_clients)
        result = AggregateResult(**{**result.__dict__, "num_clients": sa_result.num_clients})
        excluded = [c for c in final.excluded if c not in guilty]
        return self.rm.finish_round(ann, result, agg_s, t_start,
                                    extra={"secagg_dropped": float(len(sa_result.dropped) + len(excluded)),
                                           "secagg_excluded": float(len(guilty))})

    def _phases(self, ann: RoundAnnouncement, server: Any) -> tuple[Any, Any, dict[str, str]]:
        """The protocol's phases, each broadcast and collected in turn: the unmasked sum, the final
        list of holders and the senders left out for shares that failed their check."""
        from edgeflow.protocol import secagg_wire as secure

        phase_s = float(dict(self.rm.config.secagg or {}).get("phase_timeout_s", 10.0))
        rnd = self.rm.open
        adv = self._phase("AdvertiseKeys", set(ann.selected), min(ann.deadline, time.time() + phase_s))
        with rnd.lock:
            directory = server.key_directory()
        self._broadcast(secure.encode(directory))
        self._phase("ShareKeys", adv, min(ann.deadline, time.time() + phase_s))
        with rnd.lock:
            bundles = server.share_bundles()
        self._broadcast(secure.pack_bundles([secure.encode(b) for b in bundles.values()]))
        # round 1b: every holder checks its shares; a sender whose share fails (verified with the
        # accuser's evidence) is left out, and so is a false accuser; the rest mask against the final list
        self._phase("ShareCheck", set(bundles), min(ann.deadline, time.time() + phase_s))
        with rnd.lock:
            final = server.final_holders()
            guilty = server.guilty
        for who, why in sorted(guilty.items()):
            rnd.count("rejected_secagg_shares")
            log.warning("round %d: secure aggregation: %s is left out of the round: %s", ann.round_id, who, why)
        self._broadcast(secure.encode(final))
        # the check may have waited for silent holders until the deadline: the masked inputs still get a phase
        self._phase("MaskedInput", set(final.holders), max(ann.deadline, time.time() + phase_s))
        with rnd.lock:
            request = server.unmask_request()
        self._broadcast(secure.encode(request))
        self._phase("UnmaskResponse", set(request.survivors), time.time() + phase_s)
        with rnd.lock:
            return server.finish(), final, guilty

    def _fold_sum(self, sa_result: Any) -> Any:
        """The unmasked sum into the round's aggregator, as one partial of the survivors' total weight."""
        rnd = self.rm.open
        with rnd.lock:
            summed = {k: np.asarray(v, dtype=self.rm.weights[k].dtype) for k, v in sa_result.sum.items()}
            total = int(round(sa_result.total_weight))
            if total < 1:
                raise AggregationError(f"the survivors' weights sum to {sa_result.total_weight:g}; nothing to "
                                       "average")
            rnd.agg.add_partial(summed, total_samples=total, num_clients=sa_result.num_clients,
                                client_id="secagg")
            return rnd.agg.finish()
