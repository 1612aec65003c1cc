"""The production path, every step through the `edgeflow` command line:
broker-config (TLS + ACL) -> provision -> `edgeflow device` processes with
local data -> signed OTA deploy -> train_start -> `edgeflow gateway` runs
federated rounds -> `edgeflow fleet status`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from _fleet import BROKER_USER, GeneratedBroker
from edgeflow import zoo
from edgeflow.broker.mosquitto import FleetDir, ListenerSettings
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.transport.broker import free_port

pytestmark = pytest.mark.integration
DEVICES = {"pi-a": "raspberry-pi-4", "pi-b": "raspberry-pi-5", "rv-c": "visionfive-2", "box-d": "x86-gateway"}


def _cli() -> list[str]:
    exe = shutil.which("edgeflow")
    return [exe] if exe else [sys.executable, "-m", "edgeflow.cli.main"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run(_cli() + list(args), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"edgeflow {' '.join(args)}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def test_gateway_service_runs_rounds_with_device_agents_over_tls(tmp_path):
    fd = FleetDir(tmp_path / "fleet").init("lab")
    for dev, prof in DEVICES.items():
        fd.provision(dev, profile=prof)
    port = free_port()
    files = fd.write_broker_config(ListenerSettings(host="127.0.0.1", port=port, log_file=str(tmp_path / "m.log"),
                                                    user=BROKER_USER),
                                   tls_hosts=["localhost", "127.0.0.1"])
    broker = GeneratedBroker(files.config, port, tmp_path / "m.log")
    url = f"mqtts://127.0.0.1:{port}"
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, len(DEVICES), alpha=1.0, seed=0)
    model = tmp_path / "model.onnx"
    onnx.save(zoo.digits_mlp(seed=0), model)
    np.savez(tmp_path / "eval.npz", x=split.x_test, y=split.y_test)
    procs = []
    try:
        for (dev, prof), idx in zip(DEVICES.items(), parts):
            np.savez(tmp_path / f"{dev}.npz", x=split.x_train[idx], y=split.y_train[idx])
            procs.append(subprocess.Popen(
                _cli() + ["device", "--credentials", str(fd.device_dir(dev)), "--broker", url,
                          "--state", str(tmp_path / "state" / dev), "--telemetry-interval", "1",
                          "--train-data", str(tmp_path / f"{dev}.npz")],
                stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{dev}.log", "w"), env={**os.environ}))
        time.sleep(1.0)
        dep = json.loads(_run("fleet", "deploy", str(model), "--to", "all", "--dir", str(fd.path), "--broker", url,
                              "--canary", "1", "--wait", "5", "--json").stdout)
        assert dep["state"] == "completed" and dep["counts"] == {"ok": 4}, dep
        for dev in DEVICES:
            ack = json.loads(_run("fleet", "cmd", dev, "train_start", "--dir", str(fd.path), "--broker", url,
                                  "--json").stdout)
            assert ack["ok"], ack
        (tmp_path / "gw.toml").write_text(
            '[gateway]\nstate = "gw.sqlite"\nmodel = "model.onnx"\neval = "eval.npz"\nmetrics = "metrics.jsonl"\n'
            '[rounds]\nrounds = 3\nmin_clients = 4\ndeadline_s = 30\n'
            '[rounds.train]\nepochs = 3\nlr = 0.1\ncodec = "topk-int8"\ncodec_opts = { ratio = 0.05 }\n')
        gw = _run("gateway", "--config", str(tmp_path / "gw.toml"), "--dir", str(fd.path), "--broker", url, "--json",
                  timeout=180)
        rounds = [json.loads(line) for line in gw.stdout.splitlines() if line.startswith("{")]
        assert [r["round_id"] for r in rounds] == [1, 2, 3]
        assert all(r["participants"] == 4 and r["rejected"] == 0 for r in rounds), rounds
        assert rounds[-1]["accuracy"] > rounds[0]["accuracy"]
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
        status = json.loads(_run("fleet", "status", "--state", str(tmp_path / "gw.sqlite"), "--dir", str(fd.path),
                                 "--json").stdout)
        rows = status["devices"] if isinstance(status, dict) else status
        assert {r["device_id"] if "device_id" in r else r["device"] for r in rows} == set(DEVICES)
        # a second gateway run continues the job: nothing left to do (exit 3, one line), no round repeated
        again = subprocess.run(_cli() + ["gateway", "--config", str(tmp_path / "gw.toml"), "--dir", str(fd.path),
                                         "--broker", url, "--json"], capture_output=True, text=True, timeout=120)
        assert again.returncode == 3 and "nothing to do" in again.stderr, again.stderr
        assert not [line for line in again.stdout.splitlines() if line.startswith("{")]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        broker.stop()
