"""Real data that ships inside installed packages — scikit-learn's 8x8
handwritten digits (1,797 images, 10 classes) — plus the federated split
used throughout: a label-skewed (Dirichlet) partition across devices.

Nothing here downloads at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError


@dataclass(frozen=True)
class Split:
    """Train/test arrays: images (N, 1, 8, 8) float32 in [0, 1], labels int64."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def flat(self) -> "Split":
        """The same data with images flattened to (N, 64) for MLPs."""
        return Split(
            self.x_train.reshape(len(self.x_train), -1),
            self.y_train,
            self.x_test.reshape(len(self.x_test), -1),
            self.y_test,
        )


def require_digits() -> None:
    """InputError naming the extra when scikit-learn (the digits data set) is not installed: commands
    call it before they start a broker or a progress bar, so the line is all they print."""
    import importlib.util

    if importlib.util.find_spec("sklearn") is None:  # the sim extra (pyproject.toml): not in a device's install
        raise InputError("scikit-learn is needed for the digits data set (edgeflow demo/simulate): "
                         "pip install 'edgeflow[sim]' (from a checkout: pip install '.[sim]')")


def load_digits(*, test_fraction: float = 0.25, seed: int = 0) -> Split:
    """scikit-learn's digits, shuffled with ``seed`` and split stratified by class."""
    require_digits()
    from sklearn.datasets import load_digits as _load

    if not 0.0 < test_fraction < 1.0:
        raise InputError(f"test_fraction must be in (0, 1), got {test_fraction}")
    d = _load()
    x = (d.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(len(idx) * test_fraction))
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    tr = rng.permutation(np.concatenate(train_idx))
    te = rng.permutation(np.concatenate(test_idx))
    return Split(x[tr], y[tr], x[te], y[te])


def dirichlet_partition(
    labels: np.ndarray, n_clients: int, *, alpha: float = 0.3, seed: int = 0, min_size: int = 2
) -> list[np.ndarray]:
    """Indices of ``labels`` for each of ``n_clients``, label-skewed by Dirichlet(alpha).

    For each class the class's samples are divided among clients in
    proportions drawn from Dirichlet(alpha): small alpha = each client sees
    few classes (non-IID). Redrawn until every client has ``min_size``
    samples, so no device starts empty.
    """
    labels = np.asarray(labels)
    if n_clients < 1:
        raise InputError(f"n_clients must be >= 1, got {n_clients}")
    if n_clients * min_size > len(labels):
        raise InputError(f"{len(labels)} samples cannot give {n_clients} clients {min_size} each")
    if alpha <= 0:
        raise InputError(f"alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)

    def draw(pool: np.ndarray, parts: list[list[int]]) -> None:
        for c in classes:
            idx = rng.permutation(pool[labels[pool] == c])
            p = rng.dirichlet(np.full(n_clients, alpha))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())

    everything = np.arange(len(labels))
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        draw(everything, parts)
        if min(len(p) for p in parts) >= min_size:
            return [np.array(sorted(p), dtype=np.int64) for p in parts]
    # Many clients, few samples: redraws rarely give everyone min_size. Deal
    # min_size random samples to each client first, then split the rest by
    # Dirichlet(alpha) as above (the skew is kept, the floor guaranteed).
    order = rng.permutation(len(labels))
    floor = order[: n_clients * min_size].reshape(n_clients, min_size)
    parts = [row.tolist() for row in floor]
    draw(np.sort(order[n_clients * min_size:]), parts)
    return [np.array(sorted(p), dtype=np.int64) for p in parts]
