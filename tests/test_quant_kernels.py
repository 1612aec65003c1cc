"""int8 kernels against exact int64 references: rounding, saturation, the
float-BLAS exactness bound (at and past it), adversarial extremes."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.kernels import get_kernel
from edgeflow.kernels.int_gemm import F32_EXACT, exact_matmul, f32_block, int_bound, int_matmul
from edgeflow.kernels.qdq_fused import k_blocks, qconv, qgemm

Q = get_kernel("QuantizeLinear", opset=21)
DQ = get_kernel("DequantizeLinear", opset=21)
DQL = get_kernel("DynamicQuantizeLinear", opset=11)
MMI = get_kernel("MatMulInteger", opset=10, dtype="uint8")
CI = get_kernel("ConvInteger", opset=10, dtype="uint8")
QLMM = get_kernel("QLinearMatMul", opset=21, dtype="uint8")
QLC = get_kernel("QLinearConv", opset=10, dtype="uint8")


# --- QuantizeLinear / DequantizeLinear / DynamicQuantizeLinear -------------

def test_quantize_rounds_half_to_even_after_division():
    x = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 0.49999997], np.float32)
    y = Q(x, np.float32(1.0), np.int8(0))
    assert y.tolist() == [0, 2, 2, 4, 0, -2, -2, 0]
    # the zero point is added after rounding: rint(0.5) + 1 = 1, not rint(1.5) = 2
    assert Q(np.float32([0.5]), np.float32(1.0), np.uint8(1)).tolist() == [1]
    # a true float32 division (not a multiplication by the reciprocal), as the spec says
    rng = np.random.default_rng(0)
    v = rng.standard_normal(10_000).astype(np.float32) * 10
    s = np.float32(0.0371)
    np.testing.assert_array_equal(Q(v, s, np.int8(0)), np.clip(np.rint(v / s), -128, 127).astype(np.int8))


@pytest.mark.parametrize("dtype, lo, hi", [(np.uint8, 0, 255), (np.int8, -128, 127), (np.uint16, 0, 65535), (np.int16, -32768, 32767)])
def test_quantize_saturates_to_the_type_range(dtype, lo, hi):
    x = np.array([-1e30, -1e6, -1.0, 0.0, 1.0, 1e6, 1e30, np.inf, -np.inf], np.float32)
    y = Q(x, np.float32(0.5), np.zeros((), dtype))
    assert y.dtype == dtype
    assert y.tolist() == [lo, lo, max(lo, -2), 0, min(hi, 2), hi, hi, hi, lo]


def test_quantize_default_type_is_uint8_and_output_dtype_attribute():
    assert Q(np.float32([3.0]), np.float32(1.0)).dtype == np.uint8
    assert Q(np.float32([-3.0]), np.float32(1.0), output_dtype=3).tolist() == [-3]  # INT8
    with pytest.raises(ValueError, match="numpy representation"):
        Q(np.float32([1.0]), np.float32(1.0), output_dtype=17)  # FLOAT8E4M3FN


def test_per_axis_and_blocked_parameters():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    s = np.array([1.0, 2.0, 4.0], np.float32)
    y = Q(x, s, np.zeros(3, np.uint8), axis=0)
    np.testing.assert_array_equal(y, np.rint(x / s[:, None]).astype(np.uint8))
    sb = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]], np.float32)  # blocks of 2 along axis 1
    yb = Q(x, sb, np.zeros((3, 2), np.uint8), axis=1, block_size=2)
    np.testing.assert_array_equal(yb, np.rint(x / np.repeat(sb, 2, axis=1)).astype(np.uint8))
    with pytest.raises(ValueError, match="entries"):
        Q(x, np.ones(4, np.float32), None, axis=0)


def test_dequantize_subtracts_the_zero_point_in_int_range():
    x = np.array([0, 1, 128, 255], np.uint8)
    np.testing.assert_array_equal(DQ(x, np.float32(0.5), np.uint8(128)), np.array([-64, -63.5, 0, 63.5], np.float32))
    xi = np.array([-(2**31), 2**31 - 1], np.int32)
    np.testing.assert_array_equal(DQ(xi, np.float32(1.0)), xi.astype(np.float32))
    assert DQ(np.int8([1]), np.float16(0.5)).dtype == np.float16


def test_dynamic_quantize_linear_range_includes_zero_and_handles_constant_input():
    x = np.array([1.0, 2.0, 3.0], np.float32)  # min > 0: range starts at 0
    y, s, z = DQL(x)
    assert z == 0 and np.isclose(s, 3.0 / 255)
    assert y.tolist() == [85, 170, 255]
    y0, s0, z0 = DQL(np.zeros(4, np.float32))
    assert s0 == np.float32(1.0 / 255) and z0 == 0 and not y0.any()
    yn, sn, zn = DQL(np.array([-1.0, 0.0, 1.0], np.float32))
    assert int(zn) in (127, 128) and DQ(yn, sn, zn)[1] == 0.0  # real zero is exact


# --- the float-BLAS exactness bound --------------------------------------

def test_f32_block_is_the_exact_bound():
    assert f32_block(128, 128) == 1024  # 1024 * 128 * 128 == 2**24 exactly
    assert f32_block(255, 128) == F32_EXACT // (255 * 128) == 514
    assert 514 * 255 * 128 <= F32_EXACT < 515 * 255 * 128
    assert int_bound(np.uint8, 0) == 255 and int_bound(np.uint8, 128) == 128 and int_bound(np.int8) == 128


def test_exact_at_the_bound_and_past_it():
    # K = 1024 products of (-128)(-128): the sum is 2**24, still exact in float32.
    a = np.full((1, 1024), -128.0, np.float32)
    b = np.full((1024, 1), -128.0, np.float32)
    assert exact_matmul(a, b, 128, 128)[0, 0] == 2**24
    # One more term of +1: 2**24 + 1 is not a float32; a single sgemm must get it wrong,
    # the split path must get it right.
    a1 = np.concatenate([a, np.ones((1, 1), np.float32)], axis=1)
    b1 = np.concatenate([b, np.ones((1, 1), np.float32)], axis=0)
    naive = (a1 @ b1)[0, 0]
    assert int(naive) != 2**24 + 1  # the test has teeth: float32 cannot hold the result
    assert exact_matmul(a1, b1, 128, 128)[0, 0] == 2**24 + 1


def test_int32_wraparound_matches_an_int32_accumulator():
    k = 70_000  # 70000 * 255 * 127 > 2**31
    a = np.full((1, k), 255, np.uint8)
    b = np.full((k, 1), 127, np.int8)
    got = int_matmul(a, b)
    want = np.array([[k * 255 * 127]], np.int64).astype(np.int32)  # two's complement wrap
    np.testing.assert_array_equal(got, want)


def _ref_matmul(a, b, azp=0, bzp=0):
    return ((a.astype(np.int64) - azp) @ (b.astype(np.int64) - bzp)).astype(np.int32)


@pytest.mark.parametrize("k", [1, 7, 514, 515, 2000])
@pytest.mark.parametrize("fill", ["extremes", "random"])
def test_matmul_integer_against_int64(k, fill):
    rng = np.random.default_rng(k)
    if fill == "extremes":
        a = rng.choice(np.array([0, 255], np.uint8), (5, k))
        b = rng.choice(np.array([-128, 127], np.int8), (k, 3))
        azp, bzp = np.uint8(0), np.int8(0)
    else:
        a = rng.integers(0, 256, (5, k), dtype=np.uint8)
        b = rng.integers(-128, 128, (k, 3), dtype=np.int8)
        azp, bzp = np.uint8(131), np.int8(-3)
    np.testing.assert_array_equal(MMI(a, b, azp, bzp), _ref_matmul(a, b, int(azp), int(bzp)))


def test_matmul_integer_all_255_times_all_minus_128_with_zero_points():
    a = np.full((2, 3, 600), 255, np.uint8)  # batched, K past the single-sgemm bound
    b = np.full((600, 4), -128, np.int8)
    np.testing.assert_array_equal(MMI(a, b), _ref_matmul(a, b))
    # per-row / per-column zero points
    azp = np.array([0, 255, 7], np.uint8)
    bzp = np.array([-128, 0, 127, 1], np.int8)
    want = ((a.astype(np.int64) - azp[:, None]) @ (b.astype(np.int64) - bzp)).astype(np.int32)
    np.testing.assert_array_equal(MMI(a, b, azp, bzp), want)


def _ref_conv(x, w, xzp=0, wzp=0, pads=(0, 0, 0, 0), strides=(1, 1), dilations=(1, 1), group=1):
    """Direct int64 convolution (no im2col): loops over kernel offsets."""
    x = x.astype(np.int64) - xzp
    w = w.astype(np.int64) - (np.asarray(wzp).reshape(-1, 1, 1, 1) if np.size(wzp) > 1 else wzp)
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    oh = (h - (kh - 1) * dilations[0] - 1) // strides[0] + 1
    ow = (wd - (kw - 1) * dilations[1] - 1) // strides[1] + 1
    y = np.zeros((n, m, oh, ow), np.int64)
    mg = m // group
    for gi in range(group):
        xs = x[:, gi * cg:(gi + 1) * cg]
        ws = w[gi * mg:(gi + 1) * mg]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i * dilations[0]: i * dilations[0] + (oh - 1) * strides[0] + 1: strides[0],
                           j * dilations[1]: j * dilations[1] + (ow - 1) * strides[1] + 1: strides[1]]
                y[:, gi * mg:(gi + 1) * mg] += np.einsum("nchw,mc->nmhw", patch, ws[:, :, i, j])
    return y.astype(np.int32)


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(pads=(1, 1, 1, 1)),
    dict(pads=(0, 2, 1, 0), strides=(2, 1), dilations=(1, 2)),
    dict(group=2, pads=(1, 1, 1, 1)),
])
def test_conv_integer_against_direct_int64(cfg):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (2, 4, 7, 6), dtype=np.uint8)
    w = rng.integers(-128, 128, (6, 4 // cfg.get("group", 1), 3, 3), dtype=np.int8)
    xzp, wzp = np.uint8(200), np.array([-128, 0, 1, 2, 3, 127], np.int8)
    got = CI(x, w, xzp, wzp, **{k: tuple(v) if isinstance(v, tuple) else v for k, v in cfg.items()})
    np.testing.assert_array_equal(got, _ref_conv(x, w, 200, wzp, **cfg))


def test_conv_integer_extremes_with_long_reduction():
    x = np.full((1, 64, 5, 5), 255, np.uint8)  # K = 64 * 9 = 576 > 514
    w = np.full((2, 64, 3, 3), -128, np.int8)
    np.testing.assert_array_equal(CI(x, w, np.uint8(0), None, pads=(1, 1, 1, 1)), _ref_conv(x, w, pads=(1, 1, 1, 1)))


def _requant_ref(acc, mult, zp, lo, hi):
    return np.clip(np.rint(acc.astype(np.float32) * mult) + zp, lo, hi)


def test_qlinear_matmul_and_conv_requantize_like_onnxruntime():
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (4, 300), dtype=np.uint8)
    b = rng.integers(-127, 128, (300, 5), dtype=np.int8)
    sa, sb, sy = np.float32(0.02), np.float32(0.003), np.float32(0.05)
    y = QLMM(a, sa, np.uint8(10), b, sb, np.int8(0), sy, np.uint8(128))
    acc = _ref_matmul(a, b, 10, 0)
    np.testing.assert_array_equal(y, _requant_ref(acc, np.float32(sa * sb / sy), 128, 0, 255))
    x = rng.integers(0, 256, (1, 3, 6, 6), dtype=np.uint8)
    w = rng.integers(-127, 128, (4, 3, 3, 3), dtype=np.int8)
    ws = np.array([0.01, 0.02, 0.03, 0.04], np.float32)
    bias = np.array([-1000, 0, 1000, 123456], np.int32)
    yc = QLC(x, sa, np.uint8(3), w, ws, np.int8(0), sy, np.uint8(5), bias, pads=(1, 1, 1, 1))
    accc = _ref_conv(x, w, 3, 0, pads=(1, 1, 1, 1)) + bias.reshape(1, -1, 1, 1)
    mult = (sa * ws / sy).astype(np.float32).reshape(1, -1, 1, 1)
    np.testing.assert_array_equal(yc, _requant_ref(accc, mult, 5, 0, 255))


# --- fused QDQ kernels -----------------------------------------------------

def test_k_blocks_split_where_the_bound_would_break():
    terms = np.full((2, 10), F32_EXACT // 4, np.int64)
    assert k_blocks(terms) == (0, 4, 8, 10)
    assert k_blocks(np.ones((3, 100), np.int64)) == ()  # one sgemm is exact


@pytest.mark.parametrize("k", [64, 3000])
def test_fused_gemm_exact_accumulator_on_extremes(k):
    """QGemm's accumulator (read back with multiplier 1, float output) is the exact integer."""
    rng = np.random.default_rng(k)
    x = rng.choice(np.array([0, 255], np.uint8), (3, k))
    w = rng.choice(np.array([-127, 127], np.int64), (k, 4))
    c = np.array([5, -7, 0, 2**20], np.int64)
    terms = np.concatenate([255 * np.abs(w.T), np.abs(c)[:, None]], axis=1)
    packed = np.concatenate([w, c[None, :]], axis=0).astype(np.float32)
    y = qgemm(x, packed, out_scale=np.ones(4, np.float32), blocks=k_blocks(terms))
    want = x.astype(np.int64) @ w + c
    np.testing.assert_array_equal(y.astype(np.int64), want.astype(np.float32).astype(np.int64))
    assert (k > 300) == bool(k_blocks(terms))  # the long case really takes the split path


def test_fused_conv_matches_integer_reference_and_relu_clamps_at_zero_point():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (2, 3, 5, 5), dtype=np.uint8)
    w = rng.integers(-127, 128, (4, 3, 3, 3)).astype(np.int64)
    xzp, yzp = 17, 100
    c = -xzp * w.reshape(4, -1).sum(axis=1)
    packed = np.concatenate([w.reshape(4, -1), c[:, None]], axis=1).astype(np.float32).reshape(1, 4, -1)
    mult = np.array([0.001, 0.002, 0.003, 0.004], np.float32)
    kw = dict(x_zero_point=xzp, multiplier=mult, y_zero_point=yzp, y_dtype="uint8",
              kernel_shape=(3, 3), pads=(1, 1, 1, 1))
    y = qconv(x, packed, **kw)
    acc = _ref_conv(x, w, xzp, 0, pads=(1, 1, 1, 1))
    want = _requant_ref(acc, mult.reshape(1, -1, 1, 1), yzp, 0, 255)
    np.testing.assert_array_equal(y, want)
    yr = qconv(x, packed, relu=1, **kw)
    np.testing.assert_array_equal(yr, np.maximum(want, yzp))
