"""A custom aggregation strategy for gateway.toml (docs/flower.md, "Custom strategies"):

    [rounds]
    strategy = "strategy.py:TrimmedFedAvg"        # a file next to gateway.toml, or "my_module:TrimmedFedAvg"
    strategy_params = { proportion = 0.1 }

Built from a robust strategy's bookkeeping (it holds each round's updates) and the pure function
``trimmed_mean`` of edgeflow.gateway.aggregate. Metrics whose names start with ``strategy_`` go into
each round's record (``edgeflow rounds --json``).
"""

from edgeflow.gateway.aggregate import trimmed_mean
from edgeflow.gateway.strategies import Median


class TrimmedFedAvg(Median):
    """Coordinate-wise mean after dropping the ``proportion`` largest and smallest values."""

    def __init__(self, proportion: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.proportion = float(proportion)

    def _reduce(self):
        # self._held: one flat update per client; _coordinatewise applies fn ((n, c) -> (c,)) chunk by chunk
        flat = self._coordinatewise(lambda stack: trimmed_mean(stack, self.proportion))
        return self._as_tensors(flat), {"strategy_trimmed_per_side": float(int(self.proportion * len(self._held)))}
