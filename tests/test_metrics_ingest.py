"""/metrics of a coordinator whose updates come through an ingestion worker, on real Mosquitto: hostile
updates the worker refused (the round manager never sees them) are counted by reason, and the bytes the
coordinator published (its model in chunks) equal what a subscriber of the broker received, chunk headers
included."""

from __future__ import annotations

import sys
import threading
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="the web view needs prometheus_client (pip install 'edgeflow[web]')")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _brokers import FAST, Inbox, mosquitto_factory, wait_until  # noqa: E402,F401
from edgeflow import zoo  # noqa: E402
from edgeflow.codecs import encode_update  # noqa: E402
from edgeflow.data.datasets import dirichlet_partition, load_digits  # noqa: E402
from edgeflow.federated import Client  # noqa: E402
from edgeflow.gateway.global_model import model_weights  # noqa: E402
from edgeflow.gateway.ingest import IngestPool, SharedIngest, WorkerConfig  # noqa: E402
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager  # noqa: E402
from edgeflow.gateway.store import GatewayStore  # noqa: E402
from edgeflow.protocol.rounds import RoundAnnouncement, TrainConfig  # noqa: E402
from edgeflow.signing import KeyRing, PrivateKey, Signer  # noqa: E402
from edgeflow.transport import MqttTransport  # noqa: E402
from edgeflow.transport.chunking import HEADER_SIZE  # noqa: E402

pytestmark = pytest.mark.integration

FLEET = "mingest"


def _samples(url: str, name: str, label: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "metrics", timeout=10) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            return {s.labels[label]: s.value for s in fam.samples if s.name == name + "_total"}
    raise AssertionError(f"{name} not on /metrics")


class Heard:
    """What a subscriber received live (reassembled), with the chunk headers its frames carried."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.messages: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, msg) -> None:
        if msg.retain:
            return
        kind = msg.topic.rsplit("/", 1)[1]
        n = len(msg.payload) + (HEADER_SIZE * msg.chunks if msg.chunks > 1 else 0)
        with self._lock:
            self.bytes[kind] = self.bytes.get(kind, 0) + n
            self.messages.append((kind, len(msg.payload), msg.chunks))


def test_worker_refusals_by_reason_and_chunked_bytes_out(mosquitto_factory, tmp_path):  # noqa: F811
    from edgeflow.gateway.web import WebServer

    broker = mosquitto_factory()
    fleet_key = PrivateKey.generate()
    model = zoo.digits_mlp(seed=5)
    split = load_digits(seed=0).flat()
    names = ["d0", "d1", "d2", "evil"]
    parts = dirichlet_partition(split.y_train, len(names), alpha=1.0, seed=1)
    ring, signers, clients = KeyRing(), {}, {}
    for name, idx in zip(names, parts):
        s = signers[name] = Signer.generate(name)
        ring.register(name, s.public_key)
        t = MqttTransport.from_url(broker.url, client_id=f"{FLEET}-{name}", clean_start=True, **FAST)
        clients[name] = Client(t, fleet=FLEET, device_id=name, signer=s, fleet_key=fleet_key.public_key,
                               model=model, data=(split.x_train[idx], split.y_train[idx]), seed=1)
    ring.save(tmp_path / "ring.json")
    state = tmp_path / "gw.sqlite"
    store = GatewayStore(state)
    ingest = SharedIngest(merge_timeout_s=10, dead_after_s=3)
    # the coordinator's frames are at most 4 KB: its ~10 KB model goes in chunks
    gt = MqttTransport.from_url(broker.url, client_id=f"{FLEET}-gateway", max_payload=4096, **FAST)
    rm = RoundManager(gt, store, fleet=FLEET, fleet_key=fleet_key, keyring=ring, model=model,
                      config=RoundConfig(rounds=1, min_clients=len(names), deadline_s=120, strategy="fedavg",
                                         train=TrainConfig(epochs=1, batch_size=16, lr=0.1, codec="dense")),
                      candidates=lambda: [Candidate(d) for d in ring.devices()], ingest=ingest)
    pool = IngestPool(WorkerConfig(name="w0", broker=broker.url, state=str(state), fleet=FLEET,
                                   keyring=str(tmp_path / "ring.json"), heartbeat_s=0.2),
                      ["w0"], workdir=tmp_path / "workers")
    heard, rounds_seen = Heard(), Inbox()
    ear = MqttTransport.from_url(broker.url, client_id=f"{FLEET}-ear", **FAST)
    attacker = MqttTransport.from_url(broker.url, client_id=f"{FLEET}-attacker", **FAST)
    server = WebServer(rm, "127.0.0.1:0").start()
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("history", rm.run()), daemon=True)
    try:
        ear.connect(timeout=10)
        for channel in ("model", "round"):
            ear.subscribe(f"edgeflow/{FLEET}/gateway/{channel}", heard)
        attacker.connect(timeout=10)
        attacker.subscribe(f"edgeflow/{FLEET}/gateway/round", rounds_seen)
        pool.start()
        assert pool.wait_ready(60), pool.logs()
        for name in names[:3]:  # "evil" trains only after its impostors were refused
            clients[name].start()
            clients[name].transport.connect(timeout=10)
        rm.start()
        gt.connect(timeout=10)
        runner.start()
        ann = RoundAnnouncement.verify(rounds_seen.wait_for(lambda m: bool(m.payload), 60).payload,
                                       fleet_key.public_key)
        assert ann.state == "open" and "evil" in ann.selected
        zeros = {k: v * 0 for k, v in model_weights(model).items()}
        topic = f"edgeflow/{FLEET}/evil/update"
        forged = encode_update(zeros, "dense", round_id=ann.round_id, device_id="evil", seq=1,
                               signer=Signer.generate("evil"), num_samples=10)  # not evil's registered key
        spoofed = encode_update(zeros, "dense", round_id=ann.round_id, device_id="d0", seq=1,
                                signer=signers["d0"], num_samples=10)  # d0's update on evil's topic
        for payload in (b"\x00not an envelope", forged, spoofed):
            attacker.publish(topic, payload, qos=1).wait(10)
        want = {"malformed": 1, "wrong_key": 1, "spoofed": 1}
        got: dict = {}
        assert wait_until(lambda: got.update(_samples(server.url, "edgeflow_ingest_refused_updates", "reason"))
                          or all(got.get(k) == v for k, v in want.items()), 30), (got, pool.logs())
        clients["evil"].start()
        clients["evil"].transport.connect(timeout=10)
        runner.join(120)
        assert not runner.is_alive() and [m.participants for m in result["history"]] == [4], result
        # the coordinator never saw them: its own refusal counters are empty
        assert not _samples(server.url, "edgeflow_round_rejected_updates", "reason")
        ear_model = [m for m in heard.messages if m[0] == "model"]
        assert wait_until(lambda: len([m for m in heard.messages if m[0] == "model"]) >= 1, 10), heard.messages
        ear_model = [m for m in heard.messages if m[0] == "model"]
        assert ear_model[0][2] > 1, "the model was meant to travel in chunks"
        sent = _samples(server.url, "edgeflow_published_bytes", "kind")
        assert wait_until(lambda: heard.bytes.get("round") == sent.get("round"), 10), (sent, heard.bytes)
        assert sent["model"] == heard.bytes["model"], (sent, heard.messages)
        assert sent["model"] > ear_model[0][1]  # the chunk headers are counted too
    finally:
        server.stop()
        rm.stop()
        for c in clients.values():
            c.stop(timeout=2)
            c.transport.close(timeout=1, flush=False)
        for t in (gt, ear, attacker):
            t.close(timeout=1, flush=False)
        pool.stop()
