"""Issue 31, finding "a device whose clock is 90 s fast trains every round but never sends": round
deadlines are counted on the device's clock from the announcement's receipt (``deadline - issued``),
and the device reports the offset it measured (``clock_skew_s`` in its update metadata and status)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "unit"))

from _lbfleet import LoopbackFleet  # noqa: E402

import edgeflow.federated.client as client_mod  # noqa: E402
from edgeflow.codecs import decode_update  # noqa: E402
from edgeflow.protocol.rounds import RoundAnnouncement  # noqa: E402
from edgeflow.transport.message import Message  # noqa: E402
from edgeflow.transport.topics import gateway_topic  # noqa: E402

_real_time = time.time


class _ClockAhead:
    """The devices' ``time`` module with a wall clock ``offset`` seconds off (everything else real)."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def time(self) -> float:
        return _real_time() + self.offset

    def __getattr__(self, name: str):
        return getattr(time, name)


def _watch_updates(fleet: LoopbackFleet) -> dict[str, dict]:
    """The metadata of every update the devices publish, by device (an observer on the hub)."""
    seen: dict[str, dict] = {}
    spy = fleet.hub.transport("spy")

    def on_update(msg: Message) -> None:
        upd = decode_update(msg.payload, verifier=fleet.ring, require_signature=True)
        seen[upd.device_id] = upd.metadata

    spy.subscribe(f"edgeflow/{fleet.fleet}/+/update", on_update)
    spy.connect()
    fleet.transports.append(spy)  # closed with the fleet
    return seen


def test_devices_whose_clock_is_90_s_fast_still_send_in_time(monkeypatch):
    """Every device's clock (the client module's time.time) runs 90 s ahead of the gateway's; the
    deadline is 15 s. Before: each trained, found its clock past the deadline and sent nothing, so the
    round failed. Now every update counts and each reports a skew of about +90 s."""
    monkeypatch.setattr(client_mod, "time", _ClockAhead(90.0))
    fleet = LoopbackFleet(3, config={"min_clients": 3, "deadline_s": 15, "rounds": 1})
    meta = _watch_updates(fleet)
    with fleet:
        history = fleet.rounds.run()
        fleet.hub.settle()
    assert len(history) == 1 and history[0].participants == 3 and not history[0].extra.get("failed")
    for c in fleet.clients:
        assert c.stats.updates_sent == 1 and c.stats.skipped_late == 0
        assert c.clock_skew_s == pytest.approx(90.0, abs=5.0)
        assert c.status()["clock_skew_s"] == c.clock_skew_s
    assert set(meta) == {c.device_id for c in fleet.clients}
    assert all(m["clock_skew_s"] == pytest.approx(90.0, abs=5.0) for m in meta.values())


def test_an_injected_clock_on_one_device_only():
    """One device with ``clock`` 90 s ahead beside two with the right time: all three count."""
    fleet = LoopbackFleet(3, config={"min_clients": 3, "deadline_s": 15, "rounds": 1})
    fleet.clients[0].clock = lambda: _real_time() + 90.0
    with fleet:
        (m,) = fleet.rounds.run()
    assert m.participants == 3
    assert fleet.clients[0].stats.skipped_late == 0 and fleet.clients[0].stats.updates_sent == 1
    assert fleet.clients[0].clock_skew_s == pytest.approx(90.0, abs=5.0)
    assert abs(fleet.clients[1].clock_skew_s) < 5.0


def test_a_retained_announcement_does_not_stretch_the_skew():
    """The skew is the smallest (receipt - issued) seen lately: an announcement received 50 s after it was
    issued (retained, or re-published after an extension) keeps the offset measured on a live one, so its
    deadline is not pushed 50 s further; a gateway without ``issued`` keeps its absolute deadline."""
    fleet = LoopbackFleet(1)
    c = fleet.clients[0]
    now = [1_000_000.0]
    c.clock = lambda: now[0]
    key = fleet.fleet_key
    topic = str(gateway_topic(fleet.fleet, "round"))

    def receive(ann: RoundAnnouncement, retain: bool) -> RoundAnnouncement:
        c._on_round(Message(topic, ann.sign(key), 1, retain))
        return c._current

    gw = now[0] - 90.0  # the gateway's clock: 90 s behind this device
    live = RoundAnnouncement(1, 0, deadline=gw + 60.0, selected=("d0",), config=fleet.rounds.config.train,
                             issued=gw)
    got = receive(live, retain=False)
    assert got.deadline == pytest.approx(now[0] + 60.0) and c.clock_skew_s == pytest.approx(90.0)
    now[0] += 10.0
    old = RoundAnnouncement(2, 0, deadline=gw + 60.0, selected=("d0",), config=fleet.rounds.config.train,
                            issued=gw - 50.0, nonce="ab")
    got = receive(old, retain=True)  # received 60 s after it was issued (10 s later, issued 50 s earlier)
    assert c.clock_skew_s == pytest.approx(90.0)
    assert got.deadline == pytest.approx(gw + 60.0 + 90.0)
    legacy = RoundAnnouncement(3, 0, deadline=12345.0, selected=("d0",), config=fleet.rounds.config.train)
    assert receive(legacy, retain=False).deadline == 12345.0
    fleet.close()
