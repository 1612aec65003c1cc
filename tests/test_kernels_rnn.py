"""LSTM, GRU and RNN on the numpy backend against onnxruntime over grids of
directions, layouts, sequence lengths, initial states, peepholes, clip,
activations and linear_before_reset, with every output."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _nn_check import assert_matches_ort, one_node_model, run_numpy, run_ort

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(5)
F = np.float32
SEQ, BATCH, IN, HID = 5, 3, 4, 6
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _model(op, *, direction="forward", layout=0, lens=None, init=False, peep=False, bias=True,
           dtype=F, n_out=None, **attrs):
    dirs = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    x = RNG.standard_normal((BATCH, SEQ, IN) if layout else (SEQ, BATCH, IN)).astype(dtype)
    consts = {"W": (RNG.standard_normal((dirs, g * HID, IN)) * 0.5).astype(dtype),
              "R": (RNG.standard_normal((dirs, g * HID, HID)) * 0.5).astype(dtype)}
    order = ["x", "W", "R"]
    feeds = {"x": x}
    inputs = {"x": x}

    def add(name, value):
        order.append(name if value is not None else "")
        if value is not None:
            consts[name] = value

    add("B", (RNG.standard_normal((dirs, 2 * g * HID)) * 0.3).astype(dtype) if bias else None)
    add("L", None if lens is None else np.asarray(lens, np.int32))
    state_shape = (BATCH, dirs, HID) if layout else (dirs, BATCH, HID)
    add("H0", RNG.standard_normal(state_shape).astype(dtype) if init else None)
    if op == "LSTM":
        add("C0", RNG.standard_normal(state_shape).astype(dtype) if init else None)
        add("P", (RNG.standard_normal((dirs, 3 * HID)) * 0.3).astype(dtype) if peep else None)
    while order[-1] == "":
        order.pop()
    n = n_out or (3 if op == "LSTM" else 2)
    m = one_node_model(op, inputs, consts, opset=14 if layout else 7, input_order=order, n_outputs=n,
                       direction=direction, hidden_size=HID, **({"layout": layout} if layout else {}), **attrs)
    return m, feeds, consts, order, n, attrs


def check(op, **kw):
    """Compare with onnxruntime; onnxruntime's CPU kernels refuse layout=1, so
    a layout-1 model is compared with the layout-0 model of the transposed data."""
    m, feeds, consts, order, n, attrs = _model(op, **kw)
    direction = kw.get("direction", "forward")
    if not kw.get("layout"):
        assert_matches_ort(m, feeds, rtol=1e-4, atol=1e-5)
        return
    t_feeds = {"x": np.swapaxes(feeds["x"], 0, 1)}
    t_consts = {k: (np.swapaxes(v, 0, 1) if k in ("H0", "C0") else v) for k, v in consts.items()}
    m0 = one_node_model(op, t_feeds, t_consts, opset=14, input_order=order, n_outputs=n,
                        direction=direction, hidden_size=HID, **attrs)
    want = run_ort(m0, t_feeds)
    got = run_numpy(m, feeds)
    back = [np.transpose(want[0], (2, 0, 1, 3))] + [np.swapaxes(s, 0, 1) for s in want[1:]]
    for g, w in zip(got, back):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


GRID = list(itertools.product(["forward", "reverse", "bidirectional"], [0, 1], [None, [5, 3, 0], [2, 5, 4]],
                              [False, True]))


@pytest.mark.parametrize("direction,layout,lens,init", GRID)
def test_lstm(direction, layout, lens, init):
    check("LSTM", direction=direction, layout=layout, lens=lens, init=init, peep=init)


@pytest.mark.parametrize("direction,layout,lens,init", GRID)
@pytest.mark.parametrize("lbr", [0, 1])
def test_gru(direction, layout, lens, init, lbr):
    check("GRU", direction=direction, layout=layout, lens=lens, init=init, linear_before_reset=lbr)


@pytest.mark.parametrize("direction,layout,lens,init", GRID)
def test_rnn(direction, layout, lens, init):
    check("RNN", direction=direction, layout=layout, lens=lens, init=init)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_clip_and_no_bias(op, direction):
    check(op, direction=direction, clip=0.7, bias=False, init=True)


ACTS = {
    "LSTM": [["Sigmoid", "Tanh", "Tanh"], ["HardSigmoid", "Relu", "Tanh"], ["Sigmoid", "ScaledTanh", "Affine"],
             ["Sigmoid", "LeakyRelu", "Softsign"]],
    "GRU": [["HardSigmoid", "Tanh"], ["Sigmoid", "Relu"], ["Sigmoid", "Softplus"], ["Sigmoid", "Elu"]],
    "RNN": [["Relu"], ["ScaledTanh"], ["Affine"], ["ThresholdedRelu"], ["LeakyRelu"], ["Sigmoid"]],
}


@pytest.mark.parametrize("op,acts", [(op, a) for op, lst in ACTS.items() for a in lst], ids=str)
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_activation_lists(op, acts, direction):
    dirs = 2 if direction == "bidirectional" else 1
    alphas = [0.3, 0.7, 0.4, 0.9][: 2 * dirs]
    betas = [0.2, 0.6, 0.1, 0.5][: 2 * dirs]
    check(op, direction=direction, activations=acts * dirs, activation_alpha=alphas, activation_beta=betas)


def test_lstm_input_forget():
    check("LSTM", input_forget=1, init=True)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_only_the_last_state(op):
    """Y unused (empty output name): Y_h alone is still right."""
    m, feeds, *_ = _model(op, direction="bidirectional", lens=[5, 1, 3])
    m.graph.node[0].output[0] = ""
    del m.graph.output[0]
    assert_matches_ort(m, feeds)


def test_float64_and_float16():
    """float64 keeps its precision (onnxruntime has no float64 GRU: compare with
    its float32 run of the same numbers); float16 runs in float32 inside."""
    m, feeds, consts, order, n, _ = _model("GRU", direction="bidirectional", dtype=np.float64, lens=[5, 2, 4])
    got = run_numpy(m, feeds)
    assert all(g.dtype == np.float64 for g in got)
    c32 = {k: (v.astype(F) if v.dtype == np.float64 else v) for k, v in consts.items()}
    f32 = {"x": feeds["x"].astype(F)}
    m32 = one_node_model("GRU", f32, c32, opset=7, input_order=order, n_outputs=n, direction="bidirectional",
                         hidden_size=HID)
    for g, w in zip(got, run_ort(m32, f32)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    k = get_kernel("LSTM", opset=14, dtype="float16")
    x = RNG.standard_normal((SEQ, BATCH, IN)).astype(np.float16)
    w = RNG.standard_normal((1, 4 * HID, IN)).astype(np.float16)
    r = RNG.standard_normal((1, 4 * HID, HID)).astype(np.float16)
    y, yh, yc = k(x, w, r, n_outputs=3)
    assert y.dtype == yh.dtype == yc.dtype == np.float16
    y32 = get_kernel("LSTM", opset=14)(x.astype(F), w.astype(F), r.astype(F), n_outputs=1)
    np.testing.assert_allclose(y, y32, atol=5e-3)


def test_bad_shapes_name_the_problem():
    k = get_kernel("LSTM", opset=14)
    x = np.zeros((SEQ, BATCH, IN), F)
    w, r = np.zeros((1, 4 * HID, IN), F), np.zeros((1, 4 * HID, HID), F)
    with pytest.raises(KernelError, match="direction='sideways'"):
        k(x, w, r, direction="sideways")
    with pytest.raises(KernelError, match=r"W must be \(2, 24, 4\)"):
        k(x, w, r, direction="bidirectional")
    with pytest.raises(KernelError, match="sequence_lens"):
        k(x, w, r, None, np.array([9, 1, 1], np.int32))
    with pytest.raises(KernelError, match="activation 'Swish'"):
        k(x, w, r, activations=["Sigmoid", "Swish", "Tanh"])
    with pytest.raises(KernelError, match="hidden_size=7"):
        k(x, w, r, hidden_size=7)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
def test_lstm_plain_path_with_initial_states(direction, layout):
    """The default LSTM (no peepholes, clip, input_forget, ragged lengths) takes the
    both-directions-per-step path; with initial states too it matches onnxruntime."""
    check("LSTM", direction=direction, layout=layout, init=True, peep=False)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_lstm_plain_path_is_the_general_path_bit_for_bit(direction):
    """Zero peepholes send the same LSTM down the general per-direction loop; adding 0 is
    exact, so the two paths must agree to the last bit, every output."""
    dirs = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(11)
    x = rng.standard_normal((7, 2, 5)).astype(F)
    w = (rng.standard_normal((dirs, 4 * HID, 5)) * 0.5).astype(F)
    r = (rng.standard_normal((dirs, 4 * HID, HID)) * 0.5).astype(F)
    b = (rng.standard_normal((dirs, 8 * HID)) * 0.3).astype(F)
    h0 = rng.standard_normal((dirs, 2, HID)).astype(F)
    c0 = rng.standard_normal((dirs, 2, HID)).astype(F)
    lstm = get_kernel("LSTM", opset=14, dtype="float32").forward
    plain = lstm(x, w, r, b, None, h0, c0, None, direction=direction, hidden_size=HID)
    general = lstm(x, w, r, b, None, h0, c0, np.zeros((dirs, 3 * HID), F), direction=direction, hidden_size=HID)
    for p, g in zip(plain, general):
        np.testing.assert_array_equal(p, g)
