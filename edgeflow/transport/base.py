"""The transport seam: what edgeflow's devices and gateway need from a message transport.

Everything above the transport (the device agent, the federated client, the
gateway's rounds, fleet, OTA and ingestion) talks to a :class:`Transport`,
never to a concrete class (:func:`edgeflow.transport.factory.transport_from_url`
picks one by the URL's scheme). Three implementations exist:

- :class:`edgeflow.transport.mqtt.MqttTransport`: MQTT over TCP, TLS or
  websockets to a real broker (the only code that imports paho-mqtt);
- :class:`edgeflow.transport.nats.NatsTransport`: NATS with JetStream
  (``nats://``, ``tls://``; the only code that imports nats-py; what differs
  from MQTT is listed in docs/transport.md);
- :class:`edgeflow.transport.loopback.LoopbackTransport`: an in-process
  broker hub with the MQTT semantics edgeflow relies on, for fast tests
  without a broker (in the spirit of httpx's ``MockTransport``).

The contract, which all three keep (tests/unit/test_transport_protocol.py checks
the signatures, tests/test_transport_contract.py the behaviour of each):

- ``publish`` queues a message and returns a :class:`Delivery` at once
  (online or not); ``Delivery.wait`` blocks until the broker acknowledged
  it and raises :class:`~edgeflow.errors.TransportError` on failure or
  timeout. QoS is 0 or 1 (edgeflow deduplicates instead of using QoS 2).
  Messages are sent in publish order.
- ``subscribe`` registers a handler for a filter (``+``/``#`` wildcards,
  ``$share/<group>/<filter>`` shared subscriptions); handlers run on the
  transport's single worker thread, one message at a time, in arrival
  order, and a QoS 1 message is acknowledged only after its handler
  returned (at least once: a message may come again after a reconnect).
  Zero-length messages (a cleared retained message) reach only handlers
  subscribed with ``include_empty=True``. Connected, ``subscribe`` waits for
  the broker's acknowledgement and ``unsubscribe`` for its UNSUBACK.
- connection listeners get a :class:`ConnectionEvent` on every connect and
  disconnect, on the worker thread, in order with the messages.
- ``will`` is read when a connection is made (a callable payload once per
  attempt); the broker publishes it when the connection ends without a
  clean close (``close(abort=True)`` behaves like a power cut).
- errors are :mod:`edgeflow.errors` only: ``ConfigError`` for bad arguments
  (topic, QoS, properties), ``TransportError`` for everything on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from edgeflow.transport.message import (
    ConnectionEvent,
    ConnectionListener,
    Delivery,
    Handler,
    Message,
    MessageProperties,
    Subscription,
)
from edgeflow.transport.topics import TopicFilter

__all__ = [
    "ConnectionEvent",
    "ConnectionListener",
    "Delivery",
    "Handler",
    "Message",
    "MessageProperties",
    "Payload",
    "Subscription",
    "Transport",
    "WillSpec",
]

Payload = bytes | bytearray | memoryview | str
"""What ``publish`` takes; ``str`` is sent as UTF-8."""


@runtime_checkable
class WillSpec(Protocol):
    """A last will: :class:`edgeflow.transport.message.Will`, or any object with these
    attributes (the device agent's per-session will computes ``payload`` on each read)."""

    @property
    def topic(self) -> str: ...

    @property
    def payload(self) -> bytes | str | Callable[[], bytes | str]: ...

    @property
    def qos(self) -> int: ...

    @property
    def retain(self) -> bool: ...

    @property
    def delay_s(self) -> int: ...


@runtime_checkable
class Transport(Protocol):
    """A publish/subscribe connection to one broker. See the module docstring for the contract."""

    name: str
    """For log lines: which transport this is."""
    will: WillSpec | None
    """Set before :meth:`connect`; read on every connection attempt."""

    @property
    def is_connected(self) -> bool: ...

    def connect(self, timeout: float | None = None, *, wait: bool = True) -> Transport:
        """Start; with ``wait`` block until connected (TransportError after ``timeout``)."""
        ...

    def wait_connected(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float = 5.0, *, flush: bool = True, abort: bool = False) -> None:
        """Stop: ``flush`` waits for queued messages first; ``abort`` drops the connection like a
        crash (the broker publishes the will); pending deliveries fail."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued was acknowledged; False on timeout."""
        ...

    def publish(
        self,
        topic: str,
        payload: Payload,
        *,
        qos: int = 1,
        retain: bool = False,
        properties: MessageProperties | None = None,
        raw: bool = False,
    ) -> Delivery: ...

    def subscribe(
        self,
        filter: str | TopicFilter,
        handler: Handler,
        *,
        qos: int = 1,
        timeout: float | None = 10.0,
        include_empty: bool = False,
    ) -> Subscription: ...

    def unsubscribe(self, sub: Subscription | str, *, timeout: float | None = 10.0) -> None: ...

    def add_connection_listener(self, listener: ConnectionListener) -> None: ...

    def stats(self) -> dict[str, int]:
        """Counters (names vary by implementation; ``published_messages`` and
        ``delivered_messages`` exist in both)."""
        ...
