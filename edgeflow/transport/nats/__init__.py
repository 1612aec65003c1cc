"""The NATS transport: the only package in edgeflow that imports nats-py.

``from edgeflow.transport.nats import NatsTransport`` is the public entry
(``transport_from_url("nats://...")`` picks it); the rest are its rooms:

- :mod:`.facade`: :class:`NatsTransport`, the public API (a
  :class:`~edgeflow.transport.base.Transport`);
- :mod:`.link`: the event-loop thread (nats-py, JetStream streams, sender,
  subscriptions with retained replay, will records);
- :mod:`.dispatch`: the worker thread (duplicate suppression, reassembly,
  handlers in arrival order);
- :mod:`.subjects`: topics and filters as subjects (pure);
- :mod:`.will`: :class:`WillKeeper`, which publishes the wills of
  connections that ended without a clean close.
"""

from __future__ import annotations

from edgeflow.transport.nats.facade import DEFAULT_MAX_PAYLOAD, NatsTransport

__all__ = ["DEFAULT_MAX_PAYLOAD", "NatsTransport"]
