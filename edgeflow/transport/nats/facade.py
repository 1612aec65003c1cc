"""NatsTransport: the public face of the NATS transport (a :class:`~edgeflow.transport.base.Transport`).

It checks arguments, queues publishes in the outbox (chunking large
payloads), keeps the handler table and waits for the server's answers; the
work happens in :mod:`.link` (the event-loop thread, the only code that
calls nats-py) and :mod:`.dispatch` (the worker thread).

How the MQTT contract maps onto NATS (docs/transport.md, "NATS"): topics
become subjects under a prefix (:mod:`.subjects`); QoS 1 is a JetStream
publish with its PubAck; retained messages live in a JetStream stream with
one message per subject; ``$share/<g>/<f>`` is a queue group; the last will
is a record in JetStream that :class:`~.will.WillKeeper` publishes when the
server reports the connection gone. What differs from MQTT: a subscriber
that is offline misses live (non-retained) messages, as with a clean MQTT
session; QoS 1 on the receiving side is at-least-once only while connected.
"""

from __future__ import annotations

import ssl
import threading
import uuid
from typing import Any

from edgeflow.errors import ConfigError, TransportError
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
from edgeflow.transport.limits import check_limits, payload_limit
from edgeflow.transport.dispatching import ConnectionListeners, Counters, check_subscribe
from edgeflow.transport.nats.dispatch import Dispatcher, HandlerTable, LocalHandler
from edgeflow.transport.nats.jetstream import NatsFrame
from edgeflow.transport.nats.link import CloseBudget, Link
from edgeflow.transport.nats.subjects import DEFAULT_PREFIX, check_prefix, filter_subjects
from edgeflow.transport.outbox import Outbox
from edgeflow.transport.topics import TopicFilter, chunk_filter, match_filter
from edgeflow.transport.url import parse_broker_url
from edgeflow.transport.framing import RetainedChunks, check_publish, publish_frames

__all__ = ["DEFAULT_MAX_PAYLOAD", "NatsTransport"]

DEFAULT_MAX_PAYLOAD = 256 * 1024
_MQTT_ONLY = ("protocol", "clean_start", "session_expiry_s", "keepalive", "websockets", "ws_path", "ws_headers")


class NatsTransport:
    """edgeflow's transport over NATS with JetStream (``nats://`` and ``tls://`` URLs).

    Typical use::

        with NatsTransport.from_url("nats://gw:4222", client_id="pi-7") as t:
            t.subscribe("edgeflow/lab/gateway/model", on_model)
            t.publish("edgeflow/lab/pi-7/update", envelope).wait(30)

    MQTT session options the callers pass to every transport (``protocol``,
    ``clean_start``, ``session_expiry_s``, ``keepalive``) have no NATS
    meaning and are accepted and ignored; websockets options are refused.

    ``upstream_check_s``: where the JetStream is another server's (a site's uplink account on a leaf
    node, its API mapped to the hub's domain; detected on connect), how often the link asks it for
    its account info, to notice the leaf connection gone and replay the hub's messages after it
    (docs/transport.md, "NATS leaf nodes"); 0 turns that off. Unused on a direct connection.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 4222,
        *,
        client_id: str | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: TlsConfig | None = None,
        will: WillSpec | None = None,
        prefix: str = DEFAULT_PREFIX,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_queued_bytes: int = 64 * 1024 * 1024,
        max_inflight: int = 20,
        ack_timeout_s: float = 5.0,
        reconnect_min_s: float = 0.5,
        reconnect_max_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        chunk_timeout_s: float = 300.0,
        max_transfer_bytes: int = 1 << 30,
        max_reassembly_bytes: int = 1 << 30,
        max_sender_bytes: int | None = None,
        accept_transfer: Any = None,
        create_streams: bool = True,
        live_max_age_s: float = 3600.0,
        live_max_bytes: int = 1 << 30,
        upstream_check_s: float = 1.0,
        name: str | None = None,
        **mqtt_options: Any,
    ) -> None:
        unknown = sorted(set(mqtt_options) - set(_MQTT_ONLY))
        if unknown:
            msg = f"NatsTransport got unknown option {unknown[0]!r}; see docs/transport.md, 'NATS'"
            raise ConfigError(msg)
        if mqtt_options.get("websockets"):
            raise ConfigError("websockets are an MQTT option; NATS URLs are nats:// or tls://")
        check_limits(max_payload=max_payload, max_inflight=max_inflight, port=port, server="NATS")
        self.host = host
        self.port = int(port)
        self.client_id = client_id or f"edgeflow-{uuid.uuid4().hex[:12]}"
        self.username = username
        self.password = password
        self.tls = tls
        self.will = will
        self.prefix = check_prefix(prefix)
        self.max_payload = int(max_payload)
        self.max_inflight = int(max_inflight)
        self.ack_timeout_s = float(ack_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.create_streams = create_streams
        self.live_max_age_s = float(live_max_age_s)
        self.live_max_bytes = int(live_max_bytes)
        self.upstream_check_s = float(upstream_check_s)
        self.name = name or self.client_id
        scheme = "tls" if tls is not None else "nats"
        host_part = f"[{host}]" if ":" in host else host
        self.servers = [f"{scheme}://{host_part}:{self.port}"]

        self._lock = threading.Lock()
        self._retained_chunks = RetainedChunks()
        self._counters = Counters()
        self._outbox = Outbox(max_queued_bytes)
        self._handlers = HandlerTable()
        self._reassembler = Reassembler(timeout_s=chunk_timeout_s, max_transfer_bytes=max_transfer_bytes,
                                        max_total_bytes=max_reassembly_bytes, max_sender_bytes=max_sender_bytes)
        self._dispatch = Dispatcher(self.name, self._handlers, self._reassembler, self._counters.add, accept_transfer)
        self._listeners = ConnectionListeners(self._dispatch.queue)
        self._link = Link(self, self._outbox, self._dispatch, self._counters.add,
                          Backoff(reconnect_min_s, max(reconnect_min_s, reconnect_max_s)))
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ setup

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> NatsTransport:
        """Build from a ``nats://`` or ``tls://`` URL (``user:password@`` allowed)."""
        addr = parse_broker_url(url)
        if addr.scheme not in ("nats", "tls"):
            msg = f"broker URL {url!r} is not a NATS URL; use nats://host:4222 or tls://host:4222"
            raise ConfigError(msg)
        if addr.tls and kwargs.get("tls") is None:
            kwargs["tls"] = TlsConfig()
        if kwargs.get("username") is None:
            kwargs["username"] = addr.username
        if kwargs.get("password") is None:
            kwargs["password"] = addr.password
        return cls(addr.host, addr.port, **kwargs)

    @property
    def url(self) -> str:
        return self.servers[0]

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for the next connection (None without TLS); read by the link when it connects."""
        tls = self.tls
        if tls is None:
            return None
        if tls.context is not None:
            return tls.context
        ctx = ssl.create_default_context(cafile=tls.ca_file)
        if tls.cert_file:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.insecure:
            ctx.check_hostname = False
        return ctx

    @property
    def is_connected(self) -> bool:
        return self._link.up

    @property
    def closing(self) -> bool:
        return self._closed

    @property
    def last_error(self) -> TransportError | None:
        return self._link.last_error

    @property
    def queued_bytes(self) -> int:
        return self._outbox.queued_bytes

    def stats(self) -> dict[str, int]:
        """Counters: published/delivered messages, frames acked and resent, chunk and error counts."""
        out = self._counters.snapshot()
        for k, v in list(self._reassembler.stats.items()):
            out[f"reassembly_{k}"] = v
        out.setdefault("published_messages", 0)
        out.setdefault("delivered_messages", 0)
        out["queued_bytes"] = self._outbox.queued_bytes
        out["reassembly_bytes"] = self._reassembler.bytes_buffered
        return out

    def add_connection_listener(self, listener: ConnectionListener) -> None:
        self._listeners.add(listener)

    def notify_connection(self, event: ConnectionEvent) -> None:
        """Tell the connection listeners (called by the link on connect, loss and reconnect)."""
        self._listeners.notify(event)

    # -------------------------------------------------------------- lifecycle

    def connect(self, timeout: float | None = None, *, wait: bool = True) -> NatsTransport:
        """Start; with ``wait`` block until connected (TransportError after ``timeout``, or at once for a
        refusal no retry can fix: bad credentials, TLS verification, missing stream rights)."""
        if self._closed:
            raise TransportError("this transport was closed; create a new NatsTransport")
        with self._lock:
            start = not self._started
            self._started = True
        if start:
            self._dispatch.start()
            self._link.start()
        if not wait:
            return self
        limit = self.connect_timeout_s if timeout is None else timeout
        ok = self._link.wait(lambda lk: lk.up or lk.fatal is not None, limit)
        if self._link.fatal is not None:
            err = self._link.fatal
            self.close(flush=False)
            raise err
        if not ok:
            last = self._link.last_error
            self.close(flush=False)
            detail = f": {last}" if last else ""
            raise TransportError(f"could not connect to NATS at {self.url} within {limit} s{detail}; "
                                 "is nats-server running there (with -js for JetStream)?")
        return self

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._link.wait(lambda lk: lk.up, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        return self._outbox.wait_empty(timeout)

    def close(self, timeout: float = 5.0, *, flush: bool = True, abort: bool = False) -> None:
        """Stop, within ``timeout``. ``flush`` waits for queued messages first (half the timeout at
        most); a normal close deletes the will record (the will is never published), ``abort=True``
        leaves it, like a crash. Every task the transport started (nats-py's too) is cancelled and
        awaited before its event loop is closed; what does not end in time is logged
        (:class:`~.link.CloseBudget`, docs/transport.md, "NATS")."""
        if self._closed:
            return
        budget = CloseBudget.of(timeout)
        if flush and self._started and self._link.up:
            self._outbox.wait_empty(budget.left(budget.flushed_by))
        self._closed = True
        self._link.close(budget, abort=abort)
        self._outbox.abandon()
        self._link.fail_inflight()
        self._dispatch.stop(budget.left(budget.end))
        self._link._set(up=False)

    def __enter__(self) -> NatsTransport:
        if not self._started:
            self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- publish

    def _limit(self, topic: str) -> int:
        overhead = len(topic.encode("utf-8")) * 2 + 1024  # subject, headers (ids, properties), chunk suffix
        return payload_limit(self.max_payload, self._link.server_max_payload, overhead)

    def publish(self, topic: str, payload: Payload, *, qos: int = 1, retain: bool = False,
                properties: MessageProperties | None = None, raw: bool = False) -> Delivery:
        """Queue a message and return its :class:`Delivery` (``.wait()`` blocks for the PubAcks).

        Payloads over the limit (``max_payload``, at most the server's ``max_payload``) go as chunks
        on ``<topic>/_chunk/<i>``, exactly as on MQTT; a retained chunked payload keeps every chunk
        retained. Works offline: frames wait in the byte-bounded queue.
        """
        if self._closed:
            raise TransportError("cannot publish: this transport is closed")
        check_publish(topic, qos, raw=raw, properties=properties)
        data = payload.encode("utf-8") if isinstance(payload, str) else bytes(payload)
        delivery, frames = publish_frames(topic, data, qos=qos, retain=retain, properties=properties, raw=raw,
                                          limit=self._limit(topic), frame=NatsFrame, retained=self._retained_chunks)
        self._outbox.put(frames, online=self._link.up)
        self._counters.add("published_messages")
        self._link.wake()
        return delivery

    # -------------------------------------------------------------- subscribe

    def subscribe(self, filter: str | TopicFilter, handler: Handler, *, qos: int = 1, timeout: float | None = 10.0,
                  include_empty: bool = False) -> Subscription:
        """Call ``handler(message)`` on the worker thread for every message matching ``filter``.

        The retained messages of the matching topics come first (not for ``$share/...``: MQTT sends
        none to shared subscriptions), then live ones. Chunked payloads arrive reassembled; the chunk
        sub-filter of a shared subscription is subscribed unshared (as on MQTT). Connected, waits for
        the server and raises TransportError if it refused the subscription; if it did not answer in
        time (the core subscription or the read of the retained stream timed out), TransportError
        says so too, but the subscription stays and is retried in the background with backoff
        (0.5 s doubling to 10 s) until it is made, as one made offline is (on connect, then so).
        """
        if self._closed:
            raise TransportError("cannot subscribe: this transport is closed")
        check_subscribe(qos, handler)
        f = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
        match = match_filter(f)
        group, subjects = filter_subjects(f, self.prefix)
        cf = chunk_filter(match)
        chunk_subjects = filter_subjects(cf, self.prefix)[1] if cf is not None else []
        sub = Subscription(f.value, handler, qos)
        local = LocalHandler(match, handler, include_empty, sub)
        parts = [(subjects, group, group is None)]
        if chunk_subjects:
            parts.append((chunk_subjects, None, group is None))
        self._handlers.add(local)
        self._link.start_thread()
        online = self._link.up
        wait_s = timeout if online else None
        try:  # the link answers within wait_s; the margin is for a loop that does not answer at all
            late = self._link.submit(self._link.register(local, parts, wait_s), None if wait_s is None else wait_s + 5)
        except TransportError:
            self._handlers.remove(sub)
            raise
        if late is not None:  # as MqttTransport without a SUBACK: the subscription stays, the caller is told
            msg = (f"subscription to {f.value} not made yet ({late}); it stays and is retried in the background "
                   "(unsubscribe() to stop)")
            raise TransportError(msg)
        return sub

    def unsubscribe(self, sub: Subscription | str, *, timeout: float | None = 10.0) -> None:
        """Remove a handler (or every handler of a filter) and its server-side subscriptions."""
        gone = self._handlers.remove(sub)
        subs = [s for h in gone for s in h.nats_subs]
        if subs and self._started and not self._closed:
            self._link.submit(self._link.unsubscribe(subs), timeout)

    def __repr__(self) -> str:
        state = "connected" if self.is_connected else ("closed" if self._closed else "disconnected")
        return f"<NatsTransport {self.name} {self.url} {state}>"
