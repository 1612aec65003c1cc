"""edgeflow's server optimizers step as Flower's own strategies do: FedAvg, FedAvgM, FedAdam (with
``bias_correction = "flower"``), FedYogi and FedAdagrad, run for 4 rounds on the same client updates, against
Flower 1.42's classes themselves (``aggregate_fit``), not a transcription. Flower runs in its own venv
(tests/_flower.py); without it these skip, saying how to make it."""

from __future__ import annotations

import numpy as np
import pytest
from _flower import run_flower

from edgeflow.gateway.strategies import make_aggregator

UNBOUNDED = {"clip": "off", "sample_multiplier": "off"}

# edgeflow's name and settings -> Flower's class and the same settings in its names
PAIRS = {
    "fedavg": ({}, "FedAvg", {}),
    "fedavgm": ({"server_lr": 0.7, "server_momentum": 0.9}, "FedAvgM",
                {"server_learning_rate": 0.7, "server_momentum": 0.9}),
    "fedadam": ({"eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3, "bias_correction": "flower"}, "FedAdam",
                {"eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    "fedyogi": ({"eta": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}, "FedYogi",
                {"eta": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    "fedadagrad": ({"eta": 0.1, "tau": 1e-3}, "FedAdagrad", {"eta": 0.1, "tau": 1e-3}),
}


def _rounds(seed: int = 7, rounds: int = 4):
    rng = np.random.default_rng(seed)
    shapes = [(4, 3), (3,)]
    initial = [rng.standard_normal(s) for s in shapes]
    data = [[([0.1 * rng.standard_normal(s) for s in shapes], int(rng.integers(1, 50))) for _ in range(3)]
            for _ in range(rounds)]
    return initial, data


def _edgeflow(name: str, params: dict, initial, data) -> list[list[np.ndarray]]:
    agg = make_aggregator(name, **params, **UNBOUNDED)
    weights = {f"t{i}": a.copy() for i, a in enumerate(initial)}
    out = []
    for r, clients in enumerate(data, start=1):
        agg.begin_round(weights, r)
        for c, (deltas, n) in enumerate(clients):
            agg.add({f"t{i}": d.copy() for i, d in enumerate(deltas)}, n, client_id=f"c{c}")
        weights = agg.finish().weights
        out.append([weights[f"t{i}"] for i in range(len(initial))])
    return out


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_each_round_is_flowers_to_rounding(name):
    ours, flower_class, flower_params = PAIRS[name]
    initial, data = _rounds()
    flower = run_flower("strategy_rounds", strategy=flower_class, kwargs=flower_params, initial=initial, rounds=data)
    mine = _edgeflow(name, ours, initial, data)
    assert len(flower) == len(mine) == 4
    for r, (f, m) in enumerate(zip(flower, mine), start=1):
        for t, (a, b) in enumerate(zip(f, m)):
            np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12, err_msg=f"{name}: round {r}, tensor {t}")
    # the rounds moved the model (a parity of no-ops would prove nothing)
    assert not np.allclose(mine[-1][0], initial[0], atol=1e-3)


def test_the_default_fedadam_is_not_flowers():
    """edgeflow's default bias correction counts from 1 (Kingma & Ba), Flower's from round + 1: the parity
    above holds only with ``bias_correction = "flower"``, as docs/aggregation.md says."""
    ours, flower_class, flower_params = PAIRS["fedadam"]
    initial, data = _rounds()
    flower = run_flower("strategy_rounds", strategy=flower_class, kwargs=flower_params, initial=initial, rounds=data)
    mine = _edgeflow("fedadam", {k: v for k, v in ours.items() if k != "bias_correction"}, initial, data)
    assert not np.allclose(mine[0][0], flower[0][0], rtol=1e-6)
