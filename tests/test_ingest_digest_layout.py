"""Updates sent with the layout digest (envelope version 3, ``codec_opts = {layout = "digest"}``) through
ingestion workers on real Mosquitto: a worker killed mid-round and restarted rebuilds its partial from its
stored digest-layout claims with the shapes of the model it knows (as the round manager decodes them), so
the coordinator merges that partial instead of re-folding every claim from the store (issue 34)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _ingest_fleet import digits_clients, start_fleet, stop_fleet
from _brokers import FAST, Inbox, mosquitto_factory, wait_until  # noqa: F401
from edgeflow.codecs import peek_update
from edgeflow.gateway.ingest import IngestPool, IngestStore, SharedIngest, WorkerConfig
from edgeflow.gateway.intake import RoundView, check_update
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.gateway.strategies import bounded_mean
from edgeflow.protocol.rounds import TrainConfig
from edgeflow.signing import PrivateKey
from edgeflow.transport import MqttTransport

pytestmark = pytest.mark.integration

FLEET = "digest"
DEVICES = 4


def test_a_restarted_worker_rebuilds_digest_layout_claims(mosquitto_factory, tmp_path):  # noqa: F811
    broker = mosquitto_factory()
    fleet_key = PrivateKey.generate()
    model, clients, ring = digits_clients(broker.url, FLEET, DEVICES, fleet_key, tmp_path / "ring.json", id_format="d{}")
    state = tmp_path / "gw.sqlite"
    store = GatewayStore(state)
    ingest = SharedIngest(merge_timeout_s=20, dead_after_s=5)
    gt = MqttTransport.from_url(broker.url, client_id=f"{FLEET}-gateway", **FAST)
    train = TrainConfig(epochs=1, batch_size=16, lr=0.1, codec="topk-packed",
                        codec_opts={"ratio": 0.2, "layout": "digest"})
    rm = RoundManager(gt, store, fleet=FLEET, fleet_key=fleet_key, keyring=ring, model=model,
                      config=RoundConfig(rounds=2, min_clients=DEVICES, deadline_s=60, strategy="fedavg",
                                         strategy_params={"stage": 0}, train=train),
                      candidates=lambda: [Candidate(d) for d in ring.devices()], ingest=ingest)
    # one worker; delay_s keeps round 2's updates in flight when it is killed after its first claim
    pool = IngestPool(WorkerConfig(name="w0", broker=broker.url, state=str(state), fleet=FLEET,
                                   keyring=str(tmp_path / "ring.json"), delay_s=0.3, heartbeat_s=0.2),
                      ["w0"], workdir=tmp_path / "workers")
    db = IngestStore(state)
    ear, heard = MqttTransport.from_url(broker.url, client_id=f"{FLEET}-ear", **FAST), Inbox()  # the wire bytes
    killed: dict[str, int] = {}

    def killer() -> None:  # round 1 warms the norm bounds up at the coordinator; round 2 uses the partials
        if wait_until(lambda: db.own_claims(2, "w0"), 120, 0.005):
            killed["pid"] = pool.kill("w0")

    befores: list[dict] = []
    merges: list[dict] = []
    metrics: list = []

    def on_round(m) -> None:
        merges.append(dict(ingest.last_merge))
        metrics.append(m)
        befores.append(dict(rm.weights))

    try:
        ear.connect(timeout=10)
        ear.subscribe(f"edgeflow/{FLEET}/+/update", heard)
        start_fleet(pool, clients, rm, gt)
        k = threading.Thread(target=killer, daemon=True)
        k.start()
        rm.on_round = on_round
        history = rm.run()
        k.join(5)
        assert killed, "w0 never claimed an update in round 2"
        assert [m.participants for m in history] == [DEVICES, DEVICES], (history, pool.logs())
        assert pool.restarts["w0"] == 1, pool.logs()
        # the devices really sent the digest layout (envelope version 3, no names or shapes on the wire)
        heard.wait(2 * DEVICES)
        envelopes = {peek_update(m.payload).device_id: bytes(m.payload) for m in heard.messages
                     if peek_update(m.payload).round_id == history[1].round_id}
        assert sorted(envelopes) == sorted(ring.devices())
        assert all(peek_update(e).version == 3 and peek_update(e).tensors == () for e in envelopes.values())
        m1 = merges[1]
        assert m1["claims"] == {"w0": sorted(ring.devices())}
        assert killed["pid"] in m1["claim_pids"]["w0"]  # claimed before the kill ...
        # ... and rebuilt by the restarted worker: its partial covers every claim, none is re-folded here
        assert m1["partials"] == {"w0": sorted(ring.devices())}, pool.logs()
        assert m1["from_store"] == [], pool.logs()
        assert db.workers()["w0"]["stats"]["rebuilt"] >= 1, pool.logs()
        assert "unreadable" not in pool.logs()
        # and the merged partial is the flat bounded mean of what the devices sent, decoded with the model
        view = RoundView(history[1].round_id, history[0].model_version, frozenset(ring.devices()))  # round 1's model
        decoded = [check_update(e, view, keyring=ring, like=befores[0], seq_floor=None) for e in envelopes.values()]
        step = bounded_mean([u.tensors for u in decoded], [u.meta.num_samples for u in decoded],
                            metrics[1].extra.get("norm_bound"), metrics[1].extra.get("sample_cap"))
        for name, w in befores[0].items():
            np.testing.assert_allclose(befores[1][name], w.astype(np.float64) + step[name], rtol=1e-5, atol=1e-6,
                                       err_msg=name)
    finally:
        stop_fleet(rm, clients, (gt, ear), pool)
        db.close()
