"""The aggregator interface: streaming FedAvg math, validation, rejection, memory, FedBuff."""

from __future__ import annotations

import gc
import math
import tracemalloc

import numpy as np
import pytest
from _flower import run_flower

from edgeflow.errors import AggregationError, ConfigError
from edgeflow.gateway import make_aggregator
from edgeflow.gateway.aggregation import Schema
from edgeflow.gateway.buffered import (
    BufferedAggregator,
    constant_staleness,
    exponential_staleness,
    hinge_staleness,
    make_staleness,
    polynomial_staleness,
)
from edgeflow.gateway.strategies import FedAvg, available_aggregators, weighted_average


UNBOUNDED = {"clip": "off", "sample_multiplier": "off"}
"""FedAvg without its default norm bound and sample cap: the plain weighted mean these math tests check
(the bound has its own tests in tests/test_robust_default.py)."""


def _model(rng, shapes=(("fc.w", (16, 8)), ("fc.b", (8,)), ("out.w", (8, 3)))):
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes}


def _updates(rng, like, k):
    return [{n: (0.1 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in like.items()} for _ in range(k)]


def test_fedavg_is_the_sample_weighted_mean_of_deltas():
    rng = np.random.default_rng(0)
    g = _model(rng)
    ups = _updates(rng, g, 7)
    ns = [3, 10, 1, 7, 22, 5, 9]
    agg = FedAvg(**UNBOUNDED)
    agg.begin_round(g, round_id=4)
    for i, (u, n) in enumerate(zip(ups, ns)):
        agg.add(u, n, client_id=f"d{i}")
    res = agg.finish()
    ref = weighted_average(ups, ns)
    assert res.round_id == 4 and res.num_clients == 7 and res.total_samples == sum(ns)
    assert res.client_ids == tuple(f"d{i}" for i in range(7))
    for name in g:
        np.testing.assert_allclose(res.delta[name], ref[name], rtol=1e-6, atol=1e-7)
        assert res.delta[name].dtype == np.float32
        np.testing.assert_allclose(res.weights[name], g[name].astype(np.float64) + ref[name], rtol=1e-6, atol=1e-6)
    assert res.metrics["num_clients"] == 7 and res.metrics["num_rejected"] == 0


def test_fedavg_matches_flower_aggregate():
    rng = np.random.default_rng(1)
    g = _model(rng)
    ups = _updates(rng, g, 5)
    ns = [5, 1, 8, 2, 4]
    flower = run_flower("aggregate", fn="aggregate", args=[[([u[n] for n in g], k) for u, k in zip(ups, ns)]],
                        kwargs={})
    agg = make_aggregator("fedavg", **UNBOUNDED)
    agg.begin_round(g, 0)
    for u, k in zip(ups, ns):
        agg.add(u, k)
    res = agg.finish()
    for name, ref in zip(g, flower):
        np.testing.assert_allclose(res.delta[name], ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("stage", [0, 8])
def test_accumulation_error_does_not_grow_with_1000_updates(stage):
    """stage=0 folds exactly in float64; the default float32 staging stays within
    a few float32 ulps of the sum of magnitudes, however many clients."""
    rng = np.random.default_rng(2)
    g = {"w": np.zeros(257, np.float32)}
    agg = FedAvg(stage=stage, **UNBOUNDED)
    agg.begin_round(g, 0)
    rows, ns = [], []
    for i in range(1000):
        u = {"w": (rng.standard_normal(257) * 10 ** rng.uniform(-3, 1)).astype(np.float32)}
        n = int(rng.integers(1, 500))
        agg.add(u, n)
        rows.append(u["w"].astype(np.float64) * n)
        ns.append(n)
    rows = np.array(rows)
    exact = np.array([math.fsum(col) for col in rows.T]) / sum(ns)
    got = agg.finish().delta["w"]
    if stage == 0:  # the only error left is the final cast to float32
        np.testing.assert_array_equal(got, exact.astype(np.float32))
    else:
        magnitude = np.abs(rows).sum(axis=0) / sum(ns)
        err = np.abs(got.astype(np.float64) - exact)
        assert np.all(err <= 4 * 2.0 ** -24 * magnitude + np.spacing(np.abs(exact).astype(np.float32)))


def test_unweighted_and_delta_only_round():
    rng = np.random.default_rng(3)
    g = _model(rng)
    ups = _updates(rng, g, 3)
    agg = FedAvg(weighted=False)
    agg.begin_round(None, 1)  # no global weights: the first update fixes the layout
    for k, u in enumerate(ups):
        agg.add(u, 100 * (k + 1))
    res = agg.finish()
    assert res.weights is None
    for n in g:
        np.testing.assert_allclose(res.delta[n], sum(u[n].astype(np.float64) for u in ups) / 3, rtol=1e-6)


@pytest.mark.parametrize("mutate, match", [
    (lambda u: u.pop("fc.b"), "lacks tensor 'fc.b'"),
    (lambda u: u.__setitem__("extra", np.zeros(2, np.float32)), "unexpected tensor 'extra'"),
    (lambda u: u.__setitem__("fc.w", np.zeros((8, 16), np.float32)), r"'fc.w' has shape \(8, 16\)"),
    (lambda u: u.__setitem__("out.w", np.zeros((8, 3), np.float64)), "'out.w' has dtype float64"),
    (lambda u: u.__setitem__("fc.b", [0.0] * 8), "'fc.b' is a list"),
])
def test_layout_errors_name_client_and_tensor_and_leave_the_round_intact(mutate, match):
    rng = np.random.default_rng(4)
    g = _model(rng)
    good = _updates(rng, g, 2)
    agg = FedAvg()
    agg.begin_round(g, 0)
    agg.add(good[0], 5, "ok-1")
    bad = dict(good[1])
    mutate(bad)
    with pytest.raises(AggregationError, match=match) as info:
        agg.add(bad, 5, "dev-42")
    assert "dev-42" in str(info.value)
    agg.add(good[1], 5, "ok-2")
    res = agg.finish()
    assert res.num_clients == 2
    np.testing.assert_allclose(res.delta["fc.w"], (good[0]["fc.w"] + good[1]["fc.w"]) / 2, rtol=1e-6, atol=1e-8)


def test_non_finite_and_duplicate_updates_are_rejected_not_fatal():
    rng = np.random.default_rng(5)
    g = _model(rng)
    ups = _updates(rng, g, 4)
    nan = {k: v.copy() for k, v in ups[1].items()}
    nan["fc.b"][3] = np.nan
    inf = {k: v.copy() for k, v in ups[2].items()}
    inf["out.w"][0, 0] = -np.inf
    agg = FedAvg()
    agg.begin_round(g, 9)
    agg.add(ups[0], 1, "a")
    agg.add(nan, 1, "b")
    agg.add(inf, 1, "c")
    agg.add(ups[3], 1, "a")  # second update from "a"
    agg.add(ups[3], 1, "d")
    res = agg.finish()
    assert res.num_clients == 2 and res.client_ids == ("a", "d")
    assert [(r.client_id, r.reason) for r in res.rejected] == [("b", "non_finite"), ("c", "non_finite"),
                                                                ("a", "duplicate")]
    assert "fc.b" in res.rejected[0].detail
    assert res.metrics["rejected_non_finite"] == 2 and res.metrics["rejected_duplicate"] == 1
    np.testing.assert_allclose(res.delta["fc.w"], (ups[0]["fc.w"] + ups[3]["fc.w"]) / 2, rtol=1e-6)


@pytest.mark.parametrize("stage", [0, 16])
def test_a_rejected_update_leaves_no_trace_bit_for_bit(stage):
    """The NaN sits in the last block of a large tensor, after most of it was summed."""
    rng = np.random.default_rng(9)
    g = {"big": np.zeros(300_000, np.float32), "small": np.zeros(7, np.float64)}
    ups = [{"big": rng.standard_normal(300_000).astype(np.float32), "small": rng.standard_normal(7)}
           for _ in range(5)]
    bad = {"big": (rng.standard_normal(300_000) * 1e30).astype(np.float32), "small": np.zeros(7)}
    bad["big"][-3] = np.inf
    bad_small = {"big": ups[0]["big"].copy(), "small": np.array([0, 0, 0, np.nan, 0, 0, 0])}
    results = []
    for with_bad in (False, True):
        agg = FedAvg(stage=stage)
        agg.begin_round(g, 0)
        for i, u in enumerate(ups):
            agg.add(u, 3 + i, f"c{i}")
            if with_bad and i == 2:
                agg.add(bad, 1000, "evil")
                agg.add(bad_small, 1000, "evil-2")
        results.append(agg.finish())
    clean, dirty = results
    assert [r.detail for r in dirty.rejected] == ["tensor 'big' has NaN or Inf", "tensor 'small' has NaN or Inf"]
    for k in g:
        np.testing.assert_array_equal(clean.delta[k], dirty.delta[k])


def test_round_with_only_rejected_updates_fails_clearly():
    g = {"w": np.zeros(3, np.float32)}
    agg = FedAvg()
    agg.begin_round(g, 2)
    agg.add({"w": np.array([np.nan, 0, 0], np.float32)}, 1, "x")
    with pytest.raises(AggregationError, match=r"round 2: no update was accepted \(1 rejected - x: non_finite"):
        agg.finish()


def test_lifecycle_and_argument_errors():
    g = {"w": np.zeros(3, np.float32)}
    agg = FedAvg()
    with pytest.raises(AggregationError, match="begin_round"):
        agg.add({"w": np.zeros(3, np.float32)}, 1)
    agg.begin_round(g, 0)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(AggregationError, match="num_samples"):
            agg.add({"w": np.zeros(3, np.float32)}, bad, "c")
    with pytest.raises(AggregationError, match="staleness"):
        agg.add({"w": np.zeros(3, np.float32)}, 1, "c", staleness=-1)
    agg.add({"w": np.ones(3, np.float32)}, 1)
    agg.finish()
    with pytest.raises(AggregationError, match="no open round"):
        agg.finish()
    with pytest.raises(AggregationError, match="only floating-point"):
        agg.begin_round({"steps": np.zeros(1, np.int64)}, 1)
    with pytest.raises(AggregationError, match="empty"):
        agg.begin_round({}, 1)


def test_streaming_fedavg_memory_does_not_grow_with_clients():
    """200 updates of 250k params: traced memory stays at the accumulator + scratch."""
    size = 250_000
    g = {"a": np.zeros((500, 400), np.float32), "b": np.zeros(50_000, np.float32)}
    rng = np.random.default_rng(6)
    base = rng.standard_normal(size).astype(np.float32)
    agg = FedAvg()
    gc.collect()
    tracemalloc.start()
    try:
        agg.begin_round(g, 0)
        peaks = []
        for i in range(200):
            upd = {"a": (base[:200_000] * (1 + i * 1e-3)).reshape(500, 400), "b": base[200_000:] * (i % 7)}
            agg.add(upd, 10 + i, f"c{i}")
            del upd
            peaks.append(tracemalloc.get_traced_memory()[1])
            if i == 9:
                tracemalloc.reset_peak()
        current = tracemalloc.get_traced_memory()[0]
        res = agg.finish()
    finally:
        tracemalloc.stop()
    state = 12 * size  # float64 accumulator + float32 staging sum
    one_update = 4 * size
    # after warm-up the peak (state + the update in flight + scratch) never grows
    assert max(peaks[10:]) < state + one_update + 2_000_000, max(peaks[10:])
    assert max(peaks[10:]) - min(peaks[10:]) < 100_000
    assert current < state + 1_000_000
    assert res.num_clients == 200


def test_add_partial_equals_adding_each_update():
    rng = np.random.default_rng(7)
    g = _model(rng)
    ups = _updates(rng, g, 6)
    ns = [4, 2, 9, 1, 3, 5]
    direct = FedAvg()
    direct.begin_round(g, 0)
    for u, n in zip(ups, ns):
        direct.add(u, n)
    partial = FedAvg()
    partial.begin_round(g, 0)
    partial.add(ups[0], ns[0], "solo")
    s = {k: sum(u[k].astype(np.float64) * n for u, n in zip(ups[1:], ns[1:])).astype(np.float32) for k in g}
    partial.add_partial(s, sum(ns[1:]), num_clients=5, client_id="edge-gw-2")
    a, b = direct.finish(), partial.finish()
    assert b.num_clients == 6 and b.total_samples == sum(ns)
    for k in g:
        np.testing.assert_allclose(a.delta[k], b.delta[k], rtol=1e-5, atol=1e-7)


def test_staleness_weighting_fedbuff_and_normalized():
    g = {"w": np.zeros(2, np.float32)}
    u1, u2 = {"w": np.array([1.0, 0.0], np.float32)}, {"w": np.array([0.0, 1.0], np.float32)}
    for normalize in (False, True):
        agg = FedAvg(staleness_fn=polynomial_staleness(0.5), normalize_staleness=normalize)
        agg.begin_round(g, 0)
        agg.add(u1, 10, "fresh", staleness=0)
        agg.add(u2, 30, "old", staleness=3)  # weight 30 * 4^-0.5 = 15
        got = agg.finish().delta["w"]
        denom = 25.0 if normalize else 40.0
        np.testing.assert_allclose(got, [10 / denom, 15 / denom], rtol=1e-6)


def test_staleness_functions():
    assert constant_staleness()(100) == 1.0
    p = polynomial_staleness(0.5)
    assert p(0) == 1.0 and p(3) == pytest.approx(0.5)
    h = hinge_staleness(a=10, b=4)
    assert h(4) == 1.0 and h(5) == pytest.approx(1 / 11)
    assert exponential_staleness(0.5)(2) == pytest.approx(math.exp(-1))
    assert make_staleness("polynomial", a=1.0)(1) == 0.5
    with pytest.raises(ConfigError, match="available: constant, exponential, hinge, polynomial"):
        make_staleness("linear")
    with pytest.raises(ConfigError):
        polynomial_staleness(-1)


def test_buffered_aggregator_applies_every_k_updates_with_staleness():
    g = {"w": np.zeros(3, np.float32)}
    buf = BufferedAggregator(FedAvg(), buffer_size=3, staleness_fn=polynomial_staleness(0.5), max_staleness=2)
    buf.start(g, version=0)
    e = np.eye(3, dtype=np.float32)
    assert buf.add({"w": e[0]}, 1, "a", base_version=0) is None
    assert buf.add({"w": e[1]}, 1, "b", base_version=0) is None
    assert buf.buffered == 2
    r1 = buf.add({"w": e[2]}, 2, "c", base_version=0)
    assert r1 is not None and buf.version == 1 and r1.round_id == 1
    np.testing.assert_allclose(buf.global_weights["w"], [0.25, 0.25, 0.5])
    # version 1: one fresh, one 1-behind, one too stale, one from the future
    assert buf.add({"w": e[0]}, 1, "a", base_version=1) is None
    assert buf.add({"w": e[1]}, 1, "b", base_version=0) is None
    assert buf.add({"w": e[2]}, 1, "late", base_version=-5) is None
    assert buf.add({"w": e[2]}, 1, "time-traveller", base_version=7) is None
    r2 = buf.flush()
    assert r2 is not None and buf.version == 2 and r2.num_clients == 2
    np.testing.assert_allclose(r2.delta["w"], [0.5, 0.5 * 2 ** -0.5, 0.0], rtol=1e-6)
    assert {(r.client_id, r.reason) for r in r2.rejected} == {("late", "stale"), ("time-traveller", "future_version")}
    assert r2.metrics["max_staleness"] == 1 and r2.metrics["rejected_stale"] == 1
    assert buf.flush() is None  # empty buffer


def test_buffered_aggregator_with_server_optimizer_keeps_state():
    g = {"w": np.zeros(2, np.float32)}
    buf = BufferedAggregator(make_aggregator("fedavgm", server_lr=1.0, server_momentum=0.5), buffer_size=1)
    buf.start(g)
    buf.add({"w": np.array([1, 0], np.float32)}, 1, base_version=0)
    buf.add({"w": np.array([1, 0], np.float32)}, 1, base_version=1)
    np.testing.assert_allclose(buf.global_weights["w"], [1 + 1.5, 0])


def test_registry_names_and_config_errors():
    assert set(available_aggregators()) >= {"fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad",
                                            "median", "trimmed-mean", "krum", "multi-krum"}
    assert make_aggregator("Trimmed_Mean", proportion=0.1).proportion == 0.1
    with pytest.raises(ConfigError, match="unknown aggregator 'fedsgd'; available: bulyan, fedadagrad"):
        make_aggregator("fedsgd")
    with pytest.raises(ConfigError, match="no parameter 'momentum'; accepted: .*server_momentum"):
        make_aggregator("fedavgm", momentum=0.9)
    with pytest.raises(ConfigError, match="no parameter 'num_selected'"):
        make_aggregator("krum", num_selected=3)
    with pytest.raises(ConfigError):
        make_aggregator("trimmed-mean", proportion=0.5)
    with pytest.raises(ConfigError):
        make_aggregator("fedadam", beta_1=1.0)


def test_schema_flatten_roundtrip():
    rng = np.random.default_rng(8)
    g = _model(rng)
    s = Schema.of(g)
    flat = s.flatten(g)
    assert flat.shape == (s.size,) and s.size == 16 * 8 + 8 + 8 * 3
    back = s.unflatten(flat)
    for n in g:
        np.testing.assert_array_equal(back[n], g[n])
