"""Resize / Upsample on the numpy backend against onnxruntime over parameter
grids (modes, coordinate modes, nearest modes, scales and sizes, axes,
antialias, legacy opsets, integer images), plus edge cases and backwards.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _nn_check import assert_matches_ort, one_node_model, run_numpy, run_ort
from test_backward_kernels import check_backward

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(7)
X4 = RNG.standard_normal((1, 2, 5, 7)).astype(np.float32)
F = np.float32

COORDS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize",
          "half_pixel_symmetric"]
# non-integral products (7 * 1.5, 5 * 0.6, ...) on purpose: rounding boundaries
SCALES = [[1, 1, 2, 1.5], [1, 1, 0.6, 0.5], [1, 1, 1.7, 3.1], [1, 1, 0.34, 0.8]]
ROI = [0, 0, 0.1, 0.2, 1, 1, 0.9, 0.7]


def _resize(x, *, opset=19, scales=None, sizes=None, roi=None, **attrs):
    consts, order = {}, ["x"]
    if opset >= 11:
        consts["roi"] = np.asarray(roi if roi is not None else [], F)
        order.append("roi")
        consts["scales"] = np.asarray(scales if scales is not None else [], F)
        order.append("scales")
        if sizes is not None:
            consts["sizes"] = np.asarray(sizes, np.int64)
            order.append("sizes")
    else:
        consts["scales"] = np.asarray(scales, F)
        order.append("scales")
    return one_node_model("Resize", {"x": x}, consts, opset=opset, input_order=order, **attrs)


def _diverges(ctm, x_shape, scales):
    """align_corners with a fractional scale * length: the ONNX test data divide by
    (scale * length - 1), onnxruntime by (output length - 1); the numpy backend
    follows the conformance data (see kernels/resize.py), so such a case is checked
    against onnx.reference instead."""
    if ctm != "align_corners" or scales is None:
        return False
    return any(abs(s * n - round(s * n)) > 1e-6 for s, n in zip(scales, x_shape))


def _ac_scales(ctm, scales):
    # 5 * 0.6 is whole in float32 (so onnxruntime's and this backend's length agree)
    # but not in float64 (onnx.reference's): no peer to compare with there
    return [0.625 if v == 0.6 else v for v in scales] if ctm == "align_corners" else scales


def _check(model, feeds, divergent=False):
    if not divergent:
        assert_matches_ort(model, feeds)
        return
    from onnx.reference import ReferenceEvaluator

    want = ReferenceEvaluator(model).run(None, feeds)
    for g, w in zip(run_numpy(model, feeds), want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def _opset_coords(opsets):
    # half_pixel_symmetric exists from opset 19
    return [(o, c) for o in opsets for c in COORDS if c != "half_pixel_symmetric" or o >= 19]


@pytest.mark.parametrize("opset,ctm", _opset_coords([11, 13, 19]))
@pytest.mark.parametrize("scales", SCALES, ids=str)
def test_nearest_all_modes_match_onnxruntime(opset, ctm, scales):
    scales = _ac_scales(ctm, scales)
    roi = ROI if ctm == "tf_crop_and_resize" else None
    for nm in ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]:
        m = _resize(X4, opset=opset, scales=scales, roi=roi, mode="nearest",
                    coordinate_transformation_mode=ctm, nearest_mode=nm)
        _check(m, {"x": X4}, _diverges(ctm, X4.shape, scales))


@pytest.mark.parametrize("opset,ctm", _opset_coords([11, 19]))
@pytest.mark.parametrize("scales", SCALES, ids=str)
def test_linear_and_cubic_match_onnxruntime(opset, ctm, scales):
    scales = _ac_scales(ctm, scales)
    roi = ROI if ctm == "tf_crop_and_resize" else None
    divergent = _diverges(ctm, X4.shape, scales)
    m = _resize(X4, opset=opset, scales=scales, roi=roi, mode="linear", coordinate_transformation_mode=ctm,
                extrapolation_value=-3.5)
    _check(m, {"x": X4}, divergent)
    for a, ex in [(-0.75, 0), (-0.5, 1), (-0.5, 0)]:
        m = _resize(X4, opset=opset, scales=scales, roi=roi, mode="cubic", coordinate_transformation_mode=ctm,
                    cubic_coeff_a=a, exclude_outside=ex)
        _check(m, {"x": X4}, divergent)


@pytest.mark.parametrize("ctm", COORDS)
@pytest.mark.parametrize("sizes", [[1, 2, 9, 4], [1, 2, 3, 13], [1, 2, 1, 1], [1, 2, 5, 7]], ids=str)
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_sizes_match_onnxruntime(ctm, sizes, mode):
    roi = ROI if ctm == "tf_crop_and_resize" else None
    m = _resize(X4, sizes=sizes, roi=roi, mode=mode, coordinate_transformation_mode=ctm)
    # onnxruntime copies the input when the output shape equals it, ignoring roi;
    # the numpy backend crops as the spec (and onnx.reference) say
    _check(m, {"x": X4}, ctm == "tf_crop_and_resize" and sizes == list(X4.shape))


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("scales", [[1, 1, 0.6, 0.5], [1, 1, 0.34, 0.8], [1, 1, 2, 0.3]], ids=str)
def test_antialias_scales(mode, scales):
    assert_matches_ort(_resize(X4, scales=scales, mode=mode, antialias=1), {"x": X4})


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
@pytest.mark.parametrize("axes,sizes", [([2, 3], [3, 3]), ([3, 2], [5, 2]), ([2, 3], [9, 4])], ids=str)
def test_axes_and_keep_aspect_ratio(mode, policy, axes, sizes):
    m = _resize(X4, sizes=sizes, mode=mode, keep_aspect_ratio_policy=policy, axes=axes,
                antialias=int(mode != "nearest"))
    assert_matches_ort(m, {"x": X4})


def test_axes_with_scales():
    assert_matches_ort(_resize(X4, scales=[2.5, 0.5], mode="linear", axes=[2, 3]), {"x": X4})
    assert_matches_ort(_resize(X4, scales=[0.5, 2.5], mode="nearest", axes=[-1, -2]), {"x": X4})


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", SCALES, ids=str)
def test_resize_10_legacy_rounding(mode, scales):
    assert_matches_ort(_resize(X4, opset=10, scales=scales, mode=mode), {"x": X4})


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 1.5], [1, 1, 0.6, 0.5]], ids=str)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32])
def test_integer_images_truncate_like_onnxruntime(mode, scales, dtype):
    """Integer outputs are truncated, as onnxruntime's C cast does. Its float32
    sums land near-whole values on either side now and then (25.0 -> 24.99998
    -> 24); the numpy backend truncates the float64 value snapped to whole
    numbers within 1e-4: the two are at most 1 apart, and rarely."""
    info = np.iinfo(dtype)
    x = RNG.integers(max(info.min, -1000), min(info.max, 1000) + 1, (1, 3, 4, 6)).astype(dtype)
    m = _resize(x, scales=scales, mode=mode)
    if mode == "nearest":
        assert_matches_ort(m, {"x": x})
        return
    got, want = run_numpy(m, {"x": x})[0], run_ort(m, {"x": x})[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = got.astype(np.int64) - want.astype(np.int64)
    assert np.all(np.abs(diff) <= 1), diff
    assert np.mean(diff == 0) > 0.8
    exact = run_numpy(_resize(x.astype(np.float64), scales=scales, mode=mode), {"x": x.astype(np.float64)})[0]
    np.testing.assert_array_equal(got, np.trunc(exact + np.copysign(1e-4, exact)).astype(dtype))


def test_other_ranks():
    x5 = RNG.standard_normal((1, 2, 3, 4, 5)).astype(F)
    assert_matches_ort(_resize(x5, scales=[1, 1, 2, 1.5, 0.5], mode="linear"), {"x": x5})
    assert_matches_ort(_resize(x5, scales=[1, 2, 2, 1.5, 0.5], mode="nearest"), {"x": x5})
    x2 = RNG.standard_normal((5, 6)).astype(F)
    for mode in ["nearest", "linear", "cubic"]:
        assert_matches_ort(_resize(x2, scales=[2, 1.5], mode=mode), {"x": x2})


@pytest.mark.parametrize("opset", [7, 9])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_matches_onnxruntime(opset, mode):
    scales = [1, 1, 2, 3]
    if opset == 7:
        m = one_node_model("Upsample", {"x": X4}, opset=7, mode=mode, scales=[float(s) for s in scales])
    else:
        m = one_node_model("Upsample", {"x": X4}, {"s": np.asarray(scales, F)}, opset=9, mode=mode)
    assert_matches_ort(m, {"x": X4})


# ------------------------------------------------------------------- edge cases

def test_bad_input_is_a_clear_kernel_error():
    k = get_kernel("Resize", opset=19)
    with pytest.raises(KernelError, match="exactly one of the scales and sizes"):
        k(X4, None, np.array([1, 1, 2, 2], F), np.array([1, 2, 10, 14]))
    with pytest.raises(KernelError, match="exactly one"):
        k(X4, None, None, None)
    with pytest.raises(KernelError, match="antialias"):
        k(X4, None, np.array([1, 1, 0.5, 0.5], F), mode="nearest", antialias=1)
    with pytest.raises(KernelError, match="mode='bicubic'"):
        k(X4, None, np.array([1, 1, 2, 2], F), mode="bicubic")
    with pytest.raises(KernelError, match="scales has 3 values for 4 axes"):
        k(X4, None, np.array([1, 2, 2], F))
    with pytest.raises(KernelError, match="needs the roi"):
        k(X4, None, np.array([1, 1, 2, 2], F), coordinate_transformation_mode="tf_crop_and_resize")
    with pytest.raises(KernelError, match="positive"):
        k(X4, None, np.array([1, 1, 0, 2], F))


def test_zero_sized_output_and_identity():
    k = get_kernel("Resize", opset=19)
    y = k(X4, None, None, np.array([1, 2, 0, 7]))
    assert y.shape == (1, 2, 0, 7)
    same = k(X4, None, np.array([1, 1, 1, 1], F), mode="linear")
    np.testing.assert_array_equal(same, X4)
    assert same is not X4


def test_crop_to_the_same_size():
    """tf_crop_and_resize to the input's own size still crops and stretches the roi."""
    k = get_kernel("Resize", opset=19)
    x = np.arange(5, dtype=F).reshape(1, 5)
    y = k(x, np.array([0, 0.25, 1, 0.75], F), None, np.array([1, 5]), mode="linear",
          coordinate_transformation_mode="tf_crop_and_resize")
    np.testing.assert_allclose(y, [[1, 1.5, 2, 2.5, 3]])


def test_dtype_is_kept():
    k = get_kernel("Resize", opset=19)
    for dt in (np.float16, np.float64, np.int32, np.uint8):
        x = (X4 * 10).astype(dt)
        assert k(x, None, np.array([1, 1, 2, 2], F), mode="linear").dtype == dt
    b = X4 > 0
    assert k(b, None, np.array([1, 1, 2, 2], F)).dtype == np.bool_


def test_nearest_integer_upsample_is_repeat():
    k = get_kernel("Resize", opset=19)
    y = k(X4, None, np.array([1, 1, 2, 3], F), mode="nearest", coordinate_transformation_mode="asymmetric",
          nearest_mode="floor")
    np.testing.assert_array_equal(y, np.repeat(np.repeat(X4, 2, axis=2), 3, axis=3))


# ------------------------------------------------------------------- backward

@pytest.mark.parametrize(
    "mode,ctm,scales",
    list(itertools.product(["nearest", "linear"], ["half_pixel", "align_corners", "asymmetric"],
                           [[1, 1, 2, 2], [1, 1, 0.5, 1.5], [1, 1, 1.7, 0.6]])),
)
def test_resize_backward(mode, ctm, scales):
    x = RNG.standard_normal((1, 2, 4, 5))
    if ctm == "align_corners":
        scales = [1, 1, 2, 2]
    check_backward("Resize", [x, None, np.asarray(scales, F)], dict(mode=mode, coordinate_transformation_mode=ctm),
                   opset=19, wrt=[0])


def test_resize_backward_sizes_and_upsample():
    x = RNG.standard_normal((1, 1, 3, 4))
    check_backward("Resize", [x, None, None, np.array([1, 1, 7, 5])], dict(mode="linear"), opset=13, wrt=[0])
    check_backward("Upsample", [x, np.array([1, 1, 2, 3], F)], dict(mode="linear"), opset=9, wrt=[0])
    check_backward("Upsample", [x], dict(mode="nearest", scales=(1.0, 1.0, 2.0, 2.0)), opset=7, wrt=[0])
