"""Device agents and a gateway FleetManager on a loopback hub (no broker): the real
:class:`DeviceAgent` and :class:`FleetManager`, each on its own LoopbackTransport.

    from _lbdevices import lb_env  # noqa: F401  (a fixture)

The keys are made here (what ``edgeflow fleet init/provision`` would write):
one fleet key, one signer per device, the gateway's key ring of device keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeflow import zoo
from edgeflow.device.agent import AgentOptions, DeviceAgent
from edgeflow.gateway.fleet import FleetManager, FleetOptions
from edgeflow.gateway.store import GatewayStore
from edgeflow.artifact import build_artifact, make_golden
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport.loopback import LoopbackBroker

FLEET = "lab"
PROFILE = "raspberry-pi-4"


class LoopbackFleetEnv:
    def __init__(self, root: Path, hub: LoopbackBroker | None = None) -> None:
        self.root = root
        self.hub = hub or LoopbackBroker(name="fleet")
        self.fleet_key = PrivateKey.generate()
        self.keyring = KeyRing()
        self.signers: dict[str, Signer] = {}
        self.made: list[Any] = []
        self._n = 0

    def new_id(self) -> str:
        self._n += 1
        return f"dev-{self._n:02d}"

    def signer(self, device_id: str) -> Signer:
        if device_id not in self.signers:
            s = Signer.generate(device_id)
            self.signers[device_id] = s
            self.keyring.register(device_id, s.public_key)
        return self.signers[device_id]

    def gateway(self, store: GatewayStore | None = None, **options: Any) -> FleetManager:
        t = self.hub.transport(f"gateway-{len(self.made)}")
        fm = FleetManager(t, store or GatewayStore(":memory:"), FLEET, self.fleet_key,
                          FleetOptions(**{"command_timeout_s": 10.0, **options}), keyring=self.keyring)
        fm.start()
        t.connect()
        self.made.append(fm)
        return fm

    def agent(self, device_id: str | None = None, *, profile: str = PROFILE, start: bool = True,
              state: Path | None = None, **options: Any) -> DeviceAgent:
        device_id = device_id or self.new_id()
        opts = AgentOptions(**{"telemetry_interval_s": 0.5, "health_runs": 2, **options})
        a = DeviceAgent(self.hub.transport(device_id), device_id=device_id, fleet=FLEET, profile=profile,
                        signer=self.signer(device_id), fleet_key=self.fleet_key.public_key,
                        state_dir=state or (self.root / "state" / device_id), options=opts)
        self.made.append(a)
        if start:
            a.start()
        return a

    def close(self) -> None:
        for obj in reversed(self.made):
            if isinstance(obj, DeviceAgent):
                obj.crash()
            else:
                obj.stop(timeout=1.0)
                obj.transport.close(timeout=1.0, flush=False)


@pytest.fixture
def lb_env(tmp_path: Path) -> Iterator[LoopbackFleetEnv]:
    env = LoopbackFleetEnv(tmp_path)
    try:
        yield env
    finally:
        env.close()


_GOLDEN_X = np.random.default_rng(7).random((1, 64)).astype(np.float32)


def mlp_bytes(seed: int = 0) -> bytes:
    return zoo.digits_mlp(seed=seed).SerializeToString()


def artifact(env: LoopbackFleetEnv, version: int, *, seed: int | None = None, profile: str = PROFILE) -> bytes:
    model = mlp_bytes(version if seed is None else seed)
    return build_artifact(model, version=version, profile=profile, key=env.fleet_key, fleet=FLEET,
                          golden=make_golden(model, profile, _GOLDEN_X))


def wait_until(pred: Callable[[], object], timeout: float = 10.0) -> bool:
    """For state that a thread of the code under test changes (not a message on the hub:
    use ``hub.settle()`` for those)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())
