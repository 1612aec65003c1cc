"""Per-layer sensitivity: which layers cost the most accuracy when quantized.

Each target layer is quantized *alone* (every other layer fp32, the same
calibrated ranges) and evaluated on the held-out data. A layer that loses
accuracy on its own is the one to keep in fp32 (``keep_fp32=[name]``) when
the whole model loses too much. One model per layer: cheap for the small
models edge boards run, and it always uses edgeflow's own QDQ writer so it
works with or without onnxruntime.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from .analysis import QuantPlan
from .data import CalibrationSet
from .params import TensorQParams
from .qdq import insert_qdq
from .report import LayerSensitivity, accuracy, output_error

Predict = Callable[[onnx.ModelProto, CalibrationSet], np.ndarray]


def layer_sensitivity(
    model: onnx.ModelProto,
    plan: QuantPlan,
    qparams: dict[str, TensorQParams],
    eval_set: CalibrationSet,
    reference: np.ndarray,
    predict: Predict,
    *,
    labels: np.ndarray | None = None,
    per_channel: bool = True,
) -> list[LayerSensitivity]:
    """Sensitivity of every target of ``plan``, worst first."""
    acc_ref = accuracy(reference, labels) if labels is not None else None
    out: list[LayerSensitivity] = []
    for t in plan.targets:
        sub = plan.subset([t.node], model)
        qm, _ = insert_qdq(model, sub, {k: qparams[k] for k in sub.quantized_tensors}, per_channel=per_channel)
        got = predict(qm, eval_set)
        err = output_error(reference, got)
        drop = acc_ref - accuracy(got, labels) if labels is not None else None
        out.append(LayerSensitivity(t.node, t.op_type, drop, err.cosine, err.max_abs))
    out.sort(key=lambda s: (-(s.accuracy_drop or 0.0), s.cosine))
    return out
