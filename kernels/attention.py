"""The attention family of opsets 23-28: Attention (MHA / GQA / MQA, 3-D and
4-D inputs, boolean and float masks, causal with the offset-aware frontier,
past/present key-value cache, nonpad_kv_seqlen, softcap, softmax_precision,
the four qk_matmul_output modes, sliding windows), RotaryEmbedding (SwiGLU lives in activations.py),
LinearAttention (linear / gated / delta / gated_delta recurrences) and
CausalConvWithState.

Attention is two batched matmuls around one softmax over the whole
(batch, heads) block; the mask, causal frontier, window and padding are
folded into one additive bias built once per call with broadcasting. GQA
shares each key/value head across its group of query heads by reshaping the
queries to (batch, kv_heads, group, ...) so no key/value copy is made.
float16 Attention computes in float16 (as the ONNX reference and its test
data do); the other float16 ops compute in float32.
"""

from __future__ import annotations

import numpy as np

from ._nn import OpError, choice
from .registry import FLOAT_TYPES, register

_NP_TYPES = {1: np.float32, 10: np.float16, 11: np.float64}


def _heads_4d(x: np.ndarray, heads: int, name: str) -> np.ndarray:
    """(B, S, H*D) -> (B, H, S, D)."""
    b, s, hd = x.shape
    if heads <= 0 or hd % heads:
        raise OpError(f"Attention: {name} hidden size {hd} is not divisible by its head count {heads}")
    return x.reshape(b, s, heads, hd // heads).transpose(0, 2, 1, 3)


def _work(dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _bias(q_len, kv_len, batch, wd, attn_mask, is_causal, offset, left, right, nonpad):
    """Additive bias broadcastable to (B, H, Sq, T), or None for no masking."""
    bias = None
    if attn_mask is not None:
        m = attn_mask
        pad = kv_len - m.shape[-1]
        if pad < 0:
            raise OpError(f"Attention: attn_mask's last dim {m.shape[-1]} exceeds the total sequence length {kv_len}")
        if m.dtype == np.bool_:
            m = np.where(m, wd.type(0), wd.type(-np.inf))
        else:
            m = m.astype(wd, copy=False)
        if pad:
            m = np.concatenate([m, np.full(m.shape[:-1] + (pad,), -np.inf, wd)], axis=-1)
        bias = m
    i = np.arange(q_len).reshape(q_len, 1)
    j = np.arange(kv_len).reshape(1, kv_len)
    off = np.asarray(offset).reshape(-1, 1, 1, 1) if np.ndim(offset) else int(offset)
    allowed = None
    if is_causal:
        allowed = j <= i + off
    if left >= 0 or right >= 0:
        diff = (i + off) - j
        win = np.ones(np.shape(diff), dtype=bool)
        if left >= 0:
            win &= diff <= left
        if right >= 0:
            win &= -diff <= right
        allowed = win if allowed is None else allowed & win
    if nonpad is not None:
        keep = (np.arange(kv_len)[None, :] < np.asarray(nonpad).reshape(-1, 1)).reshape(batch, 1, 1, kv_len)
        allowed = keep if allowed is None else allowed & keep
    if allowed is not None:
        add = np.where(allowed, wd.type(0), wd.type(-np.inf))
        bias = add if bias is None else bias + add
    return bias


def _softmax_rows(x: np.ndarray, fully_masked) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    e = np.exp(x - m)
    s = np.sum(e, axis=-1, keepdims=True)
    e /= np.where(s == 0, 1, s)
    if fully_masked is not None:
        e = np.where(fully_masked, 0, e)
    return e


@register("Attention", dtypes=FLOAT_TYPES, since=23)
def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    attn_mask: np.ndarray | None = None,
    past_key: np.ndarray | None = None,
    past_value: np.ndarray | None = None,
    nonpad_kv_seqlen: np.ndarray | None = None,
    *,
    is_causal: int = 0,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    qk_matmul_output_mode: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    softmax_precision: int | None = None,
    left_window_size: int = -1,
    right_window_size: int = -1,
    n_outputs: int = 1,
):
    """Outputs Y, present_key, present_value, qk_matmul_output."""
    if q.ndim != k.ndim or q.ndim != v.ndim or q.ndim not in (3, 4):
        raise OpError(f"Attention: Q, K, V must all be 3-D or all 4-D, got {q.shape}, {k.shape}, {v.shape}")
    if (past_key is None) != (past_value is None):
        raise OpError("Attention: past_key and past_value must be given together")
    if nonpad_kv_seqlen is not None and past_key is not None:
        raise OpError("Attention: nonpad_kv_seqlen cannot be combined with past_key/past_value")
    if qk_matmul_output_mode not in (0, 1, 2, 3):
        raise OpError(f"Attention: qk_matmul_output_mode={qk_matmul_output_mode} is not 0, 1, 2 or 3")
    if left_window_size < -1 or right_window_size < -1:
        raise OpError("Attention: left_window_size and right_window_size must be -1 or non-negative")
    three_d = q.ndim == 3
    out_dtype = q.dtype
    if three_d:
        if not q_num_heads or not kv_num_heads:
            raise OpError("Attention: 3-D inputs need the q_num_heads and kv_num_heads attributes")
        q = _heads_4d(q, q_num_heads, "Q")
        k = _heads_4d(k, kv_num_heads, "K")
        v = _heads_4d(v, kv_num_heads, "V")
    # float16 stays float16, step for step as the ONNX reference computes it
    # (its test data hold float16 results to rtol 1e-3)
    wd = np.dtype(np.float16) if out_dtype == np.float16 else _work(out_dtype)
    batch, hq, q_len, dh = q.shape
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv or v.shape[1] != hkv:
        raise OpError(f"Attention: {hq} query heads cannot share {hkv} key / {v.shape[1]} value heads")
    if past_key is not None:
        k = np.concatenate([past_key, k], axis=2)
        v = np.concatenate([past_value, v], axis=2)
    present_k, present_v = k, v
    kv_len = k.shape[2]
    s = (1.0 / np.sqrt(dh)) if not scale else float(scale)
    root = wd.type(np.sqrt(s))
    qs = q.astype(wd) * root
    ks = k.astype(wd) * root
    group = hq // hkv
    # (B, Hkv, group * Sq, D) @ (B, Hkv, D, T): every kv head serves its group with one matmul
    qg = qs.reshape(batch, hkv, group * q_len, dh)
    scores = np.matmul(qg, np.swapaxes(ks, -1, -2)).reshape(batch, hq, q_len, kv_len)
    if nonpad_kv_seqlen is not None and past_key is None:
        offset = np.asarray(nonpad_kv_seqlen).reshape(-1).astype(np.int64) - q_len
    else:
        offset = past_key.shape[2] if past_key is not None else 0
    bias = _bias(q_len, kv_len, batch, wd, attn_mask, is_causal, offset, left_window_size, right_window_size,
                 nonpad_kv_seqlen)
    raw = scores
    if softcap:
        scores = wd.type(softcap) * np.tanh(scores / wd.type(softcap))
    capped = scores
    if bias is not None:
        scores = scores + bias
    pre_softmax = scores
    if softmax_precision:
        if softmax_precision not in _NP_TYPES:
            raise OpError(f"Attention: softmax_precision={softmax_precision} is not 1, 10 or 11 (bfloat16 has no numpy type)")
        scores = scores.astype(_NP_TYPES[softmax_precision])
    fully = None
    if bias is not None:
        fully = np.isneginf(np.max(np.broadcast_to(bias, np.broadcast_shapes(np.shape(bias), (1, 1, q_len, kv_len))),
                                   axis=-1, keepdims=True))
    probs = _softmax_rows(scores, fully)
    y = np.matmul(probs.astype(out_dtype).astype(wd).reshape(batch, hkv, group * q_len, kv_len), v.astype(wd))
    y = y.reshape(batch, hq, q_len, v.shape[3]).astype(out_dtype)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(batch, q_len, hq * v.shape[3])
    if n_outputs == 1:
        return y
    qk = (raw, capped, pre_softmax, probs)[qk_matmul_output_mode]
    qk = np.broadcast_to(qk, (batch, hq, q_len, kv_len)).astype(out_dtype)
    return (y, present_k.astype(out_dtype, copy=False), present_v.astype(out_dtype, copy=False), qk)[:n_outputs]


@attention.workspace
def _(shapes, attrs):
    """Scores and probabilities: 2 * B * Hq * Sq * T floats."""
    q, k = shapes[0], shapes[1]
    if q is None or k is None:
        return 0
    if len(q) == 4:
        b, h, sq = q[0], q[1], q[2]
        t = k[2]
    else:
        b, sq, h = q[0], q[1], attrs.get("q_num_heads") or 1
        t = k[1]
    past = shapes[4] if len(shapes) > 4 and shapes[4] is not None else None
    if past is not None:
        t = int(t) + int(past[2])
    return 8 * int(b) * int(h) * int(sq) * int(t)


class _Scores:
    """The forward's scores and probabilities, recomputed from the inputs for the Attention backward."""

    def __init__(self, q, k, v, attn_mask, past_key, past_value, nonpad, *, is_causal, kv_num_heads, q_num_heads,
                 scale, softcap, left_window_size, right_window_size):
        self.three_d = q.ndim == 3
        if self.three_d:
            q4 = _heads_4d(q, q_num_heads, "Q")
            k4, v4 = _heads_4d(k, kv_num_heads, "K"), _heads_4d(v, kv_num_heads, "V")
        else:
            q4, k4, v4 = q, k, v
        self.wd = _work(q.dtype)
        self.batch, self.hq, self.q_len, self.dh = q4.shape
        self.hkv, self.dv = k4.shape[1], v4.shape[3]
        self.group = self.hq // self.hkv
        self._raw_scores(q4, k4, v4, past_key, past_value, scale)
        self._probabilities(attn_mask, past_key, nonpad, is_causal, softcap, left_window_size, right_window_size)

    def _raw_scores(self, q4, k4, v4, past_key, past_value, scale) -> None:
        """Keys and values with the past, the scaled queries and keys, and the raw scores Q K^T."""
        wd, batch, hq, q_len, dh, hkv, group = self.wd, self.batch, self.hq, self.q_len, self.dh, self.hkv, self.group
        kk = k4 if past_key is None else np.concatenate([past_key, k4], axis=2)
        self.vv = v4 if past_value is None else np.concatenate([past_value, v4], axis=2)
        self.kv_len = kv_len = kk.shape[2]
        self.root = root = np.sqrt((1.0 / np.sqrt(dh)) if not scale else float(scale))
        qs = q4.astype(wd) * root
        self.ks = ks = kk.astype(wd) * root
        self.qg = qg = qs.reshape(batch, hkv, group * q_len, dh)
        self.raw = np.matmul(qg, np.swapaxes(ks, -1, -2)).reshape(batch, hq, q_len, kv_len)

    def _probabilities(self, attn_mask, past_key, nonpad, is_causal, softcap, left_window_size,
                       right_window_size) -> None:
        """The softcapped scores and the softmax probabilities under the mask, causal frontier and window."""
        wd, batch, q_len, kv_len, raw = self.wd, self.batch, self.q_len, self.kv_len, self.raw
        offset = (np.asarray(nonpad).reshape(-1).astype(np.int64) - q_len) if nonpad is not None and past_key is None \
            else (past_key.shape[2] if past_key is not None else 0)
        bias = _bias(q_len, kv_len, batch, wd, attn_mask, is_causal, offset, left_window_size, right_window_size,
                     nonpad)
        self.capped = capped = wd.type(softcap) * np.tanh(raw / wd.type(softcap)) if softcap else raw
        z = capped if bias is None else capped + bias
        fully = None
        if bias is not None:
            shape = np.broadcast_shapes(np.shape(bias), (1, 1, q_len, kv_len))
            fully = np.isneginf(np.max(np.broadcast_to(bias, shape), axis=-1, keepdims=True))
        self.probs = _softmax_rows(z, fully)  # (B, Hq, Sq, T)


def _through_softmax(sc: _Scores, gy: np.ndarray, dvv: np.ndarray, softcap):
    """From Y's gradient: add V's into ``dvv`` (in place); return those of Q and of the keys (with the past)."""
    wd, batch, hq, q_len, dh, hkv, dv = sc.wd, sc.batch, sc.hq, sc.q_len, sc.dh, sc.hkv, sc.dv
    group, kv_len, probs, root = sc.group, sc.kv_len, sc.probs, sc.root
    gy4 = gy.reshape(batch, q_len, hq, dv).transpose(0, 2, 1, 3) if sc.three_d else gy
    gy4 = gy4.astype(wd)
    pg = probs.reshape(batch, hkv, group * q_len, kv_len)
    gyg = gy4.reshape(batch, hkv, group * q_len, dv)
    dvv += np.matmul(np.swapaxes(pg, -1, -2), gyg)
    dp = np.matmul(gyg, np.swapaxes(sc.vv.astype(wd), -1, -2)).reshape(batch, hq, q_len, kv_len)
    dz = probs * (dp - np.sum(dp * probs, axis=-1, keepdims=True))
    if softcap:
        dz = dz * (1 - (sc.capped / wd.type(softcap)) ** 2)
    dzg = dz.reshape(batch, hkv, group * q_len, kv_len)
    dq4 = (np.matmul(dzg, sc.ks) * root).reshape(batch, hq, q_len, dh)
    dkk = np.matmul(np.swapaxes(dzg, -1, -2), sc.qg) * root
    return dq4, dkk


def _input_grads(sc: _Scores, q, past_key, past_value, dq4, dkk, dvv, n_in: int) -> tuple:
    """One gradient per input, in the inputs' layout and dtype: Q, K, V, none for the mask, then the past's."""
    past_len = 0 if past_key is None else past_key.shape[2]
    dk4 = None if dkk is None else dkk[:, :, past_len:]
    dv4 = dvv[:, :, past_len:]
    batch, three_d = sc.batch, sc.three_d

    def back(a, heads):
        """``a`` in the inputs' layout (3-D: heads merged back) and dtype."""
        if a is None:
            return None
        if three_d:
            a = a.transpose(0, 2, 1, 3).reshape(batch, a.shape[2], heads * a.shape[3])
        return a.astype(q.dtype)

    out = [back(dq4, sc.hq), back(dk4, sc.hkv), back(dv4, sc.hkv), None]
    if n_in > 4:
        out.append(None if past_key is None or dkk is None else dkk[:, :, :past_len].astype(past_key.dtype))
    if n_in > 5:
        out.append(None if past_value is None else dvv[:, :, :past_len].astype(past_value.dtype))
    out += [None] * (n_in - len(out))
    return tuple(out[:n_in])


@attention.backward(uses="inputs")
def _(grads, inputs, outputs, *, is_causal=0, kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0,
      scale=None, softcap=0.0, softmax_precision=None, left_window_size=-1, right_window_size=-1):
    """Gradients for Q, K, V (and past_key / past_value) from those of Y and
    of present_key / present_value; masks and sequence lengths get none."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    rest = list(inputs[3:]) + [None] * (7 - len(inputs))
    attn_mask, past_key, past_value, nonpad = rest[0], rest[1], rest[2], rest[3]
    gy = grads[0]
    g_pk = grads[1] if len(grads) > 1 else None
    g_pv = grads[2] if len(grads) > 2 else None
    n_in = len(inputs)
    if gy is None and g_pk is None and g_pv is None:
        return (None,) * n_in
    sc = _Scores(q, k, v, attn_mask, past_key, past_value, nonpad, is_causal=is_causal, kv_num_heads=kv_num_heads,
                 q_num_heads=q_num_heads, scale=scale, softcap=softcap, left_window_size=left_window_size,
                 right_window_size=right_window_size)
    dq4 = dkk = None
    dvv = np.zeros((sc.batch, sc.hkv, sc.kv_len, sc.dv), dtype=sc.wd)
    if gy is not None:
        dq4, dkk = _through_softmax(sc, gy, dvv, softcap)
    if g_pk is not None:
        dkk = g_pk.astype(sc.wd) if dkk is None else dkk + g_pk
    if g_pv is not None:
        dvv = dvv + g_pv
    return _input_grads(sc, q, past_key, past_value, dq4, dkk, dvv, n_in)


@register("RotaryEmbedding", dtypes=FLOAT_TYPES, since=23)
def rotary_embedding(
    x: np.ndarray,
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
    position_ids: np.ndarray | None = None,
    *,
    interleaved: int = 0,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
) -> np.ndarray:
    """Rotate the first ``rotary_embedding_dim`` features of each head: x is
    (B, H, S, D) or (B, S, H*D); the caches (S or max_pos, dim/2), indexed by
    ``position_ids`` (B, S) when given, else (B, S, dim/2)."""
    four_d = x.ndim == 4
    if four_d:
        xs = np.swapaxes(x, 1, 2)  # (B, S, H, D)
    elif x.ndim == 3:
        if not num_heads or x.shape[2] % num_heads:
            raise OpError(f"RotaryEmbedding: a 3-D input needs num_heads dividing {x.shape[2]}, got {num_heads}")
        xs = x.reshape(x.shape[0], x.shape[1], num_heads, -1)
    else:
        raise OpError(f"RotaryEmbedding expects a 3-D or 4-D input, got shape {x.shape}")
    d = xs.shape[3]
    rd = rotary_embedding_dim or d
    if rd > d or rd % 2:
        raise OpError(f"RotaryEmbedding: rotary_embedding_dim {rd} must be even and at most the head size {d}")
    cos, sin = cos_cache, sin_cache
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.shape[-1] != rd // 2 or sin.shape[-1] != rd // 2:
        raise OpError(f"RotaryEmbedding: the caches' last dim {cos.shape[-1]} must be rotary_embedding_dim/2 = {rd // 2}")
    cos = cos[..., None, :]
    sin = sin[..., None, :]
    rot = xs[..., :rd]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    out = np.empty(xs.shape, dtype=x.dtype)
    if interleaved:
        out[..., 0:rd:2] = real
        out[..., 1:rd:2] = imag
    else:
        out[..., : rd // 2] = real
        out[..., rd // 2: rd] = imag
    out[..., rd:] = xs[..., rd:]
    return np.swapaxes(out, 1, 2) if four_d else out.reshape(x.shape)


@register("CausalConvWithState", dtypes=FLOAT_TYPES, since=27)
def causal_conv_with_state(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None, past_state: np.ndarray | None = None,
    *, activation: str = "none", n_outputs: int = 2,
):
    """Depthwise causal 1-d convolution over (B, C, L) with a carried (B, C, k-1)
    state; optional SiLU. Outputs (y, present_state)."""
    act = choice("CausalConvWithState", "activation", activation, ("none", "silu", "swish"))
    if x.ndim != 3 or weight.ndim != 3 or weight.shape[0] != x.shape[1] or weight.shape[1] != 1:
        raise OpError(
            f"CausalConvWithState: input (B, C, L) and weight (C, 1, k) expected, got {x.shape} and {weight.shape}"
        )
    bsz, c, _ = x.shape
    kk = weight.shape[2]
    if past_state is None:
        past_state = np.zeros((bsz, c, kk - 1), dtype=x.dtype)
    elif past_state.shape != (bsz, c, kk - 1):
        raise OpError(f"CausalConvWithState: past_state must be ({bsz}, {c}, {kk - 1}), got {past_state.shape}")
    wd = _work(x.dtype)
    padded = np.concatenate([past_state, x], axis=2)
    length = x.shape[2]
    y = np.zeros((bsz, c, length), dtype=wd)
    w = weight[:, 0, :].astype(wd)
    for t in range(kk):
        y += padded[:, :, t:t + length] * w[:, t][None, :, None]
    if bias is not None:
        y += bias.astype(wd)[None, :, None]
    y = y.astype(x.dtype).astype(wd)
    if act != "none":
        with np.errstate(over="ignore"):
            y = y / (1 + np.exp(-y))
    present = padded[:, :, padded.shape[2] - (kk - 1):]
    return (y.astype(x.dtype), np.ascontiguousarray(present))[:n_outputs] if n_outputs > 1 else y.astype(x.dtype)


@register("LinearAttention", dtypes=FLOAT_TYPES, since=27)
def linear_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    past_state: np.ndarray | None = None,
    decay: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    *,
    chunk_size: int = 64,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    scale: float = 0.0,
    update_rule: str = "gated_delta",
    n_outputs: int = 2,
):
    """Recurrent linear attention over (B, T, H*D) inputs with a (B, Hkv, Dk, Dv)
    state S: optionally decayed (S *= exp(g)), delta-corrected
    (v <- beta * (v - S^T k)), updated S += k v^T, read o = scale * q S.
    One loop over time, vectorised over batch and heads. Outputs
    (output, present_state)."""
    del chunk_size  # a tuning hint: no effect on the result
    rule = choice("LinearAttention", "update_rule", update_rule, ("linear", "gated", "delta", "gated_delta"))
    if not q_num_heads or not kv_num_heads or q_num_heads % kv_num_heads:
        raise OpError(f"LinearAttention: q_num_heads ({q_num_heads}) must be a positive multiple of "
                      f"kv_num_heads ({kv_num_heads})")
    gating = rule in ("gated", "gated_delta")
    delta = rule in ("delta", "gated_delta")
    if gating != (decay is not None):
        raise OpError(f"LinearAttention: update_rule {rule!r} {'needs' if gating else 'forbids'} the decay input")
    if delta != (beta is not None):
        raise OpError(f"LinearAttention: update_rule {rule!r} {'needs' if delta else 'forbids'} the beta input")
    for name, arr in (("query", query), ("key", key), ("value", value)):
        if arr.ndim != 3:
            raise OpError(f"LinearAttention: {name} must be (B, T, H*D), got shape {arr.shape}")
    b, t, _ = query.shape
    hq, hkv = int(q_num_heads), int(kv_num_heads)
    dk = query.shape[2] // hq
    dv = value.shape[2] // hkv
    group = hq // hkv
    f = np.float32 if query.dtype != np.float64 else np.float64
    q4 = query.reshape(b, t, hkv, group, dk).astype(f)  # heads grouped by their kv head
    k4 = key.reshape(b, t, hkv, dk).astype(f)
    v4 = value.reshape(b, t, hkv, dv).astype(f)
    if gating:
        if decay.ndim != 3 or decay.shape[-1] not in (hkv, hkv * dk):
            raise OpError(f"LinearAttention: decay must be (B, T, {hkv}) or (B, T, {hkv * dk}), got {decay.shape}")
        g4 = np.exp(decay.astype(f).reshape(b, t, hkv, -1))  # (B, T, Hkv, 1 or Dk)
    if delta:
        if beta.ndim != 3 or beta.shape[-1] not in (hkv, 1):
            raise OpError(f"LinearAttention: beta must be (B, T, {hkv}) or (B, T, 1), got {beta.shape}")
        b4 = beta.astype(f).reshape(b, t, -1, 1)  # (B, T, Hkv or 1, 1)
    if past_state is not None:
        if past_state.shape != (b, hkv, dk, dv):
            raise OpError(f"LinearAttention: past_state must be ({b}, {hkv}, {dk}, {dv}), got {past_state.shape}")
        state = past_state.astype(f)
        state_dtype = past_state.dtype
    else:
        state = np.zeros((b, hkv, dk, dv), dtype=f)
        state_dtype = query.dtype
    s = f(1.0 / np.sqrt(dk)) if not scale else f(scale)
    out = np.empty((b, t, hkv, group, dv), dtype=f)
    for i in range(t):
        kt, vt = k4[:, i], v4[:, i]  # (B, Hkv, Dk), (B, Hkv, Dv)
        if gating:
            state = state * g4[:, i][..., None]
        if delta:
            retrieved = np.matmul(kt[:, :, None, :], state)[:, :, 0]  # (B, Hkv, Dv)
            vt = b4[:, i] * (vt - retrieved)
        state = state + kt[..., :, None] * vt[..., None, :]
        out[:, i] = s * np.matmul(q4[:, i], state)  # (B, Hkv, group, Dv)
    y = out.reshape(b, t, hq * dv).astype(query.dtype)
    if n_outputs == 1:
        return y
    return y, state.astype(state_dtype)
