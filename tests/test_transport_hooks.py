"""Transport hooks the fleet's defences use: per-attempt wills, a transfer filter, clearing junk retained chunks."""

from __future__ import annotations

import os

import pytest
from _brokers import Inbox, mosquitto_factory, requires_mosquitto, stays, transport_factory, wait_until  # noqa: F401

from edgeflow.transport import Will, device_filter, device_topic
from edgeflow.transport.chunking import Splitter
from edgeflow.transport.topics import chunk_topic

pytestmark = [pytest.mark.integration, requires_mosquitto]

FLEET = "lab"


def test_a_callable_will_payload_is_made_anew_for_every_connection_attempt(mosquitto_factory, transport_factory):
    broker = mosquitto_factory()
    watcher = transport_factory(broker, client_id="watcher")
    deaths = Inbox()
    topic = device_topic(FLEET, "dev", "death").value
    watcher.subscribe(topic, deaths)
    made: list[bytes] = []

    def payload() -> bytes:
        made.append(f"death-{len(made) + 1}".encode())
        return made[-1]

    dev = transport_factory(broker, client_id="dev", will=Will(topic, payload, retain=False))
    dev.close(abort=True)  # like a power cut: the broker publishes the will of that session
    (msg,) = deaths.wait(1, timeout=10)
    assert msg.payload == b"death-1" and made == [b"death-1"]
    dev2 = transport_factory(broker, client_id="dev", will=Will(topic, payload, retain=False))
    dev2.close(abort=True)
    deaths.wait(2, timeout=10)
    assert [m.payload for m in deaths.messages] == [b"death-1", b"death-2"]


def test_a_transfer_filter_drops_chunks_before_they_take_memory(mosquitto_factory, transport_factory):
    broker = mosquitto_factory()
    known = {"pi-1"}
    inbox = Inbox()
    gw = transport_factory(broker, client_id="gw", accept_transfer=lambda base: base.split("/")[2] in known)
    gw.subscribe(device_filter(FLEET, "update"), inbox)
    for device in ("pi-1", "made-up-7"):
        dev = transport_factory(broker, client_id=device, max_payload=8 * 1024)
        dev.publish(device_topic(FLEET, device, "update").value, os.urandom(64 * 1024)).wait(10)
    (msg,) = inbox.wait(1, timeout=10)
    assert msg.topic == device_topic(FLEET, "pi-1", "update").value
    assert wait_until(lambda: gw.stats().get("chunks_refused_sender", 0) >= 8, 10)
    stays(lambda: len(inbox.messages), for_s=0.2, reason="a refused sender's transfer was delivered")
    assert len(inbox.messages) == 1 and gw.stats()["reassembly_bytes"] == 0


def test_junk_retained_chunks_are_cleared_at_the_broker(mosquitto_factory, transport_factory):
    broker = mosquitto_factory()
    attacker = transport_factory(broker, client_id="dev")
    base = device_topic(FLEET, "dev", "update").value  # a device channel: never retained+chunked
    frames = list(Splitter(os.urandom(20_000), 8 * 1024))
    for i, frame in enumerate(frames):
        attacker.publish(chunk_topic(base, i), frame, retain=True, raw=True).wait(10)
    gw = transport_factory(broker, client_id="gw")
    gw.subscribe(device_filter(FLEET, "update"), Inbox())
    assert wait_until(lambda: gw.stats().get("retained_cleared", 0) == len(frames), 10), gw.stats()
    # a newcomer now finds nothing retained there
    late = Inbox()
    newcomer = transport_factory(broker, client_id="late")
    newcomer.subscribe(chunk_topic(base, 0), late, include_empty=True)
    # retained messages follow the SUBACK that subscribe() waited for
    stays(lambda: [m.payload for m in late.messages if m.payload], for_s=0.5,
          reason="a retained junk chunk was still at the broker")
    assert [m.payload for m in late.messages if m.payload] == []
