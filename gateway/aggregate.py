"""The aggregation math: small pure functions on arrays, one home for every rule.

Like Flower's ``server/strategy/aggregate.py``: each rule is first a pure
function here, easy to test against a reference; the strategies
(:mod:`edgeflow.gateway.strategies`), the ingestion workers' partial sums
(:mod:`edgeflow.gateway.ingest`) and the tests' oracles all call these, so a
rule exists once. Imports only numpy, math and :mod:`edgeflow.errors`.

- :func:`bound_update` -- THE per-update bound of default FedAvg: the delta's L2
  norm clipped to the round's norm bound, its claimed sample count capped;
- :func:`next_reference` -- how the bound's reference (median norm, median
  claim) follows the fleet from round to round without letting one device
  take it over: it moves by at most ``max_change`` per round, and a round with
  fewer than ``min_updates`` updates does not move it;
- :func:`robust_median` -- the median the bounds come from: for an even count
  the *lower* middle value, so two updates (one of them hostile) give the
  smaller, not their mean;
- the means (:func:`weighted_average`, :func:`bounded_mean`), the robust rules
  (:func:`coordinate_median`, :func:`trimmed_mean`, Krum's
  :func:`krum_scores`/:func:`krum_select`, :func:`bulyan`,
  :func:`krum_bounded_mean`: default FedAvg's bounds over a Multi-Krum
  selection, the backdoor defence of docs/security.md section 14; with
  :func:`krum_ratios`, :func:`update_suspicion` and :func:`most_suspicious`
  the per-device reputation over rounds of ``krum-reputation``), FedProx's client
  term (:func:`proximal_term`, :func:`proximal_gradient`), and
  :func:`global_norm`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edgeflow.errors import AggregationError, ConfigError

__all__ = [
    "Bounded",
    "Weights",
    "bound_update",
    "bounded_mean",
    "bounded_weights",
    "bulyan",
    "coordinate_median",
    "global_norm",
    "iter_chunks",
    "most_suspicious",
    "KrumBounded",
    "krum_bounded_mean",
    "krum_ratios",
    "krum_scores",
    "krum_select",
    "next_reference",
    "pairwise_sq_distances",
    "proximal_gradient",
    "proximal_term",
    "robust_median",
    "trimmed_mean",
    "update_suspicion",
    "weighted_average",
    "weighted_metrics",
]

Weights = Mapping[str, np.ndarray]
"""Named tensors: a model's weights or one client's update (a delta)."""


def iter_chunks(size: int, chunk: int) -> Iterator[tuple[int, int]]:
    """[a, b) ranges that cover 0..size in steps of ``chunk``."""
    if chunk < 1:
        raise ConfigError(f"chunk size must be >= 1, got {chunk}")
    for a in range(0, size, chunk):
        yield a, min(size, a + chunk)


def global_norm(update: Mapping[str, np.ndarray]) -> float:
    """L2 norm of all tensors of ``update`` taken together.

    ``einsum`` rather than ``vdot``: no BLAS thread pool in the per-update
    path (OpenBLAS threads on a busy gateway were measured 25x slower).
    Sums of squares accumulate per tensor in the tensor's dtype (float32:
    relative error ~1e-7, ample for clipping), float16 in float32.
    """
    total = 0.0
    for arr in update.values():
        flat = np.asarray(arr).reshape(-1)
        if flat.dtype.itemsize < 4:
            flat = flat.astype(np.float32)
        total += float(np.einsum("i,i->", flat, flat))
    return math.sqrt(total)


@dataclass(frozen=True)
class Bounded:
    """One update under the round's bounds."""

    weight: float
    """Its weight in the sum: ``counted * min(1, norm_bound / norm)``."""
    counted: float
    """Its sample count as counted: ``min(num_samples, sample_cap)``."""
    clipped: bool
    capped: bool


def bound_update(norm: float, num_samples: float, norm_bound: float | None, sample_cap: float | None) -> Bounded:
    """Default FedAvg's rule for one update (None turns a bound off): the claim is capped at
    ``sample_cap``, and a delta longer than ``norm_bound`` keeps its direction but counts as if it
    had norm ``norm_bound`` (its weight is scaled by ``norm_bound / norm``)."""
    counted = float(num_samples)
    capped = sample_cap is not None and counted > sample_cap
    if capped:
        counted = float(sample_cap)
    factor = 1.0
    clipped = norm_bound is not None and norm > norm_bound
    if clipped:
        factor = norm_bound / norm if norm > 0 else 0.0
    return Bounded(counted * factor, counted, clipped, capped)


def robust_median(values: Sequence[float]) -> float | None:
    """The median the bounds come from, None for no values. For an even count it is the *lower*
    of the two middle values (not their mean): with two updates, one hostile, the bound comes
    from the smaller one, whichever it is."""
    if not len(values):
        return None
    v = np.sort(np.asarray(values, dtype=np.float64))
    return float(v[(len(v) - 1) // 2])


def next_reference(prev: Mapping[str, float] | None, norms: Sequence[float], claims: Sequence[float], *,
                   max_change: float, min_updates: int) -> dict[str, float] | None:
    """The next round's bound reference ``{"median_norm", "median_samples"}`` after a round whose
    updates had these raw ``norms`` and ``claims``.

    - fewer than ``min_updates`` updates: the reference stays ``prev`` (a round of two updates
      cannot set the bound); without a ``prev`` (a fresh state's first rounds) their robust
      medians are taken, as the warm-up does;
    - otherwise their robust medians, each moved at most by the factor ``max_change`` from
      ``prev`` (a fleet whose norms shrink 10x as it converges gets there in a few rounds; one
      device's burst cannot move the bound more than that per round).
    """
    if max_change < 1 or not math.isfinite(max_change):
        raise ConfigError(f"reference_max_change must be a finite number >= 1, got {max_change}")
    m, n = robust_median(norms), robust_median(claims)
    if m is None or n is None:
        return None if prev is None else dict(prev)
    if prev is None:
        return {"median_norm": m, "median_samples": n}
    if len(norms) < min_updates:
        return dict(prev)

    def clamp(x: float, ref: float) -> float:
        if ref <= 0:
            return x
        return min(max(x, ref / max_change), ref * max_change)

    return {"median_norm": clamp(m, float(prev["median_norm"])),
            "median_samples": clamp(n, float(prev["median_samples"]))}


def weighted_average(updates: Sequence[Weights], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """sum_i w_i u_i / sum_i w_i per tensor, in float64 (reference; holds all)."""
    if not updates or len(updates) != len(weights):
        raise AggregationError("weighted_average needs as many weights as updates, and at least one")
    total = float(sum(weights))
    if not total > 0:
        raise AggregationError(f"weights must sum to > 0, got {total}")
    return {name: sum(np.asarray(u[name], dtype=np.float64) * w for u, w in zip(updates, weights)) / total
            for name in updates[0]}


def bounded_weights(norms: Sequence[float], samples: Sequence[int], norm_bound: float | None,
                    sample_cap: float | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`bound_update` over many updates as arrays: (weight_i, counted_i)."""
    rows = [bound_update(float(m), float(n), norm_bound, sample_cap) for m, n in zip(norms, samples)]
    return (np.array([r.weight for r in rows], dtype=np.float64),
            np.array([r.counted for r in rows], dtype=np.float64))


def bounded_mean(updates: Sequence[Weights], samples: Sequence[int], norm_bound: float | None,
                 sample_cap: float | None) -> dict[str, np.ndarray]:
    """The default FedAvg step for given bounds: sum_i w_i d_i / sum_i counted_i (reference; holds all)."""
    norms = [global_norm(u) for u in updates]
    w, counted = bounded_weights(norms, samples, norm_bound, sample_cap)
    total = float(counted.sum())
    return {name: sum(np.asarray(u[name], dtype=np.float64) * wi for u, wi in zip(updates, w)) / total
            for name in updates[0]}


def coordinate_median(stack: np.ndarray) -> np.ndarray:
    """Median over axis 0 (clients) of an (n, ...) array; mean of the two
    middle values when n is even (numpy's convention)."""
    return np.median(stack, axis=0)


def trimmed_mean(stack: np.ndarray, proportion: float) -> np.ndarray:
    """Mean over axis 0 after cutting ``int(proportion * n)`` values from each
    end of every coordinate: exactly ``scipy.stats.trim_mean(stack, proportion)``."""
    if not 0.0 <= proportion < 0.5:
        raise ConfigError(f"trimmed mean proportion must be in [0, 0.5), got {proportion}")
    n = stack.shape[0]
    lo = int(proportion * n)
    hi = n - lo
    if lo == 0:
        return stack.mean(axis=0, dtype=np.float64)
    part = np.partition(stack, (lo, hi - 1), axis=0)
    return part[lo:hi].mean(axis=0, dtype=np.float64)


def pairwise_sq_distances(vectors: Sequence[np.ndarray], chunk: int = 1 << 18) -> np.ndarray:
    """(n, n) squared Euclidean distances between flat vectors, in float64.

    Uses the Gram matrix accumulated over coordinate chunks, so the temporary
    memory is n x chunk x 8 bytes rather than n x n x P. In float64 the
    cancellation in |a|^2 + |b|^2 - 2ab costs about 1e-16 |a|^2, far below
    the gaps Krum cares about.
    """
    n = len(vectors)
    size = vectors[0].shape[0]
    gram = np.zeros((n, n), dtype=np.float64)
    block = np.empty((n, min(chunk, size)), dtype=np.float64)
    for a, b in iter_chunks(size, chunk):
        x = block[:, : b - a]
        for i, v in enumerate(vectors):
            x[i] = v[a:b]
        gram += x @ x.T
    sq = np.diag(gram).copy()
    dist = sq[:, None] + sq[None, :] - 2.0 * gram
    np.maximum(dist, 0.0, out=dist)
    np.fill_diagonal(dist, 0.0)
    return dist


def krum_scores(dist: np.ndarray, num_byzantine: int) -> np.ndarray:
    """Krum score of each client: the sum of squared distances to its
    n - f - 2 nearest other clients (Blanchard et al., NeurIPS 2017)."""
    n = dist.shape[0]
    k = n - num_byzantine - 2
    if k < 1:
        raise AggregationError(
            f"Krum needs n - f - 2 >= 1 neighbours: n={n} clients, f={num_byzantine} Byzantine"
        )
    scores = np.empty(n, dtype=np.float64)
    for i in range(n):
        others = np.delete(dist[i], i)
        scores[i] = np.partition(others, k - 1)[:k].sum()
    return scores


def krum_select(dist: np.ndarray, num_byzantine: int, num_selected: int = 1) -> np.ndarray:
    """Indices of the ``num_selected`` lowest Krum scores (ties: lowest index first)."""
    scores = krum_scores(dist, num_byzantine)
    if not 1 <= num_selected <= len(scores):
        raise AggregationError(f"cannot select {num_selected} of {len(scores)} updates")
    return np.argsort(scores, kind="stable")[:num_selected]


@dataclass(frozen=True)
class KrumBounded:
    """What :func:`krum_bounded_mean` did in one round."""

    mean: np.ndarray
    """The aggregated delta (float64, flat)."""
    chosen: np.ndarray
    """Row indices of the updates that entered the mean (ascending)."""
    norm_bound: float
    sample_cap: float
    clipped: int
    """Updates whose norm was bounded (all rows, chosen or not)."""
    capped: int
    """Updates whose sample count was capped (all rows)."""


def _round_bounds(norms: np.ndarray, samples: np.ndarray, clip_multiplier: float, sample_multiplier: float,
                  sample_cap: float | None) -> tuple[float, float]:
    """The norm bound and the sample cap from this round's own updates: ``clip_multiplier`` x the robust
    (lower) median norm, ``sample_multiplier`` x the robust median claim in whole samples (at most
    ``sample_cap``). With n >= 3 updates the lower median lies within the honest ones' range
    whatever one device sends."""
    for name, value in (("clip_multiplier", clip_multiplier), ("sample_multiplier", sample_multiplier)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value <= 0:
            raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    bound = float(clip_multiplier) * float(robust_median(norms))  # type: ignore[arg-type]
    cap = float(max(1, math.floor(float(sample_multiplier) * max(1.0, float(robust_median(samples))))))
    if sample_cap is not None:
        cap = min(cap, float(sample_cap))
    return bound, cap


def krum_bounded_mean(stack: np.ndarray, samples: Sequence[float], num_byzantine: int, *,
                      clip_multiplier: float = 1.5, sample_multiplier: float = 3.0,
                      sample_cap: float | None = None, weighted: bool = True,
                      drop: Sequence[int] | None = None) -> KrumBounded:
    """Default FedAvg's bounded mean over a Multi-Krum selection, all from one round's updates.

    ``stack``: (n clients x P coordinates) deltas; ``samples``: their claimed sample counts.

    1. bounds from the round itself (:func:`_round_bounds`): each delta longer than
       ``clip_multiplier`` x the robust median norm is scaled down to that norm, each claim capped
       at ``sample_multiplier`` x the robust median claim (and ``sample_cap``);
    2. Multi-Krum (Blanchard et al. 2017) on the deltas as sent: the n - f with the lowest Krum
       scores (f = ``num_byzantine``) are kept. Not on the bounded ones: a poisoner that trains on
       more data sends a longer delta, and that length is part of what makes it the farthest
       (with the selection after the bound, 2 of 6 seeds of benchmarks/backdoor.py let 9% and 64% through);
    3. the mean of the kept deltas, each within the norm bound, weighted by their capped claims
       (1 each unless ``weighted``).

    Why: on non-IID shards a backdoor poisoner's update is, round by round, no less similar to the
    rest than an honest outlier's, but in the rounds that plant the backdoor it is the Krum-farthest
    often enough that dropping the farthest f every round holds it (docs/security.md section 14);
    the bounds keep what Multi-Krum alone lets through: a chosen update's claimed sample count
    buying weight, a long delta. Needs n >= 2f + 3 updates; NaN/Inf, a non-2-D stack or
    a sample count that is not finite and >= 1 raise AggregationError (nothing is computed).

    ``drop``: the row indices to leave out instead of Multi-Krum's choice (``krum-reputation`` drops the
    most suspicious devices over rounds, :func:`most_suspicious`); any number of rows >= 1 then, as long as
    one is kept."""
    x = np.asarray(stack)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
        raise AggregationError(f"krum_bounded_mean needs a 2-D float array (clients x coordinates), got "
                               f"{x.dtype} of shape {x.shape}")
    n = x.shape[0]
    if isinstance(num_byzantine, bool) or not isinstance(num_byzantine, (int, np.integer)) or num_byzantine < 0:
        raise ConfigError(f"num_byzantine must be an int >= 0, got {num_byzantine!r}")
    f = int(num_byzantine)
    if drop is None and n < 2 * f + 3:
        raise AggregationError(f"krum_bounded_mean with f={f} Byzantine needs at least {2 * f + 3} updates, got {n}")
    if drop is not None:
        gone = {int(i) for i in drop}
        if any(not 0 <= i < n for i in gone) or len(gone) >= n:
            raise AggregationError(f"krum_bounded_mean: drop {sorted(gone)} must name rows of the {n} and keep one")
    s = np.asarray(samples, dtype=np.float64)
    if s.shape != (n,) or not np.isfinite(s).all() or (s < 1).any():
        raise AggregationError(f"krum_bounded_mean needs one finite sample count >= 1 per update, got {samples!r}")
    rows = [np.asarray(r, dtype=np.float64) for r in x]
    norms = np.array([math.sqrt(float(np.einsum("i,i->", r, r))) for r in rows])
    if not np.isfinite(norms).all():
        bad = int(np.flatnonzero(~np.isfinite(norms))[0])
        raise AggregationError(f"krum_bounded_mean: update {bad} holds NaN or Inf (or overflows)")
    bound, cap = _round_bounds(norms, s, clip_multiplier, sample_multiplier, sample_cap)
    bounded = [bound_update(float(m), float(c), bound, cap) for m, c in zip(norms, s)]
    scaled = [r * (b.weight / b.counted) for r, b in zip(rows, bounded)]
    if drop is None:
        chosen = np.sort(krum_select(pairwise_sq_distances(rows), f, n - f))  # on the updates as sent: see above
    else:
        chosen = np.array([i for i in range(n) if i not in gone], dtype=np.int64)
    w = np.array([bounded[i].counted if weighted else 1.0 for i in chosen], dtype=np.float64)
    mean = np.zeros(x.shape[1], dtype=np.float64)
    for i, wi in zip(chosen, w):
        mean += scaled[i] * (wi / w.sum())
    return KrumBounded(mean, chosen, bound, cap, sum(b.clipped for b in bounded), sum(b.capped for b in bounded))


def krum_ratios(stack: np.ndarray, num_byzantine: int) -> np.ndarray:
    """Each row's Krum score (:func:`krum_scores` on the rows as sent) over the round's median score: 1 is a
    typical update, 2 one twice as far from its n - f - 2 nearest neighbours. Scale-free, so ratios of rounds
    whose updates shrink as training converges can be averaged. Needs n - f - 2 >= 1 rows; a round whose
    median score is 0 (identical updates) gives 1 for every row at distance 0 and inf for the others."""
    x = np.asarray(stack)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
        raise AggregationError(f"krum_ratios needs a 2-D float array (clients x coordinates), got {x.dtype} of "
                               f"shape {x.shape}")
    scores = krum_scores(pairwise_sq_distances([np.asarray(r, dtype=np.float64) for r in x]), num_byzantine)
    if not np.isfinite(scores).all():
        raise AggregationError("krum_ratios: an update holds NaN or Inf (or overflows)")
    med = float(np.median(scores))
    if med <= 0.0:
        return np.where(scores <= 0.0, 1.0, np.inf)
    return scores / med


def update_suspicion(previous: Mapping[str, float], client_ids: Sequence[str], ratios: Sequence[float],
                     memory: float) -> dict[str, float]:
    """Each device's suspicion after a round: ``memory * previous + (1 - memory) * ratio`` for the devices in
    the round (a device seen for the first time starts at its ratio, so one round decides for it), the others'
    unchanged. An exponential average of :func:`krum_ratios` over the rounds a device took part in: a device
    that is far from the rest round after round (a poisoner whose update keeps pushing what no one else
    pushes) stays the most suspicious through the rounds where an honest device is farther. Returns a new
    dict; ``previous`` is not changed. Updates without a client id (``""``) are not remembered."""
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0.0 <= memory < 1.0:
        raise ConfigError(f"memory must be a number in [0, 1), got {memory!r}")
    r = np.asarray(ratios, dtype=np.float64)
    if r.shape != (len(client_ids),):
        raise AggregationError(f"update_suspicion: {len(client_ids)} client ids but ratios of shape {r.shape}")
    out = dict(previous)
    for cid, ratio in zip(client_ids, r):
        if cid:
            ratio = float(min(ratio, _SUSPICION_MAX))  # an inf ratio (median score 0) stays a finite maximum
            out[cid] = memory * out.get(cid, ratio) + (1.0 - memory) * ratio
    return out


_SUSPICION_MAX = 1e6
"""A ratio counts for at most this much (an identical-update round gives inf; the stored state stays finite)."""


def most_suspicious(suspicion: Sequence[float], num_dropped: int) -> np.ndarray:
    """Indices of the ``num_dropped`` highest suspicions (ties: lowest index first), ascending."""
    s = np.asarray(suspicion, dtype=np.float64)
    if isinstance(num_dropped, bool) or not isinstance(num_dropped, (int, np.integer)) \
            or not 0 <= num_dropped < max(1, len(s)):
        raise AggregationError(f"cannot drop {num_dropped!r} of {len(s)} updates and keep one")
    return np.sort(np.argsort(-s, kind="stable")[:num_dropped])


def proximal_term(weights: Weights, global_weights: Weights, mu: float) -> float:
    """FedProx's client-side penalty (mu / 2) * ||w - w_global||^2.

    FedProx (Li et al., MLSys 2020) changes only the *client* objective: each
    device minimises loss(w) + this term, which keeps heterogeneous clients
    from drifting far from the global model in long local epochs. The server
    side is plain FedAvg. The trainer adds this to its loss.
    """
    return 0.5 * mu * sum(float(np.sum((np.asarray(weights[n], np.float64) - global_weights[n]) ** 2))
                          for n in global_weights)


def proximal_gradient(weights: Weights, global_weights: Weights, mu: float) -> dict[str, np.ndarray]:
    """Gradient of :func:`proximal_term`: mu * (w - w_global), added to each local gradient."""
    return {n: (mu * (np.asarray(weights[n]) - global_weights[n])).astype(np.asarray(weights[n]).dtype)
            for n in global_weights}


def bulyan(stack: np.ndarray, num_byzantine: int, dist: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Bulyan (El Mhamdi et al., ICML 2018) over the rows of ``stack`` (n clients x P coordinates):
    theta = n - 2f updates chosen one by one by Krum (each time the lowest Krum score among those
    not yet chosen, scored among themselves), then per coordinate the mean of the beta = theta - 2f
    chosen values closest to the chosen values' median. Needs n >= 4f + 3. Returns the aggregate
    (float64) and the chosen row indices."""
    n = stack.shape[0]
    f = int(num_byzantine)
    if f < 0:
        raise ConfigError(f"num_byzantine must be >= 0, got {num_byzantine}")
    if n < 4 * f + 3:
        raise AggregationError(f"Bulyan with f={f} Byzantine needs at least {4 * f + 3} updates, got {n}")
    if dist is None:
        dist = pairwise_sq_distances([row for row in stack])
    theta = n - 2 * f
    remaining = list(range(n))
    chosen: list[int] = []
    while len(chosen) < theta:
        sub = dist[np.ix_(remaining, remaining)]
        m = len(remaining)
        k = max(1, m - f - 2)
        scores = np.array([np.sort(np.delete(sub[i], i))[:k].sum() for i in range(m)])
        pick = remaining[int(np.argmin(scores))]
        chosen.append(pick)
        remaining.remove(pick)
    sel = np.asarray(stack[sorted(chosen)], dtype=np.float64)
    beta = theta - 2 * f
    med = np.median(sel, axis=0)
    order = np.argsort(np.abs(sel - med), axis=0, kind="stable")[:beta]
    closest = np.take_along_axis(sel, order, axis=0)
    return closest.mean(axis=0), np.array(sorted(chosen))


def weighted_metrics(results: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, float]:
    """Flower's ``weighted_average`` for metrics: each metric's mean over the clients that reported it,
    weighted by their example counts (``results`` = [(num_examples, {name: value})])."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for n, metrics in results:
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(n) * float(v)
            counts[k] = counts.get(k, 0.0) + float(n)
    return {k: sums[k] / counts[k] for k in sorted(sums) if counts[k] > 0}
