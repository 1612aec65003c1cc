"""A site gateway as its own process (a test host): tests/test_multihost.py runs it in a network
namespace next to that site's own Mosquitto, with its state on PostgreSQL over the veth link.

    python _site_host.py CONFIG.json

CONFIG: site_id, site_broker (the site's devices' broker), uplink (the central broker: a direct
uplink), state (a store URL), fleet, fleet_key (the fleet's private key file: the site signs its
own announcements with it), site_key (the site's identity, signs its partials), keyring (the
site's devices), model (the initial ONNX file), min_clients, deadline_s. Prints one line per
root round it took part in; runs until SIGTERM.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading

import onnx

from edgeflow.gateway.hierarchy import SiteGateway, Uplink, site_manager
from edgeflow.gateway.rounds import Candidate, RoundConfig
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport import MqttTransport


def main() -> int:
    cfg = json.loads(open(sys.argv[1], encoding="utf-8").read())
    logging.basicConfig(level=logging.INFO, format=f"{cfg['site_id']} %(levelname)s %(message)s")
    fleet, site = cfg["fleet"], cfg["site_id"]
    store = GatewayStore(cfg["state"])
    ring = KeyRing.load(cfg["keyring"])
    fleet_key = PrivateKey.load(cfg["fleet_key"])
    signer = Signer(site, PrivateKey.load(cfg["site_key"]))
    gt = MqttTransport.from_url(cfg["site_broker"], client_id=f"{fleet}-{site}-gateway", clean_start=False)
    ut = MqttTransport.from_url(cfg["uplink"], client_id=f"{fleet}-{site}", clean_start=False)
    uplink = Uplink(ut, fleet, bridged=False)
    rm = site_manager(gt, store, fleet=fleet, fleet_key=fleet_key, keyring=ring, model=onnx.load(cfg["model"]),
                      config=RoundConfig(min_clients=cfg["min_clients"], deadline_s=cfg["deadline_s"],
                                         strategy="fedavg"),
                      candidates=lambda: [Candidate(d) for d in ring.devices()], uplink=uplink, signer=signer,
                      on_round=lambda m: print(f"ROUND {m.round_id} participants={m.participants}", flush=True))
    sg = SiteGateway(rm, uplink, site_id=site, root_key=fleet_key.public_key, forward_margin_s=3.0)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: (stop.set(), sg.stop()))
    sg.start()
    gt.connect(timeout=60)
    ut.connect(timeout=60)
    print(f"READY {site} store={store.engine}", flush=True)
    try:
        sg.run()
    finally:
        ut.close(timeout=2)
        gt.close(timeout=2)
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
