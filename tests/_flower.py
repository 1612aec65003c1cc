"""Flower, the peer, for the tests that check edgeflow's aggregation against it.

Flower 1.42 pins typer < 0.21, which breaks amqtt, so it lives in its own venv (.ci/run makes one): these
helpers call it there, in a subprocess, when this interpreter cannot import it. Inputs and outputs travel
pickled between two of our own processes (test data, never a device's)."""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RUNNER = Path(__file__).with_name("_flower_runner.py")
CANDIDATES = ("/work/venvs/flwr/bin/python", str(Path.home() / ".cache" / "edgeflow" / "flwr-venv" / "bin" / "python"))
MAKE_VENV = ("python -m venv --system-site-packages ~/.cache/edgeflow/flwr-venv && "
             "~/.cache/edgeflow/flwr-venv/bin/pip install 'flwr[simulation]==1.42.0' (or set FLOWER_PYTHON)")


def _imports_flower(python: str) -> bool:
    if not Path(python).exists():
        return False
    return subprocess.run([python, "-c", "import flwr, ray"], capture_output=True, timeout=120).returncode == 0


@functools.lru_cache(maxsize=1)
def flower_python() -> str | None:
    """The interpreter that runs Flower: ``FLOWER_PYTHON`` if set, else this one or the first venv of
    :data:`CANDIDATES` that imports flwr and ray; None when there is none."""
    if "FLOWER_PYTHON" in os.environ:
        return os.environ["FLOWER_PYTHON"] if _imports_flower(os.environ["FLOWER_PYTHON"]) else None
    return next((p for p in (sys.executable, *CANDIDATES) if _imports_flower(p)), None)


def run_flower(job: str, **args: Any) -> Any:
    """Run one job of tests/_flower_runner.py under Flower's interpreter and return its result; skip the test,
    saying how to make the venv, when there is none."""
    python = flower_python()
    if python is None:
        pytest.skip(f"no Flower interpreter (flwr 1.42 + ray): make it with: {MAKE_VENV}")
    proc = subprocess.run([python, str(RUNNER)], input=pickle.dumps({"job": job, **args}), capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    return pickle.loads(proc.stdout)
