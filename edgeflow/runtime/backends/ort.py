"""The onnxruntime backend: an InferenceSession configured from the profile.

Execution providers come from the profile's preference list, filtered by
what the installed onnxruntime build offers (``get_available_providers``),
with CPU always last as the fallback. onnxruntime is imported lazily so
that edgeflow imports on boards without a wheel.
"""

from __future__ import annotations

import onnx

from ...errors import BackendError
from ..graph import find_unsupported
from ..limits import WATCHDOG, current_budget
from ..model import graph_inputs, graph_outputs
from .base import Backend, Session, SessionOptions

_OPT_LEVELS = {
    "disabled": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def _ort():
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendError(
            "onnxruntime is not installed on this host; use the 'numpy' backend "
            "(boards such as armv7 and riscv64 have no onnxruntime wheel)"
        ) from exc
    return onnxruntime


def choose_providers(preferred: tuple[str, ...] | list[str], available: list[str]) -> list[str]:
    """Keep the preferred providers this build has, in order, CPU last."""
    chosen = [p for p in preferred if p in available and p != "CPUExecutionProvider"]
    chosen.append("CPUExecutionProvider")
    return chosen


def weight_only_quantized(model: onnx.ModelProto) -> bool:
    """DequantizeLinear nodes and no QuantizeLinear or QLinear*/Integer op in the main graph."""
    ops = {n.op_type for n in model.graph.node}
    return "DequantizeLinear" in ops and "QuantizeLinear" not in ops and not any(
        o.startswith("QLinear") or o.endswith("Integer") or o == "DynamicQuantizeLinear" for o in ops)


class OrtSession(Session):
    backend_name = "ort"

    def __init__(self, model: onnx.ModelProto, options: SessionOptions) -> None:
        super().__init__(graph_inputs(model), graph_outputs(model))
        ort = _ort()
        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, int(options.threads))
        so.inter_op_num_threads = 1
        so.enable_cpu_mem_arena = bool(options.memory_arena)
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPT_LEVELS[options.optimization])
        so.log_severity_level = 3
        if options.exact_int8:
            # x86 without VNNI (AVX2, AVX-512F): MLAS's u8 x s8 kernels add pairs of products in int16
            # (vpmaddubsw), which saturates for weights outside [-64, 63] (up to 20 output steps off on a
            # small CNN here); this switches such layers to the exact u8 x u8 path, at a cost in speed
            # (docs/quantization.md). On this AVX512-VNNI EPYC it buys no accuracy (the default path already
            # matched the exact integer results) and roughly halves int8 speed (YOLOv8n 2.26x -> 1.19x
            # over fp32): opt-in only.
            so.add_session_config_entry("session.x64quantprecision", "1")
        if weight_only_quantized(model):
            # int8 weights behind DequantizeLinear, float activations: without this onnxruntime keeps
            # the DequantizeLinear nodes for QDQ fusion and dequantizes every weight on every run
            # (measured 12.3 vs 5.0 ms CPU on PP-LCNet, 1 thread); with it they fold once at load.
            so.add_session_config_entry("session.disable_quant_qdq", "1")
        self.providers = choose_providers(options.providers, ort.get_available_providers())
        try:
            self._sess = ort.InferenceSession(model.SerializeToString(), sess_options=so, providers=self.providers)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise BackendError(f"onnxruntime could not load the model: {exc}") from exc

    def _run(self, feeds, output_names):
        budget = current_budget()
        if budget is None:
            try:
                values = self._sess.run(output_names, feeds)
            except Exception as exc:
                raise BackendError(f"onnxruntime failed to run the model: {exc}") from exc
            return dict(zip(output_names, values))
        # the wall-time limit: onnxruntime checks RunOptions.terminate between nodes and Loop iterations
        ro = _ort().RunOptions()
        ro.log_severity_level = 4  # a stopped run is reported once, below, not also in onnxruntime's log

        def stop() -> None:
            budget.expired = True
            ro.terminate = True

        token = WATCHDOG.arm(budget.deadline, stop)
        try:
            values = self._sess.run(output_names, feeds, ro)
        except Exception as exc:
            if budget.expired:
                raise budget.time_error("onnxruntime") from None
            raise BackendError(f"onnxruntime failed to run the model: {exc}") from exc
        finally:
            WATCHDOG.disarm(token)
        return dict(zip(output_names, values))


class OrtBackend(Backend):
    name = "ort"

    @classmethod
    def available(cls) -> bool:
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return False
        return True

    def unsupported_ops(self, model: onnx.ModelProto) -> list[str]:
        # onnxruntime implements the whole default domain and com.microsoft;
        # anything else (in the graph or any subgraph) needs a custom-op library.
        return find_unsupported(model, lambda domain, op, opset: domain in ("", "com.microsoft", "ai.onnx.ml"))

    def load(self, model: onnx.ModelProto, options: SessionOptions | None = None) -> OrtSession:
        return OrtSession(model, options or SessionOptions())


__all__ = ["OrtBackend", "OrtSession", "choose_providers"]
