"""Execution backends, found by name.

``get_backend("ort")`` / ``get_backend("numpy")``. Modules are imported
lazily so that a board without onnxruntime never touches it; probing catches
only ImportError. New backends register with :func:`register_backend`.
"""

from __future__ import annotations

import importlib

from ...errors import BackendError
from .base import Backend, Session, SessionOptions, check_feeds

_BACKENDS: dict[str, str] = {
    "ort": "edgeflow.runtime.backends.ort:OrtBackend",
    "numpy": "edgeflow.runtime.backends.numpy_backend:NumpyBackend",
}


def register_backend(name: str, target: str) -> None:
    """Register ``"package.module:Class"`` under ``name``."""
    _BACKENDS[name] = target


def backend_names() -> list[str]:
    return list(_BACKENDS)


def _load_class(name: str) -> type[Backend]:
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; known backends: {', '.join(_BACKENDS)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str) -> Backend:
    """An instance of the named backend; a clear error if it cannot run here."""
    cls = _load_class(name)
    if not cls.available():
        raise BackendError(
            f"backend {name!r} is not available on this host (its library is not installed); "
            f"available: {', '.join(available_backends())}"
        )
    return cls()


def available_backends() -> list[str]:
    out = []
    for name in _BACKENDS:
        try:
            if _load_class(name).available():
                out.append(name)
        except ImportError:
            continue
    return out


__all__ = [
    "Backend",
    "Session",
    "SessionOptions",
    "available_backends",
    "backend_names",
    "check_feeds",
    "get_backend",
    "register_backend",
]
