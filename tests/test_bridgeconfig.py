"""The generated Mosquitto bridge: what it forwards, what it keeps local, and that a real
site broker running it reaches a central broker made by `edgeflow broker-config`
(TLS, no anonymous access, the site's own provisioned credentials, the fleet ACL)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _brokers import Inbox, mosquitto_factory, wait_until  # noqa: F401
from _fleet import BROKER_USER, GeneratedBroker
from edgeflow.broker.bridge import BridgeSpec, bridge_from_fleet_dir, bridge_topics, render_bridge
from edgeflow.broker.mosquitto import FleetDir, ListenerSettings
from edgeflow.errors import ConfigError
from edgeflow.transport import MqttTransport
from edgeflow.transport.broker import free_port
from edgeflow.transport.message import TlsConfig


def test_bridge_forwards_the_roots_round_and_model_down_and_only_the_sites_partial_up():
    spec = BridgeSpec("lab", "site-a", "central.example", 8883, username="site-a", password="pw", cafile="/ca.crt")
    assert bridge_topics(spec) == [
        "topic gateway/round/# in 1 edgeflow/lab/_uplink/ edgeflow/lab/",
        "topic gateway/model/# in 1 edgeflow/lab/_uplink/ edgeflow/lab/",
        "topic site-a/update/# out 1 edgeflow/lab/_uplink/ edgeflow/lab/",
    ]
    text = render_bridge(spec)
    for line in ("connection lab-site-a-uplink", "address central.example:8883", "remote_username site-a",
                 "remote_password pw", "bridge_cafile /ca.crt", "bridge_insecure false", "cleansession false",
                 "try_private true"):
        assert line in text.splitlines(), line
    assert "bridge_cafile" not in render_bridge(BridgeSpec("lab", "s1", "127.0.0.1", 1883))


@pytest.mark.parametrize("kwargs, match", [
    ({"site_id": "gateway"}, "reserved"),
    ({"site_id": "bad id"}, "site id"),
    ({"remote_port": 0}, "port"),
    ({"qos": 2}, "qos"),
    ({"password": "a b"}, "spaces"),
    ({"certfile": "c.pem"}, "keyfile"),
    ({"extra_down": ("cmd/#",)}, "gateway/"),
])
def test_bad_bridge_settings_are_refused(kwargs, match):
    base = {"fleet": "lab", "site_id": "s1", "remote_host": "h"}
    with pytest.raises(ConfigError, match=match):
        BridgeSpec(**{**base, **kwargs})


@pytest.mark.integration
def test_site_broker_bridges_to_the_generated_central_broker_over_tls_with_the_sites_credentials(
        mosquitto_factory, tmp_path):  # noqa: F811
    fd = FleetDir(tmp_path / "central").init("lab", operators=("gateway",))
    fd.provision("site-a")
    port = free_port()
    log = tmp_path / "central.log"
    files = fd.write_broker_config(ListenerSettings(host="127.0.0.1", port=port, log_file=str(log), user=BROKER_USER),
                                   tls_hosts=["localhost", "127.0.0.1"])
    central = GeneratedBroker(files.config, port, log)
    site_t = root_t = None
    try:
        # the CLI writes the bridge file from the fleet directory
        out = subprocess.run([sys.executable, "-m", "edgeflow.cli.main", "broker-config", "--dir", str(fd.path),
                              "--bridge-site", "site-a", "--central", f"mqtts://127.0.0.1:{port}", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        path = json.loads(out.stdout)["bridge"]
        text = open(path).read()
        assert text == render_bridge(bridge_from_fleet_dir(fd, "site-a", f"mqtts://127.0.0.1:{port}"))
        site = mosquitto_factory(extra_config=text.replace("restart_timeout 2 30", "restart_timeout 1 2"))
        gw = fd.operator("gateway")
        root_t = MqttTransport.from_url(f"mqtts://127.0.0.1:{port}", client_id="gateway", username=gw["username"],
                                        password=gw["password"], tls=TlsConfig(ca_file=str(fd.ca_file()))).connect()
        site_t = MqttTransport.from_url(site.url, client_id="site-gw").connect()
        up, down, leaked = Inbox(), Inbox(), Inbox()
        root_t.subscribe("edgeflow/lab/site-a/update", up)
        root_t.subscribe("edgeflow/lab/+/telemetry", leaked)
        root_t.subscribe("edgeflow/lab/d1/update", leaked)
        assert wait_until(lambda: "site-a" in central.log() and "New client connected" in central.log(), 15)
        root_t.publish("edgeflow/lab/gateway/round", b"round-7", retain=True).wait(5)
        root_t.publish("edgeflow/lab/gateway/model", b"M" * 10_000, retain=True).wait(5)
        # retained root messages land on the site broker, under _uplink, retained
        site_t.subscribe("edgeflow/lab/_uplink/gateway/#", down)
        msgs = {m.topic: m for m in down.wait(2, timeout=15)}
        assert msgs["edgeflow/lab/_uplink/gateway/round"].payload == b"round-7"
        assert msgs["edgeflow/lab/_uplink/gateway/model"].payload == b"M" * 10_000
        # the site's partial goes up, chunked or not; device traffic stays on the site broker
        site_t.publish("edgeflow/lab/d1/update", b"device update", qos=1).wait(5)
        site_t.publish("edgeflow/lab/d1/telemetry", b"{}", qos=1).wait(5)
        site_t.publish("edgeflow/lab/_uplink/site-a/update", b"P" * 300_000, qos=1).wait(10)
        assert up.wait(1, timeout=15)[0].payload == b"P" * 300_000
        root_t.subscribe("edgeflow/lab/site-b/update", leaked)
        site_t.publish("edgeflow/lab/_uplink/site-b/update", b"not mine", qos=1).wait(5)
        site_t.publish("edgeflow/lab/_uplink/site-a/update", b"second", qos=1).wait(5)
        assert wait_until(lambda: len(up.messages) == 2, 10)
        assert leaked.messages == []
    finally:
        for t in (site_t, root_t):
            if t is not None:
                t.close(timeout=1, flush=False)
        central.stop()
