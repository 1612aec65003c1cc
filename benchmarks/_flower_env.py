"""Where Flower (the peer) lives: an interpreter that imports it, for the benchmarks that compare with it.

Flower 1.42 pins typer < 0.21, which breaks amqtt in edgeflow's own environment, so Flower gets a venv of
its own made with ``--system-site-packages`` (it then sees edgeflow too); ``.ci/run`` makes one at
``~/.cache/edgeflow/flwr-venv``:

    python -m venv --system-site-packages ~/.cache/edgeflow/flwr-venv
    ~/.cache/edgeflow/flwr-venv/bin/pip install 'flwr[simulation]==1.42.0'
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CANDIDATES = ("/work/venvs/flwr/bin/python", str(Path.home() / ".cache" / "edgeflow" / "flwr-venv" / "bin" / "python"))
MAKE_VENV = ("python -m venv --system-site-packages ~/.cache/edgeflow/flwr-venv && "
             "~/.cache/edgeflow/flwr-venv/bin/pip install 'flwr[simulation]==1.42.0' (or set FLOWER_PYTHON)")


def imports(python: str, modules: tuple[str, ...]) -> bool:
    """Whether ``python`` exists and imports every one of ``modules``."""
    if not Path(python).exists():
        return False
    probe = subprocess.run([python, "-c", "import " + ", ".join(modules)], capture_output=True, timeout=120)
    return probe.returncode == 0


def flower_python(modules: tuple[str, ...] = ("flwr",)) -> str | None:
    """``FLOWER_PYTHON`` if set (and it imports ``modules``), else this interpreter or the first of
    :data:`CANDIDATES` that imports them; None when there is none."""
    if "FLOWER_PYTHON" in os.environ:
        return os.environ["FLOWER_PYTHON"] if imports(os.environ["FLOWER_PYTHON"], modules) else None
    return next((p for p in (sys.executable, *CANDIDATES) if imports(p, modules)), None)
