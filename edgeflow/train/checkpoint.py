"""Resumable training: optimizer state, step and trained weights saved beside the model.

    save_state(trainer, "trained.train")     # trained.train.npz + trained.train.json
    load_state(trainer, "trained.train")     # continue where it stopped

Two files, no pickle: ``.npz`` holds arrays only (the trainable weights as
``param/NAME``, the optimizer's per-weight slots as ``opt/SLOT/NAME`` and the
non-trainable tensors that training updates -- BatchNorm running mean and
variance when the mode trains BatchNorm (full) -- as ``state/NAME``; read back
with ``allow_pickle=False``), ``.json`` the step counters, the optimizer's
kind and settings, the mode, the data-shuffling RNG state and each saved
tensor's shape. Without the ``state/`` entries a resumed full-mode run would
restart the running statistics from the base model (the CLI reloads it).

A checkpoint restores onto a different base model (an OTA update of the
pretrained weights) when every saved tensor is still a weight of the new
model with the same shape: the saved trainable weights and optimizer state
replace the new model's, the frozen body comes from the new model (in the
transfer modes BatchNorm statistics are frozen, so they come from it too). Where a
name is gone or a shape differs, :class:`~edgeflow.errors.TrainingError`
lists them in one line and nothing is changed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import InputError, TrainingError

FORMAT = "edgeflow-train-state/1"


def state_path(model_path: "str | os.PathLike") -> Path:
    """Where the state of a run writing ``model_path`` lives: ``trained.onnx`` -> ``trained.train``."""
    p = Path(model_path)
    return p.with_suffix("").with_name(p.with_suffix("").name + ".train") if p.suffix else p.with_name(p.name + ".train")


def _files(path: "str | os.PathLike") -> tuple[Path, Path]:
    p = Path(path)
    base = p.with_suffix("") if p.suffix in (".npz", ".json") else p
    return base.with_name(base.name + ".npz"), base.with_name(base.name + ".json")


def _optimizer_settings(opt) -> dict:
    keep = {}
    for k in ("lr", "momentum", "weight_decay", "nesterov", "dampening", "betas", "eps", "decoupled"):
        if hasattr(opt, k):
            v = getattr(opt, k)
            keep[k] = list(v) if isinstance(v, tuple) else v
    return keep


def updated_buffers(trainer) -> list[str]:
    """Weights that are no trainable candidate but change as training runs (BatchNorm running stats)."""
    cands = set(trainer._candidates())
    return [n for n in trainer.weight_names if n not in cands and n not in trainer.params]


def save_state(trainer, path: "str | os.PathLike") -> tuple[Path, Path]:
    """Write ``PATH.npz`` and ``PATH.json``; returns both paths."""
    npz, meta = _files(path)
    arrays: dict[str, np.ndarray] = {}
    for name in trainer.trainable_names:
        arrays[f"param/{name}"] = np.asarray(trainer.params[name])
    for name in updated_buffers(trainer):
        arrays[f"state/{name}"] = np.asarray(trainer.tape.constants[name])
    for name, slots in trainer.optimizer.state.items():
        for slot, arr in slots.items():
            arrays[f"opt/{slot}/{name}"] = np.asarray(arr)
    info = {
        "format": FORMAT,
        "global_step": int(trainer.global_step),
        "optimizer": type(trainer.optimizer).__name__,
        "optimizer_steps": int(trainer.optimizer.steps),
        "optimizer_settings": _optimizer_settings(trainer.optimizer),
        "mode": str(trainer.mode),
        "trainable": list(trainer.trainable_names),
        "shapes": {k: list(v.shape) for k, v in arrays.items()},
        "rng": trainer._rng.bit_generator.state,
    }
    npz.parent.mkdir(parents=True, exist_ok=True)
    tmp = npz.with_name(npz.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, npz)
    meta.write_text(json.dumps(info, indent=1, sort_keys=True))
    return npz, meta


def load_state(trainer, path: "str | os.PathLike", *, weights: bool = True) -> dict:
    """Restore what :func:`save_state` wrote (all checked before anything changes); returns the JSON record.

    ``weights=False`` restores only the optimizer state and step (the model's own weights and
    BatchNorm statistics stay).
    """
    npz, meta = _files(path)
    info = _read_record(trainer, npz, meta)
    with np.load(npz, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    params, state, opt = _fitting_entries(trainer, arrays, npz.name)
    if weights:
        for name, arr in params.items():
            np.copyto(trainer.params[name], arr, casting="unsafe")
        for name, arr in state.items():
            trainer.tape.constants[name] = np.array(arr, dtype=trainer.dtype)
        trainer._pending_state = {}
    trainer.optimizer.state.clear()
    for name, slots in opt.items():
        trainer.optimizer.state[name] = {s: np.array(a, dtype=trainer.params[name].dtype) for s, a in slots.items()}
    trainer.optimizer.steps = int(info.get("optimizer_steps", 0))
    trainer.global_step = int(info.get("global_step", 0))
    if "rng" in info:
        try:
            trainer._rng.bit_generator.state = info["rng"]
        except (TypeError, ValueError, KeyError):
            pass  # another bit generator: shuffling restarts from the seed
    return info


def _read_record(trainer, npz: Path, meta: Path) -> dict:
    """The JSON record beside the arrays: present, parseable, this format, this run's optimizer."""
    if not npz.exists() or not meta.exists():
        raise InputError(f"no training state at {npz} / {meta}: run once without --resume (resume=False) first")
    try:
        info = json.loads(meta.read_text())
    except ValueError as e:
        raise InputError(f"{meta} is not a training-state file ({e}); delete it and start again") from None
    if info.get("format") != FORMAT:
        raise InputError(f"{meta} has format {info.get('format')!r}, expected {FORMAT!r}")
    kind = type(trainer.optimizer).__name__
    if info.get("optimizer") != kind:
        raise TrainingError(f"the saved state is of optimizer {info.get('optimizer')}, this run uses {kind}: "
                            "resume with the same --optimizer, or start again without --resume")
    return info


def _fitting_entries(trainer, arrays: dict[str, np.ndarray], where: str) -> tuple[
        dict[str, np.ndarray], dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """The saved arrays sorted into weights, training-updated statistics and optimizer slots, each
    checked against the model; one TrainingError naming every entry that does not fit."""
    current = {n: trainer._value(n) for n in trainer.weight_names}
    buffers = set(updated_buffers(trainer))
    params: dict[str, np.ndarray] = {}
    state: dict[str, np.ndarray] = {}
    opt: dict[str, dict[str, np.ndarray]] = {}
    problems: list[str] = []
    for key, arr in arrays.items():
        kind_, _, rest = key.partition("/")
        if kind_ == "param":
            name, slot = rest, None
        elif kind_ == "state":
            if rest in buffers and tuple(arr.shape) == tuple(current[rest].shape):
                state[rest] = arr
            elif rest in buffers:
                problems.append(f"{rest!r} was {tuple(arr.shape)}, the model has {tuple(current[rest].shape)}")
            elif rest in trainer.graph.initializers:
                problems.append(f"{rest!r} (a statistic that training updated) stays frozen in mode {trainer.mode}")
            else:
                problems.append(f"{rest!r} is not a weight of this model")
            continue
        elif kind_ == "opt":
            slot, _, name = rest.partition("/")
        else:
            problems.append(f"unknown entry {key!r}")
            continue
        if name not in current:
            problems.append(f"{name!r} is not a weight of this model")
        elif tuple(arr.shape) != tuple(current[name].shape):
            problems.append(f"{name!r} was {tuple(arr.shape)}, the model has {tuple(current[name].shape)}")
        elif name not in trainer.params:
            problems.append(f"{name!r} does not train in mode {trainer.mode}")
        elif slot is None:
            params[name] = arr
        else:
            opt.setdefault(name, {})[slot] = arr
    if problems:
        uniq = list(dict.fromkeys(problems))
        shown = "; ".join(uniq[:4]) + (f" (+{len(uniq) - 4} more)" if len(uniq) > 4 else "")
        raise TrainingError(
            f"the training state {where} does not fit this model ({len(problems)} problem(s): {shown}); "
            "the base model changed shape (a new architecture or head): start again without --resume "
            "(resume=False), or keep the old base model")
    return params, state, opt
