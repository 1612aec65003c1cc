"""topk-packed: gap-coded varint indices and 1-8 bit values; error-feedback accounting; hostile sections."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from edgeflow.codecs import ErrorFeedback, RejectStats, decode_update, encode_update
from edgeflow.codecs.envelope import SectionInput, build_envelope
from edgeflow.codecs.packing import pack_bits, read_varints, unpack_bits, varint, varint_bytes
from edgeflow.errors import CodecError

CODEC_ID = 6


def delta(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"fc.weight": (rng.standard_normal((64, 64)) * 0.05).astype(np.float32),
            "fc.bias": (rng.standard_normal(10) * 0.01).astype(np.float32)}


def encode(tensors, state=None, **opts) -> bytes:
    return encode_update(tensors, "topk-packed", round_id=1, device_id="pi-7", seq=1, state=state, rng=0, **opts)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_error_feedback_accounts_for_every_value(bits: int) -> None:
    # what was sent (decoded) plus what stays on the device (residual) is exactly the update plus the old residual
    state = ErrorFeedback()
    sent_total = {n: np.zeros(x.size, np.float32) for n, x in delta().items()}
    owed = {n: np.zeros(x.size, np.float32) for n, x in delta().items()}
    for r in range(3):
        d = delta(r)
        up = decode_update(encode(d, state, ratio=0.05, bits=bits))
        for n, x in d.items():
            owed[n] += x.reshape(-1)
            sent_total[n] += up.tensors[n].reshape(-1)
            np.testing.assert_allclose(sent_total[n] + state.get(n), owed[n], atol=1e-5)


def test_gap_varints_and_small_values_beat_topk_int8() -> None:
    x = {"w": np.random.default_rng(0).standard_normal(200_000).astype(np.float32)}
    packed = len(encode(x, ratio=0.01, bits=4))
    int8 = len(encode_update(x, "topk-int8", round_id=1, device_id="pi-7", seq=1, rng=0, ratio=0.01))
    # 2,000 entries: gaps average 100 (one byte below 128, two above: about 1.3 bytes) + half a byte
    # per value, vs a 4-byte index + 1 byte in topk-int8 (a tensor of more than 65,536 entries)
    assert packed < 0.4 * int8
    assert packed < 2000 * 1.8 + 200


def test_stochastic_rounding_is_unbiased() -> None:
    x = {"w": np.full(20_000, 1.0 / 3.0, dtype=np.float32)}
    x["w"][0] = 1.0  # sets the scale: 1/7 per level, so 1/3 lies between levels 2 and 3
    mean = np.mean([decode_update(encode_update(x, "topk-packed", round_id=1, device_id="d", seq=1, rng=s,
                                                ratio=1.0, bits=4)).tensors["w"][1:].mean() for s in range(5)])
    assert abs(mean - 1.0 / 3.0) < 2e-3


def test_all_zero_and_empty_tensors() -> None:
    up = decode_update(encode({"z": np.zeros(50, np.float32), "e": np.zeros((0, 3), np.float32)}, ratio=0.1))
    assert not up.tensors["z"].any() and up.tensors["e"].shape == (0, 3)


@pytest.mark.parametrize(("opts", "match"), [
    ({"bits": 0}, "bits must be an integer in 1..8"),
    ({"bits": 9}, "bits must be an integer in 1..8"),
    ({"bits": True}, "bits must be an integer"),
    ({"bits": "4"}, "bits must be an integer"),
    ({"ratio": 0.0}, "ratio must be in"),
    ({"level": 3}, "unknown option"),
])
def test_bad_options_say_what_is_valid(opts, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode(delta(), **opts)


# ------------------------------------------------------------------ hostile sections, through decode_update


def envelope(section: bytes, size: int = 100) -> bytes:
    return build_envelope(codec_id=CODEC_ID, round_id=1, seq=1, device_id="evil", metadata_json=b"",
                          sections=[SectionInput("w", 2, (size,), [section])])


def section(k_declared: int, bits: int, scale: float, gaps: list[int], codes: list[int], tail: bytes = b"") -> bytes:
    return (varint(k_declared) + struct.pack("<Bf", bits, scale) + varint_bytes(np.array(gaps, dtype=np.uint64))
            + pack_bits(np.array(codes, dtype=np.uint8), bits) + tail)


def refused(data: bytes) -> tuple[str, str]:
    stats = RejectStats()
    with pytest.raises(CodecError) as err:
        decode_update(data, stats=stats)
    reason = err.value.reason  # type: ignore[attr-defined]
    assert stats.count(reason) == 1
    return reason, str(err.value)


def test_a_hand_built_valid_section_decodes() -> None:
    up = decode_update(envelope(section(3, 4, 0.5, [1, 4, 95], [14, 0, 7])))
    w = up.tensors["w"]
    assert np.flatnonzero(w).tolist() == [0, 4]  # code 7 is zero
    assert w[0] == pytest.approx(3.5) and w[4] == pytest.approx(-3.5)


@pytest.mark.parametrize(("sec", "reason", "match"), [
    (section(2, 4, 0.5, [50, 51], [8, 8]), "malformed", "indexes entry 100 of a tensor of 100"),
    (section(2, 4, 0.5, [3, 200], [8, 8]), "malformed", "gap beyond"),
    (section(3, 4, 0.5, [3, 0, 2], [8, 8, 8]), "malformed", "repeats an index"),
    (section(3, 4, 0.5, [1, 2, 3], [8, 8, 8])[:-1], "malformed", "packs 1 bytes of values, expected 2"),
    (section(3, 4, 0.5, [1, 2], [], tail=b"\x80\x80\x80"), "malformed", "ends inside its varints"),
    (section(2, 4, 0.5, [1, 2], [8, 8], tail=b"\0"), "malformed", "packs 2 bytes of values, expected 1"),
    (section(1, 4, 0.5, [1], [15]), "malformed", "never produces"),
    (section(1, 4, 0.5, [1], [8]) [:-1] + b"\xf8", "malformed", "non-zero padding bits"),
    (section(1, 0, 0.5, [1], [0]), "malformed", "0 bits per value"),
    (section(1, 9, 0.5, [1], []), "malformed", "9 bits per value"),
    (section(1, 4, float("nan"), [1], [8]), "non_finite", "scale"),
    (section(1, 4, -1.0, [1], [8]), "non_finite", "scale"),
    (section(1, 4, 1e30, [1], [8]), "out_of_range", "exceeds"),
    (section(101, 4, 0.5, [1], [8]), "malformed", "declares 101 entries for a tensor of 100"),
    (b"\x80" * 12, "malformed", "longer than 9 bytes"),
    (b"", "malformed", "declares 1 varints but only 0 bytes follow"),
    (varint(5) + b"\x04", "malformed", "shorter than its header"),
])
def test_hostile_sections_are_refused_with_a_reason(sec: bytes, reason: str, match: str) -> None:
    got_reason, message = refused(envelope(sec))
    assert got_reason == reason
    assert match in message


def test_a_huge_declared_count_is_refused_before_allocating() -> None:
    # 2**60 entries declared for a tensor of 2**40 (header says so; max_elements raised to let it through):
    # refused from the section's length, not by trying to allocate 2**40 floats
    sec = varint(1 << 39) + struct.pack("<Bf", 4, 0.5) + b"\x01" * 8
    data = build_envelope(codec_id=CODEC_ID, round_id=1, seq=1, device_id="evil", metadata_json=b"",
                          sections=[SectionInput("w", 2, (1 << 40,), [sec])])
    with pytest.raises(CodecError, match="declares 549755813888 varints but only 8 bytes follow"):
        decode_update(data, max_elements=1 << 41, stats=RejectStats())


def test_varint_and_bit_packing_round_trip() -> None:
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.integers(0, 1 << 40, 500, dtype=np.uint64), [0, 127, 128, 16383, 16384]])
    raw = varint_bytes(values)
    got, used = read_varints(memoryview(raw + b"\x7f"), values.size, "t")
    assert used == len(raw) and np.array_equal(got, values)
    assert b"".join(varint(int(v)) for v in values) == raw
    too_long = memoryview(b"\x01" + b"\x80" * 10 + b"\x01")
    with pytest.raises(CodecError, match="holds a varint longer than 9 bytes"):
        read_varints(too_long, 2, "t")
    for bits in range(1, 9):
        codes = rng.integers(0, 1 << bits, 77).astype(np.uint8)
        packed = pack_bits(codes, bits)
        assert len(packed) == (77 * bits + 7) // 8
        assert np.array_equal(unpack_bits(memoryview(packed), 77, bits, "t"), codes)


def test_min_k_keeps_small_tensors_moving() -> None:
    t = {"bias": np.arange(1, 11, dtype=np.float32), "weight": np.ones(1000, np.float32)}
    plain = decode_update(encode(t, ratio=0.02))
    floor = decode_update(encode(t, ratio=0.02, min_k=8))
    assert np.count_nonzero(plain.tensors["bias"]) == 1 and np.count_nonzero(floor.tensors["bias"]) == 8
    assert np.count_nonzero(floor.tensors["weight"]) == 20  # the ratio's 20 already exceed min_k
    with pytest.raises(CodecError, match="min_k must be an integer >= 1"):
        encode(t, min_k=0)


def test_long_sections_decode_block_by_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # 16-byte blocks: varints straddle block ends, codes span blocks, padding sits in the last one;
    # the same bytes must decode the same, and every refusal must still happen
    import edgeflow.codecs.packing as packing

    rng = np.random.default_rng(5)
    values = rng.integers(0, 1 << 30, 300, dtype=np.uint64)
    raw = varint_bytes(values)
    for bits in (1, 3, 4, 7):
        codes = rng.integers(0, 1 << bits, 101).astype(np.uint8)
        packed = pack_bits(codes, bits)
        monkeypatch.setattr(packing, "BLOCK", 16)
        got, used = read_varints(memoryview(raw), values.size, "t")
        assert used == len(raw) and np.array_equal(got, values)
        assert np.array_equal(unpack_bits(memoryview(packed), 101, bits, "t"), codes)
        with pytest.raises(CodecError, match="ends inside its varints"):
            read_varints(memoryview(raw[:-1]), values.size, "t")
        if (101 * bits) % 8:
            with pytest.raises(CodecError, match="non-zero padding bits"):
                unpack_bits(memoryview(packed[:-1] + bytes([packed[-1] | 0x80])), 101, bits, "t")
        monkeypatch.undo()
    t = delta(7)
    monkeypatch.setattr(packing, "BLOCK", 16)
    state = ErrorFeedback()
    up = decode_update(encode(t, state, ratio=0.3, bits=3))
    for n, x in t.items():
        np.testing.assert_allclose(up.tensors[n].reshape(-1) + state.get(n), x.reshape(-1), atol=1e-5)
