"""Past one machine: site gateways and ingestion workers as test hosts. Ingestion workers on two test hosts (network namespaces on a private
subnet), sharing one PostgreSQL state and one Mosquitto over their veth links; one host is
SIGKILLed mid-round (every process on it), the other takes its worker's name over and the
broker hands it the dead member's updates. Nothing is lost, nothing counted twice, and the
round equals flat FedAvg over every device.

The PostgreSQL and the Mosquitto are the test's own, bound to the test network's address
(tests/_netns.py); needs root and ``ip netns`` (skips with the reason otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from _ingest_fleet import digits_clients
from _brokers import FAST, wait_until
from _netns import pg_cluster, testnet  # noqa: F401
from _stores import pg_schema_url
from edgeflow import zoo
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.federated import Client
from edgeflow.protocol.rounds import TrainConfig
from edgeflow.gateway.ingest import IngestStore, SharedIngest, WorkerConfig
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.gateway.strategies import bounded_mean
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport import MqttTransport
from edgeflow.transport.broker import MosquittoBroker, find_mosquitto

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FLEET = "hosts"
DEVICES = 12


def _flat(before, clients, m):
    step = bounded_mean([c.last_delta for c in clients], [len(c.x) for c in clients],
                        m.extra.get("norm_bound"), m.extra.get("sample_cap"))
    return {name: w.astype(np.float64) + step[name] for name, w in before.items()}


def test_a_worker_host_killed_mid_round_loses_nothing(testnet, pg_cluster, tmp_path):  # noqa: F811
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    net = testnet
    broker = MosquittoBroker(host=net.gateway_ip, binary=find_mosquitto(), workdir=tmp_path / "broker").start()
    state = pg_schema_url("gw", pg_cluster.url)
    fleet_key = PrivateKey.generate()
    model, clients, ring = digits_clients(broker.url, FLEET, DEVICES, fleet_key, tmp_path / "ring.json", chunk_first=True)
    store = GatewayStore(state)
    assert store.engine == "postgresql"
    ingest = SharedIngest(merge_timeout_s=20, dead_after_s=3)
    gt = MqttTransport.from_url(broker.url, client_id=f"{FLEET}-gateway", **FAST)
    rm = RoundManager(gt, store, fleet=FLEET, fleet_key=fleet_key, keyring=ring, model=model,
                      config=RoundConfig(rounds=2, min_clients=DEVICES, deadline_s=60, strategy="fedavg",
                                         strategy_params={"stage": 0},
                                         train=TrainConfig(epochs=1, batch_size=16, lr=0.1, codec="dense")),
                      candidates=lambda: [Candidate(d) for d in ring.devices()], ingest=ingest)
    # Two worker hosts, each a supervisor running one worker and ready to take the other's name over.
    hosts = {"wa": ("w0", "w1"), "wb": ("w1", "w0")}
    procs = {}
    for hname, (mine, peer) in hosts.items():
        h = net.host(hname)
        cfg = WorkerConfig(name=mine, broker=broker.url, state=state, fleet=FLEET, keyring=str(tmp_path / "ring.json"),
                           delay_s=0.25, heartbeat_s=0.2, host=hname, lease_s=3.0)
        path = tmp_path / f"{hname}.json"
        path.write_text(json.dumps(asdict(cfg)))
        work = tmp_path / hname
        work.mkdir()
        log = open(tmp_path / f"{hname}.log", "wb")  # noqa: SIM115 - closed below
        procs[hname] = h.popen([sys.executable, "-m", "edgeflow.gateway.ingest", str(path), "--pool", mine,
                                "--peers", peer, "--takeover-after", "3", "--workdir", str(work)],
                               stdout=log, stderr=log)
        log.close()
    db = IngestStore(state)
    killed: dict[str, object] = {}

    def logs() -> str:
        out = []
        for hname in hosts:
            for p in [tmp_path / f"{hname}.log", *(tmp_path / hname).glob("*.log")]:
                if p.exists():
                    out.append(f"--- {p.name} ({hname})\n" + p.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def killer() -> None:  # power off host wa right after its worker persisted its first update of round 2
        if wait_until(lambda: db.own_claims(2, "w0"), 180, 0.005):
            killed["stored_before"] = len(db.reported(2))
            killed["pids"] = net.hosts["wa"].kill()

    try:
        assert wait_until(lambda: all(db.workers().get(n, {}).get("stats", {}).get("connected")
                                      for n in ("w0", "w1")), 90), logs()
        ws = db.workers()
        assert (ws["w0"]["host"], ws["w1"]["host"]) == ("wa", "wb")
        for c in clients:
            c.start()
            c.transport.connect(timeout=20)
        rm.start()
        gt.connect(timeout=20)
        k = threading.Thread(target=killer, daemon=True)
        k.start()
        expected, befores, merges = [], [dict(rm.weights)], []

        def on_round(m) -> None:
            expected.append(_flat(befores[-1], clients, m))
            befores.append(dict(rm.weights))
            merges.append(dict(ingest.last_merge))

        rm.on_round = on_round
        history = rm.run()
        k.join(10)
        assert killed, "w0 never claimed an update in round 2\n" + logs()
        assert killed["stored_before"] < DEVICES  # it died mid-round, with updates still to come
        assert [m.participants for m in history] == [DEVICES, DEVICES], logs()
        for got, want in zip(befores[1:], expected):
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        m2 = merges[1]
        assert sorted(d for ds in m2["claims"].values() for d in ds) == sorted(ring.devices())  # each once
        assert set(m2["claims"]) == {"w0", "w1"}  # the stream was shared by the two hosts
        # w0's name moved to host wb: its new process there took the dead session's updates
        assert db.workers()["w0"]["host"] == "wb"
        assert len(m2["claim_pids"]["w0"]) == 2, m2
        assert m2["from_store"] == []  # the successor rebuilt w0's partial from its stored claims
        assert history[1].duplicates == 0
        assert not any(p.poll() is None for p in [procs["wa"]])  # host wa is really down
    finally:
        rm.stop()
        for c in clients:
            c.stop(timeout=2)
            c.transport.close(timeout=1, flush=False)
        gt.close(timeout=1, flush=False)
        db.close()
        store.close()
        net.close()
        broker.stop()


def test_site_gateways_on_their_own_hosts_reproduce_flat_fedavg(testnet, pg_cluster, tmp_path):  # noqa: F811
    """Two sites, each a test host running its own Mosquitto and its site gateway process, with
    the site's state on the shared PostgreSQL (its own schema) over the veth link and a direct
    uplink to the central broker; the root runs here. Two root rounds equal flat FedAvg over
    every device of both sites."""

    from edgeflow.gateway.hierarchy import root_manager

    mosq = find_mosquitto()
    if mosq is None:
        pytest.skip("mosquitto is not installed")
    net = testnet
    central = MosquittoBroker(host=net.gateway_ip, binary=mosq, workdir=tmp_path / "central").start()
    fleet_key = PrivateKey.generate()
    fleet_key.save(tmp_path / "fleet.key")
    model = zoo.digits_mlp(seed=3)
    onnx_path = tmp_path / "model.onnx"
    onnx_path.write_bytes(model.SerializeToString())
    split = load_digits(seed=0).flat()
    sites, per_site = ("site-a", "site-b"), 3
    parts = dirichlet_partition(split.y_train, per_site * len(sites), alpha=1.0, seed=0)
    site_keys = KeyRing()
    clients: list[Client] = []
    site_of: dict[str, str] = {}
    for k, site in enumerate(sites):
        h = net.host(site.replace("-", ""))
        conf = tmp_path / f"{site}-mosquitto.conf"
        conf.write_text("listener 1883 0.0.0.0\nallow_anonymous true\npersistence false\n")
        h.popen([mosq, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(lambda ip=h.ip: _port_open(ip, 1883), 20), f"{site}'s broker did not start"
        skey = PrivateKey.generate()
        skey.save(tmp_path / f"{site}.key")
        site_keys.register(site, skey.public_key)
        ring = KeyRing()
        for j in range(per_site):
            i = k * per_site + j
            s = Signer.generate(f"d{i}")
            ring.register(s.device_id, s.public_key)
            t = MqttTransport.from_url(f"mqtt://{h.ip}:1883", client_id=f"{FLEET}-d{i}", clean_start=True, **FAST)
            clients.append(Client(t, fleet=FLEET, device_id=s.device_id, signer=s, fleet_key=fleet_key.public_key,
                                  model=model, data=(split.x_train[parts[i]], split.y_train[parts[i]]), seed=i))
            site_of[s.device_id] = site
        ring.save(tmp_path / f"{site}-ring.json")
        cfg = {"site_id": site, "site_broker": "mqtt://127.0.0.1:1883", "uplink": central.url,
               "state": pg_schema_url(site.replace("-", "_"), pg_cluster.url), "fleet": FLEET,
               "fleet_key": str(tmp_path / "fleet.key"), "site_key": str(tmp_path / f"{site}.key"),
               "keyring": str(tmp_path / f"{site}-ring.json"), "model": str(onnx_path), "min_clients": per_site,
               "deadline_s": 30}
        (tmp_path / f"{site}.json").write_text(json.dumps(cfg))
        log = open(tmp_path / f"{site}.log", "wb")  # noqa: SIM115 - closed below
        h.popen([sys.executable, str(ROOT_TESTS / "_site_host.py"), str(tmp_path / f"{site}.json")],
                stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def logs() -> str:
        return "\n".join(f"--- {s}\n" + (tmp_path / f"{s}.log").read_text(errors="replace")[-3000:] for s in sites)

    assert wait_until(lambda: all("READY" in (tmp_path / f"{s}.log").read_text() for s in sites), 90), logs()
    rt = MqttTransport.from_url(central.url, client_id=f"{FLEET}-root", **FAST)
    root_store = GatewayStore(pg_schema_url("root", pg_cluster.url))
    root = root_manager(rt, root_store, fleet=FLEET, fleet_key=fleet_key, site_keys=site_keys, model=model,
                        sites=list(sites),
                        config=RoundConfig(rounds=2, min_clients=2, deadline_s=60, strategy="fedavg",
                                           strategy_params={"stage": 0},
                                           train=TrainConfig(epochs=1, batch_size=16, lr=0.1, codec="dense")))
    try:
        for c in clients:
            c.start()
            c.transport.connect(timeout=20)
        root.start()
        rt.connect(timeout=20)
        expected, befores = [], [dict(root.weights)]

        def on_round(m) -> None:
            n = np.array([len(c.x) for c in clients], dtype=np.float64)
            expected.append({name: w.astype(np.float64) + np.tensordot(
                n / n.sum(), np.stack([c.last_delta[name].astype(np.float64) for c in clients]), axes=1)
                for name, w in befores[-1].items()})
            befores.append(dict(root.weights))

        root.on_round = on_round
        history = root.run()
        assert [m.participants for m in history] == [per_site * len(sites)] * 2, (history, logs())
        for got, want in zip(befores[1:], expected):
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        # each site kept its own rounds in its own schema of the shared PostgreSQL
        for site in sites:
            st = GatewayStore(pg_schema_url(site.replace("-", "_"), pg_cluster.url))
            try:
                assert [r.state for r in st.rounds()][:2] == ["closed", "closed"], st.rounds()
            finally:
                st.close()
        # the new model reached every device through its site gateway and site broker
        assert wait_until(lambda: all(c._version == root.version for c in clients), 30), \
            [c._version for c in clients]
        assert all(c.stats.updates_sent == 2 for c in clients)
    finally:
        root.stop()
        for c in clients:
            c.stop(timeout=2)
            c.transport.close(timeout=1, flush=False)
        rt.close(timeout=1, flush=False)
        root_store.close()
        net.close()
        central.stop()


ROOT_TESTS = Path(__file__).resolve().parent


def _port_open(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
