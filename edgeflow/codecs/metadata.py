"""Binary metadata for the compact envelope: the update's JSON object in about a third of the bytes.

A device's metadata (``{"base_version": 12, "loss": 0.1993..., "num_samples":
72, "round_nonce": "9f3c..."}``) is about 90 bytes of JSON: a third of a
compact envelope's fixed cost on a small model. This is the same JSON data
model written as tagged binary values; :func:`unpack_metadata` returns
exactly what ``json.loads`` of the version-1 text would.

Values (tag byte, then)::

    0 null | 1 false | 2 true | 3 integer >= 0: varint | 4 integer < 0: varint of -1 - x
    5 float: <f4 (used when the float32 is the same number) | 6 float: <f8
    7 string: varint length | UTF-8      8 lowercase hex string: varint byte count | the bytes
    9 array: varint count | values       10 object: varint count | (key | value) per member
    11 JSON text: varint length | UTF-8 JSON (an integer beyond 64 bits)

A key is a varint: 0 then a string (varint length | UTF-8), or i >= 1 for
:data:`KEYS`\\ [i - 1], the keys edgeflow's devices send. The table is part of
the wire format: only append to it.

The reader takes bytes from the network: nesting deeper than
:data:`~edgeflow.codecs.untrusted.MAX_JSON_DEPTH`, counts larger than the
bytes left, repeated keys, NaN/Inf, bad UTF-8, unknown tags and trailing
bytes all raise a CodecError (reason ``malformed``).
"""

from __future__ import annotations

import math
import struct
from typing import Any

from edgeflow.codecs.packing import varint
from edgeflow.codecs.rejects import codec_error
from edgeflow.codecs.untrusted import MAX_JSON_DEPTH, loads_untrusted
from edgeflow.errors import CodecError

__all__ = ["KEYS", "pack_metadata", "unpack_metadata"]

KEYS = ("num_samples", "loss", "base_version", "round_nonce", "eval", "metrics", "num_examples", "train_s",
        "clock_skew_s", "accuracy")
_KEY_INDEX = {k: i + 1 for i, k in enumerate(KEYS)}
_F4, _F8 = struct.Struct("<f"), struct.Struct("<d")
_U64 = 1 << 64
_HEX = frozenset("0123456789abcdef")


def _text(s: str) -> bytes:
    raw = s.encode("utf-8")
    return varint(len(raw)) + raw


def _value(v: Any, out: list[bytes]) -> None:
    if v is None or isinstance(v, bool):
        out.append(b"\x00" if v is None else (b"\x02" if v else b"\x01"))
    elif isinstance(v, int):
        if 0 <= v < _U64:
            out.append(b"\x03" + varint(v))
        elif -_U64 <= v < 0:
            out.append(b"\x04" + varint(-1 - v))
        else:
            out.append(b"\x0b" + _text(str(v)))
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise codec_error("bad_input", f"metadata holds {v}; JSON has no NaN or Infinity")
        f4 = _F4.pack(v) if abs(v) < 3.4e38 else b""
        out.append(b"\x05" + f4 if f4 and _F4.unpack(f4)[0] == v else b"\x06" + _F8.pack(v))
    elif isinstance(v, str):
        if v and len(v) % 2 == 0 and set(v) <= _HEX:
            raw = bytes.fromhex(v)
            out.append(b"\x08" + varint(len(raw)) + raw)
        else:
            out.append(b"\x07" + _text(v))
    elif isinstance(v, (list, tuple)):
        out.append(b"\x09" + varint(len(v)))
        for item in v:
            _value(item, out)
    elif isinstance(v, dict):
        out.append(b"\x0a" + varint(len(v)))
        for key, item in v.items():
            if not isinstance(key, str):
                raise codec_error("bad_input", f"metadata keys must be strings, got {key!r}")
            out.append(varint(_KEY_INDEX[key]) if key in _KEY_INDEX else b"\x00" + _text(key))
            _value(item, out)
    else:
        raise codec_error("bad_input", f"metadata must be JSON data; {type(v).__name__} is not")


def pack_metadata(metadata: dict[str, Any]) -> bytes:
    """The binary form of a JSON object (empty bytes for an empty one)."""
    if not metadata:
        return b""
    out: list[bytes] = []
    _value(dict(metadata), out)
    return b"".join(out)


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if n > len(self.buf) - self.pos:
            raise codec_error("malformed", "metadata ends inside a value")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def varint(self) -> int:
        value = shift = 0
        for _ in range(10):
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
        raise codec_error("malformed", "metadata holds a varint longer than 10 bytes")

    def count(self) -> int:
        n = self.varint()
        if n > len(self.buf) - self.pos:  # every element takes at least one byte
            raise codec_error("malformed", f"metadata declares {n} elements with {len(self.buf) - self.pos} bytes left")
        return n

    def text(self) -> str:
        try:
            return self.take(self.count()).decode("utf-8")
        except UnicodeDecodeError:
            raise codec_error("malformed", "metadata holds a string that is not valid UTF-8") from None

    def key(self) -> str:
        i = self.varint()
        if i == 0:
            return self.text()
        if i > len(KEYS):
            raise codec_error("malformed", f"metadata names key {i}; this edgeflow knows {len(KEYS)}: upgrade it")
        return KEYS[i - 1]

    def value(self, depth: int) -> Any:
        if depth > MAX_JSON_DEPTH:
            raise codec_error("malformed", f"metadata nests deeper than {MAX_JSON_DEPTH} levels; refused")
        tag = self.take(1)[0]
        if tag <= 2:
            return (None, False, True)[tag]
        if tag in (3, 4):
            v = self.varint()
            if v >= _U64:
                raise codec_error("malformed", "metadata holds an integer varint beyond 64 bits")
            return v if tag == 3 else -1 - v
        if tag in (5, 6):
            (f,) = (_F4 if tag == 5 else _F8).unpack(self.take(4 if tag == 5 else 8))
            if not math.isfinite(f):
                raise codec_error("malformed", "metadata holds NaN or Infinity")
            return float(f)
        if tag == 7:
            return self.text()
        if tag == 8:
            return self.take(self.count()).hex()
        if tag == 9:
            return [self.value(depth + 1) for _ in range(self.count())]
        if tag == 10:
            out: dict[str, Any] = {}
            for _ in range(self.count()):
                k = self.key()
                if k in out:
                    raise codec_error("malformed", f"metadata repeats the key {k[:40]!r}")
                out[k] = self.value(depth + 1)
            return out
        if tag == 11:
            try:
                v = loads_untrusted(self.text(), "metadata")
            except CodecError as exc:
                raise codec_error("malformed", str(exc)) from None
            if isinstance(v, bool) or not isinstance(v, int):
                raise codec_error("malformed", "metadata's JSON-text value must be an integer")
            return v
        raise codec_error("malformed", f"metadata holds unknown tag {tag}; upgrade the receiver")


def unpack_metadata(raw: bytes) -> dict[str, Any]:
    """Parse binary metadata from the network into a JSON object, or raise CodecError (malformed)."""
    if not raw:
        return {}
    reader = _Reader(bytes(raw))
    out = reader.value(1)
    if not isinstance(out, dict):
        raise codec_error("malformed", "metadata must be an object")
    if reader.pos != len(reader.buf):
        raise codec_error("malformed", f"metadata has {len(reader.buf) - reader.pos} bytes after its value")
    return out
