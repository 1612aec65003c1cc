"""The embedded engine: one SQLite file (standard library only), or ``:memory:``.

- WAL mode keeps readers (``edgeflow fleet status``) from blocking the writer;
  ``synchronous=NORMAL`` (a power cut may lose the last commits, never corrupt).
- Writes are ``BEGIN IMMEDIATE``: the database lock is taken at the start of
  the transaction, so a read-modify-write (a claim, the end of a round) never
  races another process. Several processes may share the file on one machine
  (the ingestion workers, the coordinator); a file cannot be shared across
  machines — use PostgreSQL (:mod:`.postgres`) for that.
- ``shared=True`` (ingestion workers) serializes writers with an advisory
  file lock (``<state>.ingest-lock``) before ``BEGIN IMMEDIATE``: SQLite's own
  busy handler sleeps 1-100 ms when it finds the database locked, longer than
  a claim takes, so contending workers would spend more time asleep than
  writing (benchmarks/round_scaling.py, 2 workers on 2 cores: about 1.65x one
  worker's rate without this lock, 1.9x with it).
- Damage is detected on open: ``PRAGMA integrity_check`` and the SHA-256 of the
  latest model; a truncated, overwritten or non-SQLite file raises one
  :class:`~edgeflow.errors.StateError` line that names the file and the
  recovery path (docs/security.md), never a raw traceback.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
from pathlib import Path
from typing import Any

from edgeflow.errors import StateError

from .base import RECOVERY, Dialect, GatewayStore, StoreError, Tx
from .migrations import SCHEMA_VERSION

__all__ = ["SqliteStore"]


class SqliteStore(GatewayStore):
    """:class:`~edgeflow.gateway.store.base.GatewayStore` on SQLite."""

    dialect = Dialect("sqlite")
    engine = "sqlite"

    def _open(self, check: bool) -> None:
        path = self.target.path
        self._flock: int | None = None
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            existed = Path(path).exists() and Path(path).stat().st_size > 0
        else:
            existed = False
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                                       timeout=30.0 if path != ":memory:" else 5.0)
        except sqlite3.Error as exc:
            raise StateError(f"gateway state {path} cannot be opened ({exc}): {RECOVERY}") from None
        try:
            self._prepare(existed, check)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StateError(f"gateway state {path} is damaged ({exc}): {RECOVERY}") from None
        except BaseException:
            self._db.close()
            raise
        if self.shared and path != ":memory:":
            self._flock = os.open(path + ".ingest-lock", os.O_RDWR | os.O_CREAT, 0o600)

    def _prepare(self, existed: bool, check: bool) -> None:
        db = self._db
        if existed and check:
            problems = [r[0] for r in db.execute("PRAGMA integrity_check(5)").fetchall()]
            if problems != ["ok"]:
                raise StateError(f"gateway state {self.path} is damaged (SQLite integrity_check: "
                                 f"{'; '.join(' '.join(str(p).split()) for p in problems)[:300]}): {RECOVERY}")
        if self.target.path != ":memory:":
            db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if existed and tables and "meta" not in tables:
            raise StateError(f"{self.path} is an SQLite file but not a gateway state (tables {sorted(tables)[:5]}): "
                             "pass the gateway's own --state file, or a new path to start fresh")
        if self._version(db) != SCHEMA_VERSION:
            db.execute("BEGIN IMMEDIATE")
            try:
                self._migrate(Tx(self, db), self._version(db))  # read again under the lock: another may have
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        if existed and check:
            self._check_latest_model()

    @staticmethod
    def _version(db: sqlite3.Connection) -> int | None:
        if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone() is None:
            return None
        row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        return None if row is None else int(row[0])

    # -- the engine hooks ------------------------------------------------------------
    def _conn(self) -> Any:
        return self._db

    def _begin(self, conn: Any) -> None:
        if self._flock is not None:
            fcntl.flock(self._flock, fcntl.LOCK_EX)
        conn.execute("BEGIN IMMEDIATE")

    def _commit(self, conn: Any) -> None:
        conn.execute("COMMIT")

    def _rollback(self, conn: Any) -> None:
        if conn.in_transaction:
            conn.execute("ROLLBACK")

    def _end(self, conn: Any) -> None:
        if self._flock is not None:
            fcntl.flock(self._flock, fcntl.LOCK_UN)

    def _error(self, exc: BaseException) -> BaseException | None:
        if isinstance(exc, sqlite3.Error):
            return StoreError(f"gateway state {self.path}: {type(exc).__name__}: {' '.join(str(exc).split())}")
        return None

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._flock is not None:
                os.close(self._flock)
                self._flock = None
