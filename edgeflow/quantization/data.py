"""Calibration / evaluation data: accepted forms, validation, batching.

Users hand in a few hundred samples of their own data as an array (single-
input models), a dict of arrays, or a .npz/.npy file. Everything that can be
wrong with it — empty, wrong rank or fixed dimension, integer or object
dtype for a float input, NaN/Inf, inputs of different lengths, names that
are not the model's inputs — is found here, before any calibration run, and
reported in one :class:`~edgeflow.errors.QuantizationError` that names the
input and says what to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Union

import numpy as np

from ..errors import QuantizationError
from ..runtime.model import TensorInfo

DataSource = Union[np.ndarray, Mapping[str, np.ndarray], str, os.PathLike, "CalibrationSet"]


@dataclass(frozen=True)
class CalibrationSet:
    """Validated samples: input name -> array with the samples on axis 0."""

    arrays: dict[str, np.ndarray]

    @property
    def n(self) -> int:
        return len(next(iter(self.arrays.values())))

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        for i in range(0, self.n, batch_size):
            yield {k: v[i:i + batch_size] for k, v in self.arrays.items()}

    def take(self, index: np.ndarray | slice) -> "CalibrationSet":
        return CalibrationSet({k: v[index] for k, v in self.arrays.items()})

    def first(self) -> np.ndarray:
        return next(iter(self.arrays.values()))


def _read_file(path: Path) -> dict[str, np.ndarray] | np.ndarray:
    from ..data import read_arrays

    return read_arrays(path, what="calibration", error=QuantizationError)


def load_arrays(source: DataSource) -> dict[str, np.ndarray] | np.ndarray:
    """Read a path, or pass arrays through (no validation yet)."""
    if isinstance(source, CalibrationSet):
        return dict(source.arrays)
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source))
    if isinstance(source, Mapping):
        return {str(k): np.asarray(v) for k, v in source.items()}
    return np.asarray(source)


def _check_one(name: str, a: np.ndarray, info: TensorInfo, what: str) -> tuple[np.ndarray, list[str]]:
    problems: list[str] = []
    want = np.dtype(info.dtype or "float32")
    if a.dtype.kind not in "biuf":
        return a, [f"{what} for input {name!r} has dtype {a.dtype}; the model expects {want} numbers"]
    if want.kind == "f":
        if a.dtype.kind != "f":
            problems.append(
                f"{what} for input {name!r} has dtype {a.dtype}, the model expects {want}: "
                f"convert it as the model was trained (e.g. x.astype(np.float32) / 255 for images)"
            )
            return a, problems
        a = a.astype(want, copy=False)
    elif a.dtype != want and not np.can_cast(a.dtype, want, casting="same_kind"):
        return a, [f"{what} for input {name!r} has dtype {a.dtype}, the model expects {want}"]
    if info.shape and a.ndim != len(info.shape):
        hint = " (add the batch axis: x[None])" if a.ndim == len(info.shape) - 1 else ""
        return a, [
            f"{what} for input {name!r} has shape {a.shape} (rank {a.ndim}); the model expects "
            f"rank {len(info.shape)} {list(info.shape)} with samples on axis 0{hint}"
        ]
    for i, (d, s) in enumerate(zip(info.shape, a.shape)):
        if i > 0 and isinstance(d, int) and d > 0 and d != s:
            problems.append(
                f"{what} for input {name!r} has shape {a.shape}; the model expects {list(info.shape)} "
                f"(dimension {i} must be {d}, got {s})"
            )
            break
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a)
        if bad.any():
            samples = np.flatnonzero(bad.reshape(len(a), -1).any(axis=1)) if a.ndim else np.array([0])
            problems.append(
                f"{what} for input {name!r} contains {int(bad.sum())} NaN/Inf value(s) in "
                f"{len(samples)} sample(s) (first: sample {int(samples[0])}); remove or fix those samples"
            )
    return a, problems


def folder_arrays(path: Path, inputs: list[TensorInfo], prep=None, *, what: str = "calibration data"):
    """A folder of images or .wav files as samples for a single-input model, and notes on what was read."""
    from ..errors import InputError
    from ..data.preprocess import folder_samples

    if len(inputs) != 1:
        names = [i.name for i in inputs]
        raise QuantizationError(
            f"{what}: a folder of files feeds one input, but the model has {len(inputs)} inputs {names}; "
            "give a .npz with one array per input"
        )
    try:
        arr, notes = folder_samples(path, list(inputs[0].shape or ()), prep)
    except InputError as exc:
        raise QuantizationError(f"{what}: {exc}") from exc
    return arr, notes


def as_calibration_set(source: DataSource, inputs: list[TensorInfo], *, what: str = "calibration data",
                       prep=None, notes: list[str] | None = None) -> CalibrationSet:
    """Validate ``source`` against the model's inputs; one error lists every problem.

    ``source`` may also be a folder of images or .wav files (single-input
    models), read with the :mod:`edgeflow.data.preprocess` recipe ``prep``; what
    was read is appended to ``notes``.
    """
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        raw, more = folder_arrays(Path(source), inputs, prep, what=what)
        if notes is not None:
            notes.extend(more)
    else:
        raw = load_arrays(source)
    names = [i.name for i in inputs]
    if isinstance(raw, np.ndarray):
        if len(inputs) != 1:
            raise QuantizationError(
                f"the model has {len(inputs)} inputs {names}; give {what} as a dict / .npz with one array per input"
            )
        raw = {names[0]: raw}
    if len(names) == 1 and names[0] not in raw and "x" in raw and set(raw) <= {"x", "y"}:
        # the x/y files of `edgeflow train`, `device --train-data` and the gateway's eval: x holds the samples
        raw = {names[0]: raw["x"]}
    missing = [n for n in names if n not in raw]
    extra = [k for k in raw if k not in names]
    if missing:
        each = (", ".join(f"{n}=..." for n in names) if all(n.isidentifier() for n in names)
                else "**{" + ", ".join(f"{n!r}: ..." for n in names) + "}")
        raise QuantizationError(
            f"{what} has no array for input(s) {missing}; it has {sorted(raw)} "
            f"(the model's inputs are {names}): save the samples under the input names, "
            f"e.g. np.savez(PATH, {each})"
        )
    problems = []
    if extra:
        problems.append(f"{what} has arrays {extra} that are not model inputs ({names})")
    arrays: dict[str, np.ndarray] = {}
    for info in inputs:
        a = np.asarray(raw[info.name])
        if a.ndim == 0 or len(a) == 0:
            problems.append(
                f"{what} for input {info.name!r} is empty (shape {a.shape}); give at least one sample "
                "(a few hundred representative samples calibrate well)"
            )
            continue
        a, p = _check_one(info.name, a, info, what)
        problems += p
        arrays[info.name] = a
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        problems.append(f"{what} inputs have different sample counts: {lengths}")
    if problems:
        raise QuantizationError("; ".join(problems))
    return CalibrationSet(arrays)


def fixed_batch(inputs: list[TensorInfo]) -> int | None:
    """The model's batch size when its first input dimension is fixed."""
    for t in inputs:
        if t.shape and isinstance(t.shape[0], int) and t.shape[0] > 0:
            return int(t.shape[0])
    return None


def full_batches(data: CalibrationSet, batch: int) -> tuple[CalibrationSet, str | None]:
    """Samples in whole batches of a fixed-batch model, and a note saying what changed.

    A model whose batch dimension is fixed (say 4) accepts only batches of
    exactly that size: the remainder of the samples is dropped, or, with
    fewer samples than one batch, samples are repeated to fill it.
    """
    n = data.n
    if n % batch == 0:
        return data, None
    if n < batch:
        idx = np.arange(batch) % n
        return data.take(idx), f"the model's batch is fixed at {batch}: {n} samples repeated to fill one batch"
    keep = n - n % batch
    return data.take(slice(0, keep)), (f"the model's batch is fixed at {batch}: calibrated on {keep} of {n} "
                                       f"samples (whole batches)")
