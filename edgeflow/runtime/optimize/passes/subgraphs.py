"""The portable passes inside subgraphs: If branches, Loop and Scan bodies.

Exporters put whole blocks of a model into control flow (silero-vad's
sample-rate ``If`` holds the entire network, with its weights as Constant
nodes and ``Slice``/``Concat`` chains over them). Left as they are, those
nodes run on every call. This pass gives each graph attribute the treatment
the main graph gets — Constant nodes to initializers, Identity removal,
constant folding, BatchNormalization folding, dead-node removal, and this
pass again for nested graphs — until nothing changes, and writes the body
back. Folded values become initializers of the body (a graph attribute may
hold initializers).

What a body reads from the enclosing scope folds too when it is a constant
there (an initializer no caller can override): the body sees it as one of
its own initializers while it is optimized, and afterwards reads it from the
enclosing scope again unless folding consumed it — so weights are never
copied into a body. A body's inputs and outputs keep their names and order,
so the node's interface is unchanged.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ..ir import Graph, Node, PassOptions, from_model, infer_shapes, outer_refs, to_model
from .constants import constants_to_initializers
from .dce import remove_dead_nodes
from .fold import fold_constants
from .fuse_bn import fuse_batchnorm
from .identity import remove_identity

_MAX_ROUNDS = 4


def _body_passes():
    return (constants_to_initializers, remove_identity, fold_constants, inline_constant_if, fuse_batchnorm,
            remove_dead_nodes, optimize_subgraphs)


def _value_info(parent: Graph, name: str) -> onnx.ValueInfoProto | None:
    if name in parent.initializers:
        a = parent.initializers[name]
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
    return parent.value_info.get(name)


def optimize_body(body: onnx.GraphProto, parent: Graph, options: PassOptions) -> onnx.GraphProto:
    """One graph attribute optimized (the same object back when nothing changed)."""
    # IR >= 4: initializers are not listed as inputs, so a body's inputs stay exactly its own
    g = from_model(_as_model(body, parent))
    refs = sorted(outer_refs(body))
    outer = {x: parent.initializers[x] for x in refs if parent.is_constant(x) and x not in options.keep}
    # the other outer values enter as inputs while the body is optimized, so that shape
    # inference sees their types and shapes (then Shape -> Gather -> Equal -> If folds)
    extra = tuple(vi for vi in (_value_info(parent, x) for x in refs if x not in outer) if vi is not None)
    start = g
    own_inputs = g.inputs
    g = g.replace(initializers={**outer, **g.initializers}, inputs=own_inputs + extra)
    g = infer_shapes(g)
    for _ in range(_MAX_ROUNDS):
        before = g
        for fn in _body_passes():
            g = fn(g, options)
        if g is before:
            break
        g = infer_shapes(g)
    back = {k: v for k, v in g.initializers.items() if not (k in outer and v is outer[k])}
    g = g.replace(initializers=back, inputs=own_inputs)  # outer values read from the enclosing scope again
    if g.nodes == start.nodes and g.initializers.keys() == start.initializers.keys() and all(
            g.initializers[k] is start.initializers[k] for k in g.initializers):
        return body
    return to_model(g).graph


def _implicit(attrs: dict[str, onnx.AttributeProto]) -> tuple[str, ...]:
    names: set[str] = set()
    for a in attrs.values():
        if a.type == onnx.AttributeProto.GRAPH:
            names |= outer_refs(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for sub in a.graphs:
                names |= outer_refs(sub)
    return tuple(sorted(names))


def optimize_subgraphs(graph: Graph, options: PassOptions = PassOptions()) -> Graph:
    nodes: list[Node] = []
    changed = False
    for n in graph.nodes:
        if not n.has_subgraph:
            nodes.append(n)
            continue
        attrs = dict(n.attrs)
        touched = False
        for k, a in n.attrs.items():
            if a.type == onnx.AttributeProto.GRAPH:
                new = optimize_body(a.g, graph, options)
                if new is not a.g:
                    attrs[k] = helper.make_attribute(k, new)
                    touched = True
            elif a.type == onnx.AttributeProto.GRAPHS:
                subs = [optimize_body(s, graph, options) for s in a.graphs]
                if any(s is not o for s, o in zip(subs, a.graphs)):
                    attrs[k] = helper.make_attribute(k, subs)
                    touched = True
        if touched:
            n = n.replace(attrs=attrs, implicit=_implicit(attrs))
            changed = True
        nodes.append(n)
    return graph.replace(nodes=nodes) if changed else graph


def _constant_condition(graph: Graph, name: str) -> bool | None:
    if not name or not graph.is_constant(name):
        return None
    v = graph.initializers[name]
    if v.size != 1:
        return None
    return bool(v.reshape(-1)[0])


def inline_constant_if(graph: Graph, options: PassOptions = PassOptions()) -> Graph:
    """An If whose condition is a constant becomes the nodes of the branch it takes.

    The branch's nodes and initializers move into this graph (ONNX names are
    unique across a model and its subgraphs; a branch whose names clash with
    this graph's stays an If), and each branch output reaches the If's output
    through an Identity that the identity pass then removes.
    """
    nodes: list[Node] = []
    inits = dict(graph.initializers)
    vinfo = dict(graph.value_info)
    changed = False
    defined = set(inits) | set(graph.input_names) | {o for n in graph.nodes for o in n.outputs if o}
    for n in graph.nodes:
        cond = _constant_condition(graph, n.inputs[0]) if n.is_op("If") and n.inputs else None
        branch = n.attrs.get("then_branch" if cond else "else_branch") if cond is not None else None
        if branch is None or branch.type != onnx.AttributeProto.GRAPH \
                or len(branch.g.output) != len(n.outputs):
            nodes.append(n)
            continue
        b = branch.g
        sub = from_model(_as_model(b, graph))
        local = set(sub.initializers) | {o for m in sub.nodes for o in m.outputs if o}
        if local & defined:
            nodes.append(n)
            continue
        inits.update(sub.initializers)
        for k, vi in sub.value_info.items():
            vinfo.setdefault(k, vi)
        nodes.extend(sub.nodes)
        for src, dst in zip(sub.output_names, n.outputs):
            if dst:
                nodes.append(Node("Identity", (src,), (dst,), name=f"{n.name or 'If'}/{dst}"))
        defined |= local
        changed = True
    if not changed:
        return graph
    return graph.replace(nodes=nodes, initializers=inits, value_info=vinfo)


def _as_model(body: onnx.GraphProto, parent: Graph) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.ir_version = max(int(parent.template.ir_version or 0), 4)
    m.opset_import.extend(parent.template.opset_import)
    m.graph.CopyFrom(body)
    return m
