"""Issue 31, the slow loris within ``max_connections``: broker/nftables.conf limits each source address.

Mosquitto 2.0 drops a socket that never sends CONNECT only after about 95 s, so one address opening
``max_connections`` idle sockets held the TLS listener's slots that long. ``edgeflow broker-config``
now also writes a firewall ruleset (:mod:`edgeflow.broker.firewall`) that caps the connections per
source address (and their rate). The unit tests read its text; the integration test loads it with
``nft`` in a network namespace of its own (tests/_netns.py), where the broker runs, and attacks it
from another namespace's address while a device connects from a third.
"""

from __future__ import annotations

import json
import select
import shutil
import subprocess
import sys
import time

import pytest
from _fleet import BROKER_USER, PROFILE
from _netns import netns_unavailable, testnet  # noqa: F401  (fixture)

from edgeflow.broker.firewall import ConnectionLimits, nftables_ruleset, per_source_limit, table_name
from edgeflow.broker.mosquitto import OPERATORS, FleetDir, ListenerSettings
from edgeflow.cli.main import main
from edgeflow.errors import ConfigError, TransportError
from edgeflow.transport.broker import find_mosquitto, wait_for_port
from edgeflow.transport.message import TlsConfig
from edgeflow.transport.mqtt import MqttTransport
from edgeflow.transport.topics import device_topic

# ------------------------------------------------------------------ the ruleset's text


def _rules(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("tcp dport")]


def test_the_ruleset_caps_connections_and_their_rate_per_source_on_the_listener_ports() -> None:
    text = nftables_ruleset(ConnectionLimits.for_source("lab-1.x", [8883, 8884], 9), config_path="/f/broker/nftables.conf")
    table = "inet edgeflow_broker_lab_1_x"
    body = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert body[:3] == [f"table {table}", f"delete table {table}", f"table {table} {{"], "one transaction replaces it"
    rules = _rules(text)
    assert len(rules) == 4 and all(r.startswith("tcp dport { 8883, 8884 } ct state new") for r in rules)
    assert all(r.endswith(('comment "new_rate"', 'comment "per_source"')) and "reject with tcp reset" in r
               for r in rules)
    rate = [r for r in rules if "new_rate" in r]
    count = [r for r in rules if "per_source" in r]
    assert [("ip saddr" in r, "ip6 saddr" in r) for r in rate] == [(True, False), (False, True)], "v4 and v6 apart"
    assert all("limit rate over 36/minute burst 18 packets" in r for r in rate)
    assert all("ct count over 9 }" in r for r in count) and "@open_v4" in count[0] and "@open_v6" in count[1]
    assert text.index('comment "new_rate"') < text.index('comment "per_source"'), "a SYN refused for its rate is never counted"
    assert 'iif "lo" accept' in text and text.index('iif "lo"') < text.index("tcp dport"), "loopback tools not counted"
    assert "nft -f /f/broker/nftables.conf" in text and f"nft delete table {table}" in text
    assert "flags dynamic,timeout; timeout 2m;" in text, "rate entries of quiet sources expire"


def test_per_source_limit_is_sized_from_the_operator_users_and_validated() -> None:
    assert per_source_limit(len(OPERATORS)) == len(OPERATORS) + 4 == 9
    assert per_source_limit(0) == 8 and per_source_limit(20) == 24
    assert table_name("a.b-c_d") == "edgeflow_broker_a_b_c_d"
    for bad, what in (((), 9, ), ([0], 9), ([8883], 0), ([True], 9)):
        with pytest.raises(ConfigError):
            nftables_ruleset(ConnectionLimits.for_source("lab", bad, what))
    with pytest.raises(ConfigError, match="per_source_connections 0 is too small"):
        ConnectionLimits("lab", (8883,), 0, 1, 1).validate()


def test_broker_config_writes_the_ruleset_and_keeps_the_per_source_flag(tmp_path, capsys) -> None:
    d = str(tmp_path / "fleet")
    user = ["--broker-user", BROKER_USER] if BROKER_USER else []
    capsys.readouterr()
    assert main(["broker-config", "--dir", d, "--fleet", "lab", "--port", "18883", "--websockets", "18884",
                 "--local-port", "18885", *user]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "fleet/broker/nftables.conf"
    assert f"nft -f {path}" in " ".join(out.split()) and "at most 9 connections per source address" in out
    rules = _rules(path.read_text())
    assert rules and all(r.startswith("tcp dport { 18883, 18884 }") for r in rules), "the loopback listener needs none"
    assert main(["broker-config", "--dir", d, "--per-source-connections", "40", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["firewall"] == str(path) and got["per_source_connections"] == 40
    assert main(["fleet", "provision", "pi-1", "--dir", d]) == 0, "provisioning reruns it"
    assert "ct count over 40 }" in path.read_text(), "the override is kept in fleet.json"
    assert json.loads((tmp_path / "fleet/fleet.json").read_text())["listener"]["per_source_connections"] == 40
    capsys.readouterr()
    assert main(["broker-config", "--dir", d, "--per-source-connections", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "per_source_connections 0 is too small" in err[0], err
    assert "ct count over 40 }" in path.read_text(), "nothing rewritten"


# ------------------------------------------------------------------ the attack, with the ruleset loaded

ATTACKER = r"""
import json, socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held, reset, other = [], 0, []
for _ in range(n):
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.settimeout(5)
    try:
        s.connect((host, port))
        held.append(s)
    except ConnectionRefusedError:
        reset += 1
        s.close()
    except OSError as exc:
        other.append(repr(exc))
        s.close()
print(json.dumps({"held": len(held), "reset": reset, "other": other}), flush=True)
sys.stdin.read()  # idle: never a CONNECT; hold the sockets until the test closes stdin
"""


def nft_unavailable() -> str | None:
    """Why the generated ruleset cannot be loaded here (no nft, no netns, the kernel refuses), or None."""
    if shutil.which("nft") is None:
        return "nftables is not installed (apt-get install -y nftables)"
    why = netns_unavailable()
    if why is not None:
        return why
    ns = f"efnft{time.monotonic_ns() % 100000}"
    subprocess.run(["ip", "netns", "add", ns], capture_output=True, timeout=30)
    try:
        p = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"], capture_output=True, text=True,
                           timeout=30)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return None if p.returncode == 0 else f"the kernel refuses nf_tables: {p.stderr.strip()}"


class Attacker:
    """``n`` idle TCP sockets from a test host, opened as fast as it can; held until :meth:`stop`."""

    def __init__(self, host, target: str, port: int, n: int) -> None:
        self.proc = host.popen([sys.executable, "-c", ATTACKER, target, str(port), str(n)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        assert ready, "the attacker did not report within 60 s"
        self.result = json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


def device_transport(fd: FleetDir, device: str, host: str, port: int, timeout_s: float) -> MqttTransport:
    """A TLS transport with ``device``'s credentials from the fleet directory (not connected)."""
    creds = json.loads((fd.device_dir(device) / "device.json").read_text())
    return MqttTransport(host, port, client_id=device, username=device, password=creds["password"],
                         tls=TlsConfig(ca_file=str(fd.broker_dir / "ca.crt")), connect_timeout_s=timeout_s)


def rule_counters(host, table: str) -> dict[str, int]:
    """Packets each commented rule of ``table`` matched (``nft -j``)."""
    out = json.loads(host.run(["nft", "-j", "list", "table", "inet", table], timeout=30, check=True).stdout)
    got: dict[str, int] = {}
    for item in out["nftables"]:
        rule = item.get("rule")
        if rule and rule.get("comment"):
            packets = sum(e["counter"]["packets"] for e in rule["expr"] if "counter" in e)
            got[rule["comment"]] = got.get(rule["comment"], 0) + packets
    return got


def _ipv6_addresses(net, hosts) -> dict[str, str]:
    """``fd00:231:K::/64`` on the test network (the bridge ``::1``, each host ``::<its IPv4 host part>``, no
    duplicate address detection so they work at once); returns {host name: address}."""
    prefix = f"fd00:231:{net.k}::"
    subprocess.run(["ip", "-6", "addr", "add", f"{prefix}1/64", "dev", net.bridge, "nodad"], check=True, timeout=30)
    out = {}
    for h in hosts:
        links = h.run(["ip", "-o", "link", "show"], timeout=30, check=True).stdout.splitlines()
        ifname = next(ln.split(":")[1].strip().split("@")[0] for ln in links if ": lo:" not in ln)
        out[h.name] = f"{prefix}{h.ip.rsplit('.', 1)[1]}"
        h.run(["ip", "-6", "addr", "add", f"{out[h.name]}/64", "dev", ifname, "nodad"], timeout=30, check=True)
    return out


@pytest.mark.integration
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_one_address_of_idle_sockets_no_longer_locks_a_device_out(tmp_path, testnet, family) -> None:  # noqa: F811
    """The broker in its own namespace (max_connections 16). Without the ruleset one attacker address with
    20 idle sockets holds every slot and the device's TLS connection is refused; with broker/nftables.conf
    loaded, the same address gets per_source sockets (the rest reset at once: rate and count rules
    both fire) and the device, from another address, connects and publishes at once. Over IPv4 and IPv6
    (the ruleset counts each family in its own set)."""
    why = nft_unavailable()
    if why is not None:
        pytest.skip(why)
    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto is not installed")
    broker, attacker = testnet.host("broker"), testnet.host("attacker")
    if family == "ipv6":
        target, bind = _ipv6_addresses(testnet, [broker, attacker])["broker"], "::"
    else:
        target, bind = broker.ip, "0.0.0.0"
    fd = FleetDir(tmp_path / "fleet").init("lab")
    fd.provision("pi-1", profile=PROFILE)
    limit, port = 16, 8883  # the namespace's own port space: the default port is free there
    files = fd.write_broker_config(ListenerSettings(host=bind, port=port, max_connections=limit, user=BROKER_USER,
                                                    log_file=str(tmp_path / "m.log")), tls_hosts=[target])
    per_source = files.per_source
    assert per_source == per_source_limit(len(OPERATORS)) < limit
    proc = broker.popen([binary, "-c", str(files.config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        stdin=subprocess.DEVNULL)
    assert wait_for_port(target, port, 10, alive=lambda: proc.poll() is None), (tmp_path / "m.log").read_text()

    # 1. the attack as it was: one address fills the listener, the device is refused
    flood = Attacker(attacker, target, port, limit + 4)
    try:
        assert flood.result["held"] == limit + 4, flood.result  # accepted; Mosquitto closes those past 16
        with pytest.raises(TransportError):
            device_transport(fd, "pi-1", target, port, 3).connect()
    finally:
        flood.stop()

    # 2. the generated ruleset loaded in the broker's namespace
    loaded = broker.run(["nft", "-f", str(files.firewall)], timeout=30)
    assert loaded.returncode == 0, loaded.stderr
    flood = Attacker(attacker, target, port, 3 * per_source)
    try:
        assert flood.result == {"held": per_source, "reset": 2 * per_source, "other": []}, flood.result
        counters = rule_counters(broker, table_name("lab"))
        assert counters.get("new_rate", 0) > 0 and counters.get("per_source", 0) > 0, counters
        t0 = time.monotonic()
        dev = device_transport(fd, "pi-1", target, port, 10)
        try:
            dev.connect()
            dev.publish(device_topic("lab", "pi-1", "telemetry").value, b"{}").wait(5)
        finally:
            dev.close(timeout=1)
        seconds = time.monotonic() - t0
        print(f"{family}: device connected and published in {seconds:.2f} s with {per_source} idle sockets held by the "
              f"attacker and {2 * per_source} refused; counters {counters}")
        assert flood.proc.poll() is None and proc.poll() is None, "the attack still holds its sockets, the broker is up"
    finally:
        flood.stop()
