"""Recurrent layers: LSTM, GRU and RNN (forward, reverse, bidirectional;
sequence_lens, initial states, peepholes, clip, activation lists with
alpha/beta, layout 0 and 1, all outputs).

Per direction the input projection ``X @ W^T + Wb`` is one matmul over all
time steps; only the recurrence ``H @ R^T`` runs in a Python loop over time,
on the whole batch at once. Variable ``sequence_lens`` are handled without
per-sample loops: a reverse direction first reverses each sample within its
own length (one gather), every direction then runs forward and freezes the
state of samples whose sequence has ended (outputs past the end are 0, as
the spec and onnxruntime have it).

float16 runs in float32 and converts back.
"""

from __future__ import annotations

import numpy as np

from ._nn import OpError, text
from .registry import FLOAT_TYPES, register


def _sigmoid(x):
    # exp(-x) may overflow to inf for very negative x: 1 / inf = 0 is right
    # (the time loop runs under np.errstate(over="ignore"))
    e = np.exp(-x)
    e += 1
    return np.reciprocal(e, out=e)


def _sigmoid_(x):
    """In place on a view."""
    np.negative(x, out=x)
    return _sigmoid_of_negated_(x)


def _sigmoid_of_negated_(x):
    """sigmoid(-x) = 1 / (1 + exp(x)), in place on a view: for gates whose weights already hold the negation."""
    np.exp(x, out=x)
    x += 1
    return np.reciprocal(x, out=x)


def _act(name: str, alpha, beta):
    n = name.lower()
    if n == "sigmoid":
        return _sigmoid
    if n == "tanh":
        return np.tanh
    if n == "relu":
        return lambda x: np.maximum(x, 0)
    if n == "affine":
        return lambda x: alpha * x + beta
    if n == "leakyrelu":
        return lambda x: np.where(x >= 0, x, alpha * x)
    if n == "thresholdedrelu":
        return lambda x: np.where(x > alpha, x, 0)
    if n == "scaledtanh":
        return lambda x: alpha * np.tanh(beta * x)
    if n == "hardsigmoid":
        return lambda x: np.clip(alpha * x + beta, 0, 1)
    if n == "elu":
        return lambda x: np.where(x >= 0, x, alpha * (np.exp(np.minimum(x, 0)) - 1))
    if n == "softsign":
        return lambda x: x / (1 + np.abs(x))
    if n == "softplus":
        return lambda x: np.logaddexp(x, 0)
    raise OpError(f"recurrent op: activation {name!r} is not an ONNX RNN activation")


# (uses alpha, uses beta, default alpha, default beta)
_PARAMS = {
    "affine": (True, True, 1.0, 0.0), "leakyrelu": (True, False, 0.01, 0.0),
    "thresholdedrelu": (True, False, 1.0, 0.0), "scaledtanh": (True, True, 1.0, 1.0),
    "hardsigmoid": (True, True, 0.2, 0.5), "elu": (True, False, 1.0, 0.0),
}


def _activations(op: str, names, alphas, betas, per_dir: tuple[str, ...], n_dirs: int):
    """One tuple of callables per direction; alpha/beta values are consumed in
    order by the activations that take them (onnxruntime's rule)."""
    names = [text(n) for n in names] if names else list(per_dir) * n_dirs
    if len(names) == len(per_dir) and n_dirs == 2:
        names = names * 2
    if len(names) != len(per_dir) * n_dirs:
        raise OpError(
            f"{op}: {len(names)} activations given; {n_dirs} direction(s) need {len(per_dir) * n_dirs} "
            f"({len(per_dir)} each)"
        )
    al, be = list(alphas or ()), list(betas or ())
    fns = []
    for nm in names:
        ua, ub, da, db = _PARAMS.get(nm.lower(), (False, False, 0.0, 0.0))
        a = al.pop(0) if ua and al else da
        b = be.pop(0) if ub and be else db
        fns.append(_act(nm, a, b))
    k = len(per_dir)
    return [tuple(fns[d * k:(d + 1) * k]) for d in range(n_dirs)]


def _setup(op, x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, n_gates):
    d = text(direction, "forward")
    if d not in ("forward", "reverse", "bidirectional"):
        raise OpError(f"{op}: direction={d!r} is not forward, reverse or bidirectional")
    n_dirs = 2 if d == "bidirectional" else 1
    if x.ndim != 3 or w.ndim != 3 or r.ndim != 3:
        raise OpError(f"{op}: X, W and R must be rank 3, got shapes {x.shape}, {w.shape}, {r.shape}")
    if layout:
        x = np.swapaxes(x, 0, 1)
        if initial_h is not None:
            initial_h = np.swapaxes(initial_h, 0, 1)
    seq, batch, _ = x.shape
    hs = r.shape[-1]
    if hidden_size is not None and int(hidden_size) != hs:
        raise OpError(f"{op}: hidden_size={hidden_size} but R has shape {r.shape}")
    if w.shape[0] != n_dirs or w.shape[1] != n_gates * hs or w.shape[2] != x.shape[2] or r.shape != (n_dirs, n_gates * hs, hs):
        raise OpError(
            f"{op}: with direction={d!r} and hidden size {hs}, W must be ({n_dirs}, {n_gates * hs}, {x.shape[2]}) "
            f"and R ({n_dirs}, {n_gates * hs}, {hs}); got {w.shape} and {r.shape}"
        )
    if b is not None and b.shape != (n_dirs, 2 * n_gates * hs):
        raise OpError(f"{op}: B must be ({n_dirs}, {2 * n_gates * hs}), got {b.shape}")
    lens = None
    if sequence_lens is not None:
        lens = np.asarray(sequence_lens).reshape(-1).astype(np.int64)
        if lens.shape != (batch,) or np.any(lens < 0) or np.any(lens > seq):
            raise OpError(f"{op}: sequence_lens {lens.tolist()} must hold {batch} lengths in 0..{seq}")
        if np.all(lens == seq):
            lens = None
    return d, n_dirs, x, initial_h, seq, batch, hs, lens


def _split2(a, n):
    return a[:, :n], a[:, n:]


def _work(x):
    return np.float64 if x.dtype == np.float64 else np.float32


def _time_index(seq: int, batch: int, lens, reverse: bool):
    """(seq, batch) source step of every processed step, or None for the identity."""
    if not reverse:
        return None
    steps = np.arange(seq)[:, None]
    if lens is None:
        return np.broadcast_to(seq - 1 - steps, (seq, batch))
    return np.where(steps < lens[None, :], lens[None, :] - 1 - steps, steps)


def _gather_time(a: np.ndarray, idx):
    if idx is None:
        return a
    return a[idx, np.arange(a.shape[1])[None, :]]


def _project(x, w, b_w, wd):
    """X @ W^T + Wb for all steps: (seq, batch, G*H)."""
    seq, batch, n_in = x.shape
    # one 2-d GEMM (a 3-d @ 2-d matmul would loop over the leading axis)
    xp = np.matmul(x.astype(wd, copy=False).reshape(seq * batch, n_in), w.T.astype(wd, copy=False))
    xp = xp.reshape(seq, batch, -1)
    if b_w is not None:
        xp += b_w.astype(wd, copy=False)
    return xp


def _run_directions(step_fn, n_dirs, direction, xproj, lens, seq, batch, states):
    """Run ``step_fn(d, t, xp_t, state) -> (h_out, new_state)`` for every
    direction over time; returns Y (seq, dirs, batch, H) and final states."""
    ys, finals = [], []
    for d in range(n_dirs):
        reverse = direction == "reverse" or (direction == "bidirectional" and d == 1)
        idx = _time_index(seq, batch, lens, reverse)
        xp = _gather_time(xproj[d], idx)
        state = states[d]
        y = np.empty((seq, batch, state[0].shape[-1]), dtype=state[0].dtype)
        with np.errstate(over="ignore"):
            for t in range(seq):
                h, new = step_fn(d, xp[t], state)
                if lens is not None:
                    alive = (t < lens)[:, None]
                    h = np.where(alive, h, 0)
                    new = tuple(np.where(alive, n, s) for n, s in zip(new, state))
                y[t] = h
                state = new
        if idx is not None:
            inv = np.empty_like(y)
            inv[idx, np.arange(batch)[None, :]] = y
            y = inv
        if lens is not None and np.any(lens == 0):
            # onnxruntime: a sample with no steps ends in zero states, not its initial ones
            empty = (lens == 0)[:, None]
            state = tuple(np.where(empty, 0, s) for s in state)
        ys.append(y)
        finals.append(state)
    return np.stack(ys, axis=1), finals


def _outputs(y, finals, layout, dtype, n_outputs, n_states):
    res = [y]
    for k in range(n_states):
        res.append(np.stack([f[k] for f in finals]))
    if layout:
        res[0] = np.transpose(res[0], (2, 0, 1, 3))
        res[1:] = [np.swapaxes(s, 0, 1) for s in res[1:]]
    res = [np.ascontiguousarray(a, dtype=dtype) for a in res]
    return tuple(res[:n_outputs]) if n_outputs > 1 else res[0]


def _initial(init, n_dirs, batch, hs, wd, name, op):
    if init is None:
        return np.zeros((n_dirs, batch, hs), dtype=wd)
    if init.shape != (n_dirs, batch, hs):
        raise OpError(f"{op}: {name} must be ({n_dirs}, {batch}, {hs}) (layout 0), got {init.shape}")
    return init.astype(wd)


def _clipper(clip):
    if clip is None:
        return lambda v: v
    c = float(clip)
    return lambda v: np.clip(v, -c, c)


@register("LSTM", dtypes=FLOAT_TYPES, since=7)
def lstm(
    x: np.ndarray,
    w: np.ndarray,
    r: np.ndarray,
    b: np.ndarray | None = None,
    sequence_lens: np.ndarray | None = None,
    initial_h: np.ndarray | None = None,
    initial_c: np.ndarray | None = None,
    p: np.ndarray | None = None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    layout: int = 0,
    n_outputs: int = 3,
):
    """Gates i, o, f, c; peepholes i, o, f. Outputs Y, Y_h, Y_c."""
    if layout and initial_c is not None:
        initial_c = np.swapaxes(initial_c, 0, 1)
    d, n_dirs, x, initial_h, seq, batch, hs, lens = _setup(
        "LSTM", x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, 4)
    wd = _work(x)
    acts = _activations("LSTM", activations, activation_alpha, activation_beta, ("Sigmoid", "Tanh", "Tanh"), n_dirs)
    cl = _clipper(clip)
    h0 = _initial(initial_h, n_dirs, batch, hs, wd, "initial_h", "LSTM")
    c0 = _initial(initial_c, n_dirs, batch, hs, wd, "initial_c", "LSTM")
    if p is not None and p.shape != (n_dirs, 3 * hs):
        raise OpError(f"LSTM: P must be ({n_dirs}, {3 * hs}), got {p.shape}")
    if (clip is None and p is None and not input_forget and lens is None and seq > 0
            and all(a[0] is _sigmoid and a[1] is np.tanh and a[2] is np.tanh for a in acts)):
        y, h_n, c_n = _lstm_plain(x, w, r, b, h0, c0, d, n_dirs, seq, batch, hs, wd)
        if not layout and x.dtype == wd:  # already the outputs, contiguous (no per-state stack/copy)
            return (y, h_n, c_n)[:n_outputs] if n_outputs > 1 else y
        return _outputs(y, [(h_n[k], c_n[k]) for k in range(n_dirs)], layout, x.dtype, n_outputs, 2)
    xproj, rt, peep = [], [], []
    for k in range(n_dirs):
        bw = None if b is None else b[k, : 4 * hs] + b[k, 4 * hs:]
        xproj.append(_project(x, w[k], bw, wd))
        rt.append(r[k].T.astype(wd, copy=False))  # BLAS reads the transpose in place: no copy per call
        peep.append(None if p is None else p[k].astype(wd).reshape(3, hs))

    plain = [a[0] is _sigmoid and a[1] is np.tanh and a[2] is np.tanh for a in acts]
    fast = clip is None and p is None and not input_forget

    def step(k, xp_t, state):
        h, c = state
        gates = np.matmul(h, rt[k])
        gates += xp_t
        if fast and plain[k]:
            sig = _sigmoid_(gates[:, : 3 * hs])  # i, o, f at once
            c_new = sig[:, 2 * hs:] * c
            c_new += sig[:, :hs] * np.tanh(gates[:, 3 * hs:])
            h_new = np.tanh(c_new)
            h_new *= sig[:, hs:2 * hs]
            return h_new, (h_new, c_new)
        f_act, g_act, h_act = acts[k]
        gi, go, gf, gc = gates[:, :hs], gates[:, hs:2 * hs], gates[:, 2 * hs:3 * hs], gates[:, 3 * hs:]
        if peep[k] is not None:
            gi = gi + peep[k][0] * c
            gf = gf + peep[k][2] * c
        i = f_act(cl(gi))
        f = 1 - i if input_forget else f_act(cl(gf))
        c_new = f * c + i * g_act(cl(gc))
        if peep[k] is not None:
            go = go + peep[k][1] * c_new
        o = f_act(cl(go))
        h_new = o * h_act(c_new)
        return h_new, (h_new, c_new)

    y, finals = _run_directions(step, n_dirs, d, xproj, lens, seq, batch, [(h0[k], c0[k]) for k in range(n_dirs)])
    return _outputs(y, finals, layout, x.dtype, n_outputs, 2)


def _lstm_plain(x, w, r, b, h0, c0, direction, n_dirs, seq, batch, hs, wd):
    """The default LSTM (sigmoid/tanh/tanh; no clip, peepholes, input_forget or ragged
    sequence_lens) with both directions in one step: per time step one batched
    matmul of (dirs, B, H) by (dirs, H, 4H) and each elementwise op once over both
    directions, into buffers allocated once. The per-direction loop of the general
    path made every call twice, and its per-step Python (closures, tuples, a state
    per direction) was most of a batch-1 step (thai2rom's bidirectional encoder:
    9 steps, 128 hidden). The arithmetic is the general path's, op for op.

    Returns Y (seq, dirs, B, H) and the final H and C (dirs, B, H)."""
    g4 = 4 * hs
    # the input projection of every step and direction: one GEMM, written W @ X^T: OpenBLAS
    # is ~1.7x faster on it than on X @ W^T with W^T a transposed view (9x128 @ 128x1024:
    # 54 vs 90 us); xs below copies it into step order anyway
    xp = np.matmul(w.reshape(n_dirs * g4, -1).astype(wd, copy=False),
                   x.astype(wd, copy=False).reshape(seq * batch, -1).T).T
    xp = xp.reshape(seq, batch, n_dirs, g4)
    if b is not None:
        xp += (b[:, :g4] + b[:, g4:]).astype(wd, copy=False)
    rev = [direction == "reverse" or (direction == "bidirectional" and k == 1) for k in range(n_dirs)]
    xs = np.empty((seq, n_dirs, batch, g4), wd)  # step t of each direction in its processing order
    for k in range(n_dirs):
        xs[:, k] = xp[::-1, :, k] if rev[k] else xp[:, :, k]
    rt = np.swapaxes(r, 1, 2).astype(wd, copy=False)  # (dirs, H, 4H): BLAS reads the transpose in place
    gates = np.empty((n_dirs, batch, g4), wd)
    sig = gates[..., : 3 * hs]  # i, o, f
    views = (sig, sig[..., :hs], sig[..., hs:2 * hs], sig[..., 2 * hs:], gates[..., 3 * hs:])
    return _lstm_steps(xs, rt, h0, c0.copy(), gates, views, rev, negated=False)


def _lstm_steps(xs, rt, h, c, gates, views, rev, negated):
    """The time loop of :func:`_lstm_plain` and :func:`lstm_packed`: step t of every
    direction at once, ``gates = h @ rt + xs[t]`` into ``gates`` (whose layout the
    caller chose), then the sigmoid over ``sig`` = i, o, f (``views``: sig, i, o, f and
    the cell gate, all views of ``gates``), the cell and hidden state. ``negated``:
    the weights already hold -i, -o, -f (:func:`pack_lstm`), so the sigmoid skips its
    negation. ``c`` is updated in place. Returns Y (seq, dirs, B, H) in time order
    (directions in ``rev`` flipped back) and the final H and C (dirs, B, H)."""
    sig, si, so, sf, gc = views
    sigmoid_ = _sigmoid_of_negated_ if negated else _sigmoid_
    tmp = np.empty_like(c)
    ys = np.empty((len(xs),) + c.shape, c.dtype)
    with np.errstate(over="ignore"):  # exp overflows to inf for very negative gates: 1 / inf = 0 is right
        for t in range(len(xs)):
            np.matmul(h, rt, out=gates)
            gates += xs[t]
            sigmoid_(sig)
            np.tanh(gc, out=gc)
            c *= sf
            np.multiply(si, gc, out=tmp)
            c += tmp
            h = ys[t]
            np.tanh(c, out=h)
            h *= so
    h_n = h.copy()
    for k, flip in enumerate(rev):
        if flip:
            ys[:, k] = ys[::-1, k].copy()
    return ys, h_n, c


class LSTMPack:
    """An LSTM's weights laid out once for :func:`lstm_packed` (see :func:`pack_lstm`)."""

    __slots__ = ("w", "rt", "bias", "rev", "hs", "n_dirs", "n_in", "dtype")

    def __init__(self, w, rt, bias, rev, hs, n_dirs, n_in, dtype):
        self.w, self.rt, self.bias, self.rev = w, rt, bias, rev
        self.hs, self.n_dirs, self.n_in, self.dtype = hs, n_dirs, n_in, dtype


def pack_lstm(w: np.ndarray, r: np.ndarray, b: np.ndarray | None, direction="forward") -> LSTMPack | None:
    """The default LSTM's weights (sigmoid/tanh/tanh gates) prepared once, for an inference
    graph whose W, R and B are constants (the numpy backend's ``prepack_lstm`` pass): W as
    one (dirs * 4H, in) matrix, R transposed and contiguous per gate and direction
    (4, dirs, H, H), Wb + Rb summed (4, dirs, 1, H), and the sigmoid gates (i, o, f)
    negated in all three, so that each step's ``1 / (1 + exp(g))`` needs no negation
    (negating is exact: the same sums, sign flipped). Gate-major, so that every gate of
    every direction is one contiguous block per step. None where the shapes are not an
    LSTM's (the kernel then reports them)."""
    d = text(direction, "forward")
    if d not in ("forward", "reverse", "bidirectional") or w.ndim != 3 or r.ndim != 3:
        return None
    n_dirs = 2 if d == "bidirectional" else 1
    hs = r.shape[-1]
    if w.shape[:2] != (n_dirs, 4 * hs) or r.shape != (n_dirs, 4 * hs, hs):
        return None
    if b is not None and b.shape != (n_dirs, 8 * hs):
        return None
    wd = np.float64 if w.dtype == np.float64 else np.float32
    sign = np.ones(4 * hs, wd)
    sign[: 3 * hs] = -1
    wn = (w.astype(wd) * sign[:, None]).reshape(n_dirs * 4 * hs, w.shape[2])
    rn = (r.astype(wd) * sign[:, None]).reshape(n_dirs, 4, hs, hs)  # (dir, gate, out, in)
    rt = np.ascontiguousarray(rn.transpose(1, 0, 3, 2))  # (gate, dir, in, out)
    bias = None
    if b is not None:
        bsum = (b[:, : 4 * hs].astype(wd) + b[:, 4 * hs:].astype(wd)) * sign
        bias = np.ascontiguousarray(bsum.reshape(n_dirs, 4, 1, hs).transpose(1, 0, 2, 3))
    rev = tuple(d == "reverse" or (d == "bidirectional" and k == 1) for k in range(n_dirs))
    return LSTMPack(wn, rt, bias, rev, hs, n_dirs, w.shape[2], np.dtype(wd))


def lstm_packed(pack: LSTMPack, x: np.ndarray, sequence_lens=None, initial_h=None, initial_c=None):
    """The default LSTM on prepacked weights (:func:`pack_lstm`), layout 0: (Y, Y_h, Y_c).

    Or None where this path does not apply (the caller runs the kernel): x not
    (seq > 0, batch, in) of the weights' dtype, sequence lengths that are not all the
    full sequence, initial states of another shape or dtype. Like :func:`_lstm_plain`:
    the input projection of every step and direction is one GEMM, each step runs both
    directions at once (one batched matmul, each elementwise op once) into buffers
    allocated once. Here the gates are gate-major (4, dirs, batch, H), so every
    elementwise op reads and writes contiguous blocks (on the plain path's (dirs,
    batch, 4H) the sigmoid's three gates are a strided view: 1.5x slower per call at
    hidden 128), the negation is in the weights, and the attributes and shapes were
    checked at load. The arithmetic is the plain path's but for the recurrence's
    matmul, which BLAS runs on contiguous blocks of R^T (rounding: ~1e-7 relative)."""
    wd, hs, n_dirs = pack.dtype, pack.hs, pack.n_dirs
    if x.ndim != 3 or x.dtype != wd or x.shape[2] != pack.n_in or not x.shape[0]:
        return None
    seq, batch = x.shape[0], x.shape[1]
    if sequence_lens is not None:
        lens = np.asarray(sequence_lens).reshape(-1)
        if lens.shape != (batch,) or lens.dtype.kind not in "iu" or any(v != seq for v in lens.tolist()):
            return None
    state = (n_dirs, batch, hs)
    for s in (initial_h, initial_c):
        if s is not None and (s.shape != state or s.dtype != wd):
            return None
    # (dirs * 4H, seq * batch) -> per direction (seq, gate, batch, H), time reversed for a
    # reverse direction, the summed biases added on the way
    xp = np.matmul(pack.w, x.reshape(seq * batch, -1).T).reshape(n_dirs, 4, hs, seq, batch)
    xs = np.empty((seq, 4, n_dirs, batch, hs), wd)
    for k in range(n_dirs):
        src = xp[k].transpose(2, 0, 3, 1)
        if pack.rev[k]:
            src = src[::-1]
        if pack.bias is None:
            xs[:, :, k] = src
        else:
            np.add(src, pack.bias[:, k], out=xs[:, :, k])
    h = np.zeros(state, wd) if initial_h is None else initial_h
    c = np.zeros(state, wd) if initial_c is None else initial_c.copy()
    gates = np.empty((4, n_dirs, batch, hs), wd)
    views = (gates[:3], gates[0], gates[1], gates[2], gates[3])  # -i, -o, -f: sigmoid(-g) = 1 / (1 + exp(g))
    return _lstm_steps(xs, pack.rt, h, c, gates, views, pack.rev, negated=True)


@lstm.workspace
def _(shapes, attrs):
    x, w = shapes[0], shapes[1]
    if x is None or w is None:
        return 0
    seq, batch = (x[1], x[0]) if attrs.get("layout") else (x[0], x[1])
    return 4 * int(seq) * int(batch) * int(w[0]) * int(w[1])  # the input projection


@register("GRU", dtypes=FLOAT_TYPES, since=7)
def gru(
    x: np.ndarray,
    w: np.ndarray,
    r: np.ndarray,
    b: np.ndarray | None = None,
    sequence_lens: np.ndarray | None = None,
    initial_h: np.ndarray | None = None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    linear_before_reset: int = 0,
    n_outputs: int = 2,
):
    """Gates z, r, h. Outputs Y, Y_h."""
    d, n_dirs, x, initial_h, seq, batch, hs, lens = _setup(
        "GRU", x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, 3)
    wd = _work(x)
    acts = _activations("GRU", activations, activation_alpha, activation_beta, ("Sigmoid", "Tanh"), n_dirs)
    cl = _clipper(clip)
    h0 = _initial(initial_h, n_dirs, batch, hs, wd, "initial_h", "GRU")
    xproj, rt_zr, rt_zr_2, rt_h, rb = [], [], [], [], []
    fast = [clip is None and a[0] is _sigmoid and a[1] is np.tanh for a in acts]
    for k in range(n_dirs):
        bw = None if b is None else b[k, : 3 * hs].astype(wd)
        br = np.zeros(3 * hs, wd) if b is None else b[k, 3 * hs:].astype(wd)
        if not linear_before_reset:  # Rb of z and r can join Wb; Rb of h stays inside
            bw = (np.zeros(3 * hs, wd) if bw is None else bw) + np.concatenate([br[: 2 * hs], np.zeros(hs, wd)])
        xproj.append(_project(x, w[k], bw, wd))
        rt_zr.append(r[k].T.astype(wd, copy=False))  # (H, 3H), a view: BLAS transposes
        rt_zr_2.append(r[k, : 2 * hs].T.astype(wd, copy=False))  # (H, 2H)
        rt_h.append(r[k, 2 * hs:].T.astype(wd, copy=False))
        rb.append(br)

    def step(k, xp_t, state):
        (h,) = state
        f_act, g_act = acts[k]
        if linear_before_reset:
            hr = np.matmul(h, rt_zr[k])  # (B, 3H)
            hr += rb[k]
            zr = hr[:, : 2 * hs]
            zr += xp_t[:, : 2 * hs]
            if fast[k]:
                z, rr = _split2(_sigmoid_(zr), hs)
            else:
                z, rr = _split2(f_act(cl(zr)), hs)
            pre = rr * hr[:, 2 * hs:]
            pre += xp_t[:, 2 * hs:]
        else:
            zr = np.matmul(h, rt_zr_2[k])
            zr += xp_t[:, : 2 * hs]
            if fast[k]:
                z, rr = _split2(_sigmoid_(zr), hs)
            else:
                z, rr = _split2(f_act(cl(zr)), hs)
            pre = np.matmul(rr * h, rt_h[k])
            pre += xp_t[:, 2 * hs:]
            pre += rb[k][2 * hs:]
        hh = np.tanh(pre, out=pre) if fast[k] else g_act(cl(pre))
        # (1 - z) * hh + z * h = hh + z * (h - hh)
        h_new = h - hh
        h_new *= z
        h_new += hh
        return h_new, (h_new,)

    y, finals = _run_directions(step, n_dirs, d, xproj, lens, seq, batch, [(h0[k],) for k in range(n_dirs)])
    return _outputs(y, finals, layout, x.dtype, n_outputs, 1)


@gru.workspace
def _(shapes, attrs):
    return lstm.workspace_fn(shapes, attrs)


@register("RNN", dtypes=FLOAT_TYPES, since=7)
def rnn(
    x: np.ndarray,
    w: np.ndarray,
    r: np.ndarray,
    b: np.ndarray | None = None,
    sequence_lens: np.ndarray | None = None,
    initial_h: np.ndarray | None = None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    n_outputs: int = 2,
):
    """H = f(X W^T + H R^T + Wb + Rb). Outputs Y, Y_h."""
    d, n_dirs, x, initial_h, seq, batch, hs, lens = _setup(
        "RNN", x, w, r, b, sequence_lens, initial_h, direction, layout, hidden_size, 1)
    wd = _work(x)
    acts = _activations("RNN", activations, activation_alpha, activation_beta, ("Tanh",), n_dirs)
    cl = _clipper(clip)
    h0 = _initial(initial_h, n_dirs, batch, hs, wd, "initial_h", "RNN")
    xproj, rt = [], []
    for k in range(n_dirs):
        bw = None if b is None else b[k, :hs] + b[k, hs:]
        xproj.append(_project(x, w[k], bw, wd))
        rt.append(r[k].T.astype(wd, copy=False))  # BLAS reads the transpose in place: no copy per call

    def step(k, xp_t, state):
        (h,) = state
        h_new = acts[k][0](cl(xp_t + h @ rt[k]))
        return h_new, (h_new,)

    y, finals = _run_directions(step, n_dirs, d, xproj, lens, seq, batch, [(h0[k],) for k in range(n_dirs)])
    return _outputs(y, finals, layout, x.dtype, n_outputs, 1)


@rnn.workspace
def _(shapes, attrs):
    return lstm.workspace_fn(shapes, attrs)
