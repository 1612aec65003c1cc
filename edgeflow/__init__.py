"""edgeflow: run and train int8 ONNX models on small boards, federate over MQTT.

The runtime is split into independent modules behind small interfaces:
``edgeflow.profiles`` (boards as data), ``edgeflow.model`` (loading and
checking ONNX), ``edgeflow.backends`` (onnxruntime or pure numpy),
``edgeflow.kernels`` (the numpy op library), and, as they are used,
quantization, training, transport, codecs and the gateway.
"""

from __future__ import annotations

from . import onnx_compat as _onnx_compat

# A hook, not an import: ``import onnx`` gets the installed package, or where a
# board has none (or only an old one) the protobuf stand-in of edgeflow.onnx_compat.
_onnx_compat.install()

__version__ = "0.1.0"

__all__ = ["__version__", "quantize"]


def __getattr__(name: str):
    # Lazy: ``import edgeflow`` must stay light (no onnx/onnxruntime import).
    if name == "quantize":
        from .quantization.api import quantize

        return quantize
    raise AttributeError(f"module 'edgeflow' has no attribute {name!r}")
