"""The broker launchers used by tests and `edgeflow demo`: Mosquitto, embedded amqtt, selection."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from _brokers import MOSQUITTO, Inbox, mosquitto_factory, requires_mosquitto, transport_factory  # noqa: F401

from edgeflow.errors import ConfigError, TransportError
from edgeflow.transport import broker as broker_mod
from edgeflow.transport.broker import (
    EmbeddedBroker,
    ExternalBroker,
    MosquittoBroker,
    free_port,
    mosquitto_password_hash,
    start_broker,
)

pytestmark = pytest.mark.integration


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@requires_mosquitto
def test_mosquitto_starts_on_a_free_port_and_cleans_up() -> None:
    with MosquittoBroker() as b:
        assert b.running and b.kind == "mosquitto" and b.url == f"mqtt://127.0.0.1:{b.port}"
        assert port_open(b.host, b.port)
        workdir = b.workdir
        assert f"listener {b.port} 127.0.0.1" in (workdir / "mosquitto.conf").read_text()
    assert not b.running and not port_open(b.host, b.port)
    assert not workdir.exists(), "temp dir removed on stop"


@requires_mosquitto
def test_mosquitto_config_options_are_written(tmp_path: Path) -> None:
    b = MosquittoBroker(users={"a": "pw"}, acl="user a\ntopic readwrite #", message_size_limit=1234,
                        max_packet_size=5678, persistence=True, websockets=True, max_queued_messages=99,
                        workdir=tmp_path / "mq")
    try:
        b.start()
        conf = b.config_path.read_text()
        for line in ("allow_anonymous false", "message_size_limit 1234", "max_packet_size 5678",
                     "persistence true", "protocol websockets", "max_queued_messages 99", "acl_file", "password_file"):
            assert line in conf
        passwd = (b.workdir / "passwd").read_text()
        assert passwd.startswith("a:$7$101$") and (b.workdir / "passwd").stat().st_mode & 0o777 == 0o600
        assert port_open(b.host, b.ws_port) and b.ws_url.startswith("ws://")
    finally:
        b.stop()
    assert (tmp_path / "mq").exists(), "a workdir given by the caller is left in place"


def test_password_hash_format() -> None:
    h = mosquitto_password_hash("secret", salt=b"\0" * 12)
    assert h.startswith("$7$101$AAAAAAAAAAAAAAAA$") and h == mosquitto_password_hash("secret", salt=b"\0" * 12)
    assert mosquitto_password_hash("secret") != mosquitto_password_hash("secret")  # random salt


@requires_mosquitto
def test_mosquitto_start_failure_shows_the_log() -> None:
    b = MosquittoBroker(extra_config="this_is_not_an_option 1")
    with pytest.raises(TransportError, match="(?s)mosquitto did not start.*this_is_not_an_option"):
        b.start()
    b.stop()


@requires_mosquitto
def test_restart_keeps_port_and_persisted_state(mosquitto_factory, transport_factory) -> None:
    b = mosquitto_factory(persistence=True)
    port = b.port
    t = transport_factory(b, client_id="pub")
    t.publish("edgeflow/lab/gateway/round", b'{"round": 4}', retain=True).wait(5)
    t.close()
    b.restart()
    assert b.port == port and b.running
    inbox = Inbox()
    transport_factory(b, client_id="sub").subscribe("edgeflow/lab/gateway/round", inbox)
    assert inbox.wait(1)[0].json() == {"round": 4}, "retained message survived the restart"


@requires_mosquitto
def test_pause_makes_a_hung_broker(mosquitto_factory, transport_factory) -> None:
    b = mosquitto_factory()
    t = transport_factory(b)
    b.pause()
    try:
        with pytest.raises(TransportError, match="not acknowledged within 0.5 s"):
            t.publish("edgeflow/lab/pi/telemetry", b"x").wait(0.5)
    finally:
        b.resume()
    t.flush(5)


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="either users or password_file"):
        MosquittoBroker(users={}, password_file="x", binary="/bin/true")
    with pytest.raises(ConfigError, match="needs tls or websockets"):
        MosquittoBroker(plain=False, binary="/bin/true")


def test_embedded_broker_with_mqtt311_and_chunking(transport_factory) -> None:
    pytest.importorskip("amqtt")
    with EmbeddedBroker() as b:
        assert b.kind == "amqtt" and b.protocol == "3.1.1" and port_open(b.host, b.port)
        sub = transport_factory(b, client_id="sub", max_payload=16 * 1024)
        pub = transport_factory(b, client_id="pub", max_payload=16 * 1024)
        assert sub.protocol_version == "3.1.1"
        inbox = Inbox()
        sub.subscribe("edgeflow/lab/+/update", inbox)
        payload = os.urandom(200_000)
        pub.publish("edgeflow/lab/pi/update", payload).wait(10)
        (msg,) = inbox.wait(1)
        assert msg.payload == payload and msg.chunks > 1
        assert msg.properties == {}, "MQTT 3.1.1 carries no properties"
    assert not port_open(b.host, b.port)


def test_auto_protocol_falls_back_to_mqtt311_on_amqtt(transport_factory) -> None:
    pytest.importorskip("amqtt")
    with EmbeddedBroker() as b:
        t = transport_factory(b, protocol="auto")
        assert t.protocol_version == "3.1.1" and t.stats()["protocol_fallbacks"] == 1
        t.publish("edgeflow/lab/pi/telemetry", b"x").wait(5)


def test_start_broker_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    ext = start_broker("mqtt://example.invalid:1999")
    assert isinstance(ext, ExternalBroker) and ext.kind == "external" and ext.port == 1999
    ext.stop()
    if MOSQUITTO is not None:
        with start_broker() as b:
            assert b.kind == "mosquitto" and port_open(b.host, b.port)
    pytest.importorskip("amqtt")
    monkeypatch.setattr(broker_mod, "find_mosquitto", lambda: None)
    with start_broker() as b:
        assert b.kind == "amqtt" and port_open(b.host, b.port)


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_is_below_the_ephemeral_range() -> None:
    # a broker restarted on an ephemeral port can lose it to a reconnecting client's source port (a client
    # connecting to itself by TCP simultaneous open): the restart then fails with "Address already in use"
    from edgeflow.transport.broker import _ephemeral_low

    low = _ephemeral_low()
    if low is None or low <= 10_000:
        pytest.skip("no readable /proc/sys/net/ipv4/ip_local_port_range above 10000 here")
    ports = {free_port() for _ in range(20)}
    assert all(10_000 <= p < low for p in ports) and len(ports) > 1
