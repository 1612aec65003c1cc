"""A gateway killed in the middle of a round restarts and finishes that round
with the updates it had stored plus those the broker kept for its persistent
session, counting every update exactly once: on both state engines (SQLite, PostgreSQL)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from _brokers import mosquitto_factory, wait_until  # noqa: F401
from _stores import pg_schema_url, pg_url, store_target  # noqa: F401
from edgeflow import zoo
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.federated import Client
from edgeflow.gateway.rounds import model_weights
from edgeflow.gateway.store import GatewayStore
from edgeflow.gateway.strategies import bounded_mean
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport import MqttTransport

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent


def _gateway(args, faults: str = "", **kw):
    env = {**os.environ, "EDGEFLOW_FAULTS": faults}
    return subprocess.Popen([sys.executable, str(HERE / "_gateway_proc.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kw)


def test_gateway_killed_mid_round_finishes_it_without_double_counting(mosquitto_factory, store_target,  # noqa: F811
                                                                     tmp_path):
    broker = mosquitto_factory(persistence=True)
    fleet = "crash"
    fk = PrivateKey.generate()
    fk.save(tmp_path / "fleet.key")
    model = zoo.digits_mlp(seed=1)
    onnx.save(model, tmp_path / "model.onnx")
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, 6, alpha=1.0, seed=0)
    ring = KeyRing()
    devices = []
    for i, idx in enumerate(parts):
        s = Signer.generate(f"d{i}")
        ring.register(s.device_id, s.public_key)
        t = MqttTransport.from_url(broker.url, client_id=f"{fleet}-d{i}")
        c = Client(t, fleet=fleet, device_id=s.device_id, signer=s, fleet_key=fk.public_key, model=model,
                   data=(split.x_train[idx], split.y_train[idx]), seed=i,
                   delay_s=0.3 * i)  # staggered: some updates arrive while the gateway is down
        devices.append((t, c))
    ring.save(tmp_path / "ring.json")
    for t, c in devices:
        c.start()
        t.connect(timeout=10)
    # the gateway process's state argument: the SQLite file, or the PostgreSQL URL with this test's schema
    state = store_target.path if store_target.engine == "sqlite" else pg_schema_url(store_target.schema,
                                                                                     store_target.dsn)
    common = [broker.url, state, fleet, tmp_path / "fleet.key", tmp_path / "ring.json", tmp_path / "model.onnx", 2]
    try:
        first = _gateway(common, faults="rounds.update_stored@2:3")  # die right after storing round 2's 3rd update
        out1, _ = first.communicate(timeout=120)
        assert first.returncode == 137, out1
        assert "ROUND 1 participants=6" in out1
        s = GatewayStore(state)
        assert [r.round_id for r in s.open_rounds()] == [2] and s.update_count(2) == 3
        v1_weights = model_weights(onnx.load_model_from_string(s.model(2)[0]))  # round 2 trained from v2
        s.close()
        # the rest of round 2's updates reach the broker while no gateway runs
        assert wait_until(lambda: all(c.stats.updates_sent == 2 for _, c in devices), 30)
        second = _gateway(common)  # restart: resumes round 2, then has nothing left to run
        out2, _ = second.communicate(timeout=120)
        assert second.returncode == 0, out2
        assert "ROUND 2 participants=6" in out2, out2
    finally:
        for t, c in devices:
            c.stop()
            t.close(timeout=2)
    s = GatewayStore(state)
    version, onnx_bytes, _ = s.latest_model()
    assert version == 3 and s.open_rounds() == []
    got = model_weights(onnx.load_model_from_string(onnx_bytes))
    # exactly FedAvg over the six round-2 deltas, each counted once, with the round's default
    # norm bound and sample cap (docs/aggregation.md; recorded in the round's metrics)
    rec = s.round(2)
    step = bounded_mean([c.last_delta for _, c in devices], [len(p) for p in parts],
                        rec.metrics.get("norm_bound"), rec.metrics.get("sample_cap"))
    for name, w in got.items():
        np.testing.assert_allclose(w, v1_weights[name] + step[name], rtol=1e-5, atol=1e-6, err_msg=name)
