"""The numpy backend's prepack_lstm pass: default LSTMs on constant weights run on
weights packed at load (edgeflow.kernels.rnn.pack_lstm / lstm_packed) and give the
LSTM kernel's result; every other LSTM, or call, runs the kernel."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _nn_check import one_node_model, run_ort

from edgeflow.kernels import get_kernel
from edgeflow.kernels.rnn import lstm_packed, pack_lstm
from edgeflow.runtime.backends.numpy_backend import execute
from edgeflow.runtime.graph import compile_graph

F = np.float32
LSTM = get_kernel("LSTM", opset=14, dtype="float32").forward


def _weights(rng, dirs, hid, n_in, dtype=F, bias=True):
    w = (rng.standard_normal((dirs, 4 * hid, n_in)) * 0.5).astype(dtype)
    r = (rng.standard_normal((dirs, 4 * hid, hid)) * 0.5).astype(dtype)
    b = (rng.standard_normal((dirs, 8 * hid)) * 0.3).astype(dtype) if bias else None
    return w, r, b


CASES = list(itertools.product(["forward", "reverse", "bidirectional"], [1, 3], [False, True], [True, False],
                               [None, "full"], [F, np.float64]))


@pytest.mark.parametrize("direction,batch,init,bias,lens,dtype", CASES, ids=str)
def test_packed_lstm_is_the_kernel(direction, batch, init, bias, lens, dtype):
    rng = np.random.default_rng(3)
    dirs = 2 if direction == "bidirectional" else 1
    seq, n_in, hid = 7, 5, 6
    w, r, b = _weights(rng, dirs, hid, n_in, dtype, bias)
    x = rng.standard_normal((seq, batch, n_in)).astype(dtype) * 2
    sl = None if lens is None else np.full(batch, seq, np.int32)
    h0 = rng.standard_normal((dirs, batch, hid)).astype(dtype) if init else None
    c0 = rng.standard_normal((dirs, batch, hid)).astype(dtype) if init else None
    c0_before = None if c0 is None else c0.copy()
    want = LSTM(x, w, r, b, sl, h0, c0, None, direction=direction, hidden_size=hid)
    got = lstm_packed(pack_lstm(w, r, b, direction), x, sl, h0, c0)
    assert got is not None
    tol = 1e-5 if dtype == F else 1e-12
    for g, e in zip(got, want):
        assert g.shape == e.shape and g.dtype == e.dtype and g.flags.c_contiguous
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol)
    if c0 is not None:
        np.testing.assert_array_equal(c0, c0_before)  # the initial state is not overwritten


def test_packed_lstm_declines_what_it_does_not_run():
    rng = np.random.default_rng(4)
    w, r, b = _weights(rng, 2, 4, 3)
    pack = pack_lstm(w, r, b, "bidirectional")
    x = rng.standard_normal((5, 2, 3)).astype(F)
    assert lstm_packed(pack, x, np.array([5, 3], np.int32)) is None  # ragged: the kernel's masking
    assert lstm_packed(pack, x.astype(np.float64)) is None
    assert lstm_packed(pack, x.astype(np.float16)) is None
    assert lstm_packed(pack, x[:0]) is None
    assert lstm_packed(pack, x, None, np.zeros((2, 1, 4), F)) is None
    assert pack_lstm(w, r[:, :8], b, "bidirectional") is None
    assert pack_lstm(w, r, b, "forward") is None


def _model(rng, direction="bidirectional", bias=True, n_outputs=3, peep=False, **attrs):
    dirs = 2 if direction == "bidirectional" else 1
    seq, batch, n_in, hid = 6, 2, 5, 7
    w, r, b = _weights(rng, dirs, hid, n_in, F, bias)
    consts = {"W": w, "R": r}
    order = ["x", "W", "R", "B" if bias else "", "L"]
    if bias:
        consts["B"] = b
    if peep:
        consts["P"] = (rng.standard_normal((dirs, 3 * hid)) * 0.3).astype(F)
        order += ["", "", "P"]
    x = rng.standard_normal((seq, batch, n_in)).astype(F)
    m = one_node_model("LSTM", {"x": x, "L": np.array([seq, seq], np.int32)}, consts, opset=14,
                       input_order=order, n_outputs=n_outputs, direction=direction, hidden_size=hid, **attrs)
    return m, x


def _run(model, feeds):
    g = compile_graph(model)
    env = execute(g, feeds)
    return g, [env[o.name] for o in model.graph.output]


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("bias,n_outputs", [(True, 3), (False, 1), (True, 2)])
def test_the_pass_prepacks_a_default_lstm_and_matches_onnxruntime(direction, bias, n_outputs):
    rng = np.random.default_rng(5)
    m, x = _model(rng, direction, bias, n_outputs)
    feeds = {"x": x, "L": np.array([6, 6], np.int32)}
    g, got = _run(m, feeds)
    assert [n.kernel.op_type for n in g.nodes] == ["LSTM(prepacked)"]
    want = run_ort(m, feeds)
    assert len(got) == len(want) == n_outputs
    for a, e in zip(got, want):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)
    ragged = {"x": x, "L": np.array([6, 2], np.int32)}  # the same node falls back to the kernel
    _, got = _run(m, ragged)
    for a, e in zip(got, run_ort(m, ragged)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("extra", [dict(clip=0.5), dict(input_forget=1), dict(peep=True),
                                   dict(activations=["Sigmoid", "Relu", "Tanh"] * 2)], ids=str)
def test_other_lstms_are_left_to_the_kernel(extra):
    m, _ = _model(np.random.default_rng(6), **extra)
    assert [n.kernel.op_type for n in compile_graph(m).nodes] == ["LSTM"]


def test_default_activation_names_spelled_out_are_prepacked():
    m, _ = _model(np.random.default_rng(7), activations=["Sigmoid", "Tanh", "Tanh"] * 2)
    assert [n.kernel.op_type for n in compile_graph(m).nodes] == ["LSTM(prepacked)"]


def test_other_weight_arrays_than_the_packed_ones_run_the_kernel():
    rng = np.random.default_rng(8)
    m, x = _model(rng)
    g = compile_graph(m)
    node = g.nodes[0]
    w, r, b = (g.initializers[k] for k in ("W", "R", "B"))
    w2 = w * -1.5
    attrs = dict(node.attrs)
    got = node.kernel.forward(x, w2, r, b, None, None, None, None, **attrs)
    want = LSTM(x, w2, r, b, None, None, None, None, **attrs)
    for a, e in zip(got, want):
        np.testing.assert_array_equal(a, e)
