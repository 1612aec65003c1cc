"""Planned peak memory of running a model, for the profile's memory budget.

The plan fixes the input shapes (dynamic dims -> the given batch size),
runs ONNX shape inference to size every intermediate, and walks the
schedule of :mod:`edgeflow.runtime.graph` keeping the set of live values — the same
lifetimes the numpy executor uses to free intermediates — plus each kernel's
workspace (e.g. Conv's im2col buffer). Weights count in full.

Values whose size inference cannot tell (data-dependent shapes) are
reported in ``unknown``; then :func:`measure_peak` can trace one real run.

Control flow is counted conservatively: the outer graph is planned as
usual, and a control-flow node (If, Loop, Scan, SequenceMap) adds, as its
workspace, the largest planned peak of its subgraphs (each walked like a
graph, its inputs counted live at its start, nested control flow counted
the same way) plus, for Loop, Scan and SequenceMap, every output of the
node once more — the per-iteration pieces held before they are stacked.
Loop-carried values whose shape changes across iterations have no inferred
size and are reported in ``unknown``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..errors import ShapeError
from .graph import CompiledGraph
from .model import TensorInfo, elem_dtype

log = logging.getLogger("edgeflow.runtime.memory")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes needed by one inference at the planned input shapes."""

    weights_bytes: int
    peak_activation_bytes: int
    peak_node: str
    input_shapes: dict[str, tuple[int, ...]]
    unknown: tuple[str, ...] = field(default=())
    workspace_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return self.weights_bytes + self.peak_activation_bytes

    def to_dict(self) -> dict:
        return {
            "weights_bytes": self.weights_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "workspace_bytes": self.workspace_bytes,
            "input_shapes": {k: list(v) for k, v in self.input_shapes.items()},
            "unknown": list(self.unknown),
        }


def shape_example(t: TensorInfo, batch_size: int = 1) -> str:
    """``1x3x<height>x<width>``: an input's dims for a --shape hint (dynamic ones by name)."""
    dims = []
    for i, d in enumerate(t.shape):
        if isinstance(d, int) and d >= 0:
            dims.append(str(d))
        elif i == 0:
            dims.append(str(batch_size))
        else:
            dims.append(f"<{d}>" if isinstance(d, str) and d else f"<dim{i}>")
    return "x".join(dims)


def concrete_shapes(inputs: list[TensorInfo], batch_size: int = 1,
                    shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    """Fill dynamic dims of each input: the first with ``batch_size``, others must be given."""
    out: dict[str, tuple[int, ...]] = {}
    for t in inputs:
        if shapes and t.name in shapes:
            out[t.name] = tuple(int(d) for d in shapes[t.name])
            continue
        dims = []
        dynamic = []
        for i, d in enumerate(t.shape):
            if isinstance(d, int) and d >= 0:
                dims.append(d)
            elif i == 0:
                dims.append(batch_size)
            else:
                dynamic.append(f"{i} ({d!r})" if d else str(i))
        if dynamic:
            raise ShapeError(
                f"input {t.name!r} has dynamic dim(s) {', '.join(dynamic)} besides the batch; give its "
                f"shape: --shape {t.name}={shape_example(t, batch_size)} on the command line, "
                f"input_shapes={{{t.name!r}: (...)}} in Python"
            )
        out[t.name] = tuple(dims)
    return out


def fixed_shape_model(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A copy of ``model`` with the inputs fixed to ``shapes`` and every value's shape re-inferred."""
    m = copy.deepcopy(model)
    del m.graph.value_info[:]
    for vi in m.graph.input:
        if vi.name in shapes:
            dims = vi.type.tensor_type.shape.dim
            del dims[:]
            for d in shapes[vi.name]:
                dims.add().dim_value = int(d)
    for vi in m.graph.output:
        vi.type.tensor_type.ClearField("shape")
    return onnx.shape_inference.infer_shapes(m, data_prop=True)


def _sizes(model: onnx.ModelProto) -> dict[str, tuple[int, ...] | None]:
    out: dict[str, tuple[int, ...] | None] = {}
    _graph_sizes(model.graph, out)
    return out


def _graph_sizes(g: onnx.GraphProto, out: dict[str, tuple[int, ...] | None]) -> None:
    """Shapes of the values of ``g`` and of its subgraphs (a name seen twice keeps the larger)."""
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
            out.setdefault(vi.name, None)
            continue
        dims = []
        for d in t.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims = None
                break
        shape = tuple(dims) if dims is not None else None
        old = out.get(vi.name)
        if old is None or (shape is not None and np.prod(shape, dtype=np.int64) > np.prod(old, dtype=np.int64)):
            out[vi.name] = shape
    for t in g.initializer:
        out.setdefault(t.name, tuple(t.dims))
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _graph_sizes(a.g, out)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    _graph_sizes(sg, out)


def _graph_types(g: onnx.GraphProto, out: dict[str, str]) -> None:
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.tensor_type.elem_type:
            out[vi.name] = elem_dtype(vi.type.tensor_type.elem_type)
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _graph_types(a.g, out)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    _graph_types(sg, out)


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 4


_STACKING = frozenset({"Loop", "Scan", "SequenceMap"})


def plan_memory(graph: CompiledGraph, batch_size: int = 1,
                input_shapes: dict[str, tuple[int, ...]] | None = None) -> MemoryPlan:
    """Plan the peak memory of one run at ``batch_size`` (or explicit shapes)."""
    shapes = concrete_shapes(graph.inputs, batch_size, input_shapes)
    fixed = fixed_shape_model(graph.model, shapes)
    types = dict(graph.types)
    _graph_types(fixed.graph, types)
    planner = _Planner(_sizes(fixed), types, dict(graph.initializers))
    live: dict[str, int] = {}
    for name in shapes:
        live[name] = int(np.prod(shapes[name], dtype=np.int64)) * _itemsize(types.get(name, "float32"))
    peak, peak_node, peak_ws = planner.walk(graph.nodes, live)
    weights = sum(int(a.nbytes) for a in graph.initializers.values())
    weights += sum(int(a.nbytes) for sg in _all_subgraphs(graph.nodes) for a in sg.initializers.values())
    return MemoryPlan(
        weights_bytes=weights,
        peak_activation_bytes=peak,
        peak_node=peak_node,
        input_shapes=shapes,
        unknown=tuple(dict.fromkeys(planner.unknown)),
        workspace_bytes=peak_ws,
    )


class _Planner:
    """Walks a graph's nodes in order with the bytes of every live value; what it cannot size goes to
    :attr:`unknown` (counted as 0 bytes, never hidden)."""

    def __init__(self, sizes: dict[str, tuple[int, ...] | None], types: dict[str, str], weights_of: dict[str, np.ndarray]) -> None:
        self.sizes, self.types, self.weights_of = sizes, types, weights_of
        self.unknown: list[str] = []

    def nbytes(self, name: str) -> int | None:
        """The bytes of one value; 0 for a weight (counted in weights), None when its shape is unknown."""
        if name in self.weights_of:
            return 0  # counted in weights
        shp = self.sizes.get(name)
        if shp is None:
            return None
        return int(np.prod(shp, dtype=np.int64)) * _itemsize(self.types.get(name, "float32"))

    def workspace(self, node) -> int:
        """A node's scratch memory: its kernel's estimate, plus the peak of its subgraphs (and the stacked
        outputs of a loop or scan)."""
        ws = 0
        if node.kernel.workspace_fn is not None:
            in_shapes = [self.sizes.get(x) if x and x not in self.weights_of
                         else (self.weights_of[x].shape if x else None) for x in node.inputs]
            try:
                ws = int(node.kernel.workspace_fn(in_shapes, node.attrs) or 0)
            except Exception as exc:  # noqa: BLE001 - planning goes on; the gap is reported, not hidden as 0 bytes
                what = f"workspace of {node.op_type} node {node.name or '?'}"
                log.warning("memory plan: the %s is not estimated (%s: %s); it is listed in the plan's unknown",
                            what, type(exc).__name__, exc)
                self.unknown.append(what)
                ws = 0
        if node.subgraphs:
            ws += max(self.sub_peak(sg) for sg in node.subgraphs.values())
            if node.op_type in _STACKING:
                ws += sum(self.nbytes(o) or 0 for o in node.outputs if o)
        return ws

    def walk(self, nodes, live: dict[str, int]) -> tuple[int, str, int]:
        """The peak of live values plus workspace over ``nodes``: (bytes, the node at the peak, its workspace)."""
        peak, peak_node, peak_ws = sum(live.values()), "(inputs)", 0
        for node in nodes:
            for o in node.outputs:
                if not o:
                    continue
                b = self.nbytes(o)
                if b is None:
                    self.unknown.append(o)
                    b = 0
                live[o] = b
            ws = self.workspace(node)
            total = sum(live.values()) + ws
            if total > peak:
                peak, peak_node, peak_ws = total, node.name, ws
            for name in node.free_after:
                live.pop(name, None)
        return peak, peak_node, peak_ws

    def sub_peak(self, sg) -> int:
        """The peak of one subgraph run, from its inputs."""
        self.weights_of.update(sg.initializers)
        live = {}
        for name in sg.input_names:
            b = self.nbytes(name)
            if b is None:
                self.unknown.append(name)
            live[name] = b or 0
        return self.walk(sg.nodes, live)[0]


def _all_subgraphs(nodes):
    for n in nodes:
        for sg in n.subgraphs.values():
            yield sg
            yield from _all_subgraphs(sg.nodes)
