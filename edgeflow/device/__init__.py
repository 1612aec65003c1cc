"""edgeflow.device (in progress)."""
