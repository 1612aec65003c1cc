"""edgeflow.gateway: the aggregator and fleet manager service."""
