"""Secure aggregation carried over MQTT: signed frames and the client's session.

The protocol itself (Bonawitz et al.: advertise keys, share keys, masked
input, unmask) is :mod:`edgeflow.gateway.secagg`, message-level and free of
I/O. This module moves its frames (:mod:`edgeflow.gateway.secagg_wire`):

- device -> gateway on ``<device>/secagg``, each frame signed with the
  device's Ed25519 key, so the gateway cannot be fed invented participants
  (the protocol's own threat model asks for authenticated advertisements);
- gateway -> devices on ``gateway/secagg``, signed with the fleet key: the
  key directory, then *all* share bundles in one message (each share is
  AES-GCM encrypted for its recipient, so broadcasting them reveals nothing),
  then the unmask request.

A sealed frame is ``signature (64 bytes) | frame``, the signature over
``signing_message("secagg/v1", SHA-256(frame))``.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from ..errors import CodecError, SignatureError
from ..signing import KeyRing, PrivateKey, PublicKey, Signer, signing_message

CONTEXT = "secagg/v1"
SIG = 64
_BUNDLES_MAGIC = b"EFSB"


def seal(frame: bytes, key: "Signer | PrivateKey") -> bytes:
    return key.sign(signing_message(CONTEXT, hashlib.sha256(frame).digest())) + frame


def unseal(data: bytes, key: PublicKey) -> bytes:
    if len(data) <= SIG:
        raise CodecError(f"secagg frame of {len(data)} bytes is too short")
    sig, frame = data[:SIG], data[SIG:]
    key.verify(signing_message(CONTEXT, hashlib.sha256(frame).digest()), sig)
    return frame


def unseal_from(data: bytes, keyring: KeyRing, sender: str) -> bytes:
    key = keyring.get(sender)
    if key is None:
        raise SignatureError(f"secagg frame from unregistered device {sender!r}")
    return unseal(data, key)


def pack_bundles(frames: list[bytes]) -> bytes:
    out = [_BUNDLES_MAGIC, struct.pack(">I", len(frames))]
    for f in frames:
        out += [struct.pack(">I", len(f)), f]
    return b"".join(out)


def unpack_bundles(data: bytes) -> list[bytes]:
    if data[:4] != _BUNDLES_MAGIC or len(data) < 8:
        raise CodecError("not a share-bundle container")
    (n,) = struct.unpack_from(">I", data, 4)
    pos, frames = 8, []
    for _ in range(n):
        if pos + 4 > len(data):
            raise CodecError("truncated share-bundle container")
        (size,) = struct.unpack_from(">I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise CodecError("truncated share-bundle container")
        frames.append(data[pos:pos + size])
        pos += size
    return frames


def decode(frame: bytes) -> Any:
    from ..gateway.secagg_wire import decode_message

    return decode_message(frame)


def encode(msg: Any) -> bytes:
    from ..gateway.secagg_wire import encode_message

    return encode_message(msg)
