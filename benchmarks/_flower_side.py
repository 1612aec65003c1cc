"""Flower's half of benchmarks/fl_vs_flower.py: one FedAvg run in Flower's simulation, in Flower's venv.

    /work/venvs/flwr/bin/python benchmarks/_flower_side.py SPEC.json DATA.npz OUT.json

Run by fl_vs_flower.py as a subprocess with the Flower venv's interpreter
(Flower 1.42 pins typer < 0.21, which breaks amqtt in edgeflow's env); not
meant to be run by hand. It imports no edgeflow module except for the
pretrained fine-tune, whose client trains with edgeflow's Trainer (the same
math on both sides by construction: only the framework differs).

SPEC (JSON): model ("mlp" | "cnn" | "finetune"), clients, rounds, epochs,
batch_size, lr, momentum, seed; finetune also onnx (path) and train_mode.
DATA (.npz, written by fl_vs_flower.py): x_train, y_train, x_test, y_test,
part_<i> (client i's indices into the training set, the same partition the
edgeflow side trains on), names (the federated tensors, in order) and
w_<k> (their initial values, edgeflow's initial model).

The run: ``flwr.simulation.run_simulation`` (Ray backend), a ServerApp
whose strategy is FedAvg (every client every round, weighted by examples,
centralized evaluation on the test set after each round, no federated
evaluation) wrapped to count bytes: down = the serialized tensors of each
client's FitIns, up = those of each FitRes (Flower's wire form of a
Parameters object: one ``np.save`` buffer per tensor). The clients are
NumPyClients: the MLP in numpy (the same forward/backward and SGD as
edgeflow's Trainer), the CNN in PyTorch (what a Flower user writes).
OUT (JSON): per round accuracy, bytes up/down, seconds since the first round began.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

_DATA: dict[str, Any] = {}


# ----------------------------------------------------------------- the data

def load_data(path: str) -> dict[str, Any]:
    """The .npz, once per process (each Ray worker loads it on its first client)."""
    if path not in _DATA:
        with np.load(path, allow_pickle=False) as z:
            _DATA[path] = {k: z[k] for k in z.files}
    return _DATA[path]


def initial_weights(data: dict[str, Any]) -> list[np.ndarray]:
    return [data[f"w_{n}"].astype(np.float32) for n in data["names"]]


# ---------------------------------------------------------------- the models

class NumpyMLP:
    """Gemm (x @ W.T + b) + ReLU layers, softmax cross-entropy averaged over the batch, plain SGD
    (torch.optim.SGD's momentum), reshuffled every epoch, the last partial batch kept: edgeflow's Trainer
    on zoo.mlp."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def _forward(self, w: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        acts = [x]
        h = x
        n_layers = len(w) // 2
        for i in range(n_layers):
            h = h @ w[2 * i].T + w[2 * i + 1]
            if i < n_layers - 1:
                h = np.maximum(h, 0)
            acts.append(h)
        return h, acts

    def _gradients(self, w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
        logits, acts = self._forward(w, x)
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        g_out = p / len(y)
        grads: list[np.ndarray] = [np.empty(0)] * len(w)
        for i in reversed(range(len(w) // 2)):
            grads[2 * i] = g_out.T @ acts[i]
            grads[2 * i + 1] = g_out.sum(axis=0)
            if i:
                g_out = (g_out @ w[2 * i]) * (acts[i] > 0)
        return grads

    def fit(self, w: list[np.ndarray], x: np.ndarray, y: np.ndarray, spec: dict, seed: int) -> list[np.ndarray]:
        w = [a.astype(np.float32).copy() for a in w]
        x = x.reshape(len(x), -1).astype(np.float32)
        rng = np.random.default_rng(seed)
        bufs: list[np.ndarray | None] = [None] * len(w)
        lr, mom, bs = np.float32(spec["lr"]), np.float32(spec["momentum"]), int(spec["batch_size"])
        for _ in range(int(spec["epochs"])):
            order = rng.permutation(len(y)) if spec.get("shuffle", True) else np.arange(len(y))
            for s in range(0, len(y), bs):
                idx = order[s:s + bs]
                for k, g in enumerate(self._gradients(w, x[idx], y[idx])):
                    g = g.astype(np.float32)
                    if mom:
                        bufs[k] = g.copy() if bufs[k] is None else bufs[k] * mom + g
                        g = bufs[k]
                    w[k] -= lr * g
        return w

    def accuracy(self, w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        logits, _ = self._forward(w, x.reshape(len(x), -1).astype(np.float32))
        return float((logits.argmax(axis=1) == y).mean())


class TorchCNN:
    """zoo.small_cnn in PyTorch: [Conv3x3 pad 1 -> ReLU -> MaxPool2] x2 -> Flatten -> Linear -> ReLU -> Linear,
    edgeflow's initial weights loaded by name, torch.optim.SGD, cross-entropy, reshuffled every epoch."""

    def __init__(self, names: list[str]) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.names = names

    def _net(self, w: list[np.ndarray]):
        nn = self.torch.nn
        d = dict(zip(self.names, w))
        c0, c1 = d["conv0.weight"], d["conv1.weight"]
        net = nn.Sequential(
            nn.Conv2d(c0.shape[1], c0.shape[0], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1.shape[1], c1.shape[0], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(d["fc0.weight"].shape[1], d["fc0.weight"].shape[0]), nn.ReLU(),
            nn.Linear(d["fc1.weight"].shape[1], d["fc1.weight"].shape[0]))
        layers = {"conv0": net[0], "conv1": net[3], "fc0": net[7], "fc1": net[9]}
        with self.torch.no_grad():
            for name, v in d.items():
                layer, kind = name.split(".")
                getattr(layers[layer], kind).copy_(self.torch.tensor(np.asarray(v, np.float32)))
        return net, layers

    def _weights(self, layers) -> list[np.ndarray]:
        return [getattr(layers[n.split(".")[0]], n.split(".")[1]).detach().numpy().copy() for n in self.names]

    def fit(self, w: list[np.ndarray], x: np.ndarray, y: np.ndarray, spec: dict, seed: int) -> list[np.ndarray]:
        torch = self.torch
        net, layers = self._net(w)
        opt = torch.optim.SGD(net.parameters(), lr=spec["lr"], momentum=spec["momentum"])
        xt, yt = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
        rng = np.random.default_rng(seed)
        bs = int(spec["batch_size"])
        for _ in range(int(spec["epochs"])):
            order = torch.from_numpy(rng.permutation(len(y)) if spec.get("shuffle", True) else np.arange(len(y)))
            for s in range(0, len(y), bs):
                idx = order[s:s + bs]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(xt[idx]), yt[idx]).backward()
                opt.step()
        return self._weights(layers)

    def accuracy(self, w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        net, _ = self._net(w)
        with self.torch.no_grad():
            pred = net(self.torch.from_numpy(x.astype(np.float32))).argmax(dim=1).numpy()
        return float((pred == y).mean())


class EdgeflowTrainerModel:
    """The pretrained fine-tune: edgeflow's Trainer (mode head / bias) on the suite model with its new head,
    so the math is edgeflow's by construction; Flower carries the trainable tensors only, as edgeflow does.
    A client object lives one round in Flower's simulation, so each fit gets a Trainer seeded for the round."""

    def __init__(self, names: list[str], spec: dict) -> None:
        self.names = names
        self.spec = spec
        self.trainer = self._trainer(int(spec["seed"]))

    def _trainer(self, seed: int):
        from edgeflow.train import Trainer

        s = self.spec
        return Trainer(s["onnx"], mode=s["train_mode"], lr=s["lr"], momentum=s["momentum"],
                       batch_size=s["batch_size"], seed=seed)

    def fit(self, w: list[np.ndarray], x: np.ndarray, y: np.ndarray, spec: dict, seed: int) -> list[np.ndarray]:
        t = self._trainer(seed)
        t.set_weights(dict(zip(self.names, w)))
        t.fit((x, y), epochs=int(spec["epochs"]), batch_size=int(spec["batch_size"]))
        got = t.get_weights(trainable_only=True)
        return [np.asarray(got[n], np.float32).copy() for n in self.names]

    def accuracy(self, w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        self.trainer.set_weights(dict(zip(self.names, w)))
        return float(self.trainer.evaluate(x, y)[1])


def make_model(spec: dict, names: list[str]):
    if spec["model"] == "mlp":
        return NumpyMLP(names)
    if spec["model"] == "cnn":
        return TorchCNN(names)
    return EdgeflowTrainerModel(names, spec)


# ---------------------------------------------------------------- Flower apps

def client_app(spec: dict, data_path: str):
    from flwr.client import ClientApp, NumPyClient

    class DigitsClient(NumPyClient):
        def __init__(self, pid: int) -> None:
            self.pid = pid
            self.data = load_data(data_path)
            self.model = make_model(spec, [str(n) for n in self.data["names"]])
            idx = self.data[f"part_{pid}"]
            self.x, self.y = self.data["x_train"][idx], self.data["y_train"][idx]

        def fit(self, parameters, config):
            seed = int(spec["seed"]) * 1000 + self.pid + 100_003 * int(config["server_round"])
            w = self.model.fit(parameters, self.x, self.y, spec, seed)
            return w, len(self.y), {}

    def client_fn(context):
        return DigitsClient(int(context.node_config["partition-id"])).to_client()

    return ClientApp(client_fn=client_fn)


def counting_fedavg(spec: dict, data: dict[str, Any], log: list[dict]):
    """FedAvg over every client, centralized test accuracy, and a byte count of every FitIns / FitRes;
    each round's ``t_s`` counts from the first round's start (Ray is up by then)."""
    from flwr.common import ndarrays_to_parameters
    from flwr.server.strategy import FedAvg

    model = make_model(spec, [str(n) for n in data["names"]])
    x_test, y_test = data["x_test"], data["y_test"]
    n = int(spec["clients"])
    t_first: dict[str, float] = {}

    def evaluate_fn(server_round, parameters, config):
        return 0.0, {"accuracy": model.accuracy(parameters, x_test, y_test)}

    class CountingFedAvg(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            ins = super().configure_fit(server_round, parameters, client_manager)
            down = sum(len(t) for _, fit_ins in ins for t in fit_ins.parameters.tensors)
            t_first.setdefault("t", time.perf_counter())
            log.append({"round": server_round, "bytes_down": down, "clients": len(ins)})
            return ins

        def aggregate_fit(self, server_round, results, failures):
            log[-1]["bytes_up"] = sum(len(t) for _, res in results for t in res.parameters.tensors)
            log[-1]["participants"] = len(results)
            log[-1]["failures"] = len(failures)
            return super().aggregate_fit(server_round, results, failures)

        def evaluate(self, server_round, parameters):
            out = super().evaluate(server_round, parameters)
            if server_round > 0 and out is not None:
                log[-1]["accuracy"] = out[1]["accuracy"]
                log[-1]["t_s"] = time.perf_counter() - t_first["t"]
            return out

    return CountingFedAvg(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_evaluate_clients=0, min_available_clients=n,
        evaluate_fn=evaluate_fn, on_fit_config_fn=lambda r: {"server_round": r},
        initial_parameters=ndarrays_to_parameters(initial_weights(data)))


def run(spec: dict, data_path: str) -> dict:
    import flwr
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.simulation import run_simulation

    t0 = time.perf_counter()
    data = load_data(data_path)
    log: list[dict] = []
    strategy = counting_fedavg(spec, data, log)

    def server_fn(context):
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=int(spec["rounds"])))

    cpus = int(spec.get("ray_cpus", os.cpu_count() or 1))
    run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=client_app(spec, data_path),
                   num_supernodes=int(spec["clients"]),
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": cpus, "include_dashboard": False}})
    return {"framework": f"flwr {flwr.__version__}", "rounds": log, "wall_s": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: _flower_side.py SPEC.json DATA.npz OUT.json (run by benchmarks/fl_vs_flower.py)",
              file=sys.stderr)
        return 2
    spec = json.loads(open(argv[0], encoding="utf-8").read())
    result = run(spec, argv[1])
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
