"""What a gateway restart does to a federated run: uninterrupted vs restarted between rounds.

    python benchmarks/restart_continuity.py              # 5 rounds, restart after round 2
    python benchmarks/restart_continuity.py --json out.json

A real RoundManager and 5 real federated Clients (digits MLP, Dirichlet shards) over the
loopback transport, the state in a SQLite file. For each strategy the same seeded run is done
twice: once straight through, once with the gateway process replaced by a new RoundManager on
the same state after ``--restart-after`` rounds. Reported per strategy: the largest difference
between the two final models, the step of the first round after the restart (||delta||) in
both runs, and for central DP the epsilon each run reports at the end (and the true epsilon:
the accountant over all rounds, computed here from the settings).

Issue 29's finding, before the fix: epsilon 7.08 reported after a restart where 9.01 was true,
FedAdam's step after a restart 0.0528 instead of 0.0659 (other settings than here).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

STRATEGIES: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg"},
    "fedadam": {"strategy": "fedadam", "strategy_params": {"eta": 0.05}},
    "fedavgm": {"strategy": "fedavgm", "strategy_params": {"server_momentum": 0.9}},
    "fedyogi": {"strategy": "fedyogi", "strategy_params": {"eta": 0.05}},
    "central-dp": {"strategy": "fedavg", "dp": {"clip_norm": 1.0, "noise_multiplier": 0.8, "seed": 7}},
}


def _fleet(state: str, config: dict[str, Any], rounds: int, seed: int) -> dict[str, Any]:
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
    parts = dirichlet_partition(split.y_train, 5, alpha=1.0, seed=seed)
    clients, transports = [], []
    for i, idx in enumerate(parts):
        s = Signer.generate(f"d{i}")
        ring.register(s.device_id, s.public_key)
        t = hub.transport(f"restart-d{i}")
        transports.append(t)
        clients.append(Client(t, fleet="restart", device_id=s.device_id, signer=s, fleet_key=key.public_key,
                              model=model, data=(split.x_train[idx][:120], split.y_train[idx][:120]), seed=i))
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
    return {"clients": clients, "transports": transports, "manager": manager}


def one_run(config: dict[str, Any], rounds: int, restart_after: int | None, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        fl = _fleet(str(Path(tmp) / "gw.sqlite"), config, rounds, seed)
        rm, gt = fl["manager"]()
        try:
            if restart_after is None:
                history = rm.run()
            else:
                history = rm.run(restart_after)
                rm.stop()
                gt.close(timeout=1, flush=False)
                rm.store.close()
                rm, gt = fl["manager"]()
                history += rm.run()
            weights = {k: v.copy() for k, v in rm.weights.items()}
        finally:
            rm.stop()
            for c in fl["clients"]:
                c.stop(timeout=2)
            for t in [*fl["transports"], gt]:
                t.close(timeout=1, flush=False)
            rm.store.close()
    return {"weights": weights, "history": [m.to_dict() for m in history]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--restart-after", type=int, default=2)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--only", choices=sorted(STRATEGIES), action="append")
    ap.add_argument("--json", help="write the figures as JSON to this path")
    args = ap.parse_args(argv)
    if not 1 <= args.restart_after < args.rounds:
        print(f"error: --restart-after must be in [1, {args.rounds - 1}]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.ERROR)
    from edgeflow.gateway.privacy import RDPAccountant

    rows = []
    for name in args.only or list(STRATEGIES):
        config = STRATEGIES[name]
        plain = one_run(config, args.rounds, None, args.seed)
        resumed = one_run(config, args.rounds, args.restart_after, args.seed)
        diff = max(float(np.max(np.abs(plain["weights"][k] - resumed["weights"][k]))) for k in plain["weights"])
        k = args.restart_after  # the first round after the restart (0-based index k)
        row: dict[str, Any] = {
            "strategy": name, "max_abs_weight_diff": diff,
            "step_after_restart_plain": plain["history"][k].get("delta_norm"),
            "step_after_restart_resumed": resumed["history"][k].get("delta_norm"),
            "final_accuracy_plain": plain["history"][-1].get("accuracy"),
            "final_accuracy_resumed": resumed["history"][-1].get("accuracy"),
        }
        if "dp" in config:
            acc = RDPAccountant()
            for _ in range(args.rounds):
                acc.step(config["dp"]["noise_multiplier"], 1.0)
            row.update(epsilon_plain=plain["history"][-1].get("dp_epsilon"),
                       epsilon_resumed=resumed["history"][-1].get("dp_epsilon"),
                       epsilon_true=acc.get_epsilon(1e-5))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
