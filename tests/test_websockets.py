"""MQTT over websockets, with and without TLS: devices behind firewalls that only let HTTPS out.

Unit tests check what the transport puts into the HTTP upgrade request
(path, query, subprotocol, headers) against a socket that records it. The
integration tests use real Mosquitto websockets listeners: the launcher's
``ws_tls`` listener, and the listener ``edgeflow broker-config --websockets``
generates (TLS, passwords, ACL), over which a gateway and two devices run a
whole federated round.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from _brokers import Inbox, make_tls_material, mosquitto_factory, tls_material, wait_until  # noqa: F401
from _fleet import BROKER_USER
from edgeflow.errors import ConfigError, TransportError
from edgeflow.transport import MqttTransport
from edgeflow.transport.broker import MosquittoBroker, TlsFiles, find_mosquitto, free_port, wait_for_port
from edgeflow.transport.message import TlsConfig

WS_PAYLOAD = 4000
"""Chunk size for publishers whose subscribers use Mosquitto 2.0's websockets listener (docs/transport.md)."""
FAST = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.5, "connect_timeout_s": 5.0}


# ------------------------------------------------------------------ URLs and options


def test_wss_urls_keep_path_query_and_turn_tls_on() -> None:
    t = MqttTransport.from_url("wss://gw.example.com/edge/mqtt?token=a%2Fb&x=1", client_id="pi")
    assert (t.host, t.port, t.websockets, t.ws_path) == ("gw.example.com", 443, True, "/edge/mqtt?token=a%2Fb&x=1")
    assert t.tls == TlsConfig() and t.url == "wss://gw.example.com:443/edge/mqtt?token=a%2Fb&x=1"
    ca = TlsConfig(ca_file="/etc/edgeflow/ca.crt", cert_file="c.pem", key_file="k.pem")
    t = MqttTransport.from_url("wss://gw:8443", tls=ca, username="pi", password="pw")
    assert t.tls is ca and t.ws_path == "/mqtt" and t.port == 8443 and t.username == "pi"
    t = MqttTransport.from_url("ws://gw")
    assert (t.port, t.tls, t.ws_path, t.url) == (80, None, "/mqtt", "ws://gw:80/mqtt")
    with pytest.raises(ConfigError, match="only makes sense for ws"):
        MqttTransport.from_url("mqtts://gw:8883/mqtt?x=1")


@pytest.mark.parametrize("kwargs, match", [
    ({"ws_path": "mqtt"}, "must start with '/'"),
    ({"ws_path": "/a b"}, "no spaces"),
    ({"ws_path": "/mqtt\r\nX-Evil: 1"}, "line breaks"),
    ({"ws_headers": {"X-Token": "a\r\nHost: evil"}}, "not a valid HTTP header"),
    ({"ws_headers": {"Bad:Name": "v"}}, "not a valid HTTP header"),
])
def test_websocket_options_that_would_corrupt_the_request_are_refused(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        MqttTransport("gw", 443, websockets=True, **kwargs)


def _record_upgrade_request() -> tuple[int, dict, threading.Thread]:
    """A socket that stores the first HTTP request it receives and hangs up."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got: dict = {}

    def serve() -> None:
        srv.settimeout(10)
        try:
            conn, _ = srv.accept()
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            got["request"] = data.decode("latin-1")
            conn.close()
        finally:
            srv.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return srv.getsockname()[1], got, th


def test_upgrade_request_carries_path_query_subprotocol_and_headers() -> None:
    port, got, th = _record_upgrade_request()
    t = MqttTransport.from_url(f"ws://127.0.0.1:{port}/edge/mqtt?token=abc", client_id="pi",
                               ws_headers={"Authorization": "Bearer t0k3n"}, **FAST)
    t.connect(wait=False)
    try:
        th.join(10)
    finally:
        t.close(timeout=1, flush=False)
    lines = got["request"].split("\r\n")
    assert lines[0] == "GET /edge/mqtt?token=abc HTTP/1.1"
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    assert headers["upgrade"].lower() == "websocket"
    assert headers["sec-websocket-protocol"] == "mqtt"
    assert headers["authorization"] == "Bearer t0k3n"
    assert headers["host"].startswith("127.0.0.1")


def test_launcher_puts_tls_on_the_websockets_listener(tls_material) -> None:  # noqa: F811
    m = tls_material
    files = TlsFiles(str(m.server_cert), str(m.server_key), str(m.ca_cert))
    b = MosquittoBroker(tls=files, websockets=True, ws_tls=True, plain=False, binary="/bin/true")
    text = b._config_text()
    ws_block = text[text.index("protocol websockets"):]
    assert f"certfile {m.server_cert}" in ws_block and f"cafile {m.ca_cert}" in ws_block
    b.ws_port = 9443
    assert b.ws_url == "wss://127.0.0.1:9443/mqtt"
    plain_ws = MosquittoBroker(websockets=True, binary="/bin/true")
    assert "certfile" not in plain_ws._config_text() and plain_ws.ws_url.startswith("ws://")
    with pytest.raises(ConfigError, match="ws_tls needs"):
        MosquittoBroker(websockets=True, ws_tls=True, binary="/bin/true")


# ------------------------------------------------------------------ a real Mosquitto wss listener


@pytest.mark.integration
def test_wss_through_a_mosquitto_tls_websockets_listener(mosquitto_factory, tls_material, tmp_path) -> None:  # noqa: F811
    m = tls_material
    broker = mosquitto_factory(tls=TlsFiles(str(m.server_cert), str(m.server_key), str(m.ca_cert)),
                               websockets=True, ws_tls=True, plain=False)
    url = broker.ws_url.replace("/mqtt", "/edgeflow/mqtt?fleet=lab")
    ca = TlsConfig(ca_file=str(m.ca_cert))
    sub = MqttTransport.from_url(url, client_id="ws-sub", tls=ca, **FAST).connect(timeout=10)
    pub = MqttTransport.from_url(url, client_id="ws-pub", tls=ca, max_payload=WS_PAYLOAD, **FAST).connect(timeout=10)
    try:
        assert sub.url.startswith("wss://") and sub.protocol_version == "5"
        inbox = Inbox()
        sub.subscribe("edgeflow/lab/+/update", inbox)  # waits for the SUBACK
        payload = bytes(range(256)) * 1200  # 300 KB: 76 chunks of 4 KB
        started = time.monotonic()
        d = pub.publish("edgeflow/lab/pi/update", payload)
        d.wait(20)
        (msg,) = inbox.wait(1, timeout=20)
        assert msg.payload == payload and msg.chunks == d.total >= 70
        assert time.monotonic() - started < 10
        # retained + websockets: a late subscriber gets the whole retained chunked payload
        pub.publish("edgeflow/lab/gateway/model", payload[:50_000], retain=True).wait(20)
        late = Inbox()
        sub.subscribe("edgeflow/lab/gateway/model", late)
        assert late.wait(1, timeout=20)[0].payload == payload[:50_000]
    finally:
        sub.close(timeout=1)
        pub.close(timeout=1)
    # the port speaks websockets only: plain MQTT over TLS, or websockets without TLS, get nowhere
    for wrong in (f"mqtts://127.0.0.1:{broker.ws_port}", f"ws://127.0.0.1:{broker.ws_port}/mqtt"):
        t = MqttTransport.from_url(wrong, tls=ca if wrong.startswith("mqtts") else None, **FAST)
        with pytest.raises(TransportError):
            t.connect(timeout=2)
        t.close(timeout=1, flush=False)
    other = make_tls_material(tmp_path / "other")
    t = MqttTransport.from_url(broker.ws_url, tls=TlsConfig(ca_file=str(other.ca_cert)), **FAST)
    started = time.monotonic()
    with pytest.raises(TransportError, match="certificate .* failed verification.*ca_file"):
        t.connect(timeout=10)
    assert time.monotonic() - started < 3, "a certificate the CA did not sign is final, not retried"
    t.close(timeout=1, flush=False)


@pytest.mark.integration
def test_wss_with_client_certificates(mosquitto_factory, tls_material) -> None:  # noqa: F811
    m = tls_material
    broker = mosquitto_factory(tls=TlsFiles(str(m.server_cert), str(m.server_key), str(m.ca_cert),
                                            require_certificate=True), websockets=True, ws_tls=True, plain=False)
    mutual = TlsConfig(ca_file=str(m.ca_cert), cert_file=str(m.client_cert), key_file=str(m.client_key))
    t = MqttTransport.from_url(broker.ws_url, tls=mutual, **FAST).connect(timeout=10)
    inbox = Inbox()
    t.subscribe("edgeflow/lab/#", inbox)
    t.publish("edgeflow/lab/pi/update", b"signed envelope").wait(5)
    assert inbox.wait(1)[0].payload == b"signed envelope"
    t.close(timeout=1)
    no_cert = MqttTransport.from_url(broker.ws_url, tls=TlsConfig(ca_file=str(m.ca_cert)), **FAST)
    started = time.monotonic()
    with pytest.raises(TransportError, match="requires a client certificate.*cert_file"):
        no_cert.connect(timeout=10)
    assert time.monotonic() - started < 3, "a missing client certificate is final over wss too, not retried"
    no_cert.close(timeout=1, flush=False)


def test_broker_config_cli_adds_a_tls_websockets_listener(tmp_path, capsys) -> None:
    from edgeflow.cli.main import main

    port, ws = free_port(), free_port()
    rc = main(["broker-config", "--dir", str(tmp_path / "fleet"), "--fleet", "lab", "--host", "127.0.0.1",
               "--port", str(port), "--websockets", str(ws), "--public-host", "127.0.0.1", "--json",
               *(["--broker-user", BROKER_USER] if BROKER_USER else [])])
    assert rc == 0
    conf = Path(json.loads(capsys.readouterr().out)["config"]).read_text()
    block = conf[conf.index(f"listener {ws} 127.0.0.1"):]
    assert "protocol websockets" in block and "certfile" in block and "allow_anonymous false" in conf


# ------------------------------------------------------------------ a federated round over wss


@pytest.mark.integration
def test_federated_round_over_wss_on_the_generated_fleet_broker(tmp_path) -> None:
    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto is not installed")
    from edgeflow import zoo
    from edgeflow.broker.mosquitto import FleetDir, ListenerSettings
    from edgeflow.data.datasets import dirichlet_partition, load_digits
    from edgeflow.device.credentials import DeviceCredentials
    from edgeflow.federated import Client
    from edgeflow.protocol.rounds import TrainConfig
    from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
    from edgeflow.gateway.store import GatewayStore

    fd = FleetDir(tmp_path / "fleet").init("lab")
    devices = ["dev-a", "dev-b"]
    for d in devices:
        fd.provision(d, profile="raspberry-pi-4")
    tls_port, ws_port = free_port(), free_port()
    log = tmp_path / "mosquitto.log"
    files = fd.write_broker_config(ListenerSettings(host="127.0.0.1", port=tls_port, websockets_port=ws_port,
                                                    log_file=str(log), user=BROKER_USER),
                                   tls_hosts=["localhost", "127.0.0.1"])
    out = open(tmp_path / "mosquitto.out", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, "-c", str(files.config)], stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    made: list = []
    try:
        assert wait_for_port("127.0.0.1", ws_port, 10, alive=lambda: proc.poll() is None), log.read_text()
        url = f"wss://127.0.0.1:{ws_port}/mqtt"
        ca = TlsConfig(ca_file=str(fd.ca_file()))
        op = fd.operator("gateway")
        gw = MqttTransport.from_url(url, client_id="gateway", username=op["username"], password=op["password"],
                                    tls=ca, max_payload=WS_PAYLOAD, **FAST)
        made.append(gw)
        model = zoo.digits_mlp(seed=1)
        split = load_digits(seed=0).flat()
        parts = dirichlet_partition(split.y_train, len(devices), alpha=1.0, seed=0)
        clients = []
        for dev, idx in zip(devices, parts):
            cred = DeviceCredentials.load(fd.device_dir(dev))
            t = MqttTransport.from_url(url, client_id=cred.username, username=cred.username,
                                       password=cred.password, tls=cred.tls_config(), max_payload=WS_PAYLOAD, **FAST)
            made.append(t)
            c = Client(t, fleet="lab", device_id=dev, signer=cred.signer, fleet_key=cred.fleet_key, model=model,
                       data=(split.x_train[idx], split.y_train[idx]), seed=1)
            clients.append(c)
        rm = RoundManager(
            gw, GatewayStore(tmp_path / "gw.sqlite"), fleet="lab", fleet_key=fd.fleet_key(), keyring=fd.keyring(),
            model=model, config=RoundConfig(rounds=1, min_clients=2, deadline_s=40, wait_for_devices_s=5,
                                            train=TrainConfig(epochs=1, batch_size=32, lr=0.1, codec="int8")),
            candidates=lambda: [Candidate(d) for d in devices],
        )
        rm.start()
        gw.connect(timeout=15)
        for c in clients:
            c.start()
            c.transport.connect(timeout=15)
        (metrics,) = rm.run(rounds=1)
        assert metrics.selected == 2 and metrics.participants == 2 and metrics.rejected == 0, metrics
        assert wait_until(lambda: all(c.status()["model_version"] == rm.version for c in clients), 20), \
            [c.status() for c in clients]
        assert all(t.url.startswith("wss://") and t.stats().get("reconnects", 0) == 0 for t in made)
        assert all(c.stats.updates_sent == 1 and c.stats.rejected_messages == 0 for c in clients)
        for c in clients:
            c.stop()
    finally:
        for t in made:
            t.close(timeout=1, flush=False)
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()
