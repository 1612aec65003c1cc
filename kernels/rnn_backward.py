"""Backward passes of the recurrent layers LSTM, GRU (``linear_before_reset``
0 and 1) and RNN: gradients of X, W, R, B, initial_h and initial_c from the
gradients of any of Y, Y_h and Y_c.

Covered: the default activations (sigmoid/tanh; an ``activations`` list that
names exactly the defaults is accepted), forward, reverse and bidirectional,
layout 0 and 1, ``sequence_lens`` (samples whose sequence has ended pass
their state's gradient through unchanged, as the forward passes the state),
float16/32/64 (float16 works in float32, like the forward). Not covered, and
refused before training starts (:func:`training_limits`, which the trainer's
tape calls): ``clip``, other activations, LSTM peepholes (input P) and
``input_forget``.

The training forward (``@kernel.saving``) runs the same operations in the
same order as the plain forward in ``rnn.py`` (its outputs are the plain
forward's, bit for bit) and also keeps, per direction and step, the gate
activations and the states the step started from. The backward walks time
backwards on the whole batch at once: per step one (B, G*H) @ (G*H, H)
product carries the gradient to the previous state; the gradients of W, R
and X are then one GEMM each over all steps. Without the saved record (the
trainer's ``save_workspace=False``) the backward runs the recording forward
again from the inputs.
"""

from __future__ import annotations

import numpy as np

from ._nn import OpError, text
from .rnn import (
    _gather_time,
    _initial,
    _outputs,
    _project,
    _setup,
    _sigmoid_,
    _time_index,
    _work,
    gru,
    lstm,
    rnn,
)

_DEFAULT_ACTS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh"), "RNN": ("tanh",)}
_HOW = "the backward covers the default sigmoid/tanh activations without clip, peepholes or input_forget"


def training_limits(op_type: str, attrs: dict, inputs: list[str]) -> str | None:
    """Why a node's settings have no backward (one clause naming the attribute), or None."""
    if op_type not in _DEFAULT_ACTS:
        return None
    if attrs.get("clip") is not None:
        return f"attribute clip={attrs['clip']} is not supported in training ({_HOW})"
    acts = attrs.get("activations")
    if acts:
        names = tuple(text(a).lower() for a in acts)
        default = _DEFAULT_ACTS[op_type]
        if names not in (default, default * 2):
            shown = [text(a) for a in acts]
            return f"attribute activations={shown} is not supported in training ({_HOW})"
    if op_type == "LSTM":
        if int(attrs.get("input_forget", 0) or 0):
            return f"attribute input_forget=1 is not supported in training ({_HOW})"
        if len(inputs) > 7 and inputs[7]:
            return f"peepholes (input P {inputs[7]!r}) are not supported in training ({_HOW})"
    return None


def _refuse(op_type: str, attrs: dict, p=None) -> None:
    why = training_limits(op_type, attrs, ["x"] * 7 + (["P"] if p is not None else []))
    if why:
        raise OpError(f"{op_type}: {why}")


# ---------------------------------------------------------------- recording forwards


def _lens_alive(lens, t):
    return None if lens is None else (t < lens)[:, None]


def _lstm_record(x, w, r, b, sequence_lens, initial_h, initial_c, direction, layout, hidden_size, n_outputs):
    """The plain LSTM forward (fast path) keeping, per direction, the gates i, o, f, g (seq, B, 4H)
    and the hidden and cell states (seq + 1, B, H) of every step."""
    if layout and initial_c is not None:
        initial_c = np.swapaxes(initial_c, 0, 1)
    d, n_dirs, x, initial_h, seq, batch, hs, lens = _setup(
        "LSTM", x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, 4)
    wd = _work(x)
    h0 = _initial(initial_h, n_dirs, batch, hs, wd, "initial_h", "LSTM")
    c0 = _initial(initial_c, n_dirs, batch, hs, wd, "initial_c", "LSTM")
    ys, finals, recs = [], [], []
    for k in range(n_dirs):
        bw = None if b is None else b[k, : 4 * hs] + b[k, 4 * hs:]
        xproj = _project(x, w[k], bw, wd)
        rt = r[k].T.astype(wd, copy=False)
        idx = _time_index(seq, batch, lens, _reverse(d, k))
        xp = _gather_time(xproj, idx)
        del xproj
        gates_all = np.empty((seq, batch, 4 * hs), wd)
        hs_all = np.empty((seq + 1, batch, hs), wd)
        cs_all = np.empty((seq + 1, batch, hs), wd)
        hs_all[0], cs_all[0] = h0[k], c0[k]
        y = np.empty((seq, batch, hs), wd)
        h, c = h0[k], c0[k]
        with np.errstate(over="ignore"):
            for t in range(seq):
                gates = np.matmul(h, rt)
                gates += xp[t]
                sig = _sigmoid_(gates[:, : 3 * hs])
                g = np.tanh(gates[:, 3 * hs:])
                c_new = sig[:, 2 * hs:] * c
                c_new += sig[:, :hs] * g
                h_new = np.tanh(c_new)
                h_new *= sig[:, hs:2 * hs]
                gates[:, 3 * hs:] = g
                gates_all[t] = gates
                alive = _lens_alive(lens, t)
                if alive is not None:
                    h_out = np.where(alive, h_new, 0)
                    h_new, c_new = np.where(alive, h_new, h), np.where(alive, c_new, c)
                else:
                    h_out = h_new
                y[t] = h_out
                h, c = h_new, c_new
                hs_all[t + 1], cs_all[t + 1] = h, c
        y = _scatter_time(y, idx)
        state = (h, c)
        if lens is not None and np.any(lens == 0):
            empty = (lens == 0)[:, None]
            state = tuple(np.where(empty, 0, s) for s in state)
        ys.append(y)
        finals.append(state)
        recs.append((idx, gates_all, hs_all, cs_all))
    out = _outputs(np.stack(ys, axis=1), finals, layout, x.dtype, n_outputs, 2)
    return out, {"dirs": recs, "lens": lens, "direction": d}


def _gru_record(x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, linear_before_reset,
                n_outputs):
    """The plain GRU forward (fast path) keeping, per direction, z and r (seq, B, 2H), the candidate
    h~ (seq, B, H), the hidden states (seq + 1, B, H) and, with linear_before_reset, H R_h^T + Rb_h."""
    d, n_dirs, x, initial_h, seq, batch, hs, lens = _setup(
        "GRU", x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, 3)
    wd = _work(x)
    h0 = _initial(initial_h, n_dirs, batch, hs, wd, "initial_h", "GRU")
    ys, finals, recs = [], [], []
    for k in range(n_dirs):
        bw = None if b is None else b[k, : 3 * hs].astype(wd)
        br = np.zeros(3 * hs, wd) if b is None else b[k, 3 * hs:].astype(wd)
        if not linear_before_reset:
            bw = (np.zeros(3 * hs, wd) if bw is None else bw) + np.concatenate([br[: 2 * hs], np.zeros(hs, wd)])
        xproj = _project(x, w[k], bw, wd)
        rt_zr = r[k].T.astype(wd, copy=False)
        rt_zr_2 = r[k, : 2 * hs].T.astype(wd, copy=False)
        rt_h = r[k, 2 * hs:].T.astype(wd, copy=False)
        idx = _time_index(seq, batch, lens, _reverse(d, k))
        xp = _gather_time(xproj, idx)
        del xproj
        zr_all = np.empty((seq, batch, 2 * hs), wd)
        hh_all = np.empty((seq, batch, hs), wd)
        hrh_all = np.empty((seq, batch, hs), wd) if linear_before_reset else None
        hs_all = np.empty((seq + 1, batch, hs), wd)
        hs_all[0] = h0[k]
        y = np.empty((seq, batch, hs), wd)
        h = h0[k]
        with np.errstate(over="ignore"):
            for t in range(seq):
                xp_t = xp[t]
                if linear_before_reset:
                    hr = np.matmul(h, rt_zr)
                    hr += br
                    zr = hr[:, : 2 * hs]
                    zr += xp_t[:, : 2 * hs]
                    zr = _sigmoid_(zr)
                    z, rr = zr[:, :hs], zr[:, hs:]
                    hrh_all[t] = hr[:, 2 * hs:]
                    pre = rr * hr[:, 2 * hs:]
                    pre += xp_t[:, 2 * hs:]
                else:
                    zr = np.matmul(h, rt_zr_2)
                    zr += xp_t[:, : 2 * hs]
                    zr = _sigmoid_(zr)
                    z, rr = zr[:, :hs], zr[:, hs:]
                    pre = np.matmul(rr * h, rt_h)
                    pre += xp_t[:, 2 * hs:]
                    pre += br[2 * hs:]
                hh = np.tanh(pre, out=pre)
                h_new = h - hh
                h_new *= z
                h_new += hh
                zr_all[t] = zr
                hh_all[t] = hh
                alive = _lens_alive(lens, t)
                if alive is not None:
                    h_out = np.where(alive, h_new, 0)
                    h_new = np.where(alive, h_new, h)
                else:
                    h_out = h_new
                y[t] = h_out
                h = h_new
                hs_all[t + 1] = h
        y = _scatter_time(y, idx)
        if lens is not None and np.any(lens == 0):
            h = np.where((lens == 0)[:, None], 0, h)
        ys.append(y)
        finals.append((h,))
        recs.append((idx, zr_all, hh_all, hrh_all, hs_all))
    out = _outputs(np.stack(ys, axis=1), finals, layout, x.dtype, n_outputs, 1)
    return out, {"dirs": recs, "lens": lens, "direction": d}


def _rnn_record(x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, n_outputs):
    """The plain RNN forward (tanh) keeping, per direction, the hidden states (seq + 1, B, H) and
    each step's tanh output (seq, B, H)."""
    d, n_dirs, x, initial_h, seq, batch, hs, lens = _setup(
        "RNN", x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, 1)
    wd = _work(x)
    h0 = _initial(initial_h, n_dirs, batch, hs, wd, "initial_h", "RNN")
    ys, finals, recs = [], [], []
    for k in range(n_dirs):
        bw = None if b is None else b[k, :hs] + b[k, hs:]
        xproj = _project(x, w[k], bw, wd)
        rt = r[k].T.astype(wd, copy=False)
        idx = _time_index(seq, batch, lens, _reverse(d, k))
        xp = _gather_time(xproj, idx)
        del xproj
        act_all = np.empty((seq, batch, hs), wd)
        hs_all = np.empty((seq + 1, batch, hs), wd)
        hs_all[0] = h0[k]
        y = np.empty((seq, batch, hs), wd)
        h = h0[k]
        for t in range(seq):
            h_new = np.tanh(xp[t] + h @ rt)
            act_all[t] = h_new
            alive = _lens_alive(lens, t)
            if alive is not None:
                h_out = np.where(alive, h_new, 0)
                h_new = np.where(alive, h_new, h)
            else:
                h_out = h_new
            y[t] = h_out
            h = h_new
            hs_all[t + 1] = h
        y = _scatter_time(y, idx)
        if lens is not None and np.any(lens == 0):
            h = np.where((lens == 0)[:, None], 0, h)
        ys.append(y)
        finals.append((h,))
        recs.append((idx, act_all, hs_all))
    out = _outputs(np.stack(ys, axis=1), finals, layout, x.dtype, n_outputs, 1)
    return out, {"dirs": recs, "lens": lens, "direction": d}


def _reverse(direction: str, k: int) -> bool:
    return direction == "reverse" or (direction == "bidirectional" and k == 1)


def _scatter_time(a: np.ndarray, idx) -> np.ndarray:
    """Inverse of :func:`_gather_time` (``idx`` is a permutation of the steps of every sample)."""
    if idx is None:
        return a
    out = np.empty_like(a)
    out[idx, np.arange(a.shape[1])[None, :]] = a
    return out


# ---------------------------------------------------------------- shared backward plumbing


class _Grads:
    """The output gradients in layout 0 and working precision, and the input gradients' assembly."""

    def __init__(self, grads, n_states, layout, wd, n_dirs, seq, batch, hs, lens):
        grads = list(grads) + [None] * (1 + n_states - len(grads))
        gy = grads[0]
        if gy is not None:
            gy = np.transpose(gy, (1, 2, 0, 3)) if layout else gy  # (seq, dirs, B, H)
            gy = gy.astype(wd, copy=False)
        self.gy = gy
        self.gstates = []
        for g in grads[1:1 + n_states]:
            if g is None:
                g = np.zeros((n_dirs, batch, hs), wd)
            else:
                g = (np.swapaxes(g, 0, 1) if layout else g).astype(wd)  # (dirs, B, H), a copy
                if lens is not None and np.any(lens == 0):
                    g = np.where((lens == 0)[None, :, None], 0, g)  # those final states are constant 0
            self.gstates.append(g)
        self.lens = lens

    def dy(self, k: int, idx):
        """Gradient of direction ``k``'s Y in processing order, 0 past each sample's end."""
        if self.gy is None:
            return None
        g = _gather_time(self.gy[:, k], idx)
        if self.lens is not None:
            g = np.where(np.arange(g.shape[0])[:, None, None] < self.lens[None, :, None], g, 0)
        return g


def _alive_steps(lens, seq):
    """(seq, B, 1) booleans: which sample is still running at each step (None: all are)."""
    return None if lens is None else (np.arange(seq)[:, None] < lens[None, :])[:, :, None]


def _finish(inputs, needs, layout, wd, d_gates, d_r, d_b, d_states, x_work, n_gates, hs, state_pos):
    """Gradients of (X, W, R, B, sequence_lens, initial_h[, initial_c, P]) from the per-direction
    gradients of the input projections (``d_gates``: (seq, B, G*H) in time order), of R and of B."""
    x, w = inputs[0], inputs[1]
    n = len(inputs)
    want = tuple(needs) if needs is not None else (True,) * n
    want = tuple(want) + (True,) * (n - len(want))
    seq, batch, n_in = x_work.shape
    flat_x = x_work.reshape(seq * batch, n_in).astype(wd, copy=False)
    dx = np.zeros((seq * batch, n_in), wd) if want[0] else None
    dw = np.empty(w.shape, wd) if want[1] else None
    for k, dg in enumerate(d_gates):
        dgf = dg.reshape(seq * batch, n_gates * hs)
        if dw is not None:
            dw[k] = dgf.T @ flat_x
        if dx is not None:
            dx += dgf @ w[k].astype(wd, copy=False)
    out = [None] * n
    if dx is not None:
        dx = dx.reshape(seq, batch, n_in)
        out[0] = np.ascontiguousarray(np.swapaxes(dx, 0, 1) if layout else dx, dtype=x.dtype)
    if dw is not None:
        out[1] = dw.astype(w.dtype, copy=False)
    if n > 2 and want[2]:
        out[2] = np.stack(d_r).astype(inputs[2].dtype, copy=False)
    if n > 3 and inputs[3] is not None and want[3]:
        out[3] = np.stack(d_b).astype(inputs[3].dtype, copy=False)
    for pos, g in zip(state_pos, d_states):
        if n > pos and inputs[pos] is not None and want[pos]:
            out[pos] = np.ascontiguousarray(np.swapaxes(g, 0, 1) if layout else g, dtype=inputs[pos].dtype)
    return tuple(out)


def _args(inputs, size):
    return list(inputs) + [None] * (size - len(inputs))


def _x_work(x, layout):
    return np.swapaxes(x, 0, 1) if layout else x


# ---------------------------------------------------------------- LSTM


@lstm.saving
def _(x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None, *, direction="forward",
      hidden_size=None, layout=0, n_outputs=3, **_attrs):
    _refuse("LSTM", _attrs, p)
    return _lstm_record(x, w, r, b, sequence_lens, initial_h, initial_c, direction, layout, hidden_size, n_outputs)


@lstm.backward(uses="inputs")
def _(grads, inputs, outputs, *, direction="forward", hidden_size=None, layout=0, needs_grad=None, saved=None,
      **_attrs):
    x, w, r, b, seq_lens, h0, c0, p = _args(inputs, 8)
    _refuse("LSTM", _attrs, p)
    if saved is None:
        _, saved = _lstm_record(x, w, r, b, seq_lens, h0, c0, direction, layout, hidden_size, 1)
    wd = _work(x)
    hs = r.shape[-1]
    seq, batch = (x.shape[1], x.shape[0]) if layout else (x.shape[0], x.shape[1])
    lens, recs = saved["lens"], saved["dirs"]
    n_dirs = len(recs)
    gr = _Grads(grads, 2, layout, wd, n_dirs, seq, batch, hs, lens)
    alive_all = _alive_steps(lens, seq)
    d_gates, d_r, d_b, dh0s, dc0s = [], [], [], [], []
    for k, (idx, gates_all, hs_all, cs_all) in enumerate(recs):
        rk = r[k].astype(wd, copy=False)
        dy = gr.dy(k, idx)
        dh, dc = gr.gstates[0][k], gr.gstates[1][k]
        dg_all = np.empty((seq, batch, 4 * hs), wd)
        for t in range(seq - 1, -1, -1):
            g4 = gates_all[t]
            i, o, f, g = g4[:, :hs], g4[:, hs:2 * hs], g4[:, 2 * hs:3 * hs], g4[:, 3 * hs:]
            c_prev, c = cs_all[t], cs_all[t + 1]
            dh_t = dh if dy is None else dh + dy[t]
            tc = np.tanh(c)
            dc_t = dh_t * o
            dc_t *= 1 - tc * tc
            dc_t += dc
            dg = dg_all[t]
            np.multiply(dc_t * g, i * (1 - i), out=dg[:, :hs])
            np.multiply(dh_t * tc, o * (1 - o), out=dg[:, hs:2 * hs])
            np.multiply(dc_t * c_prev, f * (1 - f), out=dg[:, 2 * hs:3 * hs])
            np.multiply(dc_t * i, 1 - g * g, out=dg[:, 3 * hs:])
            dc_prev = dc_t * f
            if alive_all is not None:
                alive = alive_all[t]
                dg[...] = np.where(alive, dg, 0)
                dh = np.where(alive, dg @ rk, dh_t)
                dc = np.where(alive, dc_prev, dc)  # a frozen state passes its gradient on as it is
            else:
                dh = dg @ rk
                dc = dc_prev
        dflat = dg_all.reshape(seq * batch, 4 * hs)
        d_r.append(dflat.T @ hs_all[:seq].reshape(seq * batch, hs))
        db = dflat.sum(axis=0)
        d_b.append(np.concatenate([db, db]))
        d_gates.append(_scatter_time(dg_all, idx))
        dh0s.append(dh)
        dc0s.append(dc)
    return _finish(inputs, needs_grad, layout, wd, d_gates, d_r, d_b, (np.stack(dh0s), np.stack(dc0s)),
                   _x_work(x, layout), 4, hs, (5, 6))


# ---------------------------------------------------------------- GRU


@gru.saving
def _(x, w, r, b=None, sequence_lens=None, initial_h=None, *, direction="forward", hidden_size=None, layout=0,
      linear_before_reset=0, n_outputs=2, **_attrs):
    _refuse("GRU", _attrs)
    return _gru_record(x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, linear_before_reset,
                       n_outputs)


@gru.backward(uses="inputs")
def _(grads, inputs, outputs, *, direction="forward", hidden_size=None, layout=0, linear_before_reset=0,
      needs_grad=None, saved=None, **_attrs):
    x, w, r, b, seq_lens, h0 = _args(inputs, 6)
    _refuse("GRU", _attrs)
    lbr = bool(linear_before_reset)
    if saved is None:
        _, saved = _gru_record(x, w, r, b, seq_lens, h0, direction, layout, hidden_size, linear_before_reset, 1)
    wd = _work(x)
    hs = r.shape[-1]
    seq, batch = (x.shape[1], x.shape[0]) if layout else (x.shape[0], x.shape[1])
    lens, recs = saved["lens"], saved["dirs"]
    n_dirs = len(recs)
    gr = _Grads(grads, 1, layout, wd, n_dirs, seq, batch, hs, lens)
    alive_all = _alive_steps(lens, seq)
    d_gates, d_r, d_b, dh0s = [], [], [], []
    for k, (idx, zr_all, hh_all, hrh_all, hs_all) in enumerate(recs):
        rk = r[k].astype(wd, copy=False)
        r_zr, r_h = rk[: 2 * hs], rk[2 * hs:]
        dy = gr.dy(k, idx)
        dh = gr.gstates[0][k]
        dg_all = np.empty((seq, batch, 3 * hs), wd)  # gradients of the input projections z, r, h
        dhrh_all = np.empty((seq, batch, hs), wd) if lbr else None  # of H R_h^T + Rb_h
        for t in range(seq - 1, -1, -1):
            z, rr = zr_all[t][:, :hs], zr_all[t][:, hs:]
            hh, h_prev = hh_all[t], hs_all[t]
            dh_t = dh if dy is None else dh + dy[t]
            dg = dg_all[t]
            dpre = dg[:, 2 * hs:]
            np.multiply(dh_t * (1 - z), 1 - hh * hh, out=dpre)
            if lbr:
                dhrh = dhrh_all[t]
                np.multiply(dpre, rr, out=dhrh)
                dr = dpre * hrh_all[t]
            else:
                drh = dpre @ r_h
                dr = drh * h_prev
            np.multiply(dh_t * (h_prev - hh), z * (1 - z), out=dg[:, :hs])
            np.multiply(dr, rr * (1 - rr), out=dg[:, hs:2 * hs])
            if alive_all is not None:
                alive = alive_all[t]
                dg[...] = np.where(alive, dg, 0)
                if lbr:
                    dhrh[...] = np.where(alive, dhrh, 0)
            dh_prev = dh_t * z
            dh_prev += dg[:, : 2 * hs] @ r_zr
            if lbr:
                dh_prev += dhrh @ r_h
            else:
                dh_prev += drh * rr
            dh = dh_prev if alive_all is None else np.where(alive_all[t], dh_prev, dh_t)
        dflat = dg_all.reshape(seq * batch, 3 * hs)
        h_flat = hs_all[:seq].reshape(seq * batch, hs)
        dr_k = np.empty((3 * hs, hs), wd)
        dr_k[: 2 * hs] = dflat[:, : 2 * hs].T @ h_flat
        db_w = dflat.sum(axis=0)
        if lbr:
            dhrh_flat = dhrh_all.reshape(seq * batch, hs)
            dr_k[2 * hs:] = dhrh_flat.T @ h_flat
            db_r = np.concatenate([db_w[: 2 * hs], dhrh_flat.sum(axis=0)])
        else:
            rh = (zr_all[:, :, hs:] * hs_all[:seq]).reshape(seq * batch, hs)
            dr_k[2 * hs:] = dflat[:, 2 * hs:].T @ rh
            db_r = db_w
        d_r.append(dr_k)
        d_b.append(np.concatenate([db_w, db_r]))
        d_gates.append(_scatter_time(dg_all, idx))
        dh0s.append(dh)
    return _finish(inputs, needs_grad, layout, wd, d_gates, d_r, d_b, (np.stack(dh0s),), _x_work(x, layout), 3, hs,
                   (5,))


# ---------------------------------------------------------------- RNN


@rnn.saving
def _(x, w, r, b=None, sequence_lens=None, initial_h=None, *, direction="forward", hidden_size=None, layout=0,
      n_outputs=2, **_attrs):
    _refuse("RNN", _attrs)
    return _rnn_record(x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, n_outputs)


@rnn.backward(uses="inputs")
def _(grads, inputs, outputs, *, direction="forward", hidden_size=None, layout=0, needs_grad=None, saved=None,
      **_attrs):
    x, w, r, b, seq_lens, h0 = _args(inputs, 6)
    _refuse("RNN", _attrs)
    if saved is None:
        _, saved = _rnn_record(x, w, r, b, seq_lens, h0, direction, layout, hidden_size, 1)
    wd = _work(x)
    hs = r.shape[-1]
    seq, batch = (x.shape[1], x.shape[0]) if layout else (x.shape[0], x.shape[1])
    lens, recs = saved["lens"], saved["dirs"]
    n_dirs = len(recs)
    gr = _Grads(grads, 1, layout, wd, n_dirs, seq, batch, hs, lens)
    alive_all = _alive_steps(lens, seq)
    d_gates, d_r, d_b, dh0s = [], [], [], []
    for k, (idx, act_all, hs_all) in enumerate(recs):
        rk = r[k].astype(wd, copy=False)
        dy = gr.dy(k, idx)
        dh = gr.gstates[0][k]
        dg_all = np.empty((seq, batch, hs), wd)
        for t in range(seq - 1, -1, -1):
            a = act_all[t]
            dh_t = dh if dy is None else dh + dy[t]
            dg = dg_all[t]
            np.multiply(dh_t, 1 - a * a, out=dg)
            if alive_all is not None:
                dg[...] = np.where(alive_all[t], dg, 0)
                dh = np.where(alive_all[t], dg @ rk, dh_t)
            else:
                dh = dg @ rk
        dflat = dg_all.reshape(seq * batch, hs)
        d_r.append(dflat.T @ hs_all[:seq].reshape(seq * batch, hs))
        db = dflat.sum(axis=0)
        d_b.append(np.concatenate([db, db]))
        d_gates.append(_scatter_time(dg_all, idx))
        dh0s.append(dh)
    return _finish(inputs, needs_grad, layout, wd, d_gates, d_r, d_b, (np.stack(dh0s),), _x_work(x, layout), 1, hs,
                   (5,))
