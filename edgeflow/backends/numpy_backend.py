"""The pure-numpy backend: runs a :class:`~edgeflow.graph.CompiledGraph`.

For boards where no onnxruntime wheel exists (armv7, riscv64). The loop is
deliberately plain — look up inputs, call the kernel, store outputs, drop
values whose last reader ran — because per-node Python overhead is what
decides small-batch latency.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..errors import BackendError
from ..graph import CompiledGraph, compile_graph, unsupported_ops
from .base import Backend, Session, SessionOptions


class NumpySession(Session):
    backend_name = "numpy"

    def __init__(self, graph: CompiledGraph, options: SessionOptions) -> None:
        super().__init__(graph.inputs, graph.outputs)
        self.graph = graph
        self.options = options
        self._threads = max(1, int(options.threads))
        self._limiter = _thread_limiter(self._threads)

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        with self._limiter():
            env = execute(self.graph, feeds)
        return {n: env[n] for n in output_names}


def execute(graph: CompiledGraph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run every node in order; returns the environment holding the outputs."""
    env: dict[str, np.ndarray] = dict(graph.initializers)
    env.update(feeds)
    for node in graph.nodes:
        args = [env[x] if x else None for x in node.inputs]
        try:
            result = node.kernel.forward(*args, **node.attrs)
        except (ValueError, IndexError, TypeError, FloatingPointError) as exc:
            shapes = [None if a is None else getattr(a, "shape", None) for a in args]
            raise BackendError(
                f"node {node.name} ({node.op_type}) failed on input shapes {shapes}: {exc}"
            ) from exc
        if isinstance(result, tuple):
            for name, value in zip(node.outputs, result):
                if name:
                    env[name] = value
        else:
            env[node.outputs[0]] = result
        for name in node.free_after:
            env.pop(name, None)
    return env


def _thread_limiter(threads: int):
    """Context manager limiting BLAS threads to the profile's count, if possible."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl is optional
        import contextlib

        return contextlib.nullcontext
    # Entering threadpool_limits costs ~50 us; pay it only if it changes anything.
    try:
        from threadpoolctl import threadpool_info

        current = max((i.get("num_threads", 1) for i in threadpool_info()), default=1)
    except Exception:  # pragma: no cover
        current = threads + 1
    if current == threads:
        import contextlib

        return contextlib.nullcontext
    return lambda: threadpool_limits(limits=threads, user_api="blas")


class NumpyBackend(Backend):
    name = "numpy"

    @classmethod
    def available(cls) -> bool:
        return True

    def unsupported_ops(self, model: onnx.ModelProto) -> list[str]:
        return unsupported_ops(model)

    def load(self, model: onnx.ModelProto, options: SessionOptions | None = None) -> NumpySession:
        return NumpySession(compile_graph(model), options or SessionOptions())
