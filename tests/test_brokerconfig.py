"""``edgeflow broker-config``: the generated Mosquitto config, and proof against a running broker
that it locks devices into their own topics. Then the second layer: on a wide-open broker the
agent still refuses unsigned and forged commands and models."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _brokers import Inbox, make_tls_material, mosquitto_factory, tls_material, transport_factory  # noqa: F401
from _fleet import BROKER_USER, FLEET, PROFILE, GeneratedBroker, artifact, fleet_env, wait_until  # noqa: F401

from edgeflow.broker.mosquitto import (
    OPERATORS,
    FleetDir,
    ListenerSettings,
    fleet_acl,
    read_password_file,
    render_config,
)
from edgeflow.device.agent import AgentOptions, DeviceAgent
from edgeflow.protocol.fleet import Ack, Command
from edgeflow.protocol.ota import OtaOffer, deploy_command
from edgeflow.errors import ConfigError, TransportError
from edgeflow.signing import PrivateKey, Signer
from edgeflow.transport.broker import free_port, wait_for_port
from edgeflow.transport.message import TlsConfig
from edgeflow.transport.mqtt import MqttTransport
from edgeflow.transport.topics import device_topic, gateway_topic


def test_acl_confines_devices_and_names_every_channel() -> None:
    acl = fleet_acl("lab", ["gateway", "admin"], ["pi-1"])
    lines = [ln for ln in acl.splitlines() if ln and not ln.startswith("#")]
    writes = {ln.split()[2] for ln in lines if ln.startswith("pattern write")}
    reads = {ln.split()[2] for ln in lines if ln.startswith("pattern read")}
    # Reading the gateway's topics is granted per device user: a pattern without %u makes Mosquitto warn.
    block = lines[lines.index("user pi-1") + 1:lines.index("user gateway")]
    gateway_reads = {ln.split()[2] for ln in block}
    assert all(ln.startswith("topic read edgeflow/lab/gateway/") for ln in block)
    assert all(t.startswith("edgeflow/lab/%u/") for t in writes)
    assert "edgeflow/lab/%u/cmd" not in writes and "edgeflow/lab/%u/ota" not in writes, "devices never write commands"
    assert not any("gateway" in t for t in writes), "devices never write gateway topics (no pushing models)"
    assert {"edgeflow/lab/%u/cmd", "edgeflow/lab/%u/ota"} <= reads
    assert {"edgeflow/lab/gateway/model", "edgeflow/lab/gateway/model/_chunk/+", "edgeflow/lab/gateway/round"} <= gateway_reads
    assert not any("+" in t.split("/")[2] or "#" == t.split("/")[2] for t in reads | writes), "no other device"
    assert all("%u" in ln or "%c" in ln for ln in lines if ln.startswith("pattern"))
    assert "user gateway" in lines and "user admin" in lines
    assert lines.index("user gateway") > max(i for i, ln in enumerate(lines) if ln.startswith("pattern"))


def test_acl_covers_every_chunk_channel_from_the_topic_table() -> None:
    """Finding 10 of issue 20: infer/reply/_chunk/+ and cmd/ack/_chunk/+ were missing."""
    from edgeflow.transport.topics import DEVICE_CHANNEL_SPECS

    acl = fleet_acl("lab", ["gateway"], ["pi-1"]).splitlines()
    for spec in DEVICE_CHANNEL_SPECS:
        access = "write" if spec.writer == "device" else "read"
        assert f"pattern {access} edgeflow/lab/%u/{spec.name}" in acl
        assert (f"pattern {access} edgeflow/lab/%u/{spec.name}/_chunk/+" in acl) == spec.chunked, spec.name
    assert "pattern write edgeflow/lab/%u/infer/reply/_chunk/+" in acl
    assert "pattern write edgeflow/lab/%u/cmd/ack/_chunk/+" in acl


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
    files = fd.write_broker_config(ListenerSettings(port=18883, user=BROKER_USER), tls_hosts=["localhost"])
    creds = json.loads((fd.device_dir("pi-1") / "device.json").read_text())
    hashes = read_password_file(files.password_file)
    assert set(hashes) == {*OPERATORS, "pi-1"}
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
    assert set(read_password_file(again.password_file)) == {*OPERATORS, "pi-1", "pi-2"}
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


# ------------------------------------------------ issue 17: a config that runs from anywhere


def _cli(cwd, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow.cli.main", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # effective uid
    raise AssertionError("no Uid line")


@pytest.mark.integration
def test_generated_broker_starts_from_any_directory_unprivileged_and_without_warnings() -> None:
    """Relative --dir, started from /: absolute paths; as root the broker drops to `mosquitto` and can
    still read its files; its log has no warning; a device connects with the URL it was provisioned with."""
    from edgeflow.transport.broker import find_mosquitto

    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto is not installed")
    # A directory the unprivileged broker can enter (pytest's own tmp dirs are private to their owner).
    base = Path(tempfile.mkdtemp(prefix="edgeflow-brokercfg-"))
    os.chmod(base, 0o711)
    proc = None
    try:
        port = free_port()
        r = _cli(base, "broker-config", "--dir", "fleet", "--fleet", "lab", "--host", "127.0.0.1", "--port",
                 str(port), "--public-host", "localhost", "--log-file", "mosquitto.log", "--json")
        assert r.returncode == 0, r.stderr
        conf = Path(json.loads(r.stdout)["config"])
        r = _cli(base, "fleet", "provision", "pi-1", "--dir", "fleet", "--profile", PROFILE, "--json")
        assert r.returncode == 0, r.stderr
        text = conf.read_text()
        paths = [ln.split(None, 1)[1] for ln in text.splitlines()
                 if ln.split(" ", 1)[0] in ("password_file", "acl_file", "certfile", "keyfile", "cafile")]
        assert paths and all(Path(p).is_absolute() for p in paths)
        want_user = "mosquitto" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        assert f"user {want_user}" in text.splitlines() and "user root" not in text
        assert f"log_dest file {base / 'mosquitto.log'}" in text
        proc = subprocess.Popen([binary, "-c", str(conf)], cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert wait_for_port("127.0.0.1", port, 10, alive=lambda: proc.poll() is None), (base / "mosquitto.log").read_text()
        assert _uid_of(proc.pid) == pwd.getpwnam(want_user).pw_uid
        creds = json.loads((base / "fleet/devices/pi-1/device.json").read_text())
        assert creds["broker"] == f"mqtts://localhost:{port}"
        t = MqttTransport.from_url(creds["broker"], client_id="pi-1", username="pi-1", password=creds["password"],
                                   tls=TlsConfig(ca_file=str(base / "fleet/devices/pi-1/ca.crt")), connect_timeout_s=5)
        try:
            t.connect()
            t.publish(device_topic("lab", "pi-1", "telemetry").value, b"{}").wait(5)
        finally:
            t.close(timeout=1)
        lines = (base / "mosquitto.log").read_text().splitlines()
        startup = lines[:next(i for i, ln in enumerate(lines) if ln.endswith("running"))]
        # (the port probe above shows up later as a failed TLS connection: that is not the config's doing)
        bad = [ln for ln in lines if "warning" in ln.lower()] + [ln for ln in startup if "error" in ln.lower()]
        assert not bad, "\n".join(lines)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(5)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "--port 99999 is not a TCP port"),
    (["--port", "0"], "--port 0 is not a TCP port"),
    (["--websockets", "8883"], "--websockets 8883 is already the --port port"),
    (["--cert", "/nonexistent/s.crt", "--key", "/nonexistent/s.key"], "--cert /nonexistent/s.crt: file not found"),
    (["--cert", "CERT"], "--cert and --key go together"),
    (["--cert", "CERT", "--key", "OTHERKEY"], "does not belong to the certificate"),
    (["--ca", "NOTPEM"], "is not a PEM certificate"),
    (["--log-file", "/nonexistent/dir/m.log"], "directory /nonexistent/dir does not exist"),
    (["--max-packet-size", "100"], "max_packet_size 100 is too small"),
    (["--max-connections", "0"], "max_connections 0 is too small"),
    (["--broker-url", "gw:8883"], "has no scheme"),
    (["--broker-user", "nosuchuser"], "--broker-user nosuchuser"),
])
def test_broker_config_checks_ports_and_files_before_writing_anything(tmp_path, capsys, tls_material, argv,
                                                                      message) -> None:
    from edgeflow.cli.main import main

    other = make_tls_material(tmp_path / "other")
    (tmp_path / "notpem").write_text("hello")
    subst = {"CERT": str(tls_material.server_cert), "OTHERKEY": str(other.server_key), "NOTPEM": str(tmp_path / "notpem")}
    d = tmp_path / "fleet"
    capsys.readouterr()
    rc = main(["broker-config", "--dir", str(d), "--fleet", "lab", *[subst.get(a, a) for a in argv]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not d.exists(), "nothing is written when a setting is wrong"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_as_root_an_unreachable_fleet_directory_is_a_clear_error(tmp_path, capsys) -> None:
    from edgeflow.cli.main import main

    capsys.readouterr()
    rc = main(["broker-config", "--dir", str(tmp_path / "fleet"), "--fleet", "lab"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "drops to user 'mosquitto', which cannot enter" in err[0]
    assert "--broker-user root" in err[0]
    assert not (tmp_path / "fleet").exists(), "nothing is written when the broker could not read it"


def test_a_rerun_and_provisioning_keep_the_fleets_settings(tmp_path, capsys) -> None:
    from edgeflow.cli.main import main

    d = str(tmp_path / "fleet")
    user = ["--broker-user", BROKER_USER] if BROKER_USER else []
    assert main(["broker-config", "--dir", d, "--fleet", "lab", "--port", "18883", "--websockets", "18884",
                 "--public-host", "gw.lab.local", "--max-packet-size", "2000000", *user]) == 0
    conf = tmp_path / "fleet/broker/mosquitto.conf"
    first = conf.read_text()
    assert main(["broker-config", "--dir", d]) == 0, "a rerun without flags"
    assert main(["fleet", "provision", "pi-1", "--dir", d]) == 0
    text = conf.read_text()
    assert text == first, "nothing changed"
    assert "listener 18883 0.0.0.0" in text and "listener 18884 0.0.0.0" in text and "max_packet_size 2000000" in text
    creds = json.loads((tmp_path / "fleet/devices/pi-1/device.json").read_text())
    assert creds["broker"] == "mqtts://gw.lab.local:18883"
    assert main(["broker-config", "--dir", d, "--port", "18885"]) == 0, "one flag given again changes only that"
    text = conf.read_text()
    assert "listener 18885 0.0.0.0" in text and "listener 18884 0.0.0.0" in text and "max_packet_size 2000000" in text
    assert main(["fleet", "provision", "pi-2", "--dir", d]) == 0
    assert json.loads((tmp_path / "fleet/devices/pi-2/device.json").read_text())["broker"] == "mqtts://gw.lab.local:18885"
    capsys.readouterr()


@pytest.mark.integration
def test_a_device_provisioned_without_public_host_gets_a_usable_broker_url(tmp_path) -> None:
    fd = FleetDir(tmp_path / "fleet").init("lab")
    fd.provision("pi-1", profile=PROFILE)  # before any broker config: no URL known yet
    assert json.loads((fd.device_dir("pi-1") / "device.json").read_text())["broker"] is None
    port = free_port()
    log = tmp_path / "m.log"
    files = fd.write_broker_config(ListenerSettings(host="127.0.0.1", port=port, log_file=str(log), user=BROKER_USER),
                                   tls_hosts=["localhost", "127.0.0.1"])
    url = json.loads((fd.device_dir("pi-1") / "device.json").read_text())["broker"]
    assert url == f"mqtts://localhost:{port}", "broker-config filled in the URL"
    fd.provision("pi-2", profile=PROFILE)
    assert json.loads((fd.device_dir("pi-2") / "device.json").read_text())["broker"] == url
    broker = GeneratedBroker(files.config, port, log)
    try:
        agent = DeviceAgent.from_credentials(fd.device_dir("pi-1"), state_dir=tmp_path / "state",
                                             options=AgentOptions(telemetry_interval_s=5, health_runs=1))
        agent.start(timeout=10)
        try:
            assert agent.transport.is_connected
        finally:
            agent.stop()
    finally:
        broker.stop()


def test_transport_doc_shows_the_acl_broker_config_writes() -> None:
    """docs/transport.md's ACL section is the generated text for its example (fleet lab, device dev-1)."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "transport.md").read_text(encoding="utf-8")
    marker = '<!-- generated: fleet_acl("lab", ["gateway", "admin"], ["dev-1"]) -->'
    assert marker in doc, "docs/transport.md lost its generated ACL block"
    block = doc.split(marker, 1)[1].split("```", 2)[1]
    want = fleet_acl("lab", ["gateway", "admin"], ["dev-1"]).strip()
    assert block.strip() == want, ("docs/transport.md's ACL differs from what broker-config writes; paste:\n" + want)


@pytest.mark.parametrize("bind_host, flag", [("127.0.0.1", "--port"), ("0.0.0.0", "--port"),
                                             ("127.0.0.1", "--websockets"), ("127.0.0.1", "--local-port")])
def test_a_port_already_listened_on_is_refused_before_anything_is_written(tmp_path, capsys, bind_host, flag) -> None:
    """Issue 33: broker-config accepted a port in use; the broker then failed at start. A real listening
    socket: one line naming the port and the fix, rc 2, no fleet directory. A rerun keeping the port the
    running broker holds (what `fleet provision` does) is not refused."""
    from edgeflow.cli.main import main

    user = ["--broker-user", BROKER_USER] if BROKER_USER else []
    d = tmp_path / "fleet"
    with socket.socket() as busy:
        busy.bind((bind_host, 0))
        busy.listen()
        port = busy.getsockname()[1]
        others = {"--port": [], "--websockets": ["--port", str(free_port())], "--local-port": ["--port", str(free_port())]}
        capsys.readouterr()
        rc = main(["broker-config", "--dir", str(d), "--fleet", "lab", *others[flag], flag, str(port), *user])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert f"{flag} {port}: the port is already in use" in err[0] and f"choose another port with {flag}" in err[0]
        assert not d.exists(), "nothing is written when a port is taken"
    assert main(["broker-config", "--dir", str(d), "--fleet", "lab", *others[flag], flag, str(port), *user]) == 0
    with socket.socket() as broker:  # the broker now runs on it: reruns and provisioning go on
        broker.bind(("127.0.0.1" if flag == "--local-port" else "0.0.0.0", port))
        broker.listen()
        assert main(["broker-config", "--dir", str(d)]) == 0
        assert main(["fleet", "provision", "pi-1", "--dir", str(d)]) == 0
        capsys.readouterr()
        assert main(["broker-config", "--dir", str(d), flag, str(port)]) == 0, "the same port given again"
