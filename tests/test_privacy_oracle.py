"""The RDP accountant against oracles computed in the test, not copied numbers.

* log erfc against mpmath at 40 digits, also where erfc is denormal or underflows;
* RDP at fractional and large orders against mpmath: the integral definition of A_alpha
  (E over N(0, s^2) of ((1 - q) + q exp((2z - 1) / (2 s^2)))^alpha) and, for integer orders,
  the exact binomial sum;
* epsilon at high noise against a brute-force search over a dense order grid (the optimum of
  the RDP -> (eps, delta) conversion over all orders), and low-noise epsilon unchanged;
* Opacus' ``compute_rdp``/``get_privacy_spent`` where it is installed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from edgeflow.gateway.privacy import (
    DEFAULT_ORDERS,
    OPACUS_ORDERS,
    RDPAccountant,
    _log_erfc,
    compute_rdp,
    rdp_to_epsilon,
)

mpmath = pytest.importorskip("mpmath")


def test_log_erfc_matches_mpmath_everywhere():
    xs = list(np.linspace(-30, 40, 1401)) + [24.999, 25.0, 25.001, 26.0, 26.6, 27.0, 27.2, 27.3, 27.5, 30.0,
                                             100.0, 1e3, 1e5, 1e8]
    worst = 0.0
    with mpmath.workdps(40):
        for x in xs:
            exact = mpmath.log(mpmath.erfc(mpmath.mpf(float(x))))
            err = abs(mpmath.mpf(_log_erfc(float(x))) - exact) / max(1, abs(exact))
            worst = max(worst, float(err))
    # math.log(math.erfc(27)) is off by 4.7e-10 (erfc(27) is denormal): 6.5e-13 relative
    assert worst < 2e-15


def _rdp_integral(q: float, sigma: float, alpha: float) -> float:
    """RDP of one sampled Gaussian step from the integral definition of A_alpha, at 30 digits."""
    with mpmath.workdps(30):
        q, s, a = mpmath.mpf(q), mpmath.mpf(sigma), mpmath.mpf(alpha)

        def integrand(z):
            return mpmath.npdf(z, 0, s) * ((1 - q) + q * mpmath.exp((2 * z - 1) / (2 * s * s))) ** a

        # the mass sits near 0 (the (1 - q) part) and near alpha (the q exp(...) part)
        points = sorted({-mpmath.inf, mpmath.inf, mpmath.mpf(0), mpmath.mpf(1), -8 * s, 8 * s, a - 8 * s, a,
                         a + 8 * s})
        return float(mpmath.log(mpmath.quad(integrand, points)) / (a - 1))


@pytest.mark.parametrize("q, sigma, alpha", [
    (0.5, 1.0, 1.1),      # the case: 0.1561289 before, exact 0.1561305
    (0.5, 1.0, 1.5), (0.5, 5.0, 1.1), (0.01, 0.5, 1.1), (0.01, 0.5, 1.4), (0.1, 1.0, 1.2),
    (0.001, 1.0, 2.5), (0.9, 0.8, 3.3),
    (0.99, 5.0, 10.5),    # most of the first terms are below e^-30: the sum must not stop there
    (0.2, 50.0, 168.5),   # stopping at the first small term gave -0.224 (a negative RDP), exact 0.00136
    (0.1, 2.0, 63.5), (0.01, 10.0, 100.5),
    (0.5, 1.0, 1000.5), (0.01, 100.0, 5000.5),  # binom(alpha, i) overflows a float here
])
def test_fractional_orders_match_the_integral(q, sigma, alpha):
    exact = _rdp_integral(q, sigma, alpha)
    assert compute_rdp(q, sigma, 1, alpha) == pytest.approx(exact, rel=2e-9, abs=0)
    # and the same through the vector path with a composition
    assert compute_rdp(q, sigma, 7, [alpha, 2.0])[0] == pytest.approx(7 * exact, rel=2e-9, abs=0)


def _rdp_binomial_sum(q: float, sigma: float, alpha: int) -> float:
    """RDP at integer alpha from the exact sum  sum_i binom(alpha, i) q^i (1-q)^(alpha-i) e^((i^2-i)/(2 s^2))."""
    with mpmath.workdps(30):
        q, s2 = mpmath.mpf(q), 2 * mpmath.mpf(sigma) ** 2
        total, coef = mpmath.mpf(0), mpmath.mpf(1)
        for i in range(alpha + 1):
            if i:
                coef = coef * (alpha - i + 1) / i
            total += coef * q ** i * (1 - q) ** (alpha - i) * mpmath.exp((i * i - i) / s2)
        return float(mpmath.log(total) / (alpha - 1))


@pytest.mark.parametrize("q, sigma, alpha", [(0.01, 100.0, 17715), (0.1, 10.0, 4241), (0.5, 0.8, 1015),
                                             (0.01, 1.1, 64), (1e-4, 50.0, 9091), (0.9, 3.0, 323)])
def test_large_integer_orders_match_the_exact_sum(q, sigma, alpha):
    assert alpha in DEFAULT_ORDERS
    assert compute_rdp(q, sigma, 1, float(alpha)) == pytest.approx(_rdp_binomial_sum(q, sigma, alpha), rel=1e-10)


def _dense_orders() -> list[float]:
    """DEFAULT_ORDERS plus fractional orders from 1.01 (ratio 1.02) and integers to 2e5 (ratio 1.02):
    a superset, so its epsilon is never above the default grid's, and within ~5e-5 of the optimum
    over all orders (eps(a r) / eps(a) ~ (r + 1/r) / 2 near the optimum)."""
    frac = [float(x) for x in np.geomspace(1.01, 11, 121)]
    ints = [float(round(x)) for x in np.geomspace(11, 2e5, 480)]
    return sorted(set(DEFAULT_ORDERS) | set(frac) | set(ints))


def _brute_force_epsilon(q: float, z: float, steps: int, dense: list[float], per_step: np.ndarray) -> tuple[float, float]:
    """The optimum of the conversion over all orders: the dense grid, then every integer order
    within 3% of the dense grid's best (its grid neighbours are 2% away)."""
    best, order = rdp_to_epsilon(dense, per_step * steps, 1e-5)
    assert order < dense[-1] / 4  # an interior optimum: the grid covers it
    if order > 20:
        window = [float(a) for a in range(math.floor(order / 1.03), math.ceil(order * 1.03) + 1)]
        eps_w, order_w = rdp_to_epsilon(window, compute_rdp(q, z, steps, window), 1e-5)
        if eps_w < best:
            best, order = eps_w, order_w
    return best, order


@pytest.mark.parametrize("q", [1.0, 0.1, 0.01])
@pytest.mark.parametrize("z", [10.0, 50.0, 100.0])
def test_high_noise_epsilon_matches_a_brute_force_order_search(z, q):
    dense = _dense_orders()
    per_step = compute_rdp(q, z, 1, dense)
    for steps in (1, 10, 100, 1000):
        best, best_order = _brute_force_epsilon(q, z, steps, dense, per_step)
        acc = RDPAccountant()
        for _ in range(steps):
            acc.step(z, q)
        eps, order = acc.get_privacy_spent(1e-5)
        assert best * (1 - 1e-9) <= eps <= best * 1.002, (steps, eps, best, order, best_order)
        if best_order >= 64:  # the accountant searches the integers there: the exact optimum
            assert eps == pytest.approx(best, rel=1e-9), (steps, eps, best, order, best_order)
        old = rdp_to_epsilon(OPACUS_ORDERS, compute_rdp(q, z, steps, OPACUS_ORDERS), 1e-5)[0]
        assert eps <= old * (1 + 1e-12)
    if z == 100.0 and q == 0.01:
        # one round: the best order is ~18,000; Opacus' orders (<= 63) gave a 783x looser epsilon
        one = RDPAccountant()
        one.step(z, q)
        old = rdp_to_epsilon(OPACUS_ORDERS, compute_rdp(q, z, 1, OPACUS_ORDERS), 1e-5)[0]
        assert old > 500 * one.get_epsilon(1e-5)


@pytest.mark.parametrize("q", [1.0, 0.1, 0.01])
@pytest.mark.parametrize("z", [0.5, 0.8, 1.1, 2.0])
def test_low_noise_epsilon_is_unchanged(z, q):
    for steps in (1, 10, 100, 1000, 10000):
        old, old_order = rdp_to_epsilon(OPACUS_ORDERS, compute_rdp(q, z, steps, OPACUS_ORDERS), 1e-5)
        acc = RDPAccountant()
        acc.step(z, q, steps)
        eps, order = acc.get_privacy_spent(1e-5)
        if old_order < OPACUS_ORDERS[-1]:  # the old grid held the optimum: nothing may move
            assert (eps, order) == (old, old_order)
        else:
            assert eps < old


def test_against_opacus():
    rdp_mod = pytest.importorskip("opacus.accountants.analysis.rdp",
                                  reason="Opacus is not installed (optional cross-check)")
    for q, z in [(0.5, 1.0), (0.01, 1.1), (0.1, 0.8), (0.01, 10.0), (0.1, 50.0), (1.0, 100.0), (0.001, 2.0)]:
        theirs = np.asarray(rdp_mod.compute_rdp(q=q, noise_multiplier=z, steps=10, orders=list(DEFAULT_ORDERS)))
        ours = compute_rdp(q, z, 10, DEFAULT_ORDERS)
        ok = np.isfinite(theirs)  # Opacus' binomials overflow past order ~1000 (inf there)
        assert ok[: len(OPACUS_ORDERS)].all()
        # Opacus stops its fractional series at terms below e^-30 (9e-14 absolute in log A_alpha), and both
        # sum log A_alpha in doubles (~1e-16 absolute): 1e-8 of a tiny RDP. Where they differ that much,
        # ours is the one that matches the integral (e.g. q = 0.01, z = 1.1, alpha = 1.1: 1e-11 vs 1e-8).
        atol = 10 * 1e-12 / (np.asarray(DEFAULT_ORDERS)[ok] - 1)
        assert (np.abs(ours[ok] - theirs[ok]) <= 1e-9 * theirs[ok] + atol).all(), (q, z)
        eps_theirs, order_theirs = rdp_mod.get_privacy_spent(orders=np.asarray(DEFAULT_ORDERS)[ok],
                                                             rdp=theirs[ok], delta=1e-5)
        eps_ours, order_ours = rdp_to_epsilon(DEFAULT_ORDERS, ours, 1e-5)
        assert eps_ours <= eps_theirs * (1 + 1e-9)
        if order_ours in np.asarray(DEFAULT_ORDERS)[ok]:
            assert eps_ours == pytest.approx(eps_theirs, rel=1e-9) and order_ours == order_theirs
    assert math.isclose(compute_rdp(0.5, 1.0, 1, 1.1),
                        rdp_mod.compute_rdp(q=0.5, noise_multiplier=1.0, steps=1, orders=[1.1])[0], rel_tol=1e-10)
