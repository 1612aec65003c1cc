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

from collections.abc import Sequence

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
    from .params import quantize_weight

    w = np.asarray(w, np.float32)
    qw = quantize_weight(w, 0 if axis is None else axis, per_channel=axis is not None)
    return qw.values, np.asarray(qw.scale, np.float32)


def weight_only_int8(model: onnx.ModelProto, nodes: Sequence[str] | None = None, *, per_channel: bool = True,
                     min_elements: int = 256, optimize: bool = True, embeddings: bool = True) -> onnx.ModelProto:
    """A copy of ``model`` whose Conv/ConvTranspose/Gemm/MatMul float32 weight
    initializers are int8 behind a DequantizeLinear; activations are untouched.

    ``nodes``: only these nodes' weights (the bench-gated choice of
    :mod:`.gate` names them); None: every such weight of at least
    ``min_elements`` values. ``embeddings``: 2-d float tables read by Gather
    (4096 values or more) too, one scale per row. ``optimize``: the model goes
    through the portable optimizer first (Constant-node weights become
    initializers, BatchNormalization folds into the conv weights), so the
    weights quantized are the ones the backend will run."""
    import copy

    if optimize:
        from ..runtime.optimize import optimize_model

        m = optimize_model(model)
    else:
        m = copy.deepcopy(model)
    g = m.graph
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 0)
    inits = {t.name: t for t in g.initializer}
    graph_inputs = {i.name for i in g.input}
    wanted = None if nodes is None else set(nodes)
    new_nodes: list[onnx.NodeProto] = []
    done: set[str] = set()

    def dequantized(name: str, w: np.ndarray, axis: int | None) -> list[onnx.NodeProto]:
        """Replace initializer ``name`` by int8 + scales and the nodes that give ``name`` back in float."""
        q, scale = quantize_weights(w, axis)
        qname, sname, zname = f"{name}_int8", f"{name}_scale", f"{name}_zero_point"
        g.initializer.remove(inits[name])
        g.initializer.append(numpy_helper.from_array(q, qname))
        done.add(name)
        if opset >= 13 or axis is None:
            g.initializer.extend([numpy_helper.from_array(scale.reshape(()) if axis is None else scale, sname),
                                  numpy_helper.from_array(np.zeros(() if axis is None else scale.shape, np.int8),
                                                          zname)])
            return [helper.make_node("DequantizeLinear", [qname, sname, zname], [name], name=f"{name}_dequantize",
                                     **({} if axis is None else {"axis": axis}))]
        shape = [1] * w.ndim  # no per-channel DequantizeLinear before opset 13: Cast and a broadcast Mul
        shape[axis] = -1
        g.initializer.append(numpy_helper.from_array(scale.reshape(shape), sname))
        return [helper.make_node("Cast", [qname], [f"{name}_float"], name=f"{name}_cast", to=onnx.TensorProto.FLOAT),
                helper.make_node("Mul", [f"{name}_float", sname], [name], name=f"{name}_dequantize")]

    for n in g.node:
        plain = n.domain in ("", "ai.onnx")
        spec = _WEIGHTS.get(n.op_type) if plain else None
        if spec is not None and len(n.input) > spec[0] and (wanted is None or n.name in wanted):
            name = n.input[spec[0]]
            t = inits.get(name)
            if t is not None and name not in done and name not in graph_inputs and t.data_type == onnx.TensorProto.FLOAT:
                w = numpy_helper.to_array(t)
                if w.ndim >= 2 and (w.size >= min_elements or wanted is not None):
                    new_nodes += dequantized(name, w, _channel_axis(n, w) if per_channel else None)
        elif embeddings and plain and n.op_type == "Gather" and n.input:
            name = n.input[0]
            t = inits.get(name)
            if t is not None and name not in done and t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2:
                w = numpy_helper.to_array(t)
                if w.size >= 4096:
                    new_nodes += dequantized(name, w, 0 if per_channel else None)
        new_nodes.append(n)
    del g.node[:]
    g.node.extend(new_nodes)
    return m
