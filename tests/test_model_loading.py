"""Model loading: every bad model fails at load, with a message naming the problem."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from _models import single_op, with_custom_ops
from edgeflow import zoo
from edgeflow.runtime.backends import available_backends
from edgeflow.errors import ModelError, UnsupportedOpError
from edgeflow.runtime.model import load_model, model_info
from edgeflow.runtime.session import load


def test_load_from_path_bytes_and_proto(tmp_path):
    m = zoo.mlp((8, 4, 2))
    p = tmp_path / "m.onnx"
    onnx.save(m, p)
    for src in (p, str(p), m.SerializeToString(), m):
        assert len(load_model(src).graph.node) == 3


def test_missing_file():
    with pytest.raises(ModelError, match="model file not found: .*nope.onnx"):
        load_model("/tmp/definitely/nope.onnx")


def test_not_onnx(tmp_path):
    p = tmp_path / "junk.onnx"
    p.write_bytes(b"\x00\x01 this is not protobuf \xff" * 10)
    with pytest.raises(ModelError, match="junk.onnx is not a valid ONNX model"):
        load_model(p)


def test_directory(tmp_path):
    with pytest.raises(ModelError, match="is a directory"):
        load_model(tmp_path)


def test_checker_failure_names_problem():
    m = single_op("Relu", {"x": (1, 4)})
    m.graph.node[0].input[0] = "undefined_value"
    with pytest.raises(ModelError, match="fails onnx.checker"):
        load_model(m)


def test_opset_too_old_and_too_new():
    with pytest.raises(ModelError, match="older than the oldest supported"):
        load_model(single_op("Relu", {"x": (1, 4)}, opset=5), check=True)
    newer = single_op("Relu", {"x": (1, 4)})
    newer.opset_import[0].version = onnx.defs.onnx_opset_version() + 5
    with pytest.raises(ModelError, match="newer than this runtime"):
        load_model(newer)


def test_shape_inference_failure_is_reported():
    # MatMul of (2, 3) by (4, 5): inner dims disagree
    m = single_op("MatMul", {"a": (2, 3), "b": (4, 5)}, out_shape=(2, 5))
    with pytest.raises(ModelError, match="shape inference failed"):
        load_model(m)


def _declared_shape_contradicts_inference() -> onnx.ModelProto:
    """As Paddle's table-slanet-plus: an If branch declares a Cast output of rank 0 that really has rank 1.
    onnx.checker accepts it and onnxruntime merges the shapes leniently; strict shape inference refuses it."""
    def body(name):
        nodes = [helper.make_node("Cast", ["x"], [f"{name}_c"], to=TensorProto.FLOAT, name=f"{name}_cast"),
                 helper.make_node("Relu", [f"{name}_c"], [f"{name}_y"])]
        g = helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [3])])
        g.value_info.append(helper.make_tensor_value_info(f"{name}_c", TensorProto.FLOAT, []))
        return g

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    c = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    node = helper.make_node("If", ["c"], ["y"], then_branch=body("a"), else_branch=body("b"), name="branch")
    g = helper.make_graph([node], "g", [x, c], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    return m


def test_declared_shapes_that_contradict_inference_are_dropped_not_fatal(caplog):
    m = _declared_shape_contradicts_inference()
    with pytest.raises(Exception, match="differ in rank"):
        onnx.shape_inference.infer_shapes(m, strict_mode=True)
    with caplog.at_level("INFO", logger="edgeflow.runtime.model"):
        loaded = load_model(m)
    assert "declared shapes disagree with shape inference" in caplog.text
    branch = next(a.g for a in loaded.graph.node[0].attribute if a.name == "then_branch")
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in branch.value_info}
    assert dims["a_c"] == [3]  # the inferred shape, not the declared one
    feeds = {"x": np.array([-1.0, 2.0, 3.0], np.float32), "c": np.array(True)}
    backends = ["numpy", "ort"] if "ort" in available_backends() else ["numpy"]
    for backend in backends:
        np.testing.assert_array_equal(load(m, "x86-gateway", backend=backend).run(feeds)["y"], [0.0, 2.0, 3.0])


def test_all_unsupported_ops_listed_at_load():
    m = with_custom_ops(["Frobnicate", "Twiddle", "Frobnicate"])
    with pytest.raises(UnsupportedOpError) as ei:
        load(m, "x86-gateway")
    assert ei.value.ops == ["acme.custom::Frobnicate", "acme.custom::Twiddle"]
    assert "Frobnicate" in str(ei.value) and "Twiddle" in str(ei.value)


def test_numpy_backend_lists_every_missing_standard_op():
    # Two standard ops without numpy kernels (random draws, which the numpy
    # kernels leave out: no draw could match another runtime's): both named,
    # before any run.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("RandomUniformLike", ["x"], ["a"], seed=1.0),
             helper.make_node("Bernoulli", ["a"], ["b"], seed=2.0)]
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOpError) as ei:
        load(m, "raspberry-pi-zero-2w")  # numpy-only board
    assert sorted(ei.value.ops) == ["Bernoulli", "RandomUniformLike"]
    # the ort board falls back to nothing needed: onnxruntime runs both
    rt = load(m, "x86-gateway")
    assert rt.backend_name == "ort"
    out = rt(np.ones((2, 3), np.float32))
    assert out.shape == (2, 3) and set(np.unique(out).tolist()) <= {0.0, 1.0}


def test_unsupported_attribute_is_named():
    # onnx.checker rejects attributes outside the spec; the compiler also
    # names any spec attribute a kernel does not implement (checked here on a
    # graph that skips the checker).
    from edgeflow.runtime.graph import compile_graph

    m = single_op("Relu", {"x": (1, 4)})
    m.graph.node[0].attribute.append(helper.make_attribute("flavour", 3))
    with pytest.raises(UnsupportedOpError, match="attribute 'flavour' is not supported"):
        compile_graph(m)


def test_model_info_counts():
    info = model_info(zoo.small_cnn())
    assert info.op_counts == {"Conv": 2, "Flatten": 1, "Gemm": 2, "MaxPool": 2, "Relu": 3}
    assert info.num_parameters == 32 * 9 + 32 + 64 * 32 * 9 + 64 + 3136 * 128 + 128 + 128 * 10 + 10
    assert info.parameter_bytes == 4 * info.num_parameters
    assert info.inputs[0].shape == ("N", 1, 28, 28)
