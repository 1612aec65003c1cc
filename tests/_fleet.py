"""Shared set-up for the fleet tests: a fleet directory, Mosquitto started with the config that
``edgeflow broker-config`` generates (TLS listener, no anonymous access, per-device passwords,
ACL), a gateway FleetManager and device agents, each on its own real MqttTransport.

    from _fleet import fleet_env  # noqa: F401  (a fixture: each test its own fleet and broker)

Nothing is mocked: agents, gateway and broker talk TLS over loopback sockets.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeflow import zoo
from edgeflow.broker.mosquitto import FleetDir, ListenerSettings
from edgeflow.device.agent import AgentOptions, DeviceAgent
from edgeflow.gateway.fleet import FleetManager, FleetOptions
from edgeflow.gateway.store import GatewayStore
from edgeflow.artifact import build_artifact, make_golden
from edgeflow.transport.broker import find_mosquitto, free_port, wait_for_port
from edgeflow.transport.message import TlsConfig
from edgeflow.transport.mqtt import MqttTransport

FLEET = "lab"
PROFILE = "raspberry-pi-4"
POOL = 48
OPERATORS = ("gateway", "admin", "tester", "cli")
FAST = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.5, "connect_timeout_s": 10.0}
BROKER_USER = "root" if hasattr(os, "geteuid") and os.geteuid() == 0 else None
"""The generated broker's ``user`` in tests: pytest's temporary directories (/tmp/pytest-of-root, mode 0700)
are out of reach of the ``mosquitto`` user that broker-config picks when run as root, so tests that run as
root keep the broker root (test_brokerconfig checks the default user on a reachable directory)."""


class GeneratedBroker:
    """``mosquitto -c`` on the config file the fleet directory generated (nothing added)."""

    def __init__(self, config: Path, port: int, log: Path) -> None:
        binary = find_mosquitto()
        if binary is None:
            pytest.skip("mosquitto is not installed")
        self.config, self.port, self.log_path = config, port, log
        self._out = open(log.with_suffix(".out"), "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([binary, "-c", str(config)], stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        if not wait_for_port("127.0.0.1", port, 10, alive=lambda: self.proc.poll() is None):
            self.stop()
            raise RuntimeError(f"mosquitto did not start with {config}:\n{self.log()}")

    def log(self) -> str:
        parts = []
        for p in (self.log_path.with_suffix(".out"), self.log_path):
            try:
                parts.append(p.read_text(errors="replace"))
            except OSError:
                pass
        return "".join(parts)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._out.close()


@dataclass
class FleetEnv:
    root: Path
    fleet_dir: FleetDir
    broker: GeneratedBroker
    url: str
    ids: Iterator[str]
    made: list[Any] = field(default_factory=list)
    by_user: dict[str, Any] = field(default_factory=dict)
    managers: dict[str, Any] = field(default_factory=dict)

    @property
    def ca(self) -> str:
        return str(self.fleet_dir.ca_file())

    def new_id(self) -> str:
        return next(self.ids)

    def transport(self, user: str, password: str | None = None, *, client_id: str | None = None,
                  connect: bool = True, **kw: Any) -> MqttTransport:
        """A transport as ``user``. The broker forces client id = user name, so an earlier
        transport of the same user (another test's) is closed first instead of being kicked."""
        self._release(user)
        if password is None:
            password = self.fleet_dir.operator(user)["password"]
        opts = {**FAST, **kw}
        t = MqttTransport.from_url(self.url, client_id=client_id or user, username=user, password=password,
                                   tls=TlsConfig(ca_file=self.ca), name=f"{user}-{len(self.made)}", **opts)
        self.made.append(t)
        self.by_user[user] = t
        if connect:
            t.connect()
        return t

    def _release(self, user: str) -> None:
        old = self.by_user.pop(user, None)
        fm = self.managers.pop(user, None)
        if fm is not None:
            fm.stop(timeout=1.0)
        if old is not None:
            old.close(timeout=1.0, flush=False)

    def device_password(self, device_id: str) -> str:
        import json

        return json.loads((self.fleet_dir.device_dir(device_id) / "device.json").read_text())["password"]

    def gateway(self, user: str = "gateway", store: GatewayStore | None = None, **options: Any) -> FleetManager:
        t = self.transport(user, connect=False)
        fm = FleetManager(t, store or GatewayStore(":memory:"), FLEET, self.fleet_dir.fleet_key(),
                          FleetOptions(**{"command_timeout_s": 20.0, **options}), keyring=self.fleet_dir.keyring())
        fm.start()
        t.connect()
        self.made.append(fm)
        self.managers[user] = fm
        return fm

    def agent(self, device_id: str | None = None, *, profile: str = PROFILE, start: bool = True,
              state: Path | None = None, **options: Any) -> DeviceAgent:
        device_id = device_id or self.new_id()
        opts = AgentOptions(**{"telemetry_interval_s": 0.5, "health_runs": 2, **options})
        a = DeviceAgent.from_credentials(self.fleet_dir.device_dir(device_id), broker=self.url, profile=profile,
                                         state_dir=state or (self.root / "state" / device_id), options=opts, **FAST)
        self.made.append(a)
        if start:
            a.start()
        return a

    def close(self) -> None:
        for obj in reversed(self.made):
            try:
                if isinstance(obj, DeviceAgent):
                    obj.crash()
                elif isinstance(obj, FleetManager):
                    obj.stop(timeout=1.0)
                else:
                    obj.close(timeout=1.0, flush=False)
            except Exception:  # noqa: BLE001 - teardown is best effort
                pass
        self.broker.stop()


def make_fleet_env(root: Path, *, pool: int = POOL) -> FleetEnv:
    fd = FleetDir(root / "fleet").init(FLEET, operators=OPERATORS)
    ids = [f"dev-{i:02d}" for i in range(pool)]
    for d in ids:
        fd.provision(d, profile=PROFILE)
    port = free_port()
    log = root / "mosquitto.log"
    files = fd.write_broker_config(ListenerSettings(host="127.0.0.1", port=port, log_file=str(log), user=BROKER_USER),
                                   tls_hosts=["localhost", "127.0.0.1"])
    broker = GeneratedBroker(files.config, port, log)
    url = f"mqtts://127.0.0.1:{port}"
    return FleetEnv(root, fd, broker, url, iter(ids))


@pytest.fixture
def fleet_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetEnv]:
    """Each test its own fleet directory and broker (0.2 s to make): a test then sees no retained
    births, deaths or deploy versions of another, in any order and under `pytest --count N`
    (a module-scoped fleet made repeats of test_fleet_registry and test_fleet_cli fail)."""
    env = make_fleet_env(tmp_path_factory.mktemp("fleet"))
    try:
        yield env
    finally:
        env.close()


# ---------------------------------------------------------------- models


def mlp_bytes(seed: int = 0) -> bytes:
    return zoo.digits_mlp(seed=seed).SerializeToString()


_GOLDEN_X = np.random.default_rng(7).random((1, 64)).astype(np.float32)


def artifact(env_or_key: Any, version: int, *, seed: int | None = None, profile: str = PROFILE,
             golden: bool = True, **golden_kw: Any) -> bytes:
    key = env_or_key.fleet_dir.fleet_key() if isinstance(env_or_key, FleetEnv) else env_or_key
    model = mlp_bytes(version if seed is None else seed)
    g = make_golden(model, profile, _GOLDEN_X, **golden_kw) if golden else None
    return build_artifact(model, version=version, profile=profile, key=key, fleet=FLEET, golden=g)


def wait_until(pred: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
