"""One gateway process: a transport, a store, the fleet registry and the rounds.

:class:`Gateway` composes the independent parts — :class:`~edgeflow.gateway.fleet.FleetManager`
(births, liveness, telemetry, commands, OTA), :class:`~edgeflow.gateway.rounds.RoundManager`
(federated rounds) — over one MQTT connection with a persistent session and
one state store (a SQLite file, or PostgreSQL with ``[store] url``), and publishes the gateway's own status retained on
``gateway/state`` (with a last will saying it went offline).

Configuration comes from ``gateway.toml`` (see :func:`load_config` and
docs/gateway.md) and the operator's fleet directory (fleet key, device key
ring, the ``gateway`` broker credentials, the broker URL).

``[gateway] role`` places the gateway in a hierarchy (docs/scaling.md):
"flat" (default) aggregates its devices and publishes the model; "site"
aggregates its devices and forwards the partial sum to the root
(``[hierarchy]`` says how); "root" aggregates the sites' partials.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import onnx

from edgeflow.errors import ConfigError, EdgeflowError
from edgeflow.signing import KeyRing, PrivateKey, PublicKey, Signer
from edgeflow.transport.base import Transport
from edgeflow.transport.url import parse_broker_url

from .fleet import FleetManager, FleetOptions
from .hierarchy import HierarchyOptions, SiteGateway, Uplink, root_manager, site_manager
from .rounds import RoundConfig, RoundManager, RoundMetrics
from .store import GatewayStore, StoreTarget, parse_store_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("edgeflow.gateway")


@dataclass
class GatewayConfig:
    """``gateway.toml``: ``[gateway]`` paths and ids, ``[fleet]`` registry options,
    ``[rounds]`` (+ ``[rounds.train]``) the federated rounds, ``[hierarchy]`` a
    site's uplink or a root's sites (with ``[gateway] role``)."""

    fleet_dir: str | None = None
    fleet: str | None = None
    state: str = "gateway.sqlite"
    model: str | None = None
    initial_parameters: str | None = None  # .npz of the first global parameters, instead of model (docs/flower.md)
    eval: str | None = None
    metrics: str | None = "metrics.jsonl"
    client_id: str | None = None
    broker: str | None = None
    max_payload: int | None = None  # bytes per MQTT message before chunking (4000 for wss:// fleets, see docs)
    role: str = "flat"  # "flat" | "site" | "root" (docs/scaling.md)
    fleet_options: FleetOptions = field(default_factory=FleetOptions)
    rounds: RoundConfig = field(default_factory=RoundConfig)
    hierarchy: HierarchyOptions = field(default_factory=HierarchyOptions)
    store_url: str | None = None  # [store] url: sqlite:///PATH or postgresql://... (instead of [gateway] state)
    telemetry_keep: int = 500  # [store] telemetry_keep: rows of telemetry history kept per device
    http_listen: str | None = None  # [http] listen: HOST:PORT of the dashboard and /metrics (gateway/web)
    http_tls_cert: str | None = None  # [http] tls_cert, tls_key: serve the dashboard over HTTPS
    http_tls_key: str | None = None
    http_actions: bool = False  # [http] actions: the fleet's operators may log in and deploy/roll back/command
    base_dir: Path = field(default_factory=Path.cwd)

    def store_target(self) -> StoreTarget:
        """Where the state lives: ``[store] url`` if given, else ``[gateway] state`` (a file)."""
        if self.store_url is not None:
            return parse_store_url(self.store_url, base_dir=self.base_dir)
        return parse_store_url(str(self.path(self.state)))

    def path(self, p: str | None) -> Path | None:
        if p is None:
            return None
        q = Path(p).expanduser()
        return q if q.is_absolute() else self.base_dir / q


# ---------------------------------------------------------------------------------------------------------
# The schema of gateway.toml: every key of every section, its type and range. load_config checks the whole
# file against it before anything is built, and a problem is one ConfigError line naming the dotted key
# (``rounds.min_clients``) and what it must be. Cross-field rules (secagg with central DP, a site without
# site_id, ...) stay with the classes that own them and run after this.
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    kind: str  # "int" | "number" | "bool" | "str" | "choice" | "strategy" | "oneof" | "strlist" | "table" | "url"
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    optional: bool = False  # None allowed (a dict given to load_config; TOML has no null)
    choices: Callable[[], list[str]] | None = None
    schemes: tuple[str, ...] = ()
    values: tuple[Any, ...] = ()

    def expected(self) -> str:
        if self.kind in ("int", "number"):
            what = "an integer" if self.kind == "int" else "a number"
            if self.lo is not None and self.hi is not None:
                return (f"{what} in {'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(self.hi)}"
                        f"{')' if self.hi_open else ']'}")
            if self.lo is not None:
                return f"{what} {'>' if self.lo_open else '>='} {_fmt(self.lo)}"
            return what
        if self.kind == "bool":
            return "true or false"
        if self.kind == "str":
            return "a non-empty string"
        if self.kind == "choice":
            assert self.choices is not None
            return "one of " + ", ".join(repr(c) for c in self.choices())
        if self.kind == "strategy":
            assert self.choices is not None
            return ("one of " + ", ".join(repr(c) for c in self.choices()) + ", or your class as "
                    "\"module:Class\" / \"file.py:Class\" (docs/flower.md)")
        if self.kind == "strlist":
            return "a list of non-empty strings"
        if self.kind == "oneof":
            return "one of " + ", ".join(repr(x) for x in self.values)
        if self.kind == "url":
            return "a URL starting with " + " or ".join(f"{x}://" for x in self.schemes)
        return "a table, e.g. { key = value }"

    def ok(self, v: Any) -> bool:
        if v is None:
            return self.optional
        if self.kind in ("int", "number"):
            if isinstance(v, bool) or not isinstance(v, int if self.kind == "int" else (int, float)):
                return False
            if self.kind == "number" and not math.isfinite(v):
                return False
            if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
                return False
            return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        if self.kind == "bool":
            return isinstance(v, bool)
        if self.kind == "str":
            return isinstance(v, str) and bool(v.strip()) and v.isprintable()
        if self.kind == "choice":
            assert self.choices is not None
            return isinstance(v, str) and v in self.choices()
        if self.kind == "strategy":  # a registered name, or a user's class "module:Class" (loaded at the semantic check)
            assert self.choices is not None
            return isinstance(v, str) and (v in self.choices() or (":" in v and v.isprintable()))
        if self.kind == "strlist":
            return isinstance(v, list) and all(isinstance(x, str) and x.strip() for x in v)
        if self.kind == "oneof":
            return not isinstance(v, bool) and any(type(v) is type(x) and v == x for x in self.values)
        if self.kind == "url":
            return isinstance(v, str) and v.isprintable() and any(v.startswith(f"{x}://") and len(v) > len(x) + 3
                                                                   for x in self.schemes)
        return isinstance(v, dict)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _int(lo: float | None = None, hi: float | None = None, *, optional: bool = False) -> _Rule:
    return _Rule("int", lo, hi, optional=optional)


def _num(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
         optional: bool = False) -> _Rule:
    return _Rule("number", lo, hi, lo_open, hi_open, optional=optional)


def _pos(optional: bool = False) -> _Rule:
    return _num(0, lo_open=True, optional=optional)


_STR, _OPT_STR, _BOOL, _TABLE = _Rule("str"), _Rule("str", optional=True), _Rule("bool"), _Rule("table")
_MQTT = ("mqtt", "mqtts", "ws", "wss")


def _choice(fn: Callable[[], list[str]]) -> _Rule:
    return _Rule("choice", choices=fn)


def _roles() -> list[str]:
    from .hierarchy import ROLES

    return list(ROLES)


def _strategies() -> list[str]:
    from .strategies import strategy_names

    return strategy_names()


def _staleness() -> list[str]:
    from .buffered import available_staleness

    return available_staleness()


def _codecs() -> list[str]:
    from edgeflow.codecs import available_codecs

    return list(available_codecs())


def _downlinks() -> list[str]:
    return ["full"] + [f"delta-{c}" for c in _codecs() if c != "auto"]


def _optimizers() -> list[str]:
    from edgeflow.train.optim import OPTIMIZERS

    return list(OPTIMIZERS)


def _min_payload() -> int:
    from edgeflow.transport.chunking import HEADER_SIZE

    return HEADER_SIZE + 1024


SCHEMA: dict[str, dict[str, _Rule]] = {
    "gateway": {
        "fleet_dir": _OPT_STR, "fleet": _OPT_STR, "state": _STR, "model": _OPT_STR, "initial_parameters": _OPT_STR,
        "eval": _OPT_STR,
        "metrics": _OPT_STR, "client_id": _OPT_STR, "broker": _Rule("url", optional=True, schemes=_MQTT),
        "max_payload": _int(_min_payload(), 268_435_455, optional=True), "role": _choice(_roles),
    },
    "fleet": {
        "heartbeat_factor": _pos(), "heartbeat_min_s": _num(0), "heartbeat_timeout_s": _pos(optional=True),
        "liveness_check_s": _pos(), "command_timeout_s": _pos(), "command_ttl_s": _pos(),
        "record_registry": _BOOL, "record_telemetry": _BOOL, "telemetry_queue": _int(1),
        "max_telemetry_bytes": _int(64), "telemetry_rate_hz": _num(0), "keyring_reload_s": _num(0),
        "lag_window": _int(1)
    },
    "rounds": {
        "rounds": _int(0), "mode": _choice(lambda: ["sync", "async"]), "fraction": _num(0, 1, lo_open=True),
        "min_clients": _int(1), "max_clients": _int(1, optional=True), "overselect": _num(1),
        "quorum": _num(0, 1, lo_open=True), "deadline_s": _pos(), "max_extensions": _int(0),
        "strategy": _Rule("strategy", choices=_strategies), "strategy_params": _TABLE, "profiles": _Rule("strlist", optional=True),
        "min_battery": _num(0, 1, optional=True), "wait_for_devices_s": _num(0), "train": _TABLE,
        "dp": _Rule("table", optional=True), "secagg": _Rule("table", optional=True), "async_buffer": _int(1),
        "staleness": _choice(_staleness), "max_staleness": _int(0, optional=True), "async_server_lr": _pos(), "seed": _int(0),
        "publish_timeout_s": _pos(), "fraction_evaluate": _num(0, 1), "min_evaluate_clients": _int(1),
        "evaluate_deadline_s": _pos(optional=True), "downlink": _choice(_downlinks),
    },
    "rounds.train": {
        "epochs": _int(1), "batch_size": _int(1), "lr": _pos(), "optimizer": _choice(_optimizers),
        "momentum": _num(0), "weight_decay": _num(0), "proximal_mu": _num(0), "clip_norm": _pos(optional=True),
        "codec": _choice(_codecs), "codec_opts": _TABLE, "max_samples": _int(1, optional=True), "secagg": _BOOL,
    },
    "rounds.dp": {
        "clip_norm": _pos(), "noise_multiplier": _num(0), "sampling_rate": _num(0, 1, lo_open=True),
        "delta": _num(0, 1, lo_open=True, hi_open=True), "expected_clients": _int(1, optional=True),
        "seed": _int(0, optional=True),
    },
    "rounds.secagg": {
        "max_dropout_fraction": _num(0, 0.5, hi_open=True), "clip": _pos(), "phase_timeout_s": _pos(),
        "ring_bits": _Rule("oneof", values=(32, 64)), "frac_bits": _int(0, 62),
        "weight_cap": _pos(), "norm_bound": _pos(),
    },
    "hierarchy": {
        "site_id": _OPT_STR, "uplink": _STR, "site_key": _OPT_STR, "root_key": _OPT_STR,
        "forward_margin_s": _num(0), "sites": _Rule("strlist"),
    },
    "store": {"url": _STR, "telemetry_keep": _int(1, 1_000_000)},
    "http": {"listen": _STR, "tls_cert": _STR, "tls_key": _STR, "actions": _BOOL},
}
"""Every key of gateway.toml (``rounds.train`` is the ``[rounds.train]`` table, ``rounds.dp`` the ``[rounds] dp``
table, ...); tests/test_gateway_config_schema.py checks it against the dataclasses' fields."""
_NESTED = {"rounds": ("train", "dp", "secagg")}
_REQUIRED = {"rounds.dp": ("clip_norm", "noise_multiplier")}


def _shown(v: Any, typed: bool = True) -> str:
    """A value as the error shows it: short, one line, with its TOML type when that is the problem."""
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    if not typed:
        return text
    kind = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(type(v))
    return f"{text} ({kind})" if kind else text


def _check_table(data: Any, name: str, problems: list[str]) -> None:
    rules = SCHEMA[name]
    if not isinstance(data, dict):
        problems.append(f"{name} must be a table ([{name}] with key = value lines), got {_shown(data)}")
        return
    unknown = sorted(set(data) - set(rules))
    if unknown:
        noun = "setting" if name.startswith("rounds") else "key"  # the words RoundConfig and [store] always used
        problems.append(f"[{name}] unknown {noun}(s) {unknown} ({', '.join(f'{name}.{k}' for k in unknown)}); "
                        f"the keys of [{name}] are {', '.join(sorted(rules))}")
    for k in _REQUIRED.get(name, ()):
        if k not in data:
            problems.append(f"{name}.{k} is required")
    for k, v in data.items():
        rule = rules.get(k)
        if rule is None:
            continue
        if not rule.ok(v):
            if rule.kind == "choice" and isinstance(v, str):
                assert rule.choices is not None
                problems.append(f"{name}.{k} must be one of {', '.join(rule.choices())} "
                                f"({k} {_shown(v, typed=False)} is unknown)")
            elif rule.kind == "strategy" and isinstance(v, str):
                assert rule.choices is not None
                problems.append(f"{name}.{k} must be one of {', '.join(rule.choices())}, or your class as "
                                f"\"module:Class\" / \"file.py:Class\" ({k} {_shown(v, typed=False)} is unknown; "
                                "docs/flower.md)")
            else:
                problems.append(f"{name}.{k} must be {rule.expected()}, got {_shown(v)}")
        elif k in _NESTED.get(name, ()) and v is not None:
            _check_table(v, f"{name}.{k}", problems)


def _check_semantics(data: dict[str, Any], base: Path, problems: list[str]) -> None:
    """What a type and range cannot say: ids, the strategy with its parameters, the codec's options, the
    central DP settings, URLs; and key pairs (max_clients >= min_clients)."""
    gw, rounds, hi, st, web = (data.get(k, {}) for k in ("gateway", "rounds", "hierarchy", "store", "http"))
    _check_places(gw, hi, st, base, problems)
    _check_http(web, problems)
    _check_rounds(rounds, problems)


def _attempt(problems: list[str], key: str, fn: Callable[[], Any]) -> None:
    """Run one check; a refusal becomes the line ``key: why``."""
    try:
        fn()
    except ConfigError as exc:
        problems.append(f"{key}: {exc}")
    except (TypeError, ValueError) as exc:  # a constructor refusing a value the schema let through
        problems.append(f"{key}: {exc}")
    except EdgeflowError as exc:  # CodecError and the like from a dry run
        problems.append(f"{key}: {exc}")


def _check_places(gw: dict[str, Any], hi: dict[str, Any], st: dict[str, Any], base: Path,
                  problems: list[str]) -> None:
    """The fleet, client and site ids, the uplink's URL and the store's URL."""
    from edgeflow.transport.topics import validate_id

    if "fleet" in gw:
        _attempt(problems, "gateway.fleet", lambda: validate_id(gw["fleet"], "fleet id"))
    if "client_id" in gw and len(gw["client_id"]) > 256:
        problems.append("gateway.client_id must be at most 256 characters")
    if "site_id" in hi and hi["site_id"] is not None:
        _attempt(problems, "hierarchy.site_id", lambda: validate_id(hi["site_id"], "site id"))
    for s in hi.get("sites", []):
        _attempt(problems, "hierarchy.sites", lambda s=s: validate_id(s, "site id"))
    if "uplink" in hi and hi["uplink"] != "bridge" and not _Rule("url", schemes=_MQTT).ok(hi["uplink"]):
        problems.append(f"hierarchy.uplink must be \"bridge\" or the central broker's URL (mqtts://HOST:PORT), "
                        f"got {_shown(hi['uplink'])}")
    if "url" in st:
        _attempt(problems, "store.url", lambda: parse_store_url(st["url"], base_dir=base))


def _check_http(web: dict[str, Any], problems: list[str]) -> None:
    """The dashboard's listen address, and TLS where it acts."""
    if "listen" in web:
        from .web.server import parse_listen

        try:
            parse_listen(web["listen"], "http.listen")
        except ConfigError as exc:
            problems.append(str(exc))
    if ("tls_cert" in web) != ("tls_key" in web):
        problems.append("http.tls_cert and http.tls_key go together: a PEM certificate and its private key")
    if web.get("actions") and "tls_cert" not in web:
        problems.append("http.actions = true needs http.tls_cert and http.tls_key: the dashboard acts only over HTTPS")


def _check_rounds(rounds: dict[str, Any], problems: list[str]) -> None:
    """min/max clients, the codec's options, and the strategy with its parameters and DP, built as a dry run."""
    lo, hi_n = rounds.get("min_clients", 2), rounds.get("max_clients")
    if hi_n is not None and hi_n < lo:
        problems.append(f"rounds.max_clients ({hi_n}) must be >= rounds.min_clients ({lo}): no round could start")
    train = rounds.get("train", {})
    if "codec_opts" in train:
        from edgeflow.codecs.registry import get_codec

        _attempt(problems, "rounds.train.codec_opts",
                 lambda: get_codec(train.get("codec", "int8")).check_options(dict(train["codec_opts"])))
    strategy_ok = True
    if ":" in rounds.get("strategy", ""):  # a user's class: its own line naming rounds.strategy
        from .custom_strategy import load_strategy

        try:
            load_strategy(rounds["strategy"])
        except ConfigError as exc:
            problems.append(str(exc))
            strategy_ok = False
    if strategy_ok and ("strategy" in rounds or "strategy_params" in rounds or rounds.get("dp")):
        _attempt(problems, "rounds.strategy_params" if "strategy_params" in rounds else
                 "rounds.dp" if rounds.get("dp") else "rounds.strategy", lambda: _build_strategy(rounds))


def _build_strategy(rounds: dict[str, Any]) -> None:
    """The configured strategy as the gateway would make it (a dry run: its refusals are the config's)."""
    from .strategies import make_aggregator, resolve_strategy

    params = dict(rounds.get("strategy_params", {}))
    chosen = resolve_strategy(rounds.get("strategy", "fedavg"), params, mode=rounds.get("mode", "sync"),
                              dp=bool(rounds.get("dp")), secagg=rounds.get("secagg") is not None).name
    if rounds.get("dp"):
        from .privacy import CentralDP

        params["privacy"] = CentralDP(**rounds["dp"])
    make_aggregator(chosen, **params)


def check_config(data: Mapping[str, Any], where: str = "<config>", base: Path | None = None) -> None:
    """Check a parsed gateway.toml against :data:`SCHEMA`: ConfigError, one line naming every bad key
    (dotted, e.g. ``rounds.min_clients``) and what it must be."""
    problems: list[str] = []
    sections = ("gateway", "fleet", "rounds", "hierarchy", "store", "http")
    for sec in sorted(set(data) - set(sections)):
        problems.append(f"unknown section [{sec}]; the sections are {', '.join(f'[{x}]' for x in sections)}")
    for sec in sections:
        if sec in data:
            _check_table(data[sec], sec, problems)
    if not problems:
        _check_semantics(dict(data), base or Path.cwd(), problems)
    if problems:
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise ConfigError(f"{where}: " + "; ".join(problems[:8]) + (more if len(problems) > 8 else "")
                          + "; fix gateway.toml (docs/gateway.md, section gateway.toml)")


def _store_section(st: dict[str, Any], gw: dict[str, Any], where: str, base: Path) -> dict[str, Any]:
    """``[store]`` (already checked by :func:`check_config`): the GatewayConfig fields it sets."""
    out: dict[str, Any] = {}
    if "url" in st:
        if "state" in gw:
            raise ConfigError(f"{where}: [gateway] state and [store] url both name the gateway's state; keep one "
                              "([store] url = \"sqlite:///gateway.sqlite\" is the same as state = \"gateway.sqlite\")")
        out["store_url"] = st["url"]
    if "telemetry_keep" in st:
        out["telemetry_keep"] = st["telemetry_keep"]
    return out


def _strategy_file_from(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """``[rounds] strategy = "file.py:Class"``: a relative file is found next to gateway.toml, as every path."""
    rounds = data.get("rounds")
    ref = rounds.get("strategy") if isinstance(rounds, dict) else None
    if not isinstance(ref, str) or ":" not in ref:
        return data
    target, _, attr = ref.rpartition(":")
    if not target.endswith(".py") or Path(target).expanduser().is_absolute():
        return data
    return {**data, "rounds": {**rounds, "strategy": f"{base / target}:{attr}"}}


def load_config(source: str | Path | Mapping[str, Any]) -> GatewayConfig:
    """Parse and validate ``gateway.toml`` (or an equivalent dict): every key against :data:`SCHEMA`
    (types, ranges, choices, unknown keys) before anything is built; errors name the dotted key."""
    if isinstance(source, Mapping):
        data, base, where = dict(source), Path.cwd(), "<config>"
    else:
        p = Path(source)
        if not p.is_file():
            raise ConfigError(f"gateway config not found: {p}")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
        base, where = p.resolve().parent, str(p)
    data = _strategy_file_from(data, base)
    check_config(data, where, base)
    gw = dict(data.get("gateway", {}))
    fo = dict(data.get("fleet", {}))
    try:
        rounds = RoundConfig.from_dict(dict(data.get("rounds", {})))
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{where}: [rounds]: {exc}") from exc
    hierarchy = HierarchyOptions(**dict(data.get("hierarchy", {})))
    try:
        hierarchy.check(gw.get("role", "flat"))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    store = _store_section(dict(data.get("store", {})), gw, where, base)
    web = dict(data.get("http", {}))
    return GatewayConfig(**gw, fleet_options=FleetOptions(**fo), rounds=rounds, hierarchy=hierarchy, base_dir=base,
                         http_listen=web.get("listen"), http_tls_cert=web.get("tls_cert"),
                         http_tls_key=web.get("tls_key"), http_actions=bool(web.get("actions", False)), **store)


def load_eval(path: Path | None) -> tuple[np.ndarray, np.ndarray] | None:
    if path is None:
        return None
    from edgeflow.data import load_npz

    ds = load_npz(path)
    return ds.x, ds.y


def _initial_model(config: GatewayConfig) -> onnx.ModelProto | None:
    """The first global model: ``[gateway] model`` (ONNX: OTA and on-device inference too) or
    ``[gateway] initial_parameters`` (an .npz of arrays, for Flower-style apps that bring their own model);
    None for a flat gateway with neither: its rounds ask one device for its parameters first, as Flower does."""
    mp, pp = config.path(config.model), config.path(config.initial_parameters)
    if mp is not None and pp is not None:
        raise ConfigError("[gateway] model and initial_parameters both give the first global model; keep one "
                          "(model: an ONNX file; initial_parameters: an .npz for Flower-style apps, docs/flower.md)")
    if pp is not None:
        from .global_model import load_initial_parameters, parameters_model

        what = "[gateway] initial_parameters"
        return parameters_model(load_initial_parameters(pp, what=what), source=f"{what} {pp}")
    if mp is None and config.role == "flat":
        return None  # the rounds ask one device for its parameters first (gateway/first_parameters.py)
    if mp is None:
        raise ConfigError(f"[gateway] model: a {config.role} gateway needs its initial global model on first start (an "
                          "ONNX model, or [gateway] initial_parameters = FILE.npz for Flower-style apps, docs/flower.md)")
    from edgeflow.runtime.model import load_model

    return load_model(mp)


class Gateway:
    """The gateway service. ``start()``, then ``run_rounds()`` and/or ``serve()``; ``stop()``."""

    def __init__(
        self,
        transport: Transport,
        store: GatewayStore,
        *,
        fleet: str,
        fleet_key: PrivateKey,
        keyring: KeyRing,
        model: onnx.ModelProto | None,
        rounds: RoundConfig,
        fleet_options: FleetOptions | None = None,
        eval_data: tuple[np.ndarray, np.ndarray] | None = None,
        metrics_path: Path | None = None,
        on_round: Callable[[RoundMetrics], None] | None = None,
        role: str = "flat",
        hierarchy: HierarchyOptions | None = None,
        site_signer: Signer | None = None,
        root_key: PublicKey | None = None,
        uplink_transport: Transport | None = None,
        keyring_loader: Callable[[], KeyRing] | None = None,
    ) -> None:
        """``keyring_loader`` (``FleetDir.keyring`` from :meth:`from_config`) re-reads the provisioned keys
        while the gateway runs: new devices are picked up, revoked ones refused. ``role`` "site" needs ``site_signer`` and ``root_key`` (and ``uplink_transport`` for a
        direct uplink; None = through the site broker's bridge); "root" takes its sites
        from ``hierarchy.sites`` and their keys from ``keyring``."""
        hierarchy = hierarchy or HierarchyOptions()
        hierarchy.check(role)
        self.transport = transport
        self.store = store
        self.fleet_id = fleet
        self.metrics_path = metrics_path
        self.role = role
        self.uplink_transport = uplink_transport
        self._on_round_cb = on_round
        self.fleet = FleetManager(transport, store, fleet, fleet_key, fleet_options, keyring=keyring,
                                  keyring_loader=keyring_loader)
        if getattr(transport, "accept_transfer", False) is None:
            # chunked transfers only from provisioned ids (per-sender budgets bound the rest)
            transport.accept_transfer = self.fleet.accepts_transfer  # type: ignore[attr-defined]
        common: dict[str, Any] = dict(fleet=fleet, fleet_key=fleet_key, model=model, config=rounds,
                                      eval_data=eval_data, on_round=self._on_round)
        self.site: SiteGateway | None = None
        if role == "site":
            if site_signer is None or root_key is None:
                raise ConfigError("a site gateway needs site_signer (signs partials) and root_key (verifies the root)")
            uplink = Uplink(uplink_transport or transport, fleet, bridged=uplink_transport is None)
            self.rounds = site_manager(transport, store, keyring=self.fleet.keyring,
                                       candidates=self.fleet.round_candidates, uplink=uplink, signer=site_signer,
                                       **common)
            self.site = SiteGateway(self.rounds, uplink, site_id=site_signer.device_id, root_key=root_key,
                                    forward_margin_s=hierarchy.forward_margin_s)
        elif role == "root":
            self.rounds = root_manager(transport, store, site_keys=self.fleet.keyring, sites=list(hierarchy.sites),
                                       **common)
        else:
            self.rounds = RoundManager(transport, store, keyring=self.fleet.keyring,
                                       candidates=self.fleet.round_candidates, **common)
        self._stop = threading.Event()
        self._started = False

    # -- construction from files -----------------------------------------------
    @classmethod
    def from_config(cls, config: GatewayConfig, *, broker: str | None = None, fleet_dir: str | None = None,
                    on_round: Callable[[RoundMetrics], None] | None = None) -> "Gateway":
        from edgeflow.broker.mosquitto import FleetDir
        from edgeflow.transport.factory import transport_from_url
        from edgeflow.transport.message import TlsConfig, Will
        from edgeflow.transport.topics import gateway_topic

        fd_path = fleet_dir or (str(config.path(config.fleet_dir)) if config.fleet_dir else None)
        if fd_path is None:
            raise ConfigError("no fleet directory: pass --dir or set [gateway] fleet_dir "
                              "(create one with `edgeflow broker-config --dir DIR --fleet NAME`)")
        fd = FleetDir(fd_path)
        fleet = config.fleet or fd.fleet
        if fleet != fd.fleet:
            raise ConfigError(f"[gateway] fleet {fleet!r} differs from the fleet directory's {fd.fleet!r}")
        url = broker or config.broker or fd.broker_url
        if not url:
            raise ConfigError("no broker URL: pass --broker, set [gateway] broker, or store one in the fleet directory")
        creds = fd.operator("gateway")
        ca = fd.ca_file()
        kwargs: dict[str, Any] = {}
        if parse_broker_url(url).tls and ca is not None:  # mqtts://, wss://, NATS tls://
            kwargs["tls"] = TlsConfig(ca_file=str(ca))
        if config.max_payload:
            kwargs["max_payload"] = int(config.max_payload)
        transport = transport_from_url(
            url, client_id=config.client_id or f"{fleet}-gateway", username=creds["username"],
            password=creds["password"], clean_start=False, session_expiry_s=24 * 3600,
            will=Will(str(gateway_topic(fleet, "state")), json.dumps({"online": False}), qos=1, retain=True),
            **kwargs,
        )
        # The user's files are checked before the state is opened: a bad eval file or model creates no state.
        eval_data = load_eval(config.path(config.eval))
        target = config.store_target()
        initial = None
        if target.engine == "sqlite" and (target.path == ":memory:" or not Path(target.path).exists()):
            initial = _initial_model(config)  # a first start
        store = GatewayStore(target, telemetry_keep=config.telemetry_keep)
        if store.latest_model() is None:
            model = initial if initial is not None else _initial_model(config)
            if model is None:
                log.warning("no [gateway] model nor initial_parameters: before round 1 the gateway asks a board "
                            "running `edgeflow device --app` for its parameters (docs/flower.md); an ONNX fleet needs "
                            "[gateway] model")
        else:
            model = onnx.load_model_from_string(store.latest_model()[1])
        site: dict[str, Any] = {}
        if config.role == "site":
            site = _site_material(config, fd, fleet, kwargs)
        return cls(
            transport, store, fleet=fleet, fleet_key=fd.fleet_key(), keyring=fd.keyring(), model=model,
            rounds=config.rounds, fleet_options=config.fleet_options,
            eval_data=eval_data, metrics_path=config.path(config.metrics),
            on_round=on_round, role=config.role, hierarchy=config.hierarchy, keyring_loader=fd.keyring, **site,
        )

    # -- lifecycle ---------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "Gateway":
        """Subscribe everything (before connecting: the persistent session's queue arrives at once)."""
        if not self._started:
            self.fleet.start()
            self.rounds.start()
            # retained junk on the device channels the rounds read is cleared too (same filters: no extra traffic)
            cfg = self.rounds.config
            self.fleet.watch_retained(["update"] + (["secagg"] if cfg.secagg is not None else [])
                                      + (["evaluate"] if getattr(cfg, "fraction_evaluate", 0) > 0 else []))
            if self.site is not None:
                self.site.start()
            self.transport.connect(timeout=timeout)
            if self.uplink_transport is not None:
                self.uplink_transport.connect(timeout=timeout)
            self._publish_state(True)
            self._started = True
        return self

    def _publish_state(self, online: bool) -> None:
        """Best effort: a broker that does not acknowledge the status within 10 s is logged,
        never fatal (the message stays queued; the rounds wait for their own publishes)."""
        from edgeflow.errors import TransportError
        from edgeflow.transport.topics import gateway_topic

        body = {"online": online, "fleet": self.fleet_id, "model_version": self.rounds.version,
                "strategy": getattr(self.rounds, "strategy_name", None),
                "devices_online": len(self.fleet.online_devices()) if online else 0, "ts": time.time()}
        try:
            self.transport.publish(str(gateway_topic(self.fleet_id, "state")), json.dumps(body), qos=1,
                                   retain=True).wait(10)
        except TransportError as exc:
            log.warning("gateway state not acknowledged by the broker (%s); going on", exc)

    def _on_round(self, m: RoundMetrics) -> None:
        if self.metrics_path is not None:
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(m.to_dict()) + "\n")
        self._publish_state(True)
        if self._on_round_cb:
            self._on_round_cb(m)

    def run_rounds(self, rounds: int | None = None) -> list[RoundMetrics]:
        """Flat and root: run ``rounds`` (default: the job's remaining). Site: take part in
        ``rounds`` root rounds (default: until :meth:`stop`)."""
        self.start()
        if self.site is not None:
            return self.site.run(rounds)
        return self.rounds.run(rounds)

    def serve(self) -> None:
        """Keep the registry and command channel running until :meth:`stop`."""
        self.start()
        while not self._stop.wait(1.0):
            pass

    def stop(self) -> None:
        self._stop.set()
        self.rounds.stop()
        if self.site is not None:
            self.site.stop()
        if self.uplink_transport is not None:
            self.uplink_transport.close()
        if self._started:
            try:
                self._publish_state(False)
            except Exception:  # pragma: no cover - shutting down anyway
                log.debug("publishing the final state at stop failed", exc_info=True)
            self.fleet.stop()
            self.transport.close()
            self._started = False
        self.store.close()

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _site_material(config: GatewayConfig, fd: Any, fleet: str, transport_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A site's signer, the root's key and (direct uplink) the connection to the central broker."""
    h = config.hierarchy
    assert h.site_id is not None
    key_path = config.path(h.site_key) if h.site_key else fd.device_dir(h.site_id) / "device.key"
    if not Path(key_path).exists():
        raise ConfigError(f"[hierarchy] site_key {key_path} not found: provision the site in the central fleet "
                          f"directory (`edgeflow fleet provision {h.site_id}`) or set site_key")
    root_key = PublicKey.load(config.path(h.root_key)) if h.root_key else fd.fleet_public_key()
    out: dict[str, Any] = {"site_signer": Signer.load(h.site_id, key_path), "root_key": root_key}
    if h.uplink != "bridge":
        from edgeflow.transport.factory import transport_from_url

        creds_path = fd.device_dir(h.site_id) / "device.json"
        creds = json.loads(creds_path.read_text(encoding="utf-8")) if creds_path.exists() else {}
        from edgeflow.transport.message import TlsConfig

        kw = {k: v for k, v in transport_kwargs.items() if k != "tls"}
        ca = fd.ca_file()
        if parse_broker_url(h.uplink).tls and ca is not None:
            kw["tls"] = TlsConfig(ca_file=str(ca))
        out["uplink_transport"] = transport_from_url(
            h.uplink, client_id=creds.get("username", h.site_id), username=creds.get("username"),
            password=creds.get("password"), clean_start=False, session_expiry_s=24 * 3600, **kw)
    return out
