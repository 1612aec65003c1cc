"""What the agent's command handlers raise to refuse a command (shared by the agent and its services)."""

from __future__ import annotations

from typing import Any

from ..errors import FleetError

__all__ = ["CommandFailed"]


class CommandFailed(FleetError):
    """Raised inside a command handler: becomes an ack with ``code`` and the message."""

    def __init__(self, code: str, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.result = result or {}
