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

The model is untrusted until it passes, so the check runs in a child process
(``isolate=True``, the default): after the model loads, the child's address
space is capped at what it holds then plus the memory budget (RLIMIT_AS), so
a model that allocates past the budget at run time (a data-dependent
``ConstantOfShape``/``Expand`` the static plan cannot size) fails the check
instead of the board; each run is bounded by the profile's loop-iteration and
wall-time limits (:mod:`edgeflow.runtime.limits`), and the parent kills a
child that does not answer in time. The agent process never runs the model
before it passed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EdgeflowError
from ..artifact import Golden
from ..child_python import child_env, python_command
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


RUN_SLACK_BYTES = 128 * 2**20
"""Address space a run may take beyond the memory budget (thread stacks, allocator and arena rounding)."""

CHILD_START_S = 120.0
"""Seconds the child may take to start and load the model, beyond the per-run limits (slow boards import slowly)."""


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
    isolate: bool = True,
) -> HealthReport:
    """Run the three checks on ``model`` (a path or ONNX bytes); never raises for a bad model.

    ``isolate`` runs them in a child process under a run-time memory cap and a
    deadline (see the module doc); False runs them here, bounded only by the
    runtime's loop-iteration and wall-time limits."""
    kwargs = dict(model=model, profile=profile, golden=golden, memory_budget_mb=memory_budget_mb, backend=backend,
                  threads=threads, runs=runs, default_latency_budget_ms=default_latency_budget_ms)
    if not isolate:
        return _check(**kwargs)
    return _check_in_child(kwargs)


def _budget_mb(profile: DeviceProfile, memory_budget_mb: int | None) -> int:
    return int(memory_budget_mb) if memory_budget_mb is not None else int(profile.memory_budget_mb)


def _check_in_child(kwargs: dict[str, Any]) -> HealthReport:
    """The check in a fresh interpreter (never a fork of the agent: its MQTT threads and locks stay behind):
    the arguments go in pickled on stdin, the verdict comes back as JSON on stdout."""
    profile: DeviceProfile = kwargs["profile"]
    runs = max(1, int(kwargs["runs"]))
    timeout = CHILD_START_S + (runs + 1) * float(profile.max_run_seconds)
    # the child imports this same edgeflow, whatever sys.path the agent was started with and whatever its
    # current directory holds (a checkout's ./edgeflow shadowed a plain install: edgeflow/child_python.py)
    cmd = python_command("from edgeflow.device.health import _child_main\n_child_main()\n")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=child_env())
    except OSError as exc:
        return HealthReport(False, "load", f"could not start the health-check process ({exc}); free memory or "
                            "processes on the device and deploy again")
    try:
        out, err = proc.communicate(pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL), timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return HealthReport(False, "golden", f"the health check did not finish within {timeout:g} s "
                            f"(profile {profile.name} allows {profile.max_run_seconds} s per run); the model "
                            "runs too long for this board")
    try:
        return HealthReport(**json.loads(out.decode("utf-8")))
    except (ValueError, TypeError):
        code = proc.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        log.debug("health-check process stderr: %s", err.decode("utf-8", "replace"))
        return HealthReport(False, "golden", f"the health-check process {how} without a verdict "
                            f"({last[0][:200] or 'out of memory?'}); the model does not run within this board's limits")


def _child_main() -> None:
    """The health check in the child process: kwargs pickled on stdin, the report as one JSON object on stdout."""
    result = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the verdict
    kwargs = pickle.load(sys.stdin.buffer)
    try:
        report = _check(**kwargs, cap_address_space=True)
    except MemoryError as exc:
        report = HealthReport(False, "golden", _memory_reason(kwargs["profile"], kwargs["memory_budget_mb"], exc))
    except BaseException as exc:  # noqa: BLE001 - the child's last word is a verdict, never a traceback
        log.info("health check child: %s: %s (reported as the verdict)", type(exc).__name__, exc)
        report = HealthReport(False, "golden", f"the health check failed: {type(exc).__name__}: {exc}")
    result.write(json.dumps(report.to_dict(), default=str))
    result.close()


def _memory_reason(profile: DeviceProfile, memory_budget_mb: int | None, exc: BaseException) -> str:
    return (f"the model needs more memory at run time than the budget of {_budget_mb(profile, memory_budget_mb)} "
            f"MiB (profile {profile.name}) allows ({type(exc).__name__}: {' '.join(str(exc).split())}); quantize or shrink the model, or "
            "raise memory_budget_mb where the board has the memory")


def _address_space() -> int:
    """This process's virtual size in bytes (VmSize), 0 where unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _cap_address_space(extra_bytes: int) -> None:
    """RLIMIT_AS = what this process maps now + ``extra_bytes`` (soft limit; a no-op where unsupported)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Linux
        return
    now = _address_space()
    if not now:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = now + int(extra_bytes)
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (ValueError, OSError) as exc:
        log.info("health check: could not cap the address space (%s)", exc)


def _check(
    model: str | Path | bytes,
    profile: DeviceProfile,
    golden: Golden | None,
    *,
    memory_budget_mb: int | None = None,
    backend: str | None = None,
    threads: int | None = None,
    runs: int = 5,
    default_latency_budget_ms: float = 5000.0,
    cap_address_space: bool = False,
) -> HealthReport:
    try:
        rt = load_runtime(model, profile, memory_budget_mb=memory_budget_mb, backend=backend, threads=threads)
    except EdgeflowError as exc:
        return HealthReport(False, "load", f"model does not load for profile {profile.name}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any failure to load is a failed health check, with its reason
        log.debug("health check: model does not load", exc_info=True)
        return HealthReport(False, "load", f"model does not load: {type(exc).__name__}: {exc}")
    if cap_address_space:
        # from here on the model runs: what it allocates beyond what is mapped now counts against the budget
        _cap_address_space(_budget_mb(profile, memory_budget_mb) * 2**20 + RUN_SLACK_BYTES)
    try:
        feeds = dict(golden.inputs) if golden is not None else _random_feeds(rt)
        outputs = rt.run(feeds)
    except MemoryError as exc:
        return HealthReport(False, "golden", _memory_reason(profile, memory_budget_mb, exc), backend=rt.backend_name)
    except EdgeflowError as exc:  # a limit (loop iterations, wall time) or a kernel failure: its own clear line
        if cap_address_space and "failed to allocate memory" in str(exc).lower():  # onnxruntime under the cap
            return HealthReport(False, "golden", _memory_reason(profile, memory_budget_mb, exc), backend=rt.backend_name)
        return HealthReport(False, "golden", f"model fails on the golden input: {exc}", backend=rt.backend_name)
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
    try:
        for _ in range(max(1, runs)):
            t0 = time.perf_counter()
            rt.run(feeds)
            times.append((time.perf_counter() - t0) * 1000.0)
    except MemoryError as exc:
        return HealthReport(False, "latency", _memory_reason(profile, memory_budget_mb, exc), backend=rt.backend_name)
    except Exception as exc:  # noqa: BLE001 - a timed run that fails (a limit) fails the check, never the agent
        log.info("health check: a timed run failed (%s): the check fails", exc)
        return HealthReport(False, "latency", f"a timed run failed: {exc}", backend=rt.backend_name)
    p50 = float(np.median(times))
    budget = golden.latency_budget_ms if golden is not None else default_latency_budget_ms
    if p50 > budget:
        return HealthReport(False, "latency", f"median latency {p50:.2f} ms exceeds the budget of {budget:g} ms",
                            backend=rt.backend_name, latency_p50_ms=p50, max_abs_error=worst)
    return HealthReport(True, "done", "", backend=rt.backend_name, latency_p50_ms=p50, max_abs_error=worst)
