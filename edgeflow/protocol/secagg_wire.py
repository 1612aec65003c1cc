"""Bytes for the secure-aggregation messages, so the orchestrator can publish them.

One frame per message::

    b"EFSA" | version (1 byte) | kind (1 byte) | header length (u32, big endian)
    | header (UTF-8 JSON; bytes fields as hex) | payload (MaskedInput only: the
    masked vector, little-endian uint32/uint64)

The masked vector travels raw because it is the only large part (8 or 4
bytes per parameter, incompressible); everything else is small. Decoding
checks the frame, every field's type and size, and raises
:class:`~edgeflow.protocol.secagg.SecAggError` on anything malformed - it never
returns a half-built message.

Authenticity: :func:`seal` signs a frame, :func:`unseal` checks it. Over MQTT
(:class:`edgeflow.federated.Client` and the gateway's rounds):

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
import json
import struct
from typing import Any, Union

import numpy as np

from edgeflow.codecs.untrusted import loads_untrusted
from edgeflow.errors import CodecError, ConfigError, SignatureError
from edgeflow.signing import KeyRing, PrivateKey, PublicKey, Signer, signing_message
from edgeflow.protocol.secagg import (
    AdvertiseKeys,
    EncryptedShare,
    FinalHolders,
    KeyDirectory,
    MaskedInput,
    ParticipantKeys,
    SecAggConfig,
    SecAggError,
    ShareBundle,
    ShareCheck,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
)

__all__ = ["CONTEXT", "Message", "decode", "decode_message", "encode", "encode_message", "pack_bundles", "seal",
           "unpack_bundles", "unseal", "unseal_from"]

Message = Union[AdvertiseKeys, KeyDirectory, ShareKeys, ShareBundle, MaskedInput, UnmaskRequest, UnmaskResponse,
                ShareCheck, FinalHolders]

_MAGIC = b"EFSA"
_VERSION = 1
_HEAD = struct.Struct(">4sBBI")
_MAX_HEADER = 64 << 20
_KINDS: dict[type, int] = {AdvertiseKeys: 1, KeyDirectory: 2, ShareKeys: 3, ShareBundle: 4, MaskedInput: 5,
                           UnmaskRequest: 6, UnmaskResponse: 7, ShareCheck: 8, FinalHolders: 9}


def _hex(b: bytes) -> str:
    return bytes(b).hex()


def _share(es: EncryptedShare) -> dict[str, str]:
    return {"sender": es.sender, "recipient": es.recipient, "ciphertext": _hex(es.ciphertext)}


def encode_message(msg: Message) -> bytes:
    """The frame for one protocol message."""
    kind = _KINDS.get(type(msg))
    if kind is None:
        raise SecAggError(f"not a secure-aggregation message: {type(msg).__name__}")
    payload = b""
    if isinstance(msg, AdvertiseKeys):
        head: dict[str, Any] = {"client_id": msg.client_id, "enc_public_key": _hex(msg.enc_public_key),
                                "mask_public_key": _hex(msg.mask_public_key)}
    elif isinstance(msg, KeyDirectory):
        c = msg.config
        head = {"session_id": _hex(msg.session_id), "round_id": msg.round_id,
                "config": {"threshold": c.threshold, "ring_bits": c.ring_bits, "frac_bits": c.frac_bits,
                           "clip": c.clip, "max_clients": c.max_clients,
                           **{k: getattr(c, k) for k in ("weight_cap", "norm_bound") if getattr(c, k) is not None}},
                "participants": [{"client_id": p.client_id, "index": p.index,
                                  "enc_public_key": _hex(p.enc_public_key),
                                  "mask_public_key": _hex(p.mask_public_key)} for p in msg.participants],
                "layout": [[name, list(shape)] for name, shape in msg.layout]}
    elif isinstance(msg, ShareKeys):
        head = {"client_id": msg.client_id, "session_id": _hex(msg.session_id),
                "shares": [_share(s) for s in msg.shares]}
    elif isinstance(msg, ShareBundle):
        head = {"recipient": msg.recipient, "session_id": _hex(msg.session_id),
                "shares": [_share(s) for s in msg.shares], "share_holders": list(msg.share_holders)}
    elif isinstance(msg, MaskedInput):
        arr = np.asarray(msg.masked)
        if arr.dtype not in (np.uint32, np.uint64) or arr.ndim != 1:
            raise SecAggError(f"masked input must be a 1-D uint32/uint64 array, got {arr.dtype}{arr.shape}")
        head = {"client_id": msg.client_id, "session_id": _hex(msg.session_id),
                "bits": arr.dtype.itemsize * 8, "length": int(arr.size)}
        if msg.weight is not None:
            head["weight"] = float(msg.weight)
        payload = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    elif isinstance(msg, UnmaskRequest):
        head = {"session_id": _hex(msg.session_id), "survivors": list(msg.survivors), "dropped": list(msg.dropped)}
    elif isinstance(msg, ShareCheck):
        head = {"client_id": msg.client_id, "session_id": _hex(msg.session_id), "accused": list(msg.accused),
                "enc_private_key": _hex(msg.enc_private_key)}
    elif isinstance(msg, FinalHolders):
        head = {"session_id": _hex(msg.session_id), "holders": list(msg.holders), "excluded": list(msg.excluded)}
    else:
        assert isinstance(msg, UnmaskResponse)
        head = {"client_id": msg.client_id, "session_id": _hex(msg.session_id),
                "seed_shares": {k: _hex(v) for k, v in msg.seed_shares.items()},
                "key_shares": {k: _hex(v) for k, v in msg.key_shares.items()}}
    body = json.dumps(head, separators=(",", ":"), allow_nan=False).encode()
    return _HEAD.pack(_MAGIC, _VERSION, kind, len(body)) + body + payload


# ---- decoding ------------------------------------------------------------


def _bad(what: str) -> SecAggError:
    return SecAggError(f"malformed secure-aggregation message: {what}")


def _str(d: dict, key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise _bad(f"field {key!r} must be a string")
    return v


def _int(d: dict, key: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"field {key!r} must be an integer")
    return v


def _bytes(d: dict, key: str, size: int | None = None) -> bytes:
    v = _str(d, key)
    try:
        b = bytes.fromhex(v)
    except ValueError:
        raise _bad(f"field {key!r} is not hex") from None
    if size is not None and len(b) != size:
        raise _bad(f"field {key!r} must be {size} bytes, got {len(b)}")
    return b


def _list(d: dict, key: str) -> list:
    v = d.get(key)
    if not isinstance(v, list):
        raise _bad(f"field {key!r} must be a list")
    return v


def _dict(d: Any, what: str) -> dict:
    if not isinstance(d, dict):
        raise _bad(f"{what} must be an object")
    return d


def _strs(d: dict, key: str) -> tuple[str, ...]:
    items = _list(d, key)
    if not all(isinstance(x, str) for x in items):
        raise _bad(f"field {key!r} must list strings")
    return tuple(items)


def _shares(d: dict) -> tuple[EncryptedShare, ...]:
    out = []
    for item in _list(d, "shares"):
        item = _dict(item, "a share")
        out.append(EncryptedShare(_str(item, "sender"), _str(item, "recipient"), _bytes(item, "ciphertext")))
    return tuple(out)


def _share_map(d: dict, key: str) -> dict[str, bytes]:
    m = _dict(d.get(key), f"field {key!r}")
    out = {}
    for k in m:
        if not isinstance(k, str):
            raise _bad(f"field {key!r} has a non-string key")
        out[k] = _bytes(m, k)
    return out


def decode_message(data: bytes) -> Message:
    """The message in a frame made by :func:`encode_message`; SecAggError if malformed."""
    data = bytes(data)
    if len(data) < _HEAD.size:
        raise _bad("shorter than the frame header")
    magic, version, kind, hlen = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise _bad("bad magic (not a secure-aggregation frame)")
    if version != _VERSION:
        raise _bad(f"unsupported version {version} (this gateway speaks {_VERSION})")
    if hlen > _MAX_HEADER or _HEAD.size + hlen > len(data):
        raise _bad("header length exceeds the frame")
    try:
        head = loads_untrusted(data[_HEAD.size:_HEAD.size + hlen], "secagg frame header")
    except CodecError as exc:  # not JSON, too deep, bad UTF-8 (RecursionError/OverflowError included)
        raise _bad(f"header is not JSON ({exc})") from None
    head = _dict(head, "the header")
    payload = data[_HEAD.size + hlen:]
    if kind != 5 and payload:
        raise _bad("unexpected bytes after the header")
    try:
        return _decode(kind, head, payload)
    except SecAggError:
        raise
    except (TypeError, ValueError, OverflowError, KeyError, IndexError) as exc:  # e.g. SecAggConfig's fields
        raise _bad(str(exc)) from None


def _decode(kind: int, head: dict, payload: bytes) -> Message:
    if kind == 1:
        return AdvertiseKeys(_str(head, "client_id"), _bytes(head, "enc_public_key", 32),
                             _bytes(head, "mask_public_key", 32))
    if kind == 2:
        c = _dict(head.get("config"), "field 'config'")
        clip = c.get("clip")
        if isinstance(clip, bool) or not isinstance(clip, (int, float)):
            raise _bad("field 'clip' must be a number")
        optional = {}
        for k in ("weight_cap", "norm_bound"):
            if k in c:
                v = c[k]
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise _bad(f"field {k!r} must be a number")
                optional[k] = float(v)
        try:
            config = SecAggConfig(threshold=_int(c, "threshold"), ring_bits=_int(c, "ring_bits"),
                                  frac_bits=_int(c, "frac_bits"), clip=float(clip), max_clients=_int(c, "max_clients"),
                                  **optional)
        except ConfigError as exc:
            raise _bad(f"config: {exc}") from None
        parts = []
        for p in _list(head, "participants"):
            p = _dict(p, "a participant")
            parts.append(ParticipantKeys(_str(p, "client_id"), _int(p, "index"), _bytes(p, "enc_public_key", 32),
                                         _bytes(p, "mask_public_key", 32)))
        layout = []
        for item in _list(head, "layout"):
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], list)
                    or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in item[1])):
                raise _bad("layout entries must be [name, [dims...]]")
            layout.append((item[0], tuple(item[1])))
        return KeyDirectory(_bytes(head, "session_id"), _int(head, "round_id"), config, tuple(parts), tuple(layout))
    if kind == 3:
        return ShareKeys(_str(head, "client_id"), _bytes(head, "session_id"), _shares(head))
    if kind == 4:
        return ShareBundle(_str(head, "recipient"), _bytes(head, "session_id"), _shares(head),
                           _strs(head, "share_holders"))
    if kind == 5:
        bits, length = _int(head, "bits"), _int(head, "length")
        if bits not in (32, 64) or length < 0:
            raise _bad("masked input needs bits 32|64 and a length >= 0")
        if len(payload) != length * bits // 8:
            raise _bad(f"masked input payload is {len(payload)} bytes, header says {length} x {bits // 8}")
        arr = np.frombuffer(payload, dtype=np.dtype(f"<u{bits // 8}")).astype(np.dtype(f"u{bits // 8}"))
        weight = head.get("weight")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))):
            raise _bad("field 'weight' must be a number")
        return MaskedInput(_str(head, "client_id"), _bytes(head, "session_id"), arr,
                           None if weight is None else float(weight))
    if kind == 6:
        return UnmaskRequest(_bytes(head, "session_id"), _strs(head, "survivors"), _strs(head, "dropped"))
    if kind == 7:
        return UnmaskResponse(_str(head, "client_id"), _bytes(head, "session_id"),
                              _share_map(head, "seed_shares"), _share_map(head, "key_shares"))
    if kind == 8:
        key = _bytes(head, "enc_private_key")
        accused = _strs(head, "accused")
        if (len(key) not in (0, 32)) or (accused and len(key) != 32) or len(set(accused)) != len(accused):
            raise _bad("a share check accuses distinct senders with a 32-byte key as evidence")
        return ShareCheck(_str(head, "client_id"), _bytes(head, "session_id"), accused, key)
    if kind == 9:
        return FinalHolders(_bytes(head, "session_id"), _strs(head, "holders"), _strs(head, "excluded"))
    raise _bad(f"unknown message kind {kind}")


# ---- sealed frames over MQTT ---------------------------------------------

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


def decode(frame: bytes) -> Message:
    """:func:`decode_message` (the name the orchestrators use)."""
    return decode_message(frame)


def encode(msg: Message) -> bytes:
    """:func:`encode_message` (the name the orchestrators use)."""
    return encode_message(msg)
