"""Limits on running an untrusted model: loop iterations and wall time per run; node count and file size per model.

A model is code: a ``Loop`` whose trip count is 2**62 runs for ever, a protobuf
of a million nodes takes seconds and gigabytes to parse and check. The limits
come from the device profile (``max_loop_iterations``, ``max_run_seconds``,
``max_model_nodes``, ``max_model_file_mb``; defaults below) and each refusal is
a :class:`~edgeflow.errors.ResourceLimitError` that names the limit and the
profile field that raises it.

Per run (:class:`RunLimits`), :meth:`Session.run <edgeflow.runtime.backends.base.Session.run>`
opens a :class:`RunBudget` for the duration of the call:

- the numpy backend checks the wall-time deadline between nodes (subgraph
  nodes included) and counts the body runs of Loop, Scan and SequenceMap
  against ``max_loop_iterations`` (all loops of the run together);
- onnxruntime cannot be stopped between nodes from Python, so a watchdog
  thread sets its ``RunOptions.terminate`` flag at the deadline, which
  onnxruntime honours between nodes and between Loop iterations.

A single kernel call is never interrupted; the device health check runs the
model in a child process that the parent kills at a deadline, under an
address-space limit (:mod:`edgeflow.device.health`).
"""

from __future__ import annotations

import logging

import contextlib
import contextvars
import heapq
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import ResourceLimitError

log = logging.getLogger("edgeflow.runtime.limits")

DEFAULT_MAX_LOOP_ITERATIONS = 1_000_000
DEFAULT_MAX_RUN_SECONDS = 60.0
DEFAULT_MAX_MODEL_NODES = 100_000
DEFAULT_MAX_MODEL_FILE_BYTES = 2**31 - 1  # protobuf's own limit: without a profile, only that


def _profile_name(profile: Any) -> str:
    return f"profile {getattr(profile, 'name', '?')!r}"


@dataclass(frozen=True)
class RunLimits:
    """What one run of a model may take: body runs of all its loops together, and wall-clock seconds."""

    max_loop_iterations: int = DEFAULT_MAX_LOOP_ITERATIONS
    max_run_seconds: float = DEFAULT_MAX_RUN_SECONDS
    source: str = "the default limits"  # who set them, for the messages: "profile 'raspberry-pi-4'"

    @classmethod
    def from_profile(cls, profile: Any) -> "RunLimits":
        return cls(int(getattr(profile, "max_loop_iterations", DEFAULT_MAX_LOOP_ITERATIONS)),
                   float(getattr(profile, "max_run_seconds", DEFAULT_MAX_RUN_SECONDS)), _profile_name(profile))


@dataclass(frozen=True)
class ModelLimits:
    """What a model file may be: its size in bytes (checked before parsing) and its node count (subgraphs included)."""

    max_nodes: int = DEFAULT_MAX_MODEL_NODES
    max_file_bytes: int = DEFAULT_MAX_MODEL_FILE_BYTES
    source: str = "the default limits"

    @classmethod
    def from_profile(cls, profile: Any) -> "ModelLimits":
        mb = int(getattr(profile, "max_model_file_mb", 0) or getattr(profile, "memory_mb", 0) or 0)
        return cls(int(getattr(profile, "max_model_nodes", DEFAULT_MAX_MODEL_NODES)),
                   mb * 2**20 if mb else DEFAULT_MAX_MODEL_FILE_BYTES, _profile_name(profile))

    def check_file_size(self, size: int, what: str) -> None:
        if size > self.max_file_bytes:
            raise ResourceLimitError(
                f"{what} is {size / 2**20:.1f} MiB, over the limit of {self.max_file_bytes / 2**20:.0f} MiB "
                f"({self.source}); refusing to parse it. If the model is trusted and the board can hold it, "
                "raise max_model_file_mb in the profile", limit="max_model_file_mb")

    def check_node_count(self, count: int, what: str = "the model") -> None:
        if count > self.max_nodes:
            raise ResourceLimitError(
                f"{what} has {count:,} nodes (subgraphs included), over the limit of {self.max_nodes:,} "
                f"({self.source}); if the model is trusted, raise max_model_nodes in the profile",
                limit="max_model_nodes")


class RunBudget:
    """The state of one run against its :class:`RunLimits`."""

    __slots__ = ("limits", "deadline", "iterations", "expired")

    def __init__(self, limits: RunLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + float(limits.max_run_seconds)
        self.iterations = 0
        self.expired = False  # set by the watchdog (onnxruntime) when the deadline passed

    def time_error(self, where: str = "") -> ResourceLimitError:
        at = f" (stopped at {where})" if where else ""
        return ResourceLimitError(
            f"the model ran longer than {self.limits.max_run_seconds:g} s, the limit of one run "
            f"({self.limits.source}){at}; a runaway or hostile model? If it is trusted and needs the time, "
            "raise max_run_seconds in the profile", limit="max_run_seconds")

    def check_time(self, where: str = "") -> None:
        if time.monotonic() > self.deadline:
            raise self.time_error(where)

    def iteration(self, where: str) -> None:
        """One more body run of a Loop/Scan/SequenceMap (``where``: its path, e.g. ``Loop 'n3' / body``)."""
        self.iterations += 1
        if self.iterations > self.limits.max_loop_iterations:
            raise ResourceLimitError(
                f"the model ran more than {self.limits.max_loop_iterations:,} loop iterations in one run "
                f"(stopped at {where}), the limit of {self.limits.source}; a runaway or hostile loop "
                "(e.g. a trip count of 2**62)? If it is trusted and needs them, raise max_loop_iterations "
                "in the profile", limit="max_loop_iterations")
        if time.monotonic() > self.deadline:
            raise self.time_error(where)


_CURRENT: contextvars.ContextVar[RunBudget | None] = contextvars.ContextVar("edgeflow_run_budget", default=None)


def current_budget() -> RunBudget | None:
    """The budget of the run in progress in this thread/context (None outside a limited run)."""
    return _CURRENT.get()


@contextlib.contextmanager
def run_budget(limits: RunLimits | None) -> Iterator[RunBudget | None]:
    """Open a :class:`RunBudget` for one run (nothing when ``limits`` is None)."""
    if limits is None:
        yield None
        return
    budget = RunBudget(limits)
    token = _CURRENT.set(budget)
    try:
        yield budget
    finally:
        _CURRENT.reset(token)


class Watchdog:
    """One daemon thread that calls a function at a deadline unless disarmed first.

    Cheap per run: arming pushes onto a heap and wakes the thread only when
    the new deadline is earlier than the one it sleeps towards; disarming
    drops finished entries from the top at once (runs end in the order they
    started, so the heap stays as small as the number of runs in progress)."""

    IDLE_S = 30.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._sleeping_until = 0.0

    def arm(self, deadline: float, fn: Callable[[], None]) -> int:
        with self._cond:
            token = next(self._ids)
            heapq.heappush(self._heap, (deadline, token, fn))
            self._live.add(token)
            if self._thread is None:
                self._sleeping_until = deadline
                self._thread = threading.Thread(target=self._loop, name="edgeflow-run-watchdog", daemon=True)
                self._thread.start()
            elif deadline < self._sleeping_until:
                self._cond.notify()
        return token

    def disarm(self, token: int) -> None:
        with self._cond:
            self._live.discard(token)
            self._drop_disarmed()

    def _drop_disarmed(self) -> None:
        while self._heap and self._heap[0][1] not in self._live:
            heapq.heappop(self._heap)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._drop_disarmed()
                now = time.monotonic()
                if not self._heap:
                    self._sleeping_until = now + self.IDLE_S
                    self._cond.wait(self.IDLE_S)
                    self._drop_disarmed()
                    if not self._heap:
                        self._thread = None  # idle: the next arm starts a new thread
                        return
                    continue
                deadline, token, fn = self._heap[0]
                if now < deadline:
                    self._sleeping_until = deadline
                    self._cond.wait(deadline - now)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(token)
            try:
                fn()
            except Exception:  # noqa: BLE001 - a watchdog callback must never kill the watchdog
                log.exception("a watchdog callback failed; the watchdog goes on")


WATCHDOG = Watchdog()
