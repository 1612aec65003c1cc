"""Weight-only int8: int8 weights in the file, float32 arithmetic at run time.

For the numpy backend, which has no integer GEMM (numpy's BLAS is float
only): a static int8 model there runs its GEMMs as float32 sgemm anyway
(exactly, see ``kernels/int_gemm.py``) and adds quantize / requantize
passes over every activation, so it cannot be faster than fp32. What int8
can still buy is size. This rewrite stores the weight of every Conv,
ConvTranspose, Gemm and MatMul as symmetric int8 (zero point 0, per output
channel) behind a ``DequantizeLinear`` (opset 13+, which has its ``axis``;
below, a ``Cast`` and a broadcast ``Mul`` by the scales, the same
arithmetic); activations stay float. The numpy backend folds each of these
constant subgraphs into a float32 initializer once, at load, so the model runs exactly the fp32 graph on
those dequantized weights: fp32 speed, about 4x smaller weights on disk and
in transit (OTA). onnxruntime runs the same file (it folds the
DequantizeLinear nodes too).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

#: op -> (weight input index, output-channel axis of the weight)
_WEIGHTS = {"Conv": (1, 0), "ConvTranspose": (1, 1), "Gemm": (1, None), "MatMul": (1, -1)}


def _channel_axis(node: onnx.NodeProto, w: np.ndarray) -> int:
    axis = _WEIGHTS[node.op_type][1]
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        axis = 0 if trans_b else 1
    return axis % w.ndim


def quantize_weights(w: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 in [-127, 127]: (q, scale), one scale per slice along ``axis`` (None: one in all)."""
    w = np.asarray(w, np.float32)
    if axis is None:
        amax = np.array(np.abs(w).max() if w.size else 0.0, np.float32)
    else:
        amax = np.abs(np.moveaxis(w, axis, 0)).reshape(w.shape[axis], -1).max(axis=1).astype(np.float32)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    shape = [1] * w.ndim
    if axis is not None:
        shape[axis] = -1
    q = np.clip(np.rint(w / scale.reshape(shape)), -127, 127).astype(np.int8)
    return q, scale


def weight_only_int8(model: onnx.ModelProto, *, min_elements: int = 256) -> onnx.ModelProto:
    """A copy of ``model`` whose Conv/ConvTranspose/Gemm/MatMul float32 weight
    initializers (of at least ``min_elements`` values, read by no other node)
    are int8 behind a DequantizeLinear. Activations are untouched.

    The model goes through the portable optimizer first (Constant-node weights
    become initializers, BatchNormalization folds into the conv weights), so
    the weights quantized are the ones the backend will run."""
    from ..optimize import optimize_model

    m = optimize_model(model)
    g = m.graph
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 0)
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    graph_inputs = {i.name for i in g.input}
    new_nodes: list[onnx.NodeProto] = []
    done: set[str] = set()
    for n in g.node:
        spec = _WEIGHTS.get(n.op_type) if n.domain in ("", "ai.onnx") else None
        if spec is not None and len(n.input) > spec[0]:
            name = n.input[spec[0]]
            t = inits.get(name)
            if (t is not None and name not in done and name not in graph_inputs and readers.get(name) == 1
                    and t.data_type == onnx.TensorProto.FLOAT):
                w = numpy_helper.to_array(t)
                if w.size >= min_elements and w.ndim >= 2:
                    axis = _channel_axis(n, w)
                    q, scale = quantize_weights(w, axis)
                    qname, sname, zname = f"{name}_int8", f"{name}_scale", f"{name}_zero_point"
                    g.initializer.remove(t)
                    g.initializer.append(numpy_helper.from_array(q, qname))
                    if opset >= 13:
                        g.initializer.extend([numpy_helper.from_array(scale, sname),
                                              numpy_helper.from_array(np.zeros(scale.shape, np.int8), zname)])
                        new_nodes.append(helper.make_node("DequantizeLinear", [qname, sname, zname], [name],
                                                          name=f"{name}_dequantize", axis=axis))
                    else:  # no per-channel DequantizeLinear before opset 13: Cast and a broadcast Mul
                        shape = [1] * w.ndim
                        shape[axis] = -1
                        g.initializer.append(numpy_helper.from_array(scale.reshape(shape), sname))
                        new_nodes += [
                            helper.make_node("Cast", [qname], [f"{name}_float"], name=f"{name}_cast",
                                             to=onnx.TensorProto.FLOAT),
                            helper.make_node("Mul", [f"{name}_float", sname], [name], name=f"{name}_dequantize"),
                        ]
                    done.add(name)
        new_nodes.append(n)
    del g.node[:]
    g.node.extend(new_nodes)
    return m
