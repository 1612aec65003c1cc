"""The OTA offer: a signed ``deploy`` command and the artifact it installs, in one message.

The artifact itself (its format, signature and checks) is :mod:`edgeflow.artifact`;
the gateway's rollout is :mod:`edgeflow.gateway.ota`; the agent installs it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import CodecError
from ..signing import PrivateKey
from .fleet import Command
from .signed_json import MAX_CONTROL_BYTES
from .signed_json import with_reason as _reason

__all__ = ["OFFER_MAGIC", "OtaOffer", "deploy_command"]

OFFER_MAGIC = b"EFOF\x01"


@dataclass(frozen=True)
class OtaOffer:
    """A ``deploy`` command and the artifact it installs, in one message on the device's ``ota`` topic.

    Why one message: the command (signed, fresh, addressed to one device)
    and the artifact (signed, durable, per profile) arrive together, so the
    agent never has to match a command with an artifact that is still on
    its way. The command's ``args["artifact_sha256"]`` binds the two.
    Layout: magic ``EFOF\\x01`` | u32 length | signed command | artifact.
    """

    command: bytes
    artifact: bytes

    def to_bytes(self) -> bytes:
        return OFFER_MAGIC + struct.pack(">I", len(self.command)) + self.command + self.artifact

    @classmethod
    def from_bytes(cls, data: bytes) -> OtaOffer:
        data = bytes(data)
        if not data.startswith(OFFER_MAGIC) or len(data) < len(OFFER_MAGIC) + 4:
            raise _reason(CodecError("not an edgeflow OTA offer (bad magic)"), "bad_message")
        (n,) = struct.unpack_from(">I", data, len(OFFER_MAGIC))
        start = len(OFFER_MAGIC) + 4
        if n > MAX_CONTROL_BYTES or start + n > len(data):
            raise _reason(CodecError("OTA offer is truncated"), "bad_message")
        return cls(data[start:start + n], data[start + n:])

    @classmethod
    def make(cls, command: Command, artifact: bytes, key: PrivateKey) -> OtaOffer:
        return cls(command.sign(key), artifact)


def deploy_command(device: str, fleet: str, artifact: bytes, *, version: int, ttl_s: float = 600.0,
                   extra: Mapping[str, Any] | None = None) -> Command:
    """The ``deploy`` command that goes with ``artifact`` in an :class:`OtaOffer`."""
    args = {"artifact_sha256": hashlib.sha256(artifact).hexdigest(), "version": int(version), **dict(extra or {})}
    return Command.make("deploy", device, fleet, args, ttl_s=ttl_s)
