"""The Trainer end to end: learning digits, head-only fine-tuning, export,
the federated client's API, determinism, and every bad-input path."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeflow import zoo
from edgeflow.data import DataLoader, from_arrays
from edgeflow.data.datasets import load_digits
from edgeflow.errors import InputError, ModelError, ShapeError, TrainingError
from edgeflow.train import Trainer


@pytest.fixture(scope="module")
def digits():
    return load_digits()


@pytest.fixture(scope="module")
def trained_cnn(digits):
    """A digits CNN trained from scratch (shared by the tests that need a pre-trained model)."""
    tr = Trainer(zoo.digits_cnn(seed=0), optimizer="sgd", lr=0.05, momentum=0.9, batch_size=32, seed=0)
    history = tr.fit((digits.x_train, digits.y_train), epochs=15)
    return tr, history


# ------------------------------------------------------------------ learning

def test_cnn_from_scratch_reaches_97_percent_on_digits(trained_cnn, digits):
    tr, history = trained_cnn
    loss, acc = tr.evaluate(digits.x_test, digits.y_test)
    assert acc >= 0.97, f"test accuracy {acc:.4f}"
    assert history.loss[-1] < history.loss[0] / 10
    assert history.num_samples == len(digits.x_train)
    assert len(history.epochs) == 15 and history.epochs[-1].steps == -(-len(digits.x_train) // 32)


def test_batchnorm_cnn_with_adam_learns(digits):
    tr = Trainer(zoo.digits_cnn(seed=1, batch_norm=True), optimizer="adam", lr=3e-3, seed=0)
    tr.fit((digits.x_train, digits.y_train), epochs=6)
    _, acc = tr.evaluate(digits.x_test, digits.y_test)
    assert acc >= 0.95
    stats = tr.get_weights()
    assert not np.allclose(stats["bn0.mean"], 0.0) and not np.allclose(stats["bn0.var"], 1.0)


def test_head_only_fine_tuning_converges_and_leaves_the_body_alone(digits):
    """Pre-train on digits 0-4 only; then train only a fresh head on all ten classes."""
    low = digits.y_train < 5
    pre = Trainer(zoo.digits_cnn(seed=0), lr=0.05, momentum=0.9, seed=0)
    pre.fit((digits.x_train[low], digits.y_train[low]), epochs=8)
    ft = Trainer(pre.to_onnx(), freeze=["conv", "fc0"], lr=0.05, momentum=0.9, seed=1)
    assert ft.trainable_names == ["fc1.weight", "fc1.bias"]
    assert not any(st.differentiable for st in ft.tape.steps if st.node.op_type == "Conv")
    rng = np.random.default_rng(5)
    shape = ft.get_weights()["fc1.weight"].shape
    ft.set_weights({"fc1.weight": (rng.standard_normal(shape) * 0.1).astype(np.float32),
                    "fc1.bias": np.zeros(10, np.float32)})
    body = {k: v for k, v in ft.get_weights().items() if not k.startswith("fc1")}
    _, before = ft.evaluate(digits.x_test, digits.y_test)
    history = ft.fit((digits.x_train, digits.y_train), epochs=10)
    _, after = ft.evaluate(digits.x_test, digits.y_test)
    assert before < 0.3 and after >= 0.88, (before, after)
    assert history.loss[-1] < 0.5 * history.loss[0]
    for k, v in ft.get_weights().items():
        if k in body:
            np.testing.assert_array_equal(v, body[k], err_msg=k)


def test_mlp_regression_with_mse():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
    tr = Trainer(zoo.mlp((4, 16, 1), seed=0), loss="mse", optimizer="adam", lr=1e-2, seed=0)
    h = tr.fit((x, y), epochs=30)
    loss, acc = tr.evaluate(x, y)
    assert acc is None and loss < 0.05 * h.loss[0]


def test_binary_cross_entropy_on_logits():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((300, 2)).astype(np.float32)
    y = (x[:, :1] + x[:, 1:] > 0).astype(np.float32)
    tr = Trainer(zoo.mlp((2, 8, 1), seed=0), loss="bce", optimizer="adam", lr=1e-2, seed=0)
    tr.fit((x, y), epochs=20)
    _, acc = tr.evaluate(x, y)
    assert acc >= 0.95


# ------------------------------------------------------------------ export

def test_export_is_checker_clean_and_served_by_onnxruntime(trained_cnn, digits, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    tr, _ = trained_cnn
    path = tmp_path / "trained.onnx"
    tr.export(path)
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    src = zoo.digits_cnn(seed=0)
    assert [i.name for i in model.graph.input] == [i.name for i in src.graph.input]
    assert [o.name for o in model.graph.output] == [o.name for o in src.graph.output]
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in src.graph.node]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ours = tr.predict(digits.x_test)
    theirs = sess.run(None, {"input": digits.x_test})[0]
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
    from edgeflow.runtime.session import load

    rt = load(model, "x86-gateway", backend="numpy")
    np.testing.assert_allclose(rt(digits.x_test), ours, rtol=1e-4, atol=1e-4)
    # the initializers changed, with their dtype kept
    t = {i.name: i for i in model.graph.initializer}
    assert t["conv0.weight"].data_type == TensorProto.FLOAT
    assert not np.array_equal(numpy_helper.to_array(t["conv0.weight"]),
                              numpy_helper.to_array(next(i for i in src.graph.initializer if i.name == "conv0.weight")))


# ------------------------------------------------------------------ federated client API

def test_weights_roundtrip_delta_and_validation(digits):
    tr = Trainer(zoo.digits_mlp(seed=0), lr=0.1, seed=0)
    start = tr.get_weights()
    assert all(v.dtype == np.float32 for v in start.values())
    tr.fit((digits.flat().x_train[:200], digits.y_train[:200]), epochs=1)
    delta = tr.delta_from(start)
    assert set(delta) == set(start)
    for k in start:
        np.testing.assert_allclose(start[k] + delta[k], tr.get_weights()[k], atol=1e-6)
    tr.set_weights(start)
    assert all(np.array_equal(v, start[k]) for k, v in tr.get_weights().items())
    with pytest.raises(InputError, match="unknown weight"):
        tr.set_weights({"nope": np.zeros(3, np.float32)})
    with pytest.raises(ShapeError, match="fc0.weight"):
        tr.set_weights({"fc0.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(InputError, match="finite"):
        tr.set_weights({"fc0.bias": np.full(64, np.nan, np.float32)})
    with pytest.raises(InputError, match="missing"):
        tr.set_weights({"fc0.bias": start["fc0.bias"]}, strict=True)
    # a rejected call wrote nothing
    assert all(np.array_equal(v, start[k]) for k, v in tr.get_weights().items())


def test_same_seed_same_result_different_seed_different(digits):
    def run(seed):
        tr = Trainer(zoo.digits_mlp(seed=0), lr=0.05, momentum=0.9, seed=seed)
        tr.fit((digits.flat().x_train[:300], digits.y_train[:300]), epochs=2)
        return tr.get_weights()

    a, b, c = run(7), run(7), run(8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], c[k]) for k in a)


def test_fedprox_adds_the_proximal_gradient(digits):
    x, y = digits.flat().x_train[:64], digits.y_train[:64]
    plain = Trainer(zoo.digits_mlp(seed=0), dtype="float64")
    prox = Trainer(zoo.digits_mlp(seed=0), dtype="float64", proximal_mu=0.5)
    anchor = {k: v + 0.1 for k, v in plain.get_weights().items()}
    g = plain.gradients(x, y)
    prox.step(x, y, anchor={k: v.astype(np.float64) for k, v in anchor.items()})
    expected = prox.last_gradients
    for k in g:
        np.testing.assert_allclose(expected[k], g[k] + 0.5 * (plain.get_weights()[k] - anchor[k]), rtol=1e-5,
                                   atol=1e-6)


def test_fedprox_keeps_local_weights_closer_to_the_global_model(digits):
    x, y = digits.flat().x_train, digits.y_train
    drift = {}
    for mu in (0.0, 1.0):
        tr = Trainer(zoo.digits_mlp(seed=0), lr=0.05, momentum=0.9, seed=0, proximal_mu=mu)
        start = tr.get_weights()
        tr.fit((x[y < 3], y[y < 3]), epochs=3)  # a skewed client
        drift[mu] = np.sqrt(sum(float((d ** 2).sum()) for d in tr.delta_from(start).values()))
    assert drift[1.0] < 0.8 * drift[0.0]


def test_dropout_trains_with_fresh_seeded_masks():
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
         helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Dropout", ["r", "ratio"], ["d"], seed=3),
         helper.make_node("Gemm", ["d", "w2", "b2"], ["y"], transB=1)],
        "drop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(a, n) for n, a in {
            "w1": np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32),
            "b1": np.zeros(16, np.float32),
            "w2": np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32),
            "b2": np.zeros(3, np.float32), "ratio": np.array(0.5, np.float32)}.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    tr = Trainer(model, seed=0, dtype="float64")
    assert "ratio" not in tr.trainable_names
    x, y = np.random.default_rng(2).standard_normal((8, 4)), np.array([0, 1, 2, 0, 1, 2, 0, 1])
    g1 = tr.gradients(x, y)
    tr.global_step += 1  # the next step draws another mask
    g2 = tr.gradients(x, y)
    tr.global_step -= 1
    g1b = tr.gradients(x, y)
    assert not np.allclose(g1["w1"], g2["w1"])
    np.testing.assert_array_equal(g1["w1"], g1b["w1"])
    # inference is deterministic and mask-free
    np.testing.assert_array_equal(tr.predict(x), tr.predict(x))


# ------------------------------------------------------------------ bad input

def test_nan_loss_stops_and_keeps_last_good_weights(digits):
    x, y = digits.flat().x_train, digits.y_train
    tr = Trainer(zoo.digits_mlp(seed=0), lr=1e4, momentum=0.9, seed=0)
    snapshots = []
    with pytest.raises(TrainingError, match="loss became") as info:
        tr.fit((x * 100, y), epochs=5, on_batch=lambda r: snapshots.append(tr.get_weights()))
    assert "learning rate" in str(info.value)
    last_good = snapshots[-1]
    now = tr.get_weights()
    assert all(np.isfinite(v).all() for v in now.values())
    assert all(np.array_equal(now[k], last_good[k]) for k in now)


def test_op_without_backward_is_named_at_construction():
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w1"], ["h"], transB=1, name="fc"),
         helper.make_node("Celu", ["h"], ["e"], name="the_celu"),
         helper.make_node("Gemm", ["e", "w2"], ["y"], transB=1, name="head")],
        "elu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(np.ones((4, 3), np.float32), "w1"),
         numpy_helper.from_array(np.ones((2, 4), np.float32), "w2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(TrainingError, match=r"Celu \(node 'the_celu'\)"):
        Trainer(model)
    assert Trainer(model, freeze=["w1"]).trainable_names == ["w2"]  # the Celu is off the gradient path


def test_labels_out_of_range_and_wrong_shapes(digits):
    tr = Trainer(zoo.digits_mlp(seed=0))
    x, y = digits.flat().x_train[:10], digits.y_train[:10]
    bad = y.copy()
    bad[7] = 10
    with pytest.raises(InputError, match=r"label 10 at sample 7 is out of range \[0, 9\]"):
        tr.fit((x, bad))
    with pytest.raises(InputError, match="label -1"):
        tr.step(x, np.where(np.arange(10) == 3, -1, y))
    with pytest.raises(ShapeError, match=r"expects shape \(N, 64\)"):
        tr.fit((digits.x_train[:10], y))
    with pytest.raises(ShapeError, match=r"dimension 1 is 63"):
        tr.step(x[:, :63], y)
    with pytest.raises(ShapeError, match="10 inputs but 9 labels"):
        tr.step(x, y[:9])
    with pytest.raises(ShapeError):
        tr.step(x, np.zeros((10, 3), np.float32))  # soft targets of the wrong width
    assert tr.global_step == 0


def test_generator_data_source(digits):
    x, y = digits.flat().x_train[:100], digits.y_train[:100]

    def chunks():
        for i in range(0, 100, 13):
            yield x[i:i + 13], y[i:i + 13]

    tr = Trainer(zoo.digits_mlp(seed=0), batch_size=32)
    h = tr.fit(chunks, epochs=2)
    assert [e.samples for e in h.epochs] == [100, 100] and h.epochs[0].steps == 4
    with pytest.raises(InputError, match="exhausted"):
        tr.fit(chunks(), epochs=2)


def test_configuration_errors():
    m = zoo.digits_mlp(seed=0)
    with pytest.raises(TrainingError, match="match no weight"):
        Trainer(m, freeze=["conv"])
    with pytest.raises(TrainingError, match="no weight is left"):
        Trainer(m, freeze=["fc"])
    with pytest.raises(TrainingError, match="unknown loss"):
        Trainer(m, loss="hinge")
    with pytest.raises(TrainingError, match="unknown optimizer"):
        Trainer(m, optimizer="lamb")
    with pytest.raises(TrainingError, match="learning rate"):
        Trainer(m, lr=-1.0)
    with pytest.raises(ModelError):
        Trainer(b"not a model")
    with pytest.raises(TrainingError, match="does not train"):
        Trainer(m, profile="beaglebone-black")


def test_data_loader_is_accepted_directly(digits):
    d = from_arrays(digits.flat().x_train[:64], digits.y_train[:64])
    tr = Trainer(zoo.digits_mlp(seed=0))
    h = tr.fit(DataLoader(d, 16, seed=1), epochs=1)
    assert h.epochs[0].steps == 4
