"""The size and count limits every broker transport checks the same way (MQTT and NATS).

A transport's ``max_payload`` may not go below :data:`MIN_PAYLOAD` (a chunk's
header plus room for data: under it chunking could not make progress), nor
may the limit a transport derives from the server's own maximum; a transport
needs at least one message in flight, and a TCP port in 1..65535.
"""

from __future__ import annotations

from edgeflow.errors import ConfigError
from edgeflow.transport.chunking import HEADER_SIZE

__all__ = ["MIN_PAYLOAD", "check_limits", "payload_limit"]

MIN_PAYLOAD = HEADER_SIZE + 1024
"""The smallest ``max_payload`` a transport accepts or derives, in bytes."""


def check_limits(*, max_payload: int, max_inflight: int, port: int | str, server: str) -> None:
    """ConfigError for a ``max_payload``, ``max_inflight`` or ``port`` that cannot work (``server``
    names the port's server in the message: "broker", "NATS")."""
    if max_payload < MIN_PAYLOAD:
        msg = f"max_payload {max_payload} is too small; use at least {MIN_PAYLOAD} bytes"
        raise ConfigError(msg)
    if max_inflight < 1:
        raise ConfigError("max_inflight must be >= 1")
    if not 0 < int(port) < 65536:
        msg = f"{server} port must be in 1..65535, got {port!r}"
        raise ConfigError(msg)


def payload_limit(max_payload: int, server_max: int | None, overhead: int) -> int:
    """The largest payload (or chunk) to send as one message: ``max_payload``, lowered to fit the
    server's announced maximum less the transport's ``overhead`` for this topic, never below
    :data:`MIN_PAYLOAD`."""
    limit = max_payload
    if server_max:
        limit = min(limit, server_max - overhead)
    return max(limit, MIN_PAYLOAD)
