"""Losses: the trainer's, under the private domain ``edgeflow.train``, and
ONNX's NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (standard
domain, at the end of this file).

The trainer's losses are kernels like any other (forward + backward beside
it), so the finite-difference tests and the trainer treat them uniformly,
but they never appear in a deployed ONNX graph: the trainer applies the loss
to the model's output outside the graph.

- ``SoftmaxCrossEntropy(logits (N, C), labels)``: labels are class indices
  (N,) or per-class target probabilities (N, C); optional label smoothing.
- ``MeanSquaredError(pred, target)``.
- ``BinaryCrossEntropy(x, target)``: on logits by default (stable form,
  ``from_logits=1``) or on probabilities (``from_logits=0``, clipped).

Every trainer loss returns the mean over all elements (``reduction="mean"``)
or the sum (``"sum"``) as a 0-d array of the input's dtype. The ONNX losses
also take ``reduction="none"``, class ``weight``s and an ``ignore_index``.
"""

from __future__ import annotations

import numpy as np

from .registry import FLOAT_TYPES, KernelError, register

DOMAIN = "edgeflow.train"
_REDUCTIONS = ("mean", "sum")


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _log_softmax_rows(z: np.ndarray) -> np.ndarray:
    s = z - z.max(axis=1, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=1, keepdims=True))


def _targets(labels: np.ndarray, n: int, c: int, dtype, label_smoothing: float) -> np.ndarray | None:
    """Dense (N, C) targets, or None for plain integer labels (the fast path)."""
    if np.issubdtype(labels.dtype, np.integer):
        if labels.shape != (n,):
            raise ValueError(f"class labels must have shape ({n},), got {labels.shape}")
        if label_smoothing == 0.0:
            return None
        t = np.full((n, c), label_smoothing / c, dtype=dtype)
        t[np.arange(n), labels] += 1.0 - label_smoothing
        return t
    if labels.shape != (n, c):
        raise ValueError(f"target probabilities must have shape ({n}, {c}), got {labels.shape}")
    t = labels.astype(dtype, copy=False)
    if label_smoothing:
        t = t * (1.0 - label_smoothing) + label_smoothing / c
    return t


def _check_logits(logits: np.ndarray) -> None:
    if logits.ndim != 2:
        raise ValueError(f"SoftmaxCrossEntropy expects logits (N, C), got shape {logits.shape}")


@register("SoftmaxCrossEntropy", domain=DOMAIN, dtypes=FLOAT_TYPES)
def softmax_cross_entropy(
    logits: np.ndarray, labels: np.ndarray, *, reduction: str = "mean", label_smoothing: float = 0.0
) -> np.ndarray:
    _check_logits(logits)
    _check_reduction(reduction)
    n, c = logits.shape
    logp = _log_softmax_rows(logits)
    t = _targets(labels, n, c, logits.dtype, label_smoothing)
    if t is None:
        total = -logp[np.arange(n), labels].sum()
    else:
        total = -(t * logp).sum()
    out = total / n if reduction == "mean" else total
    return np.asarray(out, dtype=logits.dtype)


@softmax_cross_entropy.backward(uses="inputs")
def _(grads, inputs, outputs, *, reduction="mean", label_smoothing=0.0):
    dl = grads[0]
    logits, labels = inputs[0], inputs[1]
    if dl is None:
        return (None, None)
    n, c = logits.shape
    p = np.exp(_log_softmax_rows(logits))
    t = _targets(labels, n, c, logits.dtype, label_smoothing)
    if t is None:
        p[np.arange(n), labels] -= 1
    else:
        # d/dz of -sum_c t_c log p_c is p * sum_c t_c - t (rows need not sum to 1)
        p *= t.sum(axis=1, keepdims=True)
        p -= t
    scale = float(np.asarray(dl)) / (n if reduction == "mean" else 1)
    p *= logits.dtype.type(scale)
    return (p, None)


@register("MeanSquaredError", domain=DOMAIN, dtypes=FLOAT_TYPES)
def mean_squared_error(pred: np.ndarray, target: np.ndarray, *, reduction: str = "mean") -> np.ndarray:
    _check_reduction(reduction)
    if pred.shape != target.shape:
        raise ValueError(f"MeanSquaredError: prediction {pred.shape} and target {target.shape} differ")
    d = pred - target.astype(pred.dtype, copy=False)
    total = np.dot(d.ravel(), d.ravel())
    out = total / d.size if reduction == "mean" else total
    return np.asarray(out, dtype=pred.dtype)


@mean_squared_error.backward(uses="inputs")
def _(grads, inputs, outputs, *, reduction="mean"):
    dl = grads[0]
    pred, target = inputs[0], inputs[1]
    if dl is None:
        return (None, None)
    d = pred - target.astype(pred.dtype, copy=False)
    scale = 2.0 * float(np.asarray(dl)) / (d.size if reduction == "mean" else 1)
    return (d * pred.dtype.type(scale), None)


def _bce_probs_eps(dtype) -> float:
    return 1e-7 if np.dtype(dtype) != np.float64 else 1e-12


@register("BinaryCrossEntropy", domain=DOMAIN, dtypes=FLOAT_TYPES)
def binary_cross_entropy(
    x: np.ndarray, target: np.ndarray, *, from_logits: int = 1, reduction: str = "mean"
) -> np.ndarray:
    _check_reduction(reduction)
    if x.shape != target.shape:
        raise ValueError(f"BinaryCrossEntropy: input {x.shape} and target {target.shape} differ")
    t = target.astype(x.dtype, copy=False)
    if from_logits:
        # max(z, 0) - z t + log(1 + exp(-|z|)): never overflows
        per = np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))
    else:
        eps = _bce_probs_eps(x.dtype)
        p = np.clip(x, eps, 1 - eps)
        per = -(t * np.log(p) + (1 - t) * np.log1p(-p))
    total = per.sum()
    out = total / x.size if reduction == "mean" else total
    return np.asarray(out, dtype=x.dtype)


@binary_cross_entropy.backward(uses="inputs")
def _(grads, inputs, outputs, *, from_logits=1, reduction="mean"):
    dl = grads[0]
    x, target = inputs[0], inputs[1]
    if dl is None:
        return (None, None)
    t = target.astype(x.dtype, copy=False)
    if from_logits:
        e = np.exp(-np.abs(x))
        sig = np.where(x >= 0, 1 / (1 + e), e / (1 + e))
        g = sig - t
    else:
        eps = _bce_probs_eps(x.dtype)
        p = np.clip(x, eps, 1 - eps)
        g = (p - t) / (p * (1 - p))
        g = np.where((x > eps) & (x < 1 - eps), g, 0)  # clip has zero slope outside
    scale = float(np.asarray(dl)) / (x.size if reduction == "mean" else 1)
    return ((g * scale).astype(x.dtype, copy=False), None)


# -- the ONNX standard-domain losses (opset 12 on) --------------------------------------------

_ONNX_REDUCTIONS = ("none", "sum", "mean")


def _nll(logp: np.ndarray, target: np.ndarray, weight, reduction: str, ignore_index, op: str) -> np.ndarray:
    """-logp[n, target[n, d...], d...] * weight[target], reduced.

    ``mean`` divides by the summed weights of the non-ignored targets (their
    count when there are no weights), as ONNX and PyTorch do.
    """
    if reduction not in _ONNX_REDUCTIONS:
        raise KernelError(f"{op}: reduction must be one of {', '.join(_ONNX_REDUCTIONS)}; got {reduction!r}")
    if logp.ndim < 2:
        raise KernelError(f"{op}: input must be (N, C) or (N, C, d1, ...), got shape {logp.shape}")
    n, c = logp.shape[:2]
    want = (n,) + logp.shape[2:]
    if target.shape != want:
        raise KernelError(f"{op}: target shape {target.shape} must be {want} for an input of shape {logp.shape}")
    t = target.astype(np.int64, copy=False)
    valid = np.ones(t.shape, dtype=bool) if ignore_index is None else t != int(ignore_index)
    tc = np.where(valid, t, 0)
    if tc.size and (tc.min() < 0 or tc.max() >= c):
        bad = int(tc[(tc < 0) | (tc >= c)][0])
        raise KernelError(f"{op}: target class {bad} is out of range [0, {c}) (and not the ignore_index)")
    picked = np.take_along_axis(logp, tc[:, None], axis=1)[:, 0]
    if weight is not None:
        if weight.shape != (c,):
            raise KernelError(f"{op}: weight must have shape ({c},), got {weight.shape}")
        w = weight.astype(logp.dtype, copy=False)[tc]
    else:
        w = np.ones(t.shape, dtype=logp.dtype)
    w = np.where(valid, w, logp.dtype.type(0))
    loss = -picked * w
    if reduction == "none":
        return loss.astype(logp.dtype, copy=False)
    acc = np.float32 if logp.dtype == np.float16 else logp.dtype
    total = loss.sum(dtype=acc)
    if reduction == "sum":
        return np.asarray(total, dtype=logp.dtype)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(total / w.sum(dtype=acc), dtype=logp.dtype)


@register("NegativeLogLikelihoodLoss", since=12, dtypes=FLOAT_TYPES)
def negative_log_likelihood_loss(
    x: np.ndarray,
    target: np.ndarray,
    weight: np.ndarray | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> np.ndarray:
    return _nll(x, target, weight, reduction, ignore_index, "NegativeLogLikelihoodLoss")


def _log_softmax_axis1(x: np.ndarray) -> np.ndarray:
    s = x - x.max(axis=1, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=1, keepdims=True))


@register("SoftmaxCrossEntropyLoss", since=12, dtypes=FLOAT_TYPES)
def softmax_cross_entropy_loss(
    scores: np.ndarray,
    labels: np.ndarray,
    weights: np.ndarray | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
    n_outputs: int = 1,
):
    if scores.ndim < 2:
        raise KernelError(f"SoftmaxCrossEntropyLoss: scores must be (N, C, ...), got shape {scores.shape}")
    logp = _log_softmax_axis1(scores)
    loss = _nll(logp, labels, weights, reduction, ignore_index, "SoftmaxCrossEntropyLoss")
    return (loss, logp) if n_outputs > 1 else loss


def _nll_grad(logp: np.ndarray, target: np.ndarray, weight, reduction: str, ignore_index, dy) -> np.ndarray:
    """d loss / d logp: -weight at each target class, scaled by dy (and 1/sum(w) for mean)."""
    t = target.astype(np.int64, copy=False)
    valid = np.ones(t.shape, dtype=bool) if ignore_index is None else t != int(ignore_index)
    tc = np.where(valid, t, 0)
    w = weight.astype(logp.dtype, copy=False)[tc] if weight is not None else np.ones(t.shape, dtype=logp.dtype)
    w = np.where(valid, w, logp.dtype.type(0))
    dy = np.asarray(dy, dtype=logp.dtype)
    coef = -w * dy  # dy has the loss's shape for "none", is a scalar otherwise
    if reduction == "mean":
        coef /= w.sum()
    g = np.zeros(logp.shape, dtype=logp.dtype)
    np.put_along_axis(g, tc[:, None], coef[:, None], axis=1)
    return g


@negative_log_likelihood_loss.backward(uses="inputs")
def _(grads, inputs, outputs, *, ignore_index=None, reduction="mean"):
    dy = grads[0]
    x, target = inputs[0], inputs[1]
    weight = inputs[2] if len(inputs) > 2 else None
    extra = (None,) * (len(inputs) - 1)
    if dy is None:
        return (None,) + extra
    return (_nll_grad(x, target, weight, reduction, ignore_index, dy),) + extra


@softmax_cross_entropy_loss.backward(uses="all")
def _(grads, inputs, outputs, *, ignore_index=None, reduction="mean"):
    scores, labels = inputs[0], inputs[1]
    weights = inputs[2] if len(inputs) > 2 else None
    extra = (None,) * (len(inputs) - 1)
    dloss = grads[0]
    dlogp_out = grads[1] if len(grads) > 1 else None
    if dloss is None and dlogp_out is None:
        return (None,) + extra
    logp = outputs[1] if len(outputs) > 1 and outputs[1] is not None else _log_softmax_axis1(scores)
    g = np.zeros(scores.shape, dtype=scores.dtype)
    if dloss is not None:
        g += _nll_grad(logp, labels, weights, reduction, ignore_index, dloss)
    if dlogp_out is not None:
        g += dlogp_out
    # through log_softmax: dx = g - softmax * sum_c g
    return (g - np.exp(logp) * g.sum(axis=1, keepdims=True),) + extra
