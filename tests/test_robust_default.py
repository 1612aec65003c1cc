"""FedAvg's default norm bound and sample cap (docs/aggregation.md, "Default norm bound and sample cap").

The rule, checked against its pure-function reference :func:`bounded_mean`: each
update's norm is clipped to 1.5 x the reference median norm and its claimed sample
count capped at 3 x the reference median claim (and at ``sample_cap``); the
reference is the previous round's medians; a round without one warms up on its
first 3 updates. The gateway-level attacks are in tests/test_gateway_security.py.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from edgeflow.errors import ConfigError
from edgeflow.gateway.privacy import CentralDP, global_norm
from edgeflow.gateway.strategies import CLIP_MULTIPLIER, SAMPLE_MULTIPLIER, FedAvg, FedAdam, bounded_mean


def _g():
    return {"w": np.zeros((6, 4), np.float32), "b": np.zeros(4, np.float32)}


def _u(rng, scale=1.0):
    return {k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in _g().items()}


def _check(res, ups, ns, bound, cap):
    want = bounded_mean(ups, ns, bound, cap)
    for k in want:
        np.testing.assert_allclose(res.delta[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_defaults_are_the_documented_multipliers():
    assert (CLIP_MULTIPLIER, SAMPLE_MULTIPLIER) == (1.5, 3.0)
    a = FedAvg()
    assert a.clip == "adaptive" and a.clip_multiplier == 1.5 and a.sample_multiplier == 3.0 and a.robust


def test_a_reference_bounds_norms_and_claims():
    rng = np.random.default_rng(0)
    agg = FedAvg()
    agg.set_reference({"median_norm": 1.0, "median_samples": 10})
    agg.begin_round(_g(), 1)
    assert agg.round_bounds == (1.5, 30.0)
    ups = [_u(rng, 0.1), _u(rng, 0.1), _u(rng, 10.0), _u(rng, 0.1)]  # the third: a huge delta
    ns = [10, 12, 9, 10_000]  # the fourth: a huge claim
    for i, (u, n) in enumerate(zip(ups, ns)):
        agg.add(u, n, client_id=f"c{i}")
    res = agg.finish()
    _check(res, ups, ns, 1.5, 30)
    assert res.metrics["clipped"] >= 1 and res.metrics["capped"] == 1
    assert res.total_samples == 10 + 12 + 9 + 30  # what the mean was divided by
    # the next reference: the round's (lower) medians of the raw norms and claims, moved at most 2x
    norms = sorted(global_norm(u) for u in ups)
    want_norm = min(max(norms[1], 0.5), 2.0)
    assert agg.reference == {"median_norm": pytest.approx(want_norm), "median_samples": 10.0}


def test_the_first_round_warms_up_on_its_first_three_updates():
    rng = np.random.default_rng(1)
    agg = FedAvg()
    agg.begin_round(_g(), 1)
    ups = [_u(rng, s) for s in (0.1, 0.2, 0.15, 5.0, 0.1)]
    ns = [20, 30, 25, 40, 5000]
    for i, (u, n) in enumerate(zip(ups, ns)):
        agg.add(u, n, client_id=f"c{i}")
        assert (agg.round_bounds is None) == (i < 2)
    first = [global_norm(u) for u in ups[:3]]
    bound, cap = 1.5 * float(np.median(first)), float(math.floor(3 * np.median(ns[:3])))
    assert agg.round_bounds == (bound, cap)
    _check(agg.finish(), ups, ns, bound, cap)


def test_a_round_with_fewer_updates_than_the_warm_up_still_bounds_them():
    rng = np.random.default_rng(2)
    agg = FedAvg()
    agg.begin_round(_g(), 1)
    ups, ns = [_u(rng, 0.1), _u(rng, 3.0)], [10, 10]
    for i, (u, n) in enumerate(zip(ups, ns)):
        agg.add(u, n, client_id=f"c{i}")
    norms = [global_norm(u) for u in ups]
    # two updates: the lower middle value, not their mean (the larger of two may be hostile)
    _check(agg.finish(), ups, ns, 1.5 * min(norms), 30)


def test_the_reference_carries_over_and_can_be_restored_or_fixed():
    rng = np.random.default_rng(3)
    a = FedAvg()
    for r in range(2):
        a.begin_round(_g(), r)
        for i in range(4):
            a.add(_u(rng, 0.1), 10 + i, client_id=f"c{i}")
        a.finish()
    ref = a.reference
    b = FedAvg()
    b.set_reference(ref)  # what the gateway does at start (from the last closed round's metrics)
    a.begin_round(_g(), 3)
    b.begin_round(_g(), 3)
    assert a.round_bounds == b.round_bounds == (1.5 * ref["median_norm"], math.floor(3 * ref["median_samples"]))
    b.set_round_bounds(0.01, 5)  # a resumed round keeps the bounds it was opened with
    assert b.round_bounds == (0.01, 5)
    u = _u(rng, 1.0)
    b.add(u, 50, client_id="x")
    _check(b.finish(), [u], [50], 0.01, 5)
    b.begin_round(_g(), 4)  # a new round: from the reference again
    assert b.round_bounds[0] != 0.01
    with pytest.raises(ConfigError):
        b.set_reference({"median_norm": float("nan"), "median_samples": 1})


def test_off_is_the_plain_weighted_mean_and_sample_cap_alone_works():
    rng = np.random.default_rng(4)
    ups, ns = [_u(rng, s) for s in (0.1, 9.0, 0.1)], [10, 10, 900]
    plain = FedAvg(clip="off", sample_multiplier="off")
    capped = FedAvg(clip="off", sample_multiplier="off", sample_cap=20)
    fixed = FedAvg(clip=0.5, sample_multiplier=None)
    for agg in (plain, capped, fixed):
        agg.begin_round(_g(), 1)
        for i, (u, n) in enumerate(zip(ups, ns)):
            agg.add(u, n, client_id=f"c{i}")
    assert not plain.robust
    _check(plain.finish(), ups, ns, None, None)
    _check(capped.finish(), ups, ns, None, 20)
    _check(fixed.finish(), ups, ns, 0.5, None)


def test_server_optimizers_inherit_the_bound_and_central_dp_keeps_its_own():
    assert FedAdam().robust
    dp = FedAvg(privacy=CentralDP(clip_norm=1.0, noise_multiplier=0.0))
    assert not dp.robust  # DP clips to clip_norm and weighs every client 1


@pytest.mark.parametrize("kw", [{"clip": "bogus"}, {"clip": -1.0}, {"clip_multiplier": 0},
                                {"sample_multiplier": 0}, {"sample_cap": 0}, {"clip_warmup": 0}])
def test_bad_settings_are_config_errors(kw):
    with pytest.raises(ConfigError):
        FedAvg(**kw)


def test_the_gateway_caps_claims_at_max_samples_and_restores_the_reference(tmp_path):
    from edgeflow import zoo
    from edgeflow.protocol.rounds import TrainConfig
    from edgeflow.gateway.rounds import RoundConfig, RoundManager
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.signing import KeyRing, PrivateKey
    from edgeflow.transport import MqttTransport

    store = GatewayStore(tmp_path / "gw.sqlite")
    t = MqttTransport.from_url("mqtt://127.0.0.1:9", client_id="never-connected")
    kw = dict(fleet="f", fleet_key=PrivateKey.generate(), keyring=KeyRing(), model=zoo.digits_mlp(seed=1),
              candidates=list)
    rm = RoundManager(t, store, config=RoundConfig(train=TrainConfig(max_samples=40)), **kw)
    assert rm.strategy.sample_cap == 40  # a device told to train on at most 40 cannot claim more
    store.open_round(1, 1, time.time() + 60, {}, ["a"])
    store.finish_round(1, {"median_norm": 0.25, "median_samples": 12.0})
    rm = RoundManager(t, store, config=RoundConfig(), **kw)
    assert rm.strategy.reference == {"median_norm": 0.25, "median_samples": 12.0}
    store.close()


def test_a_two_update_round_cannot_take_the_bound_over():
    """Issue 29: rounds closing with 2 updates let one device set the next bound (it rose 732x). Now a
    round below reference_min_updates (3) leaves the reference as it was, and a full round moves it by at
    most reference_max_change (2x) per round."""
    rng = np.random.default_rng(5)
    agg = FedAvg()
    agg.set_reference({"median_norm": 1.0, "median_samples": 10})
    for r in range(20):  # an honest update and a huge one, every round
        agg.begin_round(_g(), r + 1)
        agg.add(_u(rng, 0.1), 10, client_id="honest")
        agg.add(_u(rng, 1e4), 10, client_id="attacker")
        agg.finish()
        assert agg.reference == {"median_norm": 1.0, "median_samples": 10.0}
    for r in range(3):  # 5 updates, 3 of them huge: the reference may move, at most 2x per round
        before = agg.reference["median_norm"]
        agg.begin_round(_g(), 100 + r)
        for i in range(5):
            agg.add(_u(rng, 1e4 if i < 3 else 0.1), 10, client_id=f"c{i}")
        agg.finish()
        assert agg.reference["median_norm"] == pytest.approx(2.0 * before)


def test_the_reference_follows_a_converging_fleet():
    """Honest norms that shrink 10x as training converges: the reference follows (within 2x a round)."""
    agg = FedAvg()
    agg.set_reference({"median_norm": 1.0, "median_samples": 10})
    rng = np.random.default_rng(6)
    for r in range(6):
        agg.begin_round(_g(), r + 1)
        for i in range(6):
            u = _u(rng)
            norm = global_norm(u)
            agg.add({k: v * np.float32(0.1 / norm) for k, v in u.items()}, 10, client_id=f"c{i}")
        agg.finish()
    assert agg.reference["median_norm"] == pytest.approx(0.1, rel=1e-3)
