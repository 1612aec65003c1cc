"""SimConfig is built from RoundConfig and TrainConfig: one set of defaults (issue 16, item 5)."""

from __future__ import annotations

from dataclasses import MISSING, fields

import pytest

from edgeflow.errors import ConfigError
from edgeflow.gateway.rounds import RoundConfig
from edgeflow.protocol.rounds import TrainConfig
from edgeflow.sim.simulation import ROUND_KNOBS, SIM_DEFAULTS, TRAIN_KNOBS, SimConfig


def _default(f):
    return f.default if f.default is not MISSING else f.default_factory()


def test_every_shared_setting_takes_the_gateways_default_unless_named_in_sim_defaults():
    sim = {f.name: _default(f) for f in fields(SimConfig)}
    for cls, names in ((RoundConfig, ROUND_KNOBS), (TrainConfig, TRAIN_KNOBS)):
        for f in fields(cls):
            if f.name in names:
                want = SIM_DEFAULTS.get(f.name, _default(f))
                assert sim[f.name] == want, (cls.__name__, f.name)
    # and a simulation repeats no other RoundConfig or TrainConfig setting under its own default
    # (``profiles`` is another thing there: the simulated devices' boards, not the gateway's filter)
    shared = set(sim) & ({f.name for f in fields(RoundConfig)} | {f.name for f in fields(TrainConfig)})
    assert shared - {"profiles"} == set(ROUND_KNOBS) | set(TRAIN_KNOBS)
    assert set(SIM_DEFAULTS) <= shared


def test_the_default_simulation_runs_the_round_and_training_config_it_says():
    rc = SimConfig().round_config(wait_for_devices_s=10.0)
    assert rc == RoundConfig(deadline_s=30.0, wait_for_devices_s=10.0,
                             train=TrainConfig(epochs=2, batch_size=16, lr=0.1))


def test_settings_flow_into_the_round_and_training_config():
    cfg = SimConfig(devices=4, deadline_s=5, quorum=0.5, lr=0.2, codec="topk-int8", codec_opts={"ratio": 0.1},
                    strategy="median", seed=3)
    rc = cfg.round_config()
    assert (rc.deadline_s, rc.quorum, rc.strategy, rc.seed) == (5, 0.5, "median", 3)
    assert (rc.train.lr, rc.train.codec, rc.train.codec_opts) == (0.2, "topk-int8", {"ratio": 0.1})
    assert rc.train.codec_opts is not cfg.codec_opts  # a copy: the config cannot be changed under the gateway


def test_a_bad_setting_is_one_line():
    with pytest.raises(ConfigError, match="simulation: rounds must be an integer, got 'three'"):
        SimConfig(rounds="three")


def test_two_simulations_get_different_fleets_and_so_different_client_ids():
    """Client ids are fleet-device: two runs started in the same millisecond on one broker used to share
    a fleet name (milliseconds since the epoch) and took each other's sessions."""
    from edgeflow.sim.simulation import SimConfig

    names = {SimConfig().fleet for _ in range(50)}
    assert len(names) == 50
