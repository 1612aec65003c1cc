"""Device profiles shipped with edgeflow: one TOML data file per board.

This package holds data only; ``edgeflow.profiles`` reads and validates it.
"""
