"""Shared test set-up.

edgeflow maps kernels/ and gateway/ into the ``edgeflow`` namespace through
setuptools' package-dir. With a plain (non-editable) install, running pytest
from the repository root lets the local ./edgeflow shadow the installed
package and ``edgeflow.kernels`` then fails to import. Say so clearly instead
of failing with a bare ImportError in every test.
"""

from __future__ import annotations

import pytest

try:
    import edgeflow.kernels  # noqa: F401
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise pytest.UsageError(
        "edgeflow.kernels cannot be imported: install the checkout in editable mode "
        "with `pip install -e '.[dev]'` before running the tests "
        f"(import error: {exc})"
    ) from exc
