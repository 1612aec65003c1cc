"""edgeflow.federated (in progress)."""
