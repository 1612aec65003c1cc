"""The gateway's fleet registry and command channel.

:class:`FleetManager` listens to every device's ``birth``, ``death``,
``telemetry`` and ``cmd/ack`` topics and keeps the registry in the
:class:`~edgeflow.gateway.store.GatewayStore`:

- **only provisioned devices**: births, deaths, telemetry and acks of an id
  the :attr:`keyring` does not know are ignored (counted as ``*_unknown``),
  on any broker: registration is ``edgeflow fleet provision``, nothing
  else. ``keyring_loader`` (e.g. ``FleetDir.keyring``) is re-read, at most
  every ``keyring_reload_s`` (and at once when an unknown id shows up), so
  devices provisioned while the gateway runs are picked up without a
  restart, and a device revoked with ``edgeflow fleet revoke`` (its key
  removed) is refused and marked offline within ``keyring_reload_s``;
- **liveness** from two signals: the broker's last will (a signed ``death``
  whose ``bdseq`` is not older than the newest birth; an older one is a
  stale will of an earlier session, and an unsigned or forged one is
  ignored) and a heartbeat timeout (no birth, telemetry or ack for
  ``heartbeat_factor`` times the telemetry interval the device announced in
  its birth, for a device whose TCP connection hangs without the broker
  noticing yet);
- **births** (signed by the device key, every field bounded) refresh
  profile, versions and model version; a birth older than the newest one
  seen (smaller ``(bdseq, seq)``, also across gateway restarts via the
  registry) is a replay and is ignored;
- **telemetry** is bounded before it is parsed (``max_telemetry_bytes``,
  ``telemetry_rate_hz`` per device) and reduced to the known fields before
  it is kept (:func:`bounded_telemetry`), so the registry's rows per device
  (``GatewayStore.telemetry_keep``) have a bounded size; a writer thread
  commits it to SQLite, so a slow disk never stalls the transport's worker
  thread; the end-to-end lag (device timestamp to commit) is measured and
  reported by :meth:`FleetManager.stats`;
- **retained junk** on device channels is cleared at the broker: a retained
  message on a channel that carries none (``telemetry``, ``cmd/ack``, and
  whatever :meth:`FleetManager.watch_retained` adds: ``update``...), or a
  retained birth or death that does not parse as one (not JSON, not the
  signed shape, over the size bound), is replaced by an empty retained
  message on its topic (what deletes a retained message in MQTT), counted
  (``retained_junk_cleared``) and logged once per topic. Honest devices
  retain only births and deaths, so nothing they need is touched; a
  well-formed birth with a bad signature is refused but left alone.

Commands: :meth:`FleetManager.send_command` signs a :class:`Command` with
the fleet key, publishes it on the device's ``cmd`` topic and returns a
:class:`PendingCommand` that resolves with the device's signed
:class:`Ack` (or times out). OTA offers go the same way on the ``ota``
topic (:meth:`send_ota`; rollouts are in :mod:`edgeflow.gateway.ota`).

Composable: one transport and one store are shared with the round manager
(``gateway/service.py``). Call :meth:`start` before ``transport.connect()``
with a persistent session, :meth:`stop` before closing the transport. The
round manager gets device keys from :attr:`keyring` and its candidates from
:meth:`online_devices` / :meth:`latest_telemetry` (or :meth:`round_candidates`).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeflow.broker.bridge import UPLINK_LEVEL
from edgeflow.protocol.fleet import ACK_CONTEXT, MAX_BIRTH_BYTES, Ack, Birth, Command, Death
from edgeflow.protocol.ota import OtaOffer, deploy_command
from edgeflow.protocol.signed_json import loads, open_signed, peek_signed
from edgeflow.errors import CodecError, FleetError, SignatureError
from edgeflow.signing import KeyRing, PrivateKey
from edgeflow.transport.base import Transport
from edgeflow.transport.topics import device_filter, device_topic, parse_topic

from .store import DeviceRecord, GatewayStore, StoreError

__all__ = ["FleetEvent", "FleetManager", "FleetOptions", "PendingCommand", "bounded_telemetry"]

log = logging.getLogger("edgeflow.gateway.fleet")


@dataclass
class FleetOptions:
    heartbeat_factor: float = 3.0
    """A device is offline after this many of its telemetry intervals without a message."""
    heartbeat_min_s: float = 5.0
    heartbeat_timeout_s: float | None = None
    """Fixed timeout for every device (overrides factor x interval)."""
    liveness_check_s: float = 1.0
    command_timeout_s: float = 30.0
    command_ttl_s: float = 300.0
    """Commands expire on the device this long after they were issued."""
    record_registry: bool = True
    record_telemetry: bool = True
    telemetry_queue: int = 100_000
    max_telemetry_bytes: int = 16 * 1024
    """Telemetry messages larger than this are dropped unparsed."""
    telemetry_rate_hz: float = 20.0
    """Per device: telemetry beyond this rate (after a burst of twice as many) is dropped."""
    keyring_reload_s: float = 5.0
    lag_window: int = 20_000


TELEMETRY_FIELDS = {
    "device": str, "ts": float, "seq": int, "bdseq": int, "model_version": int, "training": bool,
    "inferences": int, "inference_errors": int, "latency_p50_ms": float, "latency_p95_ms": float,
    "rss_bytes": int, "peak_rss_bytes": int, "cpu_percent": float, "queue_depth": int, "battery": float,
    "charging": bool, "train": str,
}
PARTICIPANT_FIELDS = {"rounds_trained": int, "last_round": int, "last_loss": float}
LONG_TEXT = 400
"""Bound of the free-text fields (``train_detail``, ``participant.last_error``): one line for an operator."""


def _typed(v: Any, kind: type) -> Any:
    """``v`` if it is a JSON value of ``kind`` in a sane range, else None."""
    if v is None or isinstance(v, bool) != (kind is bool):
        return None
    if kind is bool:
        return v
    if kind is str:
        return v[:64] if isinstance(v, str) else None
    if kind is int:
        return v if isinstance(v, int) and -(1 << 63) <= v < (1 << 63) else None
    if isinstance(v, (int, float)) and math.isfinite(float(v)) and abs(float(v)) < 1e15:
        return float(v)
    return None


def bounded_telemetry(body: dict[str, Any]) -> dict[str, Any]:
    """The known telemetry fields with values of the right type (anything else dropped): what is kept."""
    out: dict[str, Any] = {}
    for k, kind in TELEMETRY_FIELDS.items():
        if k in body:
            v = _typed(body[k], kind)
            if v is not None or body[k] is None:
                out[k] = v
    if isinstance(body.get("train_detail"), str):
        out["train_detail"] = body["train_detail"][:LONG_TEXT]
    part = body.get("participant")
    if isinstance(part, dict):
        out["participant"] = {k: v for k, kind in PARTICIPANT_FIELDS.items()
                              if k in part and (v := _typed(part[k], kind)) is not None}
        if isinstance(part.get("last_error"), str):
            out["participant"]["last_error"] = part["last_error"][:LONG_TEXT]
    return out


def _birth_train(payload: bytes) -> dict[str, Any]:
    """``train`` and ``train_detail`` of a birth whose signature was just verified (agents add them to the
    signed body; :class:`Birth` does not carry them yet), bounded; {} when absent."""
    try:
        _, body = peek_signed(payload)
    except CodecError:
        return {}
    out: dict[str, Any] = {}
    if isinstance(body.get("train"), str):
        out["train"] = body["train"][:32]
    if isinstance(body.get("train_detail"), str):
        out["train_detail"] = body["train_detail"][:LONG_TEXT]
    return out


def train_state(birth: Mapping[str, Any], telemetry: Mapping[str, Any] | None) -> tuple[str | None, str]:
    """A device's training state (one of ``edgeflow.device.agent.TRAIN_STATES``, or None if it reports none)
    and its detail line: agents report ``train``/``train_detail`` in their birth and in every telemetry
    message; the newer of the two counts."""
    t = telemetry or {}

    def ts(d: Mapping[str, Any]) -> float:
        v = d.get("ts")
        return float(v) if isinstance(v, (int, float)) else 0.0

    src = t if "train" in t and ts(t) >= ts(birth) else (birth if "train" in birth else t)
    state = src.get("train")
    return (state if isinstance(state, str) else None), str(src.get("train_detail") or "")


def train_reason(birth: Mapping[str, Any], telemetry: Mapping[str, Any] | None) -> tuple[bool, str]:
    """(takes part in rounds now, why not) from a device's birth and latest telemetry; an agent that
    reports no state is judged by the birth's ``training`` flag."""
    state, detail = train_state(birth, telemetry)
    if not birth.get("can_train", False):
        return False, detail or f"profile {birth.get('profile', '?')} cannot train"
    if state is not None:
        return (True, "") if state == "training" else (False, detail or f"not training ({state})")
    if birth.get("training", False):
        return True, ""
    return False, "not training (no reason reported: an agent older than this gateway)"


@dataclass(frozen=True)
class FleetEvent:
    """Passed to listeners: ``kind`` is birth, death, offline (heartbeat), ack or refused."""

    kind: str
    device_id: str
    data: dict[str, Any] = field(default_factory=dict)


class PendingCommand:
    """A command on its way; :meth:`wait` returns the device's :class:`Ack`."""

    def __init__(self, command: Command, timeout_s: float) -> None:
        self.command = command
        self.timeout_s = timeout_s
        self.sent = time.monotonic()
        self._event = threading.Event()
        self._ack: Ack | None = None
        self._callbacks: list[Callable[[Ack], Any]] = []
        self._lock = threading.Lock()

    @property
    def id(self) -> str:
        return self.command.id

    @property
    def done(self) -> bool:
        return self._event.is_set()

    @property
    def ack(self) -> Ack | None:
        return self._ack

    def add_callback(self, fn: Callable[[Ack], Any]) -> None:
        with self._lock:
            if self._ack is None:
                self._callbacks.append(fn)
                return
        fn(self._ack)

    def _resolve(self, ack: Ack) -> None:
        with self._lock:
            if self._ack is not None:
                return
            self._ack = ack
            callbacks = list(self._callbacks)
        self._event.set()
        for fn in callbacks:
            try:
                fn(ack)
            except Exception:  # noqa: BLE001
                log.exception("command callback failed")

    def wait(self, timeout: float | None = None) -> Ack:
        """The ack; FleetError if none arrived within ``timeout`` (default: the command's timeout)."""
        limit = self.timeout_s if timeout is None else timeout
        if not self._event.wait(limit):
            c = self.command
            raise FleetError(f"device {c.device} did not acknowledge {c.name} ({c.id}) within {limit:g} s; "
                             "is it online? (`edgeflow fleet status`)")
        assert self._ack is not None
        return self._ack


class FleetManager:
    """Registry, liveness and commands for one fleet. See the module docstring."""

    def __init__(
        self,
        transport: Transport,
        store: GatewayStore,
        fleet: str,
        fleet_key: PrivateKey,
        options: FleetOptions | None = None,
        *,
        keyring: KeyRing | None = None,
        keyring_loader: Callable[[], KeyRing] | None = None,
    ) -> None:
        self.transport = transport
        self.store = store
        self.fleet = fleet
        self.fleet_key = fleet_key
        self.options = options or FleetOptions()
        self.keyring = keyring if keyring is not None else KeyRing()
        """Device public keys: verifies births, deaths and acks here, updates in the round manager."""
        self.keyring_loader = keyring_loader
        self._keyring_loaded = 0.0
        self._mark: dict[str, tuple[int, int, float, bool]] = {}
        """Newest birth per device: (bdseq, seq, ts, seen live); from the registry at start (not live)."""
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.RLock()
        self._pending: dict[str, PendingCommand] = {}
        self._acks: OrderedDict[str, Ack] = OrderedDict()
        self._listeners: list[Callable[[FleetEvent], Any]] = []
        self._births: dict[str, Birth] = {}
        self._deaths: dict[str, int] = {}
        self._last_seen: dict[str, float] = {}
        self._online: dict[str, bool] = {}
        self._interval: dict[str, float] = {}
        self._latest: dict[str, dict[str, Any]] = {}
        self._seq: dict[str, tuple[int, int]] = {}
        self._tq: queue.Queue[Any] = queue.Queue(maxsize=self.options.telemetry_queue)
        self._lag: deque[float] = deque(maxlen=self.options.lag_window)
        self._counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._subs: list[Any] = []
        self._started_at = 0.0
        self._cleared: OrderedDict[str, None] = OrderedDict()
        """Topics whose retained junk this manager cleared (the newest 4096): logged once each."""
        for rec in store.devices():
            self._online[rec.device_id] = rec.online
            self._last_seen[rec.device_id] = time.monotonic()
            self._interval[rec.device_id] = float(rec.birth.get("telemetry_interval_s", 10.0) or 10.0)
            b = rec.birth
            if isinstance(b.get("bdseq"), int) and isinstance(b.get("seq", 0), int):
                self._mark[rec.device_id] = (b["bdseq"], b.get("seq", 0), float(b.get("ts", 0.0) or 0.0), False)
            if not rec.online and rec.bdseq >= 0:
                self._deaths[rec.device_id] = rec.bdseq

    # -------------------------------------------------------------- lifecycle

    def start(self) -> FleetManager:
        if self._subs:
            return self
        self._stop.clear()
        self._started_at = time.time()
        on = self.transport.subscribe
        self._subs = [
            on(str(device_filter(self.fleet, "birth")), self._on_birth),
            on(str(device_filter(self.fleet, "death")), self._on_death),
            on(str(device_filter(self.fleet, "cmd/ack")), self._on_ack),
        ]
        if self.options.record_telemetry:
            self._subs.append(on(str(device_filter(self.fleet, "telemetry")), self._on_telemetry))
        for name, target in (("liveness", self._liveness_loop), ("telemetry", self._writer_loop)):
            t = threading.Thread(target=target, name=f"edgeflow-fleet-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for s in self._subs:
            try:
                self.transport.unsubscribe(s)
            except Exception:  # noqa: BLE001 - the transport may already be closed
                log.debug("unsubscribe at stop failed (transport closed?)", exc_info=True)
        self._subs = []
        self._tq.put(None)
        for t in self._threads:
            t.join(timeout)
        self._threads = []

    def watch_retained(self, channels: tuple[str, ...] | list[str]) -> None:
        """Also clear retained messages on these device channels (ones that carry no retained messages, e.g.
        ``update``), through handlers beside the application's own: subscribe the *same* filters the rounds
        use, so the broker sends nothing more (the transport shares one broker subscription per filter).
        Call before ``transport.connect()``, like :meth:`start`."""
        for ch in channels:
            self._subs.append(self.transport.subscribe(str(device_filter(self.fleet, ch)),
                                                       lambda msg, ch=ch: self._retained_only(msg, ch)))

    def _retained_only(self, msg: Any, channel: str) -> None:
        if msg.retain and msg.payload:
            self._clear_junk(msg, channel, "a retained message on a channel that carries none")

    def _clear_junk(self, msg: Any, channel: str, why: str) -> None:
        """Delete a retained message at the broker (an empty retained message on its topic); counted and
        logged once per topic."""
        with self._lock:
            again = msg.topic in self._cleared
            self._cleared[msg.topic] = None
            self._cleared.move_to_end(msg.topic)
            while len(self._cleared) > 4096:
                self._cleared.popitem(last=False)
        self._count(f"retained_junk_{channel.replace('/', '_')}")
        try:
            self.transport.publish(msg.topic, b"", qos=1, retain=True, raw=True)
        except Exception as exc:  # noqa: BLE001 - a closing transport: the next start clears it
            log.warning("retained junk on %s not cleared: %s", msg.topic, exc)
            return
        if not again:
            log.warning("cleared retained junk on %s (%d bytes: %s); a device left it there, or someone with "
                        "write access to that topic", msg.topic, len(msg.payload), why)
        self._count("retained_junk_cleared")  # last: whoever waits for the count finds the log line written

    def _retained_junk(self, msg: Any, channel: str) -> bool:
        """True (and cleared) when ``msg`` is a retained message that does not belong on ``channel``."""
        if not (msg.retain and msg.payload):
            return False
        if channel in ("telemetry", "cmd/ack"):
            self._clear_junk(msg, channel, "a retained message on a channel that carries none")
            return True
        try:
            if channel == "birth":
                if len(msg.payload) > MAX_BIRTH_BYTES:
                    raise CodecError(f"over {MAX_BIRTH_BYTES} bytes")
                Birth.from_body(peek_signed(msg.payload)[1])
            else:
                Death.from_bytes(msg.payload)  # signed, or an old agent's unsigned death: both are deaths
        except (CodecError, ValueError, TypeError, KeyError, AttributeError) as exc:
            self._clear_junk(msg, channel, f"not a {channel} message: {str(exc)[:80]}")
            return True
        return False

    def add_listener(self, fn: Callable[[FleetEvent], Any]) -> None:
        """``fn(FleetEvent)`` on births, deaths, heartbeat timeouts and acks (on the transport's worker thread)."""
        with self._lock:
            self._listeners.append(fn)

    def _emit(self, kind: str, device_id: str, data: dict[str, Any] | None = None) -> None:
        with self._lock:
            listeners = list(self._listeners)
        ev = FleetEvent(kind, device_id, data or {})
        for fn in listeners:
            try:
                fn(ev)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the registry
                log.exception("fleet listener failed on %s", kind)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    # ----------------------------------------------------------------- queries

    def devices(self) -> list[DeviceRecord]:
        return self.store.devices()

    def device(self, device_id: str) -> DeviceRecord | None:
        return self.store.device(device_id)

    def is_online(self, device_id: str) -> bool:
        with self._lock:
            return bool(self._online.get(device_id, False))

    def online_devices(self, profile: str | None = None) -> list[DeviceRecord]:
        """Devices online now (optionally of one profile), as registry records."""
        with self._lock:
            online = {d for d, up in self._online.items() if up}
        return [r for r in self.store.devices() if r.device_id in online and (profile is None or r.profile == profile)]

    def latest_telemetry(self, device_id: str) -> dict[str, Any] | None:
        """The newest telemetry body of a device (battery, latency, memory...), or None."""
        with self._lock:
            t = self._latest.get(device_id)
        if t is not None:
            return dict(t)
        rows = self.store.telemetry(device_id, limit=1)
        return rows[-1][1] if rows else None

    def birth(self, device_id: str) -> Birth | None:
        with self._lock:
            return self._births.get(device_id)

    def round_candidates(self) -> list[Any]:
        """Online devices as :class:`edgeflow.gateway.rounds.Candidate` (profile, can_train, battery)."""
        from .rounds import Candidate

        out = []
        for r in self.online_devices():
            tele = self.latest_telemetry(r.device_id) or {}
            ok, why = train_reason(r.birth, tele)
            note = str((tele.get("participant") or {}).get("last_error", ""))
            out.append(Candidate(r.device_id, r.profile, ok, tele.get("battery"), why=why, note=note))
        return out

    def wait_online(self, device_ids: list[str] | set[str], timeout: float = 10.0, *, online: bool = True) -> bool:
        """Block until every id is online (or offline, with ``online=False``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(bool(self._online.get(d, False)) == online for d in device_ids):
                    return True
            time.sleep(0.02)
        return False

    def stats(self) -> dict[str, Any]:
        """Counters plus telemetry lag percentiles (ms, device timestamp to SQLite commit)."""
        with self._lock:
            out: dict[str, Any] = {k: v for k, v in self._counts.items() if not k.startswith("_")}
            lag = np.asarray(self._lag, dtype=np.float64)
            out["online"] = sum(1 for v in self._online.values() if v)
            out["known"] = len(self._online)
        out["telemetry_backlog"] = self._tq.qsize()
        if lag.size:
            out["telemetry_lag_ms"] = {"p50": float(np.percentile(lag, 50)), "p95": float(np.percentile(lag, 95)),
                                       "max": float(lag.max()), "n": int(lag.size)}
        return out

    def reset_lag(self) -> None:
        with self._lock:
            self._lag.clear()

    # ---------------------------------------------------------------- handlers

    def _device_of(self, topic: str, channel: str) -> str | None:
        info = parse_topic(topic)
        if info is None or info.device is None or info.fleet != self.fleet or info.channel != channel:
            return None
        return info.device

    def _seen(self, device_id: str) -> None:
        with self._lock:
            self._last_seen[device_id] = time.monotonic()

    def _key(self, device: str, what: str) -> Any:
        """The device's registered key, or None (counted, logged once a minute per kind): unknown ids are ignored."""
        key = self.keyring.get(device)
        if key is None and self._reload_keyring():
            key = self.keyring.get(device)
        if key is None:
            self._count(f"{what}_unknown")
            now = time.monotonic()
            with self._lock:
                last = self._counts.get(f"_logged_{what}", 0)
                if now - last > 60:
                    self._counts[f"_logged_{what}"] = int(now)
                    log.warning("%s from %s ignored: no such provisioned device (register devices with "
                                "`edgeflow fleet provision`); further ones are only counted", what, device)
        return key

    def _reload_keyring(self) -> bool:
        """Re-read the provisioned keys (rate-limited); True when it did. Updates :attr:`keyring` in place."""
        if self.keyring_loader is None:
            return False
        now = time.monotonic()
        with self._lock:
            if now - self._keyring_loaded < self.options.keyring_reload_s:
                return False
            self._keyring_loaded = now
        try:
            fresh = self.keyring_loader()
        except Exception as exc:  # noqa: BLE001 - a half-written keyring.json must not stop the registry
            log.warning("key ring not reloaded: %s", exc)
            return False
        for dev in fresh.devices():
            key = fresh.get(dev)
            if key is not None and self.keyring.get(dev) != key:
                self.keyring.register(dev, key, replace=True)
        gone = sorted(set(self.keyring.devices()) - set(fresh.devices()))
        for dev in gone:
            self.keyring.unregister(dev)
        for dev in gone:  # revoked (`edgeflow fleet revoke`): its key is refused from now on, and it is offline
            with self._lock:
                was = self._online.get(dev, False)
                self._online[dev] = False
            if was and self.options.record_registry:
                self.store.set_online(dev, False)
            self._count("keys_revoked")
            log.warning("device %s is no longer provisioned (revoked): its messages are refused from now on", dev)
            self._emit("revoked", dev, {"reason": "key removed from the fleet's key ring"})
        return True

    def accepts_transfer(self, base: str) -> bool:
        """The transport's ``accept_transfer`` hook: chunked transfers only from provisioned devices (and the
        gateway's own topics), so made-up ids cannot take reassembly memory. Per-sender budgets
        (:class:`edgeflow.transport.chunking.Reassembler`) bound what a provisioned one can take."""
        levels = base.split("/")
        if len(levels) < 4 or levels[0] != "edgeflow" or levels[1] != self.fleet:
            return False
        who = levels[2]
        if who == "gateway" or self.keyring.get(who) is not None:
            return True
        if who == UPLINK_LEVEL and len(levels) >= 5 and levels[3] == "gateway":
            return True  # a bridged site hears its root's (signed) model and rounds under _uplink/gateway/
        if self._reload_keyring() and self.keyring.get(who) is not None:
            return True
        self._count("transfers_unknown")
        return False

    def _on_birth(self, msg: Any) -> None:
        device = self._device_of(msg.topic, "birth")
        if device is None or self._retained_junk(msg, "birth"):
            return
        key = self._key(device, "births")
        if key is None:
            return
        try:
            birth = Birth.verify(msg.payload, key)
        except (SignatureError, CodecError) as exc:
            self._count("births_bad")
            log.warning("birth from %s refused: %s", device, exc)
            self._emit("refused", device, {"what": "birth", "error": str(exc)})
            return
        if birth.device != device:
            self._count("births_bad")
            log.warning("birth on %s's topic claims to be %s: ignored", device, birth.device)
            return
        with self._lock:
            mark = self._mark.get(device)
            same = mark is not None and (birth.bdseq, birth.seq) == mark[:2]
            # Newer than the newest seen; the registry's own (retained, re-delivered at start); or, for agents
            # that sent seq 0 on every birth, a later timestamp.
            newer = mark is None or (birth.bdseq, birth.seq) > mark[:2] or (same and not mark[3]) or (
                same and birth.seq == 0 and birth.ts > mark[2])
            if not newer:
                stale = True
            else:
                stale = False
                self._mark[device] = (birth.bdseq, birth.seq, birth.ts, True)
                self._births[device] = birth
                last_death = self._deaths.get(device, -1)
                online = birth.bdseq > last_death
                if not online:
                    self._online[device] = False
                self._interval[device] = max(0.05, birth.telemetry_interval_s)
                self._last_seen[device] = time.monotonic()
                self._seq[device] = (birth.bdseq, 0)
        if stale:
            self._count("births_stale")
            return
        record = {**birth.to_dict(), **_birth_train(msg.payload), "trust": "registered", "received": time.time()}
        if self.options.record_registry:
            self.store.upsert_birth(device, record, profile=birth.profile, public_key=birth.public_key,
                                    model_version=birth.model_version, bdseq=birth.bdseq)
            if not online:
                self.store.set_online(device, False, bdseq=last_death)
        if online:
            self._announce_online(device, birth)
        self._count("births")
        self._emit("birth", device, record)

    def _announce_online(self, device: str, birth: Birth) -> None:
        """A birth's device goes online only once its registry row is written: whoever waits for it
        (:meth:`wait_online`, a rollout's target list) then reads the birth's profile and model version, never
        the previous session's row or none. Skipped when a newer birth or a death came in meanwhile."""
        with self._lock:
            if self._mark.get(device, (None, None))[:2] == (birth.bdseq, birth.seq) and \
                    birth.bdseq > self._deaths.get(device, -1):
                self._online[device] = True

    def _on_death(self, msg: Any) -> None:
        device = self._device_of(msg.topic, "death")
        if device is None or self._retained_junk(msg, "death"):
            return
        key = self._key(device, "deaths")
        if key is None:
            return
        try:
            death = Death.verify(msg.payload, key)
            if death.device != device:
                raise CodecError(f"death on {device}'s topic names {death.device}")
        except (SignatureError, CodecError) as exc:
            self._count("deaths_bad")
            log.warning("death of %s refused: %s", device, exc)
            return
        with self._lock:
            birth = self._births.get(device)
            mark = self._mark.get(device)
            newest = birth.bdseq if birth is not None else (mark[0] if mark is not None else -1)
            stale = death.bdseq < newest or death.bdseq <= self._deaths.get(device, -1) and not self._online.get(device)
            if not stale:
                self._deaths[device] = death.bdseq
                self._online[device] = False
        if stale:
            self._count("deaths_stale")
            return
        if self.options.record_registry:
            self.store.set_online(device, False, bdseq=death.bdseq)
        self._count("deaths")
        self._emit("death", device, {"bdseq": death.bdseq, "reason": death.reason})

    def _rate_ok(self, device: str, now: float) -> bool:
        """Token bucket per device: ``telemetry_rate_hz``, bursts of twice that."""
        rate = self.options.telemetry_rate_hz
        if rate <= 0:
            return True
        cap = 2.0 * rate
        with self._lock:
            tokens, last = self._buckets.get(device, (cap, now))
            tokens = min(cap, tokens + (now - last) * rate)
            ok = tokens >= 1.0
            self._buckets[device] = (tokens - 1.0 if ok else tokens, now)
        return ok

    def _on_telemetry(self, msg: Any) -> None:
        device = self._device_of(msg.topic, "telemetry")
        if device is None or self._retained_junk(msg, "telemetry"):
            return
        if self._key(device, "telemetry") is None:
            return
        if len(msg.payload) > self.options.max_telemetry_bytes:
            self._count("telemetry_oversized")
            return
        if not self._rate_ok(device, time.monotonic()):
            self._count("telemetry_rate_limited")
            return
        try:
            raw = loads(msg.payload, "telemetry")
            if not isinstance(raw, dict):
                raise CodecError("telemetry is not a JSON object")
        except CodecError:
            self._count("telemetry_bad")
            return
        body = bounded_telemetry(raw)
        now = time.time()
        with self._lock:
            self._latest[device] = body
            self._last_seen[device] = time.monotonic()
            if not self._online.get(device, False) and device in self._births:
                b = self._births[device]
                if b.bdseq > self._deaths.get(device, -1) and body.get("bdseq") == b.bdseq:
                    self._online[device] = True  # back after a heartbeat timeout
            prev = self._seq.get(device)
            seq, bdseq = body.get("seq"), body.get("bdseq")
            if prev is not None and isinstance(seq, int) and bdseq == prev[0]:
                if seq > prev[1] + 1:
                    self._counts["telemetry_gaps"] = self._counts.get("telemetry_gaps", 0) + (seq - prev[1] - 1)
                self._seq[device] = (prev[0], max(prev[1], seq))
        self._count("telemetry")
        try:
            self._tq.put_nowait((device, body, now))
        except queue.Full:
            self._count("telemetry_dropped")

    def _writer_loop(self) -> None:
        """Commit telemetry off the transport's worker thread, draining whatever queued up per wake-up."""
        while not self._stop.is_set():
            try:
                first = self._tq.get(timeout=0.5)
            except queue.Empty:
                continue
            if first is None:
                return
            batch = [first]
            while len(batch) < 5000:  # whatever queued up meanwhile; never wait for more
                try:
                    item = self._tq.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._stop.set()
                    break
                batch.append(item)
            self._write(batch)

    def _write(self, batch: list[tuple[str, dict[str, Any], float]]) -> None:
        lags = []
        try:
            self.store.add_telemetry_batch(batch)  # one transaction for the whole batch
        except StoreError as exc:  # a full disk, a lost database server: one line, at most every 10 s
            self._count("telemetry_write_errors", len(batch))
            now = time.monotonic()
            with self._lock:
                last = self._counts.get("_logged_store", 0)
                quiet = now - last < 10
                if not quiet:
                    self._counts["_logged_store"] = int(now)
            if not quiet:
                log.error("%d telemetry rows not stored (%s); further failures are counted "
                          "(telemetry_write_errors), the registry goes on", len(batch), exc)
            return
        except Exception:  # noqa: BLE001 - anything else is a bug, but must not kill the writer either
            self._count("telemetry_write_errors", len(batch))
            log.exception("%d telemetry rows not stored", len(batch))
            return
        now = time.time()
        for _device, body, _received in batch:
            ts = body.get("ts")
            if isinstance(ts, (int, float)):
                lags.append((now - float(ts)) * 1000.0)
        with self._lock:
            self._lag.extend(lags)
            self._counts["telemetry_stored"] = self._counts.get("telemetry_stored", 0) + len(lags)

    def _liveness_loop(self) -> None:
        while not self._stop.wait(self.options.liveness_check_s):
            if self.keyring_loader is not None:
                self._reload_keyring()  # rate-limited: picks up provisioning and revocations while running
            now = time.monotonic()
            expired = []
            with self._lock:
                for device, up in self._online.items():
                    if not up:
                        continue
                    limit = self.options.heartbeat_timeout_s or max(
                        self.options.heartbeat_min_s, self.options.heartbeat_factor * self._interval.get(device, 10.0))
                    if now - self._last_seen.get(device, now) > limit:
                        self._online[device] = False
                        expired.append((device, limit))
            for device, limit in expired:
                if self.options.record_registry:
                    self.store.set_online(device, False)
                self._count("heartbeat_timeouts")
                self._emit("offline", device, {"reason": f"no message for {limit:g} s"})

    def _on_ack(self, msg: Any) -> None:
        device = self._device_of(msg.topic, "cmd/ack")
        if device is None or self._retained_junk(msg, "cmd/ack"):
            return
        key = self._key(device, "acks")
        if key is None:
            return
        try:
            ack = Ack.from_body(open_signed(msg.payload, key, ACK_CONTEXT))
        except (SignatureError, CodecError) as exc:
            self._count("acks_refused")
            log.warning("ack from %s refused: %s", device, exc)
            return
        if ack.device != device:
            self._count("acks_refused")
            return
        self._seen(device)
        with self._lock:
            self._acks[ack.id] = ack
            while len(self._acks) > 4096:
                self._acks.popitem(last=False)
            pending = self._pending.pop(ack.id, None)
        self._count("acks")
        if pending is None or time.monotonic() - pending.sent > pending.timeout_s:
            self._count("acks_late")  # after its timeout (e.g. a device that came back): still recorded
        if pending is not None:
            pending._resolve(ack)
        self._emit("ack", device, ack.to_dict())

    # ---------------------------------------------------------------- commands

    def _track(self, cmd: Command, timeout_s: float | None) -> PendingCommand:
        pc = PendingCommand(cmd, self.options.command_timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            self._pending[cmd.id] = pc
            while len(self._pending) > 100_000:
                self._pending.pop(next(iter(self._pending)))
        return pc

    def send_command(self, device_id: str, name: str, args: Mapping[str, Any] | None = None, *,
                     timeout_s: float | None = None, ttl_s: float | None = None) -> PendingCommand:
        """Sign and publish a command; the returned :class:`PendingCommand` resolves with the ack."""
        cmd = Command.make(name, device_id, self.fleet, args, ttl_s=self.options.command_ttl_s if ttl_s is None else ttl_s)
        pc = self._track(cmd, timeout_s)
        self.transport.publish(device_topic(self.fleet, device_id, "cmd").value, cmd.sign(self.fleet_key), qos=1)
        self._count("commands_sent")
        return pc

    def command(self, device_id: str, name: str, args: Mapping[str, Any] | None = None, *,
                timeout_s: float | None = None) -> Ack:
        """Send a command and wait for its ack (FleetError on timeout)."""
        return self.send_command(device_id, name, args, timeout_s=timeout_s).wait()

    def send_ota(self, device_id: str, artifact: bytes, *, version: int, timeout_s: float | None = None,
                 ttl_s: float | None = None, allow_downgrade: bool = False, role: str | None = None,
                 challenge: str | None = None) -> PendingCommand:
        """Offer ``artifact`` to one device (signed deploy command + artifact, chunked by the transport).

        Devices refuse a version older than the one they run unless ``allow_downgrade``.
        ``role="train_master"``: the fp32 master of a quantized model, kept for training, not served.
        ``challenge``: hex seed of the inputs whose outputs the device returns as evidence (gateway/ota.py).
        """
        extra: dict[str, Any] = {}
        if allow_downgrade:
            extra["allow_downgrade"] = True
        if role is not None:
            extra["role"] = role
        if challenge is not None:
            extra["challenge"] = challenge
        cmd = deploy_command(device_id, self.fleet, artifact, version=version,
                             ttl_s=self.options.command_ttl_s if ttl_s is None else ttl_s, extra=extra or None)
        pc = self._track(cmd, timeout_s)
        offer = OtaOffer.make(cmd, artifact, self.fleet_key)
        self.transport.publish(device_topic(self.fleet, device_id, "ota").value, offer.to_bytes(), qos=1)
        self._count("ota_sent")
        return pc

    def deploy(self, artifacts: Mapping[str, bytes], to: str = "all", policy: Any = None, *,
               include_offline: bool = False, on_progress: Callable[..., Any] | None = None,
               masters: Mapping[str, bytes] | None = None) -> Any:
        """Roll signed per-profile ``artifacts`` out to the devices matching ``to`` (see
        :mod:`edgeflow.gateway.ota`); blocks and returns the :class:`~edgeflow.gateway.ota.RolloutReport`."""
        from .ota import Rollout, select_devices

        targets = select_devices(self.devices(), to, online=None if include_offline else self.is_online)
        if not targets:
            raise FleetError(f"no {'known' if include_offline else 'online'} device matches {to!r}")
        return Rollout(self, artifacts, targets, policy, on_progress=on_progress, masters=masters).run()

    def recent_ack(self, command_id: str) -> Ack | None:
        with self._lock:
            return self._acks.get(command_id)
