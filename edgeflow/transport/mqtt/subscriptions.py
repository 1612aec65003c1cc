"""The subscription table: local handlers, the filters the broker knows, pending unsubscribes.

Two views of one table, under one lock:

- *handlers* (what the worker thread calls): a filter to match against (for
  ``$share/<g>/<f>``: ``<f>``), the handler, its QoS and ``include_empty``;
- *broker filters* (what the network thread subscribes): each filter once,
  at the highest QoS any handler asked for, with the chunk sub-filter of
  chunked payloads beside it; acknowledged or not, and who waits for the
  SUBACK. A filter no handler uses any more is *unsubscribing* until its
  UNSUBACK (or until a new session makes it moot).

No paho here: the network thread sends what :meth:`to_subscribe` and
:meth:`to_unsubscribe` return and reports the broker's answers back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from edgeflow.errors import TransportError
from edgeflow.transport.message import Handler, Subscription
from edgeflow.transport.topics import TopicFilter, chunk_filter, match_filter

__all__ = ["BrokerSub", "LocalHandler", "SubscriptionTable"]


@dataclass
class LocalHandler:
    filter: TopicFilter
    """What messages are matched against (for ``$share/<group>/<f>``: ``<f>``)."""
    handler: Handler
    qos: int
    include_empty: bool
    sub: Subscription
    broker_filters: tuple[str, ...] = ()
    """The filters subscribed at the broker for this handler (the filter and its chunk filter)."""


@dataclass
class BrokerSub:
    """One filter as the broker knows it (several handlers may share it)."""

    filter: TopicFilter
    qos: int
    acked: bool = False
    requested: int = -1
    """Connection generation in which SUBSCRIBE was last sent (avoids duplicate requests)."""
    waiters: list[threading.Event] = field(default_factory=list)
    error: TransportError | None = None


class SubscriptionTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handlers: list[LocalHandler] = []
        self._broker: dict[str, BrokerSub] = {}
        self._unsubs: dict[str, list[threading.Event]] = {}
        """Broker filters to unsubscribe (until UNSUBACK), with the callers waiting for it."""

    # ----------------------------------------------------------- callers

    def add(self, f: TopicFilter, handler: Handler, qos: int, include_empty: bool
            ) -> tuple[Subscription, list[BrokerSub], threading.Event]:
        """Register a handler; returns its handle, the broker filters that need a SUBSCRIBE
        (new, upgraded or not yet acknowledged) and the event set on their answers."""
        match = match_filter(f)
        sub = Subscription(f.value, handler, qos)
        filters = [f] + ([cf] if (cf := chunk_filter(match)) is not None else [])
        waiter = threading.Event()
        new: list[BrokerSub] = []
        with self._lock:
            self._handlers.append(LocalHandler(match, handler, qos, include_empty, sub, tuple(x.value for x in filters)))
            for flt in filters:
                bs = self._broker.get(flt.value)
                if bs is None or bs.qos < qos:
                    bs = BrokerSub(flt, max(qos, bs.qos if bs else 0))
                    self._broker[flt.value] = bs
                    new.append(bs)
                elif not bs.acked:
                    new.append(bs)
            for bs in new:
                bs.waiters.append(waiter)
        return sub, new, waiter

    def remove(self, sub: Subscription | str) -> tuple[list[str], threading.Event]:
        """Drop a handler (or every handler of a filter); returns the broker filters now
        unused (to unsubscribe) and the event set when their UNSUBACK came."""
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
                self._broker.pop(d, None)
                self._unsubs[d] = self._unsubs.get(d, []) + [waiter]
        return drop, waiter

    def unsubscribe_pending(self, filters: list[str], waiter: threading.Event) -> list[str]:
        """Those of ``filters`` whose UNSUBACK ``waiter`` still waits for."""
        with self._lock:
            return [d for d in filters if waiter in self._unsubs.get(d, ())]

    def matching(self, topic: str) -> list[LocalHandler]:
        with self._lock:
            return [h for h in self._handlers if h.filter.matches(topic)]

    # ----------------------------------------------------- network thread

    def after_connect(self, session_present: bool) -> tuple[list[str], list[str], list[str]]:
        """On a new connection: (filters to unsubscribe now, unsubscribes a new session made
        moot, filters to subscribe). A resumed session keeps the broker's subscriptions."""
        with self._lock:
            unsubs = list(self._unsubs)
            subs = list(self._broker.values())
            if not session_present:
                for bs in subs:
                    bs.acked = False
            todo = [bs.filter.value for bs in subs if not bs.acked]
        if session_present:
            return unsubs, [], todo
        return [], unsubs, todo

    def to_subscribe(self, filters: list[str], generation: int) -> list[tuple[str, int]]:
        """(filter, qos) of ``filters`` not yet requested on this connection; marks them requested."""
        items = []
        with self._lock:
            for f in filters:
                bs = self._broker.get(f)
                if bs is not None and bs.requested != generation:
                    bs.requested = generation
                    items.append((f, bs.qos))
        return items

    def subscribe_failed(self, filters: list[str], err: TransportError) -> None:
        with self._lock:
            for f in filters:
                bs = self._broker.get(f)
                if bs is not None:
                    bs.error = err
                    _release(bs)

    def subacked(self, filters: list[str], refusals: list[TransportError | None]) -> None:
        """The broker's SUBACK: one refusal (or None: granted) per filter."""
        with self._lock:
            for f, err in zip(filters, refusals):
                bs = self._broker.get(f)
                if bs is None:
                    continue
                if err is not None:
                    bs.error = err
                else:
                    bs.acked = True
                    bs.error = None
                _release(bs)

    def to_unsubscribe(self, filters: list[str]) -> tuple[list[str], list[str]]:
        """(filters to send an UNSUBSCRIBE for, filters subscribed again meanwhile: nothing to remove)."""
        with self._lock:
            again = [f for f in filters if f in self._unsubs and f in self._broker]
            send = [f for f in filters if f in self._unsubs and f not in self._broker]
        return send, again

    def unsubscribed(self, filters: list[str]) -> None:
        with self._lock:
            for f in filters:
                for w in self._unsubs.pop(f, []):
                    w.set()


def _release(bs: BrokerSub) -> None:
    for w in bs.waiters:
        w.set()
    bs.waiters.clear()
