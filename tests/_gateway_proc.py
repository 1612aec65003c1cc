"""A gateway process for crash tests: RoundManager + SQLite state + persistent
MQTT session, with an optional crash (os._exit, like a power cut / kill -9)
right after the Nth update of a round has been stored.

    python _gateway_proc.py BROKER_URL STATE FLEET KEY KEYRING MODEL ROUNDS [CRASH_ROUND CRASH_AFTER]
"""

from __future__ import annotations

import logging
import os
import sys

import onnx

from edgeflow.federated.messages import TrainConfig
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey
from edgeflow.transport import MqttTransport


def main() -> None:
    url, state, fleet, key, keyring, model, rounds = sys.argv[1:8]
    crash_round, crash_after = (int(sys.argv[8]), int(sys.argv[9])) if len(sys.argv) > 9 else (-1, -1)
    logging.basicConfig(level=logging.INFO, format="gw %(message)s")
    store = GatewayStore(state)
    if crash_after > 0:
        real_add = store.add_update
        stored = {"n": 0}

        def add_then_maybe_crash(round_id, *a, **kw):
            ok = real_add(round_id, *a, **kw)
            if ok and round_id == crash_round:
                stored["n"] += 1
                if stored["n"] >= crash_after:
                    os._exit(137)  # no flush, no DISCONNECT, no PUBACK for this message
            return ok

        store.add_update = add_then_maybe_crash
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
