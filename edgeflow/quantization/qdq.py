"""Write a static int8 QDQ model from a plan and calibrated ranges (numpy +
onnx only — the path for boards without onnxruntime).

The output is standard ONNX in QDQ form, the same shape of graph that
``onnxruntime.quantization.quantize_static`` writes: each quantized
activation ``T`` becomes ``T -> QuantizeLinear -> DequantizeLinear ->
readers``; each weight an int8 initializer behind a per-channel
DequantizeLinear; each bias an int32 initializer behind a DequantizeLinear
with scale ``x_scale * w_scale``. It loads in onnxruntime (which fuses it
into QLinearConv / QGemm) and in the numpy backend (whose rewrite fuses it
into the same integer arithmetic).
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import QuantizationError
from ..runtime.model import model_opset
from .analysis import QuantPlan, Target, initializer_array
from .calibration import Range
from .params import TensorQParams, activation_qparams, bias_safe_scale, quantize_bias, quantize_weight

log = logging.getLogger(__name__)

#: Per-axis DequantizeLinear (the ``axis`` attribute) needs opset 13.
MIN_QDQ_OPSET = 13
#: Per-tensor QuantizeLinear/DequantizeLinear (scalar scale and zero point) exist from opset 10.
MIN_PER_TENSOR_OPSET = 10


def tensor_qparams(plan: QuantPlan, ranges: dict[str, Range], dtype: str, symmetric: bool = False) -> dict[str, TensorQParams]:
    """Parameters of every quantized tensor; pass-through outputs share their source's."""
    out: dict[str, TensorQParams] = {}
    for t in plan.quantized_tensors:
        root = plan.root(t)
        if root not in ranges:
            raise QuantizationError(f"no calibrated range for tensor {root!r}")
        out[t] = activation_qparams(ranges[root], dtype, symmetric)
    return out


def ensure_opset(model: onnx.ModelProto, minimum: int = MIN_QDQ_OPSET) -> onnx.ModelProto:
    if model_opset(model) >= minimum:
        return model
    try:
        from onnx import version_converter

        return version_converter.convert_version(model, minimum)
    except Exception as exc:  # the converter raises assorted types
        raise QuantizationError(
            f"the model uses opset {model_opset(model)}; QDQ quantization needs opset >= {minimum} "
            f"and automatic conversion failed ({exc}); re-export the model at opset {minimum} or newer"
        ) from exc


class _Names:
    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.used = {t.name for t in g.initializer} | {i.name for i in g.input} | {o.name for o in g.output}
        for n in g.node:
            self.used.update(n.input)
            self.used.update(n.output)
            self.used.add(n.name)

    def new(self, base: str) -> str:
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name


def toposort_nodes(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Kahn's algorithm, stable: a node after every producer of its inputs."""
    producers = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps = [{producers[x] for x in n.input if x and x not in available and x in producers} for n in nodes]
    children: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            children.setdefault(j, []).append(i)
    remaining = [len(d) for d in deps]
    import heapq

    ready = [i for i, r in enumerate(remaining) if r == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for c in children.get(i, []):
            remaining[c] -= 1
            if remaining[c] == 0:
                heapq.heappush(ready, c)
    if len(order) != len(nodes):
        raise QuantizationError("the quantized graph has a cycle (internal error)")
    return order


class _QDQWriter:
    """Rewrites a copy of a model into QDQ form, step by step, for :func:`insert_qdq`."""

    def __init__(self, model: onnx.ModelProto, plan: QuantPlan, qparams: dict[str, TensorQParams],
                 per_channel: bool) -> None:
        self.model, self.plan, self.qparams, self.per_channel = model, plan, qparams, per_channel
        self.m = ensure_opset(copy.deepcopy(model), MIN_QDQ_OPSET if per_channel else MIN_PER_TENSOR_OPSET)
        self.g = self.m.graph
        self.names = _Names(self.m)
        self.notes: list[str] = []
        self.new_inits: list[onnx.TensorProto] = []
        self.new_nodes: list[onnx.NodeProto] = []
        self.by_name = {n.name: n for n in self.g.node}
        self.removed: set[str] = set()

    def drop_relus(self) -> None:
        """Removable Relus: the layer writes the Relu's output; the Q clamps at 0."""
        for t in self.plan.targets:
            if t.relu:
                relu = self.by_name[t.relu]
                self.by_name[t.node].output[0] = relu.output[0]
                self.removed.add(t.relu)

    def quantize_activations(self) -> None:
        """Activations: T -> Q -> DQ -> (every reader of T)."""
        names = self.names
        dq_of: dict[str, str] = {}
        for tensor in self.plan.quantized_tensors:
            p = self.qparams[tensor]
            s_name = names.new(f"{tensor}_scale")
            z_name = names.new(f"{tensor}_zero_point")
            q_out = names.new(f"{tensor}_QuantizeLinear_Output")
            dq_out = names.new(f"{tensor}_DequantizeLinear_Output")
            self.new_inits += [
                numpy_helper.from_array(np.asarray(p.scale, np.float32), s_name),
                numpy_helper.from_array(np.asarray(p.zero_point), z_name),
            ]
            self.new_nodes += [
                helper.make_node("QuantizeLinear", [tensor, s_name, z_name], [q_out], name=names.new(f"{tensor}_QuantizeLinear")),
                helper.make_node("DequantizeLinear", [q_out, s_name, z_name], [dq_out], name=names.new(f"{tensor}_DequantizeLinear")),
            ]
            dq_of[tensor] = dq_out
        for n in self.g.node:
            if n.name in self.removed:
                continue
            for i, x in enumerate(n.input):
                if x in dq_of:
                    n.input[i] = dq_of[x]

    def quantize_weights(self) -> None:
        """Weights and biases of each target (a weight shared with the same bias and input: one DQ)."""
        weight_dq: dict[tuple[str, int], tuple[str, np.ndarray]] = {}
        for t in self.plan.targets:
            node = self.by_name[t.node]
            key = (t.weight, t.weight_axis, t.bias, t.activation)
            if key not in weight_dq:
                weight_dq[key] = self._weight_dq(t)
            w_out, w_scale = weight_dq[key]
            node.input[1] = w_out
            if t.bias:
                node.input[2] = self._bias_dq(t, w_scale)

    def _weight_dq(self, t: Target) -> tuple[str, np.ndarray]:
        """The int8 weight of target ``t`` behind a DequantizeLinear: (its output, its scale)."""
        names = self.names
        min_scale = None
        if t.bias:
            min_scale = bias_safe_scale(initializer_array(self.model, t.bias), self.qparams[t.activation].scale)
        qw = quantize_weight(initializer_array(self.model, t.weight), t.weight_axis, self.per_channel, min_scale)
        wq_name = names.new(f"{t.weight}_quantized")
        ws_name = names.new(f"{t.weight}_scale")
        wz_name = names.new(f"{t.weight}_zero_point")
        w_out = names.new(f"{t.weight}_DequantizeLinear_Output")
        self.new_inits += [
            numpy_helper.from_array(qw.values, wq_name),
            numpy_helper.from_array(qw.scale, ws_name),
            numpy_helper.from_array(np.zeros(qw.scale.shape, np.int8), wz_name),
        ]
        attrs = {"axis": t.weight_axis} if self.per_channel else {}
        self.new_nodes.append(helper.make_node(
            "DequantizeLinear", [wq_name, ws_name, wz_name], [w_out], name=names.new(f"{t.weight}_DequantizeLinear"), **attrs
        ))
        return w_out, qw.scale

    def _bias_dq(self, t: Target, w_scale: np.ndarray) -> str:
        """The int32 bias of target ``t`` behind a DequantizeLinear (scale x_scale * w_scale); its output."""
        names = self.names
        x_scale = self.qparams[t.activation].scale
        bq, bs, clipped = quantize_bias(initializer_array(self.model, t.bias), x_scale, w_scale)
        bias_attrs = {"axis": 0}
        if not self.per_channel:  # one scale for every channel: a scalar, legal below opset 13
            bs, bias_attrs = np.asarray(bs.reshape(-1)[0] if bs.size else np.float32(1.0), np.float32), {}
        if clipped:
            self.notes.append(f"{t.node}: bias clipped to the int32 range (very small input/weight scales)")
        bq_name = names.new(f"{t.bias}_quantized")
        bs_name = names.new(f"{t.bias}_quantized_scale")
        bz_name = names.new(f"{t.bias}_quantized_zero_point")
        b_out = names.new(f"{t.bias}_DequantizeLinear_Output")
        self.new_inits += [
            numpy_helper.from_array(bq, bq_name),
            numpy_helper.from_array(bs, bs_name),
            numpy_helper.from_array(np.zeros(bs.shape, np.int32), bz_name),
        ]
        self.new_nodes.append(helper.make_node(
            "DequantizeLinear", [bq_name, bs_name, bz_name], [b_out], name=names.new(f"{t.bias}_DequantizeLinear"),
            **bias_attrs
        ))
        return b_out

    def rebuild_graph(self) -> None:
        """The graph's nodes in order with the new ones, only the initializers and inputs still read."""
        g, new_nodes, new_inits = self.g, self.new_nodes, self.new_inits
        inits = {t.name for t in g.initializer}
        kept = [n for n in g.node if n.name not in self.removed]
        used = {x for n in kept + new_nodes for x in n.input if x} | {o.name for o in g.output}
        keep_inits = [t for t in g.initializer if t.name in used]
        available = {t.name for t in keep_inits} | {t.name for t in new_inits} | {i.name for i in g.input}
        ordered = toposort_nodes(kept + new_nodes, available)
        del g.node[:]
        g.node.extend(ordered)
        del g.initializer[:]
        g.initializer.extend(keep_inits + new_inits)
        del g.value_info[:]  # stale after the rewiring; re-inferred on load
        # Initializers listed as graph inputs (old IR style) that are gone.
        live_inputs = [i for i in g.input if i.name not in inits or i.name in used]
        del g.input[:]
        g.input.extend(live_inputs)

    def checked(self) -> onnx.ModelProto:
        """The written model, after onnx.checker accepts it."""
        try:
            onnx.checker.check_model(self.m)
        except onnx.checker.ValidationError as exc:  # pragma: no cover - a bug here, not user error
            raise QuantizationError(f"the QDQ model fails onnx.checker (internal error): {exc}") from exc
        return self.m


def insert_qdq(
    model: onnx.ModelProto,
    plan: QuantPlan,
    qparams: dict[str, TensorQParams],
    *,
    per_channel: bool = True,
) -> tuple[onnx.ModelProto, list[str]]:
    """The QDQ model for ``plan``; returns it and a list of notes (e.g. clipped biases).

    Per-channel weights need opset 13 (DequantizeLinear's ``axis``); per tensor,
    every scale is a scalar and opset 10 is enough, so a model the version
    converter cannot upgrade still quantizes (``per_channel=False``)."""
    w = _QDQWriter(model, plan, qparams, per_channel)
    w.drop_relus()
    w.quantize_activations()
    w.quantize_weights()
    w.rebuild_graph()
    return w.checked(), w.notes
