"""fp16 conversion for GPU profiles (Jetson: TensorRT / CUDA run fp16 at
twice the fp32 rate; int8 there is TensorRT's own calibration business).

Every float32 initializer, constant and intermediate becomes float16; the
model keeps float32 inputs and outputs (a Cast at each boundary), so
callers feed and read the same arrays as before. Inputs that ONNX requires
to stay float32 (Resize's roi/scales, Upsample's scales) are left alone.
Weights beyond float16's range saturate to +-65504 rather than become inf.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import QuantizationError
from .qdq import _Names

#: (op, input index) that must stay float32.
KEEP_FP32_INPUTS = {("Resize", 1), ("Resize", 2), ("Upsample", 1)}
_F16_MAX = float(np.finfo(np.float16).max)


def _to_fp16(t: onnx.TensorProto) -> onnx.TensorProto:
    a = numpy_helper.to_array(t)
    return numpy_helper.from_array(np.clip(a, -_F16_MAX, _F16_MAX).astype(np.float16), t.name)


def convert_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    m = copy.deepcopy(model)
    g = m.graph
    keep32 = {n.input[i] for n in g.node for (op, i) in KEEP_FP32_INPUTS if n.op_type == op and len(n.input) > i}
    floats = [t for t in g.initializer if t.data_type == TensorProto.FLOAT and t.name not in keep32]
    float_inputs = [i for i in g.input if i.type.tensor_type.elem_type == TensorProto.FLOAT
                    and i.name not in {t.name for t in g.initializer}]
    if not floats and not float_inputs:
        raise QuantizationError("the model has no float32 weights or inputs: there is nothing to convert to fp16")
    converted = {t.name for t in floats}
    new_inits = [(_to_fp16(t) if t.name in converted else t) for t in g.initializer]
    del g.initializer[:]
    g.initializer.extend(new_inits)
    for vi in g.input:  # old-IR models list initializers as inputs too
        if vi.name in converted:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16

    names = _Names(m)
    head: list[onnx.NodeProto] = []
    rename: dict[str, str] = {}
    for vi in float_inputs:
        h = names.new(f"{vi.name}_fp16")
        head.append(helper.make_node("Cast", [vi.name], [h], to=TensorProto.FLOAT16, name=names.new(f"{vi.name}_to_fp16")))
        rename[vi.name] = h
    tail: list[onnx.NodeProto] = []
    out_rename: dict[str, str] = {}
    for vi in g.output:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            h = names.new(f"{vi.name}_fp16")
            out_rename[vi.name] = h
            tail.append(helper.make_node("Cast", [h], [vi.name], to=TensorProto.FLOAT, name=names.new(f"{vi.name}_to_fp32")))
    for n in g.node:
        for i, x in enumerate(n.input):
            if x in rename and (n.op_type, i) not in KEEP_FP32_INPUTS:
                n.input[i] = rename[x]
            elif x in out_rename:
                n.input[i] = out_rename[x]
        for i, y in enumerate(n.output):
            if y in out_rename:
                n.output[i] = out_rename[y]
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(_to_fp16(a.t))
            if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.FLOAT16
    nodes = head + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    try:
        onnx.checker.check_model(m)
        onnx.shape_inference.infer_shapes(m, strict_mode=True)
    except Exception as exc:
        raise QuantizationError(f"the fp16 model is inconsistent ({exc}); an op may need float32 inputs") from exc
    return m
