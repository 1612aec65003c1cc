"""One gateway per state, as a user meets it: the real `edgeflow gateway` command twice on one state
(SQLite and PostgreSQL), a private Mosquitto, nothing mocked.

- the second gateway exits 2 at once with one line naming the first (host, pid, since); the first
  keeps running (it used to lose its broker session to the second and exit 0);
- read-only commands (`edgeflow rounds`, `fleet status`, `fleet history`) work while it runs;
- kill -9 the first: the OS (SQLite's flock) or the server (PostgreSQL's advisory lock, held by the
  dead process's session) drops the lease, and a new gateway starts;
- a state whose job is done ([rounds] rounds closed rounds) exits 3 with one line naming the fixes,
  instead of exiting 0 having done nothing.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from _brokers import mosquitto_factory  # noqa: F401
from _cli import one_clear_line
from _fleet import mlp_bytes
from _stores import pg_url, store_target  # noqa: F401

from edgeflow.broker.mosquitto import FleetDir
from edgeflow.gateway.store import parse_store_url
from edgeflow.transport.mqtt.options import TAKEOVER_SHORT_S

pytestmark = pytest.mark.integration
CLI = [sys.executable, "-m", "edgeflow"]


def _setup(tmp_path, target, broker) -> list[str]:
    """A fleet directory, a model and a gateway.toml on ``target``; the gateway's argv."""
    fd = FleetDir(tmp_path / "fleet").init("lab")
    (tmp_path / "model.onnx").write_bytes(mlp_bytes(0))
    where = f'[store]\nurl = "{target.dsn}?schema={target.schema}"\n' if target.engine == "postgresql" else ""
    state = "" if where else f'state = "{target.path}"\n'
    (tmp_path / "gw.toml").write_text(f'[gateway]\n{state}model = "model.onnx"\n'
                                      f'[rounds]\nrounds = 2\nmin_clients = 1\n{where}')
    return CLI + ["gateway", "--config", str(tmp_path / "gw.toml"), "--dir", str(fd.path), "--broker",
                  f"mqtt://127.0.0.1:{broker.port}"]


def _state_arg(target) -> str:
    return f"{target.dsn}?schema={target.schema}" if target.engine == "postgresql" else target.path


class _Serving:
    """`edgeflow gateway ... --rounds 0 --serve` in the background, up once it printed its start line."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv + ["--rounds", "0", "--serve"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.up = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the CLI's stdout is line-buffered into a pipe
            self.lines.append(line)
            if line.startswith("gateway for fleet"):
                self.up.set()

    def wait_up(self, timeout: float = 60) -> None:
        if not self.up.wait(timeout):
            self.proc.kill()
            raise AssertionError(f"gateway did not start: {self.lines} {self.proc.stderr.read()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_a_second_gateway_on_one_state_fails_naming_the_first_until_it_dies(tmp_path, store_target,  # noqa: F811
                                                                            mosquitto_factory):  # noqa: F811
    broker = mosquitto_factory()
    argv = _setup(tmp_path, store_target, broker)
    first = _Serving(argv)
    try:
        first.wait_up()
        t0 = time.monotonic()
        second = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        line = one_clear_line(second, "is in use by another gateway", f"pid {first.proc.pid}",
                              f"host {socket.gethostname()}", "since 20", "stop that gateway first")
        assert second.returncode == 2, (second.returncode, line)
        assert took < 20, took  # it failed at once, without waiting on the broker or the state
        assert first.proc.poll() is None, "the first gateway must keep running"

        # readers take no lease
        state = _state_arg(store_target)
        for argv_ro in (["rounds", "--state", state, "--json"], ["fleet", "status", "--state", state, "--json"],
                        ["fleet", "history", "dev-x", "--state", state, "--json"]):
            ro = subprocess.run(CLI + argv_ro, capture_output=True, text=True, timeout=60)
            assert "in use" not in ro.stderr and "Traceback" not in ro.stderr, (argv_ro, ro.stderr)
            assert ro.returncode in (0, 2) and (ro.returncode == 0 or "dev-x" in ro.stderr), (argv_ro, ro.stderr)

        # a dead holder's lease goes with it
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        again = _Serving(argv)
        try:
            again.wait_up()
        finally:
            again.stop()
        assert again.proc.returncode == 0, again.proc.stderr.read()
    finally:
        first.stop()


def test_a_gateway_whose_rounds_are_all_done_says_so_and_exits_3(tmp_path, store_target,  # noqa: F811
                                                                 mosquitto_factory):  # noqa: F811
    from edgeflow.gateway.store import GatewayStore

    broker = mosquitto_factory()
    argv = _setup(tmp_path, store_target, broker)
    model = mlp_bytes(0)
    store = GatewayStore(store_target)
    try:  # the state a finished job of 2 rounds leaves
        v = store.add_model(model, hashlib.sha256(model).hexdigest())
        for r in (1, 2):
            store.open_round(r, v, time.time() + 60, {}, ["dev-a"])
            v = store.finish_round(r, {"participants": 1}, model=(model, hashlib.sha256(model).hexdigest()))
    finally:
        store.close()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    line = one_clear_line(out, "nothing to do", "already holds 2 closed round(s)", "[rounds] rounds = 2",
                          "raise [rounds] rounds", "--rounds N", "new state")
    assert out.returncode == 3, (out.returncode, line)
    more = subprocess.run(argv + ["--rounds", "0"], capture_output=True, text=True, timeout=60)
    assert more.returncode == 0, more.stderr  # asking for it explicitly is not a mistake


def test_two_gateways_of_one_fleet_on_two_states_the_second_stops_naming_the_client_id(tmp_path,
                                                                                       mosquitto_factory):  # noqa: F811
    """The lease cannot see this one (two states), the broker can: both connect as <fleet>-gateway and
    take the session from each other, until the newcomer's transport gives up (ClientIdTakenError)."""
    broker = mosquitto_factory()
    argv = _setup(tmp_path, parse_store_url(str(tmp_path / "a.sqlite")), broker)
    first = _Serving(argv)
    try:
        first.wait_up()
        time.sleep(TAKEOVER_SHORT_S + 1)  # a gateway that ran that long keeps its session; the newcomer stops
        (tmp_path / "gw2.toml").write_text((tmp_path / "gw.toml").read_text().replace("a.sqlite", "b.sqlite"))
        second = subprocess.run([a if a != str(tmp_path / "gw.toml") else str(tmp_path / "gw2.toml") for a in argv]
                                + ["--rounds", "0", "--serve"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("edgeflow gateway: error: client id 'lab-gateway' is in use by another connection"), \
            second.stderr
        assert first.proc.poll() is None, "the first gateway keeps running"
    finally:
        first.stop()
    assert first.proc.returncode == 0, first.proc.stderr.read()
