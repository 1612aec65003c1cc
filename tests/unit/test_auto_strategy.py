"""``[rounds] strategy = "auto"``: resolved once, when the gateway starts, by one rule
(gateway/strategies.py ``resolve_strategy``): krum-reputation where the gateway sees each update,
FedAvg where it sees only sums (secure aggregation, site partials, ingestion workers' partial sums),
in FedBuff mode, with central DP, and on a state whose run began with FedAvg. Real RoundManagers and
real Clients over a loopback hub (tests/unit/_lbfleet.py)."""

from __future__ import annotations

import logging

import pytest
from _lbfleet import LoopbackFleet

from edgeflow.errors import ConfigError
from edgeflow.gateway.hierarchy import check_root_config, check_site_config
from edgeflow.gateway.rounds import RoundConfig, RoundManager
from edgeflow.gateway.service import load_config
from edgeflow.gateway.store import GatewayStore
from edgeflow.gateway.strategies import FedAvg, KrumReputation, folds_partials, resolve_strategy
from edgeflow.gateway.web.view import WebView

LINE = 'strategy auto -> krum-reputation (backdoor defence; set strategy = "fedavg" for plain FedAvg)'


@pytest.mark.parametrize("context,expected", [
    ({}, "krum-reputation"),
    ({"sums_only": "secure aggregation reveals only the sum"}, "fedavg"),
    ({"mode": "async"}, "fedavg"),
    ({"dp": True}, "fedavg"),
    ({"stored": "FedAvg"}, "fedavg"),
    ({"stored": ""}, "fedavg"),  # rounds closed before strategy states were stored: FedAvg's
    ({"stored": "KrumReputation"}, "krum-reputation"),
], ids=["each-update", "secagg", "async", "dp", "fedavg-state", "pre-state", "own-state"])
def test_auto_resolves_by_what_the_gateway_sees(context, expected):
    choice = resolve_strategy("auto", **context)
    assert choice.name == expected and choice.auto and choice.why
    assert choice.describe().startswith(f"strategy auto -> {expected} (")
    # a named strategy is never changed, whatever the context
    assert resolve_strategy("fedavg", **context).name == "fedavg"
    assert resolve_strategy("fedavg", **context).describe() == "strategy fedavg"


def test_auto_strategy_params_are_checked_when_the_configuration_is_read():
    assert RoundConfig(strategy="auto", strategy_params={"num_byzantine": 2}).resolve_strategy().name == \
        "krum-reputation"
    assert RoundConfig(strategy="auto", strategy_params={"clip": "off"}).resolve_strategy().name == "fedavg"
    for params, says in (({"nope": 1}, "neither krum-reputation's nor fedavg's"),
                         ({"num_byzantine": 1, "clip": "off"}, "name the strategy")):
        with pytest.raises(ConfigError) as ei:
            RoundConfig(strategy="auto", strategy_params=params)
        assert says in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(ConfigError, match="runs fedavg here"):  # secagg makes it FedAvg: Krum's f is meaningless
        RoundConfig(strategy="auto", strategy_params={"num_byzantine": 1}, secagg={})


def test_auto_passes_every_sums_only_check_and_secagg_makes_it_fedavg():
    assert folds_partials("auto")
    check_root_config(RoundConfig(strategy="auto"))
    check_site_config(RoundConfig(strategy="auto"))
    assert RoundConfig(strategy="auto", secagg={}).resolve_strategy().name == "fedavg"


def test_a_manager_with_auto_runs_krum_reputation_logs_it_once_and_shows_it(caplog):
    caplog.set_level(logging.INFO, logger="edgeflow.gateway.rounds")
    with LoopbackFleet(5, config={"strategy": "auto", "rounds": 2}) as fleet:
        assert isinstance(fleet.rounds.strategy, KrumReputation) and fleet.rounds.strategy.num_byzantine == 1
        history = fleet.rounds.run()
        assert fleet.rounds.strategy_name == "krum-reputation"
        assert WebView(fleet.rounds).state()["strategy"] == "krum-reputation"
        agg = fleet.rounds.strategy
        assert len(agg.selected_clients) == 4 and len(agg.suspicion) == 5  # 5 updates: the f = 1 most suspicious out
    assert len(history) == 2
    assert [r.getMessage() for r in caplog.records].count(LINE) == 1


class _SumsOnly:
    """An update source whose workers hand over partial sums (as gateway/ingest.py SharedIngest)."""

    folds_partials = True


@pytest.mark.parametrize("kw", [{"contributions": "partials"}, {"ingest": _SumsOnly()}], ids=["root", "ingest"])
def test_auto_is_fedavg_where_the_manager_sees_only_sums(kw, caplog):
    caplog.set_level(logging.INFO, logger="edgeflow.gateway.rounds")
    fleet = LoopbackFleet(3, config={"strategy": "auto"}, **kw)
    try:
        assert type(fleet.rounds.strategy) is FedAvg and fleet.rounds.strategy_name == "fedavg"
        assert any(r.getMessage().startswith("strategy auto -> fedavg (the gateway sees only sums: ")
                   for r in caplog.records)
    finally:
        fleet.close()


def test_auto_in_async_mode_is_fedavg():
    fleet = LoopbackFleet(3, config={"strategy": "auto", "mode": "async"})
    try:
        assert type(fleet.rounds.strategy) is FedAvg
    finally:
        fleet.close()


def test_gateway_toml_accepts_auto_and_names_a_bad_parameter_of_it(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[rounds]\nstrategy = "auto"\nstrategy_params = { num_byzantine = 1 }\n', encoding="utf-8")
    assert load_config(good).rounds.strategy == "auto"
    bad = tmp_path / "bad.toml"
    bad.write_text('[rounds]\nstrategy = "auto"\nstrategy_params = { nope = 1 }\n', encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        load_config(bad)
    assert "rounds.strategy_params" in str(ei.value) and "nope" in str(ei.value) and "\n" not in str(ei.value)


def test_a_state_that_began_with_fedavg_goes_on_with_fedavg_under_auto(tmp_path):
    """The upgrade case: a run under FedAvg, restarted with strategy "auto", must not change optimizer
    mid-run (its stored FedAvg state would not restore into krum-reputation); a fresh state gets the defence."""
    path = str(tmp_path / "s.sqlite")

    def factory(transport, _store, **kw):
        return RoundManager(transport, GatewayStore(path), **kw)

    with LoopbackFleet(5, config={"strategy": "fedavg", "rounds": 1}, rounds_factory=factory) as fleet:
        assert len(fleet.rounds.run()) == 1
    with LoopbackFleet(5, config={"strategy": "auto", "rounds": 2}, rounds_factory=factory) as fleet:
        assert type(fleet.rounds.strategy) is FedAvg
        assert "this state's run began with FedAvg" in fleet.rounds.strategy_choice.why
        assert len(fleet.rounds.run()) == 1  # the job's second round, on FedAvg
