"""Issue 31, finding "junk that is not chunk-shaped is never cleared from any device channel (broker +89 MB)":
the gateway clears a retained message on a device channel that does not parse as what the channel carries
(any retained message on a channel that carries none), counts it and logs it once; real Mosquitto."""

from __future__ import annotations

import logging
import os

import pytest
from _brokers import Inbox, mosquitto_factory, requires_mosquitto, stays, transport_factory, wait_until  # noqa: F401

from edgeflow import zoo
from edgeflow.gateway.rounds import RoundConfig
from edgeflow.gateway.service import Gateway
from edgeflow.gateway.store import GatewayStore
from edgeflow.protocol.fleet import BIRTH_CONTEXT, Birth
from edgeflow.protocol.signed_json import sign_body
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport.topics import device_topic

pytestmark = [pytest.mark.integration, requires_mosquitto]

FLEET = "lab"


def _topic(device: str, channel: str) -> str:
    return device_topic(FLEET, device, channel).value


def _gateway(broker, transport_factory, keyring: KeyRing, key: PrivateKey) -> Gateway:
    t = transport_factory(broker, client_id="lab-gateway", connect=False)
    return Gateway(t, GatewayStore(":memory:"), fleet=FLEET, fleet_key=key, keyring=keyring,
                   model=zoo.digits_mlp(seed=0), rounds=RoundConfig(rounds=0))


def test_retained_junk_on_device_channels_is_cleared_once_and_honest_births_stay(
        mosquitto_factory, transport_factory, caplog):
    broker = mosquitto_factory()
    key = PrivateKey.generate()
    honest, evil = Signer.generate("cam-1"), Signer.generate("dev-1")
    ring = KeyRing()
    for s in (honest, evil):
        ring.register(s.device_id, s.public_key)
    birth = Birth(device="cam-1", fleet=FLEET, profile="x86-gateway", bdseq=1, public_key=honest.public_key.hex,
                  model_version=0, telemetry_interval_s=5.0)
    good_birth = sign_body(birth.to_dict(), honest.key, BIRTH_CONTEXT)
    attacker = transport_factory(broker, client_id="dev-1", max_payload=1 << 20)
    junk = {
        _topic("dev-1", "telemetry"): os.urandom(200_000),  # not chunk-shaped, just big
        _topic("dev-1", "update"): b"not an update envelope" * 1000,
        _topic("dev-1", "cmd/ack"): b'{"ok": true}',  # well-formed JSON, but nothing is retained on cmd/ack
        _topic("dev-1", "birth"): b"\x00\x01 not a birth",
        _topic("dev-1", "death"): b"{broken json",
        _topic("ghost-7", "birth"): b"[1, 2, 3]",  # an id nobody provisioned
    }
    for topic, payload in junk.items():
        attacker.publish(topic, payload, retain=True, raw=True).wait(10)
    attacker.publish(_topic("cam-1", "birth"), good_birth, retain=True).wait(10)

    caplog.set_level(logging.WARNING, logger="edgeflow.gateway.fleet")
    gw = _gateway(broker, transport_factory, ring, key)
    gw.start()
    try:
        assert wait_until(lambda: gw.fleet.stats().get("retained_junk_cleared", 0) >= len(junk), 10), gw.fleet.stats()
        assert wait_until(lambda: gw.fleet.is_online("cam-1"), 10), "the honest retained birth was read"
        stats = gw.fleet.stats()
        assert stats["retained_junk_cleared"] == len(junk)
        assert stats["retained_junk_telemetry"] == 1 and stats["retained_junk_update"] == 1
        assert stats["retained_junk_birth"] == 2 and stats["retained_junk_death"] == 1
        assert stats["retained_junk_cmd_ack"] == 1
        cleared = [r.getMessage() for r in caplog.records if "cleared retained junk" in r.getMessage()]
        assert sorted(m.split()[4] for m in cleared) == sorted(junk), cleared  # one line per topic
    finally:
        gw.stop()

    # a newcomer finds only the honest birth at the broker
    late = Inbox()
    newcomer = transport_factory(broker, client_id="late")
    newcomer.subscribe(f"edgeflow/{FLEET}/+/#", late)
    late.wait(2, timeout=10)  # the honest birth and the gateway's own state
    stays(lambda: len(late.messages), for_s=0.5, reason="retained junk was still at the broker")
    devices = [(m.topic, m.payload) for m in late.messages if "/gateway/" not in m.topic]
    assert devices == [(_topic("cam-1", "birth"), good_birth)]

    # a second gateway start finds nothing left to clear
    gw2 = _gateway(broker, transport_factory, ring, key)
    gw2.start()
    try:
        assert wait_until(lambda: gw2.fleet.is_online("cam-1"), 10)
        stays(lambda: gw2.fleet.stats().get("retained_junk_cleared", 0), for_s=0.3, reason="junk came back")
        assert gw2.fleet.stats().get("retained_junk_cleared", 0) == 0
    finally:
        gw2.stop()
