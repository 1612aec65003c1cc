"""edgeflow.transport: MQTT (and NATS) for devices and the gateway.

:class:`Transport` (:mod:`.base`) is the seam everything above the transport
is written against. Pure modules import nothing heavy: :mod:`.base`,
:mod:`.topics` (the topic scheme), :mod:`.chunking` (split/reassemble),
:mod:`.url`, :mod:`.backoff`, :mod:`.outbox`, :mod:`.message`, and the rules every
transport shares: :mod:`.framing` (publish), :mod:`.dispatching` (receive),
:mod:`.limits` (option checks).
:class:`MqttTransport` (package :mod:`.mqtt`, the only code that imports
paho), :class:`NatsTransport` (package :mod:`.nats`, the only code that
imports nats-py; ``nats://``/``tls://`` URLs), the in-process :class:`LoopbackBroker`/:class:`LoopbackTransport`
(:mod:`.loopback`) and the broker launchers in :mod:`.broker` are imported
lazily, on first attribute access, so ``import edgeflow.transport.topics``
stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgeflow.transport.base import Transport
from edgeflow.transport.message import ConnectionEvent, Delivery, Message, Subscription, TlsConfig, Will
from edgeflow.transport.topics import (
    Topic,
    TopicFilter,
    device_filter,
    device_topic,
    gateway_topic,
    parse_topic,
)
from edgeflow.transport.url import BrokerAddress, parse_broker_url

if TYPE_CHECKING:
    from edgeflow.transport.broker import EmbeddedBroker, ExternalBroker, MosquittoBroker, start_broker
    from edgeflow.transport.loopback import LoopbackBroker, LoopbackTransport
    from edgeflow.transport.mqtt import MqttTransport
    from edgeflow.transport.nats import NatsTransport

__all__ = [
    "BrokerAddress",
    "ConnectionEvent",
    "Delivery",
    "EmbeddedBroker",
    "ExternalBroker",
    "LoopbackBroker",
    "LoopbackTransport",
    "Message",
    "MosquittoBroker",
    "MqttTransport",
    "NatsTransport",
    "Subscription",
    "TlsConfig",
    "Topic",
    "TopicFilter",
    "Transport",
    "Will",
    "device_filter",
    "device_topic",
    "gateway_topic",
    "parse_broker_url",
    "parse_topic",
    "start_broker",
]

_LAZY = {
    "MqttTransport": "edgeflow.transport.mqtt",
    "NatsTransport": "edgeflow.transport.nats",
    "LoopbackBroker": "edgeflow.transport.loopback",
    "LoopbackTransport": "edgeflow.transport.loopback",
    "MosquittoBroker": "edgeflow.transport.broker",
    "EmbeddedBroker": "edgeflow.transport.broker",
    "ExternalBroker": "edgeflow.transport.broker",
    "start_broker": "edgeflow.transport.broker",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'edgeflow.transport' has no attribute {name!r}"
        raise AttributeError(msg)
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
