"""HardSwish spelled out in four ops, written as one.

Paddle (and older Keras/TF converters) export ``hard_swish`` as
``Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6)`` (or a Mul by 1/6). That is
HardSwish(x) = x * clip(x/6 + 1/2, 0, 1): from opset 14 one HardSwish node,
before it ``Mul(x, HardSigmoid(x; alpha=1/6, beta=1/2))``. Fewer passes over
the tensor on every backend, and a form the int8 quantizer can run as
integer ops (:mod:`edgeflow.quantization.hardswish`); the result differs
from the four ops only by float rounding (a few ulp).

Not run for training graphs. Fused only when the three intermediates have no other reader, are not graph
outputs nor kept (``keep``), and the constants are scalar initializers of
exactly 3, 0, 6 and 6 (or 1/6 for a Mul).
"""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node, PassOptions


def _scalar(graph: Graph, name: str, consts: set[str]) -> float | None:
    if name not in consts:
        return None
    a = np.asarray(graph.initializers[name])
    return float(a.reshape(())) if a.size == 1 and a.dtype.kind == "f" else None


def _clip_bounds(graph: Graph, clip: Node, consts: set[str]) -> tuple[float | None, float | None]:
    if graph.opset() < 11:
        return clip.attr("min", None), clip.attr("max", None)
    ins = list(clip.inputs) + ["", ""]
    return (_scalar(graph, ins[1], consts) if ins[1] else None, _scalar(graph, ins[2], consts) if ins[2] else None)


def fuse_hardswish(graph: Graph, options: PassOptions = PassOptions()) -> Graph:
    if options.for_training:
        return graph  # training graphs keep the ops their exporter wrote (and their memory figures)
    keep = options.kept(graph)
    consts = graph.constants(keep)
    outputs = set(graph.output_names)
    readers = graph.readers()
    producers = graph.producers()
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    taken: set[int] = set()
    names: set[str] = set()
    replace: dict[int, list[Node]] = {}

    def only_for(name: str, reader: Node) -> Node | None:
        """The producer of ``name`` when ``reader`` is its only reader and it is free to go."""
        p = producers.get(name)
        if p is None or not p.default_domain or index[id(p)] in taken or name in outputs or name in keep:
            return None
        rs = readers.get(name, [])
        return p if len(rs) == 1 and rs[0] is reader else None

    for tail in graph.nodes:
        if not tail.default_domain or len(tail.inputs) != 2 or index[id(tail)] in taken:
            continue
        if tail.op_type == "Div" and _scalar(graph, tail.inputs[1], consts) == 6.0:
            mul = only_for(tail.inputs[0], tail)
        elif tail.op_type == "Mul" and any(
                (v := _scalar(graph, c, consts)) is not None and abs(v - 1 / 6) <= 1e-7 for c in tail.inputs):
            other = tail.inputs[0] if _scalar(graph, tail.inputs[1], consts) is not None else tail.inputs[1]
            mul = only_for(other, tail)
        else:
            continue
        if mul is None or not mul.is_op("Mul") or len(mul.inputs) != 2:
            continue
        for x, r in (mul.inputs, mul.inputs[::-1]):
            clip = only_for(r, mul)
            if clip is None or not clip.is_op("Clip") or _clip_bounds(graph, clip, consts) != (0.0, 6.0):
                continue
            add = only_for(clip.inputs[0], clip)
            if add is None or not add.is_op("Add") or len(add.inputs) != 2 or x not in add.inputs:
                continue
            three = add.inputs[1] if add.inputs[0] == x else add.inputs[0]
            if _scalar(graph, three, consts) != 3.0:
                continue
            y = tail.outputs[0]
            if graph.opset() >= 14:
                new = [Node("HardSwish", (x,), (y,), name=tail.name or y)]
            else:
                h = graph.fresh_name(f"{y}_hardsigmoid", names)
                names.add(h)
                new = [Node("HardSigmoid", (x,), (h,), name=h).with_attrs(alpha=1 / 6, beta=0.5),
                       Node("Mul", (x, h), (y,), name=tail.name or y)]
            for n in (add, clip, mul, tail):
                taken.add(index[id(n)])
            replace[index[id(tail)]] = new
            break
    if not replace:
        return graph
    nodes: list[Node] = []
    for i, n in enumerate(graph.nodes):
        if i in replace:
            nodes.extend(replace[i])
        elif i not in taken:
            nodes.append(n)
    return graph.replace(nodes=tuple(nodes))  # the constants 3, 0, 6 no longer read: dce's job, as after fold
