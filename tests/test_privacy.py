"""Central DP: clipping, noise, the RDP accountant against published values, and its durable state.

Reference values come from TF-Privacy's rdp_accountant_test and Google's
dp_accounting tests (same functions, same arguments), and from direct
numerical integration of A_alpha with mpmath (more oracles in
tests/test_privacy_oracle.py).
"""

from __future__ import annotations

import copy
import itertools
import json
import math

import numpy as np
import pytest
from edgeflow.gateway.aggregation import decode_state, encode_state
from edgeflow.gateway.privacy import (
    OPACUS_ORDERS,
    CentralDP,
    RDPAccountant,
    _log_a_frac,
    _log_a_int,
    clip_by_global_norm,
    compute_rdp,
    global_norm,
    rdp_to_epsilon,
    refine_integer_order,
)
from edgeflow.gateway.strategies import FedAdam, FedAvg

from edgeflow.errors import AggregationError, ConfigError, StateError


def test_compute_rdp_known_values():
    assert compute_rdp(0, 10, 1, 20) == 0
    assert compute_rdp(1, 10, 1, 20) == pytest.approx(0.1)
    assert compute_rdp(0.1, 2, 10, 5) == pytest.approx(0.07737, abs=1e-5)
    got = compute_rdp(0.01, 2.5, 50, [1.5, 2.5, 5, 50, 100, np.inf])
    np.testing.assert_allclose(got[:-1], [0.00065, 0.001085, 0.00218075, 0.023846, 167.416307], atol=1e-5)
    np.testing.assert_allclose(got[2:5], [2.18075656e-03, 2.38460375e-02, 1.67416308e02], rtol=1e-6)
    assert got[-1] == np.inf


def test_classic_conversion_known_values():
    orders = range(2, 33)
    rdp = compute_rdp(0.01, 4, 10000, orders)
    eps, order = rdp_to_epsilon(orders, rdp, 1e-5, method="classic")
    assert eps == pytest.approx(1.258575, abs=1e-6) and order == 20
    orders = (1.25, 1.5, 1.75, 2., 2.5, 3., 4., 5., 6., 7., 8., 10., 12., 14., 16., 20., 24., 28., 32., 64., 256.)
    rdp = compute_rdp(1e-4, 0.4, 40000, orders) + compute_rdp(0.1, 2, 100, orders)
    eps, order = rdp_to_epsilon(orders, rdp, 1e-5, method="classic")
    assert eps == pytest.approx(8.509656, abs=1e-6) and order == 2.5


def test_improved_conversion_known_values():
    eps, order = rdp_to_epsilon(range(2, 33), [1.1] * 31, 1e-5)
    assert eps == pytest.approx(1.32783806176, abs=1e-9) and order == 32
    # sigma chosen (by dp_accounting) so that the Gaussian mechanism is exactly (1, 1e-6)-DP
    orders = [0.001 * i for i in range(1000, 100000)]
    eps, _ = rdp_to_epsilon(orders, compute_rdp(1, 4.530877117, 1, orders), 1e-6)
    assert eps == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("q, sigma, alpha", [(0.01, 2.5, 1.5), (0.1, 1.0, 5.5), (0.5, 2.0, 32.5), (1e-3, 1.0, 2),
                                             (0.01, 10, 20), (0.2, 0.8, 7)])
def test_log_a_matches_numerical_integration(q, sigma, alpha):
    mpmath = pytest.importorskip("mpmath")

    def integrand(z):
        ratio = (1 - q) + q * mpmath.exp((2 * z - 1) / (2 * sigma ** 2))
        return mpmath.npdf(z, mu=0, sigma=sigma) * ratio ** alpha

    exact = float(mpmath.log(mpmath.quad(integrand, [-mpmath.inf, 0, 1, mpmath.inf])))
    ours = _log_a_int(q, sigma, int(alpha)) if float(alpha).is_integer() else _log_a_frac(q, sigma, alpha)
    assert ours == pytest.approx(exact, rel=1e-6, abs=1e-12)


def test_accountant_composes_by_adding_rdp():
    acc = RDPAccountant()
    for _ in range(10):
        acc.step(1.1, 0.05)
    direct = rdp_to_epsilon(acc.orders, compute_rdp(0.05, 1.1, 10, acc.orders), 1e-5)[0]
    assert acc.get_epsilon(1e-5) == pytest.approx(direct)
    assert RDPAccountant().get_epsilon(1e-5) == 0.0
    with pytest.raises(ConfigError):
        rdp_to_epsilon([2], [0.1], 0)
    with pytest.raises(ConfigError):
        compute_rdp(1.5, 1, 1, [2])


def test_clipping():
    rng = np.random.default_rng(0)
    u = {"a": rng.standard_normal((10, 10)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    norm = global_norm(u)
    assert norm == pytest.approx(math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in u.values())))
    clipped, n0 = clip_by_global_norm(u, 1.0)
    assert n0 == pytest.approx(norm) and global_norm(clipped) == pytest.approx(1.0, rel=1e-6)
    small, _ = clip_by_global_norm(u, 1e6)
    np.testing.assert_array_equal(small["a"], u["a"])


def test_dp_fedavg_clips_averages_uniformly_and_adds_calibrated_noise():
    rng = np.random.default_rng(1)
    size, n, clip, z = 200_000, 8, 0.5, 1.3
    ups = [{"w": rng.standard_normal(size).astype(np.float32) * 0.01 * (i + 1)} for i in range(n)]
    g = {"w": np.zeros(size, np.float32)}
    agg = FedAvg(privacy=CentralDP(clip, z, seed=7, delta=1e-5))
    agg.begin_round(g, 0)
    for i, u in enumerate(ups):
        agg.add(u, 1000 * (i + 1), f"c{i}")  # sample counts must not matter under DP
    res = agg.finish()
    clipped = [clip_by_global_norm(u, clip)[0]["w"].astype(np.float64) for u in ups]
    noise = res.delta["w"].astype(np.float64) - np.mean(clipped, axis=0)
    assert noise.mean() == pytest.approx(0, abs=5 * z * clip / n / math.sqrt(size))
    assert noise.std() == pytest.approx(z * clip / n, rel=0.01)
    m = res.metrics
    assert m["dp_noise_std"] == pytest.approx(z * clip / n)
    assert m["dp_clipped_fraction"] == pytest.approx(sum(global_norm(u) > clip for u in ups) / n)
    assert m["dp_epsilon"] == pytest.approx(rdp_to_epsilon(agg.privacy.accountant.orders,
                                                           compute_rdp(1.0, z, 1, agg.privacy.accountant.orders),
                                                           1e-5)[0])


def test_dp_epsilon_is_reported_and_grows_per_round_with_subsampling():
    g = {"w": np.zeros(10, np.float32)}
    dp = CentralDP(1.0, 1.1, sampling_rate=0.1, expected_clients=5, seed=0)
    agg = FedAdam(privacy=dp)
    eps = []
    for r in range(4):
        agg.begin_round(g, r)
        for i in range(3):  # fewer than expected: the denominator stays 5
            agg.add({"w": np.full(10, 0.01, np.float32)}, 1, f"c{i}")
        res = agg.finish()
        assert res.metrics["dp_noise_std"] == pytest.approx(1.1 / 5)
        eps.append(res.metrics["dp_epsilon"])
    assert all(a < b for a, b in itertools.pairwise(eps))
    ref = RDPAccountant()
    ref.step(1.1, 0.1, steps=4)
    assert eps[-1] == pytest.approx(ref.get_epsilon(1e-5)) and dp.epsilon() == pytest.approx(eps[-1])


def test_dp_config_errors_and_no_partial_sums():
    for kwargs in ({"clip_norm": 0, "noise_multiplier": 1}, {"clip_norm": 1, "noise_multiplier": -1},
                   {"clip_norm": 1, "noise_multiplier": 1, "sampling_rate": 0},
                   {"clip_norm": 1, "noise_multiplier": 1, "delta": 1}):
        with pytest.raises(ConfigError):
            CentralDP(**kwargs)
    agg = FedAvg(privacy=CentralDP(1, 1))
    agg.begin_round({"w": np.zeros(2, np.float32)}, 0)
    with pytest.raises(AggregationError, match="central DP"):
        agg.add_partial({"w": np.zeros(2, np.float32)}, 10, 2)


# ---------------------------------------------------------------------------
# Durable state: a restarted gateway goes on exactly where it stopped
# ---------------------------------------------------------------------------

def _rounds(dp: CentralDP, n: int) -> list[tuple[dict[str, np.ndarray], dict[str, float]]]:
    out = []
    for _ in range(n):
        mean = {"w": np.zeros(5000, np.float32), "b": np.zeros(7, np.float64)}
        metrics = dp.privatize(mean, 4.0, 4, 1)
        out.append((mean, metrics))
    return out


@pytest.mark.parametrize("z, q", [(1.1, 0.05), (50.0, 0.01), (0.0, 1.0)])
def test_central_dp_restored_from_json_adds_the_same_noise_and_epsilon(z, q):
    kw = {"clip_norm": 1.0, "noise_multiplier": z, "sampling_rate": q, "expected_clients": 4}
    straight = CentralDP(**kw, seed=11)
    reference = _rounds(straight, 5)
    first = CentralDP(**kw, seed=11)
    before = _rounds(first, 2)
    text = json.dumps(first.state_dict(), allow_nan=False)  # JSON only: no arrays, no NaN/inf literals
    restarted = CentralDP(**kw)  # a fresh process: not seeded, everything comes from the state
    restarted.load_state_dict(json.loads(text))
    after = _rounds(restarted, 3)
    for (m_ref, met_ref), (m, met) in zip(reference, before + after, strict=True):
        for k in m_ref:
            np.testing.assert_array_equal(m[k], m_ref[k])
        assert met == met_ref or (z == 0 and met["dp_epsilon"] == met_ref["dp_epsilon"] == math.inf)
    assert restarted.epsilon() == straight.epsilon()
    assert restarted.accountant.history == straight.accountant.history
    np.testing.assert_array_equal(restarted.accountant.rdp, straight.accountant.rdp)
    if z > 0:  # what a restart without the state reported: the epsilon of the last 3 rounds only
        lost = CentralDP(**kw)
        _rounds(lost, 3)
        assert lost.epsilon() < straight.epsilon()


def test_central_dp_state_goes_through_the_gateway_encoding():
    dp = CentralDP(1.0, 1.3, sampling_rate=0.1, seed=5)
    _rounds(dp, 3)
    other = CentralDP(1.0, 1.3, sampling_rate=0.1)
    other.load_state_dict(decode_state(encode_state(dp.state_dict())))
    assert other.state_dict() == dp.state_dict()
    np.testing.assert_array_equal(_rounds(other, 1)[0][0]["w"], _rounds(dp, 1)[0][0]["w"])


def test_accountant_state_stores_runs_not_one_entry_per_round():
    acc = RDPAccountant()
    for _ in range(1000):
        acc.step(1.1, 0.01)
    acc.step(2.0, 0.01, steps=3)
    acc.step(1.1, 0.01)
    state = acc.state_dict()
    assert state["history"] == [[1.1, 0.01, 1, 1000], [2.0, 0.01, 3, 1], [1.1, 0.01, 1, 1]]
    back = RDPAccountant()
    back.load_state_dict(json.loads(json.dumps(state)))
    assert back.history == acc.history and back.get_privacy_spent(1e-5) == acc.get_privacy_spent(1e-5)
    np.testing.assert_array_equal(back.rdp, acc.rdp)


def _valid_state() -> dict:
    dp = CentralDP(1.0, 1.1, sampling_rate=0.05, seed=3)
    _rounds(dp, 3)
    return json.loads(json.dumps(dp.state_dict()))


def _set(path: tuple, value):
    def mutate(state: dict) -> None:
        node = state
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return mutate


_DELETE = object()
_HOSTILE = {
    "not an object": (lambda s: s.clear() or s.update({"x": 1}), "keys accountant, rng"),
    "extra key": (_set(("extra",), 1), "keys accountant, rng"),
    "no rng": (_set(("rng",), _DELETE), "keys accountant, rng"),
    "orders shorter": (_set(("accountant", "orders"), lambda v: v[:-1]), "accountant.orders"),
    "orders shifted": (_set(("accountant", "orders", 3), 1.45), r"accountant.orders\[3\]"),
    "orders as string": (_set(("accountant", "orders"), "1.1,1.2"), "accountant.orders"),
    "order huge int": (_set(("accountant", "orders", 0), 10 ** 400), r"accountant.orders\[0\]"),
    "rdp shorter": (_set(("accountant", "rdp"), lambda v: v[1:]), "accountant.rdp"),
    "rdp NaN": (_set(("accountant", "rdp", 0), float("nan")), r"accountant.rdp\[0\]"),
    "rdp negative": (_set(("accountant", "rdp", 5), -0.1), r"accountant.rdp\[5\]"),
    "rdp string": (_set(("accountant", "rdp", 2), "0.1"), r"accountant.rdp\[2\]"),
    "rdp bool": (_set(("accountant", "rdp", 2), True), r"accountant.rdp\[2\]"),
    "rdp null": (_set(("accountant", "rdp", 2), None), r"accountant.rdp\[2\]"),
    "rdp halved": (_set(("accountant", "rdp"), lambda v: [x / 2 for x in v]), "not what the stored history gives"),
    "rdp inf": (_set(("accountant", "rdp", 7), "inf"), "not what the stored history gives"),
    "history dropped": (_set(("accountant", "history"), []), "not what the stored history gives"),
    "history fewer calls": (_set(("accountant", "history", 0, 3), 2), "not what the stored history gives"),
    "history not a list": (_set(("accountant", "history"), {"a": 1}), "accountant.history"),
    "run too short": (_set(("accountant", "history", 0), [1.1, 0.05, 1]), r"accountant.history\[0\]"),
    "noise negative": (_set(("accountant", "history", 0, 0), -1.1), r"history\[0\]\[0\]"),
    "noise NaN": (_set(("accountant", "history", 0, 0), float("nan")), r"history\[0\]\[0\]"),
    "rate above 1": (_set(("accountant", "history", 0, 1), 1.5), r"history\[0\]\[1\]"),
    "steps float": (_set(("accountant", "history", 0, 2), 1.0), r"history\[0\]\[2\]"),
    "steps negative": (_set(("accountant", "history", 0, 2), -1), r"history\[0\]\[2\]"),
    "calls zero": (_set(("accountant", "history", 0, 3), 0), r"history\[0\]\[3\]"),
    "calls bool": (_set(("accountant", "history", 0, 3), True), r"history\[0\]\[3\]"),
    "calls huge": (_set(("accountant", "history", 0, 3), 10 ** 12), r"history\[0\]\[3\]"),
    "other generator": (_set(("rng", "bit_generator"), "MT19937"), "rng.bit_generator"),
    "rng state negative": (_set(("rng", "state", "state"), -1), "rng.state.state"),
    "rng state too wide": (_set(("rng", "state", "state"), 1 << 128), "rng.state.state"),
    "rng state string": (_set(("rng", "state", "state"), "12"), "rng.state.state"),
    "rng inc even": (_set(("rng", "state", "inc"), lambda v: v - 1), "rng.state.inc"),
    "rng missing inc": (_set(("rng", "state", "inc"), _DELETE), "rng.state"),
    "rng has_uint32 2": (_set(("rng", "has_uint32"), 2), "rng.has_uint32"),
    "rng extra key": (_set(("rng", "seed"), 1), "rng"),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_hostile_dp_states_are_refused_and_change_nothing(case):
    mutate, match = _HOSTILE[case]
    state = _valid_state()
    mutate(state)
    dp = CentralDP(1.0, 1.1, sampling_rate=0.05, seed=3)
    _rounds(dp, 1)
    before = copy.deepcopy(dp.state_dict())
    with pytest.raises(StateError, match=match):
        dp.load_state_dict(state)
    assert dp.state_dict() == before  # nothing half-loaded


def test_dp_state_with_other_orders_is_refused():
    state = _valid_state()
    dp = CentralDP(1.0, 1.1, sampling_rate=0.05, orders=OPACUS_ORDERS)
    with pytest.raises(StateError, match="accountant.orders"):
        dp.load_state_dict(state)
    with pytest.raises(StateError, match="accountant"):
        RDPAccountant().load_state_dict(state)  # a CentralDP state is not an accountant state


def test_bad_accounting_inputs_are_refused_not_turned_into_nan():
    for orders in ([float("nan")], [0.5], [2.0 ** 21]):
        with pytest.raises(ConfigError, match="order"):
            compute_rdp(0.1, 1.0, 1, orders)
    for z in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ConfigError, match="noise_multiplier"):
            compute_rdp(0.1, z, 1, [2.0])
    for steps in (1.5, True, -1):
        with pytest.raises(ConfigError, match="steps"):
            compute_rdp(0.1, 1.0, steps, [2.0])
    # zero steps spend nothing, even where one step's RDP is infinite
    np.testing.assert_array_equal(compute_rdp(0.1, 0.0, 0, [2.0, 3.0]), [0.0, 0.0])
    assert compute_rdp(0.1, 0.0, 0, 2.0) == 0.0
    with pytest.raises(ConfigError, match="RDP values"):
        rdp_to_epsilon([2.0, 3.0], [0.1, float("nan")], 1e-5)
    for orders in ([1.0, 2.0], [2.0, float("inf")], [2.0, True], "123", [], [2.0 ** 21]):
        with pytest.raises(ConfigError, match="order"):
            RDPAccountant(orders)


def test_refine_integer_order_finds_the_best_integer():
    # eps of the Gaussian mechanism (q = 1): smooth, one minimum; compare with every integer
    rdp_at = lambda a: 3 * a / (2 * 40.0 ** 2)
    lo, hi = 64, 400
    every = [float(a) for a in range(lo, hi + 1)]
    best = rdp_to_epsilon(every, [rdp_at(a) for a in every], 1e-5)
    assert refine_integer_order(rdp_at, lo, hi, 1e-5) == best
    # a curve with two dips: the answer is still an evaluated order's epsilon, never above the ends
    wavy = lambda a: 0.01 * a / 64 + (0.5 if 100 < a < 300 else 0.0)
    eps, order = refine_integer_order(wavy, lo, hi, 1e-5)
    assert eps == pytest.approx(rdp_to_epsilon([order], [wavy(order)], 1e-5)[0])
    ends = rdp_to_epsilon([lo, hi], [wavy(lo), wavy(hi)], 1e-5)[0]
    assert eps <= ends
    with pytest.raises(ConfigError):
        refine_integer_order(rdp_at, 10, 5, 1e-5)
    with pytest.raises(ConfigError, match="RDP values"):
        refine_integer_order(lambda a: float("nan"), 64, 70, 1e-5)
