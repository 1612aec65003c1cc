"""The same device started twice, as a user meets it: two `edgeflow device` processes with one
credentials folder (one client id) on a real Mosquitto (MQTT 5), nothing mocked.

The broker hands the client id's session to the newest connection and ends the old one (MQTT 5
brokers may say so, DISCONNECT 0x8E "session taken over"; Mosquitto 2.0.11 closes the socket without
a word). Before issue 33 both processes took it from each other forever, logging reconnects, and the
survivor once dropped out of rounds. Now the transport counts such ends of short-lived connections
and stops at ``TAKEOVER_LIMIT`` (5) in a row with ClientIdTakenError: the
newcomer exits 2 with one line naming the client id and the reason code, the first process keeps
running, and it still trains in the gateway's rounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from _brokers import mosquitto_factory  # noqa: F401

from edgeflow import zoo
from edgeflow.broker.mosquitto import FleetDir
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.transport.mqtt.options import TAKEOVER_LIMIT

pytestmark = pytest.mark.integration
CLI = [sys.executable, "-m", "edgeflow"]
DEVICES = ("dev-a", "dev-b")


def _ok(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"edgeflow {' '.join(args)}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def test_the_same_device_started_twice_stops_with_one_line_and_the_first_keeps_training(tmp_path,
                                                                                       mosquitto_factory):  # noqa: F811
    assert TAKEOVER_LIMIT <= 5  # "N small": the newcomer gives up within a few reconnect delays
    broker = mosquitto_factory()
    url = f"mqtt://127.0.0.1:{broker.port}"
    fd = FleetDir(tmp_path / "fleet").init("lab")
    for dev in DEVICES:
        fd.provision(dev, profile="x86-gateway")
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, len(DEVICES), alpha=1.0, seed=0)
    model = tmp_path / "model.onnx"
    onnx.save(zoo.digits_mlp(seed=0), model)

    def device(dev: str, state: str) -> subprocess.Popen:
        return subprocess.Popen(CLI + ["device", "--credentials", str(fd.device_dir(dev)), "--broker", url,
                                       "--state", str(tmp_path / state), "--telemetry-interval", "1",
                                       "--train-data", str(tmp_path / f"{dev}.npz")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    procs: list[subprocess.Popen] = []
    try:
        for dev, idx in zip(DEVICES, parts):
            np.savez(tmp_path / f"{dev}.npz", x=split.x_train[idx], y=split.y_train[idx])
            procs.append(device(dev, f"state-{dev}"))
        time.sleep(1.0)
        dep = json.loads(_ok("fleet", "deploy", str(model), "--to", "all", "--dir", str(fd.path), "--broker", url,
                             "--wait", "10", "--json").stdout)
        assert dep["state"] == "completed" and dep["counts"] == {"ok": 2}, dep
        for dev in DEVICES:
            assert json.loads(_ok("fleet", "cmd", dev, "train_start", "--dir", str(fd.path), "--broker", url,
                                  "--json").stdout)["ok"]

        # the mistake: dev-a again, from another state folder (a second terminal, a second service unit)
        twin = device("dev-a", "state-dev-a-again")
        procs.append(twin)
        try:
            _, err = twin.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            twin.kill()
            raise AssertionError(f"the second dev-a kept flapping: {twin.communicate()[1][-3000:]}")
        assert twin.returncode == 2, err
        assert "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("edgeflow device: error: client id") and "in use by another connection" in last, err
        assert "0x8E" in last and "runs twice" in last, last
        assert procs[0].poll() is None, "the first dev-a must keep running"

        # the survivor still takes part: both devices in every round
        (tmp_path / "gw.toml").write_text(
            '[gateway]\nstate = "gw.sqlite"\nmodel = "model.onnx"\n'
            '[rounds]\nrounds = 2\nmin_clients = 2\nfraction = 1.0\ndeadline_s = 60\n'
            '[rounds.train]\nepochs = 1\nlr = 0.1\n')
        gw = _ok("gateway", "--config", str(tmp_path / "gw.toml"), "--dir", str(fd.path), "--broker", url, "--json",
                 timeout=240)
        rounds = [json.loads(line) for line in gw.stdout.splitlines() if line.startswith("{")]
        assert [r["round_id"] for r in rounds] == [1, 2], gw.stdout
        assert all(r["participants"] == 2 for r in rounds), rounds
        assert procs[0].poll() is None and procs[1].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
