"""benchmarks/fl_vs_flower.py as a user runs it, at tiny scale (2 clients, 2 rounds): both sides train on the
one split, every round has bytes both ways, and Flower's byte count is exactly its serialized tensors.

Flower lives in its own venv (it pins typer < 0.21, which breaks amqtt here): the run skips, saying how to
make it, when no interpreter can import flwr and ray (tests/_flower.py: ``FLOWER_PYTHON``, /work/venvs/flwr,
~/.cache/edgeflow/flwr-venv; .ci/run makes the last)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _flower import MAKE_VENV, flower_python

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "fl_vs_flower.py"
FLOWER_PYTHON = flower_python()


def _mosquitto() -> bool:
    from edgeflow.transport.broker import find_mosquitto

    return find_mosquitto() is not None


def test_a_missing_flower_venv_is_one_line_that_says_how_to_make_it(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--flower-python", str(tmp_path / "no" / "python"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "no Flower interpreter at" in lines[0] and "pip install" in lines[0] and "--flower-python" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("flag, value, says", [
    ("--codecs", "int8,int9", "--codecs: unknown ['int9']"),
    ("--alphas", "0.3,x", "--alphas takes comma-separated numbers"),
    ("--alphas", "0", "--alphas must be > 0"),
    ("--models", "mlp,resnet", "--models: unknown ['resnet']"),
    ("--train-mode", "full", "--train-mode must be head or bias"),
    ("--clients", "0", "--clients must be >= 1"),
])
def test_bad_settings_are_one_line_before_anything_runs(tmp_path, flag, value, says):
    proc = subprocess.run([sys.executable, str(BENCH), flag, value, "--flower-python", str(tmp_path / "none"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert says in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_an_interpreter_without_flower_is_refused_with_the_fix(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--flower-python", sys.executable, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONNOUSERSITE": "1"})
    if proc.returncode == 0 or "cannot import flwr" not in proc.stderr:
        pytest.skip("this interpreter can import flwr and ray: nothing to refuse")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
@pytest.mark.skipif(FLOWER_PYTHON is None, reason=f"no Flower interpreter (flwr + ray); make it with: {MAKE_VENV}")
@pytest.mark.skipif(not _mosquitto(), reason="no mosquitto binary (apt install mosquitto): edgeflow's side needs one")
def test_both_sides_run_on_one_split_with_bytes_each_way(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCH), "--clients", "2", "--rounds", "2", "--alphas", "0.3",
                           "--codecs", "int8,dense", "--sanity-seeds", "0", "--flower-python", FLOWER_PYTHON,
                           "--ray-cpus", "1", "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=420, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result == json.loads((out / "results.json").read_text())
    (case,) = result["cases"]
    assert set(case["sides"]) == {"flower", "edgeflow-int8", "edgeflow-dense"}
    for side, rows in case["per_round"].items():
        assert [r["round"] for r in rows] == [1, 2], side
        for r in rows:
            assert r["bytes_up"] > 0 and r["bytes_down"] > 0, (side, r)
            assert 0.0 < r["accuracy"] <= 1.0, (side, r)
        s = case["sides"][side]
        assert s["wall_s"] > 0 and s["peak_rss_mib"] > 0, side

    # Flower's up count is exactly 2 clients x its wire form of the MLP's tensors (one np.save buffer each)
    shapes = [(64, 64), (64,), (32, 64), (32,), (10, 32), (10,)]
    per_client = sum(len(_npy(np.zeros(s, np.float32))) for s in shapes)
    assert [r["bytes_up"] for r in case["per_round"]["flower"]] == [2 * per_client] * 2
    assert [r["bytes_down"] for r in case["per_round"]["flower"]] == [2 * per_client] * 2
    # edgeflow's dense updates carry the fp32 values (+ envelope); int8 is about a quarter of that
    dense_fp32 = 4 * sum(int(np.prod(s)) for s in shapes)
    up_dense = case["sides"]["edgeflow-dense"]["bytes_up_per_round"]
    up_int8 = case["sides"]["edgeflow-int8"]["bytes_up_per_round"]
    assert 2 * dense_fp32 <= up_dense < 2 * dense_fp32 * 1.2
    assert up_int8 < 0.4 * up_dense
    assert case["ratios"]["int8"]["bytes_up"] == pytest.approx(up_int8 / case["sides"]["flower"]["bytes_up_per_round"],
                                                                abs=1e-3)
    svg = Path(case["svg"]).read_text()
    assert svg.startswith("<svg") and all(f'data-series="{k}"' in svg for k in case["sides"])
    md = (out / "results.md").read_text()
    assert "| mlp | 0.3 | flower |" in md and "| mlp | 0.3 | int8 |" in md

    # --render: the tables again at another target, from results.json alone (no training)
    again = subprocess.run([sys.executable, str(BENCH), "--render", str(out / "results.json"), "--target-accuracy",
                            "0.01"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    redone = json.loads((out / "results.json").read_text())["cases"][0]
    for side, rows in case["per_round"].items():  # every side is above 1% after round 1
        assert redone["sides"][side]["round_to_target"] == 1
        assert redone["sides"][side]["bytes_up_to_target"] == rows[0]["bytes_up"]
    assert "round to 0.01" in (out / "results.md").read_text()


@pytest.mark.parametrize("text, says", [("{not json", "cannot read a results.json"),
                                         ("{}", "not a results.json of this benchmark"),
                                         ('{"cases": [{"sides": {}}]}', "not a results.json of this benchmark"),
                                         ("[1, 2]", "not a results.json of this benchmark")])
def test_render_of_something_else_is_one_line(tmp_path, text, says):
    bad = tmp_path / "results.json"
    bad.write_text(text)
    proc = subprocess.run([sys.executable, str(BENCH), "--render", str(bad)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert bad.read_text() == text and not (tmp_path / "results.md").exists()


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()
