"""Ingestion workers sharing the update stream through an MQTT 5 shared subscription on
real Mosquitto: each update reaches one worker, the coordinator merges the workers'
partial sums, and a worker killed with SIGKILL mid-round loses no update and counts
none twice (the broker redelivers its session to the restarted worker; the store's
claims deduplicate)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _ingest_fleet import digits_clients, start_fleet, stop_fleet
from _brokers import FAST, Inbox, mosquitto_factory, transport_factory, wait_until  # noqa: F401
from edgeflow import zoo
from edgeflow.errors import ConfigError
from edgeflow.protocol.rounds import TrainConfig
from edgeflow.gateway.ingest import IngestPool, IngestStore, SharedIngest, WorkerConfig, shared_filter
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.gateway.strategies import bounded_mean
from edgeflow.signing import KeyRing, PrivateKey
from edgeflow.transport import MqttTransport

pytestmark = pytest.mark.integration

FLEET = "ingest"
DEVICES = 12


def test_shared_subscription_through_the_transport(mosquitto_factory, transport_factory):  # noqa: F811
    broker = mosquitto_factory()
    members = [transport_factory(broker, client_id=f"m{i}") for i in range(2)]
    inboxes = [Inbox(), Inbox()]
    subs = [t.subscribe("$share/g/t/+/x", box) for t, box in zip(members, inboxes)]
    pub = transport_factory(broker, client_id="pub", max_payload=2048)
    for i in range(20):
        pub.publish(f"t/{i}/x", f"m{i}".encode(), qos=1).wait(5)
    assert wait_until(lambda: sum(len(b.messages) for b in inboxes) >= 20, 10)
    got = sorted(m.payload.decode() for b in inboxes for m in b.messages)
    assert got == sorted(f"m{i}" for i in range(20))  # each message to exactly one member
    assert all(b.messages for b in inboxes)  # and both members took a share
    # a chunked payload cannot be split across members: every member gets it whole
    big = bytes(range(256)) * 40
    pub.publish("t/big/x", big, qos=1).wait(5)
    for b in inboxes:
        assert b.wait_for(lambda m: m.topic == "t/big/x").payload == big
    members[0].unsubscribe(subs[0])  # returns once the broker acknowledged (UNSUBACK)
    n1 = len(inboxes[1].messages)
    for i in range(4):
        pub.publish(f"t/{i}/x", b"after", qos=1).wait(5)
    assert wait_until(lambda: len(inboxes[1].messages) >= n1 + 4, 10)  # the remaining member takes all
    with pytest.raises(ConfigError, match="'#'"):
        members[0].subscribe("$share/g/t/#", Inbox())
    with pytest.raises(ConfigError, match="group"):
        members[0].subscribe("$share/+/t/x", Inbox())


def _flat(before, clients, m):
    """Flat FedAvg over every client's delta with the round's default norm bound and sample cap
    (recorded in its metrics; docs/aggregation.md): what one gateway without workers computes."""
    step = bounded_mean([c.last_delta for c in clients], [len(c.x) for c in clients],
                        m.extra.get("norm_bound"), m.extra.get("sample_cap"))
    return {name: w.astype(np.float64) + step[name] for name, w in before.items()}


def test_worker_killed_mid_round_loses_no_update(mosquitto_factory, tmp_path):  # noqa: F811
    broker = mosquitto_factory()
    fleet_key = PrivateKey.generate()
    model, clients, ring = digits_clients(broker.url, FLEET, DEVICES, fleet_key, tmp_path / "ring.json", chunk_first=True)
    state = tmp_path / "gw.sqlite"
    store = GatewayStore(state)
    ingest = SharedIngest(merge_timeout_s=10, dead_after_s=3)
    gt = MqttTransport.from_url(broker.url, client_id=f"{FLEET}-gateway", **FAST)
    rm = RoundManager(gt, store, fleet=FLEET, fleet_key=fleet_key, keyring=ring, model=model,
                      config=RoundConfig(rounds=2, min_clients=DEVICES, deadline_s=40, strategy="fedavg",
                                         strategy_params={"stage": 0},
                                         train=TrainConfig(epochs=1, batch_size=16, lr=0.1, codec="dense")),
                      candidates=lambda: [Candidate(d) for d in ring.devices()], ingest=ingest)
    base = WorkerConfig(name="w0", broker=broker.url, state=str(state), fleet=FLEET,
                        keyring=str(tmp_path / "ring.json"), delay_s=0.25, heartbeat_s=0.2)
    pool = IngestPool(base, ["w0", "w1", "w2"], workdir=tmp_path / "workers")
    db = IngestStore(state)
    killed: dict[str, int] = {}

    # Round 1 of a fresh state has no norm-bound reference yet: the coordinator folds it from the
    # stored envelopes (FedAvg's warm-up, docs/aggregation.md); round 2 runs on the workers' partials,
    # so the worker is killed there.
    def killer() -> None:  # SIGKILL w1 right after its first update of round 2 is persisted
        if wait_until(lambda: db.own_claims(2, "w1"), 120, 0.005):
            killed["claimed_before"] = len(db.claims(2).get("w1", ()))
            killed["stored_before"] = len(db.reported(2))
            killed["pid"] = pool.kill("w1")

    try:
        start_fleet(pool, clients, rm, gt)
        k = threading.Thread(target=killer, daemon=True)
        k.start()
        expected, befores = [], [dict(rm.weights)]

        def on_round(m) -> None:
            expected.append(_flat(befores[-1], clients, m))
            befores.append(dict(rm.weights))
            merges.append(dict(ingest.last_merge))

        merges: list[dict] = []
        rm.on_round = on_round
        history = rm.run()
        k.join(5)
        assert killed, "w1 never claimed an update in round 2"
        assert killed["stored_before"] < DEVICES  # it died mid-round, with updates still to come
        assert [m.participants for m in history] == [DEVICES, DEVICES], (history, pool.logs())
        for got, want in zip(befores[1:], expected):
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        assert pool.restarts["w1"] == 1 and len(pool.pids["w1"]) == 2
        assert merges[0]["from_store"] == sorted(ring.devices())  # the warm-up round, folded at the coordinator
        m1 = merges[1]
        assert sorted(d for ds in m1["claims"].values() for d in ds) == sorted(ring.devices())  # each once
        assert set(m1["claims"]) == {"w0", "w1", "w2"}  # the stream really was shared
        # what was routed to the dead w1 was redelivered to its successor, which claimed it
        assert killed["pid"] in m1["claim_pids"]["w1"]
        assert any(pid != killed["pid"] for pid in m1["claim_pids"]["w1"]), m1
        assert m1["from_store"] == []  # the restarted w1 rebuilt its partial from its stored claims
        # the chunked update reached every worker; exactly one claimed it, the others saw a duplicate
        stats = {w: v["stats"] for w, v in db.workers().items()}
        assert sum(s["duplicate"] for s in stats.values()) >= 1, stats
        assert history[0].duplicates == 0 and history[1].duplicates == 0
    finally:
        stop_fleet(rm, clients, (gt,), pool)
        db.close()


def test_shared_filter_names_the_update_channel():
    assert shared_filter("lab", "g1") == "$share/g1/edgeflow/lab/+/update"
    with pytest.raises(ConfigError):
        shared_filter("lab", "bad group")


@pytest.mark.parametrize("strategy, params", [("median", {}), ("fedavg-krum", {"num_byzantine": 1})])
def test_a_strategy_that_needs_each_update_is_refused_with_workers_at_start(tmp_path, strategy, params):
    """The workers hand the coordinator partial sums: a strategy that holds every update (median,
    Krum-based) would fail at the first merge; it is refused when the manager starts, in one line."""
    from edgeflow.transport.loopback import LoopbackBroker

    fleet_key = PrivateKey.generate()
    gt = LoopbackBroker().transport(client_id=f"{FLEET}-gateway")
    with pytest.raises(ConfigError, match=f"strategy '{strategy}' needs each update.*ingestion workers"):
        RoundManager(gt, GatewayStore(tmp_path / "gw.sqlite"), fleet=FLEET, fleet_key=fleet_key, keyring=KeyRing(),
                     model=zoo.digits_mlp(seed=5),
                     config=RoundConfig(rounds=1, min_clients=5, strategy=strategy, strategy_params=params),
                     candidates=lambda: [], ingest=SharedIngest())
