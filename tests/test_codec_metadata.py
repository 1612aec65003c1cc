"""Binary metadata of the compact envelope: what JSON would give back, in fewer bytes; hostile bytes refused."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeflow.codecs.metadata import KEYS, pack_metadata, unpack_metadata
from edgeflow.codecs.packing import varint
from edgeflow.errors import CodecError

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
    | st.sampled_from(["", "ab", "0123456789abcdef", "ABCD", "abc"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.sampled_from(KEYS), inner,
                                                               max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=8) | st.sampled_from(KEYS), JSONISH, max_size=6))
def test_round_trip_equals_json(meta: dict) -> None:
    assert unpack_metadata(pack_metadata(meta)) == json.loads(json.dumps(meta))


def test_a_devices_metadata_is_a_third_of_its_json() -> None:
    meta = {"base_version": 12, "loss": 0.19933363285071554, "num_samples": 72, "round_nonce": "9f3c0a1b2c3d4e5f"}
    raw = pack_metadata(meta)
    assert unpack_metadata(raw) == meta
    assert len(raw) <= 0.4 * len(json.dumps(meta, separators=(",", ":")))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_codec_error(raw: bytes) -> None:
    try:
        out = unpack_metadata(b"\x0a" + raw)
    except CodecError as exc:
        assert exc.reason == "malformed"  # type: ignore[attr-defined]
        return
    assert isinstance(out, dict)


@pytest.mark.parametrize(("raw", "match"), [
    (b"\x0a\x01\x02", "ends inside"),                                  # key num_samples, no value
    (b"\x0a" + varint(10**9), "declares 1000000000 elements"),          # a huge count, 0 bytes left
    (b"\x0a\x02\x01\x03\x01\x01\x03\x02", "repeats the key 'num_samples'"),
    (b"\x0a\x01\x02\x05" + struct.pack("<f", float("nan")), "NaN or Infinity"),
    (b"\x0a\x01\x02\x06" + struct.pack("<d", float("inf")), "NaN or Infinity"),
    (b"\x0a\x01\x00\x02\xff\xfe\x00", "not valid UTF-8"),
    (b"\x0a\x01\x01\x03" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
    (b"\x0a\x01\x01\x03" + b"\xff" * 9 + b"\x02", "beyond 64 bits"),
    (b"\x0a\x01" + varint(len(KEYS) + 1) + b"\x00", f"knows {len(KEYS)}: upgrade"),
    (b"\x0a\x01\x01\x0c", "unknown tag 12"),
    (b"\x0a\x00\x00", "1 bytes after its value"),
    (b"\x09\x00", "must be an object"),
    (b"\x0a\x01\x01\x0b\x03\"x\"", "must be an integer"),
    (b"\x0a\x01\x01\x0b\x05\x31\x65\x34\x30\x30", "must be an integer"),  # 1e400: JSON parses it to inf
    (b"\x0a\x01\x01" + b"\x09\x01" * 70 + b"\x00", "deeper than 64"),
])
def test_hostile_metadata_is_refused(raw: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match) as err:
        unpack_metadata(raw)
    assert err.value.reason == "malformed"  # type: ignore[attr-defined]


def test_non_json_values_are_refused_on_encode() -> None:
    with pytest.raises(CodecError, match="NaN or Infinity"):
        pack_metadata({"loss": float("nan")})
    with pytest.raises(CodecError, match="set is not"):
        pack_metadata({"x": {1, 2}})
