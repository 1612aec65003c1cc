"""Squeeze-and-excitation blocks as one node (numpy backend).

``Mul(x, A2(Conv2(A1(Conv1(GlobalAveragePool(x))))))`` — MobileNetV3's and
PP-LCNet's SE block: Conv1 and Conv2 1x1 convolutions on constant weights,
A1 and A2 one-input activations (Relu, then HardSigmoid or Sigmoid) — becomes
one node whose kernel runs the six steps in one call. At batch 1 the two
convolutions on the pooled (C, 1, 1) vector are the Conv kernel's own 1x1
plan written out (one (M, C) @ (C, 1) product, then the bias), without its
per-call plan lookup and reshapes; the pooling, activations and the Mul are
their kernels' own calls. So the result is the unfused graph's, bit for bit,
for five dispatches fewer: the PP-OCR angle classifier has 10 such blocks. At
other batch sizes it calls the six kernels in turn.

Each intermediate value must have that one reader and be no graph output.
The node is labelled ``SE(fused)``. Compiled graphs for training are never
optimized.
"""

from __future__ import annotations

import dataclasses

from .readers import readers

FUSED = "SE(fused)"
ACTIVATIONS = frozenset({"Relu", "Sigmoid", "HardSigmoid", "HardSwish", "LeakyRelu", "Tanh"})


def _pointwise(conv, inits) -> bool:
    """A 1x1, stride-1, unpadded, ungrouped Conv on constant weights (and bias)."""
    a = conv.attrs
    if conv.domain or len(conv.inputs) not in (2, 3) or conv.inputs[1] not in inits:
        return False
    if len(conv.inputs) == 3 and conv.inputs[2] and conv.inputs[2] not in inits:
        return False
    w = inits[conv.inputs[1]]
    if w.ndim != 4 or w.shape[2:] != (1, 1) or int(a.get("group", 1)) != 1:
        return False
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET", "VALID", b"VALID"):
        return False
    return (all(int(p) == 0 for p in (a.get("pads") or ())) and all(int(s) == 1 for s in (a.get("strides") or ()))
            and all(int(d) == 1 for d in (a.get("dilations") or ())))


def _forward(pool, conv1, act1, conv2, act2, mul, x_first: bool):
    pool_f, conv_f = pool.kernel.forward, conv1.kernel.forward
    a1_f, a1_attrs = act1.kernel.forward, dict(act1.attrs)
    a2_f, a2_attrs = act2.kernel.forward, dict(act2.attrs)
    c1_attrs, c2_attrs = dict(conv1.attrs), dict(conv2.attrs)
    mul_f = mul.kernel.forward
    pool_attrs = dict(pool.attrs)

    def forward(x, w1, b1, w2, b2):
        v = pool_f(x, **pool_attrs)
        if x.ndim == 4 and x.shape[0] == 1 and v.shape == (1, x.shape[1], 1, 1) and w1.dtype == x.dtype == w2.dtype:
            m1, m2 = w1.shape[0], w2.shape[0]
            y = (w1.reshape(m1, -1) @ v.reshape(x.shape[1], 1)).reshape(1, m1, 1, 1)  # Conv's 1x1 batch-1 plan
            if b1 is not None:
                y += b1.reshape(1, m1, 1, 1)
            y = a1_f(y, **a1_attrs)
            s = (w2.reshape(m2, -1) @ y.reshape(m1, 1)).reshape(1, m2, 1, 1)
            if b2 is not None:
                s += b2.reshape(1, m2, 1, 1)
        else:
            y = a1_f(conv_f(v, w1, b1, **c1_attrs), **a1_attrs)
            s = conv_f(y, w2, b2, **c2_attrs)
        s = a2_f(s, **a2_attrs)
        return mul_f(x, s) if x_first else mul_f(s, x)
    return forward


def fuse_se(graph):
    """CompiledGraph -> CompiledGraph with squeeze-and-excitation blocks as one node each."""
    outputs = set(graph.output_names)
    inits = graph.initializers
    producer: dict[str, object] = {}
    for n in graph.nodes:
        for o in n.outputs:
            if o:
                producer[o] = n
    read_by = readers(graph)

    def only(value, op_types):
        """The node that makes ``value`` if it is one of ``op_types`` and ``value`` has one reader."""
        n = producer.get(value)
        if (n is None or n.domain or n.op_type not in op_types or value in outputs
                or len(read_by.get(value, ())) != 1):
            return None
        return n

    dropped: set[int] = set()
    fused: dict[int, object] = {}
    for n in graph.nodes:
        if n.op_type != "Mul" or n.domain or len(n.inputs) != 2 or len(n.outputs) != 1:
            continue
        for k in (1, 0):
            x, s = n.inputs[1 - k], n.inputs[k]
            act2 = only(s, ACTIVATIONS)
            conv2 = act2 and len(act2.inputs) == 1 and only(act2.inputs[0], {"Conv"})
            act1 = conv2 and _pointwise(conv2, inits) and only(conv2.inputs[0], ACTIVATIONS)
            conv1 = act1 and len(act1.inputs) == 1 and only(act1.inputs[0], {"Conv"})
            pool = conv1 and _pointwise(conv1, inits) and only(conv1.inputs[0], {"GlobalAveragePool"})
            chain = (pool, conv1, act1, conv2, act2)
            if not pool or not x or pool.inputs[0] != x or any(id(m) in dropped for m in chain):
                continue
            b1 = conv1.inputs[2] if len(conv1.inputs) == 3 else ""
            b2 = conv2.inputs[2] if len(conv2.inputs) == 3 else ""
            kernel = dataclasses.replace(n.kernel, op_type=FUSED, backward_fn=None, forward_train=None,
                                         forward=_forward(pool, conv1, act1, conv2, act2, n, x_first=k == 1))
            fused[id(n)] = dataclasses.replace(n, op_type=FUSED, inputs=[x, conv1.inputs[1], b1, conv2.inputs[1], b2],
                                               attrs={}, kernel=kernel, free_after=[])
            dropped.update(id(m) for m in chain)
            break
    if not fused:
        return graph
    return dataclasses.replace(graph, nodes=[fused.get(id(n), n) for n in graph.nodes if id(n) not in dropped])
