"""Ingestion workers: several gateway processes share one update stream.

Verifying an Ed25519 signature, decoding (dequantizing, densifying) and
folding an update cost CPU per update; one process on one core caps a
gateway at a few hundred updates per second (benchmarks/round_scaling.py).
Here N worker processes share the update topic through an MQTT 5 *shared
subscription* ``$share/<group>/edgeflow/<fleet>/+/update``: the broker hands
each update to one member. Each worker verifies what it gets, persists it,
and folds it into its own partial sum; the coordinator (the gateway's
:class:`~edgeflow.gateway.rounds.RoundManager`, with :class:`SharedIngest`
as its :class:`~edgeflow.gateway.rounds.UpdateSource`) merges the partials
when the round closes.

What Mosquitto 2.0.11 does when a member dies (measured, see
docs/scaling.md): with a clean session the messages it had in flight (sent,
not acknowledged) are *dropped*, not handed to the other members; with a
persistent session they stay in the dead member's session - and the broker
keeps queueing that member's share of *new* messages there - until a client
with the same id reconnects, which then receives all of them. So:

- workers use persistent sessions under stable client ids
  (``<fleet>-ingest-<name>``) and :class:`IngestPool` restarts a dead worker
  under the same name: the broker redelivers everything that was routed to
  it (any process may take the id over; the pool is one supervisor);
- a worker acknowledges an update only after it is *persisted*: the
  transport sends PUBACK after the handler returns, and the handler returns
  after the envelope is committed to the gateway's SQLite state (the shared
  store every worker and the coordinator open, WAL mode);
- each (round, device) is *claimed* once in that store, in the same
  transaction that stores the envelope and checks that the round's intake is
  still open, so a redelivery, a chunked update every worker received, or a
  restarted worker's replay is counted once;
- a worker validates each update as fully as the coordinator would (signature,
  shapes, bounded values, metadata, round nonce, the persisted replay floor)
  before it claims it, and folds it with the round's norm bound and sample
  cap (fixed when the round was opened, stored in the round's row, the same
  rule as :class:`~edgeflow.gateway.strategies.FedAvg`); a round opened
  without bounds (the first one of a fresh state warms them up) is rebuilt by
  the coordinator from the stored envelopes instead of from partials;
- a restarted worker rebuilds its partial from its own stored claims; when
  the round closes the coordinator shuts the intake (the "gate"), waits for
  every claimant's partial (or declares it dead), folds the partials and then
  folds, from the stored envelopes, every claim no partial covers. Every
  stored update enters the aggregate exactly once whoever died when.

Chunked updates cannot be load-balanced (chunks of one transfer would reach
different members): :class:`~edgeflow.transport.MqttTransport` subscribes a
shared filter's chunk sub-filter unshared, so every worker reassembles every
chunked update and the claim picks one. Keep device updates under
``max_payload`` (the default 256 KB holds a dense 60k-parameter model) so the
stream is shared, not broadcast.

Run a worker with ``python -m edgeflow.gateway.ingest worker.json`` (see
:class:`WorkerConfig`).
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import onnx

from edgeflow.codecs import decode_update, peek_update
from edgeflow.errors import AggregationError, CodecError, ConfigError, SignatureError
from edgeflow.federated.messages import RoundAnnouncement, parse_update_meta
from edgeflow.signing import KeyRing
from edgeflow.transport.base import Transport
from edgeflow.transport.topics import device_filter, parse_topic, validate_id

from .privacy import global_norm
from .rounds import RoundManager, model_weights, partial_clients
from .store import MAX_SEQ, GatewayStore

log = logging.getLogger("edgeflow.gateway.ingest")

__all__ = ["IngestPool", "IngestStore", "IngestWorker", "Partial", "SharedIngest", "WorkerConfig", "shared_filter"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ingest_gate (round_id INTEGER PRIMARY KEY, closed REAL NOT NULL);
CREATE TABLE IF NOT EXISTS ingest_claims (
    round_id INTEGER NOT NULL,
    device_id TEXT NOT NULL,
    worker TEXT NOT NULL,
    pid INTEGER NOT NULL,
    PRIMARY KEY (round_id, device_id)
);
CREATE TABLE IF NOT EXISTS ingest_partials (
    round_id INTEGER NOT NULL,
    worker TEXT NOT NULL,
    devices TEXT NOT NULL,
    num_clients INTEGER NOT NULL,
    total_samples INTEGER NOT NULL,
    losses TEXT NOT NULL,
    sums BLOB NOT NULL,
    PRIMARY KEY (round_id, worker)
);
CREATE TABLE IF NOT EXISTS ingest_workers (
    worker TEXT PRIMARY KEY,
    pid INTEGER NOT NULL,
    started REAL NOT NULL,
    seen REAL NOT NULL,
    stats TEXT NOT NULL DEFAULT '{}'
);
"""


def shared_filter(fleet: str, group: str = "ingest") -> str:
    """``$share/<group>/edgeflow/<fleet>/+/update``: the filter the workers share."""
    validate_id(group, "share group")
    return f"$share/{group}/{device_filter(fleet, 'update')}"


@dataclass(frozen=True)
class OpenRound:
    round_id: int
    model_version: int
    selected: frozenset[str]
    nonce: str = ""
    bounds: tuple[float | None, float | None] | None = None
    """(norm bound, sample cap) the round was opened with; None: it warms up at the coordinator."""


def _open_round(row: Any) -> OpenRound:
    cfg = json.loads(row[3]) if row[3] else {}
    b = cfg.get("_bounds")
    return OpenRound(int(row[0]), int(row[1]), frozenset(json.loads(row[2])), str(cfg.get("_nonce") or ""),
                     None if b is None else (b[0], b[1]))


class IngestStore:
    """The ingestion tables in the gateway's SQLite state file, one connection per process.

    Lives beside :class:`~edgeflow.gateway.store.GatewayStore` (same file, its
    ``rounds``/``models``/``round_updates`` tables, plus the ``ingest_*``
    tables made here); several processes write through SQLite's own locking.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path == ":memory:":
            raise ConfigError("ingestion workers share the gateway's state: it must be a file, not ':memory:'")
        GatewayStore(self.path).close()  # the gateway's tables exist (and the schema version matches)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._lock = threading.RLock()
        self._flock = os.open(self.path + ".ingest-lock", os.O_RDWR | os.O_CREAT, 0o600)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            os.close(self._flock)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction, serialized across processes by an advisory file lock
        first: SQLite's own busy handler sleeps 1-100 ms when it finds the database
        locked, longer than a claim takes, so workers contending for it would spend
        more time asleep than writing (benchmarks/round_scaling.py, 2 workers on 2 cores:
        about 1.65x one worker's rate without this lock, 1.9x with it)."""
        with self._lock:
            fcntl.flock(self._flock, fcntl.LOCK_EX)
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            finally:
                fcntl.flock(self._flock, fcntl.LOCK_UN)

    def _one(self, sql: str, args: tuple = ()) -> Any:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple = ()) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- what the workers read ------------------------------------------------
    def open_round(self, round_id: int) -> OpenRound | None:
        """Round ``round_id`` if it is open and its intake is not shut."""
        r = self._one("SELECT round_id, model_version, selected, config FROM rounds WHERE round_id=? AND "
                      "state='open' AND round_id NOT IN (SELECT round_id FROM ingest_gate)", (round_id,))
        return _open_round(r) if r else None

    def round_info(self, round_id: int) -> OpenRound | None:
        """Round ``round_id`` whatever its state (a restarted worker rebuilding its claims)."""
        r = self._one("SELECT round_id, model_version, selected, config FROM rounds WHERE round_id=?", (round_id,))
        return _open_round(r) if r else None

    def seq_floor(self, device_id: str) -> int | None:
        r = self._one("SELECT max_seq FROM update_seqs WHERE device_id=?", (device_id,))
        return None if r is None else int(r[0])

    def open_rounds(self) -> list[int]:
        return [int(r[0]) for r in self._all("SELECT round_id FROM rounds WHERE state='open' ORDER BY round_id")]

    def model(self, version: int) -> bytes | None:
        r = self._one("SELECT onnx FROM models WHERE version=?", (version,))
        return bytes(r[0]) if r else None

    def has_update(self, round_id: int, device_id: str) -> bool:
        return self._one("SELECT 1 FROM round_updates WHERE round_id=? AND device_id=?",
                         (round_id, device_id)) is not None

    # -- the claim: store + dedupe + intake check, one transaction ----------------
    def claim(self, round_id: int, device_id: str, seq: int, num_samples: int, envelope: bytes,
              worker: str) -> str:
        """Persist an accepted update for ``worker``: "ok", "duplicate" or "late" (intake shut)."""
        with self._tx() as db:
            open_ = db.execute("SELECT 1 FROM rounds WHERE round_id=? AND state='open' AND round_id NOT IN "
                               "(SELECT round_id FROM ingest_gate)", (round_id,)).fetchone()
            if open_ is None:
                return "late"
            cur = db.execute(
                "INSERT OR IGNORE INTO round_updates (round_id, device_id, seq, num_samples, received, nbytes, "
                "envelope) VALUES (?,?,?,?,?,?,?)",
                (round_id, device_id, seq, num_samples, time.time(), len(envelope), envelope))
            if cur.rowcount != 1:
                return "duplicate"
            db.execute("INSERT INTO update_seqs (device_id, max_seq) VALUES (?, ?) ON CONFLICT(device_id) DO UPDATE "
                       "SET max_seq=MAX(max_seq, excluded.max_seq)", (device_id, seq))
            db.execute("INSERT INTO ingest_claims (round_id, device_id, worker, pid) VALUES (?,?,?,?)",
                       (round_id, device_id, worker, os.getpid()))
        return "ok"

    def own_claims(self, round_id: int, worker: str) -> list[str]:
        return [r[0] for r in self._all("SELECT device_id FROM ingest_claims WHERE round_id=? AND worker=?",
                                        (round_id, worker))]

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

    # -- the gate and the partials ---------------------------------------------------
    def close_gate(self, round_id: int) -> None:
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO ingest_gate (round_id, closed) VALUES (?,?)", (round_id, time.time()))

    def gate_closed(self, round_id: int) -> bool:
        return self._one("SELECT 1 FROM ingest_gate WHERE round_id=?", (round_id,)) is not None

    def put_partial(self, round_id: int, worker: str, p: "Partial") -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO ingest_partials VALUES (?,?,?,?,?,?,?)",
                       (round_id, worker, json.dumps(sorted(p.devices)), p.num_clients, p.total_samples,
                        json.dumps({"losses": p.losses, "norms": p.norms, "claims": p.claims,
                                    "clipped": p.clipped, "capped": p.capped}), p.to_bytes()))

    def partials(self, round_id: int) -> dict[str, "Partial"]:
        rows = self._all("SELECT worker, devices, num_clients, total_samples, losses, sums FROM ingest_partials "
                         "WHERE round_id=?", (round_id,))
        return {w: Partial.from_row(set(json.loads(d)), n, t, json.loads(ls), bytes(b)) for w, d, n, t, ls, b in rows}

    def forget_before(self, round_id: int) -> None:
        """Drop the ingestion rows of rounds before ``round_id`` (their aggregates are stored models)."""
        with self._tx() as db:
            for table in ("ingest_gate", "ingest_claims", "ingest_partials"):
                db.execute(f"DELETE FROM {table} WHERE round_id < ?", (round_id,))  # noqa: S608 - fixed names

    # -- liveness ------------------------------------------------------------------
    def heartbeat(self, worker: str, started: float, stats: dict[str, int]) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO ingest_workers (worker, pid, started, seen, stats) VALUES (?,?,?,?,?) "
                       "ON CONFLICT(worker) DO UPDATE SET pid=excluded.pid, started=excluded.started, "
                       "seen=excluded.seen, stats=excluded.stats",
                       (worker, os.getpid(), started, time.time(), json.dumps(stats)))

    def workers(self) -> dict[str, dict[str, Any]]:
        rows = self._all("SELECT worker, pid, started, seen, stats FROM ingest_workers")
        return {w: {"pid": pid, "started": st, "seen": seen, "stats": json.loads(s)} for w, pid, st, seen, s in rows}


@dataclass
class Partial:
    """One worker's sum for one round: ``sum_i c_i n_i d_i`` in float64 and ``sum_i n_i``
    (``n_i`` capped, ``c_i`` the norm clip, as FedAvg's default does), the devices in it,
    their reported losses, and the raw norms and claims the coordinator's next
    reference needs."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    total_samples: int = 0
    devices: set[str] = field(default_factory=set)
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    claims: list[int] = field(default_factory=list)
    clipped: int = 0
    capped: int = 0

    @property
    def num_clients(self) -> int:
        return len(self.devices)

    def add(self, device_id: str, tensors: dict[str, np.ndarray], num_samples: int, loss: float | None,
            bounds: tuple[float | None, float | None] | None = None) -> None:
        """Fold one update; with ``bounds`` (norm bound, sample cap) it is clipped and capped."""
        weight = float(num_samples)
        if bounds is not None:
            norm = global_norm(tensors)
            self.norms.append(norm)
            self.claims.append(int(num_samples))
            bound, cap = bounds
            if cap is not None and num_samples > cap:
                num_samples = int(cap)
                self.capped += 1
            weight = float(num_samples)
            if bound is not None and norm > bound:
                weight *= bound / norm if norm > 0 else 0.0
                self.clipped += 1
        for name, arr in tensors.items():
            acc = self.sums.get(name)
            if acc is None:
                self.sums[name] = np.asarray(arr, dtype=np.float64) * weight
            else:
                acc += np.asarray(arr, dtype=np.float64) * weight
        self.total_samples += int(num_samples)
        self.devices.add(device_id)
        if loss is not None:
            self.losses.append(float(loss))

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, **self.sums)
        return buf.getvalue()

    @classmethod
    def from_row(cls, devices: set[str], num_clients: int, total: int, extra: Any, blob: bytes) -> "Partial":
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            sums = {k: z[k] for k in z.files}
        if isinstance(extra, list):  # written by an older worker: the losses only
            extra = {"losses": extra}
        p = cls(sums, int(total), devices, list(extra.get("losses", ())), list(extra.get("norms", ())),
                list(extra.get("claims", ())), int(extra.get("clipped", 0)), int(extra.get("capped", 0)))
        if p.num_clients != num_clients:
            raise AggregationError(f"partial lists {len(devices)} devices but claims {num_clients}")
        return p


# ---------------------------------------------------------------------------
# The coordinator side
# ---------------------------------------------------------------------------


class SharedIngest:
    """The coordinator's :class:`~edgeflow.gateway.rounds.UpdateSource`: updates come from the
    ingestion workers through the shared store, not from the manager's own subscription.

    ``merge_timeout_s`` bounds the wait for the partials of workers that
    claimed updates; ``dead_after_s`` is the heartbeat age after which a
    worker is not waited for (its claims are folded from the store).
    """

    def __init__(self, *, merge_timeout_s: float = 10.0, dead_after_s: float = 3.0) -> None:
        self.merge_timeout_s = merge_timeout_s
        self.dead_after_s = dead_after_s
        self.db: IngestStore | None = None
        self.last_merge: dict[str, Any] = {}

    def attach(self, rounds: RoundManager) -> None:
        self.db = IngestStore(rounds.store.path)

    def poll(self, rounds: RoundManager, ann: RoundAnnouncement) -> None:
        assert self.db is not None
        rounds._reported = self.db.reported(ann.round_id)

    def _await_partials(self, round_id: int) -> dict[str, Partial]:
        assert self.db is not None
        end = time.time() + self.merge_timeout_s
        while True:
            claims = self.db.claims(round_id)
            parts = self.db.partials(round_id)
            workers = self.db.workers()
            waiting = [w for w in claims if w not in parts
                       and time.time() - workers.get(w, {}).get("seen", 0.0) < self.dead_after_s]
            if not waiting or time.time() >= end:
                if waiting:
                    log.warning("round %d: no partial from worker(s) %s; folding their updates from the store",
                                round_id, waiting)
                return parts
            time.sleep(0.05)

    def merge(self, rounds: RoundManager, ann: RoundAnnouncement) -> None:
        """Shut the intake, then rebuild the round's aggregate: worker partials, plus every
        stored update that no partial covers (a worker that died and was not restarted)."""
        assert self.db is not None
        r = ann.round_id
        self.db.close_gate(r)
        self.db.forget_before(r)
        parts = self._await_partials(r)
        claims = self.db.claims(r)
        stored = self.db.reported(r)
        covered: set[str] = set()
        folded: list[str] = []
        losses: list[float] = []
        dense = 0
        shapes = {k: v.shape for k, v in rounds.weights.items()}
        dtypes = {k: v.dtype for k, v in rounds.weights.items()}
        info = self.db.round_info(r)
        robust = bool(getattr(rounds._agg, "robust", False)) and rounds.contributions == "updates"
        bounds = info.bounds if info is not None else None
        if robust and bounds is None:  # opened while warming up: the coordinator folds every update itself
            if parts:
                log.info("round %d: opened without norm bounds (first round); folding all %d stored update(s) "
                         "here instead of %d partial(s)", r, len(stored), len(parts))
            parts = {}
        with rounds._lock:
            agg = rounds._agg
            agg.begin_round(rounds.weights, round_id=r)
            if robust and bounds is not None:
                agg.set_round_bounds(*bounds)
            for worker, p in sorted(parts.items()):
                if not p.devices or not p.devices <= claims.get(worker, set()) or p.devices & covered:
                    log.warning("round %d: partial of %s does not match its claims; using the store", r, worker)
                    continue
                summed = {k: np.asarray(p.sums[k], dtype=dtypes[k]) for k in shapes}
                stats = ({"norms": p.norms, "claims": p.claims, "clipped": p.clipped, "capped": p.capped}
                         if robust else {})
                agg.add_partial(summed, total_samples=p.total_samples, num_clients=p.num_clients,
                                client_id=f"ingest:{worker}", **stats)
                covered |= p.devices
                losses += p.losses
            for device in sorted(stored - covered):
                env = self.db.envelope(r, device)
                try:
                    upd = decode_update(env, verifier=rounds.keyring, require_signature=True, expected_shapes=shapes)
                    meta = parse_update_meta(upd.metadata, device)
                except (CodecError, SignatureError) as exc:  # pragma: no cover - workers validated them
                    log.warning("round %d: stored update of %s unreadable: %s", r, device, exc)
                    continue
                tensors = {k: np.asarray(v, dtype=dtypes[k]) for k, v in upd.tensors.items()}
                if rounds.contributions == "partials":
                    agg.add_partial(tensors, total_samples=meta.num_samples,
                                    num_clients=partial_clients(upd.metadata, device), client_id=device)
                else:
                    agg.add(tensors, meta.num_samples, client_id=device)
                folded.append(device)
                if meta.loss is not None:
                    losses.append(meta.loss)
            for k in shapes:
                dense += 4 * int(np.prod(shapes[k]))
            rounds._reported = covered | set(folded)
            rounds._losses = losses
            rounds._bytes_in = self.db.nbytes(r)
            rounds._dense_bytes = dense * len(rounds._reported)
        self.last_merge = {"round_id": r, "partials": {w: sorted(p.devices) for w, p in parts.items()},
                           "from_store": folded, "claims": {w: sorted(d) for w, d in claims.items()},
                           "claim_pids": {w: sorted(p) for w, p in self.db.claim_pids(r).items()}}
        log.info("round %d: merged %d partial(s) covering %d update(s), %d more from the store",
                 r, len(parts), len(covered), len(folded))


# ---------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------


@dataclass
class WorkerConfig:
    """One ingestion worker (the JSON file given to ``python -m edgeflow.gateway.ingest``)."""

    name: str
    broker: str
    state: str
    fleet: str
    keyring: str
    """A :class:`~edgeflow.signing.KeyRing` JSON file: the devices' public keys."""
    group: str = "ingest"
    client_id: str | None = None
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    session_expiry_s: int = 3600
    heartbeat_s: float = 0.5
    delay_s: float = 0.0
    """Extra seconds per update before it is persisted (tests: keeps messages in flight)."""
    connect_at: float | None = None
    """Wall-clock time (epoch s) to connect at: benchmarks start several workers together."""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        validate_id(self.name, "worker name")
        validate_id(self.fleet, "fleet id")
        validate_id(self.group, "share group")

    @property
    def mqtt_client_id(self) -> str:
        return self.client_id or f"{self.fleet}-ingest-{self.name}"

    @classmethod
    def load(cls, path: str | Path) -> "WorkerConfig":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown worker setting(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


class IngestWorker:
    """Takes its share of the update stream: verify, persist (claim), fold; write its
    partial when the coordinator shuts the round's intake. See the module docstring."""

    def __init__(self, cfg: WorkerConfig, transport: Transport | None = None) -> None:
        self.cfg = cfg
        self.db = IngestStore(cfg.state)
        self.keyring = KeyRing.load(cfg.keyring)
        if transport is None:
            from edgeflow.transport import MqttTransport
            from edgeflow.transport.message import TlsConfig

            kwargs: dict[str, Any] = {}
            if cfg.ca_file:
                kwargs["tls"] = TlsConfig(ca_file=cfg.ca_file)
            transport = MqttTransport.from_url(cfg.broker, client_id=cfg.mqtt_client_id, clean_start=False,
                                               session_expiry_s=cfg.session_expiry_s, username=cfg.username,
                                               password=cfg.password, **kwargs)
        self.transport = transport
        self._lock = threading.Lock()
        self._partials: dict[int, Partial] = {}
        self._written: set[int] = set()
        self._shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        self._stop = threading.Event()
        self.started = time.time()
        self.stats: dict[str, int] = {k: 0 for k in ("received", "claimed", "duplicate", "late", "rejected",
                                                        "not_selected", "rebuilt")}

    # -- startup: a restarted worker picks up its own stored claims ---------------
    def _rebuild(self) -> None:
        for r in self.db.open_rounds():
            devices = self.db.own_claims(r, self.cfg.name)
            if not devices:
                continue
            info = self.db.round_info(r)
            p = self._partials.setdefault(r, Partial())
            for d in devices:
                try:
                    upd = decode_update(self.db.envelope(r, d), verifier=self.keyring, require_signature=True)
                    meta = parse_update_meta(upd.metadata, d)
                except (CodecError, SignatureError) as exc:  # claimed ones were valid
                    log.warning("worker %s: stored claim of %s unreadable (%s); the coordinator folds it",
                                self.cfg.name, d, exc)
                    continue
                p.add(d, upd.tensors, meta.num_samples, meta.loss, info.bounds if info is not None else None)
                self.stats["rebuilt"] += 1
            log.info("worker %s: rebuilt round %d partial from %d stored claim(s)", self.cfg.name, r, len(devices))

    def _expected_shapes(self, version: int) -> dict[str, tuple[int, ...]] | None:
        shapes = self._shapes.get(version)
        if shapes is None:
            blob = self.db.model(version)
            if blob is None:
                return None
            shapes = {k: v.shape for k, v in model_weights(onnx.load_model_from_string(blob)).items()}
            self._shapes[version] = shapes
        return shapes

    # -- the handler (transport worker thread; PUBACK goes out when it returns) --------
    def on_update(self, msg: Any) -> None:
        try:
            self._on_update(msg)
        except Exception:  # noqa: BLE001 - one message must never take the transport's worker thread down
            self.stats["rejected"] += 1
            log.exception("worker %s: update on %s dropped after an unexpected failure (a bug: please report it)",
                          self.cfg.name, msg.topic)

    def _on_update(self, msg: Any) -> None:
        self.stats["received"] += 1
        info = parse_topic(msg.topic)
        sender = info.device if info else None
        try:
            head = peek_update(msg.payload)
        except CodecError:
            self.stats["rejected"] += 1
            return
        if head.device_id != sender:
            self.stats["rejected"] += 1
            return
        rnd = self.db.open_round(head.round_id)
        if rnd is None:
            self.stats["late"] += 1
            return
        if rnd.selected and sender not in rnd.selected:
            self.stats["not_selected"] += 1
            return
        if self.db.has_update(rnd.round_id, sender):  # a redelivery, or a chunked update another worker took
            self.stats["duplicate"] += 1
            return
        shapes = self._expected_shapes(rnd.model_version)
        try:
            upd = decode_update(msg.payload, verifier=self.keyring, require_signature=True, expected_shapes=shapes,
                                source=f"ingest {self.cfg.name}<-{sender}")
            meta = parse_update_meta(upd.metadata, sender or "")
            problem = None
            if upd.seq > MAX_SEQ:
                problem = f"seq {upd.seq} above {MAX_SEQ}"
            elif rnd.nonce and meta.nonce is not None and meta.nonce != rnd.nonce:
                problem = "it answers another round with the same id (round nonce differs): a replay"
            elif (floor := self.db.seq_floor(sender)) is not None and upd.seq <= floor:
                problem = f"seq {upd.seq} is not above the {floor} accepted before: a replay"
            elif (meta.base_version if meta.base_version is not None else rnd.model_version) != rnd.model_version:
                problem = (f"rejected_wrong_version: trained from v{meta.base_version}, "
                           f"the round trains v{rnd.model_version}")
            if problem is not None:
                raise CodecError(f"update from {sender!r} refused: {problem}")
        except (CodecError, SignatureError) as exc:
            self.stats["rejected"] += 1
            log.warning("worker %s: update from %s refused: %s", self.cfg.name, sender, exc)
            return
        if self.cfg.delay_s:
            time.sleep(self.cfg.delay_s)
        with self._lock:
            outcome = self.db.claim(rnd.round_id, sender, upd.seq, meta.num_samples, bytes(msg.payload),
                                    self.cfg.name)
            self.stats["claimed" if outcome == "ok" else outcome] += 1
            if outcome == "ok":
                self._partials.setdefault(rnd.round_id, Partial()).add(
                    sender, upd.tensors, meta.num_samples, meta.loss, rnd.bounds)

    # -- housekeeping thread: heartbeat, write partials of shut rounds -------------
    def _housekeeping(self) -> None:
        next_beat = 0.0
        while not self._stop.wait(0.05):
            now = time.time()
            if now >= next_beat:
                self.db.heartbeat(self.cfg.name, self.started, dict(self.stats))
                next_beat = now + self.cfg.heartbeat_s
            with self._lock:
                rounds = list(self._partials)
            for r in rounds:
                if r in self._written or not self.db.gate_closed(r):
                    continue
                with self._lock:
                    p = self._partials.pop(r)
                    self._written.add(r)
                self.db.put_partial(r, self.cfg.name, p)
                log.info("worker %s: round %d partial of %d update(s) written", self.cfg.name, r, p.num_clients)

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT or :meth:`stop`."""
        self._rebuild()
        self.transport.subscribe(shared_filter(self.cfg.fleet, self.cfg.group), self.on_update)
        if self.cfg.connect_at is not None:
            self._stop.wait(max(0.0, self.cfg.connect_at - time.time()))
        self.transport.connect(timeout=30)
        hk = threading.Thread(target=self._housekeeping, name=f"ingest-{self.cfg.name}", daemon=True)
        hk.start()
        log.info("worker %s ready (pid %d, %s)", self.cfg.name, os.getpid(), shared_filter(self.cfg.fleet, self.cfg.group))
        try:
            while not self._stop.wait(0.2):
                pass
        finally:
            hk.join(2)
            self.transport.close(timeout=2)
            self.db.close()

    def stop(self) -> None:
        self._stop.set()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m edgeflow.gateway.ingest WORKER.json", file=sys.stderr)
        return 2
    cfg = WorkerConfig.load(args[0])
    logging.basicConfig(level=cfg.log_level, format=f"ingest[{cfg.name}] %(levelname)s %(message)s")
    worker = IngestWorker(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    worker.run()
    return 0


# ---------------------------------------------------------------------------
# A supervisor
# ---------------------------------------------------------------------------


class IngestPool:
    """Runs N worker processes and restarts any that dies under the same name (so the
    broker hands it the dead session's in-flight and queued updates)."""

    def __init__(self, base: WorkerConfig, names: list[str], *, workdir: str | Path, restart: bool = True,
                 python: str = sys.executable) -> None:
        self.base = base
        self.names = [validate_id(n, "worker name") for n in names]
        self.workdir = Path(workdir)
        self.restart = restart
        self.python = python
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {n: 0 for n in self.names}
        self.pids: dict[str, list[int]] = {n: [] for n in self.names}
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()

    def _spawn(self, name: str) -> None:
        cfg = WorkerConfig(**{**asdict(self.base), "name": name})
        path = self.workdir / f"ingest-{name}.json"
        path.write_text(json.dumps(asdict(cfg)), encoding="utf-8")
        log_file = open(self.workdir / f"ingest-{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen([self.python, "-m", "edgeflow.gateway.ingest", str(path)],  # noqa: S603
                                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log_file.close()
        self.procs[name] = proc
        self.pids[name].append(proc.pid)

    def start(self) -> "IngestPool":
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            for n in self.names:
                self._spawn(n)
        self._monitor = threading.Thread(target=self._watch, name="ingest-pool", daemon=True)
        self._monitor.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                for n, p in list(self.procs.items()):
                    if p.poll() is not None and self.restart and not self._stop.is_set():
                        log.warning("ingest worker %s (pid %d) exited with %s; restarting", n, p.pid, p.returncode)
                        self.restarts[n] += 1
                        self._spawn(n)

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """True once every current worker process has sent a heartbeat (it subscribed and connected)."""
        db = IngestStore(self.base.state)
        try:
            end = time.time() + timeout
            while time.time() < end:
                w = db.workers()
                with self._lock:
                    want = {n: p.pid for n, p in self.procs.items()}
                if all(w.get(n, {}).get("pid") == pid for n, pid in want.items()):
                    return True
                time.sleep(0.05)
            return False
        finally:
            db.close()

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        pid = self.procs[name].pid
        os.kill(pid, sig)
        return pid

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(2)
        with self._lock:
            for p in self.procs.values():
                if p.poll() is None:
                    p.terminate()
            for p in self.procs.values():
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)

    def logs(self) -> str:
        return "\n".join((self.workdir / f"ingest-{n}.log").read_text(errors="replace")
                         for n in self.names if (self.workdir / f"ingest-{n}.log").exists())


if __name__ == "__main__":
    raise SystemExit(main())
