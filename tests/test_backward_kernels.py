"""Every backward kernel against central finite differences in float64.

For an op y = f(x1, ..., xk) and a random upstream gradient dy, the backward
must return d<dy, f>/dxi. The numeric side perturbs one element at a time by
+-eps, so the shapes here stay small. Where an op has a training forward
(``saving``), the backward is also checked to give the same answer with the
saved values as without them; where it takes ``needs_grad``, that skipping a
gradient leaves the others unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.kernels import get_kernel

RNG = np.random.default_rng(1234)


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _objective(kernel, inputs, attrs, dy) -> float:
    y = _outputs(kernel.forward(*inputs, **attrs))[0]
    return float(np.sum(y * dy))


def numeric_grad(kernel, inputs, attrs, dy, i, eps=1e-6) -> np.ndarray:
    x = inputs[i]
    g = np.zeros_like(x)
    flat = x.reshape(-1)
    gflat = g.reshape(-1)
    for j in range(flat.size):
        orig = flat[j]
        flat[j] = orig + eps
        fp = _objective(kernel, inputs, attrs, dy)
        flat[j] = orig - eps
        fm = _objective(kernel, inputs, attrs, dy)
        flat[j] = orig
        gflat[j] = (fp - fm) / (2 * eps)
    return g


def away(x, points=(0.0,), gap=0.05):
    """Move values off the kinks of a piecewise op: finite differences are clean there, and torch and
    these kernels cannot pick different sides of a kink."""
    x = np.array(x)
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, gap, -gap)
    return x


def check_backward(op, inputs, attrs=None, *, opset=17, domain="", wrt=None, rtol=1e-5, atol=1e-7):
    """Compare analytic and numeric gradients for every input index in ``wrt``."""
    attrs = dict(attrs or {})
    inputs = [None if x is None else np.array(x) for x in inputs]  # owned arrays, 0-d included
    kernel = get_kernel(op, domain, opset, inputs[0].dtype)
    assert kernel.trainable, f"{op} has no backward"
    fwd_attrs = dict(attrs)
    if kernel.wants_n_outputs and "n_outputs" not in fwd_attrs:
        fwd_attrs["n_outputs"] = 1
    bwd_attrs = {k: v for k, v in fwd_attrs.items() if k != "n_outputs"}
    outs = _outputs(kernel.forward(*inputs, **fwd_attrs))
    dy = RNG.standard_normal(outs[0].shape)
    grads = [dy] + [None] * (len(outs) - 1)
    analytic = kernel.backward_fn(grads, inputs, outs, **bwd_attrs)
    assert len(analytic) == len(inputs), f"{op}: backward returned {len(analytic)} grads for {len(inputs)} inputs"
    wrt = [i for i, x in enumerate(inputs) if x is not None and x.dtype == np.float64] if wrt is None else wrt
    assert wrt, "nothing to check"
    for i in wrt:
        num = numeric_grad(kernel, inputs, fwd_attrs, dy, i)
        assert analytic[i] is not None, f"{op}: no gradient for input {i}"
        assert analytic[i].shape == inputs[i].shape, f"{op}: grad {i} shape {analytic[i].shape} != {inputs[i].shape}"
        np.testing.assert_allclose(analytic[i], num, rtol=rtol, atol=atol, err_msg=f"{op} input {i}")
    if kernel.forward_train is not None:
        outs_t, saved = kernel.forward_train(*inputs, **fwd_attrs)
        outs_t = _outputs(outs_t)
        np.testing.assert_array_equal(outs_t[0], outs[0])
        with_saved = kernel.backward_fn(grads, inputs, outs_t, saved=saved, **bwd_attrs)
        for i in wrt:
            np.testing.assert_allclose(with_saved[i], analytic[i], rtol=1e-12, atol=1e-12)
    if kernel.backward_wants_needs:
        for i in wrt:
            needs = tuple(j == i for j in range(len(inputs)))
            only = kernel.backward_fn(grads, inputs, outs, needs_grad=needs, **bwd_attrs)
            np.testing.assert_allclose(only[i], analytic[i], rtol=1e-12, atol=1e-12)
            assert all(only[j] is None for j in range(len(inputs)) if j != i)
    return analytic


def r(*shape):
    return np.asarray(RNG.standard_normal(shape))


# ---------------------------------------------------------------- linalg

@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("c_shape", [None, (4,), (3, 4), (1, 4), (3, 1), ()])
def test_gemm(ta, tb, c_shape):
    a = r(5, 3) if ta else r(3, 5)
    b = r(4, 5) if tb else r(5, 4)
    inputs = [a, b] + ([] if c_shape is None else [r(*c_shape)])
    check_backward("Gemm", inputs, dict(transA=ta, transB=tb, alpha=0.7, beta=1.3))


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 2)), ((2, 3, 4), (4, 5)), ((4,), (4, 3)), ((3, 4), (4,)),
                                   ((4,), (4,)), ((2, 1, 3, 4), (5, 4, 2)), ((3, 4), (2, 4, 3))])
def test_matmul(sa, sb):
    check_backward("MatMul", [r(*sa), r(*sb)])


# ---------------------------------------------------------------- elementwise

BROADCASTS = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 3, 4), (3, 1)), ((1, 4), (3, 1)), ((2, 1, 4), ()),
              ((4,), (2, 3, 4))]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("sa,sb", BROADCASTS)
def test_binary_broadcasting(op, sa, sb):
    a, b = r(*sa), r(*sb)
    if op == "Div":
        b = np.sign(b) * (np.abs(b) + 0.5)  # keep away from 0
    check_backward(op, [a, b])


def test_neg():
    check_backward("Neg", [r(3, 4)])


# ---------------------------------------------------------------- activations

def _no_kink(x, at=0.0, margin=1e-3):
    return np.where(np.abs(x - at) < margin, x + 2 * margin, x)


@pytest.mark.parametrize("op,attrs", [("Relu", {}), ("LeakyRelu", {"alpha": 0.1}), ("Sigmoid", {}), ("Tanh", {})])
def test_pointwise(op, attrs):
    check_backward(op, [_no_kink(r(3, 7) * 3)], attrs)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("opset,axis", [(13, -1), (13, 1), (13, 0), (11, 1), (11, 2), (11, 0), (11, -1)])
def test_softmax_family(op, opset, axis):
    check_backward(op, [r(2, 3, 4)], {"axis": axis}, opset=opset)


def test_softmax_opsets_differ():
    """The coerced (opset < 13) and single-axis forms must give different gradients."""
    x, dy = r(2, 3, 4), r(2, 3, 4)
    g = []
    for opset in (11, 13):
        k = get_kernel("Softmax", opset=opset)
        y = k.forward(x, axis=1)
        g.append(k.backward_fn([dy], [x], (y,), axis=1)[0])
    assert not np.allclose(g[0], g[1])


# ---------------------------------------------------------------- conv

CONV_CASES = [
    dict(x=(2, 3, 6, 6), w=(4, 3, 3, 3), attrs={}),
    dict(x=(2, 3, 7, 6), w=(4, 3, 3, 3), attrs=dict(pads=(1, 1, 1, 1))),
    dict(x=(1, 4, 7, 7), w=(6, 2, 3, 3), attrs=dict(group=2, strides=(2, 2), pads=(1, 0, 2, 1))),
    dict(x=(2, 2, 9, 8), w=(3, 2, 3, 2), attrs=dict(dilations=(2, 3), strides=(1, 2))),
    dict(x=(1, 4, 6, 6), w=(4, 1, 3, 3), attrs=dict(group=4, pads=(1, 1, 1, 1))),  # depthwise
    dict(x=(2, 4, 5, 5), w=(6, 4, 1, 1), attrs={}),  # 1x1 direct path
    dict(x=(2, 4, 5, 5), w=(6, 2, 1, 1), attrs=dict(group=2, strides=(2, 2))),
    dict(x=(2, 3, 7), w=(4, 3, 3), attrs=dict(pads=(2, 1), strides=(2,))),  # 1-D
    dict(x=(1, 2, 4, 4, 3), w=(2, 2, 2, 2, 2), attrs=dict(pads=(1, 0, 1, 0, 1, 0))),  # 3-D
    dict(x=(1, 2, 5, 6), w=(3, 2, 3, 3), attrs=dict(auto_pad="SAME_UPPER", strides=(2, 2))),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c['x']}-{c['w']}-{c['attrs']}")
@pytest.mark.parametrize("bias", [True, False])
def test_conv(case, bias):
    inputs = [r(*case["x"]), r(*case["w"])] + ([r(case["w"][0])] if bias else [])
    check_backward("Conv", inputs, case["attrs"])


# ---------------------------------------------------------------- pooling

POOL_CASES = [
    dict(x=(2, 2, 6, 6), attrs=dict(kernel_shape=(2, 2), strides=(2, 2))),
    dict(x=(1, 2, 7, 6), attrs=dict(kernel_shape=(3, 3), strides=(1, 1))),  # overlapping
    dict(x=(1, 2, 6, 7), attrs=dict(kernel_shape=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1))),
    dict(x=(1, 2, 7, 7), attrs=dict(kernel_shape=(3, 2), strides=(2, 1), pads=(1, 0, 0, 1), ceil_mode=1)),
    dict(x=(1, 1, 8, 8), attrs=dict(kernel_shape=(2, 2), strides=(1, 1), dilations=(2, 2))),
    dict(x=(1, 2, 9), attrs=dict(kernel_shape=(3,), strides=(2,), pads=(1, 1))),
    dict(x=(1, 1, 5, 6), attrs=dict(kernel_shape=(3, 3), auto_pad="SAME_UPPER", strides=(2, 2))),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"{c['x']}-{c['attrs']}")
def test_max_pool(case):
    # a permutation: distinct values, so every window has a unique maximum
    x = RNG.permutation(int(np.prod(case["x"]))).reshape(case["x"]).astype(np.float64) * 0.01
    check_backward("MaxPool", [x], case["attrs"])


def test_max_pool_ties_go_to_first_maximum():
    """After a Relu whole windows are 0: the gradient goes to one cell, the first."""
    k = get_kernel("MaxPool", opset=17)
    x = np.zeros((1, 1, 2, 4))
    x[0, 0, 1, 3] = 1.0
    y, saved = k.forward_train(x, kernel_shape=(2, 2), strides=(2, 2))
    dx = k.backward_fn([np.ones_like(y)], [x], (y,), kernel_shape=(2, 2), strides=(2, 2), saved=saved)[0]
    assert dx.sum() == 2.0
    assert dx[0, 0, 0, 0] == 1.0 and dx[0, 0, 1, 3] == 1.0


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"{c['x']}-{c['attrs']}")
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool(case, count_include_pad):
    check_backward("AveragePool", [r(*case["x"])], dict(case["attrs"], count_include_pad=count_include_pad))


def test_global_average_pool():
    check_backward("GlobalAveragePool", [r(2, 3, 4, 5)])


# ---------------------------------------------------------------- shape ops

def test_flatten():
    check_backward("Flatten", [r(2, 3, 4)], {"axis": 2})


def test_reshape():
    check_backward("Reshape", [r(2, 3, 4), np.array([4, 0, -1], dtype=np.int64)], wrt=[0])


@pytest.mark.parametrize("perm", [None, (1, 0, 2), (2, 0, 1)])
def test_transpose(perm):
    check_backward("Transpose", [r(2, 3, 4)], {} if perm is None else {"perm": perm})


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for i, s in enumerate(shapes):
        s[axis] += i
    check_backward("Concat", [r(*s) for s in shapes], {"axis": axis})


def test_squeeze_unsqueeze_identity():
    check_backward("Unsqueeze", [r(3, 4), np.array([0, 3], dtype=np.int64)], wrt=[0])
    check_backward("Squeeze", [r(3, 1, 4), np.array([1], dtype=np.int64)], wrt=[0])
    check_backward("Identity", [r(3, 4)])


# ---------------------------------------------------------------- normalization, dropout

@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 4, 5)])
@pytest.mark.parametrize("training", [0, 1])
def test_batch_normalization(shape, training):
    c = shape[1]
    inputs = [r(*shape), r(c), r(c), r(c), np.abs(r(c)) + 0.5]
    check_backward("BatchNormalization", inputs, dict(training_mode=training, epsilon=1e-3), wrt=[0, 1, 2])


def test_batch_normalization_running_stats_get_no_gradient():
    k = get_kernel("BatchNormalization", opset=17)
    x, s, b, m, v = r(4, 3, 2, 2), r(3), r(3), r(3), np.abs(r(3)) + 1
    y, rm, rv = k.forward(x, s, b, m, v, training_mode=1, n_outputs=3)
    np.testing.assert_allclose(rm, 0.9 * m + 0.1 * x.mean(axis=(0, 2, 3)))
    g = k.backward_fn([np.ones_like(y), None, None], [x, s, b, m, v], (y, rm, rv), training_mode=1)
    assert g[3] is None and g[4] is None


def test_dropout_training_with_mask_and_seed():
    ratio = np.array(0.3)
    check_backward("Dropout", [r(5, 6), ratio, np.array(True)], {"seed": 7}, wrt=[0])
    k = get_kernel("Dropout", opset=17)
    x = r(5, 6)
    y, mask = k.forward(x, ratio, np.array(True), seed=7, n_outputs=2)
    dy = r(5, 6)
    via_mask = k.backward_fn([dy, None], [x, ratio, np.array(True)], (y, mask), seed=None)[0]
    via_seed = k.backward_fn([dy], [x, ratio, np.array(True)], (y,), seed=7)[0]
    np.testing.assert_array_equal(via_mask, via_seed)
    np.testing.assert_array_equal(via_mask == 0, ~mask)


def test_dropout_inference_is_identity():
    check_backward("Dropout", [r(3, 4)], wrt=[0])


# ---------------------------------------------------------------- losses

D = "edgeflow.train"


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_softmax_cross_entropy(smoothing, reduction):
    labels = np.array([0, 3, 1, 3, 2])
    check_backward("SoftmaxCrossEntropy", [r(5, 4) * 3, labels],
                   dict(reduction=reduction, label_smoothing=smoothing), domain=D, wrt=[0])


def test_softmax_cross_entropy_soft_targets():
    t = np.abs(r(5, 4))
    check_backward("SoftmaxCrossEntropy", [r(5, 4), t / t.sum(1, keepdims=True)], domain=D, wrt=[0])
    check_backward("SoftmaxCrossEntropy", [r(5, 4), t], domain=D, wrt=[0])  # unnormalised rows


def test_softmax_cross_entropy_matches_definition():
    k = get_kernel("SoftmaxCrossEntropy", D)
    z, y = r(6, 5), np.array([0, 1, 2, 3, 4, 0])
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    np.testing.assert_allclose(k.forward(z, y), -np.log(p[np.arange(6), y]).mean())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse(reduction):
    check_backward("MeanSquaredError", [r(4, 3), r(4, 3)], {"reduction": reduction}, domain=D, wrt=[0])


@pytest.mark.parametrize("from_logits", [1, 0])
def test_bce(from_logits):
    x = r(4, 3) * 3 if from_logits else RNG.uniform(0.05, 0.95, (4, 3))
    t = RNG.uniform(0, 1, (4, 3))
    check_backward("BinaryCrossEntropy", [x, t], {"from_logits": from_logits}, domain=D, wrt=[0])


def test_bce_logits_is_stable():
    k = get_kernel("BinaryCrossEntropy", D)
    x = np.array([[-1000.0, 1000.0]])
    assert np.isfinite(k.forward(x, np.array([[1.0, 0.0]])))
