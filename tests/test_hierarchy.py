"""Hierarchical rounds over real bridged Mosquitto brokers: two site brokers bridged
(generated bridge config) to a central broker, devices on the site brokers, a site
gateway per site, one root gateway on the central broker. The root's new global
weights equal flat FedAvg over every device's delta, and the new model reaches the
devices through the bridges."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _brokers import mosquitto_factory, wait_until  # noqa: F401
from edgeflow import zoo
from edgeflow.broker.bridge import BridgeSpec, render_bridge
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.errors import ConfigError
from edgeflow.federated import Client
from edgeflow.protocol.rounds import TrainConfig
from edgeflow.gateway.hierarchy import PartialSum, SiteGateway, Uplink, root_manager, site_manager
from edgeflow.gateway.rounds import Candidate, RoundConfig
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport import MqttTransport

pytestmark = pytest.mark.integration

FLEET = "hier"
SITES = ("site-a", "site-b")
PER_SITE = 3
TRAIN = TrainConfig(epochs=1, batch_size=16, lr=0.1, codec="dense")


def _flat_fedavg(before, clients):
    n = np.array([len(c.x) for c in clients], dtype=np.float64)
    out = {}
    for name, w in before.items():
        deltas = np.stack([c.last_delta[name].astype(np.float64) for c in clients])
        out[name] = w.astype(np.float64) + np.tensordot(n / n.sum(), deltas, axes=1)
    return out


def test_two_bridged_sites_and_a_root_reproduce_flat_fedavg(mosquitto_factory):  # noqa: F811
    central = mosquitto_factory()
    site_brokers = {
        s: mosquitto_factory(extra_config=render_bridge(BridgeSpec(FLEET, s, "127.0.0.1", central.port,
                                                                   restart_timeout=(1, 2))))
        for s in SITES
    }
    fleet_key = PrivateKey.generate()
    model = zoo.digits_mlp(seed=3)
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, PER_SITE * len(SITES), alpha=1.0, seed=0)
    transports: list[MqttTransport] = []

    def transport(url: str, cid: str) -> MqttTransport:
        t = MqttTransport.from_url(url, client_id=f"{FLEET}-{cid}", clean_start=True, reconnect_min_s=0.05)
        transports.append(t)
        return t

    site_signers = {s: Signer.generate(s) for s in SITES}
    site_keys = KeyRing({s: sg.public_key for s, sg in site_signers.items()})
    clients: dict[str, list[Client]] = {s: [] for s in SITES}
    sites: dict[str, SiteGateway] = {}
    threads: list[threading.Thread] = []
    try:
        for k, s in enumerate(SITES):
            ring = KeyRing()
            for j in range(PER_SITE):
                i = k * PER_SITE + j
                signer = Signer.generate(f"d{i}")
                ring.register(signer.device_id, signer.public_key)
                c = Client(transport(site_brokers[s].url, f"d{i}"), fleet=FLEET, device_id=signer.device_id,
                           signer=signer, fleet_key=fleet_key.public_key, model=model,
                           data=(split.x_train[parts[i]], split.y_train[parts[i]]), seed=i)
                clients[s].append(c)
            gt = transport(site_brokers[s].url, f"{s}-gateway")
            rm = site_manager(
                gt, GatewayStore(), fleet=FLEET, fleet_key=fleet_key, keyring=ring, model=model,
                config=RoundConfig(min_clients=PER_SITE, deadline_s=30, strategy="fedavg"),
                candidates=lambda ring=ring: [Candidate(d) for d in ring.devices()],
                uplink=Uplink(gt, FLEET), signer=site_signers[s],
            )
            assert isinstance(rm.strategy, PartialSum)
            sites[s] = SiteGateway(rm, Uplink(gt, FLEET), site_id=s, root_key=fleet_key.public_key,
                                   forward_margin_s=3.0)
        rt = transport(central.url, "root")
        root = root_manager(rt, GatewayStore(), fleet=FLEET, fleet_key=fleet_key, site_keys=site_keys,
                            model=model, sites=list(SITES),
                            config=RoundConfig(rounds=2, min_clients=2, deadline_s=40, train=TRAIN,
                                               strategy="fedavg", strategy_params={"stage": 0}))
        for s in SITES:
            for c in clients[s]:
                c.start()
                c.transport.connect(timeout=10)
            sites[s].start()
            sites[s].rounds.transport.connect(timeout=10)
            threads.append(threading.Thread(target=sites[s].run, daemon=True))
        root.start()
        rt.connect(timeout=10)
        for t in threads:
            t.start()

        everyone = [c for s in SITES for c in clients[s]]
        expected: list[dict[str, np.ndarray]] = []
        befores = [dict(root.weights)]

        def on_round(m) -> None:  # before the next round is announced: the deltas are this round's
            expected.append(_flat_fedavg(befores[-1], everyone))
            befores.append(dict(root.weights))

        root.on_round = on_round
        history = root.run()
        assert [m.participants for m in history] == [PER_SITE * len(SITES)] * 2, history
        assert [m.selected for m in history] == [len(SITES)] * 2  # the root's clients are the sites
        assert root.version == 3
        for got, want in ((befores[1], expected[0]), (befores[2], expected[1])):
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        for s in SITES:
            assert sites[s].rounds.sink.forwarded == [1, 2]
            assert [m.participants for m in sites[s].history] == [PER_SITE, PER_SITE]
        # v3 went root -> central broker -> bridges -> site gateways -> site brokers -> devices
        assert wait_until(lambda: all(c._version == 3 for c in everyone), 20), [c._version for c in everyone]
        for c in everyone:
            for name, w in root.weights.items():
                np.testing.assert_array_equal(c._weights[name], w)
        # device updates stayed on the site brokers: the central broker saw one message per site per round
        assert all(c.stats.updates_sent == 2 for c in everyone)
        assert root.counters_total.get("not_selected", 0) == 0
    finally:
        for s in sites.values():
            s.stop()
        for t in threads:
            t.join(10)
        for t in transports:
            t.close(timeout=1, flush=False)


def test_root_refuses_strategies_that_need_each_update():
    with pytest.raises(ConfigError, match="needs each device update"):
        root_manager(None, GatewayStore(), fleet=FLEET, fleet_key=PrivateKey.generate(), site_keys=KeyRing(),
                     model=zoo.digits_mlp(seed=0), sites=["a"], config=RoundConfig(strategy="median"))
    with pytest.raises(ConfigError, match="no public key for site"):
        root_manager(None, GatewayStore(), fleet=FLEET, fleet_key=PrivateKey.generate(), site_keys=KeyRing(),
                     model=zoo.digits_mlp(seed=0), sites=["a"], config=RoundConfig())


def test_partial_sum_is_the_weighted_sum_and_root_fold_equals_flat():
    """Pure math, no broker: sites' (sum, weight) folded at a FedAvg root = flat FedAvg."""
    from edgeflow.gateway.strategies import FedAvg

    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=(5, 3)).astype(np.float32)}
    deltas = [{"w": rng.normal(size=(5, 3)).astype(np.float32)} for _ in range(7)]
    n = [int(x) for x in rng.integers(1, 50, size=7)]
    flat = FedAvg(stage=0)
    flat.begin_round(g, 1)
    for i, (d, k) in enumerate(zip(deltas, n)):
        flat.add(d, k, client_id=f"d{i}")
    want = flat.finish().weights["w"]
    root = FedAvg(stage=0)
    root.begin_round(g, 1)
    for site, idx in (("a", [0, 1, 2]), ("b", [3, 4, 5, 6])):
        ps = PartialSum()
        ps.begin_round(g, 1)
        for i in idx:
            ps.add(deltas[i], n[i], client_id=f"d{i}")
        r = ps.finish()
        np.testing.assert_allclose(r.delta["w"], sum(n[i] * deltas[i]["w"].astype(np.float64) for i in idx),
                                   rtol=1e-6)
        assert r.total_samples == sum(n[i] for i in idx) and r.num_clients == len(idx)
        root.add_partial(r.delta, r.total_samples, r.num_clients, client_id=site)
    got = root.finish()
    assert got.num_clients == 7
    np.testing.assert_allclose(got.weights["w"], want, rtol=1e-5, atol=1e-6)


def test_gateway_toml_role_and_hierarchy_settings():
    from edgeflow.gateway.service import Gateway, load_config

    cfg = load_config({"gateway": {"role": "site"}, "hierarchy": {"site_id": "site-a", "uplink": "bridge"}})
    assert cfg.role == "site" and cfg.hierarchy.site_id == "site-a" and cfg.hierarchy.forward_margin_s == 2.0
    root = load_config({"gateway": {"role": "root"}, "hierarchy": {"sites": ["site-a", "site-b"]}})
    assert root.hierarchy.sites == ["site-a", "site-b"]
    assert load_config({}).role == "flat"
    for bad, match in (({"gateway": {"role": "edge"}}, "role must be"),
                       ({"gateway": {"role": "site"}}, "site_id is required"),
                       ({"gateway": {"role": "root"}}, "sites"),
                       ({"hierarchy": {"site": "x"}}, "unknown key")):
        with pytest.raises(ConfigError, match=match):
            load_config(bad)
    # the service wires the roles: a site forwards, a root folds partials
    key, site = PrivateKey.generate(), Signer.generate("site-a")
    t = MqttTransport("127.0.0.1", 1, client_id="unused")
    model = zoo.digits_mlp(seed=0)
    gw = Gateway(t, GatewayStore(), fleet=FLEET, fleet_key=key, keyring=KeyRing(), model=model,
                 rounds=RoundConfig(), role="site", hierarchy=cfg.hierarchy, site_signer=site,
                 root_key=key.public_key)
    assert gw.site is not None and isinstance(gw.rounds.strategy, PartialSum)
    assert gw.site.uplink.round_topic == f"edgeflow/{FLEET}/_uplink/gateway/round"
    ring = KeyRing({"site-a": site.public_key, "site-b": Signer.generate("site-b").public_key})
    gr = Gateway(t, GatewayStore(), fleet=FLEET, fleet_key=key, keyring=ring, model=model, rounds=RoundConfig(),
                 role="root", hierarchy=root.hierarchy)
    assert gr.rounds.contributions == "partials"
    assert [c.device_id for c in gr.rounds.candidates()] == ["site-a", "site-b"]
