"""Empirical bias correction: the mean error each int8 conv's output carries, taken out of its bias.

Rounding an activation to a per-tensor grid does not only add noise: a channel
that sits near one value (a near-constant feature, an offset channel next to
wide ones) is rounded the same way at every position, and the conv that reads
it sees a shifted input everywhere: a bias. Downstream layers add their own,
and a detector's probability map drifts (PP-OCRv4's detector, every layer int8:
cosine 0.69 to fp32). The fix is the one in Nagel et al., "Data-Free
Quantization" (2019) and OpenVINO's FastBiasCorrection, measured
on data: for each int8 Conv in graph order, run the calibration samples through
the quantized model (with the corrections so far) and through fp32, take the
per-channel mean of the difference of the conv's output, and subtract it from
the conv's bias (an int32 in units of ``x_scale * w_scale``: the correction is
rounded to that unit). Convs are corrected one at a time because each one's
error includes what the convs before it passed on.

The measured model fetches each conv's output, so the session runs it as a
float conv on the dequantized inputs: the value a QLinearConv requantizes, with
exact sums (this measures what a VNNI board computes even on a host whose
int8 kernels saturate).

Costs one pass over the calibration data per int8 conv in a chain (convs on parallel
branches share a pass), each through only the part of the model that conv needs.

Not a default: on PicoDet the corrected model is further from fp32 (docs/quantization.md);
the bench gate measures a corrected variant beside the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import onnx
from onnx import numpy_helper

from ..runtime.optimize.ir import outer_refs, subgraphs
from .analysis import links

#: Activations that a quantizer drops after a conv (the output's QuantizeLinear clamps instead); the conv
#: in the QDQ model then writes the activation's output name, and its fp32 counterpart is the activation's input.
_FUSED_ACTIVATIONS = ("Relu", "Clip")


@dataclass(frozen=True)
class BiasSite:
    conv: str  # the Conv node's name in the quantized model
    output: str  # its output tensor there
    reference: str  # the tensor of the fp32 model that holds the same values
    bias: str  # the int32 initializer behind the bias DequantizeLinear
    scale: str  # that DequantizeLinear's scale (x_scale * w_scale)


def _reference(tensor: str, fp_producer: dict) -> str | None:
    """The fp32 tensor holding a quantized conv's output ``tensor``: the tensor itself where fp32 writes it
    with a Conv, the activation's input where fp32 writes it with a Relu/Clip after a Conv (dropped by the
    quantizer), else None."""
    src = fp_producer.get(tensor)
    if src is None:
        return None
    if src.op_type == "Conv":
        return tensor
    if src.op_type in _FUSED_ACTIVATIONS and src.input[0] in fp_producer and fp_producer[src.input[0]].op_type == "Conv":
        return src.input[0]
    return None


def _int32_bias(conv: onnx.NodeProto, producer: dict, inits: dict) -> tuple[onnx.TensorProto, str] | None:
    """(the int32 initializer, its scale's name) behind ``conv``'s bias DequantizeLinear (zero point 0),
    or None where the conv has no such bias."""
    if conv.op_type != "Conv" or len(conv.input) < 3 or not conv.input[2]:
        return None
    dq = producer.get(conv.input[2])
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[1] not in inits:
        return None
    b = inits.get(dq.input[0])
    if b is None or b.data_type != onnx.TensorProto.INT32:
        return None
    if len(dq.input) > 2 and dq.input[2]:
        zp = inits.get(dq.input[2])
        if zp is None or np.any(numpy_helper.to_array(zp) != 0):
            return None
    return b, dq.input[1]


def _lower_bias(bias: onnx.TensorProto, scale: onnx.TensorProto, shift: np.ndarray) -> None:
    """``bias`` (int32, in units of ``scale``) lowered in place by ``shift`` (float, output units)."""
    q = numpy_helper.to_array(bias).astype(np.int64) - np.rint(
        shift / numpy_helper.to_array(scale).astype(np.float64)).astype(np.int64)
    bias.CopyFrom(numpy_helper.from_array(np.clip(q, -2**31, 2**31 - 1).astype(np.int32), bias.name))


def bias_sites(qm: onnx.ModelProto, fp32: onnx.ModelProto) -> list[BiasSite]:
    """The int8 Convs of the QDQ model ``qm`` whose bias is an int32 initializer behind a
    DequantizeLinear and whose output has a counterpart in ``fp32``; in graph order."""
    inits = {t.name: t for t in qm.graph.initializer}
    producer, readers = links(list(qm.graph.node))
    fp_producer, _ = links(list(fp32.graph.node))
    sites = []
    for n in qm.graph.node:
        bias = _int32_bias(n, producer, inits)
        dq_w = producer.get(n.input[1]) if len(n.input) > 1 else None
        if bias is None or len(n.output) != 1 or dq_w is None or dq_w.op_type != "DequantizeLinear":
            continue
        b, scale = bias
        out = n.output[0]
        ref = _reference(out, fp_producer)
        if ref is None:
            # a conv that writes a graph output: the quantizer renamed its output and put a QuantizeLinear ->
            # DequantizeLinear pair before the output's own name
            qs = readers.get(out, [])
            if len(qs) == 1 and qs[0].op_type == "QuantizeLinear":
                dqs = readers.get(qs[0].output[0], [])
                if len(dqs) == 1 and dqs[0].op_type == "DequantizeLinear":
                    ref = _reference(dqs[0].output[0], fp_producer)
        if ref is not None:
            sites.append(BiasSite(n.name, out, ref, b.name, scale))
    return sites


def _channel_means(run: Callable, names: list[str], batches: Iterable[dict]) -> dict[str, np.ndarray]:
    """Per-channel (axis 1) mean of each of ``names`` over the batches."""
    sums: dict[str, np.ndarray] = {}
    count: dict[str, int] = {}
    for feeds in batches:
        got = run(feeds, names)
        for t in names:
            v = np.asarray(got[t], np.float64)
            axes = tuple(i for i in range(v.ndim) if i != 1)
            sums[t] = sums.get(t, 0.0) + v.sum(axis=axes)
            count[t] = count.get(t, 0) + int(v.size // v.shape[1])
    return {t: sums[t] / count[t] for t in names}


def _needed(nodes: list[onnx.NodeProto], targets: Iterable[str]) -> list[onnx.NodeProto]:
    """The nodes that ``targets`` depend on, in graph order (a run computes every node of its graph,
    so a model cut to these runs only what the tensors measured need)."""
    producer, _ = links(nodes)
    keep: set[int] = set()
    todo = list(targets)
    while todo:
        n = producer.get(todo.pop())
        if n is None or id(n) in keep:
            continue
        keep.add(id(n))
        todo.extend(x for x in n.input if x)
        for a in n.attribute:  # an If/Loop body reads outer values by name
            for sub in subgraphs(a):
                todo.extend(outer_refs(sub))
    return [n for n in nodes if id(n) in keep]


def _cut(model: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    """``model`` with only the nodes ``outputs`` need, and those tensors as its outputs."""
    from .calibration import augment

    m = augment(model, outputs)
    nodes = _needed(list(m.graph.node), outputs)
    read = {x for n in nodes for x in n.input}
    inits = {t.name for t in m.graph.initializer}
    # every true input stays (the caller feeds them all), an initializer listed as an input only if read
    g = onnx.helper.make_graph(nodes, m.graph.name, [i for i in m.graph.input if i.name not in inits or i.name in read],
                               [o for o in m.graph.output if o.name in outputs],
                               [t for t in m.graph.initializer if t.name in read])
    cut = onnx.helper.make_model(g, opset_imports=m.opset_import, ir_version=m.ir_version)
    cut.functions.extend(m.functions)
    return cut


def measure_corrections(qm: onnx.ModelProto, fp32: onnx.ModelProto, batches: Callable[[], Iterable[dict]],
                        runner_factory: Callable) -> dict[str, np.ndarray]:
    """Conv name -> the per-channel shift (float, output units) to take out of its bias, measured on
    ``batches()`` (feed dicts), each conv after every conv before it is corrected; ``runner_factory(model)``
    opens a session: ``run(feeds, names) -> dict``. ``qm`` itself is not changed.

    Convs that do not depend on each other (the branches of a detection head) are measured in the same
    pass, and each pass runs only the part of the model that its convs need."""
    sites = bias_sites(qm, fp32)
    if not sites:
        return {}
    refs = sorted({s.reference for s in sites})
    ref = _channel_means(runner_factory(_cut(fp32, refs)), refs, batches())
    work = onnx.ModelProto()
    work.CopyFrom(qm)
    inits = {t.name: t for t in work.graph.initializer}
    nodes = list(work.graph.node)
    by_conv = {n.name: n for n in nodes}
    # the sites each site's output depends on
    site_of = {id(by_conv[s.conv]): i for i, s in enumerate(sites)}
    before = [{site_of[id(n)] for n in _needed(nodes, [s.output]) if id(n) in site_of} - {i}
              for i, s in enumerate(sites)]
    done: set[int] = set()
    out: dict[str, np.ndarray] = {}
    while len(done) < len(sites):
        ready = [i for i in range(len(sites)) if i not in done and before[i] <= done]
        names = [sites[i].output for i in ready]
        got = _channel_means(runner_factory(_cut(work, names)), names, batches())
        for i in ready:
            s = sites[i]
            out[s.conv] = got[s.output] - ref[s.reference]
            _lower_bias(inits[s.bias], inits[s.scale], out[s.conv])
        done.update(ready)
    return out


def apply_corrections(qm: onnx.ModelProto, shifts: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, int]:
    """The QDQ model with each Conv named in ``shifts`` (and int8 here, with an int32 bias) having
    its bias lowered by the shift, in units of its bias scale; (model, convs corrected)."""
    m = onnx.ModelProto()
    m.CopyFrom(qm)
    inits = {t.name: t for t in m.graph.initializer}
    producer, readers = links(list(m.graph.node))
    by_name = {n.name: n for n in m.graph.node}
    done = 0
    for name, shift in shifts.items():
        found = _int32_bias(by_name[name], producer, inits) if name in by_name else None
        if found is None:
            continue
        bias, scale = found
        if len(readers.get(bias.name, [])) != 1 or np.shape(shift) != tuple(bias.dims):
            continue
        _lower_bias(bias, inits[scale], shift)
        done += 1
    return m, done
