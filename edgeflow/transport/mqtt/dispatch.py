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

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from edgeflow.errors import CodecError
from edgeflow.transport.chunking import Reassembler
from edgeflow.transport.dispatching import STOP, Counters, deliver, receive, run_worker
from edgeflow.transport.message import Delivery, Message, MessageProperties
from edgeflow.transport.mqtt.subscriptions import SubscriptionTable

__all__ = ["Dispatcher", "Inbound"]


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
            self.queue.put(STOP)
            self._thread.join(timeout)

    def qsize(self) -> int:
        return self.queue.qsize()

    def put(self, item: Inbound) -> None:
        self.queue.put(item)

    def _loop(self) -> None:
        run_worker(self.queue, inbound=Inbound, handle=self._handle, after=self._ack_handled,  # type: ignore[arg-type]
                   reassembler=self.reassembler, count=self._count, name=self._owner.name)

    def _ack_handled(self, item: Inbound) -> None:
        if item.qos:
            self.ack(item)

    def _handle(self, raw: Inbound) -> None:
        msg = receive(raw.topic, raw.payload, qos=raw.qos, retain=raw.retain, properties=raw.properties,
                      reassembler=self.reassembler, accept_transfer=self._owner.accept_transfer,
                      count=self._count, name=self._owner.name, on_bad=lambda exc: self._clear_junk(raw, exc))
        if msg is not None:
            self.dispatch(msg)

    def _clear_junk(self, raw: Inbound, exc: CodecError) -> None:
        if raw.retain and getattr(exc, "reason", "") == "retained" and not self._owner.closing:
            # a retained chunk where none belongs (a device's junk kept by the broker): clear it
            # at the broker, once, so it stops costing every subscriber that connects
            self._count("retained_cleared")
            self._owner.publish(raw.topic, b"", qos=1, retain=True, raw=True)

    def dispatch(self, msg: Message) -> None:
        deliver(msg, ((h.handler, h.include_empty) for h in self._subs.matching(msg.topic)), self._count,
                self._owner.name)
