"""The NATS transport's worker thread: reassembly, duplicate suppression, handlers in arrival order.

The event-loop thread (:mod:`.link`) puts every received message here, in
the order the server delivered it; this thread runs the reassembler and the
user's handlers one message at a time, so a slow handler never stalls the
NATS connection (pings, acks). Connection listeners run here too, in order
with the messages.

Idempotent receipt: every frame a :class:`~.facade.NatsTransport` publishes
carries a ``Nats-Msg-Id``; a frame resent after a lost acknowledgement has
the same id, and this thread drops ids it has seen recently (a bounded LRU).
JetStream's duplicate window drops the same resend from the streams.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from edgeflow.transport.chunking import Reassembler
from edgeflow.transport.dispatching import STOP, deliver, receive, run_worker
from edgeflow.transport.message import (
    Handler,
    Message,
    MessageProperties,
    Subscription,
)
from edgeflow.transport.topics import TopicFilter

__all__ = ["Dispatcher", "HandlerTable", "Inbound", "LocalHandler"]


@dataclass
class Inbound:
    """One received NATS message, as the event-loop thread hands it over."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: MessageProperties
    msg_id: str | None = None


@dataclass
class LocalHandler:
    filter: TopicFilter
    """What topics are matched against (for ``$share/<g>/<f>``: ``<f>``)."""
    handler: Handler
    include_empty: bool
    sub: Subscription
    nats_subs: list[object] = field(default_factory=list)
    """The client's subscriptions that feed this handler (owned by the event-loop thread)."""
    removed: bool = False
    """Unsubscribed: a subscription still waiting for the connection (or a retry) is not made."""
    setup_timeouts: int = 0
    """Tries to make the subscription that the server did not answer in time (the first one is logged)."""


class HandlerTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handlers: list[LocalHandler] = []

    def add(self, h: LocalHandler) -> None:
        with self._lock:
            self._handlers.append(h)

    def remove(self, sub: Subscription | str) -> list[LocalHandler]:
        with self._lock:
            if isinstance(sub, Subscription):
                gone = [h for h in self._handlers if h.sub is sub]
            else:
                gone = [h for h in self._handlers if h.sub.filter == str(sub)]
            self._handlers = [h for h in self._handlers if all(h is not g for g in gone)]
            for g in gone:
                g.removed = True
        return gone

    def all(self) -> list[LocalHandler]:
        with self._lock:
            return list(self._handlers)

    def matching(self, topic: str) -> list[LocalHandler]:
        with self._lock:
            return [h for h in self._handlers if h.filter.matches(topic)]


class Dispatcher:
    def __init__(self, name: str, handlers: HandlerTable, reassembler: Reassembler,
                 count: Callable[..., None], accept_transfer: Callable[[str], bool] | None,
                 seen_ids: int = 10_000) -> None:
        self.name = name
        self._handlers = handlers
        self.reassembler = reassembler
        self._count = count
        self.accept_transfer = accept_transfer
        self.queue: queue.Queue[object] = queue.Queue()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_max = seen_ids
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"edgeflow-nats-worker-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        if self._thread is not None:
            self.queue.put(STOP)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)

    def put(self, item: Inbound) -> None:
        self.queue.put(item)

    def _loop(self) -> None:
        run_worker(self.queue, inbound=Inbound, handle=self._handle,  # type: ignore[arg-type]
                   reassembler=self.reassembler, count=self._count, name=self.name)

    def _duplicate(self, msg_id: str | None) -> bool:
        if not msg_id:
            return False
        if msg_id in self._seen:
            self._seen.move_to_end(msg_id)
            return True
        self._seen[msg_id] = None
        if len(self._seen) > self._seen_max:
            self._seen.popitem(last=False)
        return False

    def _handle(self, raw: Inbound) -> None:
        if not raw.retain and self._duplicate(raw.msg_id):
            self._count("duplicates_dropped")
            return
        msg = receive(raw.topic, raw.payload, qos=raw.qos, retain=raw.retain, properties=raw.properties,
                      reassembler=self.reassembler, accept_transfer=self.accept_transfer, count=self._count,
                      name=self.name)
        if msg is not None:
            self.dispatch(msg)

    def dispatch(self, msg: Message) -> None:
        deliver(msg, ((h.handler, h.include_empty) for h in self._handlers.matching(msg.topic)), self._count, self.name)
