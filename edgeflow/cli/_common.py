"""Helpers shared by the subcommands: console, JSON output, input files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np



def console(stderr: bool = False, *, min_width: int = 0):
    """A rich console; ``min_width`` widens it when output is not a terminal
    (pipes and CI logs would otherwise wrap tables at 80 columns)."""
    from rich.console import Console

    c = Console(stderr=stderr, highlight=False)
    if min_width and not c.is_terminal and c.width < min_width:
        c = Console(stderr=stderr, highlight=False, width=min_width)
    return c


def emit_json(obj: Any) -> None:
    """Machine output: one JSON document on stdout."""
    json.dump(obj, sys.stdout, indent=2, default=_jsonable)
    sys.stdout.write("\n")


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def load_arrays(path: str) -> dict[str, np.ndarray] | np.ndarray:
    """A .npy file (one array) or .npz file (named arrays); never pickles."""
    from ..data import read_arrays

    return read_arrays(path, what="input")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
