"""A table of mistakes a user makes, each run through the real `edgeflow` command (a subprocess):
every one must exit non-zero with exactly one line on stderr that names the problem (and no
traceback, and never "a bug in edgeflow").

The rows cover issue 33's list (silent NaN input, an integer that would wrap, argparse's usage block,
missing optional dependencies, a missing CA file, a wrong password) and plausible slips: wrong
paths, files of the wrong kind, bad URLs, bad counts. Mistakes that need a live fleet of two
processes have their own files: tests/test_state_lock.py (a second gateway on one state, a state
whose rounds are all done) and tests/test_duplicate_device.py (the same device started twice).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from _cli import one_clear_line
from onnx import TensorProto, helper

CLI = [sys.executable, "-m", "edgeflow"]

# (id, argv with {d} for the scratch folder, needles the one line must hold)
MISTAKES = [
    ("run-missing-model", "run {d}/missing.onnx -i {d}/nan.npy", ["model file not found", "missing.onnx"]),
    ("run-not-onnx", "run {d}/notonnx.onnx -i {d}/f64.npy", ["notonnx.onnx", "not a valid ONNX model"]),
    ("run-missing-input", "run {d}/relu.onnx -i {d}/missing.npy", ["input file not found", "missing.npy"]),
    ("run-text-input", "run {d}/relu.onnx -i {d}/x.txt", ["x.txt", "np.save"]),
    ("run-wrong-shape", "run {d}/relu.onnx -i {d}/shape.npy", ["input 'x'", "gives 2"]),
    ("run-nan-input", "run {d}/relu.onnx -i {d}/nan.npy", ["1 NaN", "first at index [0, 2]", "--allow-nonfinite"]),
    ("run-int-wraps", "run {d}/neg_i32.onnx -i {d}/big_i64.npy", ["input 'x'", "int32", "would wrap"]),
    ("run-output-folder-missing", "run {d}/relu.onnx -i {d}/f32.npy -o {d}/nodir/out.npz",
     ["--output", "nodir", "does not exist"]),
    ("run-bad-shape-flag", "run {d}/relu.onnx -i {d}/f32.npy --shape x=1xq", ["--shape 'x=1xq'", "NAME=DIMS"]),
    ("run-shape-unknown-input", "run {d}/relu.onnx -i {d}/f32.npy --shape y=3", ["no input 'y'", "--shape"]),
    ("run-unknown-profile", "run {d}/relu.onnx -i {d}/f32.npy --profile nosuchboard",
     ["unknown device profile 'nosuchboard'", "raspberry-pi-4"]),
    ("run-zero-threads", "run {d}/relu.onnx -i {d}/f32.npy --threads 0", ["--threads", "1 or more"]),
    ("run-no-input-flag", "run {d}/relu.onnx", ["required: --input", "edgeflow run --help"]),
    ("unknown-command", "nosuch", ["invalid choice: 'nosuch'", "edgeflow --help"]),
    ("bench-missing-model", "bench {d}/missing.onnx", ["model file not found"]),
    ("bench-zero-runs", "bench {d}/relu.onnx --runs 0", ["--runs", ">= 1"]),
    ("inspect-a-folder", "inspect {d}", ["is a directory", ".onnx file"]),
    ("inspect-negative-batch", "inspect {d}/relu.onnx --batch -2", ["--batch -2", "1 or more"]),
    ("train-missing-data", "train {d}/relu.onnx --data {d}/missing.npz -o {d}/t.onnx", ["data file not found"]),
    ("train-zero-epochs", "train {d}/relu.onnx --data {d}/f32.npy -o {d}/t.onnx --epochs 0", ["--epochs", ">= 1"]),
    ("quantize-no-profile", "quantize {d}/relu.onnx -o {d}/q.onnx", ["required: --profile"]),
    ("gateway-missing-config", "gateway --config {d}/missing.toml", ["gateway config not found", "missing.toml"]),
    ("gateway-bad-toml", "gateway --config {d}/bad.toml", ["bad.toml", "not valid TOML", "line 1"]),
    ("gateway-missing-fleet-dir", "gateway --config {d}/gw.toml --dir {d}/nofleet",
     ["not a fleet directory", "edgeflow broker-config"]),
    ("gateway-initial-parameters-missing", "gateway --config {d}/gw.toml --dir {d}/fleet --initial-parameters "
     "{d}/missing.npz", ["--initial-parameters", "missing.npz", "file not found"]),
    ("gateway-initial-parameters-not-npz", "gateway --config {d}/gw.toml --dir {d}/fleet --initial-parameters "
     "{d}/bad.toml", ["--initial-parameters", "bad.toml", "not a numpy .npz file"]),
    ("gateway-bad-http", "gateway --config {d}/gw.toml --dir {d}/fleet --http nonsense", ["--http", "HOST:PORT"]),
    ("rounds-missing-state", "rounds --state {d}/missing.sqlite", ["no such file", "never created"]),
    ("rounds-state-not-sqlite", "rounds --state {d}/gw.toml", ["not an SQLite file"]),
    ("rounds-sqlite-url-two-slashes", "rounds --state sqlite:/x", ["three slashes"]),
    ("rounds-postgres-down", "rounds --state postgresql://postgres@127.0.0.1:1/x",
     ["cannot connect to PostgreSQL", "host, port"]),
    ("simulate-codec-opt-not-kv", "simulate --devices 2 --rounds 1 --codec-opt ratio",
     ["--codec-opt: 'ratio' is not KEY=VALUE"]),
    ("fleet-cmd-unknown-device", "fleet cmd dev-b status --dir {d}/fleet --broker mqtt://127.0.0.1:1",
     ["device 'dev-b' is not provisioned", "did you mean 'dev-a'", "fleet provision"]),
    ("fleet-status-missing-dir", "fleet status --dir {d}/nofleet", ["not a fleet directory"]),
    ("fleet-history-missing-state", "fleet history dev-a --state {d}/missing.sqlite", ["no such file"]),
    ("fleet-deploy-missing-model", "fleet deploy {d}/missing.onnx --to all --dir {d}/fleet",
     ["model file not found"]),
    ("fleet-status-no-broker", "fleet status --dir {d}/fleet --broker mqtt://127.0.0.1:1",
     ["connection refused", "no MQTT broker is listening"]),
    ("device-missing-credentials", "device --credentials {d}/nocreds --broker mqtt://127.0.0.1:1883",
     ["not a device credentials directory", "edgeflow fleet provision"]),
    ("device-http-broker", "device --credentials {d}/fleet/devices/dev-a --broker http://127.0.0.1:1883",
     ["unknown scheme 'http'", "mqtt://"]),
    ("device-broker-without-scheme", "device --credentials {d}/fleet/devices/dev-a --broker 127.0.0.1:1883",
     ["no scheme", "mqtt://127.0.0.1:1883"]),
    ("device-broker-bad-port", "device --credentials {d}/fleet/devices/dev-a --broker mqtt://127.0.0.1:notaport",
     ["invalid port"]),
]


def make_scratch(d: Path) -> Path:
    """Models, arrays and files of the wrong kind; a fleet directory with one device (the rows' {d};
    benchmarks/cli_mistakes_tally.py makes its folder with this too)."""
    from edgeflow.broker.mosquitto import FleetDir

    def model(op: str, dtype: int, path: str) -> None:
        x = helper.make_tensor_value_info("x", dtype, [1, 4])
        y = helper.make_tensor_value_info("y", dtype, [1, 4])
        onnx.save(helper.make_model(helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g", [x], [y]),
                                    opset_imports=[helper.make_opsetid("", 13)]), str(d / path))

    model("Relu", TensorProto.FLOAT, "relu.onnx")
    model("Neg", TensorProto.INT32, "neg_i32.onnx")
    np.save(d / "f32.npy", np.ones((1, 4), np.float32))
    np.save(d / "f64.npy", np.ones((1, 4)))
    nan = np.ones((1, 4), np.float32)
    nan[0, 2] = np.nan
    np.save(d / "nan.npy", nan)
    np.save(d / "big_i64.npy", np.array([[1, 2, 3, 2**40]], dtype=np.int64))
    np.save(d / "shape.npy", np.ones((2, 3), np.float32))
    (d / "notonnx.onnx").write_text("hello")
    (d / "x.txt").write_text("1 2 3")
    (d / "bad.toml").write_text("[gateway\nstate=")
    (d / "gw.toml").write_text('[gateway]\nstate = "gw.sqlite"\nmodel = "relu.onnx"\n[rounds]\nrounds = 1\n')
    FleetDir(d / "fleet").init("lab").provision("dev-a", profile="x86-gateway")
    return d


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return make_scratch(tmp_path_factory.mktemp("mistakes"))


@pytest.mark.parametrize("argv, needles", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_a_mistake_is_one_clear_line(scratch, argv, needles) -> None:
    out = subprocess.run(CLI + argv.format(d=scratch).split(), capture_output=True, text=True, timeout=120,
                         cwd=scratch)
    line = one_clear_line(out, *needles)
    assert line.startswith("edgeflow") and "a bug in edgeflow" not in line, line
    assert out.returncode == 2, (out.returncode, line)


def test_a_missing_optional_dependency_names_its_extra(scratch) -> None:
    """nats-py (the `nats` extra) not installed and a nats:// broker: one line naming the extra, not
    "internal error ... a bug in edgeflow". The module is made unimportable as a missing one is."""
    code = ("import sys; sys.modules['nats'] = None; from edgeflow.cli.main import main; "
            f"sys.exit(main(['fleet', 'status', '--dir', {str(scratch / 'fleet')!r}, '--broker', "
            "'nats://127.0.0.1:1']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=scratch)
    line = one_clear_line(out, "nats-py", "pip install 'edgeflow[nats]'", "'.[nats]'")
    assert out.returncode == 2 and "a bug in edgeflow" not in line, line


def test_float64_input_is_cast_with_one_warning_line(scratch) -> None:
    out = subprocess.run(CLI + ["run", str(scratch / "relu.onnx"), "-i", str(scratch / "f64.npy"), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["outputs"]["y"]["dtype"] == "float32"
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "'x' is float64" in lines[0] and "float32" in lines[0], out.stderr
    # --allow-nonfinite feeds the NaN on purpose
    nan = subprocess.run(CLI + ["run", str(scratch / "relu.onnx"), "-i", str(scratch / "nan.npy"), "--allow-nonfinite",
                                "--json"], capture_output=True, text=True, timeout=120)
    assert nan.returncode == 0 and np.isnan(json.loads(nan.stdout)["outputs"]["y"]["data"][0][2]), nan.stderr


def test_a_session_says_a_lossy_cast_once_not_per_run(scratch, caplog) -> None:
    from edgeflow.runtime.session import load

    rt = load(onnx.load(str(scratch / "relu.onnx")), "x86-gateway")
    with caplog.at_level(logging.WARNING, logger="edgeflow.runtime"):
        for _ in range(3):
            rt.run(np.ones((1, 4)))
        rt.run(np.ones((1, 4), np.float32))
    assert [r.getMessage() for r in caplog.records if "float64" in r.getMessage()] == [
        "input 'x' is float64, the model takes float32: cast, precision beyond float32 is lost (save the array "
        "as float32 to say so yourself)"]


@pytest.mark.integration
def test_a_device_without_the_ca_file_or_with_a_wrong_password_stops_with_one_line(scratch, tmp_path) -> None:
    """The broker `edgeflow broker-config` generates (TLS, passwords): a credentials folder whose ca.crt
    is gone names the missing CA file; a wrong password says so; both stop after a few refusals
    (REFUSAL_LIMIT) with exit 2 instead of retrying forever."""
    from _fleet import BROKER_USER, GeneratedBroker

    from edgeflow.broker.mosquitto import FleetDir, ListenerSettings
    from edgeflow.transport.broker import free_port

    fd = FleetDir(tmp_path / "fleet").init("lab")
    fd.provision("dev-a", profile="x86-gateway")
    port = free_port()
    files = fd.write_broker_config(ListenerSettings(host="127.0.0.1", port=port, log_file=str(tmp_path / "m.log"),
                                                    user=BROKER_USER), tls_hosts=["localhost", "127.0.0.1"])
    broker = GeneratedBroker(files.config, port, tmp_path / "m.log")
    try:
        no_ca = tmp_path / "no-ca"
        shutil.copytree(fd.device_dir("dev-a"), no_ca)
        (no_ca / "ca.crt").unlink()
        wrong = tmp_path / "wrong-password"
        shutil.copytree(fd.device_dir("dev-a"), wrong)
        creds = json.loads((wrong / "device.json").read_text())
        (wrong / "device.json").write_text(json.dumps({**creds, "password": "not-the-password"}))
        for folder, needles in ((no_ca, ["failed verification", "no CA file was given", "broker/ca.crt"]),
                                (wrong, ["refused the connection as user 'dev-a'", "check username/password"])):
            out = subprocess.run(CLI + ["device", "--credentials", str(folder), "--broker",
                                        f"mqtts://127.0.0.1:{port}", "--state", str(tmp_path / f"st-{folder.name}")],
                                 capture_output=True, text=True, timeout=90)
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
            last = out.stderr.strip().splitlines()[-1]  # after the device's start lines and the refusals logged
            assert last.startswith("edgeflow device: error:"), out.stderr
            for n in needles:
                assert n in last, last
    finally:
        broker.stop()
