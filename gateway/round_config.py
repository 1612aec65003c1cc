"""The round loop's configuration (``gateway.toml`` ``[rounds]``), checked before anything starts:
:class:`RoundConfig` and the selection :class:`Candidate`. Every setting is checked for type first,
then range, and a bad one is one ConfigError line naming it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from edgeflow.codecs import available_codecs
from edgeflow.errors import ConfigError
from edgeflow.protocol.rounds import TrainConfig

from .strategies import StrategyChoice, folds_partials, resolve_strategy

__all__ = ["Candidate", "RoundConfig"]


def _checked_train(d: Mapping[str, Any]) -> dict[str, Any]:
    """``[rounds.train]`` checked before devices get it: names, types, ranges, the codec."""
    known = set(TrainConfig.__dataclass_fields__)
    problems = []
    unknown = sorted(set(d) - known)
    if unknown:
        problems.append(f"unknown setting(s) {unknown}; known: {sorted(known)}")

    def num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for name, low in (("epochs", 1), ("batch_size", 1)):
        if name in d and not (isinstance(d[name], int) and not isinstance(d[name], bool) and d[name] >= low):
            problems.append(f"{name} must be an integer >= {low}, got {d[name]!r}")
    if "max_samples" in d and d["max_samples"] is not None and not (
            isinstance(d["max_samples"], int) and not isinstance(d["max_samples"], bool) and d["max_samples"] >= 1):
        problems.append(f"max_samples must be an integer >= 1, got {d['max_samples']!r}")
    if "lr" in d and not (num(d["lr"]) and d["lr"] > 0):
        problems.append(f"lr must be a number > 0, got {d['lr']!r}")
    for name in ("momentum", "weight_decay", "proximal_mu"):
        if name in d and not (num(d[name]) and d[name] >= 0):
            problems.append(f"{name} must be a number >= 0, got {d[name]!r}")
    if "clip_norm" in d and d["clip_norm"] is not None and not (num(d["clip_norm"]) and d["clip_norm"] > 0):
        problems.append(f"clip_norm must be a number > 0, got {d['clip_norm']!r}")
    if "codec" in d and d["codec"] not in available_codecs():
        problems.append(f"codec {d['codec']!r} is unknown; choose one of {', '.join(available_codecs())}")
    if "codec_opts" in d and not isinstance(d["codec_opts"], dict):
        problems.append(f"codec_opts must be a table, e.g. {{ ratio = 0.05 }}, got {d['codec_opts']!r}")
    if problems:
        raise ConfigError("[rounds.train]: " + "; ".join(problems))
    return dict(d)


@dataclass(frozen=True)
class Candidate:
    """A device that could be selected: what selection needs to know."""

    device_id: str
    profile: str = ""
    can_train: bool = True
    battery: float | None = None  # 0..1, None = mains powered / unknown
    why: str = ""
    """Why it cannot train (when ``can_train`` is false), as the device reported it."""
    note: str = ""
    """The device's latest training error, if any (e.g. a round it could not train)."""


@dataclass
class RoundConfig:
    """Every knob of the round loop (``gateway.toml`` ``[rounds]``)."""

    rounds: int = 10
    mode: str = "sync"  # "sync" | "async"
    fraction: float = 1.0
    min_clients: int = 2
    max_clients: int | None = None
    overselect: float = 1.0
    quorum: float = 0.6  # fraction of the selected that must report by the deadline
    deadline_s: float = 60.0
    max_extensions: int = 2
    strategy: str = "fedavg"
    """A registered name (``fedavg``, the default, is plain FedAvg), ``module:Class``, or ``auto``:
    krum-reputation (the backdoor defence, docs/security.md section 14) where the gateway sees each update,
    FedAvg where it sees only sums, runs FedBuff or central DP (:meth:`resolve_strategy`). ``auto`` is not the
    default: on a fleet sending top-k updates its momentum cost 6.9 points (``edgeflow demo``, section 14)."""
    strategy_params: dict[str, Any] = field(default_factory=dict)
    profiles: list[str] | None = None
    min_battery: float | None = None
    wait_for_devices_s: float = 30.0
    train: TrainConfig = field(default_factory=TrainConfig)
    dp: dict[str, Any] | None = None  # {clip_norm, noise_multiplier, delta}
    secagg: dict[str, Any] | None = None  # {max_dropout_fraction, clip, phase_timeout_s}
    async_buffer: int = 15  # issue 34: 10 -> 15 and async_server_lr 1.3 (benchmarks/fedbuff.py, docs/aggregation.md)
    staleness: str = "polynomial"
    max_staleness: int | None = 10
    async_server_lr: float = 1.3  # FedBuff's server learning rate eta_g: each buffer's step times this
    seed: int = 0
    publish_timeout_s: float = 30.0  # wait this long for the broker's ack before logging and waiting on
    fraction_evaluate: float = 0.0
    """Federated evaluate rounds (Flower's ``fraction_evaluate``): after each round that published a model, this
    share of the online devices evaluates it on their own data (0: none; the clients' evaluation beside their
    updates, ``fed_eval_*``, is independent of it)."""
    min_evaluate_clients: int = 2
    """An evaluate round needs at least this many devices (fewer online: skipped, and the round says so)."""
    evaluate_deadline_s: float | None = None
    """How long an evaluate round waits for the reports (default: ``deadline_s``)."""
    downlink: str = "full"
    """What devices receive of each new global model: ``full`` (the weights, retained), or ``delta-<codec>`` (e.g.
    ``delta-int8``): first a signed delta from the previous version, encoded with that codec, which devices holding
    that version apply; the gateway adopts the weights they reconstruct; the full model stays retained for the
    others (edgeflow/codecs/model_delta.py, docs/wire-format.md)."""

    def __post_init__(self) -> None:
        if isinstance(self.train, dict):
            self.train = TrainConfig.from_dict(_checked_train(self.train))
        self._check_types()
        problems = []
        if self.mode not in ("sync", "async"):
            problems.append(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if not 0 < self.fraction <= 1:
            problems.append(f"fraction must be in (0, 1], got {self.fraction}")
        if not 0 < self.quorum <= 1:
            problems.append(f"quorum must be in (0, 1], got {self.quorum}")
        if self.min_clients < 1:
            problems.append(f"min_clients must be >= 1, got {self.min_clients}")
        if self.overselect < 1:
            problems.append(f"overselect must be >= 1, got {self.overselect}")
        if self.deadline_s <= 0:
            problems.append(f"deadline_s must be > 0, got {self.deadline_s}")
        if not self.async_server_lr > 0:
            problems.append(f"async_server_lr must be > 0, got {self.async_server_lr}")
        if self.rounds < 0:
            problems.append(f"rounds must be >= 0, got {self.rounds}")
        if not self.publish_timeout_s > 0:
            problems.append(f"publish_timeout_s must be > 0, got {self.publish_timeout_s}")
        if not 0 <= self.fraction_evaluate <= 1:
            problems.append(f"fraction_evaluate must be in [0, 1], got {self.fraction_evaluate}")
        if self.min_evaluate_clients < 1:
            problems.append(f"min_evaluate_clients must be >= 1, got {self.min_evaluate_clients}")
        if self.evaluate_deadline_s is not None and not self.evaluate_deadline_s > 0:
            problems.append(f"evaluate_deadline_s must be > 0, got {self.evaluate_deadline_s}")
        if isinstance(self.downlink, str):
            from edgeflow.codecs.model_delta import delta_codec

            try:
                delta_codec(self.downlink)
            except ConfigError as exc:
                problems.append(str(exc))
        if self.fraction_evaluate > 0 and self.mode != "sync":
            problems.append("fraction_evaluate needs mode 'sync' (an asynchronous session has no round ends to "
                            "evaluate after)")
        if self.strategy.strip().lower().replace("_", "-") == "fedavg-krum":
            f = self.strategy_params.get("num_byzantine", 1)
            if isinstance(f, int) and not isinstance(f, bool) and f >= 0 and self.min_clients < 2 * f + 3:
                problems.append(f"strategy 'fedavg-krum' with num_byzantine {f} needs rounds of at least {2 * f + 3} "
                                f"updates: set min_clients >= {2 * f + 3} (it is {self.min_clients})")
        try:  # auto's strategy_params are checked here, before anything starts
            self.resolve_strategy()
        except ConfigError as exc:
            problems.append(str(exc))
        if self.secagg is not None:
            if self.dp:
                problems.append("secagg and central dp cannot be combined (dp clips each update in the clear)")
            if self.mode != "sync":
                problems.append("secagg needs mode 'sync'")
            if not folds_partials(self.strategy):
                problems.append(f"secagg reveals only the sum: strategy {self.strategy!r} needs each update")
            unknown = set(self.secagg) - {"max_dropout_fraction", "clip", "phase_timeout_s", "ring_bits", "frac_bits",
                                          "weight_cap", "norm_bound"}
            if unknown:
                problems.append(f"unknown secagg setting(s) {sorted(unknown)}")
            self.train = TrainConfig(**{**asdict(self.train), "secagg": True})
        if problems:
            raise ConfigError("round configuration: " + "; ".join(problems))

    def resolve_strategy(self, *, sums_only: str = "", stored: str | None = None) -> StrategyChoice:
        """The strategy this configuration runs (:func:`~edgeflow.gateway.strategies.resolve_strategy`: ``auto``
        becomes krum-reputation or FedAvg). ``sums_only``: why the gateway sees only sums besides secure
        aggregation (site partials, ingestion workers' partial sums); ``stored``: the class name of the stored
        strategy state (None: a fresh state). The RoundManager calls it once, at start."""
        return resolve_strategy(self.strategy, self.strategy_params, sums_only=sums_only,
                                secagg=self.secagg is not None, mode=self.mode, dp=bool(self.dp), stored=stored)

    _INTS = ("rounds", "min_clients", "max_extensions", "async_buffer", "seed", "min_evaluate_clients")
    _OPT_INTS = ("max_clients", "max_staleness")
    _NUMBERS = ("fraction", "overselect", "quorum", "deadline_s", "wait_for_devices_s", "publish_timeout_s",
                "fraction_evaluate", "async_server_lr")
    _OPT_NUMBERS = ("min_battery", "evaluate_deadline_s")
    _STRINGS = ("mode", "strategy", "staleness", "downlink")

    def _check_types(self) -> None:
        """Every setting of the right type before any range check (``rounds = "three"`` in TOML is one clear
        line, not "'<' not supported between instances of 'str' and 'int'")."""
        problems = []

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for name in self._INTS + self._OPT_INTS:
            v = getattr(self, name)
            if not (is_int(v) or (v is None and name in self._OPT_INTS)):
                problems.append(f"{name} must be an integer, got {v!r}")
        for name in self._NUMBERS + self._OPT_NUMBERS:
            v = getattr(self, name)
            if not (is_number(v) or (v is None and name in self._OPT_NUMBERS)):
                problems.append(f"{name} must be a number, got {v!r}")
        for name in self._STRINGS:
            if not isinstance(getattr(self, name), str):
                problems.append(f"{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.strategy_params, dict):
            problems.append(f"strategy_params must be a table, got {self.strategy_params!r}")
        if self.profiles is not None and not (isinstance(self.profiles, list)
                                              and all(isinstance(p, str) for p in self.profiles)):
            problems.append(f"profiles must be a list of profile names, got {self.profiles!r}")
        if problems:
            raise ConfigError("round configuration: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RoundConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"round configuration: unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(d))
