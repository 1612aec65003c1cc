"""A gateway process for crash tests: RoundManager + state (SQLite file or PostgreSQL URL) + persistent MQTT session.

    python _gateway_proc.py BROKER_URL STATE FLEET KEY KEYRING MODEL ROUNDS

Crashes are injected with the environment, not with code in this file: run it
with ``EDGEFLOW_FAULTS=<point>[@key][:n]`` (:mod:`edgeflow.faults`) and it dies
with ``os._exit(137)`` at that step - no flush, no DISCONNECT, no PUBACK for
the message in hand, as a power cut or ``kill -9`` would.
"""

from __future__ import annotations

import logging
import sys

import onnx

from edgeflow.protocol.rounds import TrainConfig
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey
from edgeflow.transport import MqttTransport


def main() -> None:
    url, state, fleet, key, keyring, model, rounds = sys.argv[1:8]
    logging.basicConfig(level=logging.INFO, format="gw %(message)s")
    store = GatewayStore(state)
    ring = KeyRing.load(keyring)
    t = MqttTransport.from_url(url, client_id=f"{fleet}-gateway", clean_start=False, session_expiry_s=600)
    rm = RoundManager(
        t, store, fleet=fleet, fleet_key=PrivateKey.load(key), keyring=ring, model=onnx.load(model),
        config=RoundConfig(rounds=int(rounds), min_clients=2, deadline_s=30, strategy="fedavg",
                           strategy_params={"stage": 0},
                           train=TrainConfig(epochs=1, batch_size=16, lr=0.1, codec="dense")),
        candidates=lambda: [Candidate(d) for d in ring.devices()],
        on_round=lambda m: print(f"ROUND {m.round_id} participants={m.participants} duplicates={m.duplicates}",
                                 flush=True),
    )
    rm.start()
    t.connect(timeout=30)
    rm.run()
    t.close()


if __name__ == "__main__":
    main()
