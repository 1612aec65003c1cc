"""The MQTT transport: the only package in edgeflow that imports paho-mqtt.

``from edgeflow.transport.mqtt import MqttTransport`` is the public entry;
the rest are its rooms (docs/transport.md, "Package layout"):

- :mod:`.facade`: :class:`MqttTransport`, the public API (a
  :class:`~edgeflow.transport.base.Transport`);
- :mod:`.state`: :class:`ConnState`, the connection's state machine, and the counters;
- :mod:`.netloop`: the network thread (select loop, reconnect and backoff,
  in-flight window, re-queue on disconnect, MQTT 5 with 3.1.1 fallback);
- :mod:`.dispatch`: the worker thread (reassembly, handlers in arrival order,
  QoS 1 acks after the handler);
- :mod:`.subscriptions`: the subscription table (handlers, broker filters,
  SUBACK/UNSUBACK waiters);
- :mod:`.options`: option checks, protocol constants, paho value mapping.
"""

from __future__ import annotations

from edgeflow.transport.mqtt.facade import MqttTransport
from edgeflow.transport.mqtt.options import DEFAULT_MAX_PAYLOAD
from edgeflow.transport.mqtt.state import ConnState
from edgeflow.transport.topics import SHARED_PREFIX, match_filter

__all__ = ["DEFAULT_MAX_PAYLOAD", "SHARED_PREFIX", "ConnState", "MqttTransport", "match_filter"]
