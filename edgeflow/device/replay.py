"""Replay protection that survives agent restarts: the ids of the commands (and OTA offers) a device
has seen, kept on disk until they expire.

A command is signed, addressed to one device and carries ``issued`` and
``expires`` (the gateway's clock). Within its lifetime a captured copy is a
valid message; what makes a second copy harmless is that the device
remembers its id. Kept only in memory, that memory ends with the process:
after an agent restart a captured OTA offer or rollback could run again
(issue 20: a device went from v4 back to v3 that way). So:

- every accepted command id is written to ``seen.json`` (atomic write, see
  :func:`edgeflow.device.slots.atomic_write`) *before* the command runs, with
  its expiry and, once sent, the signed ack to repeat for a redelivery;
- ids leave the file once ``expires + clock_skew`` has passed: a copy
  arriving after that is refused as expired anyway;
- the file is bounded (``max_entries`` ids, acks kept for the newest
  ``max_acks``). When it is full, the entry issued earliest is dropped and
  ``floor`` moves up to its ``issued`` time: every command issued at or
  before the floor is refused from then on (it might be a forgotten one), so
  bounding the file never reopens a replay window.

Thread-safe (one lock); one small JSON file per device.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .slots import atomic_write

__all__ = ["SeenCommands"]

MAX_ACK_BYTES = 64 * 1024


class SeenCommands:
    """The persisted set of command ids a device has accepted (see the module docstring)."""

    def __init__(self, path: str | Path, *, clock_skew_s: float = 120.0, max_entries: int = 4096,
                 max_acks: int = 256, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.clock_skew_s = float(clock_skew_s)
        self.max_entries = int(max_entries)
        self.max_acks = int(max_acks)
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        self.floor = 0.0
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError):
            # Unreadable: atomic writes make this a disk fault, not a cut. Refuse everything issued until now
            # rather than forget what was seen.
            self.floor = self.clock()
            return
        if not isinstance(data, dict):
            self.floor = self.clock()
            return
        floor = data.get("floor", 0.0)
        self.floor = float(floor) if isinstance(floor, (int, float)) and not isinstance(floor, bool) else self.clock()
        for cid, e in (data.get("ids") or {}).items():
            if isinstance(cid, str) and isinstance(e, dict) and isinstance(e.get("expires"), (int, float)):
                self._entries[cid] = {"issued": float(e.get("issued", 0.0) or 0.0), "expires": float(e["expires"]),
                                      "ack": e.get("ack") if isinstance(e.get("ack"), str) else None}

    def _save(self) -> None:
        doc = {"floor": self.floor, "ids": self._entries}
        atomic_write(self.path, json.dumps(doc, separators=(",", ":")).encode("utf-8"), mode=0o600)

    def _prune(self, now: float) -> None:
        for cid in [c for c, e in self._entries.items() if now > e["expires"] + self.clock_skew_s]:
            del self._entries[cid]
        while len(self._entries) >= self.max_entries:
            oldest = min(self._entries, key=lambda c: self._entries[c]["issued"])
            self.floor = max(self.floor, self._entries.pop(oldest)["issued"])
        with_ack = sorted((c for c, e in self._entries.items() if e["ack"]), key=lambda c: self._entries[c]["issued"])
        for cid in with_ack[: max(0, len(with_ack) - self.max_acks)]:
            self._entries[cid]["ack"] = None

    def __contains__(self, command_id: str) -> bool:
        with self._lock:
            return command_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def below_floor(self, issued: float) -> bool:
        """True for a command issued before what the bounded file still remembers: refuse it."""
        return issued <= self.floor

    def ack(self, command_id: str) -> bytes | None:
        """The signed ack sent for ``command_id`` (None if not seen, not acked yet, or no longer kept)."""
        with self._lock:
            e = self._entries.get(command_id)
            text = None if e is None else e["ack"]
        return None if text is None else base64.b64decode(text)

    def remember(self, command_id: str, issued: float, expires: float) -> bool:
        """Record an accepted command before it runs; False if it was already seen (a replay or redelivery)."""
        with self._lock:
            if command_id in self._entries:
                return False
            self._prune(self.clock())
            self._entries[command_id] = {"issued": float(issued), "expires": float(expires), "ack": None}
            self._save()
            return True

    def set_ack(self, command_id: str, payload: bytes, *, issued: float | None = None,
                expires: float | None = None) -> None:
        """Keep the signed ack to repeat it for a redelivery (also for ids first seen now, e.g. recovered ones)."""
        with self._lock:
            e = self._entries.get(command_id)
            if e is None:
                if expires is None:
                    return
                self._prune(self.clock())
                e = self._entries[command_id] = {"issued": float(issued or self.clock()), "expires": float(expires),
                                                 "ack": None}
            e["ack"] = base64.b64encode(payload).decode("ascii") if len(payload) <= MAX_ACK_BYTES else None
            self._prune(self.clock())
            self._save()
