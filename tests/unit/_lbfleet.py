"""A federated fleet on a loopback hub: the real gateway RoundManager and real
federated Clients, each on its own LoopbackTransport (no broker, no sockets).

    from _lbfleet import LoopbackFleet, flat_fedavg

The clients train the digits MLP on small non-IID shards; ``fleet.rounds`` is
the gateway. Everything the tests assert comes from the real classes; the hub
only carries their messages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from edgeflow import zoo
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.federated import Client
from edgeflow.protocol.rounds import RoundAnnouncement, TrainConfig
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager, RoundMetrics
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport.loopback import LoopbackBroker, LoopbackTransport

TRAIN = TrainConfig(epochs=1, batch_size=16, lr=0.1, codec="dense")
_SPLIT: list[Any] = []


def digits() -> Any:
    if not _SPLIT:
        _SPLIT.append(load_digits(seed=0).flat())
    return _SPLIT[0]


def flat_fedavg(before: dict[str, np.ndarray], clients: list[Client]) -> dict[str, np.ndarray]:
    """The FedAvg of the clients' last deltas, computed here in float64."""
    n = np.array([len(c.x) for c in clients], dtype=np.float64)
    out = {}
    for name, w in before.items():
        deltas = np.stack([c.last_delta[name].astype(np.float64) for c in clients])
        out[name] = w.astype(np.float64) + np.tensordot(n / n.sum(), deltas, axes=1)
    return out


class LoopbackFleet:
    """``devices`` clients and a gateway on ``hub`` (a new LoopbackBroker by default).

    ``shards``: the clients' ``(x, y)`` (default: a Dirichlet split of digits, ``samples`` each);
    ``apps``: NumPyClients instead (one device each, no shards).

    ``candidates``: by default the devices whose transport is connected (a
    vanished device is not selected again). ``transform``: per-device
    ``transform_update`` hooks (index -> hook).
    """

    def __init__(self, devices: int = 4, *, fleet: str = "lb", hub: LoopbackBroker | None = None,
                 config: dict[str, Any] | None = None, samples: int = 120, seed: int = 1,
                 transform: dict[int, Callable[..., Any]] | None = None,
                 fleet_key: PrivateKey | None = None, model: Any = None, prefix: str = "d",
                 rounds_factory: Callable[..., RoundManager] | None = None,
                 shards: list[tuple[np.ndarray, np.ndarray]] | None = None,
                 apps: list[Any] | None = None, **rounds_kw: Any) -> None:
        self.hub = hub or LoopbackBroker(name=fleet)
        self.fleet = fleet
        self.fleet_key = fleet_key or PrivateKey.generate()
        self.model = model if model is not None else zoo.digits_mlp(seed=seed)
        self.ring = KeyRing()
        if apps is not None:  # NumPyClients: the users' own training loops instead of edgeflow's trainer
            shards = [None] * len(apps)
        elif shards is None:
            split = digits()
            parts = dirichlet_partition(split.y_train, devices, alpha=1.0, seed=seed)
            shards = [(split.x_train[idx][:samples], split.y_train[idx][:samples]) for idx in parts]
        self.clients: list[Client] = []
        self.transports: list[LoopbackTransport] = []
        for i, data in enumerate(shards):
            s = Signer.generate(f"{prefix}{i}")
            self.ring.register(s.device_id, s.public_key)
            t = self.hub.transport(f"{fleet}-{prefix}{i}")
            self.transports.append(t)
            own = {"app": apps[i]} if apps is not None else {"model": self.model, "data": data}
            self.clients.append(Client(
                t, fleet=fleet, device_id=s.device_id, signer=s, fleet_key=self.fleet_key.public_key,
                seed=i, transform_update=(transform or {}).get(i), **own))
        cfg = {"rounds": 1, "min_clients": 2, "deadline_s": 20, "max_extensions": 0, "strategy": "fedavg",
               "train": TRAIN, "wait_for_devices_s": 5.0, **(config or {})}
        self.gateway_transport = self.hub.transport(f"{fleet}-gateway")
        make = rounds_factory or RoundManager
        kw = dict(fleet=fleet, fleet_key=self.fleet_key, keyring=self.ring, model=self.model,
                  config=RoundConfig(**cfg), candidates=self.candidates, **rounds_kw)
        self.rounds = make(self.gateway_transport, GatewayStore(), **kw)
        self.history: list[RoundMetrics] = []
        self.announcements: list[RoundAnnouncement] = []
        self._cv = threading.Condition()

    def candidates(self) -> list[Candidate]:
        return [Candidate(c.device_id) for c, t in zip(self.clients, self.transports) if t.is_connected]

    def start(self) -> LoopbackFleet:
        for c in self.clients:
            c.start()
            c.transport.connect()
        self.rounds.start()
        self.gateway_transport.connect()
        return self

    def vanish(self, i: int) -> None:
        """Device ``i`` loses power: its connection drops without DISCONNECT (a thread, as a
        transform hook runs on the device's training thread)."""
        threading.Thread(target=self.transports[i].close, kwargs={"abort": True, "flush": False},
                         daemon=True).start()

    def close(self) -> None:
        self.rounds.stop()
        for c in self.clients:
            c.stop(timeout=2)
        for t in [*self.transports, self.gateway_transport]:
            t.close(timeout=1, flush=False)
        self.rounds.store.close()

    def __enter__(self) -> LoopbackFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
