"""The runtime room: load and check ONNX, optimize the graph, plan memory, run it on a backend.

    model.py         loading and checking ONNX, input shapes
    optimize/        graph passes (constants, folding, BatchNorm/activation/QDQ fusion, dead nodes) on an IR
    graph.py         compiling a model into numpy kernel calls;  control_flow.py  If/Loop/Scan subgraphs
    memory.py        planned peak memory against a profile's budget
    backends/        the onnxruntime and numpy sessions, chosen by name
    session.py       edgeflow.load / Runtime: check, plan, open a session, fall back
    conformance.py   the ONNX node cases the numpy backend claims, run against it

``from edgeflow.runtime import Runtime, load`` works without importing the
submodules up front (PEP 562): the session module loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .session import BackendChoice, Runtime, choose_backend, load, session_options

_SESSION_NAMES = ("BackendChoice", "Runtime", "choose_backend", "load", "session_options")

__all__ = sorted(_SESSION_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _SESSION_NAMES:
        raise AttributeError(f"module 'edgeflow.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(".session", __name__), name)
    globals()[name] = value
    return value
