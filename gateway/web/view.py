"""What the operator's web view reads: the gateway's own records, gathered without instrumenting its insides.

:class:`WebView` wraps whatever runs the rounds and the fleet — a :class:`~edgeflow.gateway.service.Gateway`,
``edgeflow simulate``'s :class:`~edgeflow.sim.simulation.SimulatedFleet`, a bare
:class:`~edgeflow.gateway.rounds.RoundManager` or :class:`~edgeflow.gateway.fleet.FleetManager` — or a
function that returns one once it exists (``edgeflow demo`` builds its gateway inside ``run()``). It reads:

- the rounds: ``RoundManager.history`` (the :class:`RoundMetrics` of every round this process closed), the
  ``on_round`` callback (chained, never replaced: the reasons updates were refused are read from the open
  round's counters at that moment), and the store's round rows for failed rounds;
- the fleet: the registry (``store.devices()``), the newest telemetry, ``FleetManager.stats()``;
- rollouts: the :class:`~edgeflow.gateway.ota.RolloutReport` of every ``fleet.deploy`` (the deploy method of
  the one FleetManager instance is wrapped to pass an ``on_progress`` beside the caller's);
- the transport's counters (``stats()``: reconnects);
- what the gateway publishes: the ``publish`` method of each of its transport objects (the rounds', the fleet
  manager's, a site's uplink) is wrapped, as ``deploy`` is, to add each payload's bytes by channel
  (:class:`PublishLog`);
- ingestion workers' refusals: their ``rejected_<reason>`` counters, which each worker stores with its
  heartbeat (``RoundManager.ingest``'s store, read at scrape time).

Store reads are cached for ``ttl_s`` (1 s) so that many browsers and a scraper cost one query a second.
Every string here may come from a device: the dashboard shows it with ``textContent`` only.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from typing import Any, Callable

log = logging.getLogger("edgeflow.gateway.web")

MAX_ROUNDS = 500
"""Rounds kept for the dashboard's charts (the newest)."""
MAX_ROLLOUTS = 20
_LABEL_OK = re.compile(r"^[a-z0-9_]{1,40}$")


def bounded_label(value: Any, allowed: Any = None) -> str:
    """A label value of bounded cardinality: ``allowed`` (a set) or a short code of ``[a-z0-9_]``, else "other"."""
    text = str(value) if value is not None else "none"
    if allowed is not None:
        return text if text in allowed else "other"
    return text if _LABEL_OK.match(text) else "other"


class RoundLog:
    """Every closed round as the callback saw it, plus what the callback alone can see (the rejection reasons)."""

    def __init__(self) -> None:
        self.rows: deque[dict[str, Any]] = deque(maxlen=MAX_ROUNDS)
        self._seen: deque[int] = deque(maxlen=MAX_ROUNDS)
        self._lock = threading.Lock()
        self._listener: Callable[[dict[str, Any]], None] | None = None

    def add(self, m: Any, rejected: dict[str, int], codec: str) -> None:
        row = {k: v for k, v in m.to_dict().items() if isinstance(v, (int, float, str, type(None)))}
        row["codec"] = codec
        row["rejected_by_reason"] = dict(rejected)
        row["ts"] = time.time()
        with self._lock:
            if id(m) in self._seen:
                return
            self._seen.append(id(m))
            self.rows.append(row)
            listener = self._listener
        if listener is not None:
            listener(row)

    def listen(self, fn: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
        """Call ``fn(row)`` for every round added from now on; returns the rows before (each row goes to
        exactly one of the two)."""
        with self._lock:
            self._listener = fn
            return list(self.rows)

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.rows)


class RolloutLog:
    """The reports of the rollouts started through the wrapped ``fleet.deploy`` (the newest ``MAX_ROLLOUTS``)."""

    def __init__(self) -> None:
        self.reports: deque[tuple[Any, int]] = deque(maxlen=MAX_ROLLOUTS)
        self.finished: dict[str, int] = {}
        self._lock = threading.Lock()

    def started(self, report: Any, targets: int) -> None:
        with self._lock:
            if not any(r is report for r, _ in self.reports):
                self.reports.append((report, targets))

    def done(self, report: Any) -> None:
        with self._lock:
            state = bounded_label(getattr(report, "state", "unknown"))
            self.finished[state] = self.finished.get(state, 0) + 1

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self.reports)
        return [summarize_rollout(r, n) for r, n in items]


class PublishLog:
    """Bytes the gateway handed to its transports since the view attached, by channel (``model``, ``round``,
    ``state``, ``secagg``, ``ota``, ``cmd``, ``update`` for a site's partials, ``other``). A payload the
    transport splits counts whole plus each chunk's header (``total`` frames of its Delivery, MQTT and NATS);
    a publish made again (``publish_reliably`` after a failed delivery) counts again: it is sent again.
    MQTT/NATS packet headers and the transport's own resends after a reconnect are not counted."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.messages: dict[str, int] = {}
        self._lock = threading.Lock()
        self._wrapped: list[Any] = []

    def hook(self, transport: Any) -> None:
        """Wrap ``transport.publish`` (once per transport object; the caller's publish is unchanged)."""
        if transport is None or not callable(getattr(transport, "publish", None)):
            return
        if any(t is transport for t in self._wrapped):
            return
        self._wrapped.append(transport)
        inner = transport.publish

        def publish(topic: Any, payload: Any, *args: Any, **kw: Any) -> Any:
            delivery = inner(topic, payload, *args, **kw)
            try:
                self.add(str(topic), delivery)
            except Exception:  # noqa: BLE001 - the web view must never break a publish
                log.exception("web view: counting a publish on %s failed", topic)
            return delivery

        transport.publish = publish

    def add(self, topic: str, delivery: Any) -> None:
        from edgeflow.transport.chunking import HEADER_SIZE

        size = int(getattr(delivery, "size", 0) or 0)
        frames = int(getattr(delivery, "total", 1) or 1)
        n = size + (HEADER_SIZE * frames if frames > 1 else 0)
        kind = publish_kind(topic)
        with self._lock:
            self.bytes[kind] = self.bytes.get(kind, 0) + n
            self.messages[kind] = self.messages.get(kind, 0) + 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.bytes), dict(self.messages)


def publish_kind(topic: str) -> str:
    """The channel of an edgeflow topic (bounded: the topic scheme's channel names), else ``other``."""
    from edgeflow.transport.topics import parse_topic, split_chunk_topic

    base = split_chunk_topic(topic)
    info = parse_topic(base[0] if isinstance(base, tuple) else topic)
    if info is None:
        levels = topic.split("/")  # a site's partial through a bridge: edgeflow/<fleet>/_uplink/<site>/update
        return "update" if len(levels) == 5 and levels[2] == "_uplink" and levels[4] == "update" else "other"
    return bounded_label(info.channel.replace("/", "_"))


def summarize_rollout(report: Any, targets: int = 0) -> dict[str, Any]:
    """A RolloutReport as the dashboard shows it: counts by state, canary wave, failures, rollbacks."""
    for _ in range(5):  # the rollout thread may add a device while this reads: try again
        try:
            devices = list(report.devices.values())
            waves = [list(w) for w in report.waves]
            break
        except RuntimeError:
            continue
    else:
        devices, waves = [], []
    counts: dict[str, int] = {}
    for r in devices:
        counts[r.state] = counts.get(r.state, 0) + 1
    failed = [{"device_id": r.device_id, "state": r.state, "code": r.code, "error": str(r.error)[:200]}
              for r in devices if r.state in ("failed", "refused", "timeout", "reverted")]
    return {
        "version": report.version, "state": report.state, "targets": max(targets, len(devices)),
        "counts": counts, "done": sum(v for k, v in counts.items() if k != "pending"),
        "canary": waves[0] if waves else [], "waves": len(waves), "failure_rate": round(report.failure_rate, 4),
        "rolled_back": sum(1 for r in devices if r.rolled_back), "failures": failed[:50],
        "halted_reason": report.halted_reason, "started": report.started, "finished": report.finished,
    }


class WebView:
    """The read side of the web view; see the module docstring. ``target``: the object, or a function
    returning it (or None while it does not exist yet)."""

    def __init__(self, target: Any, *, ttl_s: float = 1.0) -> None:
        self._target = target
        self.ttl_s = ttl_s
        self.rounds: Any = None
        self.fleet: Any = None
        self.store: Any = None
        self.transport: Any = None
        self.sim_devices: Any = None
        self.fleet_id = ""
        self.round_log = RoundLog()
        self.rollout_log = RolloutLog()
        self.publish_log = PublishLog()
        self.started = time.time()
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Any]] = {}
        self._failed_upto = 0
        self.round_states: dict[str, int] = {}
        self.store_reads: list[float] = []
        """Seconds each store read of this view took since the last scrape (metrics drain it)."""
        self.attached = False
        self.ready = threading.Event()
        """Set once attached (the target exists and its hooks are in)."""
        self.resolve()

    # -- attaching ---------------------------------------------------------------------------------------
    def resolve(self) -> bool:
        """Attach to the target once it exists; True when attached."""
        if self.attached:
            return True
        with self._lock:
            if self.attached:
                return True
            obj = self._target() if callable(self._target) and not _is_component(self._target) else self._target
            if obj is None:
                return False
            self._attach(obj)
            self.attached = True
            self.ready.set()
            return True

    def _attach(self, obj: Any) -> None:
        rounds = getattr(obj, "rounds", None)
        if rounds is None and hasattr(obj, "history") and hasattr(obj, "on_round"):
            rounds = obj  # a RoundManager
        fleet = getattr(obj, "fleet", None)
        if not hasattr(fleet, "stats"):
            fleet = obj if hasattr(obj, "stats") and hasattr(obj, "deploy") else None
        self.rounds, self.fleet = rounds, fleet
        self.store = getattr(obj, "store", None) or getattr(rounds, "store", None) or getattr(fleet, "store", None)
        self.transport = (getattr(obj, "transport", None) or getattr(obj, "gateway_transport", None)
                          or getattr(rounds, "transport", None))
        devices = getattr(obj, "devices", None)
        self.sim_devices = devices if isinstance(devices, list) else None
        self.fleet_id = str(getattr(obj, "fleet_id", "") or getattr(rounds, "fleet", "") or getattr(fleet, "fleet", "")
                            or getattr(getattr(obj, "cfg", None), "fleet", ""))
        if rounds is not None:
            self._hook_rounds(rounds)
        if fleet is not None:
            self._hook_deploy(fleet)
        for t in (self.transport, getattr(rounds, "transport", None), getattr(fleet, "transport", None),
                  getattr(obj, "uplink_transport", None)):
            self.publish_log.hook(t)

    def _hook_rounds(self, rounds: Any) -> None:
        codec = bounded_label(getattr(getattr(getattr(rounds, "config", None), "train", None), "codec", "unknown"))
        for m in list(getattr(rounds, "history", [])):  # rounds closed before the view attached
            self.round_log.add(m, {}, codec)
        inner = rounds.on_round

        def on_round(m: Any) -> None:
            try:
                counters = rounds.open.snapshot().counters  # the round just closed: reset only at the next begin
                rejected = {k[len("rejected_"):] or "other": int(v) for k, v in counters.items()
                            if k.startswith("rejected") and v}
                self.round_log.add(m, rejected, codec)
            except Exception:  # noqa: BLE001 - the web view must never break a round
                log.exception("web view: recording round %s failed", getattr(m, "round_id", "?"))
            if inner is not None:
                inner(m)

        rounds.on_round = on_round

    def _hook_deploy(self, fleet: Any) -> None:
        inner = fleet.deploy
        tracker = self.rollout_log

        def deploy(artifacts: Any, to: str = "all", policy: Any = None, *, on_progress: Any = None,
                   **kw: Any) -> Any:
            def progress(report: Any, result: Any) -> None:
                tracker.started(report, 0)
                if on_progress is not None:
                    on_progress(report, result)

            report = inner(artifacts, to, policy, on_progress=progress, **kw)
            tracker.started(report, len(report.devices))
            tracker.done(report)
            return report

        fleet.deploy = deploy

    # -- cached reads ------------------------------------------------------------------------------------
    def _cached(self, key: str, fn: Callable[[], Any]) -> Any:
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        t0 = time.perf_counter()
        value = fn()
        self.store_reads.append(time.perf_counter() - t0)
        del self.store_reads[:-1000]
        self._cache[key] = (now, value)
        return value

    def device_records(self) -> list[Any]:
        if self.store is None:
            return []
        return self._cached("devices", self.store.devices)

    def devices(self) -> list[dict[str, Any]]:
        """The fleet table: one row per known device (the registry), or the simulation's devices."""
        if not self.resolve():
            return []
        if self.fleet is None and self.sim_devices is not None:
            return [{"device_id": d.device_id, "profile": d.profile, "online": not d.vanished, "health": "simulated"
                     if not d.vanished else "vanished", "backend": "", "model_version": None, "last_seen": None,
                     "trains": True, "why": ""} for d in list(self.sim_devices)]
        return self._cached("device_rows", self._device_rows)

    def _device_rows(self) -> list[dict[str, Any]]:
        from ..fleet import train_reason

        out = []
        latest = getattr(self.fleet, "latest_telemetry", None)
        online_now = getattr(self.fleet, "is_online", None)
        for rec in self.device_records():
            tele = (latest(rec.device_id) if latest is not None else None) or {}
            online = online_now(rec.device_id) if online_now is not None else rec.online
            try:
                trains, why = train_reason(rec.birth, tele)
            except Exception:  # noqa: BLE001 - a malformed record is shown, not fatal
                log.debug("web view: train_reason failed for a device", exc_info=True)
                trains, why = False, "unknown"
            out.append({
                "device_id": rec.device_id, "profile": rec.profile, "online": bool(online),
                "health": _health(online, tele), "backend": str(rec.birth.get("backend") or ""),
                "model_version": rec.model_version, "last_seen": rec.last_seen, "trains": bool(trains), "why": why,
                "battery": tele.get("battery") if isinstance(tele.get("battery"), (int, float)) else None,
            })
        return out

    def device(self, device_id: str, limit: int = 100) -> dict[str, Any] | None:
        """One device's page: its registry row, birth and telemetry history (newest ``limit``)."""
        if not self.resolve():
            return None
        row = next((d for d in self.devices() if d["device_id"] == device_id), None)
        if row is None:
            return None
        rec = next((r for r in self.device_records() if r.device_id == device_id), None)
        telemetry: list[dict[str, Any]] = []
        if self.store is not None and rec is not None:
            t0 = time.perf_counter()
            telemetry = [{"ts": ts, "data": data} for ts, data in self.store.telemetry(device_id, limit=limit)]
            self.store_reads.append(time.perf_counter() - t0)
        return {**row, "birth": rec.birth if rec is not None else {},
                "first_seen": rec.first_seen if rec is not None else None, "telemetry": telemetry}

    def round_states_counts(self) -> dict[str, int]:
        """Rounds by final state (closed, failed) from the store: each round row is read once, when it ended."""
        if self.store is None:
            return dict(self.round_states)

        def scan() -> dict[str, int]:
            last = int(self.store.last_round_id())
            start = max(self._failed_upto + 1, last - MAX_ROUNDS + 1, 1)
            for rid in range(start, last + 1):
                rec = self.store.round(rid)
                if rec is None:
                    self._failed_upto = rid
                    continue
                if rec.state == "open":
                    break
                state = bounded_label(rec.state)
                self.round_states[state] = self.round_states.get(state, 0) + 1
                self._failed_upto = rid
            return dict(self.round_states)

        with self._lock:
            return self._cached("round_states", scan)

    def fleet_stats(self) -> dict[str, Any]:
        if self.fleet is None:
            return {}
        return self._cached("fleet_stats", self.fleet.stats)

    def ingest_refusals(self) -> dict[str, int] | None:
        """Updates the ingestion workers refused before the round manager saw them, by reason (their
        ``rejected_<reason>`` counters, and ``late`` and ``not_selected``, summed over the workers as of each
        one's last heartbeat; a restarted worker starts again from 0); None without workers. Duplicates are
        left out: every worker reassembles a chunked update and all but the one that claims it count one."""
        db = getattr(getattr(self.rounds, "ingest", None), "db", None)
        if db is None or not hasattr(db, "workers"):
            return None

        def read() -> dict[str, int]:
            out: dict[str, int] = {}
            for w in db.workers().values():
                stats = w.get("stats") if isinstance(w, dict) else None
                if not isinstance(stats, dict):
                    continue
                for k, v in stats.items():
                    if not isinstance(v, int) or isinstance(v, bool):
                        continue
                    if k.startswith("rejected_"):
                        reason = bounded_label(k[len("rejected_"):])
                        out[reason] = out.get(reason, 0) + v
                    elif k in ("late", "not_selected"):
                        out[k] = out.get(k, 0) + v
            return out

        return self._cached("ingest_refusals", read)

    def transport_stats(self) -> dict[str, Any]:
        fn = getattr(self.transport, "stats", None)
        if fn is None:
            return {}
        try:
            return dict(fn())
        except Exception:  # noqa: BLE001 - a closed transport: no counters this time
            log.debug("web view: transport stats failed", exc_info=True)
            return {}

    def state(self) -> dict[str, Any]:
        """What ``/api/state`` returns: the whole dashboard in one document."""
        attached = self.resolve()
        rounds = self.round_log.list()
        devices = self.devices() if attached else []
        cfg = getattr(self.rounds, "config", None)
        return {
            "fleet": self.fleet_id, "attached": attached, "ts": time.time(), "uptime_s": time.time() - self.started,
            "model_version": getattr(self.rounds, "version", None),
            "rounds_planned": getattr(cfg, "rounds", None), "strategy": getattr(self.rounds, "strategy_name", None),
            "round_states": self.round_states_counts() if attached else {},
            "devices": devices,
            "summary": {"devices": len(devices), "online": sum(1 for d in devices if d["online"]),
                        "training": sum(1 for d in devices if d["trains"])},
            "rounds": rounds[-200:], "rollouts": self.rollout_log.list(),
        }


def _is_component(obj: Any) -> bool:
    """A gateway part (not a provider function): has what the view reads."""
    return any(hasattr(obj, a) for a in ("history", "stats", "rounds", "store"))


def _health(online: bool, tele: dict[str, Any]) -> str:
    if not online:
        return "offline"
    part = tele.get("participant")
    if isinstance(part, dict) and part.get("last_error"):
        return "degraded"
    batt = tele.get("battery")
    if isinstance(batt, (int, float)) and not isinstance(batt, bool) and batt < 0.15:
        return "low battery"
    return "ok"
