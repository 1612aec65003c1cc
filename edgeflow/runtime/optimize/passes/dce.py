"""Dead-node removal: nodes none of whose outputs reaches a graph output.

Walks back from the graph outputs (and ``keep``) through what each node
reads — its inputs and the outer-scope values its subgraphs read — and
drops every node it never reaches, then every initializer no node reads
(initializers that are also graph inputs stay: they are part of the
model's interface).
"""

from __future__ import annotations

from ..ir import Graph, PassOptions, toposorted


def remove_dead_nodes(graph: Graph, options: PassOptions = PassOptions()) -> Graph:
    keep = options.kept(graph)
    needed = set(graph.output_names) | keep
    order = toposorted(graph.nodes, set(graph.initializers) | set(graph.input_names))
    live = set()
    for n in reversed(order):
        if any(o and o in needed for o in n.outputs):
            live.add(id(n))
            needed.update(n.reads)
    nodes = [n for n in graph.nodes if id(n) in live]
    interface = graph.overridable | set(graph.output_names)
    inits = {k: v for k, v in graph.initializers.items() if k in needed or k in interface}
    if len(nodes) == len(graph.nodes) and len(inits) == len(graph.initializers):
        return graph
    return graph.replace(nodes=nodes, initializers=inits)
