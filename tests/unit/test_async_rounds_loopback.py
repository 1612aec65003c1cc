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
    """Fewer devices than the buffer holds: after ``deadline_s`` what the buffer has is flushed."""
    fleet = LoopbackFleet(2, config={"mode": "async", "async_buffer": 5, "rounds": 1, "deadline_s": 1.0})
    with fleet:
        v0 = fleet.rounds.version
        (m,) = fleet.rounds.run()
        assert m.model_version == v0 + 1 and 1 <= m.participants <= 2
