"""The gateway's state on both engines, for tests: one parametrized fixture.

Import what you need in a test module (pytest puts tests/ on sys.path)::

    from _stores import store_target, pg_url  # noqa: F401

- :func:`store_target` (parametrized ``sqlite`` / ``postgresql``) -> a fresh
  :class:`~edgeflow.gateway.store.StoreTarget`: a new SQLite file under the
  test's tmp_path, or a new PostgreSQL schema (dropped at teardown). Open it
  with ``GatewayStore(target)`` as often as the test needs (a restart is a
  reopen).
- PostgreSQL comes from ``EDGEFLOW_TEST_PG`` (default
  ``postgresql://postgres@127.0.0.1:5432/test``, the server every project
  machine and CI run); if it cannot be reached, the PostgreSQL half skips with
  the reason — nothing else is ever skipped.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from functools import lru_cache

import pytest

from edgeflow.gateway.store import StoreTarget, parse_store_url

__all__ = ["PG_URL", "drop_schema", "pg_available", "pg_schema_url", "pg_url", "store_target"]

PG_URL = os.environ.get("EDGEFLOW_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


@lru_cache(maxsize=1)
def pg_available() -> str | None:
    """None if the test server answers, else why not (the skip reason)."""
    try:
        import psycopg
    except ImportError:
        return "psycopg 3 is not installed (pip install -e '.[dev]' brings it)"
    try:
        with psycopg.connect(PG_URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"PostgreSQL at {PG_URL} is not reachable ({' '.join(str(exc).split())[:160]}); .ci/run starts it"
    return None


def pg_schema_url(schema: str, base: str = PG_URL) -> str:
    return f"{base}{'&' if '?' in base else '?'}schema={schema}"


def drop_schema(schema: str, base: str = PG_URL) -> None:
    import psycopg

    with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL naming a fresh PostgreSQL schema of this test (dropped afterwards)."""
    why = pg_available()
    if why is not None:
        pytest.skip(why)
    schema = f"ef_test_{uuid.uuid4().hex[:12]}"
    try:
        yield pg_schema_url(schema)
    finally:
        drop_schema(schema)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_target(request, tmp_path) -> Iterator[StoreTarget]:
    """A fresh, empty state on each engine (see the module docstring)."""
    if request.param == "sqlite":
        yield parse_store_url(str(tmp_path / "gw.sqlite"))
        return
    url = request.getfixturevalue("pg_url")
    yield parse_store_url(url)
