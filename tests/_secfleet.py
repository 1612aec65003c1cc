"""A small real fleet for the red-team regression tests: a RoundManager on a real Mosquitto,
honest :class:`edgeflow.federated.Client` devices, and one *compromised provisioned device*
("evil": its key is in the gateway's key ring) that publishes hand-built, validly signed
envelopes - what an attacker holding a device's key can send."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from _brokers import FAST, wait_until
from edgeflow import zoo
from edgeflow.codecs.envelope import SectionInput, build_envelope, dtype_code
from edgeflow.data.datasets import dirichlet_partition, load_digits
from edgeflow.federated import Client
from edgeflow.protocol.rounds import RoundAnnouncement, TrainConfig
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager, model_weights
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport import MqttTransport

CODEC_IDS = {"dense": 1, "int8": 3}


def envelope(signer: Signer, round_id: int, seq: int, sections: list[SectionInput], *,
             metadata: dict | None = None, metadata_json: bytes | None = None, codec: str = "dense") -> bytes:
    """A signed envelope with arbitrary (hostile) sections and metadata bytes."""
    meta = metadata_json if metadata_json is not None else (
        json.dumps(metadata, separators=(",", ":"), sort_keys=True).encode() if metadata else b"")
    return build_envelope(codec_id=CODEC_IDS[codec], round_id=round_id, seq=seq, device_id=signer.device_id,
                          metadata_json=meta, sections=sections, signer=signer)


def dense_sections(tensors: dict[str, np.ndarray]) -> list[SectionInput]:
    return [SectionInput(k, dtype_code(np.float32), tuple(v.shape), [np.ascontiguousarray(v, "<f4").tobytes()])
            for k, v in tensors.items()]


def int8_sections(shapes: dict[str, tuple[int, ...]], scale: float, q: int) -> list[SectionInput]:
    return [SectionInput(k, dtype_code(np.float32), s, [struct.pack("<f4x", scale), bytes([q & 0xFF]) * int(np.prod(s))])
            for k, s in shapes.items()]


class Fleet:
    """Gateway + ``honest`` devices + the compromised ``evil`` device on one broker."""

    def __init__(self, broker: Any, tmp: Path, *, honest: int = 2, fleet: str = "red", state: Path | None = None,
                 config: dict | None = None, attacker: bool = True, device_delay: dict[int, float] | None = None,
                 clients: list[Client] | None = None, keys: tuple | None = None) -> None:
        self.broker = broker
        self.tmp = tmp
        self.fleet = fleet
        self.model = zoo.digits_mlp(seed=1)
        if keys is None:
            self.fleet_key = PrivateKey.generate()
            self.ring = KeyRing()
            self.evil = Signer.generate("evil")
            self.ring.register("evil", self.evil.public_key)
        else:
            self.fleet_key, self.ring, self.evil = keys
        self.attacker = attacker
        self.clients: list[Client] = clients or []
        if not self.clients:
            split = load_digits(seed=0).flat()
            parts = dirichlet_partition(split.y_train, honest, alpha=1.0, seed=0)
            for i, idx in enumerate(parts):
                s = Signer.generate(f"d{i}")
                self.ring.register(s.device_id, s.public_key)
                t = MqttTransport.from_url(broker.url, client_id=f"{fleet}-d{i}", **FAST)
                c = Client(t, fleet=fleet, device_id=s.device_id, signer=s, fleet_key=self.fleet_key.public_key,
                           model=self.model, data=(split.x_train[idx][:150], split.y_train[idx][:150]), seed=i,
                           delay_s=(device_delay or {}).get(i, 0.0))
                self.clients.append(c)
        self.state = state or tmp / "gw.sqlite"
        self.store = GatewayStore(self.state)
        cfg = {"rounds": 1, "min_clients": 2, "deadline_s": 20, "max_extensions": 0, "strategy": "fedavg",
               "train": TrainConfig(epochs=1, batch_size=16, lr=0.1, codec="dense"), **(config or {})}
        self.gateway_transport = MqttTransport.from_url(broker.url, client_id=f"{fleet}-gateway", **FAST)
        self.rounds = RoundManager(self.gateway_transport, self.store, fleet=fleet, fleet_key=self.fleet_key,
                                   keyring=self.ring, model=self.model, config=RoundConfig(**cfg),
                                   candidates=self.candidates)
        self.evil_transport = MqttTransport.from_url(broker.url, client_id=f"{fleet}-evil", **FAST)
        self.announcements: list[RoundAnnouncement] = []
        self.on_announce: Callable[[RoundAnnouncement], None] | None = None
        self._cv = threading.Condition()
        self.seq = time.time_ns() // 1_000_000

    @property
    def keys(self) -> tuple:
        return self.fleet_key, self.ring, self.evil

    def candidates(self) -> list[Candidate]:
        ids = [c.device_id for c in self.clients] + (["evil"] if self.attacker else [])
        return [Candidate(d) for d in ids]

    def _on_round(self, msg: Any) -> None:
        if not msg.payload:
            return
        ann = RoundAnnouncement.verify(msg.payload, self.fleet_key.public_key)
        with self._cv:
            self.announcements.append(ann)
            self._cv.notify_all()
        if ann.state == "open" and self.on_announce is not None:
            self.on_announce(ann)

    def start(self, start_clients: bool = True) -> "Fleet":
        self.evil_transport.subscribe(f"edgeflow/{self.fleet}/gateway/round", self._on_round)
        self.evil_transport.connect(timeout=10)
        if start_clients:
            for c in self.clients:
                c.start()
                c.transport.connect(timeout=10)
        self.rounds.start()
        self.gateway_transport.connect(timeout=10)
        return self

    def open_round(self, timeout: float = 30) -> RoundAnnouncement:
        with self._cv:
            assert self._cv.wait_for(lambda: any(a.state == "open" for a in self.announcements), timeout)
            return [a for a in self.announcements if a.state == "open"][-1]

    def evil_send(self, payload: bytes) -> None:
        self.evil_transport.publish(f"edgeflow/{self.fleet}/evil/update", payload, qos=1).wait(10)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def valid_delta(self, scale: float = 1e-3) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(7)
        return {k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in self.rounds.weights.items()}

    def valid_update(self, ann: RoundAnnouncement, **meta: Any) -> bytes:
        md = {"num_samples": 50, "base_version": ann.model_version, "loss": 1.0,
              **({"round_nonce": ann.nonce} if ann.nonce else {}), **meta}
        return envelope(self.evil, ann.round_id, self.next_seq(), dense_sections(self.valid_delta()), metadata=md)

    def wait_counter(self, key: str, n: int = 1, timeout: float = 15) -> bool:
        return wait_until(lambda: self.rounds.counters_total.get(key, 0) >= n, timeout)

    def weights_finite(self) -> bool:
        return all(np.isfinite(v).all() for v in model_weights(self.rounds.current_model()).values())

    def close(self, *, clients: bool = True) -> None:
        self.rounds.stop()
        if clients:
            for c in self.clients:
                c.stop(timeout=2)
                c.transport.close(timeout=1, flush=False)
        self.evil_transport.close(timeout=1, flush=False)
        self.gateway_transport.close(timeout=1, flush=False)
        self.store.close()
