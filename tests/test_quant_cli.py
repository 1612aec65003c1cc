"""``edgeflow quantize`` on the command line."""

from __future__ import annotations

import json

import numpy as np
import onnx

from edgeflow import zoo
from edgeflow.cli.main import main


def _files(tmp_path):
    model = tmp_path / "cnn.onnx"
    onnx.save(zoo.digits_cnn(seed=7), str(model))
    rng = np.random.default_rng(0)
    cal = tmp_path / "cal.npz"
    np.savez(cal, input=rng.random((40, 1, 8, 8), dtype=np.float32), labels=rng.integers(0, 10, 40))
    return model, cal


def test_quantize_writes_the_model_and_a_json_report(tmp_path, capsys):
    model, cal = _files(tmp_path)
    out, report = tmp_path / "q.onnx", tmp_path / "report.json"
    rc = main(["quantize", str(model), "--profile", "x86-gateway", "-c", str(cal), "-o", str(out),
               "--engine", "numpy", "--keep-last", "--report", str(report), "--json", "--no-gate"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kept_fp32"]["fc1"] == "last quantizable layer kept in fp32"
    assert printed["quantized_nodes"] == ["conv1", "fc0"]  # conv0: 1 input channel, faster in fp32
    assert printed["n_eval"] == 8 and printed["accuracy_fp32"] is not None  # labels taken from the .npz
    assert json.loads(report.read_text())["quantized_bytes"] == printed["quantized_bytes"]
    q = onnx.load(str(out))
    assert any(n.op_type == "QuantizeLinear" for n in q.graph.node)


def test_quantize_prints_the_report(tmp_path, capsys):
    model, cal = _files(tmp_path)
    rc = main(["quantize", str(model), "--profile", "raspberry-pi-4", "-c", str(cal), "-o", str(tmp_path / "q.onnx"),
               "--method", "entropy", "--engine", "numpy", "--no-sensitivity", "--no-gate"])
    out = capsys.readouterr().out
    assert rc == 0 and "entropy calibration" in out and "activations int8" in out and "wrote" in out


def test_bad_calibration_file_exits_2_with_the_reason(tmp_path, capsys):
    model, _ = _files(tmp_path)
    bad = tmp_path / "bad.npz"
    np.savez(bad, input=np.zeros((4, 1, 8, 8), np.int64))
    rc = main(["quantize", str(model), "--profile", "x86-gateway", "-c", str(bad), "-o", str(tmp_path / "q.onnx"), "--no-gate"])
    err = capsys.readouterr().err
    assert rc == 2 and "dtype int64" in err
    missing = main(["quantize", str(model), "--profile", "x86-gateway", "-c", str(tmp_path / "nope.npz"),
                    "-o", str(tmp_path / "q.onnx"), "--no-gate"])
    assert missing == 2 and "not found" in capsys.readouterr().err
