"""onnxruntime.quantization where it is installed: ``quantize_static``
(QDQ, per-channel, calibration through a CalibrationDataReader) and
``quantize_dynamic``.

onnxruntime's quantizer knows more op types and graph patterns than
edgeflow's own writer (:mod:`.qdq`), so it is preferred where it exists.
It is imported lazily: boards without a wheel never touch this module.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx

from ..errors import QuantizationError
from .data import CalibrationSet

_ORT_METHODS = {"minmax": "MinMax", "percentile": "Percentile", "entropy": "Entropy"}
HARD_ACTIVATIONS = ("HardSigmoid", "HardSwish")


def available() -> bool:
    try:
        import onnxruntime.quantization  # noqa: F401
    except ImportError:
        return False
    return True


def _oq():
    try:
        import onnxruntime.quantization as oq
    except ImportError as exc:
        raise QuantizationError(
            "onnxruntime is not installed here; use engine='numpy' (edgeflow's own calibration and QDQ writer)"
        ) from exc
    return oq


def _reader(data: CalibrationSet, batch_size: int):
    oq = _oq()

    class Reader(oq.CalibrationDataReader):
        """Feeds calibration batches; rewindable (Entropy/Percentile read twice)."""

        def __init__(self) -> None:
            self.rewind()

        def get_next(self):
            return next(self._it, None)

        def rewind(self) -> None:
            self._it = iter(list(data.batches(batch_size)))

    return Reader()


def even_batch(n: int, batch_size: int) -> int:
    """The largest batch size <= ``batch_size`` that divides ``n``.

    onnxruntime's histogram calibrators (Percentile, Entropy) stack the
    per-batch outputs with ``np.asarray`` and fail on a short last batch.
    """
    for b in range(min(batch_size, n), 0, -1):
        if n % b == 0:
            return b
    return 1


def _quiet():
    # onnxruntime's quantizer logs "consider pre-processing" warnings on the root logger.
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))


def quantize_static_ort(
    model: onnx.ModelProto,
    data: CalibrationSet,
    *,
    method: str,
    activations: str,
    per_channel: bool,
    exclude: list[str],
    percentile: float = 99.999,
    batch_size: int = 32,
    fixed: bool = False,
    qoperator: bool = False,
    op_types: list[str] | None = None,
    hard_activations: bool = False,
) -> onnx.ModelProto:
    """``quantize_static`` on ``data``; ``fixed`` when the model's batch size is fixed.

    ``hard_activations``: in QDQ format, HardSigmoid and HardSwish are quantized too (QDQ around
    them, which onnxruntime's default op list leaves out), for :mod:`.hardswish` to turn into int8
    ops on onnxruntime; without it a Conv whose only reader is one of them keeps a float output and
    so never becomes a QLinearConv."""
    oq = _oq()
    if op_types is None and not qoperator and hard_activations:
        from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

        op_types = sorted(set(QLinearOpsRegistry) | set(QDQRegistry) | set(HARD_ACTIVATIONS))
    if method not in _ORT_METHODS:
        raise QuantizationError(f"unknown calibration method {method!r}")
    act = oq.QuantType.QUInt8 if activations == "uint8" else oq.QuantType.QInt8
    extra = {"CalibPercentile": float(percentile)} if method == "percentile" else {}
    root = logging.getLogger()
    level = root.level
    _quiet()
    if method != "minmax" and not fixed:
        batch_size = even_batch(data.n, batch_size)
    try:
        with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
            src, dst = Path(d) / "fp32.onnx", Path(d) / "int8.onnx"
            onnx.save(model, src)
            oq.quantize_static(
                str(src), str(dst), _reader(data, batch_size),
                quant_format=oq.QuantFormat.QOperator if qoperator else oq.QuantFormat.QDQ,
                per_channel=per_channel,
                activation_type=act,
                weight_type=oq.QuantType.QInt8,
                nodes_to_exclude=list(exclude),
                **({"op_types_to_quantize": list(op_types)} if op_types else {}),
                calibrate_method=getattr(oq.CalibrationMethod, _ORT_METHODS[method]),
                extra_options=extra,
            )
            return onnx.load(str(dst))
    except QuantizationError:
        raise
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own and assorted types: re-raised as ours
        raise ort_error("quantize_static", exc) from exc
    finally:
        root.setLevel(level)


_CAUSES = (
    ("Got invalid dimensions", "the calibration samples do not match the model's input shape"),
    ("Unrecognized attribute", "onnxruntime wrote a model that onnx.checker rejects for this opset"),
    ("NOT_IMPLEMENTED", "onnxruntime has no kernel for an op of this model or of its quantized form"),
    ("Type Error", "a tensor type in the model does not match what an op accepts"),
    ("is not a registered function/op", "the model uses an op that this onnxruntime does not know"),
    ("shape inference", "onnxruntime's shape inference failed on this model: fix its input shapes (--shape)"),
)


def ort_error(step: str, exc: BaseException) -> QuantizationError:
    """An onnxruntime failure as one edgeflow line: the likely cause first, then onnxruntime's words."""
    text = " ".join(str(exc).split())
    text = text.replace("[ONNXRuntimeError] : ", "").strip() or type(exc).__name__
    cause = next((c for key, c in _CAUSES if key in text), f"onnxruntime.quantization.{step} failed")
    return QuantizationError(f"{cause} (onnxruntime {step}: {text[:400]})")


def gemm_to_matmul(model: onnx.ModelProto, nodes: list[str]) -> onnx.ModelProto:
    """Rewrite the named Gemm nodes (transA=0, alpha=beta=1, constant B) as
    MatMul (+ Add): onnxruntime's dynamic quantizer handles MatMul only."""
    import copy

    from onnx import helper, numpy_helper

    m = copy.deepcopy(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    out_nodes = []
    for n in g.node:
        if n.name not in nodes or n.op_type != "Gemm":
            out_nodes.append(n)
            continue
        trans_b = next((a.i for a in n.attribute if a.name == "transB"), 0)
        w_name = n.input[1]
        if trans_b:
            w = numpy_helper.to_array(inits[w_name])
            new = w_name + "_T"
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), new))
            w_name = new
        bias = n.input[2] if len(n.input) > 2 and n.input[2] else None
        y = n.output[0]
        mm_out = y + "_MatMul" if bias else y
        out_nodes.append(helper.make_node("MatMul", [n.input[0], w_name], [mm_out], name=n.name))
        if bias:
            out_nodes.append(helper.make_node("Add", [mm_out, bias], [y], name=n.name + "_Add"))
    del g.node[:]
    g.node.extend(out_nodes)
    used = {x for n in g.node for x in n.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    del g.value_info[:]
    return m


def quantize_dynamic_ort(model: onnx.ModelProto, *, per_channel: bool, nodes: list[str], gemms: list[str]) -> onnx.ModelProto:
    oq = _oq()
    prepared = gemm_to_matmul(model, gemms) if gemms else model
    root = logging.getLogger()
    level = root.level
    _quiet()
    try:
        with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
            src, dst = Path(d) / "fp32.onnx", Path(d) / "int8.onnx"
            onnx.save(prepared, src)
            oq.quantize_dynamic(
                str(src), str(dst), op_types_to_quantize=["MatMul"], per_channel=per_channel,
                weight_type=oq.QuantType.QInt8, nodes_to_quantize=list(nodes),
            )
            return onnx.load(str(dst))
    except Exception as exc:  # noqa: BLE001 - re-raised as ours
        raise ort_error("quantize_dynamic", exc) from exc
    finally:
        root.setLevel(level)
