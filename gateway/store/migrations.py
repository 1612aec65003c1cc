"""The gateway state's one schema, as numbered migrations shared by every engine.

Each migration is a list of statements written once with a few dialect
tokens (``{blob}``, ``{real}``, ``{int}``) that each engine renders
(:class:`~edgeflow.gateway.store.base.Dialect`): SQLite types are loose, but
PostgreSQL's ``REAL`` is a 4-byte float (timestamps would lose their
seconds) and its ``INTEGER`` is 32-bit (sequence numbers are 63-bit), so
they become ``DOUBLE PRECISION`` and ``BIGINT`` there.

Rules for adding one: append ``N: [...]`` with the next number, never edit
a released migration, and keep every statement valid on both engines. A
state opens at any older version and is migrated forward, one migration per
transaction, before anything else reads it; a state *newer* than this
edgeflow is refused with one line (:class:`~edgeflow.errors.StateError`).

- **1**: models, rounds, round updates, devices, telemetry, the replay floor
  and ``meta`` (the schema of edgeflow's first stateful release).
- **2**: the ingestion workers' tables (the gate, claims, partials and worker
  leases), which ``gateway/ingest.py`` used to create in the same SQLite file
  on its own, plus the lease's ``host`` (workers on several machines) and an
  index for the claims a worker rebuilds its partial from.
- **3**: ``strategy_state``: the aggregation strategy's cross-round state
  (norm-bound reference, server-optimizer moments, the DP accountant and its
  noise generator) as it stood when a round ended, written in the round's own
  closing transaction, so a restarted gateway goes on exactly where it stopped.
- **4**: ``rollouts``: one row per OTA rollout (``edgeflow fleet deploy``), written in one
  transaction when it finishes: the artifact version it shipped, the SHA-256 of the model it
  was built from (which names the gateway's model version when that model came from this
  state's ``models``), its state, target selector and the whole report as JSON
  (``edgeflow fleet rollouts`` lists them).
"""

from __future__ import annotations

MIGRATIONS: dict[int, list[str]] = {
    1: [
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE IF NOT EXISTS models (
            version {int} PRIMARY KEY,
            created {real} NOT NULL,
            sha256 TEXT NOT NULL,
            size {int} NOT NULL,
            onnx {blob} NOT NULL,
            round_id {int},
            metrics TEXT NOT NULL DEFAULT '{{}}'
        )""",
        """CREATE TABLE IF NOT EXISTS rounds (
            round_id {int} PRIMARY KEY,
            model_version {int} NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('open', 'closed', 'failed')),
            created {real} NOT NULL,
            deadline {real} NOT NULL,
            config TEXT NOT NULL,
            selected TEXT NOT NULL,
            metrics TEXT NOT NULL DEFAULT '{{}}'
        )""",
        """CREATE TABLE IF NOT EXISTS round_updates (
            round_id {int} NOT NULL,
            device_id TEXT NOT NULL,
            seq {int} NOT NULL,
            num_samples {int} NOT NULL,
            received {real} NOT NULL,
            nbytes {int} NOT NULL,
            envelope {blob} NOT NULL,
            PRIMARY KEY (round_id, device_id)
        )""",
        """CREATE TABLE IF NOT EXISTS devices (
            device_id TEXT PRIMARY KEY,
            profile TEXT NOT NULL DEFAULT '',
            public_key TEXT NOT NULL DEFAULT '',
            online {int} NOT NULL DEFAULT 0,
            first_seen {real} NOT NULL,
            last_seen {real} NOT NULL,
            model_version {int},
            birth TEXT NOT NULL DEFAULT '{{}}',
            bdseq {int} NOT NULL DEFAULT -1
        )""",
        """CREATE TABLE IF NOT EXISTS telemetry (
            device_id TEXT NOT NULL,
            ts {real} NOT NULL,
            data TEXT NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS telemetry_by_device ON telemetry (device_id, ts)",
        "CREATE TABLE IF NOT EXISTS update_seqs (device_id TEXT PRIMARY KEY, max_seq {int} NOT NULL)",
    ],
    2: [
        # IF NOT EXISTS: a version-1 SQLite file may already hold these, made by an older ingest worker
        "CREATE TABLE IF NOT EXISTS ingest_gate (round_id {int} PRIMARY KEY, closed {real} NOT NULL)",
        """CREATE TABLE IF NOT EXISTS ingest_claims (
            round_id {int} NOT NULL,
            device_id TEXT NOT NULL,
            worker TEXT NOT NULL,
            pid {int} NOT NULL,
            PRIMARY KEY (round_id, device_id)
        )""",
        """CREATE TABLE IF NOT EXISTS ingest_partials (
            round_id {int} NOT NULL,
            worker TEXT NOT NULL,
            devices TEXT NOT NULL,
            num_clients {int} NOT NULL,
            total_samples {int} NOT NULL,
            losses TEXT NOT NULL,
            sums {blob} NOT NULL,
            PRIMARY KEY (round_id, worker)
        )""",
        """CREATE TABLE IF NOT EXISTS ingest_workers (
            worker TEXT PRIMARY KEY,
            pid {int} NOT NULL,
            started {real} NOT NULL,
            seen {real} NOT NULL,
            stats TEXT NOT NULL DEFAULT '{{}}'
        )""",
        "ALTER TABLE ingest_workers ADD COLUMN host TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX IF NOT EXISTS ingest_claims_by_worker ON ingest_claims (round_id, worker)",
    ],
    3: [
        """CREATE TABLE IF NOT EXISTS strategy_state (
            round_id {int} PRIMARY KEY,
            created {real} NOT NULL,
            state {blob} NOT NULL
        )""",
    ],
    4: [
        """CREATE TABLE IF NOT EXISTS rollouts (
            rollout_id TEXT PRIMARY KEY,
            artifact_version {int} NOT NULL,
            state TEXT NOT NULL,
            started {real} NOT NULL,
            finished {real},
            source_sha256 TEXT NOT NULL DEFAULT '',
            name TEXT NOT NULL DEFAULT '',
            selector TEXT NOT NULL DEFAULT '',
            report TEXT NOT NULL DEFAULT '{{}}'
        )""",
        "CREATE INDEX IF NOT EXISTS rollouts_by_started ON rollouts (started)",
    ],
}

SCHEMA_VERSION = max(MIGRATIONS)
