"""HardSwish / HardSigmoid between DequantizeLinear and QuantizeLinear rewritten as int8
Add (+ Mul) (edgeflow.quantization.hardswish): the float meaning of the graph is kept, and
onnxruntime then runs them as QLinearAdd/QLinearMul instead of in float."""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest
from onnx import helper

from _graphs import make, rand, run_numpy
from edgeflow.quantization.hardswish import hardswish_as_qlinear


def _qdq(op: str, dtype=np.uint8, attrs=None, per_channel=False):
    """x -> Q -> DQ -> op -> Q -> DQ -> y, the way a QDQ quantizer leaves an unsupported activation."""
    lo = 0 if dtype == np.uint8 else -128
    inits = {"xs": np.float32(12 / 255), "xz": np.array(lo + 85, dtype),  # x in [-4, 8]
             "ys": np.float32(8.5 / 255), "yz": np.array(lo + 15, dtype)}
    if per_channel:
        inits["xs"] = np.full(4, 12 / 255, np.float32)
        inits["xz"] = np.full(4, lo + 85, dtype)
    dq_kw = {"axis": 1} if per_channel else {}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], **dq_kw),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], **dq_kw),
        helper.make_node(op, ["xd"], ["a"], name="act", **(attrs or {})),
        helper.make_node("QuantizeLinear", ["a", "ys", "yz"], ["aq"]),
        helper.make_node("DequantizeLinear", ["aq", "ys", "yz"], ["y"]),
    ]
    return make(nodes, [("x", [1, 4, 8, 8])], [("y", [1, 4, 8, 8])], inits, opset=14)


def _reference(model, x):
    """The graph's float meaning: every op as written, no fusion."""
    return run_numpy(model, {"x": x}, optimize=False)[0]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("op,attrs", [("HardSwish", None), ("HardSigmoid", None),
                                      ("HardSigmoid", {"alpha": 1 / 6, "beta": 0.5})])
def test_the_rewrite_keeps_the_float_meaning_within_one_output_step(op, attrs, dtype):
    m = _qdq(op, dtype, attrs)
    out, n = hardswish_as_qlinear(copy.deepcopy(m))
    assert n == 1
    ops = [nd.op_type for nd in out.graph.node]
    assert op not in ops and "Add" in ops and ("Mul" in ops) == (op == "HardSwish")
    x = np.linspace(-6, 10, 256, dtype=np.float32).reshape(1, 4, 8, 8)
    before, after = _reference(m, x), _reference(out, x)
    step = 8.5 / 255
    assert np.max(np.abs(after - before)) <= 1.01 * step, np.max(np.abs(after - before)) / step
    if op == "HardSigmoid":  # its integers are read directly by the DQ after it: no Q of its own is left
        assert ops.count("QuantizeLinear") == 2
    if importlib.util.find_spec("onnxruntime"):
        from _graphs import run_ort

        np.testing.assert_allclose(run_ort(out, {"x": x})[0], after, atol=1e-6)


def test_what_it_cannot_run_in_int8_is_left_alone():
    # per-channel input parameters; an activation fed by a float op; a graph output
    m = _qdq("HardSwish", per_channel=True)
    assert hardswish_as_qlinear(m)[1] == 0
    f = make([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("HardSwish", ["r"], ["y"])],
             [("x", [1, 4])], [("y", [1, 4])], opset=14)
    assert hardswish_as_qlinear(f)[1] == 0
    g = _qdq("HardSwish")
    g.graph.output.append(helper.make_value_info("a", g.graph.output[0].type))
    assert hardswish_as_qlinear(g)[1] == 0
    neg = _qdq("HardSigmoid", attrs={"alpha": 0.2, "beta": -0.1})  # beta <= 0: no shift to quantize
    assert hardswish_as_qlinear(neg)[1] == 0


def _mobilenet_block(rng):
    """Conv -> HardSwish -> depthwise Conv -> HardSwish -> SE (pool, conv, HardSigmoid, Mul) -> Conv."""
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c0"], ["h0"]),
        helper.make_node("Conv", ["h0", "wd", "bd"], ["c1"], pads=[1, 1, 1, 1], group=16),
        helper.make_node("HardSwish", ["c1"], ["h1"]),
        helper.make_node("GlobalAveragePool", ["h1"], ["p"]),
        helper.make_node("Conv", ["p", "ws", "bs"], ["s"]),
        helper.make_node("HardSigmoid", ["s"], ["g"], alpha=0.2, beta=0.5),
        helper.make_node("Mul", ["h1", "g"], ["e"]),
        helper.make_node("Conv", ["e", "w2", "b2"], ["y"]),
    ]
    inits = {"w0": rand(rng, 16, 8, 3, 3, scale=0.4), "b0": rand(rng, 16, scale=0.5),
             "wd": rand(rng, 16, 1, 3, 3, scale=0.5), "bd": rand(rng, 16, scale=0.5),
             "ws": rand(rng, 16, 16, 1, 1, scale=0.5), "bs": rand(rng, 16, scale=0.5),
             "w2": rand(rng, 8, 16, 1, 1, scale=0.3), "b2": rand(rng, 8, scale=0.1)}
    return make(nodes, [("x", [1, 8, 12, 12])], [("y", [1, 8, 12, 12])], inits, opset=14)


@pytest.mark.parametrize("profile", ["x86-gateway", "raspberry-pi-4"])
def test_quantize_runs_them_in_int8_on_onnxruntime(profile, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    import edgeflow

    rng = np.random.default_rng(3)
    m = _mobilenet_block(rng)
    x = rng.standard_normal((64, 8, 12, 12)).astype(np.float32)
    r = edgeflow.quantize(m, profile, calibration=x[:48], eval_data=x[48:], engine="ort", backend="ort",
                          latency_runs=0, sensitivity=False, min_int8_channels=0, max_loss=None)
    assert any(n.startswith("3 HardSwish/HardSigmoid run in int8") for n in r.report.notes), r.report.notes
    assert r.report.error.cosine > 0.995, r.report.error
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # no x86-only layouts
    if profile == "raspberry-pi-4":
        # int8 activations: onnxruntime fuses their QDQ nodes where session.qdqisint8allowed is on, its
        # default on Arm builds (on x86 it is off, and Add/Mul/depthwise Conv stay float between Q/DQ)
        so.add_session_config_entry("session.qdqisint8allowed", "1")
    ort.InferenceSession(r.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    import onnx

    ran = [nd.op_type for nd in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    assert "HardSwish" not in ran and "HardSigmoid" not in ran, ran
    assert ran.count("QLinearConv") == 4 and ran.count("QLinearAdd") == 3 and ran.count("QLinearMul") == 3, ran
    assert "Add" not in ran and "Mul" not in ran and "Conv" not in ran, ran
    # the numpy backend runs the same file to the same result, up to one int8 step of the output
    out_np = edgeflow.load(r.model, profile, backend="numpy").run({"x": x[48:49]})
    out_ort = edgeflow.load(r.model, profile, backend="ort", exact_int8=True).run({"x": x[48:49]})
    diff = np.abs(next(iter(out_np.values())) - next(iter(out_ort.values())))
    ref = np.abs(next(iter(out_ort.values()))).max()
    assert diff.max() <= 0.02 * ref, (diff.max(), ref)


def test_the_numpy_backend_gets_no_rewrite():
    import edgeflow

    rng = np.random.default_rng(4)
    m = _mobilenet_block(rng)
    x = rng.standard_normal((24, 8, 12, 12)).astype(np.float32)
    r = edgeflow.quantize(m, "x86-gateway", calibration=x, engine="numpy", backend="numpy", latency_runs=0,
                          sensitivity=False, min_int8_channels=0, max_loss=None)
    ops = [nd.op_type for nd in r.model.graph.node]
    assert ops.count("HardSwish") == 2 and not any("run in int8" in n for n in r.report.notes)


def test_on_a_host_without_vnni_fidelity_is_the_vnni_boards(monkeypatch):
    """The report's and the gate's outputs come from onnxruntime's exact int8 path where this host's
    fast kernels saturate and the profile's board's do not."""
    pytest.importorskip("onnxruntime")
    import edgeflow
    from edgeflow import profiles
    from edgeflow.quantization import api

    seen = []
    real = profiles.host_facts()
    monkeypatch.setattr(api, "host_facts", lambda: profiles.HostFacts(  # where quantize reads it
        "x86_64", real.cores, real.memory_mb, ("avx2", "fma", "sse4_1"), ""))
    from edgeflow.runtime.backends import ort as ort_backend

    load = ort_backend.OrtBackend.load

    def spy(self, model, options):
        seen.append(options.exact_int8)
        return load(self, model, options)

    monkeypatch.setattr(ort_backend.OrtBackend, "load", spy)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 8, 12, 12)).astype(np.float32)
    r = edgeflow.quantize(_mobilenet_block(rng), "x86-gateway", calibration=x[:32], eval_data=x[32:], engine="ort",
                          backend="ort", latency_runs=0, sensitivity=False, min_int8_channels=0, max_loss=None)
    assert any("exact int8 path" in n for n in r.report.notes), r.report.notes
    assert seen and all(seen)
