"""The acceptance test of int8 quantization: on scikit-learn's digits (real
data shipped with the package), a trained MLP and a small CNN lose at most
1.0 point of top-1 accuracy against fp32 — with onnxruntime's quantizer and
with edgeflow's own numpy path, on onnxruntime and on the numpy backend.

edgeflow.train is not used here (it is developed separately): the MLP is
trained with scikit-learn's MLPClassifier, the CNN with torch (skipped
without it), and the weights copied into the edgeflow.zoo graphs.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import edgeflow
from edgeflow import zoo
from edgeflow.data.datasets import load_digits
from edgeflow.runtime.session import load

SEED = 0
N_CALIBRATION = 300
MAX_DROP = 1.0  # points of top-1 accuracy


def _set_weights(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    for t in model.graph.initializer:
        if t.name in weights:
            t.CopyFrom(numpy_helper.from_array(np.asarray(weights[t.name], np.float32), t.name))
    return model


def train_digits_mlp(split, seed: int = SEED) -> onnx.ModelProto:
    from sklearn.neural_network import MLPClassifier

    d = split.flat()
    clf = MLPClassifier(hidden_layer_sizes=(64, 32), max_iter=300, random_state=seed).fit(d.x_train, d.y_train)
    w = {}
    for i, (coef, bias) in enumerate(zip(clf.coefs_, clf.intercepts_)):
        w[f"fc{i}.weight"], w[f"fc{i}.bias"] = coef.T, bias  # zoo stores (out, in), transB=1
    return _set_weights(zoo.digits_mlp(seed=seed), w)


def train_digits_cnn(split, seed: int = SEED, epochs: int = 15) -> onnx.ModelProto:
    torch = pytest.importorskip("torch", reason="torch trains the reference CNN (a test-only dependency)")
    from torch import nn

    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10),
    )
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    x, y = torch.from_numpy(split.x_train), torch.from_numpy(split.y_train)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), 32):
            idx = perm[i:i + 32]
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    layer = {"0": "conv0", "3": "conv1", "7": "fc0", "9": "fc1"}
    w = {f"{layer[k.split('.')[0]]}.{k.split('.')[1]}": v.detach().numpy() for k, v in net.state_dict().items()}
    return _set_weights(zoo.digits_cnn(seed=seed), w)


@pytest.fixture(scope="module")
def digits():
    return load_digits(seed=SEED)


@pytest.fixture(scope="module")
def models(digits):
    return {"mlp": train_digits_mlp(digits)}


@pytest.fixture(scope="module")
def cnn(digits):
    return train_digits_cnn(digits)


def _data(name, digits):
    d = digits.flat() if name == "mlp" else digits
    return d.x_train[:N_CALIBRATION], d.x_test, digits.y_test


def _model(name, models, request):
    return models["mlp"] if name == "mlp" else request.getfixturevalue("cnn")


def _accuracy(model, profile, backend, x, y) -> float:
    return float(np.mean(np.argmax(load(model, profile, backend=backend)(x), axis=1) == y) * 100)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_fp32_baselines_are_real_classifiers(name, models, digits, request):
    model = _model(name, models, request)
    _, x_test, y_test = _data(name, digits)
    assert _accuracy(model, "x86-gateway", "numpy", x_test, y_test) >= 95.0


@pytest.mark.parametrize("engine", ["numpy", "ort"])
@pytest.mark.parametrize("name, min_channels", [("mlp", 4), ("cnn", 4), ("cnn", 0)])
def test_int8_loses_at_most_one_point(name, min_channels, engine, models, digits, request):
    """min_channels 4 (the default) keeps the 1-channel input conv fp32 (faster); 0 quantizes every layer."""
    if engine == "ort":
        pytest.importorskip("onnxruntime.quantization")
    model = _model(name, models, request)
    x_cal, x_test, y_test = _data(name, digits)
    result = edgeflow.quantize(model, "x86-gateway", calibration=x_cal, engine=engine, min_int8_channels=min_channels,
                               eval_data=x_test, labels=y_test, latency_runs=0, sensitivity=False, max_loss=None)
    rep = result.report
    # Measured here, independently of the report, on both backends.
    fp32 = _accuracy(model, "x86-gateway", "numpy", x_test, y_test)
    for backend in ("numpy", "ort"):
        q = _accuracy(result.model, "x86-gateway", backend, x_test, y_test)
        assert fp32 - q <= MAX_DROP, f"{name}/{engine} on {backend}: fp32 {fp32:.2f}% -> int8 {q:.2f}%"
    assert rep.accuracy_fp32 == pytest.approx(fp32)
    assert rep.accuracy_drop <= MAX_DROP
    assert rep.n_eval == len(x_test) and rep.n_calibration == N_CALIBRATION
    n_layers = {"mlp": 3, "cnn": 4}[name] - (1 if name == "cnn" and min_channels else 0)
    assert len(rep.quantized_nodes) == n_layers


def test_arm_profile_int8_activations_on_the_numpy_backend(models, digits):
    """A board without onnxruntime, static int8 asked for by name: int8 activations, own
    calibration, numpy backend (without method= such a board gets the bench-gated choice)."""
    x_cal, x_test, y_test = _data("mlp", digits)
    result = edgeflow.quantize(models["mlp"], "raspberry-pi-zero-2w", calibration=x_cal, engine="numpy",
                               method="static", eval_data=x_test, labels=y_test, latency_runs=3, max_loss=None,
                               time_on_host=True)
    rep = result.report
    assert rep.gate is None and any("expected to be slower than fp32 on the numpy backend" in n for n in rep.notes)
    assert rep.activations == "int8" and rep.latency.backend == "numpy"
    zps = [t for t in result.model.graph.initializer if t.name.endswith("_zero_point") and "weight" not in t.name
           and "bias" not in t.name]
    assert zps and all(t.data_type == onnx.TensorProto.INT8 for t in zps)
    assert rep.accuracy_drop <= MAX_DROP
    assert _accuracy(models["mlp"], "raspberry-pi-zero-2w", "numpy", x_test, y_test) - \
        _accuracy(result.model, "raspberry-pi-zero-2w", "numpy", x_test, y_test) <= MAX_DROP


def test_sensitivity_ranks_every_layer(models, digits):
    x_cal, x_test, y_test = _data("mlp", digits)
    rep = edgeflow.quantize(models["mlp"], "x86-gateway", calibration=x_cal, engine="numpy",
                            eval_data=x_test, labels=y_test, latency_runs=0, max_loss=None).report
    assert [s.node for s in rep.sensitivity] and {s.node for s in rep.sensitivity} == {"fc0", "fc1", "fc2"}
    drops = [s.accuracy_drop for s in rep.sensitivity]
    assert drops == sorted(drops, reverse=True)
    assert all(0.99 < s.cosine <= 1.0 + 1e-9 for s in rep.sensitivity)


@pytest.mark.parametrize("method", ["percentile", "entropy"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_histogram_calibrations_lose_at_most_one_point(name, method, models, digits, request):
    model = _model(name, models, request)
    x_cal, x_test, y_test = _data(name, digits)
    rep = edgeflow.quantize(model, "raspberry-pi-5", calibration=x_cal, method=method, engine="numpy",
                            eval_data=x_test, labels=y_test, backend="numpy", latency_runs=0,
                            sensitivity=False, max_loss=None).report
    assert rep.calibration == method and rep.accuracy_drop <= MAX_DROP
