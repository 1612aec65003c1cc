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


SHAPE_HELP = ("fix an input's dims, e.g. --shape x=1x3x320x320 (repeatable; '?' keeps a dim as the model "
              "has it; NAME may also be a symbolic dim such as batch=4)")


def add_shape_arg(p) -> None:
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS", help=SHAPE_HELP)


def parse_shapes(specs: list[str]) -> dict[str, list[int | None]]:
    """``["x=1x3x320x320", "batch=4"]`` -> ``{"x": [1, 3, 320, 320], "batch": [4]}``."""
    from ..errors import InputError

    out: dict[str, list[int | None]] = {}
    for spec in specs or []:
        name, sep, dims = spec.rpartition("=")
        tokens = dims.replace(",", "x").split("x") if dims else []
        bad = [t for t in tokens if t != "?" and not t.isdigit()]
        if not sep or not name or not tokens or bad:
            raise InputError(f"--shape {spec!r}: write NAME=DIMS with whole numbers (or ?) joined by x, "
                             "e.g. --shape x=1x3x320x320")
        if name in out:
            raise InputError(f"--shape names {name!r} twice ({'x'.join(map(str, out[name]))} and {dims})")
        out[name] = [None if t == "?" else int(t) for t in tokens]
    return out


def model_with_shapes(path: str, specs: list[str], arrays=None):
    """The model at ``path``, checked, with ``--shape`` and the shapes of ``arrays``
    (the ``--input`` of ``run``: a dict or, for a single-input model, one array) fixed."""
    from ..errors import InputError, ShapeError
    from ..model import fix_input_shapes, graph_inputs, load_model

    model = load_model(path)
    shapes = parse_shapes(specs)
    if shapes:
        model = fix_input_shapes(model, shapes, source="--shape")
    if arrays is not None:
        inputs = graph_inputs(model)
        if isinstance(arrays, np.ndarray):
            if len(inputs) != 1:
                raise InputError(f"the model has {len(inputs)} inputs {[t.name for t in inputs]}; "
                                 "give a .npz with one array per input name")
            arrays = {inputs[0].name: arrays}
        known = {t.name for t in inputs}
        given = {k: list(np.shape(v)) for k, v in arrays.items() if k in known}
        for k, dims in given.items():
            want = shapes.get(k)
            if want is not None and (len(want) != len(dims) or any(w is not None and w != d for w, d in zip(want, dims))):
                raise ShapeError(f"--shape {k}={'x'.join('?' if w is None else str(w) for w in want)} "
                                 f"disagrees with the --input array {k!r} of shape {'x'.join(map(str, dims))}")
        if given:
            model = fix_input_shapes(model, given, source="the --input array")
    return model


def require_static_shapes(model, batch: int | None = None, *, batch_dim: bool = True) -> None:
    """One line naming --shape when an input still has a dynamic dim besides the batch."""
    from ..errors import ShapeError
    from ..memory import shape_example
    from ..model import graph_inputs

    for t in graph_inputs(model):
        dyn = [i for i, d in enumerate(t.shape) if not (isinstance(d, int) and d >= 0) and (i > 0 or not batch_dim)]
        if dyn:
            names = ", ".join(f"{i} ({t.shape[i]!r})" if t.shape[i] else str(i) for i in dyn)
            raise ShapeError(f"input {t.name!r} has dynamic dim(s) {names}; give its shape with "
                             f"--shape {t.name}={shape_example(t, batch or 1)}")
