"""Training a model with several inputs (issue 15): x as a dict of per-sample arrays keyed by input
name, fixed arrays by ``feeds=``, a TrainingError naming an input that has no data (it was a bare
KeyError), and ``edgeflow train --input`` / a .npz with one array per input name.

The real case is the suite's transformer encoder (MiniLM: input_ids + attention_mask) with a small
classification head on its pooled embedding, fine-tuned in bias (TinyTL) and head mode on a tiny
labeled task; a two-input toy model covers the same paths without the suite's cache.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeflow import model_suite as ms
from edgeflow.cli.main import main
from edgeflow.errors import InputError, ShapeError, TrainingError
from edgeflow.runtime.model import fix_input_shapes
from edgeflow.train import Trainer

LM = "minilm-l3-paraphrase"
SEQ = 8


def _two_inputs() -> onnx.ModelProto:
    """logits = (a + b) @ w + c, a and b float (N, 4)."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Gemm", ["s", "w", "c"], ["logits"])],
        "two", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4]),
                helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(np.zeros(3, np.float32), "c")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _toy_data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, 4)).astype(np.float32)
    b = rng.standard_normal((n, 4)).astype(np.float32)
    return a, b, np.argmax((a + b)[:, :3], axis=1)


def test_a_dict_of_inputs_trains_and_a_missing_input_is_named():
    a, b, y = _toy_data()
    t = Trainer(_two_inputs(), lr=0.1, batch_size=8)
    before = t.evaluate({"a": a, "b": b}, y)[0]
    t.fit(({"a": a, "b": b}, y), epochs=5)
    assert t.evaluate({"a": a, "b": b}, y)[0] < before
    assert t.predict({"a": a, "b": b}).shape == (len(a), 3)
    with pytest.raises(TrainingError, match=r"\['b'\] have no data") as e:
        Trainer(_two_inputs(), input="a").step(a[:4], y[:4])  # was KeyError: 'b'
    assert "\n" not in str(e.value)
    with pytest.raises(TrainingError, match="give x as a dict"):
        Trainer(_two_inputs()).step(a[:4], y[:4])
    with pytest.raises(TrainingError, match=r"\['z'\], which are not inputs"):
        t.step({"a": a[:4], "b": b[:4], "z": a[:4]}, y[:4])
    with pytest.raises(ShapeError, match="different numbers of samples"):
        t.step({"a": a[:4], "b": b[:3]}, y[:4])
    with pytest.raises(InputError, match="NaN"):
        t.step({"a": np.full((4, 4), np.nan, np.float32), "b": b[:4]}, y[:4])


def test_fit_reads_a_npz_with_one_array_per_input(tmp_path):
    a, b, y = _toy_data()
    np.savez(tmp_path / "d.npz", a=a, b=b, y=y)
    t = Trainer(_two_inputs(), lr=0.1, batch_size=8)
    before = t.evaluate({"a": a, "b": b}, y)[0]
    assert t.fit(str(tmp_path / "d.npz"), epochs=3).num_samples == len(y)
    assert t.evaluate({"a": a, "b": b}, y)[0] < before


def test_fixed_feeds_and_a_plain_x_for_the_named_input():
    a, b, y = _toy_data()
    zero = np.zeros((1, 4), np.float32)  # the same for every sample, broadcast by Add
    t = Trainer(_two_inputs(), input="a", feeds={"b": zero}, lr=0.1, batch_size=8)
    before = t.evaluate(a, y)[0]
    t.fit((a, y), epochs=5)
    assert t.evaluate(a, y)[0] < before
    with pytest.raises(TrainingError, match="not inputs"):
        Trainer(_two_inputs(), input="a", feeds={"q": zero})


def test_cli_trains_a_two_input_model_from_one_array_per_input(tmp_path, capsys):
    a, b, y = _toy_data()
    onnx.save(_two_inputs(), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", a=a, b=b, y=y)
    np.savez(tmp_path / "x.npz", x=a, b=b, y=y)
    np.savez(tmp_path / "only.npz", x=a, y=y)
    base = ["train", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx"), "--profile", "x86-gateway",
            "--batch-size", "8"]
    assert main(base + ["--data", str(tmp_path / "d.npz"), "--val-fraction", "0.25"]) == 0
    assert "val_loss" in capsys.readouterr().out
    assert main(base + ["--data", str(tmp_path / "x.npz"), "--input", "a"]) == 0
    assert "saved" in capsys.readouterr().out
    assert main(base + ["--data", str(tmp_path / "x.npz")]) == 0  # x feeds the one input left: a
    capsys.readouterr()
    assert main(base + ["--data", str(tmp_path / "only.npz"), "--input", "a"]) == 2
    err = capsys.readouterr().err
    assert "input(s) ['b']" in err and "np.savez(path, a=..., b=..., y=...)" in err and "Traceback" not in err
    assert main(base + ["--data", str(tmp_path / "only.npz")]) == 2
    assert "--input NAME" in capsys.readouterr().err
    assert main(base + ["--data", str(tmp_path / "d.npz"), "--input", "nope"]) == 2
    assert "not an input of the model" in capsys.readouterr().err


# ------------------------------------------------------------------ MiniLM (real-model suite)


@pytest.fixture(scope="module")
def minilm():
    """MiniLM-L3 with a 2-class Gemm head on its pooled (N, 384) sentence embedding."""
    if not ms.cached(LM):
        pytest.skip(f"{LM} is not in the real-model suite's cache (python -m edgeflow models fetch {LM})")
    m = ms.load(LM)
    rng = np.random.default_rng(0)
    g = m.graph
    g.initializer.extend([
        numpy_helper.from_array((rng.uniform(-1, 1, (384, 2)) / np.sqrt(384)).astype(np.float32), "head.w"),
        numpy_helper.from_array(np.zeros(2, np.float32), "head.b")])
    g.node.extend([helper.make_node("Gemm", ["461", "head.w", "head.b"], ["logits"], name="head")])
    del g.output[:]
    g.output.extend([helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", 2])])
    return m


def _task(n=8, seed=0):
    """Label 1: the sentence has token 2023 at position 1; some trailing tokens are padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 2000, (n, SEQ))
    y = np.arange(n) % 2
    ids[y == 1, 1] = 2023
    mask = np.ones((n, SEQ), np.int64)
    mask[::3, -2:] = 0
    return ids, mask, y


def test_minilm_bias_mode_loss_decreases_with_a_dict_of_inputs(minilm):
    m = fix_input_shapes(minilm, {"sequence_length": SEQ})
    ids, mask, y = _task()
    with pytest.raises(TrainingError, match=r"\['attention_mask'\] have no data"):
        Trainer(m, input="input_ids", mode="bias").step(ids[:4], y[:4])
    t = Trainer(m, mode="bias", optimizer="adam", lr=1e-3, batch_size=4, seed=0)
    assert "input_ids" in t.inputs and t.input_name is None
    assert any("attention" in n for n in t.trainable_names) and "head.w" in t.trainable_names
    x = {"input_ids": ids, "attention_mask": mask}
    before = t.evaluate(x, y)[0]
    h = t.fit((x, y), epochs=2)
    assert t.global_step == 4 and h.num_samples == len(y)
    after = t.evaluate(x, y)[0]
    assert after < before, (before, after)


def test_minilm_head_mode_with_a_fixed_mask_and_the_cli(minilm, tmp_path, capsys):
    m = fix_input_shapes(minilm, {"sequence_length": SEQ})
    ids, _, y = _task(seed=1)
    ones = np.ones((1, SEQ), np.int64)  # one mask for every sample, broadcast by the model
    t = Trainer(m, input="input_ids", feeds={"attention_mask": ones}, mode="head", optimizer="adam", lr=5e-2,
                batch_size=8, seed=0)
    before = t.evaluate(ids, y)[0]
    for _ in range(3):
        t.step(ids, y)
    assert t.evaluate(ids, y)[0] < before

    onnx.save(minilm, tmp_path / "lm.onnx")  # sequence_length open in the file: the data fixes it
    np.savez(tmp_path / "d.npz", x=ids, attention_mask=np.ones_like(ids), y=y)
    assert main(["train", str(tmp_path / "lm.onnx"), "--data", str(tmp_path / "d.npz"), "--input", "input_ids",
                 "--mode", "head", "-o", str(tmp_path / "t.onnx"), "--profile", "x86-gateway", "--batch-size", "8",
                 "--optimizer", "adam", "--json"]) == 0
    out = capsys.readouterr().out
    import json

    doc = json.loads(out)
    assert doc["trainable"] == ["head.w", "head.b"] and doc["step"] == 1 and doc["resumed_from"] is None
