"""Hierarchical rounds without a broker: two site hubs bridged (the bridge's own topic
lines, from edgeflow.broker.bridge) to a central hub, devices on the sites, a SiteGateway
per site, a root gateway on the central hub (tests/test_hierarchy.py runs the same over
bridged Mosquitto brokers)."""

from __future__ import annotations

import threading

import numpy as np
from _lbdevices import wait_until
from _lbfleet import TRAIN, LoopbackFleet, digits, flat_fedavg

from edgeflow import zoo
from edgeflow.broker.bridge import BridgeSpec, bridge_topics
from edgeflow.data.datasets import dirichlet_partition
from edgeflow.gateway.hierarchy import PartialSum, SiteGateway, Uplink, root_manager, site_manager
from edgeflow.gateway.rounds import RoundConfig
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport.loopback import LoopbackBridge, LoopbackBroker

FLEET = "hier"
SITES = ("site-a", "site-b")
PER_SITE = 3


def _site_factory(uplink_of, signer):
    def make(transport, store, **kw):
        return site_manager(transport, store, uplink=uplink_of(transport), signer=signer, **kw)

    return make


def test_two_bridged_sites_and_a_root_reproduce_flat_fedavg():
    central = LoopbackBroker(name="central")
    fleet_key = PrivateKey.generate()
    model = zoo.digits_mlp(seed=3)
    signers = {s: Signer.generate(s) for s in SITES}
    split = digits()  # the shards of tests/test_hierarchy.py: one split over every device
    parts = dirichlet_partition(split.y_train, PER_SITE * len(SITES), alpha=1.0, seed=0)
    shards = [(split.x_train[idx], split.y_train[idx]) for idx in parts]
    sites: dict[str, LoopbackFleet] = {}
    gateways: dict[str, SiteGateway] = {}
    bridges = []
    threads = []
    for k, s in enumerate(SITES):
        hub = LoopbackBroker(name=s)
        bridges.append(LoopbackBridge(hub, central, bridge_topics(BridgeSpec(FLEET, s, "central")), name=s).start())
        sites[s] = LoopbackFleet(PER_SITE, fleet=FLEET, hub=hub, fleet_key=fleet_key, model=model,
                                 shards=shards[k * PER_SITE:(k + 1) * PER_SITE],
                                 prefix=f"{s}-d", config={"min_clients": PER_SITE, "deadline_s": 20},
                                 rounds_factory=_site_factory(lambda t: Uplink(t, FLEET), signers[s]))
        assert isinstance(sites[s].rounds.strategy, PartialSum)
        gateways[s] = SiteGateway(sites[s].rounds, Uplink(sites[s].gateway_transport, FLEET), site_id=s,
                                  root_key=fleet_key.public_key, forward_margin_s=1.0)
    rt = central.transport("root")
    root = root_manager(rt, GatewayStore(), fleet=FLEET, fleet_key=fleet_key,
                        site_keys=KeyRing({s: sg.public_key for s, sg in signers.items()}), model=model,
                        sites=list(SITES), config=RoundConfig(rounds=2, min_clients=2, deadline_s=20, train=TRAIN,
                                                              strategy="fedavg", strategy_params={"stage": 0}))
    everyone = [c for s in SITES for c in sites[s].clients]
    expected, befores = [], [dict(root.weights)]

    def on_round(m) -> None:  # before the next round is announced: the deltas are this round's
        expected.append(flat_fedavg(befores[-1], everyone))
        befores.append(dict(root.weights))

    root.on_round = on_round
    try:
        for s in SITES:
            for c in sites[s].clients:
                c.start()
                c.transport.connect()
            gateways[s].start()
            sites[s].gateway_transport.connect()
            threads.append(threading.Thread(target=gateways[s].run, daemon=True))
        root.start()
        rt.connect()
        for t in threads:
            t.start()
        history = root.run()
        assert [m.participants for m in history] == [PER_SITE * len(SITES)] * 2, history
        assert [m.selected for m in history] == [len(SITES)] * 2  # the root's clients are the sites
        assert root.version == 3
        for r, (got, want) in enumerate(zip(befores[1:], expected), 1):
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=f"round {r} {name}")
        # v3 went root -> central hub -> bridges -> site gateways -> site hubs -> devices; each site
        # adopts the root's newest model on its own loop
        assert wait_until(lambda: all(c._version == 3 for c in everyone), 10), [c._version for c in everyone]
        for c in everyone:
            for name, w in root.weights.items():
                np.testing.assert_array_equal(c._weights[name], w)
        for g in gateways.values():
            g.stop()
        for t in threads:
            t.join(10)
        for s in SITES:
            assert sites[s].rounds.sink.forwarded == [1, 2]
            assert [m.participants for m in gateways[s].history] == [PER_SITE, PER_SITE]
        # device updates stayed on the site hubs: the bridges carried one partial per site per round
        assert all(c.stats.updates_sent == 2 for c in everyone)
        assert [b.forwarded["out"] for b in bridges] == [2, 2]
        assert not any(t.endswith("/update") and "-d" in t for t in central.retained())
    finally:
        for g in gateways.values():
            g.stop()
        for t in threads:
            t.join(10)
        for s in SITES:
            sites[s].close()
        for b in bridges:
            b.stop()
        rt.close(flush=False)


def test_a_site_whose_devices_stay_silent_forwards_nothing_and_the_root_closes_by_quorum():
    """Direct uplinks (no bridge): each site gateway has a second connection to the central hub."""
    central = LoopbackBroker(name="central")
    fleet_key = PrivateKey.generate()
    model = zoo.digits_mlp(seed=3)
    signers = {s: Signer.generate(s) for s in ("s1", "s2", "s3")}
    fleets: dict[str, LoopbackFleet] = {}
    gws: dict[str, SiteGateway] = {}
    ups = {s: central.transport(f"{s}-uplink") for s in signers}
    threads = []
    for k, s in enumerate(signers):
        silent = {i: (lambda d, r: None) for i in range(PER_SITE)} if s == "s3" else None
        uplink = Uplink(ups[s], FLEET, bridged=False)
        fleets[s] = LoopbackFleet(PER_SITE, fleet=FLEET, fleet_key=fleet_key, model=model, seed=k, prefix=f"{s}-d",
                                  config={"min_clients": PER_SITE, "deadline_s": 1.0}, transform=silent,
                                  rounds_factory=_site_factory(lambda t, u=uplink: u, signers[s]))
        gws[s] = SiteGateway(fleets[s].rounds, uplink, site_id=s, root_key=fleet_key.public_key, forward_margin_s=0.5)
    rt = central.transport("root")
    root = root_manager(rt, GatewayStore(), fleet=FLEET, fleet_key=fleet_key,
                        site_keys=KeyRing({s: sg.public_key for s, sg in signers.items()}), model=model,
                        sites=list(signers), config=RoundConfig(rounds=1, min_clients=2, quorum=0.6, deadline_s=3.0,
                                                                max_extensions=0, train=TRAIN, strategy="fedavg",
                                                                strategy_params={"stage": 0}))
    try:
        for s in signers:
            for c in fleets[s].clients:
                c.start()
                c.transport.connect()
            gws[s].start()
            fleets[s].gateway_transport.connect()
            ups[s].connect()
            threads.append(threading.Thread(target=gws[s].run, daemon=True))
        root.start()
        rt.connect()
        for t in threads:
            t.start()
        before = dict(root.weights)
        (m,) = root.run()
        assert (m.selected, m.participants, m.dropped) == (3, 2 * PER_SITE, 1)  # participants: devices; dropped: sites
        want = flat_fedavg(before, fleets["s1"].clients + fleets["s2"].clients)
        for name in want:
            np.testing.assert_allclose(root.weights[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        assert [x.participants for x in gws["s3"].history] == [0]
    finally:
        for g in gws.values():
            g.stop()
        for t in threads:
            t.join(10)
        for s in signers:
            fleets[s].close()
            ups[s].close(flush=False)
        rt.close(flush=False)
