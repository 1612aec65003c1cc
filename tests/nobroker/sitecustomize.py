"""Applies tests/nobroker/_nobroker.py's rules in subprocesses of a ``-p _nobroker`` run."""

import os

os.environ["EDGEFLOW_NOBROKER_SUBPROCESS"] = "1"
try:
    import _nobroker  # noqa: F401
except ImportError:  # edgeflow not importable in this interpreter: nothing to patch
    pass
