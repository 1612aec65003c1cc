"""Loading and checking ONNX models.

Everything that accepts a model in edgeflow goes through :func:`load_model`,
so a bad file fails in one place with one clear message: a missing path, a
file that is not ONNX, a graph that fails ``onnx.checker``, shape inference
or an opset this runtime does not know.
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence, Union

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import InputError, ModelError, ShapeError
from .limits import ModelLimits

log = logging.getLogger(__name__)

ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto]

#: Oldest default-domain opset accepted. Older models predate the operator
#: semantics the kernels implement; convert them with onnx.version_converter.
MIN_OPSET = 7


def max_opset() -> int:
    """Newest default-domain opset the installed onnx package defines."""
    return onnx.defs.onnx_opset_version()


@dataclass(frozen=True)
class TensorInfo:
    """Name, element dtype and (possibly symbolic) shape of a graph input/output."""

    name: str
    dtype: str  # numpy dtype name, e.g. "float32" (of the elements, for a sequence or an optional)
    shape: tuple[int | str | None, ...]
    kind: str = "tensor"  # "tensor", "sequence" (a list of tensors), "optional-tensor", "optional-sequence"

    def to_dict(self) -> dict:
        d = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.kind != "tensor":
            d["kind"] = self.kind
        return d


@dataclass(frozen=True)
class ModelInfo:
    """A summary of a model for ``edgeflow inspect`` and backend selection."""

    ir_version: int
    opsets: dict[str, int]
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    op_counts: dict[str, int]
    num_parameters: int
    parameter_bytes: int
    file_bytes: int
    producer: str = ""
    node_count: int = 0
    initializer_dtypes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "ir_version": self.ir_version,
            "opsets": self.opsets,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "op_counts": self.op_counts,
            "num_parameters": self.num_parameters,
            "parameter_bytes": self.parameter_bytes,
            "file_bytes": self.file_bytes,
            "producer": self.producer,
            "node_count": self.node_count,
            "initializer_dtypes": self.initializer_dtypes,
        }


def _read(source: ModelSource, limits: ModelLimits) -> onnx.ModelProto:
    if isinstance(source, onnx.ModelProto):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        limits.check_file_size(len(source), "the model given as bytes")
        try:
            return onnx.load_model_from_string(bytes(source))
        except Exception as exc:  # protobuf raises DecodeError and others
            raise ModelError(f"the given bytes are not a valid ONNX model ({exc})") from exc
    path = Path(source)
    if not path.exists():
        raise ModelError(f"model file not found: {path} (check the path)")
    if path.is_dir():
        raise ModelError(f"model path {path} is a directory; give the .onnx file")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ModelError(f"cannot read the model file {path} ({exc})") from exc
    limits.check_file_size(size, f"model file {path}")  # before parsing: protobuf holds it all in memory
    try:
        return onnx.load(str(path))
    except Exception as exc:
        raise ModelError(f"{path} is not a valid ONNX model: {exc}") from exc


def model_opset(model: onnx.ModelProto, domain: str = "") -> int:
    """The opset version the model imports for ``domain`` (0 if none)."""
    for imp in model.opset_import:
        if imp.domain in (domain, "ai.onnx" if domain == "" else domain):
            return int(imp.version)
    return 0


def count_nodes(model: onnx.ModelProto, stop_above: int | None = None) -> int:
    """Nodes of the model, subgraphs included (counting stops early once past ``stop_above``)."""
    total = 0
    pending = [model.graph]
    while pending:
        g = pending.pop()
        total += len(g.node)
        if stop_above is not None and total > stop_above:
            return total
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    pending.append(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    pending.extend(a.graphs)
    return total


def load_model(source: ModelSource, *, check: bool = True, infer_shapes: bool = True,
               limits: ModelLimits | None = None) -> onnx.ModelProto:
    """Read and check an ONNX model from a path, bytes, or a ModelProto.

    ``check`` runs ``onnx.checker`` and the opset range test; ``infer_shapes``
    runs strict shape inference (:func:`infer_model_shapes`: declared shapes
    that contradict it are dropped with a logged note) and returns the model
    with value_info filled in (the numpy backend's memory planner uses it).

    ``limits`` (the profile's, or the defaults: :class:`~edgeflow.runtime.limits.ModelLimits`)
    bound the file size, checked before parsing, and the node count, checked
    right after parsing and before any per-node work (checker, shape
    inference); past either is a :class:`~edgeflow.errors.ResourceLimitError`.
    """
    limits = limits or ModelLimits()
    model = _read(source, limits)
    limits.check_node_count(count_nodes(model, stop_above=limits.max_nodes))
    if not model.graph.node and not model.graph.output:
        raise ModelError("the model has an empty graph (no nodes and no outputs)")
    if check:
        opset = model_opset(model)
        if opset == 0:
            raise ModelError("the model imports no default-domain (ai.onnx) opset")
        if opset < MIN_OPSET:
            raise ModelError(
                f"model opset {opset} is older than the oldest supported ({MIN_OPSET}); "
                "upgrade it with onnx.version_converter.convert_version(model, 13)"
            )
        if opset > max_opset():
            raise ModelError(
                f"model opset {opset} is newer than this runtime's onnx package knows "
                f"({max_opset()}); upgrade onnx or export the model at a lower opset"
            )
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ModelError(f"the model fails onnx.checker: {first}") from exc
    if infer_shapes:
        model = infer_model_shapes(model)
    return model


def _graphs_of(g: onnx.GraphProto):
    """``g`` and every graph nested in it (If/Loop/Scan bodies)."""
    yield g
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graphs_of(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    yield from _graphs_of(sub)


def _negative_dims(model: onnx.ModelProto) -> list[onnx.TensorShapeProto.Dimension]:
    """Dims written as ``dim_value: -1`` (Paddle's way to say "dynamic") anywhere in the model."""
    out = []
    for g in _graphs_of(model.graph):
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            t = vi.type.tensor_type
            if t.HasField("shape"):
                out += [d for d in t.shape.dim if d.HasField("dim_value") and d.dim_value < 0]
    return out


def without_negative_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every ``dim_value: -1`` made an unknown dim (a copy; the model itself when there is none).

    Shape inference takes -1 for a size, so that a declared output ``[-1, 2]``
    contradicts the inferred ``[1, 2]`` once an input dim is fixed."""
    if not _negative_dims(model):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for d in _negative_dims(m):
        d.Clear()
    return m


def _without_declared_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with the shapes an exporter declared for intermediate values and outputs (graph and
    subgraphs) dropped, element types kept: only the main graph's inputs still say what they are."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for g in _graphs_of(m.graph):
        del g.value_info[:]
        for vi in g.output:
            vi.type.tensor_type.ClearField("shape")
    return m


def _strict(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)


def _last_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[-1].strip() if lines else repr(exc)


def infer_model_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with value_info filled in by strict shape inference.

    Exporters declare shapes that contradict inference without the graph
    being wrong (Paddle writes ``-1`` for a dynamic dim and, in table-slanet's
    Loop body, a rank-0 shape where the Cast makes rank 1); onnxruntime merges
    such declarations leniently. So ``-1`` dims count as unknown, and where
    strict inference still fails it runs again without the declared shapes of
    intermediate values and outputs (a logged note says so). Only when the
    graph fails inference on its own (a node whose input shapes contradict
    it) is this a :class:`ModelError`.
    """
    model = without_negative_dims(model)
    try:
        return _strict(model)
    except Exception as exc:  # onnx raises InferenceError and others
        log.debug("strict shape inference failed (%s); trying again without the declared shapes", _last_line(exc))
        first = exc
    try:
        out = _strict(_without_declared_shapes(model))
    except Exception as exc:  # onnx raises InferenceError and others
        raise ModelError(f"shape inference failed, the graph is inconsistent: {_last_line(exc)}") from exc
    log.info("the model's declared shapes disagree with shape inference (%s); using the inferred shapes instead",
             _last_line(first))
    return out


_ELEM = {v: k for k, v in onnx.TensorProto.DataType.items()}


def elem_dtype(elem_type: int) -> str:
    """ONNX element type number -> numpy dtype name ('' if unknown)."""
    if elem_type == 0:
        return ""
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name
    except (KeyError, TypeError, ValueError):
        return _ELEM.get(elem_type, str(elem_type)).lower()


def _value_info(vi: onnx.ValueInfoProto) -> TensorInfo:
    kind, tp = "tensor", vi.type
    if tp.WhichOneof("value") == "optional_type":
        kind, tp = "optional-", tp.optional_type.elem_type
    if tp.WhichOneof("value") == "sequence_type":
        kind, tp = ("optional-" if kind == "optional-" else "") + "sequence", tp.sequence_type.elem_type
    elif kind == "optional-":
        kind = "optional-tensor"
    t = tp.tensor_type
    dims: list[int | str | None] = []
    if t.HasField("shape"):
        for d in t.shape.dim:
            if d.HasField("dim_value") and d.dim_value >= 0:
                dims.append(int(d.dim_value))
            elif d.HasField("dim_value"):  # Paddle exports write -1 for a dynamic dim
                dims.append(None)
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                dims.append(None)
    return TensorInfo(vi.name, elem_dtype(t.elem_type), tuple(dims), kind)


def graph_inputs(model: onnx.ModelProto) -> list[TensorInfo]:
    """Real inputs: graph inputs that are not also initializers."""
    init = {i.name for i in model.graph.initializer}
    return [_value_info(v) for v in model.graph.input if v.name not in init]


def graph_outputs(model: onnx.ModelProto) -> list[TensorInfo]:
    return [_value_info(v) for v in model.graph.output]


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers as numpy arrays (external data must already be loaded)."""
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _subgraphs(g: onnx.GraphProto):
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield a.g
            elif a.type == onnx.AttributeProto.GRAPHS:
                yield from a.graphs


def _constant_tensors(g: onnx.GraphProto):
    """(dims, elem type) of every weight of a graph and its subgraphs: initializers and Constant nodes."""
    for t in g.initializer:
        yield tuple(t.dims), t.data_type
    for n in g.node:
        if n.op_type != "Constant" or n.domain not in ("", "ai.onnx"):
            continue
        for a in n.attribute:
            if a.name == "value":
                yield tuple(a.t.dims), a.t.data_type
            elif a.name == "sparse_value":
                yield tuple(a.sparse_tensor.values.dims), a.sparse_tensor.values.data_type
            elif a.name in ("value_floats", "value_ints"):
                yield (len(a.floats) + len(a.ints),), (onnx.TensorProto.FLOAT if a.floats else onnx.TensorProto.INT64)
            elif a.name == "value_float":
                yield (), onnx.TensorProto.FLOAT
            elif a.name == "value_int":
                yield (), onnx.TensorProto.INT64
    for sub in _subgraphs(g):
        yield from _constant_tensors(sub)


def model_info(model: onnx.ModelProto) -> ModelInfo:
    """Counts for ``inspect``. Parameters are every constant tensor: initializers
    and Constant-node values (how Paddle and some other exporters store weights),
    in the main graph and in subgraphs."""
    counts = collections.Counter(
        (n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}") for n in model.graph.node
    )
    n_params = 0
    n_bytes = 0
    dtypes: collections.Counter[str] = collections.Counter()
    for dims, data_type in _constant_tensors(model.graph):
        size = int(np.prod(dims, dtype=np.int64)) if dims else 1
        n_params += size
        dt = elem_dtype(data_type)
        dtypes[dt] += size
        try:
            n_bytes += size * np.dtype(dt).itemsize
        except TypeError:
            pass
    return ModelInfo(
        ir_version=int(model.ir_version),
        opsets={(i.domain or "ai.onnx"): int(i.version) for i in model.opset_import},
        inputs=graph_inputs(model),
        outputs=graph_outputs(model),
        op_counts=dict(sorted(counts.items())),
        num_parameters=n_params,
        parameter_bytes=n_bytes,
        file_bytes=model.ByteSize(),
        producer=f"{model.producer_name} {model.producer_version}".strip(),
        node_count=len(model.graph.node),
        initializer_dtypes=dict(dtypes),
    )


ShapeSpec = Mapping[str, Sequence["int | None"]]


def _dims_text(dims: Sequence) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _inputs_text(inputs: list[TensorInfo]) -> str:
    return ", ".join(f"{t.name!r} {_dims_text(t.shape)}" for t in inputs)


ANONYMOUS_DIMS = frozenset({"?", "", "-1", "None", "none", "unk"})
"""Symbolic dim names that exporters use for *any* free dim (Paddle writes "?"); two such dims are not
the same symbol, unlike a named one such as "batch"."""


def resolve_input_shapes(model: "onnx.ModelProto | Sequence[TensorInfo]", shapes: ShapeSpec, *,
                         source: str = "the shape given") -> dict[str, list[int | None]]:
    """The full dims each input gets from ``shapes``, checked against the model; no shape inference.

    ``model`` is a model or its inputs (:func:`graph_inputs`). ``shapes``
    maps an input name to its full shape (``None`` in a dim keeps that dim as
    the model has it), or a symbolic dim name (``"batch"``) to one number,
    which fixes that dim in every input that has it — like onnxruntime's
    free-dimension overrides. Inputs not named keep their symbolic dims (and
    are left out of the result). An unknown name lists the real inputs; a
    rank or a fixed dim that disagrees names the input and the dim (``input
    'x' dim 1 is 3 in the model, --shape gives 4``, with ``source`` naming
    where the shape came from).
    """
    inputs = graph_inputs(model) if isinstance(model, onnx.ModelProto) else list(model)
    by_name = {t.name: t for t in inputs}
    symbols = {d for t in inputs for d in t.shape if isinstance(d, str) and d not in ANONYMOUS_DIMS}
    wanted: dict[str, list[int | None]] = {}
    bound: dict[str, tuple[int, str]] = {}  # dim symbol -> (value, input that fixed it)
    for name, given in shapes.items():
        dims = [given] if isinstance(given, (int, np.integer)) else list(given)
        for d in dims:
            if d is not None and (not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0):
                raise InputError(f"{source} for {name!r} has dim {d!r}; dims are whole numbers >= 0")
        if name in by_name:
            wanted[name] = [None if d is None else int(d) for d in dims]
        elif name in symbols and len(dims) == 1 and dims[0] is not None:
            bound[name] = (int(dims[0]), f"{source} {name}={dims[0]}")
        else:
            sym = f"; its symbolic dims: {', '.join(sorted(symbols))}" if symbols else ""
            raise InputError(f"the model has no input {name!r} ({source}); its inputs: {_inputs_text(inputs)}{sym}")
    fixed: dict[str, list[int | None]] = {}
    for t in inputs:
        given = wanted.get(t.name)
        if given is None and not any(isinstance(d, str) and d in bound for d in t.shape):
            continue
        if given is not None and t.shape and len(given) != len(t.shape):
            raise ShapeError(
                f"input {t.name!r} has rank {len(t.shape)} in the model {_dims_text(t.shape)}, "
                f"{source} gives {len(given)} dims {_dims_text(given)}"
            )
        out: list[int | None] = []
        for i, d in enumerate(t.shape if t.shape else given or []):
            g = given[i] if given is not None else None
            if isinstance(d, int):
                if g is not None and g != d:
                    raise ShapeError(f"input {t.name!r} dim {i} is {d} in the model, {source} gives {g}")
                out.append(d)
                continue
            if isinstance(d, str) and d in ANONYMOUS_DIMS:
                d = None  # exporters write "?" (or "-1") for every free dim: not one shared symbol
            if g is None and isinstance(d, str) and d in bound:
                g = bound[d][0]
            if g is not None and isinstance(d, str):
                if d in bound and bound[d][0] != g:
                    raise ShapeError(
                        f"input {t.name!r} dim {i} is {d!r}, which {bound[d][1]} fixed to {bound[d][0]}; "
                        f"{source} gives {g}"
                    )
                bound.setdefault(d, (g, f"{source} for input {t.name!r}"))
            out.append(g)
        fixed[t.name] = out
    return fixed


def with_input_dims(inputs: Sequence[TensorInfo], fixed: Mapping[str, Sequence["int | None"]]) -> list[TensorInfo]:
    """``inputs`` with the dims :func:`resolve_input_shapes` fixed (a ``None`` keeps the model's dim)."""
    out = []
    for t in inputs:
        dims = fixed.get(t.name)
        if dims is None:
            out.append(t)
            continue
        old = list(t.shape)
        shape = tuple(d if d is not None else (old[i] if i < len(old) else None) for i, d in enumerate(dims))
        out.append(TensorInfo(t.name, t.dtype, shape))
    return out


def fix_input_shapes(model: onnx.ModelProto, shapes: ShapeSpec, *, source: str = "the shape given") -> onnx.ModelProto:
    """A copy of ``model`` with these inputs' dims fixed and every value's shape re-inferred.

    ``shapes`` and the checks are those of :func:`resolve_input_shapes`. The
    copy is for the numpy backend and memory planning: onnxruntime loads the
    model as given (the runtime hands it the original), since onnx writes the
    fixed shapes into subgraphs, untaken If branches included, where
    onnxruntime may refuse them. A shape the graph cannot take is a
    :class:`ShapeError` naming the shapes.
    """
    fixed = resolve_input_shapes(model, shapes, source=source)
    if not fixed:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    for vi in m.graph.input:
        if vi.name not in fixed:
            continue
        shape = vi.type.tensor_type.shape
        old = list(shape.dim)
        del shape.dim[:]
        for i, d in enumerate(fixed[vi.name]):
            dim = shape.dim.add()
            if d is not None:
                dim.dim_value = d
            elif i < len(old):
                dim.CopyFrom(old[i])
    try:
        # -1 dims (Paddle) count as unknown; declared shapes that contradict the fixed ones (an exporter
        # may have declared the output shapes for one input shape only) are dropped
        return infer_model_shapes(m)
    except ModelError as exc:
        given = ", ".join(f"{k} {_dims_text(v)}" for k, v in fixed.items())
        raise ShapeError(
            f"the model cannot take inputs of shape {given} ({source}): shape inference fails: "
            f"{_last_line(exc.__cause__ or exc)}"
        ) from exc
