"""A light graph IR for the optimizer's portable passes.

:func:`from_model` reads a ModelProto into a :class:`Graph` (nodes with
their attributes kept as ``AttributeProto`` — subgraph bodies of If, Loop
and Scan travel untouched —, initializers as numpy arrays, value infos by
name); :func:`to_model` writes it back. Passes treat a Graph and its Nodes
as immutable: each returns a new Graph (``dataclasses.replace``), so the
caller's model is never changed.

A node holding subgraphs reads, besides its inputs, the outer-scope values
its bodies use (``Node.implicit``, like onnxruntime's implicit inputs):
every pass that asks "who reads this value" sees those readers too, so no
pass removes, renames or folds away a value a subgraph needs.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

DEFAULT_DOMAINS = ("", "ai.onnx")

log = logging.getLogger(__name__)


def subgraphs(attr: onnx.AttributeProto) -> Iterator[onnx.GraphProto]:
    """The graphs an attribute holds (an If's branches, a Loop's or Scan's body); none for other attributes."""
    if attr.type == onnx.AttributeProto.GRAPH:
        yield attr.g
    elif attr.type == onnx.AttributeProto.GRAPHS:
        yield from attr.graphs


def outer_refs(g: onnx.GraphProto) -> set[str]:
    """Names a (sub)graph reads that it does not define: its outer-scope values."""
    defined = {i.name for i in g.input} | {t.name for t in g.initializer}
    defined |= {t.values.name for t in g.sparse_initializer}
    used: set[str] = {o.name for o in g.output}
    for n in g.node:
        defined.update(o for o in n.output if o)
        used.update(x for x in n.input if x)
        for a in n.attribute:
            for sub in subgraphs(a):
                used |= outer_refs(sub)
    return used - defined


@dataclass(frozen=True)
class Node:
    """One node: op, value names ("" marks an omitted optional one), attributes."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, onnx.AttributeProto] = field(default_factory=dict)
    domain: str = ""
    name: str = ""
    implicit: tuple[str, ...] = ()  # outer-scope values read by subgraph attributes

    @property
    def default_domain(self) -> bool:
        return self.domain in DEFAULT_DOMAINS

    def is_op(self, *ops: str) -> bool:
        return self.default_domain and self.op_type in ops

    @property
    def has_subgraph(self) -> bool:
        return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in self.attrs.values())

    @property
    def reads(self) -> tuple[str, ...]:
        """Every value this node reads: its inputs and its subgraphs' outer-scope values."""
        return tuple(x for x in self.inputs if x) + self.implicit

    def attr(self, name: str, default: Any = None) -> Any:
        """An attribute's value (strings decoded, tensors as arrays), or ``default``."""
        a = self.attrs.get(name)
        if a is None:
            return default
        return attr_value(a)

    def with_attrs(self, **values: Any) -> "Node":
        """A copy with these attributes set (``None`` removes one)."""
        attrs = dict(self.attrs)
        for k, v in values.items():
            if v is None:
                attrs.pop(k, None)
            else:
                attrs[k] = helper.make_attribute(k, v)
        return dataclasses.replace(self, attrs=attrs)

    def replace(self, **changes: Any) -> "Node":
        for k in ("inputs", "outputs"):
            if k in changes:
                changes[k] = tuple(changes[k])
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        return self.op_type if self.default_domain else f"{self.domain}::{self.op_type}"


def attr_value(a: onnx.AttributeProto) -> Any:
    """AttributeProto -> plain value: str for strings, arrays for tensors, tuples for lists."""
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, list):
        if v and isinstance(v[0], bytes):
            return tuple(x.decode("utf-8") for x in v)
        if v and isinstance(v[0], onnx.TensorProto):
            return tuple(numpy_helper.to_array(x) for x in v)
        return tuple(v)
    return v


@dataclass(frozen=True)
class Graph:
    """A model's main graph as the passes see it."""

    nodes: tuple[Node, ...]
    initializers: dict[str, np.ndarray]
    inputs: tuple[onnx.ValueInfoProto, ...]
    outputs: tuple[onnx.ValueInfoProto, ...]
    value_info: dict[str, onnx.ValueInfoProto]
    opsets: dict[str, int]
    template: onnx.ModelProto  # metadata source for to_model; never modified
    protos: dict[str, tuple[weakref.ref, onnx.TensorProto]] = field(default_factory=dict)
    # initializer name -> (weak reference to the array read from it, the original tensor): unchanged
    # initializers are written back as they were, without a round trip through numpy

    def replace(self, **changes: Any) -> "Graph":
        if "nodes" in changes:
            changes["nodes"] = tuple(changes["nodes"])
        return dataclasses.replace(self, **changes)

    def opset(self, domain: str = "") -> int:
        if domain in DEFAULT_DOMAINS:
            return self.opsets.get("", self.opsets.get("ai.onnx", 0))
        return self.opsets.get(domain, 0)

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.outputs]

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def readers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for x in n.reads:
                out.setdefault(x, []).append(n)
        return out

    def implicit_reads(self) -> set[str]:
        """Values some subgraph reads from this graph's scope."""
        return {x for n in self.nodes for x in n.implicit}

    @property
    def overridable(self) -> set[str]:
        """Initializers a caller may feed: those also listed as graph inputs, from IR
        version 4 on (before it every initializer had to be listed, and none can be
        overridden — onnxruntime's rule too)."""
        if self.template.ir_version and self.template.ir_version < 4:
            return set()
        return {v.name for v in self.inputs if v.name in self.initializers}

    def constants(self, keep: Iterable[str] = ()) -> set[str]:
        """Initializers the passes may treat as fixed values (not overridable, not kept)."""
        return set(self.initializers) - self.overridable - set(keep)

    def is_constant(self, name: str) -> bool:
        """An initializer that no caller can override."""
        return name in self.initializers and name not in self.overridable

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Static shape of a value (every dim known), else None."""
        if name in self.initializers:
            return tuple(self.initializers[name].shape)
        vi = self.value_info.get(name)
        if vi is None or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            return None
        dims = []
        for d in vi.type.tensor_type.shape.dim:
            if not d.HasField("dim_value"):
                return None
            dims.append(int(d.dim_value))
        return tuple(dims)

    def dims(self, name: str) -> tuple[int | None, ...] | None:
        """Per-dim static sizes of a value (None where unknown), or None when the rank is unknown."""
        if name in self.initializers:
            return tuple(self.initializers[name].shape)
        vi = self.value_info.get(name)
        if vi is None or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            return None
        return tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim)

    def elem_type(self, name: str) -> int:
        if name in self.initializers:
            return helper.np_dtype_to_tensor_dtype(self.initializers[name].dtype)
        vi = self.value_info.get(name)
        if vi is None or not vi.type.HasField("tensor_type"):
            return 0
        return int(vi.type.tensor_type.elem_type)

    def fresh_name(self, base: str, taken: Iterable[str] = ()) -> str:
        """A value name not used anywhere in the graph (nor in ``taken``)."""
        used = set(taken) | set(self.initializers) | set(self.value_info)
        used |= {x for n in self.nodes for x in n.inputs + n.outputs} | self.implicit_reads()
        if base not in used:
            return base
        i = 1
        while f"{base}_{i}" in used:
            i += 1
        return f"{base}_{i}"


def from_model(model: onnx.ModelProto) -> Graph:
    """Read a ModelProto's main graph (initializers with external data must be loaded)."""
    g = model.graph
    nodes = []
    for n in g.node:
        implicit: set[str] = set()
        for a in n.attribute:
            for sub in subgraphs(a):
                implicit |= outer_refs(sub)
        nodes.append(Node(
            op_type=n.op_type, inputs=tuple(n.input), outputs=tuple(n.output),
            attrs={a.name: a for a in n.attribute}, domain=n.domain, name=n.name,
            implicit=tuple(sorted(implicit)),
        ))
    inits: dict[str, np.ndarray] = {}
    protos: dict[str, tuple[weakref.ref, onnx.TensorProto]] = {}
    for t in g.initializer:
        a = numpy_helper.to_array(t)
        inits[t.name] = a
        # a weak reference, not id(a): a pass that writes a new array under the same name after the
        # old one was freed can get the old id, and the stale proto would be written back
        protos[t.name] = (weakref.ref(a), t)
    vinfo = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    return Graph(
        nodes=tuple(nodes), initializers=inits, inputs=tuple(g.input), outputs=tuple(g.output),
        value_info=vinfo, opsets={i.domain: int(i.version) for i in model.opset_import},
        template=model, protos=protos,
    )


def _copy_fields(dst, src, skip: set[str]) -> None:
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        # protobuf 7 dropped ``label``; Debian's 4.21 has no ``is_repeated``
        if (fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED):
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def _tensor(name: str, a: np.ndarray, protos: dict[str, tuple[weakref.ref, onnx.TensorProto]],
            skeleton: bool = False) -> onnx.TensorProto:
    if skeleton and a.dtype.kind not in "iub" and a.nbytes > 256:
        # type and dims only: enough for shape inference, which never reads float data
        t = onnx.TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(a.dtype)
        t.dims.extend(a.shape)
        return t
    known = protos.get(name)
    if known is not None and known[0]() is a:
        return known[1]
    return numpy_helper.from_array(np.asarray(a), name)


def to_model(graph: Graph, *, value_info: bool = True, skeleton: bool = False) -> onnx.ModelProto:
    """Write the Graph back as a ModelProto (metadata, functions and opsets from the original).

    ``value_info`` keeps the inferred shapes of values that still exist;
    ``skeleton`` writes large float initializers without their data (for
    shape inference only, which needs their type and dims).
    """
    t = graph.template
    m = onnx.ModelProto()
    _copy_fields(m, t, {"graph"})
    g = m.graph
    _copy_fields(g, t.graph, {"node", "initializer", "input", "output", "value_info"})
    for n in graph.nodes:
        p = g.node.add()
        p.op_type = n.op_type
        p.input.extend(n.inputs)
        p.output.extend(n.outputs)
        if n.name:
            p.name = n.name
        if n.domain:
            p.domain = n.domain
        p.attribute.extend(n.attrs.values())
    g.initializer.extend(_tensor(k, a, graph.protos, skeleton) for k, a in graph.initializers.items())
    inits = set(graph.initializers)
    if m.ir_version and m.ir_version < 4:
        # before IR 4 every initializer is also listed as a graph input: list
        # the current ones (a removed initializer must not become a real input)
        was_init = {x.name for x in t.graph.initializer}
        listed = [v for v in graph.inputs if v.name in inits or v.name not in was_init]
        names = {v.name for v in listed}
        extra = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                 for k, a in graph.initializers.items() if k not in names]
        g.input.extend(listed + extra)
    else:
        g.input.extend(graph.inputs)
    g.output.extend(graph.outputs)
    if value_info:
        produced = {o for n in graph.nodes for o in n.outputs if o}
        io = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
        g.value_info.extend(vi for name, vi in graph.value_info.items()
                            if name in produced and name not in io and name not in inits)
    return m



def infer_shapes(graph: Graph) -> Graph:
    """The graph with value infos re-inferred by ONNX shape inference (data propagation on).

    Inference runs on a skeleton copy (float weights without data), so it is
    cheap for large models. If it fails, the graph comes back unchanged: the
    passes then fold less, never wrongly.
    """
    skel = to_model(graph, value_info=False, skeleton=True)
    try:
        inferred = onnx.shape_inference.infer_shapes(skel, data_prop=True)
    except Exception as exc:  # onnx raises InferenceError and others; folding just sees fewer shapes
        log.debug("shape inference failed, optimizing without it: %s", exc)
        return graph
    g = inferred.graph
    vinfo = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    return graph.replace(value_info=vinfo)


def toposorted(nodes: Iterable[Node], available: Iterable[str] = ()) -> list[Node]:
    """Nodes ordered so that each comes after the producers of what it reads (stable)."""
    nodes = list(nodes)
    produced_by = {o: i for i, n in enumerate(nodes) for o in n.outputs if o}
    avail = set(available)
    state = [0] * len(nodes)  # 0 new, 1 visiting, 2 done
    order: list[Node] = []
    for start in range(len(nodes)):
        if state[start]:
            continue
        stack = [(start, 0)]
        while stack:
            i, k = stack.pop()
            if k == 0:
                if state[i] == 2:
                    continue
                state[i] = 1
            deps = [produced_by[x] for x in nodes[i].reads if x not in avail and x in produced_by]
            if k < len(deps):
                stack.append((i, k + 1))
                d = deps[k]
                if state[d] == 0:
                    stack.append((d, 0))
                # a cycle (state 1) is left for the checker/compiler to report
            else:
                state[i] = 2
                order.append(nodes[i])
    return order


@dataclass(frozen=True)
class PassOptions:
    """What the portable passes may touch.

    ``keep``: value and initializer names that must survive with their
    meaning: never folded into something else, renamed or removed (the
    trainer's trainable weights, a value a caller reads). ``for_training``:
    every float initializer is kept, and Dropout stays (it is live in
    training). ``fold_limit``: a folded value may be at most this many bytes
    larger than the constants it is computed from (Expand/Tile/ConstantOfShape
    of a large shape stay nodes, the model stays small).
    """

    keep: frozenset[str] = frozenset()
    for_training: bool = False
    fold_limit: int = 16 << 20

    def kept(self, graph: Graph) -> frozenset[str]:
        """``keep`` plus, for training, every float initializer of ``graph``."""
        if not self.for_training:
            return self.keep
        return self.keep | {k for k, a in graph.initializers.items() if a.dtype.kind == "f"}
