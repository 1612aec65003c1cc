"""Registry over real Mosquitto (generated TLS + ACL config): birth, death, liveness, telemetry."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _fleet import FLEET, PROFILE, artifact, fleet_env, wait_until  # noqa: F401

from edgeflow.protocol.fleet import Death
from edgeflow.gateway.store import GatewayStore
from edgeflow.transport.topics import device_topic

pytestmark = pytest.mark.integration


def test_birth_registers_device_with_profile_versions_and_key(fleet_env) -> None:
    fm = fleet_env.gateway()
    events = []
    fm.add_listener(events.append)
    a = fleet_env.agent()
    assert fm.wait_online([a.device_id], 10)
    rec = fm.device(a.device_id)
    assert rec.profile == PROFILE and rec.online and rec.model_version is None
    assert rec.public_key == a.signer.public_key.hex and rec.bdseq == a.bdseq
    assert rec.birth["trust"] == "registered" and rec.birth["versions"]["edgeflow"]
    assert rec.birth["telemetry_interval_s"] == 0.5 and "set_config" in rec.birth["commands"]
    assert [e.kind for e in events if e.device_id == a.device_id][:1] == ["birth"]
    assert [r.device_id for r in fm.online_devices(PROFILE)] == [a.device_id]
    assert fm.online_devices("jetson-orin-nano") == []


def test_crash_fires_the_will_and_a_clean_stop_announces_shutdown(fleet_env) -> None:
    fm = fleet_env.gateway()
    deaths = {}
    fm.add_listener(lambda e: e.kind == "death" and deaths.setdefault(e.device_id, e.data))
    crashing, polite = fleet_env.agent(), fleet_env.agent()
    assert fm.wait_online([crashing.device_id, polite.device_id], 10)
    crashing.crash()  # TCP dropped without DISCONNECT, like a power cut: the broker publishes the will
    polite.stop()
    assert wait_until(lambda: len(deaths) == 2, 10), deaths
    assert deaths[crashing.device_id] == {"bdseq": crashing.bdseq, "reason": "lost"}
    assert deaths[polite.device_id] == {"bdseq": polite.bdseq, "reason": "shutdown"}
    assert not fm.device(crashing.device_id).online and not fm.device(polite.device_id).online


def test_stale_will_is_ignored_and_a_gateway_restart_sees_the_true_state(fleet_env) -> None:
    fm = fleet_env.gateway()
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    first = a.bdseq
    a.crash()
    assert fm.wait_online([dev], 10, online=False)
    b = fleet_env.agent(dev)  # same state dir: restarted agent, higher bdseq
    assert b.bdseq > first
    assert fm.wait_online([dev], 10)
    # The will of the first session arrives late (e.g. the broker noticed the dead TCP connection only now).
    spoof = fleet_env.transport("tester")
    late_will = Death(dev, first).sign(a.signer.key)  # deaths are signed by the device since issue 20
    spoof.publish(device_topic(FLEET, dev, "death").value, late_will, qos=1).wait(5)
    assert wait_until(lambda: fm.stats().get("deaths_stale", 0) >= 1, 5)
    assert fm.is_online(dev) and fm.device(dev).online

    gone = fleet_env.agent()
    assert fm.wait_online([gone.device_id], 10)
    gone.crash()
    assert fm.wait_online([gone.device_id], 10, online=False)
    # A gateway started now learns both from the retained births and deaths alone.
    fresh = fleet_env.gateway("admin", store=GatewayStore(":memory:"))
    assert wait_until(lambda: fresh.device(dev) is not None and fresh.device(gone.device_id) is not None, 10)
    assert wait_until(lambda: fresh.is_online(dev) and not fresh.is_online(gone.device_id), 5)
    assert fresh.device(dev).online and not fresh.device(gone.device_id).online


def test_heartbeat_timeout_marks_a_silent_device_offline_until_it_reports(fleet_env) -> None:
    fm = fleet_env.gateway(heartbeat_timeout_s=1.0, liveness_check_s=0.1)
    offline = []
    fm.add_listener(lambda e: e.kind == "offline" and offline.append(e.device_id))
    a = fleet_env.agent(telemetry_interval_s=30.0)  # connected, but silent
    assert fm.wait_online([a.device_id], 10)
    assert wait_until(lambda: a.device_id in offline, 5)
    assert not fm.device(a.device_id).online
    ack = fm.command(a.device_id, "set_config", {"telemetry_interval_s": 0.2})
    assert ack.ok and ack.result["changed"] == ["telemetry_interval_s"]
    assert fm.wait_online([a.device_id], 5), "telemetry brings a timed-out device back"


def test_telemetry_has_latency_memory_cpu_queue_battery_and_history_is_bounded(fleet_env, tmp_path) -> None:
    store = GatewayStore(":memory:", telemetry_keep=4)
    fm = fleet_env.gateway(store=store)
    battery = tmp_path / "battery"
    battery.write_text("42 Discharging\n")
    a = fleet_env.agent(battery_file=str(battery), telemetry_interval_s=0.2)
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    ack = fm.send_ota(dev, artifact(fleet_env, 1), version=1).wait(30)
    assert ack.ok, ack.error
    x = np.random.default_rng(0).random((1, 64)).astype(np.float32)
    for _ in range(20):
        a.predict(x)
    assert wait_until(lambda: (fm.latest_telemetry(dev) or {}).get("inferences", 0) > 0, 5)
    t = fm.latest_telemetry(dev)
    assert t["model_version"] == 1 and t["bdseq"] == a.bdseq and t["device"] == dev
    assert 0 < t["latency_p50_ms"] <= t["latency_p95_ms"] < 1000
    assert t["rss_bytes"] > 10 * 2**20 and t["cpu_percent"] >= 0 and t["queue_depth"] == 0
    assert t["battery"] == pytest.approx(0.42) and t["charging"] is False
    assert wait_until(lambda: len(store.telemetry(dev, limit=100)) >= 4 and fm.stats()["telemetry_stored"] >= 6, 5)
    assert len(store.telemetry(dev, limit=100)) == 4, "history is bounded to telemetry_keep rows"
    lag = fm.stats()["telemetry_lag_ms"]
    assert 0 < lag["p50"] <= lag["p95"] < 2000
    assert json.loads(json.dumps(t)) == t


class _Participant:
    """The least a training participant does (edgeflow.federated.Client in production)."""

    def __init__(self, agent) -> None:
        self.running = False

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def status(self) -> dict:
        return {"running": self.running}


def test_round_candidates_for_the_round_manager(fleet_env, tmp_path) -> None:
    """Only devices that take part in rounds are trainable candidates; the others say why (a device
    without training data used to be selected and then never answered)."""
    pytest.importorskip("edgeflow.gateway.rounds")
    fm = fleet_env.gateway()
    battery = tmp_path / "b"
    battery.write_text("80")
    a = fleet_env.agent(battery_file=str(battery), telemetry_interval_s=0.2, start=False)
    a.make_participant = _Participant
    a.start()
    bare = fleet_env.agent(telemetry_interval_s=0.2)  # no training data
    assert fm.wait_online([a.device_id, bare.device_id], 10)
    assert wait_until(lambda: "battery" in (fm.latest_telemetry(a.device_id) or {}), 5)
    c = {c.device_id: c for c in fm.round_candidates()}[a.device_id]
    assert (c.profile, c.can_train, c.battery) == (PROFILE, False, pytest.approx(0.8))
    assert "no model" in c.why, "no model deployed yet"
    assert fm.send_ota(a.device_id, artifact(fleet_env, 1), version=1).wait(30).ok
    assert wait_until(lambda: {c.device_id: c for c in fm.round_candidates()}[a.device_id].can_train, 5)
    assert a.training and a.participant.running, "it joins by default: no train_start needed"
    c = {c.device_id: c for c in fm.round_candidates()}[bare.device_id]
    assert not c.can_train and "--train-data" in c.why
    assert fm.keyring.get(a.device_id) == a.signer.public_key
