"""A newcomer's mistakes with the fleet commands: each one is a single clear line on stderr, a non-zero exit
code and nothing stored, before any broker is contacted or any long work starts (issue 17).

Every case runs the real command in a subprocess (``python -m edgeflow``). No broker is started: the
commands must refuse before they would need one (a few point ``--broker`` at a port nobody listens on,
so a command that did try to connect would fail differently, and slowly).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from _cli import one_clear_line
from edgeflow import zoo

NOBODY = "mqtt://127.0.0.1:9"  # the discard port: no broker


def ef(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)



@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Path:
    """A fleet directory with one provisioned board (no broker)."""
    d = tmp_path_factory.mktemp("fleet") / "fleet"
    user = ["--broker-user", "root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    assert ef("broker-config", "--dir", str(d), "--fleet", "farm", "--public-host", "localhost", *user).returncode == 0
    assert ef("fleet", "provision", "cam-1", "--dir", str(d), "--profile", "raspberry-pi-4").returncode == 0
    return d


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("m") / "digits.onnx"
    onnx.save(zoo.digits_mlp(seed=0), p)
    return p


# ------------------------------------------------------------ fleet status --state


def test_status_state_on_a_file_that_is_not_sqlite(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a database\n")
    one_clear_line(ef("fleet", "status", "--state", str(bad)), str(bad), "not an SQLite file")
    assert bad.read_text() == "not a database\n", "nothing is written to it"


def test_a_mistyped_state_path_creates_nothing(tmp_path):
    typo = tmp_path / "gatway.sqlite"
    line = one_clear_line(ef("fleet", "status", "--state", str(typo)), str(typo), "no such file", "never created")
    assert line.startswith("edgeflow fleet status: error: "), "the error names the whole command"
    assert not typo.exists() and not list(tmp_path.iterdir())


def test_status_state_on_another_sqlite_database(tmp_path):
    other = tmp_path / "other.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE recipes (name TEXT)")
    db.commit()
    db.close()
    before = other.read_bytes()
    one_clear_line(ef("fleet", "status", "--state", str(other)), "not a gateway state", "recipes")
    assert other.read_bytes() == before, "read-only: the file is unchanged"


# ------------------------------------------------------------ provision, inspect


def test_provision_checks_the_profile_and_stores_nothing(fleet):
    line = one_clear_line(ef("fleet", "provision", "cam-9", "--dir", str(fleet), "--profile", "rpi4"),
                          "'rpi4' is not a known board profile", "raspberry-pi-4", "edgeflow profile list")
    assert "did you mean" in line
    assert not (fleet / "devices" / "cam-9").exists()
    assert "cam-9" not in (fleet / "keyring.json").read_text()


def test_inspect_refuses_a_batch_below_one(model):
    one_clear_line(ef("inspect", str(model), "--batch", "-1"), "--batch -1", "1 or more")
    one_clear_line(ef("inspect", str(model), "--batch", "0"), "--batch 0")


# ------------------------------------------------------------ fleet deploy: before "deploying v3..."


@pytest.mark.parametrize(("flags", "needles"), [
    (["--canary", "150%"], ["--canary '150%'", "share in (0%, 100%]"]),
    (["--canary", "0"], ["--canary '0'"]),
    (["--canary", "ten"], ["--canary 'ten'"]),
    (["--threshold", "2"], ["--threshold '2'", "0% to 100%"]),
    (["--quantize"], ["--quantize needs --calibration", "unquantized"]),
    (["--calibration", "c.npy"], ["--calibration is only used with --quantize"]),
    (["--timeout", "0"], ["--timeout 0"]),
    (["--wave-size", "0"], ["--wave-size 0"]),
    (["--to", "colour=red"], ["bad target 'colour=red'", "profile=raspberry-pi-4"]),
])
def test_deploy_refuses_bad_settings_before_connecting(fleet, model, flags, needles):
    args = ["fleet", "deploy", str(model), "--dir", str(fleet), "--broker", NOBODY, "--wait", "0"]
    if "--to" not in flags:
        args += ["--to", "all"]
    t0 = time.monotonic()
    out = ef(*args, *flags)
    one_clear_line(out, *needles)
    assert "deploying" not in out.stdout + out.stderr
    assert time.monotonic() - t0 < 30, "no broker was waited for"


def test_deploy_of_a_file_that_is_not_a_model(fleet, tmp_path):
    junk = tmp_path / "model.onnx"
    junk.write_bytes(b"\x00\x01 not protobuf")
    one_clear_line(ef("fleet", "deploy", str(junk), "--to", "all", "--dir", str(fleet), "--broker", NOBODY),
                   str(junk), "not a valid ONNX model")


def test_deploy_with_calibration_that_is_not_an_array_file(fleet, model, tmp_path):
    bad = tmp_path / "calib.npy"
    bad.write_bytes(b"\x93NUMPY garbage")
    one_clear_line(ef("fleet", "deploy", str(model), "--to", "all", "--quantize", "--calibration", str(bad),
                      "--dir", str(fleet), "--broker", NOBODY), str(bad))


# ------------------------------------------------------------ other operator commands


def test_status_wait_must_not_be_negative(fleet):
    one_clear_line(ef("fleet", "status", "--dir", str(fleet), "--broker", NOBODY, "--wait", "-1"), "--wait -1")


def test_status_expect_is_for_the_broker_view(fleet, tmp_path):
    one_clear_line(ef("fleet", "status", "--state", str(tmp_path / "x.db"), "--expect", "2"), "--expect")


def test_cmd_arguments_are_key_value(fleet):
    one_clear_line(ef("fleet", "cmd", "cam-1", "set_config", "telemetry", "--dir", str(fleet), "--broker", NOBODY),
                   "'telemetry' is not KEY=VALUE")
    one_clear_line(ef("fleet", "cmd", "cam-1", "set_config", "--args", "[1]", "--dir", str(fleet), "--broker",
                      NOBODY), "--args must be a JSON object")


def test_an_unreachable_broker_is_one_line(fleet):
    out = ef("fleet", "status", "--dir", str(fleet), "--broker", NOBODY, "--wait", "1")
    one_clear_line(out, "could not connect", "127.0.0.1:9")


def test_gateway_config_with_a_string_for_a_number(tmp_path):
    conf = tmp_path / "gw.toml"
    conf.write_text('[gateway]\nfleet_dir = "fleet"\n[rounds]\nrounds = "three"\n')
    one_clear_line(ef("gateway", "--config", str(conf)), "rounds must be an integer", "'three'")
    conf.write_text('[rounds.train]\nepoch = 3\ncodec = "gzip"\n')
    one_clear_line(ef("gateway", "--config", str(conf)), "unknown setting(s) ['epoch']", "codec 'gzip' is unknown")
    assert not (tmp_path / "gateway.sqlite").exists(), "no state is created for a refused configuration"


def test_gateway_checks_its_eval_data_and_model_before_creating_the_state(fleet, model, tmp_path):
    bad = tmp_path / "eval.npz"
    bad.write_bytes(b"PK\x03\x04 this is not a zip archive")
    conf = tmp_path / "gw.toml"
    conf.write_text(f'[gateway]\nfleet_dir = "{fleet}"\nstate = "gw.sqlite"\nmodel = "{model}"\neval = "eval.npz"\n'
                    f'broker = "{NOBODY}"\n')
    one_clear_line(ef("gateway", "--config", str(conf)), str(bad), "np.save")
    assert not (tmp_path / "gw.sqlite").exists(), "no state is created before the eval data is checked"
    np.savez(bad, x=np.zeros((4, 64), np.float32), y=np.zeros(4, np.int64))
    (tmp_path / "model.onnx").write_bytes(b"not a model")
    conf.write_text(f'[gateway]\nfleet_dir = "{fleet}"\nstate = "gw.sqlite"\nmodel = "model.onnx"\n'
                    f'eval = "eval.npz"\nbroker = "{NOBODY}"\n')
    one_clear_line(ef("gateway", "--config", str(conf)), "model.onnx", "not a valid ONNX model")
    assert not (tmp_path / "gw.sqlite").exists(), "no state is created before the initial model is checked"


def test_gateway_export_without_a_state(tmp_path):
    conf = tmp_path / "gw.toml"
    conf.write_text('[gateway]\nfleet_dir = "fleet"\nstate = "gw.sqlite"\n')
    one_clear_line(ef("gateway", "--config", str(conf), "--export-model", str(tmp_path / "m.onnx")),
                   "no gateway state", "gw.sqlite")
    assert not (tmp_path / "gw.sqlite").exists()


def test_device_with_bad_training_data_refuses_before_connecting(fleet, tmp_path):
    bad = tmp_path / "train.npz"
    np.savez(bad, images=np.zeros((4, 64), np.float32))  # no x / y arrays
    t0 = time.monotonic()
    out = ef("device", "--credentials", str(fleet / "devices" / "cam-1"), "--broker", NOBODY,
             "--state", str(tmp_path / "state"), "--train-data", str(bad))
    one_clear_line(out, str(bad))
    assert time.monotonic() - t0 < 30


def test_device_without_credentials(tmp_path):
    one_clear_line(ef("device", "--credentials", str(tmp_path / "nope")), "not a device credentials directory",
                   "edgeflow fleet provision")


def test_json_output_is_only_json_for_provision(fleet):
    out = ef("fleet", "provision", "cam-2", "--dir", str(fleet), "--profile", "raspberry-pi-5", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["device"] == "cam-2" and doc["broker"].startswith("mqtts://localhost:")


# ------------------------------------------------------------ output a script can trust


def _state_with_devices(path: Path) -> None:
    """A gateway state as a running gateway leaves it: three boards, telemetry, the rounds' status."""
    from edgeflow.gateway.store import GatewayStore

    store = GatewayStore(path)
    now = time.time()
    boards = [("cam-1", "raspberry-pi-4", "training", ""),
              ("cam-2", "raspberry-pi-zero-2w", "no_data",
               "this agent has no training participant: no training data (start `edgeflow device` with "
               "--train-data x_y.npz holding arrays x and y)"),
              ("sensor-with-a-long-name-3", "beaglebone-black", "profile",
               "profile beaglebone-black cannot train (can_train = false in its profile)")]
    for dev, prof, state, detail in boards:
        birth = {"device": dev, "profile": prof, "bdseq": 1, "model_version": 2, "backend": "numpy",
                 "can_train": state != "profile", "training": state == "training", "train": state,
                 "train_detail": detail, "ts": now, "trust": "registered", "versions": {"edgeflow": "0.1"}}
        store.upsert_birth(dev, birth, profile=prof, model_version=2, bdseq=1)
        store.add_telemetry(dev, {"device": dev, "ts": now, "train": state, "train_detail": detail,
                                  "latency_p50_ms": 1.23456789, "latency_p95_ms": 2.3456789,
                                  "rss_bytes": 123456789, "cpu_percent": 12.3456, "battery": 0.87654321})
    store.set_meta("rounds_status", json.dumps({"state": "waiting", "reason": "round 4 not started: 1 eligible "
                                                "device(s), min_clients is 2", "ts": now}))
    store.close()


def test_status_table_fits_80_columns_and_says_why_boards_do_not_train(tmp_path):
    state = tmp_path / "gw.sqlite"
    _state_with_devices(state)
    out = subprocess.run([sys.executable, "-m", "edgeflow", "fleet", "status", "--state", str(state)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    table = [line for line in lines if not line.startswith(("not training:", "rounds:"))]
    assert max(len(line) for line in table) <= 80, out.stdout
    # lines of text are never broken at the width: a script greps one line and gets all of it
    assert any(line.startswith("not training: cam-2: ") and line.endswith("holding arrays x and y)")
               for line in lines), out.stdout
    assert "rounds: waiting: round 4 not started: 1 eligible device(s), min_clients is 2" in lines, out.stdout
    text = " ".join(out.stdout.split())
    for dev in ("cam-1", "cam-2", "sensor-with-a-long-name-3"):
        assert dev in text  # names are never cut
    assert "no data" in text and "--train-data" in text and "cannot train" in text
    assert "rounds: waiting: round 4 not started" in text


def test_status_json_is_rounded(tmp_path):
    state = tmp_path / "gw.sqlite"
    _state_with_devices(state)
    out = ef("fleet", "status", "--state", str(state), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    row = {r["device"]: r for r in doc["devices"]}["cam-1"]
    assert row["latency_p50_ms"] == 1.235 and row["cpu_percent"] == 12.3 and row["battery"] == 0.877
    assert row["train"] == "training" and doc["rounds"]["state"] == "waiting"
    assert {r["device"]: r for r in doc["devices"]}["cam-2"]["train"] == "no_data"


@pytest.mark.parametrize("argv", [
    ["profile", "list"], ["profile", "show", "raspberry-pi-4"], ["inspect", "{model}"],
    ["run", "{model}", "--input", "{x}"], ["bench", "{model}", "--runs", "3"],
    ["quantize", "{model}", "--profile", "x86-gateway", "-c", "{x}", "-o", "{tmp}/q.onnx"],
    ["train", "{model}", "--data", "{xy}", "--epochs", "1", "-o", "{tmp}/t.onnx"],
    ["broker-config", "--dir", "{tmp}/fd", "--fleet", "f"],
])
def test_json_means_only_json_on_stdout(model, tmp_path, argv):
    x, xy = tmp_path / "x.npy", tmp_path / "xy.npz"
    np.save(x, np.random.default_rng(0).random((8, 64)).astype(np.float32))
    np.savez(xy, x=np.random.default_rng(1).random((32, 64)).astype(np.float32),
             y=np.random.default_rng(2).integers(0, 10, 32))
    args = [a.format(model=model, x=x, xy=xy, tmp=tmp_path) for a in argv]
    if args[0] == "broker-config" and hasattr(os, "geteuid") and os.geteuid() == 0:
        args += ["--broker-user", "root"]
    out = ef(*args, "--json")
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)


@pytest.mark.integration
def test_two_operator_commands_at_once_have_their_own_sessions(tmp_path):
    """Each operator command connects with a client id of its own: two run at once, neither takes the other's
    session over. (Plain Mosquitto here: the generated fleet config also forces client id = user name, see
    docs/fleet.md.)"""
    import shutil as _shutil

    from edgeflow.broker.mosquitto import FleetDir
    from edgeflow.transport.broker import MosquittoBroker, find_mosquitto

    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto is not installed")
    broker = MosquittoBroker(binary=binary).start()
    try:
        fd = FleetDir(tmp_path / "fleet").init("farm", broker=broker.url)
        cmd = [sys.executable, "-m", "edgeflow", "fleet", "status", "--dir", str(fd.path), "--wait", "4", "--json"]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=60) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err
            assert json.loads(out) == {"devices": []}
        log = broker.log()
        ids = {line.split(" as ")[1].split(" ")[0] for line in log.splitlines() if "New client connected" in line}
        status_ids = [i for i in ids if "-status-" in i]
        assert len(status_ids) == 2, log
        assert {i.split("-status-")[0] for i in status_ids} == {"admin", "admin-2"}, "each claims its own operator user"
        assert "already connected, closing old connection" not in log, log
    finally:
        broker.stop()
        _shutil.rmtree(tmp_path / "fleet", ignore_errors=True)


@pytest.mark.parametrize(("flags", "needles"), [
    (["--devices", "1"], ["--devices 1", "two boards that train"]),
    (["--rounds", "0"], ["--rounds 0"]),
    (["--codec", "gzip"], ["--codec 'gzip' is unknown", "topk-int8"]),
    (["--ratio", "2"], ["--ratio 2", "(0, 1]"]),
    (["--seed", "-1"], ["--seed -1"]),
])
def test_demo_refuses_bad_settings_before_starting_a_broker(flags, needles):
    t0 = time.monotonic()
    out = ef("demo", *flags, "--json")
    one_clear_line(out, *needles)  # and no "broker: ..." line: nothing was started
    assert out.stdout == "" and time.monotonic() - t0 < 30


@pytest.mark.parametrize(("flags", "needles"), [
    (["--telemetry-interval", "0"], ["--telemetry-interval 0", "0.05"]),
    (["--memory-budget-mb", "-5"], ["--memory-budget-mb -5"]),
    (["--no-train", "--train-data", "x.npz"], ["--no-train and --train-data"]),
])
def test_device_flags_are_checked_before_connecting(fleet, tmp_path, flags, needles):
    out = ef("device", "--credentials", str(fleet / "devices" / "cam-1"), "--broker", NOBODY,
             "--state", str(tmp_path / "state"), *flags)
    one_clear_line(out, *needles)
