"""The compact envelope (version 2): same fields as version 1 in fewer bytes; every bound still holds."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from edgeflow.codecs import ErrorFeedback, RejectStats, decode_update, encode_update, peek_update
from edgeflow.codecs.envelope import SectionInput, build_envelope
from edgeflow.codecs.packing import varint
from edgeflow.errors import CodecError
from edgeflow.signing import KeyRing, Signer

SIGNER = Signer.generate("pi-7")
RING = KeyRing({"pi-7": SIGNER.public_key})


def mlp_delta(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"fc0.weight": (64, 64), "fc0.bias": (64,), "fc1.weight": (32, 64), "fc1.bias": (32,),
              "fc2.weight": (10, 32), "fc2.bias": (10,)}
    return {n: (rng.standard_normal(s) * 0.01).astype(np.float32) for n, s in shapes.items()}


def test_signed_round_trip_keeps_every_field() -> None:
    t = {"a": np.arange(12, dtype=np.float64).reshape(3, 4), "b": np.ones(5, np.float16),
         "s": np.array(2.0, np.float32)}
    data = encode_update(t, "topk-packed", round_id=2**40, device_id="pi-7", seq=2**64 - 1, signer=SIGNER, rng=0,
                         metadata={"loss": 0.5, "base_version": 7}, num_samples=64, ratio=1.0, bits=8)
    head = peek_update(data)
    assert (head.version, head.round_id, head.seq, head.device_id) == (2, 2**40, 2**64 - 1, "pi-7")
    up = decode_update(data, verifier=RING, expected_shapes={n: x.shape for n, x in t.items()})
    assert up.metadata == {"loss": 0.5, "base_version": 7, "num_samples": 64} and up.signed_by
    for n, x in t.items():
        assert up.tensors[n].dtype == x.dtype and up.tensors[n].shape == x.shape
        np.testing.assert_allclose(up.tensors[n], x, rtol=0.02, atol=0.05)


def test_version_2_is_smaller_than_version_1_for_the_same_sections() -> None:
    sections = [SectionInput(n, 2, x.shape, [b"\x01" * 7]) for n, x in mlp_delta().items()]
    kw = {"codec_id": 6, "round_id": 17, "seq": 17, "device_id": "sim-007", "metadata_json": b"", "sections": sections,
          "signer": Signer.generate("sim-007")}
    v1, v2 = len(build_envelope(**kw, version=1)), len(build_envelope(**kw, version=2))
    # version 1: 36 B of prefix and fixed fields, 12 B + 8 B per dim per tensor, 8-byte alignment
    assert v1 - v2 >= 140, (v1, v2)


def test_a_signature_does_not_survive_a_change_of_version_or_codec() -> None:
    data = bytearray(encode_update(mlp_delta(), "topk-packed", round_id=1, device_id="pi-7", seq=1, signer=SIGNER))
    data[6] = 5  # claim topk-int8 (a valid CRC, so only the signature can tell): it covers the prefix
    crc_at = len(data) - 72 - 4
    data[crc_at : crc_at + 4] = struct.pack("<I", zlib.crc32(bytes(data[:crc_at])))
    with pytest.raises(CodecError) as err:
        decode_update(bytes(data), verifier=RING, stats=RejectStats())
    assert err.value.reason in ("bad_signature", "malformed")  # type: ignore[attr-defined]


def test_every_truncation_and_every_byte_flip_is_refused_or_finite() -> None:
    valid = encode_update(mlp_delta(), "topk-packed", round_id=3, device_id="pi-7", seq=9, rng=0, ratio=0.05,
                          metadata={"loss": 0.25}, state=ErrorFeedback())
    for cut in range(len(valid)):
        with pytest.raises(CodecError):
            decode_update(valid[:cut], stats=RejectStats())
    for pos in range(len(valid) - 4):
        for bit in (0, 7):
            data = bytearray(valid)
            data[pos] ^= 1 << bit
            try:
                up = decode_update(fix_crc(bytes(data)), stats=RejectStats())
            except CodecError:
                continue
            assert all(np.isfinite(v).all() for v in up.tensors.values())


# ------------------------------------------------------------------ hand-built hostile headers


def fix_crc(data: bytes) -> bytes:
    body = data[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def compact(*, flags: int = 0, round_id: bytes = b"\x01", dev: bytes = b"\x03evl", meta: bytes = b"\x00",
            count: bytes = b"\x01", tensors: bytes = b"\x01w\x02\x01\x04\x10", body: bytes = b"\0" * 16,
            header_len: bytes | None = None, tail: bytes = b"") -> bytes:
    """A version-2 dense envelope (codec 1) with every field overridable as raw bytes."""
    header = round_id + b"\x01" + dev + meta + count + tensors
    data = b"EFUP" + bytes((2, flags, 1)) + (varint(len(header)) if header_len is None else header_len) + header + body
    return data + struct.pack("<I", zlib.crc32(data)) + tail


def refused(data: bytes, **kw) -> tuple[str, str]:
    stats = RejectStats()
    with pytest.raises(CodecError) as err:
        decode_update(data, stats=stats, **kw)
    reason = err.value.reason  # type: ignore[attr-defined]
    assert stats.count(reason) == 1
    return reason, str(err.value)


def test_the_hand_built_envelope_is_valid() -> None:
    up = decode_update(compact())
    assert up.device_id == "evl" and up.tensors["w"].shape == (4,) and not up.tensors["w"].any()


@pytest.mark.parametrize(("kw", "reason", "match"), [
    ({"tensors": b"\x01w\x02\x02" + varint(10**6) + varint(10**6) + b"\x10"}, "too_large", "refused before allocating"),
    ({"round_id": b"\x80" * 11}, "malformed", "varint longer than 10 bytes"),
    ({"round_id": b"\xff" * 9 + b"\x02"}, "malformed", "exceeds 64 bits"),
    ({"header_len": varint(10_000)}, "truncated", "header alone claims"),
    ({"header_len": varint(5)}, "malformed", "header ends inside"),
    ({"tail": b"\0"}, "malformed", "bytes after its declared end"),
    ({"body": b"\0" * 15}, "truncated", "its header declares"),
    ({"tensors": b"\x01w\x02\x01\x04" + varint(1000)}, "truncated", "ends inside the section"),
    ({"count": varint(70_000)}, "malformed", "70000 tensors"),
    ({"count": b"\x02"}, "malformed", "header ends inside"),
    ({"tensors": b"\x01w\x09\x01\x04\x10"}, "malformed", "unknown dtype code 9"),
    ({"tensors": b"\x01w\x02\x21" + b"\x01" * 33 + b"\x10"}, "malformed", "33 dimensions"),
    ({"tensors": b"\x00\x02\x01\x04\x10"}, "malformed", "empty or repeated"),
    ({"tensors": b"\x01\xff\x02\x01\x04\x10"}, "malformed", "not valid UTF-8"),
    ({"dev": varint(300) + b"x" * 300}, "malformed", "more than 256"),
    ({"meta": varint(70_000)}, "too_large", "metadata is 70000 bytes"),
    ({"meta": varint(146) + b"\x0a\x01\x00\x01k" + b"\x09\x01" * 70 + b"\x00"}, "malformed", "deeper than 64"),
    ({"meta": b"\x02\x09\x00"}, "malformed", "must be an object"),
    ({"flags": 0x80}, "unsupported_version", "unknown flags"),
    ({"flags": 0x01}, "truncated", "its header declares"),
])
def test_hostile_compact_headers_are_refused_with_a_reason(kw, reason: str, match: str) -> None:
    got, message = refused(compact(**kw), max_elements=1 << 30)
    assert got == reason
    assert match in message


def test_a_compact_envelope_cut_inside_its_prefix_or_header_length_is_truncated() -> None:
    assert refused(b"EFUP\x02\x00")[0] == "truncated"
    assert refused(b"EFUP\x02\x00\x01\xff\xff")[0] == "truncated"
