"""BatchNormalization folded into the Conv, Gemm or MatMul(+Add) before it.

At inference BatchNormalization is a per-channel affine map
``y = (x - mean) * s + B`` with ``s = scale / sqrt(var + epsilon)``. When
``x`` comes from a linear layer whose only reader is the BN, the map goes
into that layer's weights and bias (computed in float64, stored in the
weight's dtype), and the BN node disappears:

- ``Conv(W, b) -> BN``: ``W' = W * s`` per output channel, ``b' = (b - mean) * s + B``;
- ``Gemm(A, B, C) -> BN``: B scaled per output column, ``C' = (beta C - mean) s + B``, beta 1;
- ``MatMul(X, W) [-> Add(bias)] -> BN`` on a rank-2 output: W scaled per
  column, the bias becomes (or stays) an Add.

Folded only when every parameter is a constant initializer outside
``keep`` (training keeps BN: its parameters train), BN is in inference mode
and only its first output is read. A weight read by another node too is
written under a new name; otherwise it keeps its name.

:func:`fuse_conv_affine` folds the same way a ``Mul`` or ``Add`` by a
constant that is one value or one per output channel (shape ``(C, 1, 1)``,
``(1, C, 1, 1)``, ...) after a Conv: ``W' = W * c``, ``b' = b * c`` for
``Mul(c)``; ``b' = b + d`` for ``Add(d)``. PP-OCRv4's recognizer writes its
"learnable affine blocks" so (28 Conv -> Mul -> Add): onnxruntime folds them
in fp32 itself, but once quantized each is a QLinearMul and a QLinearAdd
over the whole activation.
"""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node, PassOptions


class _Rewriter:
    def __init__(self, graph: Graph, options: PassOptions) -> None:
        self.g = graph
        self.keep = options.kept(graph)
        self.const = graph.constants(self.keep)
        self.outputs = set(graph.output_names)
        self.inits = dict(graph.initializers)
        self.readers = graph.readers()
        self.index = {id(n): i for i, n in enumerate(graph.nodes)}
        self.producers = graph.producers()
        self.taken: set[str] = set()
        self.replace: dict[int, list[Node]] = {}  # node index -> nodes written in its place
        self.drop: set[int] = set()

    def free(self, n: Node | None) -> bool:
        i = self.index[id(n)] if n is not None else None
        return i is not None and i not in self.drop and i not in self.replace

    def sole_reader(self, name: str) -> Node | None:
        rs = self.readers.get(name, [])
        if len(rs) != 1 or name in self.outputs or name in self.keep:
            return None
        return rs[0]

    def producer(self, name: str, op: str) -> Node | None:
        p = self.producers.get(name)
        return p if p is not None and p.is_op(op) and self.free(p) else None

    def name_for(self, name: str, base: str) -> str:
        """Where a rewritten weight goes: its own name if only this node read it, else a new one."""
        if name and len(self.readers.get(name, [])) == 1:
            return name
        new = self.g.fresh_name(f"{name or base}_bn", self.taken)
        self.taken.add(new)
        return new

    def bn_params(self, bn: Node) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(s, mean, B) in float64 for an inference-mode BN with constant parameters, else None."""
        if len(bn.inputs) != 5 or not all(x in self.const for x in bn.inputs[1:]):
            return None
        if any(o and (o in self.readers or o in self.outputs) for o in bn.outputs[1:]):
            return None
        if bn.attr("training_mode", 0) or not bn.attr("spatial", 1):
            return None
        scale, bias, mean, var = (np.asarray(self.inits[x], np.float64).reshape(-1) for x in bn.inputs[1:])
        if not (scale.shape == bias.shape == mean.shape == var.shape):
            return None
        return scale / np.sqrt(var + float(bn.attr("epsilon", 1e-5))), mean, bias

    def weight(self, name: str) -> np.ndarray | None:
        if name not in self.const:
            return None
        w = self.inits[name]
        return w if w.dtype.kind == "f" else None

    def fold(self, bn: Node) -> bool:
        x = bn.inputs[0] if bn.inputs else ""
        if self.sole_reader(x) is not bn:
            return False
        params = self.bn_params(bn)
        if params is None:
            return False
        p = self.producers.get(x)
        if p is None or not self.free(p):
            return False
        if p.is_op("Conv"):
            return self._conv(p, bn, *params)
        if p.is_op("Gemm"):
            return self._gemm(p, bn, *params)
        if p.is_op("MatMul", "Add"):
            return self._matmul(p, bn, *params)
        return False

    def fold_affine(self, op: Node) -> bool:
        """``Conv -> Mul(c)`` or ``Conv -> Add(d)``, c / d constant per output channel, into the Conv."""
        if len(op.inputs) != 2 or any(o in self.readers for o in op.outputs[1:]):
            return False
        for k in (0, 1):
            x, c = op.inputs[k], op.inputs[1 - k]
            p = self.producer(x, "Conv")
            if p is None or c not in self.const or self.sole_reader(x) is not op:
                continue
            w = self.weight(p.inputs[1]) if len(p.inputs) > 1 else None
            v = self.inits[c]
            if w is None or v.dtype != w.dtype or v.ndim > w.ndim:
                continue
            m = w.shape[0]
            full = (1,) * (w.ndim - v.ndim) + tuple(v.shape)
            if full[0] != 1 or full[1] not in (1, m) or any(d != 1 for d in full[2:]):
                continue
            vec = np.broadcast_to(np.asarray(v, np.float64).reshape(-1), (m,))
            if op.is_op("Mul"):
                return self._conv(p, op, vec, np.zeros(m), np.zeros(m))
            return self._conv(p, op, np.ones(m), np.zeros(m), vec)
        return False

    def _commit(self, bn: Node, old: list[Node], new: list[Node]) -> bool:
        """Write ``new`` in the places of ``old`` (same count), drop ``bn``."""
        for o, n in zip(old, new):
            self.replace[self.index[id(o)]] = [n]
        self.drop.add(self.index[id(bn)])
        return True

    def _conv(self, p: Node, bn: Node, s, mean, beta) -> bool:
        m = s.size
        w = self.weight(p.inputs[1]) if len(p.inputs) > 1 else None
        b_name = p.inputs[2] if len(p.inputs) > 2 else ""
        if w is None or w.ndim < 3 or w.shape[0] != m or (b_name and self.weight(b_name) is None):
            return False
        b = np.asarray(self.inits[b_name], np.float64).reshape(-1) if b_name else np.zeros(m)
        if b.size != m:
            return False
        wn, bname = self.name_for(p.inputs[1], ""), self.name_for(b_name, f"{p.inputs[1]}_bias")
        self.inits[wn] = (w.astype(np.float64) * s.reshape((m,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        self.inits[bname] = ((b - mean) * s + beta).astype(w.dtype)
        return self._commit(bn, [p], [p.replace(inputs=[p.inputs[0], wn, bname], outputs=[bn.outputs[0]])])

    def _gemm(self, p: Node, bn: Node, s, mean, beta_bn) -> bool:
        m = s.size
        w = self.weight(p.inputs[1]) if len(p.inputs) > 1 else None
        c_name = p.inputs[2] if len(p.inputs) > 2 else ""
        trans_b = int(p.attr("transB", 0))
        if w is None or w.ndim != 2 or w.shape[0 if trans_b else 1] != m or (c_name and self.weight(c_name) is None):
            return False
        c = float(p.attr("beta", 1.0)) * np.asarray(self.inits[c_name], np.float64) if c_name else np.zeros(m)
        try:
            c_new = ((c - mean) * s + beta_bn).astype(w.dtype)
        except ValueError:  # C does not broadcast along the channels
            return False
        wn, cname = self.name_for(p.inputs[1], ""), self.name_for(c_name, f"{p.inputs[1]}_bias")
        self.inits[wn] = (w.astype(np.float64) * (s[:, None] if trans_b else s[None, :])).astype(w.dtype)
        self.inits[cname] = c_new
        new = p.replace(inputs=[p.inputs[0], wn, cname], outputs=[bn.outputs[0]]).with_attrs(beta=1.0)
        return self._commit(bn, [p], [new])

    def _matmul(self, p: Node, bn: Node, s, mean, beta_bn) -> bool:
        m = s.size
        dims = self.g.dims(p.outputs[0])
        if dims is None or len(dims) != 2:
            return False  # BN's channel axis 1 is MatMul's last axis only for rank 2
        add, bias_name, bias = None, "", np.zeros(m)
        if p.is_op("Add"):
            add, mm = p, None
            for k in (0, 1):
                q = self.producer(p.inputs[k], "MatMul") if len(p.inputs) == 2 else None
                if q is not None and p.inputs[1 - k] in self.const and self.sole_reader(q.outputs[0]) is p:
                    mm, bias_name = q, p.inputs[1 - k]
                    break
            if mm is None:
                return False
            bias = np.asarray(self.inits[bias_name], np.float64)
            if bias.shape not in ((m,), (1, m)):
                return False
            bias = bias.reshape(-1)
        else:
            mm = p
        w = self.weight(mm.inputs[1]) if len(mm.inputs) == 2 else None
        if w is None or w.ndim != 2 or w.shape[1] != m:
            return False
        wn, bname = self.name_for(mm.inputs[1], ""), self.name_for(bias_name, f"{mm.inputs[1]}_bias")
        self.inits[wn] = (w.astype(np.float64) * s[None, :]).astype(w.dtype)
        self.inits[bname] = ((bias - mean) * s + beta_bn).astype(w.dtype)
        new_mm = mm.replace(inputs=[mm.inputs[0], wn])
        if add is not None:
            new_add = add.replace(inputs=[mm.outputs[0], bname], outputs=[bn.outputs[0]])
            return self._commit(bn, [mm, add], [new_mm, new_add])
        # MatMul -> BN becomes MatMul -> Add: the Add takes BN's place
        self.replace[self.index[id(mm)]] = [new_mm]
        self.replace[self.index[id(bn)]] = [Node("Add", (mm.outputs[0], bname), (bn.outputs[0],),
                                                 domain=bn.domain, name=bn.name)]
        return True

    def result(self) -> Graph:
        nodes: list[Node] = []
        for i, n in enumerate(self.g.nodes):
            if i in self.replace:
                nodes.extend(self.replace[i])
            elif i not in self.drop:
                nodes.append(n)
        used = {x for n in nodes for x in n.reads}
        overridable = self.g.overridable
        inits = {k: v for k, v in self.inits.items()
                 if k in used or k in overridable or k in self.outputs or k in self.keep}
        return self.g.replace(nodes=nodes, initializers=inits)


def fuse_batchnorm(graph: Graph, options: PassOptions = PassOptions()) -> Graph:
    rw = _Rewriter(graph, options)
    changed = False
    for n in graph.nodes:
        if n.is_op("BatchNormalization") and rw.free(n):
            changed |= rw.fold(n)
    return rw.result() if changed else graph


def fuse_conv_affine(graph: Graph, options: PassOptions = PassOptions()) -> Graph:
    """Mul / Add by a per-channel constant folded into the Conv before it (chains too: Conv -> Mul -> Add)."""
    while True:
        rw = _Rewriter(graph, options)
        changed = False
        for n in graph.nodes:
            if n.is_op("Mul", "Add") and rw.free(n):
                changed |= rw.fold_affine(n)
        if not changed:
            return graph
        graph = rw.result()
