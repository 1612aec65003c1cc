"""The self-describing, versioned binary envelope that carries one update.

Layout (all integers little-endian, no pickle, no framework objects)::

    prefix  12 B  magic "EFUP" | version u8 | flags u8 | codec id u8 | 0 u8 | header length u32
    header        round id u64 | seq u64 | device id length u16 | tensor count u16 | metadata length u32
                  device id (UTF-8) | metadata (UTF-8 JSON object)
                  per tensor: name length u16 | dtype u8 | ndim u8 | section length u64
                              name (UTF-8) | ndim x u64 dims
    body          one codec section per tensor, each starting at a multiple of 8 (zero padding)
    crc32   4 B   zlib CRC-32 of everything before it
    [signature 72 B, if flags & 1: key id (8 B) | Ed25519 signature (64 B)]

The header says everything a receiver needs to size and validate the body
before touching it: names, shapes, original dtypes and section lengths, so a
truncated or padded envelope is caught by arithmetic, and the declared
element count can be bounded *before* any allocation.

The CRC catches accidental corruption of unsigned envelopes cheaply (under
1 ms for 4 MB). The signature covers the whole envelope up to and including
the CRC: the signed message is ``signing_message("update/v1",
SHA-256(envelope[:crc_end]))``, so signing cost does not grow with the update
and an update signature cannot be confused with an OTA signature.

Version 2 (the compact envelope) carries the same fields for small models,
where version 1's fixed-width header (about 0.4 KB for a 6-tensor MLP)
outweighs a sparse update: every integer of the header is an unsigned
LEB128 varint and sections follow each other without padding::

    prefix  7 B   magic "EFUP" | version 2 u8 | flags u8 | codec id u8
    header        varint header length (bytes after it, up to the first section)
                  varint round id | varint seq | varint device id length | device id
                  varint metadata length | metadata (binary, edgeflow.codecs.metadata) | varint tensor count
                  per tensor: varint name length | name | dtype u8 | ndim u8 | ndim x varint dims
                              | varint section length
    body          the codec sections, back to back
    crc32   4 B   and [signature 72 B] as in version 1, signed with context "update/v2"

Version 3 (``layout="digest"``) drops what a receiver that holds the model
already knows: the tensor names, dtypes and shapes become an 8-byte digest of
the model's layout, and the sections follow in the layout's order (tensor
names sorted)::

    prefix  7 B   magic "EFUP" | version 3 u8 | flags u8 | codec id u8
    header        varint header length
                  varint round id | varint seq | varint device id length | device id
                  varint metadata length | metadata (binary) | layout digest 8 B | dtype u8 (every tensor's)
                  | varint tensor count | per tensor: varint section length
    body, crc32, [signature]  as in version 2, signed with context "update/v3"

The digest is :func:`layout_digest`: the first 8 bytes of SHA-256 over the
sorted names, each with its shape. A receiver decodes version 3 only with
the model's shapes (``expected_shapes``); without them it can still peek at
the header (device, round, seq, section lengths), and decoding is refused
(``shape_mismatch``) rather than guessed.

Which version a sender writes is the codec's (:attr:`Codec.envelope_version`):
codecs a version-1 receiver knows keep version 1; newer codecs, unknown to
such a receiver anyway, use version 2. Every bound of version 1 holds.

Version policy: a receiver refuses versions it does not know (it cannot
guess a new layout), and says which side to upgrade.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeflow.codecs.metadata import unpack_metadata
from edgeflow.codecs.packing import varint
from edgeflow.codecs.rejects import codec_error
from edgeflow.codecs.untrusted import loads_untrusted
from edgeflow.errors import CodecError
from edgeflow.signing import KEY_ID_SIZE, SIGNATURE_SIZE, Signer, signing_message

__all__ = [
    "MAGIC",
    "VERSION",
    "VERSIONS",
    "VERSION_COMPACT",
    "VERSION_LAYOUT",
    "EnvelopeHeader",
    "TensorSpec",
    "build_envelope",
    "check_crc",
    "dtype_code",
    "layout_digest",
    "parse_envelope",
    "signed_message",
]

MAGIC = b"EFUP"
VERSION = 1
VERSION_COMPACT = 2
VERSION_LAYOUT = 3
VERSIONS = (VERSION, VERSION_COMPACT, VERSION_LAYOUT)
FLAG_SIGNED = 0x01
KNOWN_FLAGS = FLAG_SIGNED
SIGN_CONTEXT = "update/v1"
SIGN_CONTEXTS = {VERSION: SIGN_CONTEXT, VERSION_COMPACT: "update/v2", VERSION_LAYOUT: "update/v3"}
LAYOUT_DIGEST_SIZE = 8

_PREFIX = struct.Struct("<4sBBBBI")
_PREFIX2 = struct.Struct("<4sBBB")
_MAX_VARINT = 10  # a u64 needs up to 10 LEB128 bytes
_U64 = (1 << 64) - 1
_FIXED = struct.Struct("<QQHHI")
_TENSOR = struct.Struct("<HBBQ")
_CRC = struct.Struct("<I")
SIG_BLOCK = KEY_ID_SIZE + SIGNATURE_SIZE
MAX_NDIM = 32
MAX_METADATA = 64 * 1024
MAX_DEVICE_ID = 256

_DTYPES: dict[int, np.dtype] = {1: np.dtype(np.float16), 2: np.dtype(np.float32), 3: np.dtype(np.float64)}
_CODES = {dt: code for code, dt in _DTYPES.items()}


def dtype_code(dtype: np.dtype) -> int:
    try:
        return _CODES[np.dtype(dtype)]
    except KeyError:
        msg = f"dtype {np.dtype(dtype)} cannot be sent; updates carry float16, float32 or float64 tensors"
        raise codec_error("bad_input", msg) from None


def _align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as declared in the header, with where its section lies."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    size: int
    offset: int
    length: int


@dataclass(frozen=True)
class EnvelopeHeader:
    """Everything in an envelope except the tensor data (see :func:`parse_envelope`)."""

    version: int
    flags: int
    codec_id: int
    round_id: int
    seq: int
    device_id: str
    metadata: dict[str, Any]
    tensors: tuple[TensorSpec, ...]
    crc_at: int
    total_size: int
    key_id: bytes | None
    signature: bytes | None
    layout: bytes | None = None
    """Version 3: the layout digest the sender declared (``tensors`` is empty when it was parsed without
    the receiver's layout); None for versions 1 and 2."""
    section_lengths: tuple[int, ...] = ()

    @property
    def signed(self) -> bool:
        return bool(self.flags & FLAG_SIGNED)

    @property
    def num_elements(self) -> int:
        return sum(t.size for t in self.tensors)


@dataclass
class SectionInput:
    name: str
    dtype_code: int
    shape: tuple[int, ...]
    parts: list[Any]


def build_envelope(
    *,
    codec_id: int,
    round_id: int,
    seq: int,
    device_id: str,
    metadata_json: bytes,
    sections: Sequence[SectionInput],
    signer: Signer | None = None,
    version: int = VERSION,
) -> bytes:
    """Assemble the envelope with a single copy of the section data (``version`` 1 or 2).

    ``metadata_json`` is the metadata as the version writes it: JSON text for version 1, the binary
    form of :func:`edgeflow.codecs.metadata.pack_metadata` for versions 2 and 3. Version 3 writes the
    sections in the order of the names, sorted."""
    if version == VERSION_COMPACT:
        pieces = _compact_pieces(codec_id, round_id, seq, device_id, metadata_json, sections, signer)
        return _seal(pieces, signer, SIGN_CONTEXTS[VERSION_COMPACT])
    if version == VERSION_LAYOUT:
        pieces = _layout_pieces(codec_id, round_id, seq, device_id, metadata_json, sections, signer)
        return _seal(pieces, signer, SIGN_CONTEXTS[VERSION_LAYOUT])
    dev = device_id.encode("utf-8")
    head = [_FIXED.pack(round_id, seq, len(dev), len(sections), len(metadata_json)), dev, metadata_json]
    lengths = []
    for s in sections:
        name = s.name.encode("utf-8")
        length = sum(len(p) if isinstance(p, (bytes, bytearray)) else memoryview(p).nbytes for p in s.parts)
        lengths.append(length)
        head.append(_TENSOR.pack(len(name), s.dtype_code, len(s.shape), length))
        head.append(name)
        head.append(struct.pack(f"<{len(s.shape)}Q", *s.shape))
    header = b"".join(head)
    flags = FLAG_SIGNED if signer is not None else 0
    prefix = _PREFIX.pack(MAGIC, VERSION, flags, codec_id, 0, len(header))
    pieces: list[Any] = [prefix, header]
    pos = len(prefix) + len(header)
    for s, length in zip(sections, lengths):
        pad = _align8(pos) - pos
        if pad:
            pieces.append(b"\0" * pad)
        pieces.extend(s.parts)
        pos += pad + length
    return _seal(pieces, signer, SIGN_CONTEXT)


def layout_digest(shapes: Sequence[tuple[str, Sequence[int]]]) -> bytes:
    """The 8-byte digest of a model layout: SHA-256 over the names in sorted order, each as varint length,
    UTF-8 name, varint ndim and varint dims. Sender and receiver compute it from the same model."""
    h = hashlib.sha256(b"edgeflow:layout/v1\0")
    for name, shape in sorted(shapes, key=lambda t: t[0]):
        raw = name.encode("utf-8")
        h.update(varint(len(raw)) + raw + varint(len(shape)) + b"".join(varint(int(d)) for d in shape))
    return h.digest()[:LAYOUT_DIGEST_SIZE]


def _layout_pieces(codec_id: int, round_id: int, seq: int, device_id: str, metadata: bytes,
                   sections: Sequence[SectionInput], signer: Signer | None) -> list[Any]:
    codes = {s.dtype_code for s in sections}
    if len(codes) > 1:
        raise codec_error("bad_input", "layout='digest' sends one dtype for every tensor, but this update mixes "
                                       "dtypes; convert the tensors to one dtype or use layout='names'")
    ordered = sorted(sections, key=lambda s: s.name)
    dev = device_id.encode("utf-8")
    head = [varint(round_id), varint(seq), varint(len(dev)), dev, varint(len(metadata)), metadata,
            layout_digest([(s.name, s.shape) for s in ordered]), bytes((codes.pop() if codes else 2,)),
            varint(len(ordered))]
    head += [varint(sum(_part_len(p) for p in s.parts)) for s in ordered]
    header = b"".join(head)
    flags = FLAG_SIGNED if signer is not None else 0
    pieces: list[Any] = [_PREFIX2.pack(MAGIC, VERSION_LAYOUT, flags, codec_id), varint(len(header)), header]
    for s in ordered:
        pieces.extend(s.parts)
    return pieces


def _part_len(p: Any) -> int:
    return len(p) if isinstance(p, (bytes, bytearray)) else memoryview(p).nbytes


def _compact_pieces(codec_id: int, round_id: int, seq: int, device_id: str, metadata_json: bytes,
                    sections: Sequence[SectionInput], signer: Signer | None) -> list[Any]:
    dev = device_id.encode("utf-8")
    head = [varint(round_id), varint(seq), varint(len(dev)), dev, varint(len(metadata_json)), metadata_json,
            varint(len(sections))]
    for s in sections:
        name = s.name.encode("utf-8")
        head += [varint(len(name)), name, bytes((s.dtype_code, len(s.shape)))]
        head += [varint(d) for d in s.shape]
        head.append(varint(sum(_part_len(p) for p in s.parts)))
    header = b"".join(head)
    flags = FLAG_SIGNED if signer is not None else 0
    pieces: list[Any] = [_PREFIX2.pack(MAGIC, VERSION_COMPACT, flags, codec_id), varint(len(header)), header]
    for s in sections:
        pieces.extend(s.parts)
    return pieces


def _seal(pieces: list[Any], signer: Signer | None, context: str) -> bytes:
    """Append the CRC-32 and, when signing, the key id and the signature over the SHA-256 of it all."""
    crc = 0
    digest = hashlib.sha256() if signer is not None else None
    for p in pieces:
        crc = zlib.crc32(p, crc)
        if digest is not None:
            digest.update(p)
    crc_bytes = _CRC.pack(crc)
    pieces.append(crc_bytes)
    if signer is not None and digest is not None:
        digest.update(crc_bytes)
        pieces.append(signer.key_id)
        pieces.append(signer.sign(signing_message(context, digest.digest())))
    return b"".join(pieces)


class _Cursor:
    __slots__ = ("end", "mv", "pos")

    def __init__(self, mv: memoryview, pos: int, end: int) -> None:
        self.mv, self.pos, self.end = mv, pos, end

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > self.end:
            msg = f"envelope header ends inside {what}; the header is corrupt"
            raise codec_error("malformed", msg)
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size, what))

    def varint(self, what: str) -> int:
        value = shift = 0
        for _ in range(_MAX_VARINT):
            (byte,) = self.take(1, what)
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
        raise codec_error("malformed", f"envelope header holds a varint longer than {_MAX_VARINT} bytes in {what}")


def _text(raw: memoryview, what: str) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise codec_error("malformed", f"{what} is not valid UTF-8") from None


def parse_envelope(data: bytes | bytearray | memoryview, *, max_elements: int,
                   layout: Sequence[tuple[str, Sequence[int]]] | None = None) -> EnvelopeHeader:
    """Parse and bound-check the structure; no CRC, signature or tensor decoding.

    Cheap (microseconds): a gateway can peek at device id and round before
    spending time on the body. Raises CodecError with a ``reason``.
    ``layout`` ((name, shape) pairs, the receiver's model) names the tensors of a version-3 envelope;
    without it such an envelope parses with no tensors (``header.layout`` says which layout it needs).
    """
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    n = len(mv)
    if n >= 5 and bytes(mv[:4]) == MAGIC and mv[4] in (VERSION_COMPACT, VERSION_LAYOUT):
        return _parse_compact(mv, max_elements=max_elements, layout=layout)
    if n < _PREFIX.size:
        raise codec_error("truncated", f"envelope is {n} bytes, shorter than its {_PREFIX.size}-byte prefix")
    magic, version, flags, codec_id, reserved, header_len = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        msg = f"not an edgeflow update envelope (magic {bytes(magic)!r}, expected {MAGIC!r})"
        raise codec_error("bad_magic", msg)
    if version != VERSION:
        side = "receiver" if version > max(VERSIONS) else "sender"
        msg = (f"envelope version {version} is not supported (this edgeflow reads versions "
               f"{', '.join(map(str, VERSIONS))}); upgrade the {side}")
        raise codec_error("unsupported_version", msg)
    if flags & ~KNOWN_FLAGS or reserved:
        msg = f"envelope has unknown flags 0x{flags:02x}/reserved byte {reserved}; upgrade the receiver"
        raise codec_error("unsupported_version", msg)
    header_end = _PREFIX.size + header_len
    if header_end > n:
        raise codec_error("truncated", f"envelope is {n} bytes but its header alone claims {header_end}")
    cur = _Cursor(mv, _PREFIX.size, header_end)
    round_id, seq, dev_len, n_tensors, meta_len = cur.unpack(_FIXED, "the fixed fields")
    device_id, metadata = _identity(cur, dev_len, meta_len)
    tensors = _Tensors(n, header_end, max_elements, align=8)
    for _ in range(n_tensors):
        name_len, code, ndim, length = cur.unpack(_TENSOR, "a tensor entry")
        name = _text(cur.take(name_len, "a tensor name"), "tensor name")
        if ndim > MAX_NDIM:
            raise codec_error("malformed", f"tensor {name!r} declares {ndim} dimensions (max {MAX_NDIM})")
        shape = struct.unpack(f"<{ndim}Q", cur.take(8 * ndim, "a tensor shape"))
        tensors.add(name, code, shape, length)
    if cur.pos != header_end:
        raise codec_error("malformed", f"envelope header has {header_end - cur.pos} unexplained trailing bytes")
    return _header(mv, version, flags, codec_id, round_id, seq, device_id, metadata, tensors)


def _parse_compact(mv: memoryview, *, max_elements: int,
                   layout: Sequence[tuple[str, Sequence[int]]] | None = None) -> EnvelopeHeader:
    """Versions 2 and 3: the fields of version 1 as varints, sections unpadded; version 3 names the
    layout by its digest."""
    n = len(mv)
    if n < _PREFIX2.size:
        raise codec_error("truncated", f"envelope is {n} bytes, shorter than its {_PREFIX2.size}-byte prefix")
    _, version, flags, codec_id = _PREFIX2.unpack_from(mv, 0)
    if flags & ~KNOWN_FLAGS:
        raise codec_error("unsupported_version", f"envelope has unknown flags 0x{flags:02x}; upgrade the receiver")
    length_cur = _Cursor(mv, _PREFIX2.size, min(n, _PREFIX2.size + _MAX_VARINT))
    try:
        header_len = length_cur.varint("the header length")
    except CodecError:
        if n < _PREFIX2.size + _MAX_VARINT:
            raise codec_error("truncated", f"envelope is {n} bytes and ends inside its header length") from None
        raise
    header_end = length_cur.pos + header_len
    if header_end > n:
        raise codec_error("truncated", f"envelope is {n} bytes but its header alone claims {header_end}")
    cur = _Cursor(mv, length_cur.pos, header_end)
    round_id = cur.varint("the round id")
    seq = cur.varint("the seq")
    if round_id > _U64 or seq > _U64:
        raise codec_error("malformed", "envelope round id or seq exceeds 64 bits")
    dev_len = cur.varint("the device id length")
    if dev_len > MAX_DEVICE_ID:
        raise codec_error("malformed", f"device id is {dev_len} bytes, more than {MAX_DEVICE_ID}")
    device_id = _text(cur.take(dev_len, "the device id"), "device id")
    meta_len = cur.varint("the metadata length")
    if meta_len > MAX_METADATA:
        raise codec_error("too_large", f"metadata is {meta_len} bytes, more than {MAX_METADATA}")
    metadata = unpack_metadata(cur.take(meta_len, "the metadata"))
    if version == VERSION_LAYOUT:
        return _parse_layout(mv, cur, header_end, flags, codec_id, round_id, seq, device_id, metadata,
                             max_elements, layout)
    n_tensors = cur.varint("the tensor count")
    if n_tensors > 0xFFFF:
        raise codec_error("malformed", f"envelope declares {n_tensors} tensors (max 65535)")
    tensors = _Tensors(n, header_end, max_elements, align=1)
    for _ in range(n_tensors):
        name = _text(cur.take(cur.varint("a tensor name length"), "a tensor name"), "tensor name")
        code, ndim = cur.take(2, "a tensor entry")
        if ndim > MAX_NDIM:
            raise codec_error("malformed", f"tensor {name!r} declares {ndim} dimensions (max {MAX_NDIM})")
        shape = tuple(cur.varint("a tensor shape") for _ in range(ndim))
        tensors.add(name, code, shape, cur.varint("a section length"))
    if cur.pos != header_end:
        raise codec_error("malformed", f"envelope header has {header_end - cur.pos} unexplained trailing bytes")
    return _header(mv, version, flags, codec_id, round_id, seq, device_id, metadata, tensors)


def _parse_layout(mv: memoryview, cur: _Cursor, header_end: int, flags: int, codec_id: int, round_id: int,
                  seq: int, device_id: str, metadata: dict[str, Any], max_elements: int,
                  layout: Sequence[tuple[str, Sequence[int]]] | None) -> EnvelopeHeader:
    """The rest of a version-3 header: layout digest, dtype, section lengths; tensors named from ``layout``."""
    n = len(mv)
    digest = bytes(cur.take(LAYOUT_DIGEST_SIZE, "the layout digest"))
    (code,) = cur.take(1, "the dtype")
    if code not in _DTYPES:
        raise codec_error("malformed", f"envelope declares unknown dtype code {code}")
    n_tensors = cur.varint("the tensor count")
    if n_tensors > 0xFFFF:
        raise codec_error("malformed", f"envelope declares {n_tensors} tensors (max 65535)")
    lengths = [cur.varint("a section length") for _ in range(n_tensors)]
    if cur.pos != header_end:
        raise codec_error("malformed", f"envelope header has {header_end - cur.pos} unexplained trailing bytes")
    tensors = _Tensors(n, header_end, max_elements, align=1)
    if layout is None:
        for length in lengths:
            if tensors.pos + length > n:
                raise codec_error("truncated", "envelope ends inside a section")
            tensors.pos += length
    else:
        ordered = sorted(((str(name), tuple(int(d) for d in shape)) for name, shape in layout), key=lambda t: t[0])
        mine = layout_digest(ordered)
        if mine != digest or len(ordered) != n_tensors:
            msg = (f"update from {device_id!r} was encoded for another model layout (digest {digest.hex()}, "
                   f"{n_tensors} tensors; this model's is {mine.hex()}, {len(ordered)} tensors): the device trains "
                   "a different model version")
            raise codec_error("shape_mismatch", msg)
        for (name, shape), length in zip(ordered, lengths):
            tensors.add(name, code, shape, length)
    head = _header(mv, VERSION_LAYOUT, flags, codec_id, round_id, seq, device_id, metadata, tensors)
    return dataclasses.replace(head, layout=digest, section_lengths=tuple(lengths))


def _identity(cur: _Cursor, dev_len: int, meta_len: int) -> tuple[str, dict[str, Any]]:
    """The device id (``dev_len`` bytes) and the metadata JSON object (``meta_len`` bytes) at the cursor."""
    if dev_len > MAX_DEVICE_ID:
        raise codec_error("malformed", f"device id is {dev_len} bytes, more than {MAX_DEVICE_ID}")
    if meta_len > MAX_METADATA:
        raise codec_error("too_large", f"metadata is {meta_len} bytes, more than {MAX_METADATA}")
    device_id = _text(cur.take(dev_len, "the device id"), "device id")
    metadata: Any = {}
    if meta_len:
        try:
            metadata = loads_untrusted(_text(cur.take(meta_len, "the metadata"), "metadata"), "metadata")
        except CodecError as exc:
            raise codec_error("malformed", str(exc)) from None
        if not isinstance(metadata, dict):
            raise codec_error("malformed", "metadata must be a JSON object")
    return device_id, metadata


class _Tensors:
    """The tensor table being read: names unique, dtypes known, elements bounded before any
    allocation, sections inside the envelope (each at a multiple of ``align``)."""

    def __init__(self, n: int, body_at: int, max_elements: int, align: int) -> None:
        self.n, self.pos, self.max_elements, self.align = n, body_at, max_elements, align
        self.specs: list[TensorSpec] = []
        self.names: set[str] = set()
        self.total = 0

    def add(self, name: str, code: int, shape: Sequence[int], length: int) -> None:
        if not name or name in self.names:
            raise codec_error("malformed", f"tensor name {name!r} is empty or repeated")
        self.names.add(name)
        dtype = _DTYPES.get(code)
        if dtype is None:
            raise codec_error("malformed", f"tensor {name!r} declares unknown dtype code {code}")
        size = 1
        for d in shape:
            size *= d
        self.total += size
        if self.total > self.max_elements:
            msg = (
                f"envelope declares more than {self.max_elements} elements (tensor {name!r} has shape "
                f"{tuple(shape)}); refused before allocating; raise max_elements if this model is really that large"
            )
            raise codec_error("too_large", msg)
        offset = (self.pos + self.align - 1) // self.align * self.align
        if offset + length > self.n:
            raise codec_error("truncated", f"envelope ends inside the section of tensor {name!r}")
        self.specs.append(TensorSpec(name, dtype, tuple(int(d) for d in shape), size, offset, int(length)))
        self.pos = offset + length


def _header(mv: memoryview, version: int, flags: int, codec_id: int, round_id: int, seq: int, device_id: str,
            metadata: dict[str, Any], tensors: _Tensors) -> EnvelopeHeader:
    """Check the declared end against the real one; read the key id and signature."""
    n, pos = len(mv), tensors.pos
    signed = bool(flags & FLAG_SIGNED)
    total = pos + _CRC.size + (SIG_BLOCK if signed else 0)
    if n < total:
        raise codec_error("truncated", f"envelope is {n} bytes, its header declares {total}")
    if n > total:
        raise codec_error("malformed", f"envelope has {n - total} bytes after its declared end")
    key_id = signature = None
    if signed:
        key_id = bytes(mv[pos + 4 : pos + 4 + KEY_ID_SIZE])
        signature = bytes(mv[pos + 4 + KEY_ID_SIZE : total])
    return EnvelopeHeader(
        version=version,
        flags=flags,
        codec_id=codec_id,
        round_id=round_id,
        seq=seq,
        device_id=device_id,
        metadata=metadata,
        tensors=tuple(tensors.specs),
        crc_at=pos,
        total_size=total,
        key_id=key_id,
        signature=signature,
    )


def check_crc(data: memoryview, header: EnvelopeHeader) -> None:
    (stored,) = _CRC.unpack_from(data, header.crc_at)
    if zlib.crc32(data[: header.crc_at]) != stored:
        raise codec_error("checksum", "envelope CRC-32 mismatch: the bytes were corrupted in transit or storage")


def signed_message(data: memoryview, header: EnvelopeHeader) -> bytes:
    """The message the device signed: context + SHA-256 of the envelope up to the signature."""
    digest = hashlib.sha256(data[: header.crc_at + _CRC.size]).digest()
    return signing_message(SIGN_CONTEXTS[header.version], digest)
