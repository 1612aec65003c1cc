"""Aggregation strategies: the math as pure functions, the strategies as classes.

Like Flower's ``server/strategy/aggregate.py``, each rule is first a small
pure function on arrays (easy to test against a reference), then a
:class:`~edgeflow.gateway.aggregation.Aggregator` that applies it to
updates arriving one at a time.

===================  =============================================  ==========================
name                 rule                                           server memory
===================  =============================================  ==========================
``fedavg``           sum_i n_i d_i / sum_i n_i  (streaming)         O(P): float64 accumulator
``fedprox``          FedAvg on the server; mu sent to clients       O(P)
``fedavgm``          FedAvg + server momentum                       O(P) + momentum (8 B/param)
``fedadam``          FedAvg + Adam on the pseudo-gradient           O(P) + m, v (16 B/param)
``fedyogi``          FedAvg + Yogi                                  O(P) + m, v
``fedadagrad``       FedAvg + Adagrad                               O(P) + m, v
``median``           coordinate-wise median                         holds n x P updates
``trimmed-mean``     coordinate-wise beta-trimmed mean              holds n x P updates
``krum``             the update with the lowest Krum score          holds n x P + n x n
``multi-krum``       mean of the m lowest-score updates             holds n x P + n x n
``bulyan``           Krum-chosen n - 2f, then a trimmed mean         holds n x P + n x n
``fedavg-krum``      FedAvg's bounds, Multi-Krum's n - f, their     holds n x P + n x n
                     bounded mean (backdoor defence)
``krum-reputation``  fedavg-krum dropping the f most suspicious    holds n x P + n x n,
                     devices over rounds, with server momentum      momentum, one float
                     (backdoor defence, docs/security.md s. 14)     per device
===================  =============================================  ==========================

(P parameters, n clients, d_i client i's delta, n_i its sample count.)
All server optimizers follow Reddi et al., "Adaptive Federated Optimization"
(ICLR 2021), Algorithm 2, with the aggregated delta as Delta_t; FedAvgM
follows Hsu et al. 2019 (and Flower's FedAvgM).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeflow.errors import AggregationError, ConfigError, StateError
from edgeflow.gateway.aggregate import (bound_update, bounded_mean, bounded_weights, bulyan, coordinate_median,
                                        global_norm, krum_bounded_mean, krum_ratios, krum_scores, krum_select,
                                        most_suspicious, next_reference, pairwise_sq_distances, proximal_gradient,
                                        proximal_term, robust_median, trimmed_mean, update_suspicion,
                                        weighted_average)
from edgeflow.gateway.aggregation import (Aggregator, Schema, Weights, all_finite, check_num_samples,
                                          iter_chunks)
from edgeflow.gateway.privacy import CentralDP

__all__ = [
    "CLIP_MULTIPLIER",
    "SAMPLE_MULTIPLIER",
    "AUTO",
    "AUTO_DEFENCE",
    "Bulyan",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgKrum",
    "FedAvgM",
    "FedProx",
    "FedYogi",
    "Krum",
    "KrumReputation",
    "Median",
    "MultiKrum",
    "ServerAdagrad",
    "ServerAdam",
    "ServerMomentum",
    "ServerYogi",
    "StrategyChoice",
    "TrimmedMean",
    "available_aggregators",
    "bounded_mean",
    "bounded_weights",
    "coordinate_median",
    "krum_scores",
    "krum_select",
    "make_aggregator",
    "pairwise_sq_distances",
    "proximal_gradient",
    "proximal_term",
    "register_aggregator",
    "resolve_strategy",
    "strategy_names",
    "trimmed_mean",
    "weighted_average",
]


# ---------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------


# The math lives in edgeflow.gateway.aggregate (one home for every rule); re-exported here.


# ---------------------------------------------------------------------------
# Server optimizers (state persists across rounds)
# ---------------------------------------------------------------------------


class _ServerOpt:
    """Per-tensor float64 state keyed by tensor name."""

    def __init__(self) -> None:
        self.t = 0
        self.state: dict[str, dict[str, np.ndarray]] = {}

    def reset(self) -> None:
        self.t = 0
        self.state = {}

    def _slot(self, slot: str, name: str, like: np.ndarray, init: float = 0.0) -> np.ndarray:
        bucket = self.state.setdefault(slot, {})
        arr = bucket.get(name)
        if arr is None:
            arr = np.full(like.shape, init, dtype=np.float64)
            bucket[name] = arr
        elif arr.shape != like.shape:
            raise AggregationError(
                f"server optimizer state for tensor {name!r} has shape {arr.shape} but the round's delta has "
                f"{like.shape}: the model changed; call reset() on the aggregator first"
            )
        return arr

    def state_dict(self) -> dict[str, Any]:
        """Copy of the state, for checkpointing the gateway."""
        return {"t": self.t, "state": {s: {n: a.copy() for n, a in d.items()} for s, d in self.state.items()}}

    _SLOTS: tuple[str, ...] = ("v",)

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (from an untrusted store): every field checked first (StateError
        naming it), nothing changed unless all of it is sound. Shapes are checked against the model at the
        next step (a model that changed raises AggregationError there)."""
        def bad(field: str, what: str) -> StateError:
            return StateError(f"server optimizer state field {field}: {what}; restore a backup of the gateway "
                              "state, or start a new run with a fresh one")

        if not isinstance(sd, Mapping) or set(sd) != {"t", "state"}:
            raise bad("", "expected an object with the keys state, t")
        t = sd["t"]
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise bad("t", f"expected an int >= 0, got {t!r}")
        slots = sd["state"]
        if not isinstance(slots, Mapping) or not set(slots) <= set(self._SLOTS):
            raise bad("state", f"expected slots among {list(self._SLOTS)}, got "
                               f"{sorted(slots) if isinstance(slots, Mapping) else type(slots).__name__}")
        out: dict[str, dict[str, np.ndarray]] = {}
        for slot, tensors in slots.items():
            if not isinstance(tensors, Mapping):
                raise bad(f"state.{slot}", "expected tensors by name")
            out[slot] = {}
            for name, a in tensors.items():
                if not isinstance(name, str) or not isinstance(a, np.ndarray) or a.dtype.kind != "f":
                    raise bad(f"state.{slot}.{name}", "expected a floating-point array")
                if not np.isfinite(a).all():
                    raise bad(f"state.{slot}.{name}", "holds NaN or Inf")
                if slot == "v" and not isinstance(self, ServerMomentum) and (a < 0).any() \
                        and not isinstance(self, ServerYogi):
                    raise bad(f"state.{slot}.{name}", "second moments must be >= 0")
                out[slot][name] = np.array(a, dtype=np.float64)
        self.t, self.state = t, out


def _positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def _unit(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must be in [0, 1), got {value}")
    return value


class ServerMomentum(_ServerOpt):
    """FedAvgM: v <- momentum * v + Delta; step = lr * v (Nesterov: lr * (momentum * v + Delta)).

    In Flower's sign convention (pseudo-gradient = w_global - w_avg = -Delta)
    this is exactly its FedAvgM; lr = 1, momentum = 0 is FedAvg.
    """

    def __init__(self, lr: float = 1.0, momentum: float = 0.9, nesterov: bool = False) -> None:
        super().__init__()
        self.lr = _positive("server_lr", lr)
        self.momentum = _unit("server_momentum", momentum)
        self.nesterov = bool(nesterov)

    def step(self, delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.t += 1
        out = {}
        for name, d in delta.items():
            v = self._slot("v", name, d)
            v *= self.momentum
            v += d
            out[name] = self.lr * (self.momentum * v + d if self.nesterov else v)
        return out


class _Adaptive(_ServerOpt):
    _SLOTS = ("m", "v")

    def __init__(self, eta: float, beta_1: float, beta_2: float, tau: float, v_init: float) -> None:
        super().__init__()
        self.eta = _positive("eta", eta)
        self.beta_1 = _unit("beta_1", beta_1)
        self.beta_2 = _unit("beta_2", beta_2)
        self.tau = _positive("tau", tau)
        self.v_init = _positive("v_init", v_init, allow_zero=True)

    def _update_v(self, v: np.ndarray, d2: np.ndarray) -> None:  # pragma: no cover - abstract
        raise NotImplementedError("need _update_v")

    def _lr(self) -> float:
        return self.eta

    def step(self, delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.t += 1
        lr = self._lr()
        out = {}
        for name, d in delta.items():
            m = self._slot("m", name, d)
            v = self._slot("v", name, d, self.v_init)
            m *= self.beta_1
            m += (1.0 - self.beta_1) * d
            self._update_v(v, d * d)
            out[name] = lr * m / (np.sqrt(v) + self.tau)
        return out


class ServerAdam(_Adaptive):
    """FedAdam: m <- b1 m + (1-b1) D; v <- b2 v + (1-b2) D^2; step = eta_t m / (sqrt(v) + tau).

    ``bias_correction``: ``True`` (the default: Kingma & Ba's) eta_t =
    eta * sqrt(1 - b2^t) / (1 - b1^t) with t = server steps taken, counted
    from 1; ``"flower"``: Flower's FedAdam, which counts from the round + 1
    (its ``eta_norm`` uses ``server_round + 1`` with rounds from 1: t + 1
    here, one server step per round; the two differ most in the first rounds,
    4e-2 in the step size with the defaults); ``False``: Reddi et al.'s
    Algorithm 2 as printed (no correction).
    """

    def __init__(self, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 v_init: float = 0.0, bias_correction: bool | str = True) -> None:
        super().__init__(eta, beta_1, beta_2, tau, v_init)
        if bias_correction not in (True, False, "flower"):
            raise ConfigError(f"bias_correction must be true, false or \"flower\", got {bias_correction!r}")
        self.bias_correction = bias_correction

    def _lr(self) -> float:
        if self.bias_correction is False:
            return self.eta
        t = self.t + 1 if self.bias_correction == "flower" else self.t
        return self.eta * math.sqrt(1.0 - self.beta_2 ** t) / (1.0 - self.beta_1 ** t)

    def _update_v(self, v: np.ndarray, d2: np.ndarray) -> None:
        v *= self.beta_2
        v += (1.0 - self.beta_2) * d2


class ServerYogi(_Adaptive):
    """FedYogi: v <- v - (1-b2) D^2 sign(v - D^2); additive, so v grows slowly
    and a burst of large deltas does not collapse the step as in Adam."""

    def __init__(self, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 v_init: float = 0.0) -> None:
        super().__init__(eta, beta_1, beta_2, tau, v_init)

    def _update_v(self, v: np.ndarray, d2: np.ndarray) -> None:
        v -= (1.0 - self.beta_2) * d2 * np.sign(v - d2)


class ServerAdagrad(_Adaptive):
    """FedAdagrad: v <- v + D^2 (beta_2 unused; beta_1 = 0 by default as in Flower)."""

    def __init__(self, eta: float = 0.1, beta_1: float = 0.0, tau: float = 1e-3, v_init: float = 0.0) -> None:
        super().__init__(eta, beta_1, 0.0, tau, v_init)

    def _update_v(self, v: np.ndarray, d2: np.ndarray) -> None:
        v += d2


# ---------------------------------------------------------------------------
# Streaming mean (FedAvg family)
# ---------------------------------------------------------------------------


_BLOCK = 1 << 16
"""Elements per fold block: 256-512 KiB, resident in L2 on the servers we target."""

CLIP_MULTIPLIER = 1.5
"""Default adaptive norm bound: updates are clipped to this many times the reference median norm."""
SAMPLE_MULTIPLIER = 3.0
"""Default sample-count cap: a claim counts for at most this many times the reference median claim."""
REFERENCE_MAX_CHANGE = 2.0
"""The bounds' reference (median norm, median claim) moves by at most this factor per round."""
REFERENCE_MIN_UPDATES = 3
"""A round with fewer updates than this does not move the bounds' reference: from 3 on, the (lower) median of
a round lies within the honest updates' range whatever one device sends; of 2 it is the hostile one's if smaller."""


def _off(value: object) -> bool:
    """None, False, "off" or "none" (0 is not off: it is a bad bound)."""
    return value is None or value is False or (isinstance(value, str) and value.lower() in ("off", "none"))


class FedAvg(Aggregator):
    """Sample-weighted mean of deltas, folded in as they arrive.

    Memory: a float64 accumulator per tensor (8 bytes/parameter) and, for
    float32/float16 models, a float32 staging sum (4 bytes/parameter) plus
    two 256-512 KiB scratch blocks - independent of the number of clients:
    12 bytes/parameter, 120 MB for 10M. (Summing into a second staging
    buffer, to check each block while folding and drop a bad update without
    a separate scan, was measured slower: the extra write stream costs more
    than the NaN scan it saves.)

    Why staging: folding straight into float64 costs a float32->float64 cast
    per update, which numpy does at about a third of the speed of float32
    math (measured: 0.9 ms vs 0.32 ms per 1M parameters). So each update is
    multiplied by its weight and added in float32, block by block so the
    product stays in cache, and every ``stage`` updates the float32 sum is
    flushed into the float64 accumulator. Plain numpy ufuncs, not BLAS
    ``saxpy``: single-threaded BLAS is barely faster, and OpenBLAS' threads
    on a busy 2-core gateway were measured 25x slower (spinning). The error is that of summing
    ``stage`` float32 terms - a few float32 ulps of the sum of magnitudes,
    *not* growing with the number of clients (a plain float32 sum, as in
    Flower, grows with n). ``stage=0`` folds exactly in float64 instead;
    float64 models always do. Kahan-compensated float32 was measured too:
    same memory as float64, slower, less accurate (benchmarks/aggregation.py).

    Staleness: an update's weight is ``n_i * s(tau_i)``; the denominator is
    ``sum n_i`` (FedBuff: stale updates shrink the step) unless
    ``normalize_staleness`` makes it ``sum n_i s(tau_i)`` (stale updates only
    lose share).

    ``weighted=False`` gives every client weight 1 (a client's claimed
    sample count then cannot buy influence). With ``privacy`` (central DP)
    weights are always uniform: each delta is clipped to ``clip_norm`` and
    Gaussian noise is added to the mean, see :class:`CentralDP`.

    **Default robustness** (docs/aggregation.md, "Default norm bound and
    sample cap"): one device must not be able to steer the average with a
    huge delta or a huge claimed ``num_samples``. So, unless turned off:

    * ``clip="adaptive"``: each delta's L2 norm (all tensors together) is
      bounded by ``B = clip_multiplier * M``, where ``M`` is the *reference
      median norm*: the median of the raw norms of the updates accepted in the
      previous round this aggregator finished (or the one the gateway restored
      with :meth:`set_reference`). A larger delta is scaled down to norm ``B``
      (it keeps its direction and its weight). ``clip`` may also be a fixed
      bound (a float) or ``"off"``;
    * ``sample_multiplier``: a client's sample count counts for at most
      ``sample_multiplier * N``, ``N`` the reference median of the claimed
      counts (same rounds as ``M``), and at most ``sample_cap`` when set
      (the gateway passes the round's ``max_samples``: a device told to
      train on at most that many cannot claim more);
    * a round with no reference (the very first one) holds its first
      ``clip_warmup`` updates in memory, takes ``M`` and ``N`` from them, and
      then folds them and the rest with those bounds.

    The medians make the bounds follow the fleet (norms shrink as training
    converges) while a minority of hostile clients cannot move them. The
    norm pass replaces the separate NaN/Inf scan (a non-finite norm rejects
    the update), so the default costs what ``check_finite`` costs.
    Pre-summed partials (:meth:`add_partial`) are not clipped: the site or
    secure-aggregation client that formed them bounds its own inputs.

    Pre-summed partial aggregates (a secure-aggregation sum, a sub-gateway)
    enter with :meth:`add_partial`.
    """

    name = "fedavg"

    def __init__(self, *, weighted: bool = True, normalize_staleness: bool = False,
                 privacy: CentralDP | None = None, stage: int = 32,
                 clip: str | float | None = "adaptive", clip_multiplier: float = CLIP_MULTIPLIER,
                 sample_multiplier: float | str | None = SAMPLE_MULTIPLIER, sample_cap: int | None = None,
                 clip_warmup: int = 3, reference_max_change: float = REFERENCE_MAX_CHANGE,
                 reference_min_updates: int = REFERENCE_MIN_UPDATES, server_optimizer=None,
                 staleness_fn: Callable[[int], float] | None = None, check_finite: bool = True) -> None:
        super().__init__(server_optimizer=server_optimizer, staleness_fn=staleness_fn, check_finite=check_finite)
        if isinstance(reference_max_change, bool) or not isinstance(reference_max_change, (int, float)) \
                or not math.isfinite(reference_max_change) or reference_max_change < 1:
            raise ConfigError(f"reference_max_change must be a number >= 1, got {reference_max_change!r}")
        if isinstance(reference_min_updates, bool) or not isinstance(reference_min_updates, int) \
                or reference_min_updates < 1:
            raise ConfigError(f"reference_min_updates must be an int >= 1, got {reference_min_updates!r}")
        self.reference_max_change = float(reference_max_change)
        self.reference_min_updates = reference_min_updates
        if privacy is not None and not isinstance(privacy, CentralDP):
            raise ConfigError(f"privacy must be a CentralDP, got {type(privacy).__name__}")
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise ConfigError(f"stage must be an int >= 0 (0 = fold exactly in float64), got {stage!r}")
        if _off(clip):
            self.clip: str | float | None = None
        elif clip == "adaptive":
            self.clip = "adaptive"
        elif isinstance(clip, (int, float)) and not isinstance(clip, bool):
            self.clip = _positive("clip", clip)
        else:
            raise ConfigError(f"clip must be 'adaptive', a bound > 0 or 'off', got {clip!r}")
        self.clip_multiplier = _positive("clip_multiplier", clip_multiplier)
        self.sample_multiplier = None if _off(sample_multiplier) else _positive("sample_multiplier",
                                                                                   sample_multiplier)
        if sample_cap is not None and (isinstance(sample_cap, bool) or not isinstance(sample_cap, int)
                                       or sample_cap < 1):
            raise ConfigError(f"sample_cap must be an int >= 1 or None, got {sample_cap!r}")
        self.sample_cap = sample_cap
        if isinstance(clip_warmup, bool) or not isinstance(clip_warmup, int) or clip_warmup < 1:
            raise ConfigError(f"clip_warmup must be an int >= 1, got {clip_warmup!r}")
        self.clip_warmup = clip_warmup
        self._reference: dict[str, float] | None = None
        self._fixed_bounds: tuple[float | None, float | None] | None = None
        self._reset_robust()
        self.weighted = bool(weighted)
        self.normalize_staleness = bool(normalize_staleness)
        self.privacy = privacy
        self.stage = stage
        self._acc: dict[str, np.ndarray] | None = None
        self._staged: dict[str, np.ndarray] = {}
        self._num_staged = 0
        self._staged_empty = True
        self._scratch: np.ndarray | None = None
        self._scratch32: np.ndarray | None = None
        self._denom = 0.0
        self._weight_sum = 0.0
        self._clipped = 0

    # ---- default robustness: norm bound and sample cap ---------------------

    @property
    def robust(self) -> bool:
        """True when updates are bounded (clip or sample cap on; central DP does its own)."""
        return self.privacy is None and (self.clip is not None or self.sample_multiplier is not None
                                         or self.sample_cap is not None)

    def _needs_reference(self) -> bool:
        return self.clip == "adaptive" or (self.sample_multiplier is not None and self.weighted)

    def _reset_robust(self) -> None:
        self._norm_bound: float | None = None
        self._count_cap: float | None = None
        self._bounds_set = False
        self._held: list[tuple[dict[str, np.ndarray], int, float, str, float]] = []
        self._norms: list[float] = []
        self._claims: list[int] = []
        self._clipped = 0
        self._capped = 0
        self._counted = 0

    def begin_round(self, global_weights: Weights | None, round_id: int) -> None:
        self._fixed_bounds = None
        super().begin_round(global_weights, round_id)

    def reset(self) -> None:
        super().reset()
        self._reference = None
        self._fixed_bounds = None

    @property
    def reference(self) -> dict[str, float] | None:
        """``{"median_norm": M, "median_samples": N}`` the next round's bounds come from
        (set when a round finishes); persist it to keep the bounds across restarts."""
        return None if self._reference is None else dict(self._reference)

    def set_reference(self, reference: Mapping[str, float] | None) -> None:
        """Restore a :attr:`reference` (takes effect at the next :meth:`begin_round`)."""
        if reference is None:
            self._reference = None
            return
        try:
            m, n = float(reference["median_norm"]), float(reference["median_samples"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"a clipping reference needs median_norm and median_samples: {exc}") from None
        if not (math.isfinite(m) and m >= 0 and math.isfinite(n) and n >= 0):
            raise ConfigError(f"clipping reference must be finite and >= 0, got {m}, {n}")
        self._reference = {"median_norm": m, "median_samples": n}

    def state_dict(self) -> dict[str, object]:
        """Aggregator state plus the bounds' reference and, with central DP, the accountant and its noise."""
        out = super().state_dict()
        out["reference"] = None if self._reference is None else dict(self._reference)
        if self.privacy is not None:
            out["privacy"] = self.privacy.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise StateError(f"strategy state: expected an object, got {type(state).__name__}")
        if ("privacy" in state) != (self.privacy is not None):
            raise StateError("strategy state field privacy: central DP is configured in only one of the stored "
                             "state and this gateway; restore the old configuration, or start a new run")
        try:
            reference = state.get("reference")
            probe = FedAvg(clip=self.clip if self.clip is not None else "off")
            probe.set_reference(reference)  # checked on a scratch object: nothing changes on failure
        except ConfigError as exc:
            raise StateError(f"strategy state field reference: {exc}") from None
        super().load_state_dict({k: v for k, v in state.items() if k not in ("reference", "privacy")})
        if self.privacy is not None:
            self.privacy.load_state_dict(state["privacy"])
        self.set_reference(reference)

    @property
    def round_bounds(self) -> tuple[float | None, float | None] | None:
        """(norm bound, sample cap) in force in the open round; None while it warms up."""
        return (self._norm_bound, self._count_cap) if self._bounds_set else None

    def set_round_bounds(self, norm_bound: float | None, sample_cap: float | None) -> None:
        """Fix the open round's bounds (a resumed round, ingestion workers: the bounds the
        round was opened with), before any update is folded."""
        self._require_open("set_round_bounds")
        if self._num_clients:
            raise AggregationError("set_round_bounds() must come before the round's first update")
        self._fixed_bounds = (norm_bound, sample_cap)
        self._norm_bound, self._count_cap, self._bounds_set = norm_bound, sample_cap, True

    def _bounds_from(self, median_norm: float | None, median_samples: float | None) -> None:
        bound = None
        if self.clip == "adaptive":
            bound = None if median_norm is None else self.clip_multiplier * median_norm
        elif self.clip is not None:
            bound = float(self.clip)
        cap = None if self.sample_cap is None else float(self.sample_cap)
        if self.sample_multiplier is not None and median_samples is not None:
            scaled = float(max(1, math.floor(self.sample_multiplier * max(1.0, median_samples))))
            cap = scaled if cap is None else min(cap, scaled)  # whole samples: partial sums stay integers
        self._norm_bound, self._count_cap, self._bounds_set = bound, cap, True

    def _fold_checked(self, update: Weights, num_samples: int, staleness_weight: float,
                      client_id: str) -> str | None:
        if not self.robust:
            return super()._fold_checked(update, num_samples, staleness_weight, client_id)
        norm = global_norm(update)  # one read: the norm, and the NaN/Inf check
        if not math.isfinite(norm):
            assert self._schema is not None
            for name in self._schema.names:
                if not all_finite(update[name]):
                    return name
            return self._schema.names[0]  # finite values whose squares overflow: refused the same way
        self._norms.append(norm)
        self._claims.append(int(num_samples))
        if not self._bounds_set:
            self._held.append(({k: np.array(v, copy=True) for k, v in update.items()}, num_samples,
                               staleness_weight, client_id, norm))
            if len(self._held) >= self.clip_warmup:
                self._settle_warmup()
            return None
        self._fold_bounded(update, num_samples, staleness_weight, norm)
        return None

    def _settle_warmup(self) -> None:
        """Bounds from the held updates' medians, then fold them."""
        self._bounds_from(robust_median([h[4] for h in self._held]), robust_median([h[1] for h in self._held]))
        held, self._held = self._held, []
        for update, n, sw, _cid, norm in held:
            self._fold_bounded(update, n, sw, norm)

    def _fold_bounded(self, update: Weights, num_samples: int, staleness_weight: float, norm: float) -> None:
        b = bound_update(norm, num_samples, self._norm_bound, self._count_cap)
        self._capped += b.capped
        self._clipped += b.clipped
        base = b.counted if self.weighted else 1.0
        factor = b.weight / b.counted if b.counted > 0 else 0.0
        weight = base * staleness_weight * factor
        self._accumulate(update, weight)
        self._denom += base * staleness_weight if self.normalize_staleness else base
        self._weight_sum += weight
        self._counted += b.counted

    def _start(self, schema: Schema) -> None:
        self._reset_robust()
        if self.robust:
            if self._fixed_bounds is not None:
                self._norm_bound, self._count_cap = self._fixed_bounds
                self._bounds_set = True
            elif self._reference is not None or not self._needs_reference():
                ref = self._reference or {}
                self._bounds_from(ref.get("median_norm"), ref.get("median_samples"))
        self._acc = schema.zeros(np.float64)
        self._staged = {}
        if self.stage > 0:
            self._staged = {n: np.empty(sp.shape, np.float32) for n, sp in schema.specs.items()
                            if sp.dtype.itemsize <= 4}
        self._num_staged = 0
        self._staged_empty = True
        block = min(_BLOCK, max(sp.size for sp in schema.specs.values()))
        self._scratch = np.empty(block, dtype=np.float64)
        self._scratch32 = np.empty(block, dtype=np.float32)
        self._denom = 0.0
        self._weight_sum = 0.0
        self._clipped = 0

    def _release(self) -> None:
        self._acc = None
        self._staged = {}
        self._scratch = None
        self._scratch32 = None

    def _fold(self, update: Weights, num_samples: int, staleness_weight: float, client_id: str) -> None:
        base = float(num_samples) if self.weighted and self.privacy is None else 1.0
        weight = base * staleness_weight
        if self.privacy is not None:
            clip, _norm = self.privacy.clip_factor(update)
            if clip < 1.0:
                self._clipped += 1
            weight *= clip
        self._accumulate(update, weight)
        self._denom += base * staleness_weight if self.normalize_staleness else base
        self._weight_sum += weight
        self._counted += num_samples

    def _accumulate(self, update: Weights, weight: float) -> None:
        """Add ``weight * update`` in place: float32 tensors into their staging sums,
        the others exactly into float64, block by block (products stay in cache)."""
        assert self._acc is not None and self._scratch is not None and self._scratch32 is not None
        fresh = self._staged_empty
        for name, acc in self._acc.items():
            staged = self._staged.get(name)
            target = (staged if staged is not None else acc).reshape(-1)
            u = np.asarray(update[name]).reshape(-1)
            if staged is not None and fresh:  # first update after a flush: write, do not add to stale sums
                np.multiply(u, np.float32(weight), out=target)
                continue
            if weight == 1.0:
                np.add(target, u, out=target)
                continue
            if staged is not None:
                scratch, w = self._scratch32, np.float32(weight)
            else:
                scratch, w = self._scratch, np.float64(weight)  # exact product in float64
            for a in range(0, target.size, _BLOCK):
                b = min(target.size, a + _BLOCK)
                tmp = scratch[: b - a]
                np.multiply(u[a:b], w, out=tmp, dtype=scratch.dtype)
                np.add(target[a:b], tmp, out=target[a:b])
        if self._staged:
            self._staged_empty = False
            self._num_staged += 1
            if self._num_staged >= self.stage:
                self._flush()

    def _flush(self) -> None:
        """Move the float32 staging sums into the float64 accumulator."""
        assert self._acc is not None
        if self._num_staged:
            for name, staged in self._staged.items():
                np.add(self._acc[name], staged, out=self._acc[name])
        self._num_staged = 0
        self._staged_empty = True  # the next update overwrites the staging sums

    def add_partial(self, weighted_sum: Weights, total_samples: int, num_clients: int, client_id: str = "", *,
                    norms: Sequence[float] = (), claims: Sequence[int] = (), clipped: int = 0,
                    capped: int = 0) -> None:
        """Fold in ``sum_i n_i d_i`` over ``num_clients`` clients whose ``sum_i n_i`` is ``total_samples``.

        For hierarchical gateways and the output of secure aggregation (which
        reveals only the sum). The sum's own arithmetic was done elsewhere;
        here it is validated like an update and added to the accumulator.
        Not available with central DP (clipping needs each client's delta).
        ``norms``/``claims``/``clipped``/``capped``: the raw norms and claims of the
        updates inside a sum that was formed with this round's bounds (ingestion
        workers), so the next round's reference covers them too.
        """
        self._require_open("add_partial")
        if self.privacy is not None:
            raise AggregationError("add_partial cannot be used with central DP: each delta must be clipped here")
        total = check_num_samples(total_samples, client_id)
        if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
            raise AggregationError(f"num_clients must be an int >= 1, got {num_clients!r}")
        schema = self._schema or Schema.of(weighted_sum, what=f"partial sum {client_id!r}")
        schema.check(weighted_sum, client_id)
        for name in schema.names:
            if not np.isfinite(weighted_sum[name]).all():
                self._reject(client_id, "non_finite", f"tensor {name!r} of the partial sum has NaN or Inf")
                return
        if self._schema is None:
            self._schema = schema
            self._start(schema)
        if self.weighted:
            self._accumulate(weighted_sum, 1.0)
            self._denom += total
        else:  # the sum was formed with weight 1 per client
            self._accumulate(weighted_sum, 1.0)
            self._denom += num_clients
        self._weight_sum += total if self.weighted else num_clients
        self._counted += total
        self._norms.extend(float(x) for x in norms)
        self._claims.extend(int(x) for x in claims)
        self._clipped += int(clipped)
        self._capped += int(capped)
        self._client_ids.append(client_id)
        self._num_clients += int(num_clients)
        self._total_samples += total

    def _robust_metrics(self) -> dict[str, float]:
        """Settle a round still warming up, record the next round's reference, report."""
        if not self.robust:
            return {}
        if self._held:
            self._settle_warmup()
        metrics: dict[str, float] = {"clipped": float(self._clipped), "capped": float(self._capped)}
        if self._norm_bound is not None:
            metrics["norm_bound"] = self._norm_bound
        if self._count_cap is not None:
            metrics["sample_cap"] = self._count_cap
        m, n = robust_median(self._norms), robust_median(self._claims)
        if m is not None and n is not None:
            metrics["median_norm"], metrics["median_samples"] = m, n
        ref = next_reference(self._reference, self._norms, self._claims, max_change=self.reference_max_change,
                             min_updates=self.reference_min_updates)
        if ref is not None:
            self._reference = ref
            metrics["reference_norm"], metrics["reference_samples"] = ref["median_norm"], ref["median_samples"]
        self._total_samples = int(round(self._counted))
        return metrics

    def _reduce(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        assert self._acc is not None
        robust = self._robust_metrics()
        self._flush()
        metrics: dict[str, float] = {"weight_sum": self._weight_sum, **robust}
        denom = self._denom
        if self.privacy is not None:
            denom = float(self.privacy.denominator(self._num_clients))
        if not denom > 0:
            raise AggregationError(f"round {self._round_id}: aggregation weights sum to {denom}")
        mean = self._acc
        if self.privacy is not None:  # the noise goes on the finished mean
            for acc in mean.values():
                acc /= denom
            metrics.update(self.privacy.privatize(mean, denom, self._num_clients, self._clipped,
                                                  scratch=self._scratch))
        else:  # divide in the final pass over the result (one read less)
            self._pending_scale = 1.0 / denom
        return mean, metrics


class FedProx(FedAvg):
    """FedProx: FedAvg on the server; the proximal term lives on the client.

    The server's only job is to tell devices ``mu`` (via
    :meth:`client_config`, which the orchestrator sends with the round) so
    their trainer adds :func:`proximal_term` / :func:`proximal_gradient`.
    """

    name = "fedprox"

    def __init__(self, mu: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mu = _positive("mu", mu, allow_zero=True)

    def client_config(self) -> dict[str, float | int | str]:
        return {"proximal_mu": self.mu}


class FedAvgM(FedAvg):
    """FedAvg + server momentum (Hsu et al. 2019)."""

    name = "fedavgm"

    def __init__(self, server_lr: float = 1.0, server_momentum: float = 0.9, nesterov: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(server_optimizer=ServerMomentum(server_lr, server_momentum, nesterov), **kwargs)


class FedAdam(FedAvg):
    """FedAvg + server Adam (Reddi et al. 2021); ``bias_correction="flower"`` steps exactly as Flower's FedAdam."""

    name = "fedadam"

    def __init__(self, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 bias_correction: bool | str = True, v_init: float = 0.0, **kwargs: Any) -> None:
        super().__init__(server_optimizer=ServerAdam(eta, beta_1, beta_2, tau, v_init, bias_correction), **kwargs)


class FedYogi(FedAvg):
    """FedAvg + server Yogi (Reddi et al. 2021)."""

    name = "fedyogi"

    def __init__(self, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 v_init: float = 0.0, **kwargs: Any) -> None:
        super().__init__(server_optimizer=ServerYogi(eta, beta_1, beta_2, tau, v_init), **kwargs)


class FedAdagrad(FedAvg):
    """FedAvg + server Adagrad (Reddi et al. 2021)."""

    name = "fedadagrad"

    def __init__(self, eta: float = 0.1, beta_1: float = 0.0, tau: float = 1e-3, v_init: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(server_optimizer=ServerAdagrad(eta, beta_1, tau, v_init), **kwargs)


# ---------------------------------------------------------------------------
# Robust strategies: they must see every update, so they hold them
# ---------------------------------------------------------------------------


class _Holding(Aggregator):
    """Keeps one flat copy per update (schema dtype, scaled by its staleness weight).

    Memory: n x P x itemsize for the held updates, plus a temporary of
    ``chunk_elems`` elements (x2 for the partition) while reducing. For 100
    clients of a 1M-parameter float32 model: 400 MB held, 32 MB temporary.
    """

    holds_updates = True

    def __init__(self, *, chunk_elems: int = 1 << 22, server_optimizer=None,
                 staleness_fn: Callable[[int], float] | None = None, check_finite: bool = True) -> None:
        super().__init__(server_optimizer=server_optimizer, staleness_fn=staleness_fn, check_finite=check_finite)
        if chunk_elems < 1:
            raise ConfigError(f"chunk_elems must be >= 1, got {chunk_elems}")
        self.chunk_elems = int(chunk_elems)
        self._held: list[np.ndarray] = []
        self._samples: list[int] = []

    def _start(self, schema: Schema) -> None:
        self._held = []
        self._samples = []

    def _release(self) -> None:
        self._held = []
        self._samples = []

    def _fold(self, update: Weights, num_samples: int, staleness_weight: float, client_id: str) -> None:
        assert self._schema is not None
        self._held.append(self._schema.flatten(update, scale=staleness_weight))
        self._samples.append(num_samples)

    def _coordinatewise(self, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Apply ``fn`` ((n, c) -> (c,)) over coordinate chunks of the held updates."""
        assert self._schema is not None
        n = len(self._held)
        out = np.empty(self._schema.size, dtype=np.float64)
        step = max(1, self.chunk_elems // n)
        block = np.empty((n, min(step, self._schema.size)), dtype=self._held[0].dtype)
        for a, b in iter_chunks(self._schema.size, step):
            x = block[:, : b - a]
            for i, v in enumerate(self._held):
                x[i] = v[a:b]
            out[a:b] = fn(x)
        return out

    def _as_tensors(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        assert self._schema is not None
        return self._schema.unflatten(flat)


class Median(_Holding):
    """Coordinate-wise median (Yin et al., ICML 2018). Unweighted: a sample
    count is a client's claim, and weighting by it would let one Byzantine
    client move the median. Tolerates < 50% Byzantine clients per coordinate."""

    name = "median"

    def _reduce(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        return self._as_tensors(self._coordinatewise(coordinate_median)), {}


class TrimmedMean(_Holding):
    """Coordinate-wise trimmed mean: drop the ``int(proportion * n)`` largest and
    smallest values of each coordinate, average the rest (Yin et al. 2018).
    Unweighted; tolerates up to ``proportion`` Byzantine clients."""

    name = "trimmed-mean"

    def __init__(self, proportion: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= float(proportion) < 0.5:
            raise ConfigError(f"trimmed-mean proportion must be in [0, 0.5), got {proportion}")
        self.proportion = float(proportion)

    def _reduce(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        cut = int(self.proportion * len(self._held))
        flat = self._coordinatewise(lambda x: trimmed_mean(x, self.proportion))
        return self._as_tensors(flat), {"trimmed_per_side": float(cut)}


class MultiKrum(_Holding):
    """Multi-Krum (Blanchard et al. 2017): score each update by the summed squared
    distance to its n - f - 2 nearest neighbours, keep the ``num_selected``
    lowest, and average them (unweighted unless ``weighted``).

    ``num_selected`` defaults to n - f. Needs n >= 2f + 3 clients (the bound
    under which Krum's guarantee holds); fewer raise AggregationError at
    finish rather than silently giving up robustness.
    """

    name = "multi-krum"

    def __init__(self, num_byzantine: int = 0, num_selected: int | None = None, weighted: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(num_byzantine, bool) or not isinstance(num_byzantine, int) or num_byzantine < 0:
            raise ConfigError(f"num_byzantine must be an int >= 0, got {num_byzantine!r}")
        if num_selected is not None and (not isinstance(num_selected, int) or num_selected < 1):
            raise ConfigError(f"num_selected must be an int >= 1 or None, got {num_selected!r}")
        self.num_byzantine = num_byzantine
        self.num_selected = num_selected
        self.weighted = bool(weighted)
        self.selected_clients: tuple[str, ...] = ()
        """Client ids chosen in the last finished round (for logs and audits)."""

    def _m(self, n: int) -> int:
        return self.num_selected if self.num_selected is not None else n - self.num_byzantine

    def _reduce(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        n, f = len(self._held), self.num_byzantine
        if n < 2 * f + 3:
            raise AggregationError(
                f"round {self._round_id}: {type(self).__name__} with f={f} Byzantine needs at least "
                f"{2 * f + 3} updates, got {n}"
            )
        m = self._m(n)
        if m > n:
            raise AggregationError(f"round {self._round_id}: cannot select {m} of {n} updates")
        dist = pairwise_sq_distances(self._held, chunk=max(1, self.chunk_elems // n))
        chosen = krum_select(dist, f, m)
        w = np.array([self._samples[i] if self.weighted else 1.0 for i in chosen], dtype=np.float64)
        out = np.zeros(self._held[0].shape, dtype=np.float64)
        for i, wi in zip(chosen, w):
            out += self._held[i] * (wi / w.sum())
        self.selected_clients = tuple(self._client_ids[i] for i in chosen)
        return self._as_tensors(out), {"num_selected": float(m), "selected_index_0": float(chosen[0])}


class Krum(MultiKrum):
    """Krum: the single update with the lowest score (Multi-Krum with m = 1)."""

    name = "krum"

    def __init__(self, num_byzantine: int = 0, **kwargs: Any) -> None:
        kwargs.pop("num_selected", None)
        super().__init__(num_byzantine=num_byzantine, num_selected=1, **kwargs)


class Bulyan(_Holding):
    """Bulyan (El Mhamdi et al., ICML 2018): theta = n - 2f updates chosen by repeated Krum, then per
    coordinate the mean of the beta = theta - 2f chosen values closest to their median
    (:func:`edgeflow.gateway.aggregate.bulyan`). Unweighted; tolerates f Byzantine clients with
    n >= 4f + 3 (fewer raise AggregationError at finish rather than silently giving up robustness)."""

    name = "bulyan"

    def __init__(self, num_byzantine: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(num_byzantine, bool) or not isinstance(num_byzantine, int) or num_byzantine < 0:
            raise ConfigError(f"num_byzantine must be an int >= 0, got {num_byzantine!r}")
        self.num_byzantine = num_byzantine
        self.selected_clients: tuple[str, ...] = ()

    def _reduce(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        n, f = len(self._held), self.num_byzantine
        if n < 4 * f + 3:
            raise AggregationError(f"round {self._round_id}: Bulyan with f={f} Byzantine needs at least "
                                   f"{4 * f + 3} updates, got {n}")
        dist = pairwise_sq_distances(self._held, chunk=max(1, self.chunk_elems // n))
        out = np.empty(self._held[0].shape, dtype=np.float64)
        chosen = None
        step = max(1, self.chunk_elems // n)
        for a, b in iter_chunks(out.size, step):  # same selection for every chunk (dist is global)
            part, chosen = bulyan(np.stack([h[a:b] for h in self._held]), f, dist=dist)
            out[a:b] = part
        assert chosen is not None
        self.selected_clients = tuple(self._client_ids[i] for i in chosen)
        return self._as_tensors(out), {"num_selected": float(len(chosen))}


class FedAvgKrum(_Holding):
    """Default FedAvg's bounds over a Multi-Krum selection (:func:`edgeflow.gateway.aggregate.krum_bounded_mean`):
    each delta's norm bounded at ``clip_multiplier`` x the round's robust median norm, each claim capped at
    ``sample_multiplier`` x the round's robust median claim (and ``sample_cap``, the round's ``max_samples``),
    the ``num_byzantine`` Krum-farthest deltas (chosen on the deltas as sent) dropped, the rest averaged by
    their capped claims.

    The backdoor defence of docs/security.md section 14: with 1 of 10 devices planting a trigger
    backdoor it holds the backdoor to the clean model's rate, and costs 1.0-1.5 points of clean accuracy
    on a fleet without an attacker (an honest update is dropped every round). Needs n >= 2f + 3 updates
    (fewer raise AggregationError at finish); the bounds come from the round itself, so there is no
    cross-round state beyond a server optimizer's. Holds every update: not available under secure
    aggregation (the gateway sees only the sum there; the round configuration refuses it)."""

    name = "fedavg-krum"

    def __init__(self, num_byzantine: int = 1, weighted: bool = True, clip_multiplier: float = CLIP_MULTIPLIER,
                 sample_multiplier: float = SAMPLE_MULTIPLIER, sample_cap: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(num_byzantine, bool) or not isinstance(num_byzantine, int) or num_byzantine < 0:
            raise ConfigError(f"num_byzantine must be an int >= 0, got {num_byzantine!r}")
        if sample_cap is not None and (isinstance(sample_cap, bool) or not isinstance(sample_cap, int)
                                       or sample_cap < 1):
            raise ConfigError(f"sample_cap must be an int >= 1 or None, got {sample_cap!r}")
        self.num_byzantine = num_byzantine
        self.weighted = bool(weighted)
        self.clip_multiplier = _positive("clip_multiplier", clip_multiplier)
        self.sample_multiplier = _positive("sample_multiplier", sample_multiplier)
        self.sample_cap = sample_cap
        self.selected_clients: tuple[str, ...] = ()
        """Client ids whose updates entered the last finished round's mean (for logs and audits)."""

    def _reduce(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        n, f = len(self._held), self.num_byzantine
        if n < 2 * f + 3:
            raise AggregationError(f"round {self._round_id}: fedavg-krum with f={f} Byzantine needs at least "
                                   f"{2 * f + 3} updates, got {n}")
        r = krum_bounded_mean(np.stack(self._held), self._samples, f, clip_multiplier=self.clip_multiplier,
                              sample_multiplier=self.sample_multiplier, sample_cap=self.sample_cap,
                              weighted=self.weighted)
        self.selected_clients = tuple(self._client_ids[i] for i in r.chosen)
        return self._as_tensors(r.mean), {"num_selected": float(len(r.chosen)), "dropped": float(n - len(r.chosen)),
                                          "norm_bound": r.norm_bound, "sample_cap": r.sample_cap,
                                          "clipped": float(r.clipped), "capped": float(r.capped)}


_MAX_SUSPECTS = 1_000_000
"""Devices a stored ``krum-reputation`` state may name (a damaged or hostile state naming more is refused)."""


class KrumReputation(FedAvgKrum):
    """``fedavg-krum`` with a memory: the ``num_byzantine`` devices dropped from a round are the most suspicious
    over rounds, not the Krum-farthest of this round alone, and the mean is applied with server momentum.

    Each round (of at least 2f + 3 updates) every update's Krum score over the round's median score
    (:func:`~edgeflow.gateway.aggregate.krum_ratios`, on the deltas as sent) enters its device's suspicion,
    an exponential average ``memory * previous + (1 - memory) * ratio``
    (:func:`~edgeflow.gateway.aggregate.update_suspicion`); the f devices of the round with the highest
    suspicion are dropped, the rest enter default FedAvg's bounded, claim-weighted mean
    (:func:`~edgeflow.gateway.aggregate.krum_bounded_mean` with ``drop``); the step is that mean through
    FedAvgM's momentum (``server_momentum``, ``server_lr``; 0 and 1 give the plain mean).

    Why (docs/security.md section 14): ``fedavg-krum`` lets a backdoor through in the few rounds where an
    honest device is farther than the poisoner (71% on seed 12 of benchmarks/backdoor.py); the suspicion
    keeps the poisoner out through them. Dropping a device every round costs clean accuracy (1-1.5 points);
    the momentum wins it back (3 seeds: 0.917 against default FedAvg's 0.870 and FedAvgM's 0.920). Its signal
    is distance: a poisoner whose delta is as long as an honest device's passes it (``--equal-size``: 11%,
    36%, 100% on seeds 0-2).

    Rounds of fewer than 2f + 3 updates (Krum is not defined there) drop nobody and leave the suspicions
    as they were. Cross-round state: the suspicions (one float per device seen) and the momentum, stored
    with the round (:meth:`state_dict`). Holds every update: not available under secure aggregation or with
    ingestion workers (the gateway sees only sums there)."""

    name = "krum-reputation"

    def __init__(self, num_byzantine: int = 1, memory: float = 0.7, server_momentum: float = 0.9,
                 server_lr: float = 1.0, **kwargs: Any) -> None:
        if kwargs.get("server_optimizer") is not None:
            raise ConfigError("krum-reputation sets its own server optimizer: use server_momentum and server_lr")
        kwargs.pop("server_optimizer", None)
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0.0 <= memory < 1.0:
            raise ConfigError(f"memory must be a number in [0, 1), got {memory!r}")
        momentum = _unit("server_momentum", server_momentum)
        lr = _positive("server_lr", server_lr)
        super().__init__(num_byzantine=num_byzantine,
                         server_optimizer=ServerMomentum(lr, momentum) if (momentum or lr != 1.0) else None,
                         **kwargs)
        self.memory = float(memory)
        self.suspicion: dict[str, float] = {}
        """Each device's suspicion as the last finished round left it."""
        self._pending: dict[str, float] | None = None

    def _reduce(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        n, f = len(self._held), self.num_byzantine
        stack = np.stack(self._held)
        ids = list(self._client_ids)
        if n < 2 * f + 3:
            drop = np.zeros(0, dtype=np.int64)
            self._pending = None
        else:
            ratios = krum_ratios(stack, f)
            self._pending = update_suspicion(self.suspicion, ids, ratios, self.memory)
            drop = most_suspicious([self._pending[c] if c else float(ratios[i]) for i, c in enumerate(ids)], f)
        r = krum_bounded_mean(stack, self._samples, f, clip_multiplier=self.clip_multiplier,
                              sample_multiplier=self.sample_multiplier, sample_cap=self.sample_cap,
                              weighted=self.weighted, drop=drop)
        self.selected_clients = tuple(self._client_ids[i] for i in r.chosen)
        top = max((self._pending[c] for c in ids if c), default=0.0) if self._pending else 0.0
        return self._as_tensors(r.mean), {"num_selected": float(len(r.chosen)), "dropped": float(n - len(r.chosen)),
                                          "norm_bound": r.norm_bound, "sample_cap": r.sample_cap,
                                          "clipped": float(r.clipped), "capped": float(r.capped),
                                          "max_suspicion": float(top)}

    def finish(self) -> Any:
        try:
            result = super().finish()
        except BaseException:
            self._pending = None
            raise
        if self._pending is not None:  # only a round that produced a model moves the suspicions
            self.suspicion = self._pending
        self._pending = None
        return result

    def reset(self) -> None:
        super().reset()
        self.suspicion = {}
        self._pending = None

    def state_dict(self) -> dict[str, object]:
        out = super().state_dict()
        ids = sorted(self.suspicion)
        out["suspicion"] = {"ids": ids, "values": np.array([self.suspicion[c] for c in ids], dtype=np.float64)}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a damaged suspicion table raises StateError and changes nothing."""
        if not isinstance(state, Mapping) or state.get("strategy") != type(self).__name__:
            super().load_state_dict(state)  # raises: the state is another strategy's
        sus = state.get("suspicion")
        if not isinstance(sus, Mapping) or set(sus) != {"ids", "values"}:
            raise StateError("strategy state field suspicion: missing or not {ids, values}")
        ids, values = sus["ids"], sus["values"]
        if not isinstance(ids, list) or not all(isinstance(c, str) and c for c in ids) or len(set(ids)) != len(ids) \
                or len(ids) > _MAX_SUSPECTS:
            raise StateError(f"strategy state field suspicion.ids: not a list of at most {_MAX_SUSPECTS} distinct "
                             "non-empty device ids")
        if not isinstance(values, np.ndarray) or values.dtype.kind != "f" or values.shape != (len(ids),) \
                or not np.isfinite(values).all() or (values < 0).any():
            raise StateError("strategy state field suspicion.values: not one finite float >= 0 per device id")
        super().load_state_dict({k: v for k, v in state.items() if k != "suspicion"})
        self.suspicion = {c: float(v) for c, v in zip(ids, values)}


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------

_REGISTRY: dict[str, type[Aggregator]] = {}


def register_aggregator(name: str, cls: type[Aggregator]) -> None:
    """Make ``cls`` available to :func:`make_aggregator` as ``name``."""
    if not (isinstance(cls, type) and issubclass(cls, Aggregator)):
        raise ConfigError(f"{cls!r} is not an Aggregator subclass")
    _REGISTRY[name] = cls


for _cls in (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad, Median, TrimmedMean, Krum, MultiKrum,
             Bulyan, FedAvgKrum, KrumReputation):
    register_aggregator(_cls.name, _cls)


def available_aggregators() -> list[str]:
    return sorted(_REGISTRY)


def make_aggregator(name: str, **params: Any) -> Aggregator:
    """Build a registered aggregator by name, e.g. ``make_aggregator("krum", num_byzantine=2)``.

    Unknown names and parameters raise :class:`ConfigError` listing what exists,
    so a typo in a gateway config fails at start, not at the first round.
    """
    key = name.strip().lower().replace("_", "-")
    cls = _REGISTRY.get(key)
    if cls is None and ":" in name:  # "my_module:MyStrategy" or "path/file.py:MyStrategy" (docs/flower.md)
        from .custom_strategy import load_strategy

        cls, key = load_strategy(name), name
    if cls is None:
        raise ConfigError(f"unknown aggregator {name!r}; available: {', '.join(available_aggregators())}")
    accepted = _accepted_params(cls)
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ConfigError(f"aggregator {key!r} has no parameter {unknown[0]!r}; accepted: {', '.join(sorted(accepted))}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"aggregator {key!r}: {exc}") from exc


def folds_partials(strategy: Any) -> bool:
    """The one rule for pre-added sums (site gateways' partial aggregates, ingestion workers' partial
    sums, a secure-aggregation total): a strategy -- an aggregator, its class or its registered
    name -- can take them only if it has ``add_partial``; one that holds each update to compare
    (median, Krum-based, Bulyan) cannot. ``auto`` can: :func:`resolve_strategy` makes it FedAvg there."""
    if isinstance(strategy, str):
        key = strategy.strip().lower().replace("_", "-")
        if key == AUTO:
            return True
        cls = _REGISTRY.get(key)
        if cls is None and ":" in strategy:
            from .custom_strategy import load_strategy

            cls = load_strategy(strategy)
        strategy = cls
    return callable(getattr(strategy, "add_partial", None))


def partial_folding_strategies() -> list[str]:
    """Registered names that :func:`folds_partials`, for messages."""
    return [k for k, cls in sorted(_REGISTRY.items()) if folds_partials(cls)]


AUTO = "auto"
"""``[rounds] strategy``'s default: the gateway picks, once at start, with :func:`resolve_strategy`."""

AUTO_DEFENCE = KrumReputation.name
"""What ``auto`` runs where the gateway sees each update: the backdoor defence of docs/security.md section 14."""


@dataclass(frozen=True)
class StrategyChoice:
    """The strategy a gateway runs, and for ``auto`` why (what the start-up log line and the status show)."""

    name: str
    """The registered name (or the user's ``module:Class``) that is built."""
    configured: str
    """What ``[rounds] strategy`` says (``auto`` by default)."""
    why: str = ""
    """Why ``auto`` chose ``name`` (empty for a strategy named in the configuration)."""

    @property
    def auto(self) -> bool:
        return self.configured.strip().lower() == AUTO

    def describe(self) -> str:
        """``strategy auto -> krum-reputation (backdoor defence; ...)``, or ``strategy fedavg``."""
        return f"strategy {AUTO} -> {self.name} ({self.why})" if self.auto else f"strategy {self.name}"


def resolve_strategy(strategy: str, params: Mapping[str, Any] | None = None, *, sums_only: str = "",
                     secagg: bool = False, mode: str = "sync", dp: bool = False,
                     stored: str | None = None) -> StrategyChoice:
    """The one rule for ``strategy = "auto"`` (any other name is returned as it is): FedAvg where the gateway
    sees only sums or the defence is not measured, :data:`AUTO_DEFENCE` (``num_byzantine`` 1 and its other
    defaults) where it sees each update.

    ``sums_only``: why the gateway sees only sums, empty when it sees each update (secure aggregation, site
    gateways' partial aggregates, ingestion workers' partial sums: :func:`folds_partials`'s contexts);
    ``secagg``: the rounds run secure aggregation (the gateway sees only the sum);
    ``mode``: ``async`` (FedBuff) gets FedAvg, the defence is not measured there; ``dp``: central DP is
    FedAvg's mechanism (each update clipped and the mean noised), the defence does not take it;
    ``stored``: the class name of the strategy state the gateway's state holds (``""`` for a state with rounds
    and no strategy state, None for a fresh state): a run that began with another strategy (FedAvg, the
    default before ``auto``) goes on with FedAvg, so a restart after an upgrade changes nothing; ``params``:
    ``[rounds] strategy_params``, which go to the strategy chosen: keys only FedAvg takes (``clip``,
    ``stage``, ...) choose FedAvg; keys neither takes raise ConfigError."""
    if not isinstance(strategy, str) or strategy.strip().lower() != AUTO:
        return StrategyChoice(strategy, strategy)
    keys = set(params or {})
    defence, plain = _accepted_params(KrumReputation), _accepted_params(FedAvg)
    neither = sorted(keys - defence - plain)
    if neither:
        raise ConfigError(f"strategy 'auto': strategy_params {neither} are neither {AUTO_DEFENCE}'s nor fedavg's "
                          f"(accepted: {', '.join(sorted(defence | plain))}); fix the name, or name the strategy")
    if keys - defence and keys - plain:
        raise ConfigError(f"strategy 'auto': strategy_params {sorted(keys - plain)} are only {AUTO_DEFENCE}'s and "
                          f"{sorted(keys - defence)} only fedavg's; name the strategy (strategy = \"{AUTO_DEFENCE}\" "
                          "or \"fedavg\")")
    if secagg and not sums_only:
        sums_only = "secure aggregation reveals only the sum"
    if sums_only:
        why = f"the gateway sees only sums: {sums_only}; {AUTO_DEFENCE} needs each update"
    elif mode != "sync":
        why = f"mode {mode!r} (FedBuff): {AUTO_DEFENCE} is not measured there"
    elif dp:
        why = f"central DP clips and noises a FedAvg mean; {AUTO_DEFENCE} does not take it"
    elif stored is not None and stored != KrumReputation.__name__:
        why = (f"this state's run began with {stored or 'FedAvg'}, before 'auto'; a restart must not change "
               f"the run: a new state gets {AUTO_DEFENCE}")
    elif keys - defence:
        why = f"strategy_params {sorted(keys - defence)} are FedAvg's, not {AUTO_DEFENCE}'s"
    else:
        return StrategyChoice(AUTO_DEFENCE, strategy, 'backdoor defence; set strategy = "fedavg" for plain FedAvg')
    if keys - plain:
        raise ConfigError(f"strategy 'auto' runs fedavg here ({why}); strategy_params {sorted(keys - plain)} are "
                          "not fedavg's: remove them, or name the strategy")
    return StrategyChoice(FedAvg.name, strategy, why)


def strategy_names() -> list[str]:
    """What ``[rounds] strategy`` may name: every registered aggregator and :data:`AUTO`."""
    return [*available_aggregators(), AUTO]


def _accepted_params(cls: type) -> set[str]:
    out: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        sig = inspect.signature(init)
        out.update(p.name for p in sig.parameters.values()
                   if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            break
    # FedAvgM & co. pass server_optimizer themselves
    if "server_optimizer" in out and cls.__init__ is not FedAvg.__init__ and issubclass(cls, FedAvg) \
            and cls not in (FedAvg, FedProx):
        out.discard("server_optimizer")
    if issubclass(cls, Krum):
        out.discard("num_selected")
    return out
