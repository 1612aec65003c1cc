"""Reverse-mode autograd over a compiled ONNX graph.

A :class:`Tape` is built once per (graph, trainable set, target output). It
decides, before any data flows:

- which values *require grad* (they depend on a trainable initializer) and
  which of those *reach the target* — only the nodes on that path run a
  backward, so a frozen body costs a forward pass and nothing else;
- that every node on the path has a backward (else one error naming them all);
- which forward values each backward reads (``Kernel.backward_uses``), so
  everything else is freed during the forward, and when each kept value's
  last backward reader has run, so it is freed during the backward;
- how training mode changes a node: BatchNormalization switches to batch
  statistics and returns running stats (written back as buffer updates),
  Dropout draws a fresh seeded mask per step and returns the mask;
- with ``compact_activations`` (off by default here; the trainer turns it on
  outside full mode), which kept inputs of piecewise ops (HardSwish,
  HardSigmoid: :data:`COMPACT_INPUT`) are stored as 8-bit region codes or
  float16 instead of float: approximate gradients within a stated bound.

:meth:`Tape.forward` then runs the schedule and returns a :class:`Forward`
record; :meth:`Tape.backward` walks it in reverse from the target's gradient
and returns the gradient of every trainable initializer.

Hooks (``Tape.add_hook``) let quantization-aware training replace a node's
input by a fake-quantized value and mask its gradient (straight-through
estimator) without the tape knowing about quantization.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import TrainingError
from ..runtime.graph import CompiledGraph, Node
from ..kernels import Kernel, get_kernel
from ..kernels.rnn_backward import training_limits as _recurrent_limits

log = logging.getLogger(__name__)

#: Input positions that never get a gradient (statistics, ratios, shapes...).
NON_DIFFERENTIABLE_INPUTS: dict[str, frozenset[int]] = {
    "BatchNormalization": frozenset({3, 4}),
    "Dropout": frozenset({1, 2}),
    "Reshape": frozenset({1}),
    "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}),
    "Clip": frozenset({1, 2}),
    "Where": frozenset({0}),
    "Split": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}),
    "Expand": frozenset({1}),
    "Tile": frozenset({1}),
    "CastLike": frozenset({1}),
    "Pad": frozenset({1, 2, 3}),
    "Resize": frozenset({1, 2, 3}),
    "LSTM": frozenset({4}),  # sequence_lens
    "GRU": frozenset({4}),
    "RNN": frozenset({4}),
}
#: Ops whose backward covers only some settings: op -> (attrs, input names) -> why not (None: covered).
#: Checked when the tape is built, so an uncovered setting is one line at Trainer construction.
BACKWARD_LIMITS: dict[str, Callable[[dict[str, Any], list[str]], str | None]] = {
    op: (lambda attrs, inputs, _op=op: _recurrent_limits(_op, attrs, inputs)) for op in ("LSTM", "GRU", "RNN")
}
#: Ops whose outputs past the first carry no gradient (stats, masks, indices).
FIRST_OUTPUT_ONLY = frozenset({"BatchNormalization", "Dropout", "MaxPool"})

#: Inputs whose *values* a backward reads only to form the gradient of other
#: inputs: position -> the input positions whose gradient needs them. An
#: input whose listed gradients are all unwanted is not kept for the
#: backward (the backward gets a zero-strided stand-in of the right shape and
#: dtype). This is what makes bias-only training cheap (TinyTL): a Conv's
#: input is needed for its weight's gradient, not for its bias's nor to pass
#: the gradient on. An empty tuple: only the shape is ever read.
VALUES_NEEDED_FOR: dict[str, dict[int, tuple[int, ...]]] = {
    "Conv": {0: (1,)},
    "ConvTranspose": {0: (1,)},
    "Gemm": {0: (1,), 1: (0,)},
    "MatMul": {0: (1,), 1: (0,)},
    "Mul": {0: (1,), 1: (0,)},
    "Div": {0: (1,)},
    "Add": {0: (), 1: ()},
    "Sub": {0: (), 1: ()},
    "Reshape": {0: ()},
    "Flatten": {0: ()},
    "Squeeze": {0: ()},
    "Unsqueeze": {0: ()},
    "GlobalAveragePool": {0: ()},
    "Slice": {0: ()},
    "Expand": {0: ()},
    "Tile": {0: ()},
    "Clip": {0: ()},  # its backward reads the output and the bounds
}
#: Frozen-statistics BatchNormalization reads x only for its scale's gradient.
_BN_EVAL_VALUES = {0: (1,)}
#: Ops whose backward reads their kept output only as ``output > 0``: where no
#: other backward needs that value it is kept as packed bits (1/32 of float32)
#: from its last forward reader on, and the backward gets the boolean mask,
#: which gives the same gradient bit for bit.
OUTPUT_READ_AS_POSITIVE_MASK = frozenset({"Relu"})
#: Ops whose samples are independent, run over groups of samples when their workspace is large.
_BY_SAMPLES = frozenset({"Conv"})
#: A Conv's forward workspace (im2col-style columns) allowed per byte of its input before the
#: training forward runs it over groups of samples.
WORKSPACE_PER_INPUT = 4
#: Element-wise ops of one input whose output, when a backward wants it, is recomputed in the
#: backward from their input (kept anyway for their own backward) instead of being kept: a
#: HardSwish output that an SE block's Mul reads costs nothing between the passes.
RECOMPUTE_FROM_INPUT = frozenset({"HardSwish", "HardSigmoid", "LeakyRelu", "Gelu", "Swish", "Mish", "Softsign",
                                  "Erf", "Elu", "Selu", "Softplus"})
#: MaxPool with its argmax saved (``forward_train``) reads its input only for the shape.
_SAVED_ARGMAX_NEEDS_NO_INPUT = frozenset({"MaxPool"})


def _hardswish_regions(attrs: dict[str, Any]) -> "Piecewise":
    # the kernel's backward: 0 where x <= -3, 1 where x >= 3, x / 3 + 0.5 between (reads x only there)
    return Piecewise(-3.0, 3.0, lambda x: (x <= x.dtype.type(-3), x >= x.dtype.type(3)))


def _hardsigmoid_regions(attrs: dict[str, Any]) -> "Piecewise | None":
    a, b = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
    if not a > 0:
        return None

    def regions(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = x * x.dtype.type(a) + x.dtype.type(b)  # as the kernel's backward computes it
        return t <= 0, t >= 1

    # The gradient is alpha where 0 < alpha x + beta < 1 and 0 elsewhere: the region alone gives it
    # exactly. Its output, where a later backward reads it, is an SE block's gate: it scales the whole
    # main path's gradient, so it is recomputed from the exact input (N x C values: nothing to save).
    return Piecewise(-b / a, (1 - b) / a, regions, half_when_recomputed=False)


#: Ops whose backward reads input 0 only through a piecewise function that is constant outside an
#: interval (lo, hi): op -> attrs -> :class:`Piecewise` (None: not this node). With
#: ``compact_activations`` such an input, when no other backward reads it, is kept from its last
#: forward reader on as 8-bit codes (:class:`RegionCodes`: 1/4 of float32) or, where the tape
#: recomputes the op's output from it (an SE block's Mul reads a HardSwish output: that needs the
#: value itself, HardSwish's upper tail is x), as float16 (:class:`HalfValues`: 1/2; or exact, for
#: ops that say so: HardSigmoid). Both approximate the input; the rest of the step is unchanged.
COMPACT_INPUT: dict[str, Callable[[dict[str, Any]], "Piecewise | None"]] = {
    "HardSwish": _hardswish_regions,
    "HardSigmoid": _hardsigmoid_regions,
}
#: Elements per slice when a value is encoded (bounds the encoder's temporaries).
_ENCODE_CHUNK = 1 << 14

#: A hook: (value, training) -> (value to use, gradient mask or None).
Hook = Callable[[np.ndarray, bool], "tuple[np.ndarray, np.ndarray | None]"]

_TRUE = np.array(True)


@dataclass
class Step:
    """One node as the trainer runs it (training-mode variant included)."""

    node: Node
    kernel: Kernel  # kernel used in training (Dropout: the opset-12 form)
    inputs: list[str]  # training-mode inputs (Dropout gets ratio + training_mode)
    outputs: list[str]  # training-mode outputs (internal names for stats, masks)
    train_attrs: dict[str, Any]
    bwd_attrs: dict[str, Any]
    needs: tuple[bool, ...] = ()
    differentiable: bool = False
    save: bool = False  # call kernel.forward_train and keep what it saves
    keep_inputs: bool = False
    keep_outputs: bool = False
    shape_only: tuple[int, ...] = ()  # input positions kept as (shape, dtype) only
    reseed: bool = False  # Dropout: a fresh seed per training step
    free_train: list[str] = field(default_factory=list)
    free_eval: list[str] = field(default_factory=list)
    free_backward: list[str] = field(default_factory=list)
    pack_train: list[str] = field(default_factory=list)  # values kept from here on as packed > 0 masks
    compact_train: list[tuple[str, "Piecewise", bool]] = field(default_factory=list)  # (value, regions, as float16)
    recompute: list[tuple[str, int]] = field(default_factory=list)  # (value, producing step) made again here
    state_updates: list[tuple[str, str]] = field(default_factory=list)  # (output, buffer)


@dataclass
class Forward:
    """What one training forward leaves for the backward."""

    env: dict[str, np.ndarray]
    saved: dict[int, Any]
    args: dict[int, list]  # actual (hooked) inputs of steps that have hooks
    masks: dict[tuple[int, int], np.ndarray]
    output: np.ndarray
    state: dict[str, np.ndarray]  # buffer name -> new value (BatchNorm running stats)
    shapes: dict[tuple[int, int], tuple[tuple[int, ...], np.dtype]] = field(default_factory=dict)


def _is_float(types: dict[str, str], name: str) -> bool:
    t = types.get(name)
    return t is None or t.startswith("float")


def refuse_control_flow(graph: CompiledGraph) -> None:
    """Training has no backward through subgraphs: say so in one line."""
    flow = next((n for n in graph.nodes if n.subgraphs), None)
    if flow is not None:
        raise TrainingError(
            f"training does not differentiate through control flow: node '{flow.name}' ({flow.op_type}) "
            "runs a subgraph; train a model without If/Loop/Scan/SequenceMap, or use this one for inference only"
        )


class Tape:
    """Forward/backward schedule for one graph, trainable set and target."""

    def __init__(
        self,
        graph: CompiledGraph,
        trainable: set[str] | frozenset[str],
        target: str,
        *,
        save_workspace: bool = True,
        constants: dict[str, np.ndarray] | None = None,
        bn_training: bool = True,
        compact_activations: bool = False,
    ) -> None:
        refuse_control_flow(graph)
        if target not in {n for s in graph.nodes for n in s.outputs} | set(graph.input_names):
            raise TrainingError(f"output {target!r} is not produced by the graph; outputs: {graph.output_names}")
        self.graph = graph
        self.target = target
        self.trainable = frozenset(trainable)
        self.save_workspace = save_workspace
        # False: BatchNormalization keeps its running statistics (inference mode) while its
        # scale and bias may still train: the usual transfer-learning setting (TinyTL).
        self.bn_training = bool(bn_training)
        # True: inputs read by a backward only through a piecewise function (COMPACT_INPUT) are kept in
        # 8 (or 16) bits; the gradients are then close to, not equal to, the exact ones.
        self.compact_activations = bool(compact_activations)
        self.constants: dict[str, np.ndarray] = dict(constants if constants is not None else graph.initializers)
        self.hooks: dict[int, list[tuple[int, Hook]]] = {}
        self._pieces_cache: dict[tuple[int, tuple[int, ...]], int] = {}
        self.steps = [self._step(n) for n in graph.nodes]
        self._analyse()

    # ------------------------------------------------------------ building

    def _step(self, node: Node) -> Step:
        attrs = dict(node.attrs)
        inputs, outputs, kernel = list(node.inputs), list(node.outputs), node.kernel
        step_updates: list[tuple[str, str]] = []
        reseed = False
        if node.op_type == "BatchNormalization" and not node.domain and not self.bn_training:
            attrs["training_mode"] = 0
        elif node.op_type == "BatchNormalization" and not node.domain:
            attrs["training_mode"] = 1
            attrs["n_outputs"] = 3
            outputs = (outputs + ["", ""])[:3]
            for k, pos in ((1, 3), (2, 4)):
                if not outputs[k]:
                    outputs[k] = f"__train.{node.name}.running{k}"
                if len(inputs) > pos and inputs[pos] in self.graph.initializers:
                    step_updates.append((outputs[k], inputs[pos]))
        elif node.op_type == "Dropout" and not node.domain:
            kernel = get_kernel("Dropout", "", 13, None)
            ratio = inputs[1] if len(inputs) > 1 else ""
            if "ratio" in attrs:  # opset < 12: ratio was an attribute
                ratio = f"__train.{node.name}.ratio"
                self.constants[ratio] = np.array(attrs.pop("ratio"), np.float32)
            inputs = [inputs[0], ratio, "__train.true"]
            outputs = [outputs[0], outputs[1] if len(outputs) > 1 and outputs[1] else f"__train.{node.name}.mask"]
            attrs = {"seed": attrs.get("seed"), "n_outputs": 2}
            reseed = True
        bwd = {k: v for k, v in attrs.items() if k != "n_outputs"}
        return Step(node, kernel, inputs, outputs, attrs, bwd, reseed=reseed, state_updates=step_updates)

    def _analyse(self) -> None:
        types = self.graph.types
        req: set[str] = set(self.trainable)
        diff_inputs: list[list[int]] = []
        for st in self.steps:
            nd = NON_DIFFERENTIABLE_INPUTS.get(st.node.op_type, frozenset()) if not st.node.domain else frozenset()
            idx = [i for i, x in enumerate(st.inputs) if x and x in req and i not in nd]
            diff_inputs.append(idx)
            if idx:
                outs = st.outputs[:1] if st.node.op_type in FIRST_OUTPUT_ONLY else st.outputs
                req.update(o for o in outs if o and _is_float(types, o))
        useful: set[str] = {self.target}
        for st, idx in zip(reversed(self.steps), reversed(diff_inputs)):
            if idx and any(o in useful for o in st.outputs if o):
                useful.update(st.inputs[i] for i in idx)
        missing: list[str] = []
        for st, idx in zip(self.steps, diff_inputs):
            needs = tuple(i in idx and st.inputs[i] in useful for i in range(len(st.inputs)))
            st.needs = needs
            st.differentiable = any(needs) and any(o in useful for o in st.outputs if o)
            if not st.differentiable:
                continue
            if not st.kernel.trainable:
                missing.append(f"{st.node.op_type} (node {st.node.name!r})")
                continue
            limit = None if st.node.domain else BACKWARD_LIMITS.get(st.node.op_type)
            why = limit(st.node.attrs, st.inputs) if limit is not None else None
            if why:
                raise TrainingError(
                    f"{st.node.op_type} node {st.node.name!r}: {why}; re-export the layer with the defaults, "
                    "or freeze it and every layer before it (freeze=[prefix, ...])"
                )
            uses = st.kernel.backward_uses
            st.keep_inputs = uses in ("all", "inputs")
            st.keep_outputs = uses in ("all", "outputs")
            st.shape_only = self._shape_only(st) if st.keep_inputs else ()
            st.save = self._saves(st)
            self._argmax_only(st)
        if missing:
            raise TrainingError(
                f"{len(missing)} op(s) on the gradient path have no backward kernel: {', '.join(missing)}. "
                "Freeze the layers before them (freeze=[prefix, ...] so that no trainable weight feeds them) "
                "or re-export the model without these ops"
            )
        self.reaches_target = frozenset(p for p in self.trainable if p in useful)
        self._lifetimes()

    def _shape_only(self, st: Step) -> tuple[int, ...]:
        """Input positions whose values this step's backward will not read."""
        if st.node.domain:
            return ()
        table = VALUES_NEEDED_FOR.get(st.node.op_type)
        if st.node.op_type == "BatchNormalization" and not st.train_attrs.get("training_mode"):
            table = _BN_EVAL_VALUES
        if not table:
            return ()
        return tuple(pos for pos, uses in table.items()
                     if pos < len(st.inputs) and st.inputs[pos] and not any(
                         j < len(st.needs) and st.needs[j] for j in uses))

    def _argmax_only(self, st: Step) -> None:
        """MaxPool keeps only its input's shape when its argmax is saved (and the values when it is not)."""
        if st.node.op_type in _SAVED_ARGMAX_NEEDS_NO_INPUT and not st.node.domain and st.keep_inputs:
            st.shape_only = (0,) if st.save else ()

    def _saves(self, st: Step) -> bool:
        # Conv's saved columns serve only its weight's gradient.
        if not (self.save_workspace and st.differentiable and st.kernel.forward_train is not None):
            return False
        if st.node.op_type in ("Conv", "ConvTranspose") and 0 in st.shape_only:
            return False
        if st.node.op_type == "Conv" and len(st.inputs) > 1:  # the depthwise backward reads no columns
            w = self.constants.get(st.inputs[1], self.graph.initializers.get(st.inputs[1]))
            if w is not None and w.ndim > 1 and w.shape[1] == 1 and st.train_attrs.get("group", 1) == w.shape[0]:
                return False
        return True

    def _lifetimes(self) -> None:
        """Decide, per step, which values the forward frees, packs or compacts and the backward recomputes or frees."""
        self._reset_lifetimes()
        persistent = set(self.constants) | set(self.trainable) | {self.target}
        kept, as_values, as_masks, piecewise = self._backward_reads()
        compact, packed, recomputed, half = self._storage(persistent, kept, as_values, as_masks, piecewise)
        self._free_after_last_read(persistent, kept, packed, compact, recomputed, half)
        self._free_after_first_backward_reader(persistent, recomputed)
        self._publish_lifetimes(persistent, kept, packed, recomputed)

    def _reset_lifetimes(self) -> None:
        """Empty every step's free / pack / compact / recompute lists."""
        for st in self.steps:
            st.free_train, st.free_eval, st.free_backward, st.pack_train, st.recompute = [], [], [], [], []
            st.compact_train = []

    def _backward_reads(self) -> "tuple[set[str], set[str], set[str], dict[str, list[tuple[int, Piecewise]]]]":
        """The values the backward reads: (kept, read as numbers, read as > 0 masks, read by piecewise ops)."""
        kept: set[str] = set()
        as_values: set[str] = set()  # kept values some backward reads as numbers
        as_masks: set[str] = set()  # kept outputs read only as output > 0
        piecewise: dict[str, list[tuple[int, Piecewise]]] = {}  # values read as a piecewise op's input 0
        for i, st in enumerate(self.steps):
            if st.differentiable:
                if st.keep_inputs:
                    ins = {x for p, x in enumerate(st.inputs) if x and p not in st.shape_only}
                    kept.update(ins)
                    pw = self._piecewise(i, st)
                    if pw is not None:
                        piecewise.setdefault(st.inputs[0], []).append((i, pw))
                        ins.discard(st.inputs[0])
                    as_values.update(ins)
                if st.keep_outputs:
                    outs = {o for o in st.outputs if o}
                    kept.update(outs)
                    masks = st.node.op_type in OUTPUT_READ_AS_POSITIVE_MASK and not st.node.domain
                    (as_masks if masks else as_values).update(outs)
        return kept, as_values, as_masks, piecewise

    def _storage(self, persistent: set[str], kept: set[str], as_values: set[str], as_masks: set[str],
                 piecewise: "dict[str, list[tuple[int, Piecewise]]]",
                 ) -> "tuple[dict[str, Piecewise], set[str], dict[str, int], set[str]]":
        """How kept values live between the passes: (compacted, packed, recomputed, recomputed-from inputs)."""
        # a value read by one piecewise op and by no other backward: compact (when asked), else as before
        compact = {x: r[0][1] for x, r in piecewise.items()
                   if len(r) == 1 and x not in as_values and x not in as_masks and x not in persistent}
        as_values.update(x for x in piecewise if x not in compact)
        packed = as_masks - as_values - persistent
        recomputed = self._recomputable(kept - persistent - packed)
        half = self._settle_compact(compact, recomputed)
        return compact, packed, recomputed, half

    def _settle_compact(self, compact: "dict[str, Piecewise]", recomputed: dict[str, int]) -> set[str]:
        """Drop recomputed values and exact-when-recomputed-from inputs from ``compact``; return the inputs
        that recomputed outputs are made from."""
        for x in recomputed:
            compact.pop(x, None)
        # float16 where the op's output is recomputed from it: a later backward reads that output's values
        half = {self.steps[j].inputs[0] for j in recomputed.values()}
        for x in [x for x, pw in compact.items() if x in half and not pw.half_when_recomputed]:
            del compact[x]
        return half

    def _last_reads(self) -> dict[str, int]:
        """Each value's last forward reader (its producer when nothing reads it)."""
        last_read: dict[str, int] = {}
        for i, st in enumerate(self.steps):
            for x in st.inputs:
                if x:
                    last_read[x] = i
            for o in st.outputs:
                if o and o not in last_read:
                    last_read[o] = i
        return last_read

    def _free_after_last_read(self, persistent: set[str], kept: set[str], packed: set[str],
                              compact: "dict[str, Piecewise]", recomputed: dict[str, int], half: set[str]) -> None:
        """After its last forward reader a value is freed, or (training) packed or compacted when kept."""
        state_outputs = {o for st in self.steps for o, _ in st.state_updates}
        for name, i in self._last_reads().items():
            if name in persistent or name in state_outputs:
                continue
            self.steps[i].free_eval.append(name)
            if name not in kept or name in recomputed:
                self.steps[i].free_train.append(name)
            elif name in packed:
                self.steps[i].pack_train.append(name)
            elif name in compact:
                self.steps[i].compact_train.append((name, compact[name], name in half))

    def _free_after_first_backward_reader(self, persistent: set[str], recomputed: dict[str, int]) -> None:
        """Free each kept value after its first-scheduled backward reader; recompute values before their readers."""
        # During the backward a kept value dies after its earliest-scheduled reader ran.
        first_bwd: dict[str, int] = {}
        for i, st in enumerate(self.steps):
            if not st.differentiable:
                continue
            ins = [x for p, x in enumerate(st.inputs) if p not in st.shape_only] if st.keep_inputs else []
            names = ins + (st.outputs if st.keep_outputs else [])
            for x in names:
                if x and x not in first_bwd:
                    first_bwd[x] = i
                if x in recomputed and (x, recomputed[x]) not in st.recompute:
                    st.recompute.append((x, recomputed[x]))
        for name, i in first_bwd.items():
            if name not in persistent:
                self.steps[i].free_backward.append(name)

    def _publish_lifetimes(self, persistent: set[str], kept: set[str], packed: set[str],
                           recomputed: dict[str, int]) -> None:
        """Set the tape's kept / packed / recomputed / compacted value sets."""
        self.kept_values = frozenset(kept - persistent - set(recomputed))
        self.packed_values = frozenset(packed)
        self.recomputed_values = frozenset(recomputed)
        #: value -> "codes8" or "float16": kept values stored approximately (compact_activations)
        self.compacted_values = {n: ("float16" if half16 else "codes8")
                                 for st in self.steps for n, _, half16 in st.compact_train}

    def _piecewise(self, i: int, st: Step) -> "Piecewise | None":
        """How step ``i``'s backward reads its input 0, when it is compactable (else None)."""
        if (not self.compact_activations or st.node.domain or i in self.hooks or st.save
                or not st.inputs or not st.inputs[0] or 0 in st.shape_only):
            return None
        rule = COMPACT_INPUT.get(st.node.op_type)
        if rule is None or any(x and x not in self.constants for x in st.inputs[1:]):
            return None
        return rule(st.train_attrs)

    def set_compact_activations(self, flag: bool) -> None:
        """Keep piecewise ops' inputs in 8/16 bits (approximate gradients) or as they are (exact)."""
        self.compact_activations = bool(flag)
        self._lifetimes()

    def _recomputable(self, kept: set[str]) -> dict[str, int]:
        """Kept outputs of :data:`RECOMPUTE_FROM_INPUT` steps whose input stays kept (as values) for
        their own backward, which runs after every backward reading the output: value -> step."""
        out: dict[str, int] = {}
        for i, st in enumerate(self.steps):
            if (st.node.op_type not in RECOMPUTE_FROM_INPUT or st.node.domain or not st.differentiable
                    or not st.keep_inputs or st.keep_outputs or 0 in st.shape_only or st.save or st.reseed
                    or i in self.hooks or len(st.outputs) != 1 or not st.inputs or not st.inputs[0]):
                continue
            if any(x and x not in self.constants for x in st.inputs[1:]):
                continue
            if st.outputs[0] in kept:
                out[st.outputs[0]] = i
        return out

    def _recompute(self, env: dict[str, Any], name: str, i: int) -> None:
        st = self.steps[i]
        x = env[st.inputs[0]]
        if isinstance(x, (RegionCodes, HalfValues)) and len(st.inputs) == 1:  # element-wise: a slice at a time
            out = None
            for a, b in _slices(x.shape):
                part = st.kernel.forward(x.decode(a, b), **st.train_attrs)
                if out is None:
                    out = np.empty(x.shape, part.dtype)
                out.reshape(-1)[a:b] = part
            env[name] = out
            return
        env[name] = st.kernel.forward(*[_plain(env[x]) if x else None for x in st.inputs], **st.train_attrs)

    def _pieces(self, i: int, st: Step, args: list) -> int:
        """In how many runs over groups of samples step ``i`` goes (1: the whole batch at once)."""
        x = args[0] if args else None
        if not isinstance(x, np.ndarray):
            return 1
        key = (i, x.shape)
        k = self._pieces_cache.get(key)
        if k is None:
            k = self._pieces_cache[key] = pieces_for(st, [None if a is None else a.shape for a in args],
                                                     x.itemsize)
        return k

    def set_save_workspace(self, flag: bool) -> None:
        """Keep training-forward savings (im2col columns...) or recompute them in the backward."""
        self.save_workspace = bool(flag)
        for st in self.steps:
            st.save = self._saves(st)
            self._argmax_only(st)
        self._lifetimes()

    # ------------------------------------------------------------ hooks

    def add_hook(self, step_index: int, position: int, hook: Hook) -> None:
        """Transform input ``position`` of step ``step_index`` on every forward."""
        self.hooks.setdefault(step_index, []).append((position, hook))
        if self.steps[step_index].node.op_type in RECOMPUTE_FROM_INPUT or \
                self.steps[step_index].node.op_type in COMPACT_INPUT:
            self._lifetimes()  # a hooked step's output is not recomputed from the unhooked input

    # ------------------------------------------------------------ running

    def _env(self, params: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        env = dict(self.constants)
        env.update(params)
        env.update(feeds)
        env["__train.true"] = _TRUE
        return env

    def forward(
        self,
        params: dict[str, np.ndarray],
        feeds: dict[str, np.ndarray],
        *,
        seed: int = 0,
    ) -> Forward:
        """Training-mode forward keeping what the backward needs."""
        env = self._env(params, feeds)
        saved: dict[int, Any] = {}
        args_kept: dict[int, list] = {}
        masks: dict[tuple[int, int], np.ndarray] = {}
        shapes: dict[tuple[int, int], tuple[tuple[int, ...], np.dtype]] = {}
        for i, st in enumerate(self.steps):
            args = [env[x] if x else None for x in st.inputs]
            for pos in st.shape_only:
                a = args[pos]
                if a is not None:
                    shapes[(i, pos)] = (a.shape, a.dtype)
            hooks = self.hooks.get(i)
            if hooks:
                for pos, hook in hooks:
                    args[pos], mask = hook(args[pos], True)
                    if mask is not None and st.differentiable:
                        masks[(i, pos)] = mask
                if st.differentiable:
                    args_kept[i] = args
            attrs = st.train_attrs
            if st.reseed:
                attrs = dict(attrs, seed=(seed * 1_000_003 + i) % (2**31 - 1))
            if st.save:
                result, saved[i] = st.kernel.forward_train(*args, **attrs)
            else:
                k = self._pieces(i, st, args)
                result = st.kernel.forward(*args, **attrs) if k == 1 else _by_samples(st.kernel.forward, args,
                                                                                        attrs, k)
            _store(env, st.outputs, result)
            for name in st.free_train:
                env.pop(name, None)
            for name in st.pack_train:
                env[name] = PositiveMask.of(env[name])
            for name, pw, half16 in st.compact_train:
                env[name] = HalfValues.of(env[name]) if half16 else RegionCodes.of(env[name], pw)
        state = {buf: env[o] for st in self.steps for o, buf in st.state_updates if o in env}
        return Forward(env, saved, args_kept, masks, env[self.target], state, shapes)

    def infer(self, params: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
        """Inference-mode forward (running stats, no dropout) of the target."""
        env = self._env(params, feeds)
        for i, st in enumerate(self.steps):
            node = st.node
            args = [env[x] if x else None for x in node.inputs]
            hooks = self.hooks.get(i)
            if hooks:
                for pos, hook in hooks:
                    args[pos], _ = hook(args[pos], False)
            attrs = node.attrs
            if node.op_type == "BatchNormalization" and attrs.get("training_mode"):
                attrs = dict(attrs, training_mode=0)
            _store(env, node.outputs, node.kernel.forward(*args, **attrs))
            for name in st.free_eval:
                env.pop(name, None)
        return env[self.target]

    def backward(self, fwd: Forward, grad_target: np.ndarray) -> dict[str, np.ndarray]:
        """Gradients of every trainable initializer (zeros where it does not reach the target)."""
        env = fwd.env
        grads: dict[str, np.ndarray] = {self.target: grad_target}
        for i in range(len(self.steps) - 1, -1, -1):
            st = self.steps[i]
            if not st.differentiable:
                continue
            gy = [grads.pop(o, None) if o else None for o in st.outputs]
            if any(g is not None for g in gy):
                for name, j in st.recompute:
                    if name not in env:
                        self._recompute(env, name, j)
                if i in fwd.args:
                    ins = fwd.args.pop(i)
                elif st.keep_inputs:
                    ins = [env.get(x) if x else None for x in st.inputs]
                    for pos in st.shape_only:
                        if (ins[pos] is None or isinstance(ins[pos], _STORED)) and (i, pos) in fwd.shapes:
                            shp, dt = fwd.shapes[(i, pos)]
                            ins[pos] = np.broadcast_to(np.zeros((), dt), shp)
                else:
                    ins = [None] * len(st.inputs)
                outs = [env.get(o) if o else None for o in st.outputs] if st.keep_outputs else [None] * len(st.outputs)
                outs = [o.unpack() if isinstance(o, PositiveMask) else o for o in outs]
                kw = st.bwd_attrs
                if st.kernel.backward_wants_needs or st.save:
                    kw = dict(kw)
                    if st.kernel.backward_wants_needs:
                        kw["needs_grad"] = st.needs
                    if st.save:
                        kw["saved"] = fwd.saved.pop(i, None)
                if _elementwise_on_stored(ins, gy, outs):
                    gx = (_backward_from_codes(st, gy[0], ins[0], kw) if isinstance(ins[0], RegionCodes)
                          else _backward_by_slices(st, gy[0], ins[0], kw))
                else:
                    gx = st.kernel.backward_fn(gy, [_plain(a) for a in ins], outs, **kw)
                for pos, (name, need, g) in enumerate(zip(st.inputs, st.needs, gx)):
                    if not need or g is None:
                        continue
                    mask = fwd.masks.get((i, pos))
                    if mask is not None:
                        g = g * mask
                    prev = grads.get(name)
                    grads[name] = g if prev is None else prev + g
            for name in st.free_backward:
                env.pop(name, None)
        out: dict[str, np.ndarray] = {}
        for p in self.trainable:
            g = grads.get(p)
            ref = env[p] if p in env else self.constants[p]
            if g is None:
                g = np.zeros_like(ref)
            elif g.dtype != ref.dtype:
                g = g.astype(ref.dtype)
            out[p] = g
        return out


@dataclass(frozen=True)
class PositiveMask:
    """``value > 0`` of a kept value as packed bits: what a Relu backward reads of its output."""

    bits: np.ndarray
    shape: tuple[int, ...]

    @classmethod
    def of(cls, value: np.ndarray) -> "PositiveMask":
        return cls(np.packbits(value > 0, axis=None), tuple(value.shape))

    def unpack(self) -> np.ndarray:
        n = int(np.prod(self.shape, dtype=np.int64))
        return np.unpackbits(self.bits, count=n).view(np.bool_).reshape(self.shape)


@dataclass(frozen=True)
class Piecewise:
    """A backward that reads its input only through ``regions`` outside (lo, hi) (its gradient is
    constant there) and through the input's value inside."""

    lo: float
    hi: float
    regions: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # (x <= lo, x >= hi) as the kernel tests them
    # False: where the output is recomputed from the input, the input stays exact
    half_when_recomputed: bool = True


@dataclass(frozen=True)
class RegionCodes:
    """An input a piecewise backward reads, as one byte per value: 0 = at or below ``lo``, 255 = at or
    above ``hi`` (the regions as the kernel's own comparisons see them, so the gradient there is exact),
    1..254 = 254 equal bins of (lo, hi), decoded to their centres: off by at most half a bin,
    (hi - lo) / 508 (HardSwish: 6/508 = 0.0118, so its derivative x / 3 + 0.5 is off by at most 1/254)."""

    codes: np.ndarray  # uint8, the value's shape
    lo: float
    hi: float
    dtype: np.dtype

    LEVELS = 254  # interior bins

    @classmethod
    def of(cls, value: np.ndarray, pw: Piecewise) -> "RegionCodes":
        codes = np.empty(value.shape, np.uint8)
        flat, out = value.reshape(-1), codes.reshape(-1)
        scale = value.dtype.type(cls.LEVELS / (pw.hi - pw.lo))
        lo = value.dtype.type(pw.lo)
        buf = np.empty(min(flat.size, _ENCODE_CHUNK), value.dtype)
        for a in range(0, flat.size, _ENCODE_CHUNK):
            x = flat[a:a + _ENCODE_CHUNK]
            t, o = buf[:x.size], out[a:a + _ENCODE_CHUNK]
            np.subtract(x, lo, out=t)
            np.multiply(t, scale, out=t)
            np.clip(t, 0, cls.LEVELS - 1, out=t)
            np.add(t, 1, out=o, casting="unsafe")  # truncated: 1 + the bin, 1..254
            below, above = pw.regions(x)  # the tails as the kernel sees them, whatever the rounding above
            np.copyto(o, 0, where=below)
            np.copyto(o, 255, where=above)
        return cls(codes, float(pw.lo), float(pw.hi), value.dtype)

    def table(self) -> np.ndarray:
        """The value each code decodes to (the tails well outside (lo, hi))."""
        w = self.hi - self.lo
        t = np.empty(256, np.float64)
        t[0], t[255] = self.lo - w, self.hi + w
        t[1:255] = self.lo + (np.arange(self.LEVELS) + 0.5) * (w / self.LEVELS)
        return t.astype(self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    def decode(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The values (flat elements ``start:stop`` when given, else the whole array)."""
        codes = self.codes if stop is None else self.codes.reshape(-1)[start:stop]
        return np.take(self.table(), codes)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes)


@dataclass(frozen=True)
class HalfValues:
    """An input kept as float16 (clipped to +-65504): where the tape recomputes the op's output from
    it, the region codes would not do (HardSwish's output above 3 is x). Relative rounding 2**-11:
    within (-4, 4) at most 2**-10 absolute (HardSwish's derivative: off by at most 1/3072)."""

    half: np.ndarray
    dtype: np.dtype

    @classmethod
    def of(cls, value: np.ndarray) -> "HalfValues":
        half = np.empty(value.shape, np.float16)
        flat, out = value.reshape(-1), half.reshape(-1)
        big = value.dtype.type(np.finfo(np.float16).max)
        for a in range(0, flat.size, _ENCODE_CHUNK):
            out[a:a + _ENCODE_CHUNK] = np.clip(flat[a:a + _ENCODE_CHUNK], -big, big)
        return cls(half, value.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.half.shape

    def decode(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The values (flat elements ``start:stop`` when given, else the whole array)."""
        half = self.half if stop is None else self.half.reshape(-1)[start:stop]
        return half.astype(self.dtype)

    @property
    def nbytes(self) -> int:
        return int(self.half.nbytes)


def _backward_from_codes(st: Step, dy: np.ndarray | None, codes: RegionCodes, kw: dict) -> tuple:
    """An element-wise backward of one input read as region codes: the kernel's own backward on the
    256 values the codes stand for, with dy = 1, is the derivative per code; the gradient is that
    table looked up and multiplied by dy (what the kernel would give on the decoded input, without
    the decoded input and the kernel's temporaries: one array)."""
    if dy is None:
        return (None,)
    table = codes.table()
    g = st.kernel.backward_fn([np.ones_like(table)], [table], [None] * len(st.outputs), **kw)[0]
    dx = np.take(np.asarray(g, dtype=dy.dtype), codes.codes)
    np.multiply(dx, dy, out=dx)
    return (dx,)


def _slices(shape: tuple[int, ...]):
    n = int(np.prod(shape, dtype=np.int64))
    return ((a, min(n, a + _ENCODE_CHUNK)) for a in range(0, n, _ENCODE_CHUNK))


def _elementwise_on_stored(ins: list, gy: list, outs: list) -> bool:
    """A one-input, one-output backward that reads only its compacted input, with a gradient of its shape."""
    return (len(ins) == 1 and isinstance(ins[0], (RegionCodes, HalfValues)) and len(gy) == 1
            and (gy[0] is None or gy[0].shape == ins[0].shape) and all(o is None for o in outs))


def _backward_by_slices(st: Step, dy: np.ndarray | None, stored: "HalfValues | RegionCodes", kw: dict) -> tuple:
    """An element-wise backward on a compacted input, run a slice at a time (the same numbers as on
    the whole decoded array; the decoded input and the kernel's temporaries are a slice, not the value)."""
    if dy is None:
        return (None,)
    dx = np.empty(dy.shape, dy.dtype)
    flat_dy, flat_dx = dy.reshape(-1), dx.reshape(-1)
    for a, b in _slices(dy.shape):
        flat_dx[a:b] = st.kernel.backward_fn([flat_dy[a:b]], [stored.decode(a, b)], [None], **kw)[0]
    return (dx,)


#: What the forward may leave in place of a kept value.
_STORED = (PositiveMask, RegionCodes, HalfValues)


def _plain(value: Any) -> Any:
    """A compacted value decoded for the kernel that reads it; anything else as it is."""
    return value.decode() if isinstance(value, (RegionCodes, HalfValues)) else value


def pieces_for(st: Step, shapes: list, itemsize: int) -> int:
    """How many groups of samples a non-saving forward of ``st`` runs in, at these input shapes.

    A Conv whose im2col-style workspace is over :data:`WORKSPACE_PER_INPUT` times its input runs
    over groups of samples (every sample is independent, so the output is the same): the frozen
    forward's working set, which every transfer mode pays, is then a few inputs, not prod(kernel)
    of them. The memory planner asks the same question."""
    x = shapes[0] if shapes else None
    if (st.save or st.node.op_type not in _BY_SAMPLES or st.node.domain or st.kernel.workspace_fn is None
            or x is None or len(x) < 3 or not isinstance(x[0], (int, np.integer)) or x[0] < 2):
        return 1
    try:
        ws = int(st.kernel.workspace_fn(shapes, st.bwd_attrs) or 0) / 4 * itemsize  # its estimate is at 4 bytes
    except Exception as exc:  # noqa: BLE001 - no estimate: run it whole
        log.debug("no workspace estimate for %s (%s); its forward runs over the whole batch", st.node.name, exc)
        return 1
    in_bytes = max(1, int(np.prod(x, dtype=np.int64)) * itemsize)
    return int(min(x[0], max(1, math.ceil(ws / in_bytes / WORKSPACE_PER_INPUT))))


def _by_samples(fn: Callable, args: list, attrs: dict, pieces: int) -> np.ndarray:
    """``fn(*args)`` over ``pieces`` groups of samples of ``args[0]``, written into one output."""
    x = args[0]
    n = x.shape[0]
    bounds = [round(j * n / pieces) for j in range(pieces + 1)]
    out = None
    for a, b in zip(bounds, bounds[1:]):
        part = fn(x[a:b], *args[1:], **attrs)
        if out is None:
            out = np.empty((n,) + part.shape[1:], part.dtype)
        out[a:b] = part
    return out


def _store(env: dict[str, np.ndarray], names: list[str], result: Any) -> None:
    if isinstance(result, tuple):
        for name, value in zip(names, result):
            if name:
                env[name] = value
    else:
        env[names[0]] = result
