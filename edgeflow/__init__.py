"""edgeflow: run and train int8 ONNX models on small boards, federate over MQTT.

The front door (everything loads on first use, so ``import edgeflow`` stays
light: no onnx, onnxruntime, torch or gateway)::

    rt = edgeflow.load("model.onnx", profile="raspberry-pi-4")   # -> edgeflow.Runtime
    edgeflow.quantize("model.onnx", "model.int8.onnx", calibration=...)
    edgeflow.Trainer(model, profile=...).fit((x, y), epochs=1)
    edgeflow.Client(transport, ..., model=model, data=(x, y))     # federated rounds, edgeflow's trainer
    edgeflow.Client(transport, ..., app=MyNumPyClient())          # ... or your own training loop
    edgeflow.Gateway(transport, store, ...)                       # the aggregator and fleet manager

Below it the runtime is split into independent modules behind small
interfaces: ``edgeflow.profiles`` (boards as data), ``edgeflow.runtime.model``
(loading and checking ONNX), ``edgeflow.runtime.backends`` (onnxruntime or pure
numpy), ``edgeflow.kernels`` (the numpy op library), ``edgeflow.protocol``
(everything on the wire), ``edgeflow.transport`` (MQTT and a loopback), and
quantization, training, codecs, the device agent and the gateway. The layering
between them: docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import onnx_compat as _onnx_compat
from ._version import __version__

# A hook, not an import: ``import onnx`` gets the installed package, or where a
# board has none (or only an old one) the protobuf stand-in of edgeflow.onnx_compat.
_onnx_compat.install()

if TYPE_CHECKING:
    from .federated.client import Client
    from .federated.numpy_client import NumPyClient
    from .gateway.service import Gateway
    from .quantization.api import quantize
    from .runtime.session import Runtime, load
    from .train.trainer import Trainer

_LAZY = {
    "load": ".runtime",
    "Runtime": ".runtime",
    "quantize": ".quantization.api",
    "Trainer": ".train.trainer",
    "Client": ".federated.client",
    "NumPyClient": ".federated.numpy_client",
    "Gateway": ".gateway.service",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    # PEP 562: the module is imported on first access, then cached in the package's namespace.
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'edgeflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
