"""Whole training steps against PyTorch (float64): gradients of an MLP and of
small CNNs (with and without BatchNorm), running statistics, and the
optimizers' update rules step by step.

PyTorch is a test/bench extra only; without it these tests skip.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from edgeflow import zoo
from edgeflow.train import SGD, Adam, AdamW, Trainer, clip_by_global_norm

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch): gradient checks skipped")
F = torch.nn.functional

RTOL = 1e-5


def _weights(model) -> dict:
    return {t.name: torch.tensor(numpy_helper.to_array(t).astype(np.float64), requires_grad=True)
            for t in model.graph.initializer}


def _torch_mlp(w, x):
    h, i = x, 0
    while f"fc{i + 1}.weight" in w:
        h = F.relu(F.linear(h, w[f"fc{i}.weight"], w[f"fc{i}.bias"]))
        i += 1
    return F.linear(h, w[f"fc{i}.weight"], w[f"fc{i}.bias"])


def _torch_cnn(w, x, batch_norm: bool, running: dict | None = None):
    h, i = x, 0
    while f"conv{i}.weight" in w:
        h = F.conv2d(h, w[f"conv{i}.weight"], w[f"conv{i}.bias"], padding=1)
        if batch_norm:
            rm, rv = running[f"bn{i}.mean"], running[f"bn{i}.var"]
            h = F.batch_norm(h, rm, rv, w[f"bn{i}.scale"], w[f"bn{i}.bias"], training=True, momentum=0.1, eps=1e-5)
        h = F.max_pool2d(F.relu(h), 2)
        i += 1
    h = F.relu(F.linear(h.flatten(1), w["fc0.weight"], w["fc0.bias"]))
    return F.linear(h, w["fc1.weight"], w["fc1.bias"])


def _assert_grads_match(ours: dict, w: dict, skip=()):
    for name, g in ours.items():
        if name in skip:
            continue
        ref = w[name].grad.numpy()
        scale = np.abs(ref).max()
        assert scale > 0, name
        np.testing.assert_allclose(g, ref, rtol=RTOL, atol=RTOL * scale, err_msg=name)


def test_mlp_step_gradients_match_torch():
    model = zoo.mlp((20, 16, 12, 5), seed=3)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((9, 20)), rng.integers(0, 5, 9)
    tr = Trainer(model, dtype="float64")
    loss, _, grads = tr.compute_gradients(x, y)
    w = _weights(model)
    ref = F.cross_entropy(_torch_mlp(w, torch.tensor(x)), torch.tensor(y))
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-12)
    _assert_grads_match(grads, w)


@pytest.mark.parametrize("batch_norm", [False, True])
def test_small_cnn_step_gradients_match_torch(batch_norm):
    model = zoo.small_cnn((1, 12, 12), channels=(4, 6), hidden=16, seed=1, batch_norm=batch_norm)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((6, 1, 12, 12)), rng.integers(0, 10, 6)
    tr = Trainer(model, dtype="float64")
    loss, _, grads = tr.compute_gradients(x, y)
    w = _weights(model)
    running = {k: v.detach().clone() for k, v in w.items() if k.endswith((".mean", ".var"))}
    ref = F.cross_entropy(_torch_cnn(w, torch.tensor(x), batch_norm, running), torch.tensor(y))
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-12)
    # A conv bias right before BatchNorm has an exact gradient of 0: only rounding noise to compare.
    skip = {n for n in grads if batch_norm and n.startswith("conv") and n.endswith(".bias")}
    _assert_grads_match(grads, w, skip)
    for n in skip:
        assert np.abs(grads[n]).max() < 1e-12

    if batch_norm:
        # After a step, our running statistics (ONNX momentum 0.9) equal torch's (momentum 0.1);
        # torch keeps the unbiased batch variance, ONNX the biased one.
        tr.step(x, y)
        n = x.shape[0] * 12 * 12
        np.testing.assert_allclose(tr.get_weights()["bn0.mean"], running["bn0.mean"].numpy(), rtol=1e-6, atol=1e-7)
        var0 = 1.0  # the zoo initialises running variance to 1
        batch_unbiased = (running["bn0.var"].numpy() - 0.9 * var0) / 0.1
        ours_biased = (tr.get_weights()["bn0.var"] - 0.9 * var0) / 0.1
        np.testing.assert_allclose(ours_biased, batch_unbiased * (n - 1) / n, rtol=1e-5)


def test_cnn_after_several_sgd_steps_matches_torch():
    """Trajectories, not just one gradient: 4 steps of SGD momentum + weight decay."""
    model = zoo.small_cnn((1, 8, 8), channels=(3, 4), hidden=8, seed=5)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((5, 1, 8, 8)) for _ in range(4)]
    ys = [rng.integers(0, 10, 5) for _ in range(4)]
    tr = Trainer(model, dtype="float64", optimizer=SGD(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True))
    w = _weights(model)
    opt = torch.optim.SGD(list(w.values()), lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
    for x, y in zip(xs, ys):
        tr.step(x, y)
        opt.zero_grad()
        F.cross_entropy(_torch_cnn(w, torch.tensor(x), False), torch.tensor(y)).backward()
        opt.step()
    for name, v in tr.get_weights().items():
        np.testing.assert_allclose(v, w[name].detach().numpy().astype(np.float32), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("make", [
    (lambda: SGD(lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    (lambda: SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)),
    (lambda: SGD(lr=0.05, momentum=0.8, dampening=0.3), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8,
                                                                                 dampening=0.3)),
    (lambda: Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    (lambda: Adam(lr=0.01, weight_decay=0.1, betas=(0.8, 0.99)),
     lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, betas=(0.8, 0.99))),
    (lambda: AdamW(lr=0.01, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
], ids=["sgd", "sgd-momentum-wd", "sgd-dampening", "adam", "adam-l2", "adamw"])
def test_optimizer_updates_match_torch(make):
    ours_f, theirs_f = make
    rng = np.random.default_rng(3)
    params = {"a": rng.standard_normal((4, 3)), "b": rng.standard_normal(5)}
    grads_seq = [{k: rng.standard_normal(v.shape) for k, v in params.items()} for _ in range(5)]
    tp = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in params.items()}
    ours, theirs = ours_f(), theirs_f(list(tp.values()))
    for g in grads_seq:
        ours.step(params, g)
        for k, t in tp.items():
            t.grad = torch.tensor(g[k])
        theirs.step()
    for k in params:
        np.testing.assert_allclose(params[k], tp[k].detach().numpy(), rtol=1e-12, atol=1e-14)


def test_clip_by_global_norm_matches_torch():
    rng = np.random.default_rng(4)
    grads = {"a": rng.standard_normal((4, 3)) * 5, "b": rng.standard_normal(7) * 5}
    clipped, norm = clip_by_global_norm(grads, 1.5)
    ts = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in grads.values()]
    for t, g in zip(ts, grads.values()):
        t.grad = torch.tensor(g.copy())
    ref_norm = torch.nn.utils.clip_grad_norm_(ts, 1.5)
    assert norm == pytest.approx(float(ref_norm), rel=1e-12)
    for t, g in zip(ts, clipped.values()):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-12)
