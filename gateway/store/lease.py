"""The gateway's lease on its state: one gateway process per state.

Two gateways on one state would run the same rounds, overwrite each other's
models and take each other's MQTT session (they share the client id). So
``edgeflow gateway`` takes a lease before it opens the state, and a second
one fails at once with one line naming the holder (host, pid, since).

- **SQLite**: an exclusive ``flock`` on ``<state>.gateway-lock``, a side file
  that also holds the holder's host, pid and start time (JSON). The kernel
  drops the lock when the process ends, however it ends (``kill -9``, power
  cut of a process; not of the machine, where nothing is left to hold it).
- **PostgreSQL**: a session-level advisory lock (``pg_try_advisory_lock``)
  keyed by the state's schema, on a connection of its own whose
  ``application_name`` names the holder (``edgeflow-gateway host=H pid=P``);
  the second gateway finds the holder in ``pg_locks``/``pg_stat_activity``.
  The server drops the lock when that connection ends (process killed: the
  socket closes; a silent network cut: when TCP keepalive gives up).

Readers never take the lease: ``edgeflow rounds``, ``fleet status`` and
``fleet history`` read the state while a gateway runs (SQLite WAL; PostgreSQL
MVCC), and ingestion workers share it on purpose (their own leases,
:meth:`~edgeflow.gateway.store.base.GatewayStore.heartbeat`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import zlib
from pathlib import Path
from typing import Any

from edgeflow.errors import StateError, StateInUseError

from .base import StoreTarget

__all__ = ["GatewayLease", "take_gateway_lease"]

_FIX = ("stop that gateway first (one gateway per state), or give this one a state of its own "
        "([gateway] state or [store] url in gateway.toml)")


def _holder_text(host: str, pid: Any, since: float | None) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if since else "an unknown time"
    return f"host {host or '?'}, pid {pid or '?'}, since {when}"


class GatewayLease:
    """A held lease; :meth:`release` (or the end of the process) gives it back."""

    def __init__(self, target: StoreTarget, release: Any) -> None:
        self.target = target
        self._release = release

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()

    def __enter__(self) -> "GatewayLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def take_gateway_lease(target: StoreTarget) -> GatewayLease:
    """Take the lease on ``target`` for this process, or raise :class:`StateInUseError` naming the holder."""
    if target.engine == "sqlite":
        return _sqlite_lease(target)
    if target.engine == "postgresql":
        return _postgres_lease(target)
    return GatewayLease(target, None)  # an engine without a lease: nothing to hold


# -- SQLite: flock on a side file -----------------------------------------------------


def _sqlite_lease(target: StoreTarget) -> GatewayLease:
    if target.path == ":memory:":
        return GatewayLease(target, None)  # private to this process anyway
    lock_path = target.path + ".gateway-lock"
    try:
        Path(lock_path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StateError(f"gateway state {target.display}: cannot create its lock file {lock_path} "
                         f"({exc.strerror}); check the folder's permissions") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise StateInUseError(f"gateway state {target.display} is in use by another gateway ({holder}): {_FIX}") \
            from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode(), 0)

    def release() -> None:
        os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor drops the flock

    return GatewayLease(target, release)


def _read_holder(fd: int) -> str:
    raw = os.pread(fd, 4096, 0)
    try:
        info = json.loads(raw.decode())
    except ValueError:  # the holder is between taking the lock and writing its name
        return "host and pid not written yet"
    if not isinstance(info, dict):
        return "host and pid not written yet"
    return _holder_text(str(info.get("host", "")), info.get("pid"), info.get("since"))


# -- PostgreSQL: a session-level advisory lock ---------------------------------------------


def _pg_key(schema: str) -> int:
    return zlib.crc32(f"edgeflow-gateway:{schema}".encode())  # < 2**32: pg_locks shows it as classid 0, objid key


def _postgres_lease(target: StoreTarget) -> GatewayLease:
    from .postgres import DEFAULT_SCHEMA, _psycopg

    pg = _psycopg()
    schema = target.schema or DEFAULT_SCHEMA
    name = f"edgeflow-gateway host={socket.gethostname()} pid={os.getpid()}"[:63]
    try:
        conn = pg.connect(target.dsn, autocommit=True, connect_timeout=10, application_name=name)
    except pg.Error as exc:
        raise StateError(f"gateway state {target.display}: cannot connect to PostgreSQL "
                         f"({' '.join(str(exc).split())[:300]}); check that the server runs and the URL's "
                         "host, port, user and database") from None
    key = _pg_key(schema)
    try:
        got = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
        holder = "" if got else _pg_holder(conn, key)
    except pg.Error as exc:
        conn.close()
        raise StateError(f"gateway state {target.display}: cannot take the gateway lease "
                         f"({' '.join(str(exc).split())[:300]})") from None
    if not got:
        conn.close()
        raise StateInUseError(f"gateway state {target.display} is in use by another gateway ({holder}): {_FIX}")
    return GatewayLease(target, conn.close)  # the session ends: the server drops the lock


def _pg_holder(conn: Any, key: int) -> str:
    row = conn.execute(
        "SELECT a.application_name, extract(epoch from a.backend_start), host(a.client_addr) "
        "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.classid = 0 AND l.objid = %s AND l.objsubid = 1 AND l.granted "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (key,)).fetchone()
    if row is None:  # it ended between the two statements
        return "it ended just now; start this one again"
    fields = dict(part.split("=", 1) for part in (row[0] or "").split()[1:] if "=" in part)
    host = fields.get("host") or row[2] or ""
    return _holder_text(host, fields.get("pid"), float(row[1]) if row[1] is not None else None)
