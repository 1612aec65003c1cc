"""The server engine: PostgreSQL through psycopg 3 (``pip install 'edgeflow[postgres]'``).

``[store] url = "postgresql://USER@HOST:PORT/DB[?schema=NAME]"``: every gateway
process, ingestion worker and site gateway on any machine that reaches the
server shares one state. The tables live in the schema ``NAME`` (default
``edgeflow``; created if missing), so a database shared with other
applications is never touched outside it, and a test can take a fresh schema.

- Each store holds one connection (autocommit; :meth:`tx` sends ``BEGIN`` /
  ``COMMIT``), READ COMMITTED. Read-modify-write steps take row locks
  (``SELECT ... FOR UPDATE``): the end of a round, a death notice against the
  newest birth. Ingestion claims hold the round's row ``FOR SHARE SKIP
  LOCKED`` and closing the intake takes it ``FOR UPDATE`` (so the gate waits
  for the claims in flight, and a claim meeting a closing gate is "late" at
  once); two workers claiming the same (round, device) meet at the primary
  key — the second waits for the first's commit and finds a duplicate. Dead
  workers' leases are taken over with ``FOR UPDATE SKIP LOCKED``.
- Migrations run under a transaction-scoped advisory lock, so several
  processes starting together on an empty schema migrate it once.
- A lost connection (server restart, network cut) fails the statement in
  flight with one :class:`~edgeflow.gateway.store.base.StoreError` line
  (nothing of its transaction is committed) and the next call reconnects.
"""

from __future__ import annotations

import zlib
from typing import Any

from edgeflow.errors import ConfigError, StateError

from .base import RECOVERY, Dialect, GatewayStore, StoreError, Tx

__all__ = ["PostgresStore", "DEFAULT_SCHEMA"]

DEFAULT_SCHEMA = "edgeflow"


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise ConfigError("a postgresql:// state needs the psycopg 3 driver: pip install 'edgeflow[postgres]' "
                          "(or pip install 'psycopg[binary]>=3.2')") from None
    return psycopg


class PostgresStore(GatewayStore):
    """:class:`~edgeflow.gateway.store.base.GatewayStore` on PostgreSQL."""

    dialect = Dialect("postgresql", blob="BYTEA", real="DOUBLE PRECISION", int="BIGINT", greatest="GREATEST",
                      for_update=" FOR UPDATE", for_share_skip_locked=" FOR SHARE SKIP LOCKED",
                      for_update_skip_locked=" FOR UPDATE SKIP LOCKED", placeholder="%s")
    engine = "postgresql"
    connect_timeout_s = 10

    @property
    def schema(self) -> str:
        return self.target.schema or DEFAULT_SCHEMA

    def _connect(self) -> Any:
        pg = _psycopg()
        try:
            conn = pg.connect(self.target.dsn, autocommit=True, connect_timeout=self.connect_timeout_s,
                              application_name="edgeflow-gateway")
        except pg.Error as exc:
            raise StateError(f"gateway state {self.path}: cannot connect to PostgreSQL "
                             f"({' '.join(str(exc).split())[:300]}); check that the server runs and the URL's "
                             "host, port, user and database") from None
        try:
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            conn.execute(f'SET search_path TO "{self.schema}"')
        except pg.errors.UniqueViolation:  # two processes created it at the same instant
            conn.execute(f'SET search_path TO "{self.schema}"')
        except pg.Error as exc:
            conn.close()
            raise StateError(f"gateway state {self.path}: schema {self.schema!r} cannot be used "
                             f"({' '.join(str(exc).split())[:300]})") from None
        return conn

    def _open(self, check: bool) -> None:
        pg = _psycopg()
        self._db = self._connect()
        try:
            self._prepare(check)
        except pg.Error as exc:
            self._db.close()
            raise StateError(f"gateway state {self.path} cannot be opened ({' '.join(str(exc).split())[:300]}): "
                             f"{RECOVERY}") from None
        except BaseException:
            self._db.close()
            raise

    def _prepare(self, check: bool) -> None:
        db = self._db
        key = zlib.crc32(f"edgeflow-schema:{self.schema}".encode())
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
            tables = {r[0] for r in db.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema=%s", (self.schema,))}
            if tables and "meta" not in tables:
                raise StateError(f"{self.path}: schema {self.schema!r} holds tables that are not a gateway state "
                                 f"({sorted(tables)[:5]}): name another ?schema= in the URL")
            have = None
            if "meta" in tables:
                row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
                have = None if row is None else int(row[0])
            existed = have is not None
            self._migrate(Tx(self, db), have)
        if existed and check:
            self._check_latest_model()

    # -- the engine hooks ------------------------------------------------------------
    def _conn(self) -> Any:
        if self._db.closed or self._db.broken:
            try:
                self._db.close()
            finally:
                self._db = self._connect()
        return self._db

    def _begin(self, conn: Any) -> None:
        conn.execute("BEGIN")

    def _commit(self, conn: Any) -> None:
        conn.execute("COMMIT")

    def _rollback(self, conn: Any) -> None:
        pg = _psycopg()
        if not conn.closed and conn.info.transaction_status != pg.pq.TransactionStatus.IDLE:
            conn.execute("ROLLBACK")

    def _error(self, exc: BaseException) -> BaseException | None:
        pg = _psycopg()
        if isinstance(exc, pg.Error):
            why = " ".join(str(exc).split())[:300] or type(exc).__name__
            return StoreError(f"gateway state {self.path}: {type(exc).__name__}: {why}")
        return None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- maintenance ---------------------------------------------------------------------
    def drop_schema(self) -> None:
        """Remove this state's schema and everything in it (tests; irreversible)."""
        with self._lock:
            self._conn().execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
