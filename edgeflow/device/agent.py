"""The device agent: one board's presence in the fleet.

What it does, on the transport it is given (one :class:`MqttTransport`):

- **birth and death** (Sparkplug B style): every connection attempt gets a
  new ``bdseq`` (persisted, so it also rises across agent restarts) and a
  last will signed for it: a retained, signed death. After the connect the
  agent clears its retained death and publishes a retained, signed birth
  (profile, versions, model version, public key, that ``bdseq``), so the
  gateway can tell a stale will from a live device, also after a
  broker-side timeout (see :mod:`edgeflow.protocol.fleet`). A clean
  :meth:`DeviceAgent.stop` publishes a signed death itself.
- **telemetry** every ``telemetry_interval_s``: latency p50/p95 of the
  inferences since the last report, RSS, CPU, queue depth, battery.
- **inference** on the deployed model: :meth:`DeviceAgent.predict`
  in-process (``edgeflow.device.predict``) and the ``infer`` ->
  ``infer/reply`` topics.
- **commands** (signed by the fleet key, addressed to this device, not
  expired): ``status``, ``set_config``, ``train_start``, ``train_stop``,
  ``rollback``, ``reboot``; ``deploy`` arrives with its artifact as an OTA
  offer on the ``ota`` topic. Every command gets one signed ack on
  ``cmd/ack``: success with a result, or a code and a clear error, also for
  refusals (bad signature, unknown command). A redelivered command gets the
  same ack again instead of running twice, also after an agent restart:
  accepted command ids persist until they expire (:mod:`.replay`). A deploy
  of an older version than the running one is refused unless the signed
  command allows the downgrade, and a rollback or deploy issued before the
  running model was installed is refused as stale.

The agent keeps identity, the connection (birth and death), the model it
serves and the command dispatch (:attr:`DeviceAgent._COMMAND_TABLE`); the rest
are services it wires, each in its own module:

- ``agent.ota`` (:class:`~edgeflow.device.ota.OtaService`): deploy, rollback
  and reboot, the OTA journal and its recovery after a power cut;
- ``agent.training_service`` (:class:`~edgeflow.device.training.TrainingService`):
  whether the board takes part in rounds, and its participant;
- ``agent.inference`` (:class:`~edgeflow.device.inference.InferenceService`):
  the ``infer`` topic;
- ``agent.telemetry`` (:class:`~edgeflow.device.telemetry.TelemetryService`):
  the periodic report.

Threads: message handlers run on the transport's worker thread and only do
quick work; deploy/rollback/reboot run one at a time on the OTA service's
operations thread, MQTT inference requests on the inference thread (a
bounded queue: "busy" replies instead of unbounded memory), telemetry on its
own timer thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact import verify_artifact
from ..errors import CodecError, EdgeflowError, FleetError, SignatureError
from ..profiles import BACKENDS, DeviceProfile, get_profile
from ..protocol.fleet import BIRTH_CONTEXT, COMMANDS, Ack, Birth, Command, Death
from ..protocol.signed_json import loads, peek_signed, sign_body
from ..signing import PublicKey, Signer
from ..transport.base import Transport
from ..transport.message import ConnectionEvent, Message
from ..transport.topics import device_topic
from .commands import CommandFailed
from .health import load_runtime
from .inference import InferenceService
from .ota import OtaService
from .replay import SeenCommands
from .slots import ActiveModel, SlotStore
from .telemetry import TelemetryCollector, TelemetryService
from .training import TRAIN_STATES, Participant, TrainingService

__all__ = ["AgentOptions", "CommandFailed", "DeviceAgent", "Participant", "ParticipantFactory", "TRAIN_STATES"]

log = logging.getLogger("edgeflow.device")


ParticipantFactory = Callable[["DeviceAgent"], Participant]
"""``make_participant(agent)``: build a participant for the agent's current model
(``agent.model_path``, ``agent.transport``, ``agent.signer``...). Called again after every
model change, since a participant trains one model. A factory whose ``needs_model`` attribute is False
(``edgeflow device --app``: a Flower-style client brings its own model) takes part with no model deployed."""


@dataclass
class AgentOptions:
    """Agent settings; the ones in :data:`CONFIG_KEYS` can be changed by ``set_config``."""

    telemetry_interval_s: float = 10.0
    telemetry_qos: int = 1
    memory_budget_mb: int | None = None
    """Override of the profile's memory budget (a board with less free memory than its profile says)."""
    backend: str | None = None
    threads: int | None = None
    battery_file: str | None = None
    health_runs: int = 5
    infer_queue: int = 64
    infer_keys: tuple[str, ...] = ()
    """Hex public keys of the applications allowed to ask for inferences, besides the fleet key."""
    clock_skew_s: float = 120.0
    """Commands are accepted until ``expires + clock_skew_s`` (device clocks drift)."""
    train: bool = True
    """Take part in federated rounds whenever this board can: a training participant (training data),
    a model that trains (fp32, or a quantized model that came with its fp32 master) and a profile that
    can train. False opts out (``edgeflow device --no-train``, ``set_config train=false``, ``train_stop``)."""


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _backend(v: Any) -> str | None:
    if v is not None and v not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or null")
    return v


def _interval(v: Any) -> float:
    f = float(v)
    if not 0.05 <= f <= 86400:
        raise ValueError("telemetry_interval_s must be between 0.05 and 86400")
    return f


def _qos(v: Any) -> int:
    if int(v) not in (0, 1):
        raise ValueError("telemetry_qos must be 0 or 1")
    return int(v)


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "on", "off", "yes", "no", "1", "0"):
        return v.lower() in ("true", "on", "yes", "1")
    raise ValueError("must be true or false")


def _runs(v: Any) -> int:
    if not 1 <= int(v) <= 1000:
        raise ValueError("health_runs must be between 1 and 1000")
    return int(v)


CONFIG_KEYS: dict[str, Callable[[Any], Any]] = {
    "telemetry_interval_s": _interval,
    "telemetry_qos": _qos,
    "memory_budget_mb": _opt_int,
    "backend": _backend,
    "threads": _opt_int,
    "battery_file": _opt_str,
    "health_runs": _runs,
    "train": _bool,
}

_AGENTS: "weakref.WeakValueDictionary[str, DeviceAgent]" = weakref.WeakValueDictionary()
_LAST: list[DeviceAgent] = []


def _plain_id(data: bytes) -> tuple[str, str]:
    try:
        d = loads(data)
    except CodecError:
        return "", ""
    if not isinstance(d, dict):
        return "", ""
    return str(d.get("id", ""))[:64], str(d.get("name", ""))[:64]


class _SessionWill:
    """The agent's last will, made anew for every connection attempt.

    The transport reads ``payload`` once per connection attempt (when it
    builds the MQTT client for it); each read takes the next persisted
    ``bdseq`` and signs a death for it, so every session's will carries its
    own ``bdseq`` and the birth the agent publishes after connecting (with
    the agent's current ``bdseq``) always outranks any earlier session's
    death. Duck-types :class:`edgeflow.transport.message.Will`.
    """

    qos = 1
    retain = True
    delay_s = 0

    def __init__(self, agent: DeviceAgent) -> None:
        self._agent = weakref.proxy(agent)
        self.topic = agent.topic("death")

    @property
    def payload(self) -> bytes:
        return self._agent._new_session()


def running_agents() -> dict[str, DeviceAgent]:
    return dict(_AGENTS)


def _versions() -> dict[str, str]:
    import platform
    from importlib import metadata

    from .._version import __version__

    out = {"edgeflow": __version__, "python": platform.python_version()}
    for dist in ("numpy", "onnx", "onnxruntime"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


class DeviceAgent:
    """One device in a fleet. See the module docstring.

    ``transport`` is an :class:`edgeflow.transport.MqttTransport` that was not
    connected yet (the agent sets its last will and subscribes first, so
    commands queued in a persistent session are not missed); the agent closes
    it on :meth:`stop`. Use :meth:`from_credentials` to build everything from
    a credentials directory.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        device_id: str,
        fleet: str,
        profile: str | DeviceProfile,
        signer: Signer,
        fleet_key: PublicKey,
        state_dir: str | os.PathLike[str],
        options: AgentOptions | None = None,
        make_participant: ParticipantFactory | None = None,
        battery_fn: Callable[[], float | None] | None = None,
    ) -> None:
        if signer.device_id != device_id:
            raise FleetError(f"signer is for device {signer.device_id!r}, the agent is {device_id!r}")
        self.transport = transport
        self.device_id = device_id
        self.fleet = fleet
        self.profile = get_profile(profile)
        self.signer = signer
        self.fleet_key = fleet_key
        self.slots = SlotStore(state_dir)
        self.options = dataclasses.replace(options or AgentOptions())
        self._owner_opted_out = not self.options.train
        """Started with ``train=False`` (``edgeflow device --no-train``): no command turns training on."""
        self.load_config()
        self.make_participant = make_participant
        self._topic = {ch: device_topic(fleet, device_id, ch).value
                       for ch in ("birth", "death", "telemetry", "cmd", "cmd/ack", "ota", "infer", "infer/reply")}
        self._model: ActiveModel | None = None
        self._runtime: Any = None
        self._rt_lock = threading.Lock()
        self._run_lock = threading.Lock()
        self.seen = SeenCommands(self.slots.root / "seen.json", clock_skew_s=self.options.clock_skew_s)
        # the services (each in its own module; each keeps a reference to this agent)
        self.ota = OtaService(self)  # deploy/rollback/reboot on the operations thread (device/ota.py)
        self.training_service = TrainingService(self)  # taking part in rounds (device/training.py)
        self.inference = InferenceService(self, self.options.infer_queue)  # the infer topic (device/inference.py)
        self.telemetry = TelemetryService(  # the periodic report (device/telemetry.py)
            self, TelemetryCollector(battery_file=self.options.battery_file, battery_fn=battery_fn))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._bdseq_lock = threading.Lock()
        self._births = 0
        self.bdseq = -1
        self.boot_notes: list[str] = []
        self._started = False
        self._recovery: bytes | None = None
        self.counters: dict[str, int] = {"commands": 0, "refused": 0, "inferences": 0, "infer_refused": 0, "deploys": 0,
                                         "rollbacks": 0}

    def load_config(self) -> None:
        """The persisted ``set_config`` values over the given options (``train`` also from the
        ``training`` flag older agents persisted for train_start/train_stop)."""
        state = self.slots.state()
        saved = state.get("config") or {}
        for k, v in saved.items():
            if k in CONFIG_KEYS:
                setattr(self.options, k, v)
        if "train" not in saved and isinstance(state.get("training"), bool):
            self.options.train = state["training"]
        if self._owner_opted_out:
            self.options.train = False

    # ------------------------------------------------------------------ build

    @classmethod
    def from_credentials(
        cls,
        credentials: str | os.PathLike[str],
        *,
        broker: str | None = None,
        profile: str | DeviceProfile | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        options: AgentOptions | None = None,
        make_participant: ParticipantFactory | None = None,
        battery_fn: Callable[[], float | None] | None = None,
        **transport_options: Any,
    ) -> DeviceAgent:
        """Build the agent and its MQTT transport from a credentials directory (see :mod:`.credentials`)."""
        from ..transport.factory import transport_from_url
        from ..transport.url import parse_broker_url
        from .credentials import DeviceCredentials

        creds = DeviceCredentials.load(credentials)
        url = broker or creds.broker
        if not url:
            raise FleetError(f"no broker URL: pass --broker (the credentials in {creds.directory} name none)")
        prof = profile or creds.profile
        if prof is None:
            raise FleetError("no device profile: pass --profile NAME (see `edgeflow profile list`)")
        kwargs: dict[str, Any] = {"client_id": creds.device_id, "username": creds.username,
                                  "password": creds.password, "name": creds.device_id, **transport_options}
        if parse_broker_url(url).tls and "tls" not in kwargs:
            tls = creds.tls_config()
            if tls is not None:
                kwargs["tls"] = tls
        transport = transport_from_url(url, **kwargs)
        state = Path(state_dir) if state_dir else Path.home() / ".edgeflow" / "device" / creds.device_id
        return cls(transport, device_id=creds.device_id, fleet=creds.fleet, profile=prof, signer=creds.signer,
                   fleet_key=creds.fleet_key, state_dir=state, options=options,
                   make_participant=make_participant, battery_fn=battery_fn)

    # -------------------------------------------------------------- lifecycle

    def start(self, *, connect: bool = True, timeout: float | None = None) -> DeviceAgent:
        """Land on a verified model, subscribe, connect, report an interrupted operation."""
        if self._started:
            return self
        self._started = True
        self.transport.will = _SessionWill(self)
        self.boot_model()
        self._recovery = self.ota.recover_pending()
        self.transport.subscribe(self._topic["cmd"], self._on_cmd)
        self.transport.subscribe(self._topic["ota"], self.ota.on_offer)
        self.transport.subscribe(self._topic["infer"], self.inference.on_request)
        self.transport.add_connection_listener(self._on_connection)
        for name, target in (("ops", self.ota.loop), ("infer", self.inference.loop), ("telemetry", self.telemetry.loop)):
            t = threading.Thread(target=target, name=f"edgeflow-agent-{name}-{self.device_id}", daemon=True)
            t.start()
            self._threads.append(t)
        if self._recovery is not None:
            delivery = self.transport.publish(self._topic["cmd/ack"], self._recovery, qos=1)
            rid = str((self.slots.pending() or {}).get("id", ""))
            delivery.add_progress_callback(lambda d: d.succeeded and self.slots.clear_pending(expect_id=rid))
        self.training_service.sync()
        _AGENTS[self.device_id] = self
        _LAST[:] = [self]
        if connect:
            self.transport.connect(timeout)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Clean shutdown: stop training, publish a death (retained), disconnect.

        The transport stops reconnecting first: without a connection when the stop begins, or once
        the connection is lost during it (:meth:`_on_connection`), it is closed at once, so a board
        whose broker stops with it (``kill $(jobs -p)``) does not retry, and warn about, the
        connection while its participant and threads stop."""
        if self._stop.is_set():
            return
        self._stop.set()
        if not self.transport.is_connected:
            self.transport.close(timeout=timeout, flush=False)  # nothing to say goodbye to: no reconnects
        self.training_service.stop_participant()
        try:
            if self.transport.is_connected:
                death = Death(self.device_id, self.bdseq, "shutdown", time.time())
                self.transport.publish(self._topic["death"], death.sign(self.signer.key), qos=1, retain=True)
        except EdgeflowError as exc:
            log.debug("%s: death not published at stop: %s", self.device_id, exc)
        self._halt_threads(timeout)
        self.transport.close(timeout=timeout)

    def crash(self) -> None:
        """Vanish like a power cut: drop the TCP connection without DISCONNECT (the will fires)."""
        self._stop.set()
        self._halt_threads(1.0)
        self.transport.close(timeout=1.0, flush=False, abort=True)

    def _halt_threads(self, timeout: float) -> None:
        self.telemetry.wake()
        for q in (self.ota.queue, self.inference.queue):
            try:
                q.put_nowait(None)
            except queue.Full:
                pass
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)
        if _AGENTS.get(self.device_id) is self:
            del _AGENTS[self.device_id]
        if _LAST and _LAST[0] is self:
            _LAST.clear()

    def __enter__(self) -> DeviceAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --------------------------------------------------------------- the model

    @property
    def model_version(self) -> int | None:
        m = self._model
        return None if m is None else m.version

    @property
    def model_path(self) -> Path | None:
        m = self._model
        return None if m is None else m.model_path

    @property
    def active_model(self) -> ActiveModel | None:
        return self._model

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` (or :meth:`crash`) began: the services' threads end."""
        return self._stop.is_set()

    @property
    def started(self) -> bool:
        return self._started

    @property
    def owner_opted_out(self) -> bool:
        """The device's owner switched training off for good (``--no-train``): no command turns it on."""
        return self._owner_opted_out

    def topic(self, channel: str) -> str:
        """This device's topic for ``channel`` ("telemetry", "infer/reply", "cmd/ack", ...)."""
        return self._topic[channel]

    @property
    def participant(self) -> Participant | None:
        return self.training_service.participant

    @property
    def training(self) -> bool:
        """True while the participant takes part in rounds."""
        return self.train_status()[0] == "training"

    @property
    def train_model_path(self) -> Path | None:
        """The fp32 model the participant trains (see :meth:`TrainingService.model_path`)."""
        return self.training_service.model_path()

    def train_status(self) -> tuple[str, str]:
        """(state, detail): one of :data:`TRAIN_STATES` and, unless training, what is wrong and what to do."""
        return self.training_service.status()

    def runtime_for(self, m: ActiveModel) -> Any:
        o = self.options
        return load_runtime(m.model_path, self.profile, memory_budget_mb=o.memory_budget_mb, backend=o.backend,
                            threads=o.threads)

    def boot_model(self) -> None:
        loaded: dict[str, Any] = {}

        def usable(m: ActiveModel) -> None:
            loaded[m.slot] = self.runtime_for(m)

        model, notes = self.slots.boot(self.fleet_key, self.profile.name, usable=usable)
        self.boot_notes = notes
        for n in notes:
            log.warning("%s: %s", self.device_id, n)
        with self._rt_lock:
            self._model = model
            self._runtime = loaded.get(model.slot) if model is not None else None

    def switch_to_active(self) -> ActiveModel:
        """Verify and load the slot the pointer names; serve it."""
        slot = self.slots.pointer().active
        if slot is None:
            raise FleetError("no active model slot")
        m = self.slots.verify_slot(slot, self.fleet_key, self.profile.name)
        rt = self.runtime_for(m)
        with self._rt_lock:
            self._model, self._runtime = m, rt
        return m

    def predict(self, x: np.ndarray | Mapping[str, np.ndarray]) -> Any:
        """Run the deployed model: an array in -> the first output; a dict in -> a dict of outputs."""
        out = self.run_named(x)
        return next(iter(out.values())) if isinstance(x, np.ndarray) else out

    def run_named(self, x: np.ndarray | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the deployed model on one array (a single-input model) or a dict; every output by its name."""
        with self._rt_lock:
            rt, m = self._runtime, self._model
        if rt is None or m is None:
            raise FleetError(f"no model is deployed on device {self.device_id} yet; deploy one with "
                             "`edgeflow fleet deploy MODEL --to device=" + self.device_id + "`")
        t0 = time.perf_counter()
        try:
            with self._run_lock:
                out = rt.run(x if isinstance(x, np.ndarray) else dict(x))
        except Exception:
            self.telemetry.record(0.0, ok=False)
            raise
        self.telemetry.record((time.perf_counter() - t0) * 1000.0)
        self.counters["inferences"] += 1
        return dict(out)

    # ------------------------------------------------------------- publishing

    def _new_session(self) -> bytes:
        """Next ``bdseq`` (persisted before use) and the signed will for the connection about to be made."""
        with self._bdseq_lock:
            self.bdseq = self.slots.next_bdseq()
            self._births = 0
            return Death(self.device_id, self.bdseq, "lost").sign(self.signer.key)

    def birth(self, seq: int | None = None) -> Birth:
        m = self._model
        with self._rt_lock:
            backend = getattr(self._runtime, "backend_name", None)
        return Birth(
            device=self.device_id, fleet=self.fleet, profile=self.profile.name, bdseq=self.bdseq,
            public_key=self.signer.public_key.hex, model_version=None if m is None else m.version,
            model_sha256=None if m is None else m.sha256, backend=backend, versions=_versions(),
            telemetry_interval_s=float(self.options.telemetry_interval_s), can_train=self.profile.can_train,
            training=self.training, commands=list(COMMANDS), seq=self._births if seq is None else seq, ts=time.time(),
        )

    def publish_birth(self) -> None:
        """Announce (again): ``seq`` counts this session's births, so a replayed older one is recognisable."""
        self.telemetry.reset_seq()
        with self._bdseq_lock:
            self._births += 1
            birth = self.birth(self._births)
        code, detail = self.train_status()
        # train/train_detail ride in the signed body beside the Birth fields (gateways read them from there)
        body = {**birth.to_dict(), "train": code, **({"train_detail": detail} if detail else {})}
        self.transport.publish(self._topic["birth"], sign_body(body, self.signer.key, BIRTH_CONTEXT), qos=1,
                               retain=True)

    def _on_connection(self, event: ConnectionEvent) -> None:
        if self._stop.is_set():
            if not event.connected:
                # lost while stopping: no reconnect attempts (and warnings) while the stop finishes. Closed
                # from a thread of its own: this listener runs on the transport's worker, which close() joins.
                threading.Thread(target=self.transport.close, kwargs={"timeout": 1.0, "flush": False},
                                 name=f"edgeflow-agent-close-{self.device_id}", daemon=True).start()
            return
        if not event.connected:
            return
        # Clear the retained death of an earlier session, then announce this one.
        self.transport.publish(self._topic["death"], b"", qos=1, retain=True)
        self.publish_birth()
        self.telemetry.wake()  # the first telemetry (why this device trains or not) right away

    def telemetry_body(self) -> dict[str, Any]:
        """What the next telemetry report says (see :meth:`TelemetryService.body`)."""
        return self.telemetry.body()

    # ------------------------------------------------------------------- acks

    def _send_ack(self, ack: Ack, *, cache: bool = True) -> bytes:
        payload = ack.sign(self.signer.key)
        if cache and ack.id:
            try:
                self.seen.set_ack(ack.id, payload)
            except OSError as exc:  # a full disk must not cost the gateway its answer
                log.warning("%s: ack for %s not kept on disk: %s", self.device_id, ack.id, exc)
        try:
            self.transport.publish(self._topic["cmd/ack"], payload, qos=1)
        except EdgeflowError as exc:
            log.warning("%s: ack for %s not sent: %s", self.device_id, ack.id, exc)
        return payload

    def ack(self, cmd_id: str, name: str, *, ok: bool, code: str = "ok", error: str = "",
             result: dict[str, Any] | None = None, cache: bool = True, restarted: bool = False) -> None:
        if not ok:
            log.info("%s: command %s %s failed: %s (%s)", self.device_id, name, cmd_id, error, code)
        self._send_ack(Ack(cmd_id, name, self.device_id, ok, code, error, result or {}, time.time(), restarted),
                       cache=cache)

    def refuse(self, cmd_id: str, name: str, code: str, error: str) -> None:
        self.counters["refused"] += 1
        log.warning("%s: refused %s %s: %s", self.device_id, name or "message", cmd_id, error)
        self.ack(cmd_id, name, ok=False, code=code, error=error, cache=False)

    def _seen_again(self, cmd: Command) -> None:
        """A command id this device accepted before (a QoS 1 redelivery, or a replay, maybe across a restart)."""
        payload = self.seen.ack(cmd.id)
        if payload is not None:
            self.transport.publish(self._topic["cmd/ack"], payload, qos=1)  # the same answer, nothing runs again
        elif cmd.id not in self.ota.busy:
            self.refuse(cmd.id, cmd.name, "replayed", f"command {cmd.id} was already received (its result is no "
                         "longer kept); it does not run twice")

    def authenticate(self, data: bytes, *, expect: str | None = None) -> Command | None:
        """The verified, fresh, never-seen command (recorded on disk before it runs), or None after acking."""
        try:
            _, body = peek_signed(data)
        except CodecError as exc:
            cid, cname = _plain_id(data)  # an unsigned command still gets a refusal it can be matched with
            self.refuse(cid, cname, getattr(exc, "reason", "bad_message"), str(exc))
            return None
        cmd_id, name = str(body.get("id", ""))[:128], str(body.get("name", ""))[:64]
        try:
            cmd = Command.verify(data, self.fleet_key)
        except (SignatureError, CodecError) as exc:
            reason = getattr(exc, "reason", "bad_signature")
            self.refuse(cmd_id, name, reason, f"command refused: {exc}; only commands signed by the fleet key "
                         f"{self.fleet_key.key_id_hex} are obeyed")
            return None
        if cmd.device != self.device_id:
            self.refuse(cmd.id, cmd.name, "wrong_device", f"command is addressed to {cmd.device!r}, not to this device")
            return None
        if cmd.fleet != self.fleet:
            self.refuse(cmd.id, cmd.name, "wrong_device", f"command is for fleet {cmd.fleet!r}, not {self.fleet!r}")
            return None
        if cmd.id in self.seen:
            self._seen_again(cmd)
            return None
        if time.time() > cmd.expires + self.options.clock_skew_s:
            self.refuse(cmd.id, cmd.name, "expired",
                         f"command expired at {cmd.expires:.0f} (now {time.time():.0f}); check the device clock (NTP)")
            return None
        if self.seen.below_floor(cmd.issued):
            self.refuse(cmd.id, cmd.name, "stale", f"command issued at {cmd.issued:.0f} is older than the commands "
                         "this device still remembers; send a new one")
            return None
        if expect is not None and cmd.name != expect:
            self.refuse(cmd.id, cmd.name, "bad_message", f"only {expect!r} commands arrive on this topic")
            return None
        try:
            fresh = self.seen.remember(cmd.id, cmd.issued, cmd.expires)
        except OSError as exc:
            self.refuse(cmd.id, cmd.name, "failed", f"cannot record the command id on disk ({exc}); not run, "
                         "so that a replay could not run it again")
            return None
        if not fresh:
            self._seen_again(cmd)
            return None
        return cmd

    # --------------------------------------------------------------- commands

    def _on_cmd(self, msg: Message) -> None:
        if self._stop.is_set():
            return
        cmd = self.authenticate(msg.payload)
        if cmd is None:
            return
        self.counters["commands"] += 1
        lane, _ = self._COMMAND_TABLE.get(cmd.name, ("quick", ""))
        if lane == "ops":
            self.ota.enqueue(cmd, None, None)
            return
        self.run_command(cmd, self.handler(cmd.name))

    # name -> (lane, handler). "quick": runs on the transport's thread and acks at once; "ops": queued
    # behind deployments on the OTA service's thread (it swaps slots). deploy arrives as an OTA offer with
    # its artifact (``OtaService.on_offer``); a bare deploy command is refused. The protocol's COMMANDS lists the same
    # names (tests/unit/test_agent_commands.py checks both stay in step).
    _COMMAND_TABLE: dict[str, tuple[str, str]] = {
        "status": ("quick", "_cmd_status"),
        "set_config": ("quick", "_cmd_set_config"),
        "train_start": ("quick", "_cmd_train_start"),
        "train_stop": ("quick", "_cmd_train_stop"),
        "deploy": ("quick", "_cmd_bare_deploy"),
        "rollback": ("ops", "_cmd_rollback"),
        "reboot": ("ops", "_cmd_reboot"),
    }

    def handler(self, name: str) -> Callable[[Command], dict[str, Any] | None]:
        entry = self._COMMAND_TABLE.get(name)
        if entry is None:
            return self._cmd_unknown
        return getattr(self, entry[1])

    def _cmd_status(self, cmd: Command) -> dict[str, Any]:
        return self.status()

    def _cmd_set_config(self, cmd: Command) -> dict[str, Any]:
        return self.set_config(cmd.args)

    def _cmd_train_start(self, cmd: Command) -> dict[str, Any]:
        return self.training_service.start_training()

    def _cmd_train_stop(self, cmd: Command) -> dict[str, Any]:
        return self.training_service.stop_training()

    def _cmd_rollback(self, cmd: Command) -> dict[str, Any] | None:
        return self.ota.rollback(cmd)

    def _cmd_reboot(self, cmd: Command) -> dict[str, Any] | None:
        return self.ota.reboot(cmd)

    def _cmd_bare_deploy(self, cmd: Command) -> dict[str, Any]:
        raise CommandFailed("bad_message", "deploy travels with its artifact as an OTA offer on the device's ota "
                            "topic; use FleetManager.deploy / `edgeflow fleet deploy`")

    def _cmd_unknown(self, cmd: Command) -> dict[str, Any]:
        raise CommandFailed("unknown_command", f"unknown command {cmd.name!r}; this agent understands "
                            f"{', '.join(COMMANDS)}")

    def run_command(self, cmd: Command, fn: Callable[[Command], dict[str, Any] | None]) -> None:
        """Run ``fn`` and ack its result; ``fn`` returns None when it acked itself."""
        try:
            result = fn(cmd)
        except CommandFailed as exc:
            self.ack(cmd.id, cmd.name, ok=False, code=exc.code, error=str(exc), result=exc.result)
            return
        except EdgeflowError as exc:
            self.ack(cmd.id, cmd.name, ok=False, code="failed", error=str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bug must still answer the gateway
            log.exception("%s: command %s crashed", self.device_id, cmd.name)
            self.ack(cmd.id, cmd.name, ok=False, code="failed", error=f"{type(exc).__name__}: {exc}")
            return
        if result is not None:
            self.ack(cmd.id, cmd.name, ok=True, result=result)

    def status(self) -> dict[str, Any]:
        m = self._model
        p = self.slots.pointer()
        out: dict[str, Any] = {
            "device": self.device_id, "profile": self.profile.name, "model_version": None if m is None else m.version,
            "model_sha256": None if m is None else m.sha256, "slot": p.active, "previous_slot": p.previous,
            "training": self.training, "train": dict(zip(("state", "detail"), self.train_status())),
            "config": self.config(), "bdseq": self.bdseq, "counters": dict(self.counters),
            "queue_depth": self.inference.queue.qsize(), "boot_notes": list(self.boot_notes),
        }
        if p.previous is not None:
            data = self.slots.read_artifact(p.previous)
            if data is not None:
                try:
                    out["previous_version"] = verify_artifact(data, self.fleet_key).version
                except EdgeflowError:
                    out["previous_version"] = None
        part = self.participant
        if part is not None:
            try:
                out["participant"] = part.status()
            except Exception as exc:  # noqa: BLE001
                log.warning("participant status failed: %s: %s", type(exc).__name__, exc)
                out["participant"] = {"error": str(exc)}
        return out

    def config(self) -> dict[str, Any]:
        return {k: getattr(self.options, k) for k in CONFIG_KEYS}

    def set_config(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Apply and persist ``set_config`` values; CommandFailed names a bad key or value."""
        if not args:
            raise CommandFailed("bad_args", f"set_config needs at least one of {', '.join(CONFIG_KEYS)}")
        unknown = sorted(set(args) - set(CONFIG_KEYS))
        if unknown:
            raise CommandFailed("bad_args", f"unknown config key(s) {', '.join(unknown)}; settable: "
                                f"{', '.join(CONFIG_KEYS)}")
        parsed = {}
        for k, v in args.items():
            try:
                parsed[k] = CONFIG_KEYS[k](v)
            except (TypeError, ValueError) as exc:
                raise CommandFailed("bad_args", f"bad value {v!r} for {k}: {exc}") from None
        if parsed.get("train") and self._owner_opted_out:
            raise CommandFailed("not_supported", "this device was started with --no-train: its owner opted out of "
                                "federated rounds (only a restart without --no-train changes that)")
        for k, v in parsed.items():
            setattr(self.options, k, v)
        if "battery_file" in parsed:
            self.telemetry.battery_file = parsed["battery_file"]
        persisted = dict(self.slots.state().get("config") or {})
        persisted.update(parsed)
        self.slots.save_state(config=persisted)
        if "telemetry_interval_s" in parsed:
            self.telemetry.wake()
        if "train" in parsed:
            self.training_service.sync(announce=False)
        if self.transport.is_connected:
            self.publish_birth()
        return {"config": self.config(), "changed": sorted(parsed),
                "note": "memory_budget_mb, backend and threads apply from the next model load (deploy, rollback, reboot)"}
