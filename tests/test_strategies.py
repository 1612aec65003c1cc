"""Strategies against reference math: Adam/Yogi/Adagrad/momentum by hand, scipy's
trim_mean, numpy's median, brute-force Krum, Flower where it has the same rule."""

from __future__ import annotations

import numpy as np
import pytest
from _flower import run_flower

from edgeflow.errors import AggregationError
from edgeflow.gateway import make_aggregator
from edgeflow.gateway.strategies import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedProx,
    FedYogi,
    Krum,
    Median,
    MultiKrum,
    TrimmedMean,
    coordinate_median,
    krum_scores,
    pairwise_sq_distances,
    proximal_gradient,
    proximal_term,
    trimmed_mean,
)


def _rounds(rng, g, num_rounds=3, k=4):
    """Per round: a list of (update, num_samples)."""
    return [[({n: (0.1 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in g.items()},
              int(rng.integers(1, 20))) for _ in range(k)] for _ in range(num_rounds)]


def _fedavg_delta(batch):
    total = sum(n for _, n in batch)
    return {name: sum(u[name].astype(np.float64) * n for u, n in batch) / total for name in batch[0][0]}


def _run(agg, g, rounds):
    w = g
    out = []
    for r, batch in enumerate(rounds):
        agg.begin_round(w, r)
        for i, (u, n) in enumerate(batch):
            agg.add(u, n, f"c{i}")
        res = agg.finish()
        w = res.weights
        out.append(res)
    return out


@pytest.fixture
def setup():
    rng = np.random.default_rng(0)
    g = {"w": rng.standard_normal((6, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}
    return g, _rounds(rng, g)


def test_fedadam_is_a_hand_written_adam_step(setup):
    g, rounds = setup
    eta, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    results = _run(FedAdam(eta=eta, beta_1=b1, beta_2=b2, tau=tau), g, rounds)
    x = {n: a.astype(np.float64) for n, a in g.items()}
    m = {n: np.zeros_like(a) for n, a in x.items()}
    v = {n: np.zeros_like(a) for n, a in x.items()}
    for t, (batch, res) in enumerate(zip(rounds, results), start=1):
        d = _fedavg_delta(batch)
        lr = eta * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        for n in x:
            m[n] = b1 * m[n] + (1 - b1) * d[n]
            v[n] = b2 * v[n] + (1 - b2) * d[n] ** 2
            x[n] = x[n] + lr * m[n] / (np.sqrt(v[n]) + tau)
            np.testing.assert_allclose(res.weights[n], x[n], rtol=1e-5, atol=1e-6)


def test_fedadam_without_bias_correction_and_yogi_and_adagrad(setup):
    g, rounds = setup
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 1e-2
    cases = {
        "adam": (FedAdam(eta=eta, beta_1=b1, beta_2=b2, tau=tau, bias_correction=False),
                 lambda v, d2: b2 * v + (1 - b2) * d2, b1),
        "yogi": (FedYogi(eta=eta, beta_1=b1, beta_2=b2, tau=tau),
                 lambda v, d2: v - (1 - b2) * d2 * np.sign(v - d2), b1),
        "adagrad": (FedAdagrad(eta=eta, tau=tau), lambda v, d2: v + d2, 0.0),
    }
    for name, (agg, v_rule, beta1) in cases.items():
        results = _run(agg, g, rounds)
        x = {n: a.astype(np.float64) for n, a in g.items()}
        m = {n: np.zeros_like(a) for n, a in x.items()}
        v = {n: np.zeros_like(a) for n, a in x.items()}
        for batch, res in zip(rounds, results):
            d = _fedavg_delta(batch)
            for n in x:
                m[n] = beta1 * m[n] + (1 - beta1) * d[n]
                v[n] = v_rule(v[n], d[n] ** 2)
                x[n] = x[n] + eta * m[n] / (np.sqrt(v[n]) + tau)
                np.testing.assert_allclose(res.weights[n], x[n], rtol=1e-5, atol=1e-6, err_msg=name)


def test_fedavgm_matches_flowers_momentum_rule(setup):
    g, rounds = setup
    lr, mu = 0.7, 0.9
    results = _run(FedAvgM(server_lr=lr, server_momentum=mu), g, rounds)
    x = {n: a.astype(np.float64) for n, a in g.items()}
    buf = None
    for batch, res in zip(rounds, results):
        avg = {n: x[n] + d for n, d in _fedavg_delta(batch).items()}
        pseudo = {n: x[n] - avg[n] for n in x}  # Flower's sign: w_global - w_avg
        buf = pseudo if buf is None else {n: mu * buf[n] + pseudo[n] for n in x}
        x = {n: x[n] - lr * buf[n] for n in x}
        for n in x:
            np.testing.assert_allclose(res.weights[n], x[n], rtol=1e-5, atol=1e-6)


def test_server_optimizer_state_checks_and_reset(setup):
    g, rounds = setup
    agg = FedAdam()
    _run(agg, g, rounds[:1])
    sd = agg.server_optimizer.state_dict()
    assert sd["t"] == 1 and set(sd["state"]) == {"m", "v"}
    other = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(5, np.float32)}
    agg.begin_round(other, 1)
    agg.add({"w": np.ones((2, 2), np.float32), "b": np.ones(5, np.float32)}, 1)
    with pytest.raises(AggregationError, match="model changed; call reset"):
        agg.finish()
    agg.reset()
    agg.begin_round(other, 2)
    agg.add({"w": np.ones((2, 2), np.float32), "b": np.ones(5, np.float32)}, 1)
    assert agg.finish().num_clients == 1
    agg.server_optimizer.load_state_dict(sd)
    assert agg.server_optimizer.t == 1


def test_fedprox_is_fedavg_on_the_server_and_tells_clients_mu(setup):
    g, rounds = setup
    prox = _run(FedProx(mu=0.1), g, rounds)
    avg = _run(make_aggregator("fedavg"), g, rounds)
    for a, b in zip(prox, avg):
        for n in g:
            np.testing.assert_array_equal(a.weights[n], b.weights[n])
    assert FedProx(mu=0.1).client_config() == {"proximal_mu": 0.1}
    w = {"a": np.array([1.0, 2.0], np.float32)}
    w0 = {"a": np.array([0.0, 0.0], np.float32)}
    assert proximal_term(w, w0, 0.5) == pytest.approx(0.25 * 5)
    np.testing.assert_allclose(proximal_gradient(w, w0, 0.5)["a"], [0.5, 1.0])


@pytest.mark.parametrize("n", [1, 2, 5, 10, 11])
def test_median_matches_numpy_and_is_chunked(n):
    rng = np.random.default_rng(n)
    g = {"w": np.zeros((7, 9), np.float32), "b": np.zeros(4, np.float32)}
    ups = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in g.items()} for _ in range(n)]
    agg = Median(chunk_elems=5 * max(n, 1))  # tiny chunks: many coordinate blocks
    agg.begin_round(g, 0)
    for u in ups:
        agg.add(u, 3)
    res = agg.finish()
    for k in g:
        np.testing.assert_allclose(res.delta[k], np.median(np.stack([u[k] for u in ups]), axis=0), rtol=1e-6)
    assert Median.holds_updates


def test_median_matches_flower():
    rng = np.random.default_rng(3)
    ups = [[rng.standard_normal((4, 3)).astype(np.float32)] for _ in range(6)]
    ref = run_flower("aggregate", fn="aggregate_median", args=[[(u, 1) for u in ups]], kwargs={})[0]
    np.testing.assert_allclose(coordinate_median(np.stack([u[0] for u in ups])), ref, rtol=1e-6)


@pytest.mark.parametrize("n, proportion", [(10, 0.1), (10, 0.2), (7, 0.25), (20, 0.45), (5, 0.0), (9, 0.3)])
def test_trimmed_mean_matches_scipy(n, proportion):
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(n)
    g = {"w": np.zeros((5, 6), np.float32)}
    ups = [{"w": rng.standard_normal((5, 6)).astype(np.float32) * (100 if i == 0 else 1)} for i in range(n)]
    agg = TrimmedMean(proportion=proportion, chunk_elems=3 * n)
    agg.begin_round(g, 0)
    for u in ups:
        agg.add(u, 1)
    res = agg.finish()
    stack = np.stack([u["w"] for u in ups]).astype(np.float64)
    np.testing.assert_allclose(res.delta["w"], stats.trim_mean(stack, proportion, axis=0), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(trimmed_mean(stack, proportion), stats.trim_mean(stack, proportion, axis=0))
    assert res.metrics["trimmed_per_side"] == int(proportion * n)


def _brute_krum(vectors, f, m):
    n = len(vectors)
    dist = np.array([[float(np.sum((a.astype(np.float64) - b) ** 2)) for b in vectors] for a in vectors])
    scores = []
    for i in range(n):
        others = sorted(dist[i, j] for j in range(n) if j != i)
        scores.append(sum(others[: n - f - 2]))
    order = sorted(range(n), key=lambda i: (scores[i], i))
    return dist, np.array(scores), order[:m]


@pytest.mark.parametrize("n, f, m", [(7, 2, 1), (10, 3, 1), (10, 3, 4), (13, 5, 8)])
def test_krum_and_multi_krum_match_brute_force(n, f, m):
    rng = np.random.default_rng(n * 10 + f)
    g = {"w": np.zeros((4, 5), np.float32), "b": np.zeros(3, np.float32)}
    ups = [{k: rng.standard_normal(v.shape).astype(np.float32) * (1 + (i < f) * 5) for k, v in g.items()}
           for i in range(n)]
    flat = [np.concatenate([u["w"].ravel(), u["b"].ravel()]) for u in ups]
    dist_ref, scores_ref, chosen = _brute_krum(flat, f, m)
    dist = pairwise_sq_distances(flat, chunk=3)
    np.testing.assert_allclose(dist, dist_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(krum_scores(dist, f), scores_ref, rtol=1e-9)
    agg = Krum(num_byzantine=f) if m == 1 else MultiKrum(num_byzantine=f, num_selected=m)
    agg.begin_round(g, 0)
    for i, u in enumerate(ups):
        agg.add(u, i + 1, f"c{i}")
    res = agg.finish()
    expect = np.mean([flat[i].astype(np.float64) for i in chosen], axis=0)
    np.testing.assert_allclose(np.concatenate([res.delta["w"].ravel(), res.delta["b"].ravel()]), expect, rtol=1e-6)
    assert set(agg.selected_clients) == {f"c{i}" for i in chosen}
    assert not set(chosen) & set(range(f))  # the inflated ones are never picked


def test_multi_krum_matches_flower_weighted():
    rng = np.random.default_rng(11)
    ups = [rng.standard_normal(12).astype(np.float32) for _ in range(9)]
    ns = [int(x) for x in rng.integers(1, 30, 9)]
    ref = run_flower("aggregate", fn="aggregate_krum", args=[[([u], k) for u, k in zip(ups, ns)]],
                     kwargs={"num_malicious": 2, "to_keep": 5})[0]
    agg = MultiKrum(num_byzantine=2, num_selected=5, weighted=True)
    agg.begin_round({"w": np.zeros(12, np.float32)}, 0)
    for u, k in zip(ups, ns):
        agg.add({"w": u}, k)
    np.testing.assert_allclose(agg.finish().delta["w"], ref, rtol=1e-5)


def test_krum_refuses_too_few_clients():
    agg = Krum(num_byzantine=2)
    agg.begin_round({"w": np.zeros(3, np.float32)}, 5)
    for i in range(6):  # needs 2f + 3 = 7
        agg.add({"w": np.full(3, i, np.float32)}, 1, f"c{i}")
    with pytest.raises(AggregationError, match="needs at least 7 updates, got 6"):
        agg.finish()


def test_robust_strategies_reject_non_finite_and_release_memory():
    for agg in (Median(), TrimmedMean(0.2), MultiKrum(num_byzantine=1)):
        agg.begin_round({"w": np.zeros(4, np.float32)}, 0)
        for i in range(5):
            agg.add({"w": np.full(4, float(i), np.float32)}, 1, f"c{i}")
        agg.add({"w": np.array([np.inf, 0, 0, 0], np.float32)}, 1, "bad")
        res = agg.finish()
        assert res.num_clients == 5 and res.rejected[0].reason == "non_finite"
        assert agg._held == []


def test_robust_memory_is_clients_times_params_as_documented():
    import tracemalloc

    size, n = 100_000, 20
    rng = np.random.default_rng(12)
    base = rng.standard_normal(size).astype(np.float32)
    agg = Median(chunk_elems=1 << 18)
    tracemalloc.start()
    try:
        agg.begin_round({"w": np.zeros(size, np.float32)}, 0)
        start = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            agg.add({"w": base * (1 + i)}, 1, f"c{i}")
        held = tracemalloc.get_traced_memory()[0] - start
        tracemalloc.reset_peak()
        agg.finish()
        reduce_peak = tracemalloc.get_traced_memory()[1] - start - held
    finally:
        tracemalloc.stop()
    assert 0.95 * n * size * 4 < held < 1.1 * n * size * 4
    # the reduction's temporaries stay near the chunk, plus the float64 result and outputs
    assert reduce_peak < 4 * (1 << 18) * 4 + 3 * 8 * size
