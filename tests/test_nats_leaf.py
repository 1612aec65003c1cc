"""A site's leaf nats-server bridged to a hub (config from edgeflow/broker/nats.py), and a 30 s uplink cut.

- The generated configs, checked on their text, with the hostile inputs themselves (a password
  that would move the leaf URL's host, a site id that is a device's, a host with a path).
- On real servers on loopback: the site's uplink reaches the hub's JetStream (a partial is
  acknowledged by the hub's stream), and may not write another site's subjects there.
- In network namespaces (tests/_netns.py): the hub's nats-server on one host, the site's leaf
  server on another, joined by a direct veth link (the WAN) besides the test bridge (the LAN
  the devices and both gateways reach their servers over). The site runs rounds with its
  devices (announce, each device answers with its update, the site sends one partial up per
  round); the WAN link goes down for 30 s; the site keeps running rounds; after the link is
  back the hub holds every round's partial once.

Run: ``python -m pytest -q tests/test_nats_leaf.py`` (root and ``ip netns`` for the partition
test; it skips with the reason otherwise). ``-s`` prints the measured figures.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install -e '.[nats]')")

from _brokers import Inbox, stays, wait_until  # noqa: E402
from _netns import testnet  # noqa: E402, F401
from edgeflow.broker.nats import (  # noqa: E402
    UPLINK_ACCOUNT,
    NatsTls,
    jetstream_domain,
    nats_fleet_config,
    nats_hub_leafnodes,
    nats_jetstream_block,
    nats_site_config,
)
from edgeflow.errors import ConfigError, TransportError  # noqa: E402
from edgeflow.transport.broker import find_nats_server, free_port, wait_for_port  # noqa: E402
from edgeflow.transport.nats import NatsTransport  # noqa: E402

FLEET, SITE = "lab", "site-a"
DEVICES = ("dev-0", "dev-1", "dev-2")
CUT_S = 30.0


# ------------------------------------------------------------------ generated text

def _site(**kw: Any) -> str:
    args: dict[str, Any] = dict(devices={"dev-0": "d0"}, operators={"gateway": "g"}, keeper_password="k",
                                uplink_password="u", hub_host="hub.example", hub_password="s")
    args.update(kw)
    return nats_site_config(FLEET, SITE, **args).text


def test_site_config_bridges_only_the_uplink_account_and_maps_its_jetstream_api_to_the_hub() -> None:
    text = _site(hub_port=7423)
    assert 'url: "nats-leaf://site-a:s@hub.example:7423", account: UPLINK' in text
    assert text.count(", account: ") == 1  # the fleet account has no leaf remote: its traffic stays at the site
    assert '"$JS.API.>": "$JS.hub.API.>"' in text  # the uplink's JetStream is the hub's
    assert "LAB: {\n    jetstream: enabled" in text  # the devices' streams live at the site
    assert f"{UPLINK_ACCOUNT}: {{ users: [ {{user: \"site-a\"" in text
    assert nats_jetstream_block("/var/lib/js", jetstream_domain(SITE)) == \
        'jetstream { store_dir: "/var/lib/js", domain: "site-a" }\n'


def test_a_password_cannot_move_the_leaf_url_to_another_host() -> None:
    text = _site(hub_password="x@evil.example:99/")
    assert 'nats-leaf://site-a:x%40evil.example%3A99%2F@hub.example:7422"' in text


@pytest.mark.parametrize(("kw", "match"), [
    ({"hub_host": "hub.example/x"}, "not a host name"),
    ({"hub_host": "a@b"}, "not a host name"),
    ({"hub_host": ""}, "not a host name"),
    ({"hub_port": 70000}, "1..65535"),
    ({"devices": {SITE: "d"}}, "also a device or operator"),
])
def test_site_config_refuses(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _site(**kw)


def test_site_id_gateway_and_bad_domain_are_refused() -> None:
    with pytest.raises(ConfigError, match="reserved"):
        nats_site_config(FLEET, "gateway", {}, {"gw": "g"}, keeper_password="k", uplink_password="u",
                         hub_host="h", hub_password="p")
    with pytest.raises(ConfigError, match="JetStream domain"):
        nats_jetstream_block("/x", "a.b")


def test_hub_tls_goes_to_both_ends() -> None:
    tls = NatsTls("/c/hub.crt", "/c/hub.key", "/c/ca.crt")
    hub = nats_hub_leafnodes(port=7422, tls=tls)
    assert 'leafnodes {\n  host: "0.0.0.0"\n  port: 7422\n  tls {\n    cert_file: "/c/hub.crt"' in hub
    assert 'tls: { ca_file: "/c/ca.crt" }' in _site(hub_ca="/c/ca.crt")
    assert "tls" not in _site()


def test_a_site_at_the_hub_has_a_devices_rights_with_the_hubs_api_prefix() -> None:
    cfg = nats_fleet_config(FLEET, {"dev-0": "d"}, {"gateway": "g"}, keeper_password="k", sites={SITE: "s"})
    assert cfg.may_publish(SITE, "ef.edgeflow.lab.site-a.update")
    assert cfg.may_publish(SITE, "$JS.hub.API.STREAM.INFO.EF_LIVE")
    assert not cfg.may_publish(SITE, "$JS.API.STREAM.INFO.EF_LIVE")
    assert not cfg.may_publish(SITE, "ef.edgeflow.lab.site-b.update")
    assert not cfg.may_publish(SITE, "ef.edgeflow.lab.gateway.round")
    assert cfg.may_publish("dev-0", "$JS.API.STREAM.INFO.EF_LIVE")
    with pytest.raises(ConfigError, match="both a device and a site"):
        nats_fleet_config(FLEET, {SITE: "d"}, {"gateway": "g"}, keeper_password="k", sites={SITE: "s"})


# ------------------------------------------------------------------ real servers

needs_server = pytest.mark.skipif(find_nats_server() is None, reason="nats-server is not installed")


class Deployment:
    """A hub and a site's leaf server: configs, passwords and the commands to start them."""

    def __init__(self, workdir: Path, *, hub_wan_ip: str, leaf_port: int = 7422, ping_s: int | None = None,
                 leaf_tls: NatsTls | None = None, hub_ca: str | None = None) -> None:
        self.workdir = workdir
        self.pw = {u: secrets.token_hex(8) for u in (*DEVICES, "gateway", "site-gateway", SITE, "uplink")}
        pings = f"ping_interval: \"{ping_s}s\"\nping_max: 2\n" if ping_s else ""
        self.leaf_port = leaf_port
        hub = nats_fleet_config(FLEET, {}, {"gateway": self.pw["gateway"]}, keeper_password=secrets.token_hex(8),
                                sites={SITE: self.pw[SITE]})
        site = nats_site_config(FLEET, SITE, {d: self.pw[d] for d in DEVICES}, {"gateway": self.pw["site-gateway"]},
                                keeper_password=secrets.token_hex(8), uplink_password=self.pw["uplink"],
                                hub_host=hub_wan_ip, hub_port=self.leaf_port, hub_password=self.pw[SITE],
                                hub_ca=hub_ca)
        self.hub_conf, self.site_conf = workdir / "hub.conf", workdir / "site.conf"
        self.hub_log, self.site_log = workdir / "hub.log", workdir / "site.log"
        self.hub_conf.write_text("server_name: hub\nport: {port}\n" + pings
                                 + nats_jetstream_block(str(workdir / "hub-js"), "hub") + hub.text
                                 + nats_hub_leafnodes(port=self.leaf_port, host=hub_wan_ip, tls=leaf_tls),
                                 encoding="utf-8")
        self.site_conf.write_text(f"server_name: {SITE}\nport: {{port}}\n" + pings
                                  + nats_jetstream_block(str(workdir / "site-js"), jetstream_domain(SITE))
                                  + site.text, encoding="utf-8")

    def conf(self, which: str, host: str, port: int) -> list[str]:
        path = self.hub_conf if which == "hub" else self.site_conf
        text = path.read_text(encoding="utf-8").replace("port: {port}", f"host: {host}\nport: {port}", 1)
        path.write_text(text, encoding="utf-8")
        return [find_nats_server() or "nats-server", "-c", str(path)]

    def transport(self, host: str, port: int, user: str, *, client_id: str, password_of: str | None = None,
                  **kw: Any) -> NatsTransport:
        return NatsTransport(host, port, client_id=client_id, username=user, password=self.pw[password_of or user],
                             reconnect_min_s=0.2, reconnect_max_s=1.0, connect_timeout_s=10.0, **kw)


def _logged_at(path: Path, text: str, index: int) -> float:
    """When nats-server logged the ``index``-th line holding ``text`` (its local-time stamp, as epoch s)."""
    import datetime

    line = [ln for ln in _log(path).splitlines() if text in ln][index]
    stamp = " ".join(line.split()[1:3])  # [pid] 2026/12/05 23:45:53.613451 [INF] ...
    return datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()


def _pick(stats: dict[str, int], *names: str) -> str:
    return " ".join(f"{n}={stats.get(n, 0)}" for n in names)


def _log(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


@needs_server
@pytest.mark.integration
def test_the_uplink_reaches_the_hubs_jetstream_and_only_its_own_subjects(tmp_path: Path) -> None:
    """Loopback: a partial from the site's uplink account is acknowledged by the hub's stream and heard
    by the root; a partial forged for another site is not let through by the hub (the leaf user's rights)."""
    d = Deployment(tmp_path, hub_wan_ip="127.0.0.1", leaf_port=free_port("127.0.0.1"))
    hp, sp = free_port("127.0.0.1"), free_port("127.0.0.1")
    procs = [subprocess.Popen(d.conf("hub", "127.0.0.1", hp), stdout=open(d.hub_log, "wb"), stderr=subprocess.STDOUT),
             subprocess.Popen(d.conf("site", "127.0.0.1", sp), stdout=open(d.site_log, "wb"),
                              stderr=subprocess.STDOUT)]
    made: list[NatsTransport] = []
    try:
        assert wait_for_port("127.0.0.1", hp, 10) and wait_for_port("127.0.0.1", sp, 10), _log(d.site_log)
        root = d.transport("127.0.0.1", hp, "gateway", client_id="root")
        made.append(root.connect())
        got = Inbox()
        root.subscribe(f"edgeflow/{FLEET}/+/update/#", got)
        assert wait_until(lambda: "Leafnode connection created" in _log(d.site_log), 10), _log(d.site_log)
        up = d.transport("127.0.0.1", sp, SITE, client_id=SITE, password_of="uplink", ack_timeout_s=1.0)
        made.append(up.connect())
        up.publish(f"edgeflow/{FLEET}/{SITE}/update", b"partial-1").wait(10)  # the hub's stream acknowledged it
        assert wait_until(lambda: [m.payload for m in got.messages] == [b"partial-1"], 10)
        forged = up.publish(f"edgeflow/{FLEET}/site-b/update", b"forged")
        with pytest.raises(TransportError):
            forged.wait(5)
        stays(lambda: len(got.messages), for_s=0.5, reason="the hub let a forged partial for another site through")
    finally:
        for t in made:
            t.close(timeout=1.0, flush=False)
        for p in procs:
            p.terminate()
            p.wait(10)


@needs_server
@pytest.mark.integration
@pytest.mark.parametrize("trusted", [True, False], ids=["fleet-ca", "other-ca"])
def test_a_tls_leaf_port_connects_a_site_that_trusts_the_fleet_ca_only(tmp_path: Path, trusted: bool) -> None:
    """The hub's leaf port with TLS (a server certificate from the fleet CA): a site given the fleet CA
    connects and its partial is acknowledged by the hub; a site given another CA never connects
    (and its uplink finds no JetStream)."""
    from edgeflow.broker.mosquitto import make_fleet_ca

    ca, cert, key = make_fleet_ca(tmp_path / "ca", ["127.0.0.1"])
    other_ca, _c, _k = make_fleet_ca(tmp_path / "other", ["127.0.0.1"])
    d = Deployment(tmp_path, hub_wan_ip="127.0.0.1", leaf_port=free_port("127.0.0.1"),
                   leaf_tls=NatsTls(str(cert), str(key), str(ca)), hub_ca=str(ca if trusted else other_ca))
    hp, sp = free_port("127.0.0.1"), free_port("127.0.0.1")
    procs = [subprocess.Popen(d.conf("hub", "127.0.0.1", hp), stdout=open(d.hub_log, "wb"), stderr=subprocess.STDOUT),
             subprocess.Popen(d.conf("site", "127.0.0.1", sp), stdout=open(d.site_log, "wb"),
                              stderr=subprocess.STDOUT)]
    made: list[NatsTransport] = []
    try:
        assert wait_for_port("127.0.0.1", hp, 10) and wait_for_port("127.0.0.1", sp, 10), _log(d.site_log)
        root = d.transport("127.0.0.1", hp, "gateway", client_id="root")
        made.append(root.connect())
        got = Inbox()
        root.subscribe(f"edgeflow/{FLEET}/{SITE}/update", got)
        up = d.transport("127.0.0.1", sp, SITE, client_id=SITE, password_of="uplink")
        made.append(up)
        if trusted:
            assert wait_until(lambda: "Adding JetStream Domain Mapping" in _log(d.site_log), 10), _log(d.site_log)
            up.connect()
            up.publish(f"edgeflow/{FLEET}/{SITE}/update", b"partial-1").wait(10)
            assert wait_until(lambda: [m.payload for m in got.messages] == [b"partial-1"], 10)
        else:
            assert wait_until(lambda: "TLS leafnode handshake error" in _log(d.site_log), 10), _log(d.site_log)
            assert "Adding JetStream Domain Mapping" not in _log(d.site_log)  # the leaf never came up
            with pytest.raises(TransportError, match="JetStream is not available"):
                up.connect(3)
    finally:
        for t in made:
            t.close(timeout=1.0, flush=False)
        for p in procs:
            p.terminate()
            p.wait(10)


# ------------------------------------------------------------------ edgeflow broker-config

def _fleet_dirs(tmp_path: Path) -> tuple[Any, Any]:
    from edgeflow.broker.mosquitto import FleetDir

    hub = FleetDir(tmp_path / "hub")
    hub.init(FLEET)
    hub.provision(SITE)
    site = FleetDir(tmp_path / "site")
    site.init(FLEET)
    site.provision("pi-7")
    return hub, site


@pytest.mark.parametrize(("args", "says"), [
    (["--leaf-of", "http://hub.example:7422"], "is not one; use nats://HUB:7422"),
    (["--leaf-of", "nats://site-a:pw@hub.example:7422"], "holds a user name or password"),
    (["--leaf-of", "nats://hub.example:99999"], "bad port"),
    (["--leaf-of", "nats://hub.example:7422/x"], "is not one"),
    (["--leaf-of", "nats://hub.example:7422"], "needs --hub-credentials"),
    (["--leaf-of", "tls://hub.example", "--hub-credentials", "{creds}"], "pass --hub-ca"),
    (["--leaf-of", "nats://hub.example", "--hub-credentials", "{missing}"], "not found"),
    (["--leaf-port", "7422"], "needs at least one --leaf-site"),
    (["--leaf-port", "7422", "--leaf-site", "site-b"], "'site-b' is not provisioned"),
    (["--leaf-port", "7422", "--leaf-site", SITE, "--leaf-tls"], "no server certificate"),
    (["--leaf-port", "7422", "--leaf-of", "nats://hub.example"], "give one"),
    (["--leaf-site", SITE], "--leaf-site goes with --leaf-port"),
])
def test_broker_config_leaf_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   args: list[str], says: str) -> None:
    from edgeflow.cli.main import main

    hub, site = _fleet_dirs(tmp_path)
    creds = tmp_path / "site-a.json"  # copied without its ca.crt
    creds.write_bytes((hub.device_dir(SITE) / "device.json").read_bytes())
    args = [a.format(creds=creds, missing=tmp_path / "nope.json") for a in args]
    target = hub if "--leaf-port" in args else site
    capsys.readouterr()
    assert main(["broker-config", "--dir", str(target.path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err, err
    assert not list(target.broker_dir.glob("nats-*.conf")) if target.broker_dir.exists() else True


@needs_server
@pytest.mark.integration
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "leaf-tls"])
def test_broker_config_writes_a_hub_and_a_site_that_run_as_its_leaf(tmp_path: Path, tls: bool) -> None:
    """`edgeflow broker-config --leaf-port` in the hub's fleet directory and `--leaf-of` in the site's:
    the two nats-servers run on them, the site's uplink (with the credentials the site's config
    made) gets a partial acknowledged by the hub's stream, and hears the hub's round announcement.
    ``leaf-tls``: the hub's leaf port with the fleet's server certificate, the site at tls://."""
    from edgeflow.broker.mosquitto import make_fleet_ca
    from edgeflow.cli.main import main

    hub, site = _fleet_dirs(tmp_path)
    hp, sp, lp = (free_port("127.0.0.1") for _ in range(3))
    secure: list[str] = []
    if tls:  # what `edgeflow broker-config` makes in broker/ on its first run
        make_fleet_ca(hub.broker_dir, ["127.0.0.1"])
        secure = ["--hub-ca", str(hub.broker_dir / "ca.crt")]
    assert main(["broker-config", "--dir", str(hub.path), "--leaf-port", str(lp), "--leaf-site", SITE,
                 "--host", "127.0.0.1", "--port", str(hp), *(["--leaf-tls"] if tls else [])]) == 0
    assert main(["broker-config", "--dir", str(site.path), "--leaf-of", f"{'tls' if tls else 'nats'}://127.0.0.1:{lp}",
                 "--hub-credentials", str(hub.device_dir(SITE) / "device.json"), *secure,
                 "--host", "127.0.0.1", "--port", str(sp)]) == 0
    assert ("tls {" in (hub.broker_dir / "nats-hub.conf").read_text(encoding="utf-8")) == tls
    hub_log, site_log = tmp_path / "hub.log", tmp_path / "site.log"
    procs = [subprocess.Popen([find_nats_server() or "nats-server", "-c", str(hub.broker_dir / "nats-hub.conf")],
                              stdout=open(hub_log, "wb"), stderr=subprocess.STDOUT),
             subprocess.Popen([find_nats_server() or "nats-server", "-c", str(site.broker_dir / "nats-leaf.conf")],
                              stdout=open(site_log, "wb"), stderr=subprocess.STDOUT)]
    made: list[NatsTransport] = []
    try:
        assert wait_for_port("127.0.0.1", hp, 10) and wait_for_port("127.0.0.1", sp, 10), _log(site_log)
        assert wait_until(lambda: "Leafnode connection created" in _log(site_log), 10), _log(site_log)
        gw = hub.operator("gateway")
        root = NatsTransport("127.0.0.1", hp, client_id="root", username=gw["username"], password=gw["password"])
        made.append(root.connect())
        got = Inbox()
        root.subscribe(f"edgeflow/{FLEET}/+/update", got)
        creds = json.loads((site.broker_dir / "nats-uplink.json").read_text(encoding="utf-8"))
        up = NatsTransport("127.0.0.1", sp, client_id=SITE, username=creds["username"], password=creds["password"])
        made.append(up.connect())
        heard = Inbox()
        up.subscribe(f"edgeflow/{FLEET}/gateway/round", heard)
        up.publish(f"edgeflow/{FLEET}/{SITE}/update", b"partial-1").wait(10)
        assert wait_until(lambda: [m.payload for m in got.messages] == [b"partial-1"], 10)
        root.publish(f"edgeflow/{FLEET}/gateway/round", b"r1").wait(10)
        assert wait_until(lambda: [m.payload for m in heard.messages] == [b"r1"], 10)
        dev = json.loads((site.device_dir("pi-7") / "device.json").read_text(encoding="utf-8"))
        local = NatsTransport("127.0.0.1", sp, client_id="pi-7", username="pi-7", password=dev["password"],
                              create_streams=False)
        sgw = site.operator("gateway")
        made.append(NatsTransport("127.0.0.1", sp, client_id="site-gw", username="gateway",
                                  password=sgw["password"]).connect())  # makes the site's own streams
        made.append(local.connect())
        local.publish(f"edgeflow/{FLEET}/pi-7/update", b"u").wait(10)  # acknowledged by the site's stream
        stays(lambda: len(got.messages), for_s=0.5, reason="a device's update left the site")
    finally:
        for t in made:
            t.close(timeout=1.0, flush=False)
        for p in procs:
            p.terminate()
            p.wait(10)


# ------------------------------------------------------------------ the partition

class SiteRounds:
    """The site's side of the test: rounds with its devices, one partial per round up to the hub.

    Each round: the site gateway announces it (``gateway/round``), every device answers with its
    update (``<device>/update``: round and a value), and when all have answered the site publishes
    the round's partial (the sum, the count) through its uplink transport and starts the next
    round. Rounds are paced ``period_s`` apart; each is stamped with whether the WAN was up.
    """

    def __init__(self, local: NatsTransport, uplink: NatsTransport, devices: list[NatsTransport],
                 period_s: float) -> None:
        self.local, self.uplink, self.devices, self.period_s = local, uplink, devices, period_s
        self.round = 0
        self.answers: dict[int, dict[str, int]] = {}
        self.closed: list[tuple[int, bool]] = []
        self.deliveries: list[Any] = []
        self.wan_up = True
        self.stop = threading.Event()
        self._next = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="site-rounds", daemon=True)

    def start(self) -> None:
        for dev in self.devices:
            dev.subscribe(f"edgeflow/{FLEET}/gateway/round", self._device_handler(dev))
        self.local.subscribe(f"edgeflow/{FLEET}/+/update", self._on_update)
        self._thread.start()

    def _device_handler(self, dev: NatsTransport) -> Any:
        def on_round(msg: Any) -> None:
            r = json.loads(msg.payload)["round"]
            value = r * 10 + int(dev.client_id.rsplit("-", 1)[1])  # this device's "training" result
            dev.publish(f"edgeflow/{FLEET}/{dev.client_id}/update", json.dumps({"round": r, "value": value}).encode())
        return on_round

    def _on_update(self, msg: Any) -> None:
        device = msg.topic.split("/")[2]
        body = json.loads(msg.payload)
        with self._lock:
            answers = self.answers.setdefault(body["round"], {})
            answers[device] = body["value"]
            done = body["round"] == self.round and len(answers) == len(self.devices)
        if done:
            self._close_round(body["round"], answers)

    def _close_round(self, r: int, answers: dict[str, int]) -> None:
        partial = {"round": r, "n": len(answers), "sum": sum(answers.values()), "wan_up": self.wan_up}
        self.deliveries.append(self.uplink.publish(f"edgeflow/{FLEET}/{SITE}/update", json.dumps(partial).encode()))
        self.closed.append((r, self.wan_up))
        self._next.set()

    def _run(self) -> None:
        while not self.stop.is_set():
            self._next.clear()
            with self._lock:
                self.round += 1
                r = self.round
            self.local.publish(f"edgeflow/{FLEET}/gateway/round", json.dumps({"round": r}).encode())
            if not self._next.wait(20):
                return  # a round did not close: the test's assertions say which
            self.stop.wait(self.period_s)


@pytest.mark.integration
@pytest.mark.slow
def test_a_site_keeps_running_rounds_through_a_30s_uplink_cut_and_the_hub_gets_every_partial_once(
        testnet, tmp_path: Path) -> None:  # noqa: F811
    """The leaf deployment in network namespaces, the WAN link cut for 30 s (see the module docstring)."""
    if find_nats_server() is None:
        pytest.skip("nats-server is not installed")
    net = testnet
    hub, site = net.host("hub"), net.host("site")
    wan = net.wire(hub, site)
    d = Deployment(tmp_path, hub_wan_ip=wan.a_ip, ping_s=2)
    hub.popen(d.conf("hub", "0.0.0.0", 4222), stdout=open(d.hub_log, "wb"), stderr=subprocess.STDOUT)
    site.popen(d.conf("site", "0.0.0.0", 4222), stdout=open(d.site_log, "wb"), stderr=subprocess.STDOUT)
    logs = lambda: f"--- hub\n{_log(d.hub_log)[-3000:]}\n--- site\n{_log(d.site_log)[-3000:]}"  # noqa: E731
    assert wait_for_port(hub.ip, 4222, 20) and wait_for_port(site.ip, 4222, 20), logs()
    assert wait_until(lambda: "Leafnode connection created" in _log(d.site_log), 20), logs()
    made: list[NatsTransport] = []

    def connect(t: NatsTransport) -> NatsTransport:
        made.append(t)
        return t.connect()

    rounds = None
    try:
        root = connect(d.transport(hub.ip, 4222, "gateway", client_id="root"))
        partials = Inbox()
        root.subscribe(f"edgeflow/{FLEET}/{SITE}/update", partials)
        local = connect(d.transport(site.ip, 4222, "gateway", client_id="site-gateway", password_of="site-gateway"))
        uplink = connect(d.transport(site.ip, 4222, SITE, client_id=SITE, password_of="uplink", ack_timeout_s=2.0))
        devices = [connect(d.transport(site.ip, 4222, dev, client_id=dev)) for dev in DEVICES]
        rounds = SiteRounds(local, uplink, devices, period_s=0.25)
        rounds.start()
        assert wait_until(lambda: len(rounds.closed) >= 5, 30), (rounds.closed, logs())

        rounds.wan_up = False
        wan.set_up(False)
        cut_at = time.monotonic()
        before = len(rounds.closed)
        # the leaf connection is seen gone (pings: 2 s, 2 missed) while the site goes on
        assert wait_until(lambda: "Leafnode connection closed" in _log(d.site_log), 15), logs()
        rounds.stop.wait(max(0.0, CUT_S - (time.monotonic() - cut_at)))
        during = len(rounds.closed) - before
        wan.set_up(True)
        rounds.wan_up = True
        up_at = time.monotonic()
        queued = len(rounds.closed)  # the rounds closed before the link came back: their partials are due
        assert wait_until(lambda: len(partials.messages) >= queued, 60), (len(partials.messages), queued, logs())
        caught_up_s = time.monotonic() - up_at
        assert _log(d.site_log).count("Leafnode connection created") >= 2, logs()  # the leaf reconnected
        assert wait_until(lambda: len(rounds.closed) >= queued + 5, 30), (rounds.closed, logs())
        rounds.stop.set()
        rounds._thread.join(30)
        closed = [r for r, _ in rounds.closed]
        assert wait_until(lambda: len(partials.messages) >= len(closed), 30), \
            (len(partials.messages), len(closed), logs())
        for dlv in rounds.deliveries:
            dlv.wait(30)  # every partial acknowledged by the hub's stream
        stays(lambda: len(partials.messages), for_s=1.0, reason="more partials than rounds reached the hub")

        got = [json.loads(m.payload) for m in partials.messages]
        counts = Counter(p["round"] for p in got)
        assert sorted(counts) == closed and set(counts.values()) == {1}, counts  # 0 lost, 0 double-counted
        want_sum = {r: sum(r * 10 + i for i in range(len(DEVICES))) for r in closed}
        assert all(p["sum"] == want_sum[p["round"]] and p["n"] == len(DEVICES) for p in got)
        offline = [r for r, up in rounds.closed if not up]
        assert during >= 20 and len(offline) >= 20, (during, offline)  # rounds went on at the site
        # the uplink kept its partials without spinning: a hot loop resent ~7,000 frames a second of the cut
        assert uplink.stats().get("resent_frames", 0) < 100 * CUT_S, uplink.stats()
        print(f"\nNATS leaf partition: {len(closed)} site rounds, {len(offline)} during the {CUT_S:.0f} s cut; "
              f"hub got {len(got)} partials ({sum(v - 1 for v in counts.values())} duplicates, "
              f"{len(closed) - len(counts)} lost); the queued ones all at the hub {caught_up_s:.1f} s after the "
              f"link came back; uplink {_pick(uplink.stats(), 'ack_timeouts', 'resent_frames', 'reconnects')}, "
              f"root {_pick(root.stats(), 'duplicates_dropped', 'gap_replayed')}")
    finally:
        if rounds is not None:
            rounds.stop.set()
        for t in made:
            t.close(timeout=1.0, flush=False)
        net.close()
        shutil.rmtree(tmp_path / "hub-js", ignore_errors=True)


@pytest.mark.integration
@pytest.mark.slow
def test_the_site_gateway_on_a_leaf_finishes_the_root_round_it_trained_through_a_30s_cut(
        testnet, tmp_path: Path) -> None:  # noqa: F811
    """The real hierarchy (gateway/hierarchy.py) on the leaf deployment: a root gateway on the hub, a
    SiteGateway at the site (its devices' rounds on the site's fleet account, its uplink on the
    UPLINK account), 3 federated devices. The WAN is cut right after the site opened root round 2:
    the devices train and the site closes its round during the cut; its partial reaches the root
    after the link is back, and the three root rounds equal flat FedAvg over the devices."""
    if find_nats_server() is None:
        pytest.skip("nats-server is not installed")
    import numpy as np

    from edgeflow import zoo
    from edgeflow.data.datasets import dirichlet_partition, load_digits
    from edgeflow.federated import Client
    from edgeflow.gateway.hierarchy import SiteGateway, Uplink, root_manager, site_manager
    from edgeflow.gateway.rounds import Candidate, RoundConfig
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.protocol.rounds import RoundAnnouncement, TrainConfig
    from edgeflow.signing import KeyRing, PrivateKey, Signer

    net = testnet
    hub, site = net.host("hub"), net.host("site")
    wan = net.wire(hub, site)
    d = Deployment(tmp_path, hub_wan_ip=wan.a_ip, ping_s=2)
    hub.popen(d.conf("hub", "0.0.0.0", 4222), stdout=open(d.hub_log, "wb"), stderr=subprocess.STDOUT)
    site.popen(d.conf("site", "0.0.0.0", 4222), stdout=open(d.site_log, "wb"), stderr=subprocess.STDOUT)
    logs = lambda: f"--- hub\n{_log(d.hub_log)[-3000:]}\n--- site\n{_log(d.site_log)[-3000:]}"  # noqa: E731
    assert wait_for_port(hub.ip, 4222, 20) and wait_for_port(site.ip, 4222, 20), logs()
    assert wait_until(lambda: "Leafnode connection created" in _log(d.site_log), 20), logs()

    fleet_key = PrivateKey.generate()
    model = zoo.digits_mlp(seed=3)
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, len(DEVICES), alpha=1.0, seed=0)
    made: list[NatsTransport] = []

    def transport(host: str, user: str, client_id: str, password_of: str | None = None) -> NatsTransport:
        t = d.transport(host, 4222, user, client_id=client_id, password_of=password_of, ack_timeout_s=2.0)
        made.append(t)
        return t

    ring = KeyRing()
    clients: list[Client] = []
    for i, dev in enumerate(DEVICES):
        signer = Signer.generate(dev)
        ring.register(dev, signer.public_key)
        clients.append(Client(transport(site.ip, dev, dev), fleet=FLEET, device_id=dev, signer=signer,
                              fleet_key=fleet_key.public_key, model=model,
                              data=(split.x_train[parts[i]], split.y_train[parts[i]]), seed=i))
    site_signer = Signer.generate(SITE)
    uplink = Uplink(transport(site.ip, SITE, SITE, password_of="uplink"), FLEET, bridged=False)
    site_closed: dict[int, float] = {}
    rm = site_manager(transport(site.ip, "gateway", "site-gateway", password_of="site-gateway"), GatewayStore(),
                      fleet=FLEET, fleet_key=fleet_key, keyring=ring, model=model,
                      config=RoundConfig(min_clients=len(DEVICES), deadline_s=60, strategy="fedavg"),
                      candidates=lambda: [Candidate(dev) for dev in ring.devices()], uplink=uplink,
                      signer=site_signer, on_round=lambda m: site_closed.setdefault(m.round_id, time.monotonic()))
    sg = SiteGateway(rm, uplink, site_id=SITE, root_key=fleet_key.public_key, forward_margin_s=3.0)
    rt = transport(hub.ip, "gateway", "root")
    root = root_manager(rt, GatewayStore(), fleet=FLEET, fleet_key=fleet_key,
                        site_keys=KeyRing({SITE: site_signer.public_key}), model=model, sites=[SITE],
                        config=RoundConfig(rounds=3, min_clients=1, deadline_s=120, strategy="fedavg",
                                           strategy_params={"stage": 0},
                                           train=TrainConfig(epochs=3, batch_size=16, lr=0.1, codec="dense")))
    cut: dict[str, float] = {}

    def cut_after_round_1(msg: Any) -> None:  # the site announced a round to its devices: the WAN goes at round 2
        if not msg.payload:
            return
        ann = RoundAnnouncement.verify(msg.payload, fleet_key.public_key)
        if ann.round_id == 2 and ann.state == "open" and "at" not in cut:
            wan.set_up(False)
            cut["at"] = time.monotonic()

    root_closed: dict[int, float] = {}
    expected: list[dict[str, Any]] = []
    befores = [dict(root.weights)]

    def on_root_round(m: Any) -> None:
        root_closed[m.round_id] = time.monotonic()
        n = np.array([len(c.x) for c in clients], dtype=np.float64)
        expected.append({name: w.astype(np.float64) + np.tensordot(
            n / n.sum(), np.stack([c.last_delta[name].astype(np.float64) for c in clients]), axes=1)
            for name, w in befores[-1].items()})
        befores.append(dict(root.weights))

    root.on_round = on_root_round
    thread = threading.Thread(target=sg.run, name="site-gateway", daemon=True)
    history: list[Any] = []
    runner = threading.Thread(target=lambda: history.extend(root.run()), name="root", daemon=True)
    try:
        root.start()
        rt.connect(timeout=20)  # first: the root's transport makes the hub's streams
        sg.start()
        rm.transport.connect(timeout=20)  # the site gateway's transport makes the site's streams
        uplink.transport.connect(timeout=20)
        for c in clients:
            c.start()
            c.transport.connect(timeout=20)
        watcher = transport(site.ip, "gateway", "watcher", password_of="site-gateway").connect(20)
        watcher.subscribe(f"edgeflow/{FLEET}/gateway/round", cut_after_round_1)
        thread.start()
        runner.start()
        assert wait_until(lambda: "at" in cut, 90), (root_closed, site_closed, logs())
        # the devices got round 2 from the site gateway and trained it, the WAN down
        assert wait_until(lambda: all(c.stats.updates_sent >= 2 for c in clients), 30), \
            [(c._version, c.stats) for c in clients]
        trained_at = time.monotonic()
        rest = CUT_S - (time.monotonic() - cut["at"])
        threading.Event().wait(max(0.0, rest))
        assert 2 not in root_closed, root_closed  # the partial waited for the link
        wan.set_up(True)
        up_at = time.monotonic()
        runner.join(120)
        assert not runner.is_alive(), (root_closed, site_closed, logs())
        assert [m.participants for m in history] == [len(DEVICES)] * 3, history
        assert cut["at"] < trained_at < up_at < root_closed[2], (cut, trained_at, up_at, root_closed)
        assert site_closed[2] > up_at  # the site's round ends when the hub's stream has its partial
        assert wait_until(lambda: rm.sink.forwarded == [1, 2, 3], 10), rm.sink.forwarded  # its ack may come after
        for got, want in zip(befores[1:], expected):
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        print(f"\nNATS leaf, real hierarchy: the devices had trained round 2 {trained_at - cut['at']:.1f} s into the "
              f"{CUT_S:.0f} s cut; root round 2 closed {root_closed[2] - up_at:.1f} s after the link came back; "
              f"uplink {_pick(uplink.transport.stats(), 'resent_frames', 'no_stream_retries')}")
    finally:
        wan.set_up(True)
        sg.stop()
        root.stop()
        for th in (thread, runner):
            if th.is_alive():
                th.join(10)
        for c in clients:
            c.stop(timeout=2)
        for t in made:
            t.close(timeout=1.0, flush=False)
        net.close()


@pytest.mark.integration
@pytest.mark.slow
def test_what_the_root_publishes_during_a_cut_reaches_the_site_after_it(testnet, tmp_path: Path) -> None:  # noqa: F811
    """The hub-to-site direction: the root's retained ``gateway/state`` and a live ``gateway/round``
    published while the WAN is down are heard by the site's uplink once the leaf connection is back,
    each once and before what the root publishes after the cut (the uplink's own connection to the site's
    server never drops: its link notices the hub's JetStream gone and back, and replays the gap)."""
    if find_nats_server() is None:
        pytest.skip("nats-server is not installed")
    net = testnet
    hub, site = net.host("hub"), net.host("site")
    wan = net.wire(hub, site)
    d = Deployment(tmp_path, hub_wan_ip=wan.a_ip, ping_s=2)
    hub.popen(d.conf("hub", "0.0.0.0", 4222), stdout=open(d.hub_log, "wb"), stderr=subprocess.STDOUT)
    site.popen(d.conf("site", "0.0.0.0", 4222), stdout=open(d.site_log, "wb"), stderr=subprocess.STDOUT)
    logs = lambda: f"--- hub\n{_log(d.hub_log)[-3000:]}\n--- site\n{_log(d.site_log)[-3000:]}"  # noqa: E731
    assert wait_for_port(hub.ip, 4222, 20) and wait_for_port(site.ip, 4222, 20), logs()
    assert wait_until(lambda: "Leafnode connection created" in _log(d.site_log), 20), logs()
    made: list[NatsTransport] = []
    try:
        root = d.transport(hub.ip, 4222, "gateway", client_id="root")
        made.append(root.connect())
        uplink = d.transport(site.ip, 4222, SITE, client_id=SITE, password_of="uplink")
        made.append(uplink.connect())
        heard = Inbox()
        at: dict[bytes, float] = {}

        def on_msg(msg: Any) -> None:
            at.setdefault(msg.payload, time.time())  # wall clock: compared with the site server's log
            heard(msg)

        uplink.subscribe(f"edgeflow/{FLEET}/gateway/round", on_msg)  # what a device (the site, at the hub) may read
        uplink.subscribe(f"edgeflow/{FLEET}/gateway/state", on_msg)
        root.publish(f"edgeflow/{FLEET}/gateway/round", b"r1").wait(10)
        assert wait_until(lambda: [m.payload for m in heard.messages] == [b"r1"], 10)
        wan.set_up(False)
        assert wait_until(lambda: "Leafnode connection closed" in _log(d.site_log), 15), logs()
        root.publish(f"edgeflow/{FLEET}/gateway/state", b"s2", retain=True).wait(10)
        root.publish(f"edgeflow/{FLEET}/gateway/round", b"r2").wait(10)
        assert wait_until(lambda: uplink.stats().get("upstream_lost", 0) == 1, 10), uplink.stats()
        wan.set_up(True)
        up_at = time.time()
        assert wait_until(lambda: _log(d.site_log).count("Leafnode connection created") >= 2, 30), logs()
        leaf_at = _logged_at(d.site_log, "Leafnode connection created", -1)
        assert wait_until(lambda: len(heard.messages) >= 3, 15), [m.payload for m in heard.messages]
        root.publish(f"edgeflow/{FLEET}/gateway/round", b"r3").wait(10)  # live again, after the replay
        assert wait_until(lambda: len(heard.messages) >= 4, 10), [m.payload for m in heard.messages]
        stays(lambda: len(heard.messages), for_s=1.0, reason="a message reached the site twice")
        got = [m.payload for m in heard.messages]  # each once; the gap before what came live after it
        assert got[0] == b"r1" and sorted(got[1:3]) == [b"r2", b"s2"] and got[3] == b"r3", got
        stats = uplink.stats()
        assert stats.get("upstream_back", 0) == 1 and stats.get("reconnects", 0) == 0, stats
        last = max(at[b"s2"], at[b"r2"])
        print(f"\nNATS leaf, hub to site: s2 and r2 (published during the cut) heard {last - up_at:.2f} s "
              f"after the WAN came back ({last - leaf_at:.2f} s after the site logged its leaf connection); "
              f"uplink {_pick(stats, 'upstream_lost', 'upstream_back', 'gap_replayed', 'duplicates_dropped')}")
    finally:
        for t in made:
            t.close(timeout=1.0, flush=False)
        net.close()
