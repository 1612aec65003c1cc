"""The global model's weights as the rounds federate them, and the default evaluator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["classification_metrics", "model_weights", "model_with_weights"]


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


def model_with_weights(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.name in weights:
            old = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array(np.asarray(weights[t.name], dtype=old.dtype), t.name))
    return m
