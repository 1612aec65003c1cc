"""Loading and checking ONNX models.

Everything that accepts a model in edgeflow goes through :func:`load_model`,
so a bad file fails in one place with one clear message: a missing path, a
file that is not ONNX, a graph that fails ``onnx.checker``, shape inference
or an opset this runtime does not know.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import ModelError

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
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
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


def model_info(model: onnx.ModelProto) -> ModelInfo:
    counts = collections.Counter(
        (n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}") for n in model.graph.node
    )
    n_params = 0
    n_bytes = 0
    dtypes: collections.Counter[str] = collections.Counter()
    for t in model.graph.initializer:
        size = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
        n_params += size
        dt = elem_dtype(t.data_type)
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
