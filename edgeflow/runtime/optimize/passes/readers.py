"""Who reads each value of a CompiledGraph (the numpy-backend passes' index).

A control-flow node's ``inputs`` end with the outer-scope values its subgraphs
read (:class:`edgeflow.runtime.graph.Node`, ``outer_reads``), so a value a
subgraph captures counts as read by that node here too, and no pass fuses it
away. A node reading a value twice (``Mul(x, x)``) is listed twice: passes
that ask for a value's sole reader want one read, not one reading node.
"""

from __future__ import annotations


def readers(graph) -> dict[str, list]:
    """Value name -> the nodes of ``graph`` that read it, once per read (omitted
    optional inputs, ``""``, skipped). Graph outputs count only where a node reads them."""
    out: dict[str, list] = {}
    for n in graph.nodes:
        for x in n.inputs:
            if x:
                out.setdefault(x, []).append(n)
    return out
