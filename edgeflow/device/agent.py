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

Threads: message handlers run on the transport's worker thread and only do
quick work; deploy/rollback/reboot run one at a time on the agent's
operations thread, MQTT inference requests on its inference thread (a
bounded queue: "busy" replies instead of unbounded memory), telemetry on its
own timer thread.

OTA and power cuts: see :mod:`edgeflow.device.slots` for the argument. The
journal ``pending.json`` is written before the first byte is staged and
removed after the ack, so an agent restarted mid-deploy acknowledges the
interrupted command with what it actually runs now (``restarted: true``).
Each step is an ``ota.<step>`` fault point of :mod:`edgeflow.faults`: crash tests
(``EDGEFLOW_FAULTS=ota.staged``) make the process die right after it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import CodecError, EdgeflowError, FleetError, SignatureError
from ..faults import fault_point
from ..artifact import Artifact, verify_artifact
from ..profiles import BACKENDS, DeviceProfile, get_profile
from ..protocol.fleet import BIRTH_CONTEXT, COMMANDS, Ack, Birth, Command, Death
from ..protocol.ota import OtaOffer
from ..protocol.signed_json import loads, peek_signed, sign_body
from ..signing import PublicKey, Signer
from ..transport.base import Transport
from ..transport.message import ConnectionEvent, Message
from ..transport.topics import device_topic
from .health import HealthReport, check_model, load_runtime
from .inference import InferenceService
from .replay import SeenCommands
from .slots import ActiveModel, SlotStore
from .telemetry import TelemetryCollector

__all__ = ["AgentOptions", "DeviceAgent", "Participant", "ParticipantFactory"]

log = logging.getLogger("edgeflow.device")



@runtime_checkable
class Participant(Protocol):
    """What the agent needs from a federated-learning client (``edgeflow.federated.Client``)."""

    def start(self) -> Any: ...

    def stop(self) -> Any: ...

    def status(self) -> dict[str, Any]: ...


ParticipantFactory = Callable[["DeviceAgent"], Participant]
"""``make_participant(agent)``: build a participant for the agent's current model
(``agent.model_path``, ``agent.transport``, ``agent.signer``...). Called again after every
model change, since a participant trains one model."""


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

TRAIN_STATES = ("training", "off", "profile", "no_data", "no_model", "quantized", "untrainable", "model_mismatch")
"""Why a device does (``training``) or does not take part in rounds; sent in telemetry as ``train`` with
``train_detail`` (one line: what is wrong and what to do), shown by ``edgeflow fleet status``."""


class CommandFailed(FleetError):
    """Raised inside a command handler: becomes an ack with ``code`` and the message."""

    def __init__(self, code: str, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.result = result or {}


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
        self.topic = agent._topic["death"]

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
        self._load_config()
        self.make_participant = make_participant
        self.telemetry = TelemetryCollector(battery_file=self.options.battery_file, battery_fn=battery_fn)
        self._topic = {ch: device_topic(fleet, device_id, ch).value
                       for ch in ("birth", "death", "telemetry", "cmd", "cmd/ack", "ota", "infer", "infer/reply")}
        self._model: ActiveModel | None = None
        self._runtime: Any = None
        self._rt_lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._participant: Participant | None = None
        self._train_lock = threading.RLock()
        self._train_state: tuple[str, str] = ("", "")
        self.seen = SeenCommands(self.slots.root / "seen.json", clock_skew_s=self.options.clock_skew_s)
        self._ops: queue.Queue[Any] = queue.Queue(maxsize=4)
        self._ops_busy: set[str] = set()
        self.inference = InferenceService(self, self.options.infer_queue)  # the infer topic (device/inference.py)
        self._stop = threading.Event()
        self._tele_wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._bdseq_lock = threading.Lock()
        self._births = 0
        self.bdseq = -1
        self.boot_notes: list[str] = []
        self._started = False
        self._recovery: bytes | None = None
        self.counters: dict[str, int] = {"commands": 0, "refused": 0, "inferences": 0, "deploys": 0, "rollbacks": 0}

    def _load_config(self) -> None:
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
        from ..transport.mqtt import MqttTransport
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
        transport = MqttTransport.from_url(url, **kwargs)
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
        self._boot_model()
        self._recovery = self._recover_pending()
        self.transport.subscribe(self._topic["cmd"], self._on_cmd)
        self.transport.subscribe(self._topic["ota"], self._on_ota)
        self.transport.subscribe(self._topic["infer"], self.inference.on_request)
        self.transport.add_connection_listener(self._on_connection)
        for name, target in (("ops", self._ops_loop), ("infer", self.inference.loop), ("telemetry", self._telemetry_loop)):
            t = threading.Thread(target=target, name=f"edgeflow-agent-{name}-{self.device_id}", daemon=True)
            t.start()
            self._threads.append(t)
        if self._recovery is not None:
            delivery = self.transport.publish(self._topic["cmd/ack"], self._recovery, qos=1)
            rid = str((self.slots.pending() or {}).get("id", ""))
            delivery.add_progress_callback(lambda d: d.succeeded and self.slots.clear_pending(expect_id=rid))
        self._sync_training()
        _AGENTS[self.device_id] = self
        _LAST[:] = [self]
        if connect:
            self.transport.connect(timeout)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Clean shutdown: stop training, publish a death (retained), disconnect."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._stop_participant()
        try:
            if self.transport.is_connected:
                death = Death(self.device_id, self.bdseq, "shutdown", time.time())
                self.transport.publish(self._topic["death"], death.sign(self.signer.key), qos=1, retain=True)
        except EdgeflowError:
            pass
        self._halt_threads(timeout)
        self.transport.close(timeout=timeout)

    def crash(self) -> None:
        """Vanish like a power cut: drop the TCP connection without DISCONNECT (the will fires)."""
        self._stop.set()
        self._halt_threads(1.0)
        self.transport.close(timeout=1.0, flush=False, abort=True)

    def _halt_threads(self, timeout: float) -> None:
        self._tele_wake.set()
        for q in (self._ops, self.inference.queue):
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
    def participant(self) -> Participant | None:
        return self._participant

    @property
    def training(self) -> bool:
        """True while the participant takes part in rounds."""
        return self.train_status()[0] == "training"

    @property
    def train_model_path(self) -> Path | None:
        """The fp32 model the participant trains: the deployed model itself, or, when the deployed model is
        quantized (manifest ``precision`` other than fp32), the fp32 master that came with it (None if none did)."""
        m = self._model
        if m is None:
            return None
        meta = m.artifact.manifest.meta or {}
        if str(meta.get("precision", "fp32")) == "fp32":
            return m.model_path
        source = meta.get("source_sha256")
        if not isinstance(source, str):
            return None
        return self.slots.master_model(source, self.fleet_key, self.profile.name)

    def train_status(self) -> tuple[str, str]:
        """(state, detail): one of :data:`TRAIN_STATES` and, unless training, what is wrong and what to do."""
        code, detail = self._train_state
        p = self._participant
        if code == "training" and p is not None:
            try:
                st = p.status()
            except Exception:  # noqa: BLE001 - a participant's status must not break the agent
                log.warning("participant status failed; the training state is reported without it", exc_info=True)
                st = {}
            if st.get("state") == "model_mismatch":
                return "model_mismatch", str(st.get("detail", "the gateway's model does not fit the deployed one"))
        return code or "off", detail

    def _load(self, m: ActiveModel) -> Any:
        o = self.options
        return load_runtime(m.model_path, self.profile, memory_budget_mb=o.memory_budget_mb, backend=o.backend,
                            threads=o.threads)

    def _boot_model(self) -> None:
        loaded: dict[str, Any] = {}

        def usable(m: ActiveModel) -> None:
            loaded[m.slot] = self._load(m)

        model, notes = self.slots.boot(self.fleet_key, self.profile.name, usable=usable)
        self.boot_notes = notes
        for n in notes:
            log.warning("%s: %s", self.device_id, n)
        with self._rt_lock:
            self._model = model
            self._runtime = loaded.get(model.slot) if model is not None else None

    def _switch_to_active(self) -> ActiveModel:
        """Verify and load the slot the pointer names; serve it."""
        slot = self.slots.pointer().active
        if slot is None:
            raise FleetError("no active model slot")
        m = self.slots.verify_slot(slot, self.fleet_key, self.profile.name)
        rt = self._load(m)
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

    def _next_seq(self) -> int:
        with self._seq_lock:
            self._seq += 1
            return self._seq

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
        with self._seq_lock:
            self._seq = 0
        with self._bdseq_lock:
            self._births += 1
            birth = self.birth(self._births)
        code, detail = self.train_status()
        # train/train_detail ride in the signed body beside the Birth fields (gateways read them from there)
        body = {**birth.to_dict(), "train": code, **({"train_detail": detail} if detail else {})}
        self.transport.publish(self._topic["birth"], sign_body(body, self.signer.key, BIRTH_CONTEXT), qos=1,
                               retain=True)

    def _on_connection(self, event: ConnectionEvent) -> None:
        if not event.connected or self._stop.is_set():
            return
        # Clear the retained death of an earlier session, then announce this one.
        self.transport.publish(self._topic["death"], b"", qos=1, retain=True)
        self.publish_birth()
        self._tele_wake.set()  # the first telemetry (why this device trains or not) right away

    def telemetry_body(self) -> dict[str, Any]:
        code, detail = self.train_status()
        body = {"device": self.device_id, "ts": time.time(), "seq": self._next_seq(), "bdseq": self.bdseq,
                "model_version": self.model_version, "training": code == "training", "train": code,
                **({"train_detail": detail} if detail else {}),
                **self.telemetry.snapshot(queue_depth=self.inference.queue.qsize() + self._ops.qsize())}
        p = self._participant
        if p is not None:
            try:
                st = p.status()
                part = {k: st[k] for k in ("rounds_trained", "last_round", "last_loss") if k in st}
                errors = st.get("errors") or []
                if errors:
                    part["last_error"] = str(errors[-1])
                body["participant"] = part
            except Exception:  # noqa: BLE001 - telemetry must not die with the participant
                log.debug("participant status failed; telemetry goes out without it", exc_info=True)
        return body

    def _telemetry_loop(self) -> None:
        while not self._stop.is_set():
            self._tele_wake.wait(max(0.05, float(self.options.telemetry_interval_s)))
            self._tele_wake.clear()
            if self._stop.is_set():
                return
            if not self.transport.is_connected:
                continue
            try:
                data = json.dumps(self.telemetry_body(), separators=(",", ":")).encode("utf-8")
                self.transport.publish(self._topic["telemetry"], data, qos=int(self.options.telemetry_qos))
            except EdgeflowError as exc:
                log.debug("%s: telemetry not sent: %s", self.device_id, exc)

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

    def _ack(self, cmd_id: str, name: str, *, ok: bool, code: str = "ok", error: str = "",
             result: dict[str, Any] | None = None, cache: bool = True, restarted: bool = False) -> None:
        if not ok:
            log.info("%s: command %s %s failed: %s (%s)", self.device_id, name, cmd_id, error, code)
        self._send_ack(Ack(cmd_id, name, self.device_id, ok, code, error, result or {}, time.time(), restarted),
                       cache=cache)

    def _refuse(self, cmd_id: str, name: str, code: str, error: str) -> None:
        self.counters["refused"] += 1
        log.warning("%s: refused %s %s: %s", self.device_id, name or "message", cmd_id, error)
        self._ack(cmd_id, name, ok=False, code=code, error=error, cache=False)

    def _seen_again(self, cmd: Command) -> None:
        """A command id this device accepted before (a QoS 1 redelivery, or a replay, maybe across a restart)."""
        payload = self.seen.ack(cmd.id)
        if payload is not None:
            self.transport.publish(self._topic["cmd/ack"], payload, qos=1)  # the same answer, nothing runs again
        elif cmd.id not in self._ops_busy:
            self._refuse(cmd.id, cmd.name, "replayed", f"command {cmd.id} was already received (its result is no "
                         "longer kept); it does not run twice")

    def _authenticate(self, data: bytes, *, expect: str | None = None) -> Command | None:
        """The verified, fresh, never-seen command (recorded on disk before it runs), or None after acking."""
        try:
            _, body = peek_signed(data)
        except CodecError as exc:
            cid, cname = _plain_id(data)  # an unsigned command still gets a refusal it can be matched with
            self._refuse(cid, cname, getattr(exc, "reason", "bad_message"), str(exc))
            return None
        cmd_id, name = str(body.get("id", ""))[:128], str(body.get("name", ""))[:64]
        try:
            cmd = Command.verify(data, self.fleet_key)
        except (SignatureError, CodecError) as exc:
            reason = getattr(exc, "reason", "bad_signature")
            self._refuse(cmd_id, name, reason, f"command refused: {exc}; only commands signed by the fleet key "
                         f"{self.fleet_key.key_id_hex} are obeyed")
            return None
        if cmd.device != self.device_id:
            self._refuse(cmd.id, cmd.name, "wrong_device", f"command is addressed to {cmd.device!r}, not to this device")
            return None
        if cmd.fleet != self.fleet:
            self._refuse(cmd.id, cmd.name, "wrong_device", f"command is for fleet {cmd.fleet!r}, not {self.fleet!r}")
            return None
        if cmd.id in self.seen:
            self._seen_again(cmd)
            return None
        if time.time() > cmd.expires + self.options.clock_skew_s:
            self._refuse(cmd.id, cmd.name, "expired",
                         f"command expired at {cmd.expires:.0f} (now {time.time():.0f}); check the device clock (NTP)")
            return None
        if self.seen.below_floor(cmd.issued):
            self._refuse(cmd.id, cmd.name, "stale", f"command issued at {cmd.issued:.0f} is older than the commands "
                         "this device still remembers; send a new one")
            return None
        if expect is not None and cmd.name != expect:
            self._refuse(cmd.id, cmd.name, "bad_message", f"only {expect!r} commands arrive on this topic")
            return None
        try:
            fresh = self.seen.remember(cmd.id, cmd.issued, cmd.expires)
        except OSError as exc:
            self._refuse(cmd.id, cmd.name, "failed", f"cannot record the command id on disk ({exc}); not run, "
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
        cmd = self._authenticate(msg.payload)
        if cmd is None:
            return
        self.counters["commands"] += 1
        lane, _ = self._COMMAND_TABLE.get(cmd.name, ("quick", ""))
        if lane == "ops":
            self._enqueue_op(cmd, None, None)
            return
        self._run_command(cmd, self._handler(cmd.name))

    # name -> (lane, handler). "quick": runs on the transport's thread and acks at once; "ops": queued
    # behind deployments on the ops thread (it swaps slots). deploy arrives as an OTA offer with its
    # artifact (``_on_ota``); a bare deploy command is refused. The protocol's COMMANDS lists the same
    # names (tests/unit/test_agent_commands.py checks both stay in step).
    _COMMAND_TABLE: dict[str, tuple[str, str]] = {
        "status": ("quick", "_cmd_status"),
        "set_config": ("quick", "_cmd_set_config"),
        "train_start": ("quick", "_cmd_train_start"),
        "train_stop": ("quick", "_cmd_train_stop"),
        "deploy": ("quick", "_cmd_bare_deploy"),
        "rollback": ("ops", "_rollback"),
        "reboot": ("ops", "_reboot"),
    }

    def _handler(self, name: str) -> Callable[[Command], dict[str, Any] | None]:
        entry = self._COMMAND_TABLE.get(name)
        if entry is None:
            return self._cmd_unknown
        return getattr(self, entry[1])

    def _cmd_status(self, cmd: Command) -> dict[str, Any]:
        return self.status()

    def _cmd_set_config(self, cmd: Command) -> dict[str, Any]:
        return self._set_config(cmd.args)

    def _cmd_train_start(self, cmd: Command) -> dict[str, Any]:
        return self._start_training()

    def _cmd_train_stop(self, cmd: Command) -> dict[str, Any]:
        return self._stop_training()

    def _cmd_bare_deploy(self, cmd: Command) -> dict[str, Any]:
        raise CommandFailed("bad_message", "deploy travels with its artifact as an OTA offer on the device's ota "
                            "topic; use FleetManager.deploy / `edgeflow fleet deploy`")

    def _cmd_unknown(self, cmd: Command) -> dict[str, Any]:
        raise CommandFailed("unknown_command", f"unknown command {cmd.name!r}; this agent understands "
                            f"{', '.join(COMMANDS)}")

    def _run_command(self, cmd: Command, fn: Callable[[Command], dict[str, Any] | None]) -> None:
        """Run ``fn`` and ack its result; ``fn`` returns None when it acked itself."""
        try:
            result = fn(cmd)
        except CommandFailed as exc:
            self._ack(cmd.id, cmd.name, ok=False, code=exc.code, error=str(exc), result=exc.result)
            return
        except EdgeflowError as exc:
            self._ack(cmd.id, cmd.name, ok=False, code="failed", error=str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bug must still answer the gateway
            log.exception("%s: command %s crashed", self.device_id, cmd.name)
            self._ack(cmd.id, cmd.name, ok=False, code="failed", error=f"{type(exc).__name__}: {exc}")
            return
        if result is not None:
            self._ack(cmd.id, cmd.name, ok=True, result=result)

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
        part = self._participant
        if part is not None:
            try:
                out["participant"] = part.status()
            except Exception as exc:  # noqa: BLE001
                log.warning("participant status failed: %s: %s", type(exc).__name__, exc)
                out["participant"] = {"error": str(exc)}
        return out

    def config(self) -> dict[str, Any]:
        return {k: getattr(self.options, k) for k in CONFIG_KEYS}

    def _set_config(self, args: Mapping[str, Any]) -> dict[str, Any]:
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
            self._tele_wake.set()
        if "train" in parsed:
            self._sync_training(announce=False)
        if self.transport.is_connected:
            self.publish_birth()
        return {"config": self.config(), "changed": sorted(parsed),
                "note": "memory_budget_mb, backend and threads apply from the next model load (deploy, rollback, reboot)"}

    # -- training --
    def _train_blocker(self) -> tuple[str, str] | None:
        """Why this device cannot take part in rounds now, or None."""
        if self._owner_opted_out:
            return "off", "this device was started with --no-train: its owner opted out of federated rounds"
        if not self.options.train:
            return "off", ("training is switched off on this device (train_stop or set_config train=false); "
                           f"`edgeflow fleet cmd {self.device_id} train_start` switches it on")
        if not self.profile.can_train:
            return "profile", f"profile {self.profile.name} cannot train (can_train = false in its profile)"
        if self.make_participant is None:
            return "no_data", ("this agent has no training participant: no training data (start `edgeflow device` "
                               "with --train-data x_y.npz holding arrays x and y)")
        m = self._model
        if m is None:
            return "no_model", "no model is deployed yet; deploy one (`edgeflow fleet deploy MODEL --to ...`)"
        if self.train_model_path is None:
            precision = (m.artifact.manifest.meta or {}).get("precision", "?")
            return "quantized", (f"v{m.version} is quantized ({precision}) and no fp32 master came with it, so it "
                                 "cannot train; deploy with `edgeflow fleet deploy --quantize` (it sends the master) "
                                 "or deploy the fp32 model")
        return None

    def _sync_training(self, *, restart: bool = False, announce: bool = True) -> tuple[str, str]:
        """Run the participant exactly when this device can and should train; record why not otherwise.

        ``restart`` makes a new participant (the model changed). When the state changes and
        ``announce``, the birth (``training``) and a telemetry message (``train``, ``train_detail``) go out
        at once, so the gateway knows before it selects the next round's devices."""
        with self._train_lock:
            if restart:
                self._stop_participant()
            blocker = self._train_blocker()
            if blocker is not None:
                self._stop_participant()
                state = blocker
            else:
                state = ("training", "")
                if self._participant is None:
                    try:
                        p = self.make_participant(self)  # type: ignore[misc]
                        if hasattr(p, "on_state_change"):
                            p.on_state_change = self._participant_changed
                        p.start()
                        self._participant = p
                    except Exception as exc:  # noqa: BLE001 - any failure to build a trainer is "untrainable", said once
                        log.debug("participant for v%s not built", self.model_version, exc_info=True)
                        v = self.model_version
                        state = ("untrainable", f"v{v} cannot be trained here: {type(exc).__name__}: {exc}")
            changed = state != self._train_state
            self._train_state = state
        if changed:
            if state[0] == "training":
                log.info("%s: taking part in federated rounds on v%s", self.device_id, self.model_version)
            else:  # a choice or a board's nature is info; a model that should train and does not is a warning
                level = logging.WARNING if state[0] in ("quantized", "untrainable") else logging.INFO
                log.log(level, "%s: not taking part in federated rounds: %s", self.device_id, state[1])
            if announce and self._started and self.transport.is_connected:
                try:
                    self.publish_birth()
                except EdgeflowError as exc:
                    log.debug("%s: birth not re-announced: %s", self.device_id, exc)
                self._tele_wake.set()
        return state

    def _participant_changed(self) -> None:
        """The participant's own state changed (e.g. the gateway's model does not fit; it logged why): tell the
        gateway now."""
        if self._started and not self._stop.is_set() and self.transport.is_connected:
            try:
                self.publish_birth()
            except EdgeflowError:
                pass
            self._tele_wake.set()

    def _stop_participant(self) -> None:
        p, self._participant = self._participant, None
        if p is not None:
            try:
                p.stop()
            except Exception:  # noqa: BLE001 - stopping is best effort
                log.exception("%s: participant failed to stop", self.device_id)

    _START_CODES = {"profile": "not_supported", "no_data": "not_supported", "no_model": "no_model",
                    "quantized": "not_supported", "untrainable": "failed"}

    def _start_training(self) -> dict[str, Any]:
        if self._owner_opted_out:
            raise CommandFailed("not_supported", self._train_blocker()[1])  # type: ignore[index]
        was = self.options.train
        self.options.train = True
        code, detail = self._sync_training()
        if code != "training":
            self.options.train = was
            self._sync_training()
            raise CommandFailed(self._START_CODES.get(code, "failed"), detail)
        self._persist_train(True)
        return {"training": True, "model_version": self.model_version}

    def _stop_training(self) -> dict[str, Any]:
        was = self.training
        self.options.train = False
        self._persist_train(False)
        self._sync_training()
        return {"training": False, "was_training": was}

    def _persist_train(self, on: bool) -> None:
        persisted = dict(self.slots.state().get("config") or {})
        persisted["train"] = on
        self.slots.save_state(config=persisted, training=on)

    def _restart_participant(self) -> None:
        self._sync_training(restart=True)

    # ------------------------------------------------------------ operations

    def _enqueue_op(self, cmd: Command, data: bytes | None, art: Artifact | None) -> None:
        if cmd.id in self._ops_busy:
            return  # already queued (a redelivery); its ack will come
        try:
            self._ops.put_nowait((cmd, data, art))
        except queue.Full:
            self._ack(cmd.id, cmd.name, ok=False, code="busy", cache=False,
                      error="the device is busy with other deployments; retry later")
            return
        self._ops_busy.add(cmd.id)

    def _ops_loop(self) -> None:
        while not self._stop.is_set():
            item = self._ops.get()
            if item is None or self._stop.is_set():
                return
            cmd, data, art = item
            try:
                if cmd.name == "deploy":  # an OTA offer, with its artifact
                    self._run_command(cmd, lambda c: self._deploy(c, data, art))
                else:
                    self._run_command(cmd, self._handler(cmd.name))
            finally:
                self._ops_busy.discard(cmd.id)

    def _hook(self, step: str) -> None:
        fault_point(f"ota.{step}")

    def _on_ota(self, msg: Message) -> None:
        if self._stop.is_set():
            return
        try:
            offer = OtaOffer.from_bytes(msg.payload)
        except CodecError as exc:
            self._refuse("", "deploy", "bad_message", str(exc))
            return
        cmd = self._authenticate(offer.command, expect="deploy")
        if cmd is None:
            return
        self.counters["commands"] += 1
        want = str(cmd.args.get("artifact_sha256", ""))
        if hashlib.sha256(offer.artifact).hexdigest() != want:
            self._refuse(cmd.id, cmd.name, "bad_artifact",
                         "the artifact does not match the SHA-256 the signed deploy command names")
            return
        try:
            art = verify_artifact(offer.artifact, self.fleet_key, profile=self.profile.name, fleet=self.fleet)
        except (SignatureError, FleetError) as exc:
            self._refuse(cmd.id, cmd.name, getattr(exc, "reason", "bad_artifact"), f"artifact refused: {exc}")
            return
        self._enqueue_op(cmd, offer.artifact, art)

    def _needed_masters(self) -> set[str]:
        """The fp32 masters the active and the rollback model train on."""
        out: set[str] = set()
        p = self.slots.pointer()
        for slot in (p.active, p.previous):
            data = None if slot is None else self.slots.read_artifact(slot)
            if data is None:
                continue
            try:
                meta = verify_artifact(data, self.fleet_key).manifest.meta or {}
            except EdgeflowError:
                continue
            if str(meta.get("precision", "fp32")) != "fp32" and isinstance(meta.get("source_sha256"), str):
                out.add(meta["source_sha256"])
        return out

    def _store_master(self, art: Artifact, data: bytes) -> dict[str, Any]:
        """Keep the fp32 master of a quantized model (sent just before it): what the participant trains."""
        meta = art.manifest.meta or {}
        if meta.get("role") != "train_master" or str(meta.get("precision", "fp32")) != "fp32":
            raise CommandFailed("bad_artifact", "a training master must be an fp32 artifact built as one "
                                "(manifest meta role = train_master); build it with edgeflow.gateway.ota.build_artifacts")
        try:
            self.slots.store_master(data, art)
        except OSError as exc:
            raise CommandFailed("failed", f"the fp32 master of v{art.version} could not be written ({exc})") from None
        self.slots.prune_masters(self._needed_masters() | {art.manifest.sha256})
        self._sync_training()  # a quantized model that waited for its master trains now
        return {"train_master": art.manifest.sha256, "version": art.version, "model_version": self.model_version}

    def _deploy(self, cmd: Command, data: bytes, art: Artifact) -> dict[str, Any] | None:
        if cmd.args.get("role") == "train_master":
            return self._store_master(art, data)
        self.counters["deploys"] += 1
        cur = self._model
        old_version = None if cur is None else cur.version
        if cur is not None and cur.sha256 == art.manifest.sha256 and cur.version == art.version:
            return {"model_version": cur.version, "unchanged": True}
        self._check_fresh(cmd, old_version)
        if cur is not None and art.version < cur.version and cmd.args.get("allow_downgrade") is not True:
            raise CommandFailed("downgrade", f"v{art.version} is older than the running v{cur.version}: a downgrade "
                                "needs a signed rollback or a deploy that allows it (`fleet deploy --allow-downgrade`)",
                                {"model_version": cur.version, "version": art.version})
        self.slots.set_pending({"id": cmd.id, "name": "deploy", "version": art.version,
                                "sha256": art.manifest.sha256, "from_version": old_version, "ts": time.time(),
                                "issued": cmd.issued, "expires": cmd.expires})
        self._hook("received")
        slot = self.slots.stage(data, art.model, hook=self._hook)
        report: HealthReport = check_model(
            self.slots.slot_dir(slot) / "model.onnx", self.profile, art.golden(),
            memory_budget_mb=self.options.memory_budget_mb, backend=self.options.backend,
            threads=self.options.threads, runs=self.options.health_runs,
        )
        self._hook("checked")
        if not report.ok:
            self.slots.clear_pending()
            raise CommandFailed(
                "health_check_failed", f"v{art.version} failed its health check ({report.stage}): {report.reason}; "
                f"staying on v{old_version}",
                {"model_version": old_version, "version": art.version, "rolled_back": True,
                 "health": report.to_dict()},
            )
        self.slots.activate(slot)
        self.slots.save_state(installed_issued=cmd.issued)
        self._hook("swapped")
        try:
            m = self._switch_to_active()
        except EdgeflowError as exc:
            self.slots.rollback()
            if cur is not None:
                self._switch_to_active()
            self.slots.clear_pending()
            raise CommandFailed("failed", f"v{art.version} passed its health check but did not load for serving "
                                f"({exc}); rolled back to v{old_version}",
                                {"model_version": old_version, "rolled_back": True}) from exc
        self._hook("loaded")
        self.slots.prune_masters(self._needed_masters())
        self._restart_participant()
        return self._finish_op(cmd, {"model_version": m.version, "previous_version": old_version, "slot": slot,
                                     "health": report.to_dict()})

    def _finish_op(self, cmd: Command, result: dict[str, Any]) -> None:
        """Ack, then forget the journal, then re-announce: a crash in between repeats the ack, never loses it."""
        self._ack(cmd.id, cmd.name, ok=True, result=result)
        self.slots.clear_pending()
        if self.transport.is_connected:
            self.publish_birth()

    def _check_fresh(self, cmd: Command, running: int | None) -> None:
        """Refuse a deploy or rollback issued before the running model was installed (both times are the
        gateway's clock): it was meant for an earlier state, e.g. a captured rollback replayed later."""
        installed = self.slots.state().get("installed_issued")
        if isinstance(installed, (int, float)) and cmd.issued < float(installed):
            raise CommandFailed("stale", f"{cmd.name} issued at {cmd.issued:.0f} predates the installation of the "
                                f"running v{running} (issued at {float(installed):.0f}); send a new command",
                                {"model_version": running})

    def _rollback(self, cmd: Command) -> dict[str, Any] | None:
        self.counters["rollbacks"] += 1
        cur = self._model
        cur_version = None if cur is None else cur.version
        self._check_fresh(cmd, cur_version)
        want_from = cmd.args.get("from_version")
        if want_from is not None and cur_version != int(want_from):
            return {"model_version": cur_version, "unchanged": True,
                    "note": f"not running v{want_from}: nothing to roll back"}
        p = self.slots.pointer()
        if p.previous is None:
            raise CommandFailed("no_model", "no previous model on this device to roll back to",
                                {"model_version": cur_version})
        try:
            prev = self.slots.verify_slot(p.previous, self.fleet_key, self.profile.name)
            self._load(prev)
        except EdgeflowError as exc:
            raise CommandFailed("failed", f"the previous model does not verify or load ({exc}); staying on "
                                f"v{cur_version}", {"model_version": cur_version}) from exc
        self.slots.set_pending({"id": cmd.id, "name": "rollback", "version": prev.version,
                                "sha256": prev.sha256, "from_version": cur_version, "ts": time.time(),
                                "issued": cmd.issued, "expires": cmd.expires})
        self.slots.rollback()
        self.slots.save_state(installed_issued=cmd.issued)
        m = self._switch_to_active()
        self._restart_participant()
        return self._finish_op(cmd, {"model_version": m.version, "previous_version": cur_version})

    def _reboot(self, cmd: Command) -> dict[str, Any] | None:
        """Restart the runtime: re-read config, re-verify and reload the model, restart training, re-announce."""
        self._load_config()
        with self._train_lock:
            self._stop_participant()
        self._boot_model()
        self._sync_training(restart=True)
        return self._finish_op(cmd, {"model_version": self.model_version, "notes": list(self.boot_notes)})

    def _recover_pending(self) -> bytes | None:
        """The signed ack for an operation a crash interrupted (sent after connect), or None."""
        pending = self.slots.pending()
        if not pending or not pending.get("id"):
            if pending:
                self.slots.clear_pending()
            return None
        m = self._model
        now = None if m is None else m.version
        done = m is not None and m.version == pending.get("version") and m.sha256 == pending.get("sha256")
        name = str(pending.get("name", "deploy"))
        if done:
            ack = Ack(str(pending["id"]), name, self.device_id, True, "ok", "",
                      {"model_version": now, "previous_version": pending.get("from_version")}, time.time(), True)
        else:
            ack = Ack(str(pending["id"]), name, self.device_id, False, "interrupted",
                      f"the agent restarted during {name} of v{pending.get('version')}; it runs v{now}",
                      {"model_version": now, "version": pending.get("version"), "rolled_back": True},
                      time.time(), True)
        payload = ack.sign(self.signer.key)
        try:
            self.seen.set_ack(ack.id, payload, issued=float(pending.get("issued", 0.0) or 0.0),
                              expires=float(pending.get("expires", time.time() + 86400.0) or 0.0))
        except (OSError, TypeError, ValueError) as exc:
            log.warning("%s: recovered ack for %s not kept on disk: %s", self.device_id, ack.id, exc)
        return payload

    # -------------------------------------------------------------- inference
