"""Flower, the peer, for the tests that check edgeflow's aggregation against it.

Flower 1.42 pins typer < 0.21, which breaks amqtt, so it lives in its own venv (.ci/run makes one): these
helpers call it there, in a subprocess, when this interpreter cannot import it. Inputs and outputs travel
pickled between two of our own processes (test data, never a device's)."""

from __future__ import annotations

import functools
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RUNNER = Path(__file__).with_name("_flower_runner.py")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _flower_env import MAKE_VENV  # noqa: E402
from _flower_env import flower_python as _find_flower  # noqa: E402


@functools.lru_cache(maxsize=1)
def flower_python() -> str | None:
    """The interpreter that runs Flower (flwr and ray), found as the benchmarks find it
    (benchmarks/_flower_env.py: FLOWER_PYTHON, this one, or a known venv); None when there is none."""
    return _find_flower(("flwr", "ray"))


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
