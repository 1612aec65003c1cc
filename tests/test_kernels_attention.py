"""The attention family against onnxruntime: Attention over grids of head
layouts (MHA / GQA / MQA, 3-D / 4-D), masks, causal, past key/value,
softcap and qk_matmul_output modes; RotaryEmbedding, LinearAttention and
CausalConvWithState; SwiGLU (no onnxruntime kernel yet) against its formula;
and an attention-style MatMul/Softmax chain at encoder size."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _nn_check import assert_matches_ort, one_node_model, run_numpy, run_ort
from test_backward_kernels import check_backward

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(23)
F = np.float32
B, S, T, D = 2, 4, 6, 8


def _attention_case(hq, hkv, mask, past, nonpad=False):
    q = RNG.standard_normal((B, hq, S, D)).astype(F)
    k = RNG.standard_normal((B, hkv, T, D)).astype(F)
    v = RNG.standard_normal((B, hkv, T, D - 2)).astype(F)
    inputs, consts, order = {"q": q, "k": k, "v": v}, {}, ["q", "k", "v"]
    total = T + (3 if past else 0)
    masks = {
        "bool2": lambda: RNG.random((S, total)) > 0.3,
        "float2": lambda: RNG.standard_normal((S, total)).astype(F),
        "bool4": lambda: RNG.random((B, 1, S, total)) > 0.3,
        "float3": lambda: RNG.standard_normal((hq, S, total)).astype(F),
        "short": lambda: RNG.standard_normal((B, hq, S, total - 2)).astype(F),  # padded with -inf
    }
    if mask:
        consts["m"] = masks[mask]()
    order.append("m" if mask else "")
    if past:
        consts["pk"] = RNG.standard_normal((B, hkv, 3, D)).astype(F)
        consts["pv"] = RNG.standard_normal((B, hkv, 3, D - 2)).astype(F)
        order += ["pk", "pv"]
    if nonpad:
        order += ["", "", "np"]
        consts["np"] = np.array([T, T - 2], np.int64)
    while order[-1] == "":
        order.pop()
    return inputs, consts, order


def _compare(m, feeds, *, mode=0):
    want, got = run_ort(m, feeds), run_numpy(m, feeds)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}"
        if i == 3 and mode == 2:
            # onnxruntime writes masked scores as the lowest float, the spec as -inf
            w = np.where(w <= np.finfo(F).min, -np.inf, w)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"output {i}")


HEADS = [(4, 4), (4, 2), (4, 1)]
MASKS = [None, "bool2", "float2", "bool4", "float3"]


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_attention_4d(hq, hkv, mask, causal, softcap):
    inputs, consts, order = _attention_case(hq, hkv, mask, past=False)
    m = one_node_model("Attention", inputs, consts, opset=23, input_order=order, is_causal=causal, softcap=softcap)
    _compare(m, inputs)


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("mask", [None, "bool4", "float3"])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_past_and_every_output(hq, hkv, mask, causal, mode):
    inputs, consts, order = _attention_case(hq, hkv, mask, past=True)
    m = one_node_model("Attention", inputs, consts, opset=23, input_order=order, n_outputs=4, is_causal=causal,
                       softcap=2.5 if mode == 1 else 0.0, qk_matmul_output_mode=mode, scale=0.2)
    _compare(m, inputs, mode=mode)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("causal", [0, 1])
def test_attention_3d(hq, hkv, causal):
    q = RNG.standard_normal((B, S, hq * D)).astype(F)
    k = RNG.standard_normal((B, T, hkv * D)).astype(F)
    v = RNG.standard_normal((B, T, hkv * 5)).astype(F)
    m = one_node_model("Attention", {"q": q, "k": k, "v": v}, opset=23, q_num_heads=hq, kv_num_heads=hkv,
                       is_causal=causal)
    _compare(m, {"q": q, "k": k, "v": v})


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_nonpad_kv_seqlen(causal):
    inputs, consts, order = _attention_case(4, 2, None, past=False, nonpad=True)
    m = one_node_model("Attention", inputs, consts, opset=24, input_order=order, is_causal=causal)
    _compare(m, inputs)


def test_short_mask_is_padded_with_minus_infinity():
    """A mask shorter than the keys (onnxruntime refuses it) means the rest is masked."""
    inputs, consts, _ = _attention_case(4, 2, "short", past=False)
    k = get_kernel("Attention", opset=24)
    m = consts["m"]
    full = np.concatenate([m, np.full(m.shape[:-1] + (2,), -np.inf, F)], axis=-1)
    np.testing.assert_array_equal(k(inputs["q"], inputs["k"], inputs["v"], m),
                                  k(inputs["q"], inputs["k"], inputs["v"], full))


def test_fully_masked_rows_are_zero_not_nan():
    k = get_kernel("Attention", opset=24)
    q = RNG.standard_normal((1, 1, 3, 4)).astype(F)
    kv = RNG.standard_normal((1, 1, 5, 4)).astype(F)
    mask = np.ones((3, 5), bool)
    mask[1] = False
    y, _, _, probs = k(q, kv, kv, mask, n_outputs=4, qk_matmul_output_mode=3)
    assert np.all(y[0, 0, 1] == 0) and np.all(probs[0, 0, 1] == 0)
    assert np.isfinite(y).all()


def test_sliding_window_equals_an_explicit_mask():
    k = get_kernel("Attention", opset=25)
    q = RNG.standard_normal((1, 2, 5, 4)).astype(F)
    kv = RNG.standard_normal((1, 2, 7, 4)).astype(F)
    i, j = np.arange(5)[:, None], np.arange(7)[None, :]
    explicit = (i - j <= 2) & (j - i <= 1)
    np.testing.assert_allclose(k(q, kv, kv, left_window_size=2, right_window_size=1), k(q, kv, kv, explicit),
                               rtol=1e-6)


def test_attention_errors():
    k = get_kernel("Attention", opset=23)
    x3 = np.zeros((1, 2, 8), F)
    with pytest.raises(KernelError, match="q_num_heads and kv_num_heads"):
        k(x3, x3, x3)
    with pytest.raises(KernelError, match="together"):
        k(np.zeros((1, 2, 3, 4), F), np.zeros((1, 2, 3, 4), F), np.zeros((1, 2, 3, 4), F), None,
          np.zeros((1, 2, 1, 4), F))
    with pytest.raises(KernelError, match="cannot share"):
        k(np.zeros((1, 3, 3, 4), F), np.zeros((1, 2, 3, 4), F), np.zeros((1, 2, 3, 4), F))


# ------------------------------------------------------------------- rotary / SwiGLU / linear attention

@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rot_dim", [0, 4])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("with_pos", [False, True])
def test_rotary_embedding(interleaved, rot_dim, rank, with_pos):
    heads, seq, d = 3, 5, 8
    x = RNG.standard_normal((2, heads, seq, d) if rank == 4 else (2, seq, heads * d)).astype(F)
    half = (rot_dim or d) // 2
    if with_pos:
        consts = {"c": RNG.standard_normal((10, half)).astype(F), "s": RNG.standard_normal((10, half)).astype(F),
                  "p": RNG.integers(0, 10, (2, seq)).astype(np.int64)}
    else:
        consts = {"c": RNG.standard_normal((2, seq, half)).astype(F),
                  "s": RNG.standard_normal((2, seq, half)).astype(F)}
    attrs = dict(interleaved=interleaved, rotary_embedding_dim=rot_dim)
    if rank == 3:
        attrs["num_heads"] = heads
    m = one_node_model("RotaryEmbedding", {"x": x}, consts, opset=23, **attrs)
    assert_matches_ort(m, {"x": x})


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("past", [False, True])
def test_linear_attention(rule, hq, hkv, past):
    b, t, dk, dv = 2, 5, 4, 3
    feeds = {"q": RNG.standard_normal((b, t, hq * dk)).astype(F)}
    consts = {"k": (RNG.standard_normal((b, t, hkv * dk)) * 0.5).astype(F),
              "v": RNG.standard_normal((b, t, hkv * dv)).astype(F)}
    order = ["q", "k", "v", "ps" if past else "", "", ""]
    if past:
        consts["ps"] = RNG.standard_normal((b, hkv, dk, dv)).astype(F)
    if rule in ("gated", "gated_delta"):
        consts["g"] = -np.abs(RNG.standard_normal((b, t, hkv))).astype(F)
        order[4] = "g"
    if rule in ("delta", "gated_delta"):
        consts["be"] = (1 / (1 + np.exp(-RNG.standard_normal((b, t, hkv))))).astype(F)
        order[5] = "be"
    while order[-1] == "":
        order.pop()
    m = one_node_model("LinearAttention", feeds, consts, opset=27, input_order=order, n_outputs=2,
                       q_num_heads=hq, kv_num_heads=hkv, update_rule=rule)
    assert_matches_ort(m, feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("act", ["none", "silu"])
@pytest.mark.parametrize("past,bias", [(False, False), (True, True)])
def test_causal_conv_with_state(act, past, bias):
    x = RNG.standard_normal((2, 6, 7)).astype(F)
    consts = {"w": RNG.standard_normal((6, 1, 4)).astype(F)}
    order = ["x", "w", "b" if bias else "", "s" if past else ""]
    if bias:
        consts["b"] = RNG.standard_normal(6).astype(F)
    if past:
        consts["s"] = RNG.standard_normal((2, 6, 3)).astype(F)
    while order[-1] == "":
        order.pop()
    m = one_node_model("CausalConvWithState", {"x": x}, consts, opset=27, input_order=order, n_outputs=2,
                       activation=act)
    assert_matches_ort(m, {"x": x})


def test_swiglu_formula_and_backward():
    a, b = RNG.standard_normal((3, 5)), RNG.standard_normal((3, 5))
    y = get_kernel("SwiGLU", opset=28, dtype="float64")(a, b, alpha=1.7)
    np.testing.assert_allclose(y, a / (1 + np.exp(-1.7 * a)) * b, rtol=1e-12)
    check_backward("SwiGLU", [a, b], dict(alpha=1.7), opset=28)
    with pytest.raises(KernelError, match="one shape"):
        get_kernel("SwiGLU", opset=28)(np.zeros((2, 3), F), np.zeros((3,), F))


# ------------------------------------------------------------------- encoder-size attention chain

def test_attention_chain_at_encoder_size():
    """MatMul -> Div -> Add(mask) -> Softmax -> MatMul, as BERT exports it,
    12 heads x 128 tokens: the numpy graph matches onnxruntime."""
    from onnx import TensorProto, helper, numpy_helper

    h, n, d = 12, 128, 32
    q = RNG.standard_normal((1, h, n, d)).astype(F)
    kt = RNG.standard_normal((1, h, d, n)).astype(F)
    v = RNG.standard_normal((1, h, n, d)).astype(F)
    mask = np.where(RNG.random((1, 1, 1, n)) > 0.1, 0, -10000).astype(F)
    nodes = [
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Div", ["s", "scale"], ["s2"]),
        helper.make_node("Add", ["s2", "mask"], ["s3"]),
        helper.make_node("Softmax", ["s3"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    g = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info(nm, TensorProto.FLOAT, a.shape) for nm, a in (("q", q), ("kt", kt), ("v", v))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(np.sqrt(d), F), "scale"), numpy_helper.from_array(mask, "mask")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert_matches_ort(m, {"q": q, "kt": kt, "v": v}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal,mask", list(itertools.product([0, 1], [None, "float2"])))
def test_attention_op_equals_the_chain(causal, mask):
    """The fused Attention op and the explicit chain agree."""
    inputs, consts, order = _attention_case(2, 2, mask, past=False)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    y = get_kernel("Attention", opset=23)(q, k, v, consts.get("m"), is_causal=causal)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    if mask:
        s = s + consts["m"]
    if causal:
        s = np.where(np.arange(T)[None, :] <= np.arange(S)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, p @ v, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------- backward

def _r(*shape):
    return np.asarray(RNG.standard_normal(shape))


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("causal,softcap", [(0, 0.0), (1, 0.0), (0, 2.0)])
def test_attention_backward(hq, hkv, causal, softcap):
    inputs = [_r(2, hq, 3, 4), _r(2, hkv, 5, 4), _r(2, hkv, 5, 3), _r(3, 5)]
    check_backward("Attention", inputs, dict(is_causal=causal, softcap=softcap, scale=0.4), opset=23,
                   wrt=[0, 1, 2], rtol=1e-5, atol=1e-7)


def test_attention_backward_3d_bool_mask_and_past():
    mask = RNG.random((3, 7)) > 0.2
    mask[:, 0] = True
    inputs = [_r(1, 3, 2 * 4), _r(1, 5, 2 * 4), _r(1, 5, 2 * 3), mask, _r(1, 2, 2, 4), _r(1, 2, 2, 3)]
    check_backward("Attention", inputs, dict(q_num_heads=2, kv_num_heads=2), opset=23, wrt=[0, 1, 2, 4, 5])
