"""Pick a :class:`~edgeflow.transport.base.Transport` implementation by the broker URL's scheme.

Everything above the transport builds its connection with
:func:`transport_from_url` and never names a concrete class, so a second
transport plugs in here (one :func:`register_transport` line) without
touching the device agent, the simulation or the gateway::

    t = transport_from_url("mqtts://gw:8883", client_id="pi-1", tls=TlsConfig(ca_file="ca.crt"))

Implementations are imported lazily (only the chosen one is loaded: a board
without paho installed can still use another transport). Each registered
class provides ``from_url(url, **kwargs)``; keyword arguments an
implementation does not understand are its own business to refuse with a
:class:`~edgeflow.errors.ConfigError`.
"""

from __future__ import annotations

import importlib
from typing import Any

from edgeflow.errors import ConfigError
from edgeflow.transport.base import Transport

__all__ = ["register_transport", "registered_schemes", "transport_class", "transport_from_url"]

_BY_SCHEME: dict[str, str] = {
    "mqtt": "edgeflow.transport.mqtt:MqttTransport",
    "tcp": "edgeflow.transport.mqtt:MqttTransport",
    "mqtts": "edgeflow.transport.mqtt:MqttTransport",
    "ssl": "edgeflow.transport.mqtt:MqttTransport",
    "ws": "edgeflow.transport.mqtt:MqttTransport",
    "wss": "edgeflow.transport.mqtt:MqttTransport",
    "nats": "edgeflow.transport.nats:NatsTransport",
    "tls": "edgeflow.transport.nats:NatsTransport",
}


_EXTRAS = {"nats": ("nats-py", "nats")}
"""Client libraries a transport needs that are not core dependencies: module -> (distribution, extra)."""


def register_transport(scheme: str, target: str) -> None:
    """Make URLs with ``scheme`` open ``target`` (``"package.module:Class"``, imported on first use)."""
    if ":" not in target:
        msg = f"transport target {target!r} must be 'module:Class'"
        raise ConfigError(msg)
    _BY_SCHEME[scheme.lower()] = target


def registered_schemes() -> list[str]:
    return sorted(_BY_SCHEME)


def _scheme(url: str) -> str:
    if not isinstance(url, str) or "://" not in url:
        msg = f"broker URL {url!r} has no scheme; expected e.g. mqtt://127.0.0.1:1883"
        raise ConfigError(msg)
    return url.split("://", 1)[0].lower()


def transport_class(url: str) -> type:
    """The class that serves ``url`` (imported now)."""
    scheme = _scheme(url)
    target = _BY_SCHEME.get(scheme)
    if target is None:
        msg = (f"broker URL {url!r} has unknown scheme {scheme!r}; "
               f"expected one of {', '.join(s + '://' for s in registered_schemes())}")
        raise ConfigError(msg)
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in _EXTRAS:
            raise
        dist, extra = _EXTRAS[missing]
        msg = (f"broker URL {url!r} needs {dist}, which is not installed: pip install 'edgeflow[{extra}]' "
               f"(from a checkout: pip install -e '.[{extra}]')")
        raise ConfigError(msg) from None


def transport_from_url(url: str, **kwargs: Any) -> Transport:
    """A transport for ``url``, not yet connected (call ``connect``)."""
    return transport_class(url).from_url(url, **kwargs)
