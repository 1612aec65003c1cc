"""Transfer learning: which tensors of a pretrained model train.

A pretrained network is adapted, not trained from scratch. The modes
(``Trainer(mode=...)``, ``edgeflow train --mode``):

- ``full``: every float weight (the classic fine-tune; the default);
- ``head``: the last layer only;
- ``bias``: every bias plus the head (TinyTL, Cai et al. 2020): a bias's
  gradient needs no stored activation of its layer, only the gradient
  passing through, so activation memory shrinks with the weights' gradients;
- ``last:N``: every parameter of the last N layers;
- ``sparse``: a sparse update chosen by the memory budget (Lin et al. 2022,
  "On-device training under 256 KB"): biases of the deepest k layers that fit,
  with the weights of the last k/4 of them, plus the head. k is the largest
  that fits the profile's training budget (``budget_bytes=``).

A *layer* is a Conv, ConvTranspose, Gemm or MatMul with an initializer weight
(or a Gather of an embedding table), together with the bias Add right after
it and the normalization (BatchNormalization, LayerNormalization, ...) that
reads it. A normalization reading anything else is a layer of its own.
Float initializers outside layers (scalar constants of HardSwish, a Clip's
bounds written as tensors) never train outside ``full``.

Models whose weights are Constant nodes (Paddle and TF exports) go through
:func:`edgeflow.runtime.optimize.optimize_model` with ``for_training=True`` first
(:func:`prepare_model`): Constant nodes become initializers, constant
subgraphs fold, and every float initializer stays unfolded so it can train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import onnx

from ..errors import InputError, TrainingError

MODES = ("full", "head", "bias", "last", "sparse")

_WEIGHTED = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (1, None)}
_NORMS = ("BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
          "RMSNormalization")
_PASS_THROUGH = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity")


@dataclass(frozen=True)
class Mode:
    """A parsed transfer-learning mode: its name and N for ``last:N``."""

    name: str
    blocks: int | None = None

    def __str__(self) -> str:
        return f"last:{self.blocks}" if self.name == "last" else self.name


def parse_mode(mode: "str | Mode | None", blocks: int | None = None) -> Mode:
    """``"head"``, ``"bias"``, ``"last:3"`` (or ``"last"`` with ``blocks=3``), ``"sparse"``, ``"full"``."""
    if mode is None:
        return Mode("full")
    if isinstance(mode, Mode):
        return mode
    text = str(mode).strip().lower()
    name, _, n = text.partition(":")
    if name == "tinytl":
        name = "bias"
    if name not in MODES:
        raise InputError(f"unknown training mode {mode!r}: use one of full, head, bias, last:N, sparse")
    if name == "last":
        try:
            k = int(n) if n else (int(blocks) if blocks is not None else 0)
        except ValueError:
            raise InputError(f"training mode {mode!r}: N in last:N must be an integer, e.g. last:3") from None
        if k < 1:
            raise InputError(f"training mode {mode!r} needs N >= 1 layers, e.g. last:3 (or blocks=3)")
        return Mode("last", k)
    if n:
        raise InputError(f"training mode {mode!r} takes no ':N' (only last:N does)")
    return Mode(name)


@dataclass
class Layer:
    """One trainable layer: its node and parameters (initializer names by role)."""

    index: int
    node: str
    op: str
    weights: list[str] = field(default_factory=list)  # conv/gemm weights, embedding tables, norm scales
    biases: list[str] = field(default_factory=list)  # conv/gemm biases, bias Adds, norm biases

    @property
    def params(self) -> list[str]:
        return self.weights + self.biases


def has_constant_weights(model: onnx.ModelProto) -> bool:
    """Float tensors held in Constant / ConstantOfShape nodes (Paddle, TF exports, onnx 'light' models)."""
    for n in model.graph.node:
        if n.op_type == "ConstantOfShape":
            return True
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.t.data_type in (1, 10, 11) and int(np.prod(a.t.dims or [1])) > 1:
                    return True
    return False


def prepare_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant-node weights to initializers, kept unfolded (the optimizer in training mode)."""
    if not has_constant_weights(model):
        return model
    from ..runtime.optimize import optimize_model

    return optimize_model(model, for_training=True)


def find_layers(graph, candidates: Sequence[str], target: str) -> list[Layer]:
    """The layers of a compiled graph in execution order, restricted to those feeding ``target``."""
    cands = set(candidates)
    layers: list[Layer] = []
    owner: dict[str, int] = {}  # value -> index of the layer that produced it
    for node in graph.nodes:
        op = node.op_type if not node.domain else ""
        ins = list(node.inputs)
        li: int | None = None
        if op in _WEIGHTED:
            w_pos, b_pos = _WEIGHTED[op]
            w = ins[w_pos] if len(ins) > w_pos else ""
            if op == "MatMul" and w not in cands and ins and ins[0] in cands:
                w = ins[0]  # x^T W^T written as W @ x
            if w in cands:
                layer = Layer(len(layers), node.name, op, [w])
                if b_pos is not None and len(ins) > b_pos and ins[b_pos] in cands:
                    layer.biases.append(ins[b_pos])
                layers.append(layer)
                li = layer.index
        elif op == "Gather" and ins and ins[0] in cands:
            layers.append(Layer(len(layers), node.name, op, [ins[0]]))
            li = len(layers) - 1
        elif op in ("Add", "Sub") and len(ins) == 2:
            const = [x for x in ins if x in cands]
            other = [x for x in ins if x not in cands]
            if len(const) == 1 and len(other) == 1 and other[0] in owner and _is_bias(graph, const[0]):
                li = owner[other[0]]
                layers[li].biases.append(const[0])
        elif op in _NORMS:
            scale = ins[1] if len(ins) > 1 and ins[1] in cands else None
            bias = ins[2] if len(ins) > 2 and ins[2] in cands else None
            if scale or bias:
                src = owner.get(ins[0]) if ins else None
                if src is None:
                    layers.append(Layer(len(layers), node.name, op))
                    src = len(layers) - 1
                layer = layers[src]
                if scale:
                    layer.weights.append(scale)
                if bias:
                    layer.biases.append(bias)
                li = src
        elif op in _PASS_THROUGH and ins and ins[0] in owner:
            li = owner[ins[0]]
        if li is not None:
            for o in node.outputs:
                if o:
                    owner[o] = li
    reach = _ancestors(graph, target)
    kept = [lay for lay in layers if any(p in reach for p in lay.params)]
    for i, lay in enumerate(kept):
        lay.index = i
    return kept


def _is_bias(graph, name: str) -> bool:
    a = graph.initializers.get(name)
    return a is not None and a.size > 1 and sum(d > 1 for d in a.shape) == 1


def _ancestors(graph, target: str) -> set[str]:
    need = {target}
    for node in reversed(graph.nodes):
        if any(o in need for o in node.outputs if o):
            need.update(x for x in node.inputs if x)
    return need


def select(mode: Mode, layers: list[Layer], candidates: Sequence[str], *, sparse_k: int | None = None) -> list[str]:
    """Initializer names that train in ``mode`` (model order)."""
    if mode.name == "full":
        return list(candidates)
    if not layers:
        raise TrainingError("the model has no Conv/Gemm/MatMul layer with a weight initializer: "
                            "use mode='full' or name the weights with trainable=")
    head = layers[-1]
    chosen: set[str] = set(head.params)
    if mode.name == "bias":
        for lay in layers:
            chosen.update(lay.biases)
    elif mode.name == "last":
        for lay in layers[-mode.blocks:]:
            chosen.update(lay.params)
    elif mode.name == "sparse":
        chosen.update(sparse_selection(layers, sparse_k if sparse_k is not None else len(layers)))
    return [c for c in candidates if c in chosen]


def sparse_selection(layers: list[Layer], k: int) -> set[str]:
    """Biases of the last ``k`` layers, weights of the last ceil(k / 4), plus the head."""
    k = max(0, min(int(k), len(layers)))
    chosen = set(layers[-1].params)
    if k:
        for lay in layers[-k:]:
            chosen.update(lay.biases)
        for lay in layers[-math.ceil(k / 4):]:
            chosen.update(lay.params)
    return chosen


def largest_fitting(fits: Callable[[int], bool], n: int) -> int | None:
    """The largest k in 0..n with ``fits(k)`` (assumed monotone: fits(k) implies fits(k - 1))."""
    if not fits(0):
        return None
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def logits_of(graph, output: str) -> str:
    """The input of a final Softmax/LogSoftmax producing ``output`` (what cross-entropy wants), else ``output``."""
    for node in graph.nodes:
        if output in node.outputs and node.op_type in ("Softmax", "LogSoftmax") and not node.domain:
            return node.inputs[0]
    return output


def describe(names: Sequence[str], arrays: dict[str, np.ndarray], total: int) -> str:
    """'12 of 146 tensors (5,124 of 2,210,000 values): a, b, c, ...'."""
    n_values = sum(int(arrays[n].size) for n in names)
    shown = ", ".join(names[:6]) + (f", ... (+{len(names) - 6})" if len(names) > 6 else "")
    return f"{len(names)} of {total} weight tensors train ({n_values:,} values): {shown}"


PASS_THROUGH = frozenset({"Add", "Softmax", "LogSoftmax", "Sigmoid", "Flatten", "Reshape", "Squeeze", "Unsqueeze",
                          "Identity", "Dropout", "Transpose", "GlobalAveragePool", "Cast"})
"""Ops between a classifier's last layer and the output that keep its class axis (the head is found
by walking back from the output through these)."""


def find_head(model: onnx.ModelProto, output: str | None = None) -> onnx.NodeProto:
    """The classifier head of ``model``: the Gemm, MatMul or 1x1 Conv with a weight of its own that produces
    ``output`` (default: the model's only output) through :data:`PASS_THROUGH` ops only (its bias Add, a
    Flatten, a final Softmax...). Raises TrainingError naming what was found instead, so an inner layer is
    never replaced by mistake (issue 30: a ResNet's inner 1x1 conv was)."""
    g = model.graph
    outputs = [o.name for o in g.output]
    if output is None:
        if len(outputs) != 1:
            raise TrainingError(f"the model has {len(outputs)} outputs ({', '.join(outputs)}): name the one the new "
                                "head replaces with --target NAME (output=)")
        output = outputs[0]
    inits = {t.name for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    users: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            users[x] = users.get(x, 0) + 1
    value, path = output, []
    while value in producer:
        node = producer[value]
        if node.op_type in ("Gemm", "MatMul", "Conv") and not node.domain:
            if len(node.input) < 2 or node.input[1] not in inits or users.get(node.input[1], 0) != 1:
                raise TrainingError(f"{node.op_type} {node.name or value!r} produces {output!r} but its weight is "
                                    "not a tensor of its own: give the model a new head yourself")
            if node.op_type == "Conv":
                w = next(t for t in g.initializer if t.name == node.input[1])
                if any(d != 1 for d in w.dims[2:]):
                    raise TrainingError(f"the layer producing {output!r} is a {'x'.join(map(str, w.dims[2:]))} Conv, "
                                        "not a classifier head: give the model a new head yourself")
            return node
        if node.op_type not in PASS_THROUGH or node.domain:
            via = " <- ".join(path + [node.op_type])
            raise TrainingError(f"found no classifier head: {output!r} comes from {via}, not from a Gemm/MatMul/1x1 "
                                "Conv through a bias, Flatten or Softmax; give the model a new head yourself")
        path.append(node.op_type)
        data = [x for x in node.input if x and x not in inits]
        if len(data) != 1:  # an Add of two computed values (a residual) is not a bias
            raise TrainingError(f"found no classifier head: {output!r} comes from {node.op_type} of "
                                f"{len(data)} computed values; give the model a new head yourself")
        value = data[0]
    raise TrainingError(f"found no classifier head: {output!r} is not computed from a Gemm/MatMul/1x1 Conv")


def new_head(model: onnx.ModelProto, n_classes: int, *, seed: int = 0, output: str | None = None) -> onnx.ModelProto:
    """The model with its classifier head (:func:`find_head`) replaced by a fresh one of ``n_classes`` outputs.

    The new weight is drawn like PyTorch's default Linear init (uniform, bound
    1/sqrt(fan_in)) with ``seed``; the bias starts at zero. Output shapes in
    the model's value_info are dropped and re-inferred.
    """
    from onnx import numpy_helper

    if n_classes < 1:
        raise InputError(f"n_classes must be >= 1, got {n_classes}")
    model = prepare_model(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    head = find_head(m, output)
    node = next(n for n in m.graph.node if list(n.output) == list(head.output))
    inits = {t.name: t for t in m.graph.initializer}
    users: dict[str, int] = {}
    for n in m.graph.node:
        for x in n.input:
            users[x] = users.get(x, 0) + 1
    w = numpy_helper.to_array(inits[node.input[1]])
    rng = np.random.default_rng(seed)
    if node.op_type == "MatMul" or (node.op_type == "Gemm" and not _attr(node, "transB")):
        fan_in = w.shape[0]
        new_w = rng.uniform(-1, 1, (fan_in, n_classes)) / math.sqrt(fan_in)
    elif node.op_type == "Gemm":
        fan_in = w.shape[1]
        new_w = rng.uniform(-1, 1, (n_classes, fan_in)) / math.sqrt(fan_in)
    else:
        fan_in = int(np.prod(w.shape[1:]))
        new_w = rng.uniform(-1, 1, (n_classes,) + w.shape[1:]) / math.sqrt(fan_in)
    inits[node.input[1]].CopyFrom(numpy_helper.from_array(new_w.astype(w.dtype), node.input[1]))
    bias = node.input[2] if len(node.input) > 2 and node.input[2] in inits else None
    if bias is None:  # MatMul + Add(bias)
        out = node.output[0]
        for n in m.graph.node:
            if n.op_type == "Add" and out in n.input:
                other = [x for x in n.input if x != out]
                if other and other[0] in inits and users.get(other[0], 0) == 1:
                    bias = other[0]
                break
    if bias is not None:
        b = numpy_helper.to_array(inits[bias])
        shape = tuple(n_classes if d > 1 else d for d in b.shape) if b.ndim else (n_classes,)
        inits[bias].CopyFrom(numpy_helper.from_array(np.zeros(shape, b.dtype), bias))
    old_n = w.shape[0] if node.op_type == "Conv" or (node.op_type == "Gemm" and _attr(node, "transB")) \
        else w.shape[-1]
    del m.graph.value_info[:]
    for o in m.graph.output:  # the class axis of the outputs changes size
        t = o.type.tensor_type
        if t.HasField("shape"):
            for i, d in enumerate(t.shape.dim):
                if d.HasField("dim_value") and d.dim_value == old_n:
                    d.dim_value = n_classes
                elif d.HasField("dim_value") and d.dim_value < 1:  # Paddle's -1: a free dim
                    d.dim_param = f"{o.name}_dim{i}"
    return m


def _attr(node, name: str, default: int = 0) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _scalar(graph, name: str) -> float | None:
    a = graph.initializers.get(name)
    if a is None or a.size != 1 or a.dtype.kind != "f":
        return None
    return float(a.reshape(-1)[0])


def fuse_hardswish(graph):
    """The compiled graph with each decomposed HardSwish, ``x * Clip(x + 3, 0, 6) / 6`` (how Paddle and
    TF export it), as one HardSwish node: a pure function (the graph given is not changed).

    Exactly the same values, and for training a quarter of the memory: the four nodes keep ``x``,
    ``x + 3``, the Clip's output and the product for their backwards, HardSwish only ``x``. The
    model proto is not touched (export writes weights into it by name; shapes are inferred from
    it), so only the trainer's tape sees the fused node.
    """
    import dataclasses

    from ..kernels import get_kernel

    users: dict[str, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        for x in n.inputs:
            if x:
                users.setdefault(x, []).append(i)
    outputs = set(graph.output_names)
    by_output = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs if o}
    drop: set[int] = set()
    replace: dict[int, object] = {}
    kernel = get_kernel("HardSwish", "", 14)

    def only_user(value: str) -> int | None:
        u = users.get(value, [])
        return u[0] if len(u) == 1 and value not in outputs else None

    for i, n in enumerate(graph.nodes):
        if n.op_type != "Add" or n.domain or len(n.inputs) != 2:
            continue
        consts = [k for k, x in enumerate(n.inputs) if _scalar(graph, x) == 3.0]
        if len(consts) != 1:
            continue
        x = n.inputs[1 - consts[0]]
        ci = only_user(n.outputs[0])
        if ci is None:
            continue
        clip = graph.nodes[ci]
        if clip.op_type != "Clip" or clip.domain:
            continue
        lo = _scalar(graph, clip.inputs[1]) if len(clip.inputs) > 1 and clip.inputs[1] else clip.attrs.get("min")
        hi = _scalar(graph, clip.inputs[2]) if len(clip.inputs) > 2 and clip.inputs[2] else clip.attrs.get("max")
        if lo != 0.0 or hi != 6.0:
            continue
        mi = only_user(clip.outputs[0])
        if mi is None:
            continue
        mul = graph.nodes[mi]
        if mul.op_type != "Mul" or mul.domain or sorted(mul.inputs) != sorted([x, clip.outputs[0]]):
            continue
        di = only_user(mul.outputs[0])
        if di is None:
            continue
        div = graph.nodes[di]
        scale = _scalar(graph, div.inputs[1]) if len(div.inputs) == 2 else None
        if not ((div.op_type == "Div" and scale == 6.0) or (div.op_type == "Mul" and scale is not None
                                                           and abs(scale - 1 / 6) < 1e-7)):
            continue
        if div.inputs[0] != mul.outputs[0] or by_output.get(x, -1) > i:
            continue
        drop.update((i, ci, mi))
        replace[di] = dataclasses.replace(div, op_type="HardSwish", domain="", inputs=[x],
                                          outputs=[div.outputs[0]], attrs={}, kernel=kernel, free_after=[],
                                          fused_relu=False, name=f"{div.name}.hardswish")
    if not replace:
        return graph
    nodes = [replace.get(i, n) for i, n in enumerate(graph.nodes) if i not in drop]
    return dataclasses.replace(graph, nodes=nodes)
