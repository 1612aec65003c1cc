"""Your own training loop over a real broker: a PyTorch NumPyClient per device behind edgeflow's
federated Client, the gateway's RoundManager, each on its own MQTT connection to Mosquitto
(the same seam without a broker: tests/unit/test_numpy_client_loopback.py). The torch code is
the example of docs/training.md, "Your own training loop"."""

from __future__ import annotations

import numpy as np
import pytest

from _brokers import mosquitto_factory, transport_factory  # noqa: F401  (fixtures)

import edgeflow
from edgeflow import zoo
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.protocol.rounds import TrainConfig
from edgeflow.signing import KeyRing, PrivateKey, Signer

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional


class MLP(nn.Module):
    """The digits MLP (zoo.digits_mlp): same parameter names and shapes as the gateway's ONNX model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(F.relu(self.fc0(x)))))


class TorchClient(edgeflow.NumPyClient):
    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.net = MLP()
        self.x, self.y = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))

    def get_parameters(self, config):
        return {k: v.detach().numpy().copy() for k, v in self.net.state_dict().items()}

    def _set(self, parameters):
        self.net.load_state_dict({k: torch.from_numpy(v) for k, v in parameters.items()})

    def fit(self, parameters, config):
        self._set(parameters)
        opt = torch.optim.SGD(self.net.parameters(), lr=config["lr"])
        bs, losses = config["batch_size"], []
        for _ in range(config["epochs"]):
            for i in range(0, len(self.x), bs):
                opt.zero_grad()
                loss = F.cross_entropy(self.net(self.x[i:i + bs]), self.y[i:i + bs])
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return self.get_parameters(config), len(self.x), {"loss": float(np.mean(losses))}

    def evaluate(self, parameters, config):
        self._set(parameters)
        with torch.no_grad():
            out = self.net(self.x)
            loss = F.cross_entropy(out, self.y)
            acc = (out.argmax(1) == self.y).float().mean()
        return float(loss), len(self.x), {"accuracy": float(acc)}


def _accuracy(weights, x, y) -> float:
    net = MLP()
    net.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()})
    with torch.no_grad():
        return float((net(torch.from_numpy(x.astype(np.float32))).argmax(1).numpy() == y).mean())


def test_torch_clients_train_the_gateways_model_over_mosquitto(mosquitto_factory, transport_factory):  # noqa: F811
    torch.manual_seed(0)
    broker = mosquitto_factory()
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, 3, alpha=1.0, seed=0)
    fleet_key, ring, clients = PrivateKey.generate(), KeyRing(), []
    for i, idx in enumerate(parts):
        s = Signer.generate(f"torch{i}")
        ring.register(s.device_id, s.public_key)
        t = transport_factory(broker, connect=False, client_id=f"np-{s.device_id}")
        clients.append(edgeflow.Client(t, fleet="np", device_id=s.device_id, signer=s,
                                       fleet_key=fleet_key.public_key, app=TorchClient(split.x_train[idx],
                                                                                       split.y_train[idx])))
    model = zoo.digits_mlp(seed=0)
    cfg = RoundConfig(rounds=4, min_clients=3, deadline_s=30, max_extensions=0, strategy="fedavg",
                      train=TrainConfig(epochs=2, batch_size=16, lr=0.1, codec="int8"), wait_for_devices_s=10.0)
    gt = transport_factory(broker, connect=False, client_id="np-gateway")
    rounds = RoundManager(gt, GatewayStore(), fleet="np", fleet_key=fleet_key, keyring=ring, model=model, config=cfg,
                          candidates=lambda: [Candidate(c.device_id) for c in clients])
    before = _accuracy(rounds.weights, split.x_test, split.y_test)
    try:
        for c in clients:
            c.start()
            c.transport.connect()
        rounds.start()
        gt.connect()
        history = rounds.run()
    finally:
        rounds.stop()
        for c in clients:
            c.stop(timeout=2)
        rounds.store.close()
    assert [m.participants for m in history] == [3, 3, 3, 3]
    after = _accuracy(rounds.weights, split.x_test, split.y_test)
    assert before < 0.3 and after > 0.85, (before, after)
    for c in clients:  # every device evaluated the global model of the last round before training on it
        assert c.last_evaluate["round_id"] == 4 and 0.5 < c.last_evaluate["metrics"]["accuracy"] <= 1.0
        assert c.last_fit["num_examples"] == len(c.app.x)
    assert history[-1].mean_client_loss < history[0].mean_client_loss
