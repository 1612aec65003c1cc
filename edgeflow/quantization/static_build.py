"""The static int8 models one ``quantize()`` call writes: every layer int8, or with some layers
kept fp32, in another format, calibration method or op set, with or without bias correction.

The bench gate (:mod:`.gate`) asks for several variants; :class:`StaticBuilder` writes each
with the engine chosen (onnxruntime's quantizer or edgeflow's QDQ writer) and, for a report
on onnxruntime, the int8 rewrites onnxruntime needs (HardSwish/HardSigmoid as QLinearAdd,
scalar affine chains folded into zero points, Softmax readouts kept float, bias correction).
It remembers what it measured once per call (the bias shifts) and how many rewrites each
model it wrote carries, for the report's notes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import onnx

from ..errors import BackendError
from .analysis import QuantPlan, activations_after
from .data import CalibrationSet
from .readout import float_readouts

if TYPE_CHECKING:
    from ..profiles import DeviceProfile

log = logging.getLogger("edgeflow.quantization")

BIAS_CORRECTION_SAMPLES = 32
"""Calibration samples that bias correction runs (one pass per int8 conv)."""


def one_line(exc: BaseException) -> str:
    """An exception's message as one line of at most 300 characters (for a report note)."""
    return " ".join(str(exc).split())[:300]


class StaticBuilder:
    """Writes the static int8 model of ``fp32`` for a set of layers kept fp32 (``build(extra)``).

    ``engine`` "ort" quantizes with onnxruntime.quantization, "numpy" with edgeflow's QDQ writer
    from ``qparams`` (the calibrated ranges); ``backend`` is where the report runs: on "ort" the
    written model also gets onnxruntime's int8 rewrites. ``bias_correction`` None corrects only
    the variants that ask for it (``bc=True``). Notes the writer has for the every-layer model
    go into ``notes``."""

    def __init__(self, fp32: onnx.ModelProto, plan: QuantPlan, cal: CalibrationSet, *, engine: str, backend: str,
                 profile: "DeviceProfile", calib: str, activations: str, per_channel: bool, percentile: float,
                 batch_size: int, fixed: int | None, evaluator: Any, qparams: dict | None,
                 bias_correction: bool | None, notes: list[str]):
        self.fp32, self.plan, self.cal = fp32, plan, cal
        self.engine, self.backend, self.profile = engine, backend, profile
        self.calib, self.activations, self.per_channel, self.percentile = calib, activations, per_channel, percentile
        self.batch_size, self.fixed, self.evaluator, self.qparams = batch_size, fixed, evaluator, qparams
        self.bias_correction, self.notes = bias_correction, notes
        self.readouts: list[str] = float_readouts(fp32) if backend == "ort" else []
        # a layer the gate keeps fp32 keeps its activation float with it (fused into the fp32 conv), so that
        # its output is not quantized just for an int8 activation to read it
        self._acts = activations_after(fp32, [t.node for t in plan.targets])
        # the engine's every-layer models (the gate's variants, a few) and the latest one with layers kept fp32:
        # the bias-corrected variant starts from the plain QDQ variant's quantization
        self._raw: dict[tuple, onnx.ModelProto] = {}
        # (calibration, op types, kept fp32) -> conv -> bias shift
        self._shifts: dict[tuple, dict[str, Any]] = {}
        # id(model build() wrote) -> (HardSwish/HardSigmoid run in int8, scalar Mul/Add chains folded into zero
        # points, convs whose bias was corrected)
        self._rewrites: dict[int, tuple[int, int, int]] = {}

    def __call__(self, extra: frozenset = frozenset(), fmt: str | None = None, cmethod: str | None = None,
                 ops: tuple | None = None, bc: bool | None = None) -> onnx.ModelProto:
        """The int8 model with the layers in ``extra`` kept fp32 (``fmt``/``cmethod``/``ops``: None = the
        profile's format, the call's calibration, every quantizable op type; ``bc``: bias correction)."""
        args = (extra, fmt, cmethod, ops)
        if args not in self._raw:
            for k in [k for k in self._raw if k[0]]:  # keep no more than one model with layers kept fp32
                del self._raw[k]
            self._raw[args] = self._write(*args)
        qm = self._raw[args]  # not changed below: each rewrite returns a new model
        if self.backend != "ort":
            return qm
        qm, counts = self._ort_rewrites(qm, extra, fmt, cmethod, ops, bc)
        self._rewrites[id(qm)] = counts
        return qm

    def rewrites_of(self, qm: onnx.ModelProto) -> tuple[int, int, int]:
        """(int8 HardSwish/HardSigmoid, folded scalar affines, bias-corrected convs) of a model this
        builder wrote; zeros for any other model (a freed model's id can be reused by a copy, so ask
        only about the model that is written)."""
        return self._rewrites.get(id(qm), (0, 0, 0))

    def _write(self, extra: frozenset, fmt: str | None, cmethod: str | None, ops: tuple | None) -> onnx.ModelProto:
        fp32, plan, fixed = self.fp32, self.plan, self.fixed
        if self.engine == "ort":
            from . import ort_backend

            return ort_backend.quantize_static_ort(
                fp32, self.cal, method=cmethod or self.calib, op_types=list(ops) if ops else None,
                activations=self.activations, per_channel=self.per_channel,
                exclude=list(plan.kept_fp32) + sorted(extra) + [a for e in sorted(extra) for a in self._acts.get(e, [])]
                + self.readouts, percentile=self.percentile,
                batch_size=fixed or self.batch_size, fixed=fixed is not None,
                qoperator=(fmt or self.profile.quantization.format) == "qoperator",
                hard_activations=self.backend == "ort",
            )
        from .qdq import insert_qdq

        assert self.qparams is not None
        sub = plan if not extra else plan.subset([t.node for t in plan.targets if t.node not in extra], fp32)
        qm, more = insert_qdq(fp32, sub, {k: self.qparams[k] for k in sub.quantized_tensors},
                              per_channel=self.per_channel)
        if not extra:
            self.notes.extend(more)
        return qm

    def _ort_rewrites(self, qm: onnx.ModelProto, extra: frozenset, fmt: str | None, cmethod: str | None,
                      ops: tuple | None, bc: bool | None) -> tuple[onnx.ModelProto, tuple[int, int, int]]:
        # onnxruntime has no int8 HardSwish/HardSigmoid: as int8 Add (+ Mul) they skip three float passes.
        # A scalar a * x + b after an activation: read through the integers' scale and zero point.
        from .affine import fold_scalar_affine
        from .hardswish import hardswish_as_qlinear
        from .readout import dequantize_readouts

        qm, n_hsw = hardswish_as_qlinear(qm)
        qm, n_aff = fold_scalar_affine(qm)
        qm, _ = dequantize_readouts(qm, self.readouts)
        n_bias = 0
        qdq = (fmt or self.profile.quantization.format) != "qoperator"
        if (self.bias_correction if bc is None else bc) and qdq:
            from .bias_correction import apply_corrections

            qm, n_bias = apply_corrections(qm, self._bias_shifts(qm, (cmethod or self.calib, ops, extra)))
        return qm, (n_hsw, n_aff, n_bias)

    def _bias_shifts(self, qm: onnx.ModelProto, key: tuple) -> dict[str, Any]:
        # measured for each model built: shifts measured with every layer int8 over-correct the convs
        # after a layer kept fp32 (PP-OCRv4's detector: 1.5% loss with every layer int8, 9.3% with its
        # most sensitive conv fp32 and the other convs' shifts reused)
        if key not in self._shifts:
            from .bias_correction import measure_corrections

            cal, fixed, evaluator = self.cal, self.fixed, self.evaluator
            k = min(cal.n, BIAS_CORRECTION_SAMPLES)
            sub = cal.take(slice(0, max(fixed, k - k % fixed) if fixed else k))  # whole fixed batches
            try:
                self._shifts[key] = measure_corrections(qm, self.fp32, lambda: sub.batches(evaluator.batch_size),
                                                        evaluator.runner)
            except BackendError as exc:  # the model is still a valid int8 model: go on uncorrected
                self._shifts[key] = {}
                log.warning("bias correction skipped: %s", exc)
                self.notes.append(f"bias correction skipped: {one_line(exc)}")
        return self._shifts[key]
