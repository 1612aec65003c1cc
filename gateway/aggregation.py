"""The aggregator interface: begin a round, fold in updates one at a time, finish.

Every strategy in :mod:`edgeflow.gateway.strategies` implements
:class:`Aggregator`. The orchestrator (MQTT rounds, written on top of this)
drives it as::

    agg = make_aggregator("fedavg")
    agg.begin_round(global_weights, round_id=7)
    for update in arriving_updates:              # as each one is decoded
        agg.add(update.tensors, update.num_samples, client_id=update.device_id)
    result = agg.finish()                        # AggregateResult
    publish(result.weights)

**Updates are deltas**: ``update[name] = w_local[name] - w_global[name]``.
Deltas are what the codecs compress (top-k, int8 work far better on a small,
centred delta than on weights), what clipping and secure aggregation bound,
and what server optimizers treat as a (negative) pseudo-gradient. The result
carries both the applied step (``delta``) and, when the round began with
global weights, the new weights ``global + delta``.

**Streaming**: :meth:`Aggregator.add` must be called as each update arrives;
the caller may drop (or reuse) the arrays as soon as it returns. Mean-type
strategies keep O(parameters) memory whatever the number of clients; robust
ones (median, trimmed mean, Krum) must keep every update until ``finish`` and
say so with ``holds_updates = True``.

**Validation** happens before any state changes, so an update that raises
leaves the round exactly as it was and the orchestrator can go on:

* names, shapes or dtypes that differ from the round's schema (the global
  weights, or the first update when the round began without them) raise
  :class:`~edgeflow.errors.AggregationError` naming the client and tensor -
  that is a bug or an attack, not noise;
* NaN/Inf values, a second update from the same client, or a staleness weight
  of zero are *rejected*: counted in ``AggregateResult.rejected`` and the
  metrics, not fatal to the round (one broken device must not stall a fleet).
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from edgeflow.errors import AggregationError, StateError
from edgeflow.gateway.aggregate import Weights, iter_chunks  # noqa: F401 - iter_chunks re-exported

__all__ = [
    "AggregateResult",
    "decode_state",
    "encode_state",
    "Aggregator",
    "Rejection",
    "Schema",
    "ServerOptimizer",
    "TensorSpec",
    "Weights",
]



@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype that every update must match for one tensor."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


class Schema:
    """The ordered tensor layout of a round, and the checks against it.

    Order is the global weights' (or first update's) key order, so flattened
    vectors (robust strategies, secure aggregation) are laid out the same on
    every client and on the server.
    """

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        if not specs:
            raise AggregationError("a round needs at least one tensor; the weights given are empty")
        self.specs: dict[str, TensorSpec] = dict(specs)
        self.names: tuple[str, ...] = tuple(self.specs)
        offsets, pos = {}, 0
        for name, spec in self.specs.items():
            offsets[name] = (pos, pos + spec.size)
            pos += spec.size
        self.offsets: dict[str, tuple[int, int]] = offsets
        self.size: int = pos

    @classmethod
    def of(cls, weights: Weights, *, what: str = "global weights") -> Schema:
        """The schema of ``weights``; every tensor must be a floating-point array."""
        if not isinstance(weights, Mapping):
            raise AggregationError(f"{what} must be a mapping of name -> ndarray, got {type(weights).__name__}")
        specs = {}
        for name, arr in weights.items():
            if not isinstance(name, str):
                raise AggregationError(f"{what}: tensor names must be str, got {name!r}")
            if not isinstance(arr, np.ndarray):
                raise AggregationError(f"{what}: tensor {name!r} is a {type(arr).__name__}, expected numpy.ndarray")
            if not np.issubdtype(arr.dtype, np.floating):
                raise AggregationError(
                    f"{what}: tensor {name!r} has dtype {arr.dtype}; only floating-point tensors aggregate "
                    "(leave integer buffers such as BatchNorm counters out of the round)"
                )
            specs[name] = TensorSpec(tuple(int(d) for d in arr.shape), arr.dtype)
        return cls(specs)

    def check(self, update: Weights, client_id: str) -> None:
        """Raise AggregationError naming client and tensor on any layout mismatch."""
        who = f"client {client_id!r}" if client_id else "an unnamed client"
        if not isinstance(update, Mapping):
            raise AggregationError(f"{who}: update must be a mapping of name -> ndarray, got {type(update).__name__}")
        missing = [n for n in self.names if n not in update]
        if missing:
            raise AggregationError(f"{who}: update lacks tensor {missing[0]!r}" + (
                f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        if len(update) != len(self.names):
            extra = sorted(str(n) for n in update if n not in self.specs)
            raise AggregationError(f"{who}: update has unexpected tensor {extra[0]!r} not in the global model")
        for name, spec in self.specs.items():
            arr = update[name]
            if not isinstance(arr, np.ndarray):
                raise AggregationError(f"{who}: tensor {name!r} is a {type(arr).__name__}, expected numpy.ndarray")
            if arr.shape != spec.shape:
                raise AggregationError(f"{who}: tensor {name!r} has shape {arr.shape}, expected {spec.shape}")
            if arr.dtype != spec.dtype:
                raise AggregationError(f"{who}: tensor {name!r} has dtype {arr.dtype}, expected {spec.dtype}")

    def zeros(self, dtype: type = np.float64) -> dict[str, np.ndarray]:
        return {n: np.zeros(s.shape, dtype=dtype) for n, s in self.specs.items()}

    def flatten(self, update: Weights, dtype: np.dtype | type | None = None, out: np.ndarray | None = None,
                scale: float = 1.0) -> np.ndarray:
        """One 1-D copy of ``update`` in schema order (optionally scaled)."""
        if out is None:
            out = np.empty(self.size, dtype=dtype or self.specs[self.names[0]].dtype)
        for name in self.names:
            a, b = self.offsets[name]
            if scale == 1.0:
                out[a:b] = np.asarray(update[name]).reshape(-1)
            else:
                np.multiply(np.asarray(update[name]).reshape(-1), scale, out=out[a:b], casting="unsafe")
        return out

    def unflatten(self, vec: np.ndarray) -> dict[str, np.ndarray]:
        """Views of ``vec`` shaped as each tensor (no copy)."""
        if vec.shape != (self.size,):
            raise AggregationError(f"flat vector has shape {vec.shape}, expected ({self.size},)")
        return {n: vec[a:b].reshape(self.specs[n].shape) for n, (a, b) in self.offsets.items()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and self.specs == other.specs

    def __hash__(self) -> int:  # pragma: no cover - schemas are not used as keys
        return hash(tuple(self.specs.items()))


@dataclass(frozen=True)
class Rejection:
    """An update that was counted but not aggregated, and why."""

    client_id: str
    reason: str  # "non_finite" | "duplicate" | "zero_weight" | "stale" | ...
    detail: str = ""


@dataclass(frozen=True)
class AggregateResult:
    """What a finished round produced.

    ``delta`` is the step the server applied (new global - old global), in
    the schema's dtypes; ``weights`` is ``global + delta`` (computed in
    float64, then cast) or None when the round began without global weights.
    """

    round_id: int
    delta: dict[str, np.ndarray]
    weights: dict[str, np.ndarray] | None
    num_clients: int
    total_samples: int
    rejected: tuple[Rejection, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    client_ids: tuple[str, ...] = ()
    """Accepted clients in arrival order (empty names included as "")."""


class ServerOptimizer(Protocol):
    """Turns the round's aggregated delta into the step applied to the weights.

    State (momentum, Adam moments) lives in the optimizer and persists across
    rounds; see :mod:`edgeflow.gateway.strategies` for FedAvgM/FedAdam/....
    """

    def step(self, delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def reset(self) -> None: ...


def check_num_samples(num_samples: object, client_id: str) -> int:
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or int(num_samples) < 1:
        who = f"client {client_id!r}" if client_id else "an unnamed client"
        raise AggregationError(f"{who}: num_samples must be an integer >= 1, got {num_samples!r}")
    return int(num_samples)


def all_finite(arr: np.ndarray) -> bool:
    """True when ``arr`` holds no NaN or Inf.

    For float32/float64 one read-only sum decides (NaN and Inf propagate
    through it), ~1.4x faster than ``isfinite().all()``, which also writes a
    mask. The price: a float32 tensor whose sum overflows (values around
    1e32 and up) counts as non-finite too; no real delta comes near.
    """
    if arr.dtype == np.float32 or arr.dtype == np.float64:
        return bool(np.isfinite(np.einsum("i->", arr.reshape(-1))))
    return bool(np.isfinite(arr).all())


def _constant_staleness(staleness: int) -> float:
    return 1.0


class Aggregator(ABC):
    """Base of every strategy: round bookkeeping, validation and rejection.

    Subclasses implement ``_start`` (allocate per-round state), ``_fold``
    (take in one validated, finite update) and ``_reduce`` (the aggregated
    delta in float64, plus metrics). An optional server optimizer then turns
    that delta into the applied step.

    ``staleness_fn`` maps an update's staleness (model versions it lags
    behind, see :mod:`edgeflow.gateway.buffered`) to a weight factor in
    [0, 1]; the default ignores staleness, which is right for synchronous
    rounds where it is always 0.

    ``check_finite`` (default on) scans every update for NaN/Inf, one read
    of the update (~0.2 ms per 1M float32 parameters, a third of FedAvg's
    fold). :func:`edgeflow.codecs.decode_update` already refuses non-finite
    tensors, so an orchestrator that feeds only decoded updates may turn it
    off; a NaN that got through would then poison the round.
    """

    name: ClassVar[str] = ""
    holds_updates: ClassVar[bool] = False
    """True when memory grows with the number of clients (robust strategies)."""

    def __init__(self, *, server_optimizer: ServerOptimizer | None = None,
                 staleness_fn: Callable[[int], float] | None = None, check_finite: bool = True) -> None:
        self.server_optimizer = server_optimizer
        self.check_finite = bool(check_finite)
        self.staleness_fn: Callable[[int], float] = staleness_fn or _constant_staleness
        self._open = False
        self._round_id = -1
        self._pending_scale = 1.0
        self._schema: Schema | None = None
        self._global: dict[str, np.ndarray] | None = None
        self._reset_round_counters()

    # ---- round lifecycle -------------------------------------------------

    def begin_round(self, global_weights: Weights | None, round_id: int) -> None:
        """Start a round against ``global_weights`` (or None: delta-only round).

        Without global weights the first accepted update fixes the schema and
        the result has ``weights=None``. Calling this while a round is open
        abandons that round (its updates are dropped).
        """
        if isinstance(round_id, bool) or not isinstance(round_id, (int, np.integer)):
            raise AggregationError(f"round_id must be an int, got {round_id!r}")
        if global_weights is not None:
            self._schema = Schema.of(global_weights)
            self._global = dict(global_weights)
        else:
            self._schema = None
            self._global = None
        self._round_id = int(round_id)
        self._pending_scale = 1.0
        self._reset_round_counters()
        self._open = True
        if self._schema is not None:
            self._start(self._schema)

    def add(self, update: Weights, num_samples: int, client_id: str = "", staleness: int = 0) -> None:
        """Fold in one client's delta. Raises on layout errors; rejects bad values.

        ``num_samples`` (>= 1) is the client's local example count, the
        FedAvg weight. ``staleness`` (>= 0) is how many global versions the
        client's base model lags (0 in synchronous rounds).
        """
        self._require_open("add")
        n = check_num_samples(num_samples, client_id)
        if isinstance(staleness, bool) or not isinstance(staleness, (int, np.integer)) or staleness < 0:
            raise AggregationError(f"client {client_id!r}: staleness must be an int >= 0, got {staleness!r}")
        if self._schema is None:
            schema = Schema.of(update, what=f"client {client_id!r} update")
        else:
            schema = self._schema
        schema.check(update, client_id)
        if client_id and client_id in self._seen:
            self._reject(client_id, "duplicate", "a second update in the same round")
            return
        factor = float(self.staleness_fn(int(staleness)))
        if not (math.isfinite(factor) and 0.0 <= factor):
            raise AggregationError(f"staleness_fn({staleness}) returned {factor}; it must be finite and >= 0")
        if factor == 0.0:
            self._reject(client_id, "zero_weight", f"staleness {staleness} has weight 0")
            return
        first = self._schema is None
        if first:  # delta-only round: the first good update fixes the layout
            self._schema = schema
            self._start(schema)
        bad = self._fold_checked(update, n, factor, client_id)
        if bad is not None:
            if first:  # a rejected update must not fix the round's layout
                self._schema = None
                self._release()
            self._reject(client_id, "non_finite", f"tensor {bad!r} has NaN or Inf")
            return
        if client_id:
            self._seen.add(client_id)
        self._client_ids.append(client_id)
        self._num_clients += 1
        self._total_samples += n
        self._max_staleness = max(self._max_staleness, int(staleness))

    def finish(self) -> AggregateResult:
        """Close the round and return its result; the round's buffers are freed."""
        self._require_open("finish")
        if self._num_clients == 0:
            reasons = ", ".join(f"{r.client_id or '?'}: {r.reason}" for r in self._rejected[:5])
            raise AggregationError(
                f"round {self._round_id}: no update was accepted"
                + (f" ({len(self._rejected)} rejected - {reasons})" if self._rejected else "")
            )
        assert self._schema is not None
        delta64, metrics = self._reduce()
        scale = self._reduce_scale
        if self.server_optimizer is not None:
            if scale != 1.0:
                for d in delta64.values():
                    d *= scale
                scale = 1.0
            delta64 = self.server_optimizer.step(delta64)
        delta, weights, delta_norm = self._finalize(delta64, scale)
        bad = self._non_finite(delta, weights, delta_norm)
        if bad is not None:
            self._open = False
            self._global = None
            self._release()
            raise AggregationError(
                f"round {self._round_id}: the aggregate is not finite ({bad}); nothing is returned, "
                "the global model stays as it was"
            )
        metrics = {
            "num_clients": float(self._num_clients),
            "total_samples": float(self._total_samples),
            "num_rejected": float(len(self._rejected)),
            "max_staleness": float(self._max_staleness),
            "delta_norm": delta_norm,
            **metrics,
        }
        for r in self._rejected:
            key = f"rejected_{r.reason}"
            metrics[key] = metrics.get(key, 0.0) + 1.0
        result = AggregateResult(
            round_id=self._round_id,
            delta=delta,
            weights=weights,
            num_clients=self._num_clients,
            total_samples=self._total_samples,
            rejected=tuple(self._rejected),
            metrics=metrics,
            client_ids=tuple(self._client_ids),
        )
        self._open = False
        self._global = None
        self._release()
        return result

    def _finalize(self, delta64: Mapping[str, np.ndarray], scale: float
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None, float]:
        """delta = scale * delta64 cast once to the schema's dtype, weights = global + delta
        in that dtype (one rounding), and ||delta||: three passes per tensor."""
        assert self._schema is not None
        deltas: dict[str, np.ndarray] = {}
        weights: dict[str, np.ndarray] | None = {} if self._global is not None else None
        sumsq = 0.0
        for name, spec in self._schema.specs.items():
            d_out = np.empty(spec.shape, dtype=spec.dtype)
            np.multiply(delta64[name], scale, out=d_out, casting="unsafe")
            flat = d_out.reshape(-1)
            sumsq += float(np.einsum("i,i->", flat, flat))  # not BLAS: no thread pool in the hot path
            deltas[name] = d_out
            if weights is not None:
                weights[name] = np.add(self._global[name], d_out, dtype=spec.dtype)
        return deltas, weights, math.sqrt(sumsq)

    def _non_finite(self, delta: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray] | None,
                    delta_norm: float) -> str | None:
        """The last line of defence before a model is stored: which tensor of the step
        or the new weights holds NaN/Inf (one read of the weights), or None."""
        if not math.isfinite(delta_norm):
            for name, d in delta.items():
                if not bool(np.isfinite(d).all()):
                    return f"step tensor {name!r}"
            return "the step's norm overflows"
        for name, w in (weights or {}).items():
            if not all_finite(w):
                return f"new weights of tensor {name!r}"
        return None

    @property
    def _reduce_scale(self) -> float:
        """Factor ``_reduce``'s arrays still need (FedAvg defers its division to
        the final pass); 1.0 for strategies that return the finished delta."""
        return self._pending_scale

    # ---- introspection ---------------------------------------------------

    @property
    def round_open(self) -> bool:
        return self._open

    @property
    def round_id(self) -> int:
        return self._round_id

    @property
    def num_clients(self) -> int:
        """Updates accepted so far in the open round."""
        return self._num_clients

    @property
    def rejected(self) -> tuple[Rejection, ...]:
        return tuple(self._rejected)

    @property
    def schema(self) -> Schema | None:
        return self._schema

    # ---- cross-round state (a restarted gateway goes on where it stopped) -----

    def state_dict(self) -> dict[str, object]:
        """The cross-round state as plain values and numpy arrays (serialize with :func:`encode_state`):
        the strategy's name and, with a server optimizer, its state. An open round is not part of it
        (a round ends before its state is stored)."""
        out: dict[str, object] = {"strategy": type(self).__name__}
        if self.server_optimizer is not None and hasattr(self.server_optimizer, "state_dict"):
            out["server_optimizer"] = self.server_optimizer.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`'s output (from an untrusted store): checked first; a state of another
        strategy, or a damaged one, raises StateError naming the field and changes nothing."""
        if not isinstance(state, Mapping) or state.get("strategy") != type(self).__name__:
            got = state.get("strategy") if isinstance(state, Mapping) else type(state).__name__
            raise StateError(f"strategy state is of {got!r}, this gateway runs {type(self).__name__}: the "
                             "configured strategy changed since the state was written; restore the old "
                             "configuration, or start a new run with a fresh state")
        opt = state.get("server_optimizer")
        if (opt is None) != (self.server_optimizer is None or not hasattr(self.server_optimizer, "load_state_dict")):
            raise StateError("strategy state field server_optimizer: present in only one of the stored state and "
                             "the configured strategy")
        if opt is not None:
            self.server_optimizer.load_state_dict(opt)  # type: ignore[union-attr]

    def client_config(self) -> dict[str, float | int | str]:
        """Settings the orchestrator must send to clients for this strategy
        (e.g. FedProx's ``proximal_mu``); empty for most strategies."""
        return {}

    def reset(self) -> None:
        """Forget cross-round state (server optimizer moments) and any open round."""
        if self.server_optimizer is not None:
            self.server_optimizer.reset()
        self._open = False
        self._global = None
        self._release()

    # ---- subclass hooks --------------------------------------------------

    @abstractmethod
    def _start(self, schema: Schema) -> None:
        """Allocate per-round state for ``schema``."""

    @abstractmethod
    def _fold(self, update: Weights, num_samples: int, staleness_weight: float, client_id: str) -> None:
        """Take in one validated, finite update."""

    def _fold_checked(self, update: Weights, num_samples: int, staleness_weight: float,
                      client_id: str) -> str | None:
        """Check for NaN/Inf (if ``check_finite``), then fold; the first bad tensor's
        name, with nothing folded, if the check fails. Strategies that can check
        while folding, without a separate read of the update, override this."""
        if self.check_finite:
            for name in self._schema.names if self._schema is not None else update:
                if not all_finite(update[name]):
                    return name
        self._fold(update, num_samples, staleness_weight, client_id)
        return None

    @abstractmethod
    def _reduce(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The aggregated delta (float64 arrays, schema shapes) and metrics."""

    def _release(self) -> None:
        """Drop per-round buffers (called when a round finishes or resets)."""

    # ---- helpers ---------------------------------------------------------

    def _reset_round_counters(self) -> None:
        self._seen: set[str] = set()
        self._client_ids: list[str] = []
        self._rejected: list[Rejection] = []
        self._num_clients = 0
        self._total_samples = 0
        self._max_staleness = 0

    def _reject(self, client_id: str, reason: str, detail: str) -> None:
        self._rejected.append(Rejection(client_id, reason, detail))

    def _require_open(self, what: str) -> None:
        if not self._open:
            raise AggregationError(f"{what}() called with no open round: call begin_round() first")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(round_open={self._open}, round_id={self._round_id})"


# ---------------------------------------------------------------------------
# Cross-round state, serialized for the gateway's store
# ---------------------------------------------------------------------------

_STATE_MAGIC = "edgeflow-strategy-state/1"
_MAX_STATE_ARRAYS = 4096


def encode_state(state: Mapping[str, object]) -> bytes:
    """A strategy's :meth:`state_dict` as bytes without pickle: the structure as JSON (floats, ints,
    strings, bools, None, lists, dicts with string keys) with every numpy array replaced by a
    reference into an ``.npz`` archive written with ``allow_pickle=False``."""
    arrays: dict[str, np.ndarray] = {}

    def walk(v: object) -> object:
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in "fiub":
                raise StateError(f"state array of dtype {v.dtype} cannot be stored (numbers only)")
            key = f"a{len(arrays)}"
            arrays[key] = np.ascontiguousarray(v)
            return {"__array__": key}
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, Mapping):
            out = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise StateError(f"state keys must be strings, got {k!r}")
                out[k] = walk(x)
            return out
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise StateError(f"a {type(v).__name__} cannot be stored in a strategy state")

    doc = json.dumps({"format": _STATE_MAGIC, "state": walk(state)}, allow_nan=False)
    buf = io.BytesIO()
    np.savez(buf, __json__=np.frombuffer(doc.encode("utf-8"), dtype=np.uint8), **arrays)
    return buf.getvalue()


def decode_state(blob: bytes) -> dict[str, object]:
    """The inverse of :func:`encode_state`; a damaged or hostile blob raises StateError naming what is wrong
    (the strategy's ``load_state_dict`` then validates the values themselves)."""
    try:
        with np.load(io.BytesIO(bytes(blob)), allow_pickle=False) as z:
            if "__json__" not in z.files or len(z.files) > _MAX_STATE_ARRAYS + 1:
                raise StateError("strategy state is not an edgeflow strategy state")
            doc = json.loads(bytes(z["__json__"]).decode("utf-8"))
            arrays = {k: z[k] for k in z.files if k != "__json__"}
    except StateError:
        raise
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise StateError(f"strategy state is damaged ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != _STATE_MAGIC:
        raise StateError(f"strategy state has format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                         f"expected {_STATE_MAGIC!r}")

    def walk(v: object) -> object:
        if isinstance(v, dict):
            if set(v) == {"__array__"}:
                key = v["__array__"]
                if key not in arrays:
                    raise StateError(f"strategy state refers to a missing array {key!r}")
                return arrays[key]
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    state = walk(doc.get("state"))
    if not isinstance(state, dict):
        raise StateError("strategy state is not a mapping")
    return state
