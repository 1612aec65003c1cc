"""com.microsoft::DynamicQuantizeLSTM on the numpy backend, against onnxruntime.

The graphs are what onnxruntime's dynamic quantizer writes (``quantize_dynamic``
on a float LSTM) and hand-built ones covering what the quantizer does not
write (per-column scales, uint8 weights, peepholes, initial states, clip).
onnxruntime quantizes the activations (X, then H at every step) to uint8 inside
the op; the kernel does the same, so the outputs agree to float32 rounding,
far closer than a float LSTM on the dequantized weights would.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeflow.errors import BackendError
from edgeflow.runtime.backends import SessionOptions, get_backend

ort = pytest.importorskip("onnxruntime")

MS = "com.microsoft"


def _model(nodes, x_shape, inits, opset=17):
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "yh", "yc")],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    return m


def _ort(model, feeds):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    # onnxruntime's exact u8 x s8 kernels on every x86 CPU: without VNNI its fast ones add products in pairs in
    # int16 and saturate with full-range int8 weights (255 * -128 * 2 < -32768), and then it is no reference
    so.add_session_config_entry("session.x64quantprecision", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _numpy(model, feeds):
    sess = get_backend("numpy").load(model, SessionOptions(threads=1))
    out = sess.run(feeds)
    return [out[n] for n in ("y", "yh", "yc")]


def _dq_lstm(rng, seq, batch, n_in, hs, direction="forward", *, per_column=False, wdt=np.int8,
             peepholes=False, states=False, clip=None, input_forget=0):
    nd = 2 if direction == "bidirectional" else 1
    g = 4 * hs
    lo, hi = (-127, 128) if wdt == np.int8 else (0, 256)
    shp = (nd, g) if per_column else (nd,)
    inits = {
        "W": rng.integers(lo, hi, (nd, n_in, g)).astype(wdt),
        "R": rng.integers(lo, hi, (nd, hs, g)).astype(wdt),
        "B": rng.standard_normal((nd, 2 * g)).astype(np.float32),
        "ws": (rng.random(shp) * 0.01 + 0.001).astype(np.float32), "wz": np.zeros(shp, wdt),
        "rs": (rng.random(shp) * 0.01 + 0.001).astype(np.float32), "rz": np.zeros(shp, wdt),
    }
    ins = ["x", "W", "R", "B", "", "", "", "", "ws", "wz", "rs", "rz"]
    if peepholes:
        inits["P"] = rng.standard_normal((nd, 3 * hs)).astype(np.float32)
        ins[7] = "P"
    if states:
        inits["h0"] = rng.standard_normal((nd, batch, hs)).astype(np.float32)
        inits["c0"] = rng.standard_normal((nd, batch, hs)).astype(np.float32)
        ins[5], ins[6] = "h0", "c0"
    attrs = {"hidden_size": hs, "direction": direction, "input_forget": input_forget}
    if clip is not None:
        attrs["clip"] = clip
    node = helper.make_node("DynamicQuantizeLSTM", ins, ["y", "yh", "yc"], domain=MS, **attrs)
    return _model([node], (seq, batch, n_in), inits)


CASES = {
    "forward-int8": dict(seq=5, batch=1, n_in=8, hs=4),
    "reverse-per-column": dict(seq=7, batch=3, n_in=6, hs=5, direction="reverse", per_column=True),
    "bidirectional-uint8": dict(seq=4, batch=2, n_in=3, hs=6, direction="bidirectional", per_column=True,
                                wdt=np.uint8),
    "peepholes-states": dict(seq=6, batch=2, n_in=5, hs=4, peepholes=True, states=True),
    "clip-input-forget": dict(seq=5, batch=2, n_in=4, hs=3, clip=0.7, input_forget=1),
    "wide-hidden-float64-sums": dict(seq=3, batch=1, n_in=600, hs=8),  # 600 * 255 * 128 > 2**24
}


@pytest.mark.parametrize("case", list(CASES))
def test_hand_built_graphs_match_onnxruntime(case):
    rng = np.random.default_rng(sorted(CASES).index(case))
    kw = CASES[case]
    m = _dq_lstm(rng, **kw)
    x = rng.standard_normal((kw["seq"], kw["batch"], kw["n_in"])).astype(np.float32)
    ref, got = _ort(m, {"x": x}), _numpy(m, {"x": x})
    for r, o in zip(ref, got):
        assert o.shape == r.shape and o.dtype == np.float32
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)


def _float_lstm(rng, seq, batch, n_in, hs, direction):
    nd = 2 if direction == "bidirectional" else 1
    inits = {"W": rng.standard_normal((nd, 4 * hs, n_in)).astype(np.float32) * 0.4,
             "R": rng.standard_normal((nd, 4 * hs, hs)).astype(np.float32) * 0.4,
             "B": rng.standard_normal((nd, 8 * hs)).astype(np.float32) * 0.2}
    node = helper.make_node("LSTM", ["x", "W", "R", "B"], ["y", "yh", "yc"], hidden_size=hs, direction=direction)
    m = _model([node], (seq, batch, n_in), inits, opset=13)
    m.opset_import.pop()  # a plain float model: ai.onnx only
    return m


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_what_onnxruntimes_quantizer_writes_matches_onnxruntime_and_not_the_float_lstm(direction):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(7)
    fm = _float_lstm(rng, 9, 2, 12, 16, direction)
    with tempfile.TemporaryDirectory() as d:
        onnx.save(fm, Path(d) / "f.onnx")
        quantize_dynamic(Path(d) / "f.onnx", Path(d) / "q.onnx", weight_type=QuantType.QInt8,
                         op_types_to_quantize=["LSTM"])
        qm = onnx.load(Path(d) / "q.onnx")
    assert [(n.domain, n.op_type) for n in qm.graph.node] == [(MS, "DynamicQuantizeLSTM")]
    x = rng.standard_normal((9, 2, 12)).astype(np.float32)
    ref, got, flt = _ort(qm, {"x": x}), _numpy(qm, {"x": x}), _ort(fm, {"x": x})
    for r, o, f in zip(ref, got, flt):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
        # the quantization of the activations is reproduced: the float LSTM is much further away
        assert np.abs(f - r).max() > 100 * max(np.abs(o - r).max(), 1e-7)


def _hostile(**change):
    rng = np.random.default_rng(3)
    m = _dq_lstm(rng, 4, 2, 3, 5, per_column=False)
    node = m.graph.node[0]
    inits = {i.name: i for i in m.graph.initializer}
    for name, value in change.items():
        if name in inits:
            inits[name].CopyFrom(numpy_helper.from_array(np.asarray(value), name))
        else:
            for a in node.attribute:
                if a.name == name:
                    node.attribute.remove(a)
                    break
            node.attribute.append(helper.make_attribute(name, value))
    return m


@pytest.mark.parametrize("change, words", [
    ({"W": np.zeros((1, 20, 3), np.int8)}, "W must be (1, 3, 20)"),
    ({"R": np.zeros((1, 5, 7), np.int8)}, "R (1, 5, 20)"),  # 7 columns: hidden 5 needs 20
    ({"wz": np.array([3], np.int8)}, "must be 0"),
    ({"ws": np.ones((1, 3), np.float32)}, "W_scale must have shape (1,) or (1, 20)"),
    ({"W": np.zeros((1, 3, 20), np.float32)}, "must be int8 or uint8"),
    ({"direction": "sideways"}, "direction='sideways'"),
    ({"hidden_size": 6}, "hidden_size=6"),
    ({"activations": ["Sigmoid", "Tanh"]}, "2 activations given"),
    ({"activations": ["Sigmoid", "Gelu", "Tanh"]}, "activation 'Gelu' is not supported"),
])
def test_hostile_shapes_and_attributes_are_refused_in_one_line(change, words):
    m = _hostile(**change)
    x = np.zeros((4, 2, 3), np.float32)
    with pytest.raises(BackendError) as ei:
        _numpy(m, {"x": x})
    msg = str(ei.value)
    assert "DynamicQuantizeLSTM" in msg and words in msg, msg
    assert "Traceback" not in msg


def test_uneven_sequence_lengths_are_refused_not_run_wrong():
    rng = np.random.default_rng(4)
    m = _dq_lstm(rng, 4, 2, 3, 5)
    m.graph.node[0].input[4] = "lens"
    m.graph.initializer.append(numpy_helper.from_array(np.array([4, 2], np.int32), "lens"))
    with pytest.raises(BackendError, match="sequence_lens of different lengths are not supported"):
        _numpy(m, {"x": np.zeros((4, 2, 3), np.float32)})
    # equal lengths are the plain case and run
    m.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array([4, 4], np.int32), "lens"))
    x = rng.standard_normal((4, 2, 3)).astype(np.float32)
    for r, o in zip(_ort(m, {"x": x}), _numpy(m, {"x": x})):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
