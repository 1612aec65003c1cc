"""Constant folding: compute once, at load, every node whose inputs are all constants.

The node runs on the numpy kernels (``edgeflow.kernels``) and its outputs
become initializers. Shapes count as constants once they are known: a
``Shape`` (or ``Size``) of a value whose dims shape inference fixed is the
constant it will always be, and a ``Gather``/``Slice`` that picks only known
dims of a ``Shape`` folds even when other dims stay dynamic — so the
``Shape -> Gather -> Concat -> Reshape`` subgraphs of exported models fold
away once the input shapes are fixed (``--shape``).

What is never folded: random ops; Quantize/DequantizeLinear (the numpy
backend's QDQ fusion reads them; it folds constant DequantizeLinear itself);
Dropout (see the identity pass); nodes with subgraphs; a node whose op has
no kernel, whose kernel fails, or whose attributes the kernel does not know
(left as a node, logged at debug level); graph outputs and values in
``keep``; a node reading an initializer that is also a graph input (a caller
may override it) or a kept one (a trainable weight); and a node whose
outputs would exceed its constant inputs by more than ``fold_limit`` bytes.
"""

from __future__ import annotations

import logging

import numpy as np
from onnx import helper

from ....kernels import UnknownOpError, get_kernel
from ..ir import Graph, Node, PassOptions, attr_value, toposorted

log = logging.getLogger(__name__)

NEVER_FOLD = frozenset({
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "Dropout", "Constant",
})


def _shape_source(graph: Graph, producers: dict[str, Node], name: str) -> list[int | None] | None:
    """Dims (None where dynamic) that value ``name`` holds if a Shape node produced it."""
    p = producers.get(name)
    if p is None or not p.is_op("Shape") or not p.inputs:
        return None
    dims = graph.dims(p.inputs[0])
    if dims is None:
        return None
    start, end = int(p.attr("start", 0)), p.attr("end")
    return list(dims[start:end] if end is not None else dims[start:])


def _fold_shape_op(graph: Graph, n: Node, inits: dict, const: set[str], producers: dict) -> list | None:
    """Shape, Size, and Gather/Slice of a partly known Shape, from inferred dims."""
    if n.op_type in ("Shape", "Size"):
        dims = graph.dims(n.inputs[0])
        if dims is None:
            return None
        if n.op_type == "Size":
            return [np.array(int(np.prod(dims)), np.int64)] if None not in dims else None
        start, end = int(n.attr("start", 0)), n.attr("end")
        sub = dims[start:end] if end is not None else dims[start:]
        return [np.array(sub, np.int64)] if None not in sub else None
    src = _shape_source(graph, producers, n.inputs[0])
    if src is None or not all(x in const for x in n.inputs[1:] if x):
        return None
    index = np.arange(len(src))
    if n.op_type == "Gather":
        if int(n.attr("axis", 0)) not in (0, -1) or len(n.inputs) < 2:
            return None
        picked = np.take(index, np.asarray(inits[n.inputs[1]]).astype(np.int64))
    else:  # Slice: run the kernel on the dim indices
        args = [index] + [inits[x] if x else None for x in n.inputs[1:]]
        picked = _run(graph, n, args)
        if picked is None:
            return None
        picked = picked[0]
    values = [src[int(i)] for i in np.asarray(picked).reshape(-1)]
    if None in values:
        return None
    return [np.array(values, np.int64).reshape(np.shape(picked))]


def _run(graph: Graph, n: Node, args: list) -> list | None:
    """Outputs of ``n`` on ``args`` through its numpy kernel, or None if it cannot run."""
    first = next((a for a in args if a is not None), None)
    try:
        kernel = get_kernel(n.op_type, "", graph.opset(), None if first is None else first.dtype)
    except UnknownOpError as exc:  # no kernel: nothing to fold with
        log.debug("not folding %s (%s): %s", n.name, n.op_type, exc)
        return None
    attrs = {}
    for k, a in n.attrs.items():
        if k not in kernel.attributes:
            return None
        attrs[k] = attr_value(a)
    if kernel.wants_n_outputs:
        used = len(n.outputs)
        while used > 1 and not n.outputs[used - 1]:
            used -= 1
        attrs["n_outputs"] = used
    try:
        out = kernel.forward(*args, **attrs)
    except Exception as exc:  # a kernel that cannot compute it: leave the node to run (and fail) normally
        log.debug("not folding %s (%s): %s", n.name, n.op_type, exc)
        return None
    return list(out) if isinstance(out, tuple) else [out]


def _owned(v: np.ndarray) -> np.ndarray:
    """A C-contiguous array of its own (kernels may return views; 0-d stays 0-d)."""
    return v.copy() if v.base is not None or not v.flags.c_contiguous else v


def _cast_to_declared(graph: Graph, name: str, value: np.ndarray) -> np.ndarray | None:
    declared = graph.elem_type(name) if name not in graph.initializers else 0
    if not declared:
        return value
    try:
        want = np.dtype(helper.tensor_dtype_to_np_dtype(declared))
    except (KeyError, TypeError, ValueError):
        return None
    return value if value.dtype == want else value.astype(want)


def fold_constants(graph: Graph, options: PassOptions = PassOptions()) -> Graph:
    keep = options.kept(graph)
    blocked = set(graph.output_names) | keep
    inits = dict(graph.initializers)
    const = graph.constants(keep)
    producers = graph.producers()
    nodes: list[Node] = []
    folded = 0
    for n in toposorted(graph.nodes, set(inits) | set(graph.input_names)):
        values = None
        if (n.default_domain and n.op_type not in NEVER_FOLD and not n.has_subgraph and n.inputs
                and any(n.outputs) and not any(o in blocked for o in n.outputs)):
            if all(x in const for x in n.inputs if x):
                args = [inits[x] if x else None for x in n.inputs]
                values = _run(graph, n, args)
                in_bytes = sum(a.nbytes for a in args if isinstance(a, np.ndarray))
            elif n.op_type in ("Shape", "Size", "Gather", "Slice"):
                values = _fold_shape_op(graph, n, inits, const, producers)
                in_bytes = 0
        if values is not None and not all(isinstance(v, (np.ndarray, np.generic)) for v in values):
            values = None  # a sequence or an optional is no initializer
        if values is not None:
            names = [o for o in n.outputs if o]
            outs = [np.asarray(v) for v, o in zip(values, n.outputs) if o]
            if len(outs) < len(names) or sum(v.nbytes for v in outs) > in_bytes + options.fold_limit:
                values = None
            else:
                outs = [_cast_to_declared(graph, o, _owned(v)) for o, v in zip(names, outs)]
                if any(v is None for v in outs):
                    values = None
        if values is None:
            nodes.append(n)
            continue
        for o, v in zip(names, outs):
            inits[o] = v
            const.add(o)
        folded += 1
    if not folded:
        return graph
    return graph.replace(nodes=nodes, initializers=inits)
