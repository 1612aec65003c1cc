"""LoopbackTransport: an in-process broker hub with the MQTT semantics edgeflow relies on.

For fast tests of round, fleet, OTA, secure-aggregation and hierarchy logic
without a broker (like httpx's ``MockTransport``): a :class:`LoopbackBroker`
stands for one broker, each :class:`LoopbackTransport` for one client
connection to it, and both keep the :class:`~edgeflow.transport.base.Transport`
contract::

    hub = LoopbackBroker()
    gw, dev = hub.transport("gateway"), hub.transport("pi-7")
    gw.subscribe("edgeflow/lab/+/update", on_update)
    gw.connect(); dev.connect()
    dev.publish("edgeflow/lab/pi-7/update", envelope).wait(1)
    hub.settle()            # every handler has run: nothing is still on its way

What it keeps from MQTT (and from :class:`~edgeflow.transport.mqtt.MqttTransport`):

- topic filters with ``+`` and ``#`` (``$``-topics not matched by a leading
  wildcard), validated exactly as the real transport validates them;
- retained messages: a subscription first receives the retained messages it
  matches (``Message.retain`` True), live messages arrive with ``retain``
  False, and an empty retained message clears the topic;
- QoS 0 and 1, delivered at the lower of the publish and subscription QoS.
  QoS 1 is at least once: a message is acknowledged to the hub only after its
  handler returned, and one a connection loss caught unacknowledged is
  delivered again on the resumed session. ``duplicate_qos1`` delivers QoS 1
  messages twice on purpose, to test idempotence;
- persistent sessions (``clean_start=False``, the default, as for
  MqttTransport): subscriptions and QoS 1 messages are kept while a client is
  away; a new connection with the same client id takes the session over (the
  old connection is dropped, its will published);
- shared subscriptions ``$share/<group>/<filter>``: each message goes to one
  connected member of the group (round robin); retained messages are not
  sent to shared subscriptions;
- wills: published by the hub when a connection ends without a clean close
  (:meth:`LoopbackTransport.close` with ``abort=True``, or
  :meth:`LoopbackBroker.disconnect`); a callable payload is read per connection;
- handlers and connection listeners run on the transport's one worker
  thread, in arrival order; messages are routed under the hub's lock, so
  every subscriber sees one global order;
- payloads over the transport's ``max_payload`` travel "chunked" like the
  real transport's (``Message.chunks`` > 1, one ``transfer_id``); a ``raw``
  publish over the hub's ``max_payload`` fails like a broker's PUBACK 0x95.

Faults, for the unhappy paths: :meth:`LoopbackBroker.drop` (messages vanish,
or are refused with an error), :meth:`LoopbackBroker.delay` (a slow link: the
message reaches the hub later), :meth:`LoopbackBroker.delay_ack` (subscribers
have it, the publisher's PUBACK comes late), :meth:`LoopbackBroker.disconnect` (a lost
connection, with or without an automatic reconnect) and
:class:`LoopbackBridge` (Mosquitto ``topic`` lines between two hubs).

Not modelled: the wire (bytes, TLS, websockets, packet sizes), keepalive,
session expiry (sessions live as long as the hub), QoS 2, MQTT 3.1.1
differences. The Mosquitto tests cover those on :class:`MqttTransport`.

:meth:`LoopbackBroker.settle` is the test's barrier: it returns once every
published message was routed, every handler returned and every delayed
message arrived, so "nothing more arrived" is asserted without sleeping.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import queue
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from edgeflow.errors import ConfigError, TransportError
from edgeflow.transport.base import Payload, WillSpec
from edgeflow.transport.dispatching import check_subscribe, deliver, queue_listeners
from edgeflow.transport.framing import check_publish
from edgeflow.transport.message import (
    ConnectionEvent,
    ConnectionListener,
    Delivery,
    Handler,
    Message,
    MessageProperties,
    Subscription,
)
from edgeflow.transport.topics import TopicFilter, match_filter, shared_group

__all__ = ["DEFAULT_MAX_PAYLOAD", "Fault", "LoopbackBridge", "LoopbackBroker", "LoopbackTransport"]

log = logging.getLogger("edgeflow.transport.loopback")

DEFAULT_MAX_PAYLOAD = 256 * 1024
"""As MqttTransport's: larger payloads count as chunked transfers."""

MessageMatch = Callable[[Message], bool]
_ids = itertools.count(1)


class LinkState(enum.Enum):
    """A loopback connection's state (the real transport's, less the wire's)."""

    IDLE = "idle"
    """Created, :meth:`LoopbackTransport.connect` not called yet."""
    CONNECTED = "connected"
    DOWN = "down"
    """The connection was lost; it reconnects when the fault says so."""
    CLOSED = "closed"


@dataclass
class Fault:
    """A rule installed by :meth:`LoopbackBroker.drop` or :meth:`LoopbackBroker.delay`."""

    kind: str
    match: MessageMatch
    times: int | None = None
    """Applies this many more times (None: until removed)."""
    delay_s: float = 0.0
    error: str | None = None
    hits: int = 0
    _broker: LoopbackBroker | None = field(default=None, repr=False)

    def remove(self) -> None:
        if self._broker is not None:
            self._broker._remove_fault(self)


@dataclass
class _Sub:
    filter: TopicFilter
    """As subscribed (``$share/...`` included)."""
    match: TopicFilter
    qos: int
    group: str | None
    retain_as_published: bool


@dataclass
class _Queued:
    """One message on its way to a session."""

    msg: Message
    qos: int
    ack_id: int = 0


@dataclass
class _Session:
    client_id: str
    persistent: bool
    subs: dict[str, _Sub] = field(default_factory=dict)
    pending: deque[_Queued] = field(default_factory=deque)
    inflight: dict[int, _Queued] = field(default_factory=dict)
    transport: LoopbackTransport | None = None
    generation: int = 0


def _message_match(what: str | TopicFilter | MessageMatch) -> MessageMatch:
    if callable(what):
        return what
    f = what if isinstance(what, TopicFilter) else TopicFilter(what)
    return lambda m: f.matches(m.topic)


class LoopbackBroker:
    """One in-process broker. See the module docstring.

    ``max_payload``: the largest message the hub accepts (a broker's
    ``message_size_limit``; None: no limit); ``duplicate_qos1``: deliver
    every QoS 1 message twice (or those for which it returns True).
    """

    def __init__(
        self,
        *,
        name: str = "loopback",
        max_payload: int | None = None,
        duplicate_qos1: bool | MessageMatch = False,
    ) -> None:
        self.name = name
        self.max_payload = max_payload
        self.duplicate_qos1 = duplicate_qos1
        self._lock = threading.RLock()
        self._sessions: dict[str, _Session] = {}
        self._retained: dict[str, Message] = {}
        self._faults: list[Fault] = []
        self._shared_turn: Counter[tuple[str, str]] = Counter()
        self._transports: list[LoopbackTransport] = []
        self._delayed = 0
        self._idle = threading.Condition(self._lock)
        self.stats: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"<LoopbackBroker {self.name} {len(self._sessions)} sessions, {len(self._retained)} retained>"

    # ------------------------------------------------------------ clients

    def transport(self, client_id: str | None = None, **options: object) -> LoopbackTransport:
        """A new (not yet connected) :class:`LoopbackTransport` on this hub."""
        return LoopbackTransport(self, client_id=client_id, **options)  # type: ignore[arg-type]

    def connected(self) -> list[str]:
        """Client ids connected now."""
        with self._lock:
            return sorted(s.client_id for s in self._sessions.values() if s.transport is not None)

    def retained(self, filter: str = "#") -> dict[str, bytes]:
        """The retained store (topic -> payload) under ``filter``."""
        f = TopicFilter(filter)
        with self._lock:
            return {t: m.payload for t, m in self._retained.items() if f.matches(t)}

    # ------------------------------------------------------------- faults

    def drop(self, match: str | TopicFilter | MessageMatch, *, times: int | None = None,
             error: str | None = None) -> Fault:
        """Drop published messages that ``match`` (a topic filter or a predicate).

        Without ``error`` the publisher's delivery succeeds and nobody
        receives the message (an ACL denial on MQTT 3.1.1, a lossy bridge);
        with ``error`` the delivery fails with TransportError(error) (an MQTT 5
        broker's refusal). ``times`` limits how often the rule applies.
        """
        return self._add_fault(Fault("drop", _message_match(match), times, error=error))

    def delay(self, match: str | TopicFilter | MessageMatch, seconds: float, *, times: int | None = None) -> Fault:
        """Matching messages reach the hub ``seconds`` later (a slow link); others are not held back."""
        if seconds < 0:
            raise ConfigError(f"delay must be >= 0 s, got {seconds}")
        return self._add_fault(Fault("delay", _message_match(match), times, delay_s=float(seconds)))

    def delay_ack(self, match: str | TopicFilter | MessageMatch, seconds: float, *,
                  times: int | None = None) -> Fault:
        """Matching messages reach their subscribers at once, but the publisher's
        acknowledgement (PUBACK) comes ``seconds`` later: a slow path back to the publisher,
        or a PUBACK lost with a connection and the message re-sent after the reconnect."""
        if seconds < 0:
            raise ConfigError(f"delay must be >= 0 s, got {seconds}")
        return self._add_fault(Fault("delay_ack", _message_match(match), times, delay_s=float(seconds)))

    def _add_fault(self, fault: Fault) -> Fault:
        fault._broker = self
        with self._lock:
            self._faults.append(fault)
        return fault

    def _remove_fault(self, fault: Fault) -> None:
        with self._lock:
            if fault in self._faults:
                self._faults.remove(fault)

    def _fault_for(self, msg: Message) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.match(msg):
                    f.hits += 1
                    if f.times is not None:
                        f.times -= 1
                        if f.times <= 0:
                            self._faults.remove(f)
                    return f
        return None

    def disconnect(self, client_id: str, *, reconnect_after: float | None = 0.0,
                   reason: str = "connection lost (loopback fault)") -> None:
        """Drop ``client_id``'s connection as a network failure would: its listeners see a
        disconnect, its will is published, unacknowledged QoS 1 messages wait for the
        resumed session. It reconnects after ``reconnect_after`` seconds (None: stays
        down until :meth:`reconnect`)."""
        with self._lock:
            session = self._sessions.get(client_id)
            t = session.transport if session is not None else None
        if t is None:
            raise TransportError(f"{client_id!r} is not connected to {self.name}")
        t._lost(reason, reconnect_after)

    def reconnect(self, client_id: str) -> None:
        """Bring back a transport that :meth:`disconnect` left down."""
        with self._lock:
            found = [t for t in self._transports if t.client_id == client_id and t.state is LinkState.DOWN]
        if not found:
            raise TransportError(f"no transport {client_id!r} is down on {self.name}")
        for t in found:
            t._reconnect()

    # ----------------------------------------------------------- barrier

    def settle(self, timeout: float = 10.0) -> None:
        """Return once every message published so far was routed and handled (handlers'
        own publishes included) and no delayed message is on its way; TransportError
        after ``timeout``. The test's replacement for "sleep and hope"."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                before = self.stats["routed"]
                transports = list(self._transports)
            for t in transports:
                if not t._wait_idle(deadline - time.monotonic()):
                    raise TransportError(f"{t.name}: handlers still busy after {timeout} s")
            with self._idle:
                if not self._idle.wait_for(lambda: self._delayed == 0, max(0.0, deadline - time.monotonic())):
                    raise TransportError(f"{self.name}: delayed messages still on their way after {timeout} s")
                if self.stats["routed"] == before and all(t._idle() for t in transports):
                    return
            if time.monotonic() >= deadline:
                raise TransportError(f"{self.name}: still busy after {timeout} s")

    # ----------------------------------------------------------- sessions

    def _connect(self, t: LoopbackTransport) -> bool:
        """Attach ``t`` to its session (taking it over from an older connection); returns
        whether the session was resumed. ``t._attached`` runs under the hub's lock before
        the session's queued messages are handed over, so its connect event comes first."""
        kicked: LoopbackTransport | None = None
        with self._lock:
            if t not in self._transports:
                self._transports.append(t)
            session = self._sessions.get(t.client_id)
            if session is not None and session.transport is not None and session.transport is not t:
                kicked = session.transport
        if kicked is not None:
            kicked._lost("session taken over by a new connection with the same client id", None)
        with self._lock:
            session = self._sessions.get(t.client_id)
            present = session is not None and session.persistent and not t.clean_start
            if session is None or not present:
                session = _Session(t.client_id, persistent=not t.clean_start)
                self._sessions[t.client_id] = session
            session.generation += 1
            session.transport = t
            t._attached(present, session.generation, {f: s.qos for f, s in session.subs.items()})
            backlog = list(session.pending)
            session.pending.clear()
            for q in backlog:
                self._hand(session, q.msg, q.qos, duplicate=False)
            self.stats["connects"] += 1
        return present

    def _detach(self, t: LoopbackTransport, *, will: bool) -> None:
        with self._lock:
            session = self._sessions.get(t.client_id)
            if session is None or session.transport is not t:
                return
            session.transport = None
            session.generation += 1
            if session.persistent:
                # unacknowledged QoS 1 messages come again on the resumed session, in order
                session.pending.extendleft(reversed([q for _, q in sorted(session.inflight.items())]))
            else:
                del self._sessions[t.client_id]
            session.inflight.clear()
            if will and t._will_message is not None:
                self.stats["wills"] += 1
                self._route(t._will_message, None)
            t._will_message = None

    def _forget(self, t: LoopbackTransport) -> None:
        with self._lock:
            if t in self._transports:
                self._transports.remove(t)

    def _subscribe(self, client_id: str, sub: _Sub) -> None:
        with self._lock:
            session = self._sessions.get(client_id)
            if session is None:
                return
            session.subs[sub.filter.value] = sub
            if sub.group is None:
                for topic, msg in sorted(self._retained.items()):
                    if sub.match.matches(topic):
                        self._hand(session, msg, min(msg.qos, sub.qos))

    def _unsubscribe(self, client_id: str, filters: list[str]) -> None:
        with self._lock:
            session = self._sessions.get(client_id)
            if session is not None:
                for f in filters:
                    session.subs.pop(f, None)

    def _ack(self, client_id: str, generation: int, ack_id: int) -> None:
        with self._lock:
            session = self._sessions.get(client_id)
            if session is not None and session.generation == generation:
                session.inflight.pop(ack_id, None)

    # ------------------------------------------------------------ routing

    def _publish(self, msg: Message, *, raw: bool) -> tuple[str | None, float]:
        """Accept one message; returns (an error text when the hub refuses it, seconds until
        the publisher's acknowledgement)."""
        if raw and self.max_payload is not None and len(msg.payload) > self.max_payload:
            self.stats["refused_size"] += 1
            return (f"broker rejected publish to {msg.topic}: packet too large (reason code 149); the message is "
                    "larger than the broker accepts: lower max_payload so it is chunked"), 0.0
        fault = self._fault_for(msg)
        if fault is not None and fault.kind == "drop":
            self.stats["dropped"] += 1
            return fault.error, 0.0
        if fault is not None and fault.kind == "delay":
            self._later(fault.delay_s, lambda: self._route(msg, None))
            return None, 0.0
        self._route(msg, None)
        return None, fault.delay_s if fault is not None and fault.kind == "delay_ack" else 0.0

    def _later(self, seconds: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` after ``seconds`` on a timer thread; :meth:`settle` waits for it."""
        with self._lock:
            self._delayed += 1

        def run() -> None:
            try:
                fn()
            finally:
                with self._idle:
                    self._delayed -= 1
                    self._idle.notify_all()

        timer = threading.Timer(seconds, run)
        timer.daemon = True
        timer.start()

    def _route(self, msg: Message, _sender: str | None) -> None:
        with self._lock:
            self.stats["routed"] += 1
            if msg.retain:
                if msg.payload:
                    self._retained[msg.topic] = msg
                else:
                    self._retained.pop(msg.topic, None)
            live = Message(msg.topic, msg.payload, msg.qos, False, msg.properties, msg.chunks, msg.transfer_id)
            groups: dict[tuple[str, str], list[tuple[_Session, _Sub]]] = {}
            for session in self._sessions.values():
                best: _Sub | None = None
                for sub in session.subs.values():
                    if not sub.match.matches(msg.topic):
                        continue
                    if sub.group is not None:
                        groups.setdefault((sub.group, sub.match.value), []).append((session, sub))
                    elif best is None or sub.qos > best.qos:
                        best = sub
                if best is not None:
                    self._hand(session, msg if best.retain_as_published else live, min(msg.qos, best.qos))
            for key, members in sorted(groups.items(), key=lambda kv: kv[0]):
                online = [m for m in members if m[0].transport is not None] or members
                online.sort(key=lambda m: m[0].client_id)
                turn = self._shared_turn[key]
                self._shared_turn[key] += 1
                session, sub = online[turn % len(online)]
                self._hand(session, live, min(msg.qos, sub.qos))

    def _hand(self, session: _Session, msg: Message, qos: int, *, duplicate: bool = True) -> None:
        """Give one message to a session: to its connection, or to its queue while it is away."""
        copies = 1
        if duplicate and qos == 1 and self.duplicate_qos1 and (self.duplicate_qos1 is True or self.duplicate_qos1(msg)):
            copies = 2
            self.stats["duplicated"] += 1
        if msg.qos != qos:
            msg = Message(msg.topic, msg.payload, qos, msg.retain, msg.properties, msg.chunks, msg.transfer_id)
        for _ in range(copies):
            if qos == 1:
                q = _Queued(msg, qos, next(_ids))
            else:
                q = _Queued(msg, qos)
            if session.transport is None:
                if qos == 1 and session.persistent:
                    session.pending.append(q)
                    self.stats["queued_offline"] += 1
                else:
                    self.stats["dropped_offline"] += 1
                continue
            if qos == 1:
                session.inflight[q.ack_id] = q
            session.transport._inbound(q, session.generation)
            self.stats["delivered"] += 1


class LoopbackTransport:
    """One client connection to a :class:`LoopbackBroker`; a
    :class:`~edgeflow.transport.base.Transport`. See the module docstring."""

    def __init__(
        self,
        broker: LoopbackBroker,
        *,
        client_id: str | None = None,
        name: str | None = None,
        clean_start: bool = False,
        will: WillSpec | None = None,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        retain_as_published: bool = False,
    ) -> None:
        if not isinstance(broker, LoopbackBroker):
            raise ConfigError(f"a LoopbackTransport needs a LoopbackBroker, got {type(broker).__name__}")
        if max_payload < 1024:
            raise ConfigError(f"max_payload {max_payload} is too small; use at least 1024 bytes")
        self.broker = broker
        self.client_id = client_id or f"edgeflow-{uuid.uuid4().hex[:12]}"
        self.name = name or self.client_id
        self.clean_start = clean_start
        self.will = will
        self.max_payload = int(max_payload)
        self.retain_as_published = retain_as_published
        self.state = LinkState.IDLE
        self._lock = threading.RLock()
        self._handlers: list[tuple[TopicFilter, Handler, bool, Subscription]] = []
        self._broker_filters: dict[str, int] = {}
        self._listeners: list[ConnectionListener] = []
        self._outbox: deque[tuple[Message, bool, Delivery]] = deque()
        self._connected = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._generation = 0
        self._will_message: Message | None = None
        self._work: queue.Queue[object] = queue.Queue()
        self._busy = 0
        self._worker: threading.Thread | None = None
        self._reconnect_timer: threading.Timer | None = None
        self._resubscribe: list[tuple[str, int]] = []
        self._flushing = False
        self._ever_connected = False
        self._stats: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"<LoopbackTransport {self.name} on {self.broker.name} {self.state.value}>"

    # ------------------------------------------------------------ status

    @property
    def is_connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._connected.wait(timeout)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
            out["queued_messages"] = len(self._outbox)
        return out

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def add_connection_listener(self, listener: ConnectionListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    # --------------------------------------------------------- lifecycle

    def connect(self, timeout: float | None = None, *, wait: bool = True) -> LoopbackTransport:
        """Connect to the hub (at once: there is no network); ``timeout`` and ``wait`` as for MqttTransport."""
        with self._lock:
            if self.state is LinkState.CLOSED:
                raise TransportError("this transport was closed; create a new LoopbackTransport")
            if self.state is not LinkState.IDLE:
                return self
            self._worker = threading.Thread(target=self._worker_loop, name=f"edgeflow-loopback-{self.name}",
                                            daemon=True)
            self._worker.start()
        self._attach()
        return self

    def _will_from(self) -> Message | None:
        w = self.will
        if w is None:
            return None
        payload = w.payload  # read once per connection (a per-session will computes it on each read)
        if callable(payload):
            payload = payload()
        data = payload.encode("utf-8") if isinstance(payload, str) else bytes(payload)
        return Message(str(w.topic), data, int(w.qos), bool(w.retain))

    def _attach(self) -> None:
        will = self._will_from()
        with self._lock:
            if self.state is LinkState.CLOSED:
                return
            self._will_message = will
        self.broker._connect(self)
        with self._lock:
            todo, self._resubscribe = self._resubscribe, []
        for f, q in todo:
            self._broker_subscribe(f, q)
        while True:
            with self._lock:
                if not self._outbox or self.state is not LinkState.CONNECTED:
                    self._flushing = False
                    self._changed.notify_all()
                    break
                msg, raw, delivery = self._outbox.popleft()
            self._send(msg, raw, delivery)

    def _attached(self, present: bool, generation: int, broker_subs: dict[str, int]) -> None:
        """Called by the hub, under its lock, when this connection is attached to its session."""
        with self._lock:
            self._generation = generation
            self.state = LinkState.CONNECTED
            if self._ever_connected:
                self._stats["reconnects"] += 1
            self._ever_connected = True
            self._resubscribe = [(f, q) for f, q in self._broker_filters.items()
                                 if not (present and broker_subs.get(f, -1) >= q)]
            self._flushing = bool(self._outbox)
            self._connected.set()
            self._changed.notify_all()
        self._notify(ConnectionEvent(True, present, "connected"))

    def _lost(self, reason: str, reconnect_after: float | None) -> None:
        with self._lock:
            if self.state is not LinkState.CONNECTED:
                return
            self.state = LinkState.DOWN
            self._connected.clear()
            self._changed.notify_all()
        self.broker._detach(self, will=True)
        log.info("%s: %s", self.name, reason)
        self._notify(ConnectionEvent(False, False, reason))
        if reconnect_after is not None:
            timer = threading.Timer(reconnect_after, self._reconnect)
            timer.daemon = True
            with self._lock:
                self._reconnect_timer = timer
            timer.start()

    def _reconnect(self) -> None:
        with self._lock:
            if self.state is not LinkState.DOWN:
                return
        self._attach()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued for a connection that is down; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._outbox or self.state is LinkState.CLOSED, timeout)

    def close(self, timeout: float = 5.0, *, flush: bool = True, abort: bool = False) -> None:
        """Stop. ``abort=True`` ends the connection like a crash: the hub publishes the will."""
        with self._lock:
            if self.state is LinkState.CLOSED:
                return
            was = self.state
        if flush and was is LinkState.CONNECTED:
            self.flush(timeout)
        with self._lock:
            self.state = LinkState.CLOSED
            self._connected.clear()
            timer = self._reconnect_timer
            backlog = list(self._outbox)
            self._outbox.clear()
            self._changed.notify_all()
        if timer is not None:
            timer.cancel()
        if was is LinkState.CONNECTED:
            self.broker._detach(self, will=abort)
        for msg, _raw, delivery in backlog:
            delivery.fail(TransportError(f"transport closed before {msg.topic} was delivered"))
        self._work.put(_STOP)
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout)
        self.broker._forget(self)

    def __enter__(self) -> LoopbackTransport:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------- publish

    def publish(
        self,
        topic: str,
        payload: Payload,
        *,
        qos: int = 1,
        retain: bool = False,
        properties: MessageProperties | None = None,
        raw: bool = False,
    ) -> Delivery:
        """Queue a message for the hub; the :class:`Delivery` completes once the hub took it."""
        if self.state is LinkState.CLOSED:
            raise TransportError("cannot publish: this transport is closed")
        check_publish(topic, qos, raw=raw, properties=properties)
        data = payload.encode("utf-8") if isinstance(payload, str) else bytes(payload)
        chunks, transfer = 1, None
        if not raw and len(data) > self.max_payload:
            chunks, transfer = math.ceil(len(data) / self.max_payload), uuid.uuid4().hex
        props: MessageProperties = dict(properties) if properties else {}  # type: ignore[assignment]
        if "user_properties" in props:
            items = props["user_properties"]
            pairs = items.items() if isinstance(items, dict) else items
            props["user_properties"] = {str(k): str(v) for k, v in pairs}
        msg = Message(topic, data, 1 if chunks > 1 else qos, retain, props, chunks, transfer)
        delivery = Delivery(topic, 1, len(data), msg.qos, transfer_id=transfer)
        self._count("published_messages")
        with self._lock:
            if self.state is not LinkState.CONNECTED or self._flushing:
                self._outbox.append((msg, raw, delivery))  # sent, in order, once connected
                return delivery
        self._send(msg, raw, delivery)
        return delivery

    def _send(self, msg: Message, raw: bool, delivery: Delivery) -> None:
        error, ack_after = self.broker._publish(msg, raw=raw)
        if error is not None:
            self._count("publish_rejected")
            delivery.fail(TransportError(error))
        elif ack_after > 0:
            self.broker._later(ack_after, lambda: delivery.frame_acked(0))
        else:
            delivery.frame_acked(0)
        with self._changed:
            self._changed.notify_all()

    # --------------------------------------------------------- subscribe

    def subscribe(
        self,
        filter: str | TopicFilter,
        handler: Handler,
        *,
        qos: int = 1,
        timeout: float | None = 10.0,
        include_empty: bool = False,
    ) -> Subscription:
        """Call ``handler(message)`` on the worker thread for every message matching ``filter``."""
        if self.state is LinkState.CLOSED:
            raise TransportError("cannot subscribe: this transport is closed")
        check_subscribe(qos, handler)
        f = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
        match = match_filter(f)
        sub = Subscription(f.value, handler, qos)
        with self._lock:
            self._handlers.append((match, handler, include_empty, sub))
            new = self._broker_filters.get(f.value, -1) < qos
            if new:
                self._broker_filters[f.value] = qos
            online = self.state is LinkState.CONNECTED
        if new and online:
            self._broker_subscribe(f.value, qos)
        return sub

    def _broker_subscribe(self, f: str, qos: int) -> None:
        with self._lock:
            if self._broker_filters.get(f) != qos:
                return  # unsubscribed (or re-subscribed at another QoS) meanwhile
        tf = TopicFilter(f)
        self.broker._subscribe(self.client_id, _Sub(tf, match_filter(tf), qos, shared_group(tf),
                                                     self.retain_as_published))

    def unsubscribe(self, sub: Subscription | str, *, timeout: float | None = 10.0) -> None:
        """Remove a handler (or every handler of a filter); the hub forgets the filter once unused."""
        target = sub.filter if isinstance(sub, Subscription) else str(sub)
        with self._lock:
            if isinstance(sub, Subscription):
                self._handlers = [h for h in self._handlers if h[3] is not sub]
            else:
                self._handlers = [h for h in self._handlers if h[3].filter != target]
            still = {h[3].filter for h in self._handlers}
            drop = [target] if target in self._broker_filters and target not in still else []
            for d in drop:
                del self._broker_filters[d]
        if drop:
            self.broker._unsubscribe(self.client_id, drop)

    # ------------------------------------------------------------ worker

    def _inbound(self, q: _Queued, generation: int) -> None:
        with self._lock:
            self._busy += 1
        self._work.put((q, generation))

    def _notify(self, event: ConnectionEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
            self._busy += len(listeners)
        queue_listeners(self._work, listeners, event)

    def _idle(self) -> bool:
        with self._lock:
            return self._busy == 0

    def _wait_idle(self, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._busy == 0, max(0.0, timeout))

    def _done(self) -> None:
        with self._changed:
            self._busy -= 1
            self._changed.notify_all()

    def _worker_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is _STOP:
                with self._changed:
                    self._busy = 0
                    self._changed.notify_all()
                return
            try:
                if isinstance(item, tuple):
                    q, generation = item
                    self._count("received_frames")
                    try:
                        self._dispatch(q.msg)
                    finally:
                        if q.qos == 1:
                            self.broker._ack(self.client_id, generation, q.ack_id)
                else:
                    try:
                        item()  # type: ignore[operator]
                    except Exception:  # noqa: BLE001 - a listener's bug must not stop the transport
                        log.exception("%s: connection listener failed", self.name)
            finally:
                self._done()

    def _dispatch(self, msg: Message) -> None:
        with self._lock:
            targets = [(h[1], h[2]) for h in self._handlers if h[0].matches(msg.topic)]
        deliver(msg, targets, self._count, self.name, log)


_STOP = object()


class LoopbackBridge:
    """Mosquitto-style bridge between two hubs: ``local`` is the site broker, ``remote``
    the central one, ``topics`` the bridge's ``topic`` lines (as
    :func:`edgeflow.broker.bridge.bridge_topics` writes them:
    ``topic <pattern> in|out|both <qos> <local prefix> <remote prefix>``).
    Retained flags cross the bridge as published."""

    def __init__(self, local: LoopbackBroker, remote: LoopbackBroker, topics: list[str], *,
                 name: str = "bridge") -> None:
        self.name = name
        self.local = local.transport(f"{name}-local", retain_as_published=True, max_payload=1 << 30)
        self.remote = remote.transport(f"{name}-remote", retain_as_published=True, max_payload=1 << 30)
        self.forwarded: Counter[str] = Counter()
        rules = [self._parse(line) for line in topics]
        for pattern, direction, qos, lp, rp in rules:
            if direction in ("in", "both"):
                self._route(self.remote, self.local, rp, lp, pattern, qos, "in")
            if direction in ("out", "both"):
                self._route(self.local, self.remote, lp, rp, pattern, qos, "out")

    @staticmethod
    def _parse(line: str) -> tuple[str, str, int, str, str]:
        parts = line.split()
        if parts[:1] == ["topic"]:
            parts = parts[1:]
        if len(parts) != 5 or parts[1] not in ("in", "out", "both") or parts[2] not in ("0", "1"):
            raise ConfigError(f"bridge topic line {line!r}: use 'topic <pattern> in|out|both <qos> <local> <remote>'")
        return parts[0], parts[1], int(parts[2]), parts[3], parts[4]

    def _route(self, src: LoopbackTransport, dst: LoopbackTransport, src_prefix: str, dst_prefix: str,
               pattern: str, qos: int, direction: str) -> None:
        def forward(msg: Message) -> None:
            topic = dst_prefix + msg.topic[len(src_prefix):]
            self.forwarded[direction] += 1
            dst.publish(topic, msg.payload, qos=min(qos, msg.qos), retain=msg.retain, properties=msg.properties)

        src.subscribe(src_prefix + pattern, forward, qos=qos, include_empty=True)

    def start(self) -> LoopbackBridge:
        self.remote.connect()
        self.local.connect()
        return self

    def stop(self) -> None:
        self.local.close(flush=False)
        self.remote.close(flush=False)
