"""A whole federated fleet in one process, over a real MQTT broker.

Used by ``edgeflow demo``, ``edgeflow simulate`` and the integration tests:
a gateway :class:`~edgeflow.gateway.rounds.RoundManager` plus N device
:class:`~edgeflow.federated.Client` s, each with its own MQTT connection,
key pair, device profile and label-skewed shard of scikit-learn's digits.
Faults are injected the way they happen — devices that vanish mid-round
(their TCP connection is dropped), Byzantine devices that send scaled or
sign-flipped updates, stragglers — never by mocking the transport.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import Any, Callable

import numpy as np
import onnx

from ..data.datasets import Split, dirichlet_partition, load_digits
from ..errors import ConfigError, EdgeflowError
from ..federated.client import Client
from ..gateway.rounds import RoundConfig
from ..protocol.rounds import TrainConfig
from ..signing import KeyRing, PrivateKey, Signer
from ..transport.base import Transport

log = logging.getLogger("edgeflow.sim.simulation")

ATTACKS = ("scale", "flip", "noise")


ROUND_KNOBS = ("rounds", "mode", "fraction", "min_clients", "overselect", "quorum", "deadline_s", "max_extensions",
               "strategy", "strategy_params", "dp", "secagg", "async_buffer", "seed", "downlink")
"""The :class:`~edgeflow.gateway.rounds.RoundConfig` settings a simulation exposes (``seed`` also seeds its data)."""

TRAIN_KNOBS = ("epochs", "batch_size", "lr", "momentum", "proximal_mu", "codec", "codec_opts", "max_samples")
"""The :class:`~edgeflow.protocol.rounds.TrainConfig` settings a simulation exposes."""

SIM_DEFAULTS: dict[str, Any] = {"deadline_s": 30.0, "epochs": 2, "batch_size": 16, "lr": 0.1}
"""The only places a simulated fleet departs from a real gateway's defaults: all its devices share
one machine, so rounds finish well inside 30 s, and the digits models learn in a few rounds with
these training settings. Every other round and training default is RoundConfig's and TrainConfig's."""


def _knobs(cls: type, names: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    out = []
    for f in fields(cls):
        if f.name not in names:
            continue
        if f.name in SIM_DEFAULTS:
            default = field(default=SIM_DEFAULTS[f.name])
        elif f.default is not MISSING:
            default = field(default=f.default)
        else:
            default = field(default_factory=f.default_factory)  # type: ignore[arg-type]
        out.append((f.name, f.type, default))
    return out


_Knobs = make_dataclass("_Knobs", _knobs(RoundConfig, ROUND_KNOBS) + _knobs(TrainConfig, TRAIN_KNOBS))
_Knobs.__doc__ = "The round and training settings of a simulation: RoundConfig's and TrainConfig's, with SIM_DEFAULTS."


@dataclass
class SimConfig(_Knobs):
    """Every knob of a simulated fleet (``edgeflow simulate`` exposes them all): the round and
    training settings of :data:`ROUND_KNOBS` and :data:`TRAIN_KNOBS` (defaults from RoundConfig and
    TrainConfig, except :data:`SIM_DEFAULTS`), and the fleet's own below."""

    devices: int = 20
    model: str = "mlp"  # "mlp" | "cnn" | a real-model suite name (a pretrained model fine-tuned on digits)
    train_mode: str = "full"  # transfer learning: full | head | bias | last:N (edgeflow.train.transfer)
    input_size: int = 48  # real models: digits are resized to input_size x input_size x 3
    alpha: float = 0.3
    dropout: float = 0.0  # fraction of devices that vanish mid-round (once, in ``dropout_round``)
    dropout_round: int = 1
    skip_rate: float = 0.0  # per-round probability a selected device sends nothing (transient fault)
    byzantine: float = 0.0
    attack: str = "flip"
    attack_scale: float = 10.0
    stragglers: float = 0.0
    straggler_delay_s: float = 0.0
    profiles: tuple[str, ...] = ("x86-gateway",)
    secagg_dropouts: int = 0  # devices that drop after sharing keys, in every secure round
    fleet: str = ""
    app: str = ""  # FILE_OR_MODULE:client_fn - the devices run the user's Flower-style clients (docs/flower.md)
    initial_parameters: str = ""  # with app: an .npz of the first global parameters (default: one client's)
    run_config: dict[str, Any] = field(default_factory=dict)  # with app: context.run_config (Flower's)

    def __post_init__(self) -> None:
        if isinstance(self.profiles, str):
            self.profiles = (self.profiles,)
        problems = _type_problems(self)
        if problems:  # ranges cannot be checked on values of the wrong type
            raise ConfigError("simulation: " + "; ".join(problems))
        problems = _range_problems(self)
        if problems:
            raise ConfigError("simulation: " + "; ".join(problems))
        if not self.fleet:
            self.fleet = f"sim{secrets.token_hex(5)}"  # unique: two runs on one broker never share client ids

    def train_config(self) -> TrainConfig:
        knobs = {n: getattr(self, n) for n in TRAIN_KNOBS}
        return TrainConfig(**{**knobs, "codec_opts": dict(self.codec_opts)})

    def round_config(self, **extra: Any) -> RoundConfig:
        """The gateway's RoundConfig for this simulation (``extra``: settings a simulation does not expose)."""
        knobs = {n: getattr(self, n) for n in ROUND_KNOBS}
        return RoundConfig(**{**knobs, "strategy_params": dict(self.strategy_params)}, train=self.train_config(),
                           **extra)


def _type_problems(cfg: SimConfig) -> list[str]:
    """Each setting must have its default's type (a TOML ``rounds = "three"`` is named, not compared)."""
    out = []
    for f in cfg.__dataclass_fields__.values():
        if f.default is MISSING:
            continue
        v, d = getattr(cfg, f.name), f.default
        if isinstance(d, bool):
            ok = isinstance(v, bool)
        elif isinstance(d, int):
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif isinstance(d, float):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        elif isinstance(d, str):
            ok = isinstance(v, str)
        elif isinstance(d, tuple):
            ok = isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v)
        else:
            continue
        if not ok:
            want = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
                    tuple: "a list of strings"}[type(d)]
            out.append(f"{f.name} must be {want}, got {v!r}")
    return out


def _range_problems(cfg: SimConfig) -> list[str]:
    from ..codecs import available_codecs, get_codec
    from ..gateway.strategies import strategy_names
    from ..profiles import list_profiles

    out = []
    for name in ("devices", "rounds", "min_clients", "epochs", "batch_size", "async_buffer", "dropout_round"):
        if getattr(cfg, name) < 1:
            out.append(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_extensions < 0:
        out.append(f"max_extensions must be >= 0, got {cfg.max_extensions}")
    if cfg.devices < cfg.min_clients:
        out.append(f"devices ({cfg.devices}) is below min_clients ({cfg.min_clients}): no round could start; "
                   "add devices or lower --min-clients")
    for name in ("dropout", "byzantine", "stragglers", "skip_rate"):
        v = getattr(cfg, name)
        if not 0 <= v < 1:
            out.append(f"{name} must be in [0, 1), got {v}")
    for name in ("fraction", "quorum"):
        v = getattr(cfg, name)
        if not 0 < v <= 1:
            out.append(f"{name} must be in (0, 1], got {v}")
    for name in ("deadline_s", "lr"):
        if not getattr(cfg, name) > 0:
            out.append(f"{name} must be > 0, got {getattr(cfg, name)}")
    for name in ("momentum", "proximal_mu", "straggler_delay_s", "attack_scale"):
        if getattr(cfg, name) < 0:
            out.append(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.overselect < 1:
        out.append(f"overselect must be >= 1, got {cfg.overselect}")
    if cfg.attack not in ATTACKS:
        out.append(f"attack must be one of {', '.join(ATTACKS)}, got {cfg.attack!r}")
    if cfg.initial_parameters and not cfg.app:
        out.append("initial_parameters needs app (--app FILE:client_fn): the digits models start from their own weights")
    if cfg.app:
        pass  # the user's clients bring the model; the reference is loaded (and its problems named) by the fleet
    elif cfg.model not in ("mlp", "cnn") and not _is_suite_model(cfg.model):
        out.append(f"model must be 'mlp', 'cnn' or a real-model suite name (edgeflow models list), got {cfg.model!r}")
    try:
        from ..train.transfer import parse_mode

        parse_mode(cfg.train_mode)
    except EdgeflowError as exc:  # parse_mode's InputError: one line per problem
        out.append(str(exc))
    if cfg.input_size < 8:
        out.append(f"input_size must be >= 8, got {cfg.input_size}")
    if cfg.mode not in ("sync", "async"):
        out.append(f"mode must be 'sync' or 'async', got {cfg.mode!r}")
    if cfg.codec not in available_codecs():
        out.append(f"codec {cfg.codec!r} is unknown; choose one of {', '.join(available_codecs())}")
    else:  # the options too (ratio=5, budget=40...): every device would fail to encode, round after round
        try:
            get_codec(cfg.codec).check_options(dict(cfg.codec_opts))
        except EdgeflowError as exc:  # CodecError: one line naming the option and what is valid
            out.append(str(exc))
    try:
        from ..codecs.model_delta import delta_codec

        delta_codec(cfg.downlink)
    except EdgeflowError as exc:  # one line naming the valid settings
        out.append(str(exc))
    if cfg.strategy not in strategy_names() and ":" not in cfg.strategy:
        out.append(f"strategy {cfg.strategy!r} is unknown; choose one of {', '.join(strategy_names())}")
    known = set(list_profiles())
    bad = [p for p in cfg.profiles if p not in known and not p.endswith(".toml")]
    if bad or not cfg.profiles:
        out.append(f"profiles {bad or '(none)'} unknown; choose from {', '.join(sorted(known))} (edgeflow profile list)")
    return out


def _is_suite_model(name: str) -> bool:
    from .. import model_suite as ms

    return name in {m.name for m in ms.models()}


def build_model(kind: str, seed: int, input_size: int = 48) -> onnx.ModelProto:
    """The digits MLP/CNN, or a pretrained suite model with a fresh 10-class head at ``input_size``."""
    from .. import zoo

    if kind == "mlp":
        return zoo.digits_mlp(seed=seed)
    if kind == "cnn":
        return zoo.digits_cnn(seed=seed)
    from .. import model_suite as ms
    from ..runtime.model import fix_input_shapes
    from ..train.transfer import new_head

    m = ms.load(kind)
    inp = m.graph.input[0].name
    m = fix_input_shapes(m, {inp: (None, 3, input_size, input_size)}, source=f"simulate input_size={input_size}")
    return new_head(m, 10, seed=seed)


def digits_as_images(x: np.ndarray, size: int) -> np.ndarray:
    """(N, 1, 8, 8) digits in [0, 1] -> (N, 3, size, size) in [-1, 1] (bilinear resize, grey to RGB)
    (PP-OCR's and PP-LCNet's normalisation, (v - 0.5) / 0.5)."""
    n = len(x)
    src = np.linspace(0, 7, size)
    i0 = np.floor(src).astype(int).clip(0, 6)
    f = (src - i0).astype(np.float32)
    rows = x[:, 0, i0, :] * (1 - f)[None, :, None] + x[:, 0, i0 + 1, :] * f[None, :, None]
    img = rows[:, :, i0] * (1 - f)[None, None, :] + rows[:, :, i0 + 1] * f[None, None, :]
    img = (img - 0.5) / 0.5
    return np.ascontiguousarray(np.broadcast_to(img[:, None], (n, 3, size, size)), dtype=np.float32)


def shard_data(cfg: SimConfig) -> tuple[Split, list[np.ndarray]]:
    split = load_digits(seed=cfg.seed)
    if cfg.model == "mlp":
        split = split.flat()
    elif cfg.model != "cnn":
        split = Split(digits_as_images(split.x_train, cfg.input_size), split.y_train,
                      digits_as_images(split.x_test, cfg.input_size), split.y_test)
    parts = dirichlet_partition(split.y_train, cfg.devices, alpha=cfg.alpha, seed=cfg.seed,
                                min_size=max(2, min(8, len(split.y_train) // (2 * cfg.devices))))
    return split, parts


def make_apps(cfg: SimConfig) -> list[Any]:
    """One client per simulated device from the user's ``client_fn`` (``cfg.app``), with Flower's context:
    ``node_id`` and ``node_config["partition-id"]`` = the device's index, ``["num-partitions"]`` = devices."""
    from ..federated.app import Context, load_client_fn, make_client

    client_fn = load_client_fn(cfg.app)
    run_config = {"seed": cfg.seed, "rounds": cfg.rounds, **cfg.run_config}
    return [make_client(client_fn, Context(node_id=i, node_config={"partition-id": i, "num-partitions": cfg.devices},
                                           run_config=run_config), cfg.app)
            for i in range(cfg.devices)]


def initial_model(cfg: SimConfig, apps: list[Any]) -> onnx.ModelProto:
    """The first global model of an app run: ``cfg.initial_parameters`` (.npz), else the parameters one
    client offers (picked at random, seeded; Flower's server does the same), checked against every client."""
    from ..gateway.global_model import load_initial_parameters, parameters_model

    if cfg.initial_parameters:
        weights = load_initial_parameters(cfg.initial_parameters)
        source = f"--initial-parameters {cfg.initial_parameters}"
    else:
        pick = int(np.random.default_rng(cfg.seed + 11).integers(len(apps)))
        name = type(getattr(apps[pick], "inner", apps[pick])).__name__
        weights = apps[pick].get_parameters({})
        if weights is None:
            raise ConfigError(f"--app {cfg.app}: {name}.get_parameters returned None, so there are no initial "
                              "parameters; return the model's arrays or give --initial-parameters FILE.npz")
        source = f"{name}.get_parameters of device dev{pick:03d}"
    model = parameters_model(weights, source=source)
    return model


def _attack(kind: str, scale: float, rng: np.random.Generator) -> Callable:
    def transform(delta: dict[str, np.ndarray], round_id: int) -> dict[str, np.ndarray]:
        if kind == "scale":
            return {k: v * scale for k, v in delta.items()}
        if kind == "flip":
            return {k: -scale * v for k, v in delta.items()}
        return {k: rng.normal(0, scale * (float(np.std(v)) + 1e-3), v.shape).astype(np.float32)
                for k, v in delta.items()}

    return transform


@dataclass
class SimDevice:
    device_id: str
    profile: str
    transport: Transport
    client: Client
    byzantine: bool = False
    straggler: bool = False
    vanished: bool = False


class SimulatedFleet:
    """Gateway + devices on one broker; ``run()`` returns per-round metrics."""

    def __init__(self, cfg: SimConfig, broker_url: str, *, state_path: str = ":memory:",
                 on_round: Callable | None = None, protocol: str = "auto", apps: list[Any] | None = None,
                 initial: onnx.ModelProto | None = None) -> None:
        """``apps``/``initial``: with ``cfg.app``, the clients and first model already built by
        :func:`make_apps` and :func:`initial_model` (built here when not given)."""
        from ..gateway.rounds import RoundManager
        from ..gateway.store import GatewayStore
        from ..transport.factory import transport_from_url

        self.cfg = cfg
        self.broker_url = broker_url
        self.protocol = protocol
        rng = np.random.default_rng(cfg.seed)
        self.apps: list[Any] | None = None
        self.app_error: tuple[str, EdgeflowError] | None = None
        self._gateway_log_level: int | None = None
        """The first device whose round failed in an app run (the run stops on it)."""
        if cfg.app:
            self.split, parts = None, [None] * cfg.devices
            self.apps = apps if apps is not None else make_apps(cfg)
            self.model = initial if initial is not None else initial_model(cfg, self.apps)
        else:
            self.split, parts = shard_data(cfg)
            self.model = build_model(cfg.model, cfg.seed, cfg.input_size)
        trainer_options = {} if cfg.train_mode == "full" and cfg.model in ("mlp", "cnn") else {"mode": cfg.train_mode}
        self.fleet_key = PrivateKey.generate()
        self.keyring = KeyRing()
        n_byz = int(round(cfg.byzantine * cfg.devices))
        n_slow = int(round(cfg.stragglers * cfg.devices))
        order = rng.permutation(cfg.devices)
        byz = set(order[:n_byz].tolist())
        slow = set(order[n_byz:n_byz + n_slow].tolist())
        n_vanish = int(round(cfg.dropout * cfg.devices))
        self._vanishing = set(rng.permutation(cfg.devices)[:n_vanish].tolist())
        self._skip_rng = np.random.default_rng(cfg.seed + 7)
        self.devices: list[SimDevice] = []
        profiles = itertools.cycle(cfg.profiles)
        for i, idx in enumerate(parts):
            did = f"dev{i:03d}"
            signer = Signer.generate(did)
            self.keyring.register(did, signer.public_key)
            t = transport_from_url(broker_url, client_id=f"{cfg.fleet}-{did}", protocol=protocol,
                                       clean_start=True)
            transform = self._transform(i, i in byz, rng)
            prof = next(profiles)
            local: dict[str, Any] = (
                {"app": self.apps[i]} if self.apps is not None else
                {"model": self.model, "data": (self.split.x_train[idx], self.split.y_train[idx]),
                 "trainer_options": trainer_options})
            c = Client(t, fleet=cfg.fleet, device_id=did, signer=signer, fleet_key=self.fleet_key.public_key,
                       profile=prof, seed=cfg.seed * 1000 + i, transform_update=transform,
                       delay_s=cfg.straggler_delay_s if i in slow else 0.0, **local)
            c.on_error = self._on_device_error
            self.devices.append(SimDevice(did, prof, t, c, byzantine=i in byz, straggler=i in slow))
        if self.apps is not None:
            self._check_apps_fit()
        self.gateway_transport = transport_from_url(broker_url, client_id=f"{cfg.fleet}-gateway",
                                                        protocol=protocol)
        rc = cfg.round_config(wait_for_devices_s=10.0)
        self.store = GatewayStore(state_path)
        self.rounds = RoundManager(
            self.gateway_transport, self.store, fleet=cfg.fleet, fleet_key=self.fleet_key, keyring=self.keyring,
            model=self.model, config=rc, candidates=self.candidates,
            eval_data=None if self.split is None else (self.split.x_test, self.split.y_test), on_round=on_round,
            weight_names=None if cfg.train_mode == "full" else self.trainable_names,
        )
        self._started = False

    def _check_apps_fit(self) -> None:
        """Every client's own parameters against the first global model, before any round (one line naming
        the device and the tensor)."""
        from ..gateway.global_model import model_weights

        weights = model_weights(self.model)
        for d in self.devices:
            problem = d.client.misfit(weights)
            if problem:
                raise ConfigError(f"device {d.device_id} ({self.cfg.app}): the initial parameters do not fit its "
                                  f"client: {problem}")

    def _on_device_error(self, device_id: str, exc: EdgeflowError) -> None:
        """An app's round failed (its result refused, fit raising): stop now, not after the round's deadlines."""
        if self.apps is None or self.app_error is not None:
            return
        self.app_error = (device_id, exc)
        # the run ends with this error as its one line; the round the gateway now abandons would only repeat it
        gw_log = logging.getLogger("edgeflow.gateway.rounds")
        self._gateway_log_level = gw_log.level  # restored by close()
        gw_log.setLevel(logging.CRITICAL)
        self.rounds.stop()

    @property
    def trainable_names(self) -> list[str]:
        """What the devices train (and the rounds federate): every device trains the same tensors."""
        return list(self.devices[0].client.trainer.trainable_names)

    def _transform(self, i: int, byzantine: bool, rng: np.random.Generator) -> Callable:
        attack = _attack(self.cfg.attack, self.cfg.attack_scale, np.random.default_rng(int(rng.integers(2**31))))

        def transform(delta, round_id):
            if i < self.cfg.secagg_dropouts:
                return None
            if i in self._vanishing and round_id == self.cfg.dropout_round:
                self._vanish(i)
                return None
            if self.cfg.skip_rate and self._skip_rng.random() < self.cfg.skip_rate:
                return None
            return attack(delta, round_id) if byzantine else delta

        return transform

    def _vanish(self, i: int) -> None:
        """Drop device i's TCP connection like a power cut (its will fires)."""
        d = self.devices[i]
        d.vanished = True
        threading.Thread(target=d.transport.close, kwargs={"abort": True}, daemon=True).start()

    def candidates(self):
        from ..gateway.rounds import Candidate

        return [Candidate(d.device_id, d.profile) for d in self.devices if not d.vanished]

    def start(self) -> None:
        for d in self.devices:
            d.client.start()
            d.transport.connect(timeout=30)
        self.rounds.start()
        self.gateway_transport.connect(timeout=30)
        self._started = True

    def run(self, rounds: int | None = None):
        if not self._started:
            self.start()
        done = self.rounds.run(rounds)
        if self.app_error is not None:
            device_id, exc = self.app_error
            raise EdgeflowError(f"device {device_id} ({self.cfg.app}): {exc}; the run stopped there, without "
                                "waiting for the round's deadline")
        return done

    def close(self) -> None:
        self.rounds.stop()
        if self._gateway_log_level is not None:
            logging.getLogger("edgeflow.gateway.rounds").setLevel(self._gateway_log_level)
        for d in self.devices:
            d.client.stop(timeout=2)
            if not d.vanished:
                d.transport.close(timeout=2)
        self.gateway_transport.close(timeout=5)

    def __enter__(self) -> "SimulatedFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def upload_bytes(self) -> tuple[int, int]:
        """(bytes sent by all devices, what dense fp32 would have been)."""
        return (sum(d.client.stats.bytes_sent for d in self.devices),
                sum(d.client.stats.dense_bytes for d in self.devices))
