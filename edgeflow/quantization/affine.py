"""Mul / Add by a scalar constant between quantized tensors, folded into the
scale and zero point of the integers they read.

PP-OCRv4's recognizer and detector follow every activation with a
"learnable affine block", ``y = a * x + b`` with scalar ``a`` and ``b``
(24-28 of them per model). The optimizer's ``fuse_affine`` folds the ones
right after a Conv into its weights; the ones after the activation feed the
next (padded) conv, where a float fold would change the border. Quantized
for onnxruntime, each is a QLinearMul and a QLinearAdd over a whole
activation: 20-25% of the int8 time of those models.

With ``x = s * (q - z)`` (a per-tensor DequantizeLinear of the integers
``q``), ``a * x + b = (a * s) * (q - (z - b / (a * s)))``: the same integers,
read with scale ``a * s`` and zero point ``z - b / (a * s)``. So each
DequantizeLinear that reads the chain's last QuantizeLinear reads ``q``
directly with those parameters, and the chain goes. The zero point is rounded
to an integer (at most half a step of the result off, where the chain's own
QuantizeLinear nodes rounded twice), and a convolution's padding still reads
the zero point as 0, as in float. A chain is folded only when ``a > 0`` and the
zero point fits the integer type; the bench gate measures the loss of the
model that carries it, like every other rewrite.

Only onnxruntime gains from this (the numpy backend runs Mul and Add in float
anyway): :func:`edgeflow.quantization.quantize` applies it where the model is
evaluated on onnxruntime.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
from onnx import numpy_helper

from .analysis import links
from .hardswish import _read_by_subgraphs, _scalar_qparams
from .qdq import _Names

OPS = ("Mul", "Add")
CLAMP_TOLERANCE = 1.0
"""A chain's QuantizeLinear may clip the affine image of the input's range by this many of its steps (the
ranges calibration gives differ so much by rounding); beyond, the chain is a clamp and stays."""


def _scalar_value(inits: dict[str, onnx.TensorProto], producer: dict[str, onnx.NodeProto], name: str) -> float | None:
    """The value of a one-element float constant: an initializer, or a DequantizeLinear of one."""
    if name in inits:
        v = numpy_helper.to_array(inits[name])
        return float(v.reshape(())) if v.size == 1 and v.dtype.kind == "f" else None
    dq = producer.get(name)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
        return None
    qp = _scalar_qparams(inits, dq)
    q = numpy_helper.to_array(inits[dq.input[0]])
    if qp is None or q.size != 1:
        return None
    return qp[0] * (float(q.reshape(())) - float(qp[1].reshape(())))


def fold_scalar_affine(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """The model with each chain ``DQ -> (Mul|Add by a scalar -> Q -> DQ)+`` read through new
    DequantizeLinear parameters instead; (model, how many chains)."""
    nodes = list(model.graph.node)  # held here, so id() of each stays valid
    graph = _Graph(model.graph, nodes)
    plans = _plans(graph, nodes)
    if not plans:
        return model, 0
    return _rewritten(model, nodes, graph, plans), len(plans)


class _Graph:
    """The constants and links of a quantized graph, and the questions a chain's fold asks of them."""

    def __init__(self, g: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
        self.inits = {t.name: t for t in g.initializer}
        self.producer, self.readers = links(nodes)
        self.outputs = {o.name for o in g.output}

    def only_reader(self, name: str, op: str) -> onnx.NodeProto | None:
        rs = self.readers.get(name, [])
        return rs[0] if len(rs) == 1 and rs[0].op_type == op and name not in self.outputs else None

    def step(self, dq: onnx.NodeProto) -> tuple[onnx.NodeProto, onnx.NodeProto, float, float] | None:
        """(op, the Q after it, a, b) when ``dq``'s only reader is a Mul/Add by a scalar constant
        (``a * x + b``) that only a QuantizeLinear reads."""
        op = self.readers.get(dq.output[0], [])
        if len(op) != 1 or op[0].op_type not in OPS or len(op[0].input) != 2 or dq.output[0] in self.outputs:
            return None
        op = op[0]
        if op.input[0] == op.input[1]:
            return None
        other = op.input[1] if op.input[0] == dq.output[0] else op.input[0]
        v = _scalar_value(self.inits, self.producer, other)
        q = self.only_reader(op.output[0], "QuantizeLinear")
        if v is None or q is None or _scalar_qparams(self.inits, q) is None:
            return None
        return (op, q, v, 0.0) if op.op_type == "Mul" else (op, q, 1.0, v)

    def same_qparams(self, x: onnx.NodeProto, y: onnx.NodeProto) -> bool:
        a, b = _scalar_qparams(self.inits, x), _scalar_qparams(self.inits, y)
        return a is not None and b is not None and a[0] == b[0] and a[1].dtype == b[1].dtype and a[1] == b[1]

    def clamps(self, q: onnx.NodeProto, lo: float, hi: float) -> bool:
        """Whether ``q`` clips values in [lo, hi] by more than CLAMP_TOLERANCE of its steps: a clamp the
        model means (HardSigmoid written as int8), not the edge of a calibrated range."""
        s_q, z_q = _scalar_qparams(self.inits, q)
        info, z = np.iinfo(z_q.dtype), float(z_q.reshape(()))
        lo, hi = min(lo, hi), max(lo, hi)
        return max(s_q * (info.min - z) - lo, hi - s_q * (info.max - z)) > CLAMP_TOLERANCE * s_q

    def dequantized(self, name: str) -> tuple[onnx.NodeProto, np.ndarray, np.ndarray] | None:
        """(DQ node, integers, scale broadcast to them) of a DequantizeLinear of a constant, zero point 0."""
        inits = self.inits
        d = self.producer.get(name)
        if d is None or d.op_type != "DequantizeLinear" or d.input[0] not in inits or d.input[1] not in inits:
            return None
        q = numpy_helper.to_array(inits[d.input[0]])
        sc = numpy_helper.to_array(inits[d.input[1]]).astype(np.float64)
        if len(d.input) > 2 and d.input[2] and np.any(numpy_helper.to_array(inits[d.input[2]]) != 0):
            return None
        if sc.size > 1:
            if q.ndim == 0:
                return None
            axis = int(next((x.i for x in d.attribute if x.name == "axis"), 1)) % q.ndim
            shape = [1] * q.ndim
            shape[axis] = -1
            sc = sc.reshape(shape)
        return d, q, sc

    def biases(self, r: onnx.NodeProto, new: float, old: float, delta: float) -> list | None:
        """How each reader of ``r`` keeps its meaning once ``r`` reads with scale ``new`` (was ``old``)
        and every value ``delta`` off: a Conv's int32 bias is stored at input scale x weight scale, so
        it is requantized at the new scale, less ``delta`` times the weight's sum (exact inside the
        image; at a padded border the taps over padding add back part of it). Any other reader that
        keeps a bias (Gemm, ConvTranspose...) is not handled: None."""
        out = []
        for c in self.readers.get(r.output[0], []):
            if c.op_type in ("Gemm", "ConvTranspose", "QLinearConv", "ConvInteger"):
                return None
            if c.op_type != "Conv" or len(c.input) < 3 or not c.input[2]:
                continue
            if c.input[0] != r.output[0]:
                return None
            wb, bb = self.dequantized(c.input[1]), self.dequantized(c.input[2])
            if wb is None or bb is None or bb[1].dtype != np.int32 or len(self.readers.get(c.input[2], [])) != 1:
                return None
            w = (wb[1].astype(np.float64) * wb[2]).reshape(wb[1].shape[0], -1).sum(axis=1)
            b_float = bb[1].astype(np.float64) * bb[2]
            b_scale = np.asarray(numpy_helper.to_array(self.inits[bb[0].input[1]]), np.float64) * (new / old)
            b_q = np.round((b_float - delta * w) / b_scale.reshape(b_float.shape if b_scale.size > 1 else ()))
            if np.any(np.abs(b_q) > 2**31 - 1):
                return None
            out.append((bb[0], b_q.astype(np.int32), b_scale.astype(np.float32)))
        return out


class _Plan(NamedTuple):
    """One chain to fold."""

    dq: onnx.NodeProto  # the chain's first DequantizeLinear
    drop: list[onnx.NodeProto]  # the chain's nodes to drop
    readers: list[onnx.NodeProto]  # the DequantizeLinear nodes after the chain, to rewire
    scale: float
    zero: np.ndarray
    fixes: list[tuple[onnx.NodeProto, np.ndarray, np.ndarray]]  # (bias DQ, new int32 bias, new bias scale)


def _plans(graph: _Graph, nodes: list[onnx.NodeProto]) -> list[_Plan]:
    """The chains that fold, each from the first DequantizeLinear not already in another."""
    plans = []
    taken: set[int] = set()
    for dq in nodes:
        if dq.op_type != "DequantizeLinear" or id(dq) in taken:
            continue
        plan = _plan(graph, dq)
        if plan is not None:
            taken.update(id(n) for n in plan.drop)
            plans.append(plan)
    return plans


def _plan(graph: _Graph, dq: onnx.NodeProto) -> _Plan | None:
    """How the chain from ``dq`` folds (None: it does not): the integers ``dq`` reads, read by the
    DequantizeLinear nodes after the chain's last QuantizeLinear with a new scale and zero point."""
    inits, readers = graph.inits, graph.readers
    qp = _scalar_qparams(inits, dq)
    if qp is None:
        return None
    lo_int, hi_int = np.iinfo(qp[1].dtype).min, np.iinfo(qp[1].dtype).max
    z0 = float(qp[1].reshape(()))
    x_lo, x_hi = qp[0] * (lo_int - z0), qp[0] * (hi_int - z0)  # every value the input integers hold
    chain, a, b, q_last = _chain(graph, dq, x_lo, x_hi)
    if q_last is None:
        return None
    rs = readers.get(q_last.output[0], [])
    if not rs or q_last.output[0] in graph.outputs or any(
            r.op_type != "DequantizeLinear" or not graph.same_qparams(r, q_last) for r in rs):
        return None
    scale = a * qp[0]
    exact = z0 - b / scale
    zero = round(exact)
    if not (lo_int <= zero <= hi_int) or not np.isfinite(scale):
        return None
    fixes = [graph.biases(r, scale, _scalar_qparams(inits, q_last)[0], scale * (exact - zero)) for r in rs]
    if any(f is None for f in fixes):
        return None
    drop = chain + ([dq] if len(readers.get(dq.output[0], [])) == 1 else [])
    return _Plan(dq, drop, rs, scale, np.array(zero, qp[1].dtype), [x for f in fixes for x in f])


def _chain(graph: _Graph, dq: onnx.NodeProto, x_lo: float, x_hi: float
           ) -> tuple[list[onnx.NodeProto], float, float, onnx.NodeProto | None]:
    """The longest chain after ``dq`` (whose values span [x_lo, x_hi]) that neither flips the sign nor
    clamps: (its nodes after ``dq``, a, b of the whole ``a * x + b``, its last QuantizeLinear or None)."""
    chain: list[onnx.NodeProto] = []
    a, b, cur, q_last = 1.0, 0.0, dq, None
    while (st := graph.step(cur)) is not None:
        op, q, sa, sb = st
        na, nb = a * sa, b * sa + sb
        if na <= 0 or graph.clamps(q, na * x_lo + nb, na * x_hi + nb):
            break
        if cur is not dq:
            chain.append(cur)
        chain += [op, q]
        a, b, q_last = na, nb, q
        cur = graph.only_reader(q.output[0], "DequantizeLinear")
        if cur is None or not graph.same_qparams(cur, q):  # a DQ with other parameters rescales: not followed
            break
    return chain, a, b, q_last


def _rewritten(model: onnx.ModelProto, nodes: list[onnx.NodeProto], graph: _Graph,
               plans: list[_Plan]) -> onnx.ModelProto:
    """A copy of ``model`` with the chains of ``plans`` dropped, their readers rewired and the
    constants only the dropped nodes read removed."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    drop_i, rewire = _new_parameters(m, nodes, plans)
    kept = _rewired(g, drop_i, rewire)
    freed = {x for i, n in enumerate(nodes) if i in drop_i or i in rewire for x in n.input} - \
        {x for n in kept for x in n.input}
    kept, freed = _without_dead_dequantizers(kept, freed, graph.outputs)
    used = {x for n in kept for x in n.input}
    del g.node[:]
    g.node.extend(kept)
    for t in [t for t in g.initializer if t.name in freed and t.name in graph.inits and t.name not in used]:
        if not _read_by_subgraphs(kept, t.name):
            g.initializer.remove(t)
    return m


def _new_parameters(m: onnx.ModelProto, nodes: list[onnx.NodeProto], plans: list[_Plan]
                    ) -> tuple[set[int], dict[int, list[str]]]:
    """Add each plan's scale, zero point and corrected biases to ``m``: (indices of the nodes to drop,
    index -> new inputs of the nodes to rewire)."""
    g = m.graph
    index = {id(n): i for i, n in enumerate(nodes)}
    names = _Names(m)
    drop_i: set[int] = set()
    rewire: dict[int, list[str]] = {}
    for dq, drop, rs, scale, zero, fixes in plans:
        s_name, z_name = names.new(f"{dq.input[0]}_affine_scale"), names.new(f"{dq.input[0]}_affine_zero_point")
        g.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), s_name),
                              numpy_helper.from_array(zero, z_name)])
        drop_i.update(index[id(n)] for n in drop)
        for r in rs:
            rewire[index[id(r)]] = [dq.input[0], s_name, z_name]
        for bias_dq, b_q, b_scale in fixes:
            q_name, bs_name = names.new(f"{bias_dq.input[0]}_affine"), names.new(f"{bias_dq.input[1]}_affine")
            g.initializer.extend([numpy_helper.from_array(b_q, q_name), numpy_helper.from_array(b_scale, bs_name)])
            rewire[index[id(bias_dq)]] = [q_name, bs_name] + list(bias_dq.input[2:])
    return drop_i, rewire


def _rewired(g: onnx.GraphProto, drop_i: set[int], rewire: dict[int, list[str]]) -> list[onnx.NodeProto]:
    """The nodes of ``g`` that stay, in order, the rewired ones reading their new inputs."""
    kept = []
    for i, n in enumerate(g.node):
        if i in drop_i:
            continue
        if i in rewire:
            n.ClearField("input")
            n.input.extend(rewire[i])
        kept.append(n)
    return kept


def _without_dead_dequantizers(kept: list[onnx.NodeProto], freed: set[str], outputs: set[str]
                               ) -> tuple[list[onnx.NodeProto], set[str]]:
    """``kept`` without the DequantizeLinear nodes of constants that only the dropped nodes read (when
    nothing else reads them), and ``freed`` with the tensors those read."""
    while True:
        read = {x for n in kept for x in n.input}
        dead = {id(n) for n in kept if n.op_type == "DequantizeLinear" and n.output[0] in freed
                and n.output[0] not in read and n.output[0] not in outputs}
        if not dead:
            break
        freed |= {x for n in kept if id(n) in dead for x in n.input}
        kept = [n for n in kept if id(n) not in dead]
    return kept, freed
