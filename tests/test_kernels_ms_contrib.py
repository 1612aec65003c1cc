"""com.microsoft float fusions (Gelu, BiasGelu, FastGelu, SkipLayerNormalization, FusedConv) and
QLinear* ops (QLinearAdd, QLinearMul, QLinearSigmoid, QLinearLeakyRelu, QLinearGlobalAveragePool,
QLinearConcat) on the numpy backend, against onnxruntime on small random onnx.helper graphs; hostile
shapes and attributes are refused in one line naming the op."""

from __future__ import annotations

import numpy as np

import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeflow.errors import BackendError
from edgeflow.runtime.backends import SessionOptions, get_backend

ort = pytest.importorskip("onnxruntime")
MS = "com.microsoft"
U8, I8 = TensorProto.UINT8, TensorProto.INT8


def _model(node, inputs, n_out=1, inits=None, out_type=TensorProto.FLOAT):
    """inputs: (name, array) fed at run time; inits: {name: array} constants."""
    g = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)) for n, a in inputs],
        [helper.make_tensor_value_info(o, out_type, None) for o in list(node.output)[:n_out] if o],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    return m


def _both(model, feeds):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    out = get_backend("numpy").load(model, SessionOptions(threads=1)).run(feeds)
    return ref, [out[o.name] for o in model.graph.output]


def _numpy(model, feeds):
    return get_backend("numpy").load(model, SessionOptions(threads=1)).run(feeds)


rng = np.random.default_rng(0)


def _f(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -- float fusions ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["Gelu", "FastGelu", "BiasGelu", "FastGeluBias"])
def test_gelu_family_matches_onnxruntime(op):
    x, b = _f(2, 5, 16, scale=3), _f(16)
    if op == "BiasGelu":
        node = helper.make_node("BiasGelu", ["x", "b"], ["y"], domain=MS)
    elif op == "FastGeluBias":
        node = helper.make_node("FastGelu", ["x", "b"], ["y"], domain=MS)
    else:
        node = helper.make_node(op, ["x"], ["y"], domain=MS)
    feeds = {"x": x, "b": b} if "Bias" in op else {"x": x}
    ref, got = _both(_model(node, list(feeds.items())), feeds)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_layer_normalization_matches_onnxruntime_with_the_sum_output(with_bias):
    x, s, gamma, beta, bias = _f(2, 4, 32), _f(2, 4, 32), _f(32), _f(32), _f(32)
    ins = ["x", "s", "gamma", "beta"] + (["bias"] if with_bias else [])
    node = helper.make_node("SkipLayerNormalization", ins, ["y", "", "", "sum"], domain=MS, epsilon=1e-5)
    feeds = dict(zip(ins, [x, s, gamma, beta, bias]))
    ref, got = _both(_model(node, list(feeds.items()), n_out=4), feeds)
    for r, o in zip(ref, got):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("act, params, with_z", [
    ("Relu", None, False), ("LeakyRelu", [0.2], True), ("Clip", [-0.5, 0.7], False),
    ("HardSigmoid", [0.3, 0.4], True), ("Sigmoid", None, False), ("Tanh", None, True), (None, None, True),
])
def test_fused_conv_matches_onnxruntime(act, params, with_z):
    x, w, b = _f(1, 4, 9, 9), _f(6, 2, 3, 3, scale=0.3), _f(6)
    attrs = dict(group=2, pads=[1, 0, 1, 2], strides=[2, 1], kernel_shape=[3, 3])
    if act:
        attrs["activation"] = act
    if params:
        attrs["activation_params"] = params
    z = _f(1, 6, 5, 9)
    ins = ["x", "w", "b"] + (["z"] if with_z else [])
    node = helper.make_node("FusedConv", ins, ["y"], domain=MS, **attrs)
    feeds = dict(zip(ins, [x, w, b, z]))
    ref, got = _both(_model(node, list(feeds.items())), feeds)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)


# -- QLinear* --------------------------------------------------------------------------------------------


def _q(dtype, *shape):
    lo, hi = (0, 256) if dtype == np.uint8 else (-128, 128)
    return rng.integers(lo, hi, shape).astype(dtype)


def _qp(dtype, scale):
    zp = np.array(rng.integers(100, 150) if dtype == np.uint8 else rng.integers(-20, 20), dtype)
    return np.array(scale, np.float32), zp


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("b_shape", [(2, 3, 8), (8,), (1, 3, 1)])
def test_qlinear_add_and_mul_match_onnxruntime_exactly(op, dtype, b_shape):
    a, b = _q(dtype, 2, 3, 8), _q(dtype, *b_shape)
    (sa, za), (sb, zb), (sc, zc) = _qp(dtype, 0.05), _qp(dtype, 0.03), _qp(dtype, 0.07 if op == "QLinearAdd" else 2.0)
    inits = {"sa": sa, "za": za, "sb": sb, "zb": zb, "sc": sc, "zc": zc}
    node = helper.make_node(op, ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["y"], domain=MS)
    t = U8 if dtype == np.uint8 else I8
    ref, got = _both(_model(node, [("a", a), ("b", b)], inits=inits, out_type=t), {"a": a, "b": b})
    assert got[0].dtype == dtype
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("op, attrs", [("QLinearSigmoid", {}), ("QLinearLeakyRelu", {"alpha": 0.1})])
def test_qlinear_unary_ops_match_onnxruntime_exactly_on_every_byte(op, attrs, dtype):
    lo = 0 if dtype == np.uint8 else -128
    x = np.arange(lo, lo + 256).astype(dtype).reshape(4, 64)  # every input value once
    (sx, zx), (sy, zy) = _qp(dtype, 0.06), _qp(dtype, 1 / 255 if op == "QLinearSigmoid" else 0.05)
    node = helper.make_node(op, ["x", "sx", "zx", "sy", "zy"], ["y"], domain=MS, **attrs)
    t = U8 if dtype == np.uint8 else I8
    m = _model(node, [("x", x)], inits={"sx": sx, "zx": zx, "sy": sy, "zy": zy}, out_type=t)
    ref, got = _both(m, {"x": x})
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("channels_last", [0, 1])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_qlinear_global_average_pool_matches_onnxruntime_exactly(channels_last, dtype):
    x = _q(dtype, 2, 7, 5, 6)
    (sx, zx), (sy, zy) = _qp(dtype, 0.04), _qp(dtype, 0.01)
    node = helper.make_node("QLinearGlobalAveragePool", ["x", "sx", "zx", "sy", "zy"], ["y"], domain=MS,
                            channels_last=channels_last)
    t = U8 if dtype == np.uint8 else I8
    ref, got = _both(_model(node, [("x", x)], inits={"sx": sx, "zx": zx, "sy": sy, "zy": zy}, out_type=t), {"x": x})
    assert got[0].shape == ref[0].shape
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_qlinear_concat_requantizes_each_input_like_onnxruntime(dtype):
    a, b, c = _q(dtype, 2, 3, 4), _q(dtype, 2, 5, 4), _q(dtype, 2, 1, 4)
    (sy, zy), (sa, za), (sb, zb) = _qp(dtype, 0.05), _qp(dtype, 0.02), _qp(dtype, 0.09)
    inits = {"sy": sy, "zy": zy, "sa": sa, "za": za, "sb": sb, "zb": zb}
    node = helper.make_node("QLinearConcat", ["sy", "zy", "a", "sa", "za", "b", "sb", "zb", "c", "sy", "zy"], ["y"],
                            domain=MS, axis=1)
    t = U8 if dtype == np.uint8 else I8
    feeds = {"a": a, "b": b, "c": c}
    ref, got = _both(_model(node, list(feeds.items()), inits=inits, out_type=t), feeds)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[0][:, 8:], c)  # Y's own scale and zero point: copied


# -- hostile ---------------------------------------------------------------------------------------------


def _refused(model, feeds, *words):
    with pytest.raises(BackendError) as ei:
        _numpy(model, feeds)
    msg = str(ei.value)
    assert all(w in msg for w in words), msg
    assert "Traceback" not in msg


def test_hostile_inputs_and_attributes_are_refused_in_one_line():
    x = _f(2, 8)
    _refused(_model(helper.make_node("BiasGelu", ["x", "b"], ["y"], domain=MS), [("x", x), ("b", _f(3))]),
             {"x": x, "b": _f(3)}, "BiasGelu", "1-D of A's last dimension")
    _refused(_model(helper.make_node("SkipLayerNormalization", ["x", "s", "g"], ["y"], domain=MS),
                    [("x", x), ("s", _f(2, 7)), ("g", _f(8))]), {"x": x, "s": _f(2, 7), "g": _f(8)},
             "SkipLayerNormalization", "does not broadcast")
    xi, wi = _f(1, 2, 5, 5), _f(3, 2, 3, 3)
    _refused(_model(helper.make_node("FusedConv", ["x", "w"], ["y"], domain=MS, activation="Swish"),
                    [("x", xi), ("w", wi)]), {"x": xi, "w": wi}, "FusedConv", "'Swish' is not one of")
    _refused(_model(helper.make_node("FusedConv", ["x", "w"], ["y"], domain=MS, activation="LeakyRelu"),
                    [("x", xi), ("w", wi)]), {"x": xi, "w": wi}, "FusedConv", "takes 1 activation_params, got 0")
    a = _q(np.uint8, 2, 3)
    per_channel = {"sa": np.array([0.1, 0.2, 0.3], np.float32), "za": np.array(3, np.uint8), "sc": np.array(0.1, np.float32)}
    node = helper.make_node("QLinearAdd", ["a", "sa", "za", "a", "sc", "za", "sc", "za"], ["y"], domain=MS)
    _refused(_model(node, [("a", a)], inits=per_channel, out_type=U8), {"a": a}, "QLinearAdd",
             "A_scale must be a single value")
    node = helper.make_node("QLinearAdd", ["a", "sc", "za", "b", "sc", "za", "sc", "za"], ["y"], domain=MS)
    b = _q(np.uint8, 4, 5)
    _refused(_model(node, [("a", a), ("b", b)], inits=per_channel, out_type=U8), {"a": a, "b": b},
             "QLinearAdd", "do not broadcast")
    node = helper.make_node("QLinearGlobalAveragePool", ["a", "sc", "za", "sc", "za"], ["y"], domain=MS)
    _refused(_model(node, [("a", a)], inits=per_channel, out_type=U8), {"a": a}, "QLinearGlobalAveragePool",
             "rank >= 3")
    node = helper.make_node("QLinearConcat", ["sc", "za", "a", "sc"], ["y"], domain=MS, axis=0)
    _refused(_model(node, [("a", a)], inits=per_channel, out_type=U8), {"a": a}, "QLinearConcat", "triples")
    node = helper.make_node("QLinearConcat", ["sc", "za", "a", "sc", "za"], ["y"], domain=MS, axis=5)
    _refused(_model(node, [("a", a)], inits=per_channel, out_type=U8), {"a": a}, "QLinearConcat", "axis=5")


def test_the_ops_are_registered_in_the_microsoft_domain():
    from edgeflow.kernels import supported_ops

    have = set(supported_ops(MS))
    assert {"DynamicQuantizeLSTM", "Gelu", "BiasGelu", "FastGelu", "SkipLayerNormalization", "FusedConv",
            "QLinearAdd", "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearGlobalAveragePool",
            "QLinearConcat"} <= have
