"""Signed OTA rollouts without a broker: real DeviceAgents (A/B slots, health checks,
rollback) and the gateway's Rollout over loopback transports (tests/test_fleet_rollout.py
runs the same on Mosquitto)."""

from __future__ import annotations

import numpy as np
import pytest
from _lbdevices import PROFILE, artifact, lb_env, mlp_bytes, wait_until  # noqa: F401

from edgeflow.gateway.ota import Rollout, RolloutPolicy, build_artifacts, select_devices
from edgeflow.runtime.session import load
from edgeflow.transport.topics import device_topic


def test_canary_rollout_halts_on_a_failing_board_which_keeps_its_working_model(lb_env):
    fm = lb_env.gateway(command_timeout_s=20)
    agents = [lb_env.agent() for _ in range(6)]
    ids = [a.device_id for a in agents]
    other = lb_env.agent(profile="jetson-orin-nano")  # not targeted by profile
    assert fm.wait_online(ids + [other.device_id], 5)
    key = lb_env.fleet_key

    targets = select_devices(fm.devices(), f"profile={PROFILE}", online=fm.is_online)
    assert [t.device_id for t in targets] == sorted(ids)
    rep = Rollout(fm, build_artifacts(mlp_bytes(1), [PROFILE], key, version=1, fleet="lab"), targets,
                  RolloutPolicy(canary=1, min_canaries=1, report_timeout_s=20)).run()
    assert rep.state == "completed" and rep.counts() == {"ok": 6}, rep.to_dict()
    assert [len(w) for w in rep.waves] == [1, 5]

    bad = ids[2]  # far less free memory than its profile says: v2 fails its health check there
    assert fm.command(bad, "set_config", {"memory_budget_mb": 0}).ok
    policy = RolloutPolicy(canary=1, min_canaries=1, wave_size=2, failure_threshold=0.2, report_timeout_s=20)
    rep = Rollout(fm, build_artifacts(mlp_bytes(2), [PROFILE], key, version=2, fleet="lab"), targets, policy).run()
    assert rep.waves == [ids[:1], ids[1:3], ids[3:5], ids[5:]]
    r = rep.devices[bad]
    assert (r.state, r.code, r.rolled_back, r.model_version) == ("failed", "health_check_failed", True, 1)
    assert r.health["stage"] == "load" and "budget" in r.error
    assert rep.state == "halted" and rep.counts() == {"ok": 2, "failed": 1, "skipped": 3}
    by_id = {a.device_id: a for a in agents}
    assert by_id[bad].model_version == 1, "the failing board stayed on its working model"
    assert [by_id[d].model_version for d in ids] == [2, 2, 1, 1, 1, 1]
    assert other.model_version is None
    x = np.random.default_rng(1).random((2, 64)).astype(np.float32)
    np.testing.assert_allclose(by_id[ids[0]].predict(x), load(mlp_bytes(2), PROFILE)(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(by_id[bad].predict(x), load(mlp_bytes(1), PROFILE)(x), rtol=1e-5, atol=1e-5)
    lb_env.hub.settle()
    assert all(fm.device(d).model_version == by_id[d].model_version for d in ids), "the registry follows births"


def test_forged_and_downgrade_offers_are_refused(lb_env):
    from edgeflow.signing import PrivateKey

    fm = lb_env.gateway()
    a = lb_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 5)
    assert fm.send_ota(dev, artifact(lb_env, 2), version=2).wait(20).ok
    old = fm.send_ota(dev, artifact(lb_env, 1), version=1).wait(20)
    assert not old.ok and a.model_version == 2  # an older version needs allow_downgrade
    assert fm.send_ota(dev, artifact(lb_env, 1), version=1, allow_downgrade=True).wait(20).ok
    # an artifact signed by someone else, in a validly signed deploy: refused, nothing installed
    real_key, lb_env.fleet_key = lb_env.fleet_key, PrivateKey.generate()
    forged = artifact(lb_env, 3)
    lb_env.fleet_key = real_key
    ack = fm.send_ota(dev, forged, version=3).wait(20)
    assert not ack.ok and a.model_version == 1


def test_a_device_that_never_reports_is_rolled_back_when_it_returns(lb_env):
    fm = lb_env.gateway(command_timeout_s=20)
    a = lb_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 5)
    assert fm.send_ota(dev, artifact(lb_env, 1), version=1).wait(20).ok
    a.crash()  # gone before the rollout; its persistent session keeps what is sent to it
    assert fm.wait_online([dev], 5, online=False)
    rep = Rollout(fm, {PROFILE: artifact(lb_env, 2)}, [fm.device(dev)],
                  RolloutPolicy(canary=1, report_timeout_s=0.5, failure_threshold=0.5)).run()
    r = rep.devices[dev]
    assert (r.state, r.rolled_back) == ("timeout", True) and rep.state == "halted"
    assert lb_env.hub.stats["queued_offline"] >= 2  # the offer and the conditional rollback wait at the hub
    acks = []
    fm.add_listener(lambda e: e.kind == "ack" and e.device_id == dev and acks.append(e.data))
    back = lb_env.agent(dev)  # same state dir and client id: resumes the session, gets the queued offer
    lb_env.hub.settle()
    assert wait_until(lambda: len(acks) >= 2, 10), acks
    assert [(x["name"], x["ok"]) for x in acks[:2]] == [("deploy", True), ("rollback", True)]
    assert acks[1]["result"] == {"model_version": 1, "previous_version": 2}
    assert back.model_version == 1
    assert fm.stats().get("acks_late", 0) >= 1


def test_an_offer_redelivered_across_a_dropped_connection_installs_once(tmp_path):
    """At least once, made to happen: the agent's connection drops as the offer arrives (it
    waits for the resumed session), then the hub delivers it twice, and later it is
    replayed. The deploy runs once; the copy that came while it ran gets no second ack
    (that ack was still coming), the replay gets the same signed ack again."""
    import json

    from _lbdevices import LoopbackFleetEnv

    from edgeflow.protocol.fleet import Ack
    from edgeflow.transport.loopback import LoopbackBroker

    hub = LoopbackBroker(duplicate_qos1=lambda m: m.topic.endswith("/ota"))
    env = LoopbackFleetEnv(tmp_path, hub)
    try:
        fm = env.gateway(command_timeout_s=20)
        a = env.agent()
        dev = a.device_id
        assert fm.wait_online([dev], 5)
        acks: list[Ack] = []
        offers: list[bytes] = []
        topic = device_topic("lab", dev, "ota").value
        tester = hub.transport("tester")
        tester.subscribe(device_topic("lab", dev, "cmd/ack").value,
                         lambda m: acks.append(Ack.from_body(json.loads(json.loads(m.payload)["body"]))))
        tester.subscribe(topic, lambda m: offers.append(m.payload), qos=0)
        tester.connect()

        cuts: list[str] = []

        def cut(msg) -> bool:
            if msg.topic == topic and not cuts:
                cuts.append(msg.topic)
                hub.disconnect(dev, reconnect_after=0.05)
            return False  # never drops: it only cuts the connection, once

        hub.drop(cut)
        ack = fm.send_ota(dev, artifact(env, 1), version=1).wait(20)
        assert ack.ok and ack.result["model_version"] == 1
        hub.settle()
        assert hub.stats["queued_offline"] >= 1 and hub.stats["duplicated"] >= 1
        assert a.model_version == 1 and a.counters["deploys"] == 1
        assert [x.id for x in acks] == [ack.id]
        # the agent keeps the ack once the deploy is over (a replay in between gets none: its ack
        # has just been sent)
        assert wait_until(lambda: a.seen.ack(ack.id) is not None, 5)
        tester.publish(topic, offers[0]).wait(1)  # a replay of the captured offer
        hub.settle()
        assert wait_until(lambda: len(acks) == 3, 5)  # the replay was delivered twice too
        assert acks[1] == acks[0] == acks[2] and cuts
        assert a.counters["deploys"] == 1
    finally:
        env.close()
