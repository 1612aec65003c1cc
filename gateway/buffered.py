"""Asynchronous buffered aggregation (FedBuff) and staleness weighting.

In asynchronous FL a device trains on whatever global version it last
received and reports whenever it is done; waiting for the slowest device of a
synchronous round is what FedBuff (Nguyen et al., AISTATS 2022) avoids. The
server buffers updates and, every ``buffer_size`` (K) of them, applies

    w <- w + eta_g * server_step( sum_i n_i s(tau_i) d_i / sum_i n_i )

where tau_i = current version - the version client i trained from (its
*staleness*) and s is a decreasing weight (FedAsync, Xie et al. 2019):

* ``constant``:     s = 1
* ``polynomial``:   s = (1 + tau)^-a            (FedBuff uses a = 0.5)
* ``hinge``:        s = 1 if tau <= b else 1 / (a (tau - b) + 1)
* ``exponential``:  s = exp(-a tau)

``eta_g`` is ``server_lr`` (FedBuff's server learning rate; 1 here, 1.3 in the
gateway's async sessions, ``[rounds] async_server_lr``): stale updates shrink
the step (s < 1), and on the digits benchmark (benchmarks/fedbuff.py) a buffer
of 15 of 20 devices with eta_g = 1.3 ends where synchronous rounds do.

:class:`BufferedAggregator` wraps any :class:`~edgeflow.gateway.aggregation.Aggregator`
(FedAvg by default; FedAdam & co. give FedBuff with a server optimizer): each
buffer is one inner "round" whose id is the version it produces. Memory is the
inner aggregator's (O(P) for the mean family) - the buffer is the running
sum, not a list of updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgeflow.errors import AggregationError, ConfigError
from edgeflow.gateway.aggregation import AggregateResult, Aggregator, Rejection, Weights

__all__ = [
    "BufferedAggregator",
    "StalenessFn",
    "available_staleness",
    "constant_staleness",
    "exponential_staleness",
    "hinge_staleness",
    "make_staleness",
    "polynomial_staleness",
]

StalenessFn = Callable[[int], float]


@dataclass(frozen=True)
class _Constant:
    def __call__(self, staleness: int) -> float:
        return 1.0


@dataclass(frozen=True)
class _Polynomial:
    a: float

    def __call__(self, staleness: int) -> float:
        return float((1.0 + staleness) ** (-self.a))


@dataclass(frozen=True)
class _Hinge:
    a: float
    b: int

    def __call__(self, staleness: int) -> float:
        return 1.0 if staleness <= self.b else 1.0 / (self.a * (staleness - self.b) + 1.0)


@dataclass(frozen=True)
class _Exponential:
    a: float

    def __call__(self, staleness: int) -> float:
        return math.exp(-self.a * staleness)


def constant_staleness() -> StalenessFn:
    """s(tau) = 1: staleness ignored."""
    return _Constant()


def polynomial_staleness(a: float = 0.5) -> StalenessFn:
    """s(tau) = (1 + tau)^-a; FedBuff's default is a = 0.5."""
    if not (math.isfinite(a) and a >= 0):
        raise ConfigError(f"polynomial staleness exponent a must be >= 0, got {a}")
    return _Polynomial(float(a))


def hinge_staleness(a: float = 10.0, b: int = 4) -> StalenessFn:
    """s(tau) = 1 up to ``b`` versions behind, then 1 / (a (tau - b) + 1)."""
    if not (math.isfinite(a) and a >= 0) or b < 0:
        raise ConfigError(f"hinge staleness needs a >= 0 and b >= 0, got a={a}, b={b}")
    return _Hinge(float(a), int(b))


def exponential_staleness(a: float = 0.5) -> StalenessFn:
    """s(tau) = exp(-a tau)."""
    if not (math.isfinite(a) and a >= 0):
        raise ConfigError(f"exponential staleness rate a must be >= 0, got {a}")
    return _Exponential(float(a))


_STALENESS = {
    "constant": constant_staleness,
    "polynomial": polynomial_staleness,
    "hinge": hinge_staleness,
    "exponential": exponential_staleness,
}


def available_staleness() -> list[str]:
    """The staleness function names :func:`make_staleness` knows (``[rounds] staleness``)."""
    return sorted(_STALENESS)


def make_staleness(name: str, **params: float) -> StalenessFn:
    """A staleness function by name (``constant``, ``polynomial``, ``hinge``, ``exponential``)."""
    fn = _STALENESS.get(name)
    if fn is None:
        raise ConfigError(f"unknown staleness function {name!r}; available: {', '.join(sorted(_STALENESS))}")
    try:
        return fn(**params)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ConfigError(f"staleness function {name!r}: {exc}") from exc


class BufferedAggregator:
    """FedBuff: aggregate every ``buffer_size`` updates, weighting each by staleness.

    Usage by the orchestrator::

        buf = BufferedAggregator(make_aggregator("fedavg"), buffer_size=10,
                                 staleness_fn=polynomial_staleness(0.5), max_staleness=20)
        buf.start(initial_weights, version=0)
        ...
        result = buf.add(update.tensors, update.num_samples, client_id, base_version=v)
        if result is not None:      # buffer full: a new global version exists
            publish(buf.version, buf.global_weights)

    ``base_version`` is the global version the client trained from (sent
    with the model, echoed in its update). Updates more than
    ``max_staleness`` versions behind are rejected (counted in the next
    result's ``rejected``), as are those claiming a future version.
    The wrapper replaces the inner aggregator's ``staleness_fn``. ``server_lr``
    multiplies each buffer's step (after the inner aggregator's server optimizer).

    One update per device per buffer: a second update from a client already
    in the current buffer is refused (reason ``buffer_duplicate``, counted as
    ``rejected_buffer_duplicate`` in the result that closes the buffer)
    before the inner aggregator sees it, whatever the inner aggregator does
    with repeated client ids. It is not held for the next buffer: the device
    trains again from the version that buffer produces (an update held over
    would be stale by then, and holding them would let one device queue work
    the gateway must keep in memory).
    """

    def __init__(self, inner: Aggregator | None = None, *, buffer_size: int = 10,
                 staleness_fn: StalenessFn | None = None, max_staleness: int | None = None,
                 server_lr: float = 1.0) -> None:
        if inner is None:
            from edgeflow.gateway.strategies import FedAvg

            inner = FedAvg()
        if not isinstance(inner, Aggregator):
            raise ConfigError(f"inner must be an Aggregator, got {type(inner).__name__}")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ConfigError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ConfigError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
        if isinstance(server_lr, bool) or not isinstance(server_lr, (int, float)) \
                or not (math.isfinite(server_lr) and server_lr > 0):
            raise ConfigError(f"server_lr must be a number > 0, got {server_lr!r}")
        self.inner = inner
        self.buffer_size = buffer_size
        self.server_lr = float(server_lr)
        self.staleness_fn = staleness_fn or polynomial_staleness(0.5)
        self.max_staleness = max_staleness
        inner.staleness_fn = self.staleness_fn
        self._weights: dict[str, np.ndarray] | None = None
        self._version = -1
        self._pending_rejections: list[Rejection] = []
        self._members: set[str] = set()
        """The clients whose update is in the current buffer."""

    # ---- state -----------------------------------------------------------

    @property
    def version(self) -> int:
        """The current global model version (the one clients should train from)."""
        return self._version

    @property
    def global_weights(self) -> dict[str, np.ndarray]:
        if self._weights is None:
            raise AggregationError("BufferedAggregator.start() has not been called")
        return self._weights

    @property
    def buffered(self) -> int:
        """Updates accepted into the current buffer."""
        return self.inner.num_clients if self.inner.round_open else 0

    # ---- lifecycle -------------------------------------------------------

    def start(self, global_weights: Weights, version: int = 0) -> None:
        """Begin at ``global_weights`` as version ``version``."""
        self._weights = {k: np.array(v, copy=True) for k, v in global_weights.items()}
        self._version = int(version)
        self._pending_rejections = []
        self._members = set()
        self.inner.begin_round(self._weights, round_id=self._version + 1)

    def add(self, update: Weights, num_samples: int, client_id: str = "", *,
            base_version: int) -> AggregateResult | None:
        """Buffer one update; returns the aggregate when the buffer fills, else None."""
        if self._weights is None:
            raise AggregationError("BufferedAggregator.start() must be called before add()")
        if isinstance(base_version, bool) or not isinstance(base_version, (int, np.integer)):
            raise AggregationError(f"client {client_id!r}: base_version must be an int, got {base_version!r}")
        if client_id and client_id in self._members:
            self._pending_rejections.append(Rejection(
                client_id, "buffer_duplicate",
                f"already has an update in the buffer for v{self._version + 1} (one update per device per buffer)"))
            return None
        staleness = self._version - int(base_version)
        if staleness < 0:
            self._pending_rejections.append(
                Rejection(client_id, "future_version", f"trained from v{base_version}, current is v{self._version}"))
            return None
        if self.max_staleness is not None and staleness > self.max_staleness:
            self._pending_rejections.append(
                Rejection(client_id, "stale", f"{staleness} versions behind (max {self.max_staleness})"))
            return None
        before = self.inner.num_clients
        self.inner.add(update, num_samples, client_id=client_id, staleness=staleness)
        if client_id and self.inner.num_clients > before:
            self._members.add(client_id)
        if self.inner.num_clients >= self.buffer_size:
            return self._flush()
        return None

    def flush(self) -> AggregateResult | None:
        """Aggregate a partly filled buffer now (e.g. on a timer); None if it is empty."""
        if self._weights is None or not self.inner.round_open or self.inner.num_clients == 0:
            return None
        return self._flush()

    def _scaled(self, result: AggregateResult) -> AggregateResult:
        """The step times ``server_lr`` (FedBuff's eta_g), computed in float64 and cast to each tensor's dtype."""
        assert self._weights is not None and result.weights is not None
        delta, weights = {}, dict(result.weights)
        for name, step in result.delta.items():
            d = np.asarray(step, dtype=np.float64) * self.server_lr
            old = self._weights[name]
            weights[name] = (old.astype(np.float64) + d).astype(old.dtype)
            delta[name] = d.astype(np.asarray(step).dtype)
        return AggregateResult(
            round_id=result.round_id, delta=delta, weights=weights, num_clients=result.num_clients,
            total_samples=result.total_samples, rejected=result.rejected,
            metrics={**result.metrics, "server_lr": self.server_lr}, client_ids=result.client_ids)

    def _flush(self) -> AggregateResult:
        result = self.inner.finish()
        if self._pending_rejections:
            extra = tuple(self._pending_rejections)
            metrics = dict(result.metrics)
            for r in extra:
                key = f"rejected_{r.reason}"
                metrics[key] = metrics.get(key, 0.0) + 1.0
            metrics["num_rejected"] = metrics.get("num_rejected", 0.0) + len(extra)
            result = AggregateResult(
                round_id=result.round_id, delta=result.delta, weights=result.weights,
                num_clients=result.num_clients, total_samples=result.total_samples,
                rejected=result.rejected + extra, metrics=metrics, client_ids=result.client_ids,
            )
            self._pending_rejections = []
        assert result.weights is not None
        if self.server_lr != 1.0:
            result = self._scaled(result)
        self._weights = result.weights
        self._version += 1
        self._members = set()
        self.inner.begin_round(self._weights, round_id=self._version + 1)
        return result
