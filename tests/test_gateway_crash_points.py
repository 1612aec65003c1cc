"""Kill -9 at every step of a round, restart, and the gateway recovers.

The gateway runs as its own process (tests/_gateway_proc.py) on a real
Mosquitto with a persistent session; three in-process devices take part.
``EDGEFLOW_FAULTS`` (:mod:`edgeflow.faults`) makes it die with ``os._exit(137)``
at one named step of round 2 - between storing the round's model and closing
the round was the crash that used to leave the state unrecoverable ("state file
is inconsistent"). A restart must then start, finish the job (2 rounds), store
exactly one model per closed round, leave no round open, and have the newest
model retained on the broker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from _brokers import Inbox, mosquitto_factory, wait_until  # noqa: F401
from edgeflow import zoo
from edgeflow.codecs import decode_update
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.faults import EXIT_CODE, POINTS
from edgeflow.federated import Client
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport import MqttTransport

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent

CRASHES = {  # point -> EDGEFLOW_FAULTS spec that fires in round 2
    "rounds.opened": "rounds.opened:2",
    "rounds.announced": "rounds.announced:2",
    "rounds.update_stored": "rounds.update_stored@2:2",
    "rounds.aggregated": "rounds.aggregated:2",
    "store.finish_round": "store.finish_round:2",
    "rounds.committed": "rounds.committed:2",
    "rounds.published": "rounds.published:2",
}


def test_every_fault_point_is_exercised():
    """Every gateway point here; the device agent's ``ota.*`` points in tests/test_ota_crash.py."""
    assert set(CRASHES) == {p for p in POINTS if not p.startswith("ota.")}


def _gateway(args, faults: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "EDGEFLOW_FAULTS": faults}
    return subprocess.run([sys.executable, str(HERE / "_gateway_proc.py"), *map(str, args)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)


@pytest.mark.parametrize("point", sorted(CRASHES))
def test_kill_at_each_step_then_restart_recovers(mosquitto_factory, tmp_path, point):  # noqa: F811
    broker = mosquitto_factory(persistence=True)
    fleet = "crash" + point.replace(".", "").replace("_", "")[-12:]
    fk = PrivateKey.generate()
    fk.save(tmp_path / "fleet.key")
    model = zoo.digits_mlp(seed=1)
    onnx.save(model, tmp_path / "model.onnx")
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, 3, alpha=1.0, seed=0)
    ring = KeyRing()
    devices = []
    for i, idx in enumerate(parts):
        s = Signer.generate(f"d{i}")
        ring.register(s.device_id, s.public_key)
        t = MqttTransport.from_url(broker.url, client_id=f"{fleet}-d{i}")
        devices.append((t, Client(t, fleet=fleet, device_id=s.device_id, signer=s, fleet_key=fk.public_key,
                                  model=model, data=(split.x_train[idx][:120], split.y_train[idx][:120]), seed=i)))
    ring.save(tmp_path / "ring.json")
    for t, c in devices:
        c.start()
        t.connect(timeout=10)
    state = tmp_path / "gw.sqlite"
    args = [broker.url, state, fleet, tmp_path / "fleet.key", tmp_path / "ring.json", tmp_path / "model.onnx", 2]
    try:
        first = _gateway(args, CRASHES[point])
        assert first.returncode == EXIT_CODE, first.stdout[-3000:]
        assert f"fault point {point}" in first.stdout and "ROUND 1 participants=3" in first.stdout, first.stdout[-3000:]
        second = _gateway(args)
        assert second.returncode == 0, second.stdout[-3000:]
        assert "inconsistent" not in second.stdout and "Traceback" not in second.stdout, second.stdout[-3000:]
    finally:
        for t, c in devices:
            c.stop()
            t.close(timeout=2)
    s = GatewayStore(state)  # opens with its integrity checks
    try:
        rounds = s.rounds()
        assert [r.state for r in rounds] == ["closed", "closed"], [(r.round_id, r.state, r.metrics) for r in rounds]
        assert [m["round_id"] for m in s.model_versions()] == [None, 1, 2]  # one model per closed round
        assert s.update_count(1) == s.update_count(2) == 0
        latest = s.latest_model()[0]
    finally:
        s.close()
    assert latest == 3
    # the newest model is what the broker retains, even when the crash came before it was published
    probe = MqttTransport.from_url(broker.url, client_id=f"{fleet}-probe")
    box = Inbox()
    probe.subscribe(f"edgeflow/{fleet}/gateway/model", box)
    probe.connect(timeout=10)
    try:
        msg = box.wait(1, timeout=10)[0]
        assert decode_update(msg.payload).metadata["model_version"] == 3
    finally:
        probe.close(timeout=2)
