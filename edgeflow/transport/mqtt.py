"""MqttTransport: the only module in edgeflow that imports paho-mqtt.

Threads. Two threads per transport, both owned here:

- the *network thread* is the only one that ever calls into paho. It runs
  its own select loop over paho's socket and a wake-up socket pair (paho's
  documented external-loop API: ``socket``/``want_write``/``loop_read``/
  ``loop_write``/``loop_misc``), connects and reconnects with exponential
  backoff and jitter, hands queued frames to paho within an in-flight
  window, and turns PUBACKs into delivery progress. Keeping paho on one
  thread avoids its lock-ordering pitfalls (``on_publish`` runs under
  paho's message lock).
- the *worker thread* runs reassembly and user handlers, one message at a
  time in arrival order. A slow handler therefore never delays keepalive
  pings or PUBACK processing. Incoming QoS 1 messages are acknowledged to
  the broker only after their handler returned (paho ``manual_ack``), so
  the broker's in-flight window (20 in Mosquitto) bounds how much can pile
  up behind a slow handler, and a crash before handling means redelivery,
  not loss.

Exactly once in effect: QoS 1 is at-least-once. Chunked payloads are
deduplicated by transfer id (see :mod:`~edgeflow.transport.chunking`), so
a handler sees one reassembled payload once; single-message payloads may be
redelivered after a reconnect and are deduplicated by the application
(``ReplayGuard`` on (device, round, seq) for updates, command ids for
commands).

Sessions and resume. By default the client uses a persistent session
(``clean_start=False``, ``session_expiry_s=3600``): the broker keeps its
subscriptions and queues QoS 1 messages while it is away. The transport,
not paho, owns retransmission: each connection gets a fresh paho client,
and frames the broker had not acknowledged (PUBACK) go back to the head of
the outbox and are re-sent after reconnect; acknowledged ones never are, so
an interrupted chunked publish resumes where it stopped.

Protocol. MQTT 5 first; if the broker answers "unsupported protocol
version" (or does not answer the very first CONNECT within 2 s) the
transport falls back to MQTT 3.1.1 (no properties, no PUBACK reason codes:
an ACL-denied publish then looks delivered).
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import ssl
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from edgeflow.errors import CodecError, ConfigError, TransportError
from edgeflow.transport.backoff import Backoff
from edgeflow.transport.base import Payload, WillSpec
from edgeflow.transport.chunking import HEADER_SIZE, Reassembler, Splitter
from edgeflow.transport.message import (
    ConnectionEvent,
    ConnectionListener,
    Delivery,
    Handler,
    Message,
    MessageProperties,
    Subscription,
    TlsConfig,
    check_properties,
)
from edgeflow.transport.outbox import Frame, Outbox
from edgeflow.transport.topics import (
    SHARED_PREFIX,
    Topic,
    TopicFilter,
    chunk_filter,
    chunk_topic,
    has_reserved_level,
    match_filter,
    split_chunk_topic,
)
from edgeflow.transport.url import parse_broker_url

__all__ = ["DEFAULT_MAX_PAYLOAD", "MqttTransport"]

log = logging.getLogger("edgeflow.transport")

DEFAULT_MAX_PAYLOAD = 256 * 1024
_FATAL_CONNACK = {
    133: "the broker rejected the client id",
    134: "bad user name or password",
    135: "not authorized",
    138: "this client is banned",
    140: "bad authentication method",
}
_PUBACK_HINTS = {
    135: "check the broker ACL: this user may not publish to that topic",
    149: "the message is larger than the broker accepts: lower max_payload so it is chunked",
    151: "the broker's quota is exceeded: publish less often",
    153: "the broker rejected the payload format",
}
_V5_PROBE_S = 2.0
"""How long a first MQTT 5 CONNECT waits for CONNACK before falling back to 3.1.1 (protocol="auto")."""
_V5 = paho.MQTTv5
_V311 = paho.MQTTv311
_RETRY_RC = frozenset({paho.MQTT_ERR_NO_CONN, paho.MQTT_ERR_CONN_LOST})
"""paho results that mean "no connection right now": the work waits for the next connection.
Everything else paho returns on publish/subscribe/unsubscribe is final."""


@dataclass
class _Handler:
    filter: TopicFilter
    """What messages are matched against (for ``$share/<group>/<f>``: ``<f>``)."""
    handler: Handler
    qos: int
    include_empty: bool
    sub: Subscription
    broker_filters: tuple[str, ...] = ()
    """The filters subscribed at the broker for this handler (the filter and its chunk filter)."""


@dataclass
class _BrokerSub:
    """One filter as the broker knows it (several handlers may share it)."""

    filter: TopicFilter
    qos: int
    acked: bool = False
    requested: int = -1
    """Connection generation in which SUBSCRIBE was last sent (avoids duplicate requests)."""
    waiters: list[threading.Event] = field(default_factory=list)
    error: TransportError | None = None


@dataclass
class _Raw:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    mid: int
    generation: int
    properties: dict[str, Any]


_STOP = object()


def _check_ws_options(path: str, headers: dict[str, str] | None) -> None:
    """Refuse what would corrupt the HTTP upgrade request (paho writes both into it verbatim)."""
    bad = ("\r", "\n", " ", "\t", "\0")
    if not isinstance(path, str) or not path.startswith("/") or any(c in path for c in bad):
        msg = f"websockets path {path!r} must start with '/' and contain no spaces or line breaks"
        raise ConfigError(msg)
    for key, value in (headers or {}).items():
        if (not isinstance(key, str) or not isinstance(value, str) or not key or ":" in key
                or any(c in key + value for c in ("\r", "\n", "\0"))):
            msg = f"websockets header {key!r}: {value!r} is not a valid HTTP header"
            raise ConfigError(msg)


def _fmt_reason(rc: Any) -> str:
    if isinstance(rc, ReasonCode):
        return f"{rc.getName()} (reason code {rc.value})"
    return str(rc)


def _rc_value(rc: Any) -> int:
    return int(rc.value) if isinstance(rc, ReasonCode) else int(rc)


class MqttTransport:
    """A robust MQTT client for edgeflow devices and gateways.

    Typical use::

        with MqttTransport.from_url("mqtt://gw:1883", client_id="pi-7") as t:
            t.subscribe("edgeflow/lab/gateway/model", on_model)
            t.publish("edgeflow/lab/pi-7/update", envelope).wait(30)

    Payloads above ``max_payload`` bytes are chunked transparently; the
    receiving transport delivers them to the handler as one :class:`Message`.
    See docs/transport.md for the topic scheme, QoS and reconnect behaviour.

    Websockets (``ws://``/``wss://``, or ``websockets=True``) carry the same
    MQTT bytes in binary websocket frames (subprotocol ``mqtt``), for devices
    whose network only lets HTTPS out: ``ws_path`` is the request target of
    the upgrade request (path and query), ``ws_headers`` extra HTTP headers
    (e.g. a proxy's authorization), and ``tls`` works exactly as for
    ``mqtts://``. Publishers whose subscribers sit on Mosquitto 2.0's
    websockets listener should keep ``max_payload`` near 4 KB (docs/transport.md).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        client_id: str | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: TlsConfig | None = None,
        websockets: bool = False,
        ws_path: str = "/mqtt",
        ws_headers: dict[str, str] | None = None,
        protocol: str = "auto",
        keepalive: int = 30,
        clean_start: bool = False,
        session_expiry_s: int = 3600,
        will: WillSpec | None = None,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_queued_bytes: int = 64 * 1024 * 1024,
        max_inflight: int = 20,
        reconnect_min_s: float = 0.5,
        reconnect_max_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        chunk_timeout_s: float = 300.0,
        max_transfer_bytes: int = 1 << 30,
        max_reassembly_bytes: int = 1 << 30,
        max_sender_bytes: int | None = None,
        accept_transfer: Callable[[str], bool] | None = None,
        max_pending_messages: int = 1000,
        name: str | None = None,
    ) -> None:
        if protocol not in ("auto", "5", "3.1.1"):
            msg = f"protocol must be 'auto', '5' or '3.1.1', got {protocol!r}"
            raise ConfigError(msg)
        if max_payload < HEADER_SIZE + 1024:
            msg = f"max_payload {max_payload} is too small; use at least {HEADER_SIZE + 1024} bytes"
            raise ConfigError(msg)
        if max_inflight < 1:
            raise ConfigError("max_inflight must be >= 1")
        if not 0 < int(port) < 65536:
            msg = f"broker port must be in 1..65535, got {port!r}"
            raise ConfigError(msg)
        _check_ws_options(ws_path, ws_headers)
        self.host = host
        self.port = int(port)
        self.client_id = client_id or f"edgeflow-{uuid.uuid4().hex[:12]}"
        self.username = username
        self.password = password
        self.tls = tls
        self.websockets = websockets
        self.ws_path = ws_path
        self.ws_headers = dict(ws_headers) if ws_headers else None
        self.protocol_choice = protocol
        self.keepalive = int(keepalive)
        self.clean_start = clean_start
        self.session_expiry_s = int(session_expiry_s)
        self.will = will
        self.max_payload = int(max_payload)
        self.max_inflight = int(max_inflight)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_pending_messages = max_pending_messages
        self.name = name or self.client_id
        self._backoff = Backoff(reconnect_min_s, max(reconnect_min_s, reconnect_max_s))
        self._outbox = Outbox(max_queued_bytes)
        self._reassembler = Reassembler(
            timeout_s=chunk_timeout_s, max_transfer_bytes=max_transfer_bytes, max_total_bytes=max_reassembly_bytes,
            max_sender_bytes=max_sender_bytes,
        )
        self.accept_transfer = accept_transfer
        """Optional filter on the base topic of an incoming chunked transfer: a gateway accepts only
        topics of provisioned devices, so made-up device ids on an open broker cannot take reassembly
        memory. Chunks of a refused topic are dropped before any buffer is allocated."""
        self._protocol = _V311 if protocol == "3.1.1" else _V5
        self._client: paho.Client | None = None

        self._lock = threading.RLock()
        self._stats: Counter[str] = Counter()
        self._handlers: list[_Handler] = []
        self._broker_subs: dict[str, _BrokerSub] = {}
        self._listeners: list[ConnectionListener] = []
        self._retained_chunks: dict[str, int] = {}

        # network-thread state
        self._cmds: deque[Callable[[], None]] = deque()
        self._inflight: dict[int, Frame] = {}
        self._early_acks: dict[int, Any] = {}
        self._pending_subacks: dict[int, list[str]] = {}
        self._pending_unsubacks: dict[int, list[str]] = {}
        self._unsubs: dict[str, list[threading.Event]] = {}
        # broker filters to unsubscribe (until UNSUBACK), with the callers waiting for it
        self._up = False
        self._generation = 0
        self._attempt_started: float | None = None
        self._attempt_done = True
        self._next_attempt = 0.0
        self._ever_connected = False
        self._server_max_packet: int | None = None
        self._server_receive_max: int | None = None
        self._session_present = False
        self._resubscribe = False
        self._closing = False
        self._abort = False
        self._probe = False
        self._client_used = False
        self._paho_error: str | None = None
        self._handing: Frame | None = None

        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._connected = threading.Event()
        self._first_outcome = threading.Event()
        self._fatal: TransportError | None = None
        self._last_error: TransportError | None = None
        self._started = False
        self._closed = False
        self._net_thread: threading.Thread | None = None
        self._worker_thread: threading.Thread | None = None
        self._work: queue.Queue[Any] = queue.Queue()

    # ------------------------------------------------------------------ setup

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> MqttTransport:
        """Build from ``mqtt://``, ``mqtts://``, ``ws://`` or ``wss://`` URL (user:password@ allowed)."""
        addr = parse_broker_url(url)
        if addr.tls and "tls" not in kwargs:
            kwargs["tls"] = TlsConfig()
        kwargs.setdefault("username", addr.username)
        kwargs.setdefault("password", addr.password)
        if addr.websockets:
            kwargs.setdefault("websockets", True)
            kwargs.setdefault("ws_path", addr.ws_path)
        return cls(addr.host, addr.port, **kwargs)

    @property
    def url(self) -> str:
        if self.websockets:
            return f"{'wss' if self.tls else 'ws'}://{self.host}:{self.port}{self.ws_path}"
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    @property
    def protocol_version(self) -> str:
        """``"5"`` or ``"3.1.1"``: what the current (or next) connection uses."""
        return "5" if self._protocol == _V5 else "3.1.1"

    @property
    def is_connected(self) -> bool:
        return self._connected.is_set()

    @property
    def last_error(self) -> TransportError | None:
        return self._last_error

    @property
    def queued_bytes(self) -> int:
        return self._outbox.queued_bytes

    def stats(self) -> dict[str, int]:
        """Counters: frames published/acked, messages received/delivered, chunk and error counts."""
        with self._lock:
            out = dict(self._stats)
        for k, v in list(self._reassembler.stats.items()):
            out[f"reassembly_{k}"] = v
        out["queued_bytes"] = self._outbox.queued_bytes
        out["reassembly_bytes"] = self._reassembler.bytes_buffered
        return out

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def add_connection_listener(self, listener: ConnectionListener) -> None:
        """Call ``listener(ConnectionEvent)`` (on the worker thread) on every connect/disconnect.

        Devices use it to publish their birth message after each reconnect.
        """
        with self._lock:
            self._listeners.append(listener)

    def _make_client(self) -> paho.Client:
        kwargs: dict[str, Any] = {
            "callback_api_version": paho.CallbackAPIVersion.VERSION2,
            "client_id": self.client_id,
            "protocol": self._protocol,
            "transport": "websockets" if self.websockets else "tcp",
            "manual_ack": True,
            "reconnect_on_failure": False,
        }
        if self._protocol != _V5:
            kwargs["clean_session"] = self.clean_start
        client = paho.Client(**kwargs)
        client.enable_logger(logging.getLogger("edgeflow.transport.paho"))
        client.max_inflight_messages_set(0)  # our own window; paho must never queue internally
        client.connect_timeout = self.connect_timeout_s
        if self.websockets:
            client.ws_set_options(path=self.ws_path, headers=self.ws_headers)
        if self.username is not None:
            client.username_pw_set(self.username, self.password)
        if self.tls is not None:
            if self.tls.context is not None:
                client.tls_set_context(self.tls.context)
            else:
                try:
                    client.tls_set(
                        ca_certs=self.tls.ca_file,
                        certfile=self.tls.cert_file,
                        keyfile=self.tls.key_file,
                        cert_reqs=ssl.CERT_REQUIRED,
                        tls_version=ssl.PROTOCOL_TLS_CLIENT,
                    )
                except (OSError, ssl.SSLError, ValueError) as exc:
                    msg = f"cannot load TLS files (ca {self.tls.ca_file}, cert {self.tls.cert_file}): {exc}"
                    raise ConfigError(msg) from exc
            if self.tls.insecure:
                client.tls_insecure_set(True)
        if self.will is not None:
            w = self.will
            props = None
            if self._protocol == _V5 and w.delay_s:
                props = Properties(PacketTypes.WILLMESSAGE)
                props.WillDelayInterval = int(w.delay_s)
            payload = w.payload  # read once per attempt (a per-session will computes it on each read): see Will
            if callable(payload):
                payload = payload()
            client.will_set(w.topic, payload, qos=w.qos, retain=w.retain, properties=props)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_unsubscribe = self._on_unsubscribe
        client.on_message = self._on_message
        client.on_log = self._on_log
        if self._protocol == _V5:
            props = Properties(PacketTypes.CONNECT)
            if self.session_expiry_s > 0:
                props.SessionExpiryInterval = self.session_expiry_s
            client.connect_async(
                self.host, self.port, self.keepalive, clean_start=self.clean_start, properties=props
            )
        else:
            client.connect_async(self.host, self.port, self.keepalive)
        return client

    # -------------------------------------------------------------- lifecycle

    def connect(self, timeout: float | None = None, *, wait: bool = True) -> MqttTransport:
        """Start the transport; by default wait until the broker accepted the connection.

        With ``wait=False`` it returns at once and keeps trying in the
        background (messages published meanwhile are queued). With waiting,
        a refusal that retrying cannot fix (bad password, not authorized,
        TLS verification) raises at once; other failures are retried until
        ``timeout`` (default ``connect_timeout_s``) and then raised.
        """
        if self._closed:
            raise TransportError("this transport was closed; create a new MqttTransport")
        if not self._started:
            self._started = True
            self._client = self._make_client()
            self._worker_thread = threading.Thread(target=self._worker_loop, name=f"edgeflow-mqtt-worker-{self.name}", daemon=True)
            self._net_thread = threading.Thread(target=self._net_loop, name=f"edgeflow-mqtt-net-{self.name}", daemon=True)
            self._worker_thread.start()
            self._net_thread.start()
        if not wait:
            return self
        limit = self.connect_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self._connected.is_set():
            if self._fatal is not None:
                err = self._fatal
                self.close(flush=False)
                raise err
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                last = self._last_error
                self.close(flush=False)
                detail = f": {last}" if last else ""
                msg = f"could not connect to MQTT broker at {self.url} within {limit} s{detail}"
                raise TransportError(msg)
            self._first_outcome.wait(min(remaining, 0.05))
            self._first_outcome.clear()
        return self

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._connected.wait(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued frame was acknowledged; False on timeout."""
        return self._outbox.wait_empty(timeout)

    def close(self, timeout: float = 5.0, *, flush: bool = True, abort: bool = False) -> None:
        """Stop the transport.

        ``flush`` first waits (up to ``timeout``) for queued messages while
        connected. A normal close sends DISCONNECT, so the broker does not
        publish the will. ``abort=True`` drops the TCP connection without
        DISCONNECT, exactly like a crash or power loss (the will is published).
        Deliveries still pending fail with TransportError.
        """
        if self._closed:
            return
        if flush and self._started and self._connected.is_set():
            self._outbox.wait_empty(timeout)
        self._closed = True
        self._abort = abort
        self._closing = True
        if self._net_thread is not None:
            self._wake()
            self._net_thread.join(timeout)
        for frame in self._outbox.drain():
            if frame.delivery is not None:
                frame.delivery._fail(TransportError(f"transport closed before {frame.topic} was delivered"))
        for frame in list(self._inflight.values()):
            if frame.delivery is not None:
                frame.delivery._fail(TransportError(f"transport closed before {frame.topic} was acknowledged"))
        self._inflight.clear()
        if self._worker_thread is not None:
            self._work.put(_STOP)
            self._worker_thread.join(timeout)
        self._connected.clear()
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> MqttTransport:
        if not self._started:
            self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- publish

    def _effective_max_payload(self, topic: str) -> int:
        limit = self.max_payload
        if self._server_max_packet:
            overhead = len(topic.encode("utf-8")) + 32 + 512  # topic, fixed header, chunk suffix, properties
            limit = min(limit, self._server_max_packet - overhead)
        return max(limit, HEADER_SIZE + 1024)

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
        """Queue a message and return its :class:`Delivery` (call ``.wait()`` to block for acks).

        Payloads over ``max_payload`` are split into chunks on
        ``<topic>/_chunk/<i>`` (QoS 1 regardless of ``qos``: a lost chunk
        would lose the payload). A retained chunked payload keeps every
        chunk retained, so late subscribers still receive it whole. Before
        it, the retained message on the topic itself is cleared; after it,
        retained chunks beyond its count left by an earlier, longer payload
        from this transport are cleared (a receiver would drop them anyway:
        they belong to an incomplete transfer). ``raw=True`` sends
        the payload as one message, unchunked, to any topic (tests, bridges).
        Works offline: frames wait in the byte-bounded queue.
        """
        if self._closed:
            raise TransportError("cannot publish: this transport is closed")
        if qos not in (0, 1):
            raise ConfigError(f"qos must be 0 or 1, got {qos!r} (edgeflow deduplicates QoS 1 instead of using QoS 2)")
        Topic(topic)
        if not raw and has_reserved_level(topic):
            msg = f"topic {topic!r}: the level '_chunk' is reserved for edgeflow's chunked transfers; rename the topic"
            raise ConfigError(msg)
        if properties:
            check_properties(properties)
        data = payload.encode("utf-8") if isinstance(payload, str) else bytes(payload)
        limit = self._effective_max_payload(topic)
        frames: list[Frame] = []
        if raw or len(data) <= limit:
            delivery = Delivery(topic, 1, len(data), qos)
            if retain and not raw:
                with self._lock:
                    previous = self._retained_chunks.pop(topic, 0)
                frames.extend(self._clear_frames(topic, 0, min(previous, 1)))
            frames.append(Frame(topic, qos, retain, len(data), 0, delivery, data=data, properties=properties))
        else:
            splitter = Splitter(data, limit)
            delivery = Delivery(topic, splitter.count, len(data), 1, transfer_id=splitter.transfer_id.hex())
            if retain:
                frames.append(Frame(topic, 1, True, 0, 0, None, data=b""))
            for i in range(splitter.count):
                frames.append(
                    Frame(
                        chunk_topic(topic, i), 1, retain, splitter.frame_size(i), i, delivery,
                        build=(lambda s=splitter, i=i: s.frame(i)), properties=properties,
                    )
                )
            if retain:
                with self._lock:
                    previous = self._retained_chunks.get(topic, 0)
                    self._retained_chunks[topic] = splitter.count
                frames.extend(self._clear_frames(topic, splitter.count, previous))
        self._outbox.put(frames, online=self._connected.is_set())
        self._count("published_messages")
        self._wake()
        return delivery

    def _clear_frames(self, topic: str, start: int, stop: int) -> list[Frame]:
        """Empty retained messages that delete retained chunks ``start..stop-1`` (best effort)."""
        return [Frame(chunk_topic(topic, i), 1, True, 0, i, None, data=b"") for i in range(start, max(start, stop))]

    # -------------------------------------------------------------- subscribe

    def subscribe(
        self,
        filter: str | TopicFilter,
        handler: Handler,
        *,
        qos: int = 1,
        timeout: float | None = 10.0,
        include_empty: bool = False,
    ) -> Subscription:
        """Call ``handler(message)`` on the worker thread for every message matching ``filter``.

        Chunked payloads arrive reassembled, as one message. Zero-length
        messages (MQTT's "delete retained message") are skipped unless
        ``include_empty``. If connected, waits up to ``timeout`` for the
        broker's SUBACK and raises TransportError if it refused the filter;
        offline, the subscription is made on connect. Subscriptions survive
        reconnects.

        MQTT 5 shared subscriptions (``$share/<group>/<filter>``): the broker
        hands each message to one member of the group. Chunked payloads
        cannot be shared that way (their chunks would go to different
        members), so the chunk sub-filter of a shared subscription is
        subscribed *unshared*: every member receives, reassembles and handles
        every chunked payload, and the application must deduplicate those
        (edgeflow's gateway does, by (round, device) in its store). Keep
        payloads that should be load-balanced under ``max_payload``.
        """
        if self._closed:
            raise TransportError("cannot subscribe: this transport is closed")
        if qos not in (0, 1):
            raise ConfigError(f"qos must be 0 or 1, got {qos!r}")
        if not callable(handler):
            raise ConfigError("handler must be callable: handler(message)")
        f = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
        match = match_filter(f)
        sub = Subscription(f.value, handler, qos)
        filters = [f] + ([cf] if (cf := chunk_filter(match)) is not None else [])
        waiter = threading.Event()
        new: list[_BrokerSub] = []
        with self._lock:
            self._handlers.append(_Handler(match, handler, qos, include_empty, sub, tuple(x.value for x in filters)))
            for flt in filters:
                bs = self._broker_subs.get(flt.value)
                if bs is None or bs.qos < qos:
                    bs = _BrokerSub(flt, max(qos, bs.qos if bs else 0))
                    self._broker_subs[flt.value] = bs
                    new.append(bs)
                elif not bs.acked:
                    new.append(bs)
            for bs in new:
                bs.waiters.append(waiter)
        if not new:
            return sub
        online = self._connected.is_set()  # before the hand-over: a drop during it must not end the wait
        self._call_net(lambda: self._send_subscribe([bs.filter.value for bs in new]))
        if timeout and online:
            deadline = time.monotonic() + timeout
            while not all(bs.acked or bs.error for bs in new):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    msg = f"no SUBACK for {f.value} within {timeout} s; the subscription is retried on reconnect"
                    raise TransportError(msg)
                waiter.wait(min(remaining, 0.1))
                waiter.clear()
            errors = [bs.error for bs in new if bs.error]
            if errors:
                self.unsubscribe(sub)
                raise errors[0]
        return sub

    def unsubscribe(self, sub: Subscription | str, *, timeout: float | None = 10.0) -> None:
        """Remove a handler (or every handler of a filter); unsubscribe at the broker when unused.

        The handler stops being called at once. If the broker-side
        subscription is dropped and the transport is connected, waits up to
        ``timeout`` for the broker's UNSUBACK (raises TransportError if none
        came: the unsubscribe is then retried on the next connection, which
        a resumed session needs — the broker kept the subscription). Offline,
        it is sent when the session is resumed (a new session has no
        subscription to remove).
        """
        target = sub.filter if isinstance(sub, Subscription) else str(sub)
        waiter = threading.Event()
        with self._lock:
            if isinstance(sub, Subscription):
                removed = [h for h in self._handlers if h.sub is sub]
            else:
                removed = [h for h in self._handlers if h.sub.filter == target]
            self._handlers = [h for h in self._handlers if all(h is not r for r in removed)]
            still = {bf for h in self._handlers for bf in h.broker_filters}
            if removed:
                candidates = [bf for h in removed for bf in h.broker_filters]
            else:
                cf = chunk_filter(match_filter(TopicFilter(target)))
                candidates = [target] + ([cf.value] if cf is not None else [])
            drop: list[str] = list(dict.fromkeys(c for c in candidates if c not in still))
            for d in drop:
                self._broker_subs.pop(d, None)
                self._unsubs[d] = self._unsubs.get(d, []) + [waiter]
        if not drop:
            return
        online = self._connected.is_set()  # before the hand-over: a drop during it must not end the wait
        self._call_net(lambda: self._send_unsubscribe(drop))
        if timeout and online:
            deadline = time.monotonic() + timeout
            while True:
                with self._lock:
                    pending = [d for d in drop if waiter in self._unsubs.get(d, ())]
                if not pending:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    msg = f"no UNSUBACK for {', '.join(pending)} within {timeout} s; the unsubscribe is retried on reconnect"
                    raise TransportError(msg)
                waiter.wait(min(remaining, 0.1))
                waiter.clear()

    # ------------------------------------------------------- network thread

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def _call_net(self, fn: Callable[[], None]) -> None:
        self._cmds.append(fn)
        self._wake()

    def _net_loop(self) -> None:
        try:
            self._net_loop_inner()
        except Exception:  # pragma: no cover - a bug; make it visible instead of silently dying
            log.exception("edgeflow MQTT network thread crashed; the transport is stopped")
            self._connected.clear()
            self._fatal = TransportError("the MQTT network thread crashed; see the log")
            self._first_outcome.set()

    def _net_loop_inner(self) -> None:
        assert self._client is not None
        while True:
            while self._cmds:
                self._cmds.popleft()()
            client = self._client
            if self._closing:
                self._shutdown_connection(client)
                return
            sock = client.socket()
            now = time.monotonic()
            if sock is None:
                if now < self._next_attempt:
                    self._idle(self._next_attempt - now)
                    continue
                self._attempt(client)
                continue
            if not self._up and self._attempt_started is not None:
                probing = self.protocol_choice == "auto" and self._protocol == _V5 and not self._ever_connected
                limit = min(self.connect_timeout_s, _V5_PROBE_S) if probing else self.connect_timeout_s
                if now - self._attempt_started > limit:
                    if probing:
                        # MQTT 3.1.1-only brokers such as amqtt may never answer an MQTT 5 CONNECT.
                        self._attempt_done = True
                        self._fallback(f"no CONNACK to an MQTT 5 CONNECT within {limit:.1f} s")
                    else:
                        self._attempt_failed(TransportError(f"no CONNACK from {self.url} within {limit} s"))
                        self._drop_socket(client)
                    continue
            if self._up:
                if self._resubscribe:
                    self._resubscribe = False
                    self._subscribe_after_connect()
                self._pump(client)
            want_write = client.want_write()
            timeout = 0.5 if self._up else 0.05
            try:
                readable, writable, _ = select.select(
                    [sock, self._wake_r], [sock] if want_write else [], [], timeout
                )
            except (OSError, ValueError):
                readable, writable = [sock], []
            if self._wake_r in readable:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            pending = getattr(sock, "pending", None)
            if sock in readable or (pending is not None and pending() > 0):
                client.loop_read()
            if client.socket() is not None and (sock in writable or client.want_write()):
                client.loop_write()
            if client.socket() is not None:
                client.loop_misc()

    def _idle(self, seconds: float) -> None:
        try:
            readable, _, _ = select.select([self._wake_r], [], [], max(0.0, min(seconds, 0.5)))
        except (OSError, ValueError):
            return
        if readable:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    def _attempt(self, client: paho.Client) -> None:
        if self._client_used:
            # A fresh paho client per connection: un-acked frames are re-sent from our own queue,
            # so paho must not also replay its copies of them.
            client = self._client = self._make_client()
        self._client_used = True
        self._paho_error = None
        self._attempt_started = time.monotonic()
        self._attempt_done = False
        try:
            client.reconnect()
        except ssl.SSLCertVerificationError as exc:
            msg = (
                f"TLS certificate of {self.url} failed verification: {exc.verify_message}; "
                "set TlsConfig.ca_file to the CA that signed the broker certificate and connect by the host "
                "name in that certificate"
            )
            self._attempt_failed(TransportError(msg), fatal=True)
        except ssl.SSLError as exc:
            if "ALERT" in str(exc).upper():
                # Over websockets paho reads the HTTP upgrade reply inside reconnect(), so the server's
                # alert (no or bad client certificate) surfaces here rather than as a disconnect.
                msg = (
                    f"the TLS listener at {self.url} rejected this client ({exc}); it probably requires a "
                    "client certificate signed by its CA: set TlsConfig.cert_file and key_file"
                )
                self._attempt_failed(TransportError(msg), fatal=True)
                return
            msg = f"TLS handshake with {self.url} failed: {exc}; check the broker's TLS listener and client certificate"
            self._attempt_failed(TransportError(msg))
        except ConnectionRefusedError:
            msg = f"connection refused by {self.url}: no MQTT broker is listening there; start one or fix host/port"
            self._attempt_failed(TransportError(msg))
        except socket.gaierror as exc:
            msg = f"cannot resolve broker host {self.host!r}: {exc}; check the host name"
            self._attempt_failed(TransportError(msg))
        except (OSError, ValueError) as exc:
            msg = f"cannot connect to {self.url}: {exc}"
            self._attempt_failed(TransportError(msg))

    def _attempt_failed(self, err: TransportError, *, fatal: bool = False) -> None:
        if self._attempt_done:
            return
        self._attempt_done = True
        self._attempt_started = None
        self._last_error = err
        self._count("connect_failures")
        if fatal and not self._ever_connected:
            self._fatal = err
        delay = self._backoff.next()
        self._next_attempt = time.monotonic() + delay
        level = logging.ERROR if fatal else logging.WARNING
        log.log(level, "%s: %s (retrying in %.1f s)", self.name, err, delay)
        self._first_outcome.set()

    def _drop_socket(self, client: paho.Client) -> None:
        """Close the TCP connection without DISCONNECT (paho then reports connection lost)."""
        sock = client.socket()
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            client.loop_read()
        except Exception:  # noqa: BLE001 - paho may raise on a dead socket; it is being dropped anyway
            pass

    def _shutdown_connection(self, client: paho.Client) -> None:
        if client.socket() is None:
            return
        if self._abort:
            self._drop_socket(client)
            return
        if self._up:
            client.disconnect()
            for _ in range(20):
                if client.socket() is None or not client.want_write():
                    break
                client.loop_write()
        self._drop_socket(client)

    def _fallback(self, why: str) -> None:
        """Switch to MQTT 3.1.1 and retry at once (only before the first successful connect)."""
        log.info("%s: %s; falling back to MQTT 3.1.1", self.name, why)
        old = self._client
        self._protocol = _V311
        self._client = self._make_client()
        self._client_used = False
        if old is not None:
            self._drop_socket(old)
        self._attempt_done = True
        self._attempt_started = None
        self._next_attempt = 0.0
        self._count("protocol_fallbacks")

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if client is not self._client:
            return
        if reason.is_failure:
            value = _rc_value(reason)
            if value == 132 and self.protocol_choice == "auto" and self._protocol == _V5 and not self._ever_connected:
                self._attempt_done = True
                self._cmds.append(lambda: self._fallback("broker does not support MQTT 5"))
                return
            fatal = value in _FATAL_CONNACK
            hint = _FATAL_CONNACK.get(value, "")
            who = f" as user {self.username!r}" if self.username else " anonymously"
            fix = "; check username/password and the broker's password file and ACL" if fatal else ""
            msg = f"broker at {self.url} refused the connection{who}: {hint or _fmt_reason(reason)}{fix}"
            self._attempt_failed(TransportError(msg), fatal=fatal)
            return
        self._attempt_done = True
        self._attempt_started = None
        self._up = True
        self._generation += 1
        self._backoff.reset()
        self._session_present = bool(getattr(flags, "session_present", False))
        if properties is not None:
            self._server_max_packet = getattr(properties, "MaximumPacketSize", None)
            self._server_receive_max = getattr(properties, "ReceiveMaximum", None)
        if self._ever_connected:
            self._count("reconnects")
        self._ever_connected = True
        self._last_error = None
        self._resubscribe = True
        self._connected.set()
        self._first_outcome.set()
        log.info(
            "%s: connected to %s (MQTT %s, session %s)", self.name, self.url, self.protocol_version,
            "resumed" if self._session_present else "new",
        )
        self._notify(ConnectionEvent(True, self._session_present, "connected"))

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if client is not self._client:
            return
        was_up = self._up
        self._up = False
        self._connected.clear()
        self._requeue_inflight(protocol_error=_rc_value(reason) == 130)
        self._pending_subacks.clear()
        self._pending_unsubacks.clear()
        if self._closing:
            return
        if not was_up:
            detail = self._paho_error or _fmt_reason(reason)
            tls_refusal = self.tls is not None and "ALERT" in detail.upper()
            if tls_refusal:
                msg = (
                    f"the TLS listener at {self.url} rejected this client ({detail}); it probably requires a "
                    "client certificate signed by its CA: set TlsConfig.cert_file and key_file"
                )
                self._attempt_failed(TransportError(msg), fatal=True)
                return
            if (
                self.protocol_choice == "auto" and self._protocol == _V5 and not self._ever_connected
                and not self._attempt_done
            ):
                self._attempt_done = True
                self._cmds.append(lambda: self._fallback("broker closed the connection before CONNACK"))
                return
            self._attempt_failed(TransportError(f"broker at {self.url} closed the connection before CONNACK ({detail})"))
            return
        delay = self._backoff.next()
        self._next_attempt = time.monotonic() + delay
        self._last_error = TransportError(f"connection to {self.url} lost: {_fmt_reason(reason)}")
        log.warning("%s: connection lost (%s); reconnecting in %.1f s", self.name, _fmt_reason(reason), delay)
        self._notify(ConnectionEvent(False, False, _fmt_reason(reason)))

    def _requeue_inflight(self, *, protocol_error: bool) -> None:
        """Put un-acknowledged frames back at the front of the queue, to re-send after reconnect.

        QoS 0 frames are dropped (at most once). A connection that paho
        dropped with a protocol error while frames were in flight may have
        been killed by one of them: Mosquitto answers a message over its
        ``message_size_limit`` with a PUBACK reason code (0x95) that paho
        cannot parse. Re-sending such a frame would loop forever, so after a
        protocol error frames are re-sent one at a time ("probe mode"), and a
        frame that is alone in flight at a second protocol error fails.
        """
        frames = list(self._inflight.values())
        handing = self._handing
        if handing is not None:  # on_disconnect from inside publish(): the frame being handed over
            frames.append(handing)
            self._handing = None
        self._inflight.clear()
        self._early_acks.clear()
        keep: list[Frame] = []
        for frame in frames:
            if frame.qos == 0:
                self._outbox.release(frame)
                if frame.delivery is not None:
                    frame.delivery._fail(TransportError(f"connection lost before QoS 0 message on {frame.topic} was sent"))
                continue
            if protocol_error and self._probe and len(frames) == 1:
                self._outbox.release(frame)
                self._count("publish_failures")
                msg = (
                    f"the broker dropped the connection twice while receiving a {frame.size}-byte message on "
                    f"{frame.topic}; it probably refuses it (message_size_limit?): lower max_payload so it is "
                    "chunked smaller; not retrying"
                )
                log.warning("%s: %s", self.name, msg)
                if frame.delivery is not None:
                    frame.delivery._fail(TransportError(msg))
                continue
            keep.append(frame)
        if protocol_error and keep:
            self._probe = True
        self._requeue(keep, handing=handing)

    def _requeue(self, frames: list[Frame], *, handing: Frame | None = None) -> None:
        """Put frames back at the head of the queue, in order, for the next connection.

        ``resent_frames`` counts the frames that reached paho and will go out
        a second time; ``handoff_retries`` the frame whose hand-over to paho
        met a lost connection (publish() returned "connection lost"/"no
        connection"): it waits for the next connection instead of failing
        its delivery.
        """
        if not frames:
            return
        self._outbox.push_front(frames)
        retried = sum(1 for f in frames if f is handing)
        self._count("resent_frames", len(frames) - retried)
        if retried:
            self._count("handoff_retries", retried)

    def _on_log(self, client: paho.Client, userdata: Any, level: int, buf: str) -> None:
        """Keep paho's last error (e.g. a TLS alert it swallowed) to explain the next disconnect."""
        if level == paho.MQTT_LOG_ERR and client is self._client:
            self._paho_error = buf

    def _props_out(self, props: dict[str, Any] | None) -> Properties | None:
        if not props or self._protocol != _V5:
            return None
        p = Properties(PacketTypes.PUBLISH)
        for key, value in props.items():
            if key == "response_topic":
                p.ResponseTopic = str(value)
            elif key == "correlation_data":
                p.CorrelationData = bytes(value)
            elif key == "content_type":
                p.ContentType = str(value)
            elif key == "message_expiry_s":
                p.MessageExpiryInterval = int(value)
            elif key == "user_properties":
                items = value.items() if isinstance(value, dict) else value
                p.UserProperty = [(str(k), str(v)) for k, v in items]
        return p

    @staticmethod
    def _props_in(props: Any) -> dict[str, Any]:
        if props is None:
            return {}
        out: dict[str, Any] = {}
        for attr, key in (
            ("ResponseTopic", "response_topic"),
            ("CorrelationData", "correlation_data"),
            ("ContentType", "content_type"),
            ("MessageExpiryInterval", "message_expiry_s"),
        ):
            if hasattr(props, attr):
                out[key] = getattr(props, attr)
        if hasattr(props, "UserProperty"):
            out["user_properties"] = dict(props.UserProperty)
        return out

    def _pump(self, client: paho.Client) -> None:
        window = 1 if self._probe else self.max_inflight
        if self._server_receive_max:
            window = min(window, int(self._server_receive_max))
        while len(self._inflight) < window and self._up and client is self._client and client.socket() is not None:
            frame = self._outbox.pop()
            if frame is None:
                return
            if self._server_max_packet and frame.size + len(frame.topic.encode("utf-8")) + 16 > self._server_max_packet:
                # The broker would drop the connection, and paho would re-send the message after every
                # reconnect: fail it here instead of looping forever.
                self._outbox.release(frame)
                self._count("publish_failures")
                msg = (
                    f"message of {frame.size} bytes on {frame.topic} exceeds the broker's maximum packet size "
                    f"({self._server_max_packet} bytes); publish without raw=True so it is chunked, or lower max_payload"
                )
                log.warning("%s: %s", self.name, msg)
                if frame.delivery is not None:
                    frame.delivery._fail(TransportError(msg))
                continue
            # paho writes to the socket inside publish(); if that write finds the connection gone it
            # runs on_disconnect before publish() returns. ``_handing`` lets _requeue_inflight put this
            # frame back in the queue together with the ones in flight, in order.
            self._handing = frame
            try:
                info = client.publish(
                    frame.topic, frame.payload(), qos=frame.qos, retain=frame.retain,
                    properties=self._props_out(frame.properties),
                )
            except (ValueError, ConfigError) as exc:
                if self._handing is None:  # requeued by a disconnect inside publish(); retried on reconnect
                    continue
                self._handing = None
                self._outbox.release(frame)
                self._count("publish_failures")
                if frame.delivery is not None:
                    frame.delivery._fail(TransportError(f"cannot publish to {frame.topic}: {exc}"))
                continue
            requeued = self._handing is None
            self._handing = None
            if info.rc in _RETRY_RC:
                # Not a final error: the connection is (being) lost. The frame waits for the next
                # connection, like every other unacknowledged frame.
                if not requeued:
                    self._requeue([frame], handing=frame)
                return
            if requeued:
                # publish() reported success although the connection dropped during it; the frame is
                # queued again (paho's copy dies with this client) and is sent after reconnect.
                return
            if info.rc != paho.MQTT_ERR_SUCCESS:
                self._outbox.release(frame)
                self._count("publish_failures")
                if frame.delivery is not None:
                    frame.delivery._fail(TransportError(f"paho refused publish to {frame.topic}: {paho.error_string(info.rc)}"))
                continue
            self._count("published_frames")
            early = self._early_acks.pop(info.mid, None)
            if early is not None:
                self._complete(frame, early)
            else:
                self._inflight[info.mid] = frame

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int, reason: Any, properties: Any) -> None:
        frame = self._inflight.pop(mid, None)
        if frame is None:
            self._early_acks[mid] = reason
            return
        self._complete(frame, reason)

    def _complete(self, frame: Frame, reason: Any) -> None:
        self._outbox.release(frame)
        failed = isinstance(reason, ReasonCode) and reason.is_failure
        if failed:
            value = _rc_value(reason)
            if frame.delivery is None:
                log.debug("%s: best-effort publish to %s refused: %s", self.name, frame.topic, _fmt_reason(reason))
                return
            self._count("publish_rejected")
            hint = _PUBACK_HINTS.get(value, "see the broker log")
            msg = f"broker rejected publish to {frame.topic}: {_fmt_reason(reason)}; {hint}"
            log.warning("%s: %s", self.name, msg)
            frame.delivery._fail(TransportError(msg))
            return
        self._count("acked_frames")
        self._probe = False
        if frame.delivery is not None:
            frame.delivery._ack(frame.index)

    def _subscribe_after_connect(self) -> None:
        with self._lock:
            unsubs = list(self._unsubs)
        if unsubs:
            if self._session_present:
                self._send_unsubscribe(unsubs)  # the broker kept the subscriptions: remove them now
            else:
                self._unsubscribed(unsubs)  # a new session has none
        with self._lock:
            subs = list(self._broker_subs.values())
            if not self._session_present:
                for bs in subs:
                    bs.acked = False
            todo = [bs.filter.value for bs in subs if not bs.acked]
        if todo:
            self._send_subscribe(todo)

    def _send_subscribe(self, filters: list[str]) -> None:
        if not self._up or self._client is None:
            return
        with self._lock:
            items = []
            for f in filters:
                bs = self._broker_subs.get(f)
                if bs is not None and bs.requested != self._generation:
                    bs.requested = self._generation
                    items.append((f, bs.qos))
        if not items:
            return
        if self._protocol == _V5:
            req: list[tuple[str, Any]] = [(f, SubscribeOptions(qos=q)) for f, q in items]
        else:
            req = list(items)
        rc, mid = self._client.subscribe(req)
        if rc == paho.MQTT_ERR_SUCCESS:
            self._pending_subacks[mid] = [f for f, _ in items]
        elif rc not in _RETRY_RC:
            err = TransportError(f"paho refused to subscribe {[f for f, _ in items]}: {paho.error_string(rc)}")
            log.warning("%s: %s", self.name, err)
            with self._lock:
                for f, _ in items:
                    bs = self._broker_subs.get(f)
                    if bs is not None:
                        bs.error = err
                        for w in bs.waiters:
                            w.set()
                        bs.waiters.clear()
        # else: the connection is being lost; re-sent on the next connection (new generation)

    def _on_subscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: list[Any], properties: Any) -> None:
        filters = self._pending_subacks.pop(mid, [])
        with self._lock:
            for f, rc in zip(filters, reasons):
                bs = self._broker_subs.get(f)
                if bs is None:
                    continue
                if isinstance(rc, ReasonCode) and rc.is_failure:
                    bs.error = TransportError(
                        f"broker refused subscription to {f}: {_fmt_reason(rc)}; check the broker ACL for this user"
                    )
                    log.warning("%s: %s", self.name, bs.error)
                else:
                    bs.acked = True
                    bs.error = None
                for w in bs.waiters:
                    w.set()
                bs.waiters.clear()

    def _send_unsubscribe(self, filters: list[str]) -> None:
        if not self._up or self._client is None:
            return  # sent by _subscribe_after_connect if the session is resumed
        with self._lock:
            again = [f for f in filters if f in self._unsubs and f in self._broker_subs]
            filters = [f for f in filters if f in self._unsubs and f not in self._broker_subs]
        self._unsubscribed(again)  # subscribed again before the UNSUBSCRIBE went out: nothing to remove
        if not filters:
            return
        rc, mid = self._client.unsubscribe(filters)
        if rc == paho.MQTT_ERR_SUCCESS:
            self._pending_unsubacks[mid] = filters
        elif rc not in _RETRY_RC:
            log.warning("%s: paho refused to unsubscribe %s: %s", self.name, filters, paho.error_string(rc))
            self._unsubscribed(filters)
        # else: the connection is being lost; retried after reconnect (resumed session) or moot (new one)

    def _unsubscribed(self, filters: list[str]) -> None:
        with self._lock:
            for f in filters:
                for w in self._unsubs.pop(f, []):
                    w.set()

    def _on_unsubscribe(self, client: paho.Client, userdata: Any, mid: int, *args: Any) -> None:
        if client is not self._client:
            return
        self._unsubscribed(self._pending_unsubacks.pop(mid, []))

    def _on_message(self, client: paho.Client, userdata: Any, msg: Any) -> None:
        self._count("received_frames")
        try:
            topic = msg.topic
        except UnicodeDecodeError:
            self._count("bad_topic")
            if msg.qos:
                client.ack(msg.mid, msg.qos)
            return
        if msg.qos == 0 and self._work.qsize() >= self.max_pending_messages:
            self._count("qos0_dropped")
            return
        raw = _Raw(topic, bytes(msg.payload), msg.qos, bool(msg.retain), msg.mid, self._generation,
                   self._props_in(getattr(msg, "properties", None)))
        self._work.put(raw)

    def _ack(self, raw: _Raw) -> None:
        if raw.qos and self._up and raw.generation == self._generation and self._client is not None:
            self._client.ack(raw.mid, raw.qos)

    # -------------------------------------------------------- worker thread

    def _notify(self, event: ConnectionEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            self._work.put(lambda fn=fn: fn(event))

    def _worker_loop(self) -> None:
        last_expire = time.monotonic()
        while True:
            try:
                item = self._work.get(timeout=1.0)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if now - last_expire >= 1.0:
                last_expire = now
                expired = self._reassembler.expire(now)
                if expired:
                    self._count("transfers_expired", len(expired))
            if item is None:
                continue
            if item is _STOP:
                return
            if isinstance(item, _Raw):
                try:
                    self._handle_raw(item)
                except Exception:  # noqa: BLE001 - a bug here must not stop the worker thread
                    self._count("worker_errors")
                    log.exception("%s: failed to process a message on %s", self.name, item.topic)
                finally:
                    if item.qos:
                        self._call_net(lambda r=item: self._ack(r))
            else:
                try:
                    item()
                except Exception:  # noqa: BLE001 - a listener's bug must not stop the transport
                    log.exception("%s: connection listener failed", self.name)

    def _handle_raw(self, raw: _Raw) -> None:
        split = split_chunk_topic(raw.topic)
        if split is not None:
            base, _index = split
            if not raw.payload:
                self._count("empty_skipped")
                return
            if self.accept_transfer is not None and not self.accept_transfer(base):
                self._count("chunks_refused_sender")
                return
            try:
                done = self._reassembler.add(base, raw.payload, retain=raw.retain, meta=raw.properties)
            except CodecError as exc:
                self._count("chunks_bad")
                log.warning("%s: dropped chunk on %s: %s", self.name, raw.topic, exc)
                if raw.retain and getattr(exc, "reason", "") == "retained" and not self._closed:
                    # a retained chunk where none belongs (a device's junk kept by the broker): clear it
                    # at the broker, once, so it stops costing every subscriber that connects
                    self._count("retained_cleared")
                    self.publish(raw.topic, b"", qos=1, retain=True, raw=True)
                return
            if done is None:
                return
            self._count("transfers_completed")
            self._dispatch(
                Message(base, done.payload, raw.qos, done.retain, done.meta or {}, done.chunks, done.transfer_id.hex())
            )
            return
        self._dispatch(Message(raw.topic, raw.payload, raw.qos, raw.retain, raw.properties))

    def _dispatch(self, msg: Message) -> None:
        with self._lock:
            handlers = [h for h in self._handlers if h.filter.matches(msg.topic)]
        if not msg.payload:
            handlers = [h for h in handlers if h.include_empty]
            if not handlers:
                self._count("empty_skipped")
                return
        if not handlers:
            self._count("unhandled")
            return
        self._count("delivered_messages")
        for h in handlers:
            try:
                h.handler(msg)
            except Exception:  # noqa: BLE001 - one handler's bug must not stop delivery
                self._count("handler_errors")
                log.exception("%s: handler %r failed on %s", self.name, h.handler, msg.topic)

    def __repr__(self) -> str:
        state = "connected" if self.is_connected else ("closed" if self._closed else "disconnected")
        return f"<MqttTransport {self.name} {self.url} MQTT {self.protocol_version} {state}>"

