"""The gateway's durable state in SQLite (standard library only).

What must survive a gateway crash, and why it lives here:

- **rounds** and **round_updates**: every accepted update envelope is
  written (in its compressed wire form) *before* it is folded into the
  in-memory aggregator, keyed by (round, device). A restarted gateway
  re-streams the stored envelopes of the open round into a fresh aggregator
  — memory stays O(parameters) — and the primary key turns a broker
  redelivery of the same update into a no-op: no update counts twice.
- **models**: every global model version with its hash and metrics, so a
  rollback target always exists.
- **devices** and **telemetry**: the fleet registry (last birth, liveness,
  model version, bounded telemetry history).

- **update_seqs**: the replay guard's floor, the newest accepted sequence
  number per device, written in the same transaction as the update: a
  captured update is refused after a restart too (docs/security.md).
- **meta**: the schema version and the gateway's epoch (see
  :mod:`edgeflow.gateway.rounds`).

A round ends in **one transaction** (:meth:`GatewayStore.finish_round`): the
new model version, the round's state and metrics, and the deletion of its
update envelopes commit together, so a power cut leaves either the open round
with its updates (resumed on restart) or the closed round with its model,
never a model without its round closed.

Damage is detected when the store opens: ``PRAGMA quick_check`` over the file
and a SHA-256 check of the latest model; a truncated, overwritten or
non-SQLite file raises one :class:`~edgeflow.errors.StateError` line that
names the file and the recovery path (docs/security.md, "Recovering from
state damage"), never a raw traceback.

One connection per store, guarded by a lock: the gateway's handlers run on
the transport's worker thread and its round loop on another. WAL mode keeps
readers (``edgeflow fleet status``) from blocking the writer.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from edgeflow.errors import StateError
from edgeflow.faults import fault_point

SCHEMA_VERSION = 1
MAX_SEQ = (1 << 63) - 1
"""SQLite integers are signed 64-bit: updates with a larger seq are refused before they are stored."""
RECOVERY = ("stop every gateway process, move the file aside (keep it for inspection), then restore the latest "
            "backup to that path or start without a state file; devices follow the new gateway epoch "
            "(docs/security.md, 'Recovering from state damage')")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (
    version INTEGER PRIMARY KEY,
    created REAL NOT NULL,
    sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    onnx BLOB NOT NULL,
    round_id INTEGER,
    metrics TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS rounds (
    round_id INTEGER PRIMARY KEY,
    model_version INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('open', 'closed', 'failed')),
    created REAL NOT NULL,
    deadline REAL NOT NULL,
    config TEXT NOT NULL,
    selected TEXT NOT NULL,
    metrics TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS round_updates (
    round_id INTEGER NOT NULL,
    device_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    num_samples INTEGER NOT NULL,
    received REAL NOT NULL,
    nbytes INTEGER NOT NULL,
    envelope BLOB NOT NULL,
    PRIMARY KEY (round_id, device_id)
);
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY,
    profile TEXT NOT NULL DEFAULT '',
    public_key TEXT NOT NULL DEFAULT '',
    online INTEGER NOT NULL DEFAULT 0,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    model_version INTEGER,
    birth TEXT NOT NULL DEFAULT '{}',
    bdseq INTEGER NOT NULL DEFAULT -1
);
CREATE TABLE IF NOT EXISTS telemetry (
    device_id TEXT NOT NULL,
    ts REAL NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS telemetry_by_device ON telemetry (device_id, ts);
CREATE TABLE IF NOT EXISTS update_seqs (device_id TEXT PRIMARY KEY, max_seq INTEGER NOT NULL);
"""


@dataclass(frozen=True)
class RoundRecord:
    round_id: int
    model_version: int
    state: str
    created: float
    deadline: float
    config: dict[str, Any]
    selected: list[str]
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceRecord:
    device_id: str
    profile: str
    public_key: str
    online: bool
    first_seen: float
    last_seen: float
    model_version: int | None
    birth: dict[str, Any]
    bdseq: int


@dataclass(frozen=True)
class StoredUpdate:
    round_id: int
    device_id: str
    seq: int
    num_samples: int
    received: float
    envelope: bytes


class GatewayStore:
    """SQLite-backed state of one gateway (``":memory:"`` for tests)."""

    def __init__(self, path: str | Path = ":memory:", *, telemetry_keep: int = 500, check: bool = True) -> None:
        """Open (or create) the state; ``check`` runs the integrity checks of the module
        docstring on an existing file and raises :class:`StateError` if it is damaged."""
        self.path = str(path)
        self.created = False
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            existed = Path(self.path).exists() and Path(self.path).stat().st_size > 0
        else:
            existed = False
        self._lock = threading.RLock()
        self.telemetry_keep = telemetry_keep
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            raise StateError(f"gateway state {self.path} cannot be opened ({exc}): {RECOVERY}") from None
        try:
            self._open(existed, check)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StateError(f"gateway state {self.path} is damaged ({exc}): {RECOVERY}") from None
        except StateError:
            self._db.close()
            raise

    def _open(self, existed: bool, check: bool) -> None:
        with self._lock:
            if existed and check:
                problems = [r[0] for r in self._db.execute("PRAGMA quick_check(5)").fetchall()]
                if problems != ["ok"]:
                    raise StateError(f"gateway state {self.path} is damaged (SQLite quick_check: "
                                     f"{'; '.join(' '.join(str(p).split()) for p in problems)[:300]}): {RECOVERY}")
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            had_meta = self._db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone() is not None
            if existed and not had_meta:
                tables = [r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
                if tables:
                    raise StateError(f"{self.path} is an SQLite file but not a gateway state (tables {tables[:5]}): "
                                     "pass the gateway's own --state file, or a new path to start fresh")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
                self.created = True
            elif row[0] != str(SCHEMA_VERSION):
                raise StateError(
                    f"{self.path}: gateway state has schema {row[0]}, this edgeflow expects "
                    f"{SCHEMA_VERSION}; use a fresh --state file or migrate"
                )
            if existed and check:
                latest = self._db.execute(
                    "SELECT version, onnx, sha256 FROM models ORDER BY version DESC LIMIT 1").fetchone()
                if latest is not None and hashlib.sha256(bytes(latest[1])).hexdigest() != latest[2]:
                    raise StateError(f"gateway state {self.path} is damaged (model v{latest[0]} does not match "
                                     f"its SHA-256): {RECOVERY}")

    # -- meta -----------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                       (key, value))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- models ---------------------------------------------------------
    def add_model(self, onnx_bytes: bytes, sha256: str, *, round_id: int | None = None,
                  metrics: dict | None = None, version: int | None = None) -> int:
        with self._tx() as db:
            if version is None:
                version = (db.execute("SELECT COALESCE(MAX(version), 0) FROM models").fetchone()[0]) + 1
            db.execute(
                "INSERT INTO models (version, created, sha256, size, onnx, round_id, metrics) VALUES (?,?,?,?,?,?,?)",
                (version, time.time(), sha256, len(onnx_bytes), onnx_bytes, round_id, json.dumps(metrics or {})),
            )
        return int(version)

    def finish_round(self, round_id: int, metrics: dict, *, state: str = "closed",
                     model: tuple[bytes, str] | None = None, model_version: int | None = None,
                     model_metrics: dict | None = None) -> int | None:
        """End a round in one transaction: store ``model`` (ONNX bytes, sha256) as a new
        version (or as ``model_version``), set the round's state and metrics, and drop its
        update envelopes. Returns the new model version (None without a model)."""
        if state not in ("closed", "failed"):
            raise ValueError(f"a round finishes 'closed' or 'failed', not {state!r}")
        version = None
        with self._tx() as db:
            row = db.execute("SELECT state FROM rounds WHERE round_id=?", (round_id,)).fetchone()
            if row is None or row[0] != "open":
                raise StateError(f"round {round_id} is {'unknown' if row is None else row[0]}, not open; "
                                 "it cannot be finished twice")
            if model is not None:
                onnx_bytes, sha = model
                version = model_version
                if version is None:
                    version = int(db.execute("SELECT COALESCE(MAX(version), 0) FROM models").fetchone()[0]) + 1
                db.execute(
                    "INSERT INTO models (version, created, sha256, size, onnx, round_id, metrics) "
                    "VALUES (?,?,?,?,?,?,?)",
                    (version, time.time(), sha, len(onnx_bytes), onnx_bytes, round_id,
                     json.dumps(model_metrics or {})),
                )
            db.execute("UPDATE rounds SET state=?, metrics=? WHERE round_id=?", (state, json.dumps(metrics), round_id))
            db.execute("DELETE FROM round_updates WHERE round_id=?", (round_id,))
            fault_point("store.finish_round")
        return None if version is None else int(version)

    def model_for_round(self, round_id: int) -> int | None:
        """The model version a round produced, if it produced one."""
        with self._lock:
            row = self._db.execute("SELECT MAX(version) FROM models WHERE round_id=?", (round_id,)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def latest_version(self) -> int:
        """The newest model version (0 when there is none)."""
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(MAX(version), 0) FROM models").fetchone()[0])

    def latest_model(self) -> tuple[int, bytes, str] | None:
        with self._lock:
            row = self._db.execute("SELECT version, onnx, sha256 FROM models ORDER BY version DESC LIMIT 1").fetchone()
        return (int(row[0]), bytes(row[1]), row[2]) if row else None

    def model(self, version: int) -> tuple[bytes, str] | None:
        with self._lock:
            row = self._db.execute("SELECT onnx, sha256 FROM models WHERE version=?", (version,)).fetchone()
        return (bytes(row[0]), row[1]) if row else None

    def model_versions(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT version, created, sha256, size, round_id, metrics FROM models ORDER BY version"
            ).fetchall()
        return [
            {"version": r[0], "created": r[1], "sha256": r[2], "size": r[3], "round_id": r[4], "metrics": json.loads(r[5])}
            for r in rows
        ]

    # -- rounds ---------------------------------------------------------
    def open_round(self, round_id: int, model_version: int, deadline: float, config: dict, selected: list[str]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO rounds (round_id, model_version, state, created, deadline, config, selected) "
                "VALUES (?,?,?,?,?,?,?)",
                (round_id, model_version, "open", time.time(), deadline, json.dumps(config), json.dumps(selected)),
            )

    def close_round(self, round_id: int, metrics: dict, state: str = "closed") -> None:
        with self._tx() as db:
            db.execute("UPDATE rounds SET state=?, metrics=? WHERE round_id=?", (state, json.dumps(metrics), round_id))

    def round(self, round_id: int) -> RoundRecord | None:
        with self._lock:
            r = self._db.execute(
                "SELECT round_id, model_version, state, created, deadline, config, selected, metrics "
                "FROM rounds WHERE round_id=?", (round_id,)).fetchone()
        return self._round(r) if r else None

    def open_rounds(self) -> list[RoundRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT round_id, model_version, state, created, deadline, config, selected, metrics "
                "FROM rounds WHERE state='open' ORDER BY round_id").fetchall()
        return [self._round(r) for r in rows]

    def last_round_id(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(MAX(round_id), 0) FROM rounds").fetchone()[0])

    def rounds(self) -> list[RoundRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT round_id, model_version, state, created, deadline, config, selected, metrics "
                "FROM rounds ORDER BY round_id").fetchall()
        return [self._round(r) for r in rows]

    @staticmethod
    def _round(r) -> RoundRecord:
        return RoundRecord(int(r[0]), int(r[1]), r[2], r[3], r[4], json.loads(r[5]), json.loads(r[6]), json.loads(r[7]))

    def add_update(self, round_id: int, device_id: str, seq: int, num_samples: int, envelope: bytes) -> bool:
        """Persist an accepted update and raise the device's replay floor, in one transaction;
        False if this device already sent one this round (nothing changes then)."""
        if not 0 <= int(seq) <= MAX_SEQ:
            raise ValueError(f"seq {seq} is outside 0..{MAX_SEQ}")
        with self._tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO round_updates (round_id, device_id, seq, num_samples, received, nbytes, envelope) "
                "VALUES (?,?,?,?,?,?,?)",
                (round_id, device_id, seq, num_samples, time.time(), len(envelope), envelope),
            )
            if cur.rowcount != 1:
                return False
            db.execute("INSERT INTO update_seqs (device_id, max_seq) VALUES (?, ?) ON CONFLICT(device_id) DO UPDATE "
                       "SET max_seq=MAX(max_seq, excluded.max_seq)", (device_id, seq))
            return True

    def record_seq(self, device_id: str, seq: int) -> None:
        """Raise the device's replay floor (updates accepted without being stored: async mode)."""
        if not 0 <= int(seq) <= MAX_SEQ:
            raise ValueError(f"seq {seq} is outside 0..{MAX_SEQ}")
        with self._tx() as db:
            db.execute("INSERT INTO update_seqs (device_id, max_seq) VALUES (?, ?) ON CONFLICT(device_id) DO UPDATE "
                       "SET max_seq=MAX(max_seq, excluded.max_seq)", (device_id, seq))

    def seq_floor(self, device_id: str) -> int | None:
        """The newest seq accepted from ``device_id`` (None: nothing yet)."""
        with self._lock:
            row = self._db.execute("SELECT max_seq FROM update_seqs WHERE device_id=?", (device_id,)).fetchone()
        return None if row is None else int(row[0])

    def seq_floors(self) -> dict[str, int]:
        """{device: newest accepted seq}: what a restarted gateway refuses as replays."""
        with self._lock:
            return {r[0]: int(r[1]) for r in self._db.execute("SELECT device_id, max_seq FROM update_seqs")}

    def remove_update(self, round_id: int, device_id: str) -> None:
        """Forget a stored update that turned out not to fit (the device may send again)."""
        with self._tx() as db:
            db.execute("DELETE FROM round_updates WHERE round_id=? AND device_id=?", (round_id, device_id))

    def has_update(self, round_id: int, device_id: str) -> bool:
        with self._lock:
            return self._db.execute(
                "SELECT 1 FROM round_updates WHERE round_id=? AND device_id=?", (round_id, device_id)
            ).fetchone() is not None

    def updates(self, round_id: int, *, order: str = "received") -> Iterator[StoredUpdate]:
        """Stored updates of a round, one at a time (streamed from disk), in arrival order or, with
        ``order="device"``, by device id (what the round folds at its close)."""
        column = {"received": "received", "device": "device_id"}[order]
        with self._lock:
            keys = self._db.execute(
                f"SELECT device_id FROM round_updates WHERE round_id=? ORDER BY {column}", (round_id,)
            ).fetchall()
        for (device_id,) in keys:
            with self._lock:
                r = self._db.execute(
                    "SELECT seq, num_samples, received, envelope FROM round_updates WHERE round_id=? AND device_id=?",
                    (round_id, device_id),
                ).fetchone()
            if r:
                yield StoredUpdate(round_id, device_id, int(r[0]), int(r[1]), float(r[2]), bytes(r[3]))

    def update_count(self, round_id: int) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM round_updates WHERE round_id=?", (round_id,)).fetchone()[0])

    def drop_updates(self, round_id: int) -> None:
        """Free the envelopes of a finished round (its aggregate is in models)."""
        with self._tx() as db:
            db.execute("DELETE FROM round_updates WHERE round_id=?", (round_id,))

    # -- devices --------------------------------------------------------
    def upsert_birth(self, device_id: str, birth: dict, *, profile: str = "", public_key: str = "",
                     model_version: int | None = None, bdseq: int = -1) -> None:
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO devices (device_id, profile, public_key, online, first_seen, last_seen, model_version, birth, bdseq) "
                "VALUES (?,?,?,1,?,?,?,?,?) ON CONFLICT(device_id) DO UPDATE SET profile=excluded.profile, "
                "public_key=CASE WHEN excluded.public_key != '' THEN excluded.public_key ELSE devices.public_key END, "
                "online=1, last_seen=excluded.last_seen, model_version=excluded.model_version, "
                "birth=excluded.birth, bdseq=excluded.bdseq",
                (device_id, profile, public_key, now, now, model_version, json.dumps(birth), bdseq),
            )

    def set_online(self, device_id: str, online: bool, *, bdseq: int | None = None) -> bool:
        """Mark liveness; a death with an older bdseq than the last birth is ignored (stale will)."""
        with self._tx() as db:
            row = db.execute("SELECT bdseq FROM devices WHERE device_id=?", (device_id,)).fetchone()
            if row is None:
                return False
            if not online and bdseq is not None and bdseq >= 0 and row[0] >= 0 and bdseq < row[0]:
                return False
            db.execute("UPDATE devices SET online=?, last_seen=? WHERE device_id=?",
                       (1 if online else 0, time.time(), device_id))
            return True

    def touch(self, device_id: str, *, model_version: int | None = None) -> None:
        with self._tx() as db:
            if model_version is None:
                db.execute("UPDATE devices SET last_seen=?, online=1 WHERE device_id=?", (time.time(), device_id))
            else:
                db.execute("UPDATE devices SET last_seen=?, online=1, model_version=? WHERE device_id=?",
                           (time.time(), model_version, device_id))

    def expire(self, timeout_s: float) -> list[str]:
        """Mark devices silent for longer than ``timeout_s`` offline; returns them."""
        cutoff = time.time() - timeout_s
        with self._tx() as db:
            rows = db.execute("SELECT device_id FROM devices WHERE online=1 AND last_seen < ?", (cutoff,)).fetchall()
            db.execute("UPDATE devices SET online=0 WHERE online=1 AND last_seen < ?", (cutoff,))
        return [r[0] for r in rows]

    def device(self, device_id: str) -> DeviceRecord | None:
        with self._lock:
            r = self._db.execute(
                "SELECT device_id, profile, public_key, online, first_seen, last_seen, model_version, birth, bdseq "
                "FROM devices WHERE device_id=?", (device_id,)).fetchone()
        return self._device(r) if r else None

    def devices(self) -> list[DeviceRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT device_id, profile, public_key, online, first_seen, last_seen, model_version, birth, bdseq "
                "FROM devices ORDER BY device_id").fetchall()
        return [self._device(r) for r in rows]

    @staticmethod
    def _device(r) -> DeviceRecord:
        return DeviceRecord(r[0], r[1], r[2], bool(r[3]), r[4], r[5], r[6], json.loads(r[7]), int(r[8]))

    def add_telemetry(self, device_id: str, data: dict, ts: float | None = None) -> None:
        ts = time.time() if ts is None else ts
        with self._tx() as db:
            db.execute("INSERT INTO telemetry (device_id, ts, data) VALUES (?,?,?)", (device_id, ts, json.dumps(data)))
            db.execute("UPDATE devices SET last_seen=?, online=1 WHERE device_id=?", (time.time(), device_id))
            # keep the newest ``telemetry_keep`` rows per device (bounded history)
            db.execute(
                "DELETE FROM telemetry WHERE device_id=? AND ts < (SELECT ts FROM telemetry WHERE device_id=? "
                "ORDER BY ts DESC LIMIT 1 OFFSET ?)",
                (device_id, device_id, self.telemetry_keep - 1),
            )

    def telemetry(self, device_id: str, limit: int = 100) -> list[tuple[float, dict]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT ts, data FROM telemetry WHERE device_id=? ORDER BY ts DESC LIMIT ?", (device_id, limit)
            ).fetchall()
        return [(r[0], json.loads(r[1])) for r in reversed(rows)]
