"""The numpy backend keeps freed memory for reuse (glibc mallopt, once per process) unless
the user chose glibc's thresholds or turned it off; each case in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = "from edgeflow.runtime.backends import numpy_backend as nb; print(nb._keep_freed_memory())"


def _run(**env) -> str:
    full = {k: v for k, v in os.environ.items()
            if k not in ("EDGEFLOW_NUMPY_MALLOPT", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=full,
                          check=True, timeout=120).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_set_on_glibc_and_not_when_the_user_chose():
    import ctypes

    glibc = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
    assert _run() == str(glibc)
    assert _run(EDGEFLOW_NUMPY_MALLOPT="0") == "False"
    assert _run(MALLOC_TRIM_THRESHOLD_="131072") == "False"
    assert _run(MALLOC_MMAP_THRESHOLD_="131072") == "False"
