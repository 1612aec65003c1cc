"""``edgeflow.quantize``: an fp32 ONNX model and a few hundred samples in, a
model quantized the way the target board runs fastest out — with a report
of what it cost.

The board's profile decides the scheme (``[quantization]`` in its TOML):
static int8 in QDQ format with per-channel symmetric weights and uint8
(x86: VNNI's fast u8 x s8 path) or int8 (Arm) activations; fp16 for GPU
boards. ``method`` overrides it: ``"static"`` (the profile's calibration),
``"minmax"`` / ``"percentile"`` / ``"entropy"`` (static with that
calibration), ``"dynamic"`` (int8 weights, activations quantized per batch
at run time: MatMul/Gemm-heavy models, no calibration needed) or ``"fp16"``.

The work is done by onnxruntime.quantization where it is installed
(``engine="ort"``), or by edgeflow's own numpy calibration and QDQ writer
(``engine="numpy"``) on boards without it; both write models that load in
either backend.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np
import onnx

from ..errors import EdgeflowError, QuantizationError
from ..profiles import (
    DeviceProfile,
    HostFacts,
    get_profile,
    host_differs,
    host_facts,
    saturates_where_board_does_not,
)
from ..runtime.model import ModelSource, TensorInfo, graph_inputs, load_model

if TYPE_CHECKING:
    from ..data.preprocess import AudioPrep, ImagePrep
    from .gate import GateDecision, Trial
from .analysis import (
    QUANTIZABLE,
    QuantPlan,
    clamps_as_clip,
    name_nodes,
    plan_quantization,
    pool_before_relu,
)
from .boxes import BOX_MEASURES, box_agreement
from .calibration import METHODS as CALIBRATION_METHODS
from .calibration import collect_ranges
from .data import (
    CalibrationSet,
    DataSource,
    as_calibration_set,
    fixed_batch,
    full_batches,
)
from .gate import LOSS_MEASURES, Evidence
from .report import (
    LatencyComparison,
    QuantizationReport,
    accuracy,
    model_bytes,
    output_error,
)
from .static_build import BIAS_CORRECTION_SAMPLES, StaticBuilder, one_line  # noqa: F401  (BIAS_CORRECTION_SAMPLES: public name)

log = logging.getLogger("edgeflow.quantization")

METHODS = ("static", *CALIBRATION_METHODS, "dynamic", "fp16")
ENGINES = ("auto", "ort", "numpy")


@dataclass
class QuantizedModel:
    """The quantized model and its report."""

    model: onnx.ModelProto
    report: QuantizationReport

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        onnx.save(self.model, str(p))
        return p


def resolve_method(method: str | None, profile: DeviceProfile) -> tuple[str, str | None]:
    """(kind, calibration method) from ``method`` or the profile's scheme."""
    q = profile.quantization
    if method is None:
        if q.scheme == "none":
            raise QuantizationError(
                f"profile {profile.name!r} runs models unquantized (quantization.scheme = \"none\"); "
                f"pass method= one of {', '.join(METHODS)} to quantize anyway"
            )
        method = "fp16" if q.scheme == "fp16" else "static"
    if method in CALIBRATION_METHODS:
        return "static", method
    if method == "static":
        return "static", q.calibration
    if method in ("dynamic", "fp16"):
        return method, None
    raise QuantizationError(f"unknown quantization method {method!r}; use one of {', '.join(METHODS)}")


class _Evaluator:
    """Runs models on the profile's backend, batch by batch."""

    def __init__(self, profile: DeviceProfile, backend: str, batch_size: int, fixed: int | None,
                 exact_int8: bool = False) -> None:
        self.profile = profile
        self.backend = backend
        self.batch_size = fixed or batch_size
        self.fixed = fixed
        self.exact_int8 = exact_int8  # the board's exact int8 sums where this host's kernels saturate

    def session(self, model: onnx.ModelProto):
        from ..runtime.backends import get_backend
        from ..runtime.session import session_options

        return get_backend(self.backend).load(model, session_options(self.profile, exact_int8=self.exact_int8))

    def runner(self, model: onnx.ModelProto):
        sess = self.session(model)
        return lambda feeds, names: sess.run(feeds, names or None)

    def predict(self, model: onnx.ModelProto, data: CalibrationSet) -> np.ndarray:
        sess = self.session(model)
        first = sess.outputs[0].name
        outs = []
        for feeds in data.batches(self.batch_size):
            n = len(next(iter(feeds.values())))
            if self.fixed and n < self.fixed:  # pad the last batch of a fixed-batch model
                feeds = {k: np.concatenate([v, np.repeat(v[-1:], self.fixed - n, axis=0)]) for k, v in feeds.items()}
            outs.append(sess.run(feeds, [first])[first][:n])
        return np.concatenate(outs)


def runnable_batch(evaluator: _Evaluator, model: onnx.ModelProto, data: CalibrationSet) -> tuple[int | None, str | None]:
    """The batch a model with a free batch dimension really runs, probed on two samples.

    Some exports leave the input's batch dimension free but fix it inside the graph (a Reshape to a
    constant shape with batch 1): batches of 2 or more then fail deep in the backend. Returns
    (1, a note) when only single samples run, (None, None) when batches do; raises
    QuantizationError naming the cause when even one sample does not run."""
    if data.n < 2:
        return None, None
    sess = evaluator.session(model)
    first = sess.outputs[0].name
    try:
        sess.run(data.take(slice(0, 2)).arrays, [first])
        return None, None
    except EdgeflowError as exc:
        batched = " ".join(str(exc).split())
    try:
        sess.run(data.take(slice(0, 1)).arrays, [first])
    except EdgeflowError as exc:
        raise QuantizationError(f"the model does not run on the calibration data ({one_line(exc)}); check that "
                                "the samples have the input's shape and dtype (edgeflow inspect MODEL)") from None
    cause = batched if len(batched) <= 200 else f"{batched[:80]} ... {batched[-110:]}"
    return 1, (f"the model runs only one sample at a time although its input's batch dimension is free (a batch "
               f"of 2 failed: {cause}): calibrated and evaluated in batches of 1")


def _labels(labels, n: int) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise QuantizationError(f"labels must be a 1-D integer array of class indices, got {y.dtype} {y.shape}")
    if len(y) != n:
        raise QuantizationError(f"labels has {len(y)} entries but the evaluation data has {n} samples")
    return y


def _latency_feeds(inputs: list[TensorInfo], data: CalibrationSet | None, batch: int, seed: int) -> dict[str, np.ndarray]:
    if data is not None:
        idx = np.arange(batch) % data.n
        return {k: v[idx] for k, v in data.arrays.items()}
    from ..runtime.memory import concrete_shapes

    rng = np.random.default_rng(seed)
    shapes = concrete_shapes(inputs, batch)
    return {t.name: rng.standard_normal(shapes[t.name]).astype(t.dtype or "float32") for t in inputs}


def _measure_latency(fp32: onnx.ModelProto, qm: onnx.ModelProto, profile: DeviceProfile, backend: str,
                     feeds: dict[str, np.ndarray], runs: int) -> LatencyComparison:
    from ..runtime.session import load
    from ..timing import measure

    batch = len(next(iter(feeds.values())))
    stats = []
    for m in (fp32, qm):
        rt = load(m, profile, backend=backend, batch_size=batch, allow_over_budget=True)
        stats.append(measure(lambda: rt.run(feeds), runs=runs, warmup=max(2, runs // 10), batch_size=batch))
    return LatencyComparison(backend, batch, min(profile.threads, os.cpu_count() or 1), stats[0], stats[1])


QDQ_OPSET = 13
"""Per-channel QuantizeLinear/DequantizeLinear (their ``axis`` attribute) exist from opset 13."""


def _opset_for_int8(model: onnx.ModelProto, per_channel: bool) -> tuple[onnx.ModelProto, bool, str | None]:
    """Upgrade a model below opset 13 so per-channel QDQ is legal; else fall back to per-tensor.

    Below opset 13 a per-channel DequantizeLinear (``axis``) fails
    onnx.checker. onnx's version converter upgrades most models; where it
    cannot, the weights are quantized per tensor and the note says so.
    """
    from ..runtime.model import model_opset

    opset = model_opset(model)
    if opset >= QDQ_OPSET or not per_channel:
        return model, per_channel, None
    from onnx import version_converter

    try:
        up = version_converter.convert_version(model, QDQ_OPSET)
        up = load_model(up)
    except Exception as exc:  # noqa: BLE001 - the converter raises assorted types; per-tensor still works
        log.warning("opset upgrade to %d failed (%s): weights per tensor", QDQ_OPSET, one_line(exc))
        return model, False, (f"opset {opset} < {QDQ_OPSET} and the upgrade failed ({one_line(exc)}): "
                              "weights quantized per tensor instead of per channel")
    return up, True, f"model upgraded from opset {opset} to {QDQ_OPSET} for per-channel int8 weights"


def preprocess_graph(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """The graph optimizer's portable passes before planning (``edgeflow.runtime.optimize``).

    Paddle and TF exports hold their weights in Constant nodes and wrap
    Conv in BatchNormalization; as initializers, folded into the Conv, the
    weights are what int8 quantizes. Shape subgraphs fixed by ``--shape``
    fold away too. Returns the model and a note of what changed (None when
    nothing did).
    """
    from ..runtime.optimize import optimize

    try:
        res = optimize(model)
    except EdgeflowError:
        raise
    except Exception as exc:  # noqa: BLE001 - a pass that fails leaves the model as it came
        log.warning("graph preprocessing failed, quantizing the model as it came: %s", one_line(exc), exc_info=True)
        return model, f"graph preprocessing skipped ({one_line(exc)})"
    r = res.report
    if r.nodes_after == r.nodes_before and r.before == r.after:
        return model, None
    done = []
    for what, key in (("Constant", "Constant"), ("BatchNormalization", "BatchNormalization"),
                      ("Identity", "Identity"), ("Shape", "Shape")):
        gone = r.before.get(key, 0) - r.after.get(key, 0)
        if gone > 0:
            done.append(f"{gone} {what}")
    detail = f" ({', '.join(done)} removed)" if done else ""
    return load_model(res.model), (f"graph preprocessed: {r.nodes_before} -> {r.nodes_after} nodes{detail}: "
                                   "Constant weights as initializers, constants and BatchNormalization folded")


def _gated(fp32, plan, build, prof, backend, evaluator, ev, labels, *, max_loss, fallback, per_channel, cal, calib,
           percentile, activations, batch, rounds, seed, inputs, formats=(None,), retry_method=None,
           loss_measure="auto", corrected: bool = False, untimed: str | None = None):
    """The bench-gated choice (:mod:`.gate`): the model it picked and the decision (``untimed``: why
    nothing is timed here; accuracy alone then decides)."""
    if untimed and backend == "numpy":
        return _numpy_untimed(fp32, plan, prof, backend, evaluator, ev, labels, max_loss=max_loss, fallback=fallback,
                              per_channel=per_channel, batch=batch, rounds=rounds, seed=seed, inputs=inputs,
                              loss_measure=loss_measure, untimed=untimed)
    run = _GateRun(fp32, plan, build, prof, backend, evaluator, ev, labels, max_loss=max_loss, fallback=fallback,
                   per_channel=per_channel, cal=cal, calib=calib, percentile=percentile, activations=activations,
                   batch=batch, rounds=rounds, seed=seed, inputs=inputs, loss_measure=loss_measure, untimed=untimed,
                   variant=[formats[0], None, None, None])
    first = run.search_variants(formats, retry_method, corrected) if len(formats) > 1 or retry_method else None
    decision = run.decide(first)
    if decision.choice == "int8":
        q = run.int8(decision)
        if q is not None:
            return q, decision
    return run.without_int8(decision)


def _numpy_untimed(fp32, plan, prof, backend, evaluator, ev, labels, *, max_loss, fallback, per_channel, batch, rounds,
                   seed, inputs, loss_measure, untimed):
    """The gate's choice on an untimed numpy board: ``fallback``."""
    from .gate import GateDecision

    # numpy has no integer GEMM: static int8 runs slower than fp32 on every host measured
    # (docs/quantization.md); without timings here, that is what decides
    targets = [t.node for t in plan.targets]
    decision = GateDecision(
        fallback, backend, float("nan"), None, None, max_loss, {}, [],
        f"static int8 is slower than fp32 on the numpy backend (no integer GEMM), and it is not timed here "
        f"({untimed}; --time-on-host times it on this host): {fallback} chosen", timed=False)
    return _fallback(fp32, decision, targets, prof, backend, evaluator, ev, labels, max_loss=max_loss,
                     fallback=fallback, per_channel=per_channel, batch=batch, rounds=rounds, seed=seed,
                     inputs=inputs, loss_measure=loss_measure)


class _Variant(NamedTuple):
    """One variant of the every-layer int8 model, as the gate measured it."""

    over: bool  # its loss is over --max-loss
    rank: float  # its latency (its loss where nothing is timed)
    args: tuple  # format, calibration method (None: the call's), op types (None: every one), bias correction
    trial: "Trial"
    model: onnx.ModelProto


@dataclass
class _GateRun:
    """One bench-gate search (:func:`_gated`'s arguments): the candidate int8 models, each built once, and
    their trials against fp32 on the evaluation set (timed unless ``untimed`` says why not)."""

    fp32: onnx.ModelProto
    plan: QuantPlan
    build: StaticBuilder
    prof: DeviceProfile
    backend: str
    evaluator: _Evaluator
    ev: CalibrationSet
    labels: np.ndarray | None
    max_loss: float
    fallback: str
    per_channel: bool
    cal: CalibrationSet
    calib: str | None
    percentile: float
    activations: str
    batch: int
    rounds: int
    seed: int
    inputs: list[TensorInfo]
    loss_measure: str
    untimed: str | None
    variant: list  # the one built: format, calibration method (None: the profile's), op types, bias correction

    def __post_init__(self) -> None:
        from ..runtime.session import load, session_options
        from .gate import ctc_strip

        self.feeds = _latency_feeds(self.inputs, self.ev, self.batch, self.seed)
        self.ref = self.evaluator.predict(self.fp32, self.ev)
        self.strip = ctc_strip(self.fp32, self.loss_measure)
        self.rt32 = load(self.fp32, self.prof, backend=self.backend, batch_size=self.batch, allow_over_budget=True)
        # runs in our thread: CPU time ignores other load
        self.cpu = self.backend == "ort" and session_options(self.prof).threads == 1
        self.targets = [t.node for t in self.plan.targets]
        self.built: dict[frozenset, onnx.ModelProto] = {}
        self.base: dict[str, float] = {}
        self.sens: list = []
        self.steps: list[str] = []  # the variants tried, before the search's own steps
        self.wo: onnx.ModelProto | None = None  # the weight-only model, once built

    def measure(self, kept: frozenset) -> "Trial":
        """The current variant with ``kept`` fp32 (built once): its loss, and its latency on the scale of
        the first fp32 timing (NaN where nothing is timed)."""
        from ..runtime.session import load
        from .gate import Trial, loss_percent, time_pair

        m = self.built.get(kept)
        if m is None:
            m = self.built[kept] = self.build(kept, *self.variant)
        loss = loss_percent(self.ref, self.evaluator.predict(m, self.ev), self.labels, self.loss_measure, self.strip)
        if self.untimed:
            self.base.setdefault("fp32", float("nan"))
            return Trial(kept, float("nan"), loss)
        rt = load(m, self.prof, backend=self.backend, batch_size=self.batch, allow_over_budget=True)
        rt32, feeds = self.rt32, self.feeds
        t32, t8 = time_pair(lambda: rt32.run(feeds), lambda: rt.run(feeds), rounds=self.rounds, cpu=self.cpu)
        self.base.setdefault("fp32", t32)
        return Trial(kept, t8 * self.base["fp32"] / t32, loss)

    def sensitivity(self) -> list[str]:
        """The layers, worst first."""
        from .qdq import tensor_qparams
        from .sensitivity import layer_sensitivity

        ev, labels, evaluator = self.ev, self.labels, self.evaluator
        ranges = collect_ranges(self.fp32, self.plan.calibrated_tensors, self.cal, evaluator.runner,
                                method=self.calib, percentile=self.percentile, batch_size=evaluator.batch_size)
        qp = tensor_qparams(self.plan, ranges, self.activations)
        k = min(ev.n, 16)  # one model per layer: rank on a few samples (the loss is checked on all)
        self.sens[:] = layer_sensitivity(self.fp32, self.plan, qp, ev.take(slice(0, k)), self.ref[:k],
                                         evaluator.predict, labels=labels[:k] if labels is not None else None,
                                         per_channel=self.per_channel)
        return [s.node for s in self.sens]

    def search_variants(self, formats, retry_method, corrected: bool) -> "Trial":
        """Measure the variants and build the one chosen from now on; its every-layer trial.

        onnxruntime: QDQ and QOperator differ per model by up to 4x, so both are measured; where
        MinMax ranges lose too much (one outlier coarsens a whole tensor), percentile ranges are tried."""
        tried: list[_Variant] = []
        for fmt in formats:
            tried.append(self.try_variant(fmt, None))
        if corrected:
            # bias correction helps some models a great deal (PP-OCRv4's detector) and hurts others
            # (PicoDet): a variant of its own, judged by its measured loss like the others
            tried.append(self.try_variant("qdq", None, None, True))
        if retry_method and all(r.over for r in tried):
            for fmt in formats:
                tried.append(self.try_variant(fmt, retry_method))
        if all(r.over for r in tried):
            # onnxruntime also quantizes Add/Mul/Softmax/...; keeping those float is the next thing to try,
            # and it makes the per-layer steps below (Conv/MatMul/Gemm) cover everything that is int8.
            for fmt in formats:
                tried.append(self.try_variant(fmt, None, ("Conv", "MatMul", "Gemm")))
        return self.pick(self.candidates(tried))

    def label(self, variant) -> str:
        fmt, cmethod, _, bc = variant
        return f"{fmt} format, {cmethod or self.calib} calibration{', bias-corrected' if bc else ''}"

    def try_variant(self, fmt, cmethod, ops=None, bc=None) -> _Variant:
        """The every-layer int8 model of one variant, measured (a step says how it did)."""
        self.variant[:] = [fmt, cmethod, ops, bc]
        self.built.pop(frozenset(), None)
        t = self.measure(frozenset())
        tried = _Variant(t.loss > self.max_loss, t.loss if self.untimed else t.latency_ms, (fmt, cmethod, ops, bc),
                         t, self.built[frozenset()])
        self.steps.append(f"{self.label(tried.args)}, "
                          f"{'only ' + '/'.join(ops) if ops else 'every op onnxruntime quantizes'} int8, "
                          f"all layers int8: {'not timed' if self.untimed else f'{t.latency_ms:.3f} ms'}, "
                          f"loss {t.loss:.2f}%")
        return tried

    def candidates(self, tried: list[_Variant]) -> list[_Variant]:
        """The variants the search may start from.

        Every variant is over --max-loss: the per-layer steps only return Conv/MatMul/Gemm to fp32, so
        a variant that also has other ops int8 can end within it only if its loss with every one of those
        layers fp32 is (PicoDet's best such variant: 51%, a dead end). The one that loses least is checked
        so; the others are left to the Conv/MatMul/Gemm-only variants."""
        if not (all(r.over for r in tried) and any(r.args[2] for r in tried)):
            return tried
        pool = [r for r in tried if r.args[2]]
        rest = [r for r in tried if not r.args[2]]
        best = min(rest, key=lambda r: r.trial.loss, default=None)
        if best is not None and best.trial.loss < min(r.trial.loss for r in pool):
            if self.floor(best).loss <= self.max_loss:
                pool = pool + [best]
        return pool

    def floor(self, best: _Variant) -> "Trial":
        """``best`` with every Conv/MatMul/Gemm fp32 and the other ops int8."""
        self.variant[:] = list(best.args)
        self.built.clear()
        floor = self.measure(frozenset(self.targets))
        self.steps.append(f"{self.label(best.args)}: with every Conv/MatMul/Gemm fp32 "
                          f"and the other ops int8, loss {floor.loss:.2f}%"
                          f"{' -> a start the per-layer steps can finish from' if floor.loss <= self.max_loss else ''}")
        return floor

    def pick(self, pool: list[_Variant]) -> "Trial":
        """The variant within --max-loss that runs fastest (else the one that loses least), built from now on."""
        chosen = min(pool, key=lambda r: (r.over, r.rank if not r.over else r.trial.loss))
        self.variant[:] = list(chosen.args)
        self.built.clear()
        self.built[frozenset()] = chosen.model
        ops = chosen.args[2]
        self.steps.append(f"{self.label(chosen.args)}{', only ' + '/'.join(ops) if ops else ''} chosen")
        return chosen.trial

    def decide(self, first: "Trial | None") -> "GateDecision":
        """The search over layers (:func:`.gate.choose`) from the every-layer trial ``first`` (measured here
        when None), its steps after the variants'."""
        from .gate import choose, layer_groups

        if first is None:
            first = self.measure(frozenset())
        decision = choose(self.targets, layer_groups(self.fp32, self.targets),
                          lambda k: first if not k else self.measure(k), self.base["fp32"], self.sensitivity,
                          max_loss=self.max_loss, fallback=self.fallback, backend=self.backend, untimed=self.untimed)
        decision.steps[:0] = self.steps
        decision.int8_format = self.variant[0] or self.prof.quantization.format
        decision.calibration = self.variant[1] or self.calib
        decision.sensitivity = list(self.sens)
        return decision

    def int8(self, decision: "GateDecision") -> onnx.ModelProto | None:
        """The int8 model chosen, with the evidence of its loss; None where re-timing takes the choice back."""
        q = self.built[frozenset(decision.kept_fp32)]
        if decision.timed:
            self.retime(decision, q)
            if decision.choice != "int8":
                return None
        decision.evidence = _evidence(self.ref, self.evaluator.predict(q, self.ev), self.max_loss, self.loss_measure,
                                      self.strip)
        return q

    def retime(self, decision: "GateDecision", q: onnx.ModelProto) -> None:
        """The search's figure is the best of many noisy timings: re-time the one int8 model against
        the model that would be written without it, in more rounds, before writing it."""
        from ..runtime.session import load
        from .gate import confirm, time_rounds
        from .weight_only import weight_only_int8

        rt8 = load(q, self.prof, backend=self.backend, batch_size=self.batch, allow_over_budget=True)
        rt_alt = self.rt32
        if self.fallback == "weight-only":
            self.wo = load_model(weight_only_int8(self.fp32, self.targets, per_channel=self.per_channel,
                                                  optimize=False))
            rt_alt = load(self.wo, self.prof, backend=self.backend, batch_size=self.batch, allow_over_budget=True)
        feeds = self.feeds
        confirm(decision, lambda: time_rounds(lambda: rt_alt.run(feeds), lambda: rt8.run(feeds),
                                              rounds=max(7, 3 * self.rounds), cpu=self.cpu), fallback=self.fallback)

    def without_int8(self, decision: "GateDecision"):
        """The model written when int8 is not chosen (:func:`_fallback`)."""
        return _fallback(self.fp32, decision, self.targets, self.prof, self.backend, self.evaluator, self.ev,
                         self.labels, max_loss=self.max_loss, fallback=self.fallback, per_channel=self.per_channel,
                         batch=self.batch, rounds=self.rounds, seed=self.seed, inputs=self.inputs,
                         loss_measure=self.loss_measure, wo=self.wo, ref=self.ref, rt32=self.rt32, cpu=self.cpu)


def _evidence(ref, got, max_loss: float, loss_measure: str, strip) -> "Evidence | None":
    """What the evaluation set shows about the written model's loss (None: a cosine loss, no count)."""
    from .gate import agreement_evidence, changed_samples

    changed = changed_samples(ref, got, loss_measure, strip)
    if changed is None:
        return None
    ev = agreement_evidence(len(ref), changed, max_loss)
    if loss_measure in BOX_MEASURES:  # say what the boxes did: the share kept and how well they sit
        ev = dataclasses.replace(ev, detail=box_agreement(ref, got, loss_measure).format())
    return ev


def _fallback(fp32, decision, targets, prof, backend, evaluator, ev, labels, *, max_loss, fallback, per_channel,
              batch, rounds, seed, inputs, loss_measure, wo=None, ref=None, rt32=None, cpu=False):
    """The model written when int8 is not chosen: weight-only int8 if its loss is within ``max_loss``
    (timed against fp32 where the gate times), else fp32."""
    from ..runtime.session import load
    from .gate import ctc_strip, loss_percent, time_pair
    from .weight_only import weight_only_int8

    strip = ctc_strip(fp32, loss_measure)
    if ref is None:
        ref = evaluator.predict(fp32, ev)
    if decision.choice == "weight-only":
        if wo is None:
            wo = load_model(weight_only_int8(fp32, targets, per_channel=per_channel, optimize=False))
        got = evaluator.predict(wo, ev)
        wo_loss = loss_percent(ref, got, labels, loss_measure, strip)
        measured = ""
        if decision.timed:
            feeds = _latency_feeds(inputs, ev, batch, seed)
            rt32 = rt32 or load(fp32, prof, backend=backend, batch_size=batch, allow_over_budget=True)
            rt = load(wo, prof, backend=backend, batch_size=batch, allow_over_budget=True)
            t32, t_wo = time_pair(lambda: rt32.run(feeds), lambda: rt.run(feeds), rounds=rounds, cpu=cpu)
            measured = f"weight-only {t_wo:.3f} ms vs fp32 {t32:.3f} ms, "
        decision.reason += (f"; measured: {measured}{wo.ByteSize() / max(1, fp32.ByteSize()):.3f} of the fp32 size, "
                            f"loss {wo_loss:.2f}%")
        if wo_loss <= max_loss:
            decision.evidence = _evidence(ref, got, max_loss, loss_measure, strip)
            return wo, decision
        decision.choice = "fp32"
        decision.reason += f" > --max-loss {max_loss:g}%: fp32 chosen"
    return copy.deepcopy(fp32), decision


DEFAULT_MAX_LOSS = 1.0
"""--max-loss of the bench gate that static int8 gets by default, on every profile (percent)."""

NUMPY_MAX_LOSS = DEFAULT_MAX_LOSS  # the earlier name (numpy boards had the gate by default first)


def _timing(prof: DeviceProfile, backend: str, host: HostFacts, time_on_host: bool | None,
            notes: list[str]) -> str | None:
    """Why the gate does not time candidates here (None: it does).

    Timings describe the machine and backend they ran on. A profile for another board (another
    architecture, or CPU features this host lacks) or a report backend other than the board's
    first is not timed unless ``time_on_host`` asks for it, and then the note says whose figures
    they are."""
    board = list(prof.backends)[:1]
    differs = host_differs(prof, host)
    if backend not in board:
        differs = f"the report runs on {backend}, the {prof.name} board on {board[0] if board else '?'}"
    if differs is None:
        return None
    if time_on_host:
        notes.append(f"timed on this host although {differs} (--time-on-host): the gate's choice and the latency "
                     f"figures are this host's, not the {prof.name} board's")
        return None
    return differs


def quantize(
    model: ModelSource,
    profile: "str | DeviceProfile",
    calibration: DataSource | None = None,
    method: str | None = None,
    *,
    engine: str = "auto",
    keep_fp32: Sequence[str] = (),
    keep_first: bool = False,
    keep_last: bool = False,
    min_int8_channels: int = 4,
    eval_data: DataSource | None = None,
    labels: np.ndarray | Sequence[int] | None = None,
    holdout: float = 0.2,
    percentile: float = 99.999,
    sensitivity: bool | None = None,
    backend: str | None = None,
    batch_size: int = 32,
    latency_runs: int = 20,
    seed: int = 0,
    output: str | os.PathLike | None = None,
    preprocess: "ImagePrep | AudioPrep | str | os.PathLike | None" = None,
    optimize_graph: bool = True,
    max_loss: "float | None | str" = "auto",
    fallback: str = "weight-only",
    time_on_host: bool | None = None,
    gate_rounds: int = 5,
    loss: str = "auto",
    bias_correction: bool | None = None,
) -> QuantizedModel:
    """Quantize ``model`` for ``profile``; see the module docstring.

    ``calibration``: samples (array, dict of arrays, or .npz/.npy path); for
    static int8 a share ``holdout`` of them (>= 10 samples) is held out for
    the report unless ``eval_data`` is given. ``labels`` are class indices
    aligned with ``eval_data`` (or with ``calibration`` when it is split);
    with labels the report gives accuracy and per-layer ``sensitivity``.
    ``keep_fp32`` names nodes to leave in fp32; ``keep_first`` /
    ``keep_last`` the first / last quantizable layer; static int8 also keeps
    convolutions over fewer than ``min_int8_channels`` input channels (image
    input layers) in fp32, where int8 is slower. ``backend`` is where the
    report runs (default: the profile's first usable backend). The result is
    saved to ``output`` when given. ``calibration`` / ``eval_data`` may be a
    folder of images or .wav files, read with ``preprocess`` (an
    :class:`~edgeflow.data.preprocess.ImagePrep` / ``AudioPrep`` or a TOML file;
    default: from the model's input shape). ``optimize_graph`` runs the graph
    optimizer first (Constant-node weights, folding, BatchNormalization).

    ``max_loss`` (percent; see :mod:`.gate`; "auto" = :data:`DEFAULT_MAX_LOSS`)
    is the bench-gated choice, on by default for static int8 on every profile:
    the layers that cost the most accuracy stay fp32 until the loss is within
    ``max_loss``, and where the profile's board is this host (same
    architecture and CPU features, the report on the board's backend) int8 is
    also timed against fp32: kinds of layers that are slower in int8 stay
    fp32, and where no int8 model is faster the result is ``fallback``
    (``"weight-only"`` int8 or ``"fp32"``). Another board's choice is made on
    accuracy alone and says that its speed was not measured, unless
    ``time_on_host`` asks for this host's timings (a numpy board then gets
    ``fallback``: numpy has no integer GEMM, so static int8 is slower there).
    ``report.gate`` says what was chosen and why, and how much the evaluation
    set can show (:class:`.gate.Evidence`). ``max_loss=None`` writes static
    int8 unchecked (a note says so). ``loss`` is how the loss is measured
    (:data:`.gate.LOSS_MEASURES`: "auto", "cosine", "top1", "sequence" or
    "ctc" for per-step class scores such as a CTC recognizer's, "boxes" or
    "yolox" for a detector's boxes: :mod:`.boxes`).

    ``bias_correction`` (static int8 in QDQ format, evaluated on onnxruntime):
    each int8 conv's mean output error on the calibration data (at most
    :data:`BIAS_CORRECTION_SAMPLES` of them) is taken out of its bias, conv by
    conv (:mod:`.bias_correction`). ``None`` (default): off, except that the
    bench gate also tries a bias-corrected variant and keeps it only if its
    measured loss makes it the better choice; ``True``: always; ``False``: never.
    """
    _check_arguments(engine, loss, batch_size, max_loss)
    notes: list[str] = []
    fp32, prof, kind, calib, inputs = _prepare(model, profile, method, optimize_graph, notes)
    loss = _loss_measure(fp32, loss, kind, notes)
    fp32, per_channel = _int8_graph(fp32, prof, kind, notes)
    engine = _choose_engine(engine, kind)
    fp32, plan = _plan(fp32, kind, keep_fp32=keep_fp32, keep_first=keep_first, keep_last=keep_last,
                       min_int8_channels=min_int8_channels)
    data = _data(calibration, eval_data, labels, inputs, kind, holdout=holdout, seed=seed, preprocess=preprocess,
                 notes=notes)
    bench = _bench(fp32, prof, backend, kind, inputs, data, batch_size, time_on_host, notes)
    max_loss = _gate_limit(max_loss, kind, bench.backend, notes)
    qm, gate, builder = _quantized(
        fp32, plan, prof, kind, data, bench, engine=engine, calib=calib, per_channel=per_channel,
        percentile=percentile, batch_size=batch_size, bias_correction=bias_correction, max_loss=max_loss,
        fallback=fallback, gate_rounds=gate_rounds, seed=seed, inputs=inputs, loss=loss, notes=notes)

    report = _report(prof, kind, engine, calib, per_channel, data, fp32, qm, plan, notes)
    if gate is not None:
        _apply_gate(report, gate)
    if data.ev is not None:
        _evaluate(report, fp32, qm, plan, data, bench, kind, calib=calib,
                  activations=prof.quantization.activations, percentile=percentile,
                  batch_size=batch_size, per_channel=per_channel, sensitivity=sensitivity,
                  qparams=builder.qparams if builder is not None else None)
    if latency_runs > 0:
        _time(report, fp32, qm, prof, inputs, data, bench, batch_size=batch_size, runs=latency_runs, seed=seed)
    result = QuantizedModel(qm, report)
    if output is not None:
        result.save(output)
    return result


def _int8_graph(fp32: onnx.ModelProto, prof: DeviceProfile, kind: str, notes: list[str]
                ) -> tuple[onnx.ModelProto, bool]:
    """The graph int8 is written from, and whether its weights are per channel: opset 13 for per-channel
    weights (int8 only), and Max/Min by a constant as Clip (static int8 only)."""
    per_channel = prof.quantization.weights == "per-channel"
    if kind != "fp16":
        fp32, per_channel, note = _opset_for_int8(fp32, per_channel)
        if note:
            notes.append(note)
    if kind == "static":
        fp32, n_clip = clamps_as_clip(fp32)
        if n_clip:
            notes.append(f"{n_clip} Max/Min with a constant rewritten as Clip (exact; onnxruntime folds a Clip "
                         "into the int8 range of the op before it instead of running it in float)")
    return fp32, per_channel


def _quantized(fp32: onnx.ModelProto, plan: QuantPlan | None, prof: DeviceProfile, kind: str, data: _Data,
               bench: _Bench, *, engine: str, calib: str | None, per_channel: bool, percentile: float,
               batch_size: int, bias_correction: bool | None, max_loss: float | None, fallback: str,
               gate_rounds: int, seed: int, inputs: list[TensorInfo], loss: str, notes: list[str]):
    """The model of ``kind`` (checked: onnx.checker and shape inference fail here, not on the board), the
    gate's decision and the static int8 builder (None where there is none)."""
    gate = builder = None
    if kind == "static":
        qm, gate, builder = _quantize_static(
            fp32, plan, prof, data, bench, engine=engine, calib=calib, per_channel=per_channel,
            percentile=percentile, batch_size=batch_size, bias_correction=bias_correction, max_loss=max_loss,
            fallback=fallback, gate_rounds=gate_rounds, seed=seed, inputs=inputs, loss=loss, notes=notes)
    elif kind == "dynamic":
        qm = _quantize_dynamic(fp32, plan, engine, per_channel)
    else:
        from .fp16 import convert_fp16

        qm = convert_fp16(fp32)
    int8_written = builder is not None and (gate is None or gate.choice == "int8")
    if int8_written:
        _note_int8_rewrites(notes, builder.rewrites_of(qm), builder.readouts)  # before the copy below: by id
    return load_model(qm), gate, builder  # checker + shape inference: fail here, not on the board


def _check_arguments(engine: str, loss: str, batch_size: int, max_loss: "float | None | str") -> None:
    if engine not in ENGINES:
        raise QuantizationError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    if loss not in LOSS_MEASURES:
        raise QuantizationError(f"unknown loss measure {loss!r}; use one of {', '.join(LOSS_MEASURES)}")
    if batch_size < 1:
        raise QuantizationError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(max_loss, str) and max_loss != "auto":
        raise QuantizationError(f"max_loss must be a percentage, 'auto' or None, got {max_loss!r}")


def _prepare(model: ModelSource, profile: "str | DeviceProfile", method: str | None, optimize_graph: bool,
             notes: list[str]) -> tuple[onnx.ModelProto, DeviceProfile, str, str | None, list[TensorInfo]]:
    """The fp32 graph (a copy, optimized, every node named), the profile, the method and the inputs."""
    src = copy.deepcopy(model) if isinstance(model, onnx.ModelProto) else model
    fp32 = load_model(src)
    prof = get_profile(profile)
    kind, calib = resolve_method(method, prof)
    if optimize_graph:
        fp32, note = preprocess_graph(fp32)
        if note:
            notes.append(note)
    fp32 = name_nodes(fp32)
    return fp32, prof, kind, calib, graph_inputs(fp32)


def _loss_measure(fp32: onnx.ModelProto, loss: str, kind: str, notes: list[str]) -> str:
    """``loss``, with "auto" made "ctc" for a PaddleOCR text recognizer (static int8 only)."""
    if loss != "auto" or kind != "static":
        return loss
    from .gate import is_ctc_recognizer

    if is_ctc_recognizer(fp32):  # a PaddleOCR text recognizer: judge the text it reads
        notes.append("the model carries a CTC character table (PaddleOCR convention): the gate's loss is the "
                     "share of samples whose decoded text differs from fp32's (--loss ctc), not the cosine, "
                     "which can stay above 0.99 while characters change")
        return "ctc"
    return loss


def _choose_engine(engine: str, kind: str) -> str:
    from . import ort_backend

    if engine == "auto":
        engine = "ort" if ort_backend.available() and kind != "fp16" else "numpy"
    if engine == "ort" and not ort_backend.available():
        raise QuantizationError("engine='ort' needs onnxruntime, which is not installed here; use engine='numpy'")
    return "numpy" if kind == "fp16" else engine


def _plan(fp32: onnx.ModelProto, kind: str, *, keep_fp32: Sequence[str], keep_first: bool, keep_last: bool,
          min_int8_channels: int) -> tuple[onnx.ModelProto, QuantPlan | None]:
    """Which layers become int8 (None for fp16); a conv kept fp32 gets its pooling moved before its Relu."""
    if kind == "fp16":
        return fp32, None
    plan_kw = dict(
        ops=("Gemm", "MatMul") if kind == "dynamic" else QUANTIZABLE,
        keep_fp32=tuple(keep_fp32), keep_first=keep_first, keep_last=keep_last,
        min_int8_channels=min_int8_channels if kind == "static" else 0,
    )
    plan = plan_quantization(fp32, **plan_kw)
    kept_convs = [n.name for n in fp32.graph.node if n.op_type == "Conv" and n.name in plan.kept_fp32]
    if kind == "static" and kept_convs:
        fp32 = load_model(pool_before_relu(fp32, kept_convs))
        plan = plan_quantization(fp32, **plan_kw)
    return fp32, plan


@dataclass
class _Data:
    """Calibration samples, the evaluation set with its labels, and where the evaluation set came from."""

    cal: CalibrationSet | None
    ev: CalibrationSet | None
    ev_labels: np.ndarray | None
    source: str


def _data(calibration: DataSource | None, eval_data: DataSource | None, labels, inputs: list[TensorInfo],
          kind: str, *, holdout: float, seed: int, preprocess, notes: list[str]) -> _Data:
    """Read the samples; for static int8 without ``eval_data`` hold out a share of the calibration set."""
    if isinstance(preprocess, (str, os.PathLike)):
        from ..data.preprocess import load_prep
        from ..errors import InputError

        try:
            preprocess = load_prep(preprocess)
        except InputError as exc:
            raise QuantizationError(str(exc)) from exc
    cal = (as_calibration_set(calibration, inputs, prep=preprocess, notes=notes)
           if calibration is not None else None)
    if kind == "static" and cal is None:
        raise QuantizationError(
            "static int8 quantization needs calibration data: pass calibration= a few hundred "
            "representative input samples (array, dict or .npz), or use method='dynamic'"
        )
    if eval_data is not None:
        ev = as_calibration_set(eval_data, inputs, what="evaluation data", prep=preprocess, notes=notes)
        return _Data(cal, ev, _labels(labels, ev.n) if labels is not None else None, "eval_data")
    if cal is None:
        if labels is not None:
            raise QuantizationError("labels given without data: pass eval_data= (or calibration=) with them")
        return _Data(None, None, None, "none")
    y = _labels(labels, cal.n) if labels is not None else None
    n_hold = int(round(cal.n * holdout)) if kind == "static" and cal.n >= 10 and holdout > 0 else 0
    if n_hold:
        perm = np.random.default_rng(seed).permutation(cal.n)
        return _Data(cal.take(perm[n_hold:]), cal.take(perm[:n_hold]), y[perm[:n_hold]] if y is not None else None,
                     f"held out: {n_hold} of {cal.n} calibration samples")
    return _Data(cal, cal, y,
                 "the calibration samples (too few to hold out)" if kind == "static" else "the given samples")


@dataclass
class _Bench:
    """Where the report and the gate run: the backend, the batch the model fixes, and why nothing is timed."""

    backend: str
    fixed: int | None
    evaluator: _Evaluator
    untimed: str | None


def _bench(fp32: onnx.ModelProto, prof: DeviceProfile, backend: str | None, kind: str, inputs: list[TensorInfo],
           data: _Data, batch_size: int, time_on_host: bool | None, notes: list[str]) -> _Bench:
    """Choose the report's backend and the batch the model really runs (a graph may fix it); a fixed batch
    cuts the calibration set to whole batches (``data.cal`` is replaced)."""
    from ..runtime.session import choose_backend

    be = choose_backend(fp32, prof, backend).name
    fixed = fixed_batch(inputs)
    host = host_facts()  # read once: /proc/cpuinfo decides both notes below
    exact = be == "ort" and kind == "static" and saturates_where_board_does_not(prof, host)
    evaluator = _Evaluator(prof, be, batch_size, fixed, exact_int8=exact)
    probe = data.cal if data.cal is not None else data.ev
    if fixed is None and probe is not None:
        fixed, note = runnable_batch(evaluator, fp32, probe)
        if fixed:
            notes.append(note)
            evaluator = _Evaluator(prof, be, batch_size, fixed, exact_int8=exact)
    if exact:
        notes.append(f"outputs for the report and the gate's loss computed with onnxruntime's exact int8 path "
                     f"(session.x64quantprecision): this host has no VNNI, so its fast u8 x s8 kernels saturate "
                     f"int16 pair sums, which a {prof.name} board (VNNI) does not; speed is timed on the fast path")
    if fixed and data.cal is not None and kind == "static":
        data.cal, note = full_batches(data.cal, fixed)
        if note:
            notes.append(note)
    return _Bench(be, fixed, evaluator, _timing(prof, be, host, time_on_host, notes))


def _gate_limit(max_loss: "float | None | str", kind: str, backend: str, notes: list[str]) -> float | None:
    """The gate's --max-loss: "auto" is :data:`DEFAULT_MAX_LOSS` for static int8; None says the gate is off."""
    if max_loss == "auto":
        return DEFAULT_MAX_LOSS if kind == "static" else None
    if max_loss is None and kind == "static":
        notes.append("the bench gate is off (max_loss=None): static int8 written without checking its loss or "
                     "speed against fp32")
        if backend == "numpy":
            log.warning("static int8 on the numpy backend without the bench gate: expected to be slower than fp32 "
                        "(numpy has no integer GEMM)")
            notes.append("static int8 is expected to be slower than fp32 on the numpy backend (numpy has no "
                         "integer GEMM: int8 runs on the same float sgemm plus requantization passes)")
    return max_loss  # type: ignore[return-value]


def _quantize_static(fp32: onnx.ModelProto, plan: QuantPlan | None, prof: DeviceProfile, data: _Data,
                     bench: _Bench, *, engine: str, calib: str | None, per_channel: bool, percentile: float,
                     batch_size: int, bias_correction: bool | None, max_loss: float | None, fallback: str,
                     gate_rounds: int, seed: int, inputs: list[TensorInfo], loss: str, notes: list[str]):
    """Static int8: calibrate (numpy engine), then the every-layer model, or the bench gate's choice."""
    assert plan is not None and data.cal is not None
    cal, fixed, be = data.cal, bench.fixed, bench.backend
    activations = prof.quantization.activations
    qparams = None
    if engine == "numpy":
        from .qdq import tensor_qparams

        ranges = collect_ranges(fp32, plan.calibrated_tensors, cal, bench.evaluator.runner, method=calib,
                                percentile=percentile, batch_size=fixed or batch_size)
        qparams = tensor_qparams(plan, ranges, activations)
        if prof.quantization.format == "qoperator":
            notes.append("the profile asks for QOperator format; the numpy engine writes QDQ (same arithmetic)")
    builder = StaticBuilder(fp32, plan, cal, engine=engine, backend=be, profile=prof, calib=calib,
                            activations=activations, per_channel=per_channel, percentile=percentile,
                            batch_size=batch_size, fixed=fixed, evaluator=bench.evaluator, qparams=qparams,
                            bias_correction=bias_correction, notes=notes)
    if max_loss is None:
        return builder(), None, builder
    qm, gate = _gated(fp32, plan, builder, prof, be, bench.evaluator, data.ev if data.ev is not None else cal,
                      data.ev_labels,
                      formats=("qdq", "qoperator") if engine == "ort" and be == "ort" else (None,),
                      retry_method="percentile" if engine == "ort" and calib == "minmax" else None,
                      max_loss=max_loss, fallback=fallback, per_channel=per_channel, cal=cal, calib=calib,
                      percentile=percentile, activations=activations, batch=fixed or 1,
                      rounds=gate_rounds, seed=seed, inputs=inputs, loss_measure=loss,
                      corrected=bias_correction is None and be == "ort", untimed=bench.untimed)
    if gate.evidence is not None and not gate.evidence.enough:
        notes.append(gate.evidence.format())
    return qm, gate, builder


def _quantize_dynamic(fp32: onnx.ModelProto, plan: QuantPlan | None, engine: str, per_channel: bool
                      ) -> onnx.ModelProto:
    assert plan is not None
    if engine == "ort":
        from . import ort_backend

        return ort_backend.quantize_dynamic_ort(
            fp32, per_channel=per_channel, nodes=[t.node for t in plan.targets],
            gemms=[t.node for t in plan.targets if t.op_type == "Gemm"],
        )
    from .dynamic import quantize_dynamic_graph

    return quantize_dynamic_graph(fp32, plan, per_channel=per_channel)


def _note_int8_rewrites(notes: list[str], counts: tuple[int, int, int], readouts: list[str]) -> None:
    n_hsw, n_aff, n_bias = counts
    if n_hsw:
        notes.append(f"{n_hsw} HardSwish/HardSigmoid run in int8 as QLinearAdd (+ QLinearMul) on onnxruntime, "
                     "which has no int8 kernel for them (the clamp is the int8 range's saturation)")
    if n_aff:
        notes.append(f"{n_aff} Mul/Add by a scalar after a quantized tensor read as its integers with another "
                     "scale and zero point (no QLinearMul/QLinearAdd pass)")
    if n_bias:
        notes.append(f"bias correction: {n_bias} int8 conv(s) had their mean output error on the calibration data "
                     "taken out of their bias")
    if readouts:
        notes.append(f"{len(readouts)} Softmax writing a model output kept float ({', '.join(readouts)}): "
                     "read in float anyway, and onnxruntime's int8 Softmax is slower")


def _report(prof: DeviceProfile, kind: str, engine: str, calib: str | None, per_channel: bool, data: _Data,
            fp32: onnx.ModelProto, qm: onnx.ModelProto, plan: QuantPlan | None, notes: list[str]
            ) -> QuantizationReport:
    activations = prof.quantization.activations
    return QuantizationReport(
        profile=prof.name, method=kind, engine=engine, calibration=calib,
        activations=activations if kind == "static" else ("uint8 (dynamic)" if kind == "dynamic" else None),
        weights=("int8 " + ("per-channel" if per_channel else "per-tensor")) if kind != "fp16" else "float16",
        n_calibration=data.cal.n if (data.cal is not None and kind == "static") else 0,
        n_eval=data.ev.n if data.ev is not None else 0, eval_source=data.source,
        fp32_bytes=model_bytes(fp32), quantized_bytes=model_bytes(qm),
        quantized_nodes=[t.node for t in plan.targets] if plan else [],
        kept_fp32=dict(plan.kept_fp32) if plan else {},
        notes=notes,
    )


def _apply_gate(report: QuantizationReport, gate) -> None:
    """The report of the model the gate chose: its layers kept fp32, or weight-only / fp32."""
    report.gate = gate
    report.kept_fp32.update(gate.kept_fp32)
    if gate.choice == "int8":
        report.quantized_nodes = [n for n in report.quantized_nodes if n not in gate.kept_fp32]
    else:
        report.activations = "float32 (weight-only int8)" if gate.choice == "weight-only" else None
        report.weights = "int8 (weight-only)" if gate.choice == "weight-only" else "float32"
        if gate.choice == "fp32":
            report.quantized_nodes = []
    if gate.sensitivity:
        report.sensitivity = gate.sensitivity


def _evaluate(report: QuantizationReport, fp32: onnx.ModelProto, qm: onnx.ModelProto, plan: QuantPlan | None,
              data: _Data, bench: _Bench, kind: str, *, calib: str | None, activations: str, percentile: float,
              batch_size: int, per_channel: bool, sensitivity: bool | None, qparams: dict | None) -> None:
    """Output error and accuracy on the evaluation set; per-layer sensitivity where asked (default: with labels)."""
    ev, ev_labels, evaluator = data.ev, data.ev_labels, bench.evaluator
    assert ev is not None
    ref = evaluator.predict(fp32, ev)
    got = evaluator.predict(qm, ev)
    report.error = output_error(ref, got)
    if ev_labels is not None:
        report.accuracy_fp32 = accuracy(ref, ev_labels)
        report.accuracy_quantized = accuracy(got, ev_labels)
    if sensitivity is None:
        sensitivity = ev_labels is not None and kind == "static"
    if not (sensitivity and kind == "static" and not report.sensitivity):
        return
    assert plan is not None and data.cal is not None
    from .qdq import tensor_qparams
    from .sensitivity import layer_sensitivity

    if qparams is None:  # onnxruntime calibrated: measure ranges once more, our way
        ranges = collect_ranges(fp32, plan.calibrated_tensors, data.cal, evaluator.runner, method=calib,
                                percentile=percentile, batch_size=bench.fixed or batch_size)
        qparams = tensor_qparams(plan, ranges, activations)
    report.sensitivity = layer_sensitivity(
        fp32, plan, qparams, ev, ref, evaluator.predict, labels=ev_labels, per_channel=per_channel
    )


def _time(report: QuantizationReport, fp32: onnx.ModelProto, qm: onnx.ModelProto, prof: DeviceProfile,
          inputs: list[TensorInfo], data: _Data, bench: _Bench, *, batch_size: int, runs: int, seed: int) -> None:
    """fp32 vs the written model's latency where this host times the board (else a note says why not)."""
    if bench.untimed:
        report.notes.append(f"latency not measured: {bench.untimed}; pass --time-on-host (time_on_host=True) for "
                            "this host's figures")
        return
    feeds = _latency_feeds(inputs, data.ev, bench.fixed or batch_size, seed)
    try:
        report.latency = _measure_latency(fp32, qm, prof, bench.backend, feeds, runs)
    except EdgeflowError as exc:
        report.notes.append(f"latency not measured on {bench.backend}: {exc}")
