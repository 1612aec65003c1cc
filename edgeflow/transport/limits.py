"""The size and count limits every broker transport checks the same way (MQTT and NATS).

A transport's ``max_payload`` may not go below :data:`MIN_PAYLOAD` (a chunk's
header plus room for data: under it chunking could not make progress), nor
may the limit a transport derives from the server's own maximum; a transport
needs at least one message in flight, and a TCP port in 1..65535.
"""

from __future__ import annotations

from edgeflow.errors import ConfigError
from edgeflow.transport.chunking import HEADER_SIZE

__all__ = ["MIN_PAYLOAD", "check_limits"]

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
