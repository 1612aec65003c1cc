"""Backdoor defences from the literature, tried against benchmarks/backdoor.py's attack (none is on by default).

    python benchmarks/backdoor_defences.py                 # every rule below, 3 seeds, 15 rounds
    python benchmarks/backdoor_defences.py --only flame --seeds 1

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


RULES: dict[str, dict[str, Any]] = {
    "rlr": {"strategy": "rlr", "strategy_params": {"theta": 4}},
    "flame": {"strategy": "flame"},
    "fltrust": {"strategy": "fltrust"},
    "centered-clip": {"strategy": "centered-clip", "strategy_params": {"tau": 1.0}},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--only", choices=sorted(RULES), action="append")
    ap.add_argument("--json", help="write the figures as JSON to this path")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    for cls in (RobustLearningRate, Flame, FLTrust, CenteredClip):
        strategies.register_aggregator(cls.name, cls)
    backdoor.STRATEGIES.update(RULES)
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
