"""Generate the wire-format test vectors with edgeflow's own encoders.

    python tests/vectors/generate.py           # (re)write tests/vectors/*.bin and manifest.json
    python tests/vectors/generate.py --check   # exit 1 if the stored vectors differ from the code

Every vector is built through the public encoders (``encode_update``, the
chunk ``Splitter``, ``RoundAnnouncement.sign``, ``Command.sign``,
``build_artifact``, ...) with fixed inputs, fixed keys (the RFC 8032 test
keys, so any Ed25519 implementation can be checked against the RFC too) and
fixed random seeds, so the bytes are a pure function of the code.
``manifest.json`` describes each vector field by field (the inputs needed to
re-encode it and the values a decoder must find) so that another
implementation can check itself in both directions without reading Python.

The version guard (``tests/test_wire_vectors.py``) regenerates everything in
memory and compares with the stored files: a difference while every format
version the vector depends on is unchanged means the wire format changed
without a version bump. See docs/wire-format.md, "Versioning".
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.codecs import decode_update, encode_update, peek_update
from edgeflow.codecs import envelope as envelope_mod
from edgeflow.codecs.metadata import pack_metadata
from edgeflow.protocol import fleet as device_messages
from edgeflow.protocol import ota as ota_messages
from edgeflow.protocol.fleet import Ack, Birth, Command, Death
from edgeflow.protocol.ota import OtaOffer
from edgeflow.protocol import rounds as round_messages
from edgeflow.protocol import signed_json
from edgeflow.protocol import secagg_wire as secure
from edgeflow.protocol.rounds import RoundAnnouncement, TrainConfig
from edgeflow.protocol import secagg_wire
from edgeflow.protocol.secagg import AdvertiseKeys, MaskedInput
from edgeflow import artifact as ota
from edgeflow.signing import PrivateKey, Signer, signing_message
from edgeflow.transport import chunking
from edgeflow.transport.topics import chunk_topic, device_topic, gateway_topic

HERE = Path(__file__).resolve().parent
MANIFEST = "manifest.json"

SPEC_REVISION = 4
"""The revision of docs/wire-format.md these vectors belong to. Bump it (and say
what changed in the document's change log) when a format that has no version
field of its own changes, e.g. the JSON of a death message."""

# RFC 8032, section 7.1, TEST 1 and TEST 2 secret keys.
FLEET_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
DEVICE_SEED = bytes.fromhex("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb")
FLEET = "lab"
DEVICE = "dev-1"
TRANSFER_ID = bytes.fromhex("00112233445566778899aabbccddeeff")
T0 = 1767225600.0  # 2026-01-01T00:00:00Z: every timestamp in the vectors is T0 + something
DENSE_LIMIT = 4096
"""Tensors up to this many values list every value; larger ones list their non-zero entries."""


# ------------------------------------------------------------------ helpers


def f32_hex(values: Any) -> str:
    """Little-endian float32 bytes of ``values``, as hex (exact, unlike decimal text)."""
    return np.ascontiguousarray(np.asarray(values, dtype="<f4")).reshape(-1).tobytes().hex()


def _values(flat: np.ndarray) -> dict[str, Any]:
    flat = np.asarray(flat, dtype=np.float32).reshape(-1)
    if flat.size <= DENSE_LIMIT:
        return {"f32": f32_hex(flat)}
    nz = np.flatnonzero(flat)
    return {"size": int(flat.size), "nonzero": [[int(i), f32_hex(flat[i])] for i in nz]}


def current_versions() -> dict[str, Any]:
    """Every format version the vectors depend on, read from the code (not from this file)."""
    probe = json.loads(signed_json.sign_body({}, PrivateKey.from_bytes(FLEET_SEED), "probe/v1"))
    return {
        "spec": SPEC_REVISION,
        "envelope": envelope_mod.VERSION,
        "update_context": envelope_mod.SIGN_CONTEXT,
        "envelope_compact": envelope_mod.VERSION_COMPACT,
        "update_compact_context": envelope_mod.SIGN_CONTEXTS[envelope_mod.VERSION_COMPACT],
        "envelope_layout": envelope_mod.VERSION_LAYOUT,
        "update_layout_context": envelope_mod.SIGN_CONTEXTS[envelope_mod.VERSION_LAYOUT],
        "chunk": chunking.VERSION,
        "signed_json": probe["v"],
        "round_context": round_messages.ROUND_CONTEXT,
        "cmd_context": device_messages.CMD_CONTEXT,
        "ack_context": device_messages.ACK_CONTEXT,
        "birth_context": device_messages.BIRTH_CONTEXT,
        "death_context": device_messages.DEATH_CONTEXT,
        "secagg_frame": secagg_wire._VERSION,
        "secagg_context": secure.CONTEXT,
        "ota_format": ota.FORMAT,
        "ota_magic": ota.MAGIC.hex(),
        "ota_context": ota.CONTEXT,
        "ota_offer_magic": ota_messages.OFFER_MAGIC.hex(),
    }


class Builder:
    """Collects vector files and their manifest entries."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.vectors: list[dict[str, Any]] = []

    def add(self, name: str, data: bytes, kind: str, depends: list[str], description: str,
            **fields: Any) -> dict[str, Any]:
        file = f"{name}.bin"
        if file in self.files:
            raise ValueError(f"duplicate vector {name}")
        self.files[file] = bytes(data)
        entry = {"name": name, "kind": kind, "file": file, "size": len(data),
                 "sha256": hashlib.sha256(data).hexdigest(), "depends": ["spec", *depends],
                 "description": description, **fields}
        self.vectors.append(entry)
        return entry


# ---------------------------------------------------------------- keys


def fleet_key() -> PrivateKey:
    return PrivateKey.from_bytes(FLEET_SEED)


def device_signer() -> Signer:
    return Signer(DEVICE, PrivateKey.from_bytes(DEVICE_SEED))


def keys_section() -> dict[str, Any]:
    out = {}
    for role, seed, who in (("fleet", FLEET_SEED, "gateway"), ("device", DEVICE_SEED, DEVICE)):
        pub = PrivateKey.from_bytes(seed).public_key
        out[role] = {"seed": seed.hex(), "public_key": pub.hex, "key_id": pub.key_id_hex, "signs_as": who}
    return out


# ---------------------------------------------------------------- envelopes


def vector_uniform(seed: int, i: int) -> float:
    """The i-th uniform of a vector: 24 bits of SHA-256(seed u64 LE | i u64 LE) / 2**24, exact in float32."""
    h = hashlib.sha256(struct.pack("<QQ", seed, i)).digest()
    return int.from_bytes(h[:3], "big") / float(1 << 24)


def vector_seed(seed: int, j: int) -> int:
    """The j-th randk-packed seed of a vector: SHA-256("randk-seed" | seed u64 LE | j u64 LE), first 4 bytes as u32 LE."""
    return int.from_bytes(hashlib.sha256(b"randk-seed" + struct.pack("<QQ", seed, j)).digest()[:4], "little")


class VectorUniforms(np.random.Generator):
    """A Generator whose ``random`` returns :func:`vector_uniform` draws in order.

    The int8 codecs draw their stochastic-rounding uniforms from the
    Generator they are given; NumPy does not promise that PCG64 streams stay
    the same across releases, and a vector must not change when NumPy does.
    """

    def __init__(self, seed: int) -> None:
        super().__init__(np.random.PCG64(seed))
        self.seed, self.count = seed, 0

    def random(self, size=None, dtype=np.float64, out=None):  # noqa: D102 - the codecs call random(n, dtype=float32)
        n = 1 if size is None else int(np.prod(size))
        draws = [vector_uniform(self.seed, self.count + i) for i in range(n)]
        self.count += n
        return np.array(draws, dtype=dtype).reshape(() if size is None else size)

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint=False):  # noqa: D102
        # randk-packed draws one u32 seed per tensor with integers(0, 2**32): the j-th is vector_seed(seed, j)
        if high is None or size is not None or endpoint or (int(low), int(high)) != (0, 1 << 32):
            raise NotImplementedError("the vectors' generator draws only integers(0, 2**32) (randk seeds)")
        self.seeds = getattr(self, "seeds", 0) + 1
        return vector_seed(self.seed, self.seeds - 1)


def _uniforms(seed: int, sizes: list[int]) -> list[np.ndarray]:
    """The draws VectorUniforms(seed) hands out, one call per quantized tensor."""
    rng = VectorUniforms(seed)
    return [rng.random(n, dtype=np.float32) if n else np.zeros(0, np.float32) for n in sizes]


def _int8_reference(x: np.ndarray, u: np.ndarray) -> tuple[np.float32, np.ndarray]:
    """The int8 quantizer written out step by step in float32, as docs/wire-format.md states it."""
    amax = max(float(x.max()), -float(x.min())) if x.size else 0.0
    if amax == 0.0:
        return np.float32(0.0), np.zeros(x.size, np.int8)
    scale = np.float32(amax / 127)
    v = (x * (np.float32(1.0) / scale)) + u
    return scale, np.clip(np.floor(v), -127, 127).astype(np.int8)


def _topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    order = sorted(range(x.size), key=lambda i: (-abs(float(x[i])), i))
    return np.array(sorted(order[:k]), dtype=np.int64)


def _describe_envelope(data: bytes, tensors: dict[str, np.ndarray], codec: str, *, seed: int | None,
                       k: int | None, signed_by: str | None) -> dict[str, Any]:
    head = peek_update(data)
    mv = memoryview(data)
    header_len = struct.unpack_from("<I", data, 8)[0]
    meta_start = 12 + 24 + len(head.device_id.encode())
    meta_len = struct.unpack_from("<I", data, 12 + 20)[0]
    out: dict[str, Any] = {
        "version": head.version, "flags": head.flags, "codec": codec, "codec_id": head.codec_id,
        "round_id": head.round_id, "seq": head.seq, "device_id": head.device_id,
        "metadata_json": bytes(mv[meta_start:meta_start + meta_len]).decode("utf-8"),
        "header_length": header_len, "crc_offset": head.crc_at,
        "crc32": f"{struct.unpack_from('<I', data, head.crc_at)[0]:08x}",
        "signed_by": signed_by,
        "key_id": head.key_id.hex() if head.key_id else None,
        "signature": head.signature.hex() if head.signature else None,
        "signing_message": (envelope_mod.signed_message(mv, head).hex() if head.signed else None),
        "rng_seed": seed, "k": k, "tensors": [],
    }
    decoded = decode_update(data).tensors
    quantized_sizes = []
    selections: dict[str, np.ndarray] = {}
    for spec in head.tensors:
        x = np.ascontiguousarray(tensors[spec.name], dtype=np.float32).reshape(-1)
        if codec in ("topk", "topk-int8"):
            sel = _topk_indices(x, min(x.size, int(k or 0)))
            selections[spec.name] = sel
            quantized_sizes.append(sel.size if codec == "topk-int8" and x.size and np.abs(x[sel]).max() > 0 else 0)
        elif codec == "int8":
            quantized_sizes.append(x.size if x.size and np.abs(x).max() > 0 else 0)
    uniforms = iter(_uniforms(seed, quantized_sizes)) if seed is not None else iter(())
    for spec in head.tensors:
        src = tensors[spec.name]
        x = np.ascontiguousarray(src, dtype=np.float32).reshape(-1)
        section = bytes(mv[spec.offset:spec.offset + spec.length])
        t: dict[str, Any] = {
            "name": spec.name, "dtype": np.dtype(spec.dtype).name,
            "dtype_code": envelope_mod.dtype_code(spec.dtype), "shape": list(spec.shape),
            "offset": spec.offset, "length": spec.length,
            "input": _values(x),
            "decoded": _values(np.asarray(decoded[spec.name], dtype=np.float32)),
        }
        if codec == "int8":
            u = next(uniforms) if x.size and np.abs(x).max() > 0 else np.zeros(0, np.float32)
            scale, q = _int8_reference(x, u)
            if struct.pack("<f4x", scale) + q.tobytes() != section:
                raise AssertionError(f"int8 reference quantizer disagrees with the codec on {spec.name}")
            t["int8"] = {"scale": f32_hex(scale), "q": q.tolist(), "uniform": f32_hex(u)}
        elif codec in ("topk", "topk-int8"):
            sel = selections[spec.name]
            width = 2 if x.size <= 0x10000 else 4
            entry: dict[str, Any] = {"k": int(sel.size), "index_width": width, "indices": sel.tolist()}
            if codec == "topk":
                entry["values"] = f32_hex(x[sel])
                expect = struct.pack("<IB3x", sel.size, width)
            else:
                vals = x[sel]
                u = next(uniforms) if sel.size and np.abs(vals).max() > 0 else np.zeros(0, np.float32)
                scale, q = _int8_reference(vals, u)
                entry.update({"scale": f32_hex(scale), "q": q.tolist(), "uniform": f32_hex(u)})
                expect = struct.pack("<IB3x", sel.size, width) + struct.pack("<f4x", scale)
            raw = sel.astype("<u2" if width == 2 else "<u4").tobytes()
            expect += raw + b"\0" * (-len(raw) % 4)
            expect += x[sel].astype("<f4").tobytes() if codec == "topk" else q.tobytes()
            if expect != section:
                raise AssertionError(f"{codec} reference layout disagrees with the codec on {spec.name}")
            t[codec.replace("-", "_")] = entry
        elif codec == "fp16":
            t["fp16"] = section.hex()
        out["tensors"].append(t)
    return out


def _envelope(b: Builder, name: str, description: str, tensors: dict[str, np.ndarray], codec: str, *,
              round_id: int, seq: int, device_id: str = DEVICE, metadata: dict[str, Any] | None = None,
              signer: Signer | None = None, seed: int | None = None, k: int | None = None,
              signed_by: str | None = None) -> bytes:
    opts = {"k": k} if k is not None else {}
    data = encode_update(tensors, codec, round_id=round_id, device_id=device_id, seq=seq, signer=signer,
                         metadata=metadata, rng=VectorUniforms(seed or 0), **opts)
    deps = ["envelope"] + (["update_context"] if signer is not None else [])
    b.add(name, data, "envelope", deps, description,
          envelope=_describe_envelope(data, tensors, codec, seed=seed, k=k, signed_by=signed_by))
    return data


def _base_tensors() -> dict[str, np.ndarray]:
    return {
        "fc.weight": np.array([[0.5, -0.25, 0.1], [-1.5, 0.0078125, 2.0]], dtype=np.float32),
        "fc.bias": np.array([0.03125, -0.75, 1e-3], dtype=np.float32),
    }


def build_envelopes(b: Builder) -> None:
    meta = {"base_version": 3, "loss": 0.25, "num_samples": 32}
    base = _base_tensors()
    _envelope(b, "envelope-dense", "dense (codec 1), two float32 tensors, unsigned", base, "dense",
              round_id=7, seq=1001, metadata=meta)
    _envelope(b, "envelope-fp16", "fp16 (codec 2): 0.1 and 1e-3 show round-to-nearest-even", base, "fp16",
              round_id=7, seq=1002, metadata=meta)
    _envelope(b, "envelope-int8", "int8 (codec 3), stochastic rounding with the listed uniforms", base, "int8",
              round_id=7, seq=1003, metadata=meta, seed=7)
    _envelope(b, "envelope-topk", "topk (codec 4), k=2 per tensor, 16-bit indices", base, "topk",
              round_id=7, seq=1004, metadata=meta, k=2)
    _envelope(b, "envelope-topk-int8", "topk-int8 (codec 5), k=2 per tensor", base, "topk-int8",
              round_id=7, seq=1005, metadata=meta, k=2, seed=11)
    wide = np.zeros(70000, dtype=np.float32)
    wide[[3, 65535, 65536, 69999]] = [0.5, -2.0, 1.25, -0.125]
    _envelope(b, "envelope-topk-wide", "topk with a 70000-value tensor: 32-bit indices (size > 65536)",
              {"emb": wide}, "topk", round_id=8, seq=1, metadata={"num_samples": 5}, k=3)
    dtypes = {
        "half": np.array([1.5, -0.5], dtype=np.float16),
        "double": np.array([[0.1, 2.0]], dtype=np.float64),
        "step": np.array(3.0, dtype=np.float32),
        "empty": np.zeros((0,), dtype=np.float32),
    }
    _envelope(b, "envelope-dtypes", "declared dtypes f16/f64, a 0-d scalar, an empty tensor, no metadata: "
              "padding between sections", dtypes, "dense", round_id=0, seq=0)
    _envelope(b, "envelope-dense-signed", "dense, signed by the device test key (flags bit 0, 72-byte block)",
              base, "dense", round_id=7, seq=1006, metadata=meta, signer=device_signer(), signed_by="device")
    _envelope(b, "envelope-int8-signed", "int8, signed by the device test key: what a device sends", base, "int8",
              round_id=7, seq=1007, metadata=meta, signer=device_signer(), seed=3, signed_by="device")
    model = {"W": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "b": np.array([0.0, 0.5, -0.5], np.float32)}
    _envelope(b, "model-signed", "a global model as the gateway retains it on gateway/model: dense, device id "
              "'gateway', signed by the fleet key, round id = seq = model version", model, "dense",
              round_id=4, seq=4, device_id="gateway", metadata={"model_version": 4},
              signer=Signer("gateway", fleet_key()), signed_by="fleet")


# ---------------------------------------------------------------- compact envelopes (version 2) and topk-packed


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _leb128(value: int) -> bytes:
    """An unsigned LEB128 varint, written out here so the vectors do not trust edgeflow's packer."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _pack_lsb_first(codes: list[int], bits: int) -> bytes:
    acc = nbits = 0
    out = bytearray()
    for c in codes:
        acc |= c << nbits
        nbits += bits
        while nbits >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            nbits -= 8
    if nbits:
        out.append(acc)
    return bytes(out)


def _packed_reference(vals: np.ndarray, bits: int, u: np.ndarray) -> tuple[np.float32, list[int]]:
    """topk-packed's quantizer written out in float32 as docs/wire-format.md §8.6 states it."""
    if vals.size == 0:
        return np.float32(0.0), []
    if bits == 1:
        return np.float32(np.abs(vals).astype(np.float64).sum() / vals.size), [int(v >= 0) for v in vals]
    qmax = (1 << (bits - 1)) - 1
    amax = max(float(vals.max()), -float(vals.min()))
    scale = np.float32(amax / qmax)
    if amax == 0.0 or scale == 0.0:
        return np.float32(0.0), [qmax] * vals.size
    t = (vals * (np.float32(1.0) / scale)) + u
    return scale, [int(c) + qmax for c in np.clip(np.floor(t), -qmax, qmax)]


def _packed_count(n: int, options: dict[str, Any]) -> int:
    if n == 0:
        return 0
    k = min(n, options["k"]) if "k" in options else max(1, min(n, int(np.ceil(options["ratio"] * n))))
    return max(k, min(n, options.get("min_k", 1)))


def _randk_density(ratio: float) -> int:
    """§8.7: the density a sender writes for a ``ratio``: ratio x 65536 rounded to nearest (ties to even), in [1, 65536]."""
    return max(1, min(1 << 16, round(ratio * (1 << 16))))


def _randk_reference(seed: int, n: int, density: int) -> tuple[np.ndarray, list[int]]:
    """§8.7's index sample written out: entry i is kept when the i-th raw PCG64 output >> 48 is below the density.
    Returns the indices and the first raw outputs (for implementers checking their PCG64)."""
    raw = np.random.PCG64(seed).random_raw(n) if n else np.zeros(0, np.uint64)
    return np.flatnonzero((raw >> np.uint64(48)) < np.uint64(density)), [int(r) for r in raw[:4]]


def _layout_reference(shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[bytes, bytes]:
    """§7.7's layout digest written out: (the bytes hashed after the context, the 8-byte digest)."""
    body = b"".join(_leb128(len(nm.encode())) + nm.encode() + _leb128(len(sh)) + b"".join(_leb128(d) for d in sh)
                    for nm, sh in sorted(shapes, key=lambda t: t[0].encode()))
    return body, hashlib.sha256(b"edgeflow:layout/v1\0" + body).digest()[:8]


def _describe_compact(data: bytes, tensors: dict[str, np.ndarray], metadata: dict[str, Any], *,
                      seed: int | None, options: dict[str, Any], signed_by: str | None,
                      codec: str = "topk-packed") -> dict[str, Any]:
    shapes = [(name, tuple(int(d) for d in np.shape(a))) for name, a in tensors.items()]
    version = peek_update(data).version
    head = envelope_mod.parse_envelope(data, max_elements=1 << 28, layout=shapes if version == 3 else None)
    mv = memoryview(data)
    header_len, pos = _read_varint(data, 7)
    for _ in range(2):  # round id, seq
        _, pos = _read_varint(data, pos)
    dev_len, pos = _read_varint(data, pos)
    meta_len, pos = _read_varint(data, pos + dev_len)
    meta_raw = data[pos:pos + meta_len]
    if meta_raw != pack_metadata(metadata):
        raise AssertionError("the compact envelope's metadata is not pack_metadata of the input")
    bits = options.get("bits", 4 if codec == "topk-packed" else 1)
    out: dict[str, Any] = {
        "version": head.version, "flags": head.flags, "codec": codec, "codec_id": head.codec_id,
        "round_id": head.round_id, "seq": head.seq, "device_id": head.device_id,
        "metadata": metadata, "metadata_hex": meta_raw.hex(),
        "header_length": header_len, "crc_offset": head.crc_at,
        "crc32": f"{struct.unpack_from('<I', data, head.crc_at)[0]:08x}",
        "signed_by": signed_by,
        "key_id": head.key_id.hex() if head.key_id else None,
        "signature": head.signature.hex() if head.signature else None,
        "signing_message": (envelope_mod.signed_message(mv, head).hex() if head.signed else None),
        "rng_seed": seed, "options": options, "tensors": [],
    }
    if version == 3:
        if list(tensors) != sorted(tensors, key=str.encode):
            raise AssertionError("list a layout-digest vector's inputs in name order: the draws follow the input order")
        body, digest = _layout_reference(shapes)
        if digest != head.layout:
            raise AssertionError("the layout digest reference disagrees with the codec")
        dtype_at = pos + meta_len + 8
        out["layout"] = {"tensors": [[nm, list(sh)] for nm, sh in sorted(shapes, key=lambda t: t[0].encode())],
                         "hashed": body.hex(), "digest": digest.hex(), "dtype_code": data[dtype_at],
                         "section_lengths": list(head.section_lengths)}
    decoded = decode_update(data, expected_shapes=dict(shapes) if version == 3 else None).tensors
    rng = VectorUniforms(seed or 0)
    for j, spec in enumerate(head.tensors):
        x = np.ascontiguousarray(tensors[spec.name], dtype=np.float32).reshape(-1)
        if codec == "topk-packed":
            sel = _topk_indices(x, _packed_count(x.size, options))
        else:
            tensor_seed = vector_seed(seed or 0, j)
            density = _randk_density(options.get("ratio", 0.1))
            sel, first_raw = _randk_reference(tensor_seed, x.size, density)
        vals = x[sel]
        draws = bits > 1 and vals.size and np.abs(vals).max() > 0
        u = rng.random(vals.size, dtype=np.float32) if draws else np.zeros(0, np.float32)
        scale, codes = _packed_reference(vals, bits, u)
        section = bytes(mv[spec.offset:spec.offset + spec.length])
        t = {"name": spec.name, "dtype": np.dtype(spec.dtype).name,
             "dtype_code": envelope_mod.dtype_code(spec.dtype), "shape": list(spec.shape),
             "offset": spec.offset, "length": spec.length,
             "input": _values(x),
             "decoded": _values(np.asarray(decoded[spec.name], dtype=np.float32))}
        if codec == "topk-packed":
            gaps = np.diff(sel, prepend=-1).tolist()
            expect = _leb128(sel.size) + struct.pack("<Bf", bits, scale) + b"".join(_leb128(g) for g in gaps)
            t["topk_packed"] = {"k": int(sel.size), "bits": bits, "scale": f32_hex(scale), "indices": sel.tolist(),
                                "gaps": gaps, "codes": codes, "uniform": f32_hex(u)}
        else:
            expect = struct.pack("<BHIf", bits, density & 0xFFFF, tensor_seed, scale)
            t["randk_packed"] = {"k": int(sel.size), "bits": bits, "density": density & 0xFFFF, "seed": tensor_seed,
                                 "pcg64_raw": [f"{r:016x}" for r in first_raw], "scale": f32_hex(scale),
                                 "indices": sel.tolist(), "codes": codes, "uniform": f32_hex(u)}
        expect += _pack_lsb_first(codes, bits)
        if expect != section:
            raise AssertionError(f"{codec} reference layout disagrees with the codec on {spec.name}")
        out["tensors"].append(t)
    return out


def _compact(b: Builder, name: str, description: str, tensors: dict[str, np.ndarray], *, round_id: int,
             seq: int, metadata: dict[str, Any], options: dict[str, Any], seed: int | None = None,
             signer: Signer | None = None, signed_by: str | None = None, codec: str = "topk-packed",
             layout: bool = False) -> bytes:
    data = encode_update(tensors, codec, round_id=round_id, device_id=DEVICE, seq=seq, signer=signer,
                         metadata=metadata, rng=VectorUniforms(seed or 0), **options,
                         **({"layout": "digest"} if layout else {}))
    if layout:
        deps = ["envelope_layout"] + (["update_layout_context"] if signer is not None else [])
    else:
        deps = ["envelope_compact"] + (["update_compact_context"] if signer is not None else [])
    b.add(name, data, "envelope", deps, description,
          envelope=_describe_compact(data, tensors, metadata, seed=seed, options=options, signed_by=signed_by,
                                     codec=codec))
    return data


def build_compact(b: Builder) -> None:
    meta = {"base_version": 3, "loss": 0.25, "num_samples": 32}
    base = _base_tensors()
    _compact(b, "envelope-topk-packed", "topk-packed (codec 6) in the compact envelope (version 2): k=2, "
             "4-bit codes, stochastic rounding with the listed uniforms", base, round_id=7, seq=1101,
             metadata=meta, options={"k": 2, "bits": 4}, seed=21)
    _compact(b, "envelope-topk-packed-1bit", "topk-packed at 1 bit: signs, scale = mean |x| (no draws); an "
             "all-zero tensor has scale 0 and code 1 (x >= 0), so it decodes to +0.0, not -0.0",
             {**base, "zeros": np.zeros(2, np.float32)}, round_id=7, seq=1102, metadata=meta,
             options={"k": 2, "bits": 1})
    _compact(b, "envelope-topk-packed-3bit", "topk-packed at 3 bits: codes cross byte boundaries", base,
             round_id=7, seq=1103, metadata=meta, options={"k": 3, "bits": 3}, seed=23)
    _compact(b, "envelope-topk-packed-8bit", "topk-packed at 8 bits: one byte per code, qmax 127", base,
             round_id=7, seq=1104, metadata=meta, options={"k": 2, "bits": 8}, seed=24)
    _compact(b, "envelope-topk-packed-min-k", "topk-packed with ratio 0.01 and min_k 3: min_k wins on small "
             "tensors", base, round_id=7, seq=1105, metadata=meta, options={"ratio": 0.01, "min_k": 3, "bits": 2},
             seed=25)
    gap = np.zeros(300, np.float32)
    gap[[5, 290, 299]] = [0.75, -1.0, 0.125]
    edge = {
        "gap": gap,
        "empty": np.zeros((0, 4), np.float32),
        "zeros": np.zeros(2, np.float64),
        "step": np.array(3.0, np.float16),
    }
    _compact(b, "envelope-topk-packed-edge", "topk-packed edge cases at 5 bits: a 2-byte gap (285), an empty "
             "tensor (k 0), an all-zero float64 tensor (scale 0, codes qmax), a 0-d float16 scalar, no metadata",
             edge, round_id=300, seq=2**40, metadata={}, options={"k": 2, "bits": 5}, seed=26)
    tags = {
        "num_samples": 12, "loss": 0.1, "round_nonce": "9f3c00ff", "accuracy": 0.75, "none": None,
        "no": False, "yes": True, "neg": -5, "min64": -(2**64), "big": 2**70, "tiny": -(2**70),
        "name": "dev-1 \u00e9", "odd_hex": "abc", "upper": "9F3C", "list": [1, -1, 0.5, "x", []],
        "metrics": {"eval": {"accuracy": 0.5}, "n": 0}, "empty": {},
    }
    _compact(b, "envelope-topk-packed-signed", "topk-packed signed by the device test key (context update/v2), "
             "binary metadata with every tag (0-11), known and literal keys", base, round_id=7, seq=1106,
             metadata=tags, options={"k": 2, "bits": 4}, seed=27, signer=device_signer(), signed_by="device")


def build_randk_and_layout(b: Builder) -> None:
    """Codec 7 (randk-packed, §8.7) and the layout-digest envelope (version 3, §7.7)."""
    meta = {"base_version": 3, "loss": 0.25, "num_samples": 32}
    base = _base_tensors()
    w = np.array([(-1) ** i * (0.05 + 0.01 * i) for i in range(40)], np.float32).reshape(5, 8)
    _compact(b, "envelope-randk-packed", "randk-packed (codec 7) in the compact envelope: ratio 0.25 (density "
             "16384), 3-bit codes; the indices come from PCG64 seeded with each section's seed (the first raw "
             "outputs are listed), the uniforms from the SHA-256 counter", {**base, "w": w}, round_id=7, seq=1201,
             metadata=meta, options={"ratio": 0.25, "bits": 3}, seed=31, codec="randk-packed")
    _compact(b, "envelope-randk-packed-1bit", "randk-packed at 1 bit (signs, scale = mean |x|, no draws) with "
             "ratio 1: density 65536 is written as 0 and every entry is kept; an empty tensor (k 0)",
             {"fc.bias": base["fc.bias"], "none": np.zeros((0, 2), np.float32), "w": np.array([0.5, -0.25, 1.0,
                                                                                               -0.25], np.float32)},
             round_id=7, seq=1202, metadata=meta, options={"ratio": 1.0, "bits": 1}, seed=32, codec="randk-packed")
    sorted_base = {k: base[k] for k in sorted(base)}
    _compact(b, "envelope-layout-digest", "the layout-digest envelope (version 3): topk-packed k=2 at 4 bits, no "
             "names or shapes on the wire, sections in name order; signed by the device test key (context "
             "update/v3)", sorted_base, round_id=7, seq=1301, metadata=meta, options={"k": 2, "bits": 4}, seed=41,
             signer=device_signer(), signed_by="device", layout=True)
    _compact(b, "envelope-layout-digest-randk", "version 3 with randk-packed (ratio 0.5, 2 bits): neither names, "
             "shapes nor indices travel", {**sorted_base, "w": w}, round_id=8, seq=1302, metadata={"num_samples": 9},
             options={"ratio": 0.5, "bits": 2}, seed=42, codec="randk-packed", layout=True)


def _weights_digest_reference(weights: dict[str, np.ndarray]) -> str:
    """§10.5's weights digest written out from the text."""
    h = hashlib.sha256(b"edgeflow-weights-v1\0")
    for name in sorted(weights, key=str.encode):
        a = np.asarray(weights[name], dtype="<f4")
        shape = a.shape or (1,)  # a 0-d weight counts as rank 1, dimension 1
        raw = name.encode("utf-8")
        h.update(struct.pack("<H", len(raw)) + raw + struct.pack("<B", len(shape))
                 + b"".join(struct.pack("<I", d) for d in shape) + a.tobytes())
    return h.hexdigest()


def _weights(weights: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    return [{"name": k, "shape": list(np.shape(v)), "f32": f32_hex(v)} for k, v in weights.items()]


def build_delta(b: Builder) -> None:
    """The model delta (§10.5): version 4 -> 5 as fp16 (deterministic: no draws), signed by the fleet key."""
    from edgeflow.codecs.model_delta import encode_model_delta, weights_digest

    base = {**_base_tensors(), "gain": np.array(1.5, np.float32)}  # a 0-d weight: hashed as rank 1, dim 1
    new = {"fc.weight": base["fc.weight"] + np.array([[0.01, -0.02, 0.003], [0.1, -1e-4, 0.5]], np.float32),
           "fc.bias": base["fc.bias"] + np.array([-0.03125, 0.2, 1e-3], np.float32),
           "gain": base["gain"] + np.float32(0.1)}
    payload, result, digest = encode_model_delta(base, new, codec="fp16", base_version=4, version=5, epoch=2,
                                                 signer=Signer("gateway", fleet_key()), seed=0)
    diff = {k: np.subtract(new[k], base[k], dtype=np.float32) for k in base}
    want = {k: np.add(base[k], np.asarray(decode_update(payload).tensors[k], np.float32), dtype=np.float32)
            for k in base}
    if any(not np.array_equal(want[k].view(np.uint32), result[k].view(np.uint32)) for k in base):
        raise AssertionError("the delta's result is not base + decode(delta) in binary32")
    if _weights_digest_reference(result) != digest or _weights_digest_reference(base) != weights_digest(base):
        raise AssertionError("the weights digest reference disagrees with edgeflow")
    b.add("model-delta", payload, "model_delta", ["envelope", "update_context"],
          "a model delta on gateway/model_delta: v4 -> v5, fp16, device id 'gateway', round id = seq = 5, signed "
          "by the fleet key; the device adds the decoded delta to v4 in binary32 and checks both digests",
          envelope=_describe_envelope(payload, diff, "fp16", seed=None, k=None, signed_by="fleet"),
          delta={"base_version": 4, "model_version": 5, "epoch": 2, "base": _weights(base), "new": _weights(new),
                 "result": _weights(result), "base_sha256": weights_digest(base), "model_sha256": digest},
          topic=gateway_topic(FLEET, "model_delta").value)


# ---------------------------------------------------------------- chunking


def build_chunked(b: Builder) -> None:
    rng = np.random.default_rng(5)
    model = {"W": (rng.standard_normal((16, 40)) * 0.1).astype(np.float32), "b": np.zeros(40, np.float32)}
    payload = encode_update(model, "dense", round_id=9, device_id="gateway", seq=9, metadata={"model_version": 9},
                            signer=Signer("gateway", fleet_key()))
    max_message = chunking.HEADER_SIZE + 1024
    splitter = chunking.Splitter(payload, max_message, transfer_id=TRANSFER_ID)
    base = gateway_topic(FLEET, "model").value
    b.add("chunked-model.payload", payload, "chunked_payload", ["envelope", "update_context"],
          f"the payload of the chunked transfer: a signed global model (version 9) of {len(payload)} bytes",
          envelope={"round_id": 9, "seq": 9, "device_id": "gateway", "metadata_json": '{"model_version":9}'})
    chunks = []
    for i in range(len(splitter)):
        frame = splitter.frame(i)
        entry = b.add(f"chunked-model.chunk{i}", frame, "chunk", ["chunk", "envelope", "update_context"],
                      f"chunk {i} of {len(splitter)}: 80-byte header + data",
                      topic=chunk_topic(base, i), index=i, count=len(splitter),
                      data_length=len(frame) - chunking.HEADER_SIZE,
                      crc32=f"{struct.unpack_from('!I', frame, 76)[0]:08x}")
        chunks.append(entry["file"])
    b.vectors.append({
        "name": "chunked-model", "kind": "chunked_transfer", "depends": ["spec", "chunk", "envelope", "update_context"],
        "description": f"one payload split for brokers that take at most {max_message}-byte messages",
        "base_topic": base, "retain": True, "max_message": max_message, "transfer_id": TRANSFER_ID.hex(),
        "count": len(splitter), "chunk_size": splitter.chunk_size, "total_size": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(), "payload_file": "chunked-model.payload.bin",
        "chunk_files": chunks,
    })


# ---------------------------------------------------------------- signed JSON


def _signed_json(b: Builder, name: str, data: bytes, depends: list[str], description: str, *, signed_by: str,
                 topic: str) -> None:
    wrapper = json.loads(data)
    digest = hashlib.sha256(wrapper["body"].encode("utf-8")).digest()
    b.add(name, data, "signed_json", ["signed_json", *depends], description, topic=topic, signed_by=signed_by,
          context=wrapper["ctx"], body_text=wrapper["body"], body=json.loads(wrapper["body"]),
          key_id=wrapper["key_id"], signature=wrapper["sig"],
          signing_message=signing_message(wrapper["ctx"], digest).hex())


def build_control(b: Builder) -> None:
    fk = fleet_key()
    dk = device_signer().key
    ann = RoundAnnouncement(round_id=7, model_version=4, deadline=T0 + 60, selected=("dev-1", "dev-2"),
                            config=TrainConfig(epochs=1, batch_size=16, lr=0.05, codec="int8"), issued=T0)
    _signed_json(b, "round-announcement", ann.sign(fk), ["round_context"],
                 "round 7 on model v4, signed by the fleet key, retained on gateway/round",
                 signed_by="fleet", topic=gateway_topic(FLEET, "round").value)
    cmd = Command("set_config", DEVICE, FLEET, {"telemetry_interval_s": 30}, "0123456789abcdef0123456789abcdef",
                  T0, T0 + 300)
    _signed_json(b, "command", cmd.sign(fk), ["cmd_context"], "a set_config command, signed by the fleet key",
                 signed_by="fleet", topic=device_topic(FLEET, DEVICE, "cmd").value)
    ack = Ack("0123456789abcdef0123456789abcdef", "reboot", DEVICE, False, "expired",
              "command expired 12.0 s ago; the gateway must send a fresh one", {}, T0 + 1, False)
    _signed_json(b, "ack-refusal", ack.sign(dk), ["ack_context"], "a refusal (code 'expired'), signed by the device",
                 signed_by="device", topic=device_topic(FLEET, DEVICE, "cmd/ack").value)
    birth = Birth(DEVICE, FLEET, "raspberry-pi-4", 1767225600000, device_signer().public_key.hex, model_version=3,
                  model_sha256="00" * 32, backend="numpy", versions={"edgeflow": "0.1.0"},
                  telemetry_interval_s=10.0, can_train=True, training=False, commands=["status", "reboot"],
                  seq=1, ts=T0)
    _signed_json(b, "birth", birth.sign(dk), ["birth_context"], "a birth (retained), signed by the device",
                 signed_by="device", topic=device_topic(FLEET, DEVICE, "birth").value)
    death = Death(DEVICE, 1767225600000, "lost", None).sign(dk)
    _signed_json(b, "death", death, ["death_context"], "the last will a device registers at connect (retained), "
                 "signed by the device", signed_by="device", topic=device_topic(FLEET, DEVICE, "death").value)


# ---------------------------------------------------------------- secure aggregation


def build_secagg(b: Builder) -> None:
    signer = device_signer()
    enc = hashlib.sha256(b"vector enc key").digest()
    mask = hashlib.sha256(b"vector mask key").digest()
    adv = secagg_wire.encode_message(AdvertiseKeys(DEVICE, enc, mask))
    topic = device_topic(FLEET, DEVICE, "secagg").value
    for name, frame, what in (
        ("secagg-advertise", adv, "AdvertiseKeys (kind 1)"),
        ("secagg-masked", secagg_wire.encode_message(MaskedInput(DEVICE, bytes(range(16)), np.array(
            [0, 1, 2**63, 2**64 - 1], dtype=np.uint64))), "MaskedInput (kind 5) with a 4 x u64 payload"),
    ):
        sealed = secure.seal(frame, signer)
        hlen = struct.unpack_from(">I", frame, 6)[0]
        b.add(name, sealed, "secagg", ["secagg_frame", "secagg_context"],
              f"{what}, sealed (signed) by the device", topic=topic, signed_by="device",
              frame_kind=frame[5], header_json=frame[10:10 + hlen].decode("utf-8"),
              payload=frame[10 + hlen:].hex(), signature=sealed[:64].hex(),
              signing_message=signing_message(secure.CONTEXT, hashlib.sha256(frame).digest()).hex())


# ---------------------------------------------------------------- OTA


def build_ota(b: Builder) -> None:
    fk = fleet_key()
    model = b"\x08\x07\x12\x07edgeflow:" + bytes(range(32))  # any bytes: the artifact does not parse ONNX
    art = ota.build_artifact(model, version=5, profile="any", key=fk, fleet=FLEET, name="model", created=T0)
    mlen = struct.unpack_from(">I", art, 6)[0]
    manifest_text = art[10:10 + mlen].decode("utf-8")
    b.add("ota-artifact", art, "ota_artifact", ["ota_format", "ota_magic", "ota_context"],
          "an OTA artifact for profile 'any' without golden data, signed by the fleet key",
          manifest_text=manifest_text, signature=art[10 + mlen:74 + mlen].hex(), model=model.hex(), golden_length=0,
          sha256=hashlib.sha256(art).hexdigest(),
          signing_message=signing_message(ota.CONTEXT, hashlib.sha256(manifest_text.encode()).digest()).hex())
    cmd = Command("deploy", DEVICE, FLEET, {"artifact_sha256": hashlib.sha256(art).hexdigest(), "version": 5},
                  "fedcba9876543210fedcba9876543210", T0, T0 + 600)
    signed = cmd.sign(fk)
    offer = OtaOffer.make(cmd, art, fk).to_bytes()
    b.add("ota-offer", offer, "ota_offer", ["ota_offer_magic", "signed_json", "cmd_context", "ota_format",
                                            "ota_magic", "ota_context"],
          "an OTA offer on the device's ota topic: magic, u32 length, signed deploy command, artifact",
          topic=device_topic(FLEET, DEVICE, "ota").value, command_length=len(signed), command=signed.decode("utf-8"),
          artifact_file="ota-artifact.bin")


BUILDERS: tuple[Callable[[Builder], None], ...] = (build_envelopes, build_compact, build_randk_and_layout,
                                                   build_delta, build_chunked, build_control, build_secagg, build_ota)


def build_all() -> tuple[dict[str, bytes], dict[str, Any]]:
    """(files, manifest) exactly as they would be written; nothing touches the disk."""
    b = Builder()
    for fn in BUILDERS:
        fn(b)
    manifest = {
        "format": "edgeflow-wire-vectors",
        "spec": "docs/wire-format.md",
        "regenerate": "python tests/vectors/generate.py",
        "versions": current_versions(),
        "keys": keys_section(),
        "fleet": FLEET,
        "vectors": b.vectors,
    }
    return b.files, manifest


def manifest_text(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=False, allow_nan=False) + "\n"


def stored(directory: Path = HERE) -> tuple[dict[str, bytes], dict[str, Any]]:
    manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    files = {p.name: p.read_bytes() for p in sorted(directory.glob("*.bin"))}
    return files, manifest


def write(directory: Path = HERE) -> list[str]:
    files, manifest = build_all()
    for old in directory.glob("*.bin"):
        if old.name not in files:
            old.unlink()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    (directory / MANIFEST).write_text(manifest_text(manifest), encoding="utf-8")
    return sorted(files)


def main(argv: list[str]) -> int:
    if "--check" in argv:
        files, manifest = build_all()
        old_files, old_manifest = stored()
        same = files == old_files and manifest_text(manifest) == manifest_text(old_manifest)
        print("vectors are up to date" if same else "vectors differ from the code: see tests/test_wire_vectors.py")
        return 0 if same else 1
    names = write()
    print(f"wrote {len(names)} vector files and {MANIFEST} to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
