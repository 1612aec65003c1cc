"""Write trained weights back into an ONNX model.

The graph is untouched — same nodes, inputs and outputs — only initializer
values change, each cast back to its original dtype. The result passes
``onnx.checker``, so the runtime (numpy or onnxruntime) serves it at once
and the quantizer takes it like any exported model.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import ModelError, ShapeError


def with_weights(model: onnx.ModelProto, weights: dict[str, np.ndarray], *,
                 metadata: dict | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers named in ``weights`` hold the new values."""
    out = copy.deepcopy(model)
    by_name = {t.name: t for t in out.graph.initializer}
    unknown = sorted(set(weights) - set(by_name))
    if unknown:
        raise ModelError(f"cannot export: {len(unknown)} weight(s) are not initializers of the model: {unknown[:5]}")
    for name, value in weights.items():
        old = by_name[name]
        dtype = helper.tensor_dtype_to_np_dtype(old.data_type)
        shape = tuple(old.dims)
        arr = np.asarray(value)
        if arr.shape != shape:
            raise ShapeError(f"cannot export {name!r}: shape {arr.shape}, the model declares {shape}")
        # np.array, not np.ascontiguousarray: the latter turns a 0-d scalar into shape (1,)
        old.CopyFrom(numpy_helper.from_array(np.array(arr, dtype=dtype, order="C"), name))
    if metadata:
        entry = next((p for p in out.metadata_props if p.key == "edgeflow.train"), None)
        if entry is None:
            entry = out.metadata_props.add()
            entry.key = "edgeflow.train"
        entry.value = json.dumps(metadata, sort_keys=True)
    try:
        onnx.checker.check_model(out)
    except onnx.checker.ValidationError as exc:  # pragma: no cover - a copy of a valid model
        raise ModelError(f"the exported model fails onnx.checker: {exc}") from exc
    return out


def save(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    onnx.save(model, os.fspath(path))
