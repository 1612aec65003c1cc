"""Backwards added for fine-tuning real models (issue 15): every op of the
suite's conv nets (PP-LCNet, PP-OCR's MobileNetV3, SqueezeNet, ResNet,
Inception, ShuffleNet) and of its transformer encoder (MiniLM) that had none.

Each is checked against float64 central finite differences
(``check_backward``) and, where PyTorch has the op, against torch's autograd
at 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_backward_kernels import away, check_backward

from edgeflow.kernels import get_kernel

RNG = np.random.default_rng(15)


def r(*shape):
    return np.asarray(RNG.standard_normal(shape))


# ---------------------------------------------------------------- torch comparisons

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test extra
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch not installed: torch comparisons skipped")


def torch_check(op, inputs, attrs, fn, *, opset=17, wrt=None, n_out=1):
    """Our backward vs torch.autograd of ``fn(*tensors)`` (float64) at 1e-5."""
    attrs = dict(attrs or {})
    kernel = get_kernel(op, "", opset, inputs[0].dtype)
    fwd_attrs = dict(attrs)
    if kernel.wants_n_outputs:
        fwd_attrs["n_outputs"] = n_out
    outs = kernel.forward(*inputs, **fwd_attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    dys = [r(*o.shape) for o in outs]
    ours = kernel.backward_fn(dys, inputs, list(outs), **attrs)
    wrt = [i for i, x in enumerate(inputs) if x is not None and x.dtype == np.float64] if wrt is None else wrt
    ts = [None if x is None else torch.tensor(x, requires_grad=i in wrt) for i, x in enumerate(inputs)]
    ref_out = fn(*ts)
    ref_out = ref_out if isinstance(ref_out, (tuple, list)) else (ref_out,)
    for o, ro in zip(outs, ref_out):
        np.testing.assert_allclose(o, ro.detach().numpy(), rtol=1e-5, atol=1e-7, err_msg=f"{op} forward")
    torch.autograd.backward(list(ref_out), [torch.tensor(d) for d in dys])
    for i in wrt:
        ref = ts[i].grad.numpy()
        scale = max(np.abs(ref).max(), 1e-12)
        np.testing.assert_allclose(ours[i], ref, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{op} input {i} vs torch")


# ---------------------------------------------------------------- element-wise

def test_pow_both_inputs():
    x = np.abs(r(3, 4)) + 0.5
    check_backward("Pow", [x, r(4) * 0.5 + 1.5])
    check_backward("Pow", [r(3, 4), np.array(2.0)], wrt=[0])


@pytest.mark.parametrize("op,make", [
    ("Exp", lambda: r(3, 4)),
    ("Log", lambda: np.abs(r(3, 4)) + 0.5),
    ("Sqrt", lambda: np.abs(r(3, 4)) + 0.5),
    ("Reciprocal", lambda: np.sign(r(3, 4)) * (np.abs(r(3, 4)) + 0.5)),
    ("Abs", lambda: away(r(3, 4))),
])
def test_unary(op, make):
    check_backward(op, [make()])


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_broadcasting(op):
    check_backward(op, [r(2, 3, 4), r(3, 1), r(4)])
    check_backward(op, [r(3, 4)])


def test_max_ties_share_the_gradient():
    a = np.array([1.0, 2.0, 3.0])
    k = get_kernel("Max", "", 17, a.dtype)
    y = k.forward(a, a.copy())
    ga, gb = k.backward_fn([np.ones(3)], [a, a.copy()], [y])
    np.testing.assert_array_equal(ga, [0.5, 0.5, 0.5])
    np.testing.assert_array_equal(gb, [0.5, 0.5, 0.5])


def test_where():
    cond = r(3, 4) > 0
    check_backward("Where", [cond, r(3, 4), r(4)], wrt=[1, 2])


@needs_torch
def test_elementwise_vs_torch():
    x = np.abs(r(3, 4)) + 0.5
    p = r(4) * 0.5 + 1.5
    torch_check("Pow", [x, p], {}, torch.pow)
    torch_check("Exp", [r(3, 4)], {}, torch.exp)
    torch_check("Log", [x], {}, torch.log)
    torch_check("Sqrt", [x], {}, torch.sqrt)
    torch_check("Reciprocal", [x], {}, torch.reciprocal)
    torch_check("Abs", [away(r(3, 4))], {}, torch.abs)
    a, b = r(3, 4), r(4)
    torch_check("Max", [a, b], {}, torch.maximum)
    torch_check("Min", [a, b], {}, torch.minimum)
    torch_check("Sum", [a, b], {}, lambda u, v: u + v)
    torch_check("Mean", [a, b], {}, lambda u, v: (u + v) / 2)
    cond = r(3, 4) > 0
    torch_check("Where", [cond, a, b], {}, torch.where, wrt=[1, 2])


# ---------------------------------------------------------------- activations

def test_clip_both_opsets():
    x = away(r(4, 5) * 3, (-1.0, 2.0))
    check_backward("Clip", [x, np.array(-1.0), np.array(2.0)], opset=13, wrt=[0])
    check_backward("Clip", [x, None, np.array(2.0)], opset=13, wrt=[0])
    check_backward("Clip", [away(r(4, 5) * 8, (0.0, 6.0))], {"min": 0.0, "max": 6.0}, opset=6)  # ReLU6


def test_hard_sigmoid():
    x = away(r(4, 5) * 4, (-2.5, 2.5))
    check_backward("HardSigmoid", [x])
    check_backward("HardSigmoid", [away(r(4, 5) * 4, (-3.0, 3.0))], {"alpha": 1 / 6, "beta": 0.5})


@pytest.mark.parametrize("op,attrs", [("Elu", {"alpha": 0.7}), ("Selu", {}), ("Softplus", {})])
def test_smooth_activations(op, attrs):
    check_backward(op, [away(r(4, 5))], attrs)


@needs_torch
def test_activations_vs_torch():
    F = torch.nn.functional
    x = away(r(4, 5) * 8, (0.0, 6.0))
    torch_check("Clip", [x, np.array(0.0), np.array(6.0)], {}, lambda u, lo, hi: torch.clamp(u, 0.0, 6.0),
                opset=13, wrt=[0])
    torch_check("Clip", [x], {"min": 0.0, "max": 6.0}, F.relu6, opset=6)
    h = away(r(4, 5) * 4, (-3.0, 3.0))
    torch_check("HardSigmoid", [h], {"alpha": 1 / 6, "beta": 0.5}, F.hardsigmoid)
    torch_check("Elu", [away(r(4, 5))], {"alpha": 0.7}, lambda u: F.elu(u, 0.7))
    torch_check("Selu", [away(r(4, 5))], {}, F.selu)
    torch_check("Softplus", [r(4, 5)], {}, F.softplus)


# ---------------------------------------------------------------- data movement

def test_split_both_opsets():
    check_backward("Split", [r(2, 7, 3), np.array([2, 4, 1])], {"axis": 1, "n_outputs": 3}, opset=13, wrt=[0])
    check_backward("Split", [r(6, 3)], {"axis": 0, "split": [1, 5], "n_outputs": 2}, opset=11)


def test_split_unused_outputs_get_zero():
    x = r(4, 6)
    k = get_kernel("Split", "", 13, x.dtype)
    outs = k.forward(x, None, axis=1, num_outputs=3, n_outputs=3)
    gx = k.backward_fn([None, np.ones((4, 2)), None], [x, None], list(outs), axis=1, num_outputs=3)[0]
    np.testing.assert_array_equal(gx[:, 2:4], 1.0)
    assert gx[:, :2].sum() == 0 and gx[:, 4:].sum() == 0


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1], [3], [0], None), ([0, 1], [4, -1], [0, 2], [2, 1]), ([-1], [-(2**63)], [1], [-2]),
    ([0], [2**63 - 1], [-1], [3]),
])
def test_slice(starts, ends, axes, steps):
    ints = [np.array(v, np.int64) if v is not None else None for v in (starts, ends, axes, steps)]
    check_backward("Slice", [r(4, 5, 6)] + ints, opset=13, wrt=[0])


def test_expand_and_tile():
    check_backward("Expand", [r(3, 1), np.array([2, 3, 4], np.int64)], wrt=[0])
    check_backward("Tile", [r(2, 3), np.array([3, 2], np.int64)], wrt=[0])


def test_cast_float_to_float():
    check_backward("Cast", [r(3, 4)], {"to": 11})
    x = r(3, 4)
    k = get_kernel("Cast", "", 17, x.dtype)
    assert k.backward_fn([np.ones((3, 4), np.int64)], [np.ones((3, 4), np.int64)], [None], to=1)[0] is None


@needs_torch
def test_data_movement_vs_torch():
    x = r(4, 5, 6)
    ints = [np.array(v, np.int64) for v in ([0, 1], [4, -1], [0, 2], [2, 1])]
    torch_check("Slice", [x] + ints, {}, lambda u, *a: u[0:4:2, :, 1:-1], opset=13, wrt=[0])
    torch_check("Split", [r(2, 7, 3), np.array([2, 4, 1])], {"axis": 1}, lambda u, s: torch.split(u, [2, 4, 1], 1),
                opset=13, wrt=[0], n_out=3)
    torch_check("Expand", [r(3, 1), np.array([2, 3, 4], np.int64)], {}, lambda u, s: u.expand(2, 3, 4), wrt=[0])
    torch_check("Tile", [r(2, 3), np.array([3, 2], np.int64)], {}, lambda u, s: u.repeat(3, 2), wrt=[0])


# ---------------------------------------------------------------- reductions, pooling, LRN

@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("axes,keepdims", [([1], 1), ([0, 2], 0), (None, 1)])
def test_reduce_extremes(op, axes, keepdims):
    x = r(3, 4, 5)
    check_backward(op, [x], {"axes": axes, "keepdims": keepdims}, opset=13)
    ax = None if axes is None else np.array(axes, np.int64)
    check_backward(op, [x, ax], {"keepdims": keepdims}, opset=18, wrt=[0])


def test_global_max_pool():
    check_backward("GlobalMaxPool", [r(2, 3, 4, 5)])


def test_lrn():
    check_backward("LRN", [r(2, 7, 3, 3)], {"size": 5, "alpha": 0.3, "beta": 0.75, "bias": 2.0}, rtol=1e-5)
    check_backward("LRN", [r(1, 4, 2, 2)], {"size": 2, "alpha": 0.5, "beta": 0.6, "bias": 1.0}, rtol=1e-5)


@needs_torch
def test_reductions_vs_torch():
    F = torch.nn.functional
    x = r(3, 4, 5)
    torch_check("ReduceMax", [x], {"axes": [1], "keepdims": 1}, lambda u: torch.amax(u, 1, keepdim=True), opset=13)
    torch_check("ReduceMin", [x, np.array([0, 2], np.int64)], {"keepdims": 0}, lambda u, a: torch.amin(u, (0, 2)),
                opset=18, wrt=[0])
    torch_check("GlobalMaxPool", [r(2, 3, 4, 5)], {}, lambda u: torch.amax(u, (2, 3), keepdim=True))
    attrs = {"size": 5, "alpha": 0.3, "beta": 0.75, "bias": 2.0}
    torch_check("LRN", [r(2, 7, 3, 3)], attrs, lambda u: F.local_response_norm(u, 5, 0.3, 0.75, 2.0))
