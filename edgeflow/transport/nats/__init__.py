"""The NATS transport: the only package in edgeflow that imports nats-py.

``from edgeflow.transport.nats import NatsTransport`` is the public entry
(``transport_from_url("nats://...")`` picks it); the rest are its rooms:

- :mod:`.facade`: :class:`NatsTransport`, the public API (a
  :class:`~edgeflow.transport.base.Transport`);
- :mod:`.link`: the event-loop thread (nats-py connection, sender,
  subscriptions with retained and gap replay, will records);
- :mod:`.jetstream`: the streams, outgoing frames, headers and properties;
- :mod:`.dispatch`: the worker thread (duplicate suppression, reassembly,
  handlers in arrival order);
- :mod:`.subjects`: topics and filters as subjects (pure, no nats-py: the
  broker config generator uses it);
- :mod:`.will`: :class:`WillKeeper`, which publishes the wills of
  connections that ended without a clean close.

The classes are imported on first use, so ``import edgeflow.transport.nats.subjects``
works where nats-py is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DEFAULT_MAX_PAYLOAD", "NatsTransport", "WillKeeper"]

_LAZY = {"NatsTransport": "edgeflow.transport.nats.facade", "DEFAULT_MAX_PAYLOAD": "edgeflow.transport.nats.facade",
         "WillKeeper": "edgeflow.transport.nats.will"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'edgeflow.transport.nats' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
