"""edgeflow.quantization: fp32 ONNX -> int8 (static QDQ / dynamic) or fp16
for a board's profile, with a measured report.

``from edgeflow.quantization import quantize``. Submodules are imported on
first use so that ``import edgeflow`` stays light. (The numpy backend's QDQ
fusion lives in the graph optimizer, :mod:`edgeflow.runtime.optimize.passes.fuse_qdq`.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["QuantizationReport", "QuantizedModel", "quantize"]


def __getattr__(name: str) -> Any:
    if name in ("quantize", "QuantizedModel"):
        from . import api

        return getattr(api, name)
    if name == "QuantizationReport":
        from .report import QuantizationReport

        return QuantizationReport
    raise AttributeError(f"module 'edgeflow.quantization' has no attribute {name!r}")
