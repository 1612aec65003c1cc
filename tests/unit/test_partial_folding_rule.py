"""One rule for pre-added sums, applied everywhere sums arrive pre-added.

A strategy can take partial sums (a site's aggregate at the root, a site's own sums, a secure-aggregation
total, ingestion workers' partial sums) only if it has ``add_partial``. Before, four places each kept their
own copy: a name list in the root check, another in the site check, a third in the secagg check, and
``hasattr`` in the round manager and in the ingest workers' attach -- so a user's FedAvg subclass named
"file.py:Class" was refused with secagg and at a root although it folds sums, and a holding custom
strategy got past the name lists.
"""

from __future__ import annotations

import textwrap

import pytest

from edgeflow import zoo
from edgeflow.errors import ConfigError
from edgeflow.gateway.hierarchy import check_root_config, check_site_config
from edgeflow.gateway.ingest import SharedIngest
from edgeflow.gateway.rounds import RoundConfig, RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.gateway.strategies import folds_partials, partial_folding_strategies
from edgeflow.signing import KeyRing, PrivateKey
from edgeflow.transport.loopback import LoopbackBroker


@pytest.fixture()
def custom(tmp_path):
    path = tmp_path / "my_strategies.py"
    path.write_text(textwrap.dedent("""
        from edgeflow.gateway.strategies import FedAvg, Median

        class Summing(FedAvg):
            pass

        class Holding(Median):
            pass
    """))
    return {"summing": f"{path}:Summing", "holding": f"{path}:Holding"}


def test_the_rule_is_add_partial_for_names_classes_and_objects(custom):
    assert folds_partials("fedavg") and folds_partials("FedAdam") and folds_partials(custom["summing"])
    assert not folds_partials("median") and not folds_partials("fedavg-krum") and not folds_partials("bulyan")
    assert not folds_partials(custom["holding"])
    assert "fedavg" in partial_folding_strategies() and "krum" not in partial_folding_strategies()


def test_each_place_applies_the_same_rule(custom, tmp_path):
    for name, ok in (("fedavg", True), ("median", False), (custom["summing"], True), (custom["holding"], False)):
        checks = {
            "root": lambda: check_root_config(RoundConfig(strategy=name)),
            "site": lambda: check_site_config(RoundConfig(strategy=name)),
            "secagg": lambda: RoundConfig(strategy=name, min_clients=3, secagg={}),
            "workers": lambda: RoundManager(
                LoopbackBroker().transport(client_id="lab-gateway"), GatewayStore(tmp_path / f"{len(name)}.sqlite"),
                fleet="lab", fleet_key=PrivateKey.generate(), keyring=KeyRing(), model=zoo.digits_mlp(seed=0),
                config=RoundConfig(rounds=1, strategy=name), candidates=lambda: [], ingest=SharedIngest()),
        }
        for where, check in checks.items():
            if ok:
                check()
            else:
                with pytest.raises(ConfigError, match="needs each|cannot be split"):
                    check()
