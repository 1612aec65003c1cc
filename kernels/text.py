"""TfIdfVectorizer on integer token ids (string pools need a string dtype,
which the numpy backend does not carry).

The pool holds the n-grams to count, grouped by length (``ngram_counts``
gives where each length starts in ``pool_int64s``); ``ngram_indexes`` maps
each pooled n-gram to its output column. An n-gram of length n >= 2 may skip
up to ``max_skip_count`` tokens between its items (every skip distance is
counted); unigrams are counted once. The counting is vectorized per
(length, skip) pair: every window of the row is compared with every pooled
n-gram of that length at once.
"""

from __future__ import annotations

import numpy as np

from .registry import INT_TYPES, KernelError, register

_MODES = ("TF", "IDF", "TFIDF")


def _pool(pool: np.ndarray, ngram_counts, ngram_indexes, min_len: int, max_len: int):
    """[(n, grams (P, n), output columns (P,))] for every pooled length in range."""
    starts = [int(s) for s in ngram_counts] + [pool.size]
    out, gram_id = [], 0
    for n, (a, b) in enumerate(zip(starts[:-1], starts[1:]), start=1):
        if (b - a) % n:
            raise KernelError(f"TfIdfVectorizer: the {n}-gram pool holds {b - a} ids, not a multiple of {n}")
        grams = pool[a:b].reshape(-1, n)
        cols = np.asarray(ngram_indexes[gram_id:gram_id + len(grams)], dtype=np.int64)
        if cols.size != len(grams):
            raise KernelError("TfIdfVectorizer: ngram_indexes has fewer entries than the pool has n-grams")
        gram_id += len(grams)
        if min_len <= n <= max_len and len(grams):
            out.append((n, grams, cols))
    return out


@register("TfIdfVectorizer", since=9, dtypes=INT_TYPES)
def tfidf_vectorizer(
    x: np.ndarray,
    *,
    max_gram_length: int,
    max_skip_count: int,
    min_gram_length: int,
    mode: str,
    ngram_counts: tuple[int, ...],
    ngram_indexes: tuple[int, ...],
    pool_int64s: tuple[int, ...] | None = None,
    pool_strings: tuple[str, ...] | None = None,
    weights: tuple[float, ...] | None = None,
) -> np.ndarray:
    if mode not in _MODES:
        raise KernelError(f"TfIdfVectorizer: mode must be one of {', '.join(_MODES)}; got {mode!r}")
    if pool_int64s is None:
        raise KernelError("TfIdfVectorizer: only pool_int64s is supported (string tensors have no numpy kernel)")
    if not 1 <= min_gram_length <= max_gram_length or max_skip_count < 0:
        raise KernelError(
            f"TfIdfVectorizer: need 1 <= min_gram_length <= max_gram_length and max_skip_count >= 0; "
            f"got {min_gram_length}, {max_gram_length}, {max_skip_count}"
        )
    if x.ndim not in (1, 2):
        raise KernelError(f"TfIdfVectorizer: input must be [C] or [B, C], got shape {x.shape}")
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    size = max(ngram_indexes) + 1 if ngram_indexes else 0
    counts = np.zeros((rows.shape[0], size), dtype=np.int64)
    pool = np.asarray(pool_int64s, dtype=np.int64)
    length = rows.shape[1]
    for n, grams, cols in _pool(pool, ngram_counts, ngram_indexes, min_gram_length, max_gram_length):
        for skip in range(1, (2 if n == 1 else max_skip_count + 2)):
            span = (n - 1) * skip
            if span >= length:
                break
            starts = np.arange(length - span)
            windows = rows[:, starts[:, None] + skip * np.arange(n)]  # (B, W, n)
            hits = (windows[:, :, None, :] == grams[None, None, :, :]).all(axis=-1).sum(axis=1)  # (B, P)
            np.add.at(counts, (slice(None), cols), hits)
    if mode == "TF":
        out = counts.astype(np.float32)
    else:
        w = np.ones(size, dtype=np.float32) if not weights else np.asarray(weights, dtype=np.float32)
        out = (counts > 0) * w if mode == "IDF" else counts * w
    out = out.astype(np.float32, copy=False)
    return out[0] if x.ndim == 1 else out
