"""A federated fleet on the loopback transport for benchmarks: the real RoundManager and real federated
Clients (digits MLP, Dirichlet shards of scikit-learn's digits), no broker. Used by
benchmarks/restart_continuity.py and benchmarks/norm_bound_takeover.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def loopback_fleet(state: str, config: dict[str, Any], rounds: int, seed: int, *, devices: int = 5,
                   transform: dict[int, Callable[..., Any]] | None = None, samples: int = 120, alpha: float = 1.0,
                   poison: dict[int, Callable[[Any, Any], tuple[Any, Any]]] | None = None) -> dict[str, Any]:
    """Started clients and a ``manager()`` factory that starts a RoundManager on ``state`` (call it again
    to restart the gateway); ``transform``: per-device ``transform_update`` hooks (attacks on the update);
    ``poison``: per-device ``(x, y) -> (x, y)`` on its training shard (attacks on the data)."""
    from edgeflow import zoo
    from edgeflow.data.datasets import dirichlet_partition, load_digits
    from edgeflow.federated import Client
    from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.protocol.rounds import TrainConfig
    from edgeflow.signing import KeyRing, PrivateKey, Signer
    from edgeflow.transport.loopback import LoopbackBroker

    hub = LoopbackBroker(name="restart")
    key = PrivateKey.generate()
    ring = KeyRing()
    model = zoo.digits_mlp(seed=seed)
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, devices, alpha=alpha, seed=seed)
    clients, transports = [], []
    for i, idx in enumerate(parts):
        s = Signer.generate(f"d{i}")
        ring.register(s.device_id, s.public_key)
        t = hub.transport(f"restart-d{i}")
        transports.append(t)
        data = (split.x_train[idx][:samples], split.y_train[idx][:samples])
        if poison and i in poison:
            data = poison[i](*data)
        clients.append(Client(t, fleet="restart", device_id=s.device_id, signer=s, fleet_key=key.public_key,
                              model=model, data=data, seed=i, transform_update=(transform or {}).get(i)))
    cfg = RoundConfig(**{"rounds": rounds, "min_clients": 2, "deadline_s": 20, "max_extensions": 0, "seed": 3,
                         "wait_for_devices_s": 5.0, "train": TrainConfig(epochs=1, batch_size=16, lr=0.1,
                                                                         codec="dense"), **config})

    def candidates() -> list[Candidate]:
        return [Candidate(c.device_id) for c, t in zip(clients, transports) if t.is_connected]

    def manager() -> Any:
        gt = hub.transport("restart-gateway")
        rm = RoundManager(gt, GatewayStore(state), fleet="restart", fleet_key=key, keyring=ring, model=model,
                          config=cfg, candidates=candidates, eval_data=(split.x_test, split.y_test))
        rm.start()
        gt.connect()
        return rm, gt

    for c in clients:
        c.start()
        c.transport.connect()
    return {"clients": clients, "transports": transports, "manager": manager, "split": split}




def shut_down(fleet: dict[str, Any], rm: Any, gateway_transport: Any) -> None:
    """Stop the gateway and every client, close the transports and the gateway's state."""
    rm.stop()
    for c in fleet["clients"]:
        c.stop(timeout=2)
    for t in [*fleet["transports"], gateway_transport]:
        t.close(timeout=1, flush=False)
    rm.store.close()
