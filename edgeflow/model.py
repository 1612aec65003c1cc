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

from .errors import InputError, ModelError, ShapeError

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
    dtype: str  # numpy dtype name, e.g. "float32"
    shape: tuple[int | str | None, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


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


def _read(source: ModelSource) -> onnx.ModelProto:
    if isinstance(source, onnx.ModelProto):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
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
        return onnx.load(str(path))
    except Exception as exc:
        raise ModelError(f"{path} is not a valid ONNX model: {exc}") from exc


def model_opset(model: onnx.ModelProto, domain: str = "") -> int:
    """The opset version the model imports for ``domain`` (0 if none)."""
    for imp in model.opset_import:
        if imp.domain in (domain, "ai.onnx" if domain == "" else domain):
            return int(imp.version)
    return 0


def load_model(source: ModelSource, *, check: bool = True, infer_shapes: bool = True) -> onnx.ModelProto:
    """Read and check an ONNX model from a path, bytes, or a ModelProto.

    ``check`` runs ``onnx.checker`` and the opset range test; ``infer_shapes``
    runs strict shape inference and returns the model with value_info filled
    in (the numpy backend's memory planner uses it).
    """
    model = _read(source)
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
        try:
            model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except Exception as exc:
            msg = str(exc).strip().splitlines()
            raise ModelError(
                f"shape inference failed, the graph is inconsistent: {msg[-1] if msg else exc}"
            ) from exc
    return model


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
    t = vi.type.tensor_type
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
    return TensorInfo(vi.name, elem_dtype(t.elem_type), tuple(dims))


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


def fix_input_shapes(model: onnx.ModelProto, shapes: ShapeSpec, *, source: str = "the shape given") -> onnx.ModelProto:
    """A copy of ``model`` with these inputs' dims fixed and every value's shape re-inferred.

    ``shapes`` maps an input name to its full shape (``None`` in a dim keeps
    that dim as the model has it), or a symbolic dim name (``"batch"``) to
    one number, which fixes that dim in every input that has it — like
    onnxruntime's free-dimension overrides. Inputs not named keep their
    symbolic dims. Everything is checked against the model first: an unknown
    name lists the real inputs; a rank or a fixed dim that disagrees names
    the input and the dim (``input 'x' dim 1 is 3 in the model, --shape
    gives 4``, with ``source`` naming where the shape came from).
    """
    inputs = graph_inputs(model)
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
        return onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    except Exception as exc:  # onnx raises InferenceError and others
        # an exporter may have declared the output shapes for one input shape only
        log.debug("shape inference with the declared output shapes failed (%s); retrying without them", exc)
    for vi in m.graph.output:
        vi.type.tensor_type.ClearField("shape")
    try:
        return onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    except Exception as exc:  # onnx raises InferenceError and others
        lines = str(exc).strip().splitlines()
        given = ", ".join(f"{k} {_dims_text(v)}" for k, v in fixed.items())
        raise ShapeError(
            f"the model cannot take inputs of shape {given} ({source}): shape inference fails: "
            f"{lines[-1] if lines else exc}"
        ) from exc
