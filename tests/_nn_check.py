"""Helpers for the NN-layer kernel tests: build a one-node ONNX model, run it
on the numpy backend and on onnxruntime, compare.

onnxruntime is the peer: a kernel must give what a user's model gives there.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgeflow.runtime.backends.numpy_backend import execute
from edgeflow.runtime.graph import compile_graph


def one_node_model(op: str, inputs: dict, consts: dict | None = None, *, opset: int, n_outputs: int = 1,
                   input_order: list[str] | None = None, outputs: list[str] | None = None,
                   out_types: list | None = None, **attrs):
    """A model with graph inputs ``inputs`` (name -> array), initializers
    ``consts`` (name -> array), the node's inputs in ``input_order`` ("" for
    an omitted optional input) and ``n_outputs`` outputs y0, y1, ... of
    ``out_types`` (numpy dtypes; default: the first input's)."""
    consts = consts or {}
    order = input_order if input_order is not None else list(inputs) + list(consts)
    outs = outputs or [f"y{i}" for i in range(n_outputs)]
    first = next(iter(inputs.values())) if inputs else next(iter(consts.values()))
    types = [helper.np_dtype_to_tensor_dtype(np.dtype(t)) for t in (out_types or [first.dtype] * len(outs))]
    node = helper.make_node(op, order, outs, **attrs)
    g = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
         for n, a in inputs.items()],
        [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, types) if o],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in consts.items()],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def run_numpy(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    env = execute(compile_graph(model), feeds)
    return [env[o.name] for o in model.graph.output]


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_matches_ort(model, feeds, *, rtol=1e-4, atol=1e-5):
    want = run_ort(model, feeds)
    got = run_numpy(model, feeds)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"output {i}: shape {g.shape} != onnxruntime's {w.shape}"
        assert g.dtype == w.dtype, f"output {i}: dtype {g.dtype} != onnxruntime's {w.dtype}"
        if w.dtype.kind in "fc":
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"output {i}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"output {i}")
