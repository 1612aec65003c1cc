"""edgeflow's wire format, implemented from docs/wire-format.md alone.

This module must never import edgeflow (or numpy): it is the proof that the
specification is complete. It uses only what C firmware has: fixed-layout
byte packing (``struct``), SHA-256/SHA-512 (``hashlib``), CRC-32 (``zlib``,
the standard IEEE 802.3 CRC) and a JSON parser for the few JSON messages.
Section numbers (§) refer to docs/wire-format.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib

import ed25519

# §7 envelope ---------------------------------------------------------------
MAGIC = b"EFUP"
VERSION = 1
VERSION_COMPACT = 2  # §7.6
VERSION_LAYOUT = 3  # §7.7
FLAG_SIGNED = 0x01
CODECS = {1: "dense", 2: "fp16", 3: "int8", 4: "topk", 5: "topk-int8", 6: "topk-packed", 7: "randk-packed"}
COMPACT_ONLY = {"topk-packed", "randk-packed"}  # §8.6, §8.7: travel in versions 2 and 3 only
CODEC_IDS = {v: k for k, v in CODECS.items()}
DTYPES = {1: "float16", 2: "float32", 3: "float64"}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
MAX_NDIM = 32
MAX_METADATA = 65536
MAX_DEVICE_ID = 256
UPDATE_CONTEXT = "update/v1"
UPDATE_COMPACT_CONTEXT = "update/v2"
UPDATE_LAYOUT_CONTEXT = "update/v3"
UPDATE_CONTEXTS = {VERSION: UPDATE_CONTEXT, VERSION_COMPACT: UPDATE_COMPACT_CONTEXT, VERSION_LAYOUT: UPDATE_LAYOUT_CONTEXT}
LAYOUT_CONTEXT = b"edgeflow:layout/v1\0"

# §5 chunks -----------------------------------------------------------------
CHUNK_MAGIC = b"EFCK"
CHUNK_VERSION = 1
CHUNK_HEADER = 80


class WireError(ValueError):
    """Anything that does not follow the specification."""


# ------------------------------------------------------------------ §3 primitives


def f32(x: float) -> float:
    """Round a Python float (binary64) to the nearest binary32, ties to even."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bytes(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def f32_list(data: bytes) -> list[float]:
    if len(data) % 4:
        raise WireError("float32 data is not a multiple of 4 bytes")
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def signing_message(context: str, digest: bytes) -> bytes:
    """§6: the bytes every edgeflow signature is made over."""
    return b"edgeflow:" + context.encode("utf-8") + b"\x00" + digest


def key_id(public_key: bytes) -> bytes:
    return hashlib.sha256(public_key).digest()[:8]


def align8(n: int) -> int:
    return (n + 7) & ~7


def align4(n: int) -> int:
    return (n + 3) & ~3


def varint(value: int) -> bytes:
    """§7.6: unsigned LEB128, 7 bits per byte, least significant first, high bit on all bytes but the last."""
    if value < 0:
        raise WireError("a varint cannot be negative")
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def read_varint(data: bytes, pos: int, end: int, max_bytes: int = 10) -> tuple[int, int]:
    """(value, next position); refuses a varint running past ``end`` or longer than ``max_bytes``."""
    value = shift = 0
    for _ in range(max_bytes):
        if pos >= end:
            raise WireError("data ends inside a varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value >= 1 << 64:
                raise WireError("varint beyond 64 bits")
            return value, pos
        shift += 7
    raise WireError(f"varint longer than {max_bytes} bytes")


# ------------------------------------------------------------------ §8 codec sections


def _check_finite(values: list[float], what: str) -> None:
    for v in values:
        if v != v or v in (math.inf, -math.inf):
            raise WireError(f"{what} holds NaN or Inf")


def decode_section(codec: str, section: bytes, size: int) -> dict:
    """A codec section as its fields (§8); raises WireError for any layout violation."""
    n = len(section)
    if codec == "dense":
        if n != 4 * size:
            raise WireError(f"dense section is {n} bytes, expected {4 * size}")
        values = f32_list(section)
        _check_finite(values, "dense section")
        return {"values": values}
    if codec == "fp16":
        if n != 2 * size:
            raise WireError(f"fp16 section is {n} bytes, expected {2 * size}")
        halves = list(struct.unpack(f"<{size}e", section))
        _check_finite(halves, "fp16 section")
        return {"values": halves}
    if codec == "int8":
        if n != 8 + size:
            raise WireError(f"int8 section is {n} bytes, expected {8 + size}")
        scale, reserved = struct.unpack_from("<fI", section, 0)
        if reserved:
            raise WireError("int8 reserved bytes are not zero")
        _check_scale(scale)
        q = list(struct.unpack_from(f"<{size}b", section, 8))
        if q and min(q) < -127:
            raise WireError("int8 value -128 never appears on the wire")
        return {"scale": scale, "q": q}
    if codec in ("topk", "topk-int8"):
        head = 8 if codec == "topk" else 16
        if n < head:
            raise WireError(f"{codec} section shorter than its header")
        k, width = struct.unpack_from("<IB", section, 0)
        if section[5:8] != b"\0\0\0":
            raise WireError(f"{codec} reserved bytes are not zero")
        if width not in (2, 4):
            raise WireError(f"index width {width}")
        if k > size:
            raise WireError(f"k={k} > size={size}")
        out: dict = {"k": k, "index_width": width}
        if codec == "topk-int8":
            scale, reserved = struct.unpack_from("<fI", section, 8)
            if reserved:
                raise WireError("topk-int8 reserved bytes are not zero")
            _check_scale(scale)
            out["scale"] = scale
        values_at = head + align4(k * width)
        value_bytes = 4 if codec == "topk" else 1
        if n != values_at + k * value_bytes:
            raise WireError(f"{codec} section is {n} bytes, expected {values_at + k * value_bytes}")
        if any(section[head + k * width:values_at]):
            raise WireError(f"{codec} index padding is not zero")
        indices = list(struct.unpack_from(f"<{k}{'H' if width == 2 else 'I'}", section, head))
        for a, b in zip(indices, indices[1:]):
            if b <= a:
                raise WireError("indices are not strictly increasing")
        if indices and indices[-1] >= size:
            raise WireError("index out of range")
        out["indices"] = indices
        if codec == "topk":
            out["values"] = f32_list(section[values_at:])
            _check_finite(out["values"], "topk values")
        else:
            out["q"] = list(struct.unpack_from(f"<{k}b", section, values_at))
            if out["q"] and min(out["q"]) < -127:
                raise WireError("int8 value -128 never appears on the wire")
        return out
    if codec == "topk-packed":
        return _decode_packed(section, size)
    if codec == "randk-packed":
        return _decode_randk(section, size)
    raise WireError(f"unknown codec {codec!r}")


def packed_qmax(bits: int) -> int:
    """§8.6: 2^(b-1) - 1, and 1 for b = 1."""
    return 1 if bits == 1 else (1 << (bits - 1)) - 1


def _decode_packed(section: bytes, size: int) -> dict:
    n = len(section)
    k, pos = read_varint(section, 0, n, 9)
    if k > size:
        raise WireError(f"k={k} > size={size}")
    if pos + 5 > n:
        raise WireError("topk-packed section shorter than its header")
    bits, scale = struct.unpack_from("<Bf", section, pos)
    pos += 5
    if not 1 <= bits <= 8:
        raise WireError(f"topk-packed bits {bits} not in 1..8")
    _check_scale(scale)
    if packed_qmax(bits) * scale > 1e9 * (1 + 1e-6):
        raise WireError("topk-packed scale beyond 10^9 / qmax")
    indices, last = [], -1
    for _ in range(k):
        gap, pos = read_varint(section, pos, n, 9)
        if gap == 0:
            raise WireError("topk-packed gap of 0 repeats an index")
        last += gap
        if last >= size:
            raise WireError("topk-packed index out of range")
        indices.append(last)
    need = (k * bits + 7) // 8
    if n - pos != need:
        raise WireError(f"topk-packed codes take {n - pos} bytes, expected {need}")
    bitstring = int.from_bytes(section[pos:], "little")
    mask = (1 << bits) - 1
    codes = [(bitstring >> (i * bits)) & mask for i in range(k)]
    if bitstring >> (k * bits):
        raise WireError("topk-packed padding bits are not zero")
    if bits > 1 and any(c > 2 * packed_qmax(bits) for c in codes):
        raise WireError("topk-packed code above 2 qmax")
    return {"k": k, "bits": bits, "scale": scale, "indices": indices, "codes": codes}


def _codes(data: bytes, k: int, bits: int, what: str) -> list[int]:
    """§8.6: k codes of ``bits`` bits, LSB first; exactly ceil(k b / 8) bytes, zero padding bits, c <= 2 qmax."""
    need = (k * bits + 7) // 8
    if len(data) != need:
        raise WireError(f"{what} codes take {len(data)} bytes, expected {need}")
    bitstring = int.from_bytes(data, "little")
    mask = (1 << bits) - 1
    codes = [(bitstring >> (i * bits)) & mask for i in range(k)]
    if bitstring >> (k * bits):
        raise WireError(f"{what} padding bits are not zero")
    if bits > 1 and any(c > 2 * packed_qmax(bits) for c in codes):
        raise WireError(f"{what} code above 2 qmax")
    return codes


def _pack_codes(codes: list[int], bits: int) -> bytes:
    bitstring = 0
    for i, c in enumerate(codes):
        bitstring |= c << (i * bits)
    return bitstring.to_bytes((len(codes) * bits + 7) // 8, "little")


# §8.7: PCG64 from a u32 seed, step by step as the document states it
_M32, _M64, _M128 = (1 << 32) - 1, (1 << 64) - 1, (1 << 128) - 1
PCG64_MULTIPLIER = 0x2360ED051FC65DA44385DF649FCCF645


def pcg64_state_words(seed: int) -> list[int]:
    """§8.7 steps 1-2: the four u64 words q_0..q_3 a u32 seed expands to."""
    if not 0 <= seed <= _M32:
        raise WireError("a randk seed is a u32")
    h = 0x43B0D7E5

    def hashmix(v: int) -> int:
        nonlocal h
        v ^= h
        h = (h * 0x931E8875) & _M32
        v = (v * h) & _M32
        return v ^ (v >> 16)

    def mix(x: int, y: int) -> int:
        t = (0xCA01F9DD * x - 0x4973F715 * y) & _M32
        return t ^ (t >> 16)

    pool = [hashmix(seed), hashmix(0), hashmix(0), hashmix(0)]
    for i in range(4):
        for j in range(4):
            if i != j:
                pool[j] = mix(pool[j], hashmix(pool[i]))
    g, words = 0x8B51F9DD, []
    for i in range(8):
        v = pool[i % 4] ^ g
        g = (g * 0x58F38DED) & _M32
        v = (v * g) & _M32
        words.append(v ^ (v >> 16))
    return [words[2 * m] | words[2 * m + 1] << 32 for m in range(4)]


class PCG64:
    """§8.7 steps 3-4: PCG64 (128-bit LCG, XSL-RR output) seeded from a u32."""

    def __init__(self, seed: int) -> None:
        q = pcg64_state_words(seed)
        self.inc = ((q[2] << 64 | q[3]) << 1 | 1) & _M128
        self.state = 0
        self._step()
        self.state = (self.state + (q[0] << 64 | q[1])) & _M128
        self._step()

    def _step(self) -> None:
        self.state = (self.state * PCG64_MULTIPLIER + self.inc) & _M128

    def next(self) -> int:
        self._step()
        x = ((self.state >> 64) ^ self.state) & _M64
        rot = self.state >> 122
        return ((x >> rot) | (x << ((64 - rot) & 63))) & _M64


def randk_indices(seed: int, n: int, density: int) -> list[int]:
    """§8.7: entry i of n is kept when the i-th raw output >> 48 is below the density (0 on the wire: 65536)."""
    d = density or 1 << 16
    gen = PCG64(seed)
    return [i for i in range(n) if gen.next() >> 48 < d]


def randk_density(ratio: float) -> int:
    """§8.7 (sender): ratio x 65536 rounded to nearest, ties to even (Python's round), in [1, 65536]."""
    return max(1, min(1 << 16, round(ratio * (1 << 16))))


def _decode_randk(section: bytes, size: int) -> dict:
    if len(section) < 11:
        raise WireError("randk-packed section shorter than its 11-byte header")
    bits, density, seed, scale = struct.unpack_from("<BHIf", section, 0)
    if not 1 <= bits <= 8:
        raise WireError(f"randk-packed bits {bits} not in 1..8")
    _check_scale(scale)
    if packed_qmax(bits) * scale > 1e9 * (1 + 1e-6):
        raise WireError("randk-packed scale beyond 10^9 / qmax")
    indices = randk_indices(seed, size, density)
    codes = _codes(section[11:], len(indices), bits, "randk-packed")
    return {"k": len(indices), "bits": bits, "density": density, "seed": seed, "scale": scale, "indices": indices,
            "codes": codes}


def _encode_randk(fields: dict) -> bytes:
    return struct.pack("<BHIf", fields["bits"], fields["density"], fields["seed"], fields["scale"]) + \
        _pack_codes(fields["codes"], fields["bits"])


def _encode_packed(fields: dict) -> bytes:
    k, bits = fields["k"], fields["bits"]
    out = varint(k) + struct.pack("<Bf", bits, fields["scale"])
    last = -1
    for i in fields["indices"]:
        out += varint(i - last)
        last = i
    bitstring = 0
    for i, c in enumerate(fields["codes"]):
        bitstring |= c << (i * bits)
    return out + bitstring.to_bytes((k * bits + 7) // 8, "little")


def quantize_packed(x: list[float], bits: int, uniforms) -> tuple[float, list[int]]:
    """§8.6 in binary32 arithmetic (b >= 2: §8.3 with qmax; b = 1: signs and the mean magnitude)."""
    if not x:
        return 0.0, []
    if bits == 1:
        return f32(sum(abs(v) for v in x) / len(x)), [1 if v >= 0 else 0 for v in x]
    qmax = packed_qmax(bits)
    amax = max(max(x), -min(x))
    scale = f32(amax / qmax)
    if amax == 0.0 or scale == 0.0:
        return 0.0, [qmax] * len(x)
    inv = f32(1.0 / scale)
    codes = []
    for v in x:
        t = f32(f32(v * inv) + next(uniforms))
        codes.append(max(-qmax, min(qmax, math.floor(t))) + qmax)
    return scale, codes


def packed_count(n: int, options: dict) -> int:
    """§8.6 selection: k from §8.4 (``k`` or ``ratio``, default 0.01), at least min(n, min_k)."""
    if n == 0:
        return 0
    if options.get("k") is not None:
        k = min(n, int(options["k"]))
    else:
        k = max(1, min(n, math.ceil(float(options.get("ratio", 0.01)) * n)))
    return max(k, min(n, int(options.get("min_k", 1))))


def _check_scale(scale: float) -> None:
    if scale != scale or scale in (math.inf, -math.inf) or scale < 0:
        raise WireError(f"scale {scale} is not finite and >= 0")


def encode_section(codec: str, fields: dict) -> bytes:
    """The bytes of a section from its fields (the inverse of :func:`decode_section`)."""
    if codec == "dense":
        return f32_bytes(fields["values"])
    if codec == "fp16":
        return struct.pack(f"<{len(fields['values'])}e", *fields["values"])
    if codec == "int8":
        return struct.pack("<fI", fields["scale"], 0) + struct.pack(f"<{len(fields['q'])}b", *fields["q"])
    if codec in ("topk", "topk-int8"):
        k, width = fields["k"], fields["index_width"]
        out = struct.pack("<IB3x", k, width)
        if codec == "topk-int8":
            out += struct.pack("<fI", fields["scale"], 0)
        idx = struct.pack(f"<{k}{'H' if width == 2 else 'I'}", *fields["indices"])
        out += idx + b"\0" * (align4(len(idx)) - len(idx))
        if codec == "topk":
            return out + f32_bytes(fields["values"])
        return out + struct.pack(f"<{k}b", *fields["q"])
    if codec == "topk-packed":
        return _encode_packed(fields)
    if codec == "randk-packed":
        return _encode_randk(fields)
    raise WireError(f"unknown codec {codec!r}")


def dequantize(scale: float, q: list[int]) -> list[float]:
    return [f32(v * scale) for v in q]


def section_values(codec: str, fields: dict, size: int) -> list[float]:
    """The float32 values a receiver reconstructs (§8: zeros where top-k sent nothing)."""
    if codec in ("dense", "fp16"):
        return [f32(v) for v in fields["values"]]
    if codec == "int8":
        return dequantize(fields["scale"], fields["q"])
    out = [0.0] * size
    if codec in ("topk-packed", "randk-packed"):
        scale, bits = fields["scale"], fields["bits"]
        if bits == 1:
            vals = [scale if c else -scale for c in fields["codes"]]
        else:
            vals = [f32((c - packed_qmax(bits)) * scale) for c in fields["codes"]]
    else:
        vals = fields["values"] if codec == "topk" else dequantize(fields["scale"], fields["q"])
    for i, v in zip(fields["indices"], vals):
        out[i] = v
    return out


def quantize_int8(x: list[float], uniforms) -> tuple[float, list[int]]:
    """§8.3 in binary32 arithmetic; ``uniforms`` yields one U[0,1) binary32 per value."""
    if not x:
        return 0.0, []
    amax = max(max(x), -min(x))
    if amax == 0.0:
        return 0.0, [0] * len(x)
    scale = f32(amax / 127.0)
    if scale == 0.0:
        return 0.0, [0] * len(x)
    inv = f32(1.0 / scale)
    q = []
    for v in x:
        t = f32(f32(v * inv) + next(uniforms))
        q.append(max(-127, min(127, math.floor(t))))
    return scale, q


def topk_select(x: list[float], k: int) -> list[int]:
    """The k largest |x| (ties: lowest index first), in increasing index order."""
    order = sorted(range(len(x)), key=lambda i: (-abs(x[i]), i))
    return sorted(order[:k])


def encode_values(codec: str, x: list[float], *, uniforms=None, k: int | None = None,
                  options: dict | None = None) -> dict:
    """Section fields for float32 values ``x`` (already rounded to binary32); ``options`` for topk-packed."""
    if codec == "randk-packed":  # options: seed (the sender's u32), ratio (default 0.1), bits (default 1)
        opts = dict(options or {})
        bits = int(opts.get("bits", 1))
        density = randk_density(float(opts.get("ratio", 0.1)))
        idx = randk_indices(int(opts["seed"]), len(x), density)
        scale, codes = quantize_packed([x[i] for i in idx], bits, uniforms)
        return {"k": len(idx), "bits": bits, "density": density & 0xFFFF, "seed": int(opts["seed"]), "scale": scale,
                "indices": idx, "codes": codes}
    if codec == "topk-packed":
        opts = dict(options or {})
        if k is not None:
            opts.setdefault("k", k)
        bits = int(opts.get("bits", 4))
        idx = topk_select(x, packed_count(len(x), opts))
        scale, codes = quantize_packed([x[i] for i in idx], bits, uniforms)
        return {"k": len(idx), "bits": bits, "scale": scale, "indices": idx, "codes": codes}
    if codec == "dense":
        return {"values": list(x)}
    if codec == "fp16":
        try:
            struct.pack(f"<{len(x)}e", *x)
        except OverflowError:
            raise WireError("values exceed the fp16 range") from None
        return {"values": list(struct.unpack(f"<{len(x)}e", struct.pack(f"<{len(x)}e", *x)))}
    if codec == "int8":
        scale, q = quantize_int8(x, uniforms)
        return {"scale": scale, "q": q}
    if codec in ("topk", "topk-int8"):
        kk = min(len(x), int(k or 0))
        idx = topk_select(x, kk)
        width = 2 if len(x) <= 65536 else 4
        if codec == "topk":
            return {"k": kk, "index_width": width, "indices": idx, "values": [x[i] for i in idx]}
        scale, q = quantize_int8([x[i] for i in idx], uniforms)
        return {"k": kk, "index_width": width, "indices": idx, "scale": scale, "q": q}
    raise WireError(f"unknown codec {codec!r}")


# ------------------------------------------------------------------ §7 envelope


def parse_envelope(data: bytes, *, max_elements: int = 1 << 28, layout: list | None = None) -> dict:
    """Header, tensor sections and signature block of an envelope; checks structure and CRC. ``layout``: the
    receiver's model as (name, shape) pairs, which a version-3 envelope needs (§7.7)."""
    n = len(data)
    if n >= 7 and data[:4] == MAGIC and data[4] == VERSION_COMPACT:
        return parse_compact_envelope(data, max_elements=max_elements)
    if n >= 7 and data[:4] == MAGIC and data[4] == VERSION_LAYOUT:
        return parse_layout_envelope(data, layout, max_elements=max_elements)
    if n < 12:
        raise WireError("shorter than the 12-byte prefix")
    magic, version, flags, codec_id, reserved, header_len = struct.unpack_from("<4sBBBBI", data, 0)
    if magic != MAGIC:
        raise WireError("bad magic")
    if version != VERSION:
        raise WireError(f"envelope version {version} unknown")
    if flags & ~FLAG_SIGNED or reserved:
        raise WireError("unknown flags or non-zero reserved byte")
    if codec_id not in CODECS or CODECS[codec_id] in COMPACT_ONLY:
        raise WireError(f"unknown codec id {codec_id} in a version-1 envelope")
    header_end = 12 + header_len
    if header_end > n or header_len < 24:
        raise WireError("header longer than the envelope")
    round_id, seq, dev_len, count, meta_len = struct.unpack_from("<QQHHI", data, 12)
    if dev_len > MAX_DEVICE_ID or meta_len > MAX_METADATA:
        raise WireError("device id or metadata too long")
    pos = 36
    device_id = data[pos:pos + dev_len].decode("utf-8")
    pos += dev_len
    meta_raw = data[pos:pos + meta_len]
    pos += meta_len
    metadata = json.loads(meta_raw.decode("utf-8")) if meta_len else {}
    if not isinstance(metadata, dict):
        raise WireError("metadata is not a JSON object")
    tensors = []
    body = header_end
    names = set()
    elements = 0
    for _ in range(count):
        if pos + 12 > header_end:
            raise WireError("header ends inside a tensor entry")
        name_len, dtype_code, ndim, length = struct.unpack_from("<HBBQ", data, pos)
        pos += 12
        name = data[pos:pos + name_len].decode("utf-8")
        pos += name_len
        if not name or name in names:
            raise WireError("empty or repeated tensor name")
        names.add(name)
        if dtype_code not in DTYPES or ndim > MAX_NDIM:
            raise WireError("bad dtype code or too many dimensions")
        shape = list(struct.unpack_from(f"<{ndim}Q", data, pos))
        pos += 8 * ndim
        size, elements = _counted(shape, elements, max_elements)
        offset = align8(body)
        if offset + length > n:
            raise WireError("section beyond the end")
        if any(data[body:offset]):
            raise WireError("padding is not zero")
        tensors.append({"name": name, "dtype_code": dtype_code, "dtype": DTYPES[dtype_code], "shape": shape,
                        "size": size, "offset": offset, "length": length,
                        "section": data[offset:offset + length]})
        body = offset + length
    if pos != header_end:
        raise WireError("header length disagrees with its contents")
    signed = bool(flags & FLAG_SIGNED)
    total = body + 4 + (72 if signed else 0)
    if n != total:
        raise WireError(f"envelope is {n} bytes, its header declares {total}")
    (crc,) = struct.unpack_from("<I", data, body)
    if zlib.crc32(data[:body]) != crc:
        raise WireError("CRC-32 mismatch")
    out = {"version": version, "flags": flags, "codec_id": codec_id, "codec": CODECS[codec_id],
           "round_id": round_id, "seq": seq, "device_id": device_id, "metadata": metadata,
           "metadata_json": meta_raw.decode("utf-8"), "tensors": tensors, "crc_offset": body, "crc32": crc,
           "header_length": header_len, "key_id": None, "signature": None, "signing_message": None}
    if signed:
        out["key_id"] = data[body + 4:body + 12]
        out["signature"] = data[body + 12:body + 76]
        out["signing_message"] = signing_message(UPDATE_CONTEXT, hashlib.sha256(data[:body + 4]).digest())
    for t in tensors:
        t["fields"] = decode_section(out["codec"], t["section"], t["size"])
        t["values"] = section_values(out["codec"], t["fields"], t["size"])
    return out


def _finish(data: bytes, out: dict, body: int) -> dict:
    """§7.4: exact total size, CRC-32, signature block; then decode every section (§8)."""
    signed = bool(out["flags"] & FLAG_SIGNED)
    total = body + 4 + (72 if signed else 0)
    if len(data) != total:
        raise WireError(f"envelope is {len(data)} bytes, its header declares {total}")
    (crc,) = struct.unpack_from("<I", data, body)
    if zlib.crc32(data[:body]) != crc:
        raise WireError("CRC-32 mismatch")
    out.update({"crc_offset": body, "crc32": crc, "key_id": None, "signature": None, "signing_message": None})
    if signed:
        context = UPDATE_CONTEXTS[out["version"]]
        out["key_id"] = data[body + 4:body + 12]
        out["signature"] = data[body + 12:body + 76]
        out["signing_message"] = signing_message(context, hashlib.sha256(data[:body + 4]).digest())
    for t in out["tensors"]:
        t["fields"] = decode_section(out["codec"], t["section"], t["size"])
        t["values"] = section_values(out["codec"], t["fields"], t["size"])
    return out


def _counted(shape: list[int], elements: int, max_elements: int) -> tuple[int, int]:
    """A tensor's element count and the envelope's running total, refused past ``max_elements``."""
    size = 1
    for d in shape:
        size *= d
    elements += size
    if elements > max_elements:
        raise WireError("too many elements")
    return size, elements


def _varint_header(data: bytes, version_expected: int) -> tuple[dict, int, int]:
    """§7.6/§7.7: what versions 2 and 3 share: prefix, header length, round, seq, device id, metadata.
    Returns the fields read, the position after the metadata and the header's end."""
    n = len(data)
    magic, version, flags, codec_id = struct.unpack_from("<4sBBB", data, 0)
    if magic != MAGIC or version != version_expected:
        raise WireError(f"not a version-{version_expected} envelope")
    if flags & ~FLAG_SIGNED:
        raise WireError("unknown flags")
    if codec_id not in CODECS:
        raise WireError(f"unknown codec id {codec_id}")
    header_len, pos = read_varint(data, 7, n)
    header_end = pos + header_len
    if header_end > n:
        raise WireError("header longer than the envelope")
    round_id, pos = read_varint(data, pos, header_end)
    seq, pos = read_varint(data, pos, header_end)
    dev_len, pos = read_varint(data, pos, header_end)
    if dev_len > MAX_DEVICE_ID or pos + dev_len > header_end:
        raise WireError("device id too long")
    device_id = data[pos:pos + dev_len].decode("utf-8")
    pos += dev_len
    meta_len, pos = read_varint(data, pos, header_end)
    if meta_len > MAX_METADATA or pos + meta_len > header_end:
        raise WireError("metadata too long")
    meta_raw = data[pos:pos + meta_len]
    pos += meta_len
    head = {"version": version, "flags": flags, "codec_id": codec_id, "codec": CODECS[codec_id],
            "round_id": round_id, "seq": seq, "device_id": device_id, "metadata": unpack_metadata(meta_raw),
            "metadata_hex": meta_raw.hex(), "header_length": header_len}
    return head, pos, header_end


def parse_compact_envelope(data: bytes, *, max_elements: int = 1 << 28) -> dict:
    """§7.6: the version-2 envelope (varint header, unpadded sections, binary metadata)."""
    n = len(data)
    head, pos, header_end = _varint_header(data, VERSION_COMPACT)
    count, pos = read_varint(data, pos, header_end)
    if count > 0xFFFF:
        raise WireError("more than 65535 tensors")
    tensors, names, elements, body = [], set(), 0, header_end
    for _ in range(count):
        name_len, pos = read_varint(data, pos, header_end)
        if pos + name_len + 2 > header_end:
            raise WireError("header ends inside a tensor entry")
        name = data[pos:pos + name_len].decode("utf-8")
        pos += name_len
        if not name or name in names:
            raise WireError("empty or repeated tensor name")
        names.add(name)
        dtype_code, ndim = data[pos], data[pos + 1]
        pos += 2
        if dtype_code not in DTYPES or ndim > MAX_NDIM:
            raise WireError("bad dtype code or too many dimensions")
        shape = []
        for _ in range(ndim):
            d, pos = read_varint(data, pos, header_end)
            shape.append(d)
        length, pos = read_varint(data, pos, header_end)
        size, elements = _counted(shape, elements, max_elements)
        if body + length > n:
            raise WireError("section beyond the end")
        tensors.append({"name": name, "dtype_code": dtype_code, "dtype": DTYPES[dtype_code], "shape": shape,
                        "size": size, "offset": body, "length": length, "section": data[body:body + length]})
        body += length
    if pos != header_end:
        raise WireError("header length disagrees with its contents")
    return _finish(data, {**head, "tensors": tensors}, body)


def build_compact_envelope(codec: str, round_id: int, seq: int, device_id: str, metadata_bin: bytes,
                           tensors: list[tuple[str, int, list[int], bytes]], secret: bytes | None = None) -> bytes:
    """§7.6: ``tensors`` are (name, dtype code, shape, section bytes); ``metadata_bin`` from :func:`pack_metadata`."""
    dev = device_id.encode("utf-8")
    head = [varint(round_id), varint(seq), varint(len(dev)), dev, varint(len(metadata_bin)), metadata_bin,
            varint(len(tensors))]
    for name, dtype_code, shape, section in tensors:
        nb = name.encode("utf-8")
        head += [varint(len(nb)), nb, bytes([dtype_code, len(shape)])] + [varint(d) for d in shape]
        head.append(varint(len(section)))
    return _sealed(VERSION_COMPACT, codec, b"".join(head), [t[3] for t in tensors], secret, UPDATE_COMPACT_CONTEXT)


def _sealed(version: int, codec: str, header: bytes, sections: list, secret: bytes | None, context: str) -> bytes:
    """§7.6/§7.7: prefix, varint header length, header, sections, CRC-32; signed: key id and the Ed25519
    signature over ``context`` and SHA-256 of everything before it."""
    out = bytearray(struct.pack("<4sBBB", MAGIC, version, FLAG_SIGNED if secret else 0, CODEC_IDS[codec]))
    out += varint(len(header)) + header
    for section in sections:
        out += section
    out += struct.pack("<I", zlib.crc32(bytes(out)))
    if secret is not None:
        msg = signing_message(context, hashlib.sha256(bytes(out)).digest())
        out += key_id(ed25519.public_key(secret)) + ed25519.sign(secret, msg)
    return bytes(out)


def layout_hashed(layout: list) -> bytes:
    """§7.7: what the layout digest hashes after its context: per tensor in UTF-8 name order, varint name
    length, name, varint ndim, the dims as varints."""
    out = b""
    for name, shape in sorted(layout, key=lambda t: t[0].encode("utf-8")):
        nb = name.encode("utf-8")
        out += varint(len(nb)) + nb + varint(len(shape)) + b"".join(varint(d) for d in shape)
    return out


def layout_digest(layout: list) -> bytes:
    return hashlib.sha256(LAYOUT_CONTEXT + layout_hashed(layout)).digest()[:8]


def parse_layout_envelope(data: bytes, layout: list | None, *, max_elements: int = 1 << 28) -> dict:
    """§7.7: the version-3 envelope; the tensors' names and shapes come from ``layout`` (the receiver's model)."""
    n = len(data)
    head, pos, header_end = _varint_header(data, VERSION_LAYOUT)
    if pos + 9 > header_end:
        raise WireError("header ends inside the layout digest")
    digest, dtype_code = data[pos:pos + 8], data[pos + 8]
    pos += 9
    if dtype_code not in DTYPES:
        raise WireError(f"unknown dtype code {dtype_code}")
    count, pos = read_varint(data, pos, header_end)
    if count > 0xFFFF:
        raise WireError("more than 65535 tensors")
    lengths = []
    for _ in range(count):
        length, pos = read_varint(data, pos, header_end)
        lengths.append(length)
    if pos != header_end:
        raise WireError("header length disagrees with its contents")
    body = header_end + sum(lengths)
    if body + 4 > n:
        raise WireError("section beyond the end")
    if layout is None:
        raise WireError("a layout-digest envelope (version 3) needs the receiver's model to decode")
    ordered = sorted(((name, list(shape)) for name, shape in layout), key=lambda t: t[0].encode("utf-8"))
    if layout_digest(ordered) != digest or len(ordered) != count:
        raise WireError(f"encoded for another model layout (digest {digest.hex()}, {count} tensors)")
    tensors, at, elements = [], header_end, 0
    for (name, shape), length in zip(ordered, lengths):
        size, elements = _counted(shape, elements, max_elements)
        tensors.append({"name": name, "dtype_code": dtype_code, "dtype": DTYPES[dtype_code], "shape": shape,
                        "size": size, "offset": at, "length": length, "section": data[at:at + length]})
        at += length
    return _finish(data, {**head, "tensors": tensors, "layout_digest": digest, "dtype_code": dtype_code,
                          "section_lengths": lengths}, body)


def build_layout_envelope(codec: str, round_id: int, seq: int, device_id: str, metadata_bin: bytes,
                          tensors: list[tuple[str, int, list[int], bytes]], secret: bytes | None = None) -> bytes:
    """§7.7: ``tensors`` as for :func:`build_compact_envelope`, one dtype code for all; sections in name order."""
    ordered = sorted(tensors, key=lambda t: t[0].encode("utf-8"))
    codes = {t[1] for t in ordered}
    if len(codes) > 1:
        raise WireError("a layout-digest envelope declares one dtype for every tensor")
    dev = device_id.encode("utf-8")
    header = b"".join([varint(round_id), varint(seq), varint(len(dev)), dev, varint(len(metadata_bin)),
                       metadata_bin, layout_digest([(t[0], t[2]) for t in ordered]),
                       bytes([codes.pop() if codes else 2]), varint(len(ordered))]
                      + [varint(len(t[3])) for t in ordered])
    return _sealed(VERSION_LAYOUT, codec, header, [t[3] for t in ordered], secret, UPDATE_LAYOUT_CONTEXT)


# §10.5 model delta ------------------------------------------------------------
DELTA_KEYS = ("kind", "model_version", "epoch", "base_version", "base_sha256", "model_sha256")


def weights_digest(weights: list) -> str:
    """§10.5: ``weights`` as (name, shape, float32 values); hex SHA-256."""
    h = hashlib.sha256(b"edgeflow-weights-v1\0")
    for name, shape, values in sorted(weights, key=lambda t: t[0].encode("utf-8")):
        shape = list(shape) or [1]  # a 0-d weight counts as rank 1, dimension 1
        nb = name.encode("utf-8")
        h.update(struct.pack("<H", len(nb)) + nb + struct.pack("<B", len(shape))
                 + b"".join(struct.pack("<I", d) for d in shape) + f32_bytes(values))
    return h.hexdigest()


def apply_model_delta(data: bytes, fleet_public: bytes, base: list, version: int, epoch: int) -> tuple[dict, list]:
    """§10.5: verify a delta against the held ``base`` ((name, shape, values) of ``version``, gateway ``epoch``)
    and return (its metadata, the new weights as (name, shape, values)); WireError names the rule broken."""
    limit = sum(4 * _count(shape) + len(name.encode("utf-8")) + 64 for name, shape, _ in base) + 65536
    if len(data) > limit:
        raise WireError("oversized: the delta is larger than the dense model")
    layout = [(name, shape) for name, shape, _ in base]
    env = parse_envelope(data, layout=layout)
    verify_envelope(env, fleet_public)
    if env["device_id"] != "gateway":
        raise WireError("wrong_key: the delta is not the gateway's")
    if sorted((t["name"], t["shape"]) for t in env["tensors"]) != sorted((n, list(s)) for n, s in layout):
        raise WireError("shape_mismatch: the delta's tensors are not the held weights'")
    meta = env["metadata"]
    if any(k not in meta for k in DELTA_KEYS):
        raise WireError(f"malformed: the delta's metadata lacks {[k for k in DELTA_KEYS if k not in meta]}")
    for k in ("base_sha256", "model_sha256"):  # binary metadata (§7.6) carries lowercase hex as bytes
        if isinstance(meta[k], (bytes, bytearray)):
            meta[k] = bytes(meta[k]).hex()
    if meta["kind"] != "model_delta":
        raise WireError("not_delta")
    if meta["epoch"] != epoch:
        raise WireError("epoch: another gateway epoch")
    if meta["model_version"] <= version:
        raise WireError("held" if meta["model_version"] == version else "replay")
    if meta["base_version"] != version:
        raise WireError("wrong_base")
    if weights_digest(base) != meta["base_sha256"]:
        raise WireError("base_digest: the held weights are not the delta's base")
    delta = {t["name"]: t["values"] for t in env["tensors"]}
    result = []
    for name, shape, values in base:
        new = [f32(a + b) for a, b in zip(values, delta[name])]  # one binary32 addition per value (§3)
        _check_finite(new, f"weight {name!r} once applied")
        if any(abs(v) > 1e9 for v in new):
            raise WireError(f"out_of_range: weight {name!r} once applied")
        result.append((name, list(shape), new))
    if weights_digest(result) != meta["model_sha256"]:
        raise WireError("digest_mismatch: the result is not the announced model")
    return meta, result


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# §7.6 binary metadata: the table of known keys (append only)
METADATA_KEYS = ["num_samples", "loss", "base_version", "round_nonce", "eval", "metrics", "num_examples", "train_s",
                 "clock_skew_s", "accuracy"]
_HEX_DIGITS = set("0123456789abcdef")


def _meta_text(text: str) -> bytes:
    raw = text.encode("utf-8")
    return varint(len(raw)) + raw


def _meta_value(v) -> bytes:
    if v is None:
        return b"\x00"
    if v is True or v is False:
        return b"\x02" if v else b"\x01"
    if isinstance(v, int):
        if 0 <= v < 1 << 64:
            return b"\x03" + varint(v)
        if -(1 << 64) <= v < 0:
            return b"\x04" + varint(-1 - v)
        return b"\x0b" + _meta_text(str(v))
    if isinstance(v, float):
        if v != v or v in (math.inf, -math.inf):
            raise WireError("metadata cannot hold NaN or Infinity")
        try:
            single = struct.pack("<f", v)
        except OverflowError:
            single = b""
        if single and struct.unpack("<f", single)[0] == v:
            return b"\x05" + single
        return b"\x06" + struct.pack("<d", v)
    if isinstance(v, str):
        if v and len(v) % 2 == 0 and set(v) <= _HEX_DIGITS:
            return b"\x08" + varint(len(v) // 2) + bytes.fromhex(v)
        return b"\x07" + _meta_text(v)
    if isinstance(v, list):
        return b"\x09" + varint(len(v)) + b"".join(_meta_value(item) for item in v)
    if isinstance(v, dict):
        out = b"\x0a" + varint(len(v))
        for key, item in v.items():
            out += varint(METADATA_KEYS.index(key) + 1) if key in METADATA_KEYS else b"\x00" + _meta_text(key)
            out += _meta_value(item)
        return out
    raise WireError(f"metadata cannot hold {type(v).__name__}")


def pack_metadata(metadata: dict) -> bytes:
    """§7.6: the binary form of a JSON object, members in the given order; nothing for an empty object."""
    return _meta_value(dict(metadata)) if metadata else b""


def unpack_metadata(raw: bytes) -> dict:
    if not raw:
        return {}
    value, pos = _meta_read(raw, 0, 1)
    if not isinstance(value, dict):
        raise WireError("metadata must be an object")
    if pos != len(raw):
        raise WireError("bytes after the metadata value")
    return value


def _meta_count(raw: bytes, pos: int) -> tuple[int, int]:
    count, pos = read_varint(raw, pos, len(raw))
    if count > len(raw) - pos:
        raise WireError("metadata count larger than the bytes left")
    return count, pos


def _meta_str(raw: bytes, pos: int) -> tuple[str, int]:
    count, pos = _meta_count(raw, pos)
    return raw[pos:pos + count].decode("utf-8"), pos + count


def _meta_read(raw: bytes, pos: int, depth: int):
    if depth > 64:
        raise WireError("metadata nests deeper than 64")
    if pos >= len(raw):
        raise WireError("metadata ends inside a value")
    tag = raw[pos]
    pos += 1
    if tag <= 2:
        return (None, False, True)[tag], pos
    if tag in (3, 4):
        v, pos = read_varint(raw, pos, len(raw))
        return (v if tag == 3 else -1 - v), pos
    if tag in (5, 6):
        width = 4 if tag == 5 else 8
        if pos + width > len(raw):
            raise WireError("metadata ends inside a float")
        (v,) = struct.unpack_from("<f" if tag == 5 else "<d", raw, pos)
        if v != v or v in (math.inf, -math.inf):
            raise WireError("metadata holds NaN or Infinity")
        return float(v), pos + width
    if tag == 7:
        return _meta_str(raw, pos)
    if tag == 8:
        count, pos = _meta_count(raw, pos)
        return raw[pos:pos + count].hex(), pos + count
    if tag == 9:
        count, pos = _meta_count(raw, pos)
        items = []
        for _ in range(count):
            item, pos = _meta_read(raw, pos, depth + 1)
            items.append(item)
        return items, pos
    if tag == 10:
        count, pos = _meta_count(raw, pos)
        obj: dict = {}
        for _ in range(count):
            index, pos = read_varint(raw, pos, len(raw))
            if index == 0:
                key, pos = _meta_str(raw, pos)
            elif index <= len(METADATA_KEYS):
                key = METADATA_KEYS[index - 1]
            else:
                raise WireError(f"unknown metadata key index {index}")
            if key in obj:
                raise WireError("repeated metadata key")
            obj[key], pos = _meta_read(raw, pos, depth + 1)
        return obj, pos
    if tag == 11:
        text, pos = _meta_str(raw, pos)
        value = json.loads(text)
        if not isinstance(value, int) or isinstance(value, bool):
            raise WireError("metadata tag 11 must hold an integer")
        return value, pos
    raise WireError(f"unknown metadata tag {tag}")


def verify_envelope(env: dict, public_key: bytes) -> None:
    if env["signature"] is None:
        raise WireError("envelope is not signed")
    if env["key_id"] != key_id(public_key):
        raise WireError("signed with another key")
    if not ed25519.verify(public_key, env["signing_message"], env["signature"]):
        raise WireError("bad envelope signature")


def build_envelope(codec: str, round_id: int, seq: int, device_id: str, metadata_json: bytes,
                   tensors: list[tuple[str, int, list[int], bytes]], secret: bytes | None = None) -> bytes:
    """§7: ``tensors`` are (name, dtype code, shape, section bytes)."""
    dev = device_id.encode("utf-8")
    header = [struct.pack("<QQHHI", round_id, seq, len(dev), len(tensors), len(metadata_json)), dev, metadata_json]
    for name, dtype_code, shape, section in tensors:
        nb = name.encode("utf-8")
        header += [struct.pack("<HBBQ", len(nb), dtype_code, len(shape), len(section)), nb,
                   struct.pack(f"<{len(shape)}Q", *shape)]
    head = b"".join(header)
    out = bytearray(struct.pack("<4sBBBBI", MAGIC, VERSION, FLAG_SIGNED if secret else 0, CODEC_IDS[codec], 0,
                                len(head)) + head)
    for *_, section in tensors:
        out += b"\0" * (align8(len(out)) - len(out))
        out += section
    out += struct.pack("<I", zlib.crc32(bytes(out)))
    if secret is not None:
        pub = ed25519.public_key(secret)
        msg = signing_message(UPDATE_CONTEXT, hashlib.sha256(bytes(out)).digest())
        out += key_id(pub) + ed25519.sign(secret, msg)
    return bytes(out)


def metadata_json(metadata: dict) -> bytes:
    """§7.2: compact JSON, keys sorted, so equal metadata gives equal bytes (empty: no bytes)."""
    if not metadata:
        return b""
    return json.dumps(metadata, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


# ------------------------------------------------------------------ §5 chunks


def parse_chunk(frame: bytes) -> dict:
    if len(frame) < CHUNK_HEADER:
        raise WireError("chunk shorter than its header")
    magic, version, flags, tid, index, count, total, csize, sha, crc = struct.unpack_from(
        "!4sBB2x16sIIQI32sI", frame, 0)
    if magic != CHUNK_MAGIC or version != CHUNK_VERSION or flags:
        raise WireError("not a version-1 chunk")
    if count < 1 or index >= count or csize < 1:
        raise WireError("impossible chunk numbering")
    if -(-total // csize) != count and not (total == 0 and count == 1):
        raise WireError("total size, chunk size and count disagree")
    data = frame[CHUNK_HEADER:]
    expected = csize if index < count - 1 else total - csize * (count - 1)
    if len(data) != expected:
        raise WireError("chunk data has the wrong length")
    if zlib.crc32(data) != crc:
        raise WireError("chunk CRC-32 mismatch")
    return {"transfer_id": tid, "index": index, "count": count, "total_size": total, "chunk_size": csize,
            "sha256": sha, "crc32": crc, "data": data}


def make_chunks(payload: bytes, max_message: int, transfer_id: bytes) -> list[bytes]:
    csize = max_message - CHUNK_HEADER
    count = max(1, -(-len(payload) // csize))
    sha = hashlib.sha256(payload).digest()
    frames = []
    for i in range(count):
        data = payload[i * csize:(i + 1) * csize]
        frames.append(struct.pack("!4sBB2x16sIIQI32sI", CHUNK_MAGIC, CHUNK_VERSION, 0, transfer_id, i, count,
                                  len(payload), csize, sha, zlib.crc32(data)) + data)
    return frames


class Reassembler:
    """§5.3: chunks in any order, duplicates ignored, whole payload checked by SHA-256."""

    def __init__(self) -> None:
        self.parts: dict[tuple[str, bytes], dict[int, bytes]] = {}
        self.heads: dict[tuple[str, bytes], dict] = {}
        self.done: set[tuple[str, bytes]] = set()

    def add(self, base_topic: str, frame: bytes) -> bytes | None:
        c = parse_chunk(frame)
        key = (base_topic, c["transfer_id"])
        if key in self.done:
            return None
        first = self.heads.setdefault(key, c)
        if (first["count"], first["total_size"], first["chunk_size"], first["sha256"]) != (
                c["count"], c["total_size"], c["chunk_size"], c["sha256"]):
            raise WireError("chunk disagrees with earlier chunks of its transfer")
        parts = self.parts.setdefault(key, {})
        parts[c["index"]] = c["data"]
        if len(parts) < c["count"]:
            return None
        payload = b"".join(parts[i] for i in range(c["count"]))
        del self.parts[key], self.heads[key]
        self.done.add(key)
        if hashlib.sha256(payload).digest() != c["sha256"]:
            raise WireError("reassembled payload fails its SHA-256")
        return payload


def split_chunk_topic(topic: str) -> tuple[str, int] | None:
    levels = topic.split("/")
    if len(levels) >= 3 and levels[-2] == "_chunk" and levels[-1].isdigit():
        return "/".join(levels[:-2]), int(levels[-1])
    return None


# ------------------------------------------------------------------ §9 signed JSON


def json_string(text: str) -> str:
    """A JSON string literal as edgeflow writes it: ASCII only, \\uXXXX for the rest."""
    return json.dumps(text, ensure_ascii=True)


def make_signed_json(body_text: str, secret: bytes, context: str) -> bytes:
    digest = hashlib.sha256(body_text.encode("utf-8")).digest()
    sig = ed25519.sign(secret, signing_message(context, digest))
    kid = key_id(ed25519.public_key(secret)).hex()
    text = ('{"v":1,"ctx":' + json_string(context) + ',"body":' + json_string(body_text)
            + ',"key_id":"' + kid + '","sig":"' + sig.hex() + '"}')
    return text.encode("utf-8")


def open_signed_json(data: bytes, public_key: bytes, context: str) -> tuple[dict, dict]:
    """(wrapper, body) after checking version, context, key id and signature over the exact body text."""
    wrapper = json.loads(data.decode("utf-8"))
    if not isinstance(wrapper, dict) or wrapper.get("v") != 1 or not isinstance(wrapper.get("body"), str):
        raise WireError("not a version-1 signed JSON message")
    if wrapper.get("ctx") != context:
        raise WireError(f"signed for {wrapper.get('ctx')!r}, expected {context!r}")
    if wrapper.get("key_id") and wrapper["key_id"] != key_id(public_key).hex():
        raise WireError("signed with another key")
    digest = hashlib.sha256(wrapper["body"].encode("utf-8")).digest()
    if not ed25519.verify(public_key, signing_message(context, digest), bytes.fromhex(wrapper["sig"])):
        raise WireError("bad signature")
    body = json.loads(wrapper["body"])
    if not isinstance(body, dict):
        raise WireError("body is not a JSON object")
    return wrapper, body


# ------------------------------------------------------------------ §12 secure-aggregation frames

SECAGG_CONTEXT = "secagg/v1"


def open_sealed(data: bytes, public_key: bytes) -> dict:
    if len(data) <= 64 + 10:
        raise WireError("sealed frame too short")
    sig, frame = data[:64], data[64:]
    if not ed25519.verify(public_key, signing_message(SECAGG_CONTEXT, hashlib.sha256(frame).digest()), sig):
        raise WireError("bad secagg signature")
    magic, version, kind, hlen = struct.unpack_from(">4sBBI", frame, 0)
    if magic != b"EFSA" or version != 1:
        raise WireError("not a version-1 secagg frame")
    if 10 + hlen > len(frame):
        raise WireError("header beyond the frame")
    header_text = frame[10:10 + hlen].decode("utf-8")
    payload = frame[10 + hlen:]
    if kind != 5 and payload:
        raise WireError("payload after a header-only frame")
    return {"kind": kind, "header_json": header_text, "header": json.loads(header_text), "payload": payload,
            "signature": sig}


def make_sealed(kind: int, header_text: str, payload: bytes, secret: bytes) -> bytes:
    h = header_text.encode("utf-8")
    frame = struct.pack(">4sBBI", b"EFSA", 1, kind, len(h)) + h + payload
    return ed25519.sign(secret, signing_message(SECAGG_CONTEXT, hashlib.sha256(frame).digest())) + frame


# ------------------------------------------------------------------ §11 OTA

OTA_MAGIC = b"EFOTA\x01"
OFFER_MAGIC = b"EFOF\x01"


def parse_artifact(data: bytes, fleet_public: bytes) -> dict:
    if data[:6] != OTA_MAGIC:
        raise WireError("not an OTA artifact")
    (mlen,) = struct.unpack_from(">I", data, 6)
    pos = 10
    manifest_raw = data[pos:pos + mlen]
    pos += mlen
    sig = data[pos:pos + 64]
    pos += 64
    (model_len,) = struct.unpack_from(">Q", data, pos)
    pos += 8
    model = data[pos:pos + model_len]
    pos += model_len
    (golden_len,) = struct.unpack_from(">Q", data, pos)
    pos += 8
    golden = data[pos:pos + golden_len]
    pos += golden_len
    if pos != len(data) or len(model) != model_len or len(golden) != golden_len:
        raise WireError("artifact sizes disagree")
    manifest = json.loads(manifest_raw.decode("utf-8"))
    msg = signing_message("ota/v1", hashlib.sha256(manifest_raw).digest())
    if not ed25519.verify(fleet_public, msg, sig):
        raise WireError("bad artifact signature")
    if manifest.get("format") != "edgeflow-ota/1" or manifest["size"] != model_len:
        raise WireError("manifest does not describe this artifact")
    if hashlib.sha256(model).hexdigest() != manifest["sha256"]:
        raise WireError("model bytes do not match the manifest")
    if golden_len and hashlib.sha256(golden).hexdigest() != (manifest.get("golden") or {}).get("sha256"):
        raise WireError("golden bytes do not match the manifest")
    return {"manifest": manifest, "manifest_text": manifest_raw.decode("utf-8"), "signature": sig, "model": model,
            "golden": golden}


def canonical_json(obj) -> str:
    """§11: sorted keys, no spaces, ASCII (how the OTA manifest is written)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def build_artifact(manifest: dict, model: bytes, golden: bytes, fleet_secret: bytes) -> bytes:
    mraw = canonical_json(manifest).encode("utf-8")
    sig = ed25519.sign(fleet_secret, signing_message("ota/v1", hashlib.sha256(mraw).digest()))
    return (OTA_MAGIC + struct.pack(">I", len(mraw)) + mraw + sig + struct.pack(">Q", len(model)) + model
            + struct.pack(">Q", len(golden)) + golden)


def parse_offer(data: bytes) -> tuple[bytes, bytes]:
    if data[:5] != OFFER_MAGIC or len(data) < 9:
        raise WireError("not an OTA offer")
    (n,) = struct.unpack_from(">I", data, 5)
    if 9 + n > len(data):
        raise WireError("truncated OTA offer")
    return data[9:9 + n], data[9 + n:]


def build_offer(command: bytes, artifact: bytes) -> bytes:
    return OFFER_MAGIC + struct.pack(">I", len(command)) + command + artifact
