"""Federated rounds at the gateway: select, announce, collect, aggregate, publish.

One :class:`RoundManager` drives rounds over a transport (anything with
``subscribe``/``publish``; in production :class:`edgeflow.transport.MqttTransport`)
and keeps its state in a :class:`~edgeflow.gateway.store.GatewayStore`:

1. **select** online devices that can train (profile filter, battery
   floor from telemetry), a fraction of them, at least ``min_clients``,
   over-selected by ``overselect`` so stragglers do not stall the round;
2. **announce** the round (signed, retained) with the model version,
   hyper-parameters and deadline; the global weights are already retained
   on ``gateway/model``;
3. **collect** updates: each one is checked (round, selection, signature,
   replay, shapes, NaN) and *stored*; the round closes when every selected
   device reported, or at the deadline once ``quorum`` updates are in
   (extended up to ``max_extensions`` times otherwise); at the close the
   stored updates are folded into the streaming aggregator one at a time in
   device-id order, so the new model does not depend on arrival order;
4. **aggregate** and **publish** the new version (retained), evaluate it
   when an eval set is configured, and record one metrics line.

A gateway killed mid-round resumes the open round on restart: the stored
updates are kept and the broker redelivers what was not acknowledged; the (round, device) key in the store makes every
update count once. A round ends in one transaction (the new model version,
the round closed, its envelopes dropped), so a restart after a crash at any
step finds a consistent state (tests/test_gateway_crash_points.py kills the
gateway at each :data:`edgeflow.faults.POINTS` step).

What the gateway trusts (docs/security.md): nothing a device claims. Every
update is fully validated before anything is stored (envelope, signature,
shapes, values bounded by the codecs, metadata types and ranges, round nonce,
replay floor); FedAvg bounds each update's norm and sample count by default;
a round below ``min_clients`` fails without publishing a model; the aggregate
is checked finite before it is stored; a broker that does not acknowledge a
publish is waited for and retried, never fatal.

Epochs. Each gateway process starts a new *epoch* (milliseconds since the
Unix epoch, above any earlier one in the state) and signs it into every
announcement and model; a round also gets a random *nonce* when it is opened.
Devices follow a higher epoch even when its model versions and round ids are
lower (a wiped or restored state) and refuse older epochs (replays); they echo
the nonce in their update, and the gateway refuses an update whose nonce is
another round's, so round ids that repeat after a restore cannot bring back
captured updates.

The asynchronous mode (FedBuff) keeps one long-running "round": every
device trains from the newest version it has, and the gateway publishes a
new version every ``async_buffer`` updates, weighting each by staleness.
Secure and asynchronous rounds are collaborators of the manager
(:class:`~edgeflow.gateway.secure_rounds.SecureRounds` as ``rm.secure``,
:class:`~edgeflow.gateway.async_rounds.AsyncRounds` as ``rm.async_rounds``);
the manager keeps selection, announcement, the update path and the commit.

Beyond one gateway, three small seams keep this loop unchanged
(docs/scaling.md):

- an :class:`AggregateSink` decides what the round's aggregate becomes:
  :class:`AdoptAndPublish` (flat gateway, hierarchy root: the new global
  model) or a site gateway's forward-upward sink
  (:mod:`edgeflow.gateway.hierarchy`);
- ``contributions="partials"`` makes the manager fold pre-summed partial
  aggregates (a site gateway's sum and weight) instead of device updates,
  so a root gateway is this same manager with sites as its clients;
- an :class:`UpdateSource` replaces the manager's own update subscription
  with ingestion workers that share it (:mod:`edgeflow.gateway.ingest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np
import onnx

from edgeflow.codecs import encode_update, peek_update
from edgeflow.errors import (
    AggregationError,
    CodecError,
    ConfigError,
    SignatureError,
    StateError,
    TransportError,
)
from edgeflow.faults import fault_point
from edgeflow.protocol.rounds import RoundAnnouncement, TrainConfig
from edgeflow.signing import KeyRing, PrivateKey, ReplayGuard, Signer
from edgeflow.transport.backoff import Backoff
from edgeflow.transport.base import Transport
from edgeflow.transport.topics import device_filter, gateway_topic, parse_topic

from .aggregate import weighted_metrics
from .aggregation import AggregateResult, decode_state, encode_state
from .async_rounds import AsyncRounds
from .downlink import ModelDownlink
from .evaluate_rounds import EvaluateRounds, aggregate_metrics, metric_value
from .first_parameters import FirstParameters
from .global_model import classification_metrics, model_weights, model_with_weights, trained_weight_names
from .intake import CheckedUpdate, RoundView, check_update, screen
from .open_round import OpenRound
from .round_config import Candidate, RoundConfig
from .secure_rounds import SecureRounds
from .store import GatewayStore, StoreError
from .strategies import AUTO, StrategyChoice, folds_partials, make_aggregator

log = logging.getLogger("edgeflow.gateway.rounds")

GATEWAY_ID = "gateway"
_ROBUST_METRICS = ("clipped", "capped", "norm_bound", "sample_cap", "median_norm", "median_samples", "delta_norm")


@dataclass
class RoundMetrics:
    round_id: int
    model_version: int
    selected: int
    participants: int
    dropped: int
    late: int
    rejected: int
    duplicates: int
    bytes_in: int
    dense_bytes: int
    aggregation_s: float
    round_s: float
    mean_client_loss: float | None = None
    accuracy: float | None = None
    eval_loss: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


class AggregateSink(Protocol):
    """What a finished synchronous round does with its aggregate."""

    def deliver(self, rounds: "RoundManager", result: AggregateResult, ann: RoundAnnouncement) -> None: ...


class AdoptAndPublish:
    """The aggregate becomes the new global model: stored as a version and
    published retained on ``gateway/model`` (a flat gateway, a hierarchy root).

    ``deliver`` only stages the new weights; the manager stores them together
    with the round's closing (one transaction) and then publishes them."""

    def deliver(self, rounds: "RoundManager", result: AggregateResult, ann: RoundAnnouncement) -> None:
        rounds.stage(result)


@dataclass
class _Staged:
    """A new global model waiting for the round's commit."""

    weights: dict[str, np.ndarray]
    onnx_bytes: bytes
    sha256: str
    version: int


class UpdateSource(Protocol):
    """Where a synchronous round's updates come from when the manager does not
    subscribe to them itself (ingestion workers sharing the subscription).

    ``attach`` replaces the manager's own update subscription (called from
    :meth:`RoundManager.start`); ``poll`` refreshes who reported
    (``rounds.open.set_reported``) while the round collects (called every
    0.1 s with the open round's lock held); ``merge`` runs once the round
    closed, before ``finish``: it must leave the open round's aggregator
    (``rounds.open.agg``) holding every accepted update exactly once, and its
    intake (``rounds.open.replace_intake``) saying what was taken in. A source whose
    ``folds_partials`` is true hands over pre-added sums: the manager then refuses a
    strategy that cannot fold them.
    """

    def attach(self, rounds: "RoundManager") -> None: ...

    def poll(self, rounds: "RoundManager", ann: RoundAnnouncement) -> None: ...

    def merge(self, rounds: "RoundManager", ann: RoundAnnouncement) -> None: ...


class RoundManager:
    """Runs federated rounds for one fleet. See the module docstring."""

    def __init__(
        self,
        transport: Transport,
        store: GatewayStore,
        *,
        fleet: str,
        fleet_key: PrivateKey,
        keyring: KeyRing,
        model: onnx.ModelProto | None,
        config: RoundConfig,
        candidates: Callable[[], list[Candidate]],
        eval_data: tuple[np.ndarray, np.ndarray] | None = None,
        on_round: Callable[[RoundMetrics], None] | None = None,
        sink: AggregateSink | None = None,
        aggregator: Any = None,
        contributions: str = "updates",
        ingest: UpdateSource | None = None,
        weight_names: Iterable[str] | None = None,
        evaluator: Callable[[onnx.ModelProto, Any], Mapping[str, float]] | None = None,
        selector: Callable[[list[Candidate], int, Any], Iterable[str]] | None = None,
        fit_metrics_fn: Callable[[list[tuple[int, Mapping[str, float]]]], Mapping[str, float]] | None = None,
        evaluate_metrics_fn: Callable[[list[tuple[int, Mapping[str, float]]]], Mapping[str, float]] | None = None,
    ) -> None:
        """``sink`` (default :class:`AdoptAndPublish`), ``aggregator`` (default: the
        configured strategy), ``contributions`` ("updates" from devices, or
        "partials" from site gateways) and ``ingest`` (default: subscribe here)
        are the seams described in the module docstring. ``weight_names``: the
        weights the rounds federate (default: every float initializer); a fleet
        fine-tuning only a pretrained model's head or biases names just those,
        so the model broadcast and every update carry only them. ``evaluator``:
        ``(model, eval_data) -> {metric: value}``, run on each new global model
        when ``eval_data`` is given (default :func:`classification_metrics`:
        top-1 accuracy and cross-entropy on onnxruntime or numpy for the
        x86-gateway profile); "accuracy" and "loss" fill the round's metrics,
        any other key goes to its ``extra`` as ``eval_<key>``. ``selector``:
        ``(eligible, n, rng) -> device ids``, which ``n`` of the eligible
        candidates (those that can train and pass the profile/battery filters)
        a round takes; default: ``n`` uniformly at random (seeded). ``fit_metrics_fn`` /
        ``evaluate_metrics_fn``: Flower's ``fit_metrics_aggregation_fn`` / ``evaluate_metrics_aggregation_fn``,
        ``[(num_examples, metrics)] -> metrics``, for the metrics clients send with their updates (default:
        the example-weighted mean of each, :func:`~edgeflow.gateway.aggregate.weighted_metrics`)."""
        if contributions not in ("updates", "partials"):
            raise ConfigError(f"contributions must be 'updates' or 'partials', got {contributions!r}")
        self.sink: AggregateSink = sink or AdoptAndPublish()
        self.contributions = contributions
        self.ingest = ingest
        self.transport = transport
        self.store = store
        self.fleet = fleet
        self.fleet_key = fleet_key
        self.signer = Signer(GATEWAY_ID, fleet_key)
        self.keyring = keyring
        self.base_model = model
        self.config = config
        self.candidates = candidates
        self.eval_data = eval_data
        self.evaluator = evaluator or classification_metrics
        self.selector = selector
        self.fit_metrics_fn = fit_metrics_fn
        self.evaluate_metrics_fn = evaluate_metrics_fn
        self.on_round = on_round
        self.replay = ReplayGuard()
        self.open = OpenRound()
        """The round being collected: announcement, aggregator, intake (gateway/open_round.py)."""
        self._stop = threading.Event()
        self._sub = None
        self._rng = np.random.default_rng(config.seed)
        self.history: list[RoundMetrics] = []
        self._recovered: RoundAnnouncement | None = None
        self.secure = SecureRounds(self)  # secure aggregation: its server and phases (gateway/secure_rounds.py)
        self.async_rounds = AsyncRounds(self)  # FedBuff: the long-running session (gateway/async_rounds.py)
        self.evaluate_rounds = EvaluateRounds(self)  # fraction_evaluate (gateway/evaluate_rounds.py)
        self._staged: _Staged | None = None
        self.downlink = ModelDownlink(config.downlink)
        """What devices get of each new version: the full model, and a delta first (gateway/downlink.py)."""
        self.first_parameters = FirstParameters(self)
        """Asks one device for the first parameters when there is no model yet (gateway/first_parameters.py)."""
        self.version, self.weights = self._global_model(model)
        self.weights = self._federated(self.weights, model, weight_names)
        self.epoch = self._new_epoch()
        if aggregator is not None:
            name = str(getattr(aggregator, "name", "") or type(aggregator).__name__)
            self.strategy_choice = StrategyChoice(name, name)
            self._strategy = aggregator
        else:
            self.strategy_choice = self._choose_strategy(contributions, ingest)
            self._strategy = self._make_strategy()
        self._require_partial_folding(contributions, ingest)
        self._restore_run()

    # -- the global model at start ----------------------------------------------
    def _global_model(self, model: onnx.ModelProto | None) -> tuple[int, dict[str, np.ndarray]]:
        """The version and weights the rounds start from: the state's latest model, else ``model``
        (stored as version 1), else none yet (run() asks a device for the first parameters)."""
        latest = self.store.latest_model()
        if latest is None and model is None:
            return 0, {}
        if latest is None:
            assert model is not None
            blob = model.SerializeToString()
            return self.store.add_model(blob, hashlib.sha256(blob).hexdigest()), model_weights(model)
        version, blob = latest[0], latest[1]
        if model is None:
            self.base_model = onnx.load_model_from_string(blob)
        try:
            return version, model_weights(onnx.load_model_from_string(blob))
        except Exception as exc:  # noqa: BLE001 - a damaged blob must become one clear line
            raise StateError(f"gateway state {self.store.path}: model v{version} cannot be loaded ({exc}); "
                             "restore a backup or start without a state file (docs/security.md)") from None

    def _federated(self, weights: dict[str, np.ndarray], model: onnx.ModelProto | None,
                   weight_names: Iterable[str] | None) -> dict[str, np.ndarray]:
        """The weights the rounds federate: ``weight_names``, else those the model marks as trained,
        else every float initializer."""
        if self.base_model is None:  # no model yet: the first parameters come from a device
            if weight_names is not None:
                raise ConfigError("weight_names need a model; without one the first parameters come from a device")
            return weights
        if weight_names is None:
            trained = trained_weight_names(model if model is not None else self.base_model)
            if trained is not None and set(trained) <= set(weights):
                return {n: w for n, w in weights.items() if n in set(trained)}
            return weights
        names = list(dict.fromkeys(weight_names))
        unknown = [n for n in names if n not in weights]
        if unknown or not names:
            raise ConfigError(f"weight_names {unknown[:4] or '(none)'} are not float weights of the model; "
                              f"it has {len(weights)} (e.g. {list(weights)[:3]})")
        return {n: weights[n] for n in names}

    # -- plumbing -----------------------------------------------------------
    def _require_partial_folding(self, contributions: str, ingest: UpdateSource | None) -> None:
        """One rule for both ways sums arrive pre-added (site gateways' partial aggregates, ingestion
        workers' partial sums): the strategy must fold them (``add_partial``); one holding each update
        to compare (median, Krum-based) is refused here, before anything connects."""
        if folds_partials(self._strategy):
            return
        if contributions == "partials":
            who = "site gateways send partial aggregates"
        elif getattr(ingest, "folds_partials", False):
            who = "ingestion workers send the coordinator partial sums"
        else:
            return
        raise ConfigError(f"strategy {self.strategy_choice.name!r} needs each update (it holds them to compare); "
                          f"{who}: use fedavg (or another summing strategy) with them, or run without them")

    def _new_epoch(self) -> int:
        """This process's epoch: now in ms, and above every epoch the state saw before."""
        prev = self.store.get_meta("epoch")
        try:
            floor = int(prev) + 1 if prev is not None else 0
        except ValueError:
            floor = 0
        epoch = max(time.time_ns() // 1_000_000, floor)
        self.store.set_meta("epoch", str(epoch))
        log.info("gateway epoch %d (%s)", epoch, "new state" if prev is None else f"previous {prev}")
        return epoch

    @property
    def strategy_name(self) -> str:
        """The strategy this manager runs (``auto`` resolved), for logs and the status."""
        return self.strategy_choice.name

    def _choose_strategy(self, contributions: str, ingest: UpdateSource | None) -> StrategyChoice:
        """``[rounds] strategy`` resolved, once (``auto``: krum-reputation where this gateway sees each update,
        FedAvg where it sees only sums; :meth:`RoundConfig.resolve_strategy`), and logged once."""
        sums_only = ("site gateways send partial aggregates" if contributions == "partials" else
                     "ingestion workers send the coordinator partial sums" if getattr(ingest, "folds_partials", False)
                     else "")
        stored: str | None = None
        if self.config.strategy.strip().lower() == AUTO:
            saved = self.store.strategy_state()
            if saved is not None:
                try:
                    stored = str(decode_state(saved[1]).get("strategy", ""))
                except StateError:
                    stored = ""  # _restore_run names the damage
            elif any(rec.state == "closed" for rec in self.store.rounds()):
                stored = ""  # rounds closed before strategy states were stored: FedAvg's
        choice = self.config.resolve_strategy(sums_only=sums_only, stored=stored)
        if choice.auto:
            log.info("%s", choice.describe())
        return choice

    def _make_strategy(self):
        params = dict(self.config.strategy_params)
        if self.config.dp:
            from .privacy import CentralDP

            dp = dict(self.config.dp)
            params["privacy"] = CentralDP(**dp)
        # Every update reaches the aggregator through decode_update, which has
        # already refused NaN/Inf and bounded every value (codecs.MAX_VALUE); skip
        # the aggregator's second scan unless the configuration asks for it (the
        # default norm bound reads each update once anyway, and checks it).
        params.setdefault("check_finite", False)
        # A device told to train on at most max_samples cannot claim more.
        if self.config.train.max_samples and "sample_cap" not in params:
            params["sample_cap"] = int(self.config.train.max_samples)
        name = self.strategy_choice.name
        try:
            return make_aggregator(name, **params)
        except ConfigError:
            for k in ("check_finite", "sample_cap"):
                if k not in self.config.strategy_params:
                    params.pop(k, None)
            return make_aggregator(name, **params)

    def _restore_run(self) -> None:
        """Go on where the previous gateway process stopped: the strategy's cross-round state as the
        last finished round left it (stored in that round's closing transaction: norm-bound reference,
        server-optimizer moments, DP accountant and noise generator), and the selection generator as
        the newest round left it. A state written before strategy states were stored restores only
        the norm bound's reference from the last closed round's metrics."""
        records = self.store.rounds()
        rng = self.store.get_meta("selection_rng")
        if rng is not None:
            try:
                self._rng.bit_generator.state = json.loads(rng)
            except (TypeError, ValueError, KeyError) as exc:
                raise StateError(f"gateway state {self.store.path}: the stored selection state is damaged ({exc}); "
                                 "restore a backup (docs/security.md)") from None
        saved = self.store.strategy_state()
        agg = self._strategy
        if saved is not None and hasattr(agg, "load_state_dict"):
            round_id, blob = saved
            try:
                agg.load_state_dict(decode_state(blob))
            except (ConfigError, StateError, AggregationError) as exc:
                raise StateError(f"gateway state {self.store.path}: the strategy state stored with round {round_id} "
                                 f"cannot be restored ({exc}); a restart must not silently change the run: "
                                 "restore a backup, or start a new run with a fresh state") from None
            log.info("strategy state restored from round %d", round_id)
            return
        if not hasattr(agg, "set_reference"):
            return
        for rec in reversed(records):
            if rec.state == "closed" and "median_norm" in rec.metrics and "median_samples" in rec.metrics:
                try:
                    agg.set_reference({"median_norm": rec.metrics["median_norm"],
                                       "median_samples": rec.metrics["median_samples"]})
                except ConfigError as exc:
                    log.warning("round %d's clipping reference is unusable (%s); the next round warms up",
                                rec.round_id, exc)
                return

    def _strategy_state(self) -> bytes | None:
        """The strategy's cross-round state, serialized for the round's closing transaction."""
        agg = self._strategy
        return encode_state(agg.state_dict()) if hasattr(agg, "state_dict") else None

    def start(self) -> None:
        """Subscribe to every device's update topic and recover an open round.

        Call before ``transport.connect()``: with a persistent session the
        broker delivers the updates it kept for this gateway right after
        CONNACK, and the round they belong to must already be open to take
        them (else they would be dropped as late).
        """
        if self._sub is None:
            self._recover()
            if self.ingest is not None:
                self.ingest.attach(self)
                self._sub = self.ingest
            else:
                self._sub = self.transport.subscribe(str(device_filter(self.fleet, "update")), self._on_update)
            if self.config.secagg is not None:
                self.transport.subscribe(str(device_filter(self.fleet, "secagg")), self.secure.on_frame)
            if self.config.fraction_evaluate > 0:
                self.evaluate_rounds.attach()

    def _recover(self) -> None:
        """Make the stored rounds consistent with the latest model, whatever step a previous
        process died at, and reopen the round that can still finish (the newest open one)."""
        for rec in reversed(self.store.open_rounds()):  # newest first
            produced = self.store.model_for_round(rec.round_id)
            if produced is not None:
                # only a state written by an older edgeflow (model and round closing were two
                # transactions) can hold a round that produced a model but is still open
                log.warning("round %d produced model v%d but was never closed (a crash in an older "
                            "edgeflow); closing it now", rec.round_id, produced)
                self.store.finish_round(rec.round_id, {"recovered": True, "model_version": produced})
                continue
            reason = None
            if self.config.mode != "sync" or rec.config.get("_mode") == "async":
                reason = "an asynchronous session of an earlier process"
            elif self._recovered is not None:
                reason = f"superseded by round {self._recovered.round_id}"
            elif rec.model_version != self.version:
                reason = f"built on model v{rec.model_version}, the latest model is v{self.version}"
            if reason is not None:
                log.warning("round %d left open by an earlier process is abandoned: %s", rec.round_id, reason)
                self.store.finish_round(rec.round_id, {"abandoned": True, "reason": reason}, state="failed")
                continue
            self._recovered = self._reopen(rec)

    def stop(self) -> None:
        self._stop.set()
        with self.open.cv:
            self.open.cv.notify_all()

    def publish_model(self) -> bool:
        """Publish the global model (retained, signed, with this gateway's epoch); False only
        when :meth:`stop` ended the wait for the broker's acknowledgement."""
        if not self.downlink.publish(self):  # the delta from the previous version, when [rounds] downlink asks
            return False
        payload = encode_update(self.weights, "dense", round_id=self.version, device_id=GATEWAY_ID,
                                seq=self.version, signer=self.signer,
                                metadata={"model_version": self.version, "epoch": self.epoch})
        return self.publish_reliably(str(gateway_topic(self.fleet, "model")), payload, f"model v{self.version}")

    def publish_round(self, ann: RoundAnnouncement) -> bool:
        return self.publish_reliably(str(gateway_topic(self.fleet, "round")), ann.sign(self.fleet_key),
                                     f"round {ann.round_id} announcement ({ann.state})")

    def publish_reliably(self, topic: str, payload: bytes, what: str, *, retain: bool = True,
                         until: float | None = None, transport: Transport | None = None) -> bool:
        """Publish at QoS 1 and wait until the broker acknowledged it, however long that takes.

        A broker that stalls (or a connection flooded by others) must not kill the
        gateway: after ``publish_timeout_s`` without an ack it logs what it waits for and
        keeps waiting (the message stays queued and the transport re-sends it after a
        reconnect); a publish that *failed* (dropped, not just slow) is published again
        with exponential backoff. Returns True once acknowledged; False when
        :meth:`stop` is called or the absolute time ``until`` passes first.
        ``transport`` (default: the manager's) is where to publish (a site's uplink).
        """
        transport = self.transport if transport is None else transport
        backoff = Backoff(1.0, 30.0)
        t0 = time.monotonic()
        step = self.config.publish_timeout_s
        delivery = None
        waits = 0
        while True:
            if delivery is None:
                try:
                    delivery = transport.publish(topic, payload, qos=1, retain=retain)
                except TransportError as exc:
                    delay = backoff.next()
                    log.warning("cannot queue %s (%s); trying again in %.1f s", what, exc, delay)
                    if self._stop.wait(delay) or (until is not None and time.time() >= until):
                        return False
                    continue
            timeout = step if until is None else max(0.0, min(step, until - time.time()))
            try:
                delivery.wait(timeout)
                if waits:
                    log.warning("%s acknowledged by the broker after %.0f s", what, time.monotonic() - t0)
                return True
            except TransportError as exc:
                waits += 1
                if self._stop.is_set():
                    log.warning("stopping while %s is still unacknowledged (%s)", what, exc)
                    return False
                if until is not None and time.time() >= until:
                    log.warning("%s not acknowledged before its deadline (%s); giving up", what, exc)
                    return False
                if delivery.error is not None:
                    delay = backoff.next()
                    log.warning("%s was not delivered (%s); publishing it again in %.1f s", what, exc, delay)
                    delivery = None
                    if self._stop.wait(delay):
                        return False
                else:
                    log.warning("still waiting for the broker to acknowledge %s: %.0f s so far, %d of %d frame(s) "
                                "acked; the gateway keeps running", what, time.monotonic() - t0, delivery.acked,
                                delivery.total)

    def _count(self, key: str, n: int = 1) -> None:
        self.open.count(key, n)

    @property
    def resuming(self) -> bool:
        """True while a round a previous process left open waits to be finished (by the next :meth:`run`)."""
        return self._recovered is not None

    @property
    def stopping(self) -> threading.Event:
        """Set once :meth:`stop` was called: round protocols end their waits."""
        return self._stop

    @property
    def strategy(self) -> Any:
        """The configured aggregation strategy (its cross-round state lives across rounds)."""
        return self._strategy

    @property
    def counters_total(self) -> dict[str, int]:
        """Every refusal/late/duplicate counter since this process started."""
        return self.open.totals

    @property
    def round_view(self) -> RoundView | None:
        return self.open.view()

    def check(self, payload: bytes, rnd: RoundView, *, live: str | None = None, source: str = "") -> CheckedUpdate:
        """The rulebook (gateway/intake.py) with this gateway's keys, model and replay state. ``live``: the
        sending device of an update arriving now (the in-memory replay guard and its persisted floor apply);
        None for a stored update being re-read."""
        floor = self.store.seq_floor(live) if live is not None else None
        return check_update(payload, rnd, keyring=self.keyring, like=self.weights, seq_floor=floor, replay_guard=self.replay if live is not None else None,
                            partials=self.contributions == "partials", source=source)

    # -- selection ------------------------------------------------------------
    def select(self, pool: Iterable[Candidate]) -> list[str]:
        cfg = self.config
        eligible = [
            c for c in pool
            if c.can_train
            and (cfg.profiles is None or c.profile in cfg.profiles)
            and (cfg.min_battery is None or c.battery is None or c.battery >= cfg.min_battery)
        ]
        eligible.sort(key=lambda c: c.device_id)
        n = math.ceil(len(eligible) * cfg.fraction * cfg.overselect)
        n = max(n, cfg.min_clients)
        if cfg.max_clients:
            n = min(n, math.ceil(cfg.max_clients * cfg.overselect))
        n = min(n, len(eligible))
        if self.selector is not None:
            known = {c.device_id for c in eligible}
            chosen = sorted(set(self.selector(list(eligible), n, self._rng)))
            self._save_rng()
            bad = [d for d in chosen if d not in known]
            if bad or len(chosen) > n:
                raise ConfigError(f"the round's selector chose {chosen[:5]}: it must pick at most {n} of the "
                                  f"eligible devices ({sorted(known)[:5]}...); {bad[:3]} are not eligible")
            return chosen
        idx = self._rng.choice(len(eligible), n, replace=False) if n else []
        self._save_rng()
        return sorted(eligible[i].device_id for i in idx)

    def _save_rng(self) -> None:
        """The selection generator's state after a draw, so a restarted gateway draws what this one would."""
        self.store.set_meta("selection_rng", json.dumps(self._rng.bit_generator.state))

    @staticmethod
    def explain_pool(pool: Iterable[Candidate]) -> str:
        """Which online devices can train and, grouped by reason, why the others cannot (one line)."""
        pool = list(pool)
        if not pool:
            return ("no device is online (see `edgeflow fleet status`; each board runs `edgeflow device "
                    "--credentials DIR --train-data x_y.npz`)")
        ok = [c.device_id for c in pool if c.can_train]
        groups: dict[str, list[str]] = {}
        for c in pool:
            if not c.can_train:
                groups.setdefault(c.why or "cannot train (no reason reported)", []).append(c.device_id)

        def names(ids: list[str]) -> str:
            ids = sorted(ids)
            return ", ".join(ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")

        parts = [f"{len(ok)} of {len(pool)} online device(s) can train" + (f" ({names(ok)})" if ok else "")]
        parts += [f"{names(ids)}: {why}" for why, ids in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
        return "; ".join(parts)

    def _explain_filters(self, pool: Iterable[Candidate]) -> str:
        """The devices that can train but the configuration leaves out (profiles, min_battery)."""
        cfg = self.config
        out = []
        trainable = [c for c in pool if c.can_train]
        if cfg.profiles is not None:
            other = sorted(c.device_id for c in trainable if c.profile not in cfg.profiles)
            if other:
                out.append(f"{', '.join(other[:4])}{' ...' if len(other) > 4 else ''}: profile not in [rounds] "
                           f"profiles {cfg.profiles}")
        if cfg.min_battery is not None:
            low = sorted(c.device_id for c in trainable if c.battery is not None and c.battery < cfg.min_battery)
            if low:
                out.append(f"{', '.join(low[:4])}{' ...' if len(low) > 4 else ''}: battery below [rounds] "
                           f"min_battery {cfg.min_battery:g}")
        return "".join(f"; {x}" for x in out)

    def _explain_missing(self, ann: RoundAnnouncement) -> str:
        """Why the selected devices that sent nothing did not: offline, stopped training, their last error."""
        got = self.open.snapshot()
        missing = sorted(set(ann.selected) - got.reported)
        c = got.counters
        try:
            pool = {cand.device_id: cand for cand in self.candidates()}
        except Exception:  # noqa: BLE001 - an explanation must never fail the round's end
            log.warning("candidates() failed while explaining the missing devices", exc_info=True)
            pool = {}
        says = []
        for d in missing[:6]:
            cand = pool.get(d)
            if cand is None:
                says.append(f"{d} went offline")
            elif not cand.can_train:
                says.append(f"{d} stopped training ({cand.why})")
            elif cand.note:
                says.append(f"{d}: {cand.note}")
            else:
                says.append(f"{d} is training but sent nothing before the deadline (slower than deadline_s = "
                            f"{self.config.deadline_s:g} s? raise it)")
        if len(missing) > 6:
            says.append(f"{len(missing) - 6} more")
        refused = {k[len("rejected_"):]: v for k, v in c.items() if k.startswith("rejected_") and v}
        if refused:
            hint = " (trained from another model version: devices run another model than the gateway's)" \
                if "wrong_version" in refused else ""
            says.append("refused: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in sorted(refused.items())) + hint)
        for k, label in (("late", "late"), ("not_selected", "from devices not selected"), ("duplicates", "duplicate")):
            if c.get(k):
                says.append(f"{c[k]} {label}")
        return "; ".join(says)

    def _status(self, state: str, reason: str = "", **extra: Any) -> None:
        """What the rounds are doing, for `edgeflow fleet status --state` (best effort)."""
        try:
            self.store.set_meta("rounds_status", json.dumps({"state": state, "reason": reason, "ts": time.time(),
                                                             "model_version": self.version, **extra}))
        except Exception as exc:  # noqa: BLE001 - a status line must never stop the rounds
            log.debug("rounds status not stored: %s", exc)

    def wait_for_pool(self) -> list[Candidate]:
        end = time.time() + self.config.wait_for_devices_s
        while True:
            pool = self.candidates()
            trainable = [c for c in pool if c.can_train]
            if len(trainable) >= self.config.min_clients or time.time() >= end or self._stop.is_set():
                return pool
            time.sleep(0.2)

    # -- the update handler (transport worker thread) ---------------------------
    def _on_update(self, msg: Any) -> None:
        try:
            self._handle_update(msg)
        except Exception:  # noqa: BLE001 - one message must never take the transport's worker thread down
            self.open.count("rejected_internal")
            log.exception("update on %s dropped after an unexpected failure (a bug: please report it)", msg.topic)

    def _handle_update(self, msg: Any) -> None:
        """An update arriving on the transport: screened, checked, stored, counted (gateway/intake.py)."""
        info = parse_topic(msg.topic)
        sender = info.device if info else None
        if self.first_parameters.take(sender, msg.payload):
            return  # the asked device's offer of first parameters
        try:
            head = peek_update(msg.payload)
        except CodecError as exc:
            self.open.count("rejected_malformed")
            log.warning("update on %s refused: %s", msg.topic, exc)
            return
        rnd = self.open.view()
        why = screen(head, sender, rnd, self.open.has_reported)
        if why is not None:
            self.open.count(why)
            if why == "late":
                log.info("update from %s for round %d dropped: round not open", sender, head.round_id)
            return
        assert rnd is not None
        try:
            upd = self.check(msg.payload, rnd, live=head.device_id, source=f"gateway<-{sender}")
        except (CodecError, SignatureError) as exc:
            reason = "rejected_" + getattr(exc, "reason", "invalid")
            self.open.count(reason)
            log.warning("update from %s refused (%s): %s", sender, reason, exc)
            return
        self._accept(upd, store=True)

    def _accept(self, upd: CheckedUpdate, *, store: bool) -> None:
        """Count a checked update in the open round: a synchronous round stores it (folded at the close),
        FedBuff folds it at once. ``store`` False: it is already in the state (a resumed round)."""
        with self.open.cv:
            if not self.open.is_open(upd.round_id):
                self.open.count("late")
                return
            ann = self.open.ann
            assert ann is not None
            if store and ann.mode == "sync":
                try:
                    if not self.store.add_update(ann.round_id, upd.device_id, upd.seq, upd.meta.num_samples,
                                                 upd.payload):
                        self.open.count("duplicates")
                        return
                except StoreError as exc:
                    self.open.count("rejected_store")
                    log.error("update from %s could not be stored (%s); not counted", upd.device_id, exc)
                    return
                fault_point("rounds.update_stored", ann.round_id)
            if ann.mode == "sync":
                self.open.keep(upd)
            result = None
            if ann.mode == "async":  # FedBuff folds as updates come (a sync round folds its stored ones at close)
                base = upd.base_version if upd.base_version is not None else ann.model_version
                try:
                    result = self.open.agg.add(upd.tensors, upd.meta.num_samples, upd.device_id, base_version=base)
                except AggregationError as exc:
                    self.open.count("rejected_schema")
                    log.warning("update from %s does not fit the model: %s", upd.device_id, exc)
                    return
                if store:
                    self.store.record_seq(upd.device_id, upd.seq)
            self.open.record(upd.device_id, nbytes=len(upd.payload),
                             dense_elements=sum(int(v.size) for v in upd.tensors.values()),
                             num_samples=upd.meta.num_samples, loss=upd.meta.loss, metrics=upd.meta.metrics,
                             evaluation=upd.meta.evaluation)
            if result is not None:
                self.async_rounds.ready(result)

    # -- rounds -----------------------------------------------------------------
    def run(self, rounds: int | None = None) -> list[RoundMetrics]:
        """Run rounds: ``rounds`` more, or (default) until the job's ``config.rounds``
        rounds are done — counting those a previous gateway process completed,
        and finishing first the round it left open."""
        self.start()
        if self.base_model is None and not self.first_parameters.adopt():
            return []  # stopped before a device offered its parameters
        self.publish_model()
        if rounds is None:
            finished = sum(1 for r in self.store.rounds() if r.state == "closed")
            todo = self.config.rounds - finished - (1 if self._recovered is not None else 0)
        else:
            todo = rounds
        if self.config.mode == "async":
            return self.async_rounds.run(todo)
        done: list[RoundMetrics] = []
        if self._recovered is not None and not self._stop.is_set():
            ann, self._recovered = self._recovered, None
            self.secure.prepare(ann)
            self.publish_round(ann)
            done.append(self._collect_and_close(ann, time.perf_counter()))
            if rounds is not None:
                todo -= 1
        while todo > 0 and not self._stop.is_set():
            m = self.run_round()
            if m is not None:
                done.append(m)
            todo -= 1
        return done

    def _begin(self, ann: RoundAnnouncement, bounds: list | tuple | None = None) -> None:
        agg = self._strategy
        with self.open.cv:
            agg.begin_round(self.weights, round_id=ann.round_id)
            if bounds is not None and hasattr(agg, "set_round_bounds"):
                agg.set_round_bounds(*bounds)
            self.open.begin(ann, agg)

    def run_round(self, *, round_id: int | None = None, deadline: float | None = None,
                  train: TrainConfig | None = None, nonce: str | None = None) -> RoundMetrics | None:
        """Select, announce, collect, aggregate one synchronous round.

        A site gateway passes the root's ``round_id``, an absolute ``deadline``
        that leaves time to forward its partial, and the root's ``train``
        settings: the root's round drives the site's. Otherwise the round id
        follows the store's and the configured settings apply. ``nonce``: the root
        round's (a site's devices and partial then answer the root's round).
        """
        cfg = self.config
        pool = self.wait_for_pool()
        selected = self.select(pool)
        if round_id is None:
            round_id = self.store.last_round_id() + 1
        if len(selected) < cfg.min_clients:
            why = (f"round {round_id} not started: {len(selected)} eligible device(s), min_clients is "
                   f"{cfg.min_clients}: {self.explain_pool(pool)}{self._explain_filters(pool)}")
            log.warning("%s", why)
            self._status("waiting", why)
            return None
        train = cfg.train if train is None else train
        ann = RoundAnnouncement(
            round_id=round_id, model_version=self.version,
            deadline=time.time() + cfg.deadline_s if deadline is None else deadline,
            selected=tuple(selected), config=train, issued=time.time(), epoch=self.epoch,
            nonce=nonce or secrets.token_hex(8),
        )
        self._begin(ann)
        bounds = getattr(self.open.agg, "round_bounds", None)
        stored = {**asdict(train), "_nonce": ann.nonce, "_bounds": list(bounds) if bounds is not None else None}
        self.store.open_round(round_id, self.version, ann.deadline, stored, selected)
        fault_point("rounds.opened")
        self.secure.prepare(ann)  # before the announcement: devices advertise keys as soon as they see it
        self.publish_round(ann)
        fault_point("rounds.announced")
        self._status("open", f"round {round_id}: {len(selected)} device(s) selected", round_id=round_id)
        return self._collect_and_close(ann, time.perf_counter())

    def _reopen(self, rec) -> RoundAnnouncement:
        """Rebuild a round a previous gateway process left open from its stored updates."""
        log.info("resuming round %d (%d stored updates)", rec.round_id, self.store.update_count(rec.round_id))
        if rec.model_version != self.version:
            raise AggregationError(
                f"open round {rec.round_id} was built on model v{rec.model_version} but the store's latest "
                f"is v{self.version}; the state file is inconsistent"
            )
        ann = RoundAnnouncement(
            round_id=rec.round_id, model_version=rec.model_version,
            deadline=max(rec.deadline, time.time() + 1.0), selected=tuple(rec.selected),
            config=TrainConfig.from_dict(rec.config), issued=rec.created, epoch=self.epoch,
            nonce=str(rec.config.get("_nonce") or ""),
        )
        self._begin(ann, bounds=rec.config.get("_bounds"))
        rnd = self.open.view()
        assert rnd is not None
        for su in self.store.updates(rec.round_id):
            try:
                upd = self.check(su.envelope, rnd, source=f"gateway<-{su.device_id} (stored)")
                self.replay.check_and_record(upd.device_id, upd.round_id, upd.seq)
            except (CodecError, SignatureError) as exc:
                # written by an older edgeflow that stored before validating: drop it, or every
                # restart would trip over it again
                log.warning("round %d: stored update of %s is refused on replay (%s); removed from the state",
                            rec.round_id, su.device_id, exc)
                self.store.remove_update(rec.round_id, su.device_id)
                continue
            self._accept(upd, store=False)
        return ann

    def _anyone_left(self, ann: RoundAnnouncement) -> bool:
        """Is a selected device that has not reported still online and training?"""
        missing = set(ann.selected) - self.open.snapshot().reported
        if not missing or self.contributions != "updates":
            return True
        try:
            return any(c.can_train for c in self.candidates() if c.device_id in missing)
        except Exception:  # noqa: BLE001 - when in doubt, keep waiting as configured
            log.warning("candidates() failed; waiting as configured", exc_info=True)
            return True

    def _closing(self, ann: RoundAnnouncement, extensions: int) -> bool:
        n = len(self.open.snapshot().reported)
        if ann.selected and n >= len(ann.selected):
            return True
        if time.time() >= ann.deadline:
            need = max(self.config.min_clients, math.ceil(self.config.quorum * len(ann.selected)
                                                          / max(self.config.overselect, 1.0)))
            return n >= need or extensions >= self.config.max_extensions
        return False

    def _collect_and_close(self, ann: RoundAnnouncement, t_start: float) -> RoundMetrics:
        if ann.config.secagg:
            return self.secure.run(ann, t_start)
        extensions = 0
        with self.open.cv:
            while not self._stop.is_set():
                if self.ingest is not None:
                    self.ingest.poll(self, ann)
                if self._closing(ann, extensions):
                    break
                if time.time() >= ann.deadline:  # below quorum: extend, unless nobody left can answer
                    if not self._anyone_left(ann):
                        log.warning("round %d: quorum not reached at the deadline and none of the selected devices "
                                    "still missing can train: %s", ann.round_id, self._explain_missing(ann))
                        break
                    extensions += 1
                    ann = replace(ann, deadline=time.time() + self.config.deadline_s)
                    self.open.announce(ann)
                    log.warning("round %d: quorum not reached at the deadline; extended (%d/%d)",
                                ann.round_id, extensions, self.config.max_extensions)
                self.open.wait(0.1)
            closed = self.open.close()
        self.publish_round(closed)
        if self.ingest is not None:
            self.ingest.merge(self, closed)
        else:
            self._fold_stored(closed)
        n_reported = len(self.open.snapshot().reported)
        if n_reported == 0 and self._stop.is_set():
            return self.fail_round(ann, t_start, "the gateway was stopped before any update arrived", 0)
        if n_reported == 0:
            return self.fail_round(ann, t_start, f"no update arrived from the {len(ann.selected)} selected "
                                                  f"device(s): {self._explain_missing(ann)}", 0)
        if n_reported < self.config.min_clients:
            return self.fail_round(ann, t_start, f"{n_reported} update(s) after {extensions} extension(s), "
                                                  f"below min_clients {self.config.min_clients}: "
                                                  f"{self._explain_missing(ann)}", n_reported)
        t0 = time.perf_counter()
        try:
            with self.open.lock:
                result = self.open.agg.finish()
        except AggregationError as exc:
            return self.fail_round(ann, t_start, f"aggregation refused: {exc}", n_reported)
        agg_s = time.perf_counter() - t0
        fault_point("rounds.aggregated")
        return self.finish_round(ann, result, agg_s, t_start)

    def _fold_stored(self, ann: RoundAnnouncement) -> None:
        """Fold the closed round's stored updates into the aggregator, in device-id order.

        Why at the close and not as they arrive: the new model must not depend on the order in
        which updates happened to arrive (floating-point sums in another order differ in the last
        bits, and FedAvg's first round takes its bounds from the first updates it holds). Folded
        in device-id order, the same updates give the same model bit for bit: under one seed
        (`edgeflow demo`), and after a restart that re-reads them from the state. Each update is
        decoded once: the open round kept what it checked on arrival (up to its byte budget,
        :attr:`OpenRound.keep_bytes`); the rest is read from the state and checked again here.
        """
        rnd = RoundView(ann.round_id, ann.model_version, frozenset(ann.selected), ann.nonce, ann.mode, False)
        for su in self.store.updates(ann.round_id, order="device"):
            try:
                upd = self.open.take(su.device_id) or self.check(
                    su.envelope, rnd, source=f"gateway<-{su.device_id} (stored)")
                with self.open.lock:
                    if self.contributions == "partials":
                        self.open.agg.add_partial(upd.tensors, total_samples=upd.meta.num_samples,
                                                  num_clients=upd.num_clients, client_id=upd.device_id)
                    else:
                        self.open.agg.add(upd.tensors, upd.meta.num_samples, client_id=upd.device_id)
            except (CodecError, SignatureError, AggregationError) as exc:
                reason = getattr(exc, "reason", None) or ("schema" if isinstance(exc, AggregationError) else "invalid")
                self.open.count("rejected_" + reason)
                self.open.forget(su.device_id)
                log.warning("round %d: stored update of %s not aggregated (%s); removed from the state",
                            ann.round_id, su.device_id, exc)
                self.store.remove_update(ann.round_id, su.device_id)
        self.open.release()

    def fail_round(self, ann: RoundAnnouncement, t_start: float, reason: str, reported: int) -> RoundMetrics:
        """Close a round without a model: say why in the log and in the state. The aggregator's
        open round is simply abandoned (the next begin_round drops it), its cross-round state kept."""
        metrics = self.round_metrics(ann, None, 0.0, t_start)
        metrics.extra["failed"] = 1.0
        metrics.extra["reported"] = float(reported)
        self.store.finish_round(ann.round_id, {**metrics.to_dict(), "reason": reason}, state="failed",
                                strategy_state=self._strategy_state())
        log.error("round %d failed: %s; no model published, the global model stays v%d",
                  ann.round_id, reason, self.version)
        self._status("failed", f"round {ann.round_id} failed: {reason}", round_id=ann.round_id)
        return metrics

    def finish_round(self, ann: RoundAnnouncement, result: AggregateResult, agg_s: float, t_start: float,
                     *, extra: Mapping[str, float] | None = None) -> RoundMetrics:
        """Hand the aggregate to the sink, then store the round's end (and the model it staged)
        in one transaction, then publish the model. ``extra``: the protocol's own metrics."""
        try:
            self.sink.deliver(self, result, ann)
        except AggregationError as exc:
            self._staged = None
            return self.fail_round(ann, t_start, str(exc), result.num_clients)
        metrics = self.round_metrics(ann, result, agg_s, t_start)
        metrics.extra.update(extra or {})
        published = self._staged is not None
        self.commit(ann, metrics.to_dict())
        if published and self.config.fraction_evaluate > 0 and not self._stop.is_set():
            evaluated = self.evaluate_rounds.run(ann.round_id)  # the model just published, on the devices' data
            metrics.extra.update(evaluated)
            self.store.add_round_metrics(ann.round_id, evaluated)
        self.report(metrics)
        return metrics

    def stage(self, result: AggregateResult, *, hold: bool = True) -> _Staged:
        """Prepare the aggregate as the next model version: held for :meth:`commit` (a synchronous
        round stores it with the round's end), or only returned (``hold=False``: FedBuff adopts it)."""
        if result.weights is None:
            raise AggregationError(f"round {result.round_id}: the aggregate has no weights to adopt")
        weights = {k: np.asarray(v, dtype=np.float32) for k, v in result.weights.items()}
        for k, v in weights.items():
            if not np.isfinite(v).all():
                raise AggregationError(f"round {result.round_id}: tensor {k!r} of the new model is not finite; "
                                       "it is not stored")
        version = self.store.latest_version() + 1
        weights = self.downlink.prepare(self, weights, version)  # a delta downlink: what devices reconstruct
        onnx_bytes = model_with_weights(self.base_model, weights).SerializeToString()
        staged = _Staged(weights, onnx_bytes, hashlib.sha256(onnx_bytes).hexdigest(), version)
        if hold:
            self._staged = staged
        return staged

    def commit(self, ann: RoundAnnouncement, metrics: dict[str, Any], *, state: str = "closed") -> None:
        staged, self._staged = self._staged, None
        try:
            self.store.finish_round(ann.round_id, metrics, state=state,
                                    model=None if staged is None else (staged.onnx_bytes, staged.sha256),
                                    model_version=None if staged is None else staged.version,
                                    strategy_state=self._strategy_state())
        except StoreError as exc:
            raise StateError(f"round {ann.round_id}: its result could not be stored ({exc}); the round stays open "
                             "in the state and a restarted gateway resumes it") from None
        fault_point("rounds.committed")
        if staged is not None:
            self.weights, self.version = staged.weights, staged.version
            self.publish_model()
            fault_point("rounds.published")

    def current_model(self, weights: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
        return model_with_weights(self.base_model, self.weights if weights is None else weights)

    def evaluate(self, weights: Mapping[str, np.ndarray] | None = None) -> tuple[float | None, float | None]:
        """Accuracy and loss on the eval set of the current weights (or of ``weights``)."""
        m = self.evaluate_metrics(weights)
        return m.get("accuracy"), m.get("loss")

    def evaluate_metrics(self, weights: Mapping[str, np.ndarray] | None = None) -> dict[str, float]:
        """The evaluator's metrics for the current weights (or ``weights``); {} without eval data."""
        if self.eval_data is None:
            return {}
        out = self.evaluator(self.current_model(weights), self.eval_data)
        return {str(k): float(v) for k, v in dict(out).items()}

    def round_metrics(self, ann, result: AggregateResult | None, agg_s: float, t_start: float) -> RoundMetrics:
        staged = self._staged
        evaluated = {} if result is None else self.evaluate_metrics(staged.weights if staged is not None else None)
        acc, eval_loss = evaluated.pop("accuracy", None), evaluated.pop("loss", None)
        got = self.open.snapshot()
        c = got.counters
        rejected = got.rejected + (len(result.rejected) if result is not None else 0)
        m = RoundMetrics(
            round_id=ann.round_id, model_version=staged.version if staged is not None else self.version,
            selected=len(ann.selected),
            participants=result.num_clients if result else 0,
            dropped=max(0, len(ann.selected) - len(got.reported)) if ann.mode == "sync" else 0,
            late=c.get("late", 0), rejected=rejected, duplicates=c.get("duplicates", 0),
            bytes_in=got.bytes_in, dense_bytes=got.dense_bytes, aggregation_s=agg_s,
            round_s=time.perf_counter() - t_start,
            mean_client_loss=float(np.mean(got.losses)) if got.losses else None,
            accuracy=acc, eval_loss=eval_loss,
            extra={**{k: float(v) for k, v in (result.metrics.items() if result else ())
                      if k.startswith(("dp_", "strategy_")) or k in _ROBUST_METRICS},  # strategy_: a custom one's
                   **{f"eval_{k}": v for k, v in evaluated.items()},
                   **self._client_metrics(got)},
        )
        return m

    def _client_metrics(self, got: Any) -> dict[str, Any]:
        """What the clients reported beside their updates: fit metrics (``fit_<name>``) and their evaluation
        of the model they trained from (``fed_eval_loss``, ``fed_eval_<name>``, ``fed_eval_clients``, the
        ``fed_eval_examples`` they evaluated on), each aggregated by example count or by the user's function."""
        out: dict[str, float] = {}
        if got.fit_metrics:
            fit = (self.fit_metrics_fn or aggregate_metrics)(list(got.fit_metrics))
            out.update({f"fit_{k}": metric_value(v) for k, v in dict(fit).items()})
        if got.evaluations:
            ev = list(got.evaluations)
            out["fed_eval_clients"] = float(len(ev))
            out["fed_eval_examples"] = float(sum(n for _, n, _ in ev))
            out["fed_eval_loss"] = weighted_metrics([(n, {"loss": loss}) for loss, n, _ in ev])["loss"]
            agg = (self.evaluate_metrics_fn or aggregate_metrics)([(n, m) for _, n, m in ev if m])
            out.update({f"fed_eval_{k}": metric_value(v) for k, v in dict(agg).items()})
        return out

    def report(self, m: RoundMetrics) -> None:
        self.history.append(m)
        acc = "" if m.accuracy is None else f", accuracy {m.accuracy:.3f}"
        self._status("closed", f"round {m.round_id}: model v{m.model_version} from {m.participants} of "
                     f"{m.selected} device(s){acc}", round_id=m.round_id)
        log.info("round %d: v%d, %d/%d participants, %d dropped, %d late, %d rejected, %.1f KiB in, acc %s",
                 m.round_id, m.model_version, m.participants, m.selected, m.dropped, m.late, m.rejected,
                 m.bytes_in / 1024, "n/a" if m.accuracy is None else f"{m.accuracy:.3f}")
        if self.on_round:
            self.on_round(m)


def metrics_jsonl(metrics: Iterable[RoundMetrics]) -> str:
    return "".join(json.dumps(m.to_dict()) + "\n" for m in metrics)
