"""The backend interface: ``load`` a model into a session that can ``run``
and describes its ``io``.

Backends are found by name (see :mod:`edgeflow.runtime.backends`), like tinygrad's
devices: the rest of edgeflow never branches on which board it is on, it
asks the profile for a backend name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx

from ...errors import InputError, ShapeError
from ..limits import RunLimits, run_budget
from ..model import TensorInfo

log = logging.getLogger("edgeflow.runtime")


@dataclass(frozen=True)
class SessionOptions:
    """Per-session settings a profile translates into backend knobs."""

    threads: int = 1
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    memory_arena: bool = True
    optimization: str = "all"  # "disabled" | "basic" | "extended" | "all"
    # onnxruntime on x86 without VNNI: exact u8 x u8 int8 instead of the fast, saturating u8 x s8
    # kernels (docs/quantization.md); no effect on VNNI CPUs, ARM or the numpy backend
    exact_int8: bool = False
    extra: dict = field(default_factory=dict)


class Session:
    """A loaded model. Subclasses implement ``_run``.

    ``limits`` bound each run (loop iterations, wall time: :mod:`edgeflow.runtime.limits`);
    the runtime sets them from the device profile, None runs unlimited."""

    backend_name = "base"

    def __init__(self, inputs: list[TensorInfo], outputs: list[TensorInfo]) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.limits: RunLimits | None = RunLimits()
        self.casts_noted: set[tuple[str, str]] = set()
        """(input, dtype) casts already logged: a lossy cast is said once per session, not per run."""

    def io(self) -> dict[str, list[TensorInfo]]:
        return {"inputs": list(self.inputs), "outputs": list(self.outputs)}

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run the model; returns the requested outputs (all by default) by name."""
        checked = check_feeds(self.inputs, feeds, noted=self.casts_noted)
        names = list(output_names) if output_names else [o.name for o in self.outputs]
        known = {o.name for o in self.outputs}
        bad = [n for n in names if n not in known]
        if bad:
            raise InputError(f"unknown output name(s) {bad}; the model's outputs are {sorted(known)}")
        with run_budget(self.limits):
            return self._run(checked, names)

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        raise NotImplementedError("need _run")


class Backend:
    """A way to execute ONNX models. Subclasses set ``name`` and implement the hooks."""

    name = "base"

    @classmethod
    def available(cls) -> bool:
        """Can this backend run on this host (its libraries importable)?"""
        raise NotImplementedError("need available")

    def unsupported_ops(self, model: onnx.ModelProto) -> list[str]:
        """Every op of ``model`` this backend cannot run (all at once)."""
        raise NotImplementedError("need unsupported_ops")

    def load(self, model: onnx.ModelProto, options: SessionOptions | None = None) -> Session:
        raise NotImplementedError("need load")


def check_feeds(inputs: list[TensorInfo], feeds: Mapping[str, np.ndarray], *,
                noted: set[tuple[str, str]] | None = None) -> dict[str, np.ndarray]:
    """Validate names, dtypes, ranks and fixed dims of the inputs; cast to the model's dtypes.

    Every problem is reported at once, naming the input and what was expected.
    A cast that loses precision (float64 to float32) is logged as one warning
    per input and dtype (once per ``noted`` set: a session says it once); an
    integer cast whose values do not fit (int64 2**40 into int32) is refused,
    never wrapped. NaN and Inf pass here (models such as IsNaN take them):
    :func:`check_finite` refuses them where the data is the user's (``edgeflow run``).
    """
    if not isinstance(feeds, Mapping):
        raise InputError("inputs must be a mapping of input name -> array")
    expected = {t.name: t for t in inputs}
    missing = [n for n in expected if n not in feeds]
    extra = [n for n in feeds if n not in expected]
    problems = []
    if missing:
        problems.append(f"missing input(s): {missing}")
    if extra:
        problems.append(f"unknown input(s): {extra} (the model takes {list(expected)})")
    out: dict[str, np.ndarray] = {}
    for name, t in expected.items():
        if name not in feeds:
            continue
        value = feeds[name]
        kind = t.kind
        if kind.startswith("optional-"):
            if value is None:  # the empty optional
                out[name] = None
                continue
            kind = kind[len("optional-"):]
        if kind == "sequence":
            if not isinstance(value, (list, tuple)):
                problems.append(f"input {name!r} is a sequence of tensors: pass a list of arrays, got "
                                f"{type(value).__name__}")
                continue
            items = [_tensor(f"{name}[{i}]", v, t.dtype, (), problems) for i, v in enumerate(value)]
            if all(a is not None for a in items):
                out[name] = items
            continue
        if value is None:
            problems.append(f"input {name!r} is a tensor: None is only an empty optional input")
            continue
        a = _tensor(name, value, t.dtype, t.shape, problems, noted)
        if a is not None:
            out[name] = a
    if problems:
        cls = ShapeError if not missing and not extra else InputError
        raise cls("; ".join(problems))
    return out


def _tensor(name: str, value, dtype: str, shape: tuple, problems: list[str],
            noted: set[tuple[str, str]] | None = None) -> np.ndarray | None:
    """One fed tensor, cast to ``dtype`` and checked against ``shape``; None (and a line in
    ``problems``) when it does not fit."""
    try:
        a = np.asarray(value)
    except ValueError as exc:  # a ragged nested list
        problems.append(f"input {name!r} is not an array ({' '.join(str(exc).split())[:120]})")
        return None
    want = np.dtype(dtype) if dtype else a.dtype
    if a.dtype != want:
        if np.can_cast(a.dtype, want, casting="same_kind") and not (
            np.issubdtype(a.dtype, np.floating) and np.issubdtype(want, np.integer)
        ):
            why = _narrowing(name, a, want)
            if why:
                problems.append(why)
                return None
            if not np.can_cast(a.dtype, want, casting="safe") and (noted is None or (name, str(a.dtype)) not in noted):
                if noted is not None:
                    noted.add((name, str(a.dtype)))
                log.warning("input %r is %s, the model takes %s: cast, precision beyond %s is lost (save the "
                            "array as %s to say so yourself)", name, a.dtype, want, want, want)
            a = a.astype(want)
        else:
            problems.append(f"input {name!r} has dtype {a.dtype}, expected {want}")
            return None
    if shape and len(shape) != a.ndim:
        problems.append(f"input {name!r} has shape {a.shape}, expected rank {len(shape)} {list(shape)}")
        return None
    for i, (d, s) in enumerate(zip(shape, a.shape)):
        if isinstance(d, int) and d > 0 and d != s:
            problems.append(f"input {name!r} has shape {a.shape}, expected {list(shape)} (dim {i})")
            return None
    return a


def _narrowing(name: str, a: np.ndarray, want: np.dtype) -> str | None:
    """Why ``a`` cannot be cast to the narrower ``want`` without changing values (None: it can):
    integers out of ``want``'s range would wrap, finite floats beyond it would become Inf."""
    if a.size == 0 or np.can_cast(a.dtype, want, casting="safe"):
        return None
    if np.issubdtype(want, np.integer):
        info = np.iinfo(want)
        lo, hi = a.min(), a.max()
        if lo < info.min or hi > info.max:
            return (f"input {name!r} is {a.dtype} with values {lo}..{hi} outside {want}'s range "
                    f"{info.min}..{info.max}: they would wrap; give values that fit, or an array of {want}")
    elif np.issubdtype(want, np.floating) and np.issubdtype(a.dtype, np.floating):
        finite = np.abs(a[np.isfinite(a)])
        limit = np.finfo(want).max
        if finite.size and finite.max() > limit:
            return (f"input {name!r} is {a.dtype} with values up to {finite.max():.3g}, beyond {want}'s "
                    f"largest {limit:.3g}: they would become Inf; scale the data")
    return None


def check_finite(feeds: Mapping[str, np.ndarray], *, fix: str = "") -> None:
    """Refuse float inputs that hold NaN or Inf, naming the input, the count and the first position
    (one :class:`ShapeError` line; ``fix`` is appended as the way out, e.g. a command-line flag)."""
    problems = []
    for name, value in feeds.items():
        a = np.asarray(value) if value is not None and not isinstance(value, (list, tuple)) else None
        if a is None or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating)):
            continue
        bad = ~np.isfinite(a)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            nan = int(np.isnan(a).sum())
            problems.append(f"input {name!r} holds {nan} NaN and {int(bad.sum()) - nan} Inf value(s) "
                            f"(first at index {list(first)})")
    if problems:
        raise ShapeError("; ".join(problems) + "; clean the data (e.g. numpy.nan_to_num)" + (f" {fix}" if fix else ""))
