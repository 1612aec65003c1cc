"""edgeflow.device: the agent that runs on each board of a fleet.

- :class:`DeviceAgent` (:mod:`.agent`): identity, birth/death, the signed
  command table; it wires its services: :mod:`.ota` (deploy, rollback,
  reboot with A/B slots), :mod:`.training` (taking part in federated rounds),
  :mod:`.inference` (the ``infer`` topic), :mod:`.telemetry` (the report);
- :func:`predict` (:mod:`.api`): in-process inference on the deployed model;
- :mod:`.slots`, :mod:`.health`, :mod:`.replay`, :mod:`.credentials`.

The wire protocol shared with the gateway is :mod:`edgeflow.protocol`
(:mod:`~edgeflow.protocol.fleet`, :mod:`~edgeflow.protocol.ota`). Imports are
lazy so that ``import edgeflow.device`` does not pull in the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .agent import AgentOptions, DeviceAgent, Participant
    from .api import load_deployed, predict
    from .credentials import DeviceCredentials, provision_device

__all__ = ["AgentOptions", "DeviceAgent", "DeviceCredentials", "Participant", "load_deployed", "predict",
           "provision_device"]

_LAZY = {
    "AgentOptions": ".agent", "DeviceAgent": ".agent", "Participant": ".agent",
    "predict": ".api", "load_deployed": ".api",
    "DeviceCredentials": ".credentials", "provision_device": ".credentials",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'edgeflow.device' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
