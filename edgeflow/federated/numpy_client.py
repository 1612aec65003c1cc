"""Bring your own training loop: the :class:`NumPyClient` seam (after Flower's ``NumPyClient``).

edgeflow's own :class:`~edgeflow.federated.Client` trains an ONNX model with
:class:`edgeflow.train.Trainer`. Give it ``app=`` instead and it calls your
code: PyTorch, JAX, scikit-learn or plain numpy. edgeflow still does the rest
of a round - the signed model and announcement, the update's codec, its
signature, the deadline, secure aggregation - over MQTT::

    class MyClient(edgeflow.NumPyClient):
        def fit(self, parameters, config):          # parameters: name -> np.ndarray
            ...train from parameters on local data...
            return new_parameters, num_examples, {"loss": loss}

        def evaluate(self, parameters, config):     # optional
            return loss, num_examples, {"accuracy": acc}

    edgeflow.Client(transport, fleet=..., device_id=..., signer=..., fleet_key=..., app=MyClient()).start()

``parameters`` are the gateway's global weights (the float initializers of its
ONNX model, by name); ``fit`` returns weights with the same names and shapes.
``config`` is the round's :class:`~edgeflow.protocol.rounds.TrainConfig` as a
dict (``epochs``, ``batch_size``, ``lr``, ...) plus ``round_id`` and
``model_version``. ``evaluate``, when the subclass defines it, runs on the
global model before each local training; its loss, example count and metrics
travel to the gateway in the update's metadata (``eval``). Metrics are numbers,
true/false or short text (:func:`clean_metrics`). A worked PyTorch example:
docs/training.md, "Your own training loop". A Flower-shaped client (parameters as a
list, no subclassing) is wrapped by :class:`edgeflow.federated.app.ListClient`
(``edgeflow simulate --app`` / ``edgeflow device --app``, docs/flower.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import EdgeflowError

__all__ = ["Metrics", "NumPyClient", "Parameters", "check_fit", "check_evaluate", "clean_metrics"]

Parameters = dict[str, np.ndarray]
Metrics = dict[str, "float | int | bool | str"]

MAX_METRICS = 16


class NumPyClient:
    """Subclass and implement :meth:`fit` (and, if you like, :meth:`evaluate` and :meth:`get_parameters`)."""

    def get_parameters(self, config: Mapping[str, Any]) -> Parameters | None:
        """The local model's weights (name -> array), or None. When given, a global model that does not
        fit them (other names or shapes) is refused before any round, with the reason in the client's state."""
        return None

    def fit(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[Parameters, int, Metrics]:
        """Train from ``parameters`` on local data: (new parameters, number of examples used, metrics)."""
        raise NotImplementedError(f"{type(self).__name__} must implement fit(parameters, config)")

    def evaluate(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[float, int, Metrics]:
        """Evaluate ``parameters`` on local data: (loss, number of examples, metrics)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement evaluate(parameters, config)")

    @property
    def evaluates(self) -> bool:
        """Whether the subclass defines :meth:`evaluate`."""
        return type(self).evaluate is not NumPyClient.evaluate


def _count(n: Any, who: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or int(n) < 1:
        raise EdgeflowError(f"{who} returned num_examples={n!r}; it must be an integer >= 1 "
                            "(the number of local examples, FedAvg's weight)")
    return int(n)


MAX_TEXT = 256
"""A text metric's longest value, in characters."""


def clean_metrics(metrics: Any, who: str) -> Metrics:
    """At most 16 metrics by string name (what fits an update's metadata): finite numbers, true/false, or
    printable text of at most :data:`MAX_TEXT` characters, as Flower's ``Scalar`` (bytes are not sent)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise EdgeflowError(f"{who} returned metrics of type {type(metrics).__name__}; return a dict name -> value")
    out: Metrics = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or not 0 < len(k) <= 64 or not k.isprintable():
            raise EdgeflowError(f"{who} returned a metric named {k!r}; names are 1-64 printable characters")
        if isinstance(v, (bool, np.bool_)):
            out[k] = bool(v)
        elif isinstance(v, str):
            if len(v) > MAX_TEXT or not v.isprintable():
                raise EdgeflowError(f"{who} returned metric {k!r} = {v[:40]!r}...; text metrics are at most "
                                    f"{MAX_TEXT} printable characters")
            out[k] = v
        elif isinstance(v, (int, np.integer)):
            out[k] = int(v)
        elif isinstance(v, (float, np.floating)) and math.isfinite(v):
            out[k] = float(v)
        else:
            raise EdgeflowError(f"{who} returned metric {k!r} = {v!r}; a metric is a finite number, true/false or "
                                f"text (of at most {MAX_TEXT} characters)")
    if len(out) > MAX_METRICS:
        raise EdgeflowError(f"{who} returned {len(out)} metrics; at most {MAX_METRICS} travel with an update")
    return out


def check_fit(result: Any, given: Mapping[str, np.ndarray], who: str) -> tuple[Parameters, int, Metrics]:
    """``fit``'s result checked against the parameters it was given: one clear EdgeflowError if not."""
    if not isinstance(result, tuple) or len(result) != 3:
        raise EdgeflowError(f"{who} must return (parameters, num_examples, metrics), got {type(result).__name__}")
    params, n, metrics = result
    if not isinstance(params, Mapping):
        raise EdgeflowError(f"{who} returned parameters of type {type(params).__name__}; return a dict name -> array")
    if set(params) != set(given):
        missing, extra = sorted(set(given) - set(params)), sorted(set(params) - set(given))
        raise EdgeflowError(f"{who} returned other parameter names than it was given "
                            f"(missing {missing[:3]}, extra {extra[:3]})")
    out: Parameters = {}
    for name, ref in given.items():
        arr = np.asarray(params[name])
        if arr.shape != np.shape(ref):
            raise EdgeflowError(f"{who} returned {name!r} with shape {arr.shape}, it was given {np.shape(ref)}")
        if arr.dtype.kind != "f" or not np.isfinite(arr).all():
            raise EdgeflowError(f"{who} returned {name!r} with non-float or non-finite values")
        out[name] = arr.astype(np.float32, copy=False)
    return out, _count(n, who), clean_metrics(metrics, who)


def check_evaluate(result: Any, who: str) -> tuple[float, int, Metrics]:
    if not isinstance(result, tuple) or len(result) != 3:
        raise EdgeflowError(f"{who} must return (loss, num_examples, metrics), got {type(result).__name__}")
    loss, n, metrics = result
    if isinstance(loss, bool) or not isinstance(loss, (int, float, np.integer, np.floating)) or not math.isfinite(loss):
        raise EdgeflowError(f"{who} returned loss={loss!r}; it must be a finite number")
    return float(loss), _count(n, who), clean_metrics(metrics, who)
