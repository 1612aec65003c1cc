"""``edgeflow broker-config``: the generated Mosquitto config, and proof against a running broker
that it locks devices into their own topics. Then the second layer: on a wide-open broker the
agent still refuses unsigned and forged commands and models."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import time

import pytest
from _brokers import Inbox, mosquitto_factory, transport_factory  # noqa: F401
from _fleet import FLEET, PROFILE, artifact, fleet_env, wait_until  # noqa: F401

from edgeflow.brokerconfig import FleetDir, ListenerSettings, fleet_acl, read_password_file, render_config
from edgeflow.device.agent import AgentOptions, DeviceAgent
from edgeflow.device.messages import Ack, Command, OtaOffer, deploy_command
from edgeflow.errors import ConfigError, TransportError
from edgeflow.signing import PrivateKey, Signer
from edgeflow.transport.message import TlsConfig
from edgeflow.transport.mqtt import MqttTransport
from edgeflow.transport.topics import device_topic, gateway_topic


def test_acl_confines_devices_and_names_every_channel() -> None:
    acl = fleet_acl("lab", ["gateway", "admin"])
    lines = [ln for ln in acl.splitlines() if ln and not ln.startswith("#")]
    writes = {ln.split()[2] for ln in lines if ln.startswith("pattern write")}
    reads = {ln.split()[2] for ln in lines if ln.startswith("pattern read")}
    assert all(t.startswith("edgeflow/lab/%u/") for t in writes)
    assert "edgeflow/lab/%u/cmd" not in writes and "edgeflow/lab/%u/ota" not in writes, "devices never write commands"
    assert not any("gateway" in t for t in writes), "devices never write gateway topics (no pushing models)"
    assert {"edgeflow/lab/%u/cmd", "edgeflow/lab/%u/ota", "edgeflow/lab/gateway/#"} <= reads
    assert not any("+" in t.split("/")[2] or "#" == t.split("/")[2] for t in reads | writes), "no other device"
    assert "user gateway" in lines and "user admin" in lines
    assert lines.index("user gateway") > max(i for i, ln in enumerate(lines) if ln.startswith("pattern"))


def test_config_is_tls_only_without_anonymous_access(tmp_path) -> None:
    text = render_config("lab", ListenerSettings(certfile="s.crt", keyfile="s.key", cafile="ca.crt"),
                         password_file="p", acl_file="a")
    assert "allow_anonymous false" in text and "password_file p" in text and "acl_file a" in text
    listeners = [ln for ln in text.splitlines() if ln.startswith("listener")]
    assert listeners == ["listener 8883 0.0.0.0"]
    assert "use_username_as_clientid true" in text and "certfile s.crt" in text
    with pytest.raises(ConfigError, match="certificate"):
        render_config("lab", ListenerSettings(), password_file="p", acl_file="a")
    with pytest.raises(ConfigError, match="require_certificate"):
        render_config("lab", ListenerSettings(certfile="c", keyfile="k", require_certificate=True),
                      password_file="p", acl_file="a")
    ws = render_config("lab", ListenerSettings(certfile="c", keyfile="k", websockets_port=8884, plain_port=1884),
                       password_file="p", acl_file="a")
    assert "listener 8884 0.0.0.0\n" in ws and "protocol websockets" in ws and "listener 1884 127.0.0.1" in ws


def test_fleet_dir_provisioning_and_mosquitto_hashes(tmp_path) -> None:
    fd = FleetDir(tmp_path / "f").init("lab")
    fd.provision("pi-1", profile=PROFILE)
    files = fd.write_broker_config(ListenerSettings(port=18883), tls_hosts=["localhost"])
    creds = json.loads((fd.device_dir("pi-1") / "device.json").read_text())
    hashes = read_password_file(files.password_file)
    assert set(hashes) == {"gateway", "admin", "pi-1"}
    _, kind, iters, salt, digest = hashes["pi-1"].split("$")
    want = hashlib.pbkdf2_hmac("sha512", creds["password"].encode(), base64.b64decode(salt), int(iters), 64)
    assert kind == "7" and base64.b64decode(digest) == want
    assert (files.password_file.stat().st_mode & 0o777) == 0o600
    assert (fd.device_dir("pi-1") / "ca.crt").read_bytes() == files.ca_file.read_bytes()
    assert fd.keyring().get("pi-1") is not None
    ca = files.ca_file.read_bytes()
    fd.provision("pi-2")
    again = fd.write_broker_config()  # provisioning later keeps the listener settings and the CA
    assert "listener 18883" in again.config.read_text() and again.ca_file.read_bytes() == ca
    assert set(read_password_file(again.password_file)) == {"gateway", "admin", "pi-1", "pi-2"}
    with pytest.raises(ConfigError, match="operator"):
        fd.provision("admin")
    with pytest.raises(ConfigError, match="already holds"):
        fd.provision("pi-1")


# -------------------------------------------------------- against the broker


def _device(env, device: str, **kw) -> MqttTransport:
    return env.transport(device, env.device_password(device), **kw)


@pytest.mark.integration
def test_broker_refuses_anonymous_wrong_password_plain_tcp_and_untrusted_tls(fleet_env) -> None:
    host, port = "127.0.0.1", fleet_env.broker.port
    with pytest.raises(TransportError, match="anonymously"):
        MqttTransport(host, port, tls=TlsConfig(ca_file=fleet_env.ca), connect_timeout_s=5).connect()
    dev = fleet_env.new_id()
    with pytest.raises(TransportError, match="username/password"):
        MqttTransport(host, port, username=dev, password="guess", tls=TlsConfig(ca_file=fleet_env.ca),
                      connect_timeout_s=5).connect()
    with pytest.raises(TransportError):
        MqttTransport(host, port, username=dev, password=fleet_env.device_password(dev), connect_timeout_s=2,
                      reconnect_max_s=0.2).connect()  # plain MQTT on the TLS port
    with pytest.raises(TransportError, match="verification"):
        MqttTransport(host, port, username=dev, password=fleet_env.device_password(dev), tls=TlsConfig(),
                      connect_timeout_s=5).connect()  # the system trust store does not know the fleet CA
    with socket.socket() as s:
        s.settimeout(1)
        s.connect((host, port))  # only the TLS listener exists; no plain one was generated
    assert "listener" in fleet_env.broker.config.read_text()
    assert sum(ln.startswith("listener") for ln in fleet_env.broker.config.read_text().splitlines()) == 1


@pytest.mark.integration
def test_a_device_cannot_publish_as_another_read_its_commands_or_push_a_model(fleet_env) -> None:
    me, victim = fleet_env.new_id(), fleet_env.new_id()
    gw = fleet_env.transport("gateway", connect=False)
    seen = Inbox()
    gw.subscribe(f"edgeflow/{FLEET}/#", seen)
    gw.connect()
    dev = _device(fleet_env, me)
    vic = _device(fleet_env, victim)
    forged = [
        device_topic(FLEET, victim, "birth"), device_topic(FLEET, victim, "telemetry"),
        device_topic(FLEET, victim, "update"), device_topic(FLEET, victim, "cmd/ack"),
        device_topic(FLEET, victim, "cmd"), device_topic(FLEET, victim, "ota"),  # commanding / updating another
        device_topic(FLEET, me, "cmd"), device_topic(FLEET, me, "ota"),  # or itself
        gateway_topic(FLEET, "model"), gateway_topic(FLEET, "round"),  # pushing a model to the fleet
        "edgeflow/otherfleet/x/birth",
    ]
    for topic in forged:
        with pytest.raises(TransportError, match="Not authorized"):
            dev.publish(str(topic), b"forged").wait(5)
    with pytest.raises(TransportError, match="Not authorized"):
        dev.publish(device_topic(FLEET, victim, "ota").value, b"x" * 600_000).wait(10)  # chunked: refused too
    dev.publish(device_topic(FLEET, me, "telemetry").value, b"own").wait(5)
    seen.wait_for(lambda m: m.payload == b"own")
    assert [m.topic for m in seen.messages if m.payload != b""] == [device_topic(FLEET, me, "telemetry").value]

    # Reading: subscriptions to another device's commands are granted but deliver nothing.
    spy, mine = Inbox(), Inbox()
    dev.subscribe(device_topic(FLEET, victim, "cmd").value, spy)
    dev.subscribe(device_topic(FLEET, victim, "ota").value, spy)
    dev.subscribe(f"edgeflow/{FLEET}/+/cmd", spy)
    dev.subscribe(device_topic(FLEET, me, "cmd").value, mine)
    victims = Inbox()
    vic.subscribe(device_topic(FLEET, victim, "cmd").value, victims)
    time.sleep(0.2)
    gw.publish(device_topic(FLEET, victim, "cmd").value, b"for the victim only").wait(5)
    gw.publish(device_topic(FLEET, victim, "ota").value, b"y" * 400_000).wait(10)
    gw.publish(device_topic(FLEET, me, "cmd").value, b"for me").wait(5)
    victims.wait_for(lambda m: m.payload == b"for the victim only")
    mine.wait_for(lambda m: m.payload == b"for me")
    time.sleep(0.3)
    # the + filter delivers the device's own command (once per overlapping subscription), never the victim's
    assert {m.payload for m in spy.messages} == {b"for me"}

    # Session hijack: connecting with the victim's client id does not kick the victim off.
    hijack = _device(fleet_env, me, client_id=victim)
    assert hijack.is_connected
    time.sleep(0.3)
    assert vic.is_connected, "the broker replaced the client id by the user name"


@pytest.mark.integration
def test_agent_refuses_forgeries_even_on_a_wide_open_broker(mosquitto_factory, transport_factory, tmp_path) -> None:
    """Anonymous broker, no ACL: anyone can publish anywhere. Signatures are the last line."""
    broker = mosquitto_factory()
    fleet_key, intruder = PrivateKey.generate(), PrivateKey.generate()
    dev = "pi-open"
    t = MqttTransport(broker.host, broker.port, client_id=dev, reconnect_min_s=0.05)
    agent = DeviceAgent(t, device_id=dev, fleet=FLEET, profile=PROFILE, signer=Signer.generate(dev),
                        fleet_key=fleet_key.public_key, state_dir=tmp_path / "s",
                        options=AgentOptions(telemetry_interval_s=5, health_runs=1))
    acks = Inbox()
    attacker = transport_factory(broker, client_id="attacker")
    attacker.subscribe(device_topic(FLEET, dev, "cmd/ack").value, acks)
    agent.start()
    try:
        good = artifact(fleet_key, 1)
        c = deploy_command(dev, FLEET, good, version=1)
        attacker.publish(device_topic(FLEET, dev, "ota").value, OtaOffer.make(c, good, fleet_key).to_bytes()).wait(5)
        acks.wait_for(lambda m: json.loads(json.loads(m.payload)["body"])["id"] == c.id, 20)
        assert agent.model_version == 1
        n = len(acks.messages)
        evil = artifact(intruder, 9)
        attacker.publish(device_topic(FLEET, dev, "ota").value,
                         OtaOffer.make(deploy_command(dev, FLEET, evil, version=9), evil, intruder).to_bytes()).wait(5)
        attacker.publish(device_topic(FLEET, dev, "cmd").value, Command.make("rollback", dev, FLEET).sign(intruder)).wait(5)
        attacker.publish(device_topic(FLEET, dev, "cmd").value, json.dumps({"id": "x", "name": "reboot"})).wait(5)
        assert wait_until(lambda: len(acks.messages) >= n + 3, 10)
        refusals = [Ack.from_body(json.loads(json.loads(m.payload)["body"])) for m in acks.messages[n:]]
        assert sorted(a.code for a in refusals) == ["unsigned", "wrong_key", "wrong_key"]
        assert all(not a.ok and a.error for a in refusals)
        assert agent.model_version == 1 and agent.counters["refused"] == 3
    finally:
        agent.stop()
