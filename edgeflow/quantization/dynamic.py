"""Dynamic int8 for MatMul/Gemm-heavy models (numpy + onnx only).

Weights are quantized once (symmetric int8, per output column); activations
are quantized at run time from each batch's own range, so no calibration
data is needed and no range is ever stale — the right trade for MLPs and
transformer blocks whose cost is the weight matrices. Each target becomes
standard ops that onnxruntime and the numpy backend both run:

    x -> DynamicQuantizeLinear -> (x_q, x_scale, x_zp)
    MatMulInteger(x_q, W_q, x_zp) -> Cast(float) -> Mul(x_scale * w_scale) [-> Add(bias)]
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .analysis import QuantPlan, initializer_array
from .params import quantize_weight
from .qdq import _Names, toposort_nodes


def quantize_dynamic_graph(model: onnx.ModelProto, plan: QuantPlan, *, per_channel: bool = True) -> onnx.ModelProto:
    m = copy.deepcopy(model)
    g = m.graph
    names = _Names(m)
    by_name = {n.name: n for n in g.node}
    removed: set[str] = set()
    new_nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    dql: dict[str, tuple[str, str, str]] = {}  # activation -> (x_q, scale, zp): shared by readers
    for t in plan.targets:
        node = by_name[t.node]
        w = initializer_array(model, t.weight).astype(np.float32)
        if t.op_type == "Gemm" and t.weight_axis == 0:
            w = w.T  # stored (N, K) with transB=1: MatMulInteger wants (K, N)
        qw = quantize_weight(w, 1, per_channel)
        if t.activation not in dql:
            xq, xs, xz = (names.new(f"{t.activation}_{s}") for s in ("quantized", "scale", "zero_point"))
            new_nodes.append(helper.make_node(
                "DynamicQuantizeLinear", [t.activation], [xq, xs, xz], name=names.new(f"{t.activation}_DynamicQuantizeLinear")
            ))
            dql[t.activation] = (xq, xs, xz)
        xq, xs, xz = dql[t.activation]
        wq_name = names.new(f"{t.weight}_quantized")
        ws_name = names.new(f"{t.weight}_scale")
        new_inits += [numpy_helper.from_array(qw.values, wq_name), numpy_helper.from_array(qw.scale, ws_name)]
        acc, acc_f, scale, y = (names.new(f"{t.node}_{s}") for s in ("MatMulInteger", "Cast", "scale", "Mul"))
        new_nodes += [
            helper.make_node("MatMulInteger", [xq, wq_name, xz], [acc], name=names.new(f"{t.node}_MatMulInteger")),
            helper.make_node("Cast", [acc], [acc_f], to=TensorProto.FLOAT, name=names.new(f"{t.node}_Cast")),
            helper.make_node("Mul", [xs, ws_name], [scale], name=names.new(f"{t.node}_scale_Mul")),
        ]
        out = node.output[0]
        bias = node.input[2] if t.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
        if bias:
            new_nodes += [
                helper.make_node("Mul", [acc_f, scale], [y], name=names.new(f"{t.node}_Mul")),
                helper.make_node("Add", [y, bias], [out], name=names.new(f"{t.node}_Add")),
            ]
        else:
            new_nodes.append(helper.make_node("Mul", [acc_f, scale], [out], name=names.new(f"{t.node}_Mul")))
        removed.add(t.node)
    kept = [n for n in g.node if n.name not in removed]
    used = {x for n in kept + new_nodes for x in n.input if x} | {o.name for o in g.output}
    keep_inits = [t for t in g.initializer if t.name in used]
    available = {t.name for t in keep_inits + new_inits} | {i.name for i in g.input}
    ordered = toposort_nodes(kept + new_nodes, available)
    del g.node[:]
    g.node.extend(ordered)
    del g.initializer[:]
    g.initializer.extend(keep_inits + new_inits)
    del g.value_info[:]
    init_names = {t.name for t in g.initializer}
    live = [i for i in g.input if i.name in init_names or i.name not in {t.name for t in model.graph.initializer}]
    del g.input[:]
    g.input.extend(live)
    onnx.checker.check_model(m)
    return m
