"""The two backends agree; the runtime picks and falls back by profile; inputs are checked."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edgeflow import zoo
from edgeflow.runtime.backends import available_backends, get_backend
from edgeflow.runtime.backends.ort import OrtBackend, choose_providers
from edgeflow.errors import BackendError, InputError, MemoryBudgetError, ShapeError
from edgeflow.runtime.session import load

RNG = np.random.default_rng(42)

MODELS = {
    "mlp": (zoo.mlp(), (784,)),
    "cnn": (zoo.small_cnn(), (1, 28, 28)),
    "cnn_bn": (zoo.small_cnn((1, 16, 16), channels=(8, 16), hidden=32, batch_norm=True, seed=3), (1, 16, 16)),
    "digits_cnn": (zoo.digits_cnn(), (1, 8, 8)),
}


def _randomise_bn(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give BatchNormalization non-trivial statistics so the test means something."""
    for t in model.graph.initializer:
        if t.name.startswith("bn"):
            a = onnx.numpy_helper.to_array(t)
            if t.name.endswith(".var"):
                a = RNG.uniform(0.5, 2.0, a.shape).astype(np.float32)
            else:
                a = RNG.normal(0, 0.5, a.shape).astype(np.float32)
            t.CopyFrom(onnx.numpy_helper.from_array(a, t.name))
    return model


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("batch", [1, 32])
def test_numpy_matches_onnxruntime(name, batch):
    model, shape = MODELS[name]
    model = _randomise_bn(model)
    x = RNG.standard_normal((batch, *shape)).astype(np.float32)
    y_np = load(model, "x86-gateway", backend="numpy", batch_size=batch)(x)
    y_ort = load(model, "x86-gateway", backend="ort", batch_size=batch)(x)
    # Documented tolerance (docs/backends.md): float32 sums in another order.
    np.testing.assert_allclose(y_np, y_ort, rtol=1e-4, atol=1e-4)
    assert np.array_equal(y_np.argmax(1), y_ort.argmax(1))


def test_profile_order_picks_first_available_backend():
    assert load(zoo.digits_mlp(), "raspberry-pi-4").backend_name == "ort"
    assert load(zoo.digits_mlp(), "visionfive-2").backend_name == "numpy"


def test_falls_back_to_numpy_without_onnxruntime(monkeypatch):
    monkeypatch.setattr(OrtBackend, "available", classmethod(lambda cls: False))
    assert "ort" not in available_backends()
    rt = load(zoo.digits_mlp(), "raspberry-pi-4")
    assert rt.backend_name == "numpy"
    assert rt.fallbacks and rt.fallbacks[0][0] == "ort" and "not available" in rt.fallbacks[0][1]
    with pytest.raises(BackendError, match="backend 'ort' is not available"):
        get_backend("ort")


def test_unknown_backend_named():
    with pytest.raises(BackendError, match="unknown backend 'tpu'; known backends: ort, numpy"):
        get_backend("tpu")


def test_providers_filtered_and_cpu_last():
    assert choose_providers(["TensorrtExecutionProvider", "CUDAExecutionProvider"], ["CPUExecutionProvider"]) == [
        "CPUExecutionProvider"
    ]
    assert choose_providers(["CUDAExecutionProvider", "CPUExecutionProvider"],
                            ["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_jetson_profile_runs_on_cpu_here():
    rt = load(zoo.digits_mlp(), "jetson-orin-nano")
    assert rt.session.providers == ["CPUExecutionProvider"]


def test_memory_budget_refused_then_override():
    big = zoo.mlp((784, 5000, 5000, 10))  # ~110 MiB of weights
    with pytest.raises(MemoryBudgetError, match="exceeds profile 'beaglebone-black'.s budget of 96 MiB") as ei:
        load(big, "beaglebone-black")
    assert ei.value.planned_bytes > ei.value.budget_bytes
    rt = load(big, "beaglebone-black", allow_over_budget=True)
    assert rt(np.zeros((1, 784), np.float32)).shape == (1, 10)


def test_memory_plan_counts_weights_and_activations():
    rt = load(zoo.mlp((784, 512, 512, 10)), "x86-gateway", backend="numpy", batch_size=64)
    plan = rt.plan
    assert plan.weights_bytes == 4 * (784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10)
    # peak: the 64x784 input with the 64x512 first hidden output (Relu fused in place)
    assert plan.peak_activation_bytes == 4 * 64 * (784 + 512)
    assert plan.unknown == ()


def test_memory_plan_includes_conv_workspace():
    rt = load(zoo.small_cnn(), "x86-gateway", backend="numpy", batch_size=8)
    # conv1's im2col: 8 * 32 channels * 9 * 14*14 floats
    assert rt.plan.workspace_bytes == 4 * 8 * 32 * 9 * 14 * 14


def test_executor_frees_intermediates():
    from edgeflow.runtime.graph import compile_graph

    g = compile_graph(zoo.small_cnn())
    freed = [x for n in g.nodes for x in n.free_after]
    produced = [o for n in g.nodes for o in n.outputs if o and o != "logits"]
    assert sorted(freed) == sorted(produced + ["input"])


@pytest.mark.parametrize("backend", ["numpy", "ort"])
def test_input_errors(backend):
    rt = load(zoo.digits_mlp(), "x86-gateway", backend=backend)
    with pytest.raises(InputError, match=r"missing input\(s\): \['input'\]"):
        rt.run({"x": np.zeros((1, 64), np.float32)})
    with pytest.raises(ShapeError, match=r"input 'input' has shape \(1, 65\), expected \['N', 64\]"):
        rt.run(np.zeros((1, 65), np.float32))
    with pytest.raises(ShapeError, match="expected rank 2"):
        rt.run(np.zeros((64,), np.float32))
    with pytest.raises(ShapeError, match="dtype complex64, expected float32"):
        rt.run(np.zeros((1, 64), np.complex64))
    # integer pixels are cast to the float input
    assert rt.run(np.zeros((1, 64), np.uint8))["logits"].shape == (1, 10)
    with pytest.raises(InputError, match="unknown output"):
        rt.run(np.zeros((1, 64), np.float32), ["nope"])
    # float64 is cast losslessly in kind: accepted
    assert rt.run(np.zeros((2, 64), np.float64))["logits"].shape == (2, 10)


def test_real_torch_exported_cnn_runs_on_both_backends(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is a bench/test extra")
    import torch.nn as nn

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, 10), nn.LogSoftmax(dim=1),
    ).eval()
    x = torch.randn(4, 1, 28, 28)
    path = tmp_path / "torch_cnn.onnx"
    torch.onnx.export(net, x, str(path), input_names=["input"], output_names=["out"],
                      dynamic_axes={"input": {0: "N"}, "out": {0: "N"}}, opset_version=17, dynamo=False)
    with torch.no_grad():
        ref = net(x).numpy()
    for backend in ("numpy", "ort"):
        y = load(str(path), "x86-gateway", backend=backend, batch_size=4)(x.numpy())
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
