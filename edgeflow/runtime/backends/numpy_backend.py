"""The pure-numpy backend: runs a :class:`~edgeflow.runtime.graph.CompiledGraph`.

For boards where no onnxruntime wheel exists (armv7, riscv64). Per-node
Python overhead is what decides small-batch latency, so the session runs
the graph's execution plan (:class:`~edgeflow.runtime.control_flow.Plan`,
built at load): each node's bound kernel, decoded attributes and input,
output and free-after slots of a list, instead of name lookups per call.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import onnx

from ..control_flow import Plan
from ..graph import CompiledGraph, compile_graph, find_missing, numpy_supports, unsupported_ops
from .base import Backend, Session, SessionOptions


class NumpySession(Session):
    backend_name = "numpy"

    def __init__(self, graph: CompiledGraph, options: SessionOptions) -> None:
        super().__init__(graph.inputs, graph.outputs)
        self.graph = graph
        self.options = options
        self._threads = max(1, int(options.threads))
        graph.plan()  # built at load: the first run pays nothing extra
        _keep_freed_memory()

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        _set_blas_threads(self._threads)
        plan = self.graph.plan()
        vals = _feed(plan, self.graph, feeds)
        plan.run(vals)
        slots = plan.slots
        return {n: vals[slots[n]] for n in output_names}


def _feed(plan: Plan, graph: CompiledGraph, feeds: dict[str, np.ndarray]) -> list:
    vals = plan.template.copy()
    for i, info in enumerate(graph.inputs, 1):  # the plan gives the inputs slots 1..n, in order
        value = feeds.get(info.name, _ABSENT)
        if value is not _ABSENT:
            vals[i] = value
    return vals


_ABSENT = object()


def execute(graph: CompiledGraph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run every node in order; returns the values alive at the end (the
    outputs among them) by name.

    Control-flow nodes are ordinary kernel calls here: their kernels run
    their compiled subgraphs (see :mod:`edgeflow.runtime.control_flow`).
    """
    plan = graph.plan()
    vals = _feed(plan, graph, feeds)
    plan.run(vals)
    out = {n: vals[i] for n, i in plan.slots.items() if n and vals[i] is not None}
    out.update((n, vals[plan.slots[n]]) for n in graph.output_names)
    return out


_CONTROLLER = None
_BLAS_THREADS: int | None = None


def _set_blas_threads(threads: int) -> None:
    """Set the BLAS pool size for this process, only when it changes.

    This is deliberately sticky (not restored after each run): switching the
    OpenBLAS pool back and forth costs ~100 us per inference, a third of a
    small CNN's batch-1 latency. Sessions of different thread counts in one
    process (the demo's simulated fleet) each set it before they run. Never
    more threads than host cores: an oversubscribed OpenBLAS spins and runs
    ~100x slower.
    """
    global _CONTROLLER, _BLAS_THREADS
    if threads == _BLAS_THREADS:  # the common case, before anything else (os.cpu_count() costs ~10 us)
        return
    threads = max(1, min(threads, _cpu_count()))
    if threads == _BLAS_THREADS:
        return
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        return
    if _CONTROLLER is None:
        _CONTROLLER = ThreadpoolController()
    _CONTROLLER.limit(limits=threads, user_api="blas")
    _BLAS_THREADS = threads


@functools.lru_cache(maxsize=1)
def _keep_freed_memory() -> bool:
    """glibc only, once per process: keep freed blocks under 32 MiB for reuse (mallopt
    M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 256 MiB) instead of unmapping them.

    Every run allocates the same activations and temporaries; with glibc's defaults
    a block over 128 KiB (until its dynamic threshold has grown) is mmap'ed fresh and
    unmapped when freed, and the top of the heap is trimmed back to the kernel, so
    each run page-faults its working set in again. Measured per run, one process, one
    thread: mtcnn-pnet 36.9 -> 27.4 ms, face-centerface 203 -> 176 ms,
    layout-picodet 216 -> 185 ms, table-slanet 115 -> 108 ms. The heap then stays at
    the run's peak between runs (the peak itself is what it was). Not done when the
    user set glibc's MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ themselves, or with
    EDGEFLOW_NUMPY_MALLOPT=0. Returns whether it was set."""
    if os.environ.get("EDGEFLOW_NUMPY_MALLOPT", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: their mallopt is not glibc's
            return False
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1
        return libc.mallopt(m_trim_threshold, 256 << 20) == 1 and ok
    except (OSError, AttributeError):  # no C library to ask: run with its defaults
        return False


@functools.lru_cache(maxsize=1)
def _cpu_count() -> int:
    return os.cpu_count() or 1


class NumpyBackend(Backend):
    name = "numpy"

    @classmethod
    def available(cls) -> bool:
        return True

    def unsupported_ops(self, model: onnx.ModelProto) -> list[str]:
        return unsupported_ops(model)

    def describe_unsupported(self, model: onnx.ModelProto) -> list[str]:
        """One line per op without a kernel: op, opset, first node with its subgraph path."""
        return [m.line() for m in find_missing(model, numpy_supports)]

    def load(self, model: onnx.ModelProto, options: SessionOptions | None = None) -> NumpySession:
        return self.load_compiled(compile_graph(model), options)

    def load_compiled(self, graph: CompiledGraph, options: SessionOptions | None = None) -> NumpySession:
        """A session on an already compiled graph (the runtime compiles once to plan memory)."""
        return NumpySession(graph, options or SessionOptions())
