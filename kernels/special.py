"""Special functions: Erf (and the ``erf`` helper Gelu uses).

numpy has no erf, and a per-element ``math.erf`` call would be a Python loop,
so erf is evaluated here with vectorized approximations:

- float16/float32: ``erf(x) = x * P(s) / Q(s)`` with ``s = (x/4)^2`` on
  ``|x| <= 4`` (beyond, erf rounds to +-1 in float32), P of degree 6 and Q
  of degree 5, evaluated in float64. The coefficients were fitted by
  iteratively reweighted least squares (Sanathanan-Koerner) against
  ``math.erf`` on 40,001 points: relative error below 5e-9, a tenth of a
  float32 ulp, so the float32 result is the correctly rounded value up to
  rare ties.
- float64: the Maclaurin series (18 terms) on ``|x| < 1``; ``1 - erfc`` on
  ``1 <= |x| < 6`` with erfc a Chebyshev interpolant built at import from
  ``math.erfc`` (erf is +-1 to double precision beyond). Within a few ulp.

tests/test_kernels_math.py checks both against ``math.erf`` on a dense grid.
"""

from __future__ import annotations

import math

import numpy as np

from .registry import register

_P32 = (
    1.1283791694359722, 2.9623458415362984, 13.901924739726665, 15.756147216611428,
    24.86082348897297, 4.905817650272227, -0.22084095732402145,
)
_Q32 = (1.0, 7.958645293910228, 29.166231880847114, 63.30482460365977, 85.63206393977019, 66.11662560037567)


def _horner(coeffs, s: np.ndarray) -> np.ndarray:
    out = np.full_like(s, coeffs[-1])
    for c in coeffs[-2::-1]:
        out *= s
        out += c
    return out


def _erf_rational(x: np.ndarray) -> np.ndarray:
    """erf of a (small) array, evaluated in float64."""
    w = np.clip(x.astype(np.float64), -4.0, 4.0)
    s = w * w
    s *= 1.0 / 16.0
    p = _horner(_P32, s)
    p /= _horner(_Q32, s)
    p *= w
    return p


_BLOCK = 1 << 16


def blocked(fn, x: np.ndarray, dtype) -> np.ndarray:
    """``fn`` applied to 64K-element slices of ``x`` (flattened), results cast to ``dtype``.

    A chain of ~30 ufuncs over a whole large tensor streams each temporary
    through memory (and faults in fresh pages); on cache-sized slices the
    same chain runs several times faster.
    """
    out = np.empty(x.shape, dtype=dtype)
    flat, dst = x.reshape(-1), out.reshape(-1)
    for i in range(0, flat.size, _BLOCK):
        dst[i:i + _BLOCK] = fn(flat[i:i + _BLOCK])
    return out


def _cheb_fit(fn, a: float, b: float, n: int) -> tuple[float, float, np.ndarray]:
    """Coefficients of the degree n-1 Chebyshev interpolant of fn on [a, b].

    The nodes and the cosine sums are taken in long double (80-bit on x86),
    so the coefficients carry the accuracy of ``fn`` rather than the
    rounding of an n-term double sum.
    """
    ld = np.longdouble
    theta = np.pi * (np.arange(n, dtype=ld) + ld(0.5)) / n
    xs = ld(0.5) * (a + b) + ld(0.5) * (b - a) * np.cos(theta)
    ys = np.array([fn(float(v)) for v in xs], dtype=ld)
    c = np.array([ld(2) / n * np.sum(ys * np.cos(j * theta)) for j in range(n)], dtype=ld)
    c[0] /= 2
    return a, b, c.astype(np.float64)


def _cheb_eval(fit, x: np.ndarray) -> np.ndarray:
    a, b, c = fit
    u = (2.0 * x - (a + b)) / (b - a)
    u2 = 2.0 * u
    b1 = np.zeros_like(u)
    b2 = np.zeros_like(u)
    for ck in c[:0:-1]:  # Clenshaw recurrence
        b1, b2 = u2 * b1 - b2 + ck, b1
    return u * b1 - b2 + c[0]


# |x| < 1: the Maclaurin series 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1)), 18 terms (2 ulp)
_TAYLOR = tuple((-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(18))
# 1 <= |x| < 6: erf = 1 - erfc, erfc interpolated (its small size keeps the absolute error tiny)
_ERFC = _cheb_fit(math.erfc, 1.0, 6.0, 36)


def _erf_f64(x: np.ndarray) -> np.ndarray:
    a = np.abs(x)
    out = np.empty(x.shape, dtype=np.float64)
    small = a < 1.0
    xs = x[small]
    out[small] = (2.0 / math.sqrt(math.pi)) * xs * _horner(_TAYLOR, xs * xs)
    big = ~small
    ab = np.minimum(a[big], 6.0)
    val = np.where(ab >= 6.0, 1.0, 1.0 - _cheb_eval(_ERFC, ab))
    out[big] = np.copysign(np.minimum(val, 1.0), x[big])
    return out


def erf(x: np.ndarray) -> np.ndarray:
    """erf of a float array, in its dtype (NaN stays NaN)."""
    x = np.asarray(x)
    return blocked(_erf_f64 if x.dtype == np.float64 else _erf_rational, x, x.dtype)


_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def _gelu_block(x: np.ndarray) -> np.ndarray:
    w = x.astype(np.float64)
    e = _erf_f64(w * _INV_SQRT2) if x.dtype == np.float64 else _erf_rational(w * _INV_SQRT2)
    e += 1.0
    e *= 0.5
    e *= w
    return e


def gelu(x: np.ndarray) -> np.ndarray:
    """``0.5 x (1 + erf(x / sqrt 2))`` in x's dtype, fused per block."""
    return blocked(_gelu_block, x, x.dtype)


@register("Erf", since=9)
def erf_op(x: np.ndarray) -> np.ndarray:
    return erf(x)


@erf_op.backward(uses="inputs")
def _(grads, inputs, outputs):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None,)
    return ((dy * (2.0 / math.sqrt(math.pi)) * np.exp(-x * x)).astype(dy.dtype, copy=False),)
