"""Conv/Gemm/MatMul/Add/BatchNormalization + activation fused (numpy backend).

``X -> act`` becomes one node (X one of Conv, ConvTranspose, Gemm, MatMul,
Add, Sum, BatchNormalization) when X's output feeds only that activation
(and is no graph output): the activation then runs on X's fresh output
inside the same call, with no extra dispatch, environment slot or (for
Relu and Clip, the ReLU6 of MobileNets) allocation, as onnxruntime's
FusedConv/FusedGemm do. Relu and Clip run in place (``np.maximum`` /
``np.clip`` with ``out=``, the very functions their kernels call); every
other activation calls its own kernel on the output, so results are
identical to the unfused graph.

The fused node keeps the producer's op type and attributes; its kernel is a
composition labelled ``Conv+Relu`` etc. (``edgeflow inspect --optimized``
counts those). Compiled graphs for training are never optimized.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .readers import readers

PRODUCERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sum", "BatchNormalization",
                       "LayerNorm(fused)"})
ACTIVATIONS = frozenset({"Relu", "Clip", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish",
                         "Elu", "Selu", "Softplus", "Gelu"})


def _fresh(y, args):
    """``y`` safe to overwrite: never one of the inputs (a kernel may return one as is)."""
    for a in args:
        if y is a:
            return y.copy()
    return y


def _composed(base, act, act_args: list, act_attrs: dict):
    f = base.forward
    if act.op_type == "Relu":
        def forward(*args, **attrs):
            y = _fresh(f(*args, **attrs), args)
            np.maximum(y, y.dtype.type(0), out=y)
            return y
    elif act.op_type == "Clip" and act.kernel.since >= 11:
        lo, hi = (None if a is None else np.asarray(a).reshape(()) for a in (act_args + [None, None])[:2])

        def forward(*args, **attrs):
            y = _fresh(f(*args, **attrs), args)
            if lo is not None or hi is not None:
                np.clip(y, None if lo is None else y.dtype.type(lo), None if hi is None else y.dtype.type(hi), out=y)
            return y
    elif act.op_type == "Clip":
        lo6, hi6 = act_attrs.get("min", -3.4028234663852886e38), act_attrs.get("max", 3.4028234663852886e38)

        def forward(*args, **attrs):
            y = _fresh(f(*args, **attrs), args)
            np.clip(y, y.dtype.type(lo6), y.dtype.type(hi6), out=y)
            return y
    else:
        g = act.kernel.forward

        def forward(*args, **attrs):
            return g(f(*args, **attrs), *act_args, **act_attrs)
    return dataclasses.replace(base, op_type=f"{base.op_type}+{act.kernel.op_type}", forward=forward,
                               backward_fn=None, forward_train=None)


GATES = frozenset({"HardSigmoid", "Sigmoid"})


def _self_gate(gate, mul):
    """``Mul(x, G(x))`` as one node running G then multiplying by x in place: the
    arithmetic of the two nodes (G's own kernel, then x * g), one allocation and one
    dispatch fewer. Paddle's hard_swish below opset 14 is HardSigmoid(1/6, 1/2) + Mul
    (fuse_hardswish writes it so), SiLU is Sigmoid + Mul. The node keeps G's op type
    and attributes, so a Conv before it fuses with it like with G alone."""
    g = gate.kernel.forward

    def forward(x, **attrs):
        y = g(x, **attrs)
        if y is x or y.shape != x.shape or y.dtype != x.dtype:
            return np.multiply(x, y)
        return np.multiply(y, x, out=y)

    kernel = dataclasses.replace(gate.kernel, op_type=f"{gate.op_type}*x", forward=forward, backward_fn=None,
                                 forward_train=None)
    return dataclasses.replace(gate, outputs=[mul.outputs[0]], kernel=kernel, free_after=[])


def _fuse_self_gates(graph, outputs: set, read_by: dict):
    gates = {n.outputs[0]: n for n in graph.nodes
             if n.op_type in GATES and not n.domain and len(n.inputs) == 1 and len(n.outputs) == 1}
    replace: dict[int, object] = {}
    dropped: set[int] = set()
    for n in graph.nodes:
        if n.op_type != "Mul" or n.domain or len(n.inputs) != 2 or len(n.outputs) != 1:
            continue
        a, b = n.inputs
        for h, x in ((a, b), (b, a)):
            gate = gates.get(h)
            if (gate is not None and x and gate.inputs[0] == x and h not in outputs and id(gate) not in dropped
                    and len(read_by.get(h, [])) == 1):
                replace[id(n)] = _self_gate(gate, n)
                dropped.add(id(gate))
                break
    if not replace:
        return graph
    return dataclasses.replace(graph, nodes=[replace.get(id(n), n) for n in graph.nodes if id(n) not in dropped])


def fuse_activation(graph):
    """CompiledGraph -> CompiledGraph with producer -> activation pairs fused (a
    ``Mul(x, HardSigmoid(x))`` or ``Mul(x, Sigmoid(x))`` first made one node)."""
    outputs = set(graph.output_names)
    graph = _fuse_self_gates(graph, outputs, readers(graph))
    read_by = readers(graph)
    inits = graph.initializers
    dropped: set[int] = set()
    fused: dict[int, object] = {}
    for n in graph.nodes:
        if n.op_type not in PRODUCERS or n.domain or len(n.outputs) != 1 or "+" in n.kernel.op_type:
            continue
        y = n.outputs[0]
        rs = read_by.get(y, [])
        if len(rs) != 1 or y in outputs:
            continue
        act = rs[0]
        if act.op_type not in ACTIVATIONS or act.domain or not act.inputs or act.inputs[0] != y \
                or id(act) in dropped or id(act) in fused or len(act.outputs) != 1:
            continue
        extra = act.inputs[1:]
        if any(x and x not in inits for x in extra) or y in extra:
            continue  # e.g. a Clip whose bounds are computed at run time
        args = [inits[x] if x else None for x in extra]
        kernel = _composed(n.kernel, act, args, dict(act.attrs))
        fused[id(n)] = dataclasses.replace(n, outputs=[act.outputs[0]], kernel=kernel, free_after=[])
        dropped.add(id(act))
    if not fused:
        return graph
    nodes = [fused.get(id(n), n) for n in graph.nodes if id(n) not in dropped]
    return dataclasses.replace(graph, nodes=nodes)
