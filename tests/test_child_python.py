"""A child interpreter imports the parent's edgeflow, not a checkout in the current directory.

README's first command installs the checkout (not editable) and runs `edgeflow demo` from its root; the
device health check's child (`python -c`) then imported the root's ./edgeflow, which has no edgeflow.kernels,
so every device failed its health check and the demo stopped at its first deployment. The same holds for
the gateway's ingestion workers (`python -m`). Here the current directory holds an `edgeflow` package that
fails on import, as a checkout without the install's mapping does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _fleet import PROFILE, mlp_bytes

import edgeflow
from edgeflow.artifact import make_golden
from edgeflow.child_python import child_env, module_command, python_command
from edgeflow.device.health import check_model
from edgeflow.profiles import get_profile

REAL = str(Path(edgeflow.__file__).resolve())


@pytest.fixture
def shadowing_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "edgeflow"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('the checkout in the current directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=120)


def test_the_plain_child_is_shadowed_by_the_current_directory(shadowing_cwd: Path) -> None:
    # the control: what `python -c` and `python -m` did before
    for cmd in ([sys.executable, "-c", "import edgeflow"], [sys.executable, "-m", "edgeflow", "--version"]):
        proc = _run(cmd, shadowing_cwd)
        assert proc.returncode != 0 and "the checkout in the current directory was imported" in proc.stderr


def test_python_command_imports_the_parents_edgeflow(shadowing_cwd: Path) -> None:
    proc = _run(python_command("import sys, edgeflow\nprint(edgeflow.__file__)\nprint(sys.argv[1:])\n", "a", "b"),
                shadowing_cwd)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [REAL, "['a', 'b']"]


def test_module_command_runs_the_module_as_main_with_its_arguments(shadowing_cwd: Path) -> None:
    proc = _run(module_command("edgeflow", "--version"), shadowing_cwd)
    assert proc.returncode == 0, proc.stderr
    assert edgeflow.__version__ in proc.stdout


def test_the_device_health_check_passes_from_a_checkout_directory(shadowing_cwd: Path) -> None:
    model = mlp_bytes(2)
    golden = make_golden(model, PROFILE, np.random.default_rng(0).random((1, 64)).astype(np.float32))
    rep = check_model(model, get_profile(PROFILE), golden, runs=1)
    assert rep.ok and rep.stage == "done", rep.reason
