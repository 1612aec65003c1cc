"""Asynchronous (FedBuff) rounds without a broker: the RoundManager's AsyncRounds collaborator
(gateway/async_rounds.py) with real federated Clients over loopback transports
(tests/test_federated_rounds.py runs FedBuff on Mosquitto)."""

from __future__ import annotations

from _lbfleet import LoopbackFleet

from edgeflow.gateway.async_rounds import AsyncRounds
from edgeflow.protocol.rounds import RoundAnnouncement
from edgeflow.transport.topics import gateway_topic


def test_fedbuff_publishes_a_version_every_k_updates_in_one_session():
    fleet = LoopbackFleet(6, config={"mode": "async", "async_buffer": 3, "rounds": 3, "deadline_s": 10})
    assert isinstance(fleet.rounds.async_rounds, AsyncRounds)
    with fleet:
        v0 = fleet.rounds.version
        history = fleet.rounds.run()
        fleet.hub.settle()
        assert len(history) == 3 and all(m.participants == 3 for m in history)
        assert [m.model_version for m in history] == [v0 + 1, v0 + 2, v0 + 3] and fleet.rounds.version == v0 + 3
        # one session (one round id) for every version; closed in the store and in the retained announcement
        assert {m.round_id for m in history} == {1}
        assert fleet.rounds.store.round(1).state == "closed"
        ann = RoundAnnouncement.verify(fleet.hub.retained()[str(gateway_topic("lb", "round"))],
                                       fleet.fleet_key.public_key)
        assert (ann.round_id, ann.mode, ann.state) == (1, "async", "closed")


def test_a_partial_buffer_becomes_a_version_after_the_deadline():
    """A straggler keeps the buffer short of K: after ``deadline_s`` what the buffer has is flushed."""
    fleet = LoopbackFleet(3, config={"mode": "async", "async_buffer": 3, "rounds": 1, "deadline_s": 1.0})
    fleet.clients[2].delay_s = 30.0  # trains, then sleeps past the deadline
    with fleet:
        v0 = fleet.rounds.version
        (m,) = fleet.rounds.run()
        assert m.model_version == v0 + 1 and m.participants == 2


def test_a_buffer_larger_than_the_fleet_holds_every_device_instead_of_waiting_for_the_deadline():
    """One update per device per buffer: with K above the devices selected a buffer could only fill by its
    deadline; the session takes K = the devices selected (the default K of 15 on a fleet of 4)."""
    fleet = LoopbackFleet(4, config={"mode": "async", "rounds": 2, "deadline_s": 60.0})
    assert fleet.rounds.config.async_buffer == 15
    with fleet:
        history = fleet.rounds.run()
        assert fleet.rounds.async_rounds.buffer_size(4) == 4 and fleet.rounds.async_rounds.buffer_size(20) == 15
        assert [m.participants for m in history] == [4, 4]
