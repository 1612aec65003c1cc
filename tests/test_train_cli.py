"""``edgeflow train``: trains, reports per epoch, writes a servable model, and fails clearly."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from edgeflow import zoo
from edgeflow.cli.main import main
from edgeflow.data.datasets import load_digits


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cli")
    d = load_digits()
    np.savez(root / "digits.npz", x=d.x_train, y=d.y_train)
    np.savez(root / "test.npz", x=d.x_test, y=d.y_test)
    onnx.save(zoo.digits_cnn(seed=0), root / "cnn.onnx")
    return root


def test_train_writes_a_model_and_prints_epochs(files, capsys):
    out = files / "trained.onnx"
    rc = main(["train", str(files / "cnn.onnx"), "--data", str(files / "digits.npz"), "--epochs", "3",
               "--profile", "raspberry-pi-4", "-o", str(out), "--lr", "0.05", "--val", str(files / "test.npz")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "epoch 1/3" in text and "epoch 3/3" in text and "val_accuracy" in text and "saved" in text
    model = onnx.load(out)
    onnx.checker.check_model(model)
    from edgeflow.runtime.session import load

    d = load_digits()
    acc = (load(model, "raspberry-pi-4", backend="numpy")(d.x_test).argmax(1) == d.y_test).mean()
    assert acc > 0.85


def test_train_json_head_only(files, capsys):
    rc = main(["train", str(files / "cnn.onnx"), "--data", str(files / "digits.npz"), "--epochs", "2",
               "--freeze", "conv", "--freeze", "fc0", "--optimizer", "adam", "--json",
               "--profile", "x86-gateway", "-o", str(files / "head.onnx")])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trainable"] == ["fc1.weight", "fc1.bias"]
    assert len(doc["epochs"]) == 2 and doc["num_samples"] == len(load_digits().x_train)
    assert doc["memory_plan"]["peak_bytes"] > 0


def test_train_errors_are_one_line_messages(files, capsys):
    args = ["train", str(files / "cnn.onnx"), "--data", str(files / "digits.npz"), "-o", str(files / "x.onnx")]
    assert main(args + ["--profile", "beaglebone-black"]) == 2
    assert "can_train" in capsys.readouterr().err
    bad = files / "bad.npz"
    d = load_digits()
    np.savez(bad, x=d.x_train[:50], y=np.full(50, 11))
    assert main(["train", str(files / "cnn.onnx"), "--data", str(bad), "-o", str(files / "x.onnx"),
                 "--profile", "x86-gateway"]) == 2
    assert "label 11" in capsys.readouterr().err
    assert main(["train", str(files / "cnn.onnx"), "--data", str(files / "digits.npz"), "-o", str(files / "x.onnx"),
                 "--profile", "raspberry-pi-zero-2w", "--batch-size", "100000"]) == 2
    assert "grad-accumulation" in capsys.readouterr().err
