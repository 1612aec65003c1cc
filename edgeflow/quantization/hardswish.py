"""HardSwish and HardSigmoid between a DequantizeLinear and a QuantizeLinear,
rewritten so that onnxruntime runs them in int8.

onnxruntime 1.32 has no int8 HardSwish or HardSigmoid: in a QDQ model each one
runs in float behind a DequantizeLinear/QuantizeLinear pair, three passes over
float tensors per activation (45% of PP-LCNet's int8 time, docs/quantization.md).
Both are affine maps clamped to a range, and a uint8/int8 tensor's saturation
*is* a clamp:

    HardSigmoid(x) = clip(alpha*x + beta, 0, 1) = alpha * clip(x + beta/alpha, 0, 1/alpha)
    HardSwish(x)   = x * HardSigmoid_{1/6, 1/2}(x)

so ``t = x + beta/alpha``, quantized over exactly [0, 1/alpha] (scale
(1/alpha)/255), is the clamp, and the same integers read back with scale
alpha*(1/alpha)/255 = 1/255 are HardSigmoid(x) in [0, 1]. onnxruntime fuses
``DQ -> Add -> Q`` into QLinearAdd and ``DQ, DQ -> Mul -> Q`` into QLinearMul,
so a HardSwish becomes QLinearAdd + QLinearMul on bytes, and a HardSigmoid
(squeeze-and-excitation gates) one QLinearAdd whose readers take its integers
directly. The graph's float meaning is unchanged (a Q then a DQ with a
different scale is a multiplication by the ratio), so every backend runs it.

Only onnxruntime gains from this: the numpy backend runs Add and Mul in float
anyway, so :func:`edgeflow.quantization.quantize` applies it where the model
is evaluated on onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..runtime.optimize.ir import outer_refs, subgraphs
from .analysis import _attr, links
from .qdq import _Names, toposort_nodes

OPS = ("HardSwish", "HardSigmoid")


def _scalar_qparams(inits: dict[str, onnx.TensorProto], node: onnx.NodeProto) -> tuple[float, np.ndarray] | None:
    """(scale, zero point array) of a per-tensor Q/DQ node with constant parameters, else None."""
    if len(node.input) < 3 or node.input[1] not in inits or node.input[2] not in inits:
        return None
    scale = numpy_helper.to_array(inits[node.input[1]])
    zp = numpy_helper.to_array(inits[node.input[2]])
    if scale.size != 1 or zp.size != 1 or zp.dtype not in (np.uint8, np.int8):
        return None
    return float(scale.reshape(())), zp


def _read_by_subgraphs(nodes: list[onnx.NodeProto], name: str) -> bool:
    return any(name in outer_refs(sub) for n in nodes for a in n.attribute for sub in subgraphs(a))


class _Rewriter:
    """A copy of a model with its quantized HardSwish/HardSigmoid rewritten one by one, then reordered."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.m = onnx.ModelProto()
        self.m.CopyFrom(model)
        self.g = g = self.m.graph
        self.inits = {t.name: t for t in g.initializer}
        self.nodes = list(g.node)  # held here, so id() of each stays valid
        self.producer, self.readers = links(self.nodes)
        self.graph_outputs = {o.name for o in g.output}
        self.names = _Names(self.m)
        self.drop: set[int] = set()
        self.added: list[onnx.NodeProto] = []
        self.rewired: dict[int, list[str]] = {}  # id(DQ reader of a dropped Q) -> its new inputs
        self.count = 0

    def const(self, base: str, value) -> str:
        """A new initializer holding ``value``; its name."""
        name = self.names.new(base)
        self.g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def match(self, n: onnx.NodeProto):
        """(DQ before it, Q after it, the integer type, alpha, beta) where ``n`` can run in int8, else None."""
        if n.op_type not in OPS or not n.input or n.output[0] in self.graph_outputs:
            return None
        dq = self.producer.get(n.input[0])
        outs = self.readers.get(n.output[0], [])
        if dq is None or dq.op_type != "DequantizeLinear" or len(outs) != 1 or outs[0].op_type != "QuantizeLinear":
            return None
        q = outs[0]
        x_qp, y_qp = _scalar_qparams(self.inits, dq), _scalar_qparams(self.inits, q)
        if x_qp is None or y_qp is None or x_qp[1].dtype != y_qp[1].dtype:
            return None
        alpha, beta = (1 / 6, 0.5) if n.op_type == "HardSwish" else (float(_attr(n, "alpha", 0.2)), float(_attr(n, "beta", 0.5)))
        if alpha <= 0 or beta <= 0:
            return None
        return dq, q, y_qp[1].dtype, alpha, beta

    def rewrite(self, n: onnx.NodeProto, dq: onnx.NodeProto, q: onnx.NodeProto, dtype, alpha: float, beta: float) -> None:
        """``n`` (and the nodes it makes unneeded) replaced by the int8 clamp and its read-out."""
        lo = 0 if dtype == np.uint8 else -128
        base = n.name or n.output[0]
        zp, h_s, t_q = self._clamp(base, dq, dtype, lo, alpha, beta)
        self._readout(n, base, dq, q, t_q, h_s, zp)
        self.drop.add(id(n))
        if len(self.readers.get(dq.output[0], [])) == 1 and dq.output[0] not in self.graph_outputs:
            self.drop.add(id(dq))
        self.count += 1

    def _clamp(self, base: str, dq: onnx.NodeProto, dtype, lo: int, alpha: float, beta: float) -> tuple[str, str, str]:
        """x + beta/alpha quantized over [0, 1/alpha]: (zero point, HardSigmoid scale, the clamped integers)."""
        names, const = self.names, self.const
        zp = const(f"{base}_int8_zp", np.array(lo, dtype))
        c_q = const(f"{base}_int8_shift", np.array(lo + 255, dtype))  # beta/alpha = (255) * scale
        c_s = const(f"{base}_int8_shift_scale", np.array(beta / alpha / 255, np.float32))
        t_s = const(f"{base}_int8_clamp_scale", np.array(1 / alpha / 255, np.float32))
        h_s = const(f"{base}_int8_hsig_scale", np.array(1 / 255, np.float32))
        x1, c, t, t_q = (names.new(f"{base}_{s}") for s in ("x", "shift", "shifted", "shifted_q"))
        self.added += [
            helper.make_node("DequantizeLinear", list(dq.input), [x1], name=names.new(f"{base}_dq_x")),
            helper.make_node("DequantizeLinear", [c_q, c_s, zp], [c], name=names.new(f"{base}_dq_shift")),
            helper.make_node("Add", [x1, c], [t], name=names.new(f"{base}_add")),
            helper.make_node("QuantizeLinear", [t, t_s, zp], [t_q], name=names.new(f"{base}_q_clamp")),
        ]
        return zp, h_s, t_q

    def _readout(self, n: onnx.NodeProto, base: str, dq: onnx.NodeProto, q: onnx.NodeProto, t_q: str, h_s: str,
                 zp: str) -> None:
        """The clamped integers read as HardSwish (times x) or HardSigmoid (scale 1/255) into ``n``'s output."""
        names = self.names
        q_readers = self.readers.get(q.output[0], [])
        if n.op_type == "HardSwish":
            x2, h = names.new(f"{base}_x2"), names.new(f"{base}_hsig")
            self.added += [
                helper.make_node("DequantizeLinear", [t_q, h_s, zp], [h], name=names.new(f"{base}_dq_hsig")),
                helper.make_node("DequantizeLinear", list(dq.input), [x2], name=names.new(f"{base}_dq_x2")),
                helper.make_node("Mul", [x2, h], [n.output[0]], name=names.new(f"{base}_mul")),
            ]
        elif q.output[0] not in self.graph_outputs and q_readers and all(r.op_type == "DequantizeLinear" for r in q_readers):
            # The gate's integers are read directly: each reader dequantizes them with scale 1/255.
            for r in q_readers:
                self.rewired[id(r)] = [t_q, h_s, zp]
            self.drop.add(id(q))
        else:
            self.added.append(helper.make_node("DequantizeLinear", [t_q, h_s, zp], [n.output[0]],
                                               name=names.new(f"{base}_dq_hsig")))

    def finish(self) -> None:
        """The graph's nodes: the kept ones (rewired) and the added ones in order, without freed initializers."""
        g = self.g
        kept = []
        for n in self.nodes:
            if id(n) in self.drop:
                continue
            if id(n) in self.rewired:
                n.ClearField("input")
                n.input.extend(self.rewired[id(n)])
            kept.append(n)
        available = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
        order = toposort_nodes(kept + self.added, available)
        del g.node[:]
        g.node.extend(order)
        # the scales and zero points only the dropped nodes read (nothing else: a subgraph may read the rest)
        freed = {i for n in self.nodes if id(n) in self.drop for i in n.input} - {i for n in order for i in n.input}
        for t in [t for t in g.initializer if t.name in freed and t.name in self.inits]:
            if _read_by_subgraphs(order, t.name):
                continue
            g.initializer.remove(t)


def hardswish_as_qlinear(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """The model with each quantized HardSwish/HardSigmoid as int8 Add (+ Mul); (model, how many).

    A node is rewritten when its input comes from a per-tensor
    DequantizeLinear and its only reader is a per-tensor QuantizeLinear of
    the same integer type; anything else is left as it is.
    """
    r = _Rewriter(model)
    for n in r.nodes:
        found = r.match(n)
        if found is not None:
            r.rewrite(n, *found)
    if not r.count:
        return model, 0
    r.finish()
    return r.m, r.count
