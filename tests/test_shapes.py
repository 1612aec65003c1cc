"""Dynamic shapes: fixing input dims (fix_input_shapes, --shape), the runtime on
models with dynamic non-batch dims on both backends, and the CLI's one-line errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper

from _graphs import const, dynamic_cnn, make, rand, run_ort
from edgeflow.cli.main import main
from edgeflow.errors import InputError, ShapeError
from edgeflow.runtime.model import fix_input_shapes, graph_inputs, model_info
from edgeflow.runtime.session import load

ort = pytest.importorskip("onnxruntime")


def _dims(model, name="x"):
    return next(t.shape for t in graph_inputs(model) if t.name == name)


# ------------------------------------------------------------------ fix_input_shapes

def test_fixing_dims_reinfers_every_shape():
    m = fix_input_shapes(dynamic_cnn(), {"x": (2, 3, 9, 7)})
    assert _dims(m) == (2, 3, 9, 7)
    vi = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in m.graph.value_info}
    assert vi["c"] == [2, 4, 9, 7] and vi["p"] == [2, 4, 1, 1]


def test_question_mark_and_symbolic_dim_names():
    m = fix_input_shapes(dynamic_cnn(), {"x": (None, 3, 32, 32)})
    assert _dims(m) == ("N", 3, 32, 32)
    m = fix_input_shapes(dynamic_cnn(), {"H": [16], "W": [8]})  # like onnxruntime's free-dimension overrides
    assert _dims(m) == ("N", 3, 16, 8)


def test_a_contradicting_shape_names_the_input_and_the_dim():
    with pytest.raises(ShapeError, match=r"^input 'x' dim 1 is 3 in the model, --shape gives 4$"):
        fix_input_shapes(dynamic_cnn(), {"x": (1, 4, 8, 8)}, source="--shape")
    with pytest.raises(ShapeError, match=r"input 'x' has rank 4 in the model \[N, 3, H, W\], the shape given gives 3"):
        fix_input_shapes(dynamic_cnn(), {"x": (1, 3, 8)})
    with pytest.raises(InputError, match=r"no input 'img'.*its inputs: 'x' \[N, 3, H, W\]; its symbolic dims: H, N, W"):
        fix_input_shapes(dynamic_cnn(), {"img": (1, 3, 8, 8)})
    with pytest.raises(InputError, match="whole numbers"):
        fix_input_shapes(dynamic_cnn(), {"x": (1, 3, -8, 8)})


def test_a_symbol_shared_by_two_inputs_must_agree():
    m = make([helper.make_node("Add", ["a", "b"], ["y"])], [("a", ["N", 2]), ("b", ["N", 2])], [("y", ["N", 2])])
    assert _dims(fix_input_shapes(m, {"a": (3, 2), "b": (3, 2)}), "b") == (3, 2)
    with pytest.raises(ShapeError, match=r"input 'b' dim 0 is 'N', which .*fixed to 3; the shape given gives 4"):
        fix_input_shapes(m, {"a": (3, 2), "b": (4, 2)})


def test_a_shape_the_graph_cannot_take_is_refused_at_once():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = make(nodes, [("x", ["N", "K"])], [("y", ["N", 4])], {"w": np.ones((8, 4), np.float32)})
    assert _dims(fix_input_shapes(m, {"x": (3, 8)})) == (3, 8)
    with pytest.raises(ShapeError, match=r"cannot take inputs of shape x \[3, 5\].*shape inference fails"):
        fix_input_shapes(m, {"x": (3, 5)})


# ------------------------------------------------------------------ the runtime

@pytest.mark.parametrize("backend", ["numpy", "ort"])
def test_dynamic_height_and_width_run_unplanned_on_both_backends(backend):
    m = dynamic_cnn()
    rt = load(m, "x86-gateway", backend=backend)
    assert rt.plan is None and "dynamic dim" in rt.plan_note
    rng = np.random.default_rng(0)
    for shape in [(1, 3, 8, 8), (2, 3, 13, 5)]:
        x = rand(rng, *shape)
        np.testing.assert_allclose(rt(x), run_ort(m, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_input_shapes_fix_the_model_for_every_backend_and_plan_it():
    rt = load(dynamic_cnn(), "x86-gateway", backend="numpy", input_shapes={"x": (1, 3, 16, 16)})
    assert rt.plan is not None and rt.plan.input_shapes == {"x": (1, 3, 16, 16)}
    assert rt.inputs[0].shape == (1, 3, 16, 16)
    with pytest.raises(ShapeError, match="dim 2"):
        rt.run(np.zeros((1, 3, 8, 8), np.float32))
    ort_rt = load(dynamic_cnn(), "x86-gateway", backend="ort", input_shapes={"x": (1, 3, 16, 16)})
    assert ort_rt.inputs[0].shape == (1, 3, 16, 16)


# ------------------------------------------------------------------ the CLI

@pytest.fixture(scope="module")
def dyn_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("dyn") / "dyn.onnx"
    onnx.save(dynamic_cnn(), p)
    return p


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("backend", ["numpy", "ort"])
def test_run_takes_its_shapes_from_the_input_array(dyn_path, tmp_path, capsys, backend):
    x = rand(np.random.default_rng(1), 2, 3, 11, 6)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(dyn_path), "-i", str(tmp_path / "x.npy"), "--backend", backend, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    np.testing.assert_allclose(np.array(out["outputs"]["y"]["data"], np.float32), run_ort(dynamic_cnn(), {"x": x})[0],
                               rtol=1e-5, atol=1e-5)
    assert main(["run", str(dyn_path), "-i", str(tmp_path / "x.npy"), "--shape", "x=2x3x11x7"]) == 2
    assert "--shape x=2x3x11x7 disagrees with the --input array 'x' of shape 2x3x11x6" in _err(capsys)


@pytest.mark.parametrize("backend", ["numpy", "ort"])
def test_bench_with_shape(dyn_path, capsys, backend):
    assert main(["bench", str(dyn_path), "--runs", "3", "--warmup", "1", "--backend", backend,
                 "--shape", "x=2x3x20x12", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["input_shapes"] == {"x": [2, 3, 20, 12]} and r["batch_size"] == 2
    assert (r["planned_peak_bytes"] or 0) > 0
    assert main(["bench", str(dyn_path), "--runs", "2", "--shape", "H=9", "--shape", "W=9", "--batch", "3",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["input_shapes"] == {"x": [3, 3, 9, 9]}


@pytest.mark.parametrize("args,message", [
    ([], "input 'x' has dynamic dim(s) 2 ('H'), 3 ('W'); give its shape with --shape x=1x3x<H>x<W>"),
    (["--shape", "x=1x4x8x8"], "input 'x' dim 1 is 3 in the model, --shape gives 4"),
    (["--shape", "img=1x3x8x8"], "the model has no input 'img' (--shape); its inputs: 'x' [N, 3, H, W]"),
    (["--shape", "x=1x3x8"], "input 'x' has rank 4 in the model [N, 3, H, W], --shape gives 3 dims [1, 3, 8]"),
    (["--shape", "x=1x3xHx8"], "--shape 'x=1x3xHx8': write NAME=DIMS"),
    (["--shape", "x=1x3x8x8", "--shape", "x=2x3x8x8"], "--shape names 'x' twice"),
    (["--shape", "x=2x3x8x8", "--batch", "4"], "input 'x' dim 0 is 2 in the model (with --shape), --batch gives 4"),
])
def test_bench_bad_shapes_are_one_line(dyn_path, capsys, args, message):
    assert main(["bench", str(dyn_path), "--runs", "1", *args]) == 2
    err = _err(capsys)
    assert message in err and "input_shapes" not in err


def test_inspect_with_shape_plans_memory_and_shows_the_optimizer(dyn_path, capsys):
    assert main(["inspect", str(dyn_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "--shape x=1x3x<H>x<W>" in info["memory_plan"]["error"]
    assert main(["inspect", str(dyn_path), "--shape", "x=1x3x32x32", "--optimized", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["inputs"][0]["shape"] == [1, 3, 32, 32]
    assert info["memory_plan"]["peak_bytes"] > 0
    opt = info["optimized"]
    assert opt["nodes_before"] == 11 and opt["nodes_after"] == 5
    assert opt["numpy"] == {"Conv+Relu": 1, "GlobalAveragePool": 1, "Gemm": 1, "Reshape": 1}
    assert main(["inspect", str(dyn_path), "--shape", "x=1x3x32x32", "--optimized"]) == 0
    out = capsys.readouterr().out
    assert "optimizer: 11 -> 5 nodes (fold -6)" in out and "Conv+Relu" in out


def test_inspect_counts_constant_node_weights(tmp_path, capsys):
    rng = np.random.default_rng(2)
    w = rand(rng, 64, 32)
    m = make([const("w", w), helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [1, 64])], [("y", [1, 32])])
    onnx.save(m, tmp_path / "c.onnx")
    assert model_info(m).num_parameters == 64 * 32
    assert main(["inspect", str(tmp_path / "c.onnx"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_parameters"] == 64 * 32 and info["parameter_bytes"] == 64 * 32 * 4


def test_train_takes_shape(tmp_path, capsys):
    """A conv net with dynamic H/W trains: --data fixes them (the batch stays dynamic), or --shape does."""
    rng = np.random.default_rng(3)
    path = tmp_path / "dyn.onnx"
    onnx.save(dynamic_cnn(), path)
    x = rand(rng, 32, 3, 6, 6)
    y = rng.integers(0, 5, 32)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    args = ["train", str(path), "-d", str(tmp_path / "d.npz"), "-o", str(tmp_path / "t.onnx"), "-b", "8"]
    assert main(args + ["--json"]) == 0  # H and W from the training data
    assert json.loads(capsys.readouterr().out)["epochs"][0]["samples"] == 32
    assert main(args + ["--shape", "x=?x3x6x6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epochs"][0]["samples"] == 32


def test_quantize_takes_shape(tmp_path, capsys):
    path = tmp_path / "dyn.onnx"
    onnx.save(dynamic_cnn(), path)
    np.save(tmp_path / "cal.npy", rand(np.random.default_rng(4), 16, 3, 8, 8))
    args = ["quantize", str(path), "--profile", "x86-gateway", "-c", str(tmp_path / "cal.npy"),
            "-o", str(tmp_path / "q.onnx"), "--engine", "numpy", "--no-sensitivity", "--json"]
    assert main(args + ["--shape", "x=?x3x8x8"]) == 0
    q = onnx.load(tmp_path / "q.onnx")
    assert [d.dim_value for d in q.graph.input[0].type.tensor_type.shape.dim][1:] == [3, 8, 8]
    capsys.readouterr()
    assert main(args + ["--shape", "x=?x3x9x8"]) == 2
    assert "calibration data for input 'x' has shape (16, 3, 8, 8)" in _err(capsys)


def test_anonymous_free_dims_are_not_one_symbol():
    """Paddle exports name every free dim "?" (or write -1): fixing one must not fix the others."""
    import onnx
    from onnx import TensorProto, helper

    from edgeflow.runtime.model import fix_input_shapes, graph_inputs

    for free in ("?", -1):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [free, 3, 8, free])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
        m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
        if free == -1:  # make_tensor_value_info refuses -1: write it as Paddle does
            m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -1
            m.graph.input[0].type.tensor_type.shape.dim[3].dim_value = -1
        fixed = fix_input_shapes(m, {"x": [1, 3, 8, 192]})
        assert tuple(graph_inputs(fixed)[0].shape) == (1, 3, 8, 192)
        onnx.checker.check_model(fixed)


# ------------------------------------------------------------------ onnxruntime gets the model as given

def _two_branch_model() -> onnx.ModelProto:
    """x [N, T] and a sample rate: If sr == 16000 reshapes x to rows of 64, else to rows of 7 (as silero-vad
    picks its 8 or 16 kHz branch). With T = 512 fixed, strict shape inference fails in the untaken branch
    (512 is no multiple of 7); onnxruntime, given the model as shipped, runs it."""
    from onnx import TensorProto, numpy_helper

    def branch(name, width):
        shape = numpy_helper.from_array(np.array([1, -1, width], np.int64))
        nodes = [helper.make_node("Constant", [], [f"{name}_s"], value=shape),
                 helper.make_node("Reshape", ["x", f"{name}_s"], [f"{name}_r"]),
                 helper.make_node("ReduceMax", [f"{name}_r"], [f"{name}_y"], axes=[1], keepdims=0)]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT,
                                                                                 ["a", "b"])])

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T"])
    sr = helper.make_tensor_value_info("sr", TensorProto.INT64, [])
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(16000, np.int64))),
             helper.make_node("Equal", ["sr", "k"], ["c"]),
             helper.make_node("If", ["c"], ["y"], name="pick", then_branch=branch("wide", 64),
                              else_branch=branch("narrow", 7))]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])
    m = helper.make_model(helper.make_graph(nodes, "g", [x, sr], [y]), opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    return m


def test_onnxruntime_gets_the_model_as_given(monkeypatch):
    from edgeflow.runtime.backends.ort import OrtBackend

    seen = []
    real = OrtBackend.load
    monkeypatch.setattr(OrtBackend, "load", lambda self, model, options=None: seen.append(model) or real(self, model, options))
    rt = load(dynamic_cnn(), "x86-gateway", backend="ort", input_shapes={"x": (1, 3, 16, 16)})
    assert _dims(seen[0]) == ("N", 3, "H", "W") and not seen[0].graph.value_info  # no numpy-side rewrite
    assert rt.inputs[0].shape == (1, 3, 16, 16) and _dims(rt.model) == (1, 3, 16, 16)  # the plan's model is fixed
    assert rt.plan is not None
    with pytest.raises(ShapeError, match="dim 2"):  # the dims given are checked on onnxruntime too
        rt.run(np.zeros((1, 3, 8, 8), np.float32))


def test_numpy_side_shape_inference_never_blocks_onnxruntime(tmp_path, capsys):
    m = _two_branch_model()
    feeds = {"x": rand(np.random.default_rng(5), 1, 512), "sr": np.array(16000, np.int64)}
    want = feeds["x"].reshape(1, -1, 64).max(axis=1)
    rt = load(m, "x86-gateway", backend="ort", input_shapes={"x": (1, 512)})
    assert rt.plan is None and "shape inference fails" in rt.plan_note
    np.testing.assert_array_equal(rt.run(feeds)["y"], want)
    with pytest.raises(ShapeError, match=r"cannot take inputs of shape x \[1, 512\]"):  # numpy needs the shapes
        load(m, "x86-gateway", backend="numpy", input_shapes={"x": (1, 512)})
    np.testing.assert_array_equal(load(m, "x86-gateway", backend="numpy").run(feeds)["y"], want)  # unplanned
    path = tmp_path / "branches.onnx"
    onnx.save(m, path)
    np.savez(tmp_path / "in.npz", **feeds)
    assert main(["run", str(path), "-i", str(tmp_path / "in.npz"), "--backend", "ort", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"]["y"]["shape"] == [1, 64]
    assert main(["run", str(path), "-i", str(tmp_path / "in.npz"), "--backend", "numpy"]) == 2
    err = _err(capsys)
    assert "cannot take inputs of shape x [1, 512], sr [] (the --input array): shape inference fails" in err
    assert main(["bench", str(path), "--shape", "x=1x512", "--backend", "numpy", "--runs", "1"]) == 2
    assert "cannot take inputs of shape x [1, 512] (--shape)" in _err(capsys)


def test_paddle_minus_one_dims_read_as_unknown():
    """Paddle declares outputs (and values) with dim_value -1: once an input dim is fixed, strict inference
    compared 1 with -1 and refused the model ('Softmax ... differ in dimension 0: (1) vs (-1)'), e.g. in
    quantize after --shape."""
    from edgeflow.runtime.model import load_model

    m = make([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [("x", [1, 8])], [("y", [1, 8])])
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_value = -1
    m.graph.value_info.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8]))
    m.graph.value_info[0].type.tensor_type.shape.dim[0].dim_value = -1
    out = load_model(m)
    assert [d.dim_value for d in out.graph.output[0].type.tensor_type.shape.dim] == [1, 8]
    dyn = make([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [("x", ["?", 8])], [("y", [1, 8])])
    dyn.graph.output[0].type.tensor_type.shape.dim[0].dim_value = -1
    assert _dims(fix_input_shapes(dyn, {"x": (4, 8)})) == (4, 8)
