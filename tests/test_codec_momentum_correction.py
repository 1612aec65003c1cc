"""topk-packed's ``momentum`` option: DGC's momentum correction on the device (velocity, masking, state)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgeflow.codecs import ErrorFeedback, decode_update, encode_update
from edgeflow.errors import CodecError


def delta(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": (rng.standard_normal(400) * 0.05).astype(np.float32),
            "b": (rng.standard_normal(7) * 0.01).astype(np.float32)}


def encode(tensors, state=None, rng=0, **opts) -> bytes:
    return encode_update(tensors, "topk-packed", round_id=1, device_id="pi-7", seq=1, state=state, rng=rng, **opts)


def test_momentum_follows_dgc_round_by_round() -> None:
    # an oracle written from the paper's algorithm: u = m u + g; v = v + u; send top-k(v); v -= sent; u[sent] = 0
    m, state = 0.5, ErrorFeedback()
    u = {n: np.zeros(x.size) for n, x in delta(0).items()}
    v = {n: np.zeros(x.size) for n, x in delta(0).items()}
    for r in range(5):
        d = delta(r)
        got = decode_update(encode(d, state, rng=r, ratio=0.05, bits=8, momentum=m)).tensors
        for n, x in d.items():
            u[n] = m * u[n] + x.reshape(-1)
            v[n] = v[n] + u[n]
            sent = got[n].reshape(-1)
            idx = np.flatnonzero(sent)
            k = max(1, int(round(0.05 * x.size)))
            assert 0 < len(idx) <= k
            assert set(idx) <= set(np.argsort(-np.abs(v[n]))[:k])  # the k largest of v, not of this round's update
            v[n] = v[n] - sent
            u[n][idx] = 0.0
            stored = state.get(n)
            assert stored.size == 2 * x.size  # [residual, velocity]
            np.testing.assert_allclose(stored[:x.size], v[n], atol=1e-5)
            np.testing.assert_allclose(stored[x.size:], u[n], atol=1e-5)


def test_sent_plus_owed_accounts_for_every_velocity() -> None:
    # with momentum the device owes the sum of its velocities, not of its updates: sent + residual == sum of
    # u_t = m * (the stored, masked velocity) + update; and a sent entry's velocity is zeroed
    state, m = ErrorFeedback(), 0.7
    owed, sent_total, velocity = np.zeros(400), np.zeros(400), np.zeros(400)
    for r in range(6):
        d = delta(r)
        up = decode_update(encode(d, state, rng=r, ratio=0.1, bits=2, momentum=m)).tensors["w"].reshape(-1)
        owed += m * velocity + d["w"].reshape(-1)
        sent_total += up
        velocity = state.get("w")[400:].astype(np.float64)
        assert not velocity[np.flatnonzero(up)].any()
        np.testing.assert_allclose(sent_total + state.get("w")[:400], owed, atol=1e-5)


def test_momentum_zero_is_the_plain_codec_byte_for_byte() -> None:
    a, b = ErrorFeedback(), ErrorFeedback()
    for r in range(3):
        d = delta(r)
        assert encode(d, a, rng=r, ratio=0.05, bits=2) == encode(d, b, rng=r, ratio=0.05, bits=2, momentum=0.0)
    assert all(a.get(n).size == b.get(n).size == x.size for n, x in delta(0).items())
    np.testing.assert_array_equal(a.get("w"), b.get("w"))


def test_first_round_sends_what_the_plain_codec_sends() -> None:
    # u starts at zero, so round one's velocity is the update itself
    d = delta(3)
    assert encode(d, ErrorFeedback(), ratio=0.05, bits=4, momentum=0.9) == encode(d, ErrorFeedback(), ratio=0.05,
                                                                                   bits=4)


def test_switching_momentum_on_drops_the_old_residual_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    state = ErrorFeedback()
    encode(delta(0), state, ratio=0.05, bits=2)
    assert state.get("w").size == 400
    with caplog.at_level(logging.WARNING, logger="edgeflow.codecs"):
        encode(delta(1), state, ratio=0.05, bits=2, momentum=0.5)
    assert state.get("w").size == 800
    assert any("has 400 values but the tensor now has 800" in r.getMessage() for r in caplog.records)


def test_a_failed_encode_leaves_the_velocity_as_it_was() -> None:
    state = ErrorFeedback()
    encode(delta(0), state, ratio=0.05, momentum=0.5)
    before = {n: state.get(n).copy() for n in ("w", "b")}
    bad = delta(1)
    bad["b"][3] = np.nan
    with pytest.raises(CodecError):
        encode(bad, state, ratio=0.05, momentum=0.5)
    for n, arr in before.items():
        np.testing.assert_array_equal(state.get(n), arr)


def test_the_state_with_velocity_survives_save_and_load(tmp_path) -> None:
    state = ErrorFeedback()
    for r in range(2):
        encode(delta(r), state, rng=r, ratio=0.05, momentum=0.5)
    loaded = ErrorFeedback.load(state.save(tmp_path / "fb.npz"))
    d = delta(2)
    assert encode(d, state, rng=2, ratio=0.05, momentum=0.5) == encode(d, loaded, rng=2, ratio=0.05, momentum=0.5)


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "0.5", float("nan")])
def test_a_bad_momentum_is_one_line_naming_the_range(bad) -> None:
    with pytest.raises(CodecError) as err:
        encode(delta(0), ErrorFeedback(), ratio=0.05, momentum=bad)
    msg = str(err.value)
    assert "momentum must be a number in [0, 1)" in msg and "\n" not in msg


def test_only_topk_packed_takes_momentum() -> None:
    with pytest.raises(CodecError, match="unknown option"):
        encode_update(delta(0), "topk-int8", round_id=1, device_id="d", seq=1, rng=0, ratio=0.05, momentum=0.5)
