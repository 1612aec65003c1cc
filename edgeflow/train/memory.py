"""Planned peak memory of one training step, checked against a profile.

Inference memory (``edgeflow.runtime.memory``) only holds values until their last
reader. A training step also holds, until the backward pass reaches them,
every value a backward reads (the tape's ``kept`` values), what training
forwards save (Conv's im2col columns, MaxPool's argmax), the gradients in
flight, one gradient per trainable weight, and the optimizer's state
(momentum: 1 array per weight; Adam: 2).
Values the tape keeps compactly count at their stored size (Relu masks: 1
bit, region codes: 1 byte, float16: 2 bytes per element), plus the full-size
decode while the kernel that reads them runs.

The plan replays the tape's exact schedule — the same free lists the
forward and backward use — over value sizes from ONNX shape inference at
the planned batch size, so what it reports is what the step allocates
(plus numpy temporaries inside kernels, which the workspace terms estimate).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx

from ..errors import MemoryBudgetError
from ..runtime.memory import concrete_shapes, fixed_shape_model
from .autograd import _ENCODE_CHUNK, Tape, pieces_for

log = logging.getLogger("edgeflow.train")


@dataclass(frozen=True)
class TrainingMemoryPlan:
    """Bytes of one training step at ``batch_size``."""

    batch_size: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    kept_bytes: int  # activations + saved workspace alive at the end of the forward
    peak_activation_bytes: int  # activations + their gradients + scratch at the worst moment
    # (weight gradients are counted once, in gradient_bytes, for the whole step)
    peak_phase: str
    peak_node: str
    unknown: tuple[str, ...] = field(default=())

    @property
    def peak_bytes(self) -> int:
        return self.weights_bytes + self.gradient_bytes + self.optimizer_bytes + self.peak_activation_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["unknown"] = list(self.unknown)
        d["peak_bytes"] = self.peak_bytes
        return d

    def describe(self) -> str:
        mib = 2**20
        return (
            f"{self.peak_bytes / mib:.1f} MiB at batch {self.batch_size} (weights {self.weights_bytes / mib:.1f}, "
            f"gradients {self.gradient_bytes / mib:.1f}, optimizer state {self.optimizer_bytes / mib:.1f}, "
            f"activations peak {self.peak_activation_bytes / mib:.1f} in the {self.peak_phase} at {self.peak_node})"
        )


def infer_values(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]
                 ) -> dict[str, tuple[tuple[int, ...] | None, int]]:
    """(shape or None, itemsize) of every value, with the inputs fixed to ``shapes``."""
    m = fixed_shape_model(model, shapes)
    out: dict[str, tuple[tuple[int, ...] | None, int]] = {}
    for vi in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        t = vi.type.tensor_type
        try:
            item = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
        except (KeyError, TypeError, ValueError):
            item = 4
        if not t.HasField("shape") or any(not d.HasField("dim_value") for d in t.shape.dim):
            out[vi.name] = (None, item)
        else:
            out[vi.name] = (tuple(int(d.dim_value) for d in t.shape.dim), item)
    return out


def _elements(info: dict, name: str) -> int:
    shp = info.get(name, (None, 4))[0]
    return 0 if shp is None else int(np.prod(shp, dtype=np.int64))


def _input_shapes(st, shape_of: dict[str, tuple[int, ...] | None], consts: dict[str, np.ndarray]) -> list:
    """The shapes of step ``st``'s inputs (None for an absent or unknown one)."""
    return [None if not x else (consts[x].shape if x in consts else shape_of.get(x)) for x in st.inputs]


def _workspace(st, shape_of: dict[str, tuple[int, ...] | None], consts: dict[str, np.ndarray],
               unknown: list[str]) -> int:
    fn = st.kernel.workspace_fn
    if fn is None:
        return 0
    shapes = _input_shapes(st, shape_of, consts)
    try:
        return int(fn(shapes, st.bwd_attrs) or 0)
    except Exception as exc:  # noqa: BLE001 - planning goes on; the gap is reported, not hidden as 0 bytes
        what = f"workspace of {st.node.op_type} node {st.node.name or '?'}"
        log.warning("training memory plan: the %s is not estimated (%s: %s); it is listed in the plan's unknown",
                    what, type(exc).__name__, exc)
        unknown.append(what)
        return 0


class _StepReplay:
    """One replay of a tape's schedule: the bytes of each value, what is live, and the peak so far."""

    def __init__(self, tape: Tape, batch_size: int, itemsize: int) -> None:
        graph = tape.graph
        self.tape, self.batch_size, self.itemsize = tape, batch_size, itemsize
        self.shapes = concrete_shapes(graph.inputs, batch_size)
        self.info = infer_values(graph.model, self.shapes)
        self.shape_of: dict[str, tuple[int, ...] | None] = {k: v[0] for k, v in self.info.items()}
        self.shape_of.update({k: tuple(a.shape) for k, a in graph.initializers.items()})
        self.consts = tape.constants
        self.unknown: list[str] = []
        self.live: dict[str, int] = {n: self.nbytes(n) for n in self.shapes}
        self.saved: dict[int, int] = {}  # step -> what its training forward saved for the backward
        self.peak, self.phase, self.where = sum(self.live.values()), "forward", "(inputs)"

    def nbytes(self, name: str) -> int:
        if not name or name in self.consts or name in self.tape.trainable:
            return 0
        shp, item = self.info.get(name, (None, 4))
        if shp is None:
            if name.startswith("__train."):
                return 0  # running stats (per channel) or a mask (counted with its Dropout)
            self.unknown.append(name)
            return 0
        if item == 4:  # float32 values run in the compute dtype
            item = self.itemsize
        return int(np.prod(shp, dtype=np.int64)) * item

    def _reach(self, total: int, phase: str, where: str) -> None:
        """Record ``total`` bytes at ``where`` when they are a new peak."""
        if total > self.peak:
            self.peak, self.phase, self.where = total, phase, where

    def _held(self) -> int:
        return sum(self.live.values()) + sum(self.saved.values())

    # ---------------------------------------------------------------- forward

    def forward(self) -> int:
        """Replay the training forward; return the bytes kept for the backward at its end."""
        for i, st in enumerate(self.tape.steps):
            self._forward_step(i, st)
            self._keep_for_backward(st)
        return self._held()

    def _forward_step(self, i: int, st) -> None:
        """Step ``st``'s outputs and workspace, and what its training forward saves."""
        itemsize = self.itemsize
        for o in st.outputs:
            if o:
                self.live[o] = self.nbytes(o)
                if o.endswith(".mask"):
                    self.live[o] = self.nbytes(st.inputs[0]) // itemsize  # bool mask, one byte per element
        ws = _workspace(st, self.shape_of, self.consts, self.unknown) * itemsize // 4
        k = pieces_for(st, _input_shapes(st, self.shape_of, self.consts), itemsize) if ws else 1
        if k > 1:  # run over groups of samples: one group's workspace and output at a time
            ws = -(-ws // k) + -(-self.nbytes(st.outputs[0]) // k)
        if st.save and st.differentiable:
            if st.node.op_type == "Conv":
                self.saved[i] = ws
                ws = 0
            elif st.node.op_type == "MaxPool":
                self.saved[i] = self.nbytes(st.outputs[0]) // itemsize
        self._reach(self._held() + ws, "forward", st.node.name)

    def _keep_for_backward(self, st) -> None:
        """Free what no backward reads; keep the rest as it is stored (packed bits, 8-bit codes, float16)."""
        for name in st.free_train:
            self.live.pop(name, None)
        for name in st.pack_train:  # kept as packed bits (a Relu output read as output > 0)
            shp = self.info.get(name, (None, 4))[0]
            if shp is not None:
                self.live[name] = (int(np.prod(shp, dtype=np.int64)) + 7) // 8
        if st.compact_train:  # kept as 8-bit codes or float16 (compact_activations)
            now = self._held()
            for name, _, half in st.compact_train:
                small = _elements(self.info, name) * (2 if half else 1)
                now += small  # made while the value is still there, a slice at a time (temporaries)
                chunk = min(_elements(self.info, name), _ENCODE_CHUNK) * (self.itemsize + 2)
                self._reach(now + chunk, "forward", st.node.name)
                now -= self.live.get(name, 0)
                if name in self.live:
                    self.live[name] = small

    # ---------------------------------------------------------------- backward

    def backward(self) -> None:
        """Replay the backward, last step first, with the gradients in flight."""
        grads: dict[str, int] = {self.tape.target: self.nbytes(self.tape.target)}
        for i in range(len(self.tape.steps) - 1, -1, -1):
            st = self.tape.steps[i]
            if st.differentiable:
                self._backward_step(i, st, grads)

    def _backward_step(self, i: int, st, grads: dict[str, int]) -> None:
        for name, _ in st.recompute:  # made again from its kept input for this backward
            self.live.setdefault(name, self.nbytes(name))  # (from a compacted input: a slice at a time)
        new = {x: self.nbytes(x) for x, need in zip(st.inputs, st.needs) if need and x not in self.tape.trainable}
        scratch = self._scratch(i, st, new)
        self._reach(self._held() + sum(grads.values()) + sum(new.values()) + scratch, "backward", st.node.name)
        for o in st.outputs:
            grads.pop(o, None)
        for x, b in new.items():
            grads[x] = grads.get(x, 0) or b
        self.saved.pop(i, None)
        for name in st.free_backward:
            self.live.pop(name, None)

    def _scratch(self, i: int, st, new: dict[str, int]) -> int:
        """Kernel temporaries: about one array the size of the largest gradient made here
        (masks, products), plus Conv's column gradient and per-sample weight gradients.
        An element-wise backward on a compacted input runs a slice at a time (or by table lookup)."""
        compacted = self.tape.compacted_values
        slice_bytes = _ENCODE_CHUNK * self.itemsize * 4  # a slice's decoded input and the kernel's temporaries
        on_codes = st.keep_inputs and len(st.inputs) == 1 and st.inputs[0] in compacted
        scratch = slice_bytes if on_codes else max(new.values(), default=0)
        if st.recompute and any(x in compacted for _, j in st.recompute for x in self.tape.steps[j].inputs):
            scratch = max(scratch, slice_bytes)
        return scratch + self._conv_scratch(i, st)

    def _conv_scratch(self, i: int, st) -> int:
        """A Conv backward's temporaries (0 for other ops)."""
        if st.node.op_type != "Conv":
            return 0
        itemsize, shape_of = self.itemsize, self.shape_of
        w_shape = shape_of.get(st.inputs[1]) if len(st.inputs) > 1 else None
        x_shape = shape_of.get(st.inputs[0])
        depthwise = (w_shape is not None and x_shape is not None and len(w_shape) > 1 and w_shape[1] == 1
                     and st.bwd_attrs.get("group", 1) == x_shape[1] == w_shape[0])
        if depthwise:  # the offset loop (kernels/conv.py): a padded dx and one dy-sized temporary
            return self.nbytes(st.inputs[0]) + self.nbytes(st.outputs[0])
        cols = self.saved.get(i) or _workspace(st, shape_of, self.consts, self.unknown) * itemsize // 4
        wants_w = len(st.needs) > 1 and st.needs[1]
        wants_x = bool(st.needs) and st.needs[0]
        # dcols (passing the gradient on) + recomputed cols (weight gradient, when not saved)
        scratch = (cols if wants_x else 0) + (cols if wants_w and i not in self.saved else 0)
        if wants_w:
            w_shape = shape_of.get(st.inputs[1]) or ()
            graph = self.tape.graph
            n = self.shapes[graph.inputs[0].name][0] if graph.inputs else self.batch_size
            scratch += int(n) * int(np.prod(w_shape, dtype=np.int64)) * itemsize  # (N, M, CK) before the sum
        return scratch

    # ---------------------------------------------------------------- optimizer

    def optimizer(self, optimizer_slots: int) -> None:
        """The optimizer runs after the backward, when only gradients are live: its
        element-wise temporaries (1 array for SGD, ~3 for Adam) of the largest weight."""
        largest = max((int(a.size) for n, a in self.tape.graph.initializers.items() if n in self.tape.trainable),
                      default=0)
        opt_peak = largest * self.itemsize * (1 if optimizer_slots < 2 else 3)  # + the gradients (gradient_bytes)
        self._reach(opt_peak, "optimizer", "(update)")


def _weights_bytes(consts: dict[str, np.ndarray], itemsize: int, trainable_bytes: int) -> int:
    """Frozen float weights in the compute dtype, other constants as stored, and the trainable weights."""
    weights = sum(int(a.size) * itemsize for n, a in consts.items() if np.issubdtype(a.dtype, np.floating))
    weights += sum(int(a.size) * a.itemsize for a in consts.values() if not np.issubdtype(a.dtype, np.floating))
    return weights + trainable_bytes


def plan_training_step(tape: Tape, batch_size: int, *, trainable_bytes: int, optimizer_slots: int,
                       itemsize: int = 4) -> TrainingMemoryPlan:
    """Replay ``tape``'s schedule at ``batch_size`` and return the peak."""
    replay = _StepReplay(tape, batch_size, itemsize)
    kept = replay.forward()
    replay.backward()
    replay.optimizer(optimizer_slots)
    return TrainingMemoryPlan(
        batch_size=batch_size,
        weights_bytes=int(_weights_bytes(tape.constants, itemsize, trainable_bytes)),
        gradient_bytes=int(trainable_bytes),
        optimizer_bytes=int(trainable_bytes * optimizer_slots),
        kept_bytes=int(kept),
        peak_activation_bytes=int(replay.peak),
        peak_phase=replay.phase,
        peak_node=replay.where,
        unknown=tuple(dict.fromkeys(replay.unknown)),
    )


@dataclass(frozen=True)
class BudgetDecision:
    """How a step fits the budget: the micro-batch size and whether im2col columns are kept."""

    micro_batch: int
    save_workspace: bool
    plan: TrainingMemoryPlan


def fit_budget(plan_at, batch_size: int, budget_bytes: int, *, allow_accumulation: bool,
               profile_name: str = "") -> BudgetDecision:
    """Pick how to run a ``batch_size`` step within ``budget_bytes``.

    ``plan_at(micro_batch, save_workspace)`` returns a plan. Tried in order:
    the whole batch with saved im2col columns; the whole batch recomputing
    them in the backward (slower, smaller); then, when gradient accumulation
    is allowed, the largest micro-batch that fits. Otherwise a
    :class:`MemoryBudgetError` that says what would fit.
    """
    for save in (True, False):
        p = plan_at(batch_size, save)
        if p.peak_bytes <= budget_bytes:
            return BudgetDecision(batch_size, save, p)
    full = plan_at(batch_size, True)
    # Activation memory grows linearly with the batch: find the largest fit by bisection.
    lo, hi, best = 1, batch_size - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        p = plan_at(mid, False)
        if p.peak_bytes <= budget_bytes:
            best, lo = (mid, p), mid + 1
        else:
            hi = mid - 1
    where = f"profile {profile_name!r}'s " if profile_name else "the "
    if best is None:
        raise MemoryBudgetError(
            f"a training step needs {full.describe()}; even batch 1 exceeds {where}training budget of "
            f"{budget_bytes / 2**20:.1f} MiB. Freeze more layers (fine-tune the head only), use SGD without "
            "momentum instead of Adam, or train on a board with more memory",
            planned_bytes=full.peak_bytes, budget_bytes=budget_bytes,
        )
    if not allow_accumulation:
        raise MemoryBudgetError(
            f"a training step needs {full.describe()}, over {where}training budget of "
            f"{budget_bytes / 2**20:.1f} MiB. Use batch_size <= {best[0]}, or allow gradient accumulation "
            f"(grad_accumulation=True / --grad-accumulation) to run micro-batches of {best[0]}",
            planned_bytes=full.peak_bytes, budget_bytes=budget_bytes,
        )
    return BudgetDecision(best[0], False, best[1])
