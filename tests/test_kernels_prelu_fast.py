"""PRelu's in-place min/max form must give np.where's values exactly (issue 30's
speed-up; only a -0.0 input comes out +0.0, an equal value), including zeros,
infinities, NaN, negative and per-channel slopes; a
non-finite slope or one that broadcasts the input up keeps the where() form."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.kernels import get_kernel

prelu = get_kernel("PRelu", opset=16, dtype="float32").forward


def _where(x, s):
    return np.where(x > 0, x, x * s).astype(x.dtype, copy=False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_same_bits_as_where(dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 5, 6)).astype(dtype)
    x[0, 0, 0, :4] = [0.0, -0.0, np.inf, -np.inf]
    x[0, 0, 1, 0] = np.nan
    for s in (rng.standard_normal((1, 4, 1, 1)).astype(dtype), np.array([0.25], dtype),
              np.array([-1.5, 0.0, 2.0, 1e-3], dtype)[:, None, None]):
        got = prelu(x, s)
        want = _where(x, s)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)  # exact values; NaN where NaN
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))


def test_per_channel_slope_and_fallbacks():
    x = np.array([[[-2.0, 1.0, -3.0], [3.0, -1.0, 0.5]]] * 2, np.float32)  # (2, 2, 3)
    np.testing.assert_array_equal(prelu(x, np.array([0.5, 2.0], np.float32)),  # (C,) slope of old exporters
                                  _where(x, np.array([0.5, 2.0], np.float32).reshape(1, 2, 1)))
    inf_slope = np.array([np.inf], np.float32)
    np.testing.assert_array_equal(prelu(x, inf_slope), _where(x, inf_slope))  # positives stay, not NaN
    v = np.array([-1.0, 2.0], np.float32)
    wide = np.array([[0.5], [0.25]], np.float32)  # broadcasts (2,) up to (2, 2)
    np.testing.assert_array_equal(prelu(v, wide), _where(v, wide))
