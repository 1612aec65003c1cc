"""Flower's quickstart client, numpy edition, run unchanged in shape by edgeflow (docs/flower.md).

    edgeflow simulate --app examples/flower_quickstart/client_app.py:client_fn --devices 4 --rounds 5
    edgeflow simulate --app ... --strategy examples/flower_quickstart/strategy.py:TrimmedFedAvg

A softmax regression on scikit-learn's 8x8 digits, each node training on its own slice
(``context.node_config["partition-id"]`` of ``["num-partitions"]``). Parameters travel as a list of
numpy arrays ``[W, b]``, as in Flower; ``evaluate`` returns a number, a text and a true/false metric.
"""

import numpy as np
from sklearn.datasets import load_digits

CLASSES = 10


def load_partition(partition_id: int, num_partitions: int, seed: int = 0):
    """This node's slice of the digits: 80% to train, 20% to test."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    part = np.array_split(order, num_partitions)[partition_id]
    x, y = (x[part] / 16.0).astype(np.float32), y[part]
    cut = int(0.8 * len(y))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def softmax_loss(w, b, x, y):
    z = x @ w + b
    z -= z.max(1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    return loss, p


class FlowerClient:  # in Flower: class FlowerClient(NumPyClient)
    def __init__(self, partition_id, num_partitions, lr=0.5, epochs=5):
        self.partition_id = partition_id
        (self.x, self.y), (self.x_test, self.y_test) = load_partition(partition_id, num_partitions)
        rng = np.random.default_rng(partition_id)
        self.w = (0.01 * rng.standard_normal((self.x.shape[1], CLASSES))).astype(np.float32)
        self.b = np.zeros(CLASSES, np.float32)
        self.lr, self.epochs = lr, epochs

    def get_parameters(self, config):
        return [self.w, self.b]

    def set_parameters(self, parameters):
        self.w, self.b = (np.array(p, dtype=np.float32) for p in parameters)

    def fit(self, parameters, config):
        self.set_parameters(parameters)
        onehot = np.eye(CLASSES, dtype=np.float32)[self.y]
        for _ in range(self.epochs):
            _, p = softmax_loss(self.w, self.b, self.x, self.y)
            grad = (p - onehot) / len(self.y)
            self.w -= self.lr * self.x.T @ grad
            self.b -= self.lr * grad.sum(0)
        loss, _ = softmax_loss(self.w, self.b, self.x, self.y)
        return self.get_parameters(config={}), len(self.y), {"train_loss": loss}

    def evaluate(self, parameters, config):
        self.set_parameters(parameters)
        loss, p = softmax_loss(self.w, self.b, self.x_test, self.y_test)
        accuracy = float((p.argmax(1) == self.y_test).mean())
        return loss, len(self.y_test), {"accuracy": accuracy, "partition": f"part-{self.partition_id}",
                                        "above_half": accuracy > 0.5}


def client_fn(context):
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    return FlowerClient(partition_id, num_partitions)  # in Flower: FlowerClient(...).to_client()
