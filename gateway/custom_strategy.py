"""A user's aggregation strategy named in gateway.toml: ``[rounds] strategy = "my_module:MyStrategy"``.

``"path/to/file.py:MyStrategy"`` works too (relative paths from where the gateway runs). The class must
subclass :class:`~edgeflow.gateway.aggregation.Aggregator` - in practice FedAvg or one of the robust
strategies of :mod:`edgeflow.gateway.strategies`, overriding ``_reduce`` and building on the pure functions of
:mod:`edgeflow.gateway.aggregate` (docs/flower.md, "Custom strategies"). :func:`make_aggregator` loads it
here, so ``[rounds] strategy_params`` reach its constructor and a bad reference is one line at config check.
"""

from __future__ import annotations

from edgeflow.errors import ConfigError
from edgeflow.federated.app import load_reference

from .aggregation import Aggregator

__all__ = ["load_strategy"]


def load_strategy(ref: str) -> type[Aggregator]:
    """The Aggregator subclass ``ref`` names; ConfigError naming the key and what is wrong (module not found,
    attribute missing, not an Aggregator)."""
    cls = load_reference(ref, "rounds.strategy")
    if not (isinstance(cls, type) and issubclass(cls, Aggregator)):
        what = cls.__name__ if isinstance(cls, type) else type(cls).__name__ + " object"
        raise ConfigError(f"rounds.strategy {ref!r}: {what} is not an Aggregator; subclass "
                          "edgeflow.gateway.strategies.FedAvg (or another strategy) and name the class (docs/flower.md)")
    return cls
