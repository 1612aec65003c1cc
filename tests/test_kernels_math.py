"""Element-wise math kernels: edge cases the ONNX node cases leave out
(integer dtypes, signs, special values, float16, accuracy of Erf)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(7)


def k(op, opset=22, dtype=None):
    return get_kernel(op, opset=opset, dtype=dtype)


# ---------------------------------------------------------------- Erf


@pytest.mark.parametrize("dtype,max_ulp", [(np.float32, 1.0), (np.float64, 8.0)])
def test_erf_matches_math_erf(dtype, max_ulp):
    x = np.concatenate([
        np.linspace(-7, 7, 100_001), np.geomspace(1e-30, 7, 4001), -np.geomspace(1e-30, 7, 4001), [0.0, -0.0],
    ]).astype(dtype)
    ref = np.array([math.erf(float(v)) for v in x])
    y = k("Erf", 13)(x)
    assert y.dtype == dtype
    ulp = np.spacing(np.abs(ref).astype(dtype)).astype(np.float64)
    assert np.max(np.abs(y - ref) / ulp) <= max_ulp
    assert np.all(np.abs(y) <= 1)


def test_erf_float16_and_special_values():
    x = np.array([-np.inf, -3, -0.5, 0, 0.5, 3, np.inf, np.nan], dtype=np.float16)
    y = k("Erf", 13)(x)
    assert y.dtype == np.float16
    ref = np.array([math.erf(float(v)) if not math.isnan(v) else math.nan for v in x.astype(np.float64)])
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=1e-3)
    for dt in (np.float32, np.float64):
        z = k("Erf", 13)(np.array([np.nan, np.inf, -np.inf], dtype=dt))
        assert np.isnan(z[0]) and z[1] == 1 and z[2] == -1


def test_erf_keeps_shape_including_empty_and_scalar():
    assert k("Erf", 13)(np.zeros((2, 0, 3), np.float32)).shape == (2, 0, 3)
    assert k("Erf", 13)(np.float64(0.5) * np.ones(())).shape == ()


# ---------------------------------------------------------------- Gelu and friends


def test_gelu_exact_and_tanh():
    x = np.linspace(-6, 6, 1001).astype(np.float64)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(k("Gelu", 20)(x), exact, rtol=1e-12, atol=1e-14)
    tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(k("Gelu", 20)(x, approximate="tanh"), tanh, rtol=1e-12)
    # the approximation is close to, but not, the exact form
    assert 0 < np.max(np.abs(tanh - exact)) < 1e-3
    with pytest.raises(KernelError, match="approximate"):
        k("Gelu", 20)(x, approximate="fast")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("op,attrs", [
    ("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("Celu", {"alpha": 0.5}), ("Swish", {"alpha": 1.5}),
    ("Mish", {}), ("HardSwish", {}), ("ThresholdedRelu", {"alpha": 0.3}), ("Softsign", {}),
    ("Shrink", {"lambd": 0.7, "bias": 0.2}), ("Erf", {}),
])
def test_activations_keep_dtype_and_survive_extremes(op, attrs, dtype):
    x = np.array([-1e4, -30, -1, -0.1, 0, 0.1, 1, 30, 1e4], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow / invalid warnings leak
        y = k(op, 28)(x, **attrs)
    assert y.dtype == dtype and y.shape == x.shape
    assert np.all(np.isfinite(y))


def test_mish_and_swish_limits():
    x = np.array([-100.0, 0.0, 100.0])
    np.testing.assert_allclose(k("Mish", 22)(x), [0, 0, 100], atol=1e-30)
    np.testing.assert_allclose(k("Swish", 24)(x, alpha=2.0), [0, 0, 100], atol=1e-30)


def test_hard_swish_pieces():
    x = np.array([-4.0, -3.0, -1.5, 0.0, 1.5, 3.0, 4.0], np.float32)
    np.testing.assert_allclose(k("HardSwish", 22)(x), x * np.clip(x / 6 + 0.5, 0, 1), rtol=1e-6)
    assert k("HardSwish", 22)(x)[0] == 0 and k("HardSwish", 22)(x)[-1] == 4


def test_celu_rejects_zero_alpha():
    with pytest.raises(KernelError, match="alpha"):
        k("Celu", 12)(np.ones(3, np.float32), alpha=0.0)


def test_shrink_on_integers():
    x = np.array([-5, -1, 0, 1, 5], np.int32)
    y = k("Shrink", 9, "int32")(x, lambd=1.5, bias=1.0)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, [-4, 0, 0, 0, 4])


def test_prelu_broadcasts_and_accepts_per_channel_slopes():
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    slope = np.array([0.1, 0.2, 0.3], np.float32)
    # (C,) against (N, C, H, W) does not broadcast in numpy: taken per channel
    y = k("PRelu", 16)(x, slope)
    ref = np.where(x > 0, x, x * slope[None, :, None, None])
    np.testing.assert_allclose(y, ref)
    # (C, 1, 1) broadcasts normally; a trailing-dim slope too
    np.testing.assert_allclose(k("PRelu", 16)(x, slope.reshape(3, 1, 1)), ref)
    s5 = np.linspace(0, 1, 5).astype(np.float32)
    np.testing.assert_allclose(k("PRelu", 16)(x, s5), np.where(x > 0, x, x * s5))
    with pytest.raises(KernelError, match="does not broadcast"):
        k("PRelu", 16)(x, np.ones(7, np.float32))
    xi = np.array([-4, 2], np.int32)
    yi = k("PRelu", 16, "int32")(xi, np.array([2], np.int32))
    assert yi.dtype == np.int32 and yi.tolist() == [-8, 2]


# ---------------------------------------------------------------- Mod, Sign, rounding


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_mod_integer_signs(dtype):
    a = np.array([-7, -7, 7, 7, 0], dtype)
    b = np.array([3, -3, 3, -3, 5], dtype)
    y = k("Mod", 13, np.dtype(dtype).name)(a, b)
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, [2, -1, 1, -2, 0])  # the divisor's sign
    f = k("Mod", 13, np.dtype(dtype).name)(a, b, fmod=1)
    np.testing.assert_array_equal(f, [-1, -1, 1, 1, 0])  # the dividend's sign


def test_mod_float_and_special_values():
    a = np.array([5.5, -5.5, 0.0, np.inf, 3.0, -3.0, 3.0], np.float32)
    b = np.array([2.0, 2.0, -2.0, 2.0, 0.0, np.inf, np.inf], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = k("Mod", 28)(a, b)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y[:2], [1.5, 0.5])
    assert y[2] == 0 and np.signbit(y[2])  # zero takes the divisor's sign
    assert np.isnan(y[3]) and np.isnan(y[4])
    assert y[5] == np.inf and y[6] == 3.0
    np.testing.assert_array_equal(k("Mod", 28)(a[:2], b[:2], fmod=1), [1.5, -1.5])
    with pytest.raises(KernelError, match="fmod"):
        k("Mod", 13)(a, b, fmod=2)


def test_mod_broadcasts_unsigned_and_by_zero_does_not_warn():
    a = np.array([[10, 11, 12]], np.uint8)
    b = np.array([[3], [0]], np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = k("Mod", 13, "uint8")(a, b)
    assert y.shape == (2, 3) and y.dtype == np.uint8
    np.testing.assert_array_equal(y[0], [1, 2, 0])


def test_sign_round_ceil_floor():
    assert k("Sign", 13, "uint8")(np.array([0, 3], np.uint8)).tolist() == [0, 1]
    assert k("Sign", 13, "int64")(np.array([-9, 0, 9])).tolist() == [-1, 0, 1]
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.6], np.float32)
    np.testing.assert_array_equal(k("Round", 22)(x), [-2, -2, -0, 0, 2, 2, 3])  # halves to even
    np.testing.assert_array_equal(k("Ceil", 13)(x), np.ceil(x))
    np.testing.assert_array_equal(k("Floor", 13)(x), np.floor(x))


def test_isinf_isnan_flags():
    x = np.array([-np.inf, -1, 0, np.inf, np.nan], np.float32)
    f = k("IsInf", 20)
    assert f(x).tolist() == [True, False, False, True, False]
    assert f(x, detect_positive=0).tolist() == [True, False, False, False, False]
    assert f(x, detect_negative=0).tolist() == [False, False, False, True, False]
    assert not f(x, detect_negative=0, detect_positive=0).any()
    assert k("IsNaN", 20)(x).tolist() == [False, False, False, False, True]


# ---------------------------------------------------------------- trigonometry


@pytest.mark.parametrize("op,fn", [
    ("Sin", np.sin), ("Cos", np.cos), ("Tan", np.tan), ("Asin", np.arcsin), ("Acos", np.arccos),
    ("Atan", np.arctan), ("Sinh", np.sinh), ("Cosh", np.cosh), ("Asinh", np.arcsinh), ("Acosh", np.arccosh),
    ("Atanh", np.arctanh),
])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_trig_out_of_domain_is_nan_without_warnings(op, fn, dtype):
    x = np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = k(op, 7)(x)
    assert y.dtype == dtype
    with np.errstate(all="ignore"):
        np.testing.assert_allclose(y, fn(x), rtol=1e-3, equal_nan=True)


@pytest.mark.parametrize("op,extra", [
    ("Sigmoid", ()), ("HardSigmoid", ()), ("HardSwish", ()), ("Elu", ()), ("Selu", ()), ("LeakyRelu", ()),
    ("Swish", ()), ("Mish", ()), ("Gelu", ()), ("Celu", ()), ("Erf", ()), ("Softmax", ()), ("LogSoftmax", ()),
    ("SwiGLU", (np.array(2.0, np.float32),)), ("Add", (np.array(2.0, np.float32),)),
    ("Mul", (np.array(2.0, np.float32),)), ("Sub", (np.array(2.0, np.float32),)), ("Div", (np.array(2.0, np.float32),)),
])
def test_scalar_inputs_give_arrays(op, extra):
    """0-d inputs: in-place kernels must not trip over numpy returning scalars, and the
    ops the executor may fuse a Relu into (out=) must return arrays."""
    x = np.array(0.5, np.float32)
    y = k(op, 28)(x, *extra)
    assert isinstance(y, np.ndarray) and y.shape == () and y.dtype == np.float32
