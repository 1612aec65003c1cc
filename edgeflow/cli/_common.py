"""Helpers shared by the subcommands: console, JSON output, input files."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def console(stderr: bool = False, *, min_width: int = 0):
    """A rich console whose width applies to tables and progress bars only.

    Lines of text are never broken at the console width (a script that greps
    one round's line must find all of it; a terminal wraps long lines
    itself). ``min_width`` widens the console for tables when output is not
    a terminal (pipes and CI logs would otherwise squeeze them to 80 columns).
    """
    from rich.console import Console
    from rich.text import Text

    class _Console(Console):
        def print(self, *objects, soft_wrap=None, **kwargs) -> None:  # type: ignore[override]
            if soft_wrap is None and objects and all(isinstance(o, (str, Text)) for o in objects):
                soft_wrap = True
            super().print(*objects, soft_wrap=soft_wrap, **kwargs)

        def on_broken_pipe(self) -> None:
            # rich exits 1 here; edgeflow's main turns a BrokenPipeError into 141 (128 + SIGPIPE), as for JSON
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")

    c = _Console(stderr=stderr, highlight=False)
    if min_width and not c.is_terminal and c.width < min_width:
        c = _Console(stderr=stderr, highlight=False, width=min_width)
    return c


def spinner(*columns, disable: bool = False, **kwargs):
    """A transient rich Progress on stderr, shown only on a terminal.

    Piped or logged, a transient display shows nothing but leaves a blank line
    on stderr when it stops (rich prints one for non-interactive consoles), in
    front of any error line; so it is not started there at all.
    """
    from rich.progress import Progress

    c = console(stderr=True)
    return Progress(*columns, console=c, transient=True, disable=disable or not c.is_terminal, **kwargs)


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


def fit_table(title: str, columns: list[tuple[str, int, str]], rows: list[list[str]], width: int):
    """A rich Table that fits ``width`` columns without wrapping or truncating any cell.

    ``columns`` are ``(header, priority, justify)``; priority 0 columns are
    always kept, higher numbers are dropped first (highest first) until the
    table fits. A note under the table names what was left out, and that a
    wider terminal or --json shows everything.
    """
    from rich import box
    from rich.table import Table

    def need(idx: list[int]) -> int:
        cells = [max([len(columns[i][0])] + [len(r[i]) for r in rows]) for i in idx]
        return sum(cells) + 3 * len(idx) + 1  # box.SIMPLE_HEAD: one space each side + a separator

    keep = list(range(len(columns)))
    dropped: list[str] = []
    for _, i in sorted(((c[1], i) for i, c in enumerate(columns) if c[1] > 0), reverse=True):
        if need(keep) <= width:
            break
        keep.remove(i)
        dropped.append(columns[i][0])
    t = Table(title=title, box=box.SIMPLE_HEAD, caption=(f"not shown at {width} columns: {', '.join(dropped)} "
              "(widen the terminal or use --json)") if dropped else None)
    for i in keep:
        t.add_column(columns[i][0], justify=columns[i][2], no_wrap=True)
    for r in rows:
        t.add_row(*[r[i] for i in keep])
    return t


def check_output_path(path: str, flag: str = "--output") -> None:
    """Refuse an output path that cannot be written, before any long work starts."""
    import os

    from ..errors import ConfigError

    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; give a file name")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: folder {parent} is not writable")


def count_arg(text: str) -> int:
    """An argparse ``type`` for counts (threads, runs): a whole number, 1 or more."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a whole number, 1 or more, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"give 1 or more, got {n}")
    return n


SHAPE_HELP = ("fix an input's dims, e.g. --shape x=1x3x320x320 (repeatable; '?' keeps a dim as the model "
              "has it; NAME may also be a symbolic dim such as batch=4)")


def parse_key_values(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``["lr=0.1", "mode=off"]`` (a flag given as KEY=VALUE, repeated) -> ``{"lr": 0.1, "mode": "off"}``: each value
    read as JSON (numbers, true/false, lists), else kept as text. A missing ``=`` or key is one ConfigError line."""
    from ..errors import ConfigError

    out: dict[str, Any] = {}
    for item in items or ():
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ConfigError(f"{flag}: {item!r} is not KEY=VALUE")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


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


def model_and_shapes(path: str, specs: list[str], arrays=None, *, infer_shapes: bool = True):
    """The model at ``path``, checked, and the input dims that ``--shape`` and the shapes of
    ``arrays`` (the ``--input`` of ``run``: a dict or, for a single-input model, one array) fix,
    checked against it (``{name: dims}``, for ``Runtime(input_shapes=...)``). The model is left as
    it is: onnxruntime loads it so; the runtime fixes the dims for the numpy backend and the plan
    (``infer_shapes=False`` leaves shape inference to it too)."""
    from ..errors import InputError, ShapeError
    from ..runtime.model import graph_inputs, load_model, resolve_input_shapes, with_input_dims

    model = load_model(path, infer_shapes=infer_shapes)
    shapes = parse_shapes(specs)
    inputs = graph_inputs(model)
    fixed = resolve_input_shapes(inputs, shapes, source="--shape") if shapes else {}
    if arrays is not None:
        inputs = with_input_dims(inputs, fixed)
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
            fixed.update(resolve_input_shapes(inputs, given, source="the --input array"))
    return model, fixed


def model_with_shapes(path: str, specs: list[str], arrays=None):
    """The model at ``path``, checked, with ``--shape`` and the shapes of ``arrays`` fixed
    (:func:`model_and_shapes`) and every value's shape re-inferred."""
    from ..runtime.model import fix_input_shapes

    model, fixed = model_and_shapes(path, specs, arrays)
    if fixed:
        model = fix_input_shapes(model, fixed, source="--shape" if arrays is None else "--shape and --input")
    return model


def require_static_shapes(model, batch: int | None = None, *, batch_dim: bool = True) -> None:
    """One line naming --shape when an input still has a dynamic dim besides the batch
    (``model``: a model, or its inputs as TensorInfo)."""
    from ..errors import ShapeError
    from ..runtime.memory import shape_example
    from ..runtime.model import graph_inputs

    for t in (graph_inputs(model) if hasattr(model, "graph") else model):
        dyn = [i for i, d in enumerate(t.shape) if not (isinstance(d, int) and d >= 0) and (i > 0 or not batch_dim)]
        if dyn:
            names = ", ".join(f"{i} ({t.shape[i]!r})" if t.shape[i] else str(i) for i in dyn)
            raise ShapeError(f"input {t.name!r} has dynamic dim(s) {names}; give its shape with "
                             f"--shape {t.name}={shape_example(t, batch or 1)}")
