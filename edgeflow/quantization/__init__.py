"""edgeflow.quantization (in progress)."""
