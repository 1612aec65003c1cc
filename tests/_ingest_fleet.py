"""The fleet the ingestion-worker tests run: digits-MLP clients on Dirichlet(1.0) shards over real MQTT,
each with its own signing key, registered in a key ring saved where the workers read it."""

from __future__ import annotations

from pathlib import Path

from _brokers import FAST
from edgeflow import zoo
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.federated import Client
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport import MqttTransport


def digits_clients(broker_url: str, fleet: str, devices: int, fleet_key: PrivateKey, ring_path: Path, *,
                   id_format: str = "d{:02d}", chunk_first: bool = False):
    """(model, clients, ring): ``devices`` clients named ``id_format.format(i)``; with ``chunk_first``
    the first one's transport sends 4 KB chunks (a 26 KB dense update is reassembled by every worker)."""
    model = zoo.digits_mlp(seed=5)
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, devices, alpha=1.0, seed=1)
    ring = KeyRing()
    clients: list[Client] = []
    for i, idx in enumerate(parts):
        s = Signer.generate(id_format.format(i))
        ring.register(s.device_id, s.public_key)
        t = MqttTransport.from_url(broker_url, client_id=f"{fleet}-{s.device_id}", clean_start=True,
                                   max_payload=4096 if chunk_first and i == 0 else 256 * 1024, **FAST)
        clients.append(Client(t, fleet=fleet, device_id=s.device_id, signer=s, fleet_key=fleet_key.public_key,
                              model=model, data=(split.x_train[idx], split.y_train[idx]), seed=i))
    ring.save(ring_path)
    return model, clients, ring


def start_fleet(pool, clients, rm, gateway_transport) -> None:
    """Start the ingestion workers (and wait until each is ready), the clients, the round manager and its
    transport, in that order: a device's first update must find a worker subscribed."""
    pool.start()
    assert pool.wait_ready(60), pool.logs()
    for c in clients:
        c.start()
        c.transport.connect(timeout=10)
    rm.start()
    gateway_transport.connect(timeout=10)


def stop_fleet(rm, clients, transports, pool) -> None:
    """Stop what :func:`start_fleet` started (and the test's other ``transports``) without waiting on the broker."""
    rm.stop()
    for c in clients:
        c.stop(timeout=2)
        c.transport.close(timeout=1, flush=False)
    for t in transports:
        t.close(timeout=1, flush=False)
    pool.stop()
