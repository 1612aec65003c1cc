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
  after the envelope is committed to the gateway's state — the one store
  (:mod:`edgeflow.gateway.store`) every worker and the coordinator open: a
  SQLite file (workers on one machine) or PostgreSQL (workers on any machine).
  If the store cannot take it (a server restart), the worker retries, and after
  ``store_retry_s`` exits *without* acknowledging, so the broker hands the
  update to its successor;
- several machines: each worker holds a lease on its name in the store
  (``ingest_workers``: host, heartbeat). A supervisor (:class:`IngestPool`) on
  another host takes over the name of a worker whose heartbeat stopped
  (``FOR UPDATE SKIP LOCKED``: two supervisors never take the same one) and
  runs it there under the same client id; a worker that finds its lease held
  by another live host exits instead of fighting over the MQTT session;
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

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from edgeflow.child_python import module_command
from edgeflow.codecs import peek_update
from edgeflow.errors import AggregationError, CodecError, ConfigError, SignatureError, StateError
from edgeflow.protocol.rounds import RoundAnnouncement
from edgeflow.signing import KeyRing
from edgeflow.transport.base import Transport
from edgeflow.transport.topics import device_filter, parse_topic, validate_id

from .intake import CheckedUpdate, RoundView, check_update, screen
from .aggregate import bound_update, global_norm
from .rounds import RoundManager, model_weights
from .store import GatewayStore, StoreError, StoreTarget, parse_store_url

log = logging.getLogger("edgeflow.gateway.ingest")

EXIT_LEASE_LOST = 76
"""A worker's exit status when another host holds its name's lease (its supervisor does not restart it)."""
EXIT_CONFIG = 2
"""A worker's exit status for a configuration it cannot run with (one line on stderr; not restarted)."""
EXIT_STORE_DOWN = 75
"""A worker's exit status after the store refused an update for ``store_retry_s`` (restart it)."""

__all__ = ["IngestPool", "IngestStore", "IngestWorker", "Partial", "SharedIngest", "WorkerConfig", "shared_filter"]

def shared_filter(fleet: str, group: str = "ingest") -> str:
    """``$share/<group>/edgeflow/<fleet>/+/update``: the filter the workers share."""
    validate_id(group, "share group")
    return f"$share/{group}/{device_filter(fleet, 'update')}"


@dataclass(frozen=True)
class StoredRound:
    """A round as the store records it (what a worker needs to check updates against it)."""

    round_id: int
    model_version: int
    selected: frozenset[str]
    nonce: str = ""
    bounds: tuple[float | None, float | None] | None = None
    """(norm bound, sample cap) the round was opened with; None: it warms up at the coordinator."""

    def view(self) -> RoundView:
        return RoundView(self.round_id, self.model_version, self.selected, self.nonce)


def _open_round(row: Any) -> StoredRound:
    cfg = json.loads(row[3]) if row[3] else {}
    b = cfg.get("_bounds")
    return StoredRound(int(row[0]), int(row[1]), frozenset(json.loads(row[2])), str(cfg.get("_nonce") or ""),
                     None if b is None else (b[0], b[1]))


class IngestStore:
    """The ingestion side of the gateway's one store (:class:`~edgeflow.gateway.store.GatewayStore`,
    opened ``shared``: one connection per process), in the workers' terms.

    ``target`` is the gateway's state: its SQLite file (workers on the same
    machine) or its ``postgresql://`` URL (workers on any machine). The tables
    (``ingest_gate``, ``ingest_claims``, ``ingest_partials``, ``ingest_workers``)
    are part of the store's schema (:mod:`edgeflow.gateway.store.migrations`).
    """

    def __init__(self, target: Any) -> None:
        t = target if isinstance(target, StoreTarget) else parse_store_url(target)
        if t.engine == "sqlite" and t.path == ":memory:":
            raise ConfigError("ingestion workers share the gateway's state: it must be a file or a postgresql:// "
                              "URL, not ':memory:'")
        self.store = GatewayStore(t, shared=True)
        self.path = self.store.path

    def close(self) -> None:
        self.store.close()

    # -- what the workers read ------------------------------------------------
    def open_round(self, round_id: int) -> StoredRound | None:
        """Round ``round_id`` if it is open and its intake is not shut."""
        r = self.store.intake_round(round_id)
        return _open_round(r) if r else None

    def round_info(self, round_id: int) -> StoredRound | None:
        """Round ``round_id`` whatever its state (a restarted worker rebuilding its claims)."""
        r = self.store.round_row(round_id)
        return _open_round(r) if r else None

    def seq_floor(self, device_id: str) -> int | None:
        return self.store.seq_floor(device_id)

    def open_rounds(self) -> list[int]:
        return self.store.open_round_ids()

    def model(self, version: int) -> bytes | None:
        m = self.store.model(version)
        return None if m is None else m[0]

    def has_update(self, round_id: int, device_id: str) -> bool:
        return self.store.has_update(round_id, device_id)

    # -- the claim: store + dedupe + intake check, one transaction ----------------
    def claim(self, round_id: int, device_id: str, seq: int, num_samples: int, envelope: bytes,
              worker: str) -> str:
        """Persist an accepted update for ``worker``: "ok", "duplicate" or "late" (intake shut)."""
        return self.store.claim(round_id, device_id, seq, num_samples, envelope, worker)

    def own_claims(self, round_id: int, worker: str) -> list[str]:
        return self.store.own_claims(round_id, worker)

    def claims(self, round_id: int) -> dict[str, set[str]]:
        return self.store.claims(round_id)

    def claim_pids(self, round_id: int) -> dict[str, set[int]]:
        """{worker: pids that claimed in the round} (a restarted worker has a new pid)."""
        return self.store.claim_pids(round_id)

    def reported(self, round_id: int) -> set[str]:
        return self.store.reported(round_id)

    def envelope(self, round_id: int, device_id: str) -> bytes | None:
        return self.store.envelope(round_id, device_id)

    def nbytes(self, round_id: int) -> int:
        return self.store.nbytes(round_id)

    # -- the gate and the partials ---------------------------------------------------
    def close_gate(self, round_id: int) -> None:
        self.store.close_gate(round_id)

    def gate_closed(self, round_id: int) -> bool:
        return self.store.gate_closed(round_id)

    def put_partial(self, round_id: int, worker: str, p: "Partial") -> None:
        self.store.put_partial(round_id, worker, sorted(p.devices), p.num_clients, p.total_samples,
                               {"losses": p.losses, "norms": p.norms, "claims": p.claims,
                                "clipped": p.clipped, "capped": p.capped}, p.to_bytes())

    def partials(self, round_id: int) -> dict[str, "Partial"]:
        return {w: Partial.from_row(set(d), n, t, x, b) for w, d, n, t, x, b in self.store.partial_rows(round_id)}

    def forget_before(self, round_id: int) -> None:
        """Drop the ingestion rows of rounds before ``round_id`` (their aggregates are stored models)."""
        self.store.forget_ingest_before(round_id)

    # -- liveness and leases -------------------------------------------------------
    def heartbeat(self, worker: str, started: float, stats: dict[str, int], *, host: str = "",
                  dead_after_s: float | None = None) -> bool:
        return self.store.heartbeat(worker, started, stats, host=host, dead_after_s=dead_after_s)

    def workers(self) -> dict[str, dict[str, Any]]:
        return self.store.workers()

    def take_over(self, host: str, dead_after_s: float, names: list[str]) -> str | None:
        return self.store.take_over_worker(host, dead_after_s, names=names)


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

    def add_update(self, upd: CheckedUpdate, bounds: tuple[float | None, float | None] | None = None) -> None:
        """Fold one checked update (gateway/intake.py)."""
        self.add(upd.device_id, upd.tensors, upd.meta.num_samples, upd.meta.loss, bounds)

    def add(self, device_id: str, tensors: dict[str, np.ndarray], num_samples: int, loss: float | None,
            bounds: tuple[float | None, float | None] | None = None) -> None:
        """Fold one update; with ``bounds`` (norm bound, sample cap) it is clipped and capped by the
        one rule (:func:`edgeflow.gateway.aggregate.bound_update`)."""
        weight = float(num_samples)
        if bounds is not None:
            norm = global_norm(tensors)
            self.norms.append(norm)
            self.claims.append(int(num_samples))
            b = bound_update(norm, num_samples, *bounds)
            self.capped += b.capped
            self.clipped += b.clipped
            num_samples, weight = int(b.counted), b.weight
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

    folds_partials = True  # the workers hand over partial sums, never each update (RoundManager checks)

    def attach(self, rounds: RoundManager) -> None:
        self.db = IngestStore(rounds.store.url)

    def poll(self, rounds: RoundManager, ann: RoundAnnouncement) -> None:
        assert self.db is not None
        rounds.open.set_reported(self.db.reported(ann.round_id))

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
        dtypes = {k: v.dtype for k, v in rounds.weights.items()}
        info = self.db.round_info(r)
        view = info.view() if info is not None else RoundView(r, ann.model_version, frozenset(ann.selected), ann.nonce)
        open_round = rounds.open
        robust = bool(getattr(open_round.agg, "robust", False)) and rounds.contributions == "updates"
        bounds = info.bounds if info is not None else None
        if robust and bounds is None:  # opened while warming up: the coordinator folds every update itself
            if parts:
                log.info("round %d: opened without norm bounds (first round); folding all %d stored update(s) "
                         "here instead of %d partial(s)", r, len(stored), len(parts))
            parts = {}
        with open_round.lock:
            agg = open_round.agg
            agg.begin_round(rounds.weights, round_id=r)
            if robust and bounds is not None:
                agg.set_round_bounds(*bounds)
            for worker, p in sorted(parts.items()):
                if not p.devices or not p.devices <= claims.get(worker, set()) or p.devices & covered:
                    log.warning("round %d: partial of %s does not match its claims; using the store", r, worker)
                    continue
                summed = {k: np.asarray(p.sums[k], dtype=dtypes[k]) for k in dtypes}
                stats = ({"norms": p.norms, "claims": p.claims, "clipped": p.clipped, "capped": p.capped}
                         if robust else {})
                agg.add_partial(summed, total_samples=p.total_samples, num_clients=p.num_clients,
                                client_id=f"ingest:{worker}", **stats)
                covered |= p.devices
                losses += p.losses
            for device in sorted(stored - covered):
                try:  # the workers checked it before claiming; the coordinator checks again what it folds
                    upd = check_update(self.db.envelope(r, device), view, keyring=rounds.keyring, like=rounds.weights,
                                       seq_floor=None, partials=rounds.contributions == "partials")
                except (CodecError, SignatureError) as exc:
                    log.warning("round %d: stored update of %s refused at the merge: %s", r, device, exc)
                    continue
                if rounds.contributions == "partials":
                    agg.add_partial(upd.tensors, total_samples=upd.meta.num_samples, num_clients=upd.num_clients,
                                    client_id=device)
                else:
                    agg.add(upd.tensors, upd.meta.num_samples, client_id=device)
                folded.append(device)
                if upd.meta.loss is not None:
                    losses.append(upd.meta.loss)
            dense = sum(4 * int(v.size) for v in rounds.weights.values())
            reported = covered | set(folded)
            open_round.replace_intake(reported=reported, losses=losses, bytes_in=self.db.nbytes(r),
                                      dense_bytes=dense * len(reported))
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
    """The gateway's state: its SQLite file (same machine) or ``postgresql://`` URL (any machine)."""
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
    host: str = ""
    """Who holds this worker's lease (default: the machine's host name)."""
    lease_s: float | None = None
    """Refuse to run while another host's lease on this name is younger than this (None: one
    machine, the supervisor alone decides; set it when several hosts may take names over)."""
    store_retry_s: float = 30.0
    """How long a worker retries an update the store could not take (server restart) before it
    exits unacknowledged, so that the broker redelivers it to the worker's successor."""

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
            from edgeflow.transport.factory import transport_from_url
            from edgeflow.transport.message import TlsConfig

            kwargs: dict[str, Any] = {}
            if cfg.ca_file:
                kwargs["tls"] = TlsConfig(ca_file=cfg.ca_file)
            transport = transport_from_url(cfg.broker, client_id=cfg.mqtt_client_id, clean_start=False,
                                               session_expiry_s=cfg.session_expiry_s, username=cfg.username,
                                               password=cfg.password, **kwargs)
        self.transport = transport
        self._lock = threading.Lock()
        self._partials: dict[int, Partial] = {}
        self._written: set[int] = set()
        self._models: dict[int, dict[str, np.ndarray]] = {}
        self._stop = threading.Event()
        self.started = time.time()
        self.stats: dict[str, int] = {k: 0 for k in ("received", "claimed", "duplicate", "late", "rejected",
                                                        "not_selected", "rebuilt", "connected")}

    # -- startup: a restarted worker picks up its own stored claims ---------------
    def _rebuild(self) -> None:
        for r in self.db.open_rounds():
            devices = self.db.own_claims(r, self.cfg.name)
            if not devices:
                continue
            info = self.db.round_info(r)
            p = self._partials.setdefault(r, Partial())
            if info is None:
                continue
            view = info.view()
            # the shapes of the model the round trains, as the live path and the round manager decode with:
            # an update sent with the layout digest (envelope v3) carries no names or shapes of its own
            like = self._like(info.model_version)
            for d in devices:
                try:
                    upd = check_update(self.db.envelope(r, d), view, keyring=self.keyring, like=like, seq_floor=None)
                except (CodecError, SignatureError) as exc:  # claimed ones were valid
                    log.warning("worker %s: stored claim of %s unreadable (%s); the coordinator folds it",
                                self.cfg.name, d, exc)
                    continue
                p.add_update(upd, info.bounds)
                self.stats["rebuilt"] += 1
            log.info("worker %s: rebuilt round %d partial from %d stored claim(s)", self.cfg.name, r, len(devices))

    def _like(self, version: int) -> dict[str, np.ndarray] | None:
        """Stand-ins with the names, shapes and dtypes of model ``version``'s federated tensors (no data
        held), or None when the store does not have that version."""
        like = self._models.get(version)
        if like is None:
            blob = self.db.model(version)
            if blob is None:
                return None
            like = {k: np.broadcast_to(np.zeros((), v.dtype), v.shape)
                    for k, v in model_weights(onnx.load_model_from_string(blob)).items()}
            self._models[version] = like
        return like

    # -- the handler (transport worker thread; PUBACK goes out when it returns) --------
    def on_update(self, msg: Any) -> None:
        self.stats["received"] += 1
        end = time.monotonic() + self.cfg.store_retry_s
        wait = 0.05
        while True:
            try:
                self._on_update(msg)
                return
            except StoreError as exc:
                # The store could not take it (server restart, network cut): retry the whole
                # (idempotent) handling; the update is not acknowledged while we do.
                self.stats["store_retries"] = self.stats.get("store_retries", 0) + 1
                if time.monotonic() >= end or self._stop.is_set():
                    log.error("worker %s: the state store refused an update for %.0f s (%s); exiting without "
                              "acknowledging it, so the broker hands it to this worker's successor",
                              self.cfg.name, self.cfg.store_retry_s, exc)
                    os._exit(EXIT_STORE_DOWN)
                log.warning("worker %s: store unavailable (%s); retrying in %.2f s", self.cfg.name, exc, wait)
                time.sleep(wait)
                wait = min(wait * 2, 1.0)
            except Exception:  # noqa: BLE001 - one message must never take the transport's worker thread down
                self._refuse("internal")
                log.exception("worker %s: update on %s dropped after an unexpected failure (a bug: please report "
                              "it)", self.cfg.name, msg.topic)
                return

    _SCREEN_STATS = {"late": "late", "not_selected": "not_selected", "duplicates": "duplicate"}

    def _refuse(self, reason: str) -> None:
        """An update refused: ``rejected`` and ``rejected_<reason>``, the coordinator's reason codes (the
        heartbeat stores them; the web view's /metrics sums them over the workers)."""
        self.stats["rejected"] += 1
        self.stats["rejected_" + reason] = self.stats.get("rejected_" + reason, 0) + 1

    def _on_update(self, msg: Any) -> None:
        """The coordinator's rulebook (gateway/intake.py) against the round as the store has it, then the claim."""
        info = parse_topic(msg.topic)
        sender = info.device if info else None
        try:
            head = peek_update(msg.payload)
        except CodecError:
            self._refuse("malformed")
            return
        rnd = self.db.open_round(head.round_id)
        view = None if rnd is None else rnd.view()
        # a redelivery, or a chunked update another worker took, has a stored claim
        why = screen(head, sender, view, lambda d: self.db.has_update(head.round_id, d))
        if why is not None:
            if why.startswith("rejected_"):
                self._refuse(why[len("rejected_"):])
            else:
                self.stats[self._SCREEN_STATS[why]] += 1
            return
        assert rnd is not None and view is not None
        try:
            upd = check_update(bytes(msg.payload), view, keyring=self.keyring, like=self._like(rnd.model_version),
                               seq_floor=self.db.seq_floor(head.device_id), source=f"ingest {self.cfg.name}<-{sender}")
        except (CodecError, SignatureError) as exc:
            self._refuse(getattr(exc, "reason", "invalid"))
            log.warning("worker %s: update from %s refused (rejected_%s): %s", self.cfg.name, sender,
                        getattr(exc, "reason", "invalid"), exc)
            return
        if self.cfg.delay_s:
            time.sleep(self.cfg.delay_s)
        with self._lock:
            outcome = self.db.claim(rnd.round_id, upd.device_id, upd.seq, upd.meta.num_samples, upd.payload,
                                    self.cfg.name)
            self.stats["claimed" if outcome == "ok" else outcome] += 1
            if outcome == "ok":
                self._partials.setdefault(rnd.round_id, Partial()).add_update(upd, rnd.bounds)

    # -- housekeeping thread: heartbeat, write partials of shut rounds -------------
    @property
    def host(self) -> str:
        return self.cfg.host or socket.gethostname()

    def _beat(self) -> bool:
        """Renew the lease; False if another host holds it (see :attr:`WorkerConfig.lease_s`)."""
        return self.db.heartbeat(self.cfg.name, self.started, dict(self.stats), host=self.host,
                                 dead_after_s=self.cfg.lease_s)

    def _housekeeping(self) -> None:
        next_beat = 0.0
        while not self._stop.wait(0.05):
            try:
                self._housekeeping_step(next_beat)
            except StoreError as exc:  # the server is back soon, or the lease runs out and a peer takes over
                log.warning("worker %s: housekeeping: %s", self.cfg.name, exc)
                continue
            now = time.time()
            if now >= next_beat:
                next_beat = now + self.cfg.heartbeat_s

    def _housekeeping_step(self, next_beat: float) -> None:
        if time.time() >= next_beat and not self._beat():
            log.error("worker %s: another host took this worker's lease over; exiting", self.cfg.name)
            os._exit(EXIT_LEASE_LOST)
        with self._lock:
            rounds = list(self._partials)
        for r in rounds:
            if r in self._written or not self.db.gate_closed(r):
                continue
            with self._lock:
                p = self._partials[r]
            self.db.put_partial(r, self.cfg.name, p)
            with self._lock:
                self._partials.pop(r, None)
                self._written.add(r)
            log.info("worker %s: round %d partial of %d update(s) written", self.cfg.name, r, p.num_clients)

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT or :meth:`stop`."""
        if not self._beat():  # before connecting: never take a live session from its holder
            log.error("worker %s: its lease is held by another live host; not starting", self.cfg.name)
            self.db.close()
            raise SystemExit(EXIT_LEASE_LOST)
        self._rebuild()
        self.transport.subscribe(shared_filter(self.cfg.fleet, self.cfg.group), self.on_update)
        if self.cfg.connect_at is not None:
            self._stop.wait(max(0.0, self.cfg.connect_at - time.time()))
        self.transport.connect(timeout=30)
        if getattr(self.transport, "protocol_version", "5") != "5":
            self.transport.close(timeout=2)
            self.db.close()
            raise ConfigError(f"worker {self.cfg.name}: shared subscriptions need MQTT 5, and the broker at "
                              f"{self.cfg.broker} speaks only MQTT {self.transport.protocol_version} (RabbitMQ 3.10 "
                              "takes '$share/...' as a plain topic): run the gateway without ingestion workers "
                              "there, or use Mosquitto 2 / EMQX (docs/brokers.md)")
        self.stats["connected"] = 1
        self._beat()
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
    """``python -m edgeflow.gateway.ingest WORKER.json``: one worker. With ``--pool w0,w1``:
    a supervisor running those workers (``--peers``: names other hosts run, taken over
    here after ``--takeover-after`` seconds without their heartbeat)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m edgeflow.gateway.ingest")
    ap.add_argument("config", help="worker settings (JSON, see WorkerConfig)")
    ap.add_argument("--pool", help="run these worker names as a supervisor (comma-separated)")
    ap.add_argument("--peers", default="", help="names other hosts run, to take over when they die")
    ap.add_argument("--takeover-after", type=float, default=None, metavar="S")
    ap.add_argument("--workdir", default=None, help="where the pool keeps worker configs and logs")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = WorkerConfig.load(args.config)
    except (OSError, ValueError, TypeError) as exc:
        print(f"error: worker config {args.config}: {exc}", file=sys.stderr)
        return 2
    if args.pool:
        logging.basicConfig(level=cfg.log_level, format="ingest-pool %(levelname)s %(message)s")
        pool = IngestPool(cfg, [n for n in args.pool.split(",") if n], workdir=args.workdir or ".",
                          peers=[n for n in args.peers.split(",") if n], takeover_after_s=args.takeover_after)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        pool.start()
        try:
            while not stop.wait(0.2):
                pass
        finally:
            pool.stop()
        return 0
    logging.basicConfig(level=cfg.log_level, format=f"ingest[{cfg.name}] %(levelname)s %(message)s")
    try:
        worker = IngestWorker(cfg)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: worker.stop())
        worker.run()
    except (ConfigError, StateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


# ---------------------------------------------------------------------------
# A supervisor
# ---------------------------------------------------------------------------


class IngestPool:
    """Runs worker processes and restarts any that dies under the same name (so the broker
    hands it the dead session's in-flight and queued updates).

    Several machines: give each machine's pool its own ``names`` and the others' as
    ``peers``, a distinct ``host`` and ``takeover_after_s``. When a peer's heartbeat is older
    than that (its machine died), one surviving pool takes the name's lease over
    (:meth:`~edgeflow.gateway.store.GatewayStore.take_over_worker`, ``FOR UPDATE SKIP
    LOCKED`` on PostgreSQL: two pools never take the same name) and runs the worker here,
    under the same client id: the broker redelivers what was routed to the dead one. A worker
    that finds its lease taken exits (:data:`EXIT_LEASE_LOST`) and is not restarted here."""

    def __init__(self, base: WorkerConfig, names: list[str], *, workdir: str | Path, restart: bool = True,
                 python: str = sys.executable, peers: list[str] | None = None, host: str | None = None,
                 takeover_after_s: float | None = None) -> None:
        self.names = [validate_id(n, "worker name") for n in names]
        self.peers = [validate_id(n, "worker name") for n in (peers or []) if n not in self.names]
        self.host = host or base.host or socket.gethostname()
        self.takeover_after_s = takeover_after_s
        lease = base.lease_s if base.lease_s is not None else takeover_after_s
        self.base = WorkerConfig(**{**asdict(base), "host": self.host, "lease_s": lease})
        self.workdir = Path(workdir)
        self.restart = restart
        self.python = python
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {n: 0 for n in self.names + self.peers}
        self.pids: dict[str, list[int]] = {n: [] for n in self.names + self.peers}
        self.taken_over: list[str] = []
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()

    def _spawn(self, name: str) -> None:
        cfg = WorkerConfig(**{**asdict(self.base), "name": name})
        path = self.workdir / f"ingest-{name}.json"
        path.write_text(json.dumps(asdict(cfg)), encoding="utf-8")
        log_file = open(self.workdir / f"ingest-{name}.log", "ab")  # noqa: SIM115 - owned by the child
        # not "-m": it would put the current directory first on the worker's path (edgeflow/child_python.py)
        proc = subprocess.Popen(module_command("edgeflow.gateway.ingest", str(path), python=self.python),  # noqa: S603
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
        db: IngestStore | None = None
        next_takeover = time.monotonic() + (self.takeover_after_s or 0.0)
        try:
            while not self._stop.wait(0.1):
                with self._lock:
                    for n, p in list(self.procs.items()):
                        if p.poll() is None or not self.restart or self._stop.is_set():
                            continue
                        if p.returncode == EXIT_CONFIG:
                            log.error("ingest worker %s refused its configuration (see its log); not restarting", n)
                            del self.procs[n]
                            continue
                        if p.returncode == EXIT_LEASE_LOST:
                            log.warning("ingest worker %s: its lease is held on another host; not restarting", n)
                            del self.procs[n]
                            continue
                        log.warning("ingest worker %s (pid %d) exited with %s; restarting", n, p.pid, p.returncode)
                        self.restarts[n] += 1
                        self._spawn(n)
                if self.takeover_after_s is None or time.monotonic() < next_takeover:
                    continue
                next_takeover = time.monotonic() + 0.25
                with self._lock:
                    idle = [n for n in self.names + self.peers if n not in self.procs]
                if not idle:
                    continue
                try:
                    db = db or IngestStore(self.base.state)
                    name = db.take_over(self.host, self.takeover_after_s, idle)
                except Exception as exc:  # noqa: BLE001 - the store is down: try again later
                    log.warning("ingest pool %s: takeover check failed: %s", self.host, exc)
                    continue
                if name is not None:
                    log.warning("ingest pool %s: worker %s's host stopped beating; running it here", self.host, name)
                    with self._lock:
                        self.taken_over.append(name)
                        self._spawn(name)
        finally:
            if db is not None:
                db.close()

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """True once every current worker process has connected (its heartbeat says so)."""
        db = IngestStore(self.base.state)
        try:
            end = time.time() + timeout
            while time.time() < end:
                w = db.workers()
                with self._lock:
                    want = {n: p.pid for n, p in self.procs.items()}
                if all(w.get(n, {}).get("pid") == pid and w[n]["stats"].get("connected") for n, pid in want.items()):
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
