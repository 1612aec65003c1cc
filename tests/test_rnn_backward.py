"""Backward of the recurrent layers LSTM, GRU and RNN (issue 30: "LSTM/GRU have no backward").

Gradients of X, W, R, B, initial_h and initial_c from gradients on Y, Y_h and Y_c are checked
against float64 finite differences (every direction, both layouts, with and without
sequence_lens, GRU's linear_before_reset 0 and 1) and against PyTorch's LSTM/GRU/RNN with the
same weights (ONNX gate order i,o,f,c / z,r,h mapped onto torch's i,f,g,o / r,z,n). Settings the
backward does not cover are refused in one line when the Trainer is built, and a small
Gemm -> LSTM -> Gemm model trains with the Trainer and with ``edgeflow train``.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from _cli import one_clear_line
from edgeflow.errors import TrainingError
from edgeflow.kernels import get_kernel
from edgeflow.train import Trainer

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
N_OUT = {"LSTM": 3, "GRU": 2, "RNN": 2}
# (op, linear_before_reset)
VARIANTS = [("LSTM", 0), ("GRU", 0), ("GRU", 1), ("RNN", 0)]
DIRECTIONS = ["forward", "reverse", "bidirectional"]


def _inputs(op, direction, layout, lens, rng, *, seq=3, batch=3, n_in=2, hs=2, bias=True, init=True,
            dtype=np.float64):
    g, nd = GATES[op], 2 if direction == "bidirectional" else 1
    x = rng.standard_normal((batch, seq, n_in) if layout else (seq, batch, n_in))
    ins = [x, rng.standard_normal((nd, g * hs, n_in)) * 0.7, rng.standard_normal((nd, g * hs, hs)) * 0.7,
           rng.standard_normal((nd, 2 * g * hs)) * 0.3 if bias else None,
           None if lens is None else np.array(lens, np.int32)]
    state = (batch, nd, hs) if layout else (nd, batch, hs)
    ins.append(rng.standard_normal(state) if init else None)
    if op == "LSTM":
        ins.append(rng.standard_normal(state) if init else None)
    return [a if a is None or a.dtype.kind != "f" else a.astype(dtype) for a in ins]


def _attrs(op, direction, layout, lbr):
    a = {"direction": direction, "layout": layout}
    if op == "GRU":
        a["linear_before_reset"] = lbr
    return a


def _backward(op, ins, attrs, gys, **kw):
    k = get_kernel(op, opset=14)
    return k.backward_fn(gys, ins, [None] * len(gys), **attrs, **kw)


def _numeric(op, ins, attrs, gys, pos, eps=1e-6):
    k = get_kernel(op, opset=14)

    def loss():
        outs = k.forward(*ins, **attrs, n_outputs=len(gys))
        return sum(float((o * g).sum()) for o, g in zip(outs, gys) if g is not None)

    a = ins[pos]
    num = np.zeros_like(a)
    flat, nf = a.reshape(-1), num.reshape(-1)
    for j in range(flat.size):
        keep = flat[j]
        flat[j] = keep + eps
        up = loss()
        flat[j] = keep - eps
        down = loss()
        flat[j] = keep
        nf[j] = (up - down) / (2 * eps)
    return num


def _check_fd(op, lbr, direction, layout, lens, *, used=None, bias=True, init=True):
    rng = np.random.default_rng(7)
    ins = _inputs(op, direction, layout, lens, rng, bias=bias, init=init)
    attrs = _attrs(op, direction, layout, lbr)
    outs = get_kernel(op, opset=14).forward(*ins, **attrs, n_outputs=N_OUT[op])
    gys = [rng.standard_normal(o.shape) for o in outs]
    if used is not None:
        gys = [g if i in used else None for i, g in enumerate(gys)]
    grads = _backward(op, ins, attrs, gys)
    checked = 0
    for pos, a in enumerate(ins):
        if a is None or pos == 4:
            continue
        num = _numeric(op, ins, attrs, gys, pos)
        assert grads[pos] is not None and grads[pos].shape == a.shape, (pos, None if grads[pos] is None else
                                                                       grads[pos].shape)
        np.testing.assert_allclose(grads[pos], num, rtol=1e-6, atol=1e-8, err_msg=f"input {pos}")
        checked += 1
    assert checked == len([a for i, a in enumerate(ins) if a is not None and i != 4])


@pytest.mark.parametrize("lens", [None, [3, 1, 0], [2, 3, 1]], ids=["full", "lens-with-0", "lens"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("op,lbr", VARIANTS, ids=["LSTM", "GRU-lbr0", "GRU-lbr1", "RNN"])
def test_gradients_match_finite_differences(op, lbr, direction, layout, lens):
    _check_fd(op, lbr, direction, layout, lens)


@pytest.mark.parametrize("op,lbr", VARIANTS, ids=["LSTM", "GRU-lbr0", "GRU-lbr1", "RNN"])
def test_without_bias_and_initial_states_and_with_one_output_used(op, lbr):
    _check_fd(op, lbr, "bidirectional", 0, [2, 3, 1], bias=False, init=False)
    for used in ({0}, {1}, {N_OUT[op] - 1}):  # Y alone, Y_h alone, the last state alone
        _check_fd(op, lbr, "forward", 1, None, used=used)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op,lbr", VARIANTS, ids=["LSTM", "GRU-lbr0", "GRU-lbr1", "RNN"])
def test_training_forward_is_the_plain_forward_and_recompute_gives_the_same_gradients(op, lbr, dtype):
    rng = np.random.default_rng(3)
    ins = _inputs(op, "bidirectional", 0, [4, 2, 5, 0, 3], rng, seq=5, batch=5, n_in=4, hs=3, dtype=dtype)
    attrs = _attrs(op, "bidirectional", 0, lbr)
    k = get_kernel(op, opset=14, dtype=dtype)
    plain = k.forward(*ins, **attrs, n_outputs=N_OUT[op])
    train, saved = k.forward_train(*ins, **attrs, n_outputs=N_OUT[op])
    for a, b in zip(plain, train):
        assert a.dtype == b.dtype == dtype and np.array_equal(a, b)  # bit for bit
    gys = [rng.standard_normal(o.shape).astype(dtype) for o in plain]
    with_saved = _backward(op, ins, attrs, gys, saved=saved)
    recomputed = _backward(op, ins, attrs, gys, saved=None)
    for pos, (a, b) in enumerate(zip(with_saved, recomputed)):
        if ins[pos] is None or pos == 4:
            assert a is None and b is None
            continue
        assert a.dtype == ins[pos].dtype and a.shape == ins[pos].shape
        assert np.array_equal(a, b)
    if dtype == np.float16:  # float16 works in float32: close to the float64 gradients
        ref = _backward(op, [None if a is None else a.astype(np.float64) if a.dtype.kind == "f" else a for a in ins],
                        attrs, [g.astype(np.float64) for g in gys])
        for pos, a in enumerate(with_saved):
            if a is not None:
                np.testing.assert_allclose(a.astype(np.float64), ref[pos], rtol=2e-2, atol=2e-2)


def test_gradients_nobody_needs_are_not_made():
    rng = np.random.default_rng(0)
    ins = _inputs("LSTM", "forward", 0, None, rng)
    attrs = _attrs("LSTM", "forward", 0, 0)
    outs = get_kernel("LSTM", opset=14).forward(*ins, **attrs, n_outputs=3)
    gys = [np.ones_like(o) for o in outs]
    needs = (False, True, True, True, False, False, False)
    grads = _backward("LSTM", ins, attrs, gys, needs_grad=needs)
    assert [g is not None for g in grads] == list(needs)
    full = _backward("LSTM", ins, attrs, gys)
    for a, b, n in zip(grads, full, needs):
        if n:
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- against PyTorch


def _torch_blocks(torch, a, order, hs):
    """Rows of an ONNX gate-stacked matrix (or bias) in torch's gate order."""
    return torch.cat([a[j * hs:(j + 1) * hs] for j in order], dim=0)


TORCH_ORDER = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}  # onnx i,o,f,c -> torch i,f,g,o; z,r,h -> r,z,n


def _torch_gru_lbr0(torch, x, w, r, b, h0, lens, hs, reverse):
    """One direction of ONNX GRU with linear_before_reset=0 (torch.nn.GRU is the =1 variant) in torch ops,
    on padded (seq, B, in) input, sequences reversed within their lengths for the reverse direction."""
    seq, batch = x.shape[0], x.shape[1]
    steps = torch.arange(seq)[:, None]
    if reverse:
        idx = torch.where(steps < lens[None, :], lens[None, :] - 1 - steps, steps)
        x = x[idx, torch.arange(batch)[None, :]]
    h, ys = h0, []
    wz, wr, wh = w[:hs], w[hs:2 * hs], w[2 * hs:]
    rz, rr, rh = r[:hs], r[hs:2 * hs], r[2 * hs:]
    wbz, wbr, wbh, rbz, rbr, rbh = (b[j * hs:(j + 1) * hs] for j in range(6))
    for t in range(seq):
        z = torch.sigmoid(x[t] @ wz.T + h @ rz.T + wbz + rbz)
        rg = torch.sigmoid(x[t] @ wr.T + h @ rr.T + wbr + rbr)
        hh = torch.tanh(x[t] @ wh.T + (rg * h) @ rh.T + wbh + rbh)
        new = (1 - z) * hh + z * h
        alive = (t < lens)[:, None]
        ys.append(torch.where(alive, new, torch.zeros_like(new)))
        h = torch.where(alive, new, h)
    y = torch.stack(ys)
    if reverse:
        out = torch.zeros_like(y)
        out[idx, torch.arange(batch)[None, :]] = y
        y = out
    return y, h


@pytest.mark.parametrize("lens", [None, [5, 2, 4, 1]], ids=["full", "lens"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("op,lbr", VARIANTS, ids=["LSTM", "GRU-lbr0", "GRU-lbr1", "RNN"])
def test_gradients_match_pytorch(op, lbr, direction, lens):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch comparison is skipped")
    seq, batch, n_in, hs = 5, 4, 3, 4
    rng = np.random.default_rng(11)
    ins = _inputs(op, direction, 0, lens, rng, seq=seq, batch=batch, n_in=n_in, hs=hs)
    attrs = _attrs(op, direction, 0, lbr)
    outs = get_kernel(op, opset=14).forward(*ins, **attrs, n_outputs=N_OUT[op])
    gys = [rng.standard_normal(o.shape) for o in outs]
    ours = _backward(op, ins, attrs, gys)

    nd = 2 if direction == "bidirectional" else 1
    x_t = torch.tensor(ins[0], requires_grad=True)
    w_t = torch.tensor(ins[1], requires_grad=True)
    r_t = torch.tensor(ins[2], requires_grad=True)
    b_t = torch.tensor(ins[3], requires_grad=True)
    h0_t = torch.tensor(ins[5], requires_grad=True)
    c0_t = torch.tensor(ins[6], requires_grad=True) if op == "LSTM" else None
    lens_t = torch.tensor(lens if lens is not None else [seq] * batch)
    dirs = [1] if direction == "reverse" else list(range(nd))  # torch direction index per ONNX direction

    if op == "GRU" and not lbr:
        ys, hns = [], []
        for k in range(nd):
            y, hn = _torch_gru_lbr0(torch, x_t, w_t[k], r_t[k], b_t[k], h0_t[k], lens_t, hs,
                                    reverse=direction == "reverse" or k == 1)
            ys.append(y)
            hns.append(hn)
        y_t, states = torch.stack(ys, dim=1), [torch.stack(hns)]
    else:
        cls = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN": torch.nn.RNN}[op]
        mod = cls(n_in, hs, bidirectional=True).double()  # a reverse ONNX layer is torch's reverse half
        order = TORCH_ORDER[op]
        params = {}
        for k, tdir in enumerate(dirs):
            sfx = "_reverse" if tdir else ""
            params[f"weight_ih_l0{sfx}"] = _torch_blocks(torch, w_t[k], order, hs)
            params[f"weight_hh_l0{sfx}"] = _torch_blocks(torch, r_t[k], order, hs)
            g = GATES[op] * hs
            params[f"bias_ih_l0{sfx}"] = _torch_blocks(torch, b_t[k, :g], order, hs)
            params[f"bias_hh_l0{sfx}"] = _torch_blocks(torch, b_t[k, g:], order, hs)
        full = {}
        for name, p in mod.named_parameters():
            full[name] = params.get(name, p.detach().clone())  # the unused half keeps its own weights
        if len(dirs) == 1 and dirs[0] == 1:
            h0_full = torch.cat([torch.zeros_like(h0_t), h0_t])
            c0_full = None if c0_t is None else torch.cat([torch.zeros_like(c0_t), c0_t])
        elif len(dirs) == 1:
            h0_full = torch.cat([h0_t, torch.zeros_like(h0_t)])
            c0_full = None if c0_t is None else torch.cat([c0_t, torch.zeros_like(c0_t)])
        else:
            h0_full, c0_full = h0_t, c0_t
        packed_in = torch.nn.utils.rnn.pack_padded_sequence(x_t, lens_t, enforce_sorted=False)
        state0 = (h0_full, c0_full) if op == "LSTM" else h0_full
        out, st = torch.func.functional_call(mod, full, (packed_in, state0))
        out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=seq)
        y_full = out.reshape(seq, batch, 2, hs).permute(0, 2, 1, 3)  # (seq, dirs, B, H)
        sel = torch.tensor(dirs)
        y_t = y_full[:, sel]
        states = [s[sel] for s in (st if op == "LSTM" else (st,))]

    loss = (y_t * torch.tensor(gys[0])).sum()
    for s, g in zip(states, gys[1:]):
        loss = loss + (s * torch.tensor(g)).sum()
    np.testing.assert_allclose(y_t.detach().numpy(), outs[0], rtol=1e-10, atol=1e-12)  # same layer
    leaves = [x_t, w_t, r_t, b_t, None, h0_t] + ([c0_t] if op == "LSTM" else [])
    torch_grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    it = iter(torch_grads)
    for pos, t in enumerate(leaves):
        if t is None:
            continue
        np.testing.assert_allclose(ours[pos], next(it).numpy(), rtol=1e-4, atol=1e-10, err_msg=f"input {pos}")


# ---------------------------------------------------------------- through the Trainer

T, F, E, H, C = 6, 3, 8, 12, 3


def _seq_model(op="LSTM", *, layout=1, **attrs):
    """x (N, T, F) -> Gemm embedding -> op (layout 1) -> last Y_h -> Gemm head -> logits (N, C)."""
    rng = np.random.default_rng(0)
    g = GATES[op]
    p = {"emb.w": rng.standard_normal((F, E)) * 0.5, "emb.b": np.zeros(E),
         "rnn.W": rng.standard_normal((1, g * H, E)) * 0.3, "rnn.R": rng.standard_normal((1, g * H, H)) * 0.3,
         "rnn.B": np.zeros((1, 2 * g * H)), "head.w": rng.standard_normal((H, C)) * 0.3, "head.b": np.zeros(C)}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in p.items()]
    inits += [numpy_helper.from_array(np.array([-1, F], np.int64), "s1"),
              numpy_helper.from_array(np.array([-1, T, E], np.int64), "s2"),
              numpy_helper.from_array(np.array([-1, H], np.int64), "s3")]
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    rnn_inputs = ["es", "rnn.W", "rnn.R", "rnn.B"]
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["xf"]),
             helper.make_node("Gemm", ["xf", "emb.w", "emb.b"], ["e"]),
             helper.make_node("Reshape", ["e", "s2"], ["es"]),
             helper.make_node(op, rnn_inputs, outs, name="rnn", hidden_size=H, layout=layout, **attrs),
             helper.make_node("Reshape", ["Y_h", "s3"], ["hl"]),
             helper.make_node("Gemm", ["hl", "head.w", "head.b"], ["logits"])]
    graph = helper.make_graph(nodes, "seq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, F])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", C])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def _toy(n=256, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, T, F)).astype(np.float32)
    return x, x.sum(axis=1).argmax(axis=1)  # which feature sums highest over the sequence


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_a_recurrent_model_trains_and_its_loss_decreases(op):
    x, y = _toy()
    tr = Trainer(_seq_model(op), optimizer="adam", lr=0.01, batch_size=32, seed=0)
    hist = tr.fit((x, y), epochs=6)
    assert hist.loss[-1] < 0.6 * hist.loss[0], hist.loss
    assert hist.accuracy[-1] > 0.7, hist.accuracy


def _mixed_outputs_model():
    """Y, Y_h and Y_c all feed the output (layout 0, bidirectional, initial states trained too)."""
    rng = np.random.default_rng(2)
    hs, n_in = 3, 2
    p = {"W": rng.standard_normal((2, 4 * hs, n_in)) * 0.5, "R": rng.standard_normal((2, 4 * hs, hs)) * 0.5,
         "B": rng.standard_normal((2, 8 * hs)) * 0.2, "h0": rng.standard_normal((2, 1, hs)) * 0.3,
         "c0": rng.standard_normal((2, 1, hs)) * 0.3}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in p.items()]
    inits.append(numpy_helper.from_array(np.array([-1, 2 * hs], np.int64), "flat"))
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
        helper.make_node("LSTM", ["xt", "W", "R", "B", "", "h0", "c0"], ["Y", "Y_h", "Y_c"], hidden_size=hs,
                         direction="bidirectional"),
        helper.make_node("ReduceMean", ["Y"], ["ym"], axes=[0], keepdims=0),
        helper.make_node("Mul", ["Y_h", "Y_c"], ["hc"]),
        helper.make_node("Add", ["ym", "hc"], ["s"]),
        helper.make_node("Transpose", ["s"], ["st"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["st", "flat"], ["out"]),
    ]
    graph = helper.make_graph(nodes, "mixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, n_in])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2 * hs])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def test_whole_graph_gradients_with_y_y_h_and_y_c_in_the_loss():
    tr = Trainer(_mixed_outputs_model(), loss="mse", dtype="float64", seed=0, batch_size=1)
    assert set(tr.trainable_names) == {"W", "R", "B", "h0", "c0"}
    rng = np.random.default_rng(4)
    x, target = rng.standard_normal((1, 4, 2)), rng.standard_normal((1, 6))
    _, _, grads = tr.compute_gradients(x, target)
    eps = 1e-6
    for name in tr.trainable_names:
        flat = tr.params[name].reshape(-1)
        num = np.zeros(flat.size)
        for j in range(flat.size):
            keep = flat[j]
            flat[j] = keep + eps
            up = tr.compute_gradients(x, target)[0]
            flat[j] = keep - eps
            down = tr.compute_gradients(x, target)[0]
            flat[j] = keep
            num[j] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grads[name].reshape(-1), num, rtol=1e-5, atol=1e-9, err_msg=name)


REFUSED = [
    ("LSTM", {"clip": 2.0}, (), "clip"),
    ("LSTM", {"activations": ["Sigmoid", "Relu", "Tanh"]}, (), "activations"),
    ("LSTM", {"input_forget": 1}, (), "input_forget"),
    ("LSTM", {}, (("", None), ("", None), ("", None), ("P", np.zeros((1, 3 * H), np.float32))), "peepholes"),
    ("GRU", {"activations": ["HardSigmoid", "Tanh"]}, (), "activations"),
    ("GRU", {"clip": 1.0}, (), "clip"),
    ("RNN", {"activations": ["Relu"]}, (), "activations"),
]


@pytest.mark.parametrize("op,attrs,extra,word", REFUSED, ids=[f"{r[0]}-{r[3]}" for r in REFUSED])
def test_unsupported_settings_are_refused_at_trainer_construction(op, attrs, extra, word):
    model = _seq_model(op, **attrs)
    if extra:  # LSTM with peepholes: inputs 4-6 empty, P an initializer
        node = model.graph.node[3]
        node.input.extend([n for n, _ in extra])
        model.graph.initializer.extend([numpy_helper.from_array(a, n) for n, a in extra if n])
    with pytest.raises(TrainingError) as err:
        Trainer(model)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{op} node 'rnn'") and word in msg, msg
    assert "freeze" in msg  # and how to go on


def test_defaults_spelled_out_are_accepted_and_a_frozen_refused_layer_is_not_in_the_way():
    named = _seq_model("LSTM", activations=["Sigmoid", "Tanh", "Tanh"])
    x, y = _toy(64)
    assert Trainer(named, optimizer="adam").fit((x, y), epochs=1).loss[0] > 0
    clipped = _seq_model("LSTM", clip=2.0)
    tr = Trainer(clipped, freeze=["emb", "rnn"])  # only the head trains: no gradient through the LSTM
    assert tr.trainable_names == ["head.w", "head.b"]


def test_edgeflow_train_on_an_lstm_model(tmp_path):
    x, y = _toy(128)
    np.savez(tmp_path / "seq.npz", x=x, y=y)
    onnx.save(_seq_model("LSTM"), tmp_path / "lstm.onnx")
    out = tmp_path / "trained.onnx"
    cmd = [sys.executable, "-m", "edgeflow", "train", str(tmp_path / "lstm.onnx"), "--data", str(tmp_path / "seq.npz"),
           "--epochs", "2", "--optimizer", "adam", "--lr", "0.01", "--profile", "x86-gateway", "-o", str(out)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "epoch 2/2" in done.stdout
    onnx.checker.check_model(onnx.load(out))

    onnx.save(_seq_model("LSTM", clip=3.0), tmp_path / "clipped.onnx")
    cmd[4] = str(tmp_path / "clipped.onnx")
    refused = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    one_clear_line(refused, "LSTM", "clip")
