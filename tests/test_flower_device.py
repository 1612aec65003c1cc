"""docs/flower.md's "On boards" block run as written (issue 33): real Mosquitto with the generated TLS config,
two real `edgeflow device --app` processes with their --node-config, the real `edgeflow gateway` starting from
an .npz with a custom strategy from a file next to gateway.toml. Only the port and the example folder change.
Also `edgeflow device --app` mistakes as a board's owner meets them: one line, exit 2, before any connection."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from _cli import one_clear_line
from edgeflow.transport.broker import find_mosquitto, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "flower.md"
EXAMPLE = ROOT / "examples" / "flower_quickstart"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "COLUMNS": "80",
       "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
ENV.pop("EDGEFLOW_FLEET_DIR", None)


def boards_block() -> str:
    section = DOC.read_text(encoding="utf-8").split("## On boards", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```bash\n(.*?)```", section, re.S)
    assert m, "docs/flower.md: 'On boards' has no ```bash block"
    return m.group(1)


def fresh_dir() -> Path:
    # a directory the broker's own user can reach (broker-config run as root makes Mosquitto drop privileges)
    work = Path(tempfile.mkdtemp(prefix="edgeflow-flower-"))
    os.chmod(work, 0o755)
    return work


def run_block(script: str) -> tuple[list[dict], subprocess.CompletedProcess, Path]:
    """The block run by bash in a fresh directory: the rounds' metrics from the gateway's state."""
    work = fresh_dir()
    wrapped = "set -eu -o pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\nset -x\n" + script
    (work / "boards.sh").write_text(wrapped)
    try:
        out = subprocess.run(["bash", str(work / "boards.sh")], cwd=work, env=ENV, capture_output=True, text=True,
                             timeout=400)
        transcript = out.stdout + "\n--- stderr ---\n" + out.stderr
        assert out.returncode == 0, transcript[-8000:]
        assert "Traceback" not in out.stderr, transcript[-8000:]
        assert out.stderr.count("federated rounds: taking part") == 2, transcript[-8000:]
        db = sqlite3.connect(f"file:{work / 'gateway.sqlite'}?mode=ro", uri=True)
        rows = db.execute("SELECT round_id, state, metrics FROM rounds ORDER BY round_id").fetchall()
        db.close()
        assert [(r[0], r[1]) for r in rows] == [(1, "closed"), (2, "closed"), (3, "closed")], rows
        jsonl = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
        metrics = [json.loads(r[2]) for r in rows]
        assert [m["fed_eval_accuracy"] for m in jsonl] == [m["fed_eval_accuracy"] for m in metrics]
        return metrics, out, work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def the_block() -> str:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    block = boards_block()
    assert re.search(r"^PORT=8883\b", block, re.M) and re.search(r"^APP=examples/flower_quickstart\b", block, re.M)
    script = re.sub(r"^PORT=8883\b", f"PORT={free_port()}", block, count=1, flags=re.M)
    return re.sub(r"^APP=examples/flower_quickstart\b", f"APP={EXAMPLE}", script, count=1, flags=re.M)


def test_the_boards_block_of_docs_flower_runs_as_written():
    script = the_block()
    assert "model =" not in script and "initial_parameters" not in script  # the gateway asks a board
    metrics, out, _ = run_block(script)
    assert all(m["participants"] == 2 for m in metrics), metrics
    # round 1 evaluates what a board offered: its own small random init (loss ln 10), model v1
    assert metrics[0]["fed_eval_loss"] == pytest.approx(math.log(10), abs=0.05), metrics[0]
    acc = [m["fed_eval_accuracy"] for m in metrics]  # the boards' evaluate, stored per round
    assert acc[-1] > acc[0] + 0.4, acc
    assert all(m["fed_eval_partition"] in ("part-0", "part-1") and "fed_eval_above_half" in m for m in metrics)
    assert all(m["strategy_trimmed_per_side"] == 0.0 for m in metrics), metrics  # the custom strategy ran
    assert "round 1: model v2," in out.stdout, out.stdout  # v1 = the offered parameters


@pytest.mark.parametrize("given_by", ["gateway.toml", "--initial-parameters"])
def test_the_gateway_starts_from_initial_parameters_when_given(given_by):
    script = the_block()
    init = ("python -c \"import numpy as np; b = np.zeros(10, np.float32); b[0] = 30; "
            "np.savez('init.npz', np.zeros((64, 10), np.float32), b)\"\n")
    script = script.replace("cp $APP/strategy.py .\n", "cp $APP/strategy.py .\n" + init, 1)
    if given_by == "gateway.toml":
        script = script.replace('state = "gateway.sqlite"\n', 'state = "gateway.sqlite"\ninitial_parameters = "init.npz"\n', 1)
    else:
        assert script.count("edgeflow gateway --config gateway.toml\n") == 1
        script = script.replace("edgeflow gateway --config gateway.toml\n",
                                "edgeflow gateway --config gateway.toml --initial-parameters init.npz\n")
    assert script.count("init.npz") == 2
    metrics, _, _ = run_block(script)
    assert metrics[0]["fed_eval_loss"] > 20, metrics[0]  # every digit predicted a 0 by the given bias


@pytest.fixture(scope="module")
def credentials():
    work = fresh_dir()
    for cmd in (["broker-config", "--dir", "fleet", "--fleet", "farm", "--public-host", "localhost", "--port",
                 str(free_port())],
                ["fleet", "provision", "cam-1", "--dir", "fleet", "--profile", "raspberry-pi-4"]):
        out = subprocess.run([sys.executable, "-m", "edgeflow.cli.main", *cmd], cwd=work, env=ENV, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    yield work
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("extra, needles", [
    (["--app", "missing.py:client_fn"], ["file missing.py not found"]),
    (["--app", "{app}:nope"], ["has no attribute 'nope'"]),
    (["--app", "{app}:raising"], ["client_fn raised KeyError", "'partition-id'"]),
    (["--app", "{app}:returns_int"], ["client_fn returned an object of type int"]),
    (["--app", "{app}:client_fn", "--train-data", "x.npz"], ["--app and --train-data contradict each other"]),
    (["--app", "{app}:client_fn", "--no-train"], ["--app and --no-train contradict each other"]),
    (["--node-config", "partition-id=0"], ["--node-config is the context of a Flower-style client"]),
    (["--app", "{app}:client_fn", "--node-config", "partition-id"], ["--node-config: 'partition-id' is not KEY=VALUE"]),
])
def test_device_app_mistakes_are_one_line_and_exit_2(credentials, tmp_path, extra, needles):
    app = tmp_path / "app.py"
    app.write_text("def raising(context):\n    return context.node_config['partition-id']\n\n"
                   "def returns_int(context):\n    return 7\n\ndef client_fn(context):\n    return 7\n")
    args = [a.format(app=app) for a in extra]
    out = subprocess.run([sys.executable, "-m", "edgeflow.cli.main", "device", "--credentials", "fleet/devices/cam-1",
                          "--state", str(tmp_path / "state"), *args], cwd=credentials, env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    one_clear_line(out, "edgeflow device: error:", *needles)
