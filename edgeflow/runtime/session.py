"""The runtime: a model loaded for a device profile.

``edgeflow.load(model, profile="raspberry-pi-4")`` checks the model, plans
its peak memory against the profile's budget, and opens a session on the
first backend in the profile's list that is installed here and can run
every op of the model — falling back down the list (e.g. ``ort`` ->
``numpy`` on a board without an onnxruntime wheel) and saying why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx

from .backends import SessionOptions, get_backend
from .backends.base import Session
from ..errors import BackendError, EdgeflowError, InputError, MemoryBudgetError, UnsupportedOpError
from .graph import compile_graph
from .limits import ModelLimits, RunLimits
from .memory import MemoryPlan, plan_memory
from .model import (ModelSource, TensorInfo, fix_input_shapes, infer_model_shapes, load_model,
                    resolve_input_shapes, with_input_dims)
from ..profiles import DeviceProfile, detect, get_profile

log = logging.getLogger(__name__)


def session_options(profile: DeviceProfile, threads: int | None = None, *, exact_int8: bool = False
                    ) -> SessionOptions:
    """Backend settings from the profile; threads capped at this host's cores
    (a profile for a 4-core board emulated on 2 cores must not oversubscribe)."""
    wanted = threads or profile.threads
    return SessionOptions(
        threads=max(1, min(wanted, os.cpu_count() or 1)),
        providers=tuple(profile.execution_providers) or ("CPUExecutionProvider",),
        memory_arena=profile.memory_arena,
        exact_int8=exact_int8,
    )


@dataclass
class BackendChoice:
    name: str
    tried: list[tuple[str, str]] = field(default_factory=list)  # (backend, why not)


def _why_not(b, model: onnx.ModelProto) -> tuple[str, list[str]] | None:
    """Why backend ``b`` cannot run ``model`` (None when it can), and the ops it lacks.

    Where the backend can say more (``describe_unsupported``), the reason names
    each op with its opset and the first node using it, with its subgraph path
    (``Bernoulli (opset 15) at If 'n12' / then_branch / node 'bern_in'``)."""
    missing = b.unsupported_ops(model)
    if not missing:
        return None
    describe = getattr(b, "describe_unsupported", None)
    lines = describe(model) if describe is not None else []
    if lines:
        return f"no kernel for {'; '.join(lines)}", list(missing)
    return f"cannot run op(s) {', '.join(missing)}", list(missing)


def choose_backend(model: onnx.ModelProto, profile: DeviceProfile, backend: str | None = None) -> BackendChoice:
    """The first backend of the profile's list (or ``backend``) that can run ``model``."""
    order = [backend] if backend else list(profile.backends)
    tried: list[tuple[str, str]] = []
    missing_ops: set[str] = set()
    unavailable = 0
    for name in order:
        try:
            b = get_backend(name)
        except BackendError as exc:
            tried.append((name, str(exc)))
            unavailable += 1
            continue
        why = _why_not(b, model)
        if why is not None:
            tried.append((name, why[0]))
            missing_ops.update(why[1])
            continue
        return BackendChoice(name, tried)
    reasons = "; ".join(f"{n}: {why}" for n, why in tried)
    if backend:
        others = [n for n in profile.backends if n != backend]
        hint = (f"; without --backend (backend=), profile {profile.name!r} tries {', '.join(profile.backends)}"
                if others else "")
        if unavailable == 0:
            raise UnsupportedOpError(
                f"backend {backend!r} (asked for explicitly) cannot run this model: {tried[0][1]}{hint}",
                ops=sorted(missing_ops),
            )
        raise BackendError(f"backend {backend!r} (asked for explicitly) is not usable here: {tried[0][1]}{hint}")
    if unavailable == 0:
        raise UnsupportedOpError(
            f"no backend of profile {profile.name!r} can run this model ({reasons})", ops=sorted(missing_ops)
        )
    raise BackendError(f"no usable backend for profile {profile.name!r}: {reasons}")


class Runtime:
    """A model ready to run on one device profile.

    ``input_shapes`` fixes input dims (``{"x": (1, 3, 320, 320)}``, or a
    symbolic dim name to one number), checked against the model first; the
    feeds are checked against them on every backend. The dims are fixed (and
    shapes inferred) in ``model``, the numpy backend's and the memory plan's;
    onnxruntime loads ``source_model``, the model as given, so that
    numpy-side planning never blocks it. The numpy backend's memory plan
    needs every dim; where some stay dynamic there is no plan (``plan`` is
    None, ``plan_note`` says why) and the model still runs, on any backend.
    ``shapes_source`` names where the shapes came from in messages.
    """

    def __init__(
        self,
        model: ModelSource,
        profile: "str | DeviceProfile | None" = None,
        *,
        backend: str | None = None,
        batch_size: int = 1,
        input_shapes: "dict[str, tuple[int, ...]] | None" = None,
        threads: int | None = None,
        allow_over_budget: bool = False,
        exact_int8: bool = False,
        shapes_source: str = "input_shapes",
    ) -> None:
        # checked, as given: what onnxruntime loads. Shape inference and fixed input dims are for the
        # numpy backend and the memory plan only; onnx writes fixed shapes into subgraphs (untaken If
        # branches too) where onnxruntime may refuse them, so they never reach it.
        self.profile = get_profile(profile) if profile is not None else detect()
        # limits on an untrusted model: its size and node count here, loop iterations and wall time per run
        self.source_model = load_model(model, infer_shapes=False, limits=ModelLimits.from_profile(self.profile))
        self.run_limits = RunLimits.from_profile(self.profile)
        self.exact_int8 = exact_int8
        self._shapes_source = shapes_source  # where input_shapes came from, for the messages (--shape)
        fixed = resolve_input_shapes(self.source_model, input_shapes, source=shapes_source) if input_shapes else {}
        self.input_shapes = fixed
        choice = choose_backend(self.source_model, self.profile, backend)
        self.backend_name = choice.name
        self.fallbacks = choice.tried
        for name, why in choice.tried:
            log.info("backend %s skipped for profile %s: %s", name, self.profile.name, why)
        self.plan_note = ""
        planning = self._planning_model(fixed)
        self.model = planning if planning is not None else self.source_model
        graph = self._compile() if planning is not None else None
        self.plan = self._plan(graph, batch_size)
        if self.plan is not None and self.plan.peak_bytes > self.profile.memory_budget_bytes and not allow_over_budget:
            raise MemoryBudgetError(
                f"planned peak memory {self.plan.peak_bytes / 2**20:.1f} MiB at batch {batch_size} "
                f"(weights {self.plan.weights_bytes / 2**20:.1f} MiB, activations peak at node "
                f"{self.plan.peak_node}) exceeds profile {self.profile.name!r}'s budget of "
                f"{self.profile.memory_budget_mb} MiB; use a smaller batch, quantize the model, "
                "or pass --allow-over-budget (allow_over_budget=True in Python) to run anyway",
                planned_bytes=self.plan.peak_bytes,
                budget_bytes=self.profile.memory_budget_bytes,
            )
        chosen = get_backend(self.backend_name)
        options = session_options(self.profile, threads, exact_int8=self.exact_int8)
        # A backend that runs the compiled graph itself takes the one just
        # planned, rather than compiling (and pre-packing weights) again.
        load_compiled = getattr(chosen, "load_compiled", None)
        if self.backend_name == "numpy" and graph is not None and load_compiled is not None:
            self.session: Session = load_compiled(graph, options)
        elif self.backend_name == "numpy":
            self.session = chosen.load(self.model, options)
        else:
            self.session = chosen.load(self.source_model, options)
            if fixed:  # feeds are checked against the dims given, as on the numpy backend
                self.session.inputs = with_input_dims(self.session.inputs, fixed)
        self.session.limits = self.run_limits

    def _planning_model(self, fixed: dict) -> onnx.ModelProto | None:
        """The model with shapes inferred (and ``fixed`` input dims): the numpy backend's, and the plan's.

        On the numpy backend its errors are the user's (nothing else can run
        the model); on another backend a failure leaves only a note (and no
        plan: that backend plans itself) and None."""
        try:
            model = infer_model_shapes(self.source_model)
            if fixed:
                model = fix_input_shapes(model, fixed, source=self._shapes_source)
            return model
        except EdgeflowError as exc:
            if self.backend_name == "numpy":
                raise
            self.plan_note = f"no numpy memory plan: {exc}"
            log.info("%s", self.plan_note)
            return None

    def _compile(self):
        """The numpy graph (for the numpy backend, and the memory plan of any backend)."""
        if self.backend_name == "numpy":
            return compile_graph(self.model)  # its errors are the user's: nothing else can run it
        try:
            # the graph onnxruntime gets, for the budget estimate only: no numpy rewrites
            return compile_graph(self.model, optimize=False)
        except EdgeflowError as exc:  # onnxruntime plans itself: never blocked by numpy-side planning
            self.plan_note = f"no numpy memory plan: {exc}"
            log.info("%s", self.plan_note)
            return None

    def _plan(self, graph, batch_size: int) -> MemoryPlan | None:
        if graph is None:
            return None
        try:
            return plan_memory(graph, batch_size)
        except EdgeflowError as exc:  # e.g. dynamic dims: the model still runs, unplanned
            self.plan_note = f"no memory plan: {exc}"
            log.info("%s", self.plan_note)
            return None

    @property
    def inputs(self) -> list[TensorInfo]:
        return self.session.inputs

    @property
    def outputs(self) -> list[TensorInfo]:
        return self.session.outputs

    def run(
        self,
        feeds: "Mapping[str, np.ndarray] | np.ndarray",
        output_names: Sequence[str] | None = None,
    ) -> dict[str, np.ndarray]:
        """Run on a feed dict (or one array for a single-input model)."""
        if isinstance(feeds, np.ndarray):
            if len(self.inputs) != 1:
                raise InputError(
                    f"the model has {len(self.inputs)} inputs {[i.name for i in self.inputs]}; pass a dict"
                )
            feeds = {self.inputs[0].name: feeds}
        return self.session.run(feeds, output_names)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """First output for a single-input model: ``y = rt(x)``."""
        return next(iter(self.run(x).values()))

    def describe(self) -> dict:
        return {
            "profile": self.profile.name,
            "backend": self.backend_name,
            "fallbacks": [{"backend": n, "reason": why} for n, why in self.fallbacks],
            "memory_plan": self.plan.to_dict() if self.plan else None,
            "memory_plan_note": self.plan_note,
            "budget_bytes": self.profile.memory_budget_bytes,
        }


def load(model: ModelSource, profile: "str | DeviceProfile | None" = None, **kwargs) -> Runtime:
    """Load ``model`` for ``profile`` (detected from the host when omitted)."""
    return Runtime(model, profile, **kwargs)
