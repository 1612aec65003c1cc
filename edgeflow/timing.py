"""Latency measurement shared by ``edgeflow bench``, quantization reports,
device telemetry and the benchmarks: percentiles over repeated runs, and the
process's peak resident memory."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class LatencyStats:
    runs: int
    batch_size: int
    p50_ms: float
    p95_ms: float
    mean_ms: float
    min_ms: float

    @property
    def throughput(self) -> float:
        """Samples per second at the median latency."""
        return self.batch_size / (self.p50_ms / 1000.0) if self.p50_ms > 0 else float("inf")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["throughput_per_s"] = self.throughput
        return d


def percentiles(samples_ms: list[float] | np.ndarray, batch_size: int = 1) -> LatencyStats:
    a = np.asarray(samples_ms, dtype=np.float64)
    return LatencyStats(
        runs=int(a.size),
        batch_size=batch_size,
        p50_ms=float(np.percentile(a, 50)),
        p95_ms=float(np.percentile(a, 95)),
        mean_ms=float(a.mean()),
        min_ms=float(a.min()),
    )


def measure(
    fn: Callable[[], object],
    *,
    runs: int = 50,
    warmup: int = 5,
    batch_size: int = 1,
    on_step: Callable[[], None] | None = None,
) -> LatencyStats:
    """Time ``fn`` ``runs`` times after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000.0)
        if on_step:
            on_step()
    return percentiles(samples, batch_size)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)
