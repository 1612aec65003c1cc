"""edgeflow.protocol: everything that travels on the wire between devices and the gateway.

Pure data, parsing and signing; no I/O, no MQTT. Both ends import it, so they
agree by construction, and device-side code never needs the gateway:

- :mod:`.signed_json` - the one signed-JSON wrapper (context, ``key_id``, Ed25519)
  every signed control message uses;
- :mod:`.rounds` - federated rounds: :class:`RoundAnnouncement`, :class:`TrainConfig`,
  an update's metadata;
- :mod:`.fleet` - births, deaths, commands, acks, tensors for inference;
- :mod:`.ota` - the OTA offer (a signed ``deploy`` command and its artifact;
  the artifact format itself is :mod:`edgeflow.artifact`);
- :mod:`.secagg`, :mod:`.secagg_wire`, :mod:`.shamir` - secure aggregation: its
  messages, shared primitives, frames and Shamir sharing (the client is
  :mod:`edgeflow.federated.secagg_client`, the server :mod:`edgeflow.gateway.secagg`).

The byte layouts are specified in docs/wire-format.md. Imports are lazy: the
secure-aggregation modules need ``cryptography``, the rest does not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fleet import Ack, Birth, Command, Death
    from .ota import OtaOffer
    from .rounds import RoundAnnouncement, TrainConfig
    from .signed_json import open_signed, sign_body

_LAZY = {
    "open_signed": ".signed_json", "sign_body": ".signed_json",
    "RoundAnnouncement": ".rounds", "TrainConfig": ".rounds",
    "Ack": ".fleet", "Birth": ".fleet", "Command": ".fleet", "Death": ".fleet",
    "OtaOffer": ".ota",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'edgeflow.protocol' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
