"""Secure aggregation over the wire without a broker: the gateway's SecAggServer round and
the devices' SecAggClients exchange every protocol message through loopback transports
(tests/test_federated_rounds.py runs the same on Mosquitto; test_secagg.py the math alone)."""

from __future__ import annotations

import numpy as np
import pytest
from _lbfleet import LoopbackFleet

from edgeflow.gateway.rounds import model_weights
from edgeflow.transport.topics import device_filter, device_topic, gateway_topic


def _gone(delta, round_id):
    return None  # trained, shared its keys, then vanished before sending its masked input


def test_two_dropouts_after_sharing_keys_still_give_plain_fedavg_of_the_survivors():
    fleet = LoopbackFleet(6, config={"secagg": {"max_dropout_fraction": 0.4}, "deadline_s": 3.0},
                                              transform={0: _gone, 1: _gone})
    seen: list[str] = []
    with fleet:
        spy = fleet.hub.transport("spy").connect()
        spy.subscribe(str(device_filter("lb", "update")), lambda m: seen.append(m.topic))
        spy.subscribe(str(device_filter("lb", "secagg")), lambda m: seen.append(m.topic))
        start = model_weights(fleet.model)
        (m,) = fleet.rounds.run(1)
        assert (m.participants, m.dropped) == (4, 2) and m.extra["secagg_dropped"] == 2
        survivors = fleet.clients[2:]
        n = np.array([len(c.y) for c in survivors], dtype=np.float64)
        for name in start:
            deltas = np.stack([c.last_delta[name].astype(np.float64) for c in survivors])
            want = start[name] + np.tensordot(n / n.sum(), deltas, axes=1)
            np.testing.assert_allclose(fleet.rounds.weights[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        fleet.hub.settle()
        # the gateway never held an individual update: nothing travelled on an update topic
        assert not any(t.endswith("/update") for t in seen)
        senders = {t.split("/")[2] for t in seen} - {"gateway"}  # device_filter's + also matches gateway/secagg
        assert senders == {c.device_id for c in fleet.clients}  # everyone took part in the key phases
        assert all(c.stats.updates_sent == 0 for c in fleet.clients[:2])
        assert fleet.rounds.counters_total.get("rejected_secagg", 0) == 0


def test_beyond_the_dropout_threshold_the_round_fails_and_the_model_stays():
    cfg = {"secagg": {"max_dropout_fraction": 0.2, "phase_timeout_s": 1.0}, "deadline_s": 1.5}
    fleet = LoopbackFleet(5, config=cfg, transform={0: _gone, 1: _gone, 2: _gone})
    with fleet:
        before = {k: v.copy() for k, v in fleet.rounds.weights.items()}
        (m,) = fleet.rounds.run(1)
        assert m.participants == 0 and m.accuracy is None
        assert fleet.rounds.store.round(1).state == "failed" and fleet.rounds.version == 1
        for k, v in fleet.rounds.weights.items():
            np.testing.assert_array_equal(v, before[k])


def test_a_forged_secagg_frame_is_refused_and_the_round_still_completes():
    fleet = LoopbackFleet(4, config={"secagg": {"max_dropout_fraction": 0.3}, "deadline_s": 10.0})
    with fleet:
        evil = fleet.hub.transport("evil").connect()
        victim = fleet.clients[0].device_id
        topic = str(device_topic("lb", victim, "secagg"))
        forged: list[int] = []

        def forge(msg) -> bool:  # as soon as the victim advertises, a forged frame on its topic
            if msg.topic == topic and not forged:
                forged.append(1)
                evil.publish(topic, b"\x00" * 64)  # (the broker ACL would stop this; the gateway must not rely on it)
            return False

        fleet.hub.drop(forge)
        (m,) = fleet.rounds.run(1)
        assert forged and m.participants == 4 and m.extra["secagg_dropped"] == 0
        assert fleet.rounds.counters_total.get("rejected_secagg", 0) == 1


def test_keys_advertised_before_the_announcement_is_acknowledged_are_kept():
    fleet = LoopbackFleet(4, config={"secagg": {"max_dropout_fraction": 0.3, "phase_timeout_s": 2.0},
                                     "deadline_s": 3.0})
    # the devices get the announcement at once; the gateway's PUBACK for it comes 0.3 s later
    fleet.hub.delay_ack(str(gateway_topic("lb", "round")), 0.3, times=1)
    with fleet:
        (m,) = fleet.rounds.run(1)
        late = fleet.rounds.counters_total.get("late", 0)
        assert (m.participants, late) == (4, 0), f"{m.participants} participants, {late} secagg frames dropped as late"
