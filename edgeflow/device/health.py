"""The health check a staged model must pass before the device switches to it.

Three questions, in order, each with a reason the gateway can show:

1. does it **load** for this board (checks, memory plan against the budget,
   a backend that runs every op)?
2. does it compute the **golden outputs** the gateway computed for the same
   inputs, within the artifact's ``atol``/``rtol``? (A wrong conversion, a
   backend that disagrees, or a corrupt kernel shows up here, not in
   production traffic.)
3. is it **fast enough**: the median of a few timed runs within the
   artifact's latency budget?

Without golden data (an artifact built without it) the check runs a seeded
random input and requires finite outputs, the weakest useful test.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EdgeflowError
from ..artifact import Golden
from ..profiles import DeviceProfile

log = logging.getLogger("edgeflow.device")

__all__ = ["HealthReport", "check_model", "load_runtime"]


@dataclass
class HealthReport:
    ok: bool
    stage: str
    """"load", "golden", "latency" or "done": where the check stopped."""
    reason: str = ""
    backend: str | None = None
    latency_p50_ms: float | None = None
    max_abs_error: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_runtime(model: str | Path | bytes, profile: DeviceProfile, *, memory_budget_mb: int | None = None,
                 backend: str | None = None, threads: int | None = None):
    """``edgeflow.runtime.session.load`` with the device's overrides (a smaller memory budget than the profile's)."""
    from ..runtime.session import load

    if memory_budget_mb is not None:
        profile = dataclasses.replace(profile, memory_budget_mb=int(memory_budget_mb))
    return load(model, profile, backend=backend, threads=threads)


def _random_feeds(rt: Any, seed: int = 0) -> dict[str, np.ndarray]:
    from ..runtime.memory import concrete_shapes

    rng = np.random.default_rng(seed)
    feeds = {}
    for name, shape in concrete_shapes(rt.inputs, 1).items():
        dtype = np.dtype(next(t.dtype for t in rt.inputs if t.name == name) or "float32")
        feeds[name] = rng.random(shape).astype(dtype) if np.issubdtype(dtype, np.floating) else \
            rng.integers(0, 10, shape).astype(dtype)
    return feeds


def check_model(
    model: str | Path | bytes,
    profile: DeviceProfile,
    golden: Golden | None,
    *,
    memory_budget_mb: int | None = None,
    backend: str | None = None,
    threads: int | None = None,
    runs: int = 5,
    default_latency_budget_ms: float = 5000.0,
) -> HealthReport:
    """Run the three checks on ``model`` (a path or ONNX bytes); never raises for a bad model."""
    try:
        rt = load_runtime(model, profile, memory_budget_mb=memory_budget_mb, backend=backend, threads=threads)
    except EdgeflowError as exc:
        return HealthReport(False, "load", f"model does not load for profile {profile.name}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any failure to load is a failed health check, with its reason
        log.debug("health check: model does not load", exc_info=True)
        return HealthReport(False, "load", f"model does not load: {type(exc).__name__}: {exc}")
    feeds = dict(golden.inputs) if golden is not None else _random_feeds(rt)
    try:
        outputs = rt.run(feeds)
    except Exception as exc:  # noqa: BLE001 - same: report, do not crash the agent
        log.debug("health check: model fails on the golden input", exc_info=True)
        return HealthReport(False, "golden", f"model fails on the golden input: {type(exc).__name__}: {exc}",
                            backend=rt.backend_name)
    worst = 0.0
    if golden is not None and golden.expected:
        for name, want in golden.expected.items():
            got = outputs.get(name)
            if got is None:
                return HealthReport(False, "golden", f"model has no output {name!r}", backend=rt.backend_name)
            got = np.asarray(got)
            if got.shape != want.shape:
                return HealthReport(False, "golden", f"output {name!r} has shape {got.shape}, expected {want.shape}",
                                    backend=rt.backend_name)
            err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if got.size else 0.0
            worst = max(worst, err)
            if not np.allclose(got, want, atol=golden.atol, rtol=golden.rtol, equal_nan=False):
                return HealthReport(
                    False, "golden",
                    f"output {name!r} differs from the golden output by up to {err:.3g} "
                    f"(atol {golden.atol:g}, rtol {golden.rtol:g})",
                    backend=rt.backend_name, max_abs_error=err,
                )
    else:
        for name, got in outputs.items():
            arr = np.asarray(got)
            if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
                return HealthReport(False, "golden", f"output {name!r} is not finite on a random input",
                                    backend=rt.backend_name)
    times = []
    for _ in range(max(1, runs)):
        t0 = time.perf_counter()
        rt.run(feeds)
        times.append((time.perf_counter() - t0) * 1000.0)
    p50 = float(np.median(times))
    budget = golden.latency_budget_ms if golden is not None else default_latency_budget_ms
    if p50 > budget:
        return HealthReport(False, "latency", f"median latency {p50:.2f} ms exceeds the budget of {budget:g} ms",
                            backend=rt.backend_name, latency_p50_ms=p50, max_abs_error=worst)
    return HealthReport(True, "done", "", backend=rt.backend_name, latency_p50_ms=p50, max_abs_error=worst)
