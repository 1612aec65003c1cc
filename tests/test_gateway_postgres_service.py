"""The gateway's state on PostgreSQL, through the command line: `edgeflow gateway` with
``[store] url = "postgresql://..."`` runs federated rounds with `edgeflow device` processes and
stores them closed there, and `edgeflow fleet status --state postgresql://...` reads that state
read-only (a fresh schema per test: tests/_stores.py; skipped, with the reason, only where the
test server cannot be reached)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest

from _cli import one_clear_line as _one_clear_line
from _stores import PG_URL, pg_url  # noqa: F401
from edgeflow import zoo
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.gateway.store import GatewayStore
from edgeflow.transport.broker import MosquittoBroker, find_mosquitto


def _ef(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow", *args], capture_output=True, text=True, timeout=timeout)


def _ok(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    out = _ef(*args, timeout=timeout)
    assert out.returncode == 0, f"edgeflow {' '.join(args)}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out



def _schemas() -> set[str]:
    import psycopg

    with psycopg.connect(PG_URL, connect_timeout=5) as conn:
        return {r[0] for r in conn.execute("SELECT schema_name FROM information_schema.schemata")}


# ------------------------------------------------------------ fleet status --state postgresql://


def test_fleet_status_reads_a_postgresql_state_read_only(pg_url):  # noqa: F811
    now = time.time()
    store = GatewayStore(pg_url)
    birth = {"device": "cam-1", "profile": "raspberry-pi-4", "bdseq": 1, "model_version": 2, "backend": "numpy",
             "can_train": True, "training": True, "train": "training", "ts": now, "trust": "registered"}
    store.upsert_birth("cam-1", birth, profile="raspberry-pi-4", model_version=2, bdseq=1)
    store.add_telemetry("cam-1", {"device": "cam-1", "ts": now, "train": "training", "latency_p50_ms": 1.23456,
                                  "latency_p95_ms": 2.5, "cpu_percent": 12.345, "battery": 0.87654})
    store.set_meta("rounds_status", json.dumps({"state": "open", "reason": "round 3: 1 device(s) selected"}))
    store.close()

    out = _ok("fleet", "status", "--state", pg_url, "--json")
    doc = json.loads(out.stdout)
    (row,) = doc["devices"]
    assert row["device"] == "cam-1" and row["online"] and row["model_version"] == 2 and row["health"] == "ok"
    assert row["latency_p50_ms"] == 1.235 and row["cpu_percent"] == 12.3 and row["train"] == "training"
    assert doc["rounds"] == {"state": "open", "reason": "round 3: 1 device(s) selected"}
    table = _ok("fleet", "status", "--state", pg_url).stdout
    assert "cam-1" in table and "rounds: open: round 3: 1 device(s) selected" in table

    # read-only: the reader's session refuses writes, and nothing of the state changed
    from edgeflow.cli.fleet import _StateReader
    from edgeflow.errors import StateError

    reader = _StateReader(pg_url)
    try:
        with pytest.raises(StateError, match="read-only transaction"):
            reader._q("INSERT INTO meta (key, value) VALUES ('x', 'y')")
    finally:
        reader.close()
    s = GatewayStore(pg_url)
    try:
        assert [d.device_id for d in s.devices()] == ["cam-1"] and len(s.telemetry("cam-1")) == 1
    finally:
        s.close()


def test_fleet_status_on_a_postgresql_url_without_a_gateway_state_creates_nothing(pg_url):  # noqa: F811
    missing = pg_url.rsplit("schema=", 1)[1] + "_typo"
    url = pg_url.rsplit("schema=", 1)[0] + f"schema={missing}"
    _one_clear_line(_ef("fleet", "status", "--state", url), f"schema={missing}", "holds no gateway state",
                    "[store] url", "never created")
    assert missing not in _schemas(), "read-only: the schema was not created"
    _one_clear_line(_ef("fleet", "status", "--state", "postgresql://postgres@127.0.0.1:1/test"),
                    "cannot connect to PostgreSQL", "127.0.0.1:1")
    _one_clear_line(_ef("fleet", "status", "--state", "postgresql:///test"), "--state", "names no host")


# ------------------------------------------------------------ the gateway service on PostgreSQL

DEVICES = {"pi-a": "raspberry-pi-4", "pi-b": "raspberry-pi-5", "rv-c": "visionfive-2"}


@pytest.mark.integration
def test_gateway_service_keeps_its_state_on_postgresql(pg_url, tmp_path):  # noqa: F811
    """`edgeflow gateway --config gateway.toml` with [store] url = postgresql://...: three
    `edgeflow device` processes (plain MQTT, the fleet's ACL) train two rounds; the rounds, the
    models and the registry are in the PostgreSQL schema (no state file anywhere), `fleet status
    --state URL` shows the devices, and a second gateway run finds the job done."""
    from edgeflow.broker.mosquitto import FleetDir

    fd = FleetDir(tmp_path / "fleet").init("pg")
    for dev, prof in DEVICES.items():
        fd.provision(dev, profile=prof)
    broker = MosquittoBroker(binary=find_mosquitto(), workdir=tmp_path / "broker").start()
    url = f"mqtt://{broker.host}:{broker.port}"
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, len(DEVICES), alpha=1.0, seed=0)
    onnx.save(zoo.digits_mlp(seed=0), tmp_path / "model.onnx")
    np.savez(tmp_path / "eval.npz", x=split.x_test, y=split.y_test)
    procs = []
    try:
        for dev, idx in zip(DEVICES, parts):
            np.savez(tmp_path / f"{dev}.npz", x=split.x_train[idx], y=split.y_train[idx])
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "edgeflow", "device", "--credentials", str(fd.device_dir(dev)),
                 "--broker", url, "--state", str(tmp_path / "state" / dev), "--telemetry-interval", "1",
                 "--train-data", str(tmp_path / f"{dev}.npz")],
                stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{dev}.log", "w"), env={**os.environ}))
        time.sleep(1.0)
        dep = json.loads(_ok("fleet", "deploy", str(tmp_path / "model.onnx"), "--to", "all", "--dir", str(fd.path),
                             "--broker", url, "--canary", "1", "--wait", "5", "--json").stdout)
        assert dep["state"] == "completed" and dep["counts"] == {"ok": len(DEVICES)}, dep
        for dev in DEVICES:
            ack = json.loads(_ok("fleet", "cmd", dev, "train_start", "--dir", str(fd.path), "--broker", url,
                                 "--json").stdout)
            assert ack["ok"], ack
        (tmp_path / "gw.toml").write_text(
            f'[store]\nurl = "{pg_url}"\n'
            '[gateway]\nmodel = "model.onnx"\neval = "eval.npz"\nmetrics = "metrics.jsonl"\n'
            f'[rounds]\nrounds = 2\nmin_clients = {len(DEVICES)}\ndeadline_s = 30\n'
            '[rounds.train]\nepochs = 2\nlr = 0.1\n')
        gw = _ok("gateway", "--config", str(tmp_path / "gw.toml"), "--dir", str(fd.path), "--broker", url, "--json",
                 timeout=180)
        rounds = [json.loads(line) for line in gw.stdout.splitlines() if line.startswith("{")]
        assert [r["round_id"] for r in rounds] == [1, 2], gw.stdout
        assert all(r["participants"] == len(DEVICES) and r["rejected"] == 0 for r in rounds), rounds

        store = GatewayStore(pg_url)
        try:
            assert store.engine == "postgresql"
            assert [(r.round_id, r.state) for r in store.rounds()] == [(1, "closed"), (2, "closed")]
            v1, v2 = store.model_for_round(1), store.model_for_round(2)
            assert v1 is not None and v2 == v1 + 1 == store.latest_version(), (v1, v2)  # one model per round
            assert {d.device_id for d in store.devices()} == set(DEVICES)
        finally:
            store.close()
        assert not list(tmp_path.glob("*.sqlite")) and not list(tmp_path.glob("*.db")), "no state file"

        status = json.loads(_ok("fleet", "status", "--state", pg_url, "--json").stdout)
        assert {r["device"] for r in status["devices"]} == set(DEVICES), status
        assert status["rounds"]["state"] == "closed" and "round 2" in status["rounds"]["reason"], status["rounds"]

        again = _ef("gateway", "--config", str(tmp_path / "gw.toml"), "--dir", str(fd.path), "--broker", url,
                    "--json")
        assert again.returncode == 3 and "nothing to do" in again.stderr, again.stderr  # the job is done
        assert not [line for line in again.stdout.splitlines() if line.startswith("{")], "no round repeated"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        broker.stop()
