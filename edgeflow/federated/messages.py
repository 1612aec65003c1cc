"""Control messages of a federated round, and signed JSON to carry them.

The gateway announces each round on the retained ``gateway/round`` topic;
the devices trust it only if the fleet key signed it, so a misconfigured
broker cannot let anyone start rounds or steer clients. Signed JSON keeps
the *exact* body bytes (a JSON string inside the wrapper): the signature
covers bytes, not a re-serialisation, so another implementation (C
firmware) verifies without canonical-JSON rules::

    {"v": 1, "ctx": "round/v1", "body": "<json text>", "key_id": "<hex>", "sig": "<hex>"}

``sig`` = Ed25519 over ``signing_message(ctx, SHA-256(body bytes))``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import CodecError, SignatureError
from ..signing import PrivateKey, PublicKey, signing_message

ROUND_CONTEXT = "round/v1"
MAX_CONTROL_BYTES = 1 << 20


def sign_json(body: dict[str, Any], key: PrivateKey, context: str) -> bytes:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    sig = key.sign(signing_message(context, digest))
    wrapper = {"v": 1, "ctx": context, "body": text, "key_id": key.public_key.key_id.hex(), "sig": sig.hex()}
    return json.dumps(wrapper, separators=(",", ":")).encode("utf-8")


def open_json(data: bytes, key: PublicKey, context: str) -> dict[str, Any]:
    """Verify and parse a signed JSON message; SignatureError/CodecError say why not."""
    if len(data) > MAX_CONTROL_BYTES:
        raise CodecError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        wrapper = json.loads(data)
        text, sig, ctx = wrapper["body"], bytes.fromhex(wrapper["sig"]), wrapper["ctx"]
        if wrapper.get("v") != 1 or not isinstance(text, str):
            raise ValueError("unknown version or body type")
    except (ValueError, KeyError, TypeError) as exc:
        raise CodecError(f"not a signed edgeflow control message ({exc})") from exc
    if ctx != context:
        raise SignatureError(f"message signed for {ctx!r}, expected {context!r}")
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    key.verify(signing_message(context, digest), sig)
    try:
        body = json.loads(text)
    except ValueError as exc:  # pragma: no cover - signed bytes were JSON when signed
        raise CodecError(f"signed body is not JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise CodecError("signed body is not a JSON object")
    return body


@dataclass(frozen=True)
class TrainConfig:
    """What a selected device does in a round (the gateway decides it)."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    proximal_mu: float = 0.0
    clip_norm: float | None = None
    codec: str = "int8"
    codec_opts: dict[str, Any] = field(default_factory=dict)
    max_samples: int | None = None
    secagg: bool = False  # masked updates via secure aggregation (codec is then unused)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class RoundAnnouncement:
    """One round, as the devices see it on ``gateway/round`` (retained).

    ``mode`` "sync": the ``selected`` devices train once from
    ``model_version`` and report before ``deadline``. ``mode`` "async"
    (FedBuff): every participating device trains from the newest version it
    has and reports whenever it is done, again and again; ``round_id`` then
    names the asynchronous session. ``state`` "closed" tells stragglers to
    stop.
    """

    round_id: int
    model_version: int
    deadline: float
    selected: tuple[str, ...]
    config: TrainConfig
    state: str = "open"
    mode: str = "sync"
    issued: float = 0.0

    def to_body(self) -> dict[str, Any]:
        d = asdict(self)
        d["selected"] = list(self.selected)
        return d

    @classmethod
    def from_body(cls, d: dict[str, Any]) -> "RoundAnnouncement":
        try:
            return cls(
                round_id=int(d["round_id"]),
                model_version=int(d["model_version"]),
                deadline=float(d["deadline"]),
                selected=tuple(str(s) for s in d.get("selected", ())),
                config=TrainConfig.from_dict(dict(d.get("config", {}))),
                state=str(d.get("state", "open")),
                mode=str(d.get("mode", "sync")),
                issued=float(d.get("issued", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecError(f"malformed round announcement ({exc})") from exc

    def sign(self, key: PrivateKey) -> bytes:
        return sign_json(self.to_body(), key, ROUND_CONTEXT)

    @classmethod
    def verify(cls, data: bytes, key: PublicKey) -> "RoundAnnouncement":
        return cls.from_body(open_json(data, key, ROUND_CONTEXT))
