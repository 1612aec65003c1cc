"""The emulated-board smoke (tests/boards/ci_smoke.sh) as a test: opt-in, it takes minutes.

    EDGEFLOW_BOARDS=1 python -m pytest -m boards tests/boards

Needs root, debootstrap and qemu-user-static (the script installs them with apt if missing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as harness  # noqa: E402


@pytest.mark.boards
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_armv7_smoke_install_detect_inference_round() -> None:
    if os.environ.get("EDGEFLOW_BOARDS") != "1":
        pytest.skip("emulated-board smoke is opt-in: EDGEFLOW_BOARDS=1 (root, debootstrap, qemu-user-static; minutes)")
    if os.geteuid() != 0:
        pytest.skip("the board harness needs root (chroot, mounts)")
    r = subprocess.run(["bash", str(HERE / "ci_smoke.sh")], capture_output=True, text=True, timeout=1700,
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    rep = json.loads((harness.cache_root() / "armv7" / "last-run.json").read_text())
    steps = rep["steps"]
    assert rep["smoke"] and not rep["failed"]
    assert steps["detect"]["profile"] == "raspberry-pi-zero-2w"
    assert steps["install"]["from_distro_used"]["numpy"].startswith("1.24")
    assert "onnxruntime" not in steps["install"]["from_pypi"] and "numpy" not in steps["install"]["from_pypi"]
    assert steps["model numpy"]["ok"] and steps["model numpy"]["max_abs_diff"] < 1e-3
    fleet = steps["fleet"]
    assert fleet["ota_v1"]["counts"] == {"ok": 2} and [r["participants"] for r in fleet["rounds"]] == [2]
