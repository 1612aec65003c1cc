"""Broker URLs: ``mqtt://``, ``mqtts://``, ``ws://``, ``wss://``; for NATS ``nats://`` and ``tls://``.

One string is the easiest thing to put in a config file, an environment
variable or on a command line (``edgeflow demo --broker mqtts://gw:8883``).

For websockets the path *and query* of the URL are the HTTP request target
of the upgrade request (``wss://gw.example.com/mqtt?token=...``): reverse
proxies route on the path, and some cloud brokers authenticate with query
parameters, so both are kept verbatim. Mosquitto itself ignores the path.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from edgeflow.errors import ConfigError

__all__ = ["BrokerAddress", "parse_broker_url"]

_SCHEMES = {
    "mqtt": (False, False, 1883),
    "tcp": (False, False, 1883),
    "mqtts": (True, False, 8883),
    "ssl": (True, False, 8883),
    "ws": (False, True, 80),
    "wss": (True, True, 443),
    "nats": (False, False, 4222),
    "tls": (True, False, 4222),
}
NATS_SCHEMES = frozenset({"nats", "tls"})


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool = False
    websockets: bool = False
    ws_path: str = "/mqtt"
    username: str | None = None
    password: str | None = None
    scheme: str = "mqtt"
    """The URL's scheme, lower case (``tcp``/``ssl`` stay as given; :attr:`url` normalises)."""

    @property
    def is_nats(self) -> bool:
        return self.scheme in NATS_SCHEMES

    @property
    def url(self) -> str:
        if self.is_nats:
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"{'tls' if self.tls else 'nats'}://{host}:{self.port}"
        scheme = ("wss" if self.tls else "ws") if self.websockets else ("mqtts" if self.tls else "mqtt")
        path = self.ws_path if self.websockets else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}{path}"


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse ``scheme://[user[:password]@]host[:port][/path]`` (path only for websockets)."""
    hint = "expected e.g. mqtt://127.0.0.1:1883, mqtts://host:8883, ws://host:9001/mqtt or nats://host:4222"
    if not isinstance(url, str) or "://" not in url:
        msg = f"broker URL {url!r} has no scheme; {hint}"
        raise ConfigError(msg)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        msg = f"broker URL {url!r} has unknown scheme {parts.scheme!r}; {hint}"
        raise ConfigError(msg)
    tls, ws, default_port = _SCHEMES[scheme]
    try:
        port = parts.port or default_port
    except ValueError:
        msg = f"broker URL {url!r} has an invalid port; {hint}"
        raise ConfigError(msg) from None
    if not parts.hostname:
        msg = f"broker URL {url!r} has no host; {hint}"
        raise ConfigError(msg)
    if (parts.path not in ("", "/") or parts.query) and not ws:
        msg = f"broker URL {url!r}: a path only makes sense for ws:// and wss://"
        raise ConfigError(msg)
    ws_path = (parts.path or "/mqtt") + (f"?{parts.query}" if parts.query else "")
    return BrokerAddress(
        host=parts.hostname,
        port=port,
        tls=tls,
        websockets=ws,
        ws_path=ws_path if ws else "/mqtt",
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        scheme=scheme,
    )
