"""The messages of a federated round: the announcement, the training config, an update's metadata.

The gateway announces each round on the retained ``gateway/round`` topic;
the devices trust it only if the fleet key signed it, so a misconfigured
broker cannot let anyone start rounds or steer clients. Signed JSON keeps
the *exact* body bytes (a JSON string inside the wrapper): the signature
covers bytes, not a re-serialisation, so another implementation (C
firmware) verifies without canonical-JSON rules (:mod:`.signed_json`, context
``round/v1``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..codecs.untrusted import as_int, as_number
from ..errors import CodecError
from ..signing import PrivateKey, PublicKey
from .signed_json import open_signed, sign_body

__all__ = ["EVALUATE_CONTEXT", "EvaluationReport", "MAX_NUM_SAMPLES", "ROUND_CONTEXT", "RoundAnnouncement",
           "TrainConfig", "UpdateMeta", "parse_update_meta"]

ROUND_CONTEXT = "round/v1"
EVALUATE_CONTEXT = "evaluate/v1"
"""What a device's signature on its evaluation report is for (never valid as anything else)."""
MAX_NUM_SAMPLES = (1 << 31) - 1
"""Largest ``num_samples`` an update may claim (the gateway caps the weight far lower, see docs/aggregation.md)."""


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

    ``epoch`` and ``nonce`` make rounds and model versions survive a wiped
    or restored gateway state (docs/security.md, "State loss and restore"):
    ``epoch`` (milliseconds since the Unix epoch when the gateway process
    started; 0 = a gateway without epochs) orders gateway incarnations, so a
    device follows a new gateway's lower model versions and refuses a replayed
    announcement or model of an older incarnation; ``nonce`` (random hex
    chosen when the round was opened, kept when a restarted gateway resumes
    it) tells a new round from an earlier one with the same id, and devices
    echo it in their update so a captured update cannot count in another
    round that reuses its id. Both are left out of the body when unset.
    """

    round_id: int
    model_version: int
    deadline: float
    selected: tuple[str, ...]
    config: TrainConfig
    state: str = "open"
    mode: str = "sync"
    issued: float = 0.0
    epoch: int = 0
    nonce: str = ""

    def to_body(self) -> dict[str, Any]:
        d = asdict(self)
        d["selected"] = list(self.selected)
        if not self.epoch:
            del d["epoch"]
        if not self.nonce:
            del d["nonce"]
        return d

    @classmethod
    def from_body(cls, d: dict[str, Any]) -> "RoundAnnouncement":
        try:
            nonce = d.get("nonce", "")
            if not isinstance(nonce, str) or len(nonce) > 64:
                raise ValueError(f"nonce must be a string of at most 64 characters, got {str(nonce)[:40]!r}")
            return cls(
                round_id=as_int(d["round_id"], "round_id", lo=0, hi=(1 << 64) - 1),
                model_version=as_int(d["model_version"], "model_version", lo=0),
                deadline=as_number(d["deadline"], "deadline"),
                selected=tuple(str(s) for s in d.get("selected", ())),
                config=TrainConfig.from_dict(dict(d.get("config", {}))),
                state=str(d.get("state", "open")),
                mode=str(d.get("mode", "sync")),
                issued=as_number(d.get("issued", 0.0), "issued"),
                epoch=as_int(d.get("epoch", 0), "epoch", lo=0, hi=(1 << 63) - 1),
                nonce=nonce,
            )
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            raise CodecError(f"malformed round announcement ({exc})") from None

    def sign(self, key: PrivateKey) -> bytes:
        return sign_body(self.to_body(), key, ROUND_CONTEXT)

    @classmethod
    def verify(cls, data: bytes, key: PublicKey) -> "RoundAnnouncement":
        return cls.from_body(open_signed(data, key, ROUND_CONTEXT))


@dataclass(frozen=True)
class UpdateMeta:
    """The validated metadata of a device's update envelope (wire-format §10.3).

    Every field is checked before the gateway stores anything: a string loss,
    a negative or float sample count, an infinite number or a wrong type
    refuses the whole update (reason ``bad_metadata``) instead of crashing
    the fold after the envelope was stored. Unknown keys are ignored.
    """

    num_samples: int = 1
    base_version: int | None = None
    loss: float | None = None
    train_s: float | None = None
    nonce: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    """The client's fit metrics (name -> finite number, true/false or text), as a Flower ``fit`` returns them."""
    evaluation: tuple[float, int, dict[str, float]] | None = None
    """(loss, num_examples, metrics) of the client's evaluation of the model it trained from, if it sent one."""


MAX_METRICS = 64
"""At most this many metrics per update (fit or evaluate); names up to 64 characters."""


MAX_TEXT = 256
"""A text metric's longest value (characters); numbers, true/false and text are kept (Flower's ``Scalar``)."""


def _metrics(value: Any, field_name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CodecError(f"{field_name} must be an object of name -> number, true/false or text")
    if len(value) > MAX_METRICS:
        raise CodecError(f"{field_name} has {len(value)} entries, at most {MAX_METRICS}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not 0 < len(k) <= 64 or not k.isprintable():
            raise CodecError(f"{field_name} has a bad name {str(k)[:40]!r} (1-64 printable characters)")
        if isinstance(v, bool):
            out[k] = v
        elif isinstance(v, str):
            if len(v) > MAX_TEXT or not v.isprintable():
                raise CodecError(f"{field_name}[{k!r}] is text of {len(v)} characters; at most {MAX_TEXT} printable")
            out[k] = v
        else:
            out[k] = as_number(v, f"{field_name}[{k!r}]")
    return out


def parse_update_meta(metadata: Any, device: str = "") -> UpdateMeta:
    """Check an update's metadata; CodecError (reason "bad_metadata") names the field."""
    who = f"update from {device!r}" if device else "update"
    try:
        if not isinstance(metadata, dict):
            raise CodecError("metadata is not a JSON object")
        num_samples = as_int(metadata.get("num_samples", 1), "num_samples", lo=1, hi=MAX_NUM_SAMPLES)
        base = metadata.get("base_version")
        base_version = None if base is None else as_int(base, "base_version", lo=0, hi=(1 << 63) - 1)
        loss = metadata.get("loss")
        loss = None if loss is None else as_number(loss, "loss")
        train_s = metadata.get("train_s")
        train_s = None if train_s is None else as_number(train_s, "train_s", lo=0.0)
        nonce = metadata.get("round_nonce")
        if nonce is not None and (not isinstance(nonce, str) or not nonce or len(nonce) > 64):
            raise CodecError(f"round_nonce must be a non-empty string of at most 64 characters, "
                             f"got {str(nonce)[:40]!r}")
        metrics = _metrics(metadata.get("metrics", {}), "metrics")
        evaluation = None
        ev = metadata.get("eval")
        if ev is not None:
            if not isinstance(ev, dict):
                raise CodecError("eval must be an object {loss, num_examples, metrics}")
            evaluation = (as_number(ev.get("loss"), "eval.loss"),
                          as_int(ev.get("num_examples"), "eval.num_examples", lo=1, hi=MAX_NUM_SAMPLES),
                          _metrics(ev.get("metrics", {}), "eval.metrics"))
    except CodecError as exc:
        err = CodecError(f"{who} has bad metadata: {exc}; refused before anything was stored")
        err.reason = "bad_metadata"  # type: ignore[attr-defined]
        raise err from None
    return UpdateMeta(num_samples, base_version, loss, train_s, nonce, metrics, evaluation)


@dataclass(frozen=True)
class EvaluationReport:
    """A device's evaluation of a global model in a federated evaluate round (``mode`` "evaluate" of a
    :class:`RoundAnnouncement`), signed with the device's key and sent on its ``evaluate`` channel.

    ``round_id``, ``nonce`` and ``model_version`` name the evaluate round it answers (the gateway
    refuses any other); ``loss`` and ``metrics`` are the device's figures over its ``num_examples``
    local examples (Flower's ``EvaluateRes``)."""

    round_id: int
    nonce: str
    model_version: int
    loss: float
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)

    def sign(self, key: PrivateKey) -> bytes:
        return sign_body(asdict(self), key, EVALUATE_CONTEXT)

    @classmethod
    def from_body(cls, d: Any) -> "EvaluationReport":
        """Check every field; CodecError (reason "bad_metadata") names the one that is wrong."""
        try:
            if not isinstance(d, dict):
                raise CodecError("the body is not a JSON object")
            nonce = d.get("nonce")
            if not isinstance(nonce, str) or len(nonce) > 64:
                raise CodecError(f"nonce must be a string of at most 64 characters, got {str(nonce)[:40]!r}")
            return cls(round_id=as_int(d.get("round_id"), "round_id", lo=0, hi=(1 << 63) - 1), nonce=nonce,
                       model_version=as_int(d.get("model_version"), "model_version", lo=0, hi=(1 << 63) - 1),
                       loss=as_number(d.get("loss"), "loss"),
                       num_examples=as_int(d.get("num_examples"), "num_examples", lo=1, hi=MAX_NUM_SAMPLES),
                       metrics=_metrics(d.get("metrics", {}), "metrics"))
        except CodecError as exc:
            err = CodecError(f"evaluation report: {exc}")
            err.reason = "bad_metadata"  # type: ignore[attr-defined]
            raise err from None

    @classmethod
    def verify(cls, data: bytes, key: PublicKey) -> "EvaluationReport":
        return cls.from_body(open_signed(data, key, EVALUATE_CONTEXT))
