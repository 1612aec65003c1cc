"""Constant nodes -> initializers.

Exporters such as Paddle's store every weight as a ``Constant`` node. As an
initializer the same tensor is a parameter: ``inspect`` counts it, the
trainer can train it, quantization finds the weights of Conv/Gemm, and the
other passes see it as a constant. A Constant whose output is a graph output
stays a node (a graph output must be produced), and so does a sparse one.
"""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node, PassOptions, attr_value

_SCALAR = {"value_float": np.float32, "value_int": np.int64, "value_floats": np.float32, "value_ints": np.int64}


def constant_value(node: Node) -> np.ndarray | None:
    """The tensor a Constant node produces, or None (sparse or malformed)."""
    if len(node.attrs) != 1:
        return None
    (name, attr), = node.attrs.items()
    if name == "value":
        return np.asarray(attr_value(attr))
    if name in _SCALAR:
        return np.asarray(attr_value(attr), dtype=_SCALAR[name])
    if name == "value_string":
        return np.asarray(attr_value(attr).encode("utf-8"), dtype=object)
    if name == "value_strings":
        return np.asarray([s.encode("utf-8") for s in attr_value(attr)], dtype=object)
    return None  # sparse_value: left as a node


def constants_to_initializers(graph: Graph, options: PassOptions = PassOptions()) -> Graph:
    outputs = set(graph.output_names)
    inits = dict(graph.initializers)
    nodes = []
    for n in graph.nodes:
        if n.is_op("Constant") and len(n.outputs) == 1 and n.outputs[0] not in outputs:
            value = constant_value(n)
            if value is not None:
                inits[n.outputs[0]] = value
                continue
        nodes.append(n)
    if len(nodes) == len(graph.nodes):
        return graph
    return graph.replace(nodes=nodes, initializers=inits)
