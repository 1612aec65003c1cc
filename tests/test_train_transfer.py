"""Transfer learning on a real pretrained model (issue 15): PP-OCR's
MobileNetV3 direction classifier (weights in Constant nodes, HardSwish as
Clip/Mul/Div, SE blocks with HardSigmoid), at a small input so each test is
quick.

Covers: Constant-node weights train; the modes select what they say; bias
mode's gradients equal the full graph's on the same tensors (activations
dropped where a backward does not need them); the whole model's gradient
against float64 finite differences; memory plans per mode and the one-line
budget error naming a mode that fits; sparse mode fits its budget; resuming
(also onto an updated base model) and the mismatch message.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from edgeflow import model_suite as ms
from edgeflow.errors import InputError, MemoryBudgetError, TrainingError
from edgeflow.runtime.model import fix_input_shapes
from edgeflow.profiles import get_profile
from edgeflow.train import Trainer
from edgeflow.train.transfer import find_layers, has_constant_weights, new_head, parse_mode

NAME = "ocr-cls-ppocr-mobile-v2"
SHAPE = (3, 48, 48)
BATCH = 4


@pytest.fixture(scope="module")
def base():
    try:
        ms.fetch([NAME])
    except ms.ModelDownloadError as exc:
        pytest.skip(f"{NAME} is not cached and cannot be downloaded: {exc}")
    m = ms.load(NAME)
    return fix_input_shapes(m, {m.graph.input[0].name: (BATCH,) + SHAPE})


@pytest.fixture(scope="module")
def model(base):
    return new_head(base, 5, seed=1)


def _batch(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n,) + SHAPE).astype(np.float32), rng.integers(0, 5, n)


def test_constant_node_weights_train(base):
    assert has_constant_weights(base)
    t = Trainer(base, batch_size=BATCH)  # used to say "no weight is left to train"
    assert len(t.trainable_names) > 100
    assert "fc_0.w_0" in t.trainable_names
    x, _ = _batch()
    before = t.get_weights()["fc_0.w_0"].copy()
    t.step(x, np.array([0, 1, 0, 1]))
    assert not np.allclose(t.get_weights()["fc_0.w_0"], before)


def test_modes_select_what_they_say(model):
    full = Trainer(model, batch_size=BATCH, mode="full")
    head = Trainer(model, batch_size=BATCH, mode="head")
    bias = Trainer(model, batch_size=BATCH, mode="bias")
    last = Trainer(model, batch_size=BATCH, mode="last:3")
    assert head.trainable_names == ["fc_0.w_0", "fc_0.b_0"]
    assert head.output_name == "linear_1.tmp_1"  # the logits before the model's Softmax
    assert set(head.trainable_names) < set(bias.trainable_names) < set(full.trainable_names)
    layers = find_layers(full.graph, full._candidates(), full.output_name)
    biases = {b for lay in layers for b in lay.biases}
    assert set(bias.trainable_names) == biases | set(head.trainable_names)
    assert all(bias.graph.initializers[n].ndim == 1 for n in bias.trainable_names if n != "fc_0.w_0")
    assert set(last.trainable_names) == {p for lay in layers[-3:] for p in lay.params}
    assert "train" in bias.describe_trainable() and f"of {len(full._candidates())}" in bias.describe_trainable()
    assert not bias.tape.bn_training and full.tape.bn_training


def test_mode_parsing():
    assert str(parse_mode("last:4")) == "last:4"
    assert str(parse_mode("last", blocks=2)) == "last:2"
    assert parse_mode("tinytl").name == "bias"
    for bad in ("lats", "last", "last:x", "head:2"):
        with pytest.raises(InputError):
            parse_mode(bad)


def test_bias_mode_gradients_equal_the_full_graphs(model):
    """Dropping Conv inputs (bias mode keeps shapes only) must not change a single gradient (on the
    exact path: compact_activations=False; the compact one is held to its bound in test_train_compact)."""
    x, y = _batch(3)
    bias = Trainer(model, batch_size=BATCH, mode="bias", dtype="float64", compact_activations=False)
    full = Trainer(model, batch_size=BATCH, mode="full", bn_training=False, dtype="float64")
    gb, gf = bias.gradients(x, y), full.gradients(x, y)
    for n, g in gb.items():
        np.testing.assert_allclose(g, gf[n], rtol=1e-6, atol=1e-9, err_msg=n)
    assert len(bias.tape.kept_values) < len(full.tape.kept_values)
    convs = [st for st in bias.tape.steps if st.node.op_type == "Conv" and st.differentiable]
    assert convs and all(0 in st.shape_only and not st.save for st in convs)  # no Conv keeps its input
    full_convs = [st for st in full.tape.steps if st.node.op_type == "Conv" and st.differentiable]
    assert not any(0 in st.shape_only for st in full_convs)


def test_whole_model_gradient_vs_finite_differences(model):
    x, y = _batch(5)
    t = Trainer(model, batch_size=BATCH, mode="last:2", dtype="float64", bn_training=False, compact_activations=False)
    t2 = Trainer(model, batch_size=BATCH, mode="bias", dtype="float64", compact_activations=False)
    for tr in (t, t2):
        g = tr.gradients(x, y)
        rng = np.random.default_rng(0)
        for name in tr.trainable_names[:6]:
            w = tr.params[name].reshape(-1)
            for j in rng.choice(w.size, size=min(2, w.size), replace=False):
                orig = w[j]
                w[j] = orig + 1e-6
                lp = tr.evaluate(x, y)[0]
                w[j] = orig - 1e-6
                lm = tr.evaluate(x, y)[0]
                w[j] = orig
                num = (lp - lm) / 2e-6
                assert abs(g[name].reshape(-1)[j] - num) <= 1e-5 * max(1.0, abs(num)), (name, j)


def test_memory_plans_per_mode(model):
    peaks = {m: Trainer(model, batch_size=BATCH, mode=m).plan_memory().peak_bytes
             for m in ("full", "bias", "head")}
    assert peaks["head"] < peaks["bias"] < peaks["full"]


def test_budget_error_names_the_budget_and_a_mode_that_fits(model):
    bias_peak = Trainer(model, batch_size=BATCH, mode="bias").plan_memory().peak_bytes
    full_peak = Trainer(model, batch_size=BATCH, mode="full").plan_memory(save_workspace=False).peak_bytes
    budget_mb = -(-bias_peak // 2**20)  # whole MiB, at least the bias mode's peak
    assert budget_mb * 2**20 < full_peak
    prof = dataclasses.replace(get_profile("raspberry-pi-4"), train_memory_budget_mb=int(budget_mb))
    with pytest.raises(MemoryBudgetError) as e:
        Trainer(model, batch_size=BATCH, mode="full", profile=prof)
    msg = str(e.value)
    assert "\n" not in msg and f"{budget_mb:.1f} MiB" in msg and "mode='bias'" in msg
    Trainer(model, batch_size=BATCH, mode="bias", profile=prof)  # fits


def test_sparse_mode_fits_its_budget(model):
    head = Trainer(model, batch_size=BATCH, mode="head").plan_memory().peak_bytes
    full = Trainer(model, batch_size=BATCH, mode="full").plan_memory().peak_bytes
    budget = (head + full) // 3
    t = Trainer(model, batch_size=BATCH, mode="sparse", budget_bytes=budget)
    assert t.plan_memory().peak_bytes <= budget
    assert 0 < t.sparse_k < len(t.layers)
    more = Trainer(model, batch_size=BATCH, mode="sparse", budget_bytes=full)
    assert more.sparse_k >= t.sparse_k and len(more.trainable_names) >= len(t.trainable_names)
    with pytest.raises(InputError, match="budget"):
        Trainer(model, batch_size=BATCH, mode="sparse")
    with pytest.raises(MemoryBudgetError, match="head alone"):
        Trainer(model, batch_size=BATCH, mode="sparse", budget_bytes=1024)


def _fit(t, steps, seed):
    for s in range(steps):
        t.step(*_batch(seed + s))


def test_resume_continues_exactly(model, tmp_path):
    kw = dict(batch_size=BATCH, mode="bias", optimizer="adam", lr=1e-3, seed=2)
    straight = Trainer(model, **kw)
    _fit(straight, 4, 10)
    first = Trainer(model, **kw)
    _fit(first, 2, 10)
    npz, meta = first.save_state(tmp_path / "run.train")
    assert json.loads(meta.read_text())["global_step"] == 2
    with np.load(npz, allow_pickle=False) as z:  # arrays only: no pickle
        assert any(k.startswith("opt/m/") for k in z.files) and any(k.startswith("param/") for k in z.files)
    resumed = Trainer(model, **kw)
    resumed.load_state(tmp_path / "run.train")
    assert resumed.global_step == 2 and resumed.optimizer.steps == 2
    _fit(resumed, 2, 12)
    for n in straight.trainable_names:
        np.testing.assert_allclose(resumed.params[n], straight.params[n], rtol=1e-6, atol=1e-7, err_msg=n)


def test_full_mode_resume_keeps_batchnorm_statistics(model, tmp_path):
    """2 + 2 steps with a save/load in between equal 4 steps exactly, BatchNorm running mean/var too
    (they are not trainable weights, but full mode updates them; they used to restart from the base)."""
    kw = dict(batch_size=BATCH, mode="full", optimizer="adam", lr=1e-3, seed=2)
    straight = Trainer(model, **kw)
    _fit(straight, 4, 30)
    first = Trainer(model, **kw)
    _fit(first, 2, 30)
    npz, _ = first.save_state(tmp_path / "bn.train")
    resumed = Trainer(model, **kw)  # a fresh trainer on the base model, as the CLI's --resume does
    resumed.load_state(tmp_path / "bn.train")
    _fit(resumed, 2, 32)
    buffers = [n for n in straight.weight_names if n not in straight.trainable_names]
    assert any(n.endswith("_bn_mean") for n in buffers) and any(n.endswith("_bn_variance") for n in buffers)
    with np.load(npz, allow_pickle=False) as z:
        assert {f"state/{n}" for n in buffers} <= set(z.files)
    got, want = resumed.get_weights(), straight.get_weights()
    assert set(got) == set(want)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)


def test_resume_across_an_ota_update_of_the_base(model, tmp_path):
    from onnx import numpy_helper

    first = Trainer(model, batch_size=BATCH, mode="head", momentum=0.9, lr=0.01)
    _fit(first, 2, 20)
    first.save_state(tmp_path / "s")
    # v2 of the base: the same architecture with other (here: perturbed) pretrained body weights
    v2 = type(first.model)()
    v2.CopyFrom(first.model)
    for t in v2.graph.initializer:
        if t.name.startswith("conv") and t.data_type == 1:
            a = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array((a * 1.01).astype(a.dtype), t.name))
    after = Trainer(v2, batch_size=BATCH, mode="head", momentum=0.9, lr=0.01)
    after.load_state(tmp_path / "s")
    np.testing.assert_array_equal(after.params["fc_0.w_0"], first.params["fc_0.w_0"])
    np.testing.assert_array_equal(after.optimizer.state["fc_0.w_0"]["momentum"],
                                  first.optimizer.state["fc_0.w_0"]["momentum"])
    # a base whose head has another shape: one clear line, nothing changed
    other = Trainer(new_head(first.model, 7), batch_size=BATCH, mode="head", momentum=0.9, lr=0.01)
    before = other.params["fc_0.w_0"].copy()
    with pytest.raises(TrainingError, match=r"does not fit this model .*fc_0\.w_0.* was \(200, 5\)") as e:
        other.load_state(tmp_path / "s")
    assert "\n" not in str(e.value)
    np.testing.assert_array_equal(other.params["fc_0.w_0"], before)
    with pytest.raises(TrainingError, match="optimizer"):
        Trainer(v2, batch_size=BATCH, mode="head", optimizer="adam").load_state(tmp_path / "s")


def test_cli_mode_new_head_and_resume(base, tmp_path, capsys):
    import onnx

    from edgeflow.cli.main import main

    onnx.save(base, tmp_path / "base.onnx")
    x, y = _batch(7)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    out = tmp_path / "t.onnx"
    args = ["train", str(tmp_path / "base.onnx"), "--data", str(tmp_path / "d.npz"), "-o", str(out),
            "--mode", "bias", "--new-head", "5", "--batch-size", str(BATCH), "--profile", "x86-gateway"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "mode bias:" in text and "weight tensors train" in text
    meta = json.loads((tmp_path / "t.train.json").read_text())
    assert meta["global_step"] == 1 and meta["mode"] == "bias"
    assert main(args + ["--resume", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    assert main(["train", str(tmp_path / "base.onnx"), "--data", str(tmp_path / "d.npz"), "-o", str(out),
                 "--mode", "bias", "--new-head", "7", "--batch-size", str(BATCH), "--resume"]) != 0
    err = capsys.readouterr().err
    assert "does not fit this model" in err and "Traceback" not in err
    assert main(args[:-4] + ["--mode", "lats"]) != 0
    assert "unknown training mode" in capsys.readouterr().err


def test_fuse_hardswish_is_exact_and_pure(model):
    from edgeflow.runtime.graph import compile_graph
    from edgeflow.train.autograd import Tape
    from edgeflow.train.transfer import fuse_hardswish, prepare_model

    g = compile_graph(prepare_model(model), optimize=False)
    n_before = len(g.nodes)
    f = fuse_hardswish(g)
    assert len(g.nodes) == n_before  # the input graph is unchanged
    ops = [n.op_type for n in f.nodes]
    assert ops.count("HardSwish") == 18 and "Clip" not in ops and "Div" not in ops
    x, _ = _batch(11)
    out = g.output_names[0]
    ref = Tape(g, set(), out).infer({}, {g.input_names[0]: x})
    got = Tape(f, set(), out).infer({}, {f.input_names[0]: x})
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_transformer_encoder_gradient_vs_finite_differences():
    """MiniLM (the suite's transformer encoder) in float64: every bias and LayerNorm parameter through
    attention, GELU (Erf), the masks (Where/Cast/Expand) to the pooled sentence embedding."""
    from edgeflow.runtime.graph import compile_graph
    from edgeflow.train.autograd import Tape
    from edgeflow.train.transfer import prepare_model

    name = "minilm-l3-paraphrase"
    try:
        ms.fetch([name])
    except ms.ModelDownloadError as exc:
        pytest.skip(f"{name} is not cached and cannot be downloaded: {exc}")
    g = compile_graph(prepare_model(ms.load(name)), optimize=False)
    consts = {k: (a.astype(np.float64) if a.dtype.kind == "f" else a) for k, a in g.initializers.items()}
    names = [k for k, a in g.initializers.items() if a.dtype.kind == "f" and a.ndim == 1 and a.size > 1]
    assert len(names) == 32
    tape = Tape(g, set(names), "461", constants=consts)  # "461": the pooled (1, 384) embedding
    feeds = ms.build_inputs(name)
    params = {k: consts[k].copy() for k in names}
    fwd = tape.forward(params, feeds)
    dy = np.random.default_rng(0).standard_normal(fwd.output.shape)
    grads = tape.backward(fwd, dy)
    assert all(np.abs(v).sum() > 0 for v in grads.values())
    rng = np.random.default_rng(1)
    for n in (names[0], names[len(names) // 2], names[-1]):
        w = params[n].reshape(-1)
        j = int(rng.integers(w.size))
        orig = w[j]
        w[j] = orig + 1e-6
        fp = float((tape.infer(params, feeds) * dy).sum())
        w[j] = orig - 1e-6
        fm = float((tape.infer(params, feeds) * dy).sum())
        w[j] = orig
        num = (fp - fm) / 2e-6
        assert abs(grads[n].reshape(-1)[j] - num) <= 1e-6 * max(1.0, abs(num)), (n, grads[n].reshape(-1)[j], num)


def test_cli_takes_open_dims_from_the_data_and_resumes_batchnorm_statistics(tmp_path, capsys):
    """The suite's model has x = (-1, 3, ?, ?): the data fixes 3x48x48 (the batch stays open, so a last
    partial batch trains too); a fixed batch that the batches would not match is one line suggesting
    ?x3x48x48; full mode's --resume continues the BatchNorm statistics instead of reloading the base's."""
    import onnx

    from edgeflow.cli.main import main
    from edgeflow.runtime.model import graph_inputs

    try:
        ms.fetch([NAME])
    except ms.ModelDownloadError as exc:
        pytest.skip(f"{NAME} is not cached and cannot be downloaded: {exc}")
    raw = ms.load(NAME)
    assert [d for d in graph_inputs(raw)[0].shape][2:] != [48, 48]  # dynamic in the file
    onnx.save(raw, tmp_path / "cls.onnx")
    rng = np.random.default_rng(4)
    x6, y6 = rng.standard_normal((6,) + SHAPE).astype(np.float32), rng.integers(0, 2, 6)
    np.savez(tmp_path / "d6.npz", x=x6, y=y6)
    common = ["--profile", "x86-gateway", "--batch-size", str(BATCH)]
    assert main(["train", str(tmp_path / "cls.onnx"), "--data", str(tmp_path / "d6.npz"),
                 "-o", str(tmp_path / "a.onnx"), *common]) == 0  # batches of 4 and 2
    capsys.readouterr()
    assert main(["train", str(tmp_path / "cls.onnx"), "--data", str(tmp_path / "d6.npz"), "-o", str(tmp_path / "b.onnx"),
                 "--shape", "x=32x3x48x48", *common]) == 2
    err = capsys.readouterr().err
    assert "fixed batch of 32" in err and "--shape x=?x3x48x48" in err and "\n" not in err.strip()
    assert main(["train", str(tmp_path / "cls.onnx"), "--data", str(tmp_path / "d6.npz"), "-o", str(tmp_path / "b.onnx"),
                 "--shape", "x=?x3x48x48", *common]) == 0  # the suggestion works
    capsys.readouterr()

    # one batch of 4, one step per run: run + --resume == two steps of a Trainer
    x, y = x6[:BATCH], y6[:BATCH]
    np.savez(tmp_path / "d.npz", x=x, y=y)
    args = ["train", str(tmp_path / "cls.onnx"), "--data", str(tmp_path / "d.npz"), "-o", str(tmp_path / "t.onnx"),
            *common]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "resumed" not in text and "train state (step 1) saved to" in text and "t.train.npz" in text
    assert main(args + ["--resume"]) == 0
    text = capsys.readouterr().out
    assert "resumed from step 1" in text and "train state (step 2) saved to" in text
    fixed = fix_input_shapes(raw, {"x": (None,) + SHAPE})
    ref = Trainer(fixed, batch_size=BATCH, optimizer="sgd", lr=0.01, momentum=0.9, seed=0)
    ref.step(x, y)
    one = ref.get_weights()
    ref.step(x, y)
    two = ref.get_weights()
    from onnx import numpy_helper

    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "t.onnx").graph.initializer}
    stats = [n for n in two if n.endswith(("_bn_mean", "_bn_variance"))]
    moved = [n for n in stats if not np.allclose(one[n], two[n], rtol=1e-4, atol=1e-6)]
    assert len(moved) > len(stats) // 2  # the second step moves them: a reset would show
    for n in stats:
        np.testing.assert_allclose(got[n], two[n], rtol=1e-4, atol=1e-6, err_msg=n)
