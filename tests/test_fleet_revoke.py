"""Issue 20's remaining gaps: ``edgeflow fleet revoke`` (a running gateway refuses the revoked key, the next
broker config drops its password and ACL entries), the gateway service's key ring loader and transfer filter,
and the device's gateway epoch kept across agent restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from _fleet import FLEET, PROFILE, fleet_env, wait_until  # noqa: F401

from edgeflow.gateway.fleet import FleetOptions
from edgeflow.gateway.rounds import RoundConfig
from edgeflow.gateway.service import Gateway
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import PrivateKey, Signer
from edgeflow.transport.chunking import Splitter
from edgeflow.transport.topics import chunk_topic, device_topic

pytestmark = pytest.mark.integration


def _gateway(env, store=None, **fleet_opts):
    from edgeflow import zoo

    t = env.transport("gateway", connect=False)
    gw = Gateway(t, store or GatewayStore(":memory:"), fleet=FLEET, fleet_key=env.fleet_dir.fleet_key(),
                 keyring=env.fleet_dir.keyring(), keyring_loader=env.fleet_dir.keyring, model=zoo.digits_mlp(seed=1),
                 rounds=RoundConfig(), fleet_options=FleetOptions(**{"keyring_reload_s": 0.2, **fleet_opts}))
    env.managers["gateway"] = gw.fleet
    gw.start()
    env.made.append(t)
    return gw


def test_a_revoked_device_is_refused_by_the_running_gateway_and_dropped_from_the_broker(fleet_env):
    gw = _gateway(fleet_env)
    fm = gw.fleet
    try:
        dev = fleet_env.new_id()
        a = fleet_env.agent(dev)
        assert fm.wait_online([dev], 15)
        events = []
        fm.add_listener(lambda e: e.device_id == dev and events.append(e.kind))
        fd = fleet_env.fleet_dir
        r = subprocess.run([sys.executable, "-m", "edgeflow", "fleet", "revoke", dev, "--dir", str(fd.path), "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        assert r.returncode == 0, r.stdout
        out = json.loads(r.stdout)
        assert out["broker_config_updated"] and out["key"] == a.signer.public_key.hex
        # the running gateway (key ring loader) refuses the key within keyring_reload_s and marks it offline
        assert wait_until(lambda: "revoked" in events and not fm.is_online(dev), 10), events
        b0 = fm.stats().get("births_unknown", 0)
        a.publish_birth()
        assert wait_until(lambda: fm.stats().get("births_unknown", 0) > b0, 10), fm.stats()
        assert not fm.is_online(dev) and gw.rounds.keyring.get(dev) is None, "rounds still verify its updates"
        # the broker files: no password, no ACL block; its credentials moved aside
        broker = fd.broker_dir
        assert f"{dev}:" not in (broker / "passwd").read_text()
        assert f"user {dev}\n" not in (broker / "acl").read_text()
        assert not fd.device_dir(dev).exists() and dev in fd.revoked() and dev not in fd.keyring().devices()
        # after the broker reloads its files the device cannot log in any more
        a.crash()
        fleet_env.broker.proc.send_signal(1)  # SIGHUP: Mosquitto re-reads passwd and acl
        time.sleep(0.5)
        creds = json.loads(next((fd.path / "revoked").glob(f"{dev}-*/device.json")).read_text())
        t = fleet_env.transport(dev, creds["password"], connect=False, connect_timeout_s=3.0)
        with pytest.raises(Exception):
            t.connect(timeout=3)
        # revoking again is one clear line
        r2 = subprocess.run([sys.executable, "-m", "edgeflow", "fleet", "revoke", dev, "--dir", str(fd.path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        assert r2.returncode != 0 and "not provisioned" in r2.stdout and "Traceback" not in r2.stdout
        # provisioning the id again gives a new key and takes it off the revoked list
        fd.provision(dev, profile=PROFILE)
        assert dev not in fd.revoked() and fd.keyring().get(dev) != a.signer.public_key
    finally:
        gw.stop()


def test_the_gateway_service_filters_chunked_transfers_by_the_key_ring(fleet_env):
    gw = _gateway(fleet_env)
    try:
        assert gw.transport.accept_transfer == gw.fleet.accepts_transfer
        dev = fleet_env.new_id()
        t = fleet_env.transport("tester")  # an operator may write anywhere: chunks under a made-up id
        frames = Splitter(os.urandom(50_000), 8 * 1024)
        for i in range(frames.count):
            t.publish(chunk_topic(device_topic(FLEET, "made-up-9", "update").value, i), frames.frame(i), raw=True)
        t.flush(10)
        assert wait_until(lambda: gw.transport.stats().get("chunks_refused_sender", 0) >= frames.count, 10)
        assert gw.transport.stats().get("reassembly_bytes", 0) == 0
        assert gw.fleet.accepts_transfer(device_topic(FLEET, dev, "update").value)
        assert not gw.fleet.accepts_transfer("edgeflow/otherfleet/dev-00/update")
        # a bridged site hears its root's model under _uplink/gateway/ (signed by the root): accepted
        assert gw.fleet.accepts_transfer(f"edgeflow/{FLEET}/_uplink/gateway/model")
        assert not gw.fleet.accepts_transfer(f"edgeflow/{FLEET}/_uplink/made-up-9/update")
    finally:
        gw.stop()


def test_a_restarted_device_keeps_refusing_an_older_gateway_epoch(tmp_path):
    from edgeflow import zoo
    from edgeflow.codecs import encode_update
    from edgeflow.federated import Client
    from edgeflow.gateway.rounds import model_weights

    class Msg:
        def __init__(self, payload: bytes) -> None:
            self.payload, self.topic = payload, "x"

    class NoTransport:
        def subscribe(self, *a, **k):
            return None

    fk = PrivateKey.generate()
    gw = Signer("gateway", fk)
    model = zoo.digits_mlp(seed=1)
    w = model_weights(model)
    signer = Signer.generate("d0")
    data = (np.zeros((4, 64), np.float32), np.zeros(4, np.int64))
    path = tmp_path / "gateway_epoch.json"

    def client() -> Client:
        return Client(NoTransport(), fleet="red", device_id="d0", signer=signer, fleet_key=fk.public_key, model=model,
                      data=data, epoch_file=path)

    def model_msg(version: int, epoch: int) -> Msg:
        return Msg(encode_update(w, "dense", round_id=version, device_id="gateway", seq=version, signer=gw,
                                 metadata={"model_version": version, "epoch": epoch}))

    c = client()
    c._on_model(model_msg(3, 2000))
    assert json.loads(path.read_text()) == {"gateway_epoch": 2000}
    c2 = client()  # the agent restarted
    assert c2.status()["gateway_epoch"] == 2000
    c2._on_model(model_msg(9, 1000))  # a captured model of an older gateway epoch, re-published as retained
    assert c2.status()["model_version"] == -1 and c2.stats.rejected_messages == 1
    c2._on_model(model_msg(1, 3000))
    assert c2.status()["model_version"] == 1 and json.loads(path.read_text())["gateway_epoch"] == 3000
    path.write_text("{not json")  # a damaged file: a warning, epoch 0, not a crash
    assert client().status()["gateway_epoch"] == 0
