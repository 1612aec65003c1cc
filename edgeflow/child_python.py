"""Start a fresh Python interpreter that imports this same edgeflow.

``python -c CODE`` and ``python -m MODULE`` put the current directory first on the child's ``sys.path``.
Run from a checkout of this project with a plain (non-editable) install -- what README's first command
does -- the child then imports the checkout's ``./edgeflow``, which has no ``edgeflow.kernels`` or
``edgeflow.gateway`` (the install maps ``kernels/`` and ``gateway/`` into the package), and fails where the
parent works: every device's health check failed and ``edgeflow demo`` stopped at its first deployment.

So the child drops that entry before it imports anything, and gets the parent's ``edgeflow`` first on its
path (``PYTHONPATH``), whatever ``sys.path`` the parent was started with. Used by the device health check's
child and the gateway's ingestion workers."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

_HOME = str(Path(__file__).resolve().parents[1])
"""The directory this ``edgeflow`` package is imported from (site-packages, or the checkout of an editable
install)."""

_DROP_CWD = "import sys\nif sys.path[:1] == ['']: del sys.path[0]\n"
"""The child's first lines: ``-c`` put the current directory first on the path as ``''``."""


def python_command(code: str, *args: str, python: str | None = None) -> list[str]:
    """argv that runs ``code`` (Python source) in a fresh interpreter whose path does not start with the current
    directory; ``args`` become ``sys.argv[1:]``. Start it with :func:`child_env`."""
    return [python or sys.executable, "-c", _DROP_CWD + code, *args]


def module_command(module: str, *args: str, python: str | None = None) -> list[str]:
    """argv that runs ``python -m module args...`` without the current directory on the path."""
    code = f"import runpy\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    return python_command(code, *args, python=python)


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with this ``edgeflow``'s directory first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_HOME, env.get("PYTHONPATH", "")) if p)
    return env
