"""Activation range calibration: MinMax, Percentile and Entropy (numpy only).

The model is run on the calibration samples with the tensors to quantize
added as graph outputs, on whichever backend is here (onnxruntime, or the
numpy backend on boards without it). One *observer* per tensor turns the
values it sees into a range ``(lo, hi)``:

- ``minmax``: the observed minimum and maximum. Exact cover, but one outlier
  stretches the scale for every other value.
- ``percentile``: cut ``(100 - p) / 2`` percent of the values off each end
  of a 2048-bin histogram (default p = 99.999, as onnxruntime).
- ``entropy``: the clipping threshold minimising the KL divergence between
  the histogram of ``|x|`` and its quantized version (TensorRT's method):
  it trades clipping error for resolution where most values are.

Histogram observers need the range before they can bin, so they take two
passes over the data (a streaming pass for the range, then the histogram)
rather than holding every activation of every sample in memory.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from ..errors import QuantizationError
from .data import CalibrationSet

METHODS = ("minmax", "percentile", "entropy")


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float


class Observer:
    """Accumulates a tensor's values over batches; ``passes`` data passes."""

    passes = 1

    def observe(self, x: np.ndarray, pass_index: int) -> None:
        raise NotImplementedError("need observe")

    def range(self) -> Range:
        raise NotImplementedError("need range")


class MinMaxObserver(Observer):
    def __init__(self) -> None:
        self.lo = np.inf
        self.hi = -np.inf

    def observe(self, x: np.ndarray, pass_index: int) -> None:
        if x.size:
            self.lo = min(self.lo, float(np.min(x)))
            self.hi = max(self.hi, float(np.max(x)))

    def range(self) -> Range:
        if self.lo > self.hi:
            return Range(0.0, 0.0)
        return Range(self.lo, self.hi)


class HistogramObserver(Observer):
    """Pass 0: min/max. Pass 1: histogram on [0, hi] (non-negative data) or
    on [-a, a] with a = max|x| (so that it folds into a histogram of |x|)."""

    passes = 2

    def __init__(self, bins: int = 2048) -> None:
        self.bins = bins
        self.minmax = MinMaxObserver()
        self.hist: np.ndarray | None = None
        self.edges: np.ndarray | None = None

    @property
    def signed(self) -> bool:
        return self.minmax.lo < 0

    def observe(self, x: np.ndarray, pass_index: int) -> None:
        if pass_index == 0:
            self.minmax.observe(x, 0)
            return
        if self.edges is None:
            r = self.minmax.range()
            a = max(abs(r.lo), abs(r.hi))
            if a == 0:
                a = 1.0
            if self.signed:
                self.edges = np.linspace(-a, a, 2 * self.bins + 1)
            else:
                self.edges = np.linspace(0.0, a, self.bins + 1)
            self.hist = np.zeros(len(self.edges) - 1, np.float64)
        h, _ = np.histogram(x, bins=self.edges)
        self.hist += h

    def abs_histogram(self) -> tuple[np.ndarray, float]:
        """Histogram of |x| over [0, a] in ``bins`` bins, and a."""
        assert self.hist is not None and self.edges is not None
        if self.signed:
            neg, pos = self.hist[: self.bins], self.hist[self.bins:]
            return pos + neg[::-1], float(self.edges[-1])
        return self.hist.copy(), float(self.edges[-1])


class PercentileObserver(HistogramObserver):
    def __init__(self, percentile: float = 99.999, bins: int = 2048) -> None:
        if not 50.0 < percentile <= 100.0:
            raise QuantizationError(f"percentile must be in (50, 100], got {percentile}")
        super().__init__(bins)
        self.percentile = percentile

    def range(self) -> Range:
        r = self.minmax.range()
        if self.hist is None or self.hist.sum() == 0:
            return r
        cdf = np.cumsum(self.hist) / self.hist.sum()
        cut = (100.0 - self.percentile) / 200.0
        lo_i = int(np.searchsorted(cdf, cut))
        hi_i = int(np.searchsorted(cdf, 1.0 - cut))
        lo = float(self.edges[lo_i]) if self.signed else 0.0
        hi = float(self.edges[min(hi_i + 1, len(self.edges) - 1)])
        return Range(max(r.lo, lo), min(r.hi, hi))


def kl_threshold(hist: np.ndarray, target_bins: int, candidates: int = 256) -> int:
    """Number of leading bins of ``hist`` whose KL-optimal clipping is best.

    For each candidate cut ``i`` the reference distribution P is
    ``hist[:i]`` with the clipped tail added to its last bin; Q is
    ``hist[:i]`` merged into ``target_bins`` levels and spread back evenly
    over the non-empty bins of each level. The cut minimising KL(P || Q) wins.
    """
    n = len(hist)
    if n <= target_bins or hist.sum() == 0:
        return n
    cuts = np.unique(np.linspace(target_bins, n, min(candidates, n - target_bins + 1)).astype(int))
    best_i, best_kl = n, np.inf
    total_tail = np.cumsum(hist[::-1])[::-1]  # total_tail[i] = hist[i:].sum()
    for i in cuts:
        p = hist[:i].astype(np.float64).copy()
        if i < n:
            p[-1] += total_tail[i]
        src = hist[:i]
        level = (np.arange(i) * target_bins) // i
        nz = (src > 0).astype(np.float64)
        sums = np.bincount(level, weights=src, minlength=target_bins)
        counts = np.bincount(level, weights=nz, minlength=target_bins)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(nz > 0, (sums / np.maximum(counts, 1))[level], 0.0)
        ps, qs = p.sum(), q.sum()
        if ps == 0 or qs == 0:
            continue
        p /= ps
        q /= qs
        mask = p > 0
        q_m = np.where(q[mask] > 0, q[mask], 1e-12)  # P mass where Q has none: heavy penalty
        kl = float(np.sum(p[mask] * np.log(p[mask] / q_m)))
        if kl < best_kl:
            best_kl, best_i = kl, int(i)
    return best_i


class EntropyObserver(HistogramObserver):
    def range(self) -> Range:
        r = self.minmax.range()
        if self.hist is None or self.hist.sum() == 0:
            return r
        hist, a = self.abs_histogram()
        # The first bin holds every exact zero (Relu outputs, padding): a spike
        # that Q can only match with one-bin levels, which biases KL toward
        # clipping hard. Like NVIDIA's pytorch-quantization, flatten it.
        if len(hist) > 1:
            hist[0] = hist[1]
        # 8-bit levels available to the magnitude: all 256 for one-sided
        # data, about half of them on each side otherwise.
        target = 128 if self.signed else 256
        i = kl_threshold(hist, target)
        t = a * i / len(hist)
        return Range(max(r.lo, -t), min(r.hi, t))


def make_observer(method: str, percentile: float = 99.999) -> Observer:
    if method == "minmax":
        return MinMaxObserver()
    if method == "percentile":
        return PercentileObserver(percentile)
    if method == "entropy":
        return EntropyObserver()
    raise QuantizationError(f"unknown calibration method {method!r}; use one of {', '.join(METHODS)}")


def augment(model: onnx.ModelProto, tensors: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs every tensor in ``tensors``."""
    m = copy.deepcopy(model)
    g = m.graph
    have = {o.name for o in g.output} | {i.name for i in g.input}
    types = {vi.name: vi.type.tensor_type.elem_type for vi in g.value_info}
    for t in tensors:
        if t in have:
            continue
        g.output.append(helper.make_tensor_value_info(t, types.get(t, onnx.TensorProto.FLOAT), None))
        have.add(t)
    return m


Runner = Callable[[dict[str, np.ndarray], list[str]], dict[str, np.ndarray]]


def collect_ranges(
    model: onnx.ModelProto,
    tensors: list[str],
    data: CalibrationSet,
    runner_factory: Callable[[onnx.ModelProto], Runner],
    *,
    method: str = "minmax",
    percentile: float = 99.999,
    batch_size: int = 32,
) -> dict[str, Range]:
    """Run the model over ``data`` and return each tensor's calibrated range.

    ``runner_factory(model)`` opens a session: ``run(feeds, names) -> dict``.
    """
    if data.n == 0:
        raise QuantizationError("the calibration set is empty; give at least one sample")
    observers = {t: make_observer(method, percentile) for t in tensors}
    inputs_fed = set(data.arrays)
    to_fetch = [t for t in tensors if t not in inputs_fed]
    run = runner_factory(augment(model, to_fetch))
    passes = max((o.passes for o in observers.values()), default=1)
    for p in range(passes):
        for feeds in data.batches(batch_size):
            outs = run(feeds, to_fetch) if to_fetch else {}
            for t, obs in observers.items():
                if p >= obs.passes:
                    continue
                v = feeds[t] if t in feeds else outs[t]
                if p == 0 and not np.all(np.isfinite(v)):
                    raise QuantizationError(
                        f"tensor {t!r} is NaN/Inf on the calibration data although the inputs are finite: "
                        "the fp32 model itself overflows; fix the model (or its input scaling) first"
                    )
                obs.observe(np.asarray(v), p)
    return {t: o.range() for t, o in observers.items()}
