"""A Softmax that writes a model output stays float on onnxruntime.

The result is read in float anyway, and onnxruntime's QLinearSoftmax costs
about 8x its float Softmax (PP-OCRv4's recognizer: 0.73 vs 0.10 ms over
40 x 6625 class scores, 1 thread: 8% of the int8 model's time). Excluding the
node from ``quantize_static`` is not enough: onnxruntime's quantizer still
puts a QuantizeLinear/DequantizeLinear pair on its output (and on the way to
the graph output through a Reshape), and the session fuses
``DQ -> Softmax -> Q`` back into QLinearSoftmax. :func:`dequantize_readouts`
removes those pairs, which only rounded the values.
"""

from __future__ import annotations

import onnx

from .analysis import links
from .hardswish import _read_by_subgraphs

READOUT_OPS = ("Softmax", "LogSoftmax")
_MOVES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity")
"""Ops that only move values: a readout's output may reach the graph output through them."""


def float_readouts(model: onnx.ModelProto) -> list[str]:
    """Names of the Softmax / LogSoftmax nodes whose output only reaches graph outputs, directly or
    through ops that only move values (the opset 12 -> 13 upgrade puts a Reshape after a Softmax)."""
    outputs = {o.name for o in model.graph.output}
    _, readers = links(list(model.graph.node))

    def only_out(t: str) -> bool:
        rs = readers.get(t, [])
        if not rs:
            return t in outputs
        return all(r.op_type in _MOVES and r.input[0] == t and only_out(r.output[0]) for r in rs)

    return [n.name for n in model.graph.node
            if n.op_type in READOUT_OPS and n.domain in ("", "ai.onnx") and len(n.output) == 1 and only_out(n.output[0])]


def dequantize_readouts(model: onnx.ModelProto, names: list[str]) -> tuple[onnx.ModelProto, int]:
    """The QDQ model without the Q -> DQ pairs after the readout nodes ``names`` (and after the ops
    that only move their values on to a graph output); (model, pairs removed)."""
    g = model.graph
    nodes = list(g.node)
    index = {id(n): i for i, n in enumerate(nodes)}
    _, readers = links(nodes)
    outputs = {o.name for o in g.output}
    drop: set[int] = set()
    bypass: dict[str, str] = {}  # a removed DQ's output -> the value before its Q
    rename: dict[str, str] = {}  # the value before a removed pair -> the graph output the DQ wrote
    todo = [n.output[0] for n in nodes if n.name in names and n.op_type in READOUT_OPS and n.output]
    while todo:
        t = todo.pop()
        rs = readers.get(t, [])
        if len(rs) == 1 and rs[0].op_type == "QuantizeLinear" and t not in outputs:
            q = rs[0]
            dqs = readers.get(q.output[0], [])
            if len(dqs) == 1 and dqs[0].op_type == "DequantizeLinear" and q.output[0] not in outputs \
                    and list(dqs[0].input[1:]) == list(q.input[1:]):
                drop.update((index[id(q)], index[id(dqs[0])]))
                y = dqs[0].output[0]
                if y in outputs:
                    rename[t] = y
                else:
                    bypass[y] = t
                    todo.append(y)
                continue
        todo.extend(r.output[0] for r in rs if r.op_type in _MOVES and r.input and r.input[0] == t)
    if not drop:
        return model, 0
    m = onnx.ModelProto()
    m.CopyFrom(model)
    kept = [n for i, n in enumerate(m.graph.node) if i not in drop]
    for n in kept:
        for i, x in enumerate(n.input):
            x = bypass.get(x, x)
            n.input[i] = rename.get(x, x)
        for i, x in enumerate(n.output):
            n.output[i] = rename.get(x, x)
    del m.graph.node[:]
    m.graph.node.extend(kept)
    # the removed pairs' scales and zero points, where nothing else reads them
    used = {x for n in kept for x in n.input}
    freed = {x for i in drop for x in nodes[i].input[1:]} - used
    for t in [t for t in m.graph.initializer if t.name in freed and not _read_by_subgraphs(kept, t.name)]:
        m.graph.initializer.remove(t)
    return m, len(drop) // 2
