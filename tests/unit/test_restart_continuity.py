"""A gateway restart changes nothing: a run stopped after any round and restarted on the same state
gives the same global model, bit for bit, and the same privacy spent, as a run that never stopped.

Real RoundManagers and real federated Clients over a loopback hub (no broker); the state is a real
store, SQLite and PostgreSQL (tests/_stores.py). What a restart must carry over: the strategy's
cross-round state (the norm bound's reference, the server optimizer's moments, the DP accountant and
its noise generator), stored with each round's end in one transaction, and the selection generator.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from _lbfleet import LoopbackFleet
from _stores import drop_schema, pg_available, pg_schema_url

from edgeflow.errors import StateError
from edgeflow.gateway.rounds import RoundManager
from edgeflow.gateway.store import GatewayStore, parse_store_url

ROUNDS = 4
STRATEGIES = {
    "fedavg (default bound)": {"strategy": "fedavg"},
    "fedadam": {"strategy": "fedadam", "strategy_params": {"eta": 0.05}},
    "fedavgm": {"strategy": "fedavgm", "strategy_params": {"server_momentum": 0.9}},
    "fedyogi": {"strategy": "fedyogi", "strategy_params": {"eta": 0.05}},
    "central dp": {"strategy": "fedavg", "dp": {"clip_norm": 1.0, "noise_multiplier": 0.8, "seed": 7}},
    "fedavg-krum": {"strategy": "fedavg-krum", "min_clients": 5, "strategy_params": {"num_byzantine": 1}},
    "krum-reputation": {"strategy": "krum-reputation", "strategy_params": {"num_byzantine": 1}},  # suspicions + momentum
    "auto": {"strategy": "auto"},  # krum-reputation here; the restart resolves it again from the stored state
}


@pytest.fixture(params=["sqlite", "postgresql"])
def new_state(request, tmp_path):
    """A factory of fresh, empty gateway states on one engine (a restart reopens the same one)."""
    schemas: list[str] = []
    if request.param == "postgresql" and (why := pg_available()) is not None:
        pytest.skip(why)

    def make():
        if request.param == "sqlite":
            return parse_store_url(str(tmp_path / f"gw{uuid.uuid4().hex[:8]}.sqlite"))
        schemas.append(f"ef_test_{uuid.uuid4().hex[:12]}")
        return parse_store_url(pg_schema_url(schemas[-1]))

    yield make
    for schema in schemas:
        drop_schema(schema)


def _fleet(target, config: dict, *, fraction: float = 1.0) -> LoopbackFleet:
    def factory(transport, _store, **kw):
        return RoundManager(transport, GatewayStore(target), **kw)

    cfg = {"rounds": ROUNDS, "seed": 3, "fraction": fraction, "min_clients": 2, **config}
    return LoopbackFleet(5, config=cfg, rounds_factory=factory, seed=2)


def _restart(fleet: LoopbackFleet, target) -> None:
    """The gateway process dies between rounds: a new RoundManager on the same state and fleet."""
    old = fleet.rounds
    old.stop()
    fleet.gateway_transport.close(timeout=1, flush=False)
    old.store.close()
    fleet.gateway_transport = fleet.hub.transport(f"{fleet.fleet}-gateway")
    fleet.rounds = RoundManager(fleet.gateway_transport, GatewayStore(target), fleet=fleet.fleet,
                                fleet_key=fleet.fleet_key, keyring=fleet.ring, model=fleet.model,
                                config=old.config, candidates=fleet.candidates)
    fleet.rounds.start()
    fleet.gateway_transport.connect()


def _run(target, config: dict, *, stop_after: int | None, fraction: float = 1.0):
    fleet = _fleet(target, config, fraction=fraction)
    with fleet:
        if stop_after is None:
            history = fleet.rounds.run()
        else:
            history = fleet.rounds.run(stop_after)
            _restart(fleet, target)
            history += fleet.rounds.run()  # the rest of the job's rounds
        weights = {k: v.copy() for k, v in fleet.rounds.weights.items()}
        version = fleet.rounds.version
        selected = [r.selected for r in fleet.rounds.store.rounds()]
    return weights, version, history, selected


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_restart_between_rounds_changes_nothing(new_state, name):
    config = STRATEGIES[name]
    plain_w, plain_v, plain_h, _ = _run(new_state(), config, stop_after=None)
    assert len(plain_h) == ROUNDS and all(m.participants >= 2 for m in plain_h)
    for k in range(1, ROUNDS):  # every round boundary
        w, v, h, _ = _run(new_state(), config, stop_after=k)
        assert v == plain_v and len(h) == ROUNDS
        for t in plain_w:
            np.testing.assert_array_equal(w[t], plain_w[t], err_msg=f"{name}: restart after round {k}, {t}")
        if "dp" in config:
            assert h[-1].extra["dp_epsilon"] == plain_h[-1].extra["dp_epsilon"]
            assert h[-1].extra["dp_rounds"] == ROUNDS


def test_partial_selection_follows_the_same_draws_after_a_restart(tmp_path):
    """fraction < 1: which devices a round takes comes from the seeded generator; a restart resumes it."""
    w0, _, _, plain = _run(str(tmp_path / "a.sqlite"), {"strategy": "fedavg"}, stop_after=None, fraction=0.6)
    w1, _, _, resumed = _run(str(tmp_path / "b.sqlite"), {"strategy": "fedavg"}, stop_after=2, fraction=0.6)
    assert len(plain) == ROUNDS and all(len(s) == 3 for s in plain)
    assert plain == resumed
    for t in w0:
        np.testing.assert_array_equal(w0[t], w1[t])


def test_a_damaged_strategy_state_is_one_clear_error_not_a_silent_reset(tmp_path):
    path = str(tmp_path / "s.sqlite")
    _run(path, STRATEGIES["fedadam"], stop_after=None)
    store = GatewayStore(path)
    store.execute_sql("UPDATE strategy_state SET state=? WHERE round_id=(SELECT MAX(round_id) FROM strategy_state)",
                      (b"not a state",))
    store.close()
    with pytest.raises(StateError, match="strategy state"):
        _fleet(path, STRATEGIES["fedadam"])
