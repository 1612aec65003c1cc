"""Envelope version 3 (layout="digest"): an 8-byte layout digest instead of names, dtypes and shapes."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from edgeflow.codecs import ErrorFeedback, RejectStats, decode_update, encode_update, peek_update
from edgeflow.codecs.envelope import layout_digest
from edgeflow.codecs.packing import varint
from edgeflow.errors import CodecError
from edgeflow.signing import KeyRing, Signer

SIGNER = Signer.generate("pi-7")
RING = KeyRing({"pi-7": SIGNER.public_key})
SHAPES = {"fc0.weight": (64, 64), "fc0.bias": (64,), "fc1.weight": (32, 64), "fc1.bias": (32,),
          "fc2.weight": (10, 32), "fc2.bias": (10,)}


def mlp_delta(seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * 0.01).astype(dtype) for n, s in SHAPES.items()}


def encode(t, codec="topk-packed", layout="digest", **kw) -> bytes:
    opts = {"round_id": 5, "device_id": "pi-7", "seq": 9, "rng": 0, "signer": SIGNER,
            "metadata": {"loss": 0.25, "base_version": 4}, "num_samples": 72, **kw}
    return encode_update(t, codec, layout=layout, **opts)


def refused(data: bytes, **kw) -> tuple[str, str]:
    stats = RejectStats()
    with pytest.raises(CodecError) as err:
        decode_update(data, stats=stats, **kw)
    reason = err.value.reason  # type: ignore[attr-defined]
    assert stats.count(reason) == 1
    return reason, str(err.value)


@pytest.mark.parametrize("codec", ["topk-packed", "randk-packed", "auto"])
def test_signed_round_trip_with_the_receivers_shapes(codec: str) -> None:
    t = mlp_delta(dtype=np.float16)
    opts = {"ratio": 1.0, "bits": 8} if codec != "auto" else {}
    data = encode(t, codec, **opts)
    head = peek_update(data)
    assert head.version == 3 and head.layout == layout_digest(list(SHAPES.items())) and head.tensors == ()
    assert (head.device_id, head.round_id, head.seq) == ("pi-7", 5, 9)
    up = decode_update(data, verifier=RING, expected_shapes=SHAPES)
    assert up.metadata == {"loss": 0.25, "base_version": 4, "num_samples": 72} and up.signed_by
    assert list(up.tensors) == sorted(SHAPES)  # the layout's order
    for n, x in t.items():
        assert up.tensors[n].dtype == np.float16 and up.tensors[n].shape == x.shape
    if codec != "auto":
        for n, x in t.items():
            np.testing.assert_allclose(up.tensors[n], x, atol=float(np.abs(x).max()) / 100 + 1e-6)


def test_the_digest_saves_the_names_and_shapes() -> None:
    t = mlp_delta()
    by_names = len(encode(t, layout="names", k=1))
    by_digest = len(encode(t, k=1))
    names = sum(len(n) for n in SHAPES)
    # each tensor's name and its length, dtype, ndim and dims (2-3 varint bytes), less digest and dtype
    assert by_names - by_digest >= names + 6 * 4 - 9, (by_names, by_digest)
    assert layout_digest([("b", (2,)), ("a", (3, 1))]) == layout_digest([("a", (3, 1)), ("b", (2,))])
    assert layout_digest([("a", (3, 1))]) != layout_digest([("a", (1, 3))])
    assert layout_digest([("a", (3,))]) != layout_digest([("a3", ())])


def test_error_feedback_is_kept_per_name_whatever_the_order() -> None:
    state = ErrorFeedback()
    t = mlp_delta()
    up = decode_update(encode(t, state=state, ratio=0.05, bits=2), expected_shapes=SHAPES)
    for n, x in t.items():
        np.testing.assert_allclose(up.tensors[n].reshape(-1) + state.get(n), x.reshape(-1), atol=1e-6)


def test_without_the_model_it_is_refused_not_guessed() -> None:
    reason, message = refused(encode(mlp_delta(), k=1))
    assert reason == "shape_mismatch" and "expected_shapes" in message


@pytest.mark.parametrize("shapes", [
    {**SHAPES, "fc2.bias": (11,)},
    {k: v for k, v in SHAPES.items() if k != "fc2.bias"},
    {**SHAPES, "extra": (1,)},
    {("x" + k): v for k, v in SHAPES.items()},
])
def test_another_model_is_a_shape_mismatch(shapes) -> None:
    reason, message = refused(encode(mlp_delta(), k=1), verifier=RING, expected_shapes=shapes)
    assert reason == "shape_mismatch" and "another model layout" in message


def test_mixed_dtypes_and_bad_options_are_one_line() -> None:
    t = {"a": np.ones(4, np.float32), "b": np.ones(4, np.float16)}
    with pytest.raises(CodecError, match="mixes dtypes"):
        encode(t, k=1)
    with pytest.raises(CodecError, match="layout must be 'names' or 'digest'"):
        encode(mlp_delta(), layout="short")
    with pytest.raises(CodecError, match="unknown option"):
        encode(mlp_delta(), codec="int8")


def test_a_signature_does_not_verify_across_versions() -> None:
    data = bytearray(encode(mlp_delta(), k=1))
    data[4] = 2  # claim version 2: parsed with a different layout, and the context differs
    crc_at = len(data) - 72 - 4
    data[crc_at : crc_at + 4] = struct.pack("<I", zlib.crc32(bytes(data[:crc_at])))
    reason, _ = refused(bytes(data), verifier=RING, expected_shapes=SHAPES)
    assert reason in ("bad_signature", "malformed", "truncated")


def test_every_truncation_and_byte_flip_is_refused_or_finite() -> None:
    valid = encode(mlp_delta(), signer=None, ratio=0.02, bits=2)
    for cut in range(len(valid)):
        with pytest.raises(CodecError):
            decode_update(valid[:cut], expected_shapes=SHAPES, stats=RejectStats())
    for pos in range(len(valid) - 4):
        for bit in (0, 7):
            data = bytearray(valid)
            data[pos] ^= 1 << bit
            body = bytes(data[:-4])
            try:
                up = decode_update(body + struct.pack("<I", zlib.crc32(body)), expected_shapes=SHAPES,
                                   stats=RejectStats())
            except CodecError:
                continue
            assert all(np.isfinite(v).all() for v in up.tensors.values())


# ------------------------------------------------------------------ hand-built hostile headers

W = {"w": (4,)}


def v3(*, digest: bytes | None = None, dtype: bytes = b"\x02", count: bytes = b"\x01", lengths: bytes = b"\x10",
       body: bytes = b"\0" * 16, header_len: bytes | None = None, tail: bytes = b"", extra: bytes = b"") -> bytes:
    """A version-3 dense envelope (codec 1) of one tensor "w" of 4 values, every field overridable."""
    header = (b"\x01\x01\x03evl\x00" + (layout_digest(list(W.items())) if digest is None else digest) + dtype
              + count + lengths + extra)
    data = b"EFUP" + bytes((3, 0, 1)) + (varint(len(header)) if header_len is None else header_len) + header + body
    return data + struct.pack("<I", zlib.crc32(data)) + tail


def test_the_hand_built_envelope_is_valid() -> None:
    up = decode_update(v3(), expected_shapes=W)
    assert up.device_id == "evl" and up.tensors["w"].shape == (4,) and not up.tensors["w"].any()


@pytest.mark.parametrize(("kw", "shapes", "reason", "match"), [
    ({"dtype": b"\x09"}, W, "malformed", "unknown dtype code 9"),
    ({"count": varint(70_000)}, W, "malformed", "70000 tensors"),
    ({"count": b"\x02"}, W, "malformed", "header ends inside"),
    ({"count": b"\x02", "lengths": b"\x10\x00"}, W, "shape_mismatch", "2 tensors"),
    ({"count": b"\x00", "lengths": b""}, W, "shape_mismatch", "0 tensors"),
    ({"lengths": varint(1 << 40)}, W, "truncated", "ends inside"),
    ({"lengths": b"\x80" * 11}, W, "malformed", "varint longer than 10 bytes"),
    ({"extra": b"\0"}, W, "malformed", "unexplained trailing bytes"),
    ({"digest": b"\0" * 8}, W, "shape_mismatch", "another model layout"),
    ({"digest": b"\0" * 3, "dtype": b"", "count": b"", "lengths": b""}, W, "malformed", "header ends inside"),
    ({"header_len": varint(10_000)}, W, "truncated", "header alone claims"),
    ({"tail": b"\0"}, W, "malformed", "bytes after its declared end"),
    ({"body": b"\0" * 15}, W, "truncated", "header declares"),
    ({"body": b"\0" * 12 + struct.pack("<f", float("nan"))}, W, "non_finite", ""),
    ({"digest": layout_digest([("w", (1 << 20, 1 << 20))])}, {"w": (1 << 20, 1 << 20)}, "too_large",
     "refused before allocating"),
])
def test_hostile_v3_headers_are_refused_with_a_reason(kw, shapes, reason: str, match: str) -> None:
    got, message = refused(v3(**kw), expected_shapes=shapes, max_elements=1 << 30)
    assert got == reason, message
    assert match in message


def test_peek_without_the_model_still_bounds_the_sections() -> None:
    head = peek_update(v3())
    assert head.section_lengths == (16,) and head.total_size == len(v3())
    for kw in ({"lengths": varint(1 << 40)}, {"body": b"\0" * 15}, {"tail": b"\0"}):
        with pytest.raises(CodecError):
            peek_update(v3(**kw))


def test_the_gateways_rulebook_takes_it_with_the_model_and_refuses_forgeries_and_replays() -> None:
    # gateway/intake.check_update: the round's weights name the layout; a forged signature, a replay and a
    # check without the model (an ingestion worker rebuilding from the store) are refused, never guessed
    from edgeflow.signing import ReplayGuard
    from gateway.intake import RoundView, check_update

    like = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    rnd = RoundView(5, 4, frozenset({"pi-7"}))
    data = encode(mlp_delta(), ratio=0.05, bits=2)
    guard = ReplayGuard()
    got = check_update(data, rnd, keyring=RING, like=like, seq_floor=None, replay_guard=guard)
    assert sorted(got.tensors) == sorted(SHAPES) and got.tensors["fc0.weight"].shape == (64, 64)
    with pytest.raises(CodecError) as err:
        check_update(data, rnd, keyring=RING, like=like, seq_floor=None, replay_guard=guard)
    assert err.value.reason == "replay"  # type: ignore[attr-defined]
    with pytest.raises(CodecError) as err:
        check_update(data, rnd, keyring=RING, like=like, seq_floor=9)
    assert err.value.reason == "replay"  # type: ignore[attr-defined]
    other = Signer.generate("pi-7")  # same device id, not its registered key
    forged = encode(mlp_delta(), ratio=0.05, bits=2, signer=other, seq=10)
    with pytest.raises(CodecError) as err:
        check_update(forged, rnd, keyring=RING, like=like, seq_floor=None)
    assert err.value.reason in ("wrong_key", "bad_signature")  # type: ignore[attr-defined]
    with pytest.raises(CodecError) as err:
        check_update(encode(mlp_delta(), k=1, seq=11), rnd, keyring=RING, like=None, seq_floor=None)
    assert err.value.reason == "shape_mismatch"  # type: ignore[attr-defined]


@pytest.mark.parametrize("budget", [250, 400, 600])
def test_auto_budget_counts_the_smaller_envelope_and_is_never_exceeded(budget: int) -> None:
    t = mlp_delta()
    by_digest = encode(t, "auto", budget=budget)
    assert len(by_digest) <= budget and peek_update(by_digest).version == 3
    entries = np.count_nonzero(np.concatenate([v.ravel() for v in decode_update(
        by_digest, expected_shapes=SHAPES).tensors.values()]))
    if budget >= 300:  # names fit too: the digest leaves room for more entries
        by_names = encode(t, "auto", layout="names", budget=budget)
        assert len(by_names) <= budget
        fewer = np.count_nonzero(np.concatenate([v.ravel() for v in decode_update(by_names).tensors.values()]))
        assert entries > fewer
    else:
        with pytest.raises(CodecError, match="raise budget to at least"):
            encode(t, "auto", layout="names", budget=budget)
