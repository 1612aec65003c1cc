"""Run under Flower's own interpreter by tests/_flower.py: reads one pickled job on stdin, writes the pickled
result on stdout. Imports only Flower and numpy (never edgeflow): what it returns is Flower's own arithmetic."""

from __future__ import annotations

import pickle
import sys

import numpy as np


def aggregate(fn: str, args: list, kwargs: dict):
    from flwr.server.strategy import aggregate as agg

    return getattr(agg, fn)(*args, **kwargs)


def strategy_rounds(strategy: str, kwargs: dict, initial: list, rounds: list) -> list:
    """Flower's strategy ``strategy`` (FedAvgM, FedAdam, ...) over ``rounds``: each round a list of (delta
    arrays, num_examples); each client's weights are the strategy's current weights + its delta, as a client
    that trained from the global model sends them. Returns the global weights after each round."""
    import flwr.server.strategy as strategies
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    current = [np.array(a) for a in initial]
    s = getattr(strategies, strategy)(initial_parameters=ndarrays_to_parameters(current), **kwargs)
    out = []
    for server_round, clients in enumerate(rounds, start=1):
        results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([c + d for c, d in zip(current, ds)]),
                                 n, {})) for ds, n in clients]
        params, _ = s.aggregate_fit(server_round, results, [])
        current = parameters_to_ndarrays(params)
        out.append(current)
    return out


def main() -> None:
    job = pickle.load(sys.stdin.buffer)
    name = job.pop("job")
    result = {"aggregate": aggregate, "strategy_rounds": strategy_rounds}[name](**job)
    pickle.dump(result, sys.stdout.buffer)


if __name__ == "__main__":
    main()
