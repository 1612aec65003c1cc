"""edgeflow.train (in progress)."""
