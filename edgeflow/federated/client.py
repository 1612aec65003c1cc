"""The device side of federated learning: take part in the gateway's rounds.

A :class:`Client` listens on the retained ``gateway/model`` (global weights,
signed by the fleet key) and ``gateway/round`` (the signed announcement).
When a round selects this device it trains on the local data with
:class:`edgeflow.train.Trainer` from exactly the announced model version,
encodes the weight delta with the round's codec — keeping the top-k error
feedback residual across rounds — signs it with the device key, and
publishes it on ``<device>/update``. An update that would arrive after the
deadline is not sent (the gateway would drop it anyway).

Deadlines are kept on the device's own clock: the announcement says when the
gateway issued it (``issued``) and when the round ends (``deadline``), both
on the gateway's clock, and the device counts ``deadline - issued`` from the
moment it received the announcement. A device whose clock is off (no RTC, no
NTP yet) still sends in time. The offset it measures (its clock minus the
gateway's at receipt; the smallest of the last few announcements, since
network delay and a retained announcement's age only ever add to it) goes
into each update's metadata as ``clock_skew_s`` (an optional field the
gateway ignores if it does not know it) and into :meth:`Client.status`.

Gateway epochs (docs/security.md, "State loss and restore"): the model and
the announcement carry the gateway's epoch. The client keeps the newest model
version *of the highest epoch* it has seen and skips rounds it already did
(keyed by round id and the round's nonce); a higher epoch - a gateway whose
state was wiped or restored from a backup - resets both, so its lower versions
and repeated round ids are followed, while a model or announcement of an
older epoch (a replay) is refused. Updates echo the round's nonce.

Model deltas (``[rounds] downlink = "delta-int8"``, :mod:`edgeflow.codecs.model_delta`): the client
always listens on ``gateway/model_delta`` and takes the full model on ``gateway/model`` only while it
needs it: from the start until it holds a model, and again after a delta it could not apply (another
base, a refused message) or an announcement of a version it lacks. Once a delta applied, it leaves the
full model's topic, so the broker sends it only the small delta of each new version. A delta is applied
to exactly its base and must give the digest it announces; refusals are counted by reason
(``delta_refusals``) and logged, and the full model is taken instead.

The client never imports the MQTT library: it gets a transport object with
``subscribe(filter, handler)`` and ``publish(topic, payload, qos=1)``
(:class:`edgeflow.transport.MqttTransport`), so the device agent, the demo
and the tests share one code path. Training runs on the client's own worker
thread, never on the transport's message thread.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..codecs import ErrorFeedback, decode_update, encode_update
from ..errors import CodecError, EdgeflowError, SignatureError, TransportError
from ..signing import KeyRing, PublicKey, Signer
from ..codecs.model_delta import apply_model_delta, refusal
from ..protocol.rounds import EvaluationReport, RoundAnnouncement, TrainConfig
from ..transport.base import Transport
from ..transport.topics import device_topic, gateway_topic
from .app import ListClient, natural_order
from .numpy_client import NumPyClient, check_evaluate, check_fit

log = logging.getLogger("edgeflow.federated")

GATEWAY_ID = "gateway"
UpdateTransform = Callable[[dict[str, np.ndarray], int], "dict[str, np.ndarray] | None"]
SKEW_SAMPLES = 8
"""The clock offset is the smallest of the last this many announcements' (receipt - issued)..."""
SKEW_WINDOW_S = 900.0
"""... received within this many seconds (a clock that was corrected is followed after that)."""


def _local_training(device_id: str, app: NumPyClient | None, model: Any, data: tuple[np.ndarray, np.ndarray] | None,
                    profile: Any, seed: int, trainer_options: Mapping[str, Any] | None) -> tuple[Any, Any, Any]:
    """Who trains on this device: the user's app (then no trainer, x or y), or edgeflow's trainer on
    ``model`` with the local ``data``; one clear error for any other combination."""
    if app is not None:
        if not isinstance(app, NumPyClient):
            raise EdgeflowError(f"device {device_id}: app must be an edgeflow.NumPyClient (fit/evaluate), "
                                f"got {type(app).__name__}")
        if model is not None or data is not None:
            raise EdgeflowError(f"device {device_id}: give either app= (your own training loop) or "
                                "model= and data= (edgeflow's trainer), not both")
        return None, None, None
    from ..train import Trainer  # numpy-only, but heavy: import where used

    if model is None or data is None:
        raise EdgeflowError(f"device {device_id}: a client needs model= and data=, or app= "
                            "(a NumPyClient with your own training loop)")
    x, y = data
    if len(x) != len(y) or len(x) == 0:
        raise EdgeflowError(f"device {device_id}: local data needs matching, non-empty x and y")
    return Trainer(model, profile=profile, seed=seed, **dict(trainer_options or {})), x, y


@dataclass
class ClientStats:
    rounds_trained: int = 0
    updates_sent: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    skipped_late: int = 0
    evaluations_sent: int = 0
    rejected_messages: int = 0
    deltas_applied: int = 0
    deltas_refused: int = 0
    full_models: int = 0
    last_round: int = -1
    last_loss: float | None = None
    last_train_s: float = 0.0
    train_s_total: float = 0.0
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["errors"] = list(self.errors[-5:])
        return d


class Client:
    """One device's participation in federated rounds.

    Args:
        transport: connected or not-yet-connected transport (subscriptions are
            made in :meth:`start`; with a persistent session call ``start``
            before ``transport.connect()``).
        fleet, device_id: topic scheme ids; ``signer`` signs updates (its
            device id must be ``device_id``).
        fleet_key: the gateway's public key; unsigned or wrongly signed
            rounds and models are refused.
        model: the ONNX model to train (architecture; weights are replaced by
            the global ones each round).
        data: local ``(x, y)`` arrays.
        app: instead of ``model`` and ``data``, your own training loop: a
            :class:`~edgeflow.federated.numpy_client.NumPyClient` whose ``fit``
            (and ``evaluate``) the client calls each round.
        profile: the device profile (threads, training memory budget).
        transform_update: a hook ``(delta, round_id) -> delta | None`` applied
            before encoding, for simulations of faulty or malicious devices
            (never in production); returning None sends nothing (a device
            that vanished mid-round).
        delay_s: extra seconds added to each local training (straggler
            simulation).
        report_train_time: put the local training time (``train_s``) into
            each update's metadata; off, updates are the same bytes on every
            run with the same seed (the demo's reproducibility).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        fleet: str,
        device_id: str,
        signer: Signer,
        fleet_key: PublicKey,
        model: Any = None,
        data: tuple[np.ndarray, np.ndarray] | None = None,
        profile: Any = None,
        seed: int = 0,
        transform_update: UpdateTransform | None = None,
        delay_s: float = 0.0,
        trainer_options: Mapping[str, Any] | None = None,
        report_train_time: bool = True,
        app: NumPyClient | None = None,
        epoch_file: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``epoch_file`` keeps the newest gateway epoch across restarts (the device agent passes one in its
        state directory), so a replayed model or announcement of an older epoch stays refused after a
        restart too. ``clock``: the device's wall clock (default ``time.time``); round deadlines are
        converted to it at receipt (module docstring)."""
        if signer.device_id != device_id:
            raise EdgeflowError(f"signer is for {signer.device_id!r}, client is {device_id!r}")
        self.transport = transport
        self.fleet = fleet
        self.device_id = device_id
        self.clock: Callable[[], float] = clock or time.time
        self.clock_skew_s: float | None = None
        """This device's clock minus the gateway's, as measured from the round announcements (None: none yet)."""
        self._skew_samples: deque[tuple[float, float]] = deque(maxlen=SKEW_SAMPLES)
        self.signer = signer
        self.keyring = KeyRing({GATEWAY_ID: fleet_key})
        self.app = app
        self.trainer, self.x, self.y = _local_training(device_id, app, model, data, profile, seed, trainer_options)
        self.last_fit: dict[str, Any] | None = None
        """The app's last fit: ``{"round_id", "num_examples", "metrics"}`` (app clients only)."""
        self.last_evaluate: dict[str, Any] | None = None
        """The app's last evaluation of a global model: ``{"round_id", "loss", "num_examples", "metrics"}``."""
        self._app_meta: dict[str, Any] = {}
        self.feedback = ErrorFeedback()
        self.transform_update = transform_update
        self.delay_s = float(delay_s)
        self.report_train_time = bool(report_train_time)
        self.stats = ClientStats()
        self._seq = time.time_ns() // 1_000_000  # monotonic across restarts
        self._weights: dict[str, np.ndarray] | None = None
        self._version = -1
        self._digest: str | None = None  # weights_digest(self._weights), computed at the first delta
        self._full_sub: Any = None  # the subscription to the full model while this device needs it
        self._sub_lock = threading.Lock()
        self.delta_refusals: dict[str, int] = {}
        """Model deltas refused, by reason (edgeflow.codecs.model_delta.apply_model_delta)."""
        self.last_delta_refusal = ""
        self.epoch_file = Path(epoch_file) if epoch_file is not None else None
        self._epoch = self._load_epoch()
        self._weights_cv = threading.Condition()
        self._rounds: "queue.Queue[RoundAnnouncement | None]" = queue.Queue()
        self._done: set[tuple[int, str]] = set()
        self._current: RoundAnnouncement | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._subs: list[Any] = []
        self._rng = np.random.default_rng(seed)
        self.last_delta: dict[str, np.ndarray] | None = None
        self._sa_inbox: "queue.Queue[Any]" = queue.Queue()
        self.state = "waiting"
        """"waiting" (no global model yet), "ready", "model_mismatch" (the gateway's model does not
        fit the local one: ``state_detail`` says how) or "app_error" (the app's last round failed: what
        ``state_detail`` says); the device agent reports it."""
        self.state_detail = ""
        self.on_state_change: Callable[[], Any] | None = None
        """Called (on the transport's thread) when :attr:`state` changes; the agent re-announces."""
        self.on_error: Callable[[str, EdgeflowError], Any] | None = None
        """Called with (device id, error) when a round fails here (the app's result refused, fit raising):
        ``edgeflow simulate --app`` stops on the first one instead of waiting out the round's deadline."""

    # -- lifecycle --------------------------------------------------------
    def start(self) -> "Client":
        if self._thread is not None:
            return self
        self._stop.clear()
        with self._sub_lock:  # the full model until a delta applies (module docstring)
            self._full_sub = self.transport.subscribe(str(gateway_topic(self.fleet, "model")), self._on_model)
        self._subs = [
            self.transport.subscribe(str(gateway_topic(self.fleet, "round")), self._on_round),
            self.transport.subscribe(str(gateway_topic(self.fleet, "secagg")), self._on_secagg),
        ]
        try:
            self._subs.append(self.transport.subscribe(str(gateway_topic(self.fleet, "model_delta")),
                                                       self._on_model_delta))
        except TransportError as exc:  # a broker ACL written before model deltas: the full model still comes
            log.warning("device %s: cannot subscribe to model deltas (%s); taking full models only", self.device_id,
                        exc)
        self._thread = threading.Thread(target=self._loop, name=f"fl-client-{self.device_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._rounds.put(None)
        with self._weights_cv:
            self._weights_cv.notify_all()
        with self._sub_lock:
            subs, self._subs = self._subs + ([self._full_sub] if self._full_sub is not None else []), []
            self._full_sub = None
        for s in subs:
            try:
                self.transport.unsubscribe(s)
            except Exception:  # the transport may already be closed
                log.debug("device %s: unsubscribe at stop failed (transport closed?)", self.device_id, exc_info=True)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def status(self) -> dict[str, Any]:
        return {"running": self._thread is not None, "model_version": self._version, "gateway_epoch": self._epoch,
                "state": self.state, "detail": self.state_detail, "clock_skew_s": self.clock_skew_s,
                "delta_refusals": dict(self.delta_refusals), **self.stats.to_dict()}

    def _set_state(self, state: str, detail: str = "") -> None:
        if (state, detail) == (self.state, self.state_detail):
            return
        self.state, self.state_detail = state, detail
        if state == "model_mismatch":
            log.warning("device %s: %s", self.device_id, detail)
        cb = self.on_state_change
        if cb is not None:
            try:
                cb()
            except Exception:  # noqa: BLE001 - a callback must not break message handling
                log.exception("device %s: state callback failed", self.device_id)

    def misfit(self, weights: Mapping[str, np.ndarray]) -> str:
        """Why ``weights`` (the gateway's global model) cannot be trained here, or ""."""
        if self.app is not None:
            return self._app_misfit(weights)
        known = {n: self.trainer._value(n).shape for n in self.trainer.weight_names}
        extra = sorted(set(weights) - set(known))
        if extra:
            return (f"it has weight(s) {extra[:3]} that the local model lacks (local weights: "
                    f"{sorted(known)[:3]}...)")
        for name, arr in weights.items():
            if tuple(np.shape(arr)) != tuple(known[name]):
                return f"weight {name!r} is {tuple(np.shape(arr))} there and {tuple(known[name])} here"
        if not set(weights) & set(self.trainer.trainable_names):
            return "none of its weights is a trainable weight of the local model"
        return ""

    def _app_misfit(self, weights: Mapping[str, np.ndarray]) -> str:
        try:
            local = self.app.get_parameters({})
        except Exception as exc:  # user code: report, the global model is then refused
            log.warning("device %s: %s.get_parameters failed", self.device_id, type(self.app).__name__,
                        exc_info=True)
            return f"{type(self.app).__name__}.get_parameters raised {type(exc).__name__}: {exc}"
        if local is None:
            return ""
        if isinstance(self.app, ListClient):  # a list: compared by position, in the names' natural order
            names = natural_order(list(weights))
            if len(local) != len(names):
                return (f"it has {len(names)} parameters and {type(self.app.inner).__name__}.get_parameters gives "
                        f"{len(local)}")
            for i, (name, mine) in enumerate(zip(names, local.values())):
                if tuple(np.shape(weights[name])) != tuple(np.shape(mine)):
                    return (f"parameter {i} ({name}) is {tuple(np.shape(weights[name]))} there and "
                            f"{tuple(np.shape(mine))} here")
            return ""
        extra = sorted(set(weights) - set(local))
        if extra:
            return f"it has weight(s) {extra[:3]} that the local model lacks (local weights: {sorted(local)[:3]}...)"
        for name, arr in weights.items():
            if tuple(np.shape(arr)) != tuple(np.shape(local[name])):
                return f"weight {name!r} is {tuple(np.shape(arr))} there and {tuple(np.shape(local[name]))} here"
        return ""

    def _load_epoch(self) -> int:
        if self.epoch_file is None:
            return 0
        try:
            value = json.loads(self.epoch_file.read_text(encoding="utf-8")).get("gateway_epoch", 0)
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("device %s: %s unreadable (%s): starting from gateway epoch 0", self.device_id,
                        self.epoch_file, exc)
            return 0
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    def _save_epoch(self) -> None:
        if self.epoch_file is None:
            return
        tmp = self.epoch_file.with_name(self.epoch_file.name + ".tmp")
        try:
            self.epoch_file.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"gateway_epoch": self._epoch}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.epoch_file)
        except OSError as exc:
            log.warning("device %s: gateway epoch not persisted to %s: %s", self.device_id, self.epoch_file, exc)

    def _follow_epoch(self, epoch: int, what: str) -> bool:
        """False (refuse) for an older gateway epoch; a newer one resets the model version seen.
        Call with ``_weights_cv`` held."""
        if epoch < self._epoch:
            self.stats.rejected_messages += 1
            log.warning("device %s: %s of gateway epoch %d refused: epoch %d is current (a replay?)",
                        self.device_id, what, epoch, self._epoch)
            return False
        if epoch > self._epoch:
            if self._epoch:
                log.warning("device %s: the gateway started epoch %d (was %d): following its model versions "
                            "and rounds from scratch", self.device_id, epoch, self._epoch)
            self._epoch = epoch  # rounds done stay done: a resumed round keeps its nonce
            self._version = -1
            self._weights = None
            self._save_epoch()
        return True

    # -- the full model's subscription (model deltas) ------------------------
    def _want_full(self, why: str) -> None:
        """Listen to the full model (its retained copy comes at once) until a delta applies again."""
        with self._sub_lock:
            if self._full_sub is not None or self._stop.is_set():
                return
            try:
                self._full_sub = self.transport.subscribe(str(gateway_topic(self.fleet, "model")), self._on_model,
                                                          timeout=None)
            except TransportError as exc:
                log.warning("device %s: cannot subscribe to the full model (%s): %s", self.device_id, why, exc)
                return
        log.debug("device %s: taking the full model (%s)", self.device_id, why)

    def _drop_full(self) -> None:
        """A delta applied: the deltas suffice, the broker need not send this device the full model."""
        with self._sub_lock:
            sub, self._full_sub = self._full_sub, None
            if sub is None:
                return
            try:
                self.transport.unsubscribe(sub, timeout=None)
            except TransportError as exc:  # retried by the transport on reconnect; the full model is then ignored
                log.debug("device %s: unsubscribe from the full model: %s", self.device_id, exc)

    # -- handlers (transport worker thread: keep them short) ---------------
    def _on_model_delta(self, msg: Any) -> None:
        if not msg.payload:
            return
        with self._weights_cv:
            weights, version, epoch, digest = self._weights, self._version, self._epoch, self._digest
        if weights is None:
            return  # nothing to apply it to: the full model is subscribed until one is held
        try:
            got = apply_model_delta(msg.payload, weights=weights, version=version, epoch=epoch, digest=digest,
                                    keyring=self.keyring, source=f"{self.device_id}<-gateway/model_delta")
        except CodecError as exc:
            reason = refusal(exc)
            if reason == "held":
                return  # the full model of that version came first
            self.stats.deltas_refused += 1
            self.stats.rejected_messages += 1
            self.delta_refusals[reason] = self.delta_refusals.get(reason, 0) + 1
            self.last_delta_refusal = f"{reason}: {exc}"
            if reason == "replay":  # this device holds a newer model: nothing to fetch
                log.warning("device %s: model delta refused (%s): %s", self.device_id, reason, exc)
                return
            log.warning("device %s: model delta refused (%s): %s; taking the full model", self.device_id, reason, exc)
            self._want_full(f"delta refused: {reason}")
            return
        with self._weights_cv:
            if self._weights is not weights or self._version != version or self._epoch != epoch:
                return  # a full model came meanwhile
            self._weights, self._version, self._digest = got.weights, got.version, got.digest
            self._weights_cv.notify_all()
        self.stats.deltas_applied += 1
        self._drop_full()
        self._set_state("ready")

    def _on_model(self, msg: Any) -> None:
        try:
            upd = decode_update(msg.payload, verifier=self.keyring, require_signature=True,
                                source=f"{self.device_id}<-gateway/model")
        except (CodecError, SignatureError) as exc:
            self.stats.rejected_messages += 1
            log.warning("device %s: global model refused: %s", self.device_id, exc)
            return
        if upd.device_id != GATEWAY_ID:
            self.stats.rejected_messages += 1
            return
        version, epoch = upd.metadata.get("model_version", upd.round_id), upd.metadata.get("epoch", 0)
        if isinstance(version, bool) or not isinstance(version, int) or isinstance(epoch, bool) \
                or not isinstance(epoch, int):
            self.stats.rejected_messages += 1
            log.warning("device %s: global model refused: model_version/epoch are not integers", self.device_id)
            return
        problem = self.misfit(upd.tensors)
        if problem:
            self.stats.rejected_messages += 1
            self._set_state("model_mismatch", f"the gateway's global model v{version} does not fit the model deployed "
                            f"on this device: {problem}; deploy the model the gateway trains (`edgeflow fleet "
                            "deploy MODEL`, MODEL = the gateway's [gateway] model)")
            return
        with self._weights_cv:
            if not self._follow_epoch(epoch, f"model v{version}"):
                return
            if version >= self._version:
                self._weights = upd.tensors
                self._version = version
                self._digest = None
                self.stats.full_models += 1
                self._weights_cv.notify_all()
        self._set_state("ready")

    def _on_round(self, msg: Any) -> None:
        if not msg.payload:
            return  # retained announcement cleared
        try:
            ann = RoundAnnouncement.verify(msg.payload, self.keyring.get(GATEWAY_ID))
        except (CodecError, SignatureError) as exc:
            self.stats.rejected_messages += 1
            log.warning("device %s: round announcement refused: %s", self.device_id, exc)
            return
        with self._weights_cv:
            if not self._follow_epoch(ann.epoch, f"round {ann.round_id} announcement"):
                return
            behind = ann.model_version > self._version
        if behind:  # a version this device missed (no delta came, or one it refused): the full model has it
            self._want_full(f"round {ann.round_id} names model v{ann.model_version}")
        ann = self._localize(ann)
        self._current = ann
        if ann.state == "open" and (not ann.selected or self.device_id in ann.selected):
            self._rounds.put(ann)

    def _localize(self, ann: RoundAnnouncement) -> RoundAnnouncement:
        """``ann`` with its deadline on this device's clock: ``deadline - issued`` counted from now (the
        receipt), corrected by the smallest offset seen lately (a retained or re-published announcement
        is older than its receipt). An announcement without ``issued`` keeps its absolute deadline."""
        if not ann.issued:
            return ann
        mono = time.monotonic()
        samples = self._skew_samples
        while samples and mono - samples[0][0] > SKEW_WINDOW_S:
            samples.popleft()
        samples.append((mono, self.clock() - ann.issued))
        skew = min(s for _, s in samples)
        if self.clock_skew_s is None or abs(skew - self.clock_skew_s) > 1.0:
            log.log(logging.WARNING if abs(skew) > 5.0 else logging.DEBUG,
                    "device %s: this clock is %+.1f s off the gateway's; round deadlines are counted from "
                    "receipt", self.device_id, skew)
        self.clock_skew_s = skew
        return replace(ann, deadline=ann.deadline + skew)

    def _on_secagg(self, msg: Any) -> None:
        """Gateway -> devices secure-aggregation broadcasts (signed by the fleet key)."""
        from ..protocol import secagg_wire as secure

        try:
            frame = secure.unseal(msg.payload, self.keyring.get(GATEWAY_ID))
            if frame[:4] == b"EFSB":
                for f in secure.unpack_bundles(frame):
                    m = secure.decode(f)
                    if getattr(m, "recipient", None) == self.device_id:
                        self._sa_inbox.put(m)
            else:
                self._sa_inbox.put(secure.decode(frame))
        except (CodecError, SignatureError) as exc:
            self.stats.rejected_messages += 1
            log.warning("device %s: secagg message refused: %s", self.device_id, exc)
        except Exception as exc:  # SecAggError derives from AggregationError
            self.stats.rejected_messages += 1
            log.warning("device %s: secagg message refused: %s", self.device_id, exc)

    def _sa_wait(self, kind: type, session: bytes | None, deadline: float) -> Any:
        while not self._stop.is_set():
            left = deadline - self.clock()
            if left <= 0:
                raise EdgeflowError(f"secure aggregation: no {kind.__name__} before the deadline")
            try:
                m = self._sa_inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if isinstance(m, kind) and (session is None or getattr(m, "session_id", session) == session):
                return m
        raise EdgeflowError("client stopped")

    def _run_secure_round(self, ann: RoundAnnouncement, weights: dict[str, np.ndarray], version: int) -> None:
        """One round under secure aggregation: the gateway only ever sees the masked sum."""
        from ..protocol.secagg import FinalHolders, KeyDirectory, ShareBundle, UnmaskRequest
        from .secagg_client import SecAggClient
        from ..protocol import secagg_wire as secure

        topic = str(device_topic(self.fleet, self.device_id, "secagg"))

        def send(msg: Any) -> None:
            payload = secure.seal(secure.encode(msg), self.signer)
            self.transport.publish(topic, payload, qos=1)
            self.stats.bytes_sent += len(payload)

        while not self._sa_inbox.empty():  # leftovers of an earlier session
            self._sa_inbox.get_nowait()
        sa = SecAggClient(self.device_id)
        send(sa.advertise())
        directory = self._sa_wait(KeyDirectory, None, ann.deadline)
        if directory.round_id != ann.round_id:
            raise EdgeflowError(f"key directory for round {directory.round_id}, expected {ann.round_id}")
        send(sa.share_keys(directory))
        delta, n, loss = self._train(weights, ann.config, ann.round_id)
        self.stats.rounds_trained += 1
        self.stats.last_round = ann.round_id
        self.stats.last_loss = loss
        self._done.add((ann.round_id, ann.nonce))
        bundle = self._sa_wait(ShareBundle, directory.session_id, ann.deadline)
        if delta is None:
            return  # this device drops out after sharing its keys (the gateway leaves it out; the others go on)
        send(sa.check_bundle(bundle))  # a peer whose share to this device fails is named (and checked by the gateway)
        final = self._sa_wait(FinalHolders, directory.session_id, ann.deadline + 30.0)
        send(sa.masked_input(final, delta, weight=float(n)))
        self.stats.updates_sent += 1
        self.stats.dense_bytes += 4 * sum(int(v.size) for v in delta.values())
        request = self._sa_wait(UnmaskRequest, directory.session_id, ann.deadline + 30.0)
        send(sa.unmask(request))

    # -- the worker --------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            ann = self._rounds.get()
            if ann is None:
                return
            try:
                self._dispatch(ann)
            except EdgeflowError as exc:
                if self._stop.is_set():  # stopped mid-round (the transport closed under it): nothing to report
                    log.debug("device %s: round %d ended by stop: %s", self.device_id, ann.round_id, exc)
                    return
                self.stats.errors.append(f"round {ann.round_id}: {exc}")
                # with on_error its owner reports it (a simulation ends with it as its one line)
                log.log(logging.DEBUG if self.on_error else logging.WARNING, "device %s: round %d failed: %s",
                        self.device_id, ann.round_id, exc)
                self._report_error(exc)

    def _dispatch(self, ann: RoundAnnouncement) -> None:
        if ann.mode == "parameters":
            if ("parameters", ann.round_id, ann.nonce) not in self._done:
                self._offer_parameters(ann)
        elif ann.mode == "async":
            self._run_async(ann)
        elif ann.mode == "evaluate":
            if ("evaluate", ann.round_id, ann.nonce) not in self._done:
                self._run_evaluate(ann)
        elif (ann.round_id, ann.nonce) not in self._done:
            self._run_round(ann)

    def _offer_parameters(self, ann: RoundAnnouncement) -> None:
        """The gateway has no model yet and asks this device for its parameters (Flower's get_parameters): send the
        app's, signed, as a dense update echoing the request's nonce (gateway/first_parameters.py)."""
        self._done.add(("parameters", ann.round_id, ann.nonce))
        if self.app is None:
            log.info("device %s: asked for first parameters, but it trains a deployed model", self.device_id)
            return
        try:
            params = self.app.get_parameters({})
        except EdgeflowError as exc:
            self._report_error(exc)
            return
        except Exception as exc:  # user code: one line, the gateway asks another device
            log.warning("device %s: %s.get_parameters raised %s: %s; no parameters offered", self.device_id,
                        self._app_name(), type(exc).__name__, exc)
            self._report_error(EdgeflowError(f"{self._app_name()}.get_parameters raised {type(exc).__name__}: {exc}"))
            return
        if not params:
            self._report_error(EdgeflowError(f"{self._app_name()}.get_parameters returned nothing, so this device "
                                             "cannot offer the first parameters"))
            return
        self._seq += 1
        payload = encode_update({k: np.asarray(v, dtype=np.float32) for k, v in params.items()}, "dense",
                                round_id=ann.round_id, device_id=self.device_id, seq=self._seq, signer=self.signer,
                                num_samples=1, metadata={"round_nonce": ann.nonce, "offer": True})
        self.transport.publish(str(device_topic(self.fleet, self.device_id, "update")), payload, qos=1)
        log.info("device %s: offered its %d parameters as the first global model", self.device_id, len(params))

    def _app_name(self) -> str:
        """The user's class, as messages name it (a Flower-shaped client's own, not its ListClient wrapper)."""
        return type(self.app.inner if isinstance(self.app, ListClient) else self.app).__name__

    def _report_error(self, exc: EdgeflowError) -> None:
        """Tell ``on_error`` (a simulation stops at once on it; a device shows it in its state)."""
        if self.app is not None:
            self._set_state("app_error", str(exc))
        cb = self.on_error
        if cb is not None:
            try:
                cb(self.device_id, exc)
            except Exception:  # noqa: BLE001 - a callback must not end the client's worker
                log.exception("device %s: error callback failed", self.device_id)

    def _wait_weights(self, version: int, deadline: float) -> tuple[int, dict[str, np.ndarray]] | None:
        with self._weights_cv:
            while self._version < version and not self._stop.is_set():
                left = deadline - self.clock()
                if left <= 0:
                    return None
                self._weights_cv.wait(min(left, 0.5))
            if self._weights is None:
                return None
            return self._version, self._weights

    def _train(self, weights: dict[str, np.ndarray], cfg: TrainConfig,
               round_id: int) -> tuple[dict[str, np.ndarray] | None, int, float]:
        if self.app is not None:
            return self._train_app(weights, cfg, round_id)
        from ..train import make_optimizer

        t = self.trainer
        t.set_weights(weights)
        t.optimizer = make_optimizer(cfg.optimizer, cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        t.proximal_mu = float(cfg.proximal_mu)
        t.clip_norm = cfg.clip_norm
        x, y = self.x, self.y
        if cfg.max_samples and len(x) > cfg.max_samples:
            idx = self._rng.choice(len(x), cfg.max_samples, replace=False)
            x, y = x[idx], y[idx]
        t0 = time.perf_counter()
        hist = t.fit((x, y), epochs=cfg.epochs, batch_size=cfg.batch_size, anchor=weights)
        if self.delay_s:
            time.sleep(self.delay_s)
        self.stats.last_train_s = time.perf_counter() - t0
        self.stats.train_s_total += self.stats.last_train_s
        delta = t.delta_from(weights)
        self.last_delta = delta
        if self.transform_update is not None:
            delta = self.transform_update(delta, round_id)
        return delta, len(x), hist.mean_loss

    def _train_app(self, weights: dict[str, np.ndarray], cfg: TrainConfig,
                   round_id: int) -> tuple[dict[str, np.ndarray] | None, int, float | None]:
        """One round through the user's NumPyClient: evaluate the global model (if it can), fit, delta."""
        app, name = self.app, self._app_name()
        config = {**cfg.__dict__, "codec_opts": dict(cfg.codec_opts), "round_id": round_id,
                  "model_version": self._version}
        meta: dict[str, Any] = {}
        if app.evaluates:
            try:
                result = app.evaluate({k: v.copy() for k, v in weights.items()}, dict(config))
            except EdgeflowError:  # edgeflow's own check of the app's result (ListClient): already one line
                raise
            except Exception as exc:
                raise EdgeflowError(f"{name}.evaluate raised {type(exc).__name__}: {exc}") from exc
            loss, n_eval, metrics = check_evaluate(result, f"{name}.evaluate")
            self.last_evaluate = {"round_id": round_id, "loss": loss, "num_examples": n_eval, "metrics": metrics}
            meta["eval"] = {"loss": loss, "num_examples": n_eval, "metrics": metrics}
        t0 = time.perf_counter()
        try:
            result = app.fit({k: v.copy() for k, v in weights.items()}, dict(config))
        except EdgeflowError:  # edgeflow's own check of the app's result (ListClient): already one line
            raise
        except Exception as exc:
            raise EdgeflowError(f"{name}.fit raised {type(exc).__name__}: {exc}") from exc
        params, n, metrics = check_fit(result, weights, f"{name}.fit")
        if self.delay_s:
            time.sleep(self.delay_s)
        self.stats.last_train_s = time.perf_counter() - t0
        self.stats.train_s_total += self.stats.last_train_s
        self.last_fit = {"round_id": round_id, "num_examples": n, "metrics": metrics}
        if metrics:
            meta["metrics"] = metrics
        self._app_meta = meta
        delta = {k: (params[k].astype(np.float32) - np.asarray(w, dtype=np.float32)) for k, w in weights.items()}
        self.last_delta = delta
        if self.transform_update is not None:
            delta = self.transform_update(delta, round_id)
        loss = metrics.get("loss")
        numeric = isinstance(loss, (int, float)) and not isinstance(loss, bool)
        return delta, n, float(loss) if numeric else None  # None: the app reports no training loss

    def _send(self, ann: RoundAnnouncement, delta: dict[str, np.ndarray], n: int, loss: float | None,
              base_version: int) -> bool:
        cfg = ann.config
        self._seq += 1
        payload = encode_update(
            delta, cfg.codec, round_id=ann.round_id, device_id=self.device_id, seq=self._seq,
            signer=self.signer, state=self.feedback, num_samples=n, rng=self._rng,
            metadata={**({} if loss is None else {"loss": float(loss)}), "base_version": int(base_version),
                      **self._app_meta,
                      **({"train_s": round(self.stats.last_train_s, 4)} if self.report_train_time else {}),
                      **({"clock_skew_s": round(self.clock_skew_s, 3)}
                         if self.report_train_time and self.clock_skew_s is not None else {}),
                      **({"round_nonce": ann.nonce} if ann.nonce else {})},
            **cfg.codec_opts,
        )
        if ann.mode == "sync" and self.clock() > ann.deadline:
            self.stats.skipped_late += 1
            log.info("device %s: round %d deadline passed; update not sent", self.device_id, ann.round_id)
            return False
        self.transport.publish(str(device_topic(self.fleet, self.device_id, "update")), payload, qos=1)
        self.stats.updates_sent += 1
        self.stats.bytes_sent += len(payload)
        self.stats.dense_bytes += 4 * sum(int(v.size) for v in delta.values())
        return True

    def _run_round(self, ann: RoundAnnouncement) -> None:
        got = self._wait_weights(ann.model_version, ann.deadline)
        if got is None:
            self.stats.errors.append(f"round {ann.round_id}: global model v{ann.model_version} never arrived")
            return
        version, weights = got
        if ann.config.secagg:
            self._run_secure_round(ann, weights, version)
            return
        delta, n, loss = self._train(weights, ann.config, ann.round_id)
        self.stats.rounds_trained += 1
        self.stats.last_round = ann.round_id
        self.stats.last_loss = loss
        self._done.add((ann.round_id, ann.nonce))
        if delta is not None:
            self._send(ann, delta, n, loss, version)

    def _run_evaluate(self, ann: RoundAnnouncement) -> None:
        """A federated evaluate round: evaluate the announced global model on the local data, send the signed
        report (gateway/evaluate_rounds.py)."""
        self._done.add(("evaluate", ann.round_id, ann.nonce))
        got = self._wait_weights(ann.model_version, ann.deadline)
        if got is None or got[0] != ann.model_version:
            why = "never arrived" if got is None else f"was replaced by v{got[0]} before it could be evaluated"
            self.stats.errors.append(f"evaluate round {ann.round_id}: global model v{ann.model_version} {why}")
            return
        try:
            loss, n, metrics = self._evaluate(got[1], ann)
        except EdgeflowError as exc:
            self.stats.errors.append(f"evaluate round {ann.round_id}: {exc}")
            log.warning("device %s: evaluate round %d failed: %s", self.device_id, ann.round_id, exc)
            return
        if self.clock() > ann.deadline:  # the deadline is on this device's clock (_localize)
            self.stats.skipped_late += 1
            log.info("device %s: evaluate round %d deadline passed; report not sent", self.device_id, ann.round_id)
            return
        report = EvaluationReport(ann.round_id, ann.nonce, ann.model_version, loss, n, metrics)
        self.transport.publish(str(device_topic(self.fleet, self.device_id, "evaluate")),
                               report.sign(self.signer.key), qos=1)
        self.stats.evaluations_sent += 1

    def _evaluate(self, weights: dict[str, np.ndarray], ann: RoundAnnouncement) -> tuple[float, int, dict]:
        """(loss, examples, metrics) of ``weights`` on the local data: the app's ``evaluate``, or the
        trainer's loss and accuracy."""
        if self.app is not None:
            app, name = self.app, self._app_name()
            if not app.evaluates:
                raise EdgeflowError(f"{name} has no evaluate(): it cannot take part in evaluate rounds "
                                    "(fraction_evaluate); define evaluate(parameters, config)")
            config = {**ann.config.__dict__, "codec_opts": dict(ann.config.codec_opts), "round_id": ann.round_id,
                      "model_version": ann.model_version}
            try:
                result = app.evaluate({k: v.copy() for k, v in weights.items()}, config)
            except EdgeflowError:  # edgeflow's own check of the app's result (ListClient): already one line
                raise
            except Exception as exc:
                raise EdgeflowError(f"{name}.evaluate raised {type(exc).__name__}: {exc}") from exc
            loss, n, metrics = check_evaluate(result, f"{name}.evaluate")
            self.last_evaluate = {"round_id": ann.round_id, "loss": loss, "num_examples": n, "metrics": metrics}
            return loss, n, metrics
        self.trainer.set_weights(weights)
        loss, acc = self.trainer.evaluate(self.x, self.y)
        return float(loss), len(self.y), ({} if acc is None else {"accuracy": float(acc)})

    def _run_async(self, ann: RoundAnnouncement) -> None:
        """FedBuff: train from the newest global version, send, repeat until closed."""
        while not self._stop.is_set():
            cur = self._current
            if cur is None or cur.round_id != ann.round_id or cur.state != "open":
                return
            got = self._wait_weights(0, self.clock() + 5.0)
            if got is None:
                continue
            version, weights = got
            try:
                delta, n, loss = self._train(weights, ann.config, ann.round_id)
            except EdgeflowError as exc:
                self.stats.errors.append(str(exc))
                return
            self.stats.rounds_trained += 1
            self.stats.last_loss = loss
            if delta is None:
                return
            self._send(cur, delta, n, loss, version)
            # wait for a newer model before training again (no point re-training the same one)
            with self._weights_cv:
                end = time.time() + 30.0
                while self._version == version and not self._stop.is_set() and time.time() < end:
                    c = self._current
                    if c is None or c.state != "open":
                        return
                    self._weights_cv.wait(0.2)
