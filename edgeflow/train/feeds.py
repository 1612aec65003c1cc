"""What a training step feeds a model with several inputs (a transformer's
``input_ids`` / ``attention_mask`` / ``token_type_ids``).

``x`` is either one array (fed to the trainer's ``input``) or a dict of
per-sample arrays keyed by input name; ``feeds=`` gives fixed arrays fed
unchanged to every step (e.g. a mask that is the same for every sample,
broadcast by the model). An input with no data is a
:class:`~edgeflow.errors.TrainingError` naming it, before any kernel runs.

On the command line a ``.npz`` holds one array per input name plus the labels
(``np.savez("d.npz", input_ids=..., attention_mask=..., y=...)``); with
``--input NAME`` its ``x`` array feeds NAME and the other arrays named after
inputs feed theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..data.loaders import NPZ_KEYS, check_inputs, read_arrays
from ..errors import InputError, ShapeError, TrainingError
from ..runtime.model import TensorInfo


def model_dtype(t: TensorInfo, compute: np.dtype) -> np.dtype:
    """The dtype an input is fed in: the compute dtype for float inputs, the model's otherwise."""
    try:
        dt = np.dtype(t.dtype)
    except TypeError:
        return compute
    return compute if dt.kind == "f" else dt


def convert(name: str, arr: Any, t: TensorInfo, compute: np.dtype) -> np.ndarray:
    """Check ``arr`` against input ``t`` (rank, static dims, a numeric dtype) and cast it to its feed dtype."""
    a = np.asarray(arr)
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        raise InputError(f"input {name!r} must be numeric, got dtype {a.dtype}")
    check_inputs(a, t.shape, name)
    want = model_dtype(t, compute)
    if want.kind in "iub" and a.dtype.kind == "f":
        if a.size and not np.array_equal(a, np.round(a)):
            raise InputError(f"input {name!r} is {t.dtype} in the model, the data holds fractions; "
                             "save it as whole numbers")
    if want.kind == "f" and a.size and not np.isfinite(a).all():
        raise InputError(f"input {name!r} contains NaN or infinity; clean or drop those samples")
    return a if a.dtype == want else a.astype(want)


def labels(y: Any, compute: np.dtype) -> np.ndarray:
    """Class indices as int64, float targets in the compute dtype (finite)."""
    y = np.asarray(y)
    if y.ndim < 1:
        raise ShapeError(f"labels need a leading sample dimension; got shape {y.shape}")
    if np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        return y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating):
        if y.size and not np.isfinite(y).all():
            raise InputError("y contains NaN or infinity; clean or drop those samples")
        return np.ascontiguousarray(y, dtype=compute)
    raise InputError(f"y must be integer class labels or float targets, got dtype {y.dtype}")


def missing_message(missing: Sequence[str], inputs: Sequence[str]) -> str:
    example = ", ".join(f"{n}=..." for n in inputs)
    return (f"the model's input(s) {list(missing)} have no data: give x as a dict keyed by input name "
            f"({list(inputs)}) or fixed arrays with feeds=; on the command line, a .npz with one array per "
            f"input name plus y (np.savez(path, {example}, y=...))")


def split_arrays(arrays: Mapping[str, np.ndarray], inputs: Sequence[TensorInfo], *, input_name: str | None,
                 x_key: str | None, y_key: str | None, source: str) -> tuple["np.ndarray | dict", np.ndarray]:
    """The (x, y) of a .npz's arrays: x one array (a single-input model) or a dict by input name."""
    names = list(arrays)
    in_names = [t.name for t in inputs]
    if y_key is None:
        y_key = next((b for a, b in NPZ_KEYS if b in names), None)
        if y_key is None:
            raise InputError(f"{source}: no labels among arrays {names}; name them y (np.savez(path, ..., y=...)) "
                             "or pass --y-key")
    elif y_key not in names:
        raise InputError(f"{source}: no array named {y_key!r}; it has {names}")
    by_name = {k: v for k, v in arrays.items() if k in in_names and k != y_key}
    if x_key is None:
        x_key = next((a for a, b in NPZ_KEYS if a in names and b == y_key and a not in in_names), None)
        if x_key is None and not by_name:
            x_key = next((a for a, _ in NPZ_KEYS if a in names and a not in in_names), None)
    elif x_key not in names:
        raise InputError(f"{source}: no array named {x_key!r}; it has {names}")
    x: dict[str, np.ndarray] = dict(by_name)
    if x_key is not None:
        target = input_name or (in_names[0] if len(in_names) == 1 else None)
        if target is None:
            missing = [n for n in in_names if n not in by_name]
            if len(missing) == 1:
                target = missing[0]
            else:
                raise InputError(f"{source}: the model has {len(in_names)} inputs {in_names}; say which one "
                                 f"{x_key!r} feeds with --input NAME, or save one array per input name")
        if target in x and x_key != target:
            raise InputError(f"{source}: both {x_key!r} and {target!r} would feed input {target!r}; keep one")
        x[target] = arrays[x_key]
    if not x:
        raise InputError(f"{source}: cannot tell inputs from labels among arrays {names}; name the inputs x "
                         f"(or after the model's inputs {in_names}) and the labels y, or pass --x-key/--y-key")
    y = arrays[y_key]
    if len(in_names) == 1 and len(x) == 1:
        return next(iter(x.values())), y
    return x, y


def read_split(path: "str | Path", inputs: Sequence[TensorInfo], *, input_name: str | None = None,
               x_key: str | None = None, y_key: str | None = None) -> tuple["np.ndarray | dict", np.ndarray]:
    """:func:`split_arrays` of a .npz file (read without pickle)."""
    arrays = read_arrays(path)
    if isinstance(arrays, np.ndarray):
        raise InputError(f"{path}: a single .npy array has no labels; save x and y with np.savez(path, x=..., y=...)")
    return split_arrays(arrays, inputs, input_name=input_name, x_key=x_key, y_key=y_key, source=str(path))


def batch_len(x: Mapping[str, np.ndarray]) -> int:
    """The shared number of samples of a dict of per-sample arrays."""
    lens = {k: len(np.asarray(v)) if np.ndim(v) else None for k, v in x.items()}
    if any(v is None for v in lens.values()):
        raise ShapeError(f"every array of x needs a leading sample dimension; got shapes "
                         f"{ {k: np.shape(v) for k, v in x.items()} }")
    if len(set(lens.values())) > 1:
        raise ShapeError(f"the arrays of x have different numbers of samples {lens}; they must match")
    return next(iter(lens.values())) if lens else 0


def check_known(x: Mapping[str, Any], inputs: Sequence[str], what: str = "x") -> None:
    unknown = [k for k in x if k not in inputs]
    if unknown:
        raise TrainingError(f"{what} names {unknown}, which are not inputs of the model; its inputs: {list(inputs)}")
