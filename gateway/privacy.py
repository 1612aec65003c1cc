"""Central differential privacy for federated rounds: clipping, Gaussian noise, RDP accounting.

The mechanism is DP-FedAvg (McMahan et al., ICLR 2018), user-level DP:

1. each client's delta d_i is clipped to L2 norm ``C`` (scaled by
   ``min(1, C / ||d_i||)``, norm over *all* tensors together);
2. the clipped deltas are summed with weight 1 each (a sample-weighted mean
   would make the sensitivity depend on the sample counts clients report);
3. Gaussian noise N(0, (z C)^2) is added to the sum, i.e. std z C / D on the
   mean, where D is the denominator (the expected number of clients per
   round when given, else the number that reported).

One client joining or leaving changes the sum by at most C, so each round is
the Gaussian mechanism with noise multiplier z; with clients sampled
independently with probability q per round it is the *sampled* Gaussian
mechanism, whose Renyi DP is computed here exactly as Opacus / TF-Privacy's
``compute_rdp`` do (Mironov, Talwar & Zhang 2019, "Renyi Differential
Privacy of the Sampled Gaussian Mechanism"), composed over rounds by adding
RDP, and converted to (epsilon, delta) with the bound of Balle et al. 2020
(Opacus' default; the older ``rdp - log(delta)/(alpha-1)`` is available as
``method="classic"``). Same formulas as Opacus, three differences: log erfc
stays exact where erfc is denormal (Opacus uses scipy's log_ndtr, same
values); integer orders are summed in log space, so orders up to 98,496 work
(Opacus' binomials overflow past ~1,000); and the accountant searches the
integers between grid orders past 64 (:func:`refine_integer_order`), where
much noise puts the best order (tests/test_privacy_oracle.py checks all three
against mpmath, a brute-force order search, and Opacus when installed).

A gateway restart must not reset the privacy spent: :meth:`CentralDP.state_dict`
(the accountant and the noise generator, plain JSON) goes into the gateway's
store with each round, and :meth:`CentralDP.load_state_dict` checks it field by
field before anything is restored.

Limits, honestly: the RDP bound for q < 1 assumes Poisson sampling of
clients; an orchestrator that picks a fixed-size cohort gets a (slightly)
different guarantee. Noise comes from numpy's PCG64 seeded from the OS, in
floating point - adequate for research and monitoring, not a hardened
implementation against floating-point side channels (that needs a discrete
Gaussian and a CSPRNG). The gateway sees individual updates in the clear
unless secure aggregation is also used.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from edgeflow.errors import ConfigError, StateError
from edgeflow.gateway.aggregate import global_norm  # noqa: F401 - its home is aggregate.py; re-exported

__all__ = [
    "DEFAULT_ORDERS",
    "OPACUS_ORDERS",
    "CentralDP",
    "RDPAccountant",
    "clip_by_global_norm",
    "compute_rdp",
    "global_norm",
    "rdp_to_epsilon",
    "refine_integer_order",
]

OPACUS_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
"""Opacus' default Renyi orders (1.1 ... 10.9, 12 ... 63): the accountant's orders before 2026-12."""

DEFAULT_ORDERS: tuple[float, ...] = OPACUS_ORDERS + tuple(sorted({float(round(64 * 1.1 ** k)) for k in range(78)}))
"""Renyi orders searched for the best epsilon: Opacus' set, then integers on a geometric grid (ratio 1.1)
from 64 to 98,496. With much noise the best order is far above 63 (about 18,000 for z = 100,
q = 0.01 and one round), where Opacus' set alone gave 783x the optimal epsilon. Past 64 the
accountant also searches the integers between grid neighbours (:meth:`RDPAccountant.get_privacy_spent`),
so there its epsilon is the optimum over integer orders (tests/test_privacy_oracle.py)."""


# ---------------------------------------------------------------------------
# Clipping
# ---------------------------------------------------------------------------


def clip_by_global_norm(update: Mapping[str, np.ndarray], max_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """``update`` scaled to L2 norm <= ``max_norm`` (a copy), and its original norm."""
    if not max_norm > 0:
        raise ConfigError(f"max_norm must be > 0, got {max_norm}")
    norm = global_norm(update)
    factor = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return {k: (np.asarray(v) * factor).astype(np.asarray(v).dtype) for k, v in update.items()}, norm


# ---------------------------------------------------------------------------
# RDP of the sampled Gaussian mechanism
# ---------------------------------------------------------------------------

_LOG_HALF = math.log(0.5)
_ERFC_DIRECT_MAX = 25.0
"""Below this ``math.erfc(x)`` is a normal float (erfc(25) = 8.3e-274) with full relative precision;
from here on erfc is computed through its scaled form (near x = 26.6 it turns denormal and loses bits)."""


def _log_erfcx_asymptotic(x: float) -> float:
    """log(exp(x^2) erfc(x)) for x >= 25 from the asymptotic series
    exp(x^2) erfc(x) = 1 / (x sqrt(pi)) * sum_n (-1)^n (2n-1)!! / (2 x^2)^n.

    The series alternates and its error is below the first term left out; at x >= 25 the terms
    shrink by at least 40x per step at first, so about 8 terms reach 1e-17 of the sum, far
    before the series' smallest term (near n = x^2)."""
    if not x >= _ERFC_DIRECT_MAX:
        raise ValueError(f"the asymptotic series of erfc needs x >= {_ERFC_DIRECT_MAX}, got {x}")
    y = 0.5 / (x * x)
    term, total, n = 1.0, 1.0, 1
    while abs(term) > 1e-17 * total:
        term *= -(2 * n - 1) * y
        total += term
        n += 1
    return math.log(total) - math.log(x) - 0.5 * math.log(math.pi)


def _log_erfc(x: float) -> float:
    """log(erfc(x)) to full double precision for every x, also where erfc(x) is denormal or underflows."""
    if x < _ERFC_DIRECT_MAX:
        return math.log(math.erfc(x))
    return _log_erfcx_asymptotic(x) - x * x


def _log_exp_erfc(k: float, z0: float, x: float, sigma: float) -> float:
    """(k^2 - k) / (2 sigma^2) + log erfc(x) where x^2 = (k - z0)^2 / (2 sigma^2).

    Far in erfc's tail both parts are huge and of opposite sign; there the exponents are
    combined first, (k^2 - k) - (k - z0)^2 = k (2 z0 - 1) - z0^2, so nothing cancels."""
    s2 = 2.0 * sigma * sigma
    if x < _ERFC_DIRECT_MAX:
        return (k * k - k) / s2 + math.log(math.erfc(x))
    return (k * (2.0 * z0 - 1.0) - z0 * z0) / s2 + _log_erfcx_asymptotic(x)


def _log_add(a: float, b: float) -> float:
    hi, lo = max(a, b), min(a, b)
    if hi == -math.inf:
        return hi
    return hi + math.log1p(math.exp(lo - hi))


def _log_sub(a: float, b: float) -> float:
    """log(exp(a) - exp(b)), a >= b."""
    if b == -math.inf:
        return a
    if a < b:
        raise ValueError("log_sub needs a >= b")
    if a == b:
        return -math.inf
    return a + math.log1p(-math.exp(b - a))


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    """log A_alpha for integer alpha: the binomial expansion (Mironov et al. 2019, Sec. 3.3),
    all alpha + 1 terms at once in log space (numpy), so large orders cost O(alpha) vector work.

    log binom(alpha, i) is a running sum of log((alpha - i + 1) / i); every term is positive,
    so the log-sum-exp has no cancellation."""
    i = np.arange(1, alpha + 1, dtype=np.float64)
    log_binom = np.empty(alpha + 1, dtype=np.float64)
    log_binom[0] = 0.0
    np.cumsum(np.log(alpha - i + 1.0) - np.log(i), out=log_binom[1:])
    i = np.arange(alpha + 1, dtype=np.float64)
    terms = log_binom + i * math.log(q) + (alpha - i) * math.log1p(-q) + (i * i - i) / (2.0 * sigma * sigma)
    top = float(terms.max())
    return top + math.log(float(np.sum(np.exp(terms - top))))


_FRAC_MAX_TERMS = 5_000_000


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    """log A_alpha for fractional alpha: the two-sided series of Mironov et al. 2019, Sec. 3.3.

    binom(alpha, i) is carried as log|.| and a sign (it would overflow a float past alpha ~ 1000).
    The sum runs past i = alpha + 1 (before that the terms may still grow: stopping at the first
    small term gave log A ~ alpha log(1 - q) instead of the body of the sum) and from there on, where
    the signs alternate and the terms shrink, until a term is below e^-30 of the partial sum; the
    rest of that alternating tail is then estimated from the last two terms."""
    log_a0, log_a1 = -math.inf, -math.inf
    z0 = sigma ** 2 * math.log(1 / q - 1) + 0.5
    log_q, log_1q = math.log(q), math.log1p(-q)
    r2s = math.sqrt(2.0) * sigma
    log_coef, positive = 0.0, True  # log|binom(alpha, i)| and its sign
    log_t_prev = math.inf  # log |previous term|
    i = 0
    while True:
        if i > 0:
            f = (alpha - i + 1) / i
            if f < 0:
                positive = not positive
            log_coef += math.log(abs(f))
        j = alpha - i
        log_s0 = log_coef + i * log_q + j * log_1q + _LOG_HALF + _log_exp_erfc(i, z0, (i - z0) / r2s, sigma)
        log_s1 = log_coef + j * log_q + i * log_1q + _LOG_HALF + _log_exp_erfc(j, z0, (z0 - j) / r2s, sigma)
        if positive:
            log_a0 = _log_add(log_a0, log_s0)
            log_a1 = _log_add(log_a1, log_s1)
        else:
            log_a0 = _log_sub(log_a0, log_s0)
            log_a1 = _log_sub(log_a1, log_s1)
        i += 1
        log_t = _log_add(log_s0, log_s1)  # |this term|
        if i > alpha + 1 and max(log_s0, log_s1) < _log_add(log_a0, log_a1) - 30:
            # The rest alternates (starting with the other sign) and shrinks by a ratio rho that
            # varies slowly: it sums to ~ |term| rho / (1 + rho). Adding that estimate takes the
            # truncation error from ~e^-30 of the sum to ~1e-3 of that where the terms decay
            # polynomially (orders near 1), and costs nothing where they decay fast (rho ~ 0).
            rho = min(1.0, math.exp(log_t - log_t_prev))
            log_rest = log_t + math.log(rho / (1 + rho)) if rho > 0 else -math.inf
            total = _log_add(log_a0, log_a1)
            return _log_sub(total, log_rest) if positive else _log_add(total, log_rest)
        if i > _FRAC_MAX_TERMS:
            raise ConfigError(f"Renyi order {alpha} is too close to 1 for the series to converge in "
                              f"{_FRAC_MAX_TERMS} terms; use orders >= 1.01")
        log_t_prev = log_t


@functools.lru_cache(maxsize=4096)
def _rdp_one(q: float, sigma: float, alpha: float) -> float:
    if q == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if math.isinf(alpha):
        return math.inf
    if q == 1.0:
        return alpha / (2 * sigma ** 2)
    if alpha == 1:  # the KL limit; not needed for conversion (orders <= 1.01 are skipped there)
        return math.inf
    if float(alpha).is_integer():
        log_a = _log_a_int(q, sigma, int(alpha))
    else:
        log_a = _log_a_frac(q, sigma, float(alpha))
    return log_a / (alpha - 1)


_MAX_ORDER = float(1 << 20)
"""The largest finite Renyi order computed: the work (and, for integer orders, the memory) grows with the order."""


def _check_order(a: float) -> float:
    a = float(a)
    if not a >= 1:  # also NaN
        raise ConfigError(f"Renyi orders must be >= 1, got {a}")
    if _MAX_ORDER < a < math.inf:
        raise ConfigError(f"Renyi order {a:g} is above the largest supported, {_MAX_ORDER:g} (its RDP costs "
                          "O(order) work); the default grid ends at 98,496")
    return a


@functools.lru_cache(maxsize=32)
def _rdp_vector(q: float, sigma: float, orders: tuple[float, ...]) -> np.ndarray:
    """Per-step RDP at ``orders``, cached: a gateway steps its accountant with the same (q, z) every round."""
    out = np.array([_rdp_one(q, sigma, a) for a in orders], dtype=np.float64)
    out.setflags(write=False)
    return out


def compute_rdp(q: float, noise_multiplier: float, steps: int, orders: Sequence[float] | float) -> np.ndarray | float:
    """RDP epsilon(alpha) of ``steps`` compositions of the sampled Gaussian mechanism.

    ``q`` is the sampling rate, ``noise_multiplier`` the noise std over the
    L2 sensitivity. Same signature and values as TF-Privacy's/Opacus'
    ``compute_rdp``; returns a float for a scalar order.
    """
    if not 0.0 <= q <= 1.0:
        raise ConfigError(f"sampling rate q must be in [0, 1], got {q}")
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ConfigError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ConfigError(f"steps must be an integer >= 0, got {steps!r}")
    if np.isscalar(orders):
        order = _check_order(orders)
        return _rdp_one(float(q), float(noise_multiplier), order) * int(steps) if steps else 0.0
    orders_t = tuple(_check_order(a) for a in orders)
    if not steps:  # zero steps spend nothing, also where one step's RDP is infinite (0 * inf is NaN)
        return np.zeros(len(orders_t), dtype=np.float64)
    return _rdp_vector(float(q), float(noise_multiplier), orders_t) * int(steps)


def rdp_to_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float,
                   method: str = "improved") -> tuple[float, float]:
    """Best (epsilon, order) for ``delta`` from an RDP curve.

    ``improved``: eps = rdp + log1p(-1/a) - log(delta * a) / (a - 1)
    (Balle et al. 2020, Prop. 12; Opacus and dp_accounting), 0 where the KL
    bound already gives delta. ``classic``: eps = rdp - log(delta) / (a - 1)
    (Mironov 2017, Prop. 3; TF-Privacy before 2020).
    """
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta}")
    orders_v = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    rdp_v = np.atleast_1d(np.asarray(rdp, dtype=np.float64))
    if orders_v.shape != rdp_v.shape:
        raise ConfigError("orders and rdp must have the same length")
    if not (rdp_v >= 0).all():  # also NaN
        bad = rdp_v[~(rdp_v >= 0)][0]
        raise ConfigError(f"RDP values must be >= 0, got {bad}")
    if not (orders_v >= 1).all():
        bad = orders_v[~(orders_v >= 1)][0]
        raise ConfigError(f"Renyi orders must be >= 1, got {bad}")
    eps = _epsilons(orders_v, rdp_v, delta, method)
    k = int(np.argmin(eps))
    return max(0.0, float(eps[k])), float(orders_v[k])


def _epsilons(orders_v: np.ndarray, rdp_v: np.ndarray, delta: float, method: str) -> np.ndarray:
    """The conversion of :func:`rdp_to_epsilon` at each order (inf where it gives nothing)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if method == "classic":
            eps = np.where(orders_v > 1, rdp_v - math.log(delta) / (orders_v - 1), np.inf)
        elif method == "improved":
            finite = np.isfinite(rdp_v) & np.isfinite(orders_v)
            zero = finite & (delta ** 2 + np.expm1(-rdp_v) >= 0)
            usable = finite & ~zero & (orders_v > 1.01)  # the bound is numerically unstable as alpha -> 1
            eps = np.full_like(rdp_v, np.inf)
            a = orders_v[usable]
            eps[usable] = rdp_v[usable] + np.log1p(-1 / a) - np.log(delta * a) / (a - 1)
            eps[zero] = 0.0
        else:
            raise ConfigError(f"unknown conversion method {method!r}; use 'improved' or 'classic'")
    return np.where(np.isnan(eps), np.inf, eps)


def refine_integer_order(rdp_at: Callable[[int], float], lo: int, hi: int, delta: float,
                         method: str = "improved") -> tuple[float, float]:
    """Smallest (epsilon, order) over the integer orders ``lo`` ... ``hi``, ``rdp_at(order)`` giving the RDP.

    A binary search on eps(a) <= eps(a + 1): about 2 log2(hi - lo) RDP evaluations. It assumes
    eps is unimodal in the order, which it is in practice (RDP grows with the order, the delta
    term shrinks); where it is not, the answer is still the epsilon of an order it evaluated,
    a valid bound, and never above eps(lo) and eps(hi).

    Why: for q < 1 the RDP of the sampled Gaussian jumps by orders of magnitude past an order
    near z^2 log(1/q) (from ~q^2 a / z^2 to ~a / (2 z^2)), and the best order sits right below
    that wall; a grid point 10% short of it gives an epsilon ~10% too large."""
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta}")
    lo, hi = int(lo), int(hi)
    if not 2 <= lo <= hi:
        raise ConfigError(f"refine_integer_order needs 2 <= lo <= hi, got {lo}, {hi}")
    seen: dict[int, float] = {}

    def eps_at(a: int) -> float:
        if a not in seen:
            r = float(rdp_at(a))
            if not r >= 0:
                raise ConfigError(f"RDP values must be >= 0, got {r} at order {a}")
            seen[a] = float(_epsilons(np.array([float(a)]), np.array([r]), delta, method)[0])
        return seen[a]

    a, b = lo, hi
    while a < b:
        m = (a + b) // 2
        if eps_at(m) <= eps_at(m + 1):
            b = m
        else:
            a = m + 1
    eps_at(a), eps_at(lo), eps_at(hi)
    best = min(seen, key=lambda k: (seen[k], k))
    return max(0.0, seen[best]), float(best)


def _finite_orders(orders: Iterable[float]) -> tuple[float, ...]:
    if isinstance(orders, (str, bytes, Mapping)) or not isinstance(orders, Iterable):
        raise ConfigError(f"orders must be a sequence of numbers > 1, got {type(orders).__name__}")
    out = []
    for a in orders:
        if isinstance(a, bool) or not isinstance(a, numbers.Real) or not (1 < float(a) <= _MAX_ORDER):
            raise ConfigError(f"the accountant's Renyi orders must be finite numbers > 1 and <= {_MAX_ORDER:g}, "
                              f"got {a!r}")
        out.append(float(a))
    if not out:
        raise ConfigError("the accountant needs at least one Renyi order")
    return tuple(out)


_REFINE_FROM = 64.0
"""From this grid order on, the accountant searches the integers between grid neighbours."""

_MAX_STATE_CALLS = 10_000_000
"""The most accountant calls (rounds) a stored state may hold: a larger count is damage, not a run."""


def _json_number(x: object) -> float | None:
    """``x`` as a float if it is a JSON number (not a bool) that a float can hold, else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return float(x)
    except OverflowError:
        return None


class RDPAccountant:
    """Adds up RDP over mechanism invocations (rounds) and reports (epsilon, delta).

    Its state (:meth:`state_dict`) is JSON: the orders, the RDP so far (``"inf"`` where infinite:
    JSON has no infinity) and the history as runs ``[noise_multiplier, sampling_rate, steps, calls]``
    of identical calls, so a gateway that steps once per round stores a few numbers, not one entry
    per round. :meth:`load_state_dict` checks every field and that the RDP is what its history gives.
    """

    def __init__(self, orders: Sequence[float] = DEFAULT_ORDERS) -> None:
        self._orders_t = _finite_orders(orders)
        self.orders = np.asarray(self._orders_t, dtype=np.float64)
        self.rdp = np.zeros_like(self.orders)
        self.history: list[tuple[float, float, int]] = []
        """(noise_multiplier, sampling_rate, steps) per call, for audit logs."""
        self._steps: dict[tuple[float, float], int] = {}  # (noise_multiplier, sampling_rate) -> steps in all

    def step(self, noise_multiplier: float, sampling_rate: float, steps: int = 1) -> None:
        self.rdp = self.rdp + compute_rdp(sampling_rate, noise_multiplier, steps, self._orders_t)
        z, q = float(noise_multiplier), float(sampling_rate)
        self.history.append((z, q, int(steps)))
        self._steps[(z, q)] = self._steps.get((z, q), 0) + int(steps)

    def rdp_at(self, order: float) -> float:
        """The composed RDP at any ``order`` (not only the grid's), from the history."""
        order = _check_order(order)
        return sum(steps * _rdp_one(q, z, order) for (z, q), steps in self._steps.items() if steps)

    def get_epsilon(self, delta: float, method: str = "improved") -> float:
        return self.get_privacy_spent(delta, method)[0]

    def get_privacy_spent(self, delta: float, method: str = "improved") -> tuple[float, float]:
        """(epsilon, best order): the best of the grid, and where that is an order >= 64 (the
        geometric part of the default grid) the best integer order between its grid neighbours
        (:func:`refine_integer_order`)."""
        if not self.history:
            return 0.0, float("nan")
        eps, order = rdp_to_epsilon(self.orders, self.rdp, delta, method)
        if order >= _REFINE_FROM and 0 < eps < math.inf:
            below, above = self.orders[self.orders < order], self.orders[self.orders > order]
            lo = max(2, math.ceil(below.max())) if below.size else math.ceil(order)
            hi = math.floor(above.min()) if above.size else math.floor(order)
            if lo < hi:
                eps2, order2 = refine_integer_order(self.rdp_at, lo, hi, delta, method)
                if eps2 < eps:
                    eps, order = eps2, order2
        return eps, order

    # -- durable state -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """The accountant as JSON-serializable values (see the class docstring)."""
        runs: list[list[float | int]] = []
        for z, q, s in self.history:
            if runs and runs[-1][0] == z and runs[-1][1] == q and runs[-1][2] == s:
                runs[-1][3] += 1
            else:
                runs.append([z, q, s, 1])
        return {
            "orders": list(self._orders_t),
            "rdp": [float(r) if math.isfinite(r) else "inf" for r in self.rdp.tolist()],
            "history": runs,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`'s output; a damaged or foreign state raises StateError naming the
        field, and leaves this accountant unchanged."""
        self._restore(*self._parse_state(state, "accountant"))

    def _restore(self, rdp: np.ndarray, history: list[tuple[float, float, int]]) -> None:
        steps: dict[tuple[float, float], int] = {}
        for z, q, s in history:
            steps[(z, q)] = steps.get((z, q), 0) + s
        self.rdp, self.history, self._steps = rdp, history, steps

    def _parse_state(self, state: object, where: str) -> tuple[np.ndarray, list[tuple[float, float, int]]]:
        def bad(field: str, what: str) -> StateError:
            return StateError(f"DP state field {where}.{field}: {what}; restore a backup of the gateway state, "
                              "or start a new run with a fresh one")

        if not isinstance(state, Mapping):
            raise bad("", f"expected an object, got {type(state).__name__}")
        if set(state) != {"orders", "rdp", "history"}:
            raise bad("", f"expected the keys history, orders, rdp, got {sorted(map(str, state))}")
        orders, rdp, history = state["orders"], state["rdp"], state["history"]
        n = len(self._orders_t)
        if not isinstance(orders, list) or len(orders) != n:
            raise bad("orders", f"expected a list of {n} numbers, got "
                      f"{len(orders) if isinstance(orders, list) else type(orders).__name__}")
        for k, a in enumerate(orders):
            if _json_number(a) != self._orders_t[k]:
                raise bad(f"orders[{k}]", f"{a!r} differs from the configured order {self._orders_t[k]} (the state "
                          "was written with other Renyi orders: configure the same ones)")
        if not isinstance(rdp, list) or len(rdp) != n:
            raise bad("rdp", f"expected a list of {n} numbers, got "
                      f"{len(rdp) if isinstance(rdp, list) else type(rdp).__name__}")
        values = []
        for k, r in enumerate(rdp):
            if r == "inf":
                values.append(math.inf)
            else:
                v = _json_number(r)
                if v is None or not 0 <= v < math.inf:
                    raise bad(f"rdp[{k}]", f"expected a finite number >= 0 or 'inf', got {r!r}")
                values.append(v)
        if not isinstance(history, list):
            raise bad("history", f"expected a list, got {type(history).__name__}")
        runs: list[tuple[float, float, int, int]] = []
        calls = 0
        for k, run in enumerate(history):
            if not isinstance(run, list) or len(run) != 4:
                raise bad(f"history[{k}]", f"expected [noise_multiplier, sampling_rate, steps, calls], got {run!r}")
            z, q, s, c = _json_number(run[0]), _json_number(run[1]), run[2], run[3]
            if z is None or not 0 <= z < math.inf:
                raise bad(f"history[{k}][0]", f"noise multiplier {run[0]!r} is not a finite number >= 0")
            if q is None or not 0 <= q <= 1:
                raise bad(f"history[{k}][1]", f"sampling rate {run[1]!r} is not a number in [0, 1]")
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= _MAX_STATE_CALLS:
                raise bad(f"history[{k}][2]", f"steps {s!r} is not an integer in [0, {_MAX_STATE_CALLS}]")
            calls += c if isinstance(c, int) else 0
            if isinstance(c, bool) or not isinstance(c, int) or c < 1 or calls > _MAX_STATE_CALLS:
                raise bad(f"history[{k}][3]", f"call count {c!r} is not an integer >= 1 (at most "
                          f"{_MAX_STATE_CALLS} calls in all)")
            runs.append((z, q, s, c))
        # the RDP must be what the history gives: a damaged number would silently change epsilon
        totals: dict[tuple[float, float], int] = {}
        for z, q, s, c in runs:
            totals[(z, q)] = totals.get((z, q), 0) + s * c
        expect = np.zeros(n, dtype=np.float64)
        for (z, q), steps in totals.items():
            expect = expect + compute_rdp(q, z, steps, self._orders_t)
        got = np.array(values, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            mismatch = ~((got == expect) | np.isclose(got, expect, rtol=1e-6, atol=1e-12))
        if mismatch.any():
            k = int(np.argmax(mismatch))
            raise bad(f"rdp[{k}]", f"{values[k]!r} is not what the stored history gives ({expect[k]!r}): the state is "
                      "damaged, or was written by an edgeflow whose accountant computes differently")
        history_out = [(z, q, s) for z, q, s, c in runs for _ in range(c)]
        return got, history_out


# ---------------------------------------------------------------------------
# The per-aggregator DP state
# ---------------------------------------------------------------------------


class CentralDP:
    """Central DP settings plus the accountant, handed to a FedAvg-family aggregator.

    ``clip_norm`` C, ``noise_multiplier`` z, ``sampling_rate`` q (clients
    per round / population; 1.0 when every client takes part), ``delta`` for
    the reported epsilon, ``expected_clients`` the fixed denominator of the
    mean (recommended with q < 1: dividing by the actual count would leak it
    and is not what the analysis covers). ``seed`` only for tests.

    Each finished round adds ``dp_epsilon`` (cumulative, at ``delta``),
    ``dp_delta``, ``dp_noise_std``, ``dp_clipped_fraction`` and ``dp_rounds``
    to the result's metrics.
    """

    def __init__(self, clip_norm: float, noise_multiplier: float, *, sampling_rate: float = 1.0,
                 delta: float = 1e-5, expected_clients: int | None = None, seed: int | None = None,
                 orders: Sequence[float] = DEFAULT_ORDERS) -> None:
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ConfigError(f"clip_norm must be > 0, got {clip_norm}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ConfigError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if not 0 < sampling_rate <= 1:
            raise ConfigError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
        if not 0 < delta < 1:
            raise ConfigError(f"delta must be in (0, 1), got {delta}")
        if expected_clients is not None and (not isinstance(expected_clients, int) or expected_clients < 1):
            raise ConfigError(f"expected_clients must be an int >= 1 or None, got {expected_clients!r}")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling_rate = float(sampling_rate)
        self.delta = float(delta)
        self.expected_clients = expected_clients
        self.accountant = RDPAccountant(orders)
        self._rng = np.random.default_rng(seed)

    def clip_factor(self, update: Mapping[str, np.ndarray]) -> tuple[float, float]:
        """(scale to apply, original norm): the clip is a weight, no copy needed."""
        norm = global_norm(update)
        return (min(1.0, self.clip_norm / norm) if norm > 0 else 1.0), norm

    def denominator(self, num_clients: int) -> int:
        return self.expected_clients if self.expected_clients is not None else num_clients

    def noise_std(self, denominator: float) -> float:
        """Noise std on the *mean*: z * C / D."""
        return self.noise_multiplier * self.clip_norm / denominator

    def privatize(self, mean: dict[str, np.ndarray], denominator: float, num_clients: int, num_clipped: int,
                  scratch: np.ndarray | None = None) -> dict[str, float]:
        """Add the noise to ``mean`` in place, account the round, return metrics."""
        std = self.noise_std(denominator)
        if std > 0:
            buf = scratch if scratch is not None and scratch.size > 0 else np.empty(1 << 15, dtype=np.float64)
            for arr in mean.values():
                flat = arr.reshape(-1)
                for a in range(0, flat.size, buf.size):  # blockwise: no tensor-sized temporary
                    b = min(flat.size, a + buf.size)
                    block = buf[: b - a]
                    self._rng.standard_normal(out=block)
                    block *= std
                    flat[a:b] += block
        self.accountant.step(self.noise_multiplier, self.sampling_rate)
        eps, order = self.accountant.get_privacy_spent(self.delta)
        return {
            "dp_epsilon": eps,
            "dp_delta": self.delta,
            "dp_order": order,
            "dp_noise_std": std,
            "dp_clipped_fraction": num_clipped / max(1, num_clients),
            "dp_rounds": float(len(self.accountant.history)),
        }

    def epsilon(self, delta: float | None = None) -> float:
        """Privacy spent so far at ``delta`` (default: the configured one)."""
        return self.accountant.get_epsilon(self.delta if delta is None else delta)

    # -- durable state -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """What a restarted gateway needs to go on exactly where this one is, as JSON-serializable values:
        the accountant (:meth:`RDPAccountant.state_dict`) and the noise generator's state (numpy's
        ``bit_generator.state``, plain ints and strings), so the next round adds the same noise as an
        uninterrupted run would. The settings (C, z, q, delta) are not part of it: they come from the
        configuration, and a run whose noise multiplier or rate changes is still accounted (the history
        records each round's)."""
        return {"accountant": self.accountant.state_dict(), "rng": _rng_state(self._rng)}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`'s output (from an untrusted store): every field is checked first,
        a damaged one raises StateError naming it, and nothing changes unless all of it is sound."""
        if not isinstance(state, Mapping) or set(state) != {"accountant", "rng"}:
            got = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            raise StateError(f"DP state: expected an object with the keys accountant, rng, got {got}; restore a "
                             "backup of the gateway state, or start a new run with a fresh one")
        rdp, history = self.accountant._parse_state(state["accountant"], "accountant")
        rng = _parse_rng_state(state["rng"], self._rng)
        self.accountant._restore(rdp, history)
        self._rng.bit_generator.state = rng


def _rng_state(rng: np.random.Generator) -> dict[str, object]:
    st = rng.bit_generator.state
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in st.items()}


def _parse_rng_state(state: object, rng: np.random.Generator) -> dict[str, object]:
    """``state`` checked against the layout of ``rng``'s own state (same keys, ints where it has ints, each
    within its bit width), then tried on a scratch generator; returns it for ``bit_generator.state``."""
    def bad(field: str, what: str) -> StateError:
        return StateError(f"DP state field rng{field}: {what}; restore a backup of the gateway state, "
                          "or start a new run with a fresh one")

    want = rng.bit_generator.state
    if not isinstance(state, Mapping):
        raise bad("", f"expected an object, got {type(state).__name__}")
    if set(state) != set(want):
        raise bad("", f"expected the keys {sorted(want)}, got {sorted(map(str, state))}")
    if state["bit_generator"] != want["bit_generator"]:
        raise bad(".bit_generator", f"{state['bit_generator']!r} is not this generator's {want['bit_generator']!r}")
    bits = {"state": 128, "inc": 128, "has_uint32": 1, "uinteger": 32}  # PCG64's fields

    def check(field: str, value: object, expected: object) -> None:
        if isinstance(expected, Mapping):
            if not isinstance(value, Mapping) or set(value) != set(expected):
                raise bad(field, f"expected an object with the keys {sorted(expected)}, got {value!r}")
            for k in expected:
                check(f"{field}.{k}", value[k], expected[k])
        elif isinstance(expected, int) and not isinstance(expected, bool):
            width = bits.get(field.rsplit(".", 1)[-1], 64)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << width):
                raise bad(field, f"expected an integer in [0, 2^{width}), got {value!r}")
        elif value != expected:
            raise bad(field, f"expected {expected!r}, got {value!r}")

    for key in want:
        if key != "bit_generator":
            check(f".{key}", state[key], want[key])
    if want["bit_generator"] == "PCG64" and state["state"]["inc"] % 2 == 0:
        raise bad(".state.inc", "PCG64's increment is always odd; this one is even")
    scratch = np.random.Generator(type(rng.bit_generator)())
    try:
        scratch.bit_generator.state = dict(state)
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise bad("", f"numpy refuses it ({exc})") from None
    return scratch.bit_generator.state
