"""Flower's PyTorch quickstart client, ported to edgeflow (docs/flower.md): the same class and client_fn.

    edgeflow simulate --app examples/flower_quickstart/client_app_torch.py:client_fn --devices 4 --rounds 5

Flower's quickstart trains a CNN on CIFAR-10 from flwr-datasets; this port keeps the code's shape and trains
a small PyTorch MLP on scikit-learn's 8x8 digits (no download), each node on its own partition.
"""

from collections import OrderedDict

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id, num_partitions):
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    part = np.array_split(order, num_partitions)[partition_id]
    x = torch.tensor(x[part] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[part], dtype=torch.long)
    cut = int(0.8 * len(y))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def train(net, data, epochs, lr=0.1):
    x, y = data
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    for _ in range(epochs):
        for i in range(0, len(y), 32):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[i:i + 32]), y[i:i + 32])
            loss.backward()
            opt.step()
    return float(loss)


def test(net, data):
    x, y = data
    net.eval()
    with torch.no_grad():
        out = net(x)
        return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def get_weights(net):
    return [val.cpu().numpy() for _, val in net.state_dict().items()]


def set_weights(net, parameters):
    params_dict = zip(net.state_dict().keys(), parameters)
    state_dict = OrderedDict({k: torch.tensor(v) for k, v in params_dict})
    net.load_state_dict(state_dict, strict=True)


class FlowerClient:  # in Flower: class FlowerClient(NumPyClient)
    def __init__(self, net, trainloader, valloader, local_epochs):
        self.net, self.trainloader, self.valloader, self.local_epochs = net, trainloader, valloader, local_epochs

    def get_parameters(self, config):
        return get_weights(self.net)

    def fit(self, parameters, config):
        set_weights(self.net, parameters)
        train_loss = train(self.net, self.trainloader, self.local_epochs)
        return get_weights(self.net), len(self.trainloader[1]), {"train_loss": train_loss}

    def evaluate(self, parameters, config):
        set_weights(self.net, parameters)
        loss, accuracy = test(self.net, self.valloader)
        return loss, len(self.valloader[1]), {"accuracy": accuracy}


def client_fn(context):
    torch.manual_seed(context.node_config["partition-id"])
    net = Net()
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader, valloader = load_data(partition_id, num_partitions)
    local_epochs = context.run_config.get("local-epochs", 2)
    return FlowerClient(net, trainloader, valloader, local_epochs)  # in Flower: ....to_client()
