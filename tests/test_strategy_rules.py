"""Issue 29's strategy rules: Bulyan, Flower's FedAdam bias correction, every strategy's state saved and
restored exactly (and a hostile state refused), the one per-update bound shared by FedAvg and the tests."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.errors import AggregationError, ConfigError, StateError
from edgeflow.gateway.aggregate import bound_update, bulyan, global_norm, next_reference, robust_median
from edgeflow.gateway.aggregation import decode_state, encode_state
from edgeflow.gateway.privacy import CentralDP
from edgeflow.gateway.strategies import FedAvg, available_aggregators, make_aggregator


def _g():
    return {"w": np.zeros((5, 3), np.float32), "b": np.zeros(3, np.float32)}


def _ups(rng, n, scale=0.1):
    return [{k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in _g().items()} for _ in range(n)]


# -- Bulyan ---------------------------------------------------------------------------


def _bulyan_reference(x: np.ndarray, f: int) -> np.ndarray:
    """Bulyan written out directly from El Mhamdi et al. 2018, Algorithm 1, for the test."""
    n = len(x)
    remaining = list(range(n))
    chosen = []
    for _ in range(n - 2 * f):
        m = len(remaining)
        scores = []
        for i in remaining:
            d = sorted(float(np.sum((x[i] - x[j]) ** 2)) for j in remaining if j != i)
            scores.append(sum(d[:max(1, m - f - 2)]))
        best = remaining[int(np.argmin(scores))]
        chosen.append(best)
        remaining.remove(best)
    sel = x[sorted(chosen)]
    beta = len(chosen) - 2 * f
    out = np.empty(x.shape[1])
    for c in range(x.shape[1]):
        col = sel[:, c]
        med = np.median(col)
        out[c] = np.mean(sorted(col, key=lambda v: abs(v - med))[:beta])
    return out


def test_bulyan_matches_its_reference_and_excludes_attackers():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((11, 40)) * 0.1
    x[3] += 50.0  # a scaled attacker
    x[7] = -x[7] * 30  # a flipped one
    want = _bulyan_reference(x, 2)
    got, chosen = bulyan(x, 2)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert 3 not in chosen and 7 not in chosen
    assert np.abs(got).max() < 1.0  # the attackers moved nothing far


def test_bulyan_strategy_end_to_end_and_its_minimum():
    rng = np.random.default_rng(1)
    agg = make_aggregator("bulyan", num_byzantine=1)
    ups = _ups(rng, 7)
    ups[2] = {k: v * 1000 for k, v in ups[2].items()}
    agg.begin_round(_g(), 1)
    for i, u in enumerate(ups):
        agg.add(u, 10, client_id=f"c{i}")
    res = agg.finish()
    flat = np.stack([np.concatenate([u["w"].ravel(), u["b"].ravel()]).astype(np.float64) for u in ups])
    want = _bulyan_reference(flat, 1)
    got = np.concatenate([res.delta["w"].ravel(), res.delta["b"].ravel()])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert "c2" not in agg.selected_clients
    agg.begin_round(_g(), 2)
    for i, u in enumerate(ups[:6]):
        agg.add(u, 10, client_id=f"c{i}")
    with pytest.raises(AggregationError, match="at least 7"):
        agg.finish()
    assert "bulyan" in available_aggregators()
    with pytest.raises(ConfigError):
        make_aggregator("bulyan", num_byzantine=-1)


# -- FedAdam: Flower's bias correction ------------------------------------------------


def _flower_fedadam(deltas, eta, b1, b2, tau):
    """Flower's FedAdam.aggregate_fit written out from its source (m, v from zeros; eta_norm with
    server_round + 1, rounds from 1) for one tensor."""
    m = np.zeros_like(deltas[0])
    v = np.zeros_like(deltas[0])
    w = np.zeros_like(deltas[0])
    for server_round, d in enumerate(deltas, start=1):
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d
        eta_norm = eta * np.sqrt(1 - np.power(b2, server_round + 1.0)) / (1 - np.power(b1, server_round + 1.0))
        w = w + eta_norm * m / (np.sqrt(v) + tau)
    return w


def test_fedadam_flower_bias_correction_steps_as_flower_does():
    rng = np.random.default_rng(2)
    deltas = [rng.standard_normal(6) * 0.1 for _ in range(4)]
    agg = make_aggregator("fedadam", eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3, bias_correction="flower",
                          clip="off", sample_multiplier="off")
    weights = {"w": np.zeros(6, np.float64)}
    for r, d in enumerate(deltas):
        agg.begin_round(weights, r + 1)
        agg.add({"w": d.copy()}, 1, client_id="a")
        weights = agg.finish().weights
    np.testing.assert_allclose(weights["w"], _flower_fedadam(deltas, 0.1, 0.9, 0.99, 1e-3), rtol=1e-12)
    # the default (Kingma & Ba, t from 1) is another step: the 4e-2 apart of the issue
    first = make_aggregator("fedadam", clip="off", sample_multiplier="off")
    first.begin_round({"w": np.zeros(6)}, 1)
    first.add({"w": deltas[0].copy()}, 1, client_id="a")
    assert not np.allclose(first.finish().weights["w"], _flower_fedadam(deltas[:1], 0.1, 0.9, 0.99, 1e-3))
    with pytest.raises(ConfigError):
        make_aggregator("fedadam", bias_correction="pytorch")


# -- state: saved and restored exactly, hostile states refused -------------------------------


SETTINGS = {
    "fedavg": {},
    "fedadam": {"eta": 0.05},
    "fedavgm": {"server_momentum": 0.9},
    "fedyogi": {"eta": 0.05},
    "fedadagrad": {"eta": 0.05},
    "median": {},
    "bulyan": {"num_byzantine": 0},
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_restored_strategy_continues_bit_for_bit(name):
    rng = np.random.default_rng(3)
    rounds = [_ups(rng, 6) for _ in range(5)]

    def run(agg, w, rs, r0):
        for r, ups in enumerate(rs):
            agg.begin_round(w, r0 + r)
            for i, u in enumerate(ups):
                agg.add(u, 10 + i, client_id=f"c{i}")
            w = agg.finish().weights
        return w

    plain = make_aggregator(name, **SETTINGS[name])
    w_plain = run(plain, _g(), rounds, 1)
    first = make_aggregator(name, **SETTINGS[name])
    w_mid = run(first, _g(), rounds[:2], 1)
    blob = encode_state(first.state_dict())
    resumed = make_aggregator(name, **SETTINGS[name])
    resumed.load_state_dict(decode_state(blob))
    w_resumed = run(resumed, w_mid, rounds[2:], 3)
    for k in w_plain:
        np.testing.assert_array_equal(w_resumed[k], w_plain[k])
    if name != "fedavg" and name not in ("median", "bulyan"):  # a fresh strategy would step differently
        fresh = make_aggregator(name, **SETTINGS[name])
        w_fresh = run(fresh, w_mid, rounds[2:], 3)
        assert any(not np.array_equal(w_fresh[k], w_plain[k]) for k in w_plain)


def test_central_dp_state_carries_the_accountant_and_the_noise():
    def make():
        return FedAvg(privacy=CentralDP(clip_norm=1.0, noise_multiplier=1.0, seed=11))

    rng = np.random.default_rng(4)
    rounds = [_ups(rng, 4) for _ in range(4)]
    plain, first = make(), make()
    results = {}
    for agg, rs in ((plain, rounds), (first, rounds[:2])):
        for r, ups in enumerate(rs):
            agg.begin_round(_g(), r)
            for i, u in enumerate(ups):
                agg.add(u, 5, client_id=f"c{i}")
            results[id(agg)] = agg.finish()
    last = results[id(plain)]
    resumed = make()
    resumed.load_state_dict(decode_state(encode_state(first.state_dict())))
    for r, ups in enumerate(rounds[2:], start=2):
        resumed.begin_round(_g(), r)
        for i, u in enumerate(ups):
            resumed.add(u, 5, client_id=f"c{i}")
        res = resumed.finish()
    assert res.metrics["dp_epsilon"] == last.metrics["dp_epsilon"] and res.metrics["dp_rounds"] == 4
    np.testing.assert_array_equal(res.delta["w"], last.delta["w"])


@pytest.mark.parametrize("mutate, match", [
    (lambda s: {**s, "strategy": "Median"}, "strategy state is of"),
    (lambda s: {**s, "reference": {"median_norm": float("nan"), "median_samples": 3}}, "reference"),
    (lambda s: {**s, "reference": {"median_norm": -1.0, "median_samples": 3}}, "reference"),
    (lambda s: {**s, "server_optimizer": {"t": -1, "state": {}}}, "field t"),
    (lambda s: {**s, "server_optimizer": {"t": 2, "state": {"zz": {}}}}, "field state"),
    (lambda s: {**s, "server_optimizer": {"t": 2, "state": {"m": {"w": np.array([np.inf])}}}}, "NaN or Inf"),
    (lambda s: {**s, "server_optimizer": {"t": 2, "state": {"v": {"w": np.array([-1.0])}}}}, ">= 0"),
    (lambda s: {**s, "server_optimizer": {"t": 2, "state": {"m": {"w": np.array(["x"])}}}}, "floating"),
    (lambda s: {k: v for k, v in s.items() if k != "server_optimizer"}, "server_optimizer"),
    (lambda s: {**s, "privacy": {}}, "privacy"),
])
def test_hostile_states_are_refused_and_change_nothing(mutate, match):
    agg = make_aggregator("fedadam")
    rng = np.random.default_rng(5)
    agg.begin_round(_g(), 1)
    for i, u in enumerate(_ups(rng, 6)):
        agg.add(u, 10, client_id=f"c{i}")
    agg.finish()
    before = agg.state_dict()
    with pytest.raises(StateError, match=match):
        agg.load_state_dict(mutate(agg.state_dict()))
    after = agg.state_dict()
    assert after["reference"] == before["reference"] and after["server_optimizer"]["t"] == before["server_optimizer"]["t"]


@pytest.mark.parametrize("blob", [b"", b"junk", encode_state({"x": 1})[:40]])
def test_a_damaged_state_blob_is_one_state_error(blob):
    with pytest.raises(StateError):
        decode_state(blob)


# -- the one per-update rule ------------------------------------------------------------


def test_bound_update_is_the_rule_fedavg_folds_with():
    rng = np.random.default_rng(6)
    ups = _ups(rng, 5)
    ups[1] = {k: v * 50 for k, v in ups[1].items()}
    ns = [10, 10, 500, 12, 9]
    agg = FedAvg()
    agg.set_reference({"median_norm": 0.5, "median_samples": 10})
    agg.begin_round(_g(), 1)
    for i, (u, n) in enumerate(zip(ups, ns)):
        agg.add(u, n, client_id=f"c{i}")
    res = agg.finish()
    bound, cap = agg_bounds = (0.75, 30.0)
    rows = [bound_update(global_norm(u), n, *agg_bounds) for u, n in zip(ups, ns)]
    want = sum(np.asarray(u["w"], np.float64) * r.weight for u, r in zip(ups, rows)) / sum(r.counted for r in rows)
    np.testing.assert_allclose(res.delta["w"], want, rtol=1e-5, atol=1e-7)
    assert res.metrics["clipped"] == sum(r.clipped for r in rows) == 1
    assert res.metrics["capped"] == sum(r.capped for r in rows) == 1
    assert bound == 0.75 and cap == 30.0


def test_robust_median_and_next_reference():
    assert robust_median([]) is None
    assert robust_median([1.0, 100.0]) == 1.0  # two values: the lower one
    assert robust_median([3.0, 1.0, 2.0]) == 2.0
    prev = {"median_norm": 1.0, "median_samples": 10.0}
    assert next_reference(prev, [50.0] * 2, [10] * 2, max_change=2.0, min_updates=3) == prev
    assert next_reference(prev, [50.0] * 3, [1] * 3, max_change=2.0, min_updates=3) == \
        {"median_norm": 2.0, "median_samples": 5.0}
    assert next_reference(None, [1.0, 9.0], [4, 8], max_change=2.0, min_updates=5) == \
        {"median_norm": 1.0, "median_samples": 4.0}
    with pytest.raises(ConfigError):
        next_reference(prev, [1.0], [1], max_change=0.5, min_updates=5)
