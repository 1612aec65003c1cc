"""Update codecs and the envelope: round trips, compression, unbiasedness, error feedback, and bad input."""

from __future__ import annotations

import ast
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeflow.codecs as codecs
from edgeflow.codecs import (
    ErrorFeedback,
    RejectStats,
    available_codecs,
    decode_update,
    encode_update,
    get_codec,
    peek_update,
)
from edgeflow.errors import CodecError, SignatureError
from edgeflow.signing import KeyRing, ReplayGuard, Signer

ALL = ["dense", "fp16", "int8", "topk", "topk-int8", "topk-packed", "randk-packed"]


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": (rng.standard_normal((8, 3, 3, 3)) * 0.1).astype(np.float32),
        "conv.bias": (rng.standard_normal(8) * 0.01).astype(np.float32),
        "fc.weight": (rng.standard_normal((10, 300)) * 0.05).astype(np.float32),
        "scalar": np.array(0.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def encode(tensors=None, codec="int8", **kw):
    kw.setdefault("round_id", 3)
    kw.setdefault("device_id", "pi-7")
    kw.setdefault("seq", 1)
    kw.setdefault("rng", 0)
    return encode_update(model() if tensors is None else tensors, codec, **kw)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    n = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / n if n else float(np.linalg.norm(a))


def test_registry_has_every_codec() -> None:
    assert available_codecs() == [*ALL, "auto"]  # auto picks one of them per update (test_codec_auto.py)
    assert [get_codec(n).codec_id for n in ALL] == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(CodecError, match="unknown codec 'zip'.*available codecs: dense"):
        get_codec("zip")


@pytest.mark.parametrize("codec", ALL)
def test_round_trip_keeps_names_shapes_dtypes_and_header(codec: str) -> None:
    tensors = model()
    opts = {"ratio": 1.0} if codec.startswith("topk") else {"ratio": 1.0, "bits": 8} if codec == "randk-packed" else {}
    data = encode(tensors, codec, metadata={"loss": 0.25}, num_samples=640, **opts)
    up = decode_update(data)
    assert (up.round_id, up.device_id, up.seq, up.codec) == (3, "pi-7", 1, codec)
    assert up.metadata == {"loss": 0.25, "num_samples": 640} and up.num_samples == 640
    assert list(up.tensors) == list(tensors)
    for name, x in tensors.items():
        y = up.tensors[name]
        assert y.shape == x.shape and y.dtype == x.dtype
        assert y.flags.writeable
        tol = {"dense": 0, "fp16": 1e-3, "int8": 0.02, "topk": 0, "topk-int8": 0.02, "topk-packed": 0.25,
               "randk-packed": 0.02}[codec]
        assert rel_err(y, x) <= tol, name


def test_dense_is_exact_and_dtypes_are_restored() -> None:
    rng = np.random.default_rng(1)
    t = {"a": rng.standard_normal(100).astype(np.float64), "b": rng.standard_normal(7).astype(np.float16)}
    up = decode_update(encode(t, "dense"))
    assert up.tensors["a"].dtype == np.float64 and up.tensors["b"].dtype == np.float16
    np.testing.assert_array_equal(up.tensors["b"], t["b"])
    np.testing.assert_allclose(up.tensors["a"], t["a"].astype(np.float32), rtol=0)


def test_compression_ratios_on_a_large_tensor() -> None:
    x = {"w": np.random.default_rng(0).standard_normal(200_000).astype(np.float32)}
    size = {c: len(encode(x, c)) for c in ALL}
    assert size["fp16"] / size["dense"] <= 0.51
    assert size["int8"] / size["dense"] <= 0.26
    assert size["topk"] / size["dense"] <= 0.021  # 1% of entries, index + fp32 value each
    assert size["topk-int8"] / size["dense"] <= 0.02


def test_int8_stochastic_rounding_is_unbiased() -> None:
    # A value a third of the way between two quantization levels: round-to-nearest would
    # always round down (bias -1/3 step); stochastic rounding is right on average.
    x = np.full(50_000, 1.0 / 3.0, dtype=np.float32)
    x[0] = 1.0  # sets the scale to 1/127, so every other entry sits at 42.333 steps
    y = decode_update(encode({"x": x}, "int8")).tensors["x"]
    step = 1.0 / 127
    mean = float(y[1:].mean())
    assert abs(mean - 1.0 / 3.0) < 0.02 * step, mean
    assert set(np.round(np.unique(y[1:]) / step).astype(int)) == {42, 43}
    assert abs(float((np.round(y[1:] / step) == 43).mean()) - 1.0 / 3.0) < 0.02


def test_int8_is_reproducible_with_a_seed_and_random_without() -> None:
    t = model()
    assert encode(t, "int8", rng=7) == encode(t, "int8", rng=7)
    assert encode(t, "int8", rng=np.random.default_rng(7)) == encode(t, "int8", rng=7)
    assert encode(t, "int8", rng=None) != encode(t, "int8", rng=None)


def test_all_zero_and_tiny_tensors_quantize_safely() -> None:
    t = {"z": np.zeros(10, np.float32), "tiny": np.full(4, 1e-42, np.float32)}
    up = decode_update(encode(t, "int8"))
    assert not up.tensors["z"].any()
    assert np.all(np.isfinite(up.tensors["tiny"]))


@pytest.mark.parametrize("codec", ["topk", "topk-int8"])
def test_topk_error_feedback_transmits_everything_eventually(codec: str) -> None:
    rng = np.random.default_rng(3)
    g = (rng.standard_normal(2000) * 0.01).astype(np.float32)
    state = ErrorFeedback()
    sent = np.zeros_like(g)
    rounds = 60
    for r in range(rounds):
        up = decode_update(encode({"g": g}, codec, round_id=r, seq=r, state=state, ratio=0.05, rng=r))
        sent += up.tensors["g"]
        assert np.count_nonzero(up.tensors["g"]) <= 100
    # invariant: what was sent plus what is still pending equals everything that was fed in
    residual = state.residual("g", g.size)
    assert residual is not None
    np.testing.assert_allclose(sent + residual, rounds * g, rtol=1e-4, atol=1e-5)
    # the backlog stays bounded (it does not grow with the rounds), so the sent share tends to 1;
    # without feedback 95% of the coordinates are never sent at all
    assert float(np.linalg.norm(residual)) < 10 * float(np.linalg.norm(g))
    assert rel_err(sent, rounds * g) < 0.2
    plain = decode_update(encode({"g": g}, codec, ratio=0.05)).tensors["g"] * rounds
    assert rel_err(plain, rounds * g) > 0.5


def test_topk_k_option_and_option_errors() -> None:
    x = {"w": np.arange(1, 101, dtype=np.float32)}
    up = decode_update(encode(x, "topk", k=3))
    assert np.flatnonzero(up.tensors["w"]).tolist() == [97, 98, 99]
    with pytest.raises(CodecError, match="unknown option.*ratoi.*valid options: ratio, k"):
        encode(x, "topk", ratoi=0.1)
    with pytest.raises(CodecError, match="either ratio or k"):
        encode(x, "topk", ratio=0.1, k=2)
    with pytest.raises(CodecError, match="ratio must be in"):
        encode(x, "topk", ratio=0)
    with pytest.raises(CodecError, match="unknown option"):
        encode(x, "int8", ratio=0.1)


def test_failed_encode_leaves_the_feedback_state_untouched() -> None:
    state = ErrorFeedback()
    encode({"a": np.ones(100, np.float32)}, "topk", state=state, ratio=0.1)
    before = state.residual("a", 100).copy()  # type: ignore[union-attr]
    bad = {"a": np.ones(100, np.float32), "b": np.array([1.0, np.nan], np.float32)}
    with pytest.raises(CodecError, match="NaN/Inf") as err:
        encode(bad, "topk", state=state, ratio=0.1)
    assert err.value.reason == "non_finite"  # type: ignore[attr-defined]
    np.testing.assert_array_equal(state.residual("a", 100), before)
    assert "b" not in state


def test_feedback_state_persists_without_pickle(tmp_path: Path) -> None:
    state = ErrorFeedback()
    encode(model(), "topk-int8", state=state, ratio=0.1)
    path = state.save(tmp_path / "residual.npz")
    loaded = ErrorFeedback.load(path)
    assert loaded.names() == state.names()
    for n in state.names():
        np.testing.assert_array_equal(loaded.get(n), state.get(n))
    assert loaded.norm() == pytest.approx(state.norm())
    # a residual whose size no longer matches the tensor is dropped, not misapplied
    assert loaded.residual("fc.weight", 7) is None and "fc.weight" not in loaded


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"a": np.array([1, 2])}, "only float tensors"),
        ({"": np.zeros(2, np.float32)}, "non-empty strings"),
        ({"a": np.array([np.inf], np.float32)}, "NaN/Inf"),
        ({"a": np.array([1e39])}, "NaN/Inf"),  # float64 that overflows float32
    ],
)
def test_encode_rejects_bad_tensors(tensors, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode(tensors, "dense")


def test_fp16_range_error_says_what_to_use() -> None:
    with pytest.raises(CodecError, match="exceed the fp16 range.*'dense' or 'int8'"):
        encode({"a": np.array([1e5], np.float32)}, "fp16")


def test_encode_rejects_bad_header_fields() -> None:
    with pytest.raises(CodecError, match="round_id"):
        encode(round_id=-1)
    with pytest.raises(CodecError, match="device_id"):
        encode(device_id="")
    with pytest.raises(CodecError, match="JSON"):
        encode(metadata={"x": object()})
    with pytest.raises(CodecError, match="signer belongs to device"):
        encode(signer=Signer.generate("other"))


# ----------------------------------------------------------------- signing


@pytest.fixture
def signer() -> Signer:
    return Signer.generate("pi-7")


@pytest.fixture
def ring(signer: Signer) -> KeyRing:
    return KeyRing({"pi-7": signer.public_key})


@pytest.mark.parametrize("codec", ALL)
def test_signed_round_trip(codec: str, signer: Signer, ring: KeyRing) -> None:
    up = decode_update(encode(codec=codec, signer=signer), verifier=ring, replay_guard=ReplayGuard())
    assert up.signed_by == signer.key_id.hex()


def _reason(fn) -> str:
    with pytest.raises(CodecError) as err:
        fn()
    return err.value.reason  # type: ignore[attr-defined]


def test_signature_failures(signer: Signer, ring: KeyRing) -> None:
    data = encode(signer=signer)
    tampered = bytearray(data)
    tampered[-80] ^= 1  # inside the body: the CRC would catch it, so fix the CRC up like an attacker would
    crc_at = len(data) - 4 - 72
    tampered[crc_at : crc_at + 4] = struct.pack("<I", zlib.crc32(bytes(tampered[:crc_at])))
    assert _reason(lambda: decode_update(bytes(tampered), verifier=ring)) == "bad_signature"
    assert _reason(lambda: decode_update(encode(), verifier=ring)) == "unsigned"
    assert _reason(lambda: decode_update(encode(), require_signature=True)) == "unsigned"
    impostor = Signer.generate("pi-7")
    assert _reason(lambda: decode_update(encode(signer=impostor), verifier=ring)) == "wrong_key"
    stranger = Signer.generate("pi-9")
    assert _reason(lambda: decode_update(encode(device_id="pi-9", signer=stranger), verifier=ring)) == "unknown_device"
    with pytest.raises(SignatureError, match="no public key registered for device 'pi-9'"):
        decode_update(encode(device_id="pi-9", signer=stranger), verifier=ring)


def test_replay_is_rejected_after_everything_else_passed(signer: Signer, ring: KeyRing) -> None:
    guard = ReplayGuard()
    data = encode(signer=signer, seq=5)
    decode_update(data, verifier=ring, replay_guard=guard)
    with pytest.raises(SignatureError, match="replayed update") as err:
        decode_update(data, verifier=ring, replay_guard=guard)
    assert err.value.reason == "replay"  # type: ignore[attr-defined]
    # a rejected envelope records nothing: the same (round, seq) in a bad envelope, then a good one
    bad = encode(signer=signer, seq=6, tensors={"fc.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(CodecError):
        decode_update(bad, verifier=ring, replay_guard=guard, expected_shapes={k: v.shape for k, v in model().items()})
    decode_update(encode(signer=signer, seq=6), verifier=ring, replay_guard=guard)


# ---------------------------------------------------------------- bad input


def test_each_rejection_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    stats = RejectStats()
    good = encode()
    bad_inputs = {
        "oversized": (good, {"max_bytes": 100}),
        "truncated": (good[:-10], {}),
        "bad_magic": (b"NOPE" + good[4:], {}),
        "unsupported_version": (good[:4] + b"\x09" + good[5:], {}),
        "unknown_codec": (good[:6] + b"\x63" + good[7:], {}),
        "checksum": (good[:-1] + bytes([good[-1] ^ 0xFF]), {}),
        "shape_mismatch": (good, {"expected_shapes": {"conv.weight": (8, 3, 3, 3)}}),
        "too_large": (good, {"max_elements": 100}),
    }
    for reason, (data, kw) in bad_inputs.items():
        with pytest.raises(CodecError) as err:
            decode_update(data, stats=stats, source="edgeflow/lab/pi-7/update", **kw)
        assert err.value.reason == reason, (reason, str(err.value))  # type: ignore[attr-defined]
    assert stats.snapshot() == dict.fromkeys(bad_inputs, 1)
    assert "edgeflow/lab/pi-7/update" in caplog.text and "rejected update" in caplog.text


def test_global_counters_are_used_by_default() -> None:
    before = codecs.rejections.count("bad_magic")
    with pytest.raises(CodecError):
        decode_update(b"\0" * 64)
    assert codecs.rejections.count("bad_magic") == before + 1


def _with_valid_crc(data: bytearray) -> bytes:
    crc_at = len(data) - 4
    data[crc_at:] = struct.pack("<I", zlib.crc32(bytes(data[:crc_at])))
    return bytes(data)


def test_nan_in_a_well_formed_envelope_is_rejected() -> None:
    data = bytearray(encode({"a": np.ones(4, np.float32)}, "dense"))
    spec = peek_update(bytes(data)).tensors[0]
    data[spec.offset : spec.offset + 4] = struct.pack("<f", float("nan"))
    with pytest.raises(CodecError, match="NaN/Inf") as err:
        decode_update(_with_valid_crc(data))
    assert err.value.reason == "non_finite"  # type: ignore[attr-defined]


def test_a_header_claiming_a_huge_tensor_is_refused_before_allocation() -> None:
    data = bytearray(encode({"a": np.ones(4, np.float32)}, "dense"))
    spec = peek_update(bytes(data)).tensors[0]
    # the dims sit just before the body; claim 10**12 elements
    dims_at = data.index(struct.pack("<Q", 4), 12)
    data[dims_at : dims_at + 8] = struct.pack("<Q", 10**12)
    assert spec.size == 4
    with pytest.raises(CodecError) as err:
        decode_update(_with_valid_crc(data))
    assert err.value.reason == "too_large"  # type: ignore[attr-defined]


def test_corrupt_sparse_indices_are_rejected() -> None:
    data = bytearray(encode({"a": np.arange(1, 101, dtype=np.float32)}, "topk", k=3))
    spec = peek_update(bytes(data)).tensors[0]
    idx_at = spec.offset + 8
    data[idx_at : idx_at + 2] = struct.pack("<H", 500)  # index beyond the tensor
    with pytest.raises(CodecError, match="strictly increasing"):
        decode_update(_with_valid_crc(data))


def test_peek_reads_the_header_only() -> None:
    h = peek_update(encode(round_id=9, seq=4))
    assert (h.round_id, h.seq, h.device_id, get_codec("int8").codec_id) == (9, 4, "pi-7", h.codec_id)
    assert [t.name for t in h.tensors] == list(model())


# ------------------------------------------------------------------ fuzzing

_VALID = {c: encode(codec=c, signer=None, **({"ratio": 0.2} if "k" in c.split("-")[0] else {})) for c in ALL}
_SIGNER = Signer.generate("pi-7")
_RING = KeyRing({"pi-7": _SIGNER.public_key})
_SIGNED = encode(codec="topk-int8", signer=_SIGNER, ratio=0.2)


def _decode_only_codec_errors(data: bytes, **kw) -> None:
    guard = ReplayGuard()
    try:
        up = decode_update(data, stats=RejectStats(), replay_guard=guard, **kw)
    except CodecError:
        assert len(guard) == 0, "a rejected envelope must not touch the replay guard"
        return
    for arr in up.tensors.values():
        assert np.all(np.isfinite(arr))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_only_codec_errors(data)
    _decode_only_codec_errors(codecs.MAGIC + b"\x01" + data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ALL), st.data())
def test_fuzz_truncation(codec: str, draw: st.DataObject) -> None:
    valid = _VALID[codec]
    cut = draw.draw(st.integers(min_value=0, max_value=len(valid) - 1))
    with pytest.raises(CodecError):
        decode_update(valid[:cut], stats=RejectStats())


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from(ALL), st.data())
def test_fuzz_bit_flips(codec: str, draw: st.DataObject) -> None:
    data = bytearray(_VALID[codec])
    for _ in range(draw.draw(st.integers(min_value=1, max_value=4))):
        pos = draw.draw(st.integers(min_value=0, max_value=len(data) - 1))
        data[pos] ^= 1 << draw.draw(st.integers(min_value=0, max_value=7))
    fix_crc = draw.draw(st.booleans())  # also let flips get past the CRC, into the codec parsers
    raw = _with_valid_crc(data) if fix_crc else bytes(data)
    _decode_only_codec_errors(raw)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fuzz_signed_envelopes_never_verify_after_a_flip(draw: st.DataObject) -> None:
    data = bytearray(_SIGNED)
    pos = draw.draw(st.integers(min_value=0, max_value=len(data) - 1))
    data[pos] ^= 1 << draw.draw(st.integers(min_value=0, max_value=7))
    with pytest.raises(CodecError):
        decode_update(bytes(data), verifier=_RING, stats=RejectStats())


def test_no_pickle_anywhere_in_codecs_or_transport() -> None:
    root = Path(codecs.__file__).parent.parent
    files = list((root / "codecs").glob("*.py")) + list((root / "transport").glob("*.py")) + [root / "signing.py"]
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n and n.split(".")[0] in {"pickle", "marshal", "shelve", "dill"} for n in names), path
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                assert isinstance(node.value, ast.Constant) and node.value.value is False, path
