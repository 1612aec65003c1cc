"""Operator commands run at once never share a broker session (docs/fleet.md).

The generated broker sets ``use_username_as_clientid``, so the client id is the
user name: each ``edgeflow fleet`` command claims a free operator session user
(``admin``, ``admin-2`` ...) by a lock file in the fleet directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from edgeflow.broker.mosquitto import ADMIN_SESSIONS, FleetDir
from edgeflow.errors import ConfigError
from edgeflow.transport.broker import find_mosquitto, free_port


def ef(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow", *args], capture_output=True, text=True, timeout=timeout)


def test_each_claim_gets_its_own_session_user_and_the_next_waits(tmp_path):
    fd = FleetDir(tmp_path / "fleet").init("farm")
    held = [fd.claim_operator("admin") for _ in range(ADMIN_SESSIONS)]
    names = [creds["username"] for creds, _ in held]
    assert names == ["admin"] + [f"admin-{i}" for i in range(2, ADMIN_SESSIONS + 1)]
    assert len({creds["password"] for creds, _ in held}) == ADMIN_SESSIONS
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="in use by other `edgeflow fleet` commands"):
        fd.claim_operator("admin", wait_s=0.3)
    assert time.monotonic() - t0 >= 0.3
    held[1][1].close()  # admin-2 released: the next command gets it
    creds, lock = fd.claim_operator("admin", wait_s=0.3)
    assert creds["username"] == "admin-2"
    for _, lk in [*held, (None, lock)]:
        lk.close()


def test_an_older_fleet_gets_the_session_users_on_rerun(tmp_path):
    fd = FleetDir(tmp_path / "fleet").init("farm", operators=("gateway", "admin"))
    assert [fd.claim_operator("admin")[0]["username"] for _ in range(1)] == ["admin"]
    FleetDir(tmp_path / "fleet").init("farm")  # what a broker-config rerun does
    assert "admin-4" in FleetDir(tmp_path / "fleet").meta()["operators"]


@pytest.mark.integration
def test_three_status_commands_at_once_do_not_take_over_each_other():
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    # a directory the broker's own user can enter (broker-config run as root drops Mosquitto to `mosquitto`)
    work = Path(tempfile.mkdtemp(prefix="edgeflow-operators-"))
    os.chmod(work, 0o755)
    port = free_port()
    log = work / "mosquitto.log"
    broker = None
    try:
        d = work / "fleet"
        r = ef("broker-config", "--dir", str(d), "--fleet", "farm", "--port", str(port), "--public-host", "localhost",
               "--log-file", str(log))
        assert r.returncode == 0, r.stderr
        for dev in ("cam-1", "cam-2"):
            assert ef("fleet", "provision", dev, "--dir", str(d), "--profile", "raspberry-pi-4").returncode == 0
        broker = subprocess.Popen([find_mosquitto(), "-c", str(d / "broker" / "mosquitto.conf")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not (log.exists() and "running" in log.read_text(errors="replace")) and time.monotonic() < deadline:
            time.sleep(0.05)
        cmd = [sys.executable, "-m", "edgeflow", "fleet", "status", "--dir", str(d), "--wait", "3", "--json"]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], [e for _, e in outs]
        text = log.read_text(errors="replace")
        assert "already connected" not in text, "a command took over another one's broker session:\n" + text[-3000:]
        users = {u for u in ("admin", "admin-2", "admin-3") if f" u'{u}'" in text or f"u'{u}'" in text}
        assert len(users) == 3, text[-3000:]
    finally:
        if broker is not None:
            broker.terminate()
            broker.wait(10)
        shutil.rmtree(work, ignore_errors=True)
