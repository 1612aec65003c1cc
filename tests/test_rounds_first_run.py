"""Federated rounds that work the first time (issue 17): devices join by themselves, say why they do
not, the gateway says why a round does not start or gets no update, and a round's model does not
depend on the order in which its updates arrived.

The round-manager tests drive a real :class:`RoundManager` (SQLite state in memory) through a
transport that records what it publishes; the agent tests run real agents against Mosquitto with the
generated TLS + ACL config (tests/_fleet.py).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import numpy as np
import pytest
from _fleet import FLEET, PROFILE, artifact, fleet_env, mlp_bytes, wait_until  # noqa: F401

from edgeflow import zoo
from edgeflow.codecs import encode_update
from edgeflow.protocol.rounds import RoundAnnouncement
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager, model_weights
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey, Signer

DEVICES = [f"d{i}" for i in range(5)]


class _Delivery:
    error = None
    acked = total = 1
    succeeded = True

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def add_progress_callback(self, fn: Any) -> None:
        fn(self)


class RecordingTransport:
    """Takes subscriptions and publishes (acknowledged at once) and remembers the round announcements."""

    def __init__(self) -> None:
        self.announced: list[bytes] = []
        self.announce_seen = threading.Event()

    def subscribe(self, topic: str, handler: Any, **kw: Any) -> Any:
        return (topic, handler)

    def unsubscribe(self, sub: Any) -> None:
        pass

    def publish(self, topic: str, payload: Any, qos: int = 1, retain: bool = False, **kw: Any) -> _Delivery:
        if topic.endswith("gateway/round"):
            self.announced.append(bytes(payload))
            self.announce_seen.set()
        return _Delivery()


class Msg:
    def __init__(self, topic: str, payload: bytes) -> None:
        self.topic, self.payload, self.properties, self.retain = topic, payload, {}, False


def _manager(candidates: Any, **config: Any) -> tuple[RoundManager, PrivateKey, dict[str, Signer]]:
    fk = PrivateKey.generate()
    signers = {d: Signer.generate(d) for d in DEVICES}
    ring = KeyRing({d: s.public_key for d, s in signers.items()})
    cfg = RoundConfig(**{"rounds": 1, "min_clients": 2, "deadline_s": 30.0, "wait_for_devices_s": 0.0, **config})
    rm = RoundManager(RecordingTransport(), GatewayStore(":memory:"), fleet="lab", fleet_key=fk, keyring=ring,
                      model=zoo.digits_mlp(seed=0), config=cfg, candidates=candidates)
    rm.start()
    return rm, fk, signers


def _open_round(rm: RoundManager, fk: PrivateKey) -> tuple[threading.Thread, list, RoundAnnouncement]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(rm.run_round()), daemon=True)
    t.start()
    assert rm.transport.announce_seen.wait(10)
    return t, out, RoundAnnouncement.verify(rm.transport.announced[-1], fk.public_key)


def _aggregate_with_arrival_order(order: list[str]) -> dict[str, np.ndarray]:
    rm, fk, signers = _manager(lambda: [Candidate(d) for d in DEVICES])
    t, out, ann = _open_round(rm, fk)
    rng = np.random.default_rng(42)  # the same five updates every time: different norms and sample counts
    updates = {d: ({k: (rng.standard_normal(v.shape) * (0.01 * (i + 1) ** 2)).astype(np.float32)
                    for k, v in rm.weights.items()}, 20 + 30 * i) for i, d in enumerate(DEVICES)}
    for d in order:
        delta, n = updates[d]
        payload = encode_update(delta, "dense", round_id=ann.round_id, device_id=d, seq=1, signer=signers[d],
                                num_samples=n, metadata={"base_version": ann.model_version,
                                                         "round_nonce": ann.nonce, "loss": 1.0})
        rm._on_update(Msg(f"edgeflow/lab/{d}/update", payload))
    t.join(30)
    assert out and out[0] is not None and out[0].participants == 5, out
    return {k: v.copy() for k, v in rm.weights.items()}


def test_the_new_model_does_not_depend_on_the_arrival_order():
    """The same five updates in two arrival orders give the same model bit for bit. (Folded as they
    arrived, FedAvg's first round took its norm bound from whichever three came first, and the sums
    differed in the last bits: the demo drifted between runs with one seed.)"""
    a = _aggregate_with_arrival_order(DEVICES)
    b = _aggregate_with_arrival_order(list(reversed(DEVICES)))
    c = _aggregate_with_arrival_order(["d3", "d0", "d4", "d1", "d2"])
    for k in a:
        assert np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k]), k


def test_a_round_that_cannot_start_says_why_for_each_device(caplog):
    why_data = "this agent has no training participant: no training data (start `edgeflow device` with --train-data)"
    pool = [Candidate("d0", can_train=True), Candidate("d1", can_train=False, why=why_data),
            Candidate("d2", can_train=False, why=why_data),
            Candidate("d3", can_train=False, why="v2 is quantized (static) and no fp32 master came with it")]
    rm, _, _ = _manager(lambda: pool)
    with caplog.at_level(logging.WARNING, logger="edgeflow.gateway.rounds"):
        assert rm.run_round() is None
    line = next(r.getMessage() for r in caplog.records if "not started" in r.getMessage())
    assert "1 eligible device(s), min_clients is 2" in line and "1 of 4 online device(s) can train (d0)" in line
    assert "d1, d2: this agent has no training participant" in line and "d3: v2 is quantized" in line
    status = json.loads(rm.store.get_meta("rounds_status"))
    assert status["state"] == "waiting" and "d3: v2 is quantized" in status["reason"]
    rm2, _, _ = _manager(list)
    with caplog.at_level(logging.WARNING, logger="edgeflow.gateway.rounds"):
        assert rm2.run_round() is None
    assert any("no device is online" in r.getMessage() for r in caplog.records)


def test_the_why_names_the_devices_the_configuration_leaves_out(caplog):
    pool = [Candidate("d0", profile="raspberry-pi-4"), Candidate("d1", profile="x86-gateway", battery=0.1)]
    rm, _, _ = _manager(lambda: pool, profiles=["x86-gateway"], min_battery=0.5)
    with caplog.at_level(logging.WARNING, logger="edgeflow.gateway.rounds"):
        assert rm.run_round() is None
    line = next(r.getMessage() for r in caplog.records if "not started" in r.getMessage())
    assert "d0: profile not in [rounds] profiles ['x86-gateway']" in line
    assert "d1: battery below [rounds] min_battery 0.5" in line


def test_a_round_without_updates_says_why_and_stops_waiting_for_devices_that_left(caplog):
    pool = {d: Candidate(d, note="round 1: global model v1 never arrived" if d == "d1" else "") for d in DEVICES[:3]}
    rm, fk, _ = _manager(lambda: list(pool.values()), deadline_s=1.0, max_extensions=5)
    t, out, ann = _open_round(rm, fk)
    # during the round: d0 goes offline, d2 stops training; d1 still trains but reports an error
    del pool["d0"]
    pool["d2"] = Candidate("d2", can_train=False, why="training is switched off on this device (train_stop)")
    with caplog.at_level(logging.WARNING, logger="edgeflow.gateway.rounds"):
        t.join(30)
    m = out[0]
    assert m is not None and m.extra.get("failed") == 1.0
    reason = rm.store.round(ann.round_id).metrics["reason"]
    assert "no update arrived from the 3 selected device(s)" in reason
    assert "d0 went offline" in reason and "d2 stopped training (training is switched off" in reason
    assert "d1: round 1: global model v1 never arrived" in reason
    extended = [r.getMessage() for r in caplog.records if "quorum not reached at the deadline; extended" in r.getMessage()]
    assert len(extended) == 5 and extended[-1].endswith("(5/5)"), "five extensions for a device that keeps training"
    assert json.loads(rm.store.get_meta("rounds_status"))["state"] == "failed"


def test_no_extension_for_devices_that_can_no_longer_answer(caplog):
    pool = {d: Candidate(d) for d in DEVICES[:2]}
    rm, fk, _ = _manager(lambda: list(pool.values()), deadline_s=1.0, max_extensions=10)
    t, out, _ = _open_round(rm, fk)
    pool.clear()  # both went offline
    with caplog.at_level(logging.WARNING, logger="edgeflow.gateway.rounds"):
        t.join(30)
    assert out[0].extra.get("failed") == 1.0
    messages = [r.getMessage() for r in caplog.records]
    assert not any("extended" in m for m in messages), "it extended the round for devices that are gone"
    assert any("none of the selected devices still missing can train" in m for m in messages)


def test_the_client_refuses_a_global_model_that_does_not_fit_and_says_so():
    from edgeflow.federated import Client

    class NoTransport:
        def subscribe(self, *a: Any, **k: Any) -> None:
            return None

    fk = PrivateKey.generate()
    changes: list[str] = []
    c = Client(NoTransport(), fleet="lab", device_id="d0", signer=Signer.generate("d0"), fleet_key=fk.public_key,
               model=zoo.digits_mlp(seed=0), data=(np.zeros((4, 64), np.float32), np.zeros(4, np.int64)))
    c.on_state_change = lambda: changes.append(c.state)
    other = model_weights(zoo.digits_cnn(seed=0))
    payload = encode_update(other, "dense", round_id=3, device_id="gateway", seq=3, signer=Signer("gateway", fk),
                            metadata={"model_version": 3, "epoch": 1})
    c._on_model(Msg("edgeflow/lab/gateway/model", payload))
    st = c.status()
    assert st["state"] == "model_mismatch" and st["model_version"] == -1 and changes == ["model_mismatch"]
    assert "does not fit the model deployed on this device" in st["detail"] and "fleet deploy" in st["detail"]
    fits = encode_update(model_weights(zoo.digits_mlp(seed=5)), "dense", round_id=4, device_id="gateway", seq=4,
                         signer=Signer("gateway", fk), metadata={"model_version": 4, "epoch": 1})
    c._on_model(Msg("edgeflow/lab/gateway/model", fits))
    assert c.status()["state"] == "ready" and c.status()["model_version"] == 4 and changes[-1] == "ready"


# ------------------------------------------------------------- agents over real Mosquitto


class _Participant:
    """The least a training participant does; remembers the model it was given."""

    made: list["_Participant"] = []

    def __init__(self, agent: Any) -> None:
        self.model_path = agent.train_model_path
        self.running = False
        _Participant.made.append(self)

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def status(self) -> dict:
        return {"running": self.running}


def _candidates(fm) -> dict[str, Candidate]:
    return {c.device_id: c for c in fm.round_candidates()}


@pytest.mark.integration
def test_devices_join_by_themselves_and_say_why_not(fleet_env, tmp_path) -> None:
    from edgeflow.gateway.ota import build_artifacts

    fm = fleet_env.gateway()
    bare = fleet_env.agent()                            # no training data
    opted = fleet_env.agent(start=False, train=False)   # `edgeflow device --no-train`
    opted.make_participant = _Participant
    opted.start()
    q_only = fleet_env.agent(start=False)               # int8 without its fp32 master
    q_only.make_participant = _Participant
    q_only.start()
    q_master = fleet_env.agent(start=False)             # int8 with the master
    q_master.make_participant = _Participant
    q_master.start()
    ids = [a.device_id for a in (bare, opted, q_only, q_master)]
    assert fm.wait_online(ids, 10)

    model = mlp_bytes(3)
    calib = np.random.default_rng(0).random((64, 64)).astype(np.float32)
    masters: dict[str, bytes] = {}
    arts = build_artifacts(model, [PROFILE], fleet_env.fleet_dir.fleet_key(), version=1, fleet=FLEET,
                           quantize=True, calibration=calib, atol=0.05, rtol=0.05, masters=masters)
    assert set(masters) == {PROFILE}
    for a in (bare, opted, q_only, q_master):
        if a is q_master:
            ack = fm.send_ota(a.device_id, masters[PROFILE], version=1, role="train_master").wait(30)
            assert ack.ok and ack.result["train_master"], ack.error
        ack = fm.send_ota(a.device_id, arts[PROFILE], version=1).wait(60)
        assert ack.ok, ack.error

    def why(a) -> Candidate:
        return _candidates(fm)[a.device_id]

    assert wait_until(lambda: why(q_master).can_train, 10), why(q_master)
    assert q_master.training and q_master.participant.model_path.read_bytes() == model, "trains on the fp32 master"
    assert q_master.active_model.artifact.manifest.meta["precision"] != "fp32", "while it serves int8"
    assert wait_until(lambda: "quantized" in why(q_only).why, 10) and not why(q_only).can_train
    assert "--train-data" in why(bare).why and not why(bare).can_train
    assert "--no-train" in why(opted).why and not why(opted).can_train
    refused = fm.command(opted.device_id, "train_start")
    assert not refused.ok and refused.code == "not_supported" and "--no-train" in refused.error

    # switched off remotely, then on again; the choice survives in the agent's state
    assert fm.command(q_master.device_id, "set_config", {"train": False}).ok
    assert wait_until(lambda: "switched off" in why(q_master).why, 10) and not q_master.training
    assert q_master.slots.state()["config"]["train"] is False
    on = fm.command(q_master.device_id, "train_start")
    assert on.ok and on.result == {"training": True, "model_version": 1}
    assert wait_until(lambda: why(q_master).can_train, 10)

    # the status command and the telemetry carry the same reason
    st = fm.command(q_only.device_id, "status").result
    assert st["train"]["state"] == "quantized" and "fp32 master" in st["train"]["detail"]
    assert wait_until(lambda: (fm.latest_telemetry(q_only.device_id) or {}).get("train") == "quantized", 10)


@pytest.mark.integration
def test_the_gateway_command_fails_with_the_reason_when_no_round_can_run(fleet_env, tmp_path) -> None:
    import subprocess
    import sys

    from edgeflow.device.agent import DeviceAgent

    fleet_env._release("gateway")  # the command below connects as the gateway operator
    for obj in fleet_env.made:  # earlier tests' boards go offline (a clean stop publishes their death)
        if isinstance(obj, DeviceAgent):
            obj.stop(timeout=2.0)
    bare = fleet_env.agent()  # online, but without training data
    (tmp_path / "model.onnx").write_bytes(mlp_bytes(0))
    conf = tmp_path / "gw.toml"
    conf.write_text('[gateway]\nstate = "gw.sqlite"\nmodel = "model.onnx"\n'
                    '[rounds]\nrounds = 1\nmin_clients = 1\nwait_for_devices_s = 2\n')
    out = subprocess.run([sys.executable, "-m", "edgeflow", "gateway", "--config", str(conf), "--dir",
                          str(fleet_env.fleet_dir.path), "--broker", fleet_env.url], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("edgeflow gateway: error: no round produced a model: round 1 not started"), out.stderr
    assert bare.device_id in last and "--train-data" in last
