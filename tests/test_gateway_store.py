"""The gateway's SQLite state: durable, deduplicating, bounded."""

from __future__ import annotations

import time

import pytest

from edgeflow.gateway.store import GatewayStore


def test_updates_are_stored_once_and_survive_reopen(tmp_path):
    path = tmp_path / "gw.sqlite"
    s = GatewayStore(path)
    s.open_round(1, model_version=1, deadline=time.time() + 60, config={"lr": 0.1}, selected=["a", "b"])
    assert s.add_update(1, "a", seq=1, num_samples=10, envelope=b"A" * 100)
    assert not s.add_update(1, "a", seq=1, num_samples=10, envelope=b"A" * 100)  # redelivery
    assert s.add_update(1, "b", seq=4, num_samples=5, envelope=b"B")
    s.close()
    s = GatewayStore(path)  # a restarted gateway
    (r,) = s.open_rounds()
    assert r.round_id == 1 and r.config == {"lr": 0.1} and r.selected == ["a", "b"]
    got = list(s.updates(1))
    assert [(u.device_id, u.num_samples, u.envelope) for u in got] == [("a", 10, b"A" * 100), ("b", 5, b"B")]
    s.close_round(1, {"participants": 2})
    assert s.open_rounds() == [] and s.round(1).metrics == {"participants": 2}
    s.drop_updates(1)
    assert s.update_count(1) == 0


def test_models_versioned():
    s = GatewayStore()
    assert s.latest_model() is None
    v1 = s.add_model(b"m1", "h1")
    v2 = s.add_model(b"m2", "h2", round_id=3, metrics={"acc": 0.9})
    assert (v1, v2) == (1, 2)
    assert s.latest_model() == (2, b"m2", "h2")
    assert s.model(1) == (b"m1", "h1")
    assert [m["version"] for m in s.model_versions()] == [1, 2]


def test_registry_liveness_and_stale_will():
    s = GatewayStore()
    s.upsert_birth("d1", {"profile": "raspberry-pi-4"}, profile="raspberry-pi-4", public_key="ab", bdseq=3)
    assert s.device("d1").online
    assert not s.set_online("d1", False, bdseq=2)  # a will from an older session
    assert s.device("d1").online
    assert s.set_online("d1", False, bdseq=3)
    assert not s.device("d1").online
    s.upsert_birth("d1", {}, profile="raspberry-pi-4", bdseq=4)
    assert s.device("d1").public_key == "ab"  # kept when a birth omits it
    s._db.execute("UPDATE devices SET last_seen=0 WHERE device_id='d1'")
    assert s.expire(10) == ["d1"] and not s.device("d1").online


def test_telemetry_history_is_bounded():
    s = GatewayStore(telemetry_keep=5)
    s.upsert_birth("d", {})
    for i in range(12):
        s.add_telemetry("d", {"i": i}, ts=1000.0 + i)
    hist = s.telemetry("d", limit=100)
    assert [d["i"] for _, d in hist] == [7, 8, 9, 10, 11]


def test_schema_mismatch_is_clear(tmp_path):
    p = tmp_path / "s.sqlite"
    s = GatewayStore(p)
    s._db.execute("UPDATE meta SET value='99' WHERE key='schema'")
    s.close()
    with pytest.raises(RuntimeError, match="schema 99"):
        GatewayStore(p)
