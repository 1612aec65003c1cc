"""Fleet registry, liveness and commands without a broker: real DeviceAgents and a real
FleetManager over loopback transports (tests/test_fleet_registry.py and
test_fleet_commands.py run the same logic on the generated TLS + ACL Mosquitto)."""

from __future__ import annotations

import json

from _lbdevices import FLEET, PROFILE, lb_env, wait_until  # noqa: F401

from edgeflow.protocol.fleet import Ack, Command, Death
from edgeflow.gateway.store import GatewayStore
from edgeflow.transport.loopback import LoopbackBroker
from edgeflow.transport.topics import device_topic


def test_birth_registers_the_device_and_deaths_tell_crash_from_shutdown(lb_env):
    fm = lb_env.gateway()
    events = []
    fm.add_listener(events.append)
    crashing, polite = lb_env.agent(), lb_env.agent()
    assert fm.wait_online([crashing.device_id, polite.device_id], 5)
    rec = fm.device(crashing.device_id)
    assert rec.profile == PROFILE and rec.online and rec.bdseq == crashing.bdseq
    assert rec.public_key == crashing.signer.public_key.hex and rec.birth["trust"] == "registered"
    assert [e.kind for e in events if e.device_id == crashing.device_id][:1] == ["birth"]
    crashing.crash()  # the connection drops without DISCONNECT: the hub publishes the will
    polite.stop()
    lb_env.hub.settle()
    assert fm.wait_online([crashing.device_id, polite.device_id], 5, online=False)
    deaths = {e.device_id: e.data for e in events if e.kind == "death"}
    assert deaths[crashing.device_id] == {"bdseq": crashing.bdseq, "reason": "lost"}
    assert deaths[polite.device_id] == {"bdseq": polite.bdseq, "reason": "shutdown"}


def test_a_vanished_device_goes_offline_and_a_stale_will_cannot_kill_its_new_session(lb_env):
    fm = lb_env.gateway()
    a = lb_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 5)
    first = a.bdseq
    lb_env.hub.disconnect(dev, reconnect_after=None)  # the network goes away: the will fires
    lb_env.hub.settle()
    assert fm.wait_online([dev], 5, online=False)
    lb_env.hub.reconnect(dev)  # back: a new session (new bdseq) and a new birth
    lb_env.hub.settle()
    assert fm.wait_online([dev], 5) and a.bdseq > first
    # the first session's will, arriving late (a broker that noticed the dead connection only now)
    spoof = lb_env.hub.transport("tester").connect()
    spoof.publish(device_topic(FLEET, dev, "death").value, Death(dev, first).sign(a.signer.key)).wait(1)
    lb_env.hub.settle()
    assert fm.stats().get("deaths_stale", 0) >= 1 and fm.is_online(dev)
    # a gateway started now learns the true state from the retained births and deaths alone
    gone = lb_env.agent()
    assert fm.wait_online([gone.device_id], 5)
    gone.crash()
    fresh = lb_env.gateway(store=GatewayStore(":memory:"))
    lb_env.hub.settle()
    assert fresh.is_online(dev) and not fresh.is_online(gone.device_id)


def test_heartbeat_timeout_marks_a_silent_device_offline_until_it_reports(lb_env):
    fm = lb_env.gateway(heartbeat_timeout_s=0.5, liveness_check_s=0.05)
    offline = []
    fm.add_listener(lambda e: e.kind == "offline" and offline.append(e.device_id))
    a = lb_env.agent(telemetry_interval_s=30.0)  # connected, but silent
    assert fm.wait_online([a.device_id], 5)
    assert wait_until(lambda: a.device_id in offline, 5)
    ack = fm.command(a.device_id, "set_config", {"telemetry_interval_s": 0.1})
    assert ack.ok and ack.result["changed"] == ["telemetry_interval_s"]
    assert fm.wait_online([a.device_id], 5), "telemetry brings a timed-out device back"


def test_status_set_config_and_unknown_commands_each_get_one_signed_ack(lb_env):
    fm = lb_env.gateway()
    a = lb_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 5)
    st = fm.command(dev, "status")
    assert st.ok and st.result["device"] == dev and st.result["profile"] == PROFILE
    bad = fm.command(dev, "set_config", {"telemetry_interval_s": -1})
    assert not bad.ok and bad.code == "bad_args"
    unknown = fm.command(dev, "self_destruct")
    assert not unknown.ok and unknown.code == "unknown_command"
    assert a.counters["commands"] >= 3


def test_a_redelivered_command_is_acked_again_but_runs_once(tmp_path):
    """QoS 1 at least once, made to happen: the hub delivers every command twice."""
    from _lbdevices import LoopbackFleetEnv

    env = LoopbackFleetEnv(tmp_path, LoopbackBroker(duplicate_qos1=lambda m: m.topic.endswith("/cmd")))
    try:
        fm = env.gateway()
        a = env.agent()
        dev = a.device_id
        assert fm.wait_online([dev], 5)
        got = []
        tester = env.hub.transport("tester")
        tester.subscribe(device_topic(FLEET, dev, "cmd/ack").value,
                         lambda m: got.append(Ack.from_body(json.loads(json.loads(m.payload)["body"]))))
        tester.connect()
        cmd = Command.make("set_config", dev, FLEET, {"telemetry_interval_s": 3.0})
        tester.publish(device_topic(FLEET, dev, "cmd").value, cmd.sign(env.fleet_key)).wait(1)
        env.hub.settle()
        assert wait_until(lambda: len(got) == 2, 5)
        assert got[0] == got[1] and got[0].ok and got[0].id == cmd.id
        assert a.counters["commands"] == 1 and a.options.telemetry_interval_s == 3.0
    finally:
        env.close()


def test_round_candidates_come_from_the_registry(lb_env, tmp_path):
    fm = lb_env.gateway()
    battery = tmp_path / "b"
    battery.write_text("80")
    a = lb_env.agent(battery_file=str(battery), telemetry_interval_s=0.1)
    other = lb_env.agent(profile="jetson-orin-nano")
    assert fm.wait_online([a.device_id, other.device_id], 5)
    assert wait_until(lambda: "battery" in (fm.latest_telemetry(a.device_id) or {}), 5)
    cands = {c.device_id: c for c in fm.round_candidates()}
    assert (cands[a.device_id].profile, cands[a.device_id].battery) == (PROFILE, 0.8)
    assert cands[other.device_id].profile == "jetson-orin-nano"
    other.crash()
    lb_env.hub.settle()
    assert wait_until(lambda: other.device_id not in {c.device_id for c in fm.round_candidates()}, 5)


def test_a_device_is_online_only_once_its_registry_row_is_written(lb_env):
    """wait_online() returning means fm.device() holds the new birth's row: the birth's store write is held
    here until the test releases it, and until then the device is not online."""
    import threading

    fm = lb_env.gateway()
    entered, release = threading.Event(), threading.Event()
    write = fm.store.upsert_birth

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(10), "the test never released the registry write"
        return write(*args, **kwargs)

    fm.store.upsert_birth = held
    a = lb_env.agent(start=False)
    starting = threading.Thread(target=a.start, daemon=True)
    starting.start()
    try:
        assert entered.wait(10), "the birth never reached the registry write"
        assert not fm.is_online(a.device_id) and fm.device(a.device_id) is None
        assert not fm.wait_online([a.device_id], 0.2)
    finally:
        release.set()
    assert fm.wait_online([a.device_id], 5)
    rec = fm.device(a.device_id)
    assert rec is not None and rec.online and rec.bdseq == a.bdseq
    starting.join(10)


def test_retained_junk_is_counted_cleared_only_once_deleted_and_logged(lb_env, caplog, monkeypatch):
    """``retained_junk_cleared`` counts junk deleted at the broker and reported: while the deleting publish
    is held, the count stays 0; once it goes out, the count and the one log line are both there (the last CI
    run found the count ahead of the log line)."""
    import logging
    import threading

    from edgeflow.transport.loopback import LoopbackTransport

    junk_topic = device_topic(FLEET, "dev-9", "telemetry").value
    lb_env.hub.transport("attacker").connect().publish(junk_topic, b"junk", retain=True, raw=True).wait(5)
    entered, release = threading.Event(), threading.Event()
    publish = LoopbackTransport.publish

    def held(self, topic, payload, *args, **kwargs):
        if topic == junk_topic and payload == b"" and kwargs.get("retain"):
            entered.set()
            assert release.wait(10), "the test never released the delete"
        return publish(self, topic, payload, *args, **kwargs)

    monkeypatch.setattr(LoopbackTransport, "publish", held)
    caplog.set_level(logging.WARNING, logger="edgeflow.gateway.fleet")
    made = []
    starting = threading.Thread(target=lambda: made.append(lb_env.gateway()), daemon=True)
    starting.start()
    try:
        assert entered.wait(10), "the retained junk never reached the delete"
        starting.join(5)
        assert made and made[0].stats().get("retained_junk_cleared", 0) == 0
    finally:
        release.set()
    starting.join(10)
    fm = made[0]
    assert wait_until(lambda: fm.stats().get("retained_junk_cleared", 0) == 1, 5)
    assert [r.getMessage().split()[4] for r in caplog.records if "cleared retained junk" in r.getMessage()] == \
        [junk_topic]
