"""Decomposed layer normalization as one node (numpy backend).

PyTorch exports ``nn.LayerNorm`` (below opset 17) and hand-written norms as

    m = ReduceMean(x, axes=[-1]);  d = Sub(x, m);  p = Pow(d, 2)  (or Mul(d, d))
    v = ReduceMean(p, axes=[-1]);  s = Sqrt(Add(v, eps));  n = Div(d, s)
    [y = Mul(n, gamma)]  [y = Add(y, beta)]

nine dispatches on small tensors (openWakeWord's classifiers: two per
model). This pass replaces the chain with one node that runs the same
numpy operations in the same order — in place where the chain allocated —
so results are those of the unfused graph. Every intermediate must be read
only inside the chain (``d`` by Pow and Div) and be no graph output; gamma,
beta and eps must be initializers. onnxruntime does the same
(LayerNormFusion). The fused node is labelled ``LayerNorm(fused)``; an
activation after it can still be fused (:mod:`.fuse_activation` runs after).
"""

from __future__ import annotations

import dataclasses

import numpy as np

FUSED = "LayerNorm(fused)"


def _axes(node, inits) -> tuple[int, ...] | None:
    if node.attrs.get("keepdims", 1) != 1 or node.attrs.get("noop_with_empty_axes", 0):
        return None
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        if node.inputs[1] not in inits:
            return None
        axes = inits[node.inputs[1]]
    if axes is None:
        return None
    return tuple(int(a) for a in np.asarray(axes).reshape(-1))


def _scalar(inits, name):
    v = inits.get(name)
    if v is None or v.size != 1:
        return None
    return v


def _affine(node, value: str, inits):
    """The initializer a Mul/Add applies to ``value`` (either operand order), else None."""
    a, b = (node.inputs + ["", ""])[:2]
    other = b if a == value else a if b == value else None
    return inits.get(other) if other and other != value else None


def _make_forward(axes, two_is_pow: bool, pow_exp, eps, gamma, beta):
    def mean(a):  # np.mean's arithmetic (a float32 sum, then one division) without its Python layers
        s = np.add.reduce(a, axis=axes, keepdims=True)
        n = a.size // s.size if s.size else 1
        return np.true_divide(s, n, out=s) if s.dtype.kind == "f" else s / n

    fits: dict[tuple, tuple[bool, bool]] = {}  # per output shape: gamma / beta apply in place
    # (np.broadcast_shapes is ~5 us of Python per call: a third of a 128-wide layer norm)

    def forward(x):
        m = mean(x)
        d = x - m
        p = np.power(d, pow_exp) if two_is_pow else d * d
        v = mean(p)
        v = np.asarray(v + eps)
        np.sqrt(v, out=v)
        n = np.divide(d, v, out=d)
        fit = fits.get(n.shape)
        if fit is None:
            fit = fits[n.shape] = tuple(p is not None and np.broadcast_shapes(n.shape, p.shape) == n.shape
                                        for p in (gamma, beta))
        if gamma is not None:
            n = np.multiply(n, gamma, out=n) if fit[0] else n * gamma
        if beta is not None:
            n = np.add(n, beta, out=n) if fit[1] else n + beta
        return n
    return forward


def _op(n, *types) -> bool:
    """Whether ``n`` is a default-domain node of one of ``types``."""
    return n is not None and not n.domain and n.kernel.op_type in types


@dataclasses.dataclass(eq=False)
class _Chain:
    """A matched decomposed layer norm: its nodes in order and what the fused node computes."""

    nodes: list
    x: str
    axes: tuple[int, ...]
    two_is_pow: bool
    pow_exp: object
    eps: object
    gamma: object = None
    beta: object = None

    @property
    def last(self):
        """The chain's last node (Div, or the Mul/Add of gamma/beta)."""
        return self.nodes[-1]


class _Matcher:
    """Finds decomposed layer norms in a graph: who reads each value, and the chain from a ReduceMean."""

    def __init__(self, graph) -> None:
        self.inits = graph.initializers
        self.outputs = set(graph.output_names)
        self.readers: dict[str, list] = {}
        for n in graph.nodes:
            for x in n.inputs:
                if x and all(r is not n for r in self.readers.get(x, [])):  # Mul(d, d) reads d once
                    self.readers.setdefault(x, []).append(n)

    def only(self, name, count=1):
        """The readers of ``name`` when there are exactly ``count`` and it is no graph output."""
        rs = self.readers.get(name, [])
        return rs if len(rs) == count and name not in self.outputs else None

    def match(self, mean1) -> _Chain | None:
        """The layer norm whose first node is the ReduceMean ``mean1``, else None."""
        axes = _axes(mean1, self.inits)
        if axes is None:
            return None
        x, m = mean1.inputs[0], mean1.outputs[0]
        rs = self.only(m)
        if not rs or not _op(rs[0], "Sub") or rs[0].inputs[:2] != [x, m]:
            return None
        sub = rs[0]
        d = sub.outputs[0]
        found = self._square_and_div(d)
        if found is None:
            return None
        sq, div, two_is_pow, pow_exp = found
        found = self._variance_root(sq, div, axes)
        if found is None:
            return None
        mean2, add_eps, sqrt, eps = found
        chain = _Chain([mean1, sub, sq, mean2, add_eps, sqrt, div], x, axes, two_is_pow, pow_exp, eps)
        self._affine_tail(chain)
        return chain

    def _square_and_div(self, d):
        """d's two readers, d squared (Pow(d, 2) or Mul(d, d)) and Div(d, ...): (sq, div, two_is_pow, pow_exp)."""
        rs = self.only(d, 2)
        if not rs:
            return None
        sq = next((r for r in rs if _op(r, "Pow", "Mul")), None)
        div = next((r for r in rs if _op(r, "Div")), None)
        if sq is None or div is None or sq is div or div.inputs[0] != d:
            return None
        if _op(sq, "Pow"):
            e = _scalar(self.inits, sq.inputs[1]) if sq.inputs[0] == d and len(sq.inputs) > 1 else None
            if e is None or float(e.reshape(-1)[0]) != 2.0:
                return None
            return sq, div, True, e
        if sq.inputs[:2] != [d, d]:
            return None
        return sq, div, False, None

    def _variance_root(self, sq, div, axes):
        """ReduceMean(sq) over ``axes``, + eps, Sqrt, read by ``div``: (mean2, add_eps, sqrt, eps)."""
        rs = self.only(sq.outputs[0])
        if not rs or not _op(rs[0], "ReduceMean") or _axes(rs[0], self.inits) != axes:
            return None
        mean2 = rs[0]
        rs = self.only(mean2.outputs[0])
        if not rs or not _op(rs[0], "Add"):
            return None
        add_eps = rs[0]
        others = [i for i in add_eps.inputs if i != mean2.outputs[0]]
        eps = _scalar(self.inits, others[0]) if len(others) == 1 else None
        if eps is None:
            return None
        rs = self.only(add_eps.outputs[0])
        if not rs or not _op(rs[0], "Sqrt"):
            return None
        sqrt = rs[0]
        rs = self.only(sqrt.outputs[0])
        if not rs or rs[0] is not div or div.inputs[1] != sqrt.outputs[0]:
            return None
        return mean2, add_eps, sqrt, eps

    def _affine_tail(self, chain: _Chain) -> None:
        """The optional Mul by gamma, then Add of beta, after the Div: appended to ``chain``."""
        inits = self.inits
        last = chain.last
        rs = self.only(last.outputs[0])
        if rs and _op(rs[0], "Mul") and _affine(rs[0], last.outputs[0], inits) is not None:
            chain.gamma = _affine(rs[0], last.outputs[0], inits)
            last = rs[0]
            chain.nodes.append(last)
            rs = self.only(last.outputs[0])
        if rs and _op(rs[0], "Add") and _affine(rs[0], last.outputs[0], inits) is not None:
            chain.beta = _affine(rs[0], last.outputs[0], inits)
            last = rs[0]
            chain.nodes.append(last)


def _fused(chain: _Chain):
    """The one node that replaces ``chain``, bound to the fused kernel."""
    forward = _make_forward(chain.axes, chain.two_is_pow, chain.pow_exp, chain.eps, chain.gamma, chain.beta)
    kernel = dataclasses.replace(chain.nodes[0].kernel, op_type=FUSED, forward=forward, backward_fn=None,
                                 forward_train=None, attributes=())
    # the fused node sits where the chain's last node was: every input is ready there
    last = chain.last
    return dataclasses.replace(last, op_type=FUSED, inputs=[chain.x], outputs=[last.outputs[0]],
                               attrs={}, kernel=kernel, free_after=[])


def fuse_layernorm(graph):
    """CompiledGraph -> CompiledGraph with decomposed layer norms as one node each."""
    matcher = _Matcher(graph)
    replaced: dict[int, object] = {}
    dropped: set[int] = set()
    for mean1 in graph.nodes:
        if not _op(mean1, "ReduceMean") or id(mean1) in dropped:
            continue
        chain = matcher.match(mean1)
        if chain is None or any(id(c) in dropped or id(c) in replaced for c in chain.nodes):
            continue
        last = chain.last
        replaced[id(last)] = _fused(chain)
        dropped.update(id(c) for c in chain.nodes if c is not last)
    if not replaced:
        return graph
    nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) not in dropped]
    return dataclasses.replace(graph, nodes=nodes)
