"""QDQ patterns run as integer kernels (numpy backend).

A QDQ model (what onnxruntime's ``quantize_static`` and
:func:`edgeflow.quantize` write) is a float graph with QuantizeLinear /
DequantizeLinear pairs around each quantized op. Executed literally, every
layer costs a float GEMM plus dequantize/quantize passes, so it would be
*slower* than the fp32 model. This pass (the numpy backend's part of
:mod:`edgeflow.runtime.optimize`) rewrites:

1. ``DQ -> Conv/Gemm/MatMul (weights DQ(int8 initializer), bias DQ(int32))
   [-> Relu] [-> Q]`` into one fused integer kernel (``edgeflow.fused::QConv``
   / ``QGemm``, see ``kernels/qdq_fused.py``) reading the quantized input
   directly;
2. ``DQ -> MaxPool/Flatten/Reshape/... -> Q`` with identical parameters into
   the same op on the integer tensor (these ops commute with a monotonic
   per-tensor dequantization, and ``Q(DQ(v)) == v``);
3. ``DQ`` of constant initializers (leftover weights) into float
   initializers, computed once at load instead of on every run;

then removes nodes whose outputs nobody reads and initializers nobody uses.
Anything that does not match exactly is left as it is — still correct, just
not fused. It operates on the compiled graph (nodes bound to kernels) and
returns a new one; the model is never changed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ....kernels import UnknownOpError, get_kernel
from ....kernels.int_gemm import F32_EXACT, F64_EXACT, int_bound
from ....kernels.qdq_fused import FUSED_DOMAIN, k_blocks

#: Ops that only move or select values: on a per-tensor quantized input they
#: give the same result on the integers as on the dequantized floats.
PASS_THROUGH = frozenset({"MaxPool", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity"})
_INT8 = (np.dtype(np.int8), np.dtype(np.uint8))


@dataclass(frozen=True)
class QParams:
    """Constant per-tensor (or per-axis) quantization parameters of one DQ/Q node."""

    scale: np.ndarray  # float32, scalar or 1-D
    zero_point: np.ndarray  # integer, same shape
    axis: int

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1

    def same_as(self, other: "QParams") -> bool:
        return (
            self.per_tensor and other.per_tensor
            and self.zero_point.dtype == other.zero_point.dtype
            and float(self.scale.reshape(-1)[0]) == float(other.scale.reshape(-1)[0])
            and int(self.zero_point.reshape(-1)[0]) == int(other.zero_point.reshape(-1)[0])
        )


class _Graph:
    """Producer / reader indexes over the node list, kept current by the rewrite."""

    def __init__(self, nodes: list, inits: dict[str, np.ndarray], outputs: set[str], types: dict[str, str]) -> None:
        self.nodes = nodes
        self.inits = inits
        self.outputs = outputs
        self.types = types
        self.producer = {o: n for n in nodes for o in n.outputs if o}
        self.readers: dict[str, list] = {}
        for n in nodes:
            for x in n.inputs:
                if x:
                    self.readers.setdefault(x, []).append(n)

    def sole_reader(self, name: str):
        rs = self.readers.get(name, [])
        if len(rs) != 1 or name in self.outputs:
            return None
        return rs[0]

    def qparams(self, node) -> QParams | None:
        """Parameters of a DQ/Q node when scale and zero point are constants."""
        if node is None or node.op_type not in ("DequantizeLinear", "QuantizeLinear") or node.domain:
            return None
        if len(node.inputs) < 2 or node.inputs[1] not in self.inits:
            return None
        if node.attrs.get("block_size"):
            return None
        scale = np.asarray(self.inits[node.inputs[1]])
        if scale.dtype != np.float32 or scale.ndim > 1:
            return None
        zp_name = node.inputs[2] if len(node.inputs) > 2 else ""
        if zp_name and zp_name not in self.inits:
            return None
        if zp_name:
            zp = np.asarray(self.inits[zp_name])
        elif node.op_type == "QuantizeLinear":
            zp = np.zeros(scale.shape, np.uint8)  # the spec's default output type
        else:
            x = node.inputs[0]
            dt = self.inits[x].dtype if x in self.inits else self.types.get(x)
            if not dt:
                return None
            zp = np.zeros(scale.shape, dt)
        if node.op_type == "QuantizeLinear" and (node.attrs.get("output_dtype") or node.attrs.get("precision")):
            return None
        return QParams(scale, zp, int(node.attrs.get("axis", 1)))

    def dq_input(self, name: str):
        """(DQ node, params) when ``name`` is produced by a constant-parameter DQ."""
        dq = self.producer.get(name)
        p = self.qparams(dq)
        if p is None or dq.op_type != "DequantizeLinear":
            return None, None
        return dq, p


def fuse_qdq(graph):
    """CompiledGraph -> CompiledGraph with QDQ patterns rewritten (see the module docstring).

    The graph's ``types`` (value name -> dtype name) resolve the integer type
    of a DequantizeLinear that has no zero-point input. A graph without
    DequantizeLinear comes back as it is.
    """
    nodes = graph.nodes
    if not any(n.op_type == "DequantizeLinear" and not n.domain for n in nodes):
        return graph
    nodes, inits = _fuse(list(nodes), dict(graph.initializers), set(graph.output_names), graph.opset,
                         graph.types)
    return dataclasses.replace(graph, nodes=nodes, initializers=inits)


def _fuse(nodes: list, inits: dict[str, np.ndarray], graph_outputs: set[str], opset: int,
          types: dict[str, str] | None) -> tuple[list, dict[str, np.ndarray]]:
    names_before = set(inits)
    g = _Graph(nodes, inits, graph_outputs, types or {})
    used_before = set(g.readers)  # every value some node reads
    replace: dict[int, object] = {}  # id(old node) -> new node (or None: drop)
    for n in nodes:
        if n.domain or id(n) in replace:
            continue
        if n.op_type in PASS_THROUGH:
            _fuse_pass_through(g, n, opset, replace)
        elif n.op_type in ("Conv", "Gemm", "MatMul"):
            _fuse_linear(g, n, replace)
    out = []
    for n in nodes:
        if id(n) in replace:
            if replace[id(n)] is not None:
                out.append(replace[id(n)])
        else:
            out.append(n)
    out = _dead_code(out, graph_outputs)
    out = _fold_constant_dq(out, inits)
    used_after = {x for n in out for x in n.inputs if x}
    created = set(inits) - names_before
    for name in ((used_before & names_before) | created) - used_after - graph_outputs:
        inits.pop(name, None)
    return out, inits


def _fuse_pass_through(g: _Graph, n, opset: int, replace: dict) -> None:
    dq, p_in = g.dq_input(n.inputs[0]) if n.inputs else (None, None)
    if dq is None or not p_in.per_tensor or len(n.outputs) != 1:
        return
    q = g.sole_reader(n.outputs[0])
    p_out = g.qparams(q)
    if p_out is None or q.op_type != "QuantizeLinear" or q.inputs[0] != n.outputs[0] or not p_in.same_as(p_out):
        return
    if any(x and x not in g.inits for x in n.inputs[1:]):
        return  # e.g. a Reshape whose shape is computed: keep it float
    x_q = dq.inputs[0]
    try:
        kernel = get_kernel(n.op_type, "", opset, p_in.zero_point.dtype)
    except UnknownOpError:
        return
    replace[id(n)] = dataclasses.replace(
        n, name=f"{n.name}::int", domain="", inputs=[x_q] + list(n.inputs[1:]), outputs=[q.outputs[0]],
        attrs=dict(n.attrs), kernel=kernel, free_after=[],
    )
    replace[id(q)] = None


def _weight(g: _Graph, name: str):
    """(int weights, params) for a DQ of a constant int8/uint8 initializer."""
    dq, p = g.dq_input(name)
    if dq is None or dq.inputs[0] not in g.inits:
        return None, None
    w = np.asarray(g.inits[dq.inputs[0]])
    if w.dtype not in _INT8:
        return None, None
    return w, p


def _bias(g: _Graph, name: str, acc_scale: np.ndarray, m: int) -> np.ndarray | None | bool:
    """int32 bias in accumulator units; ``None`` if absent; ``False`` if unusable."""
    if not name:
        return None
    dq, p = g.dq_input(name)
    if dq is None or dq.inputs[0] not in g.inits:
        return False
    b = np.asarray(g.inits[dq.inputs[0]])
    if b.dtype != np.int32 or b.size != m or np.any(p.zero_point):
        return False
    # The integer bias is only meaningful in units of x_scale * w_scale.
    if not np.allclose(np.broadcast_to(p.scale, (m,)), acc_scale, rtol=1e-5, atol=0):
        return False
    return b.reshape(m).astype(np.int64)


def _fuse_linear(g: _Graph, n, replace: dict) -> None:
    """DQ -> Conv/Gemm/MatMul [-> Relu] [-> Q] as one QConv/QGemm node, when the pattern matches exactly."""
    f = _LinearFusion(g, n)
    if not f.match():
        return
    f.requantization()
    bias = _bias(g, n.inputs[2] if len(n.inputs) > 2 else "", f.acc_scale, f.m)
    if bias is False:
        return
    f.output_side()
    if not f.integer_weights(bias):
        return  # beyond float64's exact range: leave the float pattern
    w_name = f.pack()
    f.rewire(replace, w_name, f.fused_attrs())


class _LinearFusion:
    """The steps of :func:`_fuse_linear` on one Conv/Gemm/MatMul node ``n``; each step keeps what it found."""

    def __init__(self, g: _Graph, n) -> None:
        self.g = g
        self.n = n
        self.op = n.op_type

    def match(self) -> bool:
        """Input from a per-tensor int8 DQ, weights a DQ'd int8 initializer laid out as the op needs."""
        g, n = self.g, self.n
        if len(n.inputs) < 2 or len(n.outputs) != 1:
            return False
        self.dq_x, self.px = g.dq_input(n.inputs[0])
        if self.dq_x is None or not self.px.per_tensor or self.px.zero_point.dtype not in _INT8:
            return False
        self.w, self.pw = _weight(g, n.inputs[1])
        if self.w is None:
            return False
        if not self._layout():
            return False
        w, pw = self.w, self.pw
        self.m = w.shape[self.out_axis]
        if not pw.per_tensor:
            if pw.scale.size != self.m or (pw.axis % w.ndim) != self.out_axis:
                return False  # scales along the reduction axis cannot be factored out
        return True

    def _layout(self) -> bool:
        """The (K, N) weights ``wk`` (Gemm/MatMul; None for Conv) and the output-channel axis of ``w``."""
        n, w = self.n, self.w
        if self.op == "Gemm":
            a = n.attrs
            if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or (
                len(n.inputs) > 2 and n.inputs[2] and a.get("beta", 1.0) != 1.0
            ):
                return False
            if w.ndim != 2:
                return False
            trans_b = int(a.get("transB", 0))
            self.wk = w.T if trans_b else w  # (K, N)
            self.out_axis = 0 if trans_b else 1
        elif self.op == "MatMul":
            if w.ndim != 2:
                return False
            self.wk, self.out_axis = w, 1
        else:  # Conv
            if w.ndim < 3:
                return False
            self.wk, self.out_axis = None, 0
        return True

    def requantization(self) -> None:
        """Per-channel weight scales and zero points, the input's, and the accumulator scale x_scale * w_scale."""
        m, pw, px = self.m, self.pw, self.px
        ws = np.broadcast_to(pw.scale.astype(np.float32).reshape(-1), (m,))
        self.wzp = np.broadcast_to(pw.zero_point.astype(np.int64).reshape(-1), (m,))
        xs = np.float32(px.scale.reshape(-1)[0])
        self.xzp = int(px.zero_point.reshape(-1)[0])
        self.acc_scale = (xs * ws).astype(np.float32)

    def output_side(self) -> None:
        """Output side: [Relu ->] Q with constant per-tensor parameters, or float."""
        g = self.g
        y = self.n.outputs[0]
        self.chain = []
        self.relu = 0
        nxt = g.sole_reader(y)
        if nxt is not None and nxt.op_type == "Relu" and not nxt.domain:
            self.chain.append(nxt)
            self.relu = 1
            y = nxt.outputs[0]
            nxt = g.sole_reader(y)
        pq = g.qparams(nxt) if nxt is not None and nxt.op_type == "QuantizeLinear" and nxt.inputs[0] == y else None
        if pq is not None and (not pq.per_tensor or pq.zero_point.dtype not in _INT8):
            pq = None
        self.y, self.nxt, self.pq = y, nxt, pq

    def integer_weights(self, bias: np.ndarray | None) -> bool:
        """The shifted integer weights, constant row ``c`` and sum bounds; False beyond float64's exact range."""
        w, m, n = self.w, self.m, self.n
        # Integer weights shifted by their zero point, with the output channel first.
        if self.op == "Conv":
            self.group = int(n.attrs.get("group", 1))
            wsh = (w.astype(np.int64) - self.wzp.reshape((m,) + (1,) * (w.ndim - 1))).reshape(m, -1)  # (M, Ck)
        else:
            self.group = 1
            wsh = (self.wk.astype(np.int64) - self.wzp.reshape(1, m)).T  # (N, K)
        c = -self.xzp * wsh.sum(axis=1)
        if bias is not None:
            c = c + bias
        # Bounds of every reduction term |x_k * w_mk| (raw inputs) and of the
        # constant row; they decide which sums float32 provably gets exact.
        terms = int_bound(self.px.zero_point.dtype) * np.abs(wsh)
        c_in_gemm = bool(np.all(np.abs(c) <= F32_EXACT))
        if c_in_gemm:
            terms = np.concatenate([terms, np.abs(c)[:, None]], axis=1)
        total = int(terms.sum(axis=1).max()) + (0 if c_in_gemm else int(np.abs(c).max()))
        self.wsh, self.c, self.terms, self.c_in_gemm, self.total = wsh, c, terms, c_in_gemm, total
        return total <= F64_EXACT

    def pack(self) -> str:
        """The exact blocks; the packed float32 weights (``c`` as one more row if exact) as a new initializer."""
        terms, c_in_gemm, wsh, c = self.terms, self.c_in_gemm, self.wsh, self.c
        blocks = k_blocks(terms)
        if not c_in_gemm and not blocks:
            blocks = (0, terms.shape[1])  # one exact block; c is added in float64
        self.blocks = blocks
        packed_mk = (np.concatenate([wsh, c[:, None]], axis=1) if c_in_gemm else wsh).astype(np.float32)
        if self.op == "Conv":
            packed = np.ascontiguousarray(packed_mk.reshape(self.group, self.m // self.group, -1))
        else:
            packed = np.ascontiguousarray(packed_mk.T)  # (K (+1), N)
        w_name = f"{self.n.inputs[1]}::fused"
        self.g.inits[w_name] = packed
        return w_name

    def fused_attrs(self) -> dict:
        """The fused node's attributes: requantization to the Q's parameters (or a float scale), conv geometry."""
        n, pq = self.n, self.pq
        attrs: dict = {
            "relu": self.relu,
            "blocks": self.blocks,
            "c64": None if self.c_in_gemm else self.c.astype(np.float64),
            "wrap": int(self.total >= 2**31),
        }
        if pq is not None:
            ys = np.float32(pq.scale.reshape(-1)[0])
            attrs.update(
                multiplier=(self.acc_scale / ys).astype(np.float32),
                y_zero_point=int(pq.zero_point.reshape(-1)[0]),
                y_dtype=pq.zero_point.dtype.name,
            )
            self.out_name = self.nxt.outputs[0]
            self.chain.append(self.nxt)
        else:
            attrs["out_scale"] = self.acc_scale
            self.out_name = self.y
        if self.op == "Conv":
            attrs["x_zero_point"] = self.xzp
            for k in ("auto_pad", "dilations", "group", "pads", "strides"):
                if k in n.attrs:
                    attrs[k] = n.attrs[k]
            attrs["kernel_shape"] = tuple(n.attrs.get("kernel_shape") or self.w.shape[2:])
        return attrs

    def rewire(self, replace: dict, w_name: str, attrs: dict) -> None:
        """The QConv/QGemm node in ``n``'s place, reading the quantized input; the Relu/Q it absorbed dropped."""
        n = self.n
        fused_op = "QConv" if self.op == "Conv" else "QGemm"
        replace[id(n)] = dataclasses.replace(
            n, name=f"{n.name}::fused", op_type=fused_op, domain=FUSED_DOMAIN,
            inputs=[self.dq_x.inputs[0], w_name], outputs=[self.out_name], attrs=attrs,
            kernel=get_kernel(fused_op, FUSED_DOMAIN, None, self.px.zero_point.dtype), free_after=[],
        )
        for r in self.chain:
            replace[id(r)] = None


def _fold_constant_dq(nodes: list, inits: dict[str, np.ndarray]) -> list:
    """Evaluate DequantizeLinear nodes whose inputs are all initializers, once."""
    out = []
    for n in nodes:
        if n.op_type == "DequantizeLinear" and not n.domain and all((not x) or x in inits for x in n.inputs):
            args = [inits[x] if x else None for x in n.inputs]
            inits[n.outputs[0]] = n.kernel.forward(*args, **n.attrs)
            continue
        out.append(n)
    return out


def _dead_code(nodes: list, graph_outputs: set[str]) -> list:
    """Drop nodes none of whose outputs is read or is a graph output."""
    needed = set(graph_outputs)
    keep = []
    for n in reversed(nodes):
        if any(o and o in needed for o in n.outputs):
            keep.append(n)
            needed.update(x for x in n.inputs if x)
    keep.reverse()
    return keep
