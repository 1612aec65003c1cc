"""``import edgeflow``: one front door, lazy (PEP 562), and cheap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import edgeflow

HEAVY = ("onnx", "onnxruntime", "torch", "cryptography", "paho", "edgeflow.gateway", "edgeflow.runtime",
         "edgeflow.train", "edgeflow.quantization", "edgeflow.federated", "edgeflow.kernels")


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_edgeflow_loads_nothing_heavy():
    got = _fresh("import json, sys, edgeflow; print(json.dumps(sorted(sys.modules)))")
    loaded = [m for m in got if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert loaded == []
    assert "edgeflow" in got


def test_the_checker_above_sees_a_heavy_import():
    """The same check fails once a name of the front door is used (so it can fail)."""
    got = _fresh("import json, sys, edgeflow; edgeflow.Gateway; print(json.dumps(sorted(sys.modules)))")
    assert "edgeflow.gateway.service" in got and "onnx" in got


def test_every_exported_name_resolves_to_its_module():
    from edgeflow.federated.client import Client
    from edgeflow.federated.numpy_client import NumPyClient
    from edgeflow.gateway.service import Gateway
    from edgeflow.quantization.api import quantize
    from edgeflow.runtime.session import Runtime, load
    from edgeflow.train.trainer import Trainer

    want = {"load": load, "Runtime": Runtime, "quantize": quantize, "Trainer": Trainer, "Client": Client,
            "NumPyClient": NumPyClient, "Gateway": Gateway}
    assert set(edgeflow.__all__) == {"__version__", *want}
    for name, obj in want.items():
        assert getattr(edgeflow, name) is obj, name
    assert set(edgeflow.__all__) <= set(dir(edgeflow))
    with pytest.raises(AttributeError, match="has no attribute 'Load'"):
        edgeflow.Load  # noqa: B018


def test_edgeflow_load_runs_a_model(tmp_path):
    import numpy as np
    import onnx

    from edgeflow import zoo

    path = tmp_path / "mlp.onnx"
    onnx.save(zoo.digits_mlp(seed=0), str(path))
    rt = edgeflow.load(path, profile="raspberry-pi-4")
    assert isinstance(rt, edgeflow.Runtime)
    y = rt(np.zeros((2, 64), np.float32))
    assert y.shape == (2, 10) and np.isfinite(y).all()
