"""The gateway's durable state: one interface, written once in portable SQL, on two engines.

:class:`GatewayStore` is the interface *and* the implementation of every
state change; an engine (:mod:`.sqlite`, :mod:`.postgres`) supplies the
connection, the one transaction helper (:meth:`GatewayStore.tx`), the
dialect's few differences (:class:`Dialect`) and its integrity checks.
``GatewayStore(target)`` picks the engine from ``target`` (see
:func:`open_store`): a path or ``sqlite:///PATH`` is SQLite (the embedded
default), ``postgresql://...`` is PostgreSQL (several gateway and ingestion
processes on several machines).

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
  model version, bounded telemetry history; telemetry is written in batches,
  :meth:`GatewayStore.add_telemetry_batch`).
- **update_seqs**: the replay guard's floor, the newest accepted sequence
  number per device, written in the same transaction as the update: a
  captured update is refused after a restart too (docs/security.md).
- **ingest_*** : the ingestion workers' gate, claims, partial sums and
  leases (:mod:`edgeflow.gateway.ingest`): a claim stores the envelope,
  dedupes it and checks that the round's intake is open in one transaction.
- **rollouts**: one row per finished OTA rollout (``edgeflow fleet deploy``):
  the artifact version, the SHA-256 of the model it was built from, its report.
- **meta**: the schema version (:mod:`.migrations`) and the gateway's epoch
  (see :mod:`edgeflow.gateway.rounds`).

A round ends in **one transaction** (:meth:`GatewayStore.finish_round`): the
new model version, the round's state and metrics, and the deletion of its
update envelopes commit together, so a power cut leaves either the open round
with its updates (resumed on restart) or the closed round with its model,
never a model without its round closed.

Concurrency. One connection per store object, guarded by a lock: the
gateway's handlers run on the transport's worker thread and its round loop
on another. Across processes the engine's own locking serializes writers:
SQLite's database lock (``BEGIN IMMEDIATE``; plus an advisory file lock for
the ingestion workers' many short writes, see :mod:`.sqlite`), PostgreSQL's
row locks (a claim holds the round's row ``FOR SHARE SKIP LOCKED``, closing
the intake takes it ``FOR UPDATE``; dead workers' leases are taken over with
``FOR UPDATE SKIP LOCKED``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from edgeflow.errors import ConfigError, StateError
from edgeflow.faults import fault_point

from .migrations import MIGRATIONS, SCHEMA_VERSION

__all__ = [
    "MAX_SEQ",
    "RECOVERY",
    "SCHEMA_VERSION",
    "DeviceRecord",
    "Dialect",
    "GatewayStore",
    "RoundRecord",
    "StoreError",
    "StoreTarget",
    "StoredUpdate",
    "open_store",
    "parse_store_url",
    "register_engine",
]

MAX_SEQ = (1 << 63) - 1
"""Both engines store 64-bit signed integers: updates with a larger seq are refused before they are stored."""
RECOVERY = ("stop every gateway process, move the file aside (keep it for inspection), then restore the latest "
            "backup to that path or start without a state file; devices follow the new gateway epoch "
            "(docs/security.md, 'Recovering from state damage')")


class StoreError(StateError):
    """The engine failed a statement (disk full, server gone, lock timeout): nothing of the
    transaction was committed. One line naming the state and the driver's reason."""


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


@dataclass(frozen=True)
class Dialect:
    """Where the engines' SQL differs: column types, the scalar max, row locks, placeholders."""

    name: str
    blob: str = "BLOB"
    real: str = "REAL"
    int: str = "INTEGER"
    greatest: str = "MAX"
    for_update: str = ""
    for_share_skip_locked: str = ""
    for_update_skip_locked: str = ""
    placeholder: str = "?"

    def render(self, sql: str) -> str:
        out = sql.format(blob=self.blob, real=self.real, int=self.int, greatest=self.greatest,
                         for_update=self.for_update, for_share_skip_locked=self.for_share_skip_locked,
                         for_update_skip_locked=self.for_update_skip_locked)
        return out if self.placeholder == "?" else out.replace("?", self.placeholder)


@dataclass(frozen=True)
class StoreTarget:
    """Where a state lives: ``engine`` "sqlite" (``path``, or ":memory:") or "postgresql"
    (``dsn`` for the driver, ``schema`` to keep the tables in, ``display`` without a password)."""

    engine: str
    path: str = ""
    dsn: str = ""
    schema: str = ""
    display: str = ""


_URL_HELP = "use a file path, sqlite:///PATH (sqlite:////ABS/PATH) or postgresql://USER@HOST:PORT/DB[?schema=NAME]"


def parse_store_url(value: Any, *, base_dir: str | os.PathLike | None = None) -> StoreTarget:
    """``[store] url`` (or a plain path) -> :class:`StoreTarget`; a ConfigError line otherwise.

    ``sqlite:///rel/path`` is relative to ``base_dir`` (gateway.toml's folder),
    ``sqlite:////abs/path`` absolute, ``sqlite://`` in memory. ``postgresql://``
    (or ``postgres://``) is passed to libpq as it is, except ``schema=NAME``,
    which edgeflow takes out and keeps its tables in (created if missing).
    """
    from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"[store] url must be a non-empty string, got {value!r}: {_URL_HELP}")
    value = value.strip()
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", value)  # two letters at least: "C:/x" stays a path
    scheme = m.group(1).lower() if m else ""
    if not scheme:
        if value == ":memory:":
            return StoreTarget("sqlite", ":memory:", display=":memory:")
        path = value if base_dir is None or os.path.isabs(value) else os.path.join(os.fspath(base_dir), value)
        return StoreTarget("sqlite", path, display=path)
    if scheme == "sqlite":
        rest = value[len("sqlite:"):]
        if not rest.startswith("//"):
            raise ConfigError(f"[store] url {value!r}: a sqlite URL has three slashes before the path: {_URL_HELP}")
        rest = rest[2:]
        if rest in ("", "/", "/:memory:"):
            return StoreTarget("sqlite", ":memory:", display=":memory:")
        if not rest.startswith("/"):
            raise ConfigError(f"[store] url {value!r}: a sqlite URL has three slashes before the path: {_URL_HELP}")
        rel = rest[1:]
        path = rel if os.path.isabs(rel) or base_dir is None else os.path.join(os.fspath(base_dir), rel)
        return StoreTarget("sqlite", path, display=path)
    if scheme in ("postgresql", "postgres"):
        parts = urlsplit(value)
        query = parse_qsl(parts.query, keep_blank_values=True)
        schema = ""
        kept = []
        for k, v in query:
            if k == "schema":
                schema = v
            else:
                kept.append((k, v))
        if schema and not (schema.replace("_", "a").isalnum() and schema[0].isalpha() and len(schema) <= 63
                           and schema.isascii()):
            raise ConfigError(f"[store] url {value!r}: schema {schema!r} must be letters, digits and '_', "
                              "starting with a letter")
        if not parts.hostname and not any(k == "host" for k, _ in kept):
            raise ConfigError(f"[store] url {value!r} names no host: {_URL_HELP}")
        dsn = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(kept, quote_via=quote), parts.fragment))
        netloc = parts.netloc
        if parts.password is not None:
            netloc = netloc.replace(":" + parts.password + "@", ":***@", 1)
        display = urlunsplit((parts.scheme, netloc, parts.path, urlencode(kept, quote_via=quote), ""))
        if schema:
            display += ("&" if kept else "?") + f"schema={schema}"
        return StoreTarget("postgresql", dsn=dsn, schema=schema, display=display)
    raise ConfigError(f"[store] url {value!r}: unknown engine {scheme!r}; {_URL_HELP}")


def open_store(target: Any = ":memory:", **kwargs: Any) -> "GatewayStore":
    """Open the state at ``target`` (a path, a URL or a :class:`StoreTarget`) on its engine."""
    return GatewayStore(target, **kwargs)


ENGINES: dict[str, Callable[[], type["GatewayStore"]]] = {}
"""Engine name -> a loader of its :class:`GatewayStore` subclass. The package
(:mod:`edgeflow.gateway.store`) registers SQLite and PostgreSQL, so this module
imports neither engine (no import cycle) and PostgreSQL's psycopg loads only when used."""


def register_engine(name: str, loader: Callable[[], type["GatewayStore"]]) -> None:
    ENGINES[name] = loader


class Tx:
    """One open transaction: ``execute`` renders the statement for the engine."""

    def __init__(self, store: "GatewayStore", conn: Any) -> None:
        self._store = store
        self._conn = conn

    def execute(self, sql: str, args: tuple | list = ()) -> Any:
        return self._store._execute(self._conn, sql, tuple(args))

    def many(self, sql: str, rows: Iterable[tuple]) -> None:
        self._store._executemany(self._conn, sql, [tuple(r) for r in rows])

    def one(self, sql: str, args: tuple | list = ()) -> Any:
        return self.execute(sql, args).fetchone()

    def all(self, sql: str, args: tuple | list = ()) -> list[Any]:
        return self.execute(sql, args).fetchall()


class GatewayStore:
    """The state of one gateway (see the module docstring). ``GatewayStore(target)`` opens
    ``target`` on its engine, like :func:`open_store`; ``":memory:"`` (default) for tests."""

    dialect: Dialect = Dialect("abstract")
    engine = "abstract"

    def __new__(cls, target: Any = ":memory:", *args: Any, **kwargs: Any) -> "GatewayStore":
        if cls is GatewayStore:
            t = target if isinstance(target, StoreTarget) else parse_store_url(target)
            loader = ENGINES.get(t.engine)
            if loader is None:
                raise ConfigError(f"[store] engine {t.engine!r} is not available; known: {', '.join(sorted(ENGINES))}")
            return super().__new__(loader())  # __init__ then runs with the caller's arguments
        return super().__new__(cls)

    def __init__(self, target: Any = ":memory:", *, telemetry_keep: int = 500, check: bool = True,
                 shared: bool = False) -> None:
        """Open (or create and migrate) the state; ``check`` runs the engine's integrity
        checks on an existing state and raises :class:`StateError` if it is damaged;
        ``shared`` marks a store of one of several processes writing the same state
        (ingestion workers: see the engine's notes)."""
        self.target = target if isinstance(target, StoreTarget) else parse_store_url(target)
        self.telemetry_keep = int(telemetry_keep)
        self.shared = shared
        self.created = False
        self._lock = threading.RLock()
        self._sql: dict[str, str] = {}
        self._since_trim: dict[str, int] = {}
        self._open(check)

    # -- what an engine provides ----------------------------------------------------
    def _open(self, check: bool) -> None:
        raise NotImplementedError("need _open")

    def _conn(self) -> Any:
        """The connection to use now (an engine may reconnect here)."""
        raise NotImplementedError("need _conn")

    def _begin(self, conn: Any) -> None:
        raise NotImplementedError("need _begin")

    def _commit(self, conn: Any) -> None:
        raise NotImplementedError("need _commit")

    def _rollback(self, conn: Any) -> None:
        raise NotImplementedError("need _rollback")

    def _end(self, conn: Any) -> None:
        """After COMMIT or ROLLBACK (release cross-process locks)."""

    def _error(self, exc: BaseException) -> BaseException | None:
        """The StateError to raise for a driver error (None: not a driver error)."""
        return None

    def close(self) -> None:
        raise NotImplementedError("need close")

    @property
    def path(self) -> str:
        """Where the state is, for messages: the file (SQLite) or the URL without its password."""
        return self.target.display

    @property
    def url(self) -> StoreTarget:
        """What another process opens to share this state (``GatewayStore(store.url)``)."""
        return self.target

    # -- statements and the one transaction helper -----------------------------------
    def _render(self, sql: str) -> str:
        out = self._sql.get(sql)
        if out is None:
            out = self._sql[sql] = self.dialect.render(sql)
        return out

    def _execute(self, conn: Any, sql: str, args: tuple) -> Any:
        return conn.execute(self._render(sql), args)

    def _executemany(self, conn: Any, sql: str, rows: list[tuple]) -> None:
        conn.cursor().executemany(self._render(sql), rows)

    @contextmanager
    def tx(self) -> Iterator[Tx]:
        """One write transaction: everything inside commits together or not at all."""
        with self._lock:
            conn = self._conn()
            try:
                self._begin(conn)
                try:
                    yield Tx(self, conn)
                except BaseException:
                    try:
                        self._rollback(conn)
                    except Exception as exc:  # noqa: BLE001 - the connection died: report the first error
                        if self._error(exc) is None:
                            raise
                    raise
                self._commit(conn)
            except Exception as exc:  # noqa: BLE001 - driver errors become one StateError line
                err = self._error(exc)
                if err is None:
                    raise
                raise err from None
            finally:
                self._end(conn)

    _tx = tx  # the name tests and older callers use

    def _one(self, sql: str, args: tuple = ()) -> Any:
        with self._lock:
            try:
                return self._execute(self._conn(), sql, args).fetchone()
            except Exception as exc:  # noqa: BLE001
                err = self._error(exc)
                if err is None:
                    raise
                raise err from None

    def _all(self, sql: str, args: tuple = ()) -> list[Any]:
        with self._lock:
            try:
                return self._execute(self._conn(), sql, args).fetchall()
            except Exception as exc:  # noqa: BLE001
                err = self._error(exc)
                if err is None:
                    raise
                raise err from None

    def execute_sql(self, sql: str, args: tuple = ()) -> None:
        """Run one statement in its own transaction (tests and maintenance only)."""
        with self.tx() as db:
            db.execute(sql, args)

    # -- schema -----------------------------------------------------------------------
    def schema_version(self) -> int:
        row = self._one("SELECT value FROM meta WHERE key='schema'")
        return 0 if row is None else int(row[0])

    def _migrate(self, db: Tx, have: int | None) -> None:
        """Bring the schema from ``have`` (None: empty) to :data:`SCHEMA_VERSION` inside ``db``."""
        start = 0 if have is None else have
        if start > SCHEMA_VERSION:
            raise StateError(f"{self.path}: gateway state has schema {start}, this edgeflow expects "
                             f"{SCHEMA_VERSION}; use a fresh --state file or migrate (upgrade edgeflow)")
        for v in range(start + 1, SCHEMA_VERSION + 1):
            for stmt in MIGRATIONS[v]:
                db.execute(stmt)
        if have is None:
            db.execute("INSERT INTO meta (key, value) VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            self.created = True
        elif start < SCHEMA_VERSION:
            db.execute("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA_VERSION),))

    def _check_latest_model(self) -> None:
        latest = self._one("SELECT version, onnx, sha256 FROM models ORDER BY version DESC LIMIT 1")
        if latest is not None and hashlib.sha256(bytes(latest[1])).hexdigest() != latest[2]:
            raise StateError(f"gateway state {self.path} is damaged (model v{latest[0]} does not match "
                             f"its SHA-256): {RECOVERY}")

    # -- meta -------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self._one("SELECT value FROM meta WHERE key=?", (key,))
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                       (key, value))

    # -- models -----------------------------------------------------------------------
    def add_model(self, onnx_bytes: bytes, sha256: str, *, round_id: int | None = None,
                  metrics: dict | None = None, version: int | None = None) -> int:
        with self.tx() as db:
            if version is None:
                version = int(db.one("SELECT COALESCE(MAX(version), 0) FROM models")[0]) + 1
            db.execute(
                "INSERT INTO models (version, created, sha256, size, onnx, round_id, metrics) VALUES (?,?,?,?,?,?,?)",
                (version, time.time(), sha256, len(onnx_bytes), bytes(onnx_bytes), round_id,
                 json.dumps(metrics or {})),
            )
        return int(version)

    def finish_round(self, round_id: int, metrics: dict, *, state: str = "closed",
                     model: tuple[bytes, str] | None = None, model_version: int | None = None,
                     model_metrics: dict | None = None, strategy_state: bytes | None = None) -> int | None:
        """End a round in one transaction: store ``model`` (ONNX bytes, sha256) as a new
        version (or as ``model_version``), set the round's state and metrics, store the
        aggregation strategy's cross-round ``strategy_state`` as it stands after this round,
        and drop its update envelopes. Returns the new model version (None without a model)."""
        if state not in ("closed", "failed"):
            raise ValueError(f"a round finishes 'closed' or 'failed', not {state!r}")
        version = None
        with self.tx() as db:
            row = db.one("SELECT state FROM rounds WHERE round_id=?{for_update}", (round_id,))
            if row is None or row[0] != "open":
                raise StateError(f"round {round_id} is {'unknown' if row is None else row[0]}, not open; "
                                 "it cannot be finished twice")
            if model is not None:
                onnx_bytes, sha = model
                version = model_version
                if version is None:
                    version = int(db.one("SELECT COALESCE(MAX(version), 0) FROM models")[0]) + 1
                db.execute(
                    "INSERT INTO models (version, created, sha256, size, onnx, round_id, metrics) "
                    "VALUES (?,?,?,?,?,?,?)",
                    (version, time.time(), sha, len(onnx_bytes), bytes(onnx_bytes), round_id,
                     json.dumps(model_metrics or {})),
                )
            db.execute("UPDATE rounds SET state=?, metrics=? WHERE round_id=?", (state, json.dumps(metrics), round_id))
            if strategy_state is not None:
                db.execute("INSERT INTO strategy_state (round_id, created, state) VALUES (?,?,?)",
                           (round_id, time.time(), bytes(strategy_state)))
            db.execute("DELETE FROM round_updates WHERE round_id=?", (round_id,))
            fault_point("store.finish_round")
        return None if version is None else int(version)

    def strategy_state(self) -> tuple[int, bytes] | None:
        """The newest stored strategy state and the round that ended with it (None: none stored)."""
        row = self._one("SELECT round_id, state FROM strategy_state ORDER BY round_id DESC LIMIT 1")
        return None if row is None else (int(row[0]), bytes(row[1]))

    def model_for_round(self, round_id: int) -> int | None:
        """The model version a round produced, if it produced one."""
        row = self._one("SELECT MAX(version) FROM models WHERE round_id=?", (round_id,))
        return None if row is None or row[0] is None else int(row[0])

    def latest_version(self) -> int:
        """The newest model version (0 when there is none)."""
        return int(self._one("SELECT COALESCE(MAX(version), 0) FROM models")[0])

    def latest_model(self) -> tuple[int, bytes, str] | None:
        row = self._one("SELECT version, onnx, sha256 FROM models ORDER BY version DESC LIMIT 1")
        return (int(row[0]), bytes(row[1]), row[2]) if row else None

    def model(self, version: int) -> tuple[bytes, str] | None:
        row = self._one("SELECT onnx, sha256 FROM models WHERE version=?", (version,))
        return (bytes(row[0]), row[1]) if row else None

    def model_versions(self) -> list[dict[str, Any]]:
        rows = self._all("SELECT version, created, sha256, size, round_id, metrics FROM models ORDER BY version")
        return [
            {"version": int(r[0]), "created": r[1], "sha256": r[2], "size": int(r[3]),
             "round_id": None if r[4] is None else int(r[4]), "metrics": json.loads(r[5])}
            for r in rows
        ]

    # -- rollouts (edgeflow fleet deploy) ---------------------------------------------------
    _ROLLOUT_COLS = "rollout_id, artifact_version, state, started, finished, source_sha256, name, selector, report"

    def add_rollout(self, report: dict[str, Any], *, rollout_id: str, source_sha256: str = "", name: str = "",
                    selector: str = "") -> str:
        """Record a finished rollout (a :meth:`RolloutReport.to_dict`, with ``version`` the artifact
        version it shipped) in one transaction; recording the same ``rollout_id`` again replaces it."""
        version = report.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"a rollout report names its artifact version as a whole number, got {version!r}")
        started = float(report.get("started") or time.time())
        finished = report.get("finished")
        with self.tx() as db:
            db.execute(
                "INSERT INTO rollouts (rollout_id, artifact_version, state, started, finished, source_sha256, name, "
                "selector, report) VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT (rollout_id) DO UPDATE SET "
                "artifact_version=excluded.artifact_version, state=excluded.state, started=excluded.started, "
                "finished=excluded.finished, source_sha256=excluded.source_sha256, name=excluded.name, "
                "selector=excluded.selector, report=excluded.report",
                (str(rollout_id), version, str(report.get("state", "")), started,
                 None if finished is None else float(finished), str(source_sha256), str(name), str(selector),
                 json.dumps(report, default=str)))
        return str(rollout_id)

    def rollouts(self) -> list[dict[str, Any]]:
        """Every recorded rollout, oldest first (see :meth:`rollout_row`)."""
        return [self.rollout_row(r) for r in self._all(f"SELECT {self._ROLLOUT_COLS} FROM rollouts "
                                                         "ORDER BY started, rollout_id")]

    @staticmethod
    def rollout_row(r: Any) -> dict[str, Any]:
        """A ``rollouts`` row as a dict: ``rollout_id, artifact_version, state, started, finished,
        source_sha256, name, selector, report`` (the stored report, parsed)."""
        try:
            report = json.loads(r[8] or "{}")
        except ValueError:
            report = {}
        return {"rollout_id": r[0], "artifact_version": int(r[1]), "state": r[2], "started": float(r[3]),
                "finished": None if r[4] is None else float(r[4]), "source_sha256": r[5], "name": r[6],
                "selector": r[7], "report": report if isinstance(report, dict) else {}}

    # -- rounds -----------------------------------------------------------------------
    _ROUND_COLS = "round_id, model_version, state, created, deadline, config, selected, metrics"

    def open_round(self, round_id: int, model_version: int, deadline: float, config: dict, selected: list[str]) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT INTO rounds (round_id, model_version, state, created, deadline, config, selected) "
                "VALUES (?,?,?,?,?,?,?)",
                (round_id, model_version, "open", time.time(), deadline, json.dumps(config), json.dumps(selected)),
            )

    def add_round_metrics(self, round_id: int, metrics: dict) -> None:
        """Merge ``metrics`` into a finished round's metrics, in one transaction (a federated evaluate round's
        figures, which arrive after the round stored its model)."""
        with self.tx() as db:
            row = db.one("SELECT state, metrics FROM rounds WHERE round_id=?{for_update}", (round_id,))
            if row is None or row[0] == "open":
                raise StateError(f"round {round_id} is {'unknown' if row is None else 'open'}: only a finished "
                                 "round takes more metrics")
            merged = {**json.loads(row[1] or "{}"), **metrics}
            db.execute("UPDATE rounds SET metrics=? WHERE round_id=?", (json.dumps(merged), round_id))

    def close_round(self, round_id: int, metrics: dict, state: str = "closed") -> None:
        with self.tx() as db:
            db.execute("UPDATE rounds SET state=?, metrics=? WHERE round_id=?", (state, json.dumps(metrics), round_id))

    def round(self, round_id: int) -> RoundRecord | None:
        r = self._one(f"SELECT {self._ROUND_COLS} FROM rounds WHERE round_id=?", (round_id,))
        return self._round(r) if r else None

    def open_rounds(self) -> list[RoundRecord]:
        rows = self._all(f"SELECT {self._ROUND_COLS} FROM rounds WHERE state='open' ORDER BY round_id")
        return [self._round(r) for r in rows]

    def last_round_id(self) -> int:
        return int(self._one("SELECT COALESCE(MAX(round_id), 0) FROM rounds")[0])

    def rounds(self) -> list[RoundRecord]:
        rows = self._all(f"SELECT {self._ROUND_COLS} FROM rounds ORDER BY round_id")
        return [self._round(r) for r in rows]

    @staticmethod
    def _round(r: Any) -> RoundRecord:
        return RoundRecord(int(r[0]), int(r[1]), r[2], float(r[3]), float(r[4]), json.loads(r[5]),
                           json.loads(r[6]), json.loads(r[7]))

    _RAISE_FLOOR = ("INSERT INTO update_seqs (device_id, max_seq) VALUES (?, ?) ON CONFLICT(device_id) DO UPDATE "
                    "SET max_seq={greatest}(update_seqs.max_seq, excluded.max_seq)")

    def add_update(self, round_id: int, device_id: str, seq: int, num_samples: int, envelope: bytes) -> bool:
        """Persist an accepted update and raise the device's replay floor, in one transaction;
        False if this device already sent one this round (nothing changes then)."""
        if not 0 <= int(seq) <= MAX_SEQ:
            raise ValueError(f"seq {seq} is outside 0..{MAX_SEQ}")
        with self.tx() as db:
            cur = db.execute(
                "INSERT INTO round_updates (round_id, device_id, seq, num_samples, received, nbytes, envelope) "
                "VALUES (?,?,?,?,?,?,?) ON CONFLICT (round_id, device_id) DO NOTHING",
                (round_id, device_id, seq, num_samples, time.time(), len(envelope), bytes(envelope)),
            )
            if cur.rowcount != 1:
                return False
            db.execute(self._RAISE_FLOOR, (device_id, seq))
            return True

    def record_seq(self, device_id: str, seq: int) -> None:
        """Raise the device's replay floor (updates accepted without being stored: async mode)."""
        if not 0 <= int(seq) <= MAX_SEQ:
            raise ValueError(f"seq {seq} is outside 0..{MAX_SEQ}")
        with self.tx() as db:
            db.execute(self._RAISE_FLOOR, (device_id, seq))

    def seq_floor(self, device_id: str) -> int | None:
        """The newest seq accepted from ``device_id`` (None: nothing yet)."""
        row = self._one("SELECT max_seq FROM update_seqs WHERE device_id=?", (device_id,))
        return None if row is None else int(row[0])

    def seq_floors(self) -> dict[str, int]:
        """{device: newest accepted seq}: what a restarted gateway refuses as replays."""
        return {r[0]: int(r[1]) for r in self._all("SELECT device_id, max_seq FROM update_seqs")}

    def remove_update(self, round_id: int, device_id: str) -> None:
        """Forget a stored update that turned out not to fit (the device may send again)."""
        with self.tx() as db:
            db.execute("DELETE FROM round_updates WHERE round_id=? AND device_id=?", (round_id, device_id))

    def has_update(self, round_id: int, device_id: str) -> bool:
        return self._one("SELECT 1 FROM round_updates WHERE round_id=? AND device_id=?",
                         (round_id, device_id)) is not None

    def updates(self, round_id: int, *, order: str = "received") -> Iterator[StoredUpdate]:
        """Stored updates of a round, one at a time (streamed, never all in memory), in arrival order or,
        with ``order="device"``, by device id (what the round folds at its close: order-independent)."""
        column = {"received": "received, device_id", "device": "device_id"}[order]
        keys = self._all(f"SELECT device_id FROM round_updates WHERE round_id=? ORDER BY {column}", (round_id,))
        for (device_id,) in keys:
            r = self._one("SELECT seq, num_samples, received, envelope FROM round_updates WHERE round_id=? AND "
                          "device_id=?", (round_id, device_id))
            if r:
                yield StoredUpdate(round_id, device_id, int(r[0]), int(r[1]), float(r[2]), bytes(r[3]))

    def update_count(self, round_id: int) -> int:
        return int(self._one("SELECT COUNT(*) FROM round_updates WHERE round_id=?", (round_id,))[0])

    def drop_updates(self, round_id: int) -> None:
        """Free the envelopes of a finished round (its aggregate is in models)."""
        with self.tx() as db:
            db.execute("DELETE FROM round_updates WHERE round_id=?", (round_id,))

    # -- devices ----------------------------------------------------------------------
    def upsert_birth(self, device_id: str, birth: dict, *, profile: str = "", public_key: str = "",
                     model_version: int | None = None, bdseq: int = -1) -> None:
        now = time.time()
        with self.tx() as db:
            db.execute(
                "INSERT INTO devices (device_id, profile, public_key, online, first_seen, last_seen, model_version, "
                "birth, bdseq) VALUES (?,?,?,1,?,?,?,?,?) ON CONFLICT(device_id) DO UPDATE SET "
                "profile=excluded.profile, "
                "public_key=CASE WHEN excluded.public_key != '' THEN excluded.public_key ELSE devices.public_key END, "
                "online=1, last_seen=excluded.last_seen, model_version=excluded.model_version, "
                "birth=excluded.birth, bdseq=excluded.bdseq",
                (device_id, profile, public_key, now, now, model_version, json.dumps(birth), bdseq),
            )

    def set_online(self, device_id: str, online: bool, *, bdseq: int | None = None) -> bool:
        """Mark liveness; a death with an older bdseq than the last birth is ignored (stale will)."""
        with self.tx() as db:
            row = db.one("SELECT bdseq FROM devices WHERE device_id=?{for_update}", (device_id,))
            if row is None:
                return False
            if not online and bdseq is not None and bdseq >= 0 and row[0] >= 0 and bdseq < row[0]:
                return False
            db.execute("UPDATE devices SET online=?, last_seen=? WHERE device_id=?",
                       (1 if online else 0, time.time(), device_id))
            return True

    def touch(self, device_id: str, *, model_version: int | None = None) -> None:
        with self.tx() as db:
            if model_version is None:
                db.execute("UPDATE devices SET last_seen=?, online=1 WHERE device_id=?", (time.time(), device_id))
            else:
                db.execute("UPDATE devices SET last_seen=?, online=1, model_version=? WHERE device_id=?",
                           (time.time(), model_version, device_id))

    def expire(self, timeout_s: float) -> list[str]:
        """Mark devices silent for longer than ``timeout_s`` offline; returns them."""
        cutoff = time.time() - timeout_s
        with self.tx() as db:
            rows = db.all("UPDATE devices SET online=0 WHERE online=1 AND last_seen < ? RETURNING device_id", (cutoff,))
        return sorted(r[0] for r in rows)

    _DEVICE_COLS = "device_id, profile, public_key, online, first_seen, last_seen, model_version, birth, bdseq"

    def device(self, device_id: str) -> DeviceRecord | None:
        r = self._one(f"SELECT {self._DEVICE_COLS} FROM devices WHERE device_id=?", (device_id,))
        return self._device(r) if r else None

    def devices(self) -> list[DeviceRecord]:
        rows = self._all(f"SELECT {self._DEVICE_COLS} FROM devices ORDER BY device_id")
        return [self._device(r) for r in rows]

    @staticmethod
    def _device(r: Any) -> DeviceRecord:
        return DeviceRecord(r[0], r[1], r[2], bool(r[3]), float(r[4]), float(r[5]),
                            None if r[6] is None else int(r[6]), json.loads(r[7]), int(r[8]))

    # -- telemetry --------------------------------------------------------------------
    _TRIM = ("DELETE FROM telemetry WHERE device_id=? AND ts < (SELECT ts FROM telemetry WHERE device_id=? "
             "ORDER BY ts DESC LIMIT 1 OFFSET ?)")

    def add_telemetry(self, device_id: str, data: dict, ts: float | None = None) -> None:
        self.add_telemetry_batch([(device_id, data, time.time() if ts is None else ts)])

    def add_telemetry_batch(self, items: Iterable[tuple[str, dict, float]]) -> int:
        """Store many ``(device, data, ts)`` rows in one transaction: insert them, mark their
        devices seen, and trim each device's history to its newest ``telemetry_keep`` rows
        (never more: a trim cuts a tenth below the bound, so rows stored between two trims fit
        under it). Returns the number stored."""
        rows = [(d, float(ts), json.dumps(data)) for d, data, ts in items]
        if not rows:
            return 0
        devices = sorted({r[0] for r in rows})  # one lock order for every writer (no deadlock between two)
        now = time.time()
        # Trimming a device costs a walk over its newest rows: do it once per ``every`` rows (and
        # the first time this process sees the device), down to keep - (every - 1) rows, so the
        # rows stored before the next trim leave a device at most telemetry_keep rows.
        every = max(1, self.telemetry_keep // 10)
        target = self.telemetry_keep - (every - 1)
        with self._lock:
            for d, _ts, _data in rows:
                self._since_trim[d] = self._since_trim.get(d, every - 1) + 1
            trim = [d for d in devices if self._since_trim[d] >= every]
        with self.tx() as db:
            db.many("INSERT INTO telemetry (device_id, ts, data) VALUES (?,?,?)", rows)
            db.many("UPDATE devices SET last_seen=?, online=1 WHERE device_id=?", [(now, d) for d in devices])
            if trim:
                db.many(self._TRIM, [(d, d, target - 1) for d in trim])
        with self._lock:
            for d in trim:
                self._since_trim[d] = 0
        return len(rows)

    def telemetry(self, device_id: str, limit: int = 100) -> list[tuple[float, dict]]:
        rows = self._all("SELECT ts, data FROM telemetry WHERE device_id=? ORDER BY ts DESC LIMIT ?", (device_id, limit))
        return [(float(r[0]), json.loads(r[1])) for r in reversed(rows)]

    def telemetry_count(self) -> int:
        return int(self._one("SELECT COUNT(*) FROM telemetry")[0])

    # -- ingestion workers (gateway/ingest.py) ---------------------------------------------
    _INTAKE_OPEN = ("SELECT round_id, model_version, selected, config FROM rounds WHERE round_id=? AND state='open' "
                    "AND round_id NOT IN (SELECT round_id FROM ingest_gate)")

    def intake_round(self, round_id: int) -> Any:
        """(round_id, model_version, selected json, config json) if the round's intake is open."""
        return self._one(self._INTAKE_OPEN, (round_id,))

    def round_row(self, round_id: int) -> Any:
        return self._one("SELECT round_id, model_version, selected, config FROM rounds WHERE round_id=?", (round_id,))

    def open_round_ids(self) -> list[int]:
        return [int(r[0]) for r in self._all("SELECT round_id FROM rounds WHERE state='open' ORDER BY round_id")]

    def claim(self, round_id: int, device_id: str, seq: int, num_samples: int, envelope: bytes,
              worker: str, pid: int | None = None) -> str:
        """Persist an accepted update for ``worker``, in one transaction: "ok", "duplicate"
        (this (round, device) is stored already) or "late" (the round's intake is shut).

        The round's row is held ``FOR SHARE SKIP LOCKED`` (PostgreSQL): claims share it,
        while :meth:`close_gate` takes it ``FOR UPDATE``, so it waits for the claims in
        flight to commit and a claim that meets a closing gate answers "late" at once."""
        if not 0 <= int(seq) <= MAX_SEQ:
            raise ValueError(f"seq {seq} is outside 0..{MAX_SEQ}")
        with self.tx() as db:
            if db.one("SELECT round_id FROM rounds WHERE round_id=? AND state='open'{for_share_skip_locked}",
                      (round_id,)) is None:
                return "late"
            if db.one("SELECT 1 FROM ingest_gate WHERE round_id=?", (round_id,)) is not None:
                return "late"
            cur = db.execute(
                "INSERT INTO round_updates (round_id, device_id, seq, num_samples, received, nbytes, envelope) "
                "VALUES (?,?,?,?,?,?,?) ON CONFLICT (round_id, device_id) DO NOTHING",
                (round_id, device_id, seq, num_samples, time.time(), len(envelope), bytes(envelope)))
            if cur.rowcount != 1:
                return "duplicate"
            db.execute(self._RAISE_FLOOR, (device_id, seq))
            db.execute("INSERT INTO ingest_claims (round_id, device_id, worker, pid) VALUES (?,?,?,?)",
                       (round_id, device_id, worker, os.getpid() if pid is None else pid))
        return "ok"

    def own_claims(self, round_id: int, worker: str) -> list[str]:
        return [r[0] for r in self._all("SELECT device_id FROM ingest_claims WHERE round_id=? AND worker=? "
                                        "ORDER BY device_id", (round_id, worker))]

    def claims(self, round_id: int) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for device, worker in self._all("SELECT device_id, worker FROM ingest_claims WHERE round_id=?", (round_id,)):
            out.setdefault(worker, set()).add(device)
        return out

    def claim_pids(self, round_id: int) -> dict[str, set[int]]:
        """{worker: pids that claimed in the round} (a restarted worker has a new pid)."""
        out: dict[str, set[int]] = {}
        for worker, pid in self._all("SELECT DISTINCT worker, pid FROM ingest_claims WHERE round_id=?", (round_id,)):
            out.setdefault(worker, set()).add(int(pid))
        return out

    def reported(self, round_id: int) -> set[str]:
        return {r[0] for r in self._all("SELECT device_id FROM round_updates WHERE round_id=?", (round_id,))}

    def envelope(self, round_id: int, device_id: str) -> bytes | None:
        r = self._one("SELECT envelope FROM round_updates WHERE round_id=? AND device_id=?", (round_id, device_id))
        return bytes(r[0]) if r else None

    def nbytes(self, round_id: int) -> int:
        return int(self._one("SELECT COALESCE(SUM(nbytes), 0) FROM round_updates WHERE round_id=?", (round_id,))[0])

    def close_gate(self, round_id: int) -> None:
        """Shut the round's intake: after this commits no claim for it succeeds, and every
        claim that did is committed (PostgreSQL: waits on the claims' share locks)."""
        with self.tx() as db:
            db.one("SELECT round_id FROM rounds WHERE round_id=?{for_update}", (round_id,))
            db.execute("INSERT INTO ingest_gate (round_id, closed) VALUES (?,?) ON CONFLICT (round_id) DO NOTHING",
                       (round_id, time.time()))

    def gate_closed(self, round_id: int) -> bool:
        return self._one("SELECT 1 FROM ingest_gate WHERE round_id=?", (round_id,)) is not None

    def put_partial(self, round_id: int, worker: str, devices: list[str], num_clients: int, total_samples: int,
                    extra: dict, sums: bytes) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT INTO ingest_partials (round_id, worker, devices, num_clients, total_samples, losses, sums) "
                "VALUES (?,?,?,?,?,?,?) ON CONFLICT (round_id, worker) DO UPDATE SET devices=excluded.devices, "
                "num_clients=excluded.num_clients, total_samples=excluded.total_samples, losses=excluded.losses, "
                "sums=excluded.sums",
                (round_id, worker, json.dumps(sorted(devices)), num_clients, total_samples, json.dumps(extra),
                 bytes(sums)))

    def partial_rows(self, round_id: int) -> list[tuple[str, list[str], int, int, Any, bytes]]:
        """(worker, devices, num_clients, total_samples, extra, sums) of the round's partials."""
        rows = self._all("SELECT worker, devices, num_clients, total_samples, losses, sums FROM ingest_partials "
                         "WHERE round_id=?", (round_id,))
        return [(w, json.loads(d), int(n), int(t), json.loads(x), bytes(b)) for w, d, n, t, x, b in rows]

    def forget_ingest_before(self, round_id: int) -> None:
        """Drop the ingestion rows of rounds before ``round_id`` (their aggregates are stored models)."""
        with self.tx() as db:
            db.execute("DELETE FROM ingest_gate WHERE round_id < ?", (round_id,))
            db.execute("DELETE FROM ingest_claims WHERE round_id < ?", (round_id,))
            db.execute("DELETE FROM ingest_partials WHERE round_id < ?", (round_id,))

    def heartbeat(self, worker: str, started: float, stats: dict[str, int], *, host: str = "",
                  pid: int | None = None, dead_after_s: float | None = None) -> bool:
        """Renew ``worker``'s lease for ``host``; False (nothing written) when another host holds
        a live lease on that name (its heartbeat younger than ``dead_after_s``): then this
        process must not run the worker, or two clients would fight over one MQTT session.
        ``dead_after_s`` None: always renew (one machine, one supervisor)."""
        now = time.time()
        cond = ""
        args: tuple = (worker, os.getpid() if pid is None else pid, started, now, json.dumps(stats), host)
        if dead_after_s is not None:
            cond = (" WHERE ingest_workers.host = excluded.host OR ingest_workers.host = '' "
                    "OR ingest_workers.seen < ?")
            args += (now - dead_after_s,)
        with self.tx() as db:
            cur = db.execute("INSERT INTO ingest_workers (worker, pid, started, seen, stats, host) VALUES (?,?,?,?,?,?) "
                             "ON CONFLICT(worker) DO UPDATE SET pid=excluded.pid, started=excluded.started, "
                             "seen=excluded.seen, stats=excluded.stats, host=excluded.host" + cond, args)
            return cur.rowcount == 1

    def workers(self) -> dict[str, dict[str, Any]]:
        rows = self._all("SELECT worker, pid, started, seen, stats, host FROM ingest_workers")
        return {w: {"pid": int(pid), "started": float(st), "seen": float(seen), "stats": json.loads(s), "host": h}
                for w, pid, st, seen, s, h in rows}

    def take_over_worker(self, host: str, dead_after_s: float, *, names: Iterable[str] | None = None) -> str | None:
        """Lease one dead worker's name to ``host``: the worker whose heartbeat is older than
        ``dead_after_s`` (and, with ``names``, one of them), or None. Several supervisors may
        call this at once: ``FOR UPDATE SKIP LOCKED`` (PostgreSQL) hands each a different
        name without waiting; whoever runs a worker under that name gets the dead session's
        in-flight and queued updates from the broker."""
        wanted = None if names is None else sorted(set(names))
        if wanted == []:
            return None
        only = "" if wanted is None else f" AND worker IN ({','.join('?' * len(wanted))})"
        cutoff = time.time() - dead_after_s
        with self.tx() as db:
            row = db.one(f"SELECT worker FROM ingest_workers WHERE seen < ?{only} ORDER BY seen, worker LIMIT 1"
                         "{for_update_skip_locked}", (cutoff, *(wanted or ())))
            if row is None:
                return None
            # the lease: seen now, so no other supervisor takes it before the new worker beats
            db.execute("UPDATE ingest_workers SET host=?, seen=? WHERE worker=?", (host, time.time(), row[0]))
            return str(row[0])
