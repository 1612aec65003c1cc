"""Models exported with a fixed batch train (issue 30): steps run in micro-batches of the exported
size with gradient accumulation, and the exported graph keeps its batch."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from edgeflow import zoo
from edgeflow.cli.main import main
from edgeflow.data.datasets import load_digits
from edgeflow.runtime.model import fix_input_shapes
from edgeflow.train import Trainer


def _fixed(batch: int) -> onnx.ModelProto:
    m = fix_input_shapes(zoo.digits_mlp(seed=0), {"input": [batch, 64]})
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_value = batch
    return m


@pytest.fixture(scope="module")
def digits():
    s = load_digits(seed=0).flat()
    return s.x_train[:64].astype(np.float32), s.y_train[:64]


@pytest.mark.parametrize("batch", [1, 4])
def test_a_fixed_batch_model_gets_the_free_models_gradients(batch, digits):
    x, y = digits
    free, fixed = Trainer(zoo.digits_mlp(seed=0), seed=0), Trainer(_fixed(batch), seed=0)
    assert fixed.fixed_batch == batch and free.fixed_batch is None and fixed.micro_batch == batch
    g_free, g_fixed = free.gradients(x[:32], y[:32]), fixed.gradients(x[:32], y[:32])
    assert g_free.keys() == g_fixed.keys()
    for k in g_free:
        np.testing.assert_allclose(g_fixed[k], g_free[k], rtol=1e-4, atol=1e-6)
    assert fixed.predict(x[:7]).shape == (7, 10)  # a last chunk shorter than the batch is padded, then cut
    np.testing.assert_allclose(fixed.predict(x[:7]), free.predict(x[:7]), rtol=1e-5, atol=1e-6)


def test_a_batch_that_is_not_a_multiple_leaves_its_remainder_out_and_counts_it(digits):
    x, y = digits
    t = Trainer(_fixed(4), seed=0, batch_size=8)
    t.fit((x[:30], y[:30]), epochs=1, shuffle=False)  # batches 8, 8, 8, 6: two samples left out
    assert t.skipped_samples == 2
    with pytest.raises(Exception, match="smaller than the model's fixed batch of 4"):
        t.gradients(x[:3], y[:3])


def test_cli_trains_a_batch_1_export_and_keeps_its_batch(tmp_path, capsys, digits):
    x, y = digits
    model, data, out = tmp_path / "b1.onnx", tmp_path / "d.npz", tmp_path / "t.onnx"
    onnx.save(_fixed(1), str(model))
    np.savez(data, x=x, y=y)
    rc = main(["train", str(model), "--data", str(data), "-o", str(out), "--epochs", "2", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["fixed_batch"] == 1 and rep["micro_batch"] == 1 and rep["skipped_samples"] == 0
    trained = onnx.load(str(out))
    assert trained.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 1
    assert rep["epochs"][-1]["loss"] < rep["epochs"][0]["loss"]
    assert main(["train", str(model), "--data", str(data), "-o", str(out), "--batch-size", "1"]) == 0


def test_cli_batch_size_below_the_fixed_batch_is_one_line(tmp_path, capsys, digits):
    x, y = digits
    model, data = tmp_path / "b4.onnx", tmp_path / "d.npz"
    onnx.save(_fixed(4), str(model))
    np.savez(data, x=x, y=y)
    rc = main(["train", str(model), "--data", str(data), "-o", str(tmp_path / "t.onnx"), "--batch-size", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "has a fixed batch of 4 in the model: --batch-size must be at least 4" in err
