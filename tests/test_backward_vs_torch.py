"""Op-level backwards against PyTorch's autograd (issue 15, item 1).

Every op of the real-model suite's conv nets (PP-LCNet, PP-OCR's MobileNetV3,
SqueezeNet, ResNet, Inception, ShuffleNet) and transformer encoder (MiniLM):
our kernel's forward and backward, called the way the trainer calls them,
against torch.autograd of the same function with one random upstream
gradient. Inputs are float64; the gradient of every float input (data,
weights, biases, slopes, exponents) is compared at rtol 1e-5, atol 1e-7 of the
largest reference gradient (float64 agreement is ~1e-12; the margin is only
for summation order).

Each case is run three ways against the one torch reference:

- the plain backward, with every forward value at hand;
- as the trainer runs it (edgeflow.train.autograd), wanting every gradient
  and then each alone (a frozen weight, a frozen input, TinyTL's bias only):
  only the values ``Kernel.backward_uses`` keeps (the others arrive as
  ``None``), an input that the wanted gradients do not read as zeros of its
  shape (``VALUES_NEEDED_FOR``), Relu's output as its ``> 0`` mask, the
  training forward's ``saved`` values where the kernel has
  ``forward_train``, and ``needs_grad`` where it takes it;
- in float32: outputs and gradients must stay float32 (a float32 model's
  training must not double its memory) and agree with the float64 reference
  at rtol 1e-4, atol 1e-4 of the largest reference gradient (float32 rounding
  over sums of up to ~100 terms; observed errors are ~1e-6).

The finite-difference checks of the same ops live in tests/test_backward_kernels.py,
tests/test_kernels_backward.py, tests/test_backward_transfer.py and the
per-op kernel tests; CastLike (no torch op) is checked here against finite
differences only, and runs without torch; everything else skips without it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_backward_kernels import away, check_backward

from edgeflow.kernels import get_kernel
from edgeflow.train.autograd import _BN_EVAL_VALUES, OUTPUT_READ_AS_POSITIVE_MASK, VALUES_NEEDED_FOR

try:
    import torch

    HAVE_TORCH = True
except ImportError:  # pragma: no cover - torch is a test extra

    class _Absent:
        """Stands in for torch so the parameter lists build; every torch test skips."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

    torch = _Absent()
    HAVE_TORCH = False
needs_torch = pytest.mark.skipif(not HAVE_TORCH,
                                 reason="PyTorch is not installed (pip install torch): torch comparisons skipped")
F = torch.nn.functional

RNG = np.random.default_rng(1515)
RTOL, ATOL_REL = 1e-5, 1e-7
RTOL32, ATOL32_REL = 1e-4, 1e-4


def r(*shape, lo=None, hi=None):
    if lo is not None:
        return RNG.uniform(lo, hi, shape)
    return np.asarray(RNG.standard_normal(shape))


def _tuple(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _close(got, want, what, rtol, atol_rel):
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-12)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol_rel * scale, err_msg=what)


def vs_torch(op, inputs, fn, attrs=None, *, opset=17, wrt=None, n_out=1, grad_of=None, f32=True):
    """Our forward and backward of ``op`` against torch.autograd of ``fn(*tensors)``.

    ``fn`` takes one tensor per input (``None`` where the input is omitted)
    and returns the output(s) that torch has; only the outputs at the positions
    ``grad_of`` (default: all) get an upstream gradient, the others (running
    statistics, unused Split parts) are compared in the forward only. ``wrt``: input positions
    whose gradients are compared (default: every float64 input).
    """
    attrs = dict(attrs or {})
    inputs = [None if x is None else np.array(x) for x in inputs]
    wrt = [i for i, x in enumerate(inputs) if x is not None and x.dtype == np.float64] if wrt is None else wrt
    assert wrt, "nothing to check"
    ts = [None if x is None else torch.tensor(x, requires_grad=i in wrt) for i, x in enumerate(inputs)]
    ref = _tuple(fn(*ts))
    dys = [r(*o.shape).astype(o.detach().numpy().dtype) if o.is_floating_point() and (grad_of is None or k in grad_of)
           else None for k, o in enumerate(ref)]
    used = [k for k, d in enumerate(dys) if d is not None]
    refg = torch.autograd.grad([ref[k] for k in used], [ts[i] for i in wrt], [torch.tensor(dys[k]) for k in used],
                               allow_unused=True)
    refg = {i: (np.zeros(inputs[i].shape) if g is None else g.numpy()) for i, g in zip(wrt, refg)}
    ref = [o.detach().numpy() for o in ref]
    _run(op, inputs, attrs, opset, wrt, n_out, ref, dys, refg, RTOL, ATOL_REL, "float64")
    if f32:
        ins32 = [x.astype(np.float32) if x is not None and x.dtype == np.float64 else x for x in inputs]
        dys32 = [None if d is None else d.astype(np.float32) for d in dys]
        _run(op, ins32, attrs, opset, wrt, n_out, ref, dys32, refg, RTOL32, ATOL32_REL, "float32")


def _run(op, inputs, attrs, opset, wrt, n_out, ref, dys, refg, rtol, atol_rel, tag):
    kernel = get_kernel(op, "", opset, inputs[0].dtype)
    assert kernel.trainable, f"{op} has no backward"
    fwd = dict(attrs, n_outputs=n_out) if kernel.wants_n_outputs else attrs
    outs = _tuple(kernel.forward(*inputs, **fwd))
    assert len(outs) >= len(ref)
    for k, (o, ro) in enumerate(zip(outs, ref)):
        assert o.shape == ro.shape, f"{op} output {k}: shape {o.shape} != torch's {ro.shape}"
        if ro.dtype.kind == "f":
            _close(o, ro, f"{op} output {k} vs torch ({tag})", rtol, atol_rel)
        else:
            np.testing.assert_array_equal(o, ro, err_msg=f"{op} output {k} vs torch ({tag})")
    grads = list(dys) + [None] * (len(outs) - len(dys))
    want_dtype = {i: inputs[i].dtype for i in wrt}

    def compare(got, how, only=wrt):
        assert len(got) == len(inputs), f"{op}: {len(got)} gradients for {len(inputs)} inputs ({how})"
        for i in only:
            assert got[i] is not None, f"{op}: no gradient for input {i} ({how})"
            assert got[i].shape == inputs[i].shape, f"{op}: input {i} gradient shape {got[i].shape} ({how})"
            assert got[i].dtype == want_dtype[i], \
                f"{op}: input {i} gradient is {got[i].dtype} for a {want_dtype[i]} input ({how})"
            _close(got[i], refg[i], f"{op} input {i} gradient vs torch ({how}, {tag})", rtol, atol_rel)

    compare(kernel.backward_fn(grads, inputs, list(outs), **attrs), "plain")

    # As the trainer (edgeflow.train.autograd) calls it, wanting all the gradients and then
    # each alone (a frozen weight, a frozen input, TinyTL's bias only): the values
    # ``backward_uses`` keeps, an input the wanted gradients do not read as zeros of its
    # shape, Relu's output as its > 0 mask, ``saved`` and ``needs_grad``.
    saved, outs_t = None, outs
    if kernel.forward_train is not None:
        outs_t, saved = kernel.forward_train(*inputs, **fwd)
        outs_t = _tuple(outs_t)
        for o, o_t in zip(outs, outs_t):
            np.testing.assert_array_equal(o_t, o, err_msg=f"{op}: training forward differs")
    uses = kernel.backward_uses
    kept = list(outs_t) if uses in ("all", "outputs") else [None] * len(outs_t)
    if op in OUTPUT_READ_AS_POSITIVE_MASK:
        kept = [None if o is None else o > 0 for o in kept]
    table = VALUES_NEEDED_FOR.get(op, {})
    if op == "BatchNormalization" and not attrs.get("training_mode"):
        table = _BN_EVAL_VALUES
    for wanted in [tuple(wrt)] + ([(i,) for i in wrt] if len(wrt) > 1 else []):
        needs = tuple(i in wanted for i in range(len(inputs)))
        ins = list(inputs) if uses in ("all", "inputs") else [None] * len(inputs)
        shape_only = [pos for pos, reads in table.items()
                      if pos < len(ins) and ins[pos] is not None and not any(needs[j] for j in reads)]
        kw = dict(attrs)
        if saved is not None and uses in ("all", "inputs"):
            if op == "MaxPool":  # its saved argmax leaves only the input's shape to read
                shape_only = [0]
            if not (op in ("Conv", "ConvTranspose") and 0 in shape_only):
                kw["saved"] = saved
        for pos in shape_only:
            ins[pos] = np.broadcast_to(np.zeros((), inputs[pos].dtype), inputs[pos].shape)
        if kernel.backward_wants_needs:
            kw["needs_grad"] = needs
        how = f"as trained for inputs {list(wanted)}, uses={uses}, shape only {shape_only}, saved={'saved' in kw}"
        compare(kernel.backward_fn(grads, ins, kept, **kw), how, only=wanted)


# ---------------------------------------------------------------- torch forms of ONNX attributes

def torch_pads(pads):
    """ONNX pads (x1_begin, x2_begin, ..., x1_end, ...) -> F.pad's (last_begin, last_end, ...)."""
    n = len(pads) // 2
    return [v for a in reversed(range(n)) for v in (pads[a], pads[a + n])]


def t_conv(x, w, b=None, *, pads=None, strides=None, dilations=None, group=1):
    nd = x.dim() - 2
    if pads:
        x = F.pad(x, torch_pads(pads))
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    return conv(x, w, b, stride=tuple(strides or (1,) * nd), dilation=tuple(dilations or (1,) * nd), groups=group)


def same_upper_pads(in_sizes, kernel, strides, dilations=None):
    dilations = dilations or (1,) * len(in_sizes)
    begin, end = [], []
    for n, k, s, d in zip(in_sizes, kernel, strides, dilations):
        total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
        begin.append(total // 2)
        end.append(total - total // 2)
    return begin + end


def t_conv_transpose(x, w, b=None, *, pads=None, strides=None, dilations=None, group=1, output_padding=None):
    nd = x.dim() - 2
    one = (1,) * nd
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    y = conv(x, w, b, stride=tuple(strides or one), output_padding=tuple(output_padding or (0,) * nd),
             groups=group, dilation=tuple(dilations or one))
    if pads:  # ONNX's pads crop the full output, possibly unevenly
        idx = [slice(None), slice(None)] + [slice(pads[a], y.shape[2 + a] - pads[a + nd]) for a in range(nd)]
        y = y[tuple(idx)]
    return y


def t_gather(u, idx, axis):
    axis %= u.dim()
    moved = u.movedim(axis, 0)[torch.as_tensor(idx)]  # idx.shape + rest; negative indices count from the end
    return moved.movedim(tuple(range(idx.ndim)), tuple(range(axis, axis + idx.ndim)))


# ---------------------------------------------------------------- conv

CONV = [
    dict(x=(2, 3, 6, 6), w=(4, 3, 3, 3), attrs={}),
    dict(x=(2, 3, 7, 6), w=(4, 3, 3, 3), attrs=dict(pads=(1, 1, 1, 1))),
    dict(x=(1, 4, 7, 7), w=(6, 2, 3, 3), attrs=dict(group=2, strides=(2, 2), pads=(1, 0, 2, 1))),
    dict(x=(2, 2, 9, 8), w=(3, 2, 3, 2), attrs=dict(dilations=(2, 3), strides=(1, 2))),
    dict(x=(2, 4, 6, 6), w=(4, 1, 3, 3), attrs=dict(group=4, pads=(1, 1, 1, 1))),  # depthwise
    dict(x=(1, 6, 9, 9), w=(6, 1, 5, 5), attrs=dict(group=6, strides=(2, 2), pads=(2, 2, 2, 2))),  # depthwise s2
    dict(x=(1, 4, 7, 7), w=(8, 1, 3, 3), attrs=dict(group=4, dilations=(2, 2), pads=(2, 2, 2, 2))),  # multiplier 2
    dict(x=(2, 4, 5, 5), w=(6, 4, 1, 1), attrs={}),  # pointwise
    dict(x=(2, 4, 5, 5), w=(6, 2, 1, 1), attrs=dict(group=2, strides=(2, 2))),
    dict(x=(2, 3, 7), w=(4, 3, 3), attrs=dict(pads=(2, 1), strides=(2,))),  # 1-D
    dict(x=(1, 2, 4, 4, 3), w=(2, 2, 2, 2, 2), attrs=dict(pads=(1, 0, 1, 0, 1, 0))),  # 3-D
]


@pytest.mark.parametrize("case", CONV, ids=lambda c: f"{c['x']}-{c['w']}-{c['attrs']}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_conv(case, bias):
    inputs = [r(*case["x"]), r(*case["w"])] + ([r(case["w"][0])] if bias else [])
    vs_torch("Conv", inputs, lambda *t: t_conv(*t, **case["attrs"]), case["attrs"])


def test_conv_same_upper():
    attrs = dict(auto_pad="SAME_UPPER", strides=(2, 2))
    pads = same_upper_pads((5, 6), (3, 3), (2, 2))
    vs_torch("Conv", [r(1, 2, 5, 6), r(3, 2, 3, 3), r(3)], lambda *t: t_conv(*t, pads=pads, strides=(2, 2)), attrs)


CONV_T = [
    dict(x=(2, 3, 4, 4), w=(3, 2, 3, 3), attrs={}),
    dict(x=(1, 4, 3, 5), w=(4, 3, 3, 3), attrs=dict(strides=(2, 2), pads=(1, 1, 1, 1), output_padding=(1, 0))),
    dict(x=(1, 4, 4, 4), w=(4, 1, 2, 2), attrs=dict(group=2, strides=(2, 2))),
    dict(x=(1, 2, 3, 4), w=(2, 2, 3, 2), attrs=dict(dilations=(2, 1), strides=(1, 2), pads=(0, 1, 2, 0))),
    dict(x=(2, 2, 5), w=(2, 3, 4), attrs=dict(strides=(3,), pads=(1, 2))),  # 1-D
]


@pytest.mark.parametrize("case", CONV_T, ids=lambda c: f"{c['x']}-{c['w']}-{c['attrs']}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_conv_transpose(case, bias):
    c_out = case["w"][1] * case["attrs"].get("group", 1)
    inputs = [r(*case["x"]), r(*case["w"])] + ([r(c_out)] if bias else [])
    vs_torch("ConvTranspose", inputs, lambda *t: t_conv_transpose(*t, **case["attrs"]), case["attrs"], opset=22)


# ---------------------------------------------------------------- linalg

@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("c_shape", [None, (4,), (3, 4), (3, 1), ()])
def test_gemm(ta, tb, c_shape):
    a = r(5, 3) if ta else r(3, 5)
    b = r(4, 5) if tb else r(5, 4)
    inputs = [a, b] + ([] if c_shape is None else [r(*c_shape)])

    def fn(u, v, c=None):
        y = 0.7 * ((u.T if ta else u) @ (v.T if tb else v))
        return y if c is None else y + 1.3 * c

    vs_torch("Gemm", inputs, fn, dict(transA=ta, transB=tb, alpha=0.7, beta=1.3))


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 2)), ((2, 3, 4), (4, 5)), ((4,), (4, 3)), ((3, 4), (4,)),
                                   ((4,), (4,)), ((2, 1, 3, 4), (5, 4, 2)), ((3, 4), (2, 4, 3)),
                                   ((2, 4, 5, 8), (2, 4, 8, 5))])  # attention scores
def test_matmul(sa, sb):
    vs_torch("MatMul", [r(*sa), r(*sb)], torch.matmul)


# ---------------------------------------------------------------- normalization

@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 4, 5), (2, 3, 5)])
@pytest.mark.parametrize("training", [0, 1], ids=["inference", "training"])
def test_batch_normalization(shape, training):
    c = shape[1]
    x, s, b, m, v = r(*shape), r(c), r(c), r(c), r(c, lo=0.5, hi=2.0)
    attrs = dict(training_mode=training, epsilon=1e-3, momentum=0.8)

    def fn(u, sc, bi, mean, var):
        rm, rv = mean.detach().clone(), var.detach().clone()
        y = F.batch_norm(u, rm, rv, sc, bi, training=bool(training), momentum=0.2, eps=1e-3)
        if not training:
            return y
        # torch updates the running variance with the unbiased batch variance, ONNX with the biased one
        axes = (0,) + tuple(range(2, u.dim()))
        return y, rm, 0.8 * var + 0.2 * u.var(dim=axes, unbiased=False)

    vs_torch("BatchNormalization", [x, s, b, m, v], fn, attrs, wrt=[0, 1, 2], n_out=3 if training else 1, grad_of=[0])


@pytest.mark.parametrize("shape,axis", [((2, 5, 8), -1), ((2, 3, 4), 1), ((6, 4), 0), ((3, 7), -1)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layer_normalization(shape, axis, bias):
    norm = shape[axis % len(shape):]
    inputs = [r(*shape), r(*norm)] + ([r(*norm)] if bias else [])
    vs_torch("LayerNormalization", inputs, lambda u, s, b=None: F.layer_norm(u, norm, s, b, eps=1e-3),
             dict(axis=axis, epsilon=1e-3))


@pytest.mark.parametrize("shape,groups", [((2, 4, 3), 2), ((2, 6, 3, 3), 3), ((1, 4, 5), 4), ((2, 4, 2, 3), 1)])
def test_group_normalization(shape, groups):
    c = shape[1]
    vs_torch("GroupNormalization", [r(*shape), r(c), r(c)],
             lambda u, s, b: F.group_norm(u, groups, s, b, eps=1e-3),
             dict(num_groups=groups, epsilon=1e-3), opset=21)
    # opset 18: scale and bias per group
    rep = c // groups
    vs_torch("GroupNormalization", [r(*shape), r(groups), r(groups)],
             lambda u, s, b: F.group_norm(u, groups, s.repeat_interleave(rep), b.repeat_interleave(rep), eps=1e-3),
             dict(num_groups=groups, epsilon=1e-3), opset=18)


@pytest.mark.parametrize("shape", [(2, 3, 4, 2), (1, 4, 6), (2, 2, 2, 3, 2)])
def test_instance_normalization(shape):
    c = shape[1]
    vs_torch("InstanceNormalization", [r(*shape), r(c), r(c)],
             lambda u, s, b: F.instance_norm(u, weight=s, bias=b, eps=1e-3), dict(epsilon=1e-3))


# ---------------------------------------------------------------- pooling

@pytest.mark.parametrize("x,attrs,t", [
    ((2, 2, 6, 6), dict(kernel_shape=(2, 2), strides=(2, 2)), {}),
    ((1, 2, 7, 6), dict(kernel_shape=(3, 3)), {}),  # overlapping, stride 1
    ((1, 2, 6, 7), dict(kernel_shape=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)), dict(padding=1)),
    ((1, 3, 7, 7), dict(kernel_shape=(3, 3), strides=(2, 2), ceil_mode=1), dict(ceil_mode=True)),  # SqueezeNet
    ((1, 2, 8, 8), dict(kernel_shape=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), ceil_mode=1),
     dict(padding=1, ceil_mode=True)),
    ((1, 1, 8, 8), dict(kernel_shape=(2, 2), dilations=(2, 2)), dict(dilation=2)),
    ((1, 2, 9), dict(kernel_shape=(3,), strides=(2,), pads=(1, 1)), dict(padding=1)),
    ((1, 2, 7, 7), dict(kernel_shape=(3, 2), strides=(2, 1), pads=(1, 0, 0, 1)), "asym"),
])
def test_max_pool(x, attrs, t):
    xv = RNG.permutation(int(np.prod(x))).reshape(x).astype(np.float64) * 0.01  # one maximum per window
    nd = len(x) - 2
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
    k, s = attrs["kernel_shape"], attrs.get("strides", (1,) * nd)
    if t == "asym":
        def fn(u):
            return pool(F.pad(u, torch_pads(attrs["pads"]), value=-math.inf), k, s)
    else:
        def fn(u):
            return pool(u, k, s, **t)
    vs_torch("MaxPool", [xv], fn, attrs)


@pytest.mark.parametrize("x,attrs,t", [
    ((2, 2, 6, 6), dict(kernel_shape=(2, 2), strides=(2, 2)), {}),
    ((1, 2, 7, 6), dict(kernel_shape=(3, 3)), {}),
    ((1, 2, 6, 7), dict(kernel_shape=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)), dict(padding=1)),
    ((1, 2, 7, 7), dict(kernel_shape=(3, 3), strides=(2, 2), ceil_mode=1), dict(ceil_mode=True)),
    ((1, 2, 9), dict(kernel_shape=(3,), strides=(2,), pads=(1, 1)), dict(padding=1)),
    ((1, 2, 7, 7), dict(kernel_shape=(3, 2), strides=(2, 1), pads=(1, 0, 0, 1)), "asym"),
])
@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool(x, attrs, t, include_pad):
    nd = len(x) - 2
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[nd - 1]
    k, s = attrs["kernel_shape"], attrs.get("strides", (1,) * nd)
    if t == "asym":  # pad by hand; the divisor is the window's count of (real, or real and padded) cells
        def fn(u):
            total = pool(F.pad(u, torch_pads(attrs["pads"])), k, s)
            if include_pad:
                return total
            ones = F.pad(torch.ones_like(u), torch_pads(attrs["pads"]))
            return total / pool(ones, k, s)
    else:
        def fn(u):
            return pool(u, k, s, count_include_pad=bool(include_pad), **t)
    vs_torch("AveragePool", [r(*x)], fn, dict(attrs, count_include_pad=include_pad))


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 4, 7), (1, 2, 2, 3, 2)])
def test_global_average_pool(shape):
    vs_torch("GlobalAveragePool", [r(*shape)], lambda u: u.mean(dim=tuple(range(2, u.dim())), keepdim=True))


# ---------------------------------------------------------------- activations

@pytest.mark.parametrize("op,fn,attrs,kinks,opset", [
    ("Relu", torch.relu, {}, (0.0,), 17),
    ("Sigmoid", torch.sigmoid, {}, (), 17),
    ("Tanh", torch.tanh, {}, (), 17),
    ("HardSigmoid", F.hardsigmoid, {"alpha": 1 / 6, "beta": 0.5}, (-3.0, 3.0), 17),
    ("HardSigmoid", lambda u: torch.clamp(0.2 * u + 0.5, 0.0, 1.0), {}, (-2.5, 2.5), 17),  # ONNX default
    ("HardSwish", F.hardswish, {}, (-3.0, 3.0), 17),
    ("Gelu", F.gelu, {}, (), 20),
    ("Gelu", lambda u: F.gelu(u, approximate="tanh"), {"approximate": "tanh"}, (), 20),
    ("Erf", torch.erf, {}, (), 17),
    ("Clip", F.relu6, {"min": 0.0, "max": 6.0}, (0.0, 6.0), 6),  # ReLU6, attribute form
], ids=lambda v: v if isinstance(v, str) else None)
def test_activation(op, fn, attrs, kinks, opset):
    vs_torch(op, [away(r(4, 6) * 4, kinks)], fn, attrs, opset=opset)


def test_clip_inputs_form():
    x = away(r(4, 6) * 4, (0.0, 6.0, -1.0, 2.0))
    vs_torch("Clip", [x, np.array(0.0), np.array(6.0)], lambda u, lo, hi: F.relu6(u), opset=13, wrt=[0])
    vs_torch("Clip", [x, np.array(-1.0), None], lambda u, lo, hi: torch.clamp(u, min=-1.0), opset=13, wrt=[0])
    vs_torch("Clip", [x, None, np.array(2.0)], lambda u, lo, hi: torch.clamp(u, max=2.0), opset=13, wrt=[0])


@pytest.mark.parametrize("slope", [(1,), (3, 1, 1), (5,), (2, 3, 4, 5)])
def test_prelu(slope):
    x = away(r(2, 3, 4, 5))
    if slope == (3, 1, 1):  # the per-channel form torch has
        def fn(u, s):
            return F.prelu(u, s.reshape(-1))
    else:
        def fn(u, s):
            return torch.where(u > 0, u, s * u)
    vs_torch("PRelu", [x, r(*slope)], fn, opset=16)


@pytest.mark.parametrize("op,tfn", [("Softmax", F.softmax), ("LogSoftmax", F.log_softmax)])
@pytest.mark.parametrize("opset,axis", [(13, -1), (13, 1), (13, 0), (11, 1), (11, 2), (11, 0)])
def test_softmax_family(op, tfn, opset, axis):
    x = r(2, 3, 4) * 2

    def fn(u):
        if opset >= 13:
            return tfn(u, dim=axis)
        rows = math.prod(u.shape[:axis])  # opset < 13: coerced to 2-D at axis
        return tfn(u.reshape(rows, -1), dim=1).reshape(u.shape)

    vs_torch(op, [x], fn, {"axis": axis}, opset=opset)


def test_softmax_attention_shape():
    vs_torch("Softmax", [r(2, 4, 6, 6) * 3], lambda u: F.softmax(u, dim=-1), {"axis": -1}, opset=13)


# ---------------------------------------------------------------- element-wise with broadcasting

BROADCASTS = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 3, 4), (3, 1)), ((1, 4), (3, 1)), ((2, 1, 4), ()),
              ((4,), (2, 3, 4))]


@pytest.mark.parametrize("op,fn", [("Add", torch.add), ("Sub", torch.sub), ("Mul", torch.mul), ("Div", torch.div)])
@pytest.mark.parametrize("sa,sb", BROADCASTS)
def test_binary(op, fn, sa, sb):
    a, b = r(*sa), r(*sb)
    if op == "Div":
        b = np.sign(b) * (np.abs(b) + 0.5)
    vs_torch(op, [a, b], fn)


@pytest.mark.parametrize("sa,sb", BROADCASTS)
def test_pow(sa, sb):
    vs_torch("Pow", [r(*sa, lo=0.5, hi=2.0), r(*sb, lo=-1.5, hi=2.5)], torch.pow)


def test_pow_constant_exponent():
    # MiniLM's LayerNorm decomposition: Pow(x, 2) with the exponent a constant (no gradient wanted)
    vs_torch("Pow", [r(3, 4), np.array(2.0)], lambda u, e: u ** 2, wrt=[0])
    vs_torch("Pow", [r(3, 4, lo=0.2, hi=2), np.array(0.5)], lambda u, e: u ** 0.5, wrt=[0])


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 1), ()])
def test_sqrt(shape):
    vs_torch("Sqrt", [r(*shape, lo=0.2, hi=3.0)], torch.sqrt)


# ---------------------------------------------------------------- reductions

@pytest.mark.parametrize("op,fn", [
    ("ReduceMean", lambda u, d, k: u.mean(dim=d, keepdim=k)),
    ("ReduceSum", lambda u, d, k: u.sum(dim=d, keepdim=k)),
    ("ReduceL2", lambda u, d, k: torch.linalg.vector_norm(u, 2, dim=d, keepdim=k)),
])
@pytest.mark.parametrize("axes", [None, (1,), (0, -1), (2, 3)])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reductions(op, fn, axes, keepdims):
    x = r(2, 3, 4, 5)
    dims = tuple(range(4)) if axes is None else axes
    ax = None if axes is None else np.array(axes, np.int64)
    new = 13 if op == "ReduceSum" else 18
    vs_torch(op, [x, ax], lambda u, a: fn(u, dims, bool(keepdims)), {"keepdims": keepdims}, opset=new, wrt=[0])
    vs_torch(op, [x], lambda u: fn(u, dims, bool(keepdims)), {"keepdims": keepdims, "axes": axes}, opset=11)


# ---------------------------------------------------------------- indexing, padding, resizing

@pytest.mark.parametrize("axis,idx", [
    (0, np.array([[3, 1, 3], [0, 3, 3]])),  # embedding lookup, repeated rows
    (0, np.array([4, 4, 4, 4])),
    (1, np.array([2, 2, 0, -1])),  # negative index, repeats
    (-1, np.array(1)),  # scalar index drops the axis
    (1, np.array([[1, 0], [1, -3]])),
])
def test_gather(axis, idx):
    x = r(5, 3, 4)
    if axis == 0 and idx.ndim == 2:
        def fn(u, i):
            return F.embedding(torch.as_tensor(idx), u.reshape(5, 12)).reshape(idx.shape + (3, 4))
    else:
        def fn(u, i):
            return t_gather(u, idx, axis)
    vs_torch("Gather", [x, idx], fn, {"axis": axis}, opset=13)


@pytest.mark.parametrize("mode,tmode", [("constant", "constant"), ("reflect", "reflect"), ("edge", "replicate"),
                                        ("wrap", "circular")])
@pytest.mark.parametrize("pads", [(0, 0, 1, 2, 0, 0, 2, 1), (0, 0, 0, 3, 0, 0, 2, 0), (0, 0, 1, -1, 0, 0, -2, 2)])
def test_pad(mode, tmode, pads):
    if mode != "constant" and min(pads) < 0:
        pytest.skip("torch crops only in constant mode")
    x = r(2, 3, 4, 5)
    tp = torch_pads(pads)[:4]  # the last two axes (torch pads at most those in its non-constant modes)
    vs_torch("Pad", [x, np.array(pads, np.int64)], lambda u, p: F.pad(u, tp, mode=tmode), {"mode": mode},
             opset=19, wrt=[0])
    if mode == "constant":
        vs_torch("Pad", [x, np.array(pads, np.int64), np.array(0.7)], lambda u, p, v: F.pad(u, tp, value=0.7),
                 {"mode": mode}, opset=19, wrt=[0])
    # opset 18's axes input: pads for the named axes only
    vs_torch("Pad", [x, np.array(pads[2:4] + pads[6:8], np.int64), None, np.array([2, -1], np.int64)],
             lambda u, p, v, a: F.pad(u, tp, mode=tmode), {"mode": mode}, opset=19, wrt=[0])
    if mode != "wrap":
        vs_torch("Pad", [x], lambda u: F.pad(u, tp, mode=tmode), {"mode": mode, "pads": pads}, opset=2)


F32 = np.float32
RESIZE = [
    # (x shape, onnx attrs, scales or None, sizes or None, torch interpolate kwargs)
    ((1, 2, 3, 4), dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
     (1, 1, 2, 2), None, dict(scale_factor=2, mode="nearest")),
    ((1, 2, 4, 6), dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
     (1, 1, 0.5, 1.5), None, dict(scale_factor=(0.5, 1.5), mode="nearest")),
    ((2, 2, 3, 5), dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil"),
     None, (2, 2, 7, 4), dict(size=(7, 4), mode="nearest-exact")),
    ((1, 2, 3, 4), dict(mode="linear", coordinate_transformation_mode="half_pixel"),
     (1, 1, 2, 2), None, dict(scale_factor=2, mode="bilinear", align_corners=False)),
    ((1, 2, 4, 6), dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
     None, (1, 2, 7, 3), dict(size=(7, 3), mode="bilinear", align_corners=False)),
    ((1, 2, 3, 4), dict(mode="linear", coordinate_transformation_mode="align_corners"),
     None, (1, 2, 5, 9), dict(size=(5, 9), mode="bilinear", align_corners=True)),
    ((2, 3, 5), dict(mode="linear", coordinate_transformation_mode="half_pixel"),
     (1, 1, 1.6), None, dict(scale_factor=1.6, mode="linear", align_corners=False)),
    ((1, 1, 2, 3, 4), dict(mode="linear", coordinate_transformation_mode="half_pixel"),
     (1, 1, 2, 2, 0.5), None, dict(scale_factor=(2, 2, 0.5), mode="trilinear", align_corners=False)),
    ((1, 2, 4, 5), dict(mode="cubic", coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75),
     (1, 1, 2, 2), None, dict(scale_factor=2, mode="bicubic", align_corners=False)),
]


@pytest.mark.parametrize("shape,attrs,scales,sizes,t", RESIZE, ids=lambda v: str(v) if isinstance(v, tuple) else None)
def test_resize(shape, attrs, scales, sizes, t):
    sc = None if scales is None else np.array(scales, F32)
    sz = None if sizes is None else np.array(sizes, np.int64)
    vs_torch("Resize", [r(*shape), None, sc, sz], lambda u, *_: F.interpolate(u, **t), attrs, opset=19, wrt=[0])


def test_resize_and_upsample_legacy_nearest():
    x = r(1, 2, 3, 4)

    def fn(u, *_):
        return F.interpolate(u, scale_factor=(2, 3), mode="nearest")

    vs_torch("Resize", [x, np.array([1, 1, 2, 3], F32)], fn, {"mode": "nearest"}, opset=10, wrt=[0])
    vs_torch("Upsample", [x, np.array([1, 1, 2, 3], F32)], fn, {"mode": "nearest"}, opset=9, wrt=[0])
    vs_torch("Upsample", [x], fn, {"mode": "nearest", "scales": (1.0, 1.0, 2.0, 3.0)}, opset=7)


# ---------------------------------------------------------------- data movement

@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for i, s in enumerate(shapes):
        s[axis] += i
    vs_torch("Concat", [r(*s) for s in shapes], lambda *t: torch.cat(t, axis), {"axis": axis})


def test_split():
    x = r(2, 7, 3)
    vs_torch("Split", [x, np.array([2, 4, 1], np.int64)], lambda u, s: torch.split(u, [2, 4, 1], 1),
             {"axis": 1}, opset=13, wrt=[0], n_out=3)
    vs_torch("Split", [x], lambda u: torch.split(u, [1, 1], 0), {"axis": 0, "split": [1, 1]}, opset=11, n_out=2)
    # opset 18: num_outputs, the last part shorter
    vs_torch("Split", [x, None], lambda u, s: torch.split(u, 3, 1), {"axis": 1, "num_outputs": 3}, opset=18,
             wrt=[0], n_out=3)


def test_split_only_some_outputs_used():
    x = r(4, 6)
    vs_torch("Split", [x, None], lambda u, s: torch.split(u, 2, 1), {"axis": 1, "num_outputs": 3}, opset=18,
             wrt=[0], n_out=3, grad_of=[1])


@pytest.mark.parametrize("starts,ends,axes,steps,index", [
    ([1], [3], [0], None, (slice(1, 3),)),
    ([0, 1], [4, -1], [0, 2], [2, 1], (slice(0, 4, 2), slice(None), slice(1, -1))),
    ([0], [2**63 - 1], [-1], [3], (..., slice(0, None, 3))),
    ([0, 0, 0], [1, 5, 3], None, None, (slice(0, 1), slice(0, 5), slice(0, 3))),  # MiniLM's CLS token
])
def test_slice(starts, ends, axes, steps, index):
    ints = [None if v is None else np.array(v, np.int64) for v in (starts, ends, axes, steps)]
    vs_torch("Slice", [r(4, 5, 6)] + ints, lambda u, *_: u[index], opset=13, wrt=[0])


def test_slice_negative_step():
    # torch has no negative step: flip, then slice forwards
    vs_torch("Slice", [r(4, 5, 6), np.array([-1]), np.array([-(2**63)]), np.array([1]), np.array([-2])],
             lambda u, *_: u.flip(1)[:, 0::2], opset=13, wrt=[0])


@pytest.mark.parametrize("perm", [None, (1, 0, 2), (2, 0, 1), (0, 2, 1, 3)])
def test_transpose(perm):
    x = r(2, 3, 4, 5) if perm is None or len(perm) == 4 else r(2, 3, 4)
    p = tuple(reversed(range(x.ndim))) if perm is None else perm
    vs_torch("Transpose", [x], lambda u: u.permute(p), {} if perm is None else {"perm": perm})


@pytest.mark.parametrize("shape,target", [((2, 3, 4), (4, 0, -1)), ((2, 12), (2, 3, 4)), ((2, 5, 8), (0, 0, 2, 4))])
def test_reshape(shape, target):
    x = r(*shape)
    out = tuple(shape[i] if v == 0 else v for i, v in enumerate(target))
    vs_torch("Reshape", [x, np.array(target, np.int64)], lambda u, s: u.reshape(out), wrt=[0])


def test_squeeze_unsqueeze_identity():
    x = r(3, 1, 4, 1)
    vs_torch("Squeeze", [x, np.array([1, -1], np.int64)], lambda u, a: u.squeeze(3).squeeze(1), opset=13, wrt=[0])
    vs_torch("Squeeze", [x], lambda u: u.squeeze(1), {"axes": [1]}, opset=11)
    vs_torch("Unsqueeze", [r(3, 4), np.array([0, 3], np.int64)], lambda u, a: u.unsqueeze(0).unsqueeze(3), opset=13,
             wrt=[0])
    vs_torch("Unsqueeze", [r(3, 4)], lambda u: u.unsqueeze(1), {"axes": [1]}, opset=11)
    vs_torch("Identity", [r(3, 4)], lambda u: u.clone())


@pytest.mark.parametrize("to,tdtype", [(11, torch.float64), (1, torch.float32)])
def test_cast_float_to_float(to, tdtype):
    vs_torch("Cast", [r(3, 4)], lambda u: u.to(tdtype), {"to": to})


def test_dropout():
    x, ratio = r(5, 6), np.array(0.3)
    vs_torch("Dropout", [x, ratio, np.array(False)], lambda u, p, t: F.dropout(u, 0.3, training=False), opset=13,
             wrt=[0])
    vs_torch("Dropout", [x], lambda u: u.clone(), {"ratio": 0.3}, opset=7)
    # training: torch draws other random numbers, so the reference takes the mask our seeded forward drew
    _, mask = get_kernel("Dropout", "", 13, x.dtype).forward(x, ratio, np.array(True), seed=7, n_outputs=2)
    assert 0 < mask.sum() < mask.size
    m = torch.as_tensor(mask)
    vs_torch("Dropout", [x, ratio, np.array(True)], lambda u, p, t: (u * m / 0.7, m), {"seed": 7}, opset=13,
             wrt=[0], n_out=2)


# ---------------------------------------------------------------- CastLike (no torch op: finite differences)

def test_cast_like_finite_differences():
    check_backward("CastLike", [r(3, 4), r(2)], opset=15, wrt=[0])
    check_backward("CastLike", [r(2, 3), np.zeros(1, np.float64)], opset=21, wrt=[0])


def test_cast_like_gradient_dtype_and_none():
    k = get_kernel("CastLike", "", 15, np.float32)
    x32, like64 = r(3, 4).astype(np.float32), np.zeros(1)
    y = k.forward(x32, like64)
    assert y.dtype == np.float64
    dy = r(3, 4)
    gx, glike = k.backward_fn([dy], [x32, like64], [y])
    assert gx.dtype == np.float32 and glike is None
    np.testing.assert_array_equal(gx, dy.astype(np.float32))
    # an integer source has no gradient
    xi = np.arange(6).reshape(2, 3)
    assert k.backward_fn([np.ones((2, 3))], [xi, like64], [k.forward(xi, like64)]) == (None, None)


# Every test here but CastLike's needs torch.
for _name, _test in list(globals().items()):
    if _name.startswith("test_") and "cast_like" not in _name:
        globals()[_name] = needs_torch(_test)
