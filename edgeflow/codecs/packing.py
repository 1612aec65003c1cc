"""Vectorized byte packing for compact sections: LEB128 varints and b-bit fields.

Varints (unsigned LEB128: 7 bits per byte, low bits first, the high bit set
on every byte but the last) code sorted sparse indices as gaps, so a gap
below 128 costs one byte instead of a 2- or 4-byte index. ``b``-bit fields
pack small unsigned integers (quantized values) LSB-first, ``8 // b`` per
byte for b in 1, 2, 4, 8 and across byte boundaries otherwise.

The readers take bytes from the network: every malformed input (a varint
longer than :data:`MAX_VARINT_BYTES`, a run that ends inside a varint,
non-zero padding bits) raises a CodecError with reason ``malformed``, and
nothing is allocated beyond the size of the input itself.
"""

from __future__ import annotations

import numpy as np

from edgeflow.codecs.rejects import codec_error

__all__ = ["BLOCK", "MAX_VARINT_BYTES", "pack_bits", "read_varints", "unpack_bits", "varint", "varint_bytes"]

MAX_VARINT_BYTES = 9
"""Longest varint read: 63 bits, more than any element count an envelope may declare."""

BLOCK = 1 << 20
"""Bytes (varints) or values (bit fields) decoded per step: bounds the temporaries, not the input."""


def varint(value: int) -> bytes:
    """One unsigned LEB128 varint."""
    if value < 0:
        raise ValueError(f"varint of a negative number {value}")
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def varint_bytes(values: np.ndarray) -> bytes:
    """Many unsigned varints at once (``values``: non-negative integers below 2**63)."""
    v = np.asarray(values, dtype=np.uint64)
    if v.size == 0:
        return b""
    nbytes = np.ones(v.size, dtype=np.int64)
    for j in range(1, MAX_VARINT_BYTES):
        nbytes += v >= np.uint64(1 << (7 * j))
    starts = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    for j in range(int(nbytes.max())):
        has = nbytes > j
        byte = (v[has] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (nbytes[has] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + j] = (byte | more).astype(np.uint8)
    return out.tobytes()


def _incomplete(what: str, got: int, count: int) -> Exception:
    msg = (f"{what} ends inside its varints or holds one longer than {MAX_VARINT_BYTES} bytes "
           f"({got} of {count} complete)")
    return codec_error("malformed", msg)


def read_varints(buf: memoryview, count: int, what: str) -> tuple[np.ndarray, int]:
    """Parse ``count`` varints from the start of ``buf``; return (uint64 values, bytes used).

    Refuses a ``count`` larger than ``buf`` could hold (one byte per varint at
    least) before allocating anything sized by it, and decodes :data:`BLOCK`
    bytes at a time, so the temporaries stay a few tens of MB however long
    the (hostile) input is; the result is 8 bytes per varint.
    """
    if count == 0:
        return np.zeros(0, dtype=np.uint64), 0
    if count > len(buf):
        raise codec_error("malformed", f"{what} declares {count} varints but only {len(buf)} bytes follow")
    values = np.empty(count, dtype=np.uint64)
    got = pos = 0
    while got < count:
        raw = np.frombuffer(buf, dtype=np.uint8, count=min(len(buf) - pos, BLOCK), offset=pos)
        ends = np.flatnonzero(raw < 0x80)[: count - got]
        if ends.size == 0:
            raise _incomplete(what, got, count)
        n = ends.size
        starts = np.empty(n, dtype=np.int64)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        if int(lengths.max()) > MAX_VARINT_BYTES:
            raise codec_error("malformed", f"{what} holds a varint longer than {MAX_VARINT_BYTES} bytes")
        used = int(ends[-1]) + 1
        owner = np.repeat(np.arange(n), lengths)
        shift = (np.arange(used) - starts[owner]).astype(np.uint64) * np.uint64(7)
        parts = (raw[:used] & 0x7F).astype(np.uint64) << shift
        values[got : got + n] = np.add.reduceat(parts, starts)
        got += n
        pos += used
        if got < count and pos >= len(buf):
            raise _incomplete(what, got, count)
    return values, pos


def pack_bits(u: np.ndarray, bits: int) -> bytes:
    """Pack unsigned integers below ``2**bits`` LSB-first into ``ceil(len(u) * bits / 8)`` bytes."""
    u8 = np.asarray(u, dtype=np.uint8)
    if bits == 8:
        return u8.tobytes()
    planes = np.unpackbits(u8[:, None], axis=1, count=bits, bitorder="little")
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_bits(buf: memoryview, count: int, bits: int, what: str) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``buf`` must be exactly ``ceil(count * bits / 8)`` bytes with
    zero padding bits; returns ``count`` uint8 values (unpacked :data:`BLOCK` values at a time)."""
    need = (count * bits + 7) // 8
    if len(buf) != need:
        raise codec_error("malformed", f"{what} packs {len(buf)} bytes of values, expected {need} for {count}")
    raw = np.frombuffer(buf, dtype=np.uint8, count=need)
    if bits == 8:
        return raw.copy()
    out = np.empty(count, dtype=np.uint8)
    weights = (1 << np.arange(bits)).astype(np.uint8)
    for first in range(0, count, BLOCK):  # BLOCK is a multiple of 8: every block starts on a byte
        n = min(BLOCK, count - first)
        at = first * bits // 8
        flat = np.unpackbits(raw[at : at + (n * bits + 7) // 8], bitorder="little")
        if first + n == count and flat[n * bits :].any():
            raise codec_error("malformed", f"{what} has non-zero padding bits after its values")
        out[first : first + n] = (flat[: n * bits].reshape(n, bits) * weights).sum(axis=1, dtype=np.uint16)
    return out
