"""Which layers of a model get quantized, and which tensors that touches.

Quantization targets are the ops that carry the weights and the FLOPs —
Conv, Gemm and MatMul with a constant float weight. Around them:

- the activation input and the output of each target are quantized (Q->DQ);
  a Relu that is the output's only reader is *removable*: its output is
  quantized instead, with a range starting at 0, so the Q's saturation at
  the zero point is the Relu (as onnxruntime does);
- ops that only move values (MaxPool, Flatten, Reshape, ...) pass the
  quantization of their input through to their output with the *same*
  parameters, so the numpy backend can run them on the integers;
- graph outputs stay float: the user's logits lose nothing for it.

The resulting :class:`QuantPlan` is shared by the QDQ writer, the dynamic
quantizer and per-layer sensitivity (which quantizes one target at a time).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import QuantizationError
from ..runtime.optimize.passes.fuse_qdq import PASS_THROUGH

log = logging.getLogger(__name__)

QUANTIZABLE = ("Conv", "Gemm", "MatMul")


@dataclass(frozen=True)
class Target:
    """One layer to quantize."""

    node: str
    op_type: str
    activation: str  # input tensor
    weight: str  # float initializer
    weight_axis: int  # output-channel axis of the weight
    bias: str | None  # 1-D float initializer (Conv B / Gemm C), or None
    output: str  # tensor quantized after the layer ("" if it stays float)
    relu: str | None = None  # removable Relu node folded into the output's Q


@dataclass
class QuantPlan:
    targets: list[Target]
    kept_fp32: dict[str, str] = field(default_factory=dict)  # node -> why
    shared: dict[str, str] = field(default_factory=dict)  # pass-through output -> source tensor
    graph_outputs: frozenset[str] = frozenset()

    @property
    def quantized_tensors(self) -> list[str]:
        """Every activation tensor that gets a Q->DQ pair, in a stable order."""
        seen: list[str] = []
        for t in self.targets:
            for name in (t.activation, t.output):
                if name and name not in seen:
                    seen.append(name)
        for out in self.shared:
            if out not in seen:
                seen.append(out)
        return seen

    @property
    def calibrated_tensors(self) -> list[str]:
        """Tensors whose range must be measured (the others share a range)."""
        return [t for t in self.quantized_tensors if t not in self.shared]

    def root(self, tensor: str) -> str:
        while tensor in self.shared:
            tensor = self.shared[tensor]
        return tensor

    def subset(self, nodes: list[str], model: onnx.ModelProto) -> "QuantPlan":
        """The plan restricted to some targets (for per-layer sensitivity)."""
        keep = [t for t in self.targets if t.node in nodes]
        return QuantPlan(keep, dict(self.kept_fp32), _propagate(model, keep, self.graph_outputs), self.graph_outputs)


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every unnamed node a unique name (in place) so layers can be addressed."""
    used = {n.name for n in model.graph.node if n.name}
    for i, n in enumerate(model.graph.node):
        if not n.name:
            base = f"{n.op_type}_{i}"
            name, k = base, 1
            while name in used:
                name, k = f"{base}_{k}", k + 1
            n.name = name
            used.add(name)
    return model


def links(nodes: list[onnx.NodeProto]) -> tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
    """(tensor -> the node that writes it, tensor -> the nodes that read it) over ``nodes``; the graph
    rewrites hold ``nodes`` as a list so that id() of each stays valid while they work."""
    producer = {o: n for n in nodes for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    return producer, readers


ACTIVATIONS = ("Relu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid", "LeakyRelu", "Tanh")
"""Elementwise ops that follow a layer as its activation (with Mul/Add/Sub/Div by one constant, and
x * HardSigmoid(x), HardSwish in two ops)."""


def activations_after(model: onnx.ModelProto, layers: list[str]) -> dict[str, list[str]]:
    """Layer name -> the nodes of its activation: the elementwise nodes (:data:`ACTIVATIONS`, Mul/Add/Sub/Div
    whose other input is a one-value initializer or another tensor of the activation) that read only the
    layer's output and each other's, up to the first node that reads anything else. Keeping a layer fp32
    with its activation lets the activation stay float too (onnxruntime fuses it into the fp32 conv), where
    keeping only the layer leaves its output quantized for the int8 activation to read."""
    nodes = list(model.graph.node)
    inits = {t.name: t for t in model.graph.initializer}
    _, readers = links(nodes)
    outputs = {o.name for o in model.graph.output}
    by_name = {n.name: n for n in nodes}
    order = {id(n): i for i, n in enumerate(nodes)}
    out: dict[str, list[str]] = {}
    for name in layers:
        layer = by_name.get(name)
        if layer is None or len(layer.output) != 1:
            continue
        inside = {layer.output[0]}
        chain: list[onnx.NodeProto] = []
        members: set[int] = set()
        grew = True
        while grew:
            grew = False
            for t in list(inside):
                for n in readers.get(t, []):
                    if id(n) in members or len(n.output) != 1 or n.domain not in ("", "ai.onnx"):
                        continue
                    if n.op_type in ACTIVATIONS:
                        ok = n.input[0] == t and all(x in inits for x in n.input[1:] if x)
                    elif n.op_type in ("Mul", "Add", "Sub", "Div") and len(n.input) == 2:
                        ok = all(x in inside or (x in inits and int(np.prod(inits[x].dims)) == 1) for x in n.input)
                    else:
                        ok = False
                    if ok:
                        chain.append(n)
                        members.add(id(n))
                        inside.add(n.output[0])
                        grew = True
        # a chain whose tensors are read only inside it, but for the one it ends with
        leaving = [t for t in [layer.output[0]] + [n.output[0] for n in chain]
                   if t in outputs or any(id(r) not in members for r in readers.get(t, []))]
        if chain and len(leaving) == 1 and leaving[0] != layer.output[0]:
            out[name] = [n.name for n in sorted(chain, key=lambda n: order[id(n)])]
    return out


def _readers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for x in n.input:
            if x:
                out.setdefault(x, []).append(n)
    return out


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _candidate(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], ops: tuple[str, ...]) -> tuple[Target | None, str]:
    """A Target for ``node`` (without output decisions), or why it stays float."""
    if node.op_type not in ops or node.domain not in ("", "ai.onnx"):
        return None, ""
    if len(node.input) < 2 or node.input[1] not in inits:
        return None, "its weight input is not a constant initializer"
    if node.input[0] in inits:
        return None, "its data input is a constant"
    w = inits[node.input[1]]
    if w.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16):
        return None, "its weight is not floating point"
    rank = len(w.dims)
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if node.op_type == "Conv":
        if rank < 3:
            return None, "unexpected weight rank"
        axis, n_out = 0, w.dims[0]
    elif node.op_type == "Gemm":
        if rank != 2 or _attr(node, "transA", 0):
            return None, "transposed input A (transA=1) is not quantized"
        if _attr(node, "alpha", 1.0) != 1.0 or (bias and _attr(node, "beta", 1.0) != 1.0):
            return None, "alpha/beta != 1 are not quantized"
        axis = 0 if _attr(node, "transB", 0) else 1
        n_out = w.dims[axis]
    else:  # MatMul
        if rank != 2:
            return None, "only 2-D constant weights are quantized"
        axis, n_out = 1, w.dims[1]
    if bias is not None:
        b = inits.get(bias)
        if b is None or len(b.dims) != 1 or b.dims[0] != n_out:
            bias = None  # stays a float input (still correct, just not int32)
    return Target(node.name, node.op_type, node.input[0], node.input[1], axis, bias, ""), ""


def plan_quantization(
    model: onnx.ModelProto,
    *,
    ops: tuple[str, ...] = QUANTIZABLE,
    keep_fp32: tuple[str, ...] | list[str] = (),
    keep_first: bool = False,
    keep_last: bool = False,
    quantize_outputs: bool = True,
    min_int8_channels: int = 0,
) -> QuantPlan:
    """Decide the targets of ``model`` (whose nodes must be named: :func:`name_nodes`).

    ``min_int8_channels``: a (non-grouped) Conv reading fewer input channels
    stays fp32 — an image input layer (1-3 channels) has a reduction of only
    9-27 terms, too short for int8 GEMM to beat fp32 (see docs/quantization.md).
    """
    g = model.graph
    names = [n.name for n in g.node]
    unknown = [k for k in keep_fp32 if k not in names]
    if unknown:
        quantizable = [n.name for n in g.node if n.op_type in ops]
        raise QuantizationError(
            f"keep_fp32 names node(s) {unknown} that the model does not have; "
            f"its {'/'.join(ops)} nodes are: {quantizable}"
        )
    inits = {t.name: t for t in g.initializer}
    outputs = frozenset(o.name for o in g.output)
    readers = _readers(model)
    cands: list[Target] = []
    kept: dict[str, str] = {}
    for n in g.node:
        t, why = _candidate(n, inits, ops)
        if t is None:
            if why:
                kept[n.name] = why
            continue
        cands.append(t)
    if not cands:
        present = sorted({n.op_type for n in g.node})
        raise QuantizationError(
            f"the model has no quantizable op: int8 quantization applies to {', '.join(ops)} nodes "
            f"with constant float weights, and this model has {', '.join(present) or 'no ops'}"
            + (f" ({'; '.join(f'{k}: {v}' for k, v in kept.items())})" if kept else "")
        )
    by_name_all = {n.name: n for n in g.node}
    chosen = []
    for i, t in enumerate(cands):
        c_in = _conv_input_channels(by_name_all[t.node], inits) if t.op_type == "Conv" else None
        if t.node in keep_fp32:
            kept[t.node] = "kept in fp32 by name"
        elif c_in is not None and c_in < min_int8_channels:
            kept[t.node] = (
                f"Conv over {c_in} input channel(s): int8 is slower than fp32 below "
                f"{min_int8_channels} (min_int8_channels=0 quantizes it)"
            )
        elif keep_first and i == 0:
            kept[t.node] = "first quantizable layer kept in fp32"
        elif keep_last and i == len(cands) - 1:
            kept[t.node] = "last quantizable layer kept in fp32"
        else:
            chosen.append(t)
    if not chosen:
        raise QuantizationError(
            f"every quantizable layer is kept in fp32 ({', '.join(kept)}); nothing would be quantized"
        )
    by_name = {n.name: n for n in g.node}
    final = []
    for t in chosen:
        node = by_name[t.node]
        y = node.output[0]
        relu = None
        rs = readers.get(y, [])
        if len(rs) == 1 and rs[0].op_type == "Relu" and y not in outputs and rs[0].output[0] not in outputs:
            relu = rs[0].name
            y = rs[0].output[0]
        out = y if quantize_outputs and y not in outputs else ""
        if out == "":
            relu = None  # keep the Relu when its output is not quantized
        final.append(Target(t.node, t.op_type, t.activation, t.weight, t.weight_axis, t.bias, out, relu))
    return QuantPlan(final, kept, _propagate(model, final, outputs), outputs)


def _conv_input_channels(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> int | None:
    """Input channels of a non-grouped Conv (None for grouped / depthwise ones)."""
    if _attr(node, "group", 1) != 1:
        return None
    return int(inits[node.input[1]].dims[1])


def pool_before_relu(model: onnx.ModelProto, convs: list[str]) -> onnx.ModelProto:
    """Rewrite ``Conv -> Relu -> MaxPool`` as ``Conv -> MaxPool -> Relu`` (in place)
    for the named (fp32) convolutions.

    Exact: max and relu commute, and the Relu then runs on 4x fewer values.
    It matters for a layer kept in fp32 ahead of quantized ones: with the Relu
    last, onnxruntime quantizes *after* the pool; with the pool last its QDQ
    propagation pulls the QuantizeLinear above the MaxPool onto a uint8 NCHW
    MaxPool that is slower than the whole fp32 layer (measured, onnxruntime 1.32).
    """
    g = model.graph
    readers = _readers(model)
    outputs = {o.name for o in g.output}
    by_name = {n.name: n for n in g.node}
    for name in convs:
        conv = by_name.get(name)
        if conv is None:
            continue
        y = conv.output[0]
        rs = readers.get(y, [])
        if len(rs) != 1 or rs[0].op_type != "Relu" or y in outputs:
            continue
        relu = rs[0]
        r = relu.output[0]
        ps = readers.get(r, [])
        if len(ps) != 1 or ps[0].op_type != "MaxPool" or r in outputs or len([o for o in ps[0].output if o]) != 1:
            continue
        pool = ps[0]
        pooled = pool.output[0]
        pool.input[0] = y
        pool.output[0] = r  # the pool now writes the tensor the Relu wrote...
        relu.input[0] = r
        relu.output[0] = pooled  # ...and the Relu writes what the pool wrote
        # keep the node list topologically sorted: the pool before the relu
        nodes = list(g.node)
        i_relu, i_pool = nodes.index(relu), nodes.index(pool)
        nodes[i_relu], nodes[i_pool] = nodes[i_pool], nodes[i_relu]
        del g.node[:]
        g.node.extend(nodes)
        readers = _readers(model)
    del g.value_info[:]
    return model


def clamps_as_clip(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Rewrite ``Max(x, c)`` / ``Min(x, c)`` with a one-element constant ``c`` as
    ``Clip(x, min=c)`` / ``Clip(x, max=c)`` (in place); returns the model and the count.

    Exact in float (the same clamp, the same output shape: ``c`` broadcasts to
    ``x`` only when its rank is at most ``x``'s). It matters for int8: onnxruntime
    has no int8 Max/Min, so a clamp between two quantized ops runs in float behind a
    DequantizeLinear and a QuantizeLinear, while a Clip is folded into the int8
    range of the op before it (the saturation *is* the clamp). openWakeWord's
    embedding CNN (TF export: ``Max(LeakyRelu(x), -0.4)`` after each conv) went from
    1.89x to 2.49x faster than fp32 in int8 with it (onnxruntime 1.32, batch 1,
    one thread). Needs opset >= 11 (Clip's min/max as inputs); below, nothing changes.
    """
    from ..runtime.model import model_opset

    if model_opset(model) < 11:
        return model, 0
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    ranks: dict[str, int] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
            t = vi.type.tensor_type
            if t.HasField("shape"):
                ranks[vi.name] = len(t.shape.dim)
    except Exception as exc:  # noqa: BLE001 - without shapes only scalar constants are rewritten
        log.debug("shape inference failed before the Max/Min rewrite (%s); only scalar constants are rewritten", exc)
    done = 0
    scalars: dict[tuple[str, str], str] = {}
    for n in g.node:
        if n.op_type not in ("Max", "Min") or n.domain not in ("", "ai.onnx") or len(n.input) != 2:
            continue
        const = [i for i, x in enumerate(n.input) if x in inits]
        if len(const) != 1:
            continue
        c_name, x = n.input[const[0]], n.input[1 - const[0]]
        c = numpy_helper.to_array(inits[c_name])
        if c.size != 1 or c.dtype != np.float32 or (c.ndim and ranks.get(x, -1) < c.ndim):
            continue
        key = (c_name, n.op_type)
        if key not in scalars:
            name = f"{c_name}_clip_{'min' if n.op_type == 'Max' else 'max'}"
            while name in inits:
                name += "_"
            t = numpy_helper.from_array(c.reshape(()), name)
            g.initializer.append(t)
            inits[name] = t
            scalars[key] = name
        bound = scalars[key]
        del n.input[:]
        n.input.extend([x, bound] if n.op_type == "Max" else [x, "", bound])
        n.op_type = "Clip"
        done += 1
    if done:
        used = {i for n in g.node for i in n.input}
        keep = [t for t in g.initializer if t.name in used or t.name in {i.name for i in g.input}]
        del g.initializer[:]
        g.initializer.extend(keep)
    return model, done


def _propagate(model: onnx.ModelProto, targets: list[Target], outputs: frozenset[str]) -> dict[str, str]:
    """Pass-through outputs that inherit their input's quantization."""
    quantized = {t.activation for t in targets} | {t.output for t in targets if t.output}
    inits = {t.name for t in model.graph.initializer}
    shared: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type not in PASS_THROUGH or not n.input or len(n.output) != 1:
            continue
        src, out = n.input[0], n.output[0]
        if src not in quantized or out in outputs or out in shared:
            continue
        if any(x and x not in inits for x in n.input[1:]):
            continue
        shared[out] = src
        quantized.add(out)
    return shared


def initializer_array(model: onnx.ModelProto, name: str) -> np.ndarray:
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    raise KeyError(name)
