"""What the device's services may use of their agent: one small typed interface.

The :class:`~edgeflow.device.agent.DeviceAgent` owns the identity, the transport, the model slots and the
command plumbing; its services (OTA in :mod:`.ota`, training in :mod:`.training`, telemetry in
:mod:`.telemetry`, inference in :mod:`.inference`) each receive the agent as an :class:`AgentCore` and use
only these public members, never the agent's private fields (they used to read about 40 of them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

__all__ = ["AgentCore"]


class AgentCore(Protocol):
    """The agent as its services see it (see the module docstring)."""

    device_id: str
    fleet: str
    profile: Any  # DeviceProfile
    signer: Any  # Signer
    fleet_key: Any  # PublicKey
    transport: Any  # Transport
    options: Any  # AgentOptions
    slots: Any  # SlotStore
    seen: Any  # SeenCommands
    counters: dict[str, int]
    bdseq: int
    boot_notes: list[str]
    make_participant: Any  # ParticipantFactory | None
    ota: Any
    training_service: Any
    telemetry: Any
    inference: Any

    # -- state ------------------------------------------------------------------
    @property
    def stopping(self) -> bool: ...

    @property
    def started(self) -> bool: ...

    @property
    def owner_opted_out(self) -> bool: ...

    @property
    def active_model(self) -> Any: ...  # ActiveModel | None

    @property
    def model_version(self) -> int | None: ...

    @property
    def participant(self) -> Any: ...

    def topic(self, channel: str) -> str: ...

    def train_status(self) -> tuple[str, str]: ...

    # -- the model --------------------------------------------------------------------
    def runtime_for(self, m: Any) -> Any: ...

    def boot_model(self) -> None: ...

    def switch_to_active(self) -> Any: ...

    def load_config(self) -> None: ...

    def run_named(self, x: np.ndarray | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def publish_birth(self) -> None: ...

    # -- commands ---------------------------------------------------------------------
    def authenticate(self, data: bytes, *, expect: str | None = None) -> Any: ...  # Command | None

    def ack(self, cmd_id: str, name: str, *, ok: bool, code: str = "ok", error: str = "", **kw: Any) -> None: ...

    def refuse(self, cmd_id: str, name: str, code: str, error: str) -> None: ...

    def handler(self, name: str) -> Callable[[Any], dict[str, Any] | None]: ...

    def run_command(self, cmd: Any, fn: Callable[[Any], dict[str, Any] | None]) -> None: ...
