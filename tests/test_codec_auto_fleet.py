"""codec 'auto' end to end: a gateway and 8 devices over a real Mosquitto, signed compact-envelope updates."""

from __future__ import annotations

import pytest

from _brokers import mosquitto_factory  # noqa: F401  (fixture)
from edgeflow.sim.simulation import SimConfig, SimulatedFleet

pytestmark = pytest.mark.integration


def _run(broker, **kw):
    cfg = SimConfig(devices=8, rounds=4, alpha=0.3, seed=0, deadline_s=20, **kw)
    with SimulatedFleet(cfg, broker.url) as fleet:
        metrics = fleet.run()
        up, dense = fleet.upload_bytes()
    return metrics, up, dense


@pytest.mark.parametrize(("opts", "max_ratio", "max_update"), [
    ({}, 0.03, None),                   # the digits MLP is small: topk-packed, 3%, 2 bits
    ({"budget": 400}, 0.016, 400),      # a link budget per update, envelope and signature included
])
def test_every_auto_update_is_accepted_counted_and_within_its_budget(mosquitto_factory, opts, max_ratio,  # noqa: F811
                                                                      max_update):
    metrics, up, dense = _run(mosquitto_factory(), codec="auto", codec_opts=opts)
    assert [m.participants for m in metrics] == [8] * 4 and all(m.rejected == 0 for m in metrics)
    assert sum(m.bytes_in for m in metrics) == up  # the gateway decoded and counted every byte sent
    assert up / dense < max_ratio
    if max_update is not None:
        assert up / (8 * 4) <= max_update
    accuracy = [m.accuracy for m in metrics]
    assert accuracy[-1] > accuracy[0] + 0.15, accuracy  # it learns (10 classes)


@pytest.mark.parametrize(("codec", "opts", "match"), [
    ("auto", {"budget": 40}, "budget must be a whole number of bytes >= 128"),
    ("topk-packed", {"bits": 12}, "bits must be an integer in 1..8"),
])
def test_bad_codec_options_stop_the_simulation_before_it_starts(codec, opts, match) -> None:
    # before: every device failed to encode, round after round, until the deadline ran out
    from edgeflow.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        SimulatedFleet(SimConfig(devices=2, rounds=1, codec=codec, codec_opts=opts), "mqtt://127.0.0.1:9")
