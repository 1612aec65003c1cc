"""Canary rollouts to 10 real agents over the generated TLS + ACL Mosquitto."""

from __future__ import annotations

import pytest
from _fleet import FLEET, PROFILE, artifact, fleet_env, mlp_bytes, wait_until  # noqa: F401

from edgeflow.gateway.ota import Rollout, RolloutPolicy, build_artifacts, parse_selector, plan_waves, select_devices
from edgeflow.artifact import verify_artifact

pytestmark = pytest.mark.integration


def test_wave_planning_and_selectors() -> None:
    ids = [f"d{i}" for i in range(10)]
    p = RolloutPolicy(canary=0.1, min_canaries=1)
    assert plan_waves(ids, p.canary_count(10), 3) == [["d0"], ["d1", "d2", "d3"], ["d4", "d5", "d6"], ["d7", "d8", "d9"]]
    assert plan_waves(ids, RolloutPolicy(canary=0.25).canary_count(10), None) == [ids[:3], ids[3:]]
    assert RolloutPolicy(canary=0.1).canary_count(10) == 2 and RolloutPolicy(canary=1).canary_count(1) == 1  # k of n
    assert RolloutPolicy(canary=2).canary_count(10) == 2 and RolloutPolicy(canary=0.01, min_canaries=1).canary_count(10) == 1
    assert parse_selector("profile=raspberry-pi-4,device=pi-*|cam-?") == {
        "profile": ["raspberry-pi-4"], "device": ["pi-*", "cam-?"]}
    assert parse_selector("all") == {}
    with pytest.raises(Exception, match="bad target"):
        parse_selector("colour=red")


def test_canary_rollout_to_ten_devices_one_fails_its_health_check(fleet_env) -> None:
    fm = fleet_env.gateway(command_timeout_s=30)
    agents = [fleet_env.agent() for _ in range(10)]
    ids = [a.device_id for a in agents]
    other = fleet_env.agent(profile="jetson-orin-nano")  # not targeted by profile
    assert fm.wait_online(ids + [other.device_id], 15)
    key = fleet_env.fleet_dir.fleet_key()

    # v1 everywhere (one artifact per profile, golden data computed here).
    targets = select_devices(fm.devices(), f"profile={PROFILE}", online=fm.is_online)
    assert [t.device_id for t in targets] == sorted(ids)
    arts = build_artifacts(mlp_bytes(1), [PROFILE], key, version=1, fleet=FLEET)
    assert verify_artifact(arts[PROFILE], key.public_key, profile=PROFILE).golden() is not None
    rep = Rollout(fm, arts, targets, RolloutPolicy(canary=0.1, min_canaries=1, report_timeout_s=30)).run()
    assert rep.state == "completed" and rep.counts() == {"ok": 10}, rep.to_dict()
    assert [len(w) for w in rep.waves] == [1, 9]

    # One board has far less free memory than its profile says: v2 cannot pass its health check there.
    bad = ids[2]
    assert fm.command(bad, "set_config", {"memory_budget_mb": 0}).ok
    seen = []
    policy = RolloutPolicy(canary=0.1, min_canaries=1, wave_size=3, failure_threshold=0.2, report_timeout_s=30)
    rep = Rollout(fm, build_artifacts(mlp_bytes(2), [PROFILE], key, version=2, fleet=FLEET), targets, policy,
                  on_progress=lambda r, d: seen.append((d.device_id, d.state))).run()
    assert rep.waves == [ids[:1], ids[1:4], ids[4:7], ids[7:]]
    r = rep.devices[bad]
    assert (r.state, r.code, r.rolled_back, r.model_version) == ("failed", "health_check_failed", True, 1)
    assert r.health["stage"] == "load" and "budget" in r.error
    assert rep.state == "halted" and rep.failure_rate == pytest.approx(0.25)
    assert "25%" in rep.halted_reason and "wave 1" in rep.halted_reason
    assert rep.counts() == {"ok": 3, "failed": 1, "skipped": 6}
    assert [d for d, _ in seen] == ids[:4], "the halted waves were never sent"
    by_id = {a.device_id: a for a in agents}
    assert by_id[bad].model_version == 1, "the failing board stayed on its working model"
    assert all(by_id[d].model_version == 2 for d in ids[:4] if d != bad)
    assert all(by_id[d].model_version == 1 for d in ids[4:])
    assert other.model_version is None
    assert wait_until(lambda: all(fm.device(d).model_version == (2 if d in ids[:4] and d != bad else 1) for d in ids), 5)

    # The same board as the canary: the rollout stops before touching anyone else.
    order = [bad] + [d for d in ids if d != bad]
    recs = {t.device_id: t for t in select_devices(fm.devices(), f"profile={PROFILE}")}
    rep = Rollout(fm, build_artifacts(mlp_bytes(3), [PROFILE], key, version=3, fleet=FLEET),
                  [recs[d] for d in order], RolloutPolicy(canary=0.1, min_canaries=1, report_timeout_s=30)).run()
    assert rep.state == "halted" and "canary" in rep.halted_reason
    assert rep.counts() == {"failed": 1, "skipped": 9}
    assert all(a.model_version in (1, 2) for a in agents)


def test_a_device_that_never_reports_is_rolled_back_when_it_returns(fleet_env, tmp_path) -> None:
    fm = fleet_env.gateway(command_timeout_s=30)
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    assert fm.send_ota(dev, artifact(fleet_env, 1), version=1).wait(30).ok
    a.crash()  # gone before the rollout; its persistent session queues what is sent to it
    assert fm.wait_online([dev], 10, online=False)
    rec = fm.device(dev)
    rep = Rollout(fm, {PROFILE: artifact(fleet_env, 2)}, [rec],
                  RolloutPolicy(canary=1, report_timeout_s=1.0, failure_threshold=0.5)).run()
    r = rep.devices[dev]
    assert (r.state, r.rolled_back) == ("timeout", True) and rep.state == "halted"
    acks = []
    fm.add_listener(lambda e: e.kind == "ack" and e.device_id == dev and acks.append(e.data))
    back = fleet_env.agent(dev)  # comes back: gets the queued offer, installs v2, then the conditional rollback
    assert wait_until(lambda: len(acks) >= 2, 20), acks
    assert [(x["name"], x["ok"]) for x in acks[:2]] == [("deploy", True), ("rollback", True)]
    assert acks[1]["result"] == {"model_version": 1, "previous_version": 2}
    assert back.model_version == 1
    assert fm.stats().get("acks_late", 0) >= 1
