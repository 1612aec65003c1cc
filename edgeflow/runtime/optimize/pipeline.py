"""The optimizer: one pass pipeline for every part of edgeflow.

Two stages:

1. :func:`optimize_model` — portable passes on the ONNX model (Constant
   nodes to initializers, Identity/Dropout removal, constant and shape
   folding, BatchNormalization and per-channel Mul/Add folded into convs,
   HardSwish spelled in four ops as one, dead-node removal), repeated until
   nothing changes, with ONNX shape inference between rounds so that shapes
   fixed by ``shapes=`` (``--shape``) fold the ``Shape -> ... -> Reshape``
   subgraphs. The result is a valid ONNX model that any backend runs.
   Quantization preprocesses with it; training runs it with
   ``for_training=True`` (trainable weights and Dropout stay).
2. :func:`optimize_compiled` — numpy-backend passes on the graph bound to
   kernels (QDQ patterns to integer kernels, pre-transposed Gemm weights,
   prepacked LSTM weights, squeeze-and-excitation blocks, activation fusion); :func:`edgeflow.runtime.graph.compile_graph` runs both.

:func:`optimize` returns the model with an :class:`OptimizeReport` (op
counts before and after, what each pass removed) — ``edgeflow inspect
--optimized`` prints it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import onnx

from ...errors import InputError
from ..model import fix_input_shapes
from .ir import Graph, PassOptions, from_model, infer_shapes, to_model
from .passes import (
    constants_to_initializers,
    fold_constants,
    fuse_activation,
    fuse_batchnorm,
    fuse_conv_affine,
    fuse_hardswish,
    fuse_layernorm,
    fuse_qdq,
    fuse_se,
    inline_constant_if,
    optimize_subgraphs,
    prepack_gemm,
    prepack_lstm,
    remove_dead_nodes,
    remove_identity,
)

ModelPass = Callable[[Graph, PassOptions], Graph]

#: The portable passes, in order (each a function Graph -> Graph).
MODEL_PASSES: tuple[tuple[str, ModelPass], ...] = (
    ("constants", constants_to_initializers),
    ("identity", remove_identity),
    ("fold", fold_constants),
    ("inline_if", inline_constant_if),
    ("fuse_bn", fuse_batchnorm),
    ("fuse_affine", fuse_conv_affine),
    ("fuse_hardswish", fuse_hardswish),
    ("dce", remove_dead_nodes),
    ("subgraphs", optimize_subgraphs),
)

#: The numpy backend's passes, in order (each CompiledGraph -> CompiledGraph).
NUMPY_PASSES = (
    ("fuse_qdq", fuse_qdq),
    ("prepack_gemm", prepack_gemm),
    ("prepack_lstm", prepack_lstm),
    ("fuse_se", fuse_se),
    ("fuse_layernorm", fuse_layernorm),
    ("fuse_activation", fuse_activation),
)

_MAX_ROUNDS = 4


def op_counts(nodes: Iterable) -> dict[str, int]:
    """Node count per op label (``domain::Op`` outside the default domain)."""
    c: collections.Counter[str] = collections.Counter()
    for n in nodes:
        dom = getattr(n, "domain", "")
        c[n.op_type if dom in ("", "ai.onnx") else f"{dom}::{n.op_type}"] += 1
    return dict(sorted(c.items()))


@dataclass
class OptimizeReport:
    """What the portable passes did to one model."""

    before: dict[str, int]
    after: dict[str, int]
    removed_by_pass: dict[str, int] = field(default_factory=dict)  # nodes each pass removed in all
    rounds: int = 0
    initializers_before: int = 0
    initializers_after: int = 0

    @property
    def nodes_before(self) -> int:
        return sum(self.before.values())

    @property
    def nodes_after(self) -> int:
        return sum(self.after.values())

    def to_dict(self) -> dict:
        return {"nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
                "before": self.before, "after": self.after, "removed_by_pass": self.removed_by_pass,
                "rounds": self.rounds, "initializers_before": self.initializers_before,
                "initializers_after": self.initializers_after}


@dataclass
class Optimized:
    model: onnx.ModelProto
    report: OptimizeReport


def _options(keep: Iterable[str], for_training: bool, fold_limit: int | None) -> PassOptions:
    if isinstance(keep, str):
        keep = [keep]
    kw = {} if fold_limit is None else {"fold_limit": int(fold_limit)}
    return PassOptions(keep=frozenset(keep), for_training=for_training, **kw)


def _needs_shapes(g: Graph) -> bool:
    """Shape/Size nodes whose input has a dim shape inference has not fixed yet."""
    for n in g.nodes:
        if n.is_op("Shape", "Size") and n.inputs:
            dims = g.dims(n.inputs[0])
            if dims is None or None in dims:
                return True
    return False


def optimize(
    model: onnx.ModelProto,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    keep: Iterable[str] = (),
    for_training: bool = False,
    passes: Sequence[str] | None = None,
    fold_limit: int | None = None,
) -> Optimized:
    """Run the portable passes; the model given is not changed.

    ``shapes`` fixes input dims first (:func:`edgeflow.runtime.model.fix_input_shapes`,
    validated against the model); ``keep`` names values/initializers that
    must survive unchanged; ``for_training`` keeps every float initializer
    and Dropout; ``passes`` picks a subset of :data:`MODEL_PASSES` by name.
    """
    if shapes:
        model = fix_input_shapes(model, shapes)
    options = _options(keep, for_training, fold_limit)
    chosen = _pick(MODEL_PASSES, passes)
    g = from_model(model)
    before = op_counts(g.nodes)
    n_inits = len(g.initializers)
    if not g.value_info or len(g.value_info) <= len(g.inputs) + len(g.outputs):
        g = infer_shapes(g)
    removed: dict[str, int] = {name: 0 for name, _ in chosen}
    rounds = 0
    for rounds in range(1, _MAX_ROUNDS + 1):
        start = g
        for name, fn in chosen:
            n0 = len(g.nodes)
            g = fn(g, options)
            removed[name] += n0 - len(g.nodes)
        if g is start:
            break
        if _needs_shapes(g) or rounds == 1:
            g = infer_shapes(g)  # folded shapes fix more dims downstream
    report = OptimizeReport(before=before, after=op_counts(g.nodes), removed_by_pass=removed, rounds=rounds,
                            initializers_before=n_inits, initializers_after=len(g.initializers))
    return Optimized(to_model(g), report)


def optimize_model(model: onnx.ModelProto, **kwargs) -> onnx.ModelProto:
    """:func:`optimize`'s model only."""
    return optimize(model, **kwargs).model


def optimize_compiled(graph, passes: Sequence[str] | None = None):
    """Run the numpy backend's passes on a CompiledGraph (returns a new one), and
    on every compiled subgraph its nodes hold (If branches, Loop/Scan bodies)."""
    chosen = _pick(NUMPY_PASSES, passes)
    for _, fn in chosen:
        graph = fn(graph)
    _optimize_bodies(graph.nodes, chosen, graph.opset, graph.types, graph.initializers)
    return graph


@dataclass
class _Body:
    """A compiled subgraph as the numpy passes see a CompiledGraph."""

    nodes: list
    initializers: dict
    output_names: list
    opset: int
    types: dict


def _optimize_bodies(nodes, chosen, opset: int, types: dict, outer: dict) -> None:
    """The numpy passes on each compiled subgraph, in place (the subgraphs were
    compiled for this graph alone; the control-flow kernels hold them), with the
    executor's value lifetimes recomputed. The enclosing graphs' initializers
    (``outer``) are visible to the passes as constants; those a pass did not
    replace are read from the enclosing scope again, never copied."""
    for n in nodes:
        for sub in getattr(n, "subgraphs", {}).values():
            seen = {k: v for k, v in outer.items() if k in sub.outer_names}
            body = _Body(list(sub.nodes), {**seen, **sub.initializers}, list(sub.output_names), opset, types)
            start = body
            for _, fn in chosen:
                body = fn(body)
            _optimize_bodies(body.nodes, chosen, opset, types, {**outer, **body.initializers})
            if body is start:
                continue
            body.initializers = {k: v for k, v in body.initializers.items() if not (k in seen and v is seen[k])}
            for m in body.nodes:
                m.free_after = []
            assign_lifetimes(body.nodes, set(body.initializers) | set(sub.outer_names), set(sub.output_names))
            sub.nodes, sub.initializers = body.nodes, body.initializers


def assign_lifetimes(nodes, keep: set, outputs: set) -> None:
    """Each value of compiled ``nodes`` freed after its last reader (``node.free_after``), except
    ``keep`` (weights, outer-scope values) and ``outputs``; edgeflow.runtime.graph uses this too."""
    last: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for x in n.inputs:
            if x:
                last[x] = i
        for o in n.outputs:
            if o and o not in last:
                last[o] = i
    for name, i in last.items():
        if name not in keep and name not in outputs:
            nodes[i].free_after.append(name)


def _pick(table, names: Sequence[str] | None):
    if names is None:
        return list(table)
    known = dict(table)
    bad = [n for n in names if n not in known]
    if bad:
        raise InputError(f"unknown optimizer pass(es) {bad}; the passes are {', '.join(known)}")
    return [(n, known[n]) for n in names]
