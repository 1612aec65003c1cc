"""The gateway's state on both engines (SQLite file, PostgreSQL schema): durable,
deduplicating, bounded, migrated; ingestion claims exact under concurrency."""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time

import pytest

from _stores import pg_url, store_target  # noqa: F401
from edgeflow.errors import ConfigError, StateError
from edgeflow.gateway.store import MIGRATIONS, SCHEMA_VERSION, GatewayStore, StoreError, parse_store_url
from edgeflow.gateway.store.base import Dialect
from edgeflow.gateway.store.postgres import PostgresStore
from edgeflow.gateway.store.sqlite import SqliteStore


def test_updates_are_stored_once_and_survive_reopen(store_target):  # noqa: F811
    s = GatewayStore(store_target)
    assert s.created and s.schema_version() == SCHEMA_VERSION
    s.open_round(1, model_version=1, deadline=time.time() + 60, config={"lr": 0.1}, selected=["a", "b"])
    assert s.add_update(1, "a", seq=1, num_samples=10, envelope=b"A" * 100)
    assert not s.add_update(1, "a", seq=1, num_samples=10, envelope=b"A" * 100)  # redelivery
    assert s.add_update(1, "b", seq=4, num_samples=5, envelope=b"B")
    s.close()
    s = GatewayStore(store_target)  # a restarted gateway
    assert not s.created
    (r,) = s.open_rounds()
    assert r.round_id == 1 and r.config == {"lr": 0.1} and r.selected == ["a", "b"]
    got = list(s.updates(1))
    assert [(u.device_id, u.num_samples, u.envelope) for u in got] == [("a", 10, b"A" * 100), ("b", 5, b"B")]
    assert s.seq_floors() == {"a": 1, "b": 4}
    s.close_round(1, {"participants": 2})
    assert s.open_rounds() == [] and s.round(1).metrics == {"participants": 2}
    s.drop_updates(1)
    assert s.update_count(1) == 0
    s.close()


def test_models_versioned_and_a_round_finishes_once(store_target):  # noqa: F811
    s = GatewayStore(store_target)
    assert s.latest_model() is None
    v1 = s.add_model(b"m1", "h1")
    v2 = s.add_model(b"m2", "h2", round_id=3, metrics={"acc": 0.9})
    assert (v1, v2) == (1, 2)
    assert s.latest_model() == (2, b"m2", "h2")
    assert s.model(1) == (b"m1", "h1")
    assert [m["version"] for m in s.model_versions()] == [1, 2]
    s.open_round(4, model_version=2, deadline=time.time() + 60, config={}, selected=[])
    s.add_update(4, "d", 7, 3, b"env")
    assert s.finish_round(4, {"participants": 1}, model=(b"m3", "h3")) == 3
    assert s.model_for_round(4) == 3 and s.update_count(4) == 0 and s.round(4).state == "closed"
    with pytest.raises(StateError, match="cannot be finished twice"):
        s.finish_round(4, {})
    s.close()


def test_timestamps_and_sequence_numbers_keep_full_precision(store_target):  # noqa: F811
    # PostgreSQL's REAL is 4 bytes and INTEGER 32 bits: the schema must say DOUBLE PRECISION / BIGINT there
    s = GatewayStore(store_target)
    s.upsert_birth("d", {})
    s.add_telemetry("d", {"x": 1}, ts=1796300000.123456)
    assert s.telemetry("d")[0][0] == pytest.approx(1796300000.123456, abs=1e-6)
    s.record_seq("d", (1 << 62) + 5)
    assert s.seq_floor("d") == (1 << 62) + 5
    s.close()


def test_registry_liveness_and_stale_will(store_target):  # noqa: F811
    s = GatewayStore(store_target)
    s.upsert_birth("d1", {"profile": "raspberry-pi-4"}, profile="raspberry-pi-4", public_key="ab", bdseq=3)
    assert s.device("d1").online
    assert not s.set_online("d1", False, bdseq=2)  # a will from an older session
    assert s.device("d1").online
    assert s.set_online("d1", False, bdseq=3)
    assert not s.device("d1").online
    s.upsert_birth("d1", {}, profile="raspberry-pi-4", bdseq=4)
    assert s.device("d1").public_key == "ab"  # kept when a birth omits it
    s.execute_sql("UPDATE devices SET last_seen=0 WHERE device_id='d1'")
    assert s.expire(10) == ["d1"] and not s.device("d1").online
    s.close()


def test_telemetry_history_is_bounded(store_target):  # noqa: F811
    s = GatewayStore(store_target, telemetry_keep=5)
    s.upsert_birth("d", {})
    for i in range(12):
        s.add_telemetry("d", {"i": i}, ts=1000.0 + i)
    hist = s.telemetry("d", limit=100)
    assert [d["i"] for _, d in hist] == [7, 8, 9, 10, 11]
    s.close()


def test_telemetry_batches_commit_together_and_stay_bounded(store_target):  # noqa: F811
    s = GatewayStore(store_target, telemetry_keep=3)
    for d in ("a", "b", "c"):
        s.upsert_birth(d, {})
    s.execute_sql("UPDATE devices SET online=0, last_seen=0")
    batch = [(d, {"i": i}, 2000.0 + i) for i in range(6) for d in ("c", "a", "b")]
    assert s.add_telemetry_batch(batch) == 18
    for d in ("a", "b", "c"):
        assert [x["i"] for _, x in s.telemetry(d)] == [3, 4, 5]
        rec = s.device(d)
        assert rec.online and rec.last_seen > 0
    assert s.telemetry_count() == 9
    # one bad row (not JSON-serializable) and nothing of the batch is stored
    with pytest.raises(TypeError):
        s.add_telemetry_batch([("a", {"i": 99}, 3000.0), ("b", {"bad": object()}, 3001.0)])
    assert [x["i"] for _, x in s.telemetry("a")] == [3, 4, 5]
    s.close()


def test_schema_mismatch_is_clear(store_target):  # noqa: F811
    s = GatewayStore(store_target)
    s.execute_sql("UPDATE meta SET value='99' WHERE key='schema'")
    s.close()
    with pytest.raises(StateError, match="schema 99") as e:
        GatewayStore(store_target)
    assert "\n" not in str(e.value)


def test_a_version_1_state_is_migrated_in_place(store_target):  # noqa: F811
    """A state written by the first schema (what every existing gateway.sqlite holds) opens,
    is migrated to the current version in place, and keeps its rows."""
    engine = SqliteStore if store_target.engine == "sqlite" else PostgresStore
    if store_target.engine == "sqlite":
        con = sqlite3.connect(store_target.path, isolation_level=None)
        run = con.execute
    else:
        import psycopg

        con = psycopg.connect(store_target.dsn, autocommit=True)
        con.execute(f'CREATE SCHEMA "{store_target.schema}"')
        con.execute(f'SET search_path TO "{store_target.schema}"')
        run = con.execute
    dialect: Dialect = engine.dialect
    for stmt in MIGRATIONS[1]:
        run(dialect.render(stmt))
    run(dialect.render("INSERT INTO meta (key, value) VALUES ('schema', '1')"))
    run(dialect.render("INSERT INTO update_seqs (device_id, max_seq) VALUES (?, ?)"), ("old-device", 41))
    con.close()
    s = GatewayStore(store_target)
    assert s.schema_version() == SCHEMA_VERSION and not s.created
    assert s.seq_floor("old-device") == 41
    s.open_round(1, 1, time.time() + 60, {}, [])
    assert s.claim(1, "old-device", 42, 3, b"e", "w0") == "ok"  # the ingestion tables exist now
    s.close()


def test_a_foreign_database_is_refused_with_one_line(tmp_path):
    p = tmp_path / "other.sqlite"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE invoices (id INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(StateError, match="not a gateway state") as e:
        GatewayStore(p)
    assert "\n" not in str(e.value)


# -- ingestion claims ------------------------------------------------------------------------


def test_claims_dedupe_and_the_gate_shuts_intake(store_target):  # noqa: F811
    s = GatewayStore(store_target, shared=True)
    s.open_round(1, 1, time.time() + 60, {}, [])
    assert s.claim(1, "d0", 1, 10, b"x", "w0") == "ok"
    assert s.claim(1, "d0", 1, 10, b"x", "w1") == "duplicate"  # a chunked update every worker got
    assert s.claim(2, "d0", 2, 10, b"x", "w0") == "late"  # no such round
    s.close_gate(1)
    assert s.claim(1, "d1", 1, 10, b"x", "w1") == "late"
    assert s.claims(1) == {"w0": {"d0"}} and s.reported(1) == {"d0"} and s.gate_closed(1)
    s.put_partial(1, "w0", ["d0"], 1, 10, {"losses": [0.5]}, b"sums")
    assert s.partial_rows(1) == [("w0", ["d0"], 1, 10, {"losses": [0.5]}, b"sums")]
    s.forget_ingest_before(2)
    assert s.claims(1) == {} and s.partial_rows(1) == [] and not s.gate_closed(1)
    s.close()


def test_concurrent_claims_count_each_update_once_and_nothing_after_the_gate(store_target):  # noqa: F811
    """Four writers (own connections) claim overlapping updates while the coordinator shuts
    the intake: every (round, device) is stored once, every "ok" is in the stored set, and
    the set read right after the gate commits is final."""
    setup = GatewayStore(store_target, shared=True)
    setup.open_round(1, 1, time.time() + 60, {}, [])
    devices = [f"d{i:03d}" for i in range(600)]
    results: dict[str, list[tuple[str, str]]] = {}
    go = threading.Event()

    def writer(name: str) -> None:
        st = GatewayStore(store_target, shared=True)
        order = devices[:]
        random.Random(name).shuffle(order)
        out = results.setdefault(name, [])
        go.wait()
        for d in order:
            out.append((d, st.claim(1, d, 1, 5, d.encode(), name)))
        st.close()

    threads = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    go.set()
    while sum(len(v) for v in results.values()) < 60:  # well before all 600 are stored
        time.sleep(0.001)
    setup.close_gate(1)
    frozen = setup.reported(1)
    for t in threads:
        t.join(60)
    oks = [d for v in results.values() for d, r in v if r == "ok"]
    assert len(oks) == len(set(oks)), "an update was claimed twice"
    assert set(oks) == frozen == setup.reported(1), "a claim succeeded after the gate, or a stored one was lost"
    assert 0 < len(frozen) < len(devices), (len(frozen), {k: len(v) for k, v in results.items()})
    claimed = setup.claims(1)
    assert sorted(d for ds in claimed.values() for d in ds) == sorted(frozen)
    assert all(r in ("ok", "duplicate", "late") for v in results.values() for _, r in v)
    setup.close()


def test_worker_leases_and_takeover(store_target):  # noqa: F811
    a = GatewayStore(store_target, shared=True)
    b = GatewayStore(store_target, shared=True)
    assert a.heartbeat("w0", 0.0, {}, host="A", dead_after_s=1.0)
    assert a.heartbeat("w1", 0.0, {}, host="A", dead_after_s=1.0)
    assert not b.heartbeat("w0", 0.0, {}, host="B", dead_after_s=1.0)  # A's lease is live
    assert b.take_over_worker("B", 1.0) is None
    a.execute_sql("UPDATE ingest_workers SET seen=0")  # host A stopped beating
    got = {a.take_over_worker("A2", 1.0), b.take_over_worker("B", 1.0)}
    assert got == {"w0", "w1"}  # each name to exactly one taker
    assert a.take_over_worker("C", 1.0) is None
    taker = {w["host"] for w in a.workers().values()}
    assert taker == {"A2", "B"}
    a.close()
    b.close()


def test_takeover_races_hand_each_dead_name_to_one_supervisor(store_target):  # noqa: F811
    s = GatewayStore(store_target, shared=True)
    for i in range(20):
        s.heartbeat(f"w{i:02d}", 0.0, {}, host="dead")
    s.execute_sql("UPDATE ingest_workers SET seen=0")
    taken: list[str] = []
    lock = threading.Lock()

    def supervisor(host: str) -> None:
        st = GatewayStore(store_target, shared=True)
        while (name := st.take_over_worker(host, 5.0)) is not None:
            with lock:
                taken.append(name)
        st.close()

    threads = [threading.Thread(target=supervisor, args=(f"h{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(taken) == [f"w{i:02d}" for i in range(20)]
    s.close()


# -- failures ------------------------------------------------------------------------------


def test_a_lost_server_connection_is_one_line_and_the_store_reconnects(pg_url):  # noqa: F811
    import psycopg

    s = GatewayStore(pg_url)
    s.upsert_birth("d", {})
    pid = s._db.info.backend_pid
    with psycopg.connect(parse_store_url(pg_url).dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(StoreError) as e:
        s.upsert_birth("d", {"again": True})
    assert "\n" not in str(e.value) and "postgresql://" in str(e.value)
    s.upsert_birth("d", {"again": True})  # reconnected
    assert s.device("d").birth == {"again": True}
    s.close()


def test_an_unreachable_server_is_one_clear_line():
    with pytest.raises(StateError, match="cannot connect to PostgreSQL") as e:
        GatewayStore("postgresql://nobody:secret@127.0.0.1:1/none")
    msg = str(e.value)
    assert "\n" not in msg and "secret" not in msg and "***" in msg


# -- URLs and gateway.toml -----------------------------------------------------------------


def test_store_urls(tmp_path):
    assert parse_store_url("gw.sqlite", base_dir="/srv").path == "/srv/gw.sqlite"
    assert parse_store_url("sqlite:///gw.sqlite", base_dir="/srv").path == "/srv/gw.sqlite"
    assert parse_store_url("sqlite:////var/lib/gw.sqlite").path == "/var/lib/gw.sqlite"
    assert parse_store_url("sqlite://").path == ":memory:"
    t = parse_store_url("postgresql://gw:pw@db.example:5433/fleet?sslmode=require&schema=site_a")
    assert (t.engine, t.schema) == ("postgresql", "site_a")
    assert "schema" not in t.dsn and "sslmode=require" in t.dsn and "pw" in t.dsn
    assert "pw" not in t.display and "***" in t.display
    for bad, why in [("mysql://x/y", "unknown engine 'mysql'"), ("sqlite:/x", "unknown engine|three slashes"),
                     ("postgresql://h/db?schema=1x", "schema"), ("", "non-empty"),
                     ("postgresql:///db", "names no host")]:
        with pytest.raises(ConfigError, match=why) as e:
            parse_store_url(bad)
        assert "\n" not in str(e.value)


def test_gateway_toml_store_section(tmp_path):
    from edgeflow.gateway.service import load_config

    cfg = tmp_path / "gateway.toml"
    cfg.write_text('[store]\nurl = "postgresql://gw@10.0.0.1:5432/test?schema=lab"\ntelemetry_keep = 50\n')
    c = load_config(cfg)
    assert c.store_target().engine == "postgresql" and c.store_target().schema == "lab" and c.telemetry_keep == 50
    cfg.write_text('[gateway]\nstate = "gw.sqlite"\n')
    assert load_config(cfg).store_target().path == str(tmp_path / "gw.sqlite")
    cfg.write_text('[store]\nurl = "sqlite:///state/gw.sqlite"\n')
    assert load_config(cfg).store_target().path == str(tmp_path / "state" / "gw.sqlite")
    for body, why in [('[store]\nurl = "redis://x"\n', r"\[store\] url .*unknown engine"),
                      ('[store]\nurl = 5\n', "non-empty string"),
                      ('[store]\nuri = "sqlite://"\n', r"unknown key\(s\) \['uri'\]"),
                      ('[gateway]\nstate = "a"\n[store]\nurl = "sqlite:///b"\n', "keep one"),
                      ('[store]\ntelemetry_keep = 0\n', "telemetry_keep")]:
        cfg.write_text(body)
        with pytest.raises(ConfigError, match=why) as e:
            load_config(cfg)
        assert "\n" not in str(e.value) and str(cfg) in str(e.value)


def test_the_cli_names_a_bad_store_url_in_one_line(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "gateway.toml"
    cfg.write_text('[store]\nurl = "postgresql://:5432"\n')
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-m", "edgeflow", "gateway", "--config", str(cfg)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr and "names no host" in p.stderr, p.stderr


def test_gateway_export_model_reads_the_configured_store(store_target, tmp_path):  # noqa: F811
    """`edgeflow gateway --export-model` reads where [store] url points, PostgreSQL included."""
    import hashlib
    import json
    import subprocess
    import sys

    from edgeflow.gateway.store import open_store

    onnx_bytes = b"not-a-real-model-but-bytes"
    store = open_store(store_target)
    try:
        store.add_model(onnx_bytes, hashlib.sha256(onnx_bytes).hexdigest())
    finally:
        store.close()
    url = store_target.dsn if store_target.engine == "postgresql" else "sqlite:///" + store_target.path
    if store_target.schema:
        url += ("&" if "?" in url else "?") + f"schema={store_target.schema}"
    conf = tmp_path / "gw.toml"
    conf.write_text(f'[gateway]\nfleet_dir = "fleet"\n[store]\nurl = "{url}"\n')
    out = tmp_path / "m.onnx"
    r = subprocess.run([sys.executable, "-m", "edgeflow", "gateway", "--config", str(conf), "--export-model", str(out),
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model_version"] == 1
    assert out.read_bytes() == onnx_bytes
