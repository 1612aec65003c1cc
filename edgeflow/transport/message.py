"""The value types of the transport: messages, deliveries, wills, TLS settings."""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from edgeflow.errors import ConfigError, TransportError

__all__ = [
    "ConnectionEvent",
    "ConnectionListener",
    "Delivery",
    "Handler",
    "Message",
    "MessageProperties",
    "PROPERTY_NAMES",
    "Subscription",
    "TlsConfig",
    "Will",
    "check_properties",
]


class MessageProperties(TypedDict, total=False):
    """The MQTT 5 properties edgeflow maps, on a publish and on a received :class:`Message`.

    ``user_properties`` may be given as a mapping or a list of pairs on
    publish; a received message always has a ``dict``. On MQTT 3.1.1 none
    travel (a received message has ``{}``).
    """

    response_topic: str
    correlation_data: bytes
    content_type: str
    message_expiry_s: int
    user_properties: dict[str, str] | list[tuple[str, str]]


PROPERTY_NAMES = ("response_topic", "correlation_data", "content_type", "message_expiry_s", "user_properties")
"""The keys of :class:`MessageProperties` (anything else is refused with ConfigError)."""


def check_properties(props: MessageProperties | dict[str, object]) -> None:
    """Refuse property names edgeflow does not map (ConfigError naming the known ones)."""
    unknown = sorted(set(props) - set(PROPERTY_NAMES))
    if unknown:
        msg = f"unknown MQTT property {unknown[0]!r}; use {', '.join(PROPERTY_NAMES)}"
        raise ConfigError(msg)


@dataclass(frozen=True)
class Message:
    """One received message, reassembled if it travelled in chunks.

    ``properties`` holds the MQTT 5 properties that edgeflow maps
    (``response_topic``, ``correlation_data``, ``content_type``,
    ``message_expiry_s``, ``user_properties``); it is empty on MQTT 3.1.1.
    ``retain`` is True when the message came from the broker's retained store
    (for a chunked payload: every chunk did).
    """

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: MessageProperties = field(default_factory=lambda: MessageProperties())
    chunks: int = 1
    transfer_id: str | None = None

    def text(self) -> str:
        return self.payload.decode("utf-8")

    def json(self) -> Any:
        return json.loads(self.payload)


@dataclass(frozen=True)
class Will:
    """Last will: published by the broker if the client vanishes without DISCONNECT.

    ``payload`` may be a callable: the transport calls it once per connection
    attempt, when it builds that attempt's MQTT client, so a will can differ
    per session (a device's signed death carries the session's ``bdseq``).
    """

    topic: str
    payload: bytes | str | Callable[[], bytes | str] = b""
    qos: int = 1
    retain: bool = True
    delay_s: int = 0
    """MQTT 5 will delay: a reconnect within this time cancels the will."""


@dataclass(frozen=True)
class TlsConfig:
    """TLS to the broker. ``ca_file`` None uses the system trust store.

    ``cert_file``/``key_file`` give a client certificate (mutual TLS);
    ``insecure`` skips the host name check (test set-ups only); ``context``
    overrides everything with a ready ``ssl.SSLContext``.
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    context: ssl.SSLContext | None = None


@dataclass(frozen=True)
class ConnectionEvent:
    """Passed to connection listeners on every connect and disconnect."""

    connected: bool
    session_present: bool = False
    reason: str = ""


Handler = Callable[[Message], object]
"""A message handler: called on the transport's worker thread, one message at a time, in arrival order."""

ConnectionListener = Callable[[ConnectionEvent], object]
"""Called on the transport's worker thread on every connect and disconnect (in order with messages)."""


@dataclass(frozen=True)
class Subscription:
    """Handle returned by ``subscribe``; pass it to ``unsubscribe``."""

    filter: str
    handler: Handler
    qos: int


class Delivery:
    """Tracks one ``publish`` until the broker acknowledged every frame.

    A chunked payload is acknowledged chunk by chunk; :attr:`acked` and
    :attr:`total` show progress. QoS 0 frames count as delivered once
    written to the socket (there is no acknowledgement to wait for).
    """

    def __init__(self, topic: str, total: int, size: int, qos: int, transfer_id: str | None = None) -> None:
        self.topic = topic
        self.total = total
        self.size = size
        self.qos = qos
        self.transfer_id = transfer_id
        self.created = time.monotonic()
        self._acked: set[int] = set()
        self._error: TransportError | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Delivery], object]] = []
        if total == 0:
            self._event.set()

    def add_progress_callback(self, fn: Callable[[Delivery], object]) -> None:
        """Call ``fn(delivery)`` after every acknowledged frame and on failure.

        It runs on the transport's network thread, so it must be quick (update
        a progress bar, set an event); exceptions are logged and ignored.
        """
        with self._lock:
            self._callbacks.append(fn)

    def _run_callbacks(self) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a progress callback must not break the transport
                logging.getLogger("edgeflow.transport").exception("delivery progress callback failed")

    @property
    def acked(self) -> int:
        with self._lock:
            return len(self._acked)

    @property
    def done(self) -> bool:
        return self._event.is_set()

    @property
    def error(self) -> TransportError | None:
        return self._error

    @property
    def succeeded(self) -> bool:
        return self._event.is_set() and self._error is None

    # -- the transport's side: it settles the delivery (as a future's set_result / set_exception) ----------
    def frame_acked(self, index: int) -> None:
        """Frame ``index`` was acknowledged by the broker (or written, at QoS 0); done after the last."""
        with self._lock:
            if self._event.is_set() or index in self._acked:
                return
            self._acked.add(index)
            if len(self._acked) >= self.total:
                self._event.set()
        self._run_callbacks()

    def fail(self, error: TransportError) -> None:
        """The publish failed: :meth:`wait` raises ``error`` (a delivery already done stays as it is)."""
        with self._lock:
            if self._event.is_set():
                return
            self._error = error
            self._event.set()
        self._run_callbacks()

    def wait(self, timeout: float | None = None) -> Delivery:
        """Block until every frame is acknowledged; raise TransportError on failure or timeout."""
        if not self._event.wait(timeout):
            msg = (
                f"publish to {self.topic} not acknowledged within {timeout} s "
                f"({self.acked} of {self.total} frames acked); is the broker reachable? "
                "The message stays queued and is sent after reconnect."
            )
            raise TransportError(msg)
        if self._error is not None:
            raise self._error
        return self

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done else "pending")
        return f"<Delivery {self.topic} {self.acked}/{self.total} {state}>"
