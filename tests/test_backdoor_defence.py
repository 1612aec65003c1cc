"""The backdoor defence's math (:func:`krum_bounded_mean`) and its strategy (``fedavg-krum``), fast and
without a fleet: against a reference written out here, with hostile inputs (a far poisoner, a long delta, a
huge claim, NaN/Inf, too few updates), through the public aggregator interface, and across a restart.
The fleet-level figures (clean accuracy, backdoor success, 3 seeds) are benchmarks/backdoor.py's,
checked by tests/test_backdoor_benchmark.py."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.errors import AggregationError, ConfigError
from edgeflow.gateway import make_aggregator
from edgeflow.gateway.aggregate import krum_bounded_mean
from edgeflow.gateway.aggregation import decode_state, encode_state


def _honest(n: int, p: int = 40, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(0.0, 1.0, (n, p)) * 0.1 + 0.05).astype(np.float32)


def _reference(stack, samples, f, clip_multiplier=1.5, sample_multiplier=3.0, sample_cap=None, weighted=True):
    """The rule written out the slow way: bounds from the round's lower medians, Krum by brute force."""
    x = np.asarray(stack, dtype=np.float64)
    s = np.asarray(samples, dtype=np.float64)
    n = len(x)
    norms = np.linalg.norm(x, axis=1)
    bound = clip_multiplier * np.sort(norms)[(n - 1) // 2]
    cap = max(1.0, np.floor(sample_multiplier * max(1.0, np.sort(s)[(n - 1) // 2])))
    if sample_cap is not None:
        cap = min(cap, sample_cap)
    y = x * np.minimum(1.0, bound / np.maximum(norms, 1e-300))[:, None]
    d = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)  # Krum on the updates as sent
    k = n - f - 2
    scores = [np.sort(np.delete(d[i], i))[:k].sum() for i in range(n)]
    chosen = sorted(np.argsort(scores, kind="stable")[: n - f])
    w = np.array([min(s[i], cap) if weighted else 1.0 for i in chosen])
    return (y[chosen] * w[:, None]).sum(0) / w.sum(), chosen


def test_krum_bounded_mean_matches_the_rule_written_out():
    x = _honest(9)
    samples = [120, 90, 200, 120, 60, 150, 120, 100, 130]
    for kw in ({}, {"weighted": False}, {"clip_multiplier": 1.0, "sample_multiplier": 1.0}, {"sample_cap": 100}):
        got = krum_bounded_mean(x, samples, 2, **kw)
        ref, chosen = _reference(x, samples, 2, **kw)
        assert list(got.chosen) == chosen
        np.testing.assert_allclose(got.mean, ref, rtol=1e-10, atol=1e-12)


def test_a_far_update_is_dropped_and_cannot_move_the_mean():
    x = _honest(10)
    poisoner = x.copy()
    poisoner[0] = -x[0] * 40.0  # far, long, opposite
    got = krum_bounded_mean(poisoner, [120] * 10, 1)
    assert 0 not in got.chosen
    np.testing.assert_allclose(got.mean, x[1:].astype(np.float64).mean(0), rtol=1e-6)  # the honest mean
    assert got.clipped == 1


def test_krum_chooses_on_the_updates_as_sent_so_a_long_delta_stays_marked():
    """A poisoner that trains on more data sends a longer delta; bounded first, it would look ordinary
    (the benchmark's seeds 4 and 5 let 64% and 9% of the backdoor through that way)."""
    x = _honest(10, seed=11).astype(np.float64)
    x[0] = x[1:].mean(0) * 6.0  # the fleet's direction, 6x as long: far as sent, central once bounded
    got = krum_bounded_mean(x, [120] * 10, 1)
    assert 0 not in got.chosen
    bounded_first = x.copy()
    bounded_first[0] *= got.norm_bound / np.linalg.norm(x[0])
    from edgeflow.gateway.aggregate import krum_select, pairwise_sq_distances

    assert 0 in krum_select(pairwise_sq_distances(list(bounded_first)), 1, 9)  # what the order guards against


def test_a_huge_claim_or_a_long_delta_of_a_chosen_update_buys_no_more_than_the_bounds():
    x = _honest(10)
    claims = [120] * 10
    claims[3] = 10**9
    got = krum_bounded_mean(x, claims, 1)
    assert got.capped == 1 and got.sample_cap == 360.0
    if 3 in got.chosen:  # its weight is at most 3x a median device's
        share = 360.0 / (360.0 + 120.0 * (len(got.chosen) - 1))
        assert share < 0.3
    longer = x.copy()
    longer[4] *= 2.6  # longer than the bound: 1.5x the median norm
    got = krum_bounded_mean(longer, [120] * 10, 0)  # f = 0: everything is chosen, only the bound acts
    norms = np.linalg.norm(longer.astype(np.float64), axis=1)
    assert got.clipped == 1
    expect = longer.astype(np.float64)
    expect[4] *= got.norm_bound / norms[4]
    np.testing.assert_allclose(got.mean, expect.mean(0), rtol=1e-10)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e200])
def test_non_finite_or_overflowing_updates_are_refused_naming_the_update(bad):
    x = _honest(6).astype(np.float64)
    x[2, 5] = bad  # 1e200: finite, but its square overflows float64 (no norm, no bound)
    with pytest.raises(AggregationError, match="update 2 holds NaN or Inf"):
        krum_bounded_mean(x, [10] * 6, 1)


@pytest.mark.parametrize("samples", [[10, 10, 10, 10, float("nan")], [10, 10, 0, 10, 10], [10, -5, 10, 10, 10],
                                     [10, 10, 10, 10], [10, 10, 10, 10, float("inf")]])
def test_bad_sample_counts_are_refused(samples):
    with pytest.raises(AggregationError, match="sample count"):
        krum_bounded_mean(_honest(5), samples, 1)


def test_too_few_updates_bad_settings_and_bad_shapes_are_refused():
    with pytest.raises(AggregationError, match="at least 5 updates, got 4"):
        krum_bounded_mean(_honest(4), [1] * 4, 1)
    with pytest.raises(ConfigError, match="num_byzantine"):
        krum_bounded_mean(_honest(5), [1] * 5, -1)
    with pytest.raises(ConfigError, match="clip_multiplier"):
        krum_bounded_mean(_honest(5), [1] * 5, 1, clip_multiplier=float("nan"))
    with pytest.raises(ConfigError, match="sample_multiplier"):
        krum_bounded_mean(_honest(5), [1] * 5, 1, sample_multiplier=0)
    with pytest.raises(AggregationError, match="2-D float array"):
        krum_bounded_mean(np.zeros((5, 2, 2)), [1] * 5, 1)
    with pytest.raises(AggregationError, match="2-D float array"):
        krum_bounded_mean(np.zeros((5, 4), dtype=np.int64), [1] * 5, 1)


def _round(agg, stack, samples, round_id=0):
    agg.begin_round({"w": np.zeros((stack.shape[1],), np.float32)}, round_id)
    for i, (row, n) in enumerate(zip(stack, samples)):
        agg.add({"w": row}, n, client_id=f"d{i}")
    return agg.finish()


def test_the_strategy_is_the_function_through_the_aggregator_interface():
    x = _honest(10, seed=3)
    x[7] = -x[7] * 30.0
    samples = [120, 100, 140, 120, 120, 80, 120, 10**6, 120, 90]
    agg = make_aggregator("fedavg-krum", num_byzantine=1, sample_cap=500)
    res = _round(agg, x, samples)
    ref = krum_bounded_mean(x, samples, 1, sample_cap=500)
    np.testing.assert_allclose(res.delta["w"], ref.mean, rtol=1e-6)
    assert "d7" not in agg.selected_clients and len(agg.selected_clients) == 9
    assert res.metrics["dropped"] == 1.0 and res.metrics["capped"] == 1.0 and res.metrics["sample_cap"] == 360.0


def test_the_strategy_rejects_a_nan_update_and_finishes_with_the_rest():
    x = _honest(6, seed=4)
    agg = make_aggregator("fedavg-krum", num_byzantine=1)
    agg.begin_round({"w": np.zeros((x.shape[1],), np.float32)}, 0)
    for i, row in enumerate(x):
        agg.add({"w": row}, 50, client_id=f"d{i}")
    hostile = x[0].copy()
    hostile[3] = np.nan
    agg.add({"w": hostile}, 50, client_id="evil")
    res = agg.finish()
    assert [r.client_id for r in res.rejected] == ["evil"]
    np.testing.assert_allclose(res.delta["w"], krum_bounded_mean(x, [50] * 6, 1).mean, rtol=1e-6)


def test_the_strategy_refuses_a_round_below_2f_plus_3_and_bad_settings():
    agg = make_aggregator("fedavg-krum", num_byzantine=2)
    with pytest.raises(AggregationError, match="at least 7 updates, got 6"):
        _round(agg, _honest(6), [10] * 6)
    for params in ({"num_byzantine": -1}, {"num_byzantine": True}, {"clip_multiplier": 0},
                   {"sample_cap": 0}, {"sample_multiplier": float("inf")}):
        with pytest.raises(ConfigError):
            make_aggregator("fedavg-krum", **params)


def test_the_strategy_state_survives_a_restart_and_refuses_another_strategys():
    """No cross-round state but a server optimizer's: a restarted gateway gives the same next round."""
    a = make_aggregator("fedavg-krum", num_byzantine=1)
    _round(a, _honest(7, seed=5), [20] * 7, 0)
    blob = encode_state(a.state_dict())
    b = make_aggregator("fedavg-krum", num_byzantine=1)
    b.load_state_dict(decode_state(blob))
    nxt = _honest(7, seed=6)
    np.testing.assert_array_equal(_round(a, nxt, [20] * 7, 1).delta["w"], _round(b, nxt, [20] * 7, 1).delta["w"])
    from edgeflow.errors import StateError

    with pytest.raises(StateError, match="configured strategy changed"):
        make_aggregator("multi-krum", num_byzantine=1).load_state_dict(decode_state(blob))


def test_the_round_configuration_refuses_fedavg_krum_below_its_update_count_and_under_secure_aggregation():
    from edgeflow.gateway.round_config import RoundConfig

    with pytest.raises(ConfigError, match="needs rounds of at least 5 updates: set min_clients >= 5"):
        RoundConfig(strategy="fedavg-krum", min_clients=2)
    with pytest.raises(ConfigError, match="at least 7 updates"):
        RoundConfig(strategy="fedavg_krum", strategy_params={"num_byzantine": 2}, min_clients=6)
    with pytest.raises(ConfigError, match="secagg reveals only the sum: strategy 'fedavg-krum' needs each update"):
        RoundConfig(strategy="fedavg-krum", min_clients=5, secagg={})
    assert RoundConfig(strategy="fedavg-krum", min_clients=5).min_clients == 5
