"""edgeflow.gateway: the aggregator and fleet manager service.

The aggregation layer (usable alone, no MQTT):

* :mod:`.aggregation` - the :class:`Aggregator` interface and :class:`AggregateResult`
* :mod:`.strategies`  - FedAvg/FedProx/FedAvgM/FedAdam/FedYogi/FedAdagrad, Median,
  TrimmedMean, Krum, MultiKrum, and :func:`make_aggregator` by name
* :mod:`.buffered`    - FedBuff-style asynchronous buffering and staleness weights
* :mod:`.privacy`     - clipping, Gaussian noise, RDP accountant (central DP)
* :mod:`.secagg` - the server of secure aggregation by pairwise masking (the protocol,
  its messages and frames: :mod:`edgeflow.protocol.secagg`, :mod:`edgeflow.protocol.secagg_wire`)

See docs/aggregation.md.
"""

from edgeflow.gateway.aggregation import AggregateResult, Aggregator, Rejection
from edgeflow.gateway.strategies import available_aggregators, make_aggregator

__all__ = ["AggregateResult", "Aggregator", "Rejection", "available_aggregators", "make_aggregator"]
