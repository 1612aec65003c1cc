"""The numpy backend against onnx's reference evaluator on one-node models
with random inputs, shapes and attributes the ONNX node cases do not use
(other ranks, negative axes, integer dtypes, broadcasting). The model goes
through edgeflow.runtime.graph.compile_graph, so attribute decoding and the dtype
dispatch are exercised too."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from edgeflow.runtime.backends.numpy_backend import execute
from edgeflow.runtime.graph import compile_graph

RNG = np.random.default_rng(2024)


def f32(*s):
    return RNG.standard_normal(s).astype(np.float32)


def ints(lo, hi, *s, dtype=np.int64):
    return RNG.integers(lo, hi, size=s).astype(dtype)


def _run_both(op, inputs, attrs, opset, n_out=1, consts=None):
    consts = consts or {}
    names = [f"x{i}" for i in range(len(inputs))]
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for n, v in zip(names, inputs)]
    inits = [onnx.numpy_helper.from_array(v, n) for n, v in consts.items()]
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, names + list(consts), outs, **attrs)
    graph = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None)
                                                 for o in outs], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = dict(zip(names, inputs))
    want = ReferenceEvaluator(model).run(None, feeds)
    env = execute(compile_graph(onnx.shape_inference.infer_shapes(model)), feeds)
    return [env[o] for o in outs], want


CASES = [
    ("Mod", lambda: [ints(-20, 20, 3, 4, dtype=np.int32), ints(1, 6, 4, dtype=np.int32)], {}, 13),
    ("Mod", lambda: [f32(3, 4) * 5, np.abs(f32(1, 4)) + 0.5], {"fmod": 1}, 13),
    ("Mod", lambda: [f32(2, 3) * 5, f32(3) + 3], {}, 28),
    ("Sign", lambda: [ints(-3, 4, 5, dtype=np.int8)], {}, 13),
    ("Round", lambda: [np.array([0.5, 1.5, 2.5, -0.5, -2.5, 2.4], np.float32)], {}, 22),
    ("Celu", lambda: [f32(2, 3, 4)], {"alpha": 0.7}, 12),
    ("Gelu", lambda: [f32(4, 5) * 3], {"approximate": "tanh"}, 20),
    ("Gelu", lambda: [f32(4, 5).astype(np.float64) * 3], {}, 20),
    ("Swish", lambda: [f32(4, 5)], {"alpha": 0.6}, 24),
    ("HardSwish", lambda: [f32(3, 7) * 4], {}, 22),
    ("Shrink", lambda: [ints(-5, 6, 10, dtype=np.int16)], {"lambd": 2.0, "bias": 1.0}, 9),
    ("PRelu", lambda: [f32(2, 3, 4), f32(3, 1)], {}, 16),
    ("PRelu", lambda: [ints(-5, 5, 2, 3, dtype=np.int32), ints(1, 3, 3, dtype=np.int32)], {}, 16),
    ("ThresholdedRelu", lambda: [f32(6, 2)], {"alpha": 0.2}, 22),
    ("Hardmax", lambda: [f32(2, 3, 4)], {"axis": 0}, 13),
    ("BitShift", lambda: [ints(0, 200, 6, dtype=np.uint16), ints(0, 17, 6, dtype=np.uint16)], {"direction": "LEFT"}, 11),
    ("BitwiseXor", lambda: [ints(-100, 100, 2, 3, dtype=np.int16), ints(-100, 100, 3, dtype=np.int16)], {}, 18),
    ("ConstantOfShape", lambda: [np.array([2, 0, 3], np.int64)], {}, 9),
    ("Range", lambda: [np.array(-3, np.int32), np.array(11, np.int32), np.array(4, np.int32)], {}, 11),
    ("Range", lambda: [np.array(1.5, np.float64), np.array(-2.0), np.array(-0.25)], {}, 11),
    ("EyeLike", lambda: [f32(4, 2)], {"k": -1, "dtype": TensorProto.INT32}, 9),
    ("OneHot", lambda: [ints(-4, 4, 2, 3), np.array(4, np.int64), np.array([2, 7], np.int32)], {"axis": 1}, 11),
    ("Trilu", lambda: [ints(0, 9, 2, 4, 3, dtype=np.int32), np.array(-1, np.int64)], {"upper": 0}, 14),
    ("Tile", lambda: [f32(2, 1, 3), np.array([1, 3, 2], np.int64)], {}, 13),
    ("Compress", lambda: [f32(3, 4, 2), np.array([True, False, True, True])], {"axis": -2}, 11),
    ("NonZero", lambda: [ints(0, 2, 3, 4, dtype=np.int32)], {}, 13),
    ("ReverseSequence", lambda: [f32(3, 4, 2), np.array([1, 3, 2], np.int64)], {"batch_axis": 0, "time_axis": 1}, 10),
    ("ReduceL1", lambda: [ints(-5, 5, 3, 4, dtype=np.int32), np.array([-1], np.int64)], {"keepdims": 0}, 18),
    ("ReduceL2", lambda: [f32(2, 3, 4), np.array([0, 2], np.int64)], {}, 18),
    ("ReduceLogSumExp", lambda: [f32(2, 3, 4) * 10], {"axes": [1], "keepdims": 0}, 13),
    ("ReduceProd", lambda: [f32(2, 3, 4)], {"keepdims": 1}, 18),
    ("ReduceSumSquare", lambda: [f32(3, 4), np.array([], np.int64)], {"noop_with_empty_axes": 1}, 18),
    ("ReduceMean", lambda: [ints(0, 9, 3, 4, dtype=np.int32), np.array([1], np.int64)], {}, 18),
    ("ArgMin", lambda: [ints(0, 3, 3, 5, dtype=np.int32)], {"axis": -1, "select_last_index": 1, "keepdims": 0}, 13),
    ("CumSum", lambda: [f32(3, 4), np.array(-2, np.int32)], {"exclusive": 1, "reverse": 1}, 14),
    ("CumProd", lambda: [ints(1, 4, 2, 5, dtype=np.int64), np.array(1, np.int64)], {"exclusive": 1}, 26),
    ("GatherElements", lambda: [f32(3, 4, 2), ints(-3, 3, 2, 4, 2)], {"axis": 0}, 13),
    ("GatherND", lambda: [f32(2, 3, 4, 5), ints(0, 3, 2, 6, 1)], {"batch_dims": 1}, 13),
    ("ScatterElements", lambda: [f32(3, 4), ints(-4, 4, 3, 2), f32(3, 2)], {"axis": 1, "reduction": "add"}, 18),
    ("ScatterND", lambda: [f32(4, 3, 2), np.array([[[1, 2]], [[-1, 0]]], np.int64), f32(2, 1, 2)], {"reduction": "max"}, 18),
    ("TopK", lambda: [ints(0, 5, 3, 8, dtype=np.int32), np.array([3], np.int64)], {"axis": 0, "largest": 0}, 11),
    ("Unique", lambda: [ints(0, 4, 12, dtype=np.int32)], {"sorted": 0}, 11),  # (the reference mis-handles 2-D here)
    ("ReduceL1", lambda: [f32(3, 4)], {"noop_with_empty_axes": 1}, 18),
    ("ReduceLogSum", lambda: [np.abs(f32(3, 4)) + 0.1, np.array([], np.int64)], {"noop_with_empty_axes": 1}, 18),
    ("Einsum", lambda: [f32(2, 3, 4), f32(4, 3)], {"equation": "bij,ji->b"}, 12),
    ("Einsum", lambda: [f32(2, 3, 4), f32(2, 4, 5)], {"equation": "...ij,...jk"}, 12),
    ("Det", lambda: [f32(3, 2, 2)], {}, 11),
    ("DFT", lambda: [f32(2, 5, 6, 2), np.array(8, np.int64), np.array(2, np.int64)], {"inverse": 1}, 20),
    ("HammingWindow", lambda: [np.array(7, np.int32)], {"periodic": 0, "output_datatype": TensorProto.DOUBLE}, 17),
    ("NegativeLogLikelihoodLoss", lambda: [f32(3, 4, 2), ints(0, 4, 3, 2), np.abs(f32(4))],
     {"reduction": "sum", "ignore_index": 2}, 13),
    ("SoftmaxCrossEntropyLoss", lambda: [f32(4, 5), ints(0, 5, 4)], {"reduction": "none"}, 13),
]


@pytest.mark.parametrize("op,make,attrs,opset", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_matches_the_reference(op, make, attrs, opset):
    n_out = {"TopK": 2, "Unique": 4}.get(op, 1)
    got, want = _run_both(op, make(), attrs, opset, n_out)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.shape == w.shape, (op, g.shape, w.shape)
        if w.dtype.kind == "f":
            assert g.dtype == w.dtype, (op, g.dtype, w.dtype)
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(g.astype(w.dtype), w)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_hardmax_before_opset_13_coerces_to_2d_like_onnxruntime(axis):
    """onnx's reference evaluator has only the opset-13 Hardmax; onnxruntime is the peer here."""
    ort = pytest.importorskip("onnxruntime")
    x = f32(2, 3, 4)
    node = helper.make_node("Hardmax", ["x"], ["y"], axis=axis)
    model = helper.make_model(
        helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)]),
        opset_imports=[helper.make_opsetid("", 11)])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = execute(compile_graph(model), {"x": x})["y"]
    np.testing.assert_array_equal(got, want)
    assert got.sum() == int(np.prod(x.shape[:axis % 3]))  # one 1 per coerced row
