"""An ONNX graph compiled for the numpy kernels: nodes bound to kernels,
attributes decoded once, a topological schedule, value lifetimes, and a
memory plan.

The numpy backend runs it; the trainer (``edgeflow.train``) walks the same
schedule forward and in reverse. Compiling is where every problem is found —
all unsupported ops are listed in one error, unknown attributes are named —
so that a run never fails half-way on something knowable at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import ModelError, UnsupportedOpError
from .kernels import Kernel, UnknownOpError, get_kernel
from .model import TensorInfo, elem_dtype, graph_inputs, graph_outputs, model_opset
from .optimize import optimize_compiled, optimize_model

_DEFAULT_DOMAINS = ("", "ai.onnx")


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

    def call(self, args: list[Any]) -> tuple[np.ndarray, ...]:
        out = self.kernel.forward(*args, **self.attrs)
        if isinstance(out, tuple):
            return out
        return (out,)


def decode_attribute(attr: onnx.AttributeProto) -> Any:
    """Attribute -> plain Python/numpy value (strings decoded, tensors as arrays)."""
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
    if isinstance(value, onnx.GraphProto):
        raise ModelError(f"attribute {attr.name!r} holds a subgraph; control flow is not supported")
    return value


def value_types(model: onnx.ModelProto) -> dict[str, str]:
    """Element dtype of every value the model declares or inference found."""
    g = model.graph
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


def find_unsupported(model: onnx.ModelProto, supported: Callable[[str, str, int], bool]) -> list[str]:
    """Every distinct op of the model for which ``supported(domain, op, opset)`` is false."""
    missing: list[str] = []
    for n in model.graph.node:
        dom = "" if n.domain in _DEFAULT_DOMAINS else n.domain
        opset = model_opset(model, dom)
        label = _op_label(dom, n.op_type)
        if label not in missing and not supported(dom, n.op_type, opset):
            missing.append(label)
    return missing


def _numpy_supports(domain: str, op: str, opset: int) -> bool:
    try:
        get_kernel(op, domain, opset)
    except UnknownOpError:
        return False
    return True


def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    """Ops of the model with no numpy kernel at the model's opset."""
    return find_unsupported(model, _numpy_supports)


def _toposort(g: onnx.GraphProto, available: set[str]) -> list[onnx.NodeProto]:
    """Nodes in an order where each runs after its producers (stable)."""
    produced_by: dict[str, int] = {}
    for i, n in enumerate(g.node):
        for o in n.output:
            if o:
                produced_by[o] = i
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
            deps = [produced_by[x] for x in g.node[i].input if x and x not in available and x in produced_by]
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

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]


def compile_graph(model: onnx.ModelProto, *, optimize: bool = True) -> CompiledGraph:
    """Bind every node to a kernel; raise one error listing all problems.

    ``optimize`` runs the optimizer (:mod:`edgeflow.optimize`): its portable
    passes on the model first (constants, folding, BatchNormalization
    folding, dead nodes...), then the numpy backend's passes on the bound
    graph (QDQ fusion, pre-transposed Gemm weights, activation fusion). The
    trainer compiles with ``optimize=False`` so that initializer names map
    1:1 to parameters (or optimizes itself with ``for_training=True``).
    """
    if optimize:
        model = optimize_model(model)
    missing = unsupported_ops(model)
    if missing:
        raise UnsupportedOpError(
            f"the numpy backend has no kernel for {len(missing)} op(s) of this model: "
            f"{', '.join(missing)}. Use the 'ort' backend where onnxruntime is installed, "
            "or re-export the model without these ops",
            ops=missing,
        )
    g = model.graph
    opset = model_opset(model)
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    inputs = graph_inputs(model)
    outputs = graph_outputs(model)
    types = value_types(model)
    available = set(inits) | {i.name for i in inputs}
    ordered = _toposort(g, available)

    problems: list[str] = []
    nodes: list[Node] = []
    for idx, n in enumerate(ordered):
        dom = "" if n.domain in _DEFAULT_DOMAINS else n.domain
        first = next((x for x in n.input if x), None)
        dtype = types.get(first) if first else None
        try:
            kernel = get_kernel(n.op_type, dom, model_opset(model, dom), dtype or None)
        except UnknownOpError as exc:
            problems.append(str(exc))
            continue
        attrs: dict[str, Any] = {}
        for a in n.attribute:
            if a.name not in kernel.attributes:
                problems.append(
                    f"node {n.name or idx} ({n.op_type}): attribute {a.name!r} is not supported "
                    f"by the numpy kernel (it knows: {', '.join(kernel.attributes) or 'none'})"
                )
                continue
            try:
                attrs[a.name] = decode_attribute(a)
            except ModelError as exc:
                problems.append(f"node {n.name or idx} ({n.op_type}): {exc}")
        if kernel.wants_n_outputs:
            # trailing unused outputs do not count; at least one
            attrs["n_outputs"] = _used_outputs(list(n.output))
        nodes.append(
            Node(
                index=idx,
                name=n.name or f"{n.op_type}_{idx}",
                op_type=n.op_type,
                domain=dom,
                inputs=list(n.input),
                outputs=list(n.output),
                attrs=attrs,
                kernel=kernel,
            )
        )
    if problems:
        raise UnsupportedOpError("the model cannot run on the numpy backend:\n  " + "\n  ".join(problems))

    graph = CompiledGraph(model, opset, nodes, inits, inputs, outputs, types)
    if optimize:
        graph = optimize_compiled(graph)
    _assign_lifetimes(graph.nodes, set(graph.initializers), set(graph.output_names))
    return graph


def _used_outputs(outputs: list[str]) -> int:
    n = len(outputs)
    while n > 1 and not outputs[n - 1]:
        n -= 1
    return n


def _assign_lifetimes(nodes: list[Node], keep: set[str], graph_outputs_: set[str]) -> None:
    last: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for x in n.inputs:
            if x:
                last[x] = i
        for o in n.outputs:
            if o and o not in last:
                last[o] = i  # produced but never read: free right away
    for name, i in last.items():
        if name in keep or name in graph_outputs_:
            continue
        nodes[i].free_after.append(name)
