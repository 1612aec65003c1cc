"""Backdoor defences from the literature, tried against benchmarks/backdoor.py's attack (none is on by default).

    python benchmarks/backdoor_defences.py                 # every rule below, 3 seeds, 15 rounds
    python benchmarks/backdoor_defences.py --only flame --seeds 1
    python benchmarks/backdoor_defences.py --drops         # who krum-reputation drops, per seed
    python benchmarks/backdoor_defences.py --demo --only reputation-project --demo-seeds 0 1  # on `edgeflow demo`
    python benchmarks/backdoor_defences.py --shares        # why: who is least contradicted, per round; each
                                                           # device's cosine to its own previous update

The rule kept as a strategy, ``fedavg-krum`` (FedAvg's bounds over a Multi-Krum selection, with
``dropped = "project"`` as an option), is measured by benchmarks/backdoor.py itself.

The same fleet, attack and measures as benchmarks/backdoor.py (10 devices, Dirichlet 0.5, device 0 trains
"7 + a 2x2 trigger -> 1"), with these rules as gateway aggregators (experiments, kept so that the figures in
docs/security.md section 14 can be rerun; they are not registered in the product):

- ``rlr``: robust learning rate (Ozdayi et al., AAAI 2021): the server step is negated on coordinates where
  fewer than ``theta`` clients agree on the sign.
- ``flame``: FLAME's filter (Nguyen et al., USENIX Security 2022): HDBSCAN on cosine distances with a
  minimum cluster of n/2 + 1, keep the cluster, clip to the median norm, average (scikit-learn's HDBSCAN).
- ``fltrust``: FLTrust (Cao et al., NDSS 2021): the gateway trains on 100 clean digits of its own, each
  update is weighted by ReLU(cosine with that root update) and rescaled to the root update's norm.
- ``centered-clip``: centered clipping (Karimireddy et al., ICML 2021): 3 iterations of
  v += mean(clip(x_i - v, tau x median distance)), starting from the previous round's step.

The rules below all start from default FedAvg's bounds taken from the round itself (norm 1.5x the robust
median norm, claims 3x the robust median claim) and end with the claim-weighted mean of what they keep:

- ``coord-clip`` / ``coord-clip-2x``: each coordinate of each update clipped to 1x / 2x the round's median
  |value| of that coordinate (bounds the influence on weights that honest devices barely move, such as the
  trigger pixels' input weights);
- ``coord-clip-second``: clipped to the second-largest |value| of the coordinate instead (one device alone
  cannot push a coordinate further than the next one does); ``coord-clip-second-prev``: the same bound taken
  from the previous round (the streaming form, O(P) state);
- ``noise``: FLAME's adaptive noise step: N(0, (0.01 x median norm)^2) on every coordinate of the mean;
- ``krum-downweight``: the Krum-farthest update (f = 1) counts 0.25 of its claim instead of being dropped;
- ``residual-project``: the update with the largest share outside the span of the round's other updates and
  the previous round's (its own past excluded: what no one else pushed) enters as its projection onto that
  span;
- ``krum-project``: fedavg-krum, but the dropped update enters as its projection onto the span of the round's
  kept updates and the previous round's;
- ``krum-after-bound``: fedavg-krum with Krum choosing among the bounded updates instead of the ones as sent;
- ``krum-threshold-1.4`` / ``-1.5``: fedavg-krum that drops the Krum-farthest only when its score is at least
  1.4x / 1.5x the round's median score.

Variants of the rule kept as ``krum-reputation`` (measured with the kept one by benchmarks/backdoor.py):

- ``krum-momentum``: fedavg-krum with FedAvgM's server momentum 0.9 (``krum-reputation`` with memory 0: the
  suspicion is this round's Krum ratio alone, so the Krum-farthest is dropped);
- ``reputation-no-momentum`` / ``reputation-momentum-0.5``: the suspicion over rounds without momentum / with 0.5;
- ``reputation-threshold-1.4`` / ``-1.6`` / ``-1.8`` / ``-2.0``: the suspicion over rounds without momentum, but the
  most suspicious device is dropped only when its suspicion is at least 1.4x / ... / 2.0x the median suspicion of
  the round's devices (an honest round would then be plain FedAvg's bounded mean: no momentum needed to win back
  a dropped honest device); ``--drops`` prints how often each device was dropped;
- ``flame-full``: FLAME's whole recipe: the HDBSCAN filter, clipping to the median norm, then Gaussian noise of
  ``lam`` x the median norm per coordinate (lam 0.001, the paper's value for image classification);
- ``reputation-project`` / ``reputation-project-momentum-0.5``: krum-reputation's choice of the most suspicious
  device over rounds (memory 0.7), but its update enters as its projection onto the span of the round's other
  updates instead of being dropped; server momentum 0 / 0.5;
- ``reputation-head``: krum-reputation's choice (momentum 0), but only the body of its update is dropped; its last
  layer (classifier weight and bias) enters the mean as the others';
- ``reputation-lr-1.3`` / ``-1.6``: krum-reputation without momentum, the server step 1.3x / 1.6x the mean;
- ``dnc``: Divide-and-Conquer (Shejwalkar and Houmansadr, NDSS 2021): 5 times, on 1000 random coordinates of
  the centred updates, the f updates with the largest squared projection on the top singular vector are
  flagged; the unflagged ones enter FedAvg's bounded mean (bounds from the round).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import backdoor  # noqa: E402

from edgeflow.gateway import strategies  # noqa: E402


class RobustLearningRate(strategies._Holding):
    name = "rlr"

    def __init__(self, theta: int = 4, **kw: Any) -> None:
        super().__init__(**kw)
        self.theta = theta

    def _reduce(self):
        x = np.stack(self._held).astype(np.float64)
        w = np.asarray(self._samples, dtype=np.float64)
        mean = (x * (w / w.sum())[:, None]).sum(0)
        agree = np.abs(np.sign(x).sum(0))
        return self._as_tensors(np.where(agree >= self.theta, mean, -mean)), {}


class Flame(strategies._Holding):
    name = "flame"

    def _reduce(self):
        from sklearn.cluster import HDBSCAN

        x = np.stack(self._held).astype(np.float64)
        n = len(x)
        norms = np.linalg.norm(x, axis=1)
        u = x / np.maximum(norms, 1e-30)[:, None]
        dist = np.clip(1.0 - u @ u.T, 0.0, None)
        labels = HDBSCAN(min_cluster_size=n // 2 + 1, min_samples=1, metric="precomputed", copy=True,
                         allow_single_cluster=True).fit(dist).labels_
        keep = (np.flatnonzero(labels == np.bincount(labels[labels >= 0]).argmax()) if (labels >= 0).any()
                else np.arange(n))
        bound = float(np.median(norms))
        kept = x[keep] * np.minimum(1.0, bound / np.maximum(norms[keep], 1e-30))[:, None]
        return self._as_tensors(kept.mean(0)), {"kept": float(len(keep))}


class FLTrust(strategies._Holding):
    name = "fltrust"

    def __init__(self, root: int = 100, **kw: Any) -> None:
        super().__init__(**kw)
        from edgeflow.data.datasets import load_digits

        split = load_digits(seed=0).flat()
        self.x, self.y = split.x_train[-root:], split.y_train[-root:]
        self.trainer = None

    def _root_update(self) -> np.ndarray:
        from edgeflow import zoo
        from edgeflow.train import Trainer, make_optimizer

        if self.trainer is None:
            self.trainer = Trainer(zoo.digits_mlp(seed=0), seed=0)
        t = self.trainer
        t.set_weights(self._global)
        t.optimizer = make_optimizer("sgd", 0.1)  # the clients' TrainConfig in backdoor.py
        t.fit((self.x, self.y), epochs=1, batch_size=16, anchor=self._global)
        return self._schema.flatten(t.delta_from(self._global)).astype(np.float64)

    def _reduce(self):
        x = np.stack(self._held).astype(np.float64)
        g0 = self._root_update()
        norms, n0 = np.linalg.norm(x, axis=1), float(np.linalg.norm(g0))
        trust = np.maximum(x @ g0 / np.maximum(norms * n0, 1e-30), 0.0)
        out = ((x * (n0 / np.maximum(norms, 1e-30))[:, None]) * trust[:, None]).sum(0) / max(trust.sum(), 1e-30)
        return self._as_tensors(out), {}


class CenteredClip(strategies._Holding):
    name = "centered-clip"

    def __init__(self, tau: float = 1.0, iters: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.tau, self.iters, self.v = tau, iters, None

    def _reduce(self):
        x = np.stack(self._held).astype(np.float64)
        v = np.zeros(x.shape[1]) if self.v is None else self.v.copy()
        for _ in range(self.iters):
            d = x - v
            nd = np.linalg.norm(d, axis=1)
            v = v + (d * np.minimum(1.0, self.tau * np.median(nd) / np.maximum(nd, 1e-30))[:, None]).mean(0)
        self.v = v
        return self._as_tensors(v), {}


class _Bounded(strategies._Holding):
    """FedAvg's bounds from the round itself, then :meth:`_rule` on the bounded rows, then the claim-weighted mean."""

    def _rule(self, x: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - abstract
        raise NotImplementedError("need _rule")

    def _reduce(self):
        x = np.stack(self._held).astype(np.float64)
        n = len(x)
        s = np.asarray(self._samples, dtype=np.float64)
        s = np.minimum(s, 3.0 * np.sort(s)[(n - 1) // 2])
        norms = np.linalg.norm(x, axis=1)
        self.median_norm = float(np.sort(norms)[(n - 1) // 2])
        x *= np.minimum(1.0, 1.5 * self.median_norm / np.maximum(norms, 1e-30))[:, None]
        x, s = self._rule(x, s)
        return self._as_tensors((x * s[:, None]).sum(0) / s.sum()), {}


class CoordinateClip(_Bounded):
    name = "coord-clip"

    def __init__(self, k: float = 1.0, stat: str = "median", previous: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.k, self.stat, self.previous, self.last = k, stat, previous, None

    def _rule(self, x, s):
        a = np.sort(np.abs(x), axis=0)
        ref = a[(len(x) - 1) // 2] if self.stat == "median" else a[-2]
        if self.previous:
            ref, self.last = (np.full(x.shape[1], np.inf) if self.last is None else self.last), ref
        return np.clip(x, -self.k * ref, self.k * ref), s


class AdaptiveNoise(_Bounded):
    name = "noise"

    def __init__(self, lam: float = 0.01, **kw: Any) -> None:
        super().__init__(**kw)
        self.lam, self.rng = lam, np.random.default_rng(0)

    def _reduce(self):
        mean, metrics = super()._reduce()
        return {k: v + self.rng.normal(0.0, self.lam * self.median_norm, v.shape) for k, v in mean.items()}, metrics

    def _rule(self, x, s):
        return x, s


class KrumDownweight(_Bounded):
    name = "krum-downweight"

    def __init__(self, weight: float = 0.25, **kw: Any) -> None:
        super().__init__(**kw)
        self.weight = weight

    def _rule(self, x, s):
        from edgeflow.gateway.aggregate import krum_scores, pairwise_sq_distances

        far = int(np.argmax(krum_scores(pairwise_sq_distances(list(x)), 1)))
        s = s.copy()
        s[far] *= self.weight
        return x, s


def project_onto_span(vector: np.ndarray, basis: list[np.ndarray]) -> np.ndarray:
    """The least-squares projection of ``vector`` onto the span of the ``basis`` rows (zeros without a basis)."""
    if not basis:
        return np.zeros_like(vector)
    gram = np.array([[float(a @ b) for b in basis] for a in basis])
    coef = np.linalg.lstsq(gram, np.array([float(a @ vector) for a in basis]), rcond=1e-12)[0]
    return sum((c * a for c, a in zip(coef, basis)), np.zeros_like(vector))


class KrumProject(_Bounded):
    """fedavg-krum, but the dropped update enters as its projection onto the span of the round's kept updates and
    the previous round's (what an honest outlier shares with the fleet's recent directions would come in)."""

    name = "krum-project"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.previous: list[np.ndarray] = []

    def _reduce(self):
        from edgeflow.gateway.aggregate import krum_scores, pairwise_sq_distances

        raw = np.stack(self._held).astype(np.float64)  # Krum on the updates as sent, as fedavg-krum
        self.far = int(np.argmax(krum_scores(pairwise_sq_distances(list(raw)), 1)))
        return super()._reduce()

    def _rule(self, x, s):
        kept = [x[i] for i in range(len(x)) if i != self.far]
        x = x.copy()
        x[self.far] = project_onto_span(x[self.far], kept + self.previous)
        self.previous = [v.copy() for v in kept]
        return x, s


class KrumAfterBound(_Bounded):
    """fedavg-krum with the order swapped: Krum chooses among the bounded updates."""

    name = "krum-after-bound"

    def _rule(self, x, s):
        from edgeflow.gateway.aggregate import krum_scores, pairwise_sq_distances

        s = s.copy()
        s[int(np.argmax(krum_scores(pairwise_sq_distances(list(x)), 1)))] = 0.0
        return x, s


class KrumThreshold(_Bounded):
    """fedavg-krum that drops the Krum-farthest update (chosen as sent) only when its score is at least ``t`` x the
    round's median score (an honest round then keeps every update)."""

    name = "krum-threshold"

    def __init__(self, t: float = 1.4, **kw: Any) -> None:
        super().__init__(**kw)
        self.t = t

    def _reduce(self):
        from edgeflow.gateway.aggregate import krum_scores, pairwise_sq_distances

        scores = krum_scores(pairwise_sq_distances([np.asarray(h, np.float64) for h in self._held]), 1)
        far = int(np.argmax(scores))
        self.far = far if scores[far] >= self.t * np.median(scores) else None
        return super()._reduce()

    def _rule(self, x, s):
        s = s.copy()
        if self.far is not None:
            s[self.far] = 0.0
        return x, s


class ReputationThreshold(strategies.KrumReputation):
    """krum-reputation (no momentum) that drops the most suspicious device only when its suspicion is at least ``t``
    x the median suspicion of the round's devices."""

    name = "reputation-threshold"
    dropped: list[list[str]] = []
    """Who was dropped, per round (for ``--drops``)."""

    def __init__(self, t: float = 1.6, **kw: Any) -> None:
        super().__init__(server_momentum=0.0, **kw)
        self.t = t

    def _reduce(self):
        from edgeflow.gateway.aggregate import krum_bounded_mean, krum_ratios, update_suspicion

        stack, ids = np.stack(self._held), list(self._client_ids)
        self._pending = update_suspicion(self.suspicion, ids, krum_ratios(stack, self.num_byzantine), self.memory)
        s = np.array([self._pending[c] for c in ids])
        drop = [int(i) for i in np.argsort(-s, kind="stable")[:self.num_byzantine] if s[i] >= self.t * np.median(s)]
        r = krum_bounded_mean(stack, self._samples, self.num_byzantine, clip_multiplier=self.clip_multiplier,
                              sample_multiplier=self.sample_multiplier, sample_cap=self.sample_cap,
                              weighted=self.weighted, drop=np.array(sorted(drop), dtype=np.int64))
        self.selected_clients = tuple(ids[i] for i in r.chosen)
        ReputationThreshold.dropped.append([ids[i] for i in drop])
        return self._as_tensors(r.mean), {"num_selected": float(len(r.chosen)), "dropped": float(len(drop))}


class _ReputationBounded(strategies.KrumReputation):
    """krum-reputation's choice of the most suspicious devices over rounds, with FedAvg's bounds from the round;
    :meth:`_combine` says what becomes of the suspects' bounded updates."""

    def _combine(self, x: np.ndarray, s: np.ndarray, far: list[int]) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError("need _combine")

    def _reduce(self):
        from edgeflow.gateway.aggregate import krum_ratios, most_suspicious, update_suspicion

        raw = np.stack(self._held).astype(np.float64)
        ids = list(self._client_ids)
        self._pending = update_suspicion(self.suspicion, ids, krum_ratios(raw, self.num_byzantine), self.memory)
        far = [int(i) for i in most_suspicious([self._pending[c] for c in ids], self.num_byzantine)]
        n = len(raw)
        s = np.asarray(self._samples, dtype=np.float64)
        s = np.minimum(s, 3.0 * np.sort(s)[(n - 1) // 2])
        norms = np.linalg.norm(raw, axis=1)
        x = raw * np.minimum(1.0, 1.5 * float(np.sort(norms)[(n - 1) // 2]) / np.maximum(norms, 1e-30))[:, None]
        self.selected_clients = tuple(c for i, c in enumerate(ids) if i not in far)
        return self._as_tensors(self._combine(x, s, far)), {}


class ReputationProject(_ReputationBounded):
    """krum-reputation's choice (the most suspicious device over rounds), but its update enters as its projection
    onto the span of the round's other updates instead of being dropped (what an honest outlier shares with the
    rest of this round comes in; what no one else pushed does not)."""

    name = "reputation-project"

    def _combine(self, x, s, far):
        kept = [x[i] for i in range(len(x)) if i not in far]
        for i in far:
            x[i] = project_onto_span(x[i], kept)
        return (x * s[:, None]).sum(0) / s.sum()


class ReputationHead(_ReputationBounded):
    """krum-reputation's choice (the most suspicious device over rounds), but only the body of its update is
    dropped: its last layer's (the last two tensors, the classifier's weight and bias) enters the mean as
    everyone else's (an honest outlier's classes would still be learned at the head)."""

    name = "reputation-head"

    def _combine(self, x, s, far):
        head = self._schema.offsets[self._schema.names[-2]][0]
        body_w = s.copy()
        body_w[far] = 0.0
        out = np.empty(x.shape[1])
        out[:head] = (x[:, :head] * body_w[:, None]).sum(0) / body_w.sum()
        out[head:] = (x[:, head:] * s[:, None]).sum(0) / s.sum()
        return out


class ResidualProject(_Bounded):
    name = "residual-project"
    log: list[tuple[list[str], list[float]]] = []
    """(client ids, their shares outside the others' span) per round, for ``--shares``."""
    self_cosines: list[dict[str, float]] = []
    """Per round, each device's cosine to its own previous (bounded) update, for ``--shares``."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.previous: list[tuple[str, np.ndarray]] = []

    def _rule(self, x, s):
        ids = list(self._client_ids)
        proj, share = [], []
        for i in range(len(x)):
            basis = [x[j] for j in range(len(x)) if j != i] + [v for c, v in self.previous if c != ids[i]]
            proj.append(project_onto_span(x[i], basis))
            share.append(np.linalg.norm(x[i] - proj[-1]) / max(np.linalg.norm(x[i]), 1e-30))
        own = dict(self.previous)
        ResidualProject.self_cosines.append({c: float(v @ own[c] / max(np.linalg.norm(v) * np.linalg.norm(own[c]),
                                                                       1e-30)) for c, v in zip(ids, x) if c in own})
        self.previous = [(c, v.copy()) for c, v in zip(ids, x)]
        ResidualProject.log.append((ids, share))
        top = int(np.argmax(share))
        x = x.copy()
        x[top] = proj[top]
        return x, s


class FlameFull(Flame):
    name = "flame-full"

    def __init__(self, lam: float = 0.001, **kw: Any) -> None:
        super().__init__(**kw)
        self.lam, self.rng = lam, np.random.default_rng(0)

    def _reduce(self):
        out, metrics = super()._reduce()
        med = float(np.median(np.linalg.norm(np.stack(self._held).astype(np.float64), axis=1)))
        return {k: v + self.rng.normal(0.0, self.lam * med, v.shape) for k, v in out.items()}, metrics


class DivideAndConquer(_Bounded):
    name = "dnc"

    def __init__(self, num_byzantine: int = 1, iters: int = 5, dims: int = 1000, **kw: Any) -> None:
        super().__init__(**kw)
        self.f, self.iters, self.dims, self.rng = num_byzantine, iters, dims, np.random.default_rng(0)

    def _reduce(self):
        x = np.stack(self._held).astype(np.float64)
        good = set(range(len(x)))
        for _ in range(self.iters):
            idx = self.rng.choice(x.shape[1], min(self.dims, x.shape[1]), replace=False)
            z = x[:, idx] - x[:, idx].mean(0)
            top = np.linalg.svd(z, full_matrices=False)[2][0]
            good &= set(np.argsort((z @ top) ** 2)[: len(x) - self.f].tolist())
        self.good = sorted(good)
        return super()._reduce()

    def _rule(self, x, s):
        s = s.copy()
        s[[i for i in range(len(x)) if i not in self.good]] = 0.0
        return x, s


RULES: dict[str, dict[str, Any]] = {
    "rlr": {"strategy": "rlr", "strategy_params": {"theta": 4}},
    "flame": {"strategy": "flame"},
    "fltrust": {"strategy": "fltrust"},
    "centered-clip": {"strategy": "centered-clip", "strategy_params": {"tau": 1.0}},
    "coord-clip": {"strategy": "coord-clip", "strategy_params": {"k": 1.0}},
    "coord-clip-2x": {"strategy": "coord-clip", "strategy_params": {"k": 2.0}},
    "coord-clip-second": {"strategy": "coord-clip", "strategy_params": {"stat": "second"}},
    "coord-clip-second-prev": {"strategy": "coord-clip", "strategy_params": {"stat": "second", "previous": True}},
    "noise": {"strategy": "noise", "strategy_params": {"lam": 0.01}},
    "krum-downweight": {"strategy": "krum-downweight", "strategy_params": {"weight": 0.25}},
    "residual-project": {"strategy": "residual-project"},
    "krum-project": {"strategy": "krum-project", "min_clients": 5},
    "krum-after-bound": {"strategy": "krum-after-bound", "min_clients": 5},
    "krum-threshold-1.4": {"strategy": "krum-threshold", "strategy_params": {"t": 1.4}, "min_clients": 5},
    "krum-threshold-1.5": {"strategy": "krum-threshold", "strategy_params": {"t": 1.5}, "min_clients": 5},
    "krum-momentum": {"strategy": "krum-reputation", "strategy_params": {"memory": 0.0}},
    "reputation-no-momentum": {"strategy": "krum-reputation", "strategy_params": {"server_momentum": 0.0}},
    "reputation-momentum-0.5": {"strategy": "krum-reputation", "strategy_params": {"server_momentum": 0.5}},
    "flame-full": {"strategy": "flame-full", "strategy_params": {"lam": 0.001}},
    **{f"reputation-threshold-{t}": {"strategy": "reputation-threshold", "strategy_params": {"t": float(t)}}
       for t in ("1.4", "1.6", "1.8", "2.0")},
    "dnc": {"strategy": "dnc", "min_clients": 5},
    **{f"reputation-lr-{lr}": {"strategy": "krum-reputation", "strategy_params": {"server_momentum": 0.0,
                                                                             "server_lr": float(lr)}}
       for lr in ("1.3", "1.6")},
    "reputation-head": {"strategy": "reputation-head", "strategy_params": {"server_momentum": 0.0}},
    "reputation-project": {"strategy": "reputation-project", "strategy_params": {"server_momentum": 0.0}},
    "reputation-project-momentum-0.5": {"strategy": "reputation-project", "strategy_params": {"server_momentum": 0.5}},
}


def shares(seeds: int, rounds: int) -> None:
    """Per seed, with the attacker: in how many rounds the poisoner's update has the largest share outside the
    span of the others' (this round's and the previous round's), its shares and the rounds' medians; and how
    bright the trigger's pixels are in honest training digits, per class."""
    from edgeflow.data.datasets import load_digits

    for seed in range(seeds):
        ResidualProject.log.clear()
        ResidualProject.self_cosines.clear()
        backdoor.one_run("residual-project", seed, rounds, True)
        mine_cos = [r["d0"] for r in ResidualProject.self_cosines if "d0" in r]
        honest_cos = [v for r in ResidualProject.self_cosines for c, v in r.items() if c != "d0"]
        ranks = [sorted(share).index(share[ids.index("d0")]) + 1 for ids, share in ResidualProject.log]
        mine = [share[ids.index("d0")] for ids, share in ResidualProject.log]
        med = [float(np.median(share)) for _, share in ResidualProject.log]
        print(json.dumps({"seed": seed, "poisoner_least_contradicted_rounds": sum(r == len(ResidualProject.log[0][0])
                                                                                  for r in ranks),
                          "rounds": len(ranks), "poisoner_share": [round(x, 2) for x in (min(mine), max(mine))],
                          "round_median_share": [round(x, 2) for x in (min(med), max(med))],
                          "poisoner_cosine_to_own_previous": [round(min(mine_cos), 2), round(max(mine_cos), 2)],
                          "honest_cosine_to_own_previous_p10_median": [
                              round(float(np.percentile(honest_cos, 10)), 2), round(float(np.median(honest_cos)), 2)]}),
              flush=True)
    split = load_digits(seed=0).flat()
    corner = {int(c): [round(float(v), 2) for v in split.x_train[split.y_train == c][:, backdoor.TRIGGER].mean(0)]
              for c in range(10)}
    print(json.dumps({"trigger_pixels_mean_intensity_by_class": corner}))


class ReputationLog(strategies.KrumReputation):
    """krum-reputation, recording who it dropped in each round (for ``--drops``)."""

    name = "krum-reputation-log"
    dropped: list[list[str]] = []

    def _reduce(self):
        out = super()._reduce()
        ReputationLog.dropped.append([c for c in self._client_ids if c not in self.selected_clients])
        return out


def drops(seeds: int, rounds: int, rules: list[str] | None = None) -> None:
    """Per seed, with and without the attacker: how many rounds krum-reputation (or each of ``rules``, of the
    ``reputation-threshold-*`` family) dropped each device, with the run's clean accuracy and backdoor success."""
    from collections import Counter

    backdoor.STRATEGIES["krum-reputation-log"] = {"strategy": "krum-reputation-log"}
    for name in rules or ["krum-reputation-log"]:
        log = ReputationLog.dropped if name == "krum-reputation-log" else ReputationThreshold.dropped
        for seed in range(seeds):
            for attack in (False, True):
                log.clear()
                row = backdoor.one_run(name, seed, rounds, attack)
                print(json.dumps({"rule": name, "seed": seed, "attack": attack,
                                  "clean_accuracy": round(row["clean_accuracy"], 3),
                                  "backdoor_success": round(row["backdoor_success"], 3),
                                  "rounds_dropped": dict(Counter(c for r in log for c in r))}), flush=True)


def demo_arms(rules: list[str], seeds: list[int], codecs: list[str]) -> None:
    """``edgeflow demo`` (benchmarks/backdoor_default.py's demo arm: the demo's RoundConfig built with the rule's
    strategy) per codec and seed, FedAvg first, then each rule; a JSON line per run, then each rule's mean
    difference from FedAvg in points."""
    import backdoor_default

    for codec in codecs:
        diffs: dict[str, list[float]] = {r: [] for r in rules}
        for seed in seeds:
            base = backdoor_default.run_demo("fedavg", seed, codec, {})["final_accuracy"]
            print(json.dumps({"rule": "fedavg", "codec": codec, "seed": seed, "final_accuracy": base}), flush=True)
            for rule in rules:
                cfg = RULES[rule]
                acc = backdoor_default.run_demo(cfg["strategy"], seed, codec,
                                                dict(cfg.get("strategy_params", {})))["final_accuracy"]
                diffs[rule].append(100.0 * (acc - base))
                print(json.dumps({"rule": rule, "codec": codec, "seed": seed, "final_accuracy": acc}), flush=True)
        for rule, d in diffs.items():
            print(json.dumps({"rule": rule, "codec": codec, "seeds": seeds,
                              "mean_points_vs_fedavg": round(float(np.mean(d)), 2)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--only", choices=sorted(RULES), action="append")
    ap.add_argument("--json", help="write the figures as JSON to this path")
    ap.add_argument("--shares", action="store_true", help="print who is least contradicted per round, then exit")
    ap.add_argument("--drops", action="store_true", help="print who krum-reputation drops per seed, then exit")
    ap.add_argument("--demo", action="store_true",
                    help="run `edgeflow demo` with each --only rule (and FedAvg) instead of the backdoor benchmark")
    ap.add_argument("--demo-seeds", type=int, nargs="+", default=[0, 1], metavar="SEED", help="--demo's seeds")
    ap.add_argument("--codec", choices=["topk-int8", "int8"], action="append", help="--demo's codecs (default top-k)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    for cls in (RobustLearningRate, Flame, FLTrust, CenteredClip, CoordinateClip, AdaptiveNoise, KrumDownweight,
                ResidualProject, KrumProject, KrumAfterBound, KrumThreshold, FlameFull, DivideAndConquer,
                ReputationLog, ReputationThreshold, ReputationProject, ReputationHead):
        strategies.register_aggregator(cls.name, cls)
    backdoor.STRATEGIES.update(RULES)
    if args.shares:
        shares(args.seeds, args.rounds)
        return 0
    if args.demo:
        if not args.only:
            ap.error("--demo needs --only RULE (each demo run takes about 25 s)")
        demo_arms(args.only, args.demo_seeds, args.codec or ["topk-int8"])
        return 0
    if args.drops:
        if any(not n.startswith("reputation-threshold") for n in args.only or []):
            ap.error("--drops takes only --only reputation-threshold-* (or no --only: krum-reputation)")
        drops(args.seeds, args.rounds, args.only)
        return 0
    rows = []
    for name in args.only or list(RULES):
        for attack in (False, True):
            rows += [backdoor.one_run(name, seed, args.rounds, attack) for seed in range(args.seeds)]
            key = f"{name} {'attacked' if attack else 'clean'}"
            print(json.dumps({name: backdoor.mean_table(rows, [name])[key], "attack": attack}), flush=True)
    if args.json:
        table = backdoor.mean_table(rows, args.only or list(RULES))
        Path(args.json).write_text(json.dumps({"rows": rows, "mean": table, "args": vars(args)}, indent=2),
                                   encoding="utf-8")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
