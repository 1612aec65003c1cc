"""``edgeflow demo``: the whole product on one machine, on real parts.

What runs (all in this process, each device with its own MQTT connection):

1. a broker — the given URL, else Mosquitto started on a free loopback port
   with a temporary config, else amqtt's broker embedded in-process;
2. a gateway (:class:`~edgeflow.gateway.service.Gateway`: fleet registry +
   federated rounds, SQLite state) holding the fleet key;
3. one :class:`~edgeflow.device.agent.DeviceAgent` per board profile, each
   with its own device key, A/B model slots, telemetry, and — where the
   profile can train — a federated :class:`~edgeflow.federated.Client` on a
   label-skewed shard of scikit-learn's digits.

The story: the gateway deploys the initial model over the air (signed, health
checked), the training boards run R federated rounds with compressed signed
updates, the gateway quantizes the final model per board profile (int8 for
CPUs, fp16 for the Jetson), rolls it out over the air, and every board runs
the held-out test set on its own backend (onnxruntime, or pure numpy on the
armv7/riscv64 boards). The final table compares fp32 with what each board
now runs.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

DEMO_PROFILES = (
    "raspberry-pi-4", "raspberry-pi-5", "jetson-orin-nano", "raspberry-pi-zero-2w",
    "visionfive-2", "x86-gateway", "coral-dev-board", "beaglebone-black",
)


SHORT = {"raspberry-pi-4": "rpi4", "raspberry-pi-5": "rpi5", "jetson-orin-nano": "jetson",
         "raspberry-pi-zero-2w": "rpi0", "visionfive-2": "vf2", "x86-gateway": "x86",
         "coral-dev-board": "coral", "beaglebone-black": "bbb"}


def precision_label(method: str) -> str:
    return {"static": "int8", "minmax": "int8", "percentile": "int8", "entropy": "int8",
            "dynamic": "int8-dyn", "fp16": "fp16"}.get(method, method)


@dataclass
class DemoConfig:
    devices: int = 8
    rounds: int = 15
    seed: int = 0
    model: str = "cnn"
    alpha: float = 0.5
    codec: str = "topk-int8"
    ratio: float = 0.03
    epochs: int = 3
    lr: float = 0.1
    batch_size: int = 16
    deadline_s: float = 120.0
    """Each round waits for every selected device (quorum 1.0), at most this long: which devices make it
    must not depend on the machine's load, or the same seed would give another model."""
    broker: str | None = None  # URL, "mosquitto", "embedded", or None = auto
    workdir: str | None = None  # keep state here (default: a temporary directory)
    fleet: str = "demo"


def check_config(cfg: DemoConfig) -> None:
    """Every setting checked before a broker starts: ConfigError naming each problem and its flag."""
    from ..codecs import available_codecs
    from ..errors import ConfigError
    from ..profiles import get_profile

    problems = []
    trainers = sum(1 for i in range(max(0, cfg.devices)) if get_profile(DEMO_PROFILES[i % len(DEMO_PROFILES)]).can_train)
    if trainers < 2:
        problems.append(f"--devices {cfg.devices}: a round needs two boards that train; use --devices 2 or more")
    if cfg.rounds < 1:
        problems.append(f"--rounds {cfg.rounds}: give 1 or more federated rounds")
    if cfg.seed < 0:
        problems.append(f"--seed {cfg.seed}: seeds are whole numbers >= 0")
    if cfg.codec not in available_codecs():
        problems.append(f"--codec {cfg.codec!r} is unknown; choose one of {', '.join(available_codecs())}")
    if cfg.codec.startswith("topk") and not 0 < cfg.ratio <= 1:
        problems.append(f"--ratio {cfg.ratio:g}: the share of values top-k sends must be in (0, 1], e.g. 0.03")
    if cfg.model not in ("cnn", "mlp"):
        problems.append(f"model {cfg.model!r}: 'cnn' or 'mlp'")
    if problems:
        raise ConfigError("; ".join(problems))


@dataclass
class DeviceRow:
    device: str
    profile: str
    backend: str
    trains: bool
    samples: int
    precision: str
    fp32_accuracy: float
    deployed_accuracy: float
    latency_p50_ms: float
    latency_p95_ms: float
    upload_bytes: int
    dense_bytes: int


@dataclass
class DemoResult:
    broker: str
    rounds: int
    accuracy_per_round: list[float]
    devices: list[DeviceRow]
    upload_bytes: int
    dense_bytes: int
    wall_s: float
    final_fp32_accuracy: float
    rollout: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def upload_ratio(self) -> float:
        return self.upload_bytes / self.dense_bytes if self.dense_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The result with figures rounded (accuracies 4 decimals, latencies in ms 3, seconds 2)."""
        d = asdict(self)
        d["upload_ratio"] = round(self.upload_ratio, 4)
        d["accuracy_per_round"] = [round(a, 4) for a in self.accuracy_per_round]
        d["final_fp32_accuracy"] = round(self.final_fp32_accuracy, 4)
        d["wall_s"] = round(self.wall_s, 2)
        for row in d["devices"]:
            for k in ("fp32_accuracy", "deployed_accuracy"):
                row[k] = round(row[k], 4)
            for k in ("latency_p50_ms", "latency_p95_ms"):
                row[k] = round(row[k], 3)
        return d


def select_broker(spec: str | None):
    """A running broker for ``spec``: a URL, "mosquitto", "embedded", or None (auto)."""
    from ..errors import TransportError
    from ..transport.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto, start_broker

    if spec in (None, "", "auto"):
        return start_broker(None)
    if spec == "mosquitto":
        binary = find_mosquitto()
        if binary is None:
            raise TransportError("--broker mosquitto: no mosquitto binary found (apt install mosquitto)")
        return MosquittoBroker(binary=binary).start()
    if spec == "embedded":
        return EmbeddedBroker().start()
    return start_broker(spec)


def describe_broker(broker: Any) -> str:
    kind = getattr(broker, "kind", "external")
    how = {"mosquitto": "Mosquitto started on a free loopback port with a temporary config",
           "amqtt": "amqtt's broker embedded in this process",
           }.get(kind, "the broker you named")
    return f"broker: {kind} at {broker.url} ({how})"


def _participant_factory(shards: dict[str, tuple[np.ndarray, np.ndarray]], seed: int,
                         created: dict[str, list]) -> Callable:
    """The agents' training participants: federated Clients on each device's shard.

    Every client made is remembered in ``created`` so the demo can total the
    bytes each device uploaded after training stopped.
    """
    from ..federated import Client

    def make(agent):
        c = Client(agent.transport, fleet=agent.fleet, device_id=agent.device_id, signer=agent.signer,
                   fleet_key=agent.fleet_key, model=str(agent.train_model_path), data=shards[agent.device_id],
                   profile=agent.profile, seed=seed * 1000 + sorted(shards).index(agent.device_id),
                   report_train_time=False,  # no timings in the updates: the same bytes on every run
                   epoch_file=agent.slots.root / "gateway_epoch.json")
        created.setdefault(agent.device_id, []).append(c)
        return c

    return make


def _latency(agent, x: np.ndarray, runs: int = 30) -> tuple[float, float]:
    samples = []
    for i in range(runs):
        xi = x[i % len(x): i % len(x) + 1]
        t0 = time.perf_counter()
        agent.predict(xi)
        samples.append((time.perf_counter() - t0) * 1e3)
    a = np.array(samples)
    return float(np.percentile(a, 50)), float(np.percentile(a, 95))


class Demo:
    """Build, run and tear down the demo fleet. Use as a context manager."""

    def __init__(self, cfg: DemoConfig, *, say: Callable[[str], None] = print, progress: Any = None) -> None:
        self.cfg = cfg
        self.say = say
        self.progress = progress  # a rich Progress or None
        self._stack = contextlib.ExitStack()
        self.notes: list[str] = []

    def __enter__(self) -> "Demo":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    # -- set-up ---------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.cfg
        check_config(cfg)
        self.work = self._workdir()
        self.broker = select_broker(cfg.broker)
        self._stack.callback(self.broker.stop)
        self.say(describe_broker(self.broker))
        protocol = getattr(self.broker, "protocol", "auto") or "auto"
        profiles = self._data_and_devices()
        signers = self._start_gateway(protocol)
        self._start_agents(profiles, signers, protocol)

    def _workdir(self) -> Path:
        """``--workdir``, or a temporary directory removed at the end."""
        if self.cfg.workdir:
            work = Path(self.cfg.workdir)
            work.mkdir(parents=True, exist_ok=True)
            return work
        work = Path(tempfile.mkdtemp(prefix="edgeflow-demo-"))
        self._stack.callback(shutil.rmtree, work, True)
        return work

    def _data_and_devices(self) -> list[str]:
        """The digits, the model, each device's board profile and id, and the training boards' non-IID shards;
        returns the profiles (by device, in the order of :attr:`device_ids`)."""
        from .. import zoo
        from ..data.datasets import dirichlet_partition, load_digits
        from ..profiles import get_profile

        cfg = self.cfg
        split = load_digits(seed=cfg.seed)
        if cfg.model == "mlp":
            split = split.flat()
        self.split = split
        self.model = zoo.digits_cnn(seed=cfg.seed) if cfg.model == "cnn" else zoo.digits_mlp(seed=cfg.seed)
        profiles = [DEMO_PROFILES[i % len(DEMO_PROFILES)] for i in range(cfg.devices)]
        ids = [f"{SHORT.get(p, 'dev')}-{i}" for i, p in enumerate(profiles)]
        self.device_ids = ids
        trainers = [d for d, p in zip(ids, profiles) if get_profile(p).can_train]
        if not trainers:
            from ..errors import ConfigError

            raise ConfigError("no device of the demo can train: use more devices")
        parts = dirichlet_partition(split.y_train, len(trainers), alpha=cfg.alpha, seed=cfg.seed)
        self.shards = {d: (split.x_train[idx], split.y_train[idx]) for d, idx in zip(trainers, parts)}
        self.trainers = trainers
        return profiles

    def _start_gateway(self, protocol: str) -> dict[str, Any]:
        """The fleet key, each device's signing key in the gateway's key ring, and the gateway, started;
        returns the devices' signers."""
        from ..gateway.fleet import FleetOptions
        from ..gateway.rounds import RoundConfig
        from ..gateway.service import Gateway
        from ..gateway.store import GatewayStore
        from ..protocol.rounds import TrainConfig
        from ..signing import KeyRing, PrivateKey, Signer
        from ..transport.factory import transport_from_url
        from ..transport.message import Will
        from ..transport.topics import gateway_topic

        cfg = self.cfg
        fleet_key = PrivateKey.generate()
        self.fleet_key = fleet_key
        keyring = KeyRing()
        signers = {d: Signer.generate(d) for d in self.device_ids}
        for d, s in signers.items():
            keyring.register(d, s.public_key)

        gt = transport_from_url(
            self.broker.url, client_id=f"{cfg.fleet}-gateway", protocol=protocol, clean_start=True,
            will=Will(str(gateway_topic(cfg.fleet, "state")), '{"online": false}'),
        )
        rounds = RoundConfig(
            rounds=cfg.rounds, min_clients=max(2, len(self.trainers) // 2), quorum=1.0, deadline_s=cfg.deadline_s,
            strategy="fedavg", seed=cfg.seed, wait_for_devices_s=20.0,
            train=TrainConfig(epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr, codec=cfg.codec,
                              codec_opts={"ratio": cfg.ratio} if cfg.codec.startswith("topk") else {}),
        )
        self.gateway = Gateway(
            gt, GatewayStore(self.work / "gateway.sqlite"), fleet=cfg.fleet, fleet_key=fleet_key, keyring=keyring,
            model=self.model, rounds=rounds, fleet_options=FleetOptions(heartbeat_timeout_s=30.0),
            eval_data=(self.split.x_test, self.split.y_test), metrics_path=self.work / "metrics.jsonl",
            on_round=self._on_round,
        )
        self._stack.callback(self.gateway.stop)
        self.gateway.start()
        return signers

    def _start_agents(self, profiles: list[str], signers: dict[str, Any], protocol: str) -> None:
        """One device agent per board (the training ones with a participant), until all are online."""
        from ..device.agent import AgentOptions, DeviceAgent
        from ..transport.factory import transport_from_url

        cfg = self.cfg
        ids = self.device_ids
        self.clients: dict[str, list] = {}
        make = _participant_factory(self.shards, cfg.seed, self.clients)
        self.agents = {}
        for d, p in zip(ids, profiles):
            t = transport_from_url(self.broker.url, client_id=d, protocol=protocol, clean_start=True)
            agent = DeviceAgent(t, device_id=d, fleet=cfg.fleet, profile=p, signer=signers[d],
                                fleet_key=self.fleet_key.public_key, state_dir=self.work / "devices" / d,
                                options=AgentOptions(telemetry_interval_s=2.0, health_runs=3),
                                make_participant=make if d in self.shards else None)
            agent.start(timeout=30)
            self._stack.callback(agent.stop)
            self.agents[d] = agent
        if not self.gateway.fleet.wait_online(ids, timeout=30):
            from ..errors import FleetError

            raise FleetError("not every demo device came online within 30 s")

    # -- steps ------------------------------------------------------------------
    def _wait_trainers(self, timeout: float = 60.0) -> None:
        """Until the gateway sees every training board as a trainable candidate, so every round selects
        the same devices (a birth still in flight would make round 1 select fewer)."""
        from ..errors import FleetError

        end = time.monotonic() + timeout
        while True:
            pool = {c.device_id: c for c in self.gateway.fleet.round_candidates()}
            missing = [d for d in self.trainers if not (d in pool and pool[d].can_train)]
            if not missing:
                return
            if time.monotonic() > end:
                why = "; ".join(f"{d}: {pool[d].why if d in pool else 'offline'}" for d in missing)
                raise FleetError(f"training boards not ready after {timeout:g} s: {why}")
            time.sleep(0.1)

    def _on_round(self, m) -> None:
        self.accuracy.append(float(m.accuracy) if m.accuracy is not None else float("nan"))
        if self.progress is not None:
            self.progress.update(self._round_task, advance=1,
                                 description=f"federated rounds (accuracy {m.accuracy:.3f})")

    def _rollout(self, onnx_bytes: bytes, version: int, *, quantize: bool, label: str) -> Any:
        from ..gateway.ota import RolloutPolicy, build_artifacts

        profiles = sorted({a.profile.name for a in self.agents.values()})
        notes: list[str] = []
        arts = build_artifacts(onnx_bytes, profiles, self.fleet_key, version=version, fleet=self.cfg.fleet,
                               quantize=quantize, calibration=self.split.x_train[:256],
                               golden_inputs=self.split.x_test[:4], atol=1e-3, rtol=1e-3,
                               latency_budget_ms=2000.0, notes=notes)
        self.notes += notes
        task = None
        if self.progress is not None:
            task = self.progress.add_task(label, total=len(self.agents))

        def on_progress(report, result) -> None:
            if task is not None and result.state not in ("pending",):
                self.progress.update(task, completed=sum(1 for r in report.devices.values()
                                                         if r.state not in ("pending",)))

        report = self.gateway.fleet.deploy(
            arts, to="all", policy=RolloutPolicy(canary=1, failure_threshold=0.3, report_timeout_s=60.0),
            on_progress=on_progress)
        if task is not None:
            self.progress.update(task, completed=len(self.agents))
        return report, arts

    def run(self) -> DemoResult:
        from ..runtime.session import load

        t0 = time.perf_counter()
        self.accuracy: list[float] = []
        self._setup()
        rep1, _ = self._rollout(self.model.SerializeToString(), 1, quantize=False, label="OTA deploy v1 (fp32)")
        if rep1.state != "completed":
            from ..errors import FleetError

            raise FleetError(f"initial deployment {rep1.state}: {rep1.halted_reason}")
        self._wait_trainers()  # they joined by themselves once v1 was deployed: no train_start
        if self.progress is not None:
            self._round_task = self.progress.add_task("federated rounds", total=self.cfg.rounds)
        self.gateway.run_rounds(self.cfg.rounds)
        for d in self.trainers:
            self.gateway.fleet.command(d, "train_stop", timeout_s=30)
        final = self.gateway.rounds.current_model()
        rep2, arts = self._rollout(final.SerializeToString(), 2, quantize=True, label="OTA deploy v2 (quantized)")

        from ..artifact import parse_artifact

        x, y = self.split.x_test, self.split.y_test
        rows = []
        fp32_cache: dict[tuple[str, str], float] = {}
        for d, agent in self.agents.items():
            prof = agent.profile
            rt = load(final, prof, batch_size=len(x), allow_over_budget=True)
            key = (prof.name, rt.backend_name)
            if key not in fp32_cache:
                fp32_cache[key] = float((rt(x).argmax(1) == y).mean())
            deployed = agent.predict(x)
            dep_acc = float((np.asarray(deployed).argmax(1) == y).mean())
            p50, p95 = _latency(agent, x)
            meta = dict(parse_artifact(arts[prof.name]).manifest.meta or {}) if prof.name in arts else {}
            clients = self.clients.get(d, [])
            up = sum(c.stats.bytes_sent for c in clients)
            dense = sum(c.stats.dense_bytes for c in clients)
            rows.append(DeviceRow(
                device=d, profile=prof.name, backend=agent.birth().backend or rt.backend_name,
                trains=d in self.shards, samples=len(self.shards[d][1]) if d in self.shards else 0,
                precision=precision_label(str(meta.get("precision", "?"))), fp32_accuracy=fp32_cache[key],
                deployed_accuracy=dep_acc, latency_p50_ms=p50, latency_p95_ms=p95,
                upload_bytes=up, dense_bytes=dense,
            ))
        final_acc = float((load(final, "x86-gateway", batch_size=len(x))(x).argmax(1) == y).mean())
        return DemoResult(
            broker=describe_broker(self.broker), rounds=self.cfg.rounds, accuracy_per_round=self.accuracy,
            devices=rows, upload_bytes=sum(r.upload_bytes for r in rows),
            dense_bytes=sum(r.dense_bytes for r in rows), wall_s=time.perf_counter() - t0,
            final_fp32_accuracy=final_acc, rollout={"v1": rep1.counts(), "v2": rep2.counts()}, notes=self.notes,
        )
