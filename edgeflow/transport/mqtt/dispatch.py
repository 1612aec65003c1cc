"""The dispatcher: the transport's worker thread.

It runs reassembly and user handlers, one message at a time in arrival
order, so a slow handler never delays keepalive pings or PUBACK processing
on the network thread. Incoming QoS 1 messages are acknowledged to the
broker only after their handler returned (paho ``manual_ack``): the broker's
in-flight window (20 in Mosquitto) bounds how much can pile up behind a slow
handler, and a crash before handling means redelivery, not loss. Connection
listeners run here too, in order with the messages.

Chunked payloads are deduplicated by transfer id (see
:mod:`~edgeflow.transport.chunking`): a handler sees one reassembled payload
once. Single-message payloads may be redelivered after a reconnect and are
deduplicated by the application.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from edgeflow.errors import CodecError
from edgeflow.transport.chunking import Reassembler
from edgeflow.transport.message import ConnectionEvent, ConnectionListener, Delivery, Message, MessageProperties
from edgeflow.transport.mqtt.state import Counters
from edgeflow.transport.mqtt.subscriptions import SubscriptionTable
from edgeflow.transport.topics import split_chunk_topic

__all__ = ["Dispatcher", "Inbound"]

log = logging.getLogger("edgeflow.transport")


@dataclass
class Inbound:
    """One received MQTT message, as the network thread hands it over."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    mid: int
    generation: int
    properties: MessageProperties


class Owner(Protocol):
    """What the dispatcher needs from its transport."""

    name: str
    accept_transfer: Callable[[str], bool] | None

    @property
    def closing(self) -> bool: ...

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                raw: bool = False) -> Delivery: ...


_STOP = object()


class Dispatcher:
    def __init__(self, owner: Owner, subs: SubscriptionTable, reassembler: Reassembler, counters: Counters) -> None:
        self._owner = owner
        self._subs = subs
        self.reassembler = reassembler
        self._count = counters.add
        self.ack: Callable[[Inbound], None] = lambda raw: None
        """Acknowledge a handled QoS 1 message (the transport sets the network loop's)."""
        self.queue: queue.Queue[object] = queue.Queue()
        """Inbound messages and listener calls, in arrival order (the network thread puts here)."""
        self._thread: threading.Thread | None = None

    def start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"edgeflow-mqtt-worker-{name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        if self._thread is not None:
            self.queue.put(_STOP)
            self._thread.join(timeout)

    def qsize(self) -> int:
        return self.queue.qsize()

    def put(self, item: Inbound) -> None:
        self.queue.put(item)

    def notify(self, listeners: list[ConnectionListener], event: ConnectionEvent) -> None:
        for fn in listeners:
            self.queue.put(lambda fn=fn: fn(event))

    def _loop(self) -> None:
        last_expire = time.monotonic()
        while True:
            try:
                item = self.queue.get(timeout=1.0)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if now - last_expire >= 1.0:
                last_expire = now
                expired = self.reassembler.expire(now)
                if expired:
                    self._count("transfers_expired", len(expired))
            if item is None:
                continue
            if item is _STOP:
                return
            if isinstance(item, Inbound):
                try:
                    self._handle(item)
                except Exception:  # noqa: BLE001 - a bug here must not stop the worker thread
                    self._count("worker_errors")
                    log.exception("%s: failed to process a message on %s", self._owner.name, item.topic)
                finally:
                    if item.qos:
                        self.ack(item)
            else:
                try:
                    item()  # type: ignore[operator]
                except Exception:  # noqa: BLE001 - a listener's bug must not stop the transport
                    log.exception("%s: connection listener failed", self._owner.name)

    def _handle(self, raw: Inbound) -> None:
        split = split_chunk_topic(raw.topic)
        if split is not None:
            base, _index = split
            if not raw.payload:
                self._count("empty_skipped")
                return
            accept = self._owner.accept_transfer
            if accept is not None and not accept(base):
                self._count("chunks_refused_sender")
                return
            try:
                done = self.reassembler.add(base, raw.payload, retain=raw.retain, meta=raw.properties)
            except CodecError as exc:
                self._count("chunks_bad")
                log.warning("%s: dropped chunk on %s: %s", self._owner.name, raw.topic, exc)
                if raw.retain and getattr(exc, "reason", "") == "retained" and not self._owner.closing:
                    # a retained chunk where none belongs (a device's junk kept by the broker): clear it
                    # at the broker, once, so it stops costing every subscriber that connects
                    self._count("retained_cleared")
                    self._owner.publish(raw.topic, b"", qos=1, retain=True, raw=True)
                return
            if done is None:
                return
            self._count("transfers_completed")
            self.dispatch(
                Message(base, done.payload, raw.qos, done.retain, done.meta or {}, done.chunks, done.transfer_id.hex())
            )
            return
        self.dispatch(Message(raw.topic, raw.payload, raw.qos, raw.retain, raw.properties))

    def dispatch(self, msg: Message) -> None:
        handlers = self._subs.matching(msg.topic)
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
                log.exception("%s: handler %r failed on %s", self._owner.name, h.handler, msg.topic)
