"""``krum-reputation`` (docs/security.md section 14): fedavg-krum that drops the most suspicious device over
rounds (an exponential average of each device's Krum score / the round's median) and applies the mean with
server momentum. The math on hand-made updates with known answers, the strategy through the public aggregator
interface (history keeps a poisoner out of the round where an honest device is farther, small rounds, the
momentum), its stored state across a restart and hostile states. The fleet figures (3 and 6 seeds) are
benchmarks/backdoor.py's; tests/test_backdoor_benchmark.py reruns its quick form."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.errors import AggregationError, ConfigError, StateError
from edgeflow.gateway import make_aggregator
from edgeflow.gateway.aggregate import (krum_bounded_mean, krum_ratios, krum_scores, most_suspicious,
                                        pairwise_sq_distances, update_suspicion)
from edgeflow.gateway.aggregation import decode_state, encode_state


def _honest(n: int, p: int = 30, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 0.1, (n, p)) + 0.05


def test_suspicion_is_an_exponential_average_over_the_rounds_a_device_took_part_in():
    prev = {"a": 2.0, "gone": 5.0}
    got = update_suspicion(prev, ["a", "b", ""], [1.0, 3.0, 9.0], 0.7)
    assert got == {"a": pytest.approx(0.7 * 2.0 + 0.3 * 1.0), "b": 3.0, "gone": 5.0}  # new: its ratio; absent: kept
    assert prev == {"a": 2.0, "gone": 5.0}  # not changed in place
    assert update_suspicion({"a": 2.0}, ["a"], [4.0], 0.0) == {"a": 4.0}  # memory 0: this round alone
    assert update_suspicion({}, ["a"], [np.inf], 0.5) == {"a": 1e6}  # an identical-update round stays finite
    for memory in (1.0, -0.1, True, "0.5"):
        with pytest.raises(ConfigError, match="memory"):
            update_suspicion({}, ["a"], [1.0], memory)
    with pytest.raises(AggregationError, match="2 client ids"):
        update_suspicion({}, ["a", "b"], [1.0], 0.5)


def test_krum_ratios_are_the_scores_over_their_median():
    x = _honest(7, seed=1)
    x[2] += 1.0
    scores = krum_scores(pairwise_sq_distances(list(x)), 1)
    got = krum_ratios(x, 1)
    np.testing.assert_allclose(got, scores / np.median(scores), rtol=1e-12)
    assert int(np.argmax(got)) == 2 and np.median(got) == pytest.approx(1.0)
    same = np.ones((5, 4))
    same[4] = 2.0
    np.testing.assert_array_equal(krum_ratios(same, 1), [1.0, 1.0, 1.0, 1.0, np.inf])  # median score 0
    with pytest.raises(AggregationError, match="NaN or Inf"):
        krum_ratios(np.where(np.eye(5, 3) > 0, np.nan, 0.0), 1)
    with pytest.raises(AggregationError, match="neighbours"):
        krum_ratios(_honest(3), 1)


def test_most_suspicious_and_a_chosen_drop():
    np.testing.assert_array_equal(most_suspicious([1.0, 3.0, 2.0, 3.0], 2), [1, 3])
    np.testing.assert_array_equal(most_suspicious([1.0, 3.0, 3.0], 1), [1])  # ties: lowest index
    assert most_suspicious([1.0, 2.0], 0).size == 0
    with pytest.raises(AggregationError, match="keep one"):
        most_suspicious([1.0, 2.0], 2)
    x = _honest(6, seed=2)
    x[3] *= 4.0  # longer than the bound (1.5x the median norm)
    got = krum_bounded_mean(x, [10, 20, 30, 10, 40, 10], 1, drop=[1])
    norms = np.linalg.norm(x, axis=1)
    bound = 1.5 * np.sort(norms)[2]
    y = x * np.minimum(1.0, bound / norms)[:, None]
    w = np.array([10, 30, 10, 30, 10], dtype=float)  # claims capped at 3x the lower median claim (10): 40 -> 30
    np.testing.assert_allclose(got.mean, (y[[0, 2, 3, 4, 5]] * w[:, None]).sum(0) / w.sum(), rtol=1e-12)
    assert list(got.chosen) == [0, 2, 3, 4, 5]
    assert list(krum_bounded_mean(x[:2], [1, 1], 1, drop=[]).chosen) == [0, 1]  # any count with a given drop
    with pytest.raises(AggregationError, match="keep one"):
        krum_bounded_mean(x[:2], [1, 1], 1, drop=[0, 1])
    with pytest.raises(AggregationError, match="keep one"):
        krum_bounded_mean(x, [1] * 6, 1, drop=[6])


def _round(agg, rows, round_id, ids=None, samples=None):
    rows = np.asarray(rows)
    agg.begin_round({"w": np.zeros(rows.shape[1], np.float64)}, round_id)
    for i, row in enumerate(rows):
        agg.add({"w": row}, 100 if samples is None else samples[i], client_id=f"d{i}" if ids is None else ids[i])
    return agg.finish()


def _fleet(round_id: int, spike: bool) -> np.ndarray:
    """10 devices; d0 pushes a direction no one else does (3.0 along the last coordinate); with ``spike``
    honest d5 is far this once (a round of odd data) and d0 only a little."""
    x = _honest(10, seed=100 + round_id)
    x[0, -1] += 0.5 if spike else 3.0
    if spike:
        x[5] += 0.3
    return x


def test_history_keeps_the_poisoner_out_of_the_round_where_an_honest_device_is_farther():
    rep = make_aggregator("krum-reputation", server_momentum=0.0)
    plain = make_aggregator("fedavg-krum")
    for r in range(3):
        for agg in (rep, plain):
            _round(agg, _fleet(r, False), r)
        assert "d0" not in rep.selected_clients and "d0" not in plain.selected_clients
    x = _fleet(3, True)
    ratios = krum_ratios(x, 1)
    assert int(np.argmax(ratios)) == 5 and ratios[0] > 1.0  # the premise: this round d5 is the farthest
    got = _round(rep, x, 3)
    _round(plain, x, 3)
    assert "d5" not in plain.selected_clients and "d0" in plain.selected_clients  # fedavg-krum lets d0 in
    assert "d0" not in rep.selected_clients and "d5" in rep.selected_clients  # the suspicion keeps it out
    np.testing.assert_allclose(got.delta["w"], krum_bounded_mean(x, [100] * 10, 1, drop=[0]).mean, rtol=1e-12)
    assert rep.suspicion["d0"] > rep.suspicion["d5"] > 1.0
    assert got.metrics["dropped"] == 1.0 and got.metrics["max_suspicion"] == pytest.approx(rep.suspicion["d0"])


def test_small_rounds_drop_nobody_and_the_step_carries_momentum():
    rep = make_aggregator("krum-reputation", server_momentum=0.9)  # FedAvgM's step: v = 0.9 v + mean
    a = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # equal norms and claims: the bounded mean is the mean
    b = np.array([[0.0, 2.0], [2.0, 0.0]])
    first = _round(rep, a, 0)
    np.testing.assert_allclose(first.delta["w"], a.mean(0), rtol=1e-12)
    second = _round(rep, b, 1)
    np.testing.assert_allclose(second.delta["w"], b.mean(0) + 0.9 * a.mean(0), rtol=1e-12)
    assert second.metrics["dropped"] == 0.0 and rep.suspicion == {}  # Krum is not defined below 2f + 3
    lr = make_aggregator("krum-reputation", server_momentum=0.0, server_lr=2.0)
    np.testing.assert_allclose(_round(lr, a, 0).delta["w"], 2.0 * a.mean(0), rtol=1e-12)


def test_an_update_without_a_device_id_is_judged_on_its_round_alone():
    rep = make_aggregator("krum-reputation", server_momentum=0.0)
    x = _fleet(0, False)
    ids = [""] + [f"d{i}" for i in range(1, 10)]
    _round(rep, x, 0, ids=ids)
    assert "" not in rep.suspicion and len(rep.suspicion) == 9
    assert rep.selected_clients == tuple(ids[1:])  # still dropped: the farthest this round


def test_the_state_survives_a_restart_and_a_damaged_state_is_refused():
    a = make_aggregator("krum-reputation")
    for r in range(3):
        _round(a, _fleet(r, False), r)
    blob = encode_state(a.state_dict())
    b = make_aggregator("krum-reputation")
    b.load_state_dict(decode_state(blob))
    assert b.suspicion == a.suspicion
    x = _fleet(3, True)
    np.testing.assert_array_equal(_round(a, x, 3).delta["w"], _round(b, x, 3).delta["w"])  # momentum and suspicion
    assert a.selected_clients == b.selected_clients and "d0" not in b.selected_clients
    fresh = make_aggregator("krum-reputation")
    assert "d0" in (_round(fresh, x, 3), fresh.selected_clients)[1]  # without the state the poisoner gets in
    good = decode_state(blob)
    bad_values = [
        {**good, "suspicion": {"ids": ["d0", "d0"], "values": np.array([1.0, 2.0])}},
        {**good, "suspicion": {"ids": ["d0"], "values": np.array([np.nan])}},
        {**good, "suspicion": {"ids": ["d0"], "values": np.array([-1.0])}},
        {**good, "suspicion": {"ids": ["d0", "d1"], "values": np.array([1.0])}},
        {**good, "suspicion": {"ids": [""], "values": np.array([1.0])}},
        {**good, "suspicion": {"ids": ["d0"], "values": np.array([1], dtype=np.int64)}},
        {k: v for k, v in good.items() if k != "suspicion"},
    ]
    for state in bad_values:
        c = make_aggregator("krum-reputation")
        c.suspicion = {"kept": 1.0}
        with pytest.raises(StateError, match="suspicion"):
            c.load_state_dict(state)
        assert c.suspicion == {"kept": 1.0}  # nothing changed
    with pytest.raises(StateError, match="configured strategy changed"):
        make_aggregator("fedavg-krum").load_state_dict(good)
    with pytest.raises(StateError, match="configured strategy changed"):
        make_aggregator("krum-reputation").load_state_dict(decode_state(encode_state(
            make_aggregator("fedavg-krum").state_dict())))
    with pytest.raises(StateError, match="server_optimizer"):  # stored with momentum, configured without
        make_aggregator("krum-reputation", server_momentum=0.0).load_state_dict(good)
    a.reset()
    assert a.suspicion == {}


def test_bad_settings_are_one_config_error():
    for params in ({"memory": 1.0}, {"memory": -0.5}, {"server_momentum": 1.5}, {"server_lr": 0},
                   {"num_byzantine": -1}, {"server_optimizer": object()}):
        with pytest.raises(ConfigError):
            make_aggregator("krum-reputation", **params)
    from edgeflow.gateway.round_config import RoundConfig

    with pytest.raises(ConfigError, match="secagg reveals only the sum"):
        RoundConfig(strategy="krum-reputation", min_clients=5, secagg={})
    assert RoundConfig(strategy="krum-reputation", min_clients=2).strategy == "krum-reputation"  # small rounds: fine
