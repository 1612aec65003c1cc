"""``edgeflow.device.predict``: inference on the model the fleet deployed to this board.

Applications on the device call it in-process; it runs on the model the
agent currently serves, so an OTA swap or a rollback takes effect for the
next call without the application noticing. Remote callers use the MQTT
``infer`` topic instead (see docs/fleet.md).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from ..errors import FleetError

__all__ = ["load_deployed", "predict"]


def _agent(device: str | None) -> Any:
    from .agent import _LAST, running_agents

    agents = running_agents()
    if device is not None:
        if device not in agents:
            raise FleetError(f"no device agent {device!r} runs in this process (running: {sorted(agents) or 'none'})")
        return agents[device]
    if len(agents) == 1:
        return next(iter(agents.values()))
    if not agents:
        raise FleetError("no device agent runs in this process: start one (`edgeflow device ...` or "
                         "DeviceAgent.start()), or use load_deployed(state_dir, fleet_key, profile)")
    if _LAST:
        return _LAST[0]
    raise FleetError(f"several device agents run here ({sorted(agents)}); pass device=")


def predict(x: np.ndarray | Mapping[str, np.ndarray], *, device: str | None = None) -> Any:
    """Run the deployed model of this process's agent (``device`` picks one when several run).

    An array in returns the first output; a dict of named inputs returns a dict of outputs.
    """
    return _agent(device).predict(x)


def load_deployed(state_dir: str | os.PathLike[str], fleet_key: Any, profile: str) -> Any:
    """A :class:`~edgeflow.runtime.session.Runtime` on the verified active model of an agent's state dir
    (no agent needed: tools, a second process on the board)."""
    from ..profiles import get_profile
    from ..signing import PublicKey
    from .health import load_runtime
    from .slots import SlotStore

    key = fleet_key if isinstance(fleet_key, PublicKey) else PublicKey.coerce(fleet_key)
    model, notes = SlotStore(state_dir).boot(key, get_profile(profile).name)
    if model is None:
        raise FleetError(f"no verified model in {state_dir}" + (f" ({'; '.join(notes)})" if notes else ""))
    return load_runtime(model.model_path, get_profile(profile))
