"""Decomposed layer normalization as one node (numpy backend).

PyTorch exports ``nn.LayerNorm`` (below opset 17) and hand-written norms as

    m = ReduceMean(x, axes=[-1]);  d = Sub(x, m);  p = Pow(d, 2)  (or Mul(d, d))
    v = ReduceMean(p, axes=[-1]);  s = Sqrt(Add(v, eps));  n = Div(d, s)
    [y = Mul(n, gamma)]  [y = Add(y, beta)]

nine dispatches on small tensors (openWakeWord's classifiers: two per
model). This pass replaces the chain with one node that runs the same
numpy operations in the same order — in place where the chain allocated —
so results are those of the unfused graph. Every intermediate must be read
only inside the chain (``d`` by Pow and Div) and be no graph output; gamma,
beta and eps must be initializers. onnxruntime does the same
(LayerNormFusion). The fused node is labelled ``LayerNorm(fused)``; an
activation after it can still be fused (:mod:`.fuse_activation` runs after).
"""

from __future__ import annotations

import dataclasses

import numpy as np

FUSED = "LayerNorm(fused)"


def _axes(node, inits) -> tuple[int, ...] | None:
    if node.attrs.get("keepdims", 1) != 1 or node.attrs.get("noop_with_empty_axes", 0):
        return None
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        if node.inputs[1] not in inits:
            return None
        axes = inits[node.inputs[1]]
    if axes is None:
        return None
    return tuple(int(a) for a in np.asarray(axes).reshape(-1))


def _scalar(inits, name):
    v = inits.get(name)
    if v is None or v.size != 1:
        return None
    return v


def _affine(node, value: str, inits):
    """The initializer a Mul/Add applies to ``value`` (either operand order), else None."""
    a, b = (node.inputs + ["", ""])[:2]
    other = b if a == value else a if b == value else None
    return inits.get(other) if other and other != value else None


def _make_forward(axes, two_is_pow: bool, pow_exp, eps, gamma, beta):
    def mean(a):  # np.mean's arithmetic (a float32 sum, then one division) without its Python layers
        s = np.add.reduce(a, axis=axes, keepdims=True)
        n = a.size // s.size if s.size else 1
        return np.true_divide(s, n, out=s) if s.dtype.kind == "f" else s / n

    fits: dict[tuple, tuple[bool, bool]] = {}  # per output shape: gamma / beta apply in place
    # (np.broadcast_shapes is ~5 us of Python per call: a third of a 128-wide layer norm)

    def forward(x):
        m = mean(x)
        d = x - m
        p = np.power(d, pow_exp) if two_is_pow else d * d
        v = mean(p)
        v = np.asarray(v + eps)
        np.sqrt(v, out=v)
        n = np.divide(d, v, out=d)
        fit = fits.get(n.shape)
        if fit is None:
            fit = fits[n.shape] = tuple(p is not None and np.broadcast_shapes(n.shape, p.shape) == n.shape
                                        for p in (gamma, beta))
        if gamma is not None:
            n = np.multiply(n, gamma, out=n) if fit[0] else n * gamma
        if beta is not None:
            n = np.add(n, beta, out=n) if fit[1] else n + beta
        return n
    return forward


def fuse_layernorm(graph):
    """CompiledGraph -> CompiledGraph with decomposed layer norms as one node each."""
    inits = graph.initializers
    outputs = set(graph.output_names)
    readers: dict[str, list] = {}
    for n in graph.nodes:
        for x in n.inputs:
            if x and all(r is not n for r in readers.get(x, [])):  # Mul(d, d) reads d once
                readers.setdefault(x, []).append(n)

    def only(name, count=1):
        """The readers of ``name`` when there are exactly ``count`` and it is no graph output."""
        rs = readers.get(name, [])
        return rs if len(rs) == count and name not in outputs else None

    def op(n, *types):
        return n is not None and not n.domain and n.kernel.op_type in types

    replaced: dict[int, object] = {}
    dropped: set[int] = set()
    for mean1 in graph.nodes:
        if not op(mean1, "ReduceMean") or id(mean1) in dropped:
            continue
        axes = _axes(mean1, inits)
        if axes is None:
            continue
        x, m = mean1.inputs[0], mean1.outputs[0]
        rs = only(m)
        if not rs or not op(rs[0], "Sub") or rs[0].inputs[:2] != [x, m]:
            continue
        sub = rs[0]
        d = sub.outputs[0]
        rs = only(d, 2)
        if not rs:
            continue
        sq = next((r for r in rs if op(r, "Pow", "Mul")), None)
        div = next((r for r in rs if op(r, "Div")), None)
        if sq is None or div is None or sq is div or div.inputs[0] != d:
            continue
        if op(sq, "Pow"):
            e = _scalar(inits, sq.inputs[1]) if sq.inputs[0] == d and len(sq.inputs) > 1 else None
            if e is None or float(e.reshape(-1)[0]) != 2.0:
                continue
            two_is_pow, pow_exp = True, e
        else:
            if sq.inputs[:2] != [d, d]:
                continue
            two_is_pow, pow_exp = False, None
        rs = only(sq.outputs[0])
        if not rs or not op(rs[0], "ReduceMean") or _axes(rs[0], inits) != axes:
            continue
        mean2 = rs[0]
        rs = only(mean2.outputs[0])
        if not rs or not op(rs[0], "Add"):
            continue
        add_eps = rs[0]
        others = [i for i in add_eps.inputs if i != mean2.outputs[0]]
        eps = _scalar(inits, others[0]) if len(others) == 1 else None
        if eps is None:
            continue
        rs = only(add_eps.outputs[0])
        if not rs or not op(rs[0], "Sqrt"):
            continue
        sqrt = rs[0]
        rs = only(sqrt.outputs[0])
        if not rs or rs[0] is not div or div.inputs[1] != sqrt.outputs[0]:
            continue
        chain = [mean1, sub, sq, mean2, add_eps, sqrt, div]
        last, gamma, beta = div, None, None
        rs = only(last.outputs[0])
        if rs and op(rs[0], "Mul") and _affine(rs[0], last.outputs[0], inits) is not None:
            gamma = _affine(rs[0], last.outputs[0], inits)
            last = rs[0]
            chain.append(last)
            rs = only(last.outputs[0])
        if rs and op(rs[0], "Add") and _affine(rs[0], last.outputs[0], inits) is not None:
            beta = _affine(rs[0], last.outputs[0], inits)
            last = rs[0]
            chain.append(last)
        if any(id(c) in dropped or id(c) in replaced for c in chain):
            continue
        forward = _make_forward(axes, two_is_pow, pow_exp, eps, gamma, beta)
        kernel = dataclasses.replace(mean1.kernel, op_type=FUSED, forward=forward, backward_fn=None,
                                     forward_train=None, attributes=())
        # the fused node sits where the chain's last node was: every input is ready there
        replaced[id(last)] = dataclasses.replace(last, op_type=FUSED, inputs=[x], outputs=[last.outputs[0]],
                                                 attrs={}, kernel=kernel, free_after=[])
        dropped.update(id(c) for c in chain if c is not last)
    if not replaced:
        return graph
    nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) not in dropped]
    return dataclasses.replace(graph, nodes=nodes)
