"""Every real-suite model through the user's path: ``edgeflow.load`` (``Runtime``) and ``edgeflow run``, on
both backends.

tests/test_real_models.py checks the numpy kernels against onnxruntime by
loading each backend directly; this file goes through what a user calls,
where the runtime also checks the model, infers shapes, fixes the input dims
the arrays give (as ``edgeflow run`` does) and plans memory. That planning is
the numpy backend's: onnxruntime must get the model as shipped and never be
blocked by it (issue 13: silero-vad v5 failed on onnxruntime once its input
dims were fixed, because onnx wrote them into the untaken If branch; SLANet's
declared Loop-body shapes failed strict shape inference, on both backends).

Inputs are the suite's own (``model_suite.build_inputs``); without a cache
and a network the tests skip, saying so.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgeflow import model_suite as ms
from edgeflow.runtime.backends import SessionOptions, available_backends, get_backend
from edgeflow.cli.main import main
from edgeflow.runtime.session import Runtime

TOL = 1e-4
NAMES = [m.name for m in ms.models()]
BACKENDS = ["numpy", "ort"]


@pytest.fixture(scope="module")
def suite():
    try:
        return ms.fetch()
    except ms.ModelDownloadError as exc:
        pytest.skip(f"the real-model suite is not cached and cannot be downloaded: {exc}")


@pytest.fixture(scope="module")
def reference():
    """onnxruntime on the file as shipped, one thread: what both backends are compared with."""
    if "ort" not in available_backends():
        pytest.skip("onnxruntime is not installed: no reference to compare with")
    done: dict[str, dict] = {}

    def ref(name: str, feeds):
        if name not in done:
            model = ms.load(name)
            done[name] = get_backend("ort").load(model, SessionOptions(threads=1)).run(feeds)
        return done[name]

    return ref


def _check(name, backend, got, ref, feeds):
    assert set(got) == set(ref), name
    if backend == "ort":  # the same engine on the same file: the runtime must not have changed the model
        for k in ref:
            assert ms.max_relative_error(got[k], ref[k]) <= 1e-6, (name, k)
        return
    cmp = ms.compare_suite_outputs(name, feeds, got, ref, tol=TOL, model=ms.load(name))
    assert cmp.match, f"{name} on numpy through the runtime: {cmp.bad}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_runtime_runs_every_suite_model(suite, reference, name, backend):
    feeds = ms.build_inputs(name)
    rt = Runtime(ms.model_path(name), "x86-gateway", backend=backend, threads=1, allow_over_budget=True,
                 input_shapes={k: v.shape for k, v in feeds.items()})
    assert rt.backend_name == backend
    got = rt.run(feeds)
    _check(name, backend, got, reference(name, feeds), feeds)
    if backend == "numpy":  # every dim fixed by the arrays: the numpy backend plans the whole model
        assert rt.plan is not None, rt.plan_note


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["silero-vad-v5", "table-slanet-plus", "ocr-cls-ppocr-mobile-v2"])
def test_cli_run_on_suite_models(suite, reference, tmp_path, capsys, name, backend):
    feeds = ms.build_inputs(name)
    np.savez(tmp_path / "in.npz", **feeds)
    rc = main(["run", str(ms.model_path(name)), "-i", str(tmp_path / "in.npz"), "--backend", backend,
               "--profile", "x86-gateway", "--threads", "1", "--allow-over-budget", "-o", str(tmp_path / "out.npz")])
    err = capsys.readouterr().err
    assert rc == 0, err
    with np.load(tmp_path / "out.npz") as z:
        got = {k: z[k] for k in z.files}
    _check(name, backend, got, reference(name, feeds), feeds)


def test_cli_run_json_on_the_vad_with_shape(suite, tmp_path, capsys):
    """--shape that agrees with the array, onnxruntime: the input dims the user states are checked, and
    onnxruntime still gets the model as shipped."""
    feeds = ms.build_inputs("silero-vad-v5")
    np.savez(tmp_path / "in.npz", **feeds)
    path = str(ms.model_path("silero-vad-v5"))
    n = feeds["input"].shape[1]
    assert main(["run", path, "-i", str(tmp_path / "in.npz"), "--backend", "ort", "--shape", f"input=1x{n}",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "ort" and out["outputs"]["output"]["shape"] == [1, 1]
    rt = Runtime(path, "x86-gateway", backend="ort", input_shapes={"input": (1, n)})
    assert rt.inputs[0].shape == (1, n)
    with pytest.raises(Exception, match="dim 1"):
        rt.run({**feeds, "input": np.zeros((1, n + 64), np.float32)})


def test_quantize_a_paddle_model_with_shape(suite, tmp_path, capsys):
    """Paddle declares its outputs with dim_value -1: after --shape, strict shape inference compared them with
    the fixed dims and quantize stopped ('Softmax ... differ in dimension 0: (1) vs (-1)')."""
    cal = np.concatenate([ms.build_inputs("ocr-cls-ppocr-mobile-v2", k)["x"] for k in range(4)])
    np.savez(tmp_path / "cal.npz", x=cal)
    rc = main(["quantize", str(ms.model_path("ocr-cls-ppocr-mobile-v2")), "--profile", "x86-gateway",
               "-c", str(tmp_path / "cal.npz"), "--shape", "x=1x3x48x192", "-o", str(tmp_path / "q.onnx"), "--json"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "q.onnx").stat().st_size > 0
