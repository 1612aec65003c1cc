"""com.microsoft::DynamicQuantizeLSTM: an LSTM whose W and R are int8/uint8.

onnxruntime's dynamic quantizer (``quantize_dynamic``) writes it for every
``LSTM``: W is ``(dirs, input_size, 4H)`` and R ``(dirs, H, 4H)`` — already
transposed, unlike LSTM's — with a scale and zero point per direction
(``(dirs,)``) or per direction and column (``(dirs, 4H)``); the zero points
must be 0, as onnxruntime requires. Gate order is
LSTM's (i, o, f, c); B, sequence_lens, initial_h/c and peepholes P are the
float LSTM inputs.

The activations' side is quantized the way onnxruntime's kernel does it, so
the outputs match it and not just a float LSTM: each GEMM operand A (all
time steps of X at once, then the previous H at each step) is quantized to
uint8 with DynamicQuantizeLinear's rule (range widened to hold 0, scale
``(max - min) / 255``, zero point rounded half to even), multiplied exactly in
int32 with the weights, and scaled back by ``a_scale * w_scale`` in float32.
"""

from __future__ import annotations

import numpy as np

from ._nn import OpError, text
from .registry import register

_OP = "DynamicQuantizeLSTM"


def _quantize_u8(a: np.ndarray) -> tuple[np.ndarray, np.float32, np.uint8]:
    """uint8 (q, scale, zero point) of ``a`` as DynamicQuantizeLinear / onnxruntime's GEMMs do it."""
    lo = min(float(a.min()), 0.0) if a.size else 0.0
    hi = max(float(a.max()), 0.0) if a.size else 0.0
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise OpError(f"{_OP}: an input or state holds inf or NaN; it cannot be quantized")
    scale = np.float32(1.0) if hi == lo else np.float32((np.float32(hi) - np.float32(lo)) / np.float32(255))
    zp = np.uint8(np.rint(np.clip(np.float32(0) - np.float32(lo) / scale, 0, 255)))
    q = np.clip(np.rint(a / scale) + np.float32(zp), 0, 255).astype(np.uint8)
    return q, scale, zp


def _weights(w: np.ndarray) -> tuple[np.ndarray, int]:
    """The weights as float (converted once per direction, not per step) and their bound |w|."""
    bound = 128 if w.dtype == np.int8 else 255
    k = w.shape[0]
    # float32 sums stay exact while K * 255 * bound <= 2**24; past that, float64 (exact to 2**53)
    return w.astype(np.float32 if k * 255 * bound <= 2**24 else np.float64), bound


def _qgemm(a: np.ndarray, wf: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """float32 ``a @ dequant(w)`` as onnxruntime's quantized GEMM computes it: exact
    int32 accumulation of (qa - zp) @ w, then float32 times ``a_scale * w_scale``."""
    q, s, zp = _quantize_u8(a)
    acc = np.matmul(q.astype(wf.dtype) - wf.dtype.type(zp), wf)
    return acc.astype(np.float32) * (s * w_scale).astype(np.float32)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


_ACTS = {
    "sigmoid": lambda a, b: _sigmoid,
    "tanh": lambda a, b: np.tanh,
    "relu": lambda a, b: (lambda x: np.maximum(x, 0)),
    "hardsigmoid": lambda a, b: (lambda x: np.clip(a * x + b, 0, 1)),
    "affine": lambda a, b: (lambda x: a * x + b),
    "leakyrelu": lambda a, b: (lambda x: np.where(x >= 0, x, a * x)),
    "scaledtanh": lambda a, b: (lambda x: a * np.tanh(b * x)),
}
# (takes alpha, takes beta, default alpha, default beta)
_ACT_PARAMS = {
    "hardsigmoid": (True, True, 0.2, 0.5), "affine": (True, True, 1.0, 0.0),
    "leakyrelu": (True, False, 0.01, 0.0), "scaledtanh": (True, True, 1.0, 1.0),
}


def _activations(names, alphas, betas, n_dirs: int):
    names = [text(n) for n in names] if names else ["Sigmoid", "Tanh", "Tanh"] * n_dirs
    if len(names) == 3 and n_dirs == 2:
        names = names * 2
    if len(names) != 3 * n_dirs:
        raise OpError(f"{_OP}: {len(names)} activations given; {n_dirs} direction(s) need {3 * n_dirs} (3 each)")
    al, be = list(alphas or ()), list(betas or ())
    fns = []
    for nm in names:
        if nm.lower() not in _ACTS:
            raise OpError(f"{_OP}: activation {nm!r} is not supported; use one of {', '.join(sorted(_ACTS))}")
        ua, ub, da, db = _ACT_PARAMS.get(nm.lower(), (False, False, 0.0, 0.0))
        fns.append(_ACTS[nm.lower()](al.pop(0) if ua and al else da, be.pop(0) if ub and be else db))
    return [tuple(fns[3 * d:3 * d + 3]) for d in range(n_dirs)]


def _per_dir(p, name: str, n_dirs: int, cols: int, dtype=None) -> np.ndarray:
    """A scale / zero point as (dirs, 1) or (dirs, cols)."""
    if p is None:
        raise OpError(f"{_OP}: input {name} is required")
    p = np.asarray(p)
    if dtype is not None:
        p = p.astype(dtype)
    if p.shape in ((n_dirs,), (n_dirs, 1)):
        return p.reshape(n_dirs, 1)
    if p.shape == (n_dirs, cols):
        return p
    raise OpError(f"{_OP}: {name} must have shape ({n_dirs},) or ({n_dirs}, {cols}), got {p.shape}")


def _check_shapes(d: str, n_dirs: int, x: np.ndarray, w: np.ndarray, r: np.ndarray, b, p, initial_h, initial_c,
                  hidden_size) -> tuple[int, int, int, int]:
    """Refuse bad ranks, weight types and shapes in one line each; (seq, batch, input size, hidden size)."""
    if x.ndim != 3 or w.ndim != 3 or r.ndim != 3:
        raise OpError(f"{_OP}: X, W and R must be rank 3, got shapes {x.shape}, {w.shape}, {r.shape}")
    if w.dtype not in (np.int8, np.uint8) or r.dtype not in (np.int8, np.uint8):
        raise OpError(f"{_OP}: W and R must be int8 or uint8, got {w.dtype} and {r.dtype}")
    seq, batch, n_in = x.shape
    hs = r.shape[1]
    g = 4 * hs
    if hidden_size is not None and int(hidden_size) != hs:
        raise OpError(f"{_OP}: hidden_size={hidden_size} but R has shape {r.shape}")
    if w.shape != (n_dirs, n_in, g) or r.shape != (n_dirs, hs, g):
        raise OpError(
            f"{_OP}: with direction={d!r}, input size {n_in} and hidden size {hs}, W must be "
            f"({n_dirs}, {n_in}, {g}) and R ({n_dirs}, {hs}, {g}) (transposed, as the quantizer writes them); "
            f"got {w.shape} and {r.shape}")
    if b is not None and np.shape(b) != (n_dirs, 2 * g):
        raise OpError(f"{_OP}: B must be ({n_dirs}, {2 * g}), got {np.shape(b)}")
    if p is not None and np.shape(p) != (n_dirs, 3 * hs):
        raise OpError(f"{_OP}: P must be ({n_dirs}, {3 * hs}), got {np.shape(p)}")
    for name, s in (("initial_h", initial_h), ("initial_c", initial_c)):
        if s is not None and np.shape(s) != (n_dirs, batch, hs):
            raise OpError(f"{_OP}: {name} must be ({n_dirs}, {batch}, {hs}), got {np.shape(s)}")
    return seq, batch, n_in, hs


def _weight_scales(w: np.ndarray, r: np.ndarray, w_scale, w_zero_point, r_scale, r_zero_point, n_dirs: int,
                   g: int) -> tuple[np.ndarray, np.ndarray]:
    """W's and R's scales as (dirs, 1) or (dirs, 4H), after checking that the zero points are 0."""
    ws, rs = _per_dir(w_scale, "W_scale", n_dirs, g, np.float32), _per_dir(r_scale, "R_scale", n_dirs, g, np.float32)
    wz, rz = _per_dir(w_zero_point, "W_zero_point", n_dirs, g), _per_dir(r_zero_point, "R_zero_point", n_dirs, g)
    if wz.dtype != w.dtype or rz.dtype != r.dtype:
        raise OpError(f"{_OP}: a zero point's type must be its weight's ({w.dtype}, {r.dtype}); "
                      f"got {wz.dtype} and {rz.dtype}")
    if np.any(wz) or np.any(rz):
        raise OpError(f"{_OP}: W_zero_point and R_zero_point must be 0 (symmetric weights, as onnxruntime "
                      "requires); re-quantize the model with symmetric weights")
    return ws, rs


def _check_lengths(sequence_lens, batch: int, seq: int) -> None:
    """Accept sequence_lens only when every sequence has the full length."""
    lens = None
    if sequence_lens is not None:
        lens = np.asarray(sequence_lens).reshape(-1).astype(np.int64)
        if lens.shape != (batch,) or np.any(lens < 1) or np.any(lens > seq):
            raise OpError(f"{_OP}: sequence_lens {lens.tolist()} must hold {batch} lengths in 1..{seq}")
        if np.all(lens == seq):
            lens = None
    if lens is not None:
        raise OpError(f"{_OP}: sequence_lens of different lengths are not supported by the numpy backend; "
                      "pad the batch to one length or run with the 'ort' backend")


def _direction_state(k: int, b, p, initial_h, initial_c, batch: int, hs: int):
    """Direction ``k``'s summed bias, peepholes (i, o, f) and initial (h, c), in float32."""
    g = 4 * hs
    bias = None if b is None else (np.asarray(b[k, :g], np.float32) + np.asarray(b[k, g:], np.float32))
    peep = (None, None, None) if p is None else np.split(np.asarray(p[k], np.float32), 3)
    h = np.zeros((batch, hs), np.float32) if initial_h is None else np.asarray(initial_h[k], np.float32)
    c = np.zeros((batch, hs), np.float32) if initial_c is None else np.asarray(initial_c[k], np.float32)
    return bias, peep, h, c


def _cell(z: np.ndarray, c: np.ndarray, bias, lim, peep, acts, input_forget, hs: int):
    """One time step from the gates' pre-activations ``z`` (i, o, f, c): the new (h, c) in float32."""
    pi, po, pf = peep
    f_act, g_act, h_act = acts
    if bias is not None:
        z = z + bias
    if lim is not None:
        z = np.clip(z, -lim, lim)
    zi, zo, zf, zc = z[:, :hs], z[:, hs:2 * hs], z[:, 2 * hs:3 * hs], z[:, 3 * hs:]
    if pi is not None:
        zi, zf = zi + pi * c, zf + pf * c
    i = f_act(zi)
    f = 1 - i if input_forget else f_act(zf)
    c = f * c + i * g_act(zc)
    if pi is not None:
        zo = zo + po * c
    h = (f_act(zo) * h_act(c)).astype(np.float32, copy=False)
    c = c.astype(np.float32, copy=False)
    return h, c


def _run_direction(k: int, reverse: bool, x: np.ndarray, w: np.ndarray, r: np.ndarray, ws, rs, b, p,
                   initial_h, initial_c, acts, lim, input_forget):
    """Direction ``k`` over the whole sequence: (Y in time order, last h, last c)."""
    seq, batch, n_in = x.shape
    hs = r.shape[1]
    g = 4 * hs
    xs = x[::-1] if reverse else x
    gates_x = _qgemm(xs.reshape(seq * batch, n_in), _weights(w[k])[0], ws[k]).reshape(seq, batch, g)
    rf = _weights(r[k])[0]
    bias, peep, h, c = _direction_state(k, b, p, initial_h, initial_c, batch, hs)
    y = np.empty((seq, batch, hs), np.float32)
    for t in range(seq):
        h, c = _cell(gates_x[t] + _qgemm(h, rf, rs[k]), c, bias, lim, peep, acts[k], input_forget, hs)
        y[t] = h
    return (y[::-1] if reverse else y), h, c


@register(_OP, domain="com.microsoft", dtypes={"float32"})
def dynamic_quantize_lstm(
    x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None,
    w_scale=None, w_zero_point=None, r_scale=None, r_zero_point=None,
    *, activation_alpha=None, activation_beta=None, activations=None, clip=None,
    direction="forward", hidden_size=None, input_forget=0,
):
    """Y (seq, dirs, batch, H), Y_h and Y_c of an LSTM whose W and R are int8 / uint8."""
    d = text(direction, "forward")
    if d not in ("forward", "reverse", "bidirectional"):
        raise OpError(f"{_OP}: direction={d!r} is not forward, reverse or bidirectional")
    n_dirs = 2 if d == "bidirectional" else 1
    x, w, r = np.asarray(x), np.asarray(w), np.asarray(r)
    seq, batch, n_in, hs = _check_shapes(d, n_dirs, x, w, r, b, p, initial_h, initial_c, hidden_size)
    ws, rs = _weight_scales(w, r, w_scale, w_zero_point, r_scale, r_zero_point, n_dirs, 4 * hs)
    _check_lengths(sequence_lens, batch, seq)
    acts = _activations(activations, activation_alpha, activation_beta, n_dirs)
    lim = None if clip is None else float(clip)
    x = x.astype(np.float32, copy=False)
    ys, hfin, cfin = [], [], []
    with np.errstate(over="ignore"):
        for k in range(n_dirs):
            y, h, c = _run_direction(k, d == "reverse" or k == 1, x, w, r, ws, rs, b, p, initial_h, initial_c,
                                     acts, lim, input_forget)
            ys.append(y)
            hfin.append(h)
            cfin.append(c)
    return np.stack(ys, axis=1), np.stack(hfin), np.stack(cfin)

