"""An ONNX graph compiled for the numpy kernels: nodes bound to kernels,
attributes decoded once, a topological schedule, value lifetimes, and a
memory plan.

The numpy backend runs it; the trainer (``edgeflow.train``) walks the same
schedule forward and in reverse. Compiling is where every problem is found —
all unsupported ops are listed in one error, unknown attributes are named —
so that a run never fails half-way on something knowable at load.

Control-flow nodes (If, Loop, Scan, SequenceMap) have their graph attributes
compiled recursively into :class:`~edgeflow.runtime.control_flow.Subgraph` objects;
the outer-scope values a subgraph reads become extra inputs of its node
(``Node.outer_reads``), see :mod:`edgeflow.runtime.control_flow`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..data import image_decoder as _image_decoder  # noqa: F401 - registers ImageDecoder where Pillow is installed
from .control_flow import Plan, Subgraph, bind_subgraphs, check_arity
from ..errors import ModelError, UnsupportedOpError
from ..kernels import Kernel, UnknownOpError, get_kernel
from .model import TensorInfo, elem_dtype, graph_inputs, graph_outputs, model_opset
from .optimize import optimize_compiled, optimize_model
from .optimize.pipeline import assign_lifetimes

_DEFAULT_DOMAINS = ("", "ai.onnx")
_GRAPH_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


@dataclass
class Node:
    """One graph node bound to its kernel."""

    index: int
    name: str
    op_type: str
    domain: str
    inputs: list[str]  # "" marks an omitted optional input
    outputs: list[str]  # "" marks an unused optional output
    attrs: dict[str, Any]
    kernel: Kernel
    free_after: list[str] = field(default_factory=list)
    # values whose last reader is this node: the executor drops them after it
    fused_relu: bool = False
    # inference rewrite: a following Relu applied in place on this output
    subgraphs: dict[str, Subgraph] = field(default_factory=dict)
    # control flow: the compiled graph attributes (the kernel is bound to them)
    outer_reads: tuple[str, ...] = ()
    # control flow: outer-scope values its subgraphs read; ``inputs`` ends with
    # them, so lifetimes count them as read by this node

    def call(self, args: list[Any]) -> tuple[np.ndarray, ...]:
        out = self.kernel.forward(*args, **self.attrs)
        if isinstance(out, tuple):
            return out
        return (out,)


def decode_attribute(attr: onnx.AttributeProto) -> Any:
    """Attribute -> plain Python/numpy value (strings decoded, tensors as arrays).

    Graph attributes come back as the ``GraphProto`` (a list of them for
    GRAPHS): :func:`compile_graph` compiles them into subgraphs itself.
    """
    if attr.type == onnx.AttributeProto.GRAPH:
        return attr.g
    if attr.type == onnx.AttributeProto.GRAPHS:
        return list(attr.graphs)
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8") for v in value]
    if isinstance(value, list) and value and isinstance(value[0], onnx.TensorProto):
        return [numpy_helper.to_array(v) for v in value]
    if isinstance(value, list):
        return tuple(value)  # hashable: kernels memoise geometry on attributes
    return value


def value_types(model: onnx.ModelProto) -> dict[str, str]:
    """Element dtype of every value the model declares or inference found."""
    return _graph_value_types(model.graph)


def _graph_value_types(g: onnx.GraphProto) -> dict[str, str]:
    """Element dtype of every tensor value one graph (not its subgraphs) declares."""
    out: dict[str, str] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        dt = elem_dtype(vi.type.tensor_type.elem_type)
        if dt:
            out[vi.name] = dt
    for t in g.initializer:
        out[t.name] = elem_dtype(t.data_type)
    return out


def _op_label(domain: str, op: str) -> str:
    return op if domain in _DEFAULT_DOMAINS else f"{domain}::{op}"


def node_label(n: onnx.NodeProto, position: int) -> str:
    """A node's name, or ``OpType_<position in its graph>`` for a nameless one."""
    return n.name or f"{n.op_type}_{position}"


def _walk_nodes(g: onnx.GraphProto, where: str):
    """Every node of ``g`` and of its subgraphs, as (domain, node, path)."""
    for i, n in enumerate(g.node):
        dom = "" if n.domain in _DEFAULT_DOMAINS else n.domain
        label = node_label(n, i)
        yield dom, n, f"{where}node '{label}'"
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk_nodes(a.g, f"{where}{n.op_type} '{label}' / {a.name} / ")
            elif a.type == onnx.AttributeProto.GRAPHS:
                for k, sg in enumerate(a.graphs):
                    yield from _walk_nodes(sg, f"{where}{n.op_type} '{label}' / {a.name}[{k}] / ")


@dataclass(frozen=True)
class MissingOp:
    """An op without a kernel: its label, the opset asked for, where it is used."""

    op: str  # "Erf" or "domain::Op"
    opset: int
    first: str  # path of the first node using it, e.g. "If 'n1' / then_branch / node 'e'"
    count: int  # nodes using it, subgraphs included

    def line(self) -> str:
        more = f" and {self.count - 1} more node(s)" if self.count > 1 else ""
        return f"{self.op} (opset {self.opset}) at {self.first}{more}"


def find_missing(model: onnx.ModelProto, supported: Callable[[str, str, int], bool]) -> list[MissingOp]:
    """Every distinct op of the model, subgraphs included, that ``supported`` refuses."""
    found: dict[str, list] = {}
    ok: set[str] = set()
    for dom, n, path in _walk_nodes(model.graph, ""):
        label = _op_label(dom, n.op_type)
        if label in ok:
            continue
        if label in found:
            found[label][3] += 1
            continue
        opset = model_opset(model, dom)
        if supported(dom, n.op_type, opset):
            ok.add(label)
        else:
            found[label] = [label, opset, path, 1]
    return [MissingOp(*v) for v in found.values()]


def find_unsupported(model: onnx.ModelProto, supported: Callable[[str, str, int], bool]) -> list[str]:
    """Every distinct op of the model (subgraphs included) for which ``supported(domain, op, opset)`` is false."""
    return [m.op for m in find_missing(model, supported)]


def numpy_supports(domain: str, op: str, opset: int) -> bool:
    try:
        get_kernel(op, domain, opset)
    except UnknownOpError:
        return False
    return True


def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    """Ops of the model with no numpy kernel at the model's opset."""
    return find_unsupported(model, numpy_supports)


def outer_scope_names(g: onnx.GraphProto) -> set[str]:
    """Names ``g`` (or a graph nested in it) reads but does not define: values
    of the enclosing graphs, resolved at run time."""
    defined = {i.name for i in g.input} | {t.name for t in g.initializer}
    defined |= {t.values.name for t in g.sparse_initializer}
    reads: set[str] = {o.name for o in g.output}
    for n in g.node:
        defined.update(n.output)
        reads.update(n.input)
        reads |= subgraph_reads(n)
    return reads - defined - {""}


def subgraph_reads(n: onnx.NodeProto) -> set[str]:
    """Outer-scope names read by the subgraphs of node ``n`` (empty for ordinary nodes)."""
    out: set[str] = set()
    for a in n.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out |= outer_scope_names(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for sg in a.graphs:
                out |= outer_scope_names(sg)
    return out


def _toposort(g: onnx.GraphProto, available: set[str]) -> list[onnx.NodeProto]:
    """Nodes in an order where each runs after its producers (stable).

    A control-flow node also depends on the producers of the outer-scope
    values its subgraphs read.
    """
    produced_by: dict[str, int] = {}
    for i, n in enumerate(g.node):
        for o in n.output:
            if o:
                produced_by[o] = i
    reads = [
        list(n.input) + sorted(subgraph_reads(n)) if any(a.type in _GRAPH_ATTRS for a in n.attribute)
        else n.input
        for n in g.node
    ]
    order: list[onnx.NodeProto] = []
    state = [0] * len(g.node)  # 0 new, 1 visiting, 2 done
    for start in range(len(g.node)):
        if state[start]:
            continue
        stack = [(start, 0)]
        while stack:
            i, k = stack.pop()
            if k == 0:
                if state[i] == 2:
                    continue
                state[i] = 1
            deps = [produced_by[x] for x in reads[i] if x and x not in available and x in produced_by]
            if k < len(deps):
                stack.append((i, k + 1))
                d = deps[k]
                if state[d] == 1:
                    raise ModelError(f"the graph has a cycle through node {g.node[d].name or g.node[d].op_type}")
                if state[d] == 0:
                    stack.append((d, 0))
            else:
                state[i] = 2
                order.append(g.node[i])
    return order


@dataclass
class CompiledGraph:
    """A model ready for the numpy executor (and the trainer)."""

    model: onnx.ModelProto
    opset: int
    nodes: list[Node]
    initializers: dict[str, np.ndarray]
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    types: dict[str, str]

    _plan: Plan | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    def plan(self) -> Plan:
        """The execution plan of :attr:`nodes` (built on first use, rebuilt if
        ``nodes`` or ``initializers`` were replaced since). The graph inputs
        take slots 1..len(inputs), in order."""
        p = self._plan
        if p is None or p.nodes is not self.nodes or p.constants is not self.initializers:
            p = self._plan = Plan(self.nodes, self.initializers, tuple(self.input_names))
        return p

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]


def compile_graph(model: onnx.ModelProto, *, optimize: bool = True) -> CompiledGraph:
    """Bind every node to a kernel; raise one error listing all problems.

    ``optimize`` runs the optimizer (:mod:`edgeflow.runtime.optimize`): its portable
    passes on the model first (constants, folding, BatchNormalization
    folding, dead nodes...), then the numpy backend's passes on the bound
    graph (QDQ fusion, pre-transposed Gemm weights, activation fusion). The
    trainer compiles with ``optimize=False`` so that initializer names map
    1:1 to parameters (or optimizes itself with ``for_training=True``).
    """
    if optimize:
        model = optimize_model(model)
    _refuse_missing_ops(model)
    g = model.graph
    opset = model_opset(model)
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    inputs = graph_inputs(model)
    outputs = graph_outputs(model)
    types = value_types(model)
    available = set(inits) | {i.name for i in inputs}
    ordered = _toposort(g, available)

    problems: list[str] = []
    nodes = _bind_nodes(model, g, ordered, types, "", problems)
    _check_outer_reads(nodes, available, problems)
    if problems:
        raise UnsupportedOpError("the model cannot run on the numpy backend:\n  " + "\n  ".join(problems))

    graph = CompiledGraph(model, opset, nodes, inits, inputs, outputs, types)
    if optimize:
        graph = optimize_compiled(graph)
    _assign_lifetimes(graph.nodes, set(graph.initializers), set(graph.output_names))
    return graph


def _refuse_missing_ops(model: onnx.ModelProto) -> None:
    missing = find_missing(model, numpy_supports)
    if missing:
        raise UnsupportedOpError(
            f"the numpy backend has no kernel for {len(missing)} op(s) of this model:\n  "
            + "\n  ".join(m.line() for m in missing)
            + "\nuse the 'ort' backend where onnxruntime is installed, or re-export the model without these ops",
            ops=[m.op for m in missing],
        )


def _bind_nodes(model: onnx.ModelProto, g: onnx.GraphProto, ordered: list[onnx.NodeProto],
                types: dict[str, str], where: str, problems: list[str]) -> list[Node]:
    """Bind each node of one graph (in schedule order) to its kernel.

    Graph attributes are compiled recursively into subgraphs; ``where`` is
    the path of this graph for messages (``"If 'n1' / then_branch / "``).
    """
    position = {id(n): i for i, n in enumerate(g.node)}
    nodes: list[Node] = []
    for idx, n in enumerate(ordered):
        dom = "" if n.domain in _DEFAULT_DOMAINS else n.domain
        label = node_label(n, position[id(n)])
        at = f"{where}node '{label}' ({n.op_type})"
        first = next((x for x in n.input if x), None)
        dtype = types.get(first) if first else None
        node_opset = model_opset(model, dom)
        try:
            kernel = get_kernel(n.op_type, dom, node_opset, dtype or None)
        except UnknownOpError as exc:
            problems.append(f"{at}: {exc}")
            continue
        attrs: dict[str, Any] = {}
        subgraphs: dict[str, Subgraph] = {}
        for a in n.attribute:
            if a.name not in kernel.attributes:
                problems.append(
                    f"{at}: attribute {a.name!r} is not supported "
                    f"by the numpy kernel (it knows: {', '.join(kernel.attributes) or 'none'})"
                )
                continue
            if a.type == onnx.AttributeProto.GRAPH:
                level = f"{n.op_type} '{label}' / {a.name}"
                subgraphs[a.name] = _compile_subgraph(model, a.g, types, level, f"{where}{level} / ", problems)
                continue
            if a.type == onnx.AttributeProto.GRAPHS:
                problems.append(f"{at}: attribute {a.name!r} is a list of graphs, which no numpy kernel takes")
                continue
            try:
                attrs[a.name] = decode_attribute(a)
            except ModelError as exc:
                problems.append(f"{at}: {exc}")
        if kernel.wants_n_outputs:
            # trailing unused outputs do not count; at least one
            attrs["n_outputs"] = _used_outputs(list(n.output))
        outer_reads: tuple[str, ...] = ()
        if subgraphs:
            why = check_arity(n.op_type, node_opset, list(n.input), list(n.output), subgraphs, attrs)
            if why:
                problems.append(f"{at}: {why}")
            outer_reads = tuple(sorted(set().union(*(sg.outer_names for sg in subgraphs.values()))))
            kernel = bind_subgraphs(kernel, len(n.input), subgraphs, outer_reads)
        nodes.append(
            Node(
                index=idx,
                name=label,
                op_type=n.op_type,
                domain=dom,
                inputs=list(n.input) + list(outer_reads),
                outputs=list(n.output),
                attrs=attrs,
                kernel=kernel,
                subgraphs=subgraphs,
                outer_reads=outer_reads,
            )
        )
    return nodes


def _compile_subgraph(model: onnx.ModelProto, g: onnx.GraphProto, types: dict[str, str], level: str,
                      where: str, problems: list[str]) -> Subgraph:
    """One graph attribute -> a :class:`Subgraph` (recursively for nested ones)."""
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    sub_types = {**types, **_graph_value_types(g)}
    input_names = [i.name for i in g.input]
    local = set(inits) | set(input_names)
    ordered = _toposort(g, local)
    nodes = _bind_nodes(model, g, ordered, sub_types, where, problems)
    defined = local | {o for n in g.node for o in n.output if o}
    outer = {x for nd in nodes for x in nd.inputs if x and x not in defined}
    outer |= {o.name for o in g.output if o.name not in defined}
    output_names = [o.name for o in g.output]
    _assign_lifetimes(nodes, set(inits) | outer, set(output_names))
    info = [_declared(vi) for vi in g.output]
    return Subgraph(level, nodes, inits, input_names, output_names, tuple(sorted(outer)), info, g)


def _declared(vi: onnx.ValueInfoProto) -> tuple[np.dtype | None, tuple | None]:
    """(dtype, shape) a subgraph output declares; None where it is not a tensor or not given."""
    if not vi.type.HasField("tensor_type"):
        return None, None
    t = vi.type.tensor_type
    try:
        dtype = np.dtype(elem_dtype(t.elem_type)) if t.elem_type else None
    except TypeError:
        dtype = None
    if not t.HasField("shape"):
        return dtype, None
    return dtype, tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in t.shape.dim)


def _check_outer_reads(nodes: list[Node], available: set[str], problems: list[str]) -> None:
    """Outer-scope names that reach the top-level graph must be defined there."""
    defined = set(available) | {o for n in nodes for o in n.outputs if o}
    for n in nodes:
        for x in n.outer_reads:
            if x not in defined:
                problems.append(
                    f"{n.op_type} '{n.name}': a subgraph reads {x!r}, which no enclosing graph defines"
                )


def _used_outputs(outputs: list[str]) -> int:
    n = len(outputs)
    while n > 1 and not outputs[n - 1]:
        n -= 1
    return n


def _assign_lifetimes(nodes: list[Node], keep: set[str], graph_outputs_: set[str]) -> None:
    assign_lifetimes(nodes, keep, graph_outputs_)
