"""Identity and inference-mode Dropout removal.

``y = Identity(x)`` (and ``y, [mask] = Dropout(x)`` when it is not
training) is dropped and its readers read ``x``. When ``y`` must keep its
name (a graph output, or in ``keep``), ``x`` is renamed to ``y`` instead, if
``x`` is a plain intermediate; otherwise the node stays. A value that a
subgraph reads (outer scope) is never renamed. Dropout stays when training
(``for_training``), when its ``training_mode`` input is not a constant
false, or when its mask is read.
"""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node, PassOptions


def _is_passthrough(graph: Graph, n: Node, options: PassOptions, read: set[str]) -> bool:
    if not n.default_domain or len(n.inputs) < 1 or not n.inputs[0] or not n.outputs or not n.outputs[0]:
        return False
    if n.op_type == "Identity":
        return len(n.outputs) == 1
    if n.op_type != "Dropout" or options.for_training:
        return False
    if len(n.outputs) > 1 and n.outputs[1] and (n.outputs[1] in read or n.outputs[1] in graph.output_names):
        return False  # the mask is used
    if len(n.inputs) > 2 and n.inputs[2]:
        mode = graph.initializers.get(n.inputs[2])
        if mode is None or not graph.is_constant(n.inputs[2]) or bool(np.asarray(mode).reshape(-1)[0]):
            return False
    if graph.opset() < 7 and not n.attr("is_test", 0):
        return False
    return True


def remove_identity(graph: Graph, options: PassOptions = PassOptions()) -> Graph:
    keep = options.kept(graph)
    outputs = set(graph.output_names)
    inputs = set(graph.input_names)
    implicit = graph.implicit_reads()
    read = {x for n in graph.nodes for x in n.reads}

    # 1. y is a plain intermediate: its readers read x instead
    rename: dict[str, str] = {}
    dropped: set[int] = set()
    for i, n in enumerate(graph.nodes):
        if not _is_passthrough(graph, n, options, read):
            continue
        y = n.outputs[0]
        if y in outputs or y in keep or y in implicit:
            continue
        rename[y] = n.inputs[0]
        dropped.add(i)

    def resolve(x: str) -> str:
        seen = set()
        while x in rename and x not in seen:
            seen.add(x)
            x = rename[x]
        return x

    nodes = []
    for i, n in enumerate(graph.nodes):
        if i in dropped:
            continue
        if any(x in rename for x in n.inputs):
            n = n.replace(inputs=[resolve(x) if x else x for x in n.inputs])
        nodes.append(n)

    # 2. y must keep its name: the producer of x writes y directly
    producers = {o: k for k, n in enumerate(nodes) for o in n.outputs if o}
    out_nodes: list[Node | None] = list(nodes)
    for k in range(len(out_nodes)):
        n = out_nodes[k]
        if n is None or not _is_passthrough(graph, n, options, read):
            continue
        x, y = n.inputs[0], n.outputs[0]
        if x in outputs or x in inputs or x in keep or x in implicit or x in graph.initializers:
            continue
        p = producers.get(x)
        if p is None or out_nodes[p] is None:
            continue
        out_nodes[k] = None
        for j, m in enumerate(out_nodes):
            if m is None:
                continue
            if x in m.outputs:
                m = m.replace(outputs=[y if o == x else o for o in m.outputs])
            if x in m.inputs:
                m = m.replace(inputs=[y if v == x else v for v in m.inputs])
            out_nodes[j] = m
    final = [n for n in out_nodes if n is not None]
    if len(final) == len(graph.nodes) and not rename:
        return graph
    return graph.replace(nodes=final)
