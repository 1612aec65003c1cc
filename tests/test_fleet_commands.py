"""Every command with its ack, OTA deploy/rollback, inference over MQTT, and the agent's refusals
of unsigned or wrongly signed commands and models (the broker lets the gateway user publish
anything, so these are refused by the agent itself). Real Mosquitto with the generated config."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import numpy as np
import pytest
from _fleet import FLEET, PROFILE, artifact, fleet_env, mlp_bytes, wait_until  # noqa: F401

from edgeflow.protocol.fleet import Ack, Command, decode_tensor, encode_tensor, sign_inference_request
from edgeflow.protocol.ota import OtaOffer, deploy_command
from edgeflow.protocol.signed_json import sign_body
from edgeflow.runtime.session import load
from edgeflow.signing import PrivateKey
from edgeflow.transport.topics import device_topic

pytestmark = pytest.mark.integration


class CountingParticipant:
    """A minimal training participant: the protocol the agent hosts (edgeflow.federated.Client in production)."""

    made: list[CountingParticipant] = []

    def __init__(self, agent: Any) -> None:
        self.model_path = agent.model_path
        self.model_version = agent.model_version
        self.running = False
        self.starts = self.stops = 0
        CountingParticipant.made.append(self)

    def start(self) -> None:
        self.running, self.starts = True, self.starts + 1

    def stop(self) -> None:
        self.running, self.stops = False, self.stops + 1

    def status(self) -> dict[str, Any]:
        return {"running": self.running, "rounds_trained": 0, "last_round": -1}


@pytest.fixture
def fm(fleet_env):
    return fleet_env.gateway()


def _acks(fleet_env, device: str) -> tuple[list[Ack], Any]:
    """Listen to a device's acks as the tester operator (raw: sees refusals of unknown ids too)."""
    got: list[Ack] = []
    t = fleet_env.transport("tester", connect=False)

    def on(msg: Any) -> None:
        got.append(Ack.from_body(json.loads(json.loads(msg.payload)["body"])))

    t.subscribe(device_topic(FLEET, device, "cmd/ack").value, on)
    t.connect()
    return got, t


def test_status_set_config_unknown_and_misrouted_commands(fleet_env, fm) -> None:
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    st = fm.command(dev, "status")
    assert st.ok and st.code == "ok" and st.result["device"] == dev and st.result["model_version"] is None

    ack = fm.command(dev, "set_config", {"telemetry_interval_s": 2.5, "memory_budget_mb": 512})
    assert ack.ok and ack.result["changed"] == ["memory_budget_mb", "telemetry_interval_s"]
    assert a.options.telemetry_interval_s == 2.5 and a.slots.state()["config"]["memory_budget_mb"] == 512
    assert wait_until(lambda: fm.birth(dev).telemetry_interval_s == 2.5, 5), "the birth is re-announced"

    bad = fm.command(dev, "set_config", {"colour": "blue"})
    assert not bad.ok and bad.code == "bad_args" and "colour" in bad.error and "telemetry_interval_s" in bad.error
    bad = fm.command(dev, "set_config", {"telemetry_interval_s": -1})
    assert not bad.ok and bad.code == "bad_args" and "between" in bad.error
    bad = fm.command(dev, "launch_missiles")
    assert not bad.ok and bad.code == "unknown_command" and "understands" in bad.error
    bad = fm.command(dev, "deploy", {"version": 3})
    assert not bad.ok and bad.code == "bad_message" and "ota" in bad.error
    bad = fm.command(dev, "rollback")
    assert not bad.ok and bad.code == "no_model"


def test_training_commands_host_the_participant(fleet_env, fm) -> None:
    CountingParticipant.made.clear()
    no_factory = fleet_env.agent()
    a = fleet_env.agent(start=False)
    a.make_participant = CountingParticipant
    a.start()
    cannot = fleet_env.agent(profile="beaglebone-black")  # can_train = false
    assert fm.wait_online([no_factory.device_id, a.device_id, cannot.device_id], 10)
    r = fm.command(a.device_id, "train_start")
    assert not r.ok and r.code == "no_model"
    assert fm.send_ota(a.device_id, artifact(fleet_env, 1), version=1).wait(30).ok
    r = fm.command(a.device_id, "train_start")
    assert r.ok and r.result == {"training": True, "model_version": 1}
    p1 = CountingParticipant.made[-1]
    assert p1.running and p1.model_version == 1 and p1.model_path.read_bytes() == mlp_bytes(1)
    st = fm.command(a.device_id, "status").result
    assert st["training"] and st["participant"]["running"]
    # A model change restarts the participant on the new model.
    assert fm.send_ota(a.device_id, artifact(fleet_env, 2), version=2).wait(30).ok
    p2 = CountingParticipant.made[-1]
    assert p2 is not p1 and not p1.running and p1.stops == 1 and p2.running and p2.model_version == 2
    r = fm.command(a.device_id, "train_stop")
    assert r.ok and r.result["was_training"] and not p2.running
    r = fm.command(no_factory.device_id, "train_start")
    assert not r.ok and r.code == "not_supported" and "participant" in r.error
    r = fm.command(cannot.device_id, "train_start")
    assert not r.ok and r.code == "not_supported" and "can_train" in r.error


def test_deploy_rollback_reboot_and_inference_over_mqtt(fleet_env, fm) -> None:
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    for v in (1, 2):
        ack = fm.send_ota(dev, artifact(fleet_env, v), version=v).wait(30)
        assert ack.ok, ack.error
        assert ack.result["model_version"] == v and ack.result["health"]["ok"]
    assert wait_until(lambda: fm.device(dev).model_version == 2, 5), "registry follows the new birth"
    x = np.random.default_rng(1).random((3, 64)).astype(np.float32)
    want2 = load(mlp_bytes(2), PROFILE)(x)
    np.testing.assert_allclose(a.predict(x), want2, rtol=1e-5, atol=1e-5)
    import edgeflow.device as device_api

    np.testing.assert_allclose(device_api.predict(x, device=dev), want2, rtol=1e-5, atol=1e-5)

    # Same version again: acknowledged as unchanged, nothing rewritten.
    again = fm.send_ota(dev, artifact(fleet_env, 2), version=2).wait(30)
    assert again.ok and again.result.get("unchanged")

    # Inference request/response on the device's infer topics.
    replies: list[dict] = []
    app = fleet_env.transport("tester", connect=False)
    app.subscribe(device_topic(FLEET, dev, "infer/reply").value, lambda m: replies.append(m.json()))
    app.connect()
    key = fleet_env.fleet_dir.fleet_key()
    app.publish(device_topic(FLEET, dev, "infer").value,
                sign_inference_request({"id": "q1", "input": encode_tensor(x)}, key, device=dev)).wait(5)
    app.publish(device_topic(FLEET, dev, "infer").value,
                sign_inference_request({"id": "q2", "inputs": {"nope": encode_tensor(x)}}, key, device=dev))
    # unsigned, signed by an unknown key, addressed to another device: answered with the reason, never run
    app.publish(device_topic(FLEET, dev, "infer").value, json.dumps({"id": "q3", "input": encode_tensor(x)}))
    app.publish(device_topic(FLEET, dev, "infer").value,
                sign_inference_request({"id": "q4", "input": encode_tensor(x)}, PrivateKey.generate(), device=dev))
    app.publish(device_topic(FLEET, dev, "infer").value,
                sign_inference_request({"id": "q5", "input": encode_tensor(x)}, key, device="other"))
    assert wait_until(lambda: len(replies) == 5, 10)
    refused = sorted(r["code"] for r in replies if r["id"] is None)
    assert refused == ["unauthorized", "unsigned", "wrong_device"], replies
    replies[:] = [r for r in replies if r["id"] is not None]
    by_id = {r["id"]: r for r in replies}
    assert by_id["q1"]["ok"] and by_id["q1"]["model_version"] == 2
    np.testing.assert_allclose(decode_tensor(by_id["q1"]["outputs"]["logits"]), want2, rtol=1e-5, atol=1e-5)
    assert not by_id["q2"]["ok"] and "nope" in by_id["q2"]["error"]

    # Conditional rollback: a no-op unless the device runs that version.
    r = fm.command(dev, "rollback", {"from_version": 7})
    assert r.ok and r.result["unchanged"] and a.model_version == 2
    r = fm.command(dev, "rollback")
    assert r.ok and r.result == {"model_version": 1, "previous_version": 2}
    np.testing.assert_allclose(a.predict(x), load(mlp_bytes(1), PROFILE)(x), rtol=1e-5, atol=1e-5)
    assert wait_until(lambda: fm.device(dev).model_version == 1, 5)
    r = fm.command(dev, "reboot")
    assert r.ok and r.result["model_version"] == 1 and a.model_version == 1


def test_a_redelivered_command_is_acked_again_but_runs_once(fleet_env, fm) -> None:
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    got, tester = _acks(fleet_env, dev)
    cmd = Command.make("set_config", dev, FLEET, {"telemetry_interval_s": 3.0})
    payload = cmd.sign(fleet_env.fleet_dir.fleet_key())
    topic = device_topic(FLEET, dev, "cmd").value
    for _ in range(2):
        tester.publish(topic, payload).wait(5)
    assert wait_until(lambda: len(got) == 2, 10)
    assert got[0] == got[1] and got[0].ok
    assert a.counters["commands"] == 1


def test_unsigned_forged_misaddressed_and_expired_commands_are_refused(fleet_env, fm) -> None:
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    assert fm.send_ota(dev, artifact(fleet_env, 1), version=1).wait(30).ok
    got, tester = _acks(fleet_env, dev)
    topic = device_topic(FLEET, dev, "cmd").value
    fleet_key = fleet_env.fleet_dir.fleet_key()
    intruder = PrivateKey.generate()

    def cmd(**kw: Any) -> Command:
        base = {"name": "rollback", "device": dev, "fleet": FLEET, "args": {}, "id": uuid.uuid4().hex,
                "issued": time.time(), "expires": time.time() + 60}
        return Command(**{**base, **kw})

    cases = {}
    c = cmd()
    tester.publish(topic, json.dumps({"name": "rollback", "device": dev, "id": c.id}))  # plain JSON, no signature
    cases[c.id] = "unsigned"
    c = cmd()
    tester.publish(topic, c.sign(intruder))  # signed, by a key that is not the fleet's
    cases[c.id] = "wrong_key"
    c = cmd()
    wrapper = json.loads(c.sign(intruder))
    wrapper["key_id"] = fleet_key.public_key.key_id_hex  # claims the fleet key
    tester.publish(topic, json.dumps(wrapper))
    cases[c.id] = "bad_signature"
    c = cmd()
    wrapper = json.loads(c.sign(fleet_key))
    body = json.loads(wrapper["body"])
    body["args"] = {"to": "anything"}  # altered after signing
    wrapper["body"] = json.dumps(body, sort_keys=True, separators=(",", ":"))
    tester.publish(topic, json.dumps(wrapper))
    cases[c.id] = "bad_signature"
    c = cmd(device="dev-somebody-else")
    tester.publish(topic, c.sign(fleet_key))  # right key, addressed to another device
    cases[c.id] = "wrong_device"
    c = cmd(issued=time.time() - 7200, expires=time.time() - 3600)
    tester.publish(topic, c.sign(fleet_key))
    cases[c.id] = "expired"
    c = cmd()
    tester.publish(topic, sign_body({"id": c.id, "name": "rollback"}, fleet_key, "round/v1"))  # another context
    cases[c.id] = "bad_signature"
    assert wait_until(lambda: len(got) == len(cases), 10), [g.code for g in got]
    assert {g.id: g.code for g in got} == cases
    assert all(not g.ok and g.error for g in got)
    assert a.model_version == 1 and a.counters["rollbacks"] == 0 and a.counters["refused"] == len(cases)


def test_unsigned_or_wrongly_signed_models_are_refused(fleet_env, fm) -> None:
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    assert fm.send_ota(dev, artifact(fleet_env, 1), version=1).wait(30).ok
    got, tester = _acks(fleet_env, dev)
    topic = device_topic(FLEET, dev, "ota").value
    fleet_key = fleet_env.fleet_dir.fleet_key()
    intruder = PrivateKey.generate()
    good = artifact(fleet_env, 5)
    cases: dict[str, str] = {}

    def offer(art: bytes, *, cmd_key: PrivateKey = fleet_key, sha_of: bytes | None = None) -> None:
        c = deploy_command(dev, FLEET, sha_of if sha_of is not None else art, version=5)
        tester.publish(topic, OtaOffer.make(c, art, cmd_key).to_bytes()).wait(10)
        return c.id

    cases[offer(artifact(intruder, 5))] = "wrong_key"                 # artifact signed by another key
    cases[offer(good, cmd_key=intruder)] = "wrong_key"               # deploy command signed by another key
    tampered = bytearray(good)
    tampered[-300] ^= 1
    cases[offer(bytes(tampered))] = "bad_artifact"                   # bytes changed after signing
    cases[offer(good, sha_of=b"a different artifact")] = "bad_artifact"  # command names another artifact
    cases[offer(artifact(fleet_env, 5, profile="jetson-orin-nano"))] = "wrong_profile"
    raw_model = mlp_bytes(5)
    c = deploy_command(dev, FLEET, raw_model, version=5)
    tester.publish(topic, OtaOffer.make(c, raw_model, fleet_key).to_bytes()).wait(10)  # an unsigned bare model
    cases[c.id] = "bad_artifact"
    tester.publish(topic, b"EFOF\x01 garbage").wait(5)
    assert wait_until(lambda: len(got) == len(cases) + 1, 15), [(g.id, g.code) for g in got]
    codes = {g.id: g.code for g in got if g.id}
    assert codes == cases
    assert [g.code for g in got if not g.id] == ["bad_message"]
    assert a.model_version == 1, "nothing was installed"
    assert not (a.slots.root / "pending.json").exists()


def test_a_model_larger_than_one_message_is_chunked_through_the_acl(fleet_env, fm) -> None:
    from edgeflow import zoo
    from edgeflow.artifact import build_artifact, make_golden

    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    model = zoo.mlp((784, 512, 512, 10), seed=3).SerializeToString()  # 2.6 MB: 11 chunks of 256 KiB
    x = np.random.default_rng(0).random((1, 784)).astype(np.float32)
    data = build_artifact(model, version=4, profile=PROFILE, key=fleet_env.fleet_dir.fleet_key(), fleet=FLEET,
                          golden=make_golden(model, PROFILE, x))
    assert len(data) > 10 * 256 * 1024
    rep = fm.deploy({PROFILE: data}, to=f"device={dev}")
    assert rep.state == "completed" and rep.devices[dev].state == "ok" and rep.devices[dev].model_version == 4
    assert a.active_model.model_path.read_bytes() == model
    assert a.transport.stats()["transfers_completed"] >= 1
