"""The fused layer norm decides per output shape (once) whether gamma/beta apply in
place; calls with other shapes, or with a gamma that broadcasts the output up, must
still give the plain formula's values and shape."""

from __future__ import annotations

import numpy as np

from edgeflow.runtime.optimize.passes.fuse_layernorm import _make_forward


def _ref(x, gamma, beta, eps=1e-5):
    m = x.mean(axis=-1, keepdims=True)
    d = x - m
    return d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + eps) * gamma + beta


def test_shapes_and_broadcasting_gamma():
    rng = np.random.default_rng(2)
    gamma, beta = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    f = _make_forward((-1,), False, None, np.float32(1e-5), gamma, beta)
    for shape in [(2, 3, 4), (5, 4), (2, 3, 4)]:
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(f(x), _ref(x, gamma, beta), rtol=1e-5, atol=1e-5)
    wide = rng.standard_normal((2, 1, 4)).astype(np.float32)  # broadcasts (1, 3, 4) up to (2, 3, 4)
    g = _make_forward((-1,), False, None, np.float32(1e-5), wide, None)
    x = rng.standard_normal((1, 3, 4)).astype(np.float32)
    for _ in range(2):
        got = g(x)
        assert got.shape == (2, 3, 4)
        np.testing.assert_allclose(got, _ref(x, wide, 0), rtol=1e-5, atol=1e-5)
