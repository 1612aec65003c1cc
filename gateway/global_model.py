"""The global model's weights as the rounds federate them, and the default evaluator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeflow.errors import ConfigError

__all__ = ["classification_metrics", "load_initial_parameters", "model_weights", "model_with_weights",
           "parameters_model", "trained_weight_names"]

MAX_PARAMETERS = 4096
"""The most tensors a parameters-only global model may hold."""


def classification_metrics(model: onnx.ModelProto, eval_data: Any, *, profile: str = "x86-gateway"
                           ) -> dict[str, float]:
    """The default evaluator: top-1 accuracy and mean cross-entropy of ``model``'s first output (logits)
    on ``eval_data = (x, y)``, run by the runtime for ``profile`` (onnxruntime where installed, else numpy).
    Another task brings its own ``RoundManager(evaluator=...)``: ``(model, eval_data) -> {metric: value}``."""
    from edgeflow.runtime.session import load

    x, y = eval_data
    rt = load(model, profile, batch_size=len(x), allow_over_budget=True)
    logits = rt(np.asarray(x, np.float32))
    acc = float((logits.argmax(1) == y).mean())
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return {"accuracy": acc, "loss": float(-logp[np.arange(len(y)), y].mean())}


def model_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The float initializers of a model: what federated rounds train."""
    out = {}
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t)
        if a.dtype.kind == "f":
            out[t.name] = np.array(a, dtype=np.float32)
    return out


def trained_weight_names(model: onnx.ModelProto) -> list[str] | None:
    """The float initializers devices train and exchange of ``model`` (edgeflow.train's rule: those feeding
    a differentiable input, and batch-norm statistics), or None where the trainer cannot say (a model it
    refuses, a parameters-only model). A float constant in a non-differentiable slot -- a Clip bound, a
    HardSigmoid's 3.0 -- is not one: federating it made every device refuse the global model ("weight(s)
    the local model lacks"), so no round of a real model in full mode ever completed."""
    import logging

    from edgeflow.errors import EdgeflowError
    from edgeflow.train import Trainer

    try:
        names = Trainer(model, save_workspace=False).weight_names
    except EdgeflowError as exc:
        logging.getLogger(__name__).debug("federating every float initializer: the trainer cannot say which "
                                          "are trained (%s)", exc)
        return None
    return list(names) or None


def model_with_weights(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.name in weights:
            old = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array(np.asarray(weights[t.name], dtype=old.dtype), t.name))
    return m


def parameters_model(weights: Mapping[str, np.ndarray], *, source: str = "parameters") -> onnx.ModelProto:
    """A global model that is only its parameters (no ONNX model needed, as in Flower): each float32 array is
    an initializer and a graph output, so the store, the signed broadcast and the rounds treat it as any model.
    On-device inference and OTA still need a real ONNX model (``[gateway] model``)."""
    if not weights:
        raise ConfigError(f"{source}: no parameters (an empty list); give at least one array")
    if len(weights) > MAX_PARAMETERS:
        raise ConfigError(f"{source}: {len(weights)} arrays; at most {MAX_PARAMETERS}")
    inits, outs = [], []
    for name, value in weights.items():
        arr = np.asarray(value)
        if arr.dtype.kind not in "fiu":
            raise ConfigError(f"{source}: parameter {name!r} has dtype {arr.dtype}; parameters are float arrays")
        arr = arr.astype(np.float32)
        if not np.isfinite(arr).all():
            raise ConfigError(f"{source}: parameter {name!r} holds NaN or infinite values")
        inits.append(numpy_helper.from_array(arr, name))
        outs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(arr.shape)))
    graph = helper.make_graph([], "parameters", [], outs, initializer=inits)
    return helper.make_model(graph, producer_name="edgeflow-parameters",
                             opset_imports=[helper.make_opsetid("", 17)])


def load_initial_parameters(path: Any, *, what: str = "--initial-parameters") -> dict[str, np.ndarray]:
    """The arrays of an .npz file (``np.savez(path, *arrays)`` or with names), in the file's order: the first
    global model's parameters. One ConfigError line naming the file and what is wrong."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p}: file not found")
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError) as exc:  # not a zip, damaged, pickled objects
        raise ConfigError(f"{what} {p}: not a numpy .npz file ({exc}); write it with np.savez(path, *arrays)") from None
    if not arrays:
        raise ConfigError(f"{what} {p}: the file holds no arrays")
    model = parameters_model(arrays, source=f"{what} {p}")  # the dtype and finiteness checks
    return model_weights(model)
