"""A newcomer's first try of the command line: conventions and bad input.

Every user mistake gets one line on stderr naming what was wrong and what to
change, a non-zero exit code, and no traceback (tracebacks only under -v).
Each case runs the real command in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from _cli import one_clear_line
from edgeflow import zoo


def ef(*args: str, timeout: float = 120, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)



@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("m") / "mlp.onnx"
    onnx.save(zoo.mlp((16, 8, 4)), p)
    return p


def test_python_dash_m_edgeflow_is_the_same_command():
    out = ef("--version")
    assert out.returncode == 0 and out.stdout.startswith("edgeflow ")


@pytest.mark.parametrize("argv", [["-v", "profile", "list"], ["profile", "list", "-v"], ["profile", "-q", "list"],
                                  ["profile", "list", "--verbose", "-q"]])
def test_verbosity_flags_work_anywhere_on_the_line(argv):
    out = ef(*argv, "--json")
    assert out.returncode == 0, out.stderr
    assert "raspberry-pi-4" in {p["name"] for p in json.loads(out.stdout)}


def test_tables_fit_80_columns_without_cutting_names():
    import os

    out = subprocess.run([sys.executable, "-m", "edgeflow", "profile", "list"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "80"}, timeout=60)
    assert out.returncode == 0
    assert max(len(line) for line in out.stdout.splitlines()) <= 80
    for name in ("raspberry-pi-zero-2w", "x86-gateway", "beaglebone-black"):
        assert name in out.stdout  # never "raspberry…"
    assert "not shown at 80 columns" in out.stdout


def test_a_corrupt_npz_is_one_line(mlp_path, tmp_path):
    bad = tmp_path / "x.npz"
    bad.write_bytes(b"PK\x03\x04 this is not a zip archive")
    one_clear_line(ef("run", str(mlp_path), "--input", str(bad)), str(bad), "np.save")
    truncated = tmp_path / "t.npz"
    np.savez(truncated, input=np.zeros((1, 16), np.float32))
    truncated.write_bytes(truncated.read_bytes()[:-30])
    one_clear_line(ef("run", str(mlp_path), "--input", str(truncated)), str(truncated))


def test_a_damaged_npy_is_one_line_and_the_traceback_needs_dash_v(mlp_path, tmp_path):
    # a .npy cut short: numpy raises deep inside its reader
    bad = tmp_path / "x.npy"
    np.save(bad, np.zeros((1, 16), np.float32))
    bad.write_bytes(bad.read_bytes()[:-8])
    out = ef("run", str(mlp_path), "--input", str(bad))
    one_clear_line(out, str(bad))
    out_v = ef("run", str(mlp_path), "--input", str(bad), "-v")
    assert out_v.returncode != 0 and "Traceback" in out_v.stderr


@pytest.mark.parametrize("fmt", [["--json"], []])
def test_output_into_a_closed_pipe_is_quiet(fmt):
    """`edgeflow profile list [--json] | head -1`: the reader leaves early; no BrokenPipeError traceback, and
    the same exit code (141, as for SIGPIPE) whether JSON or a table was being written."""
    p = subprocess.Popen([sys.executable, "-m", "edgeflow", "profile", "list", *fmt],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before edgeflow writes
    _, err = p.communicate(timeout=60)
    assert p.returncode == 141, err
    assert b"Traceback" not in err and b"BrokenPipe" not in err and b"Exception ignored" not in err, err


@pytest.mark.parametrize(("args", "toml", "needles"), [
    (["--codec", "gzip"], None, ["codec 'gzip' is unknown", "topk-int8"]),
    (["--devices", "1"], None, ["devices (1) is below min_clients (2)"]),
    (["--strategy", "fedmagic"], None, ["strategy 'fedmagic' is unknown", "fedavg"]),
    (["--fraction", "1.5"], None, ["fraction must be in (0, 1]"]),
    (["--profiles", "rpi4"], None, ["rpi4", "edgeflow profile list"]),
    ([], 'rounds = "three"\n', ["rounds must be an integer", "'three'"]),
    ([], "devices = 2.5\n", ["devices must be an integer"]),
    ([], "[rounds]\nrounds = 3\n", ["simulate's TOML has no tables ([rounds])", "top level", "rounds = 3"]),
])
def test_simulate_refuses_bad_settings_before_starting_anything(tmp_path, args, toml, needles):
    extra = []
    if toml is not None:
        conf = tmp_path / "sim.toml"
        conf.write_text(toml)
        extra = ["--config", str(conf)]
    out = ef("simulate", *args, *extra, "--out", str(tmp_path / "run"))
    one_clear_line(out, *needles)  # one line only: no broker started, no progress of a round
    assert not (tmp_path / "run").exists(), "nothing is created for a refused configuration"


@pytest.mark.integration
def test_simulate_json_is_only_json(tmp_path):
    out = ef("simulate", "--devices", "2", "--rounds", "1", "--deadline", "5", "--epochs", "1",
             "--out", str(tmp_path / "run"), "--json", timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["rounds_completed"] == 1 and summary["ok"] is True
    assert isinstance(summary["final_accuracy"], float)
    assert summary["final_accuracy"] == round(summary["final_accuracy"], 4)
    assert "broker:" in out.stderr


@pytest.mark.parametrize("cmd", ["run", "quantize", "train"])
def test_an_unwritable_output_is_refused_before_any_work(mlp_path, tmp_path, cmd):
    x = tmp_path / "x.npz"
    np.savez(x, input=np.zeros((4, 16), np.float32), x=np.zeros((4, 16), np.float32), y=np.zeros(4, np.int64))
    extra = {"run": ["--input", str(x)], "quantize": ["--profile", "x86-gateway", "-c", str(x)],
             "train": ["--data", str(x), "--epochs", "1"]}[cmd]
    one_clear_line(ef(cmd, str(mlp_path), *extra, "-o", "/nonexistent/dir/out.onnx"),
                   "/nonexistent/dir", "does not exist")


def test_an_unwritable_report_is_refused_before_quantizing(mlp_path, tmp_path):
    x = tmp_path / "x.npz"
    np.savez(x, input=np.zeros((4, 16), np.float32))
    out = ef("quantize", str(mlp_path), "--profile", "x86-gateway", "-c", str(x), "-o", str(tmp_path / "q.onnx"),
             "--report", "/nonexistent/dir/r.json")
    one_clear_line(out, "--report /nonexistent/dir/r.json", "does not exist")
    assert not (tmp_path / "q.onnx").exists(), "refused before the quantization, not after it"


def test_quantize_takes_the_x_y_files_train_reads(mlp_path, tmp_path):
    rng = np.random.default_rng(0)
    xy = tmp_path / "eval.npz"
    np.savez(xy, x=rng.random((40, 16), dtype=np.float32), y=rng.integers(0, 4, 40))
    out = ef("quantize", str(mlp_path), "--profile", "x86-gateway", "--calibration", str(xy), "-o",
             str(tmp_path / "q.onnx"), "--no-sensitivity", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["accuracy_fp32"] is not None, "y is taken as the labels"
    assert out.stderr.strip() == "", out.stderr


def test_calibration_without_the_input_names_says_how_to_save_it(mlp_path, tmp_path):
    bad = tmp_path / "cal.npz"
    np.savez(bad, images=np.zeros((4, 16), np.float32))
    out = ef("quantize", str(mlp_path), "--profile", "x86-gateway", "--calibration", str(bad), "-o",
             str(tmp_path / "q.onnx"))
    one_clear_line(out, "no array for input(s) ['input']", "np.savez(PATH, input=...)")
    assert out.stderr.startswith("edgeflow quantize: error:"), "no blank line (a spinner's) before the error"


@pytest.mark.parametrize("argv", [["models", "list"], ["profile", "show", "raspberry-pi-4"]])
def test_more_tables_fit_80_columns(argv):
    import os

    from edgeflow import model_suite as ms

    out = subprocess.run([sys.executable, "-m", "edgeflow", *argv], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "80"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert max(len(line) for line in out.stdout.splitlines()) <= 80, out.stdout
    if argv[0] == "models":
        for m in ms.models():
            assert m.name in out.stdout  # names whole, never cut
