"""Small ONNX models built in code for the tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def single_op(op: str, inputs: dict[str, tuple], out_shape: tuple | None = None, opset: int = 17,
              inits: dict[str, np.ndarray] | None = None, domain: str = "", **attrs) -> onnx.ModelProto:
    """A graph with one node ``op`` over float inputs (name -> shape)."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()]
    names = list(inputs) + list(inits or {})
    node = helper.make_node(op, names, ["y"], domain=domain, **attrs)
    shape = list(out_shape) if out_shape else list(next(iter(inputs.values())))
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    g = helper.make_graph([node], "t", ins, [out],
                          [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()])
    imports = [helper.make_opsetid("", opset)]
    if domain:
        imports.append(helper.make_opsetid(domain, 1))
    m = helper.make_model(g, opset_imports=imports)
    m.ir_version = 8
    return m


def with_custom_ops(ops: list[str]) -> onnx.ModelProto:
    """Relu followed by ops of a custom domain nobody implements."""
    nodes = [helper.make_node("Relu", ["x"], ["h0"])]
    for i, op in enumerate(ops):
        nodes.append(helper.make_node(op, [f"h{i}"], [f"h{i + 1}"], domain="acme.custom"))
    g = helper.make_graph(nodes, "c", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info(f"h{len(ops)}", TensorProto.FLOAT, [1, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme.custom", 1)])
    m.ir_version = 8
    return m
