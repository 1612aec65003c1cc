"""Model slots on the device's disk (active, rollback target, staging), with one atomically replaced pointer.

Layout of the state directory::

    current.json           {"active": "a", "previous": "b"}   the pointer
    slots/a/artifact.efota the signed artifact (manifest + signature + model)
    slots/a/model.onnx     the model extracted from it (what runtimes and trainers open)
    slots/b/...            the rollback target
    slots/c/...            staging: where the next deploy is written
    pending.json           journal of an operation in progress (deploy, rollback)
    agent.json             bdseq counter, the agent's persisted config, when the running model was installed
    seen.json              command ids already accepted (edgeflow.device.replay)
    train/<sha256>/        fp32 training masters of quantized models (artifact.efota + model.onnx),
                           named by the fp32 model's SHA-256 (the quantized artifact's source_sha256)

The power-cut argument. Every file is written as ``<name>.tmp``, fsynced,
renamed over the target with ``os.replace`` (atomic on POSIX) and the
directory is fsynced, so each file is either its old or its new content.
A deploy writes only into the *staging* slot (neither active nor the
rollback target) and does not touch the pointer until the staged artifact
is fully on disk and passed its health check; then one ``os.replace`` of
``current.json`` switches to it. So:

- cut before the pointer swap: ``current.json`` still names the old slot,
  which nothing in this deploy wrote to: the old model;
- cut after it: the pointer names a slot whose artifact was complete,
  fsynced and healthy before the swap: the new model.

With three slots, nothing a deploy writes is ever the rollback target: a
deploy that fails its health check (or is cut off) leaves both the running
model and the one before it, so ``rollback`` still works afterwards (with
two slots the staged write overwrote the rollback target, issue 20). After
a swap the slot that held the old rollback target is emptied: two models
on disk, three only while one is being staged. On every start
:meth:`SlotStore.boot` still verifies the active artifact (signature,
hashes) and falls back to the previous slot if it does not verify (bit
rot, a tampered disk), so the agent always lands on a verified model or on
none.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EdgeflowError, FleetError
from ..artifact import Artifact, verify_artifact
from ..signing import PublicKey

__all__ = ["ActiveModel", "Pointer", "SlotStore", "atomic_write"]

SLOTS = ("a", "b", "c")
ARTIFACT = "artifact.efota"
MODEL = "model.onnx"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644,
                 midway: Callable[[], None] | None = None) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old or the new content, never a mix.

    ``midway`` is called after half the bytes are written (and synced) to the
    temporary file: the crash-test hook for "power cut during the write".
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        half = len(data) // 2
        _write_all(fd, memoryview(data)[:half])
        if midway is not None:
            os.fsync(fd)
            midway()
        _write_all(fd, memoryview(data)[half:])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        return None  # unreadable: treat as absent (atomic writes make this a disk fault, not a cut)
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Pointer:
    active: str | None = None
    previous: str | None = None

    def inactive(self) -> str:
        """The staging slot: neither the active model nor the rollback target."""
        return next(s for s in SLOTS if s not in (self.active, self.previous))


@dataclass(frozen=True)
class ActiveModel:
    """The verified model the agent serves."""

    slot: str
    artifact: Artifact
    model_path: Path

    @property
    def version(self) -> int:
        return self.artifact.version

    @property
    def sha256(self) -> str:
        return self.artifact.manifest.sha256


class SlotStore:
    """The device's model slots, pointer, operation journal and small persisted state."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "slots").mkdir(exist_ok=True)

    # -- pointer ------------------------------------------------------------
    @property
    def pointer_path(self) -> Path:
        return self.root / "current.json"

    def pointer(self) -> Pointer:
        d = _read_json(self.pointer_path) or {}
        act, prev = d.get("active"), d.get("previous")
        return Pointer(act if act in SLOTS else None, prev if prev in SLOTS and prev != act else None)

    def _set_pointer(self, p: Pointer) -> None:
        _write_json(self.pointer_path, {"active": p.active, "previous": p.previous, "written": time.time()})

    def slot_dir(self, slot: str) -> Path:
        if slot not in SLOTS:
            raise FleetError(f"unknown model slot {slot!r}; slots are {SLOTS}")
        return self.root / "slots" / slot

    def read_artifact(self, slot: str) -> bytes | None:
        try:
            return (self.slot_dir(slot) / ARTIFACT).read_bytes()
        except OSError:
            return None

    # -- writes -------------------------------------------------------------
    def stage(self, artifact: bytes, model: bytes, *, hook: Callable[[str], None] | None = None) -> str:
        """Write ``artifact`` (and its extracted ``model``) into the inactive slot; return the slot.

        ``hook(step)`` is called at "staging" (half of the artifact written)
        and "staged" (everything on disk): the crash-test points.
        """
        p = self.pointer()
        target = p.inactive()
        if p.previous == target:
            self._set_pointer(Pointer(p.active, None))  # never point at a slot being overwritten
        d = self.slot_dir(target)
        d.mkdir(parents=True, exist_ok=True)
        for name in (ARTIFACT, MODEL):
            try:
                (d / name).unlink()
            except FileNotFoundError:
                pass
        _fsync_dir(d)
        atomic_write(d / ARTIFACT, artifact, midway=(lambda: hook("staging")) if hook else None)
        atomic_write(d / MODEL, model)
        if hook:
            hook("staged")
        return target

    def activate(self, slot: str) -> Pointer:
        """Make ``slot`` active, the current active one the rollback target (one atomic write); then empty the
        slot that held the old rollback target."""
        p = self.pointer()
        new = Pointer(slot, p.active if p.active != slot else p.previous)
        self._set_pointer(new)
        for old in SLOTS:
            if old not in (new.active, new.previous):
                self._empty(old)
        return new

    def _empty(self, slot: str) -> None:
        d = self.slot_dir(slot)
        for name in (ARTIFACT, MODEL):
            try:
                (d / name).unlink()
            except FileNotFoundError:
                pass
            except OSError:  # best effort: a full or read-only disk keeps the old files, nothing points at them
                return

    def rollback(self) -> Pointer:
        """Swap active and previous; FleetError when there is no previous model."""
        p = self.pointer()
        if p.previous is None:
            raise FleetError("no previous model to roll back to (this device has only ever run one model)")
        new = Pointer(p.previous, p.active)
        self._set_pointer(new)
        return new

    # -- verification -------------------------------------------------------
    def verify_slot(self, slot: str, fleet_key: PublicKey, profile: str | None = None) -> ActiveModel:
        """The slot's artifact, verified; its ``model.onnx`` re-extracted if missing or altered."""
        data = self.read_artifact(slot)
        if data is None:
            raise FleetError(f"model slot {slot} is empty")
        art = verify_artifact(data, fleet_key, profile=profile)
        path = self.slot_dir(slot) / MODEL
        try:
            ok = path.read_bytes() == art.model
        except OSError:
            ok = False
        if not ok:
            atomic_write(path, art.model)
        return ActiveModel(slot, art, path)

    def boot(self, fleet_key: PublicKey, profile: str | None = None,
             *, usable: Callable[[ActiveModel], None] | None = None) -> tuple[ActiveModel | None, list[str]]:
        """The model to start on, and notes on what was wrong on the way.

        Tries the active slot, then the previous one; ``usable(model)`` may
        raise to reject a verified model (e.g. it no longer loads). If the
        active slot is rejected and the previous one is good, the pointer is
        switched back to it, so the next start does not try again.
        """
        notes: list[str] = []
        p = self.pointer()
        for slot in (p.active, p.previous):
            if slot is None:
                continue
            try:
                m = self.verify_slot(slot, fleet_key, profile)
                if usable is not None:
                    usable(m)
            except EdgeflowError as exc:
                notes.append(f"slot {slot}: {exc}")
                continue
            if slot != p.active:
                self._set_pointer(Pointer(slot, None))
                notes.append(f"fell back to slot {slot} (v{m.version})")
            return m, notes
        return None, notes

    # -- fp32 training masters ---------------------------------------------
    def master_dir(self, sha256: str) -> Path:
        if not (isinstance(sha256, str) and len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256)):
            raise FleetError(f"not a model SHA-256: {str(sha256)[:80]!r}")
        return self.root / "train" / sha256

    def store_master(self, artifact: bytes, art: Artifact) -> Path:
        """Keep a verified fp32 master artifact (what a quantized model trains on); returns its model path."""
        d = self.master_dir(art.manifest.sha256)
        atomic_write(d / ARTIFACT, artifact)
        atomic_write(d / MODEL, art.model)
        return d / MODEL

    def master_model(self, sha256: str, fleet_key: PublicKey, profile: str | None = None) -> Path | None:
        """The fp32 master whose model has ``sha256``, verified again, or None if there is none (or it does
        not verify: then it is removed)."""
        try:
            d = self.master_dir(sha256)
            data = (d / ARTIFACT).read_bytes()
        except (FleetError, OSError):
            return None
        try:
            art = verify_artifact(data, fleet_key, profile=profile)
            if art.manifest.sha256 != sha256:
                raise FleetError("master artifact holds another model")
        except EdgeflowError:
            self._drop_master(d)
            return None
        path = d / MODEL
        try:
            ok = path.read_bytes() == art.model
        except OSError:
            ok = False
        if not ok:
            atomic_write(path, art.model)
        return path

    def masters(self) -> list[str]:
        try:
            return sorted(p.name for p in (self.root / "train").iterdir() if p.is_dir())
        except OSError:
            return []

    def prune_masters(self, keep: set[str]) -> None:
        """Remove the masters no slot's model needs any more (best effort)."""
        for sha in self.masters():
            if sha not in keep:
                self._drop_master(self.root / "train" / sha)

    @staticmethod
    def _drop_master(d: Path) -> None:
        for name in (ARTIFACT, MODEL, ARTIFACT + ".tmp", MODEL + ".tmp"):
            try:
                (d / name).unlink()
            except OSError:
                pass
        try:
            d.rmdir()
        except OSError:
            pass

    # -- journal and small state -------------------------------------------
    @property
    def pending_path(self) -> Path:
        return self.root / "pending.json"

    def pending(self) -> dict[str, Any] | None:
        return _read_json(self.pending_path)

    def set_pending(self, entry: dict[str, Any]) -> None:
        _write_json(self.pending_path, entry)

    def clear_pending(self, expect_id: str | None = None) -> None:
        """Remove the journal (only if it is still ``expect_id``'s, when given)."""
        if expect_id is not None and (self.pending() or {}).get("id") != expect_id:
            return
        try:
            self.pending_path.unlink()
        except FileNotFoundError:
            return
        _fsync_dir(self.root)

    def state(self) -> dict[str, Any]:
        return _read_json(self.root / "agent.json") or {}

    def save_state(self, **changes: Any) -> dict[str, Any]:
        st = self.state()
        st.update(changes)
        _write_json(self.root / "agent.json", st)
        return st

    def next_bdseq(self) -> int:
        """A birth/death sequence number larger than every earlier one (ms clock, forced upwards)."""
        last = int(self.state().get("bdseq", -1))
        value = max(last + 1, int(time.time() * 1000))
        self.save_state(bdseq=value)
        return value
