"""The edgeflow command: each subcommand on a model built here, human and --json output."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import onnx
import pytest

from edgeflow import zoo
from edgeflow.cli.main import main


@pytest.fixture(scope="module")
def cnn_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("m") / "cnn.onnx"
    onnx.save(zoo.small_cnn((1, 16, 16), channels=(8, 16), hidden=32), p)
    return p


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("profile", "inspect", "run", "bench"):
        assert cmd in out
    assert "examples:" in out


def test_profile_list_and_show(capsys):
    assert main(["profile", "list", "--json"]) == 0
    names = {p["name"] for p in _json(capsys)}
    assert "raspberry-pi-4" in names
    assert main(["profile", "show", "visionfive-2", "--json"]) == 0
    assert _json(capsys)["backends"] == ["numpy"]
    assert main(["profile", "show", "raspberry-pi-4"]) == 0
    shown = capsys.readouterr().out
    assert "train_memory_budget_mb: 0 (= memory_budget_mb: 1024 MiB" in shown, "the budget in force, not a bare 0"
    assert "    format: qdq" in shown and "{" not in shown, "nested settings one per line"
    assert main(["profile", "show", "nope"]) == 2
    assert "unknown device profile 'nope'" in capsys.readouterr().err


def test_inspect(cnn_path, capsys):
    assert main(["inspect", str(cnn_path), "--json"]) == 0
    info = _json(capsys)
    assert info["op_counts"]["Conv"] == 2
    assert info["backends"]["numpy"]["can_run"] and info["backends"]["ort"]["can_run"]
    assert info["memory_plan"]["peak_bytes"] > info["num_parameters"] * 4
    assert main(["inspect", str(cnn_path)]) == 0
    assert "backend numpy: can run" in capsys.readouterr().out


def test_run_matches_library(cnn_path, tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((3, 1, 16, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "y.npz"
    assert main(["run", str(cnn_path), "-i", str(tmp_path / "x.npy"), "--backend", "numpy", "-o", str(out), "--json"]) == 0
    res = _json(capsys)
    assert res["backend"] == "numpy"
    got = np.asarray(res["outputs"]["logits"]["data"], dtype=np.float32)
    from edgeflow.runtime.session import load

    np.testing.assert_allclose(got, load(cnn_path, backend="ort")(x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.load(out)["logits"], got, rtol=1e-6)


def test_run_bad_input_file(cnn_path, tmp_path, capsys):
    assert main(["run", str(cnn_path), "-i", str(tmp_path / "missing.npy")]) == 2
    assert "input file not found" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.zeros((2, 3), np.float32))
    assert main(["run", str(cnn_path), "-i", str(tmp_path / "bad.npy")]) == 2
    assert "input 'input' has rank 4 in the model [N, 1, 16, 16], the --input array gives 2 dims [2, 3]" in capsys.readouterr().err


def test_bench(cnn_path, capsys):
    assert main(["bench", str(cnn_path), "--batch", "4", "--runs", "5", "--warmup", "1", "--backend", "numpy", "--json"]) == 0
    r = _json(capsys)
    assert r["runs"] == 5 and r["batch_size"] == 4
    assert 0 < r["p50_ms"] <= r["p95_ms"]
    assert r["peak_rss_bytes"] > 0


def test_installed_entry_point(cnn_path):
    exe = shutil.which("edgeflow")
    if exe is None:
        pytest.skip("the edgeflow console script is not on PATH (package not installed)")
    out = subprocess.run([exe, "inspect", str(cnn_path), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["node_count"] == 10


@pytest.fixture(scope="module")
def random_draw_path(tmp_path_factory):
    """A model with ops the numpy backend leaves out (random draws), one of them inside an If branch."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    flag = helper.make_tensor_value_info("flag", TensorProto.BOOL, [])
    then = helper.make_graph([helper.make_node("Bernoulli", ["p"], ["b"], name="bern_in", seed=2.0)], "then", [],
                             [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])])
    other = helper.make_graph([helper.make_node("Identity", ["p"], ["c"], name="keep")], "else", [],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 3])])
    nodes = [helper.make_node("RandomUniformLike", ["x"], ["p"], name="draw", seed=1.0),
             helper.make_node("If", ["flag"], ["y"], name="n12", then_branch=then, else_branch=other)]
    g = helper.make_graph(nodes, "g", [x, flag], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    path = tmp_path_factory.mktemp("rand") / "rand.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    feeds = path.with_name("in.npz")
    np.savez(feeds, x=np.ones((2, 3), np.float32), flag=np.array(True))
    return path


@pytest.mark.parametrize("command", ["run", "bench"])
def test_an_op_without_a_kernel_names_op_opset_and_node(random_draw_path, capsys, command):
    """Issue 13 item 6: the op, its opset and the node (with its subgraph path), in one line; the
    backend asked for with --backend is named as such."""
    extra = ["-i", str(random_draw_path.with_name("in.npz"))] if command == "run" else ["--runs", "1"]
    assert main([command, str(random_draw_path), *extra, "--backend", "numpy", "--profile", "x86-gateway"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "backend 'numpy' (asked for explicitly) cannot run this model" in err
    assert "Bernoulli (opset 17) at If 'n12' / then_branch / node 'bern_in'" in err
    assert "RandomUniformLike (opset 17) at node 'draw'" in err
    # a profile whose only backend is numpy: the reason is the same, per backend
    assert main([command, str(random_draw_path), *extra, "--profile", "raspberry-pi-zero-2w"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "no backend of profile 'raspberry-pi-zero-2w' can run this model (numpy: no kernel for" in err
    assert "Bernoulli (opset 17) at If 'n12' / then_branch / node 'bern_in'" in err
    # onnxruntime runs it
    if command == "run":
        assert main([command, str(random_draw_path), *extra, "--backend", "ort", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["outputs"]["y"]["shape"] == [2, 3]
