"""edgeflow.quantize end to end: engines, methods, layers kept in fp32, the
report, bad input, and the numpy-only path (no onnxruntime at all) whose
output must load in onnxruntime and agree with the numpy backend."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import edgeflow
from edgeflow import zoo
from edgeflow.errors import QuantizationError
from edgeflow.profiles import QuantizationScheme, get_profile
from edgeflow.quantization.calibration import EntropyObserver, MinMaxObserver, PercentileObserver
from edgeflow.runtime.session import load

RNG = np.random.default_rng(0)
X_CNN = RNG.random((64, 1, 8, 8), dtype=np.float32)
X_MLP = RNG.random((64, 64), dtype=np.float32)


def _has_ort() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


needs_ort = pytest.mark.skipif(not _has_ort(), reason="onnxruntime is not installed")


def _float_output_step(model: onnx.ModelProto) -> np.ndarray:
    """One accumulator step of the last layer (x_scale * w_scale per channel):
    the resolution of a float output computed from int8 operands."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    prod = {o: n for n in model.graph.node for o in n.output}
    last = [n for n in model.graph.node if n.op_type in ("Gemm", "Conv", "MatMul")][-1]
    xs = inits[prod[last.input[0]].input[1]]
    ws = inits[prod[last.input[1]].input[1]]
    return xs * ws


@needs_ort
@pytest.mark.parametrize("profile", ["x86-gateway", "raspberry-pi-4"])
def test_numpy_engine_model_loads_in_onnxruntime_and_matches_the_numpy_backend(profile):
    model = zoo.digits_cnn(seed=1)
    q = edgeflow.quantize(model, profile, calibration=X_CNN, engine="numpy", latency_runs=0, max_loss=None).model
    x = RNG.random((40, 1, 8, 8), dtype=np.float32)
    y_np = load(q, profile, backend="numpy")(x)
    # exact_int8: onnxruntime's u8 x s8 kernels saturate int16 pair sums on x86 without VNNI
    y_ort = load(q, profile, backend="ort", exact_int8=True)(x)
    assert np.all(np.abs(y_np - y_ort) <= _float_output_step(q) * 1.001)


_NO_ORT_SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["onnxruntime"] = None  # any import of onnxruntime now fails
    import numpy as np, onnx
    import edgeflow
    from edgeflow import zoo
    from edgeflow.runtime.backends import available_backends
    assert available_backends() == ["numpy"], available_backends()
    x = np.random.default_rng(0).random((48, 1, 8, 8), dtype=np.float32)
    r = edgeflow.quantize(zoo.digits_cnn(seed=2), "x86-gateway", calibration=x, latency_runs=3, max_loss=None,
                          time_on_host=True)
    assert r.report.engine == "numpy" and r.report.latency.backend == "numpy", r.report
    r.save(sys.argv[1])
    np.save(sys.argv[2], x)
""")


@needs_ort
def test_quantizes_without_onnxruntime_and_the_result_runs_in_onnxruntime(tmp_path):
    out, xs = tmp_path / "q.onnx", tmp_path / "x.npy"
    proc = subprocess.run([sys.executable, "-c", _NO_ORT_SCRIPT, str(out), str(xs)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    q = onnx.load(str(out))
    assert {n.op_type for n in q.graph.node} >= {"QuantizeLinear", "DequantizeLinear"}
    x = np.load(xs)
    y_np = load(q, "x86-gateway", backend="numpy")(x)
    y_ort = load(q, "x86-gateway", backend="ort")(x)
    assert np.all(np.abs(y_np - y_ort) <= _float_output_step(q) * 1.001)
    y32 = load(zoo.digits_cnn(seed=2), "x86-gateway", backend="numpy")(x)
    assert np.mean(np.argmax(y32, 1) == np.argmax(y_np, 1)) > 0.9


def _weight_is_float(model: onnx.ModelProto, node_name: str) -> bool:
    node = next(n for n in model.graph.node if n.name == node_name)
    return node.input[1] in {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}


@pytest.mark.parametrize("engine", ["numpy", pytest.param("ort", marks=needs_ort)])
def test_layers_kept_in_fp32(engine):
    r = edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=X_CNN, engine=engine,
                          keep_first=True, keep_last=True, keep_fp32=["fc0"], latency_runs=0, max_loss=None)
    assert set(r.report.kept_fp32) == {"conv0", "fc1", "fc0"} and r.report.quantized_nodes == ["conv1"]
    for name in ("conv0", "fc0", "fc1"):
        assert _weight_is_float(r.model, name), name
    assert not _weight_is_float(r.model, "conv1")


def test_image_input_conv_stays_fp32_and_its_relu_moves_after_the_pool():
    model = zoo.digits_cnn(seed=6)
    r = edgeflow.quantize(model, "x86-gateway", calibration=X_CNN, engine="numpy", latency_runs=0, max_loss=None)
    assert "1 input channel" in r.report.kept_fp32["conv0"] and _weight_is_float(r.model, "conv0")
    ops = [n.op_type for n in r.model.graph.node]
    assert ops[:4] == ["Conv", "MaxPool", "Relu", "QuantizeLinear"]  # pool first, then relu, then Q
    x = RNG.random((16, 1, 8, 8), dtype=np.float32)
    y32 = load(model, "x86-gateway", backend="numpy")(x)
    np.testing.assert_allclose(load(r.model, "x86-gateway", backend="numpy")(x), y32, atol=0.1)
    every = edgeflow.quantize(model, "x86-gateway", calibration=X_CNN, engine="numpy", latency_runs=0,
                              min_int8_channels=0, max_loss=None)
    assert every.report.quantized_nodes == ["conv0", "conv1", "fc0", "fc1"] and not every.report.kept_fp32


def test_pool_before_relu_is_exact():
    from edgeflow.quantization.analysis import name_nodes, pool_before_relu

    model = zoo.small_cnn((1, 9, 9), channels=(3, 5), hidden=7, seed=8)  # odd sizes: pooling drops a row
    swapped = pool_before_relu(name_nodes(onnx.load_from_string(model.SerializeToString())), ["conv0", "conv1"])
    onnx.checker.check_model(swapped)
    x = RNG.standard_normal((4, 1, 9, 9)).astype(np.float32)
    a = load(model, "x86-gateway", backend="numpy")(x)
    b = load(swapped, "x86-gateway", backend="numpy")(x)
    np.testing.assert_array_equal(a, b)


def test_unknown_layer_name_is_a_clear_error():
    with pytest.raises(QuantizationError, match=r"'conv9'.*conv0"):
        edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=X_CNN, keep_fp32=["conv9"], max_loss=None)


@pytest.mark.parametrize("bad, match", [
    (RNG.random((10, 1, 9, 9), dtype=np.float32), r"dimension 2 must be 8"),
    (RNG.random((10, 8, 8), dtype=np.float32), r"rank 3.*expects rank 4"),
    (RNG.integers(0, 16, (10, 1, 8, 8)), r"dtype int64.*float32"),
    (np.zeros((0, 1, 8, 8), np.float32), r"empty"),
    (np.where(RNG.random((10, 1, 8, 8)) < 0.01, np.nan, 0.5).astype(np.float32), r"NaN/Inf"),
    ({"images": X_CNN}, r"no array for input\(s\) \['input'\]"),
    (np.array(["a", "b"]), r"dtype <U1"),
])
def test_bad_calibration_data_is_a_clear_error(bad, match):
    with pytest.raises(QuantizationError, match=match):
        edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=bad, engine="numpy", max_loss=None)


def test_inf_in_calibration_names_the_sample():
    x = X_CNN.copy()
    x[5, 0, 1, 1] = np.inf
    with pytest.raises(QuantizationError, match=r"1 NaN/Inf value\(s\) in 1 sample\(s\) \(first: sample 5\)"):
        edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=x, max_loss=None)


def _no_quantizable_op_model() -> onnx.ModelProto:
    g = helper.make_graph(
        [helper.make_node("Relu", ["input"], ["h"]), helper.make_node("Softmax", ["h"], ["y"], axis=1)], "nq",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_model_without_quantizable_op_is_a_clear_error():
    with pytest.raises(QuantizationError, match=r"no quantizable op.*Conv, Gemm, MatMul.*Relu, Softmax"):
        edgeflow.quantize(_no_quantizable_op_model(), "x86-gateway", calibration=X_MLP[:, :10], max_loss=None)
    conv_only = _conv_only_model()
    with pytest.raises(QuantizationError, match="no quantizable op.*Gemm, MatMul.*Conv"):  # dynamic: Gemm/MatMul
        edgeflow.quantize(conv_only, "x86-gateway", method="dynamic")


def _conv_only_model() -> onnx.ModelProto:
    w = numpy_helper.from_array(RNG.standard_normal((4, 1, 3, 3)).astype(np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("Conv", ["input", "w"], ["y"], pads=[1, 1, 1, 1])], "c",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], [w],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_other_usage_errors():
    with pytest.raises(QuantizationError, match="needs calibration data"):
        edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", max_loss=None)
    with pytest.raises(QuantizationError, match="unknown quantization method 'int4'"):
        edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=X_CNN, method="int4", max_loss=None)
    with pytest.raises(QuantizationError, match="labels has 3 entries"):
        edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=X_CNN, eval_data=X_CNN, labels=[1, 2, 3], max_loss=None)
    plain = dataclasses.replace(get_profile("x86-gateway"), quantization=QuantizationScheme(scheme="none"))
    with pytest.raises(QuantizationError, match="unquantized"):
        edgeflow.quantize(zoo.digits_cnn(), plain, calibration=X_CNN, max_loss=None)


def test_holdout_split_and_report_contents():
    y = RNG.integers(0, 10, 64)
    # time_on_host: a latency even on a host that lacks a CPU feature the x86-gateway board has (VNNI)
    r = edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=X_CNN, labels=y, engine="numpy",
                          latency_runs=3, max_loss=None, time_on_host=True)
    rep = r.report
    assert (rep.n_calibration, rep.n_eval) == (51, 13) and "held out" in rep.eval_source
    assert 0.2 < rep.size_ratio < 0.6
    assert rep.error is not None and 0.99 < rep.error.cosine <= 1.0 + 1e-9 and rep.error.top1_agreement is not None
    assert rep.accuracy_fp32 is not None and len(rep.sensitivity) == 3  # conv0 (1 channel) stays fp32
    assert rep.latency is not None and rep.latency.fp32.p50_ms > 0 and rep.latency.batch_size == 32
    text = rep.format()
    assert "accuracy" in text and "sensitivity" in text and "ratio" in text
    json.dumps(rep.to_dict())
    few = edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=X_CNN[:5], engine="numpy", latency_runs=0, max_loss=None)
    assert few.report.n_eval == 5 and "too few" in few.report.eval_source


@pytest.mark.parametrize("engine", ["numpy", pytest.param("ort", marks=needs_ort)])
def test_dynamic_int8_for_gemm_models(engine):
    model = zoo.digits_mlp(seed=4)
    r = edgeflow.quantize(model, "x86-gateway", calibration=X_MLP, method="dynamic", engine=engine, latency_runs=0)
    ops = {n.op_type for n in r.model.graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops and "Gemm" not in ops
    assert r.report.method == "dynamic" and r.report.n_calibration == 0
    y32 = load(model, "x86-gateway", backend="numpy")(X_MLP)
    yq = load(r.model, "x86-gateway", backend="numpy")(X_MLP)
    cos = np.sum(y32 * yq, 1) / np.linalg.norm(y32, axis=1) / np.linalg.norm(yq, axis=1)
    assert cos.min() > 0.999


def test_fp16_for_gpu_profiles():
    model = zoo.digits_cnn(seed=5)
    r = edgeflow.quantize(model, "jetson-orin-nano", calibration=X_CNN, backend="numpy", latency_runs=0, max_loss=None)
    assert r.report.method == "fp16"
    assert all(t.data_type == TensorProto.FLOAT16 for t in r.model.graph.initializer)
    assert r.model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert 0.45 < r.report.size_ratio < 0.6
    y = load(r.model, "jetson-orin-nano", backend="numpy")(X_CNN)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, load(model, "jetson-orin-nano", backend="numpy")(X_CNN), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_each_calibration_method_quantizes(method):
    r = edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=X_CNN, method=method, engine="numpy",
                          latency_runs=0, max_loss=None)
    assert r.report.calibration == method and r.report.error.cosine > 0.99


def test_old_opset_and_fixed_batch_models():
    m = zoo.mlp((64, 16, 10), opset=11)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1  # batch fixed to 1
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 1
    r = edgeflow.quantize(m, "x86-gateway", calibration=X_MLP[:12], engine="numpy", latency_runs=0, max_loss=None)
    assert next(i.version for i in r.model.opset_import if i.domain in ("", "ai.onnx")) >= 13
    assert (r.report.n_calibration, r.report.n_eval) == (10, 2)  # calibrated one sample at a time
    y = load(r.model, "x86-gateway", backend="numpy")(X_MLP[:1])
    assert y.shape == (1, 10)


def test_saves_to_output(tmp_path):
    out = tmp_path / "m.int8.onnx"
    edgeflow.quantize(zoo.digits_cnn(), "x86-gateway", calibration=X_CNN, engine="numpy", output=out, latency_runs=0, max_loss=None)
    onnx.checker.check_model(onnx.load(str(out)))


# --- observers ------------------------------------------------------------

def _observe(obs, x):
    for p in range(obs.passes):
        for chunk in np.array_split(x, 4):
            obs.observe(chunk, p)
    return obs.range()


def test_observers_on_an_outlier():
    x = np.concatenate([np.random.default_rng(1).standard_normal(200_000), [80.0]]).astype(np.float32)
    mm = _observe(MinMaxObserver(), x)
    assert mm.hi == 80.0
    pc = _observe(PercentileObserver(99.99), x)
    assert 3.0 < pc.hi < 6.0 and -6.0 < pc.lo < -3.0
    en = _observe(EntropyObserver(), x)
    assert 2.0 < en.hi < 20.0 and en.lo < 0  # clips the outlier, keeps the bulk


def test_entropy_keeps_the_range_of_uniform_data():
    x = np.random.default_rng(2).random(100_000).astype(np.float32)  # one-sided, no tail
    r = _observe(EntropyObserver(), x)
    assert r.lo == pytest.approx(x.min()) and r.hi > 0.95


@needs_ort
def test_exact_int8_reaches_onnxruntime():
    """exact_int8 turns on onnxruntime's exact u8 x u8 path; by default the session keeps its fast kernels."""
    from edgeflow.runtime.backends import get_backend
    from edgeflow.runtime.backends.base import SessionOptions

    model = zoo.digits_mlp(seed=0)
    for exact in (False, True):
        sess = get_backend("ort").load(model, SessionOptions(exact_int8=exact))
        entries = sess._sess.get_session_options().get_session_config_entry  # noqa: SLF001
        try:
            got = entries("session.x64quantprecision")
        except Exception:  # noqa: BLE001 - onnxruntime raises when the key was never set
            got = ""
        assert (got == "1") == exact
    assert load(model, "x86-gateway", backend="ort", exact_int8=True).exact_int8
