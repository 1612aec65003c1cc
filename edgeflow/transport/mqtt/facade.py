"""MqttTransport: the public face of the MQTT transport (a :class:`~edgeflow.transport.base.Transport`).

It checks arguments, queues publishes in the outbox, records subscriptions
in the table and waits for the broker's answers; the work happens in its
collaborators, each in its own module:

- :mod:`.state`: the connection state (:class:`ConnState`) and counters;
- :mod:`.netloop`: the network thread, the only code that calls paho;
- :mod:`.dispatch`: the worker thread (reassembly, handlers, acks after handlers);
- :mod:`.subscriptions`: handlers and broker filters;
- :mod:`.options`: option checks, protocol constants, paho value mapping.

Exactly once in effect: QoS 1 is at least once. Chunked payloads are
deduplicated by transfer id, so a handler sees one reassembled payload once;
single-message payloads may be redelivered after a reconnect and are
deduplicated by the application (``ReplayGuard`` on (device, round, seq) for
updates, command ids for commands).

Sessions. By default the client uses a persistent session
(``clean_start=False``, ``session_expiry_s=3600``): the broker keeps its
subscriptions and queues QoS 1 messages while it is away.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho

from edgeflow.errors import TransportError
from edgeflow.transport.backoff import Backoff
from edgeflow.transport.base import Payload, WillSpec
from edgeflow.transport.chunking import Reassembler
from edgeflow.transport.message import (
    ConnectionEvent,
    ConnectionListener,
    Delivery,
    Handler,
    MessageProperties,
    Subscription,
    TlsConfig,
)
from edgeflow.transport.mqtt.dispatch import Dispatcher
from edgeflow.transport.mqtt.netloop import NetLoop
from edgeflow.transport.mqtt.options import DEFAULT_MAX_PAYLOAD, V5, V311, check_options
from edgeflow.transport.limits import payload_limit
from edgeflow.transport.dispatching import ConnectionListeners, Counters, check_subscribe
from edgeflow.transport.mqtt.state import ConnState, Link
from edgeflow.transport.mqtt.subscriptions import SubscriptionTable
from edgeflow.transport.outbox import Frame, Outbox
from edgeflow.transport.topics import TopicFilter
from edgeflow.transport.url import parse_broker_url
from edgeflow.transport.framing import RetainedChunks, check_publish, publish_frames

__all__ = ["MqttTransport"]


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
        check_options(protocol=protocol, max_payload=max_payload, max_inflight=max_inflight, port=port,
                      ws_path=ws_path, ws_headers=ws_headers)
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
        self.accept_transfer = accept_transfer
        """Optional filter on the base topic of an incoming chunked transfer: a gateway accepts only
        topics of provisioned devices, so made-up device ids on an open broker cannot take reassembly
        memory. Chunks of a refused topic are dropped before any buffer is allocated."""

        self._lock = threading.Lock()
        self._retained_chunks = RetainedChunks()
        self._counters = Counters()
        self._link = Link()
        self._outbox = Outbox(max_queued_bytes)
        self._subs = SubscriptionTable()
        self._reassembler = Reassembler(
            timeout_s=chunk_timeout_s, max_transfer_bytes=max_transfer_bytes, max_total_bytes=max_reassembly_bytes,
            max_sender_bytes=max_sender_bytes,
        )
        self._dispatch = Dispatcher(self, self._subs, self._reassembler, self._counters)
        self._listeners = ConnectionListeners(self._dispatch.queue)
        self._net = NetLoop(self, self._link, self._outbox, self._subs, self._dispatch, self._counters,
                            Backoff(reconnect_min_s, max(reconnect_min_s, reconnect_max_s)),
                            V311 if protocol == "3.1.1" else V5)
        self._dispatch.ack = self._net.ack_later  # handled QoS 1 messages are acknowledged by the network thread
        self._net_thread: threading.Thread | None = None

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
        return "5" if self._net.protocol == V5 else "3.1.1"

    @property
    def state(self) -> ConnState:
        """The connection's state (see :mod:`edgeflow.transport.mqtt.state`)."""
        return self._link.state

    @property
    def is_connected(self) -> bool:
        return self._link.up

    @property
    def closing(self) -> bool:
        """``close()`` was called: no new work is taken."""
        return self._link.ended

    @property
    def last_error(self) -> TransportError | None:
        return self._link.last_error

    @property
    def gave_up(self) -> TransportError | None:
        """The error for which the transport stopped reconnecting for good, e.g. a
        :class:`~edgeflow.errors.ClientIdTakenError` (another connection holds this client id);
        None while it still connects or retries."""
        return self._net.gave_up

    @property
    def queued_bytes(self) -> int:
        return self._outbox.queued_bytes

    def stats(self) -> dict[str, int]:
        """Counters: frames published/acked, messages received/delivered, chunk and error counts."""
        out = self._counters.snapshot()
        for k, v in list(self._reassembler.stats.items()):
            out[f"reassembly_{k}"] = v
        out["queued_bytes"] = self._outbox.queued_bytes
        out["reassembly_bytes"] = self._reassembler.bytes_buffered
        return out

    def add_connection_listener(self, listener: ConnectionListener) -> None:
        """Call ``listener(ConnectionEvent)`` (on the worker thread) on every connect/disconnect.

        Devices use it to publish their birth message after each reconnect.
        """
        self._listeners.add(listener)

    def notify_connection(self, event: ConnectionEvent) -> None:
        """Tell the connection listeners (called by the network loop on connect and disconnect)."""
        self._listeners.notify(event)

    def make_client(self) -> paho.Client:
        """The paho client for the next connection attempt (a seam for tests that wrap it)."""
        return self._net.build_client()

    # -------------------------------------------------------------- lifecycle

    def connect(self, timeout: float | None = None, *, wait: bool = True) -> MqttTransport:
        """Start the transport; by default wait until the broker accepted the connection.

        With ``wait=False`` it returns at once and keeps trying in the
        background (messages published meanwhile are queued). With waiting,
        a refusal that retrying cannot fix (bad password, not authorized,
        TLS verification) raises at once; other failures are retried until
        ``timeout`` (default ``connect_timeout_s``) and then raised.
        """
        link = self._link
        if link.ended:
            raise TransportError("this transport was closed; create a new MqttTransport")
        with self._lock:
            start = self._net_thread is None
            if start:
                self._net.client = self.make_client()
                self._net_thread = threading.Thread(target=self._net.run, name=f"edgeflow-mqtt-net-{self.name}",
                                                    daemon=True)
        if start:
            self._dispatch.start(self.name)
            assert self._net_thread is not None
            self._net_thread.start()
        if not wait:
            return self
        limit = self.connect_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not link.up:
            if link.fatal is not None:
                err = link.fatal
                self.close(flush=False)
                raise err
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                last = link.last_error
                self.close(flush=False)
                detail = f": {last}" if last else ""
                msg = f"could not connect to MQTT broker at {self.url} within {limit} s{detail}"
                raise TransportError(msg)
            link.wait_change(min(remaining, 0.05))
        return self

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._link.wait(lambda lk: lk.up, timeout)

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
        link = self._link
        if link.ended:
            return
        if flush and self._net_thread is not None and link.up:
            self._outbox.wait_empty(timeout)
        self._net.abort = abort
        if not link.close():
            return
        if self._net_thread is not None:
            self._net.wake()
            self._net_thread.join(timeout)
        self._outbox.abandon()
        self._net.fail_inflight()
        self._dispatch.stop(timeout)
        link.to(ConnState.CLOSED)
        self._net.close_sockets()

    def __enter__(self) -> MqttTransport:
        if self._net_thread is None:
            self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- publish

    def _effective_max_payload(self, topic: str) -> int:
        overhead = len(topic.encode("utf-8")) + 32 + 512  # topic, fixed header, chunk suffix, properties
        return payload_limit(self.max_payload, self._net.server_max_packet, overhead)

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
        if self._link.ended:
            raise TransportError("cannot publish: this transport is closed")
        check_publish(topic, qos, raw=raw, properties=properties)
        data = payload.encode("utf-8") if isinstance(payload, str) else bytes(payload)
        delivery, frames = publish_frames(topic, data, qos=qos, retain=retain, properties=properties, raw=raw,
                                          limit=self._effective_max_payload(topic), frame=Frame,
                                          retained=self._retained_chunks)
        self._outbox.put(frames, online=self._link.up)
        self._counters.add("published_messages")
        self._net.wake()
        return delivery

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
        if self._link.ended:
            raise TransportError("cannot subscribe: this transport is closed")
        check_subscribe(qos, handler)
        f = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
        sub, new, waiter = self._subs.add(f, handler, qos, include_empty)
        if not new:
            return sub
        online = self._link.up  # before the hand-over: a drop during it must not end the wait
        self._net.call(lambda: self._net.send_subscribe([bs.filter.value for bs in new]))
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
        drop, waiter = self._subs.remove(sub)
        if not drop:
            return
        online = self._link.up  # before the hand-over: a drop during it must not end the wait
        self._net.call(lambda: self._net.send_unsubscribe(drop))
        if timeout and online:
            deadline = time.monotonic() + timeout
            while True:
                pending = self._subs.unsubscribe_pending(drop, waiter)
                if not pending:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    msg = f"no UNSUBACK for {', '.join(pending)} within {timeout} s; the unsubscribe is retried on reconnect"
                    raise TransportError(msg)
                waiter.wait(min(remaining, 0.1))
                waiter.clear()

    def __repr__(self) -> str:
        state = "connected" if self.is_connected else ("closed" if self.closing else "disconnected")
        return f"<MqttTransport {self.name} {self.url} MQTT {self.protocol_version} {state}>"
