"""Issue 31 (red team) on the generated broker configuration and the fleet directory:

1. run as root, broker-config handed the broker user whatever a link at the log or persistence path
   pointed to (a root-only decoy became mosquitto's): now it creates those for the broker user or leaves
   its own ones alone, never through a link, and says so in one line;
2. no ``max_connections``: idle sockets without a credential used up the broker's open files and
   blocked every TLS client; now each listener has a limit sized to the fleet (and broker/nftables.conf
   caps each source address within it: tests/test_broker_firewall.py);
3. under umask 000 keyring.json, fleet.json and ca.crt were 0666: every mode is set explicitly;
4. a device provisioned as ``admin-5`` took a future operator session user's name and rights: the two
   name spaces are disjoint.
"""

from __future__ import annotations

import json
import os
import pwd
import resource
import selectors
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from _fleet import BROKER_USER, PROFILE

from edgeflow.broker.mosquitto import (
    OPERATORS,
    FleetDir,
    ListenerSettings,
    fleet_acl,
    fleet_max_connections,
    read_password_file,
    render_config,
)
from edgeflow.cli.main import main
from edgeflow.device.credentials import provision_device
from edgeflow.errors import ConfigError
from edgeflow.transport.broker import find_mosquitto, free_port, wait_for_port
from edgeflow.transport.message import TlsConfig
from edgeflow.transport.mqtt import MqttTransport
from edgeflow.transport.topics import device_topic

as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root (chown)")


def _one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, (rc, err)
    return err[0]


def _fingerprint(path: Path) -> tuple:
    st = os.lstat(path)
    body = path.read_bytes() if stat.S_ISREG(st.st_mode) else sorted(os.listdir(path))
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_nlink, body


# ------------------------------------------------- 1. nothing handed over through a link


@pytest.fixture
def reachable(tmp_path):
    """A directory the ``mosquitto`` user can enter (pytest's are private to root), with a root-only decoy
    file and directory and a ``logs`` directory the broker user owns (like /var/log/mosquitto)."""
    base = Path(tempfile.mkdtemp(prefix="edgeflow-hardening-"))
    os.chmod(base, 0o711)
    (base / "decoy").write_text("root's secret\n")
    os.chmod(base / "decoy", 0o600)
    (base / "decoy-dir").mkdir(mode=0o700)
    (base / "decoy-dir" / "keep").write_text("x")
    logs = base / "logs"
    logs.mkdir(mode=0o755)
    mq = pwd.getpwnam("mosquitto")
    os.chown(logs, mq.pw_uid, mq.pw_gid)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@as_root
@pytest.mark.parametrize("plant, flag, target", [
    ("symlink", "--log-file", "decoy"),
    ("symlink", "--persistence", "decoy-dir"),
    ("hardlink", "--log-file", "decoy"),
    ("root-owned", "--log-file", None),
])
def test_root_never_hands_the_broker_a_file_it_did_not_create(reachable, capsys, plant, flag, target) -> None:
    """The red team's decoy: a link at the log (or persistence) path to a root-only file. Refused in one
    line, nothing written, the decoy keeps its owner, mode and contents."""
    base = reachable
    path = base / "logs" / ("mosquitto.log" if flag == "--log-file" else "db")
    if plant == "symlink":
        path.symlink_to(base / target)
    elif plant == "hardlink":
        os.link(base / target, path)
    else:  # a file root made there: not broker-config's to give away
        path.write_text("root's own log\n")
        os.chmod(path, 0o600)
    victim = path if target is None else base / target
    before = _fingerprint(victim)
    err = _one_line_error(capsys, ["broker-config", "--dir", str(base / "fleet"), "--fleet", "lab", flag, str(path)])
    assert f"{flag} {path}" in err
    assert ("symbolic link" in err and f"rm {path}" in err) if plant == "symlink" else "belongs to uid 0" in err
    assert _fingerprint(victim) == before, "the decoy changed hands"
    assert not (base / "fleet").exists(), "nothing is written when a path is refused"


@as_root
def test_a_link_planted_between_runs_is_refused_by_the_rerun_provisioning_does(reachable, capsys) -> None:
    """The broker (its user owns /var/log/mosquitto) swaps its log for a link; `fleet provision` reruns
    broker-config as root: refused, the decoy stays root's."""
    base = reachable
    log, db = base / "logs" / "mosquitto.log", base / "logs" / "db"
    d = str(base / "fleet")
    assert main(["broker-config", "--dir", d, "--fleet", "lab", "--log-file", str(log), "--persistence", str(db)]) == 0
    mq = pwd.getpwnam("mosquitto")
    for p, mode in ((log, 0o640), (db, 0o700)):  # made for the broker user
        st = os.lstat(p)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (mq.pw_uid, mq.pw_gid, mode)
    assert main(["broker-config", "--dir", d]) == 0, "its own files are left as they are on a rerun"
    log.unlink()
    log.symlink_to(base / "decoy")
    os.lchown(log, mq.pw_uid, mq.pw_gid)
    before = _fingerprint(base / "decoy")
    err = _one_line_error(capsys, ["fleet", "provision", "pi-1", "--dir", d])
    assert f"--log-file {log} is a symbolic link" in err
    assert _fingerprint(base / "decoy") == before


@as_root
def test_the_hand_over_step_itself_refuses_a_link_that_appears_after_the_check(reachable) -> None:
    """The check runs before anything is written; the link may appear after it. The step that creates
    the file opens it O_EXCL|O_NOFOLLOW and chowns the descriptor, so it is refused there too."""
    from edgeflow.broker.mosquitto import _hand_over

    base = reachable
    mq = pwd.getpwnam("mosquitto")
    log, db = base / "logs" / "late.log", base / "logs" / "late-db"
    log.symlink_to(base / "decoy")
    db.symlink_to(base / "decoy-dir")
    before = (_fingerprint(base / "decoy"), _fingerprint(base / "decoy-dir"))
    with pytest.raises(ConfigError, match="is a symbolic link"):
        _hand_over(log, "--log-file", mq.pw_uid, mq.pw_gid, "mosquitto", directory=False)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        _hand_over(db, "--persistence", mq.pw_uid, mq.pw_gid, "mosquitto", directory=True)
    assert (_fingerprint(base / "decoy"), _fingerprint(base / "decoy-dir")) == before


def test_a_link_in_the_fleet_directory_is_refused_not_written_through(tmp_path, capsys) -> None:
    """broker/acl (or mosquitto.conf) replaced by a link: the rerun used to write the ACL into the link's
    target and chmod it. Now: one line, the target untouched."""
    d = tmp_path / "fleet"
    user = ["--broker-user", BROKER_USER] if BROKER_USER else []
    assert main(["broker-config", "--dir", str(d), "--fleet", "lab", *user]) == 0
    decoy = tmp_path / "decoy"
    decoy.write_text("not an ACL\n")
    os.chmod(decoy, 0o644)
    for name in ("acl", "mosquitto.conf"):
        target = d / "broker" / name
        target.unlink()
        target.symlink_to(decoy)
        before = _fingerprint(decoy)
        err = _one_line_error(capsys, ["broker-config", "--dir", str(d)])
        assert f"{target} is a symbolic link" in err and f"rm {target}" in err
        assert _fingerprint(decoy) == before
        target.unlink()
    assert main(["broker-config", "--dir", str(d)]) == 0
    assert not (d / "broker" / "acl").is_symlink() and "topic readwrite edgeflow/lab/#" in (d / "broker/acl").read_text()


# ------------------------------------------------- 2. connections limited per listener


def test_every_listener_gets_a_connection_limit_sized_to_the_fleet(tmp_path, capsys) -> None:
    text = render_config("lab", ListenerSettings(certfile="c", keyfile="k", websockets_port=8884, plain_port=1884),
                         password_file="p", acl_file="a")
    blocks = text.split("\nlistener ")[1:]
    assert len(blocks) == 3 and all("\nmax_connections 256\n" in "\n" + b for b in blocks), text
    assert fleet_max_connections(10) == 256 and fleet_max_connections(1000) == 1280
    assert fleet_max_connections(1000) >= 1000 * 1.25

    fd = FleetDir(tmp_path / "f").init("lab")
    for i in range(3):
        fd.provision(f"pi-{i}")
    files = fd.write_broker_config(ListenerSettings(plain_port=free_port(), user=BROKER_USER))
    assert files.max_connections == fleet_max_connections(3 + len(OPERATORS)) and files.listeners == 2
    assert files.open_files == 2 * files.max_connections + 64
    assert files.config.read_text().count(f"max_connections {files.max_connections}\n") == 2

    d = str(tmp_path / "g")
    user = ["--broker-user", BROKER_USER] if BROKER_USER else []
    capsys.readouterr()
    assert main(["broker-config", "--dir", d, "--fleet", "lab", "--max-connections", "3000", *user, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_connections"] == 3000 and out["limit_nofile"] == 3064
    assert main(["broker-config", "--dir", d]) == 0 and main(["fleet", "provision", "pi-1", "--dir", d]) == 0
    conf = (tmp_path / "g/broker/mosquitto.conf").read_text()
    assert "max_connections 3000\n" in conf, "the override is stored in fleet.json and kept"
    assert json.loads((tmp_path / "g/fleet.json").read_text())["listener"]["max_connections"] == 3000
    capsys.readouterr()
    assert main(["broker-config", "--dir", d, "--max-connections", "4000"]) == 0
    assert "max_connections changed (3000 -> 4000): restart Mosquitto" in capsys.readouterr().out
    for bad in ("0", "-1"):
        err = _one_line_error(capsys, ["broker-config", "--dir", d, "--max-connections", bad])
        assert f"max_connections {bad} is too small" in err


def _refused(socks: list[socket.socket], want: int, deadline_s: float) -> int:
    """How many of ``socks`` the broker closed (EOF or reset), waiting until ``want`` are or the deadline."""
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + deadline_s
    while closed < want and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            try:
                data = key.fileobj.recv(1)
            except OSError:
                data = b""
            if data == b"":
                closed += 1
                sel.unregister(key.fileobj)
    sel.close()
    return closed


@pytest.mark.integration
def test_idle_sockets_without_credentials_cannot_lock_out_tls_clients(tmp_path) -> None:
    """The slow loris: more idle TCP sockets than the broker has open files. The broker runs with the
    LimitNOFILE broker-config asks for; the sockets past max_connections are closed at once, the broker
    stays up, the local listener still serves, and once the idle sockets go a TLS device connects."""
    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto is not installed")
    fd = FleetDir(tmp_path / "fleet").init("lab")
    fd.provision("pi-1", profile=PROFILE)
    port, local = free_port(), free_port()
    log = tmp_path / "mosquitto.log"
    limit = 16
    files = fd.write_broker_config(ListenerSettings(host="127.0.0.1", port=port, plain_port=local, log_file=str(log),
                                                    max_connections=limit, user=BROKER_USER),
                                   tls_hosts=["localhost", "127.0.0.1"])
    nofile = files.open_files  # 16 x 2 listeners + 64: fewer than the idle sockets below
    out = open(tmp_path / "mosquitto.out", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, "-c", str(files.config)], stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (nofile, nofile))  # the LimitNOFILE broker-config asks for
    idle: list[socket.socket] = []
    try:
        assert wait_for_port("127.0.0.1", port, 10, alive=lambda: proc.poll() is None), log.read_text()
        n = nofile + 24
        for _ in range(n):
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            idle.append(s)
        refused = _refused(idle, len(idle) - limit, 10.0)
        assert refused >= len(idle) - limit, f"{refused} of {len(idle)} idle sockets refused, max_connections {limit}"
        assert proc.poll() is None, "the broker stays up"
        op = fd.operator("admin")
        t = MqttTransport("127.0.0.1", local, client_id="admin", username="admin", password=op["password"],
                          connect_timeout_s=5)
        try:
            t.connect()  # another listener's limit is its own: the loopback tools still get in
        finally:
            t.close(timeout=1)
        for s in idle:
            s.close()
        idle.clear()
        creds = json.loads((fd.device_dir("pi-1") / "device.json").read_text())
        dev = MqttTransport("127.0.0.1", port, client_id="pi-1", username="pi-1", password=creds["password"],
                            tls=TlsConfig(ca_file=str(fd.device_dir("pi-1") / "ca.crt")), connect_timeout_s=10)
        try:
            dev.connect()
            dev.publish(device_topic("lab", "pi-1", "telemetry").value, b"{}").wait(5)
        finally:
            dev.close(timeout=1)
        assert proc.poll() is None
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        out.close()


# ------------------------------------------------- 3. modes whatever the umask


def test_modes_are_explicit_under_umask_000(tmp_path) -> None:
    old = os.umask(0)
    try:
        fd = FleetDir(tmp_path / "new" / "parent" / "fleet").init("lab")
        fd.provision("pi-1")
        fd.write_broker_config(ListenerSettings(user=BROKER_USER), tls_hosts=["localhost"])
        fd.provision("pi-2")  # after the CA exists: it is copied into the credentials
        fd.write_broker_config()
        fd.revoke("pi-2")
        _, lock = fd.claim_operator("admin", wait_s=1)
        lock.close()
    finally:
        os.umask(old)
    root = fd.path
    want = {
        "fleet.json": 0o600, "keyring.json": 0o644, "fleet.key": 0o600, "fleet.pub": 0o644,
        "broker/ca.crt": 0o644, "broker/ca.key": 0o600, "broker/server.crt": 0o644, "broker/server.key": 0o600,
        "broker/passwd": 0o600, "broker/acl": 0o600, "broker/mosquitto.conf": 0o600,
        "operators/admin.json": 0o600, "operators/.admin.lock": 0o600,
        "devices/pi-1/ca.crt": 0o644, "devices/pi-1/device.json": 0o600, "devices/pi-1/device.key": 0o600,
        ".": 0o700, "broker": 0o700, "operators": 0o700, "devices": 0o700, "devices/pi-1": 0o700, "revoked": 0o700,
    }
    got = {name: stat.S_IMODE(os.lstat(root / name).st_mode) for name in want}
    assert got == want
    loose = [str(p.relative_to(root)) for p in [root, *root.rglob("*")] if os.lstat(p).st_mode & 0o022]
    assert not loose, f"group- or world-writable under umask 000: {loose}"
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o755, "directories made above the fleet's too"


# ------------------------------------------------- 4. devices and operators apart


def test_a_device_cannot_take_an_operators_name_now_or_later(tmp_path, capsys) -> None:
    d = tmp_path / "fleet"
    fd = FleetDir(d).init("lab", operators=(*OPERATORS, "ops"))
    for dev in ("admin-5", "admin-17", "gateway-2", "ops", "ops-3", "admin"):
        with pytest.raises(ConfigError, match="operators' name space"):
            fd.provision(dev)
    assert not (d / "devices" / "admin-5").exists() and "admin-5" not in fd.keyring().devices()
    for fine in ("administrator", "admin5", "pi-2", "gateway2", "opsx-1"):
        fd.provision(fine)
    err = _one_line_error(capsys, ["fleet", "provision", "admin-5", "--dir", str(d)])
    assert "device id 'admin-5' is in the operators' name space" in err and "pick another device id" in err
    with pytest.raises(ConfigError, match="'admin-5' is in the operators' name space"):
        fleet_acl("lab", OPERATORS, ["pi-1", "admin-5"])
    with pytest.raises(ConfigError, match="would share a name space with provisioned device 'pi-2'"):
        fd.init("lab", operators=["pi"])  # a new operator `pi` would own pi-2
    assert "pi" not in fd.meta()["operators"]


def test_a_device_already_provisioned_under_an_operator_name_stops_the_broker_config(tmp_path, capsys) -> None:
    """A fleet from before the fix holds device admin-5 (provisioned straight into the directory):
    regenerating the password file and ACL refuses it instead of giving it a password in the operators'
    name space; nothing is rewritten."""
    d = tmp_path / "fleet"
    user = ["--broker-user", BROKER_USER] if BROKER_USER else []
    assert main(["broker-config", "--dir", str(d), "--fleet", "lab", *user]) == 0
    fd = FleetDir(d)
    creds = provision_device(fd.device_dir("admin-5"), "admin-5", "lab", fd.fleet_public_key())
    ring = fd.keyring()
    ring.register("admin-5", creds.key.public_key)
    ring.save(fd.keyring_path)
    passwd = (d / "broker/passwd").read_bytes()
    err = _one_line_error(capsys, ["broker-config", "--dir", str(d)])
    assert "device id 'admin-5' is in the operators' name space" in err and "edgeflow fleet revoke" in err
    assert (d / "broker/passwd").read_bytes() == passwd
    assert main(["fleet", "revoke", "admin-5", "--dir", str(d)]) == 0, "the fix the message names works"
    assert "admin-5" not in read_password_file(d / "broker/passwd")


def test_a_device_json_naming_another_user_cannot_set_that_users_password(tmp_path) -> None:
    fd = FleetDir(tmp_path / "fleet").init("lab")
    fd.provision("pi-1")
    fd.write_broker_config(ListenerSettings(user=BROKER_USER), tls_hosts=["localhost"])
    admin_hash = read_password_file(fd.broker_dir / "passwd")["admin"]
    path = fd.device_dir("pi-1") / "device.json"
    creds = json.loads(path.read_text())
    path.write_text(json.dumps({**creds, "username": "admin"}))
    with pytest.raises(ConfigError, match="user name 'admin' is not the device id 'pi-1'"):
        fd.write_broker_config()
    assert read_password_file(fd.broker_dir / "passwd")["admin"] == admin_hash
