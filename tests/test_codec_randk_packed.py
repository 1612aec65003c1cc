"""randk-packed: indices derived from a seed, 1-8 bit values; error-feedback accounting; hostile sections."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from edgeflow.codecs import ErrorFeedback, RejectStats, decode_update, encode_update
from edgeflow.codecs.envelope import SectionInput, build_envelope
from edgeflow.codecs.packing import pack_bits
from edgeflow.codecs.randk_packed import sample_indices
from edgeflow.errors import CodecError

CODEC_ID = 7


def delta(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"fc.weight": (rng.standard_normal((64, 64)) * 0.05).astype(np.float32),
            "fc.bias": (rng.standard_normal(10) * 0.01).astype(np.float32)}


def encode(tensors, state=None, rng=0, **opts) -> bytes:
    return encode_update(tensors, "randk-packed", round_id=1, device_id="pi-7", seq=1, state=state, rng=rng, **opts)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_error_feedback_accounts_for_every_value(bits: int) -> None:
    state = ErrorFeedback()
    sent = {n: np.zeros(x.size, np.float32) for n, x in delta().items()}
    owed = {n: np.zeros(x.size, np.float32) for n, x in delta().items()}
    for r in range(3):
        d = delta(r)
        up = decode_update(encode(d, state, rng=r, ratio=0.1, bits=bits))
        for n, x in d.items():
            owed[n] += x.reshape(-1)
            sent[n] += up.tensors[n].reshape(-1)
            np.testing.assert_allclose(sent[n] + state.get(n), owed[n], atol=1e-5)


def test_no_index_bytes_only_value_bits() -> None:
    x = {"w": np.random.default_rng(0).standard_normal(100_000).astype(np.float32)}
    small = len(encode(x, ratio=0.01, bits=1))
    large = len(encode(x, ratio=0.1, bits=1))
    # 10x the entries at 1 bit each: about 9,000 entries more, 9,000 bits more, nothing per index
    assert 0.9 * 9_000 / 8 < large - small < 1.1 * 9_000 / 8
    topk = len(encode_update(x, "topk-packed", round_id=1, device_id="pi-7", seq=1, rng=0, ratio=0.01, bits=1))
    assert small < 0.25 * topk


def test_indices_are_the_seeds_and_stable() -> None:
    # the kept set is a function of (seed, size, density) only: read in blocks it is the same as at once,
    # and it is pinned here so that a change of the derivation (which would break mixed fleets) fails
    a = sample_indices(12345, 200_000, 6554)
    assert 0.09 < a.size / 200_000 < 0.11 and np.all(np.diff(a) > 0)
    raw = np.random.PCG64(12345).random_raw(200_000) >> np.uint64(48)
    assert np.array_equal(a, np.flatnonzero(raw < 6554))
    assert sample_indices(7, 20, 16384).tolist() == [int(i) for i in np.flatnonzero(
        (np.random.PCG64(7).random_raw(20) >> np.uint64(48)) < 16384)]
    assert sample_indices(7, 20, 0).size == 0 and sample_indices(7, 0, 100).size == 0


def test_every_seed_of_a_device_differs_per_update() -> None:
    d = delta()
    a = decode_update(encode(d, rng=1, ratio=0.1)).tensors["fc.weight"]
    b = decode_update(encode(d, rng=2, ratio=0.1)).tensors["fc.weight"]
    assert not np.array_equal(np.flatnonzero(a), np.flatnonzero(b))


def test_ratio_one_at_eight_bits_sends_everything() -> None:
    d = delta()
    up = decode_update(encode(d, ratio=1.0, bits=8))
    for n, x in d.items():
        assert np.abs(up.tensors[n] - x).max() <= np.abs(x).max() / 127 + 1e-7


@pytest.mark.parametrize(("opts", "match"), [
    ({"bits": 0}, "bits must be an integer in 1..8"),
    ({"bits": 9}, "bits must be an integer in 1..8"),
    ({"bits": True}, "bits must be an integer"),
    ({"ratio": 0.0}, "ratio must be a number in (0, 1]"),
    ({"ratio": 1.5}, "ratio must be a number in (0, 1]"),
    ({"ratio": "0.1"}, "ratio must be a number"),
    ({"k": 3}, "unknown option"),
])
def test_bad_options_say_what_is_valid(opts, match: str) -> None:
    with pytest.raises(CodecError, match=match.replace("(", r"\(").replace(")", r"\)")):
        encode(delta(), **opts)


# ------------------------------------------------------------------ hostile sections, through decode_update

SEED, SIZE, DENSITY = 99, 100, 13107  # 20%: sample_indices(99, 100, 13107) keeps K entries
K = int(sample_indices(SEED, SIZE, DENSITY).size)


def envelope(section: bytes, size: int = SIZE) -> bytes:
    return build_envelope(codec_id=CODEC_ID, round_id=1, seq=1, device_id="evil", metadata_json=b"",
                          sections=[SectionInput("w", 2, (size,), [section])], version=2)


def section(bits: int, scale: float, codes: list[int], density: int = DENSITY, seed: int = SEED,
            tail: bytes = b"") -> bytes:
    return struct.pack("<BHIf", bits, density, seed, scale) + pack_bits(np.array(codes, np.uint8), bits) + tail


def refused(data: bytes, **kw) -> tuple[str, str]:
    stats = RejectStats()
    with pytest.raises(CodecError) as err:
        decode_update(data, stats=stats, **kw)
    reason = err.value.reason  # type: ignore[attr-defined]
    assert stats.count(reason) == 1
    return reason, str(err.value)


def test_a_hand_built_valid_section_decodes() -> None:
    assert 5 < K < 40
    codes = [1, 0] * (K // 2) + [1] * (K % 2)
    w = decode_update(envelope(section(1, 0.25, codes))).tensors["w"]
    idx = sample_indices(SEED, SIZE, DENSITY)
    assert np.flatnonzero(w).tolist() == idx.tolist()
    assert w[idx[0]] == pytest.approx(0.25) and w[idx[1]] == pytest.approx(-0.25)


@pytest.mark.parametrize(("sec", "reason", "match"), [
    (section(1, 0.5, [1] * K)[:-1], "malformed", "expected"),                       # truncated codes
    (section(1, 0.5, [1] * K, tail=b"\0"), "malformed", "expected"),                 # trailing byte
    (section(1, 0.5, [1] * (K + 8)), "malformed", "expected"),                       # more codes than the seed's set
    (section(4, 0.5, [15] * K), "malformed", "never produces"),                       # the all-ones code
    (section(0, 0.5, []), "malformed", "0 bits per value"),
    (section(9, 0.5, []), "malformed", "9 bits per value"),
    (section(1, float("nan"), [1] * K), "non_finite", "randk-packed section has scale nan"),
    (section(1, float("inf"), [1] * K), "non_finite", "scale"),
    (section(1, -1.0, [1] * K), "non_finite", "scale"),
    (section(8, 1e30, [1] * K), "out_of_range", "exceeds"),
    (b"\x01\x00", "malformed", "shorter than its 11-byte header"),
    (b"", "malformed", "shorter than its 11-byte header"),
])
def test_hostile_sections_are_refused_with_a_reason(sec: bytes, reason: str, match: str) -> None:
    got_reason, message = refused(envelope(sec))
    assert got_reason == reason
    assert match in message


def test_padding_bits_are_refused() -> None:
    sec = bytearray(section(1, 0.5, [1] * K))
    if K % 8 == 0:
        pytest.skip("no padding bits at this K")
    sec[-1] |= 0x80
    assert refused(envelope(bytes(sec)))[0] == "malformed"


def test_a_huge_declared_tensor_is_bounded_by_max_elements() -> None:
    # a 15-byte section cannot make the receiver draw 2**40 numbers: the envelope's element bound comes first
    data = build_envelope(codec_id=CODEC_ID, round_id=1, seq=1, device_id="evil", metadata_json=b"",
                          sections=[SectionInput("w", 2, (1 << 40,), [section(1, 0.5, [1])])], version=2)
    reason, message = refused(data)
    assert reason == "too_large" and "refused before allocating" in message
