"""The gateway's durable state: one interface (:class:`GatewayStore`), two engines.

- :mod:`.sqlite` — the embedded default: one file (``--state gw.sqlite`` or
  ``[store] url = "sqlite:///gw.sqlite"``), shared by the processes of one machine.
- :mod:`.postgres` — ``[store] url = "postgresql://USER@HOST:PORT/DB"``: one state
  for gateways and ingestion workers on several machines (psycopg 3).

One schema with versioned migrations (:mod:`.migrations`), one transaction
helper (:meth:`GatewayStore.tx`). ``GatewayStore(target)`` and :func:`open_store`
pick the engine from ``target``.
"""

from .base import (
    MAX_SEQ,
    RECOVERY,
    DeviceRecord,
    GatewayStore,
    RoundRecord,
    StoredUpdate,
    StoreError,
    StoreTarget,
    open_store,
    parse_store_url,
    register_engine,
)
from .migrations import MIGRATIONS, SCHEMA_VERSION


def _sqlite() -> type[GatewayStore]:
    from .sqlite import SqliteStore

    return SqliteStore


def _postgres() -> type[GatewayStore]:
    from .postgres import PostgresStore

    return PostgresStore


register_engine("sqlite", _sqlite)
register_engine("postgresql", _postgres)

__all__ = [
    "MAX_SEQ",
    "MIGRATIONS",
    "RECOVERY",
    "SCHEMA_VERSION",
    "DeviceRecord",
    "GatewayStore",
    "RoundRecord",
    "StoreError",
    "StoreTarget",
    "StoredUpdate",
    "open_store",
    "parse_store_url",
]
