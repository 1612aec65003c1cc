"""A lying canary cannot open the fleet to a rollout (issue 31): each offer carries a challenge, a device's ok
counts only with the offered model's outputs on the challenge's inputs (checked against the gateway's own run),
and the waves after the canary need ``min_canaries`` verified canaries. Real DeviceAgents over loopback
transports; the liars are real agents whose deploy handler lies."""

from __future__ import annotations

import numpy as np
import pytest
from _lbdevices import PROFILE, lb_env, mlp_bytes  # noqa: F401

from edgeflow.artifact import EVIDENCE_SAMPLES, challenge_inputs, evidence_problem, make_golden, sample_outputs
from edgeflow.gateway.ota import Rollout, RolloutPolicy, build_artifacts, select_devices


def _liar(agent, how: str):
    """Make ``agent`` ack every offer ok without installing it: with no evidence, or with values copied
    from the artifact's golden outputs (which it has) instead of the challenge's."""
    ota = agent.ota

    def deploy(cmd, data, art):
        result = {"model_version": art.version, "health": {"ok": True}}
        if how == "golden":
            result["evidence"] = sample_outputs(art.golden().expected, cmd.args["challenge"])
        ota.finish(cmd, result)

    ota.deploy = deploy


def _fleet(lb_env, n):
    fm = lb_env.gateway(command_timeout_s=20)
    agents = [lb_env.agent() for _ in range(n)]
    assert fm.wait_online([a.device_id for a in agents], 5)
    return fm, agents, select_devices(fm.devices(), f"profile={PROFILE}", online=fm.is_online)


def test_an_honest_rollout_is_verified_device_by_device(lb_env):
    fm, agents, targets = _fleet(lb_env, 4)
    rep = Rollout(fm, build_artifacts(mlp_bytes(1), [PROFILE], lb_env.fleet_key, version=1, fleet="lab"), targets,
                  RolloutPolicy(report_timeout_s=20)).run()
    assert rep.state == "completed" and rep.counts() == {"ok": 4}, rep.to_dict()
    assert [len(w) for w in rep.waves] == [2, 2]  # two canaries by default (min_canaries)
    assert {r.evidence for r in rep.devices.values()} == {"verified"}
    assert all(a.model_version == 1 for a in agents)


@pytest.mark.parametrize("how", ["silent", "golden"])
def test_a_lying_canary_is_caught_and_the_fleet_is_not_touched(lb_env, how):
    fm, agents, targets = _fleet(lb_env, 5)
    liar = agents[0]  # sorted first: a canary
    assert liar.device_id == targets[0].device_id
    _liar(liar, how)
    rep = Rollout(fm, build_artifacts(mlp_bytes(2), [PROFILE], lb_env.fleet_key, version=2, fleet="lab"), targets,
                  RolloutPolicy(report_timeout_s=20, failure_threshold=0.9)).run()
    r = rep.devices[liar.device_id]
    assert (r.state, r.code) == ("failed", "bad_evidence") and r.rolled_back, r
    assert ("no evidence" in r.evidence) if how == "silent" else ("the gateway computed" in r.evidence)
    assert rep.state == "halted" and "only 1 of the 2 canaries succeeded with verified evidence" in rep.halted_reason
    assert rep.counts() == {"failed": 1, "ok": 1, "skipped": 3}
    assert [a.model_version for a in agents[2:]] == [None, None, None], "the rest of the fleet never got v2"


def test_one_verified_canary_is_not_enough_when_two_are_asked(lb_env):
    """Even with a tolerant failure threshold, a canary wave of 2 with one liar stops the rollout (without
    the k-of-n rule the 50% failure rate would pass failure_threshold 0.9)."""
    fm, agents, targets = _fleet(lb_env, 3)
    _liar(agents[1], "silent")
    rep = Rollout(fm, build_artifacts(mlp_bytes(3), [PROFILE], lb_env.fleet_key, version=3, fleet="lab"), targets,
                  RolloutPolicy(report_timeout_s=20, failure_threshold=0.9)).run()
    assert rep.state == "halted" and agents[2].model_version is None


def test_the_challenge_is_unpredictable_and_the_check_has_the_golden_tolerance():
    art_model = mlp_bytes(4)
    golden = make_golden(art_model, PROFILE, np.random.default_rng(0).random((2, 64)).astype(np.float32))
    a, b = challenge_inputs(golden, "ab" * 16), challenge_inputs(golden, "cd" * 16)
    x = golden.inputs[next(iter(golden.inputs))]
    assert not np.allclose(a[next(iter(a))], x) and not np.allclose(a[next(iter(a))], b[next(iter(b))])
    seed = "ab" * 16
    ours = sample_outputs(make_golden(art_model, PROFILE, a).expected, seed)
    assert all(len(v) == min(EVIDENCE_SAMPLES, 2 * 10) for v in ours.values())
    assert evidence_problem(ours, ours, golden.atol, golden.rtol) is None
    nudged = {k: [v + 0.5 * golden.atol for v in vals] for k, vals in ours.items()}
    assert evidence_problem(ours, nudged, golden.atol, golden.rtol) is None  # board arithmetic within tolerance
    off = {k: [v + 0.1 for v in vals] for k, vals in ours.items()}
    assert "the gateway computed" in evidence_problem(ours, off, golden.atol, golden.rtol)
    assert "no evidence" in evidence_problem(ours, None, golden.atol, golden.rtol)
    with pytest.raises(Exception, match="16-64 lowercase hex digits"):
        challenge_inputs(golden, "../../etc")
