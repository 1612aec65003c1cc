"""What quantization cost and bought: size, output error or accuracy on
held-out data, latency on the profile's backend, per-layer sensitivity.

The report is data (dataclasses, ``to_dict()`` for ``--json``) plus one
plain-text rendering; nothing in it is estimated — every number is measured
on the models and data at hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import onnx

from ..timing import LatencyStats


@dataclass(frozen=True)
class OutputError:
    """Quantized vs fp32 outputs on the evaluation samples (first output)."""

    max_abs: float
    mean_abs: float
    cosine: float  # mean over samples of the cosine similarity of the outputs
    top1_agreement: float | None  # % of samples with the same argmax (classifier outputs)


def output_error(ref: np.ndarray, got: np.ndarray) -> OutputError:
    ref = np.asarray(ref, np.float64)
    got = np.asarray(got, np.float64)
    if ref.shape != got.shape:
        raise ValueError(f"output shapes differ: {ref.shape} vs {got.shape}")
    diff = np.abs(ref - got)
    r = ref.reshape(len(ref), -1) if ref.ndim else ref.reshape(1, -1)
    q = got.reshape(len(got), -1) if got.ndim else got.reshape(1, -1)
    num = np.sum(r * q, axis=1)
    den = np.linalg.norm(r, axis=1) * np.linalg.norm(q, axis=1)
    cos = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(np.all(r == q, axis=1), 1.0, 0.0))
    top1 = None
    if ref.ndim == 2 and ref.shape[1] > 1:
        top1 = float(np.mean(np.argmax(ref, axis=1) == np.argmax(got, axis=1)) * 100.0)
    return OutputError(
        max_abs=float(diff.max()) if diff.size else 0.0,
        mean_abs=float(diff.mean()) if diff.size else 0.0,
        cosine=float(np.mean(cos)),
        top1_agreement=top1,
    )


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy in percent."""
    return float(np.mean(np.argmax(logits, axis=1) == np.asarray(labels).reshape(-1)) * 100.0)


def model_bytes(model: onnx.ModelProto) -> int:
    """Serialized size: what is shipped to the board."""
    return model.ByteSize()


@dataclass(frozen=True)
class LatencyComparison:
    backend: str
    batch_size: int
    threads: int
    fp32: LatencyStats
    quantized: LatencyStats

    @property
    def speedup(self) -> float:
        return self.fp32.p50_ms / self.quantized.p50_ms if self.quantized.p50_ms > 0 else float("inf")

    def to_dict(self) -> dict:
        return {
            "backend": self.backend, "batch_size": self.batch_size, "threads": self.threads,
            "fp32": self.fp32.to_dict(), "quantized": self.quantized.to_dict(), "speedup": self.speedup,
        }


@dataclass(frozen=True)
class LayerSensitivity:
    """The cost of quantizing one layer alone (all others fp32)."""

    node: str
    op_type: str
    accuracy_drop: float | None  # points of top-1 accuracy lost (labels given)
    cosine: float
    max_abs: float


@dataclass
class QuantizationReport:
    profile: str
    method: str  # "static" | "dynamic" | "fp16"
    engine: str  # "ort" | "numpy"
    calibration: str | None  # minmax / percentile / entropy (static only)
    activations: str | None
    weights: str | None
    n_calibration: int
    n_eval: int
    eval_source: str
    fp32_bytes: int
    quantized_bytes: int
    quantized_nodes: list[str] = field(default_factory=list)
    kept_fp32: dict[str, str] = field(default_factory=dict)
    error: OutputError | None = None
    accuracy_fp32: float | None = None
    accuracy_quantized: float | None = None
    latency: LatencyComparison | None = None
    sensitivity: list[LayerSensitivity] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gate: object | None = None  # gate.GateDecision when the bench-gated choice ran

    @property
    def size_ratio(self) -> float:
        return self.quantized_bytes / self.fp32_bytes if self.fp32_bytes else float("nan")

    @property
    def accuracy_drop(self) -> float | None:
        """fp32 minus quantized top-1 accuracy, in points (negative = gained)."""
        if self.accuracy_fp32 is None or self.accuracy_quantized is None:
            return None
        return self.accuracy_fp32 - self.accuracy_quantized

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("latency", "error", "sensitivity", "gate")}
        d["gate"] = self.gate.to_dict() if self.gate is not None else None
        d["size_ratio"] = self.size_ratio
        d["accuracy_drop"] = self.accuracy_drop
        d["error"] = asdict(self.error) if self.error else None
        d["latency"] = self.latency.to_dict() if self.latency else None
        d["sensitivity"] = [asdict(s) for s in self.sensitivity]
        return d

    def format(self) -> str:
        """A plain-text summary for the terminal and the docs."""
        lines = [
            f"quantization report: {self.method}"
            + (f" ({self.calibration} calibration)" if self.calibration else "")
            + f", engine {self.engine}, profile {self.profile}",
        ]
        if self.activations:
            lines.append(f"  activations {self.activations}, weights {self.weights}")
        lines.append(
            f"  size       fp32 {self.fp32_bytes / 1024:,.1f} KiB -> {self.quantized_bytes / 1024:,.1f} KiB "
            f"(ratio {self.size_ratio:.3f})"
        )
        if self.method == "fp16":
            lines.append("  layers     every float32 weight and activation in float16 (inputs/outputs stay float32)")
        else:
            lines.append(f"  layers     {len(self.quantized_nodes)} quantized, {len(self.kept_fp32)} kept fp32"
                         + (":" if self.kept_fp32 else ""))
            by_why: dict[str, list[str]] = {}
            for k, v in self.kept_fp32.items():
                by_why.setdefault(v, []).append(k)
            for why, nodes in by_why.items():
                shown = ", ".join(nodes[:4]) + (f", ... ({len(nodes)} in all)" if len(nodes) > 4 else "")
                lines.append(f"    {shown}: {why}")
        lines.append(f"  eval data  {self.n_eval} samples ({self.eval_source}); calibration {self.n_calibration} samples")
        if self.accuracy_fp32 is not None:
            lines.append(
                f"  accuracy   fp32 {self.accuracy_fp32:.2f}%  quantized {self.accuracy_quantized:.2f}%  "
                f"drop {self.accuracy_drop:+.2f} points"
            )
        if self.error is not None:
            e = self.error
            lines.append(
                f"  output     max |diff| {e.max_abs:.4g}  mean {e.mean_abs:.4g}  cosine {e.cosine:.5f}"
                + (f"  top-1 agreement {e.top1_agreement:.2f}%" if e.top1_agreement is not None else "")
            )
        if self.latency is not None:
            lat = self.latency
            lines.append(
                f"  latency    {lat.backend} batch {lat.batch_size}, {lat.threads} thread(s): fp32 p50 "
                f"{lat.fp32.p50_ms:.3f} ms, quantized p50 {lat.quantized.p50_ms:.3f} ms ({lat.speedup:.2f}x)"
            )
        if self.gate is not None:
            lines += self.gate.format()
        if self.sensitivity:
            lines.append("  per-layer sensitivity (each layer quantized alone, worst first):")
            for s in self.sensitivity:
                acc = f"accuracy drop {s.accuracy_drop:+.2f} pts, " if s.accuracy_drop is not None else ""
                lines.append(f"    {s.node:24s} {s.op_type:7s} {acc}cosine {s.cosine:.5f}, max |diff| {s.max_abs:.4g}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)
