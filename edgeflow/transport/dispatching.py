"""The receive side every transport shares: subscribe checks, the worker loop, chunks, delivery to handlers.

MQTT and NATS receive the same way: a network thread queues what arrives,
and one worker thread per transport runs, in arrival order, the reassembly of
chunked payloads and the user's handlers and connection listeners, so a slow
handler never stalls the connection. The loopback transport (no real chunks,
its own idle bookkeeping) shares the subscribe checks, listener queueing and
delivery. The rules of that side live here, once:

- :func:`check_subscribe`: the arguments of ``subscribe`` (QoS 0 or 1, a
  callable handler);
- :class:`ConnectionListeners` and :func:`queue_listeners`: connection
  listeners run on the worker, in order with the messages;
- :func:`run_worker`: the worker loop (expire stale transfers once a second,
  handle messages, call listeners; a bug in either never stops the thread);
- :func:`receive`: one received message as the :class:`Message` handlers
  see (a chunk goes into the reassembler, a complete transfer comes out);
- :func:`deliver`: a message to the matching handlers (empty payloads only to
  ``include_empty`` ones, a failing handler never stops the others);
- :class:`Counters`: the ``stats()`` counters, safe from any thread.

Transport-specific steps (MQTT's manual acks and clearing of junk retained
chunks, NATS's duplicate-id suppression) stay in each transport and plug in
through the arguments.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

from edgeflow.errors import CodecError, ConfigError
from edgeflow.transport.chunking import Reassembler
from edgeflow.transport.message import ConnectionEvent, ConnectionListener, Handler, Message, MessageProperties
from edgeflow.transport.topics import split_chunk_topic

__all__ = ["STOP", "ConnectionListeners", "Counters", "check_subscribe", "deliver", "queue_listeners", "receive", "run_worker"]

log = logging.getLogger("edgeflow.transport")

STOP = object()
"""Put on a worker's queue to end :func:`run_worker`."""

Count = Callable[..., None]
"""``count(key, n=1)``: bump one of the transport's counters."""


class Counters:
    """The transport's counters (``stats()``), safe to bump from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._c[key] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


def check_subscribe(qos: int, handler: object) -> None:
    """The arguments of a subscribe, checked the same way on every transport (ConfigError)."""
    if qos not in (0, 1):
        raise ConfigError(f"qos must be 0 or 1, got {qos!r}")
    if not callable(handler):
        raise ConfigError("handler must be callable: handler(message)")


def queue_listeners(work: queue.Queue[object], listeners: list[ConnectionListener], event: ConnectionEvent) -> None:
    """Queue one call per listener on the worker's queue (they run in order with the messages)."""
    for fn in listeners:
        work.put(lambda fn=fn: fn(event))


class ConnectionListeners:
    """A transport's connection listeners; :meth:`notify` queues one call of each on the worker's
    queue. Thread-safe."""

    def __init__(self, work: queue.Queue[object]) -> None:
        self._work = work
        self._lock = threading.Lock()
        self._listeners: list[ConnectionListener] = []

    def add(self, listener: ConnectionListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def notify(self, event: ConnectionEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
        queue_listeners(self._work, listeners, event)


def run_worker(work: queue.Queue[object], *, inbound: type, handle: Callable[[object], None],
               reassembler: Reassembler, count: Count, name: str,
               after: Callable[[object], None] | None = None) -> None:
    """The worker loop, until :data:`STOP`: an ``inbound`` item goes to ``handle`` (then ``after``, even
    if ``handle`` failed: an ack), anything else is a queued listener call. Stale transfers expire
    once a second."""
    last_expire = time.monotonic()
    while True:
        try:
            item = work.get(timeout=1.0)
        except queue.Empty:
            item = None
        now = time.monotonic()
        if now - last_expire >= 1.0:
            last_expire = now
            expired = reassembler.expire(now)
            if expired:
                count("transfers_expired", len(expired))
        if item is None:
            continue
        if item is STOP:
            return
        if isinstance(item, inbound):
            _handle_one(item, handle, count, name, after)
        else:
            try:
                item()  # type: ignore[operator]
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the transport
                log.exception("%s: connection listener failed", name)


def _handle_one(item: object, handle: Callable[[object], None], count: Count, name: str,
                after: Callable[[object], None] | None) -> None:
    try:
        handle(item)
    except Exception:  # noqa: BLE001 - a bug here must not stop the worker thread
        count("worker_errors")
        log.exception("%s: failed to process a message on %s", name, getattr(item, "topic", "?"))
    finally:
        if after is not None:
            after(item)


def receive(topic: str, payload: bytes, *, qos: int, retain: bool, properties: MessageProperties,
            reassembler: Reassembler, accept_transfer: Callable[[str], bool] | None, count: Count, name: str,
            on_bad: Callable[[CodecError], None] | None = None) -> Message | None:
    """What one received message means for the handlers: itself as a :class:`Message`, or, for a
    chunk on ``<base>/_chunk/<i>``, the whole payload once its transfer is complete (else None).
    Empty chunks (a cleared retained chunk), chunks from a refused sender and bad chunks are
    counted and dropped; ``on_bad`` runs after a bad chunk was counted and logged."""
    split = split_chunk_topic(topic)
    if split is None:
        return Message(topic, payload, qos, retain, properties)
    base, _index = split
    if not payload:
        count("empty_skipped")
        return None
    if accept_transfer is not None and not accept_transfer(base):
        count("chunks_refused_sender")
        return None
    try:
        done = reassembler.add(base, payload, retain=retain, meta=properties)
    except CodecError as exc:
        count("chunks_bad")
        log.warning("%s: dropped chunk on %s: %s", name, topic, exc)
        if on_bad is not None:
            on_bad(exc)
        return None
    if done is None:
        return None
    count("transfers_completed")
    return Message(base, done.payload, qos, done.retain, done.meta or {}, done.chunks, done.transfer_id.hex())


def deliver(msg: Message, targets: Iterable[tuple[Handler, bool]], count: Count, name: str,
            logger: logging.Logger = log) -> None:
    """Call each ``(handler, include_empty)`` of the subscriptions matching ``msg.topic`` in order.

    An empty payload (a cleared retained message) goes only to ``include_empty`` handlers; one
    handler's exception is counted and logged (on ``logger``), and the others still run."""
    handlers = list(targets)
    if not msg.payload:
        handlers = [t for t in handlers if t[1]]
        if not handlers:
            count("empty_skipped")
            return
    if not handlers:
        count("unhandled")
        return
    count("delivered_messages")
    for handler, _empty in handlers:
        try:
            handler(msg)
        except Exception:  # noqa: BLE001 - one handler's bug must not stop delivery
            count("handler_errors")
            logger.exception("%s: handler %r failed on %s", name, handler, msg.topic)
