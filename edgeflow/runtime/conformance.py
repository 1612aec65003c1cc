"""ONNX backend node tests (shipped inside the onnx wheel) run on the numpy
backend.

``onnx.backend.test.case.node.collect_testcases`` builds every node case in
memory. A case is *eligible* when it uses only the standard domain (ai.onnx) and
every tensor it feeds, expects, stores or casts to has a dtype numpy
represents; it is *claimed* when the numpy kernels implement every op of
its graph at its opset — ops inside subgraphs (If/Loop/Scan bodies)
included, and the ``*_expanded`` cases, which test function ops written out
in primitive ops — and every tensor it feeds or expects, or holds in a
sequence or optional, has a dtype numpy represents (bfloat16, float8, int4
and strings are excluded, and the reason is recorded). Every claimed case
must pass. Sequence values are fed and compared as lists of arrays,
optional ones as ``None`` or the value.

``python -m edgeflow.runtime.conformance --write docs/conformance.md`` regenerates
the counts, the list of claimed case names and what is left, with the reason
for each case.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..data import image_decoder
from .graph import unsupported_ops

log = logging.getLogger("edgeflow.runtime.conformance")

_NUMPY_DTYPES = {
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
    onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
    onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
    onnx.TensorProto.BOOL,
}


#: Why the numpy backend has no kernel for an op on purpose (docs/kernels.md, "Left out on purpose").
LEFT_OUT = {
    **{op: "random draws: no numpy draw can reproduce another runtime's stream, so the expected values "
           "(one generator's draws) cannot be matched" for op in
       ("Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike")},
    **{op: "string tensors: the backend carries numeric tensors only" for op in
       ("RegexFullMatch", "StringConcat", "StringNormalizer", "StringSplit")},
}

#: Why a domain other than the standard one is not covered.
DOMAINS = {
    "ai.onnx.ml": "the classical-ML domain (onnx-ml: trees, encoders, feature extractors), outside the standard "
                  "domain the numpy backend targets; onnxruntime runs it",
    "ai.onnx.preview": "a preview domain (experimental ops not yet in the standard domain)",
    "ai.onnx.preview.training": "training operators (optimizer update steps); edgeflow trains with its own "
                                "optimizers (edgeflow.train), not with these graph ops",
}


@dataclass(frozen=True)
class Selection:
    claimed: list  # TestCase objects
    excluded: dict[str, str]  # name -> reason: not eligible for a dtype, though every op has a kernel
    total: int = 0  # every node case of the onnx wheel
    eligible: tuple[str, ...] = ()  # standard domain, every dtype numpy-representable
    unclaimed: dict[str, str] = field(default_factory=dict)  # eligible, not claimed: name -> why
    nonstandard: dict[str, str] = field(default_factory=dict)  # name -> "domain: its ops" (why: DOMAINS)
    dtype_and_ops: dict[str, str] = field(default_factory=dict)  # not eligible (dtype) and ops missing too


@functools.lru_cache(maxsize=1)
def all_node_cases() -> tuple:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with np.errstate(all="ignore"):
            return tuple(collect_testcases(None))


def _elem_types(tp: onnx.TypeProto) -> set[int]:
    """Tensor element types inside a (possibly sequence/optional) type."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        return {tp.tensor_type.elem_type}
    if kind == "sparse_tensor_type":
        return {tp.sparse_tensor_type.elem_type}
    if kind == "sequence_type":
        return _elem_types(tp.sequence_type.elem_type)
    if kind == "optional_type":
        return _elem_types(tp.optional_type.elem_type)
    if kind == "map_type":
        return {tp.map_type.key_type} | _elem_types(tp.map_type.value_type)
    return set()


def _subgraphs(g: onnx.GraphProto):
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield a.g
            elif a.type == onnx.AttributeProto.GRAPHS:
                yield from a.graphs


def _graph_dtypes(g: onnx.GraphProto) -> set[int]:
    """Element types a graph and its subgraphs feed, return, store or cast to."""
    types: set[int] = set()
    for vi in list(g.input) + list(g.output):
        types |= _elem_types(vi.type)
    types |= {t.data_type for t in g.initializer}
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                types.add(a.t.data_type)
            if a.type == onnx.AttributeProto.TYPE_PROTO:
                types |= _elem_types(a.tp)
            if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT:
                types.add(a.i)
    for sg in _subgraphs(g):
        types |= _graph_dtypes(sg)
    types.discard(0)
    return types


def _domains(g: onnx.GraphProto) -> set[str]:
    out = {n.domain for n in g.node}
    for sg in _subgraphs(g):
        out |= _domains(sg)
    return out


def _missing_reason(missing: list[str], dtype_reason: str = "") -> str:
    reasons = sorted({LEFT_OUT.get(op, "no numpy kernel yet") for op in missing})
    return f"no kernel for {', '.join(missing)}: {'; '.join(([dtype_reason] if dtype_reason else []) + reasons)}"


def select(cases=None) -> Selection:
    cases = all_node_cases() if cases is None else cases
    claimed, excluded = [], {}
    eligible, unclaimed, nonstandard, dtype_and_ops = [], {}, {}, {}
    for c in cases:
        model = c.model
        other = sorted(_domains(model.graph) - {"", "ai.onnx"})
        if other:
            nonstandard[c.name] = f"{', '.join(other)}: {', '.join(sorted(_ops(model.graph, set(other))))}"
            continue
        bad = _graph_dtypes(model.graph) - _NUMPY_DTYPES
        dtype_reason = ""
        if bad:
            names = sorted(onnx.TensorProto.DataType.Name(t) for t in bad)
            dtype_reason = f"dtype {', '.join(names)} has no numpy representation"
        else:
            eligible.append(c.name)
        missing = unsupported_ops(model)
        if missing == ["ImageDecoder"] and not image_decoder.AVAILABLE:
            if bad:
                excluded[c.name] = f"{dtype_reason}; {image_decoder.MISSING_REASON}"
            else:
                unclaimed[c.name] = f"no kernel for ImageDecoder: {image_decoder.MISSING_REASON}"
            continue
        if missing:
            if bad:
                dtype_and_ops[c.name] = _missing_reason(missing, dtype_reason)
            else:
                unclaimed[c.name] = _missing_reason(missing)
            continue
        if bad:
            excluded[c.name] = dtype_reason
            continue
        if c.kind != "node":
            unclaimed[c.name] = f"a {c.kind!r} case, not a node case"
            continue
        refusal = _load_refusal(model)
        if refusal:
            unclaimed[c.name] = refusal
            continue
        claimed.append(c)
    return Selection(claimed, excluded, total=len(cases), eligible=tuple(eligible), unclaimed=unclaimed,
                     nonstandard=nonstandard, dtype_and_ops=dtype_and_ops)


def _load_refusal(model: onnx.ModelProto) -> str:
    """Why the public ``load`` refuses this case's model ("" when it loads): cases are run as users run
    models, so one ``load`` refuses is not claimed."""
    from ..errors import ModelError
    from .model import MIN_OPSET, infer_model_shapes, model_opset

    opset = model_opset(model)
    if opset < MIN_OPSET:
        return (f"load refuses the model: opset {opset} is older than {MIN_OPSET} "
                "(onnx.version_converter upgrades it)")
    try:
        infer_model_shapes(model)
    except ModelError as exc:
        last = str(exc).split("Inference error(s): ")[-1].replace(",", ";")
        return f"load refuses the model: onnx's strict shape inference fails ({' '.join(last.split())[:160]})"
    return ""


def _value(v):
    """A fed or expected value: arrays as arrays, sequences as lists, empty optionals as None."""
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    if isinstance(v, onnx.TensorProto):
        return onnx.numpy_helper.to_array(v)
    return np.asarray(v)


def _compare(case, what: str, got, want) -> None:
    if want is None or isinstance(want, list):
        if want is None:
            assert got is None, f"{case.name}: {what} should be an empty optional, got {type(got).__name__}"
            return
        assert isinstance(got, list), f"{case.name}: {what} should be a sequence, got {type(got).__name__}"
        assert len(got) == len(want), f"{case.name}: {what} has {len(got)} elements, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _compare(case, f"{what}[{i}]", g, w)
        return
    assert isinstance(got, np.ndarray) or np.isscalar(got), (
        f"{case.name}: {what} should be a tensor, got {type(got).__name__}")
    got = np.asarray(got)
    assert got.shape == want.shape, f"{case.name}: {what} shape {got.shape} != {want.shape}"
    if want.dtype.kind in "fc":
        assert got.dtype == want.dtype, f"{case.name}: {what} dtype {got.dtype} != {want.dtype}"
        np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol, err_msg=f"{case.name} {what}")
    else:
        np.testing.assert_array_equal(got.astype(want.dtype), want, err_msg=f"{case.name} {what}")


def run_case(case) -> None:
    """Run every data set of one case through the public API (``load(...).run``, numpy backend), as a
    user runs a model; raise AssertionError on a mismatch."""
    from .session import load

    rt = load(case.model, "x86-gateway", backend="numpy", allow_over_budget=True)
    in_names = [i.name for i in case.model.graph.input]
    out_names = [o.name for o in case.model.graph.output]
    for inputs, expected in case.data_sets:
        feeds = {n: _value(v) for n, v in zip(in_names, inputs) if n}
        with np.errstate(all="ignore"):
            got = rt.run(feeds)
        for name, want in zip(out_names, expected):
            _compare(case, f"output {name}", got[name], _value(want))


def _ops(g: onnx.GraphProto, domains: "set[str] | None" = None) -> set[str]:
    """Op types of a graph and its subgraphs (only those of ``domains`` when given)."""
    out = {n.op_type for n in g.node if domains is None or n.domain in domains}
    for sg in _subgraphs(g):
        out |= _ops(sg, domains)
    return out


def _grouped(reasons: dict[str, str], why) -> list[str]:
    """``{case: "HEAD: DETAIL"}`` as one line per HEAD (``why(HEAD)`` says why), cases and details listed:
    ``{"test_x": "no kernel for Bernoulli: random draws"}`` groups by the reason, ``{"test_y": "ai.onnx.ml:
    Binarizer"}`` by the domain."""
    groups: dict[str, tuple[set[str], list[str]]] = {}
    for name, text in reasons.items():
        if text.startswith("no kernel for "):  # "no kernel for OPS: WHY": group by WHY, list OPS
            ops, _, head = text[len("no kernel for "):].partition(": ")
        else:  # "DOMAIN: OPS"
            head, _, ops = text.partition(": ")
        detail, names = groups.setdefault(head, (set(), []))
        detail.update(o.strip() for o in ops.split(",") if o.strip())
        names.append(name)
    return [f"- {', '.join(sorted(detail))} ({len(names)} case{'s' if len(names) != 1 else ''}: "
            f"{', '.join(f'`{n}`' for n in sorted(names))}): {why(head)}"
            for head, (detail, names) in sorted(groups.items())]


def render(selection: Selection) -> str:
    sel = selection
    ops: dict[str, int] = {}
    for c in sel.claimed:
        for op in _ops(c.model.graph):
            ops[op] = ops.get(op, 0) + 1
    n_elig, n_claim = len(sel.eligible), len(sel.claimed)
    standard = sel.total - len(sel.nonstandard)
    share = f"{100 * n_claim / n_elig:.1f}%" if n_elig else "-"
    lines = [
        "# ONNX node conformance of the numpy backend",
        "",
        "Generated by `python -m edgeflow.runtime.conformance --write docs/conformance.md`; checked by",
        "`tests/test_conformance.py`, which runs every claimed case below on the numpy backend",
        "and requires the claimed cases to be at least 90% of the eligible ones.",
        "",
        f"onnx {onnx.__version__} ships {sel.total} node cases. {standard} use only the standard domain",
        f"(ai.onnx); {n_elig} of those feed, expect, store and cast to dtypes numpy represents: the",
        f"**eligible** cases. The numpy backend **claims {n_claim} of the {n_elig} eligible cases ({share})**:",
        "every op of the case has a numpy kernel at the case's opset, subgraphs and `*_expanded`",
        "function bodies included. All claimed cases are expected to pass.",
        "",
        "| node cases | count |",
        "|---|---:|",
        f"| in the onnx wheel | {sel.total} |",
        f"| outside the standard domain | {len(sel.nonstandard)} |",
        f"| standard domain, a dtype numpy cannot represent | {standard - n_elig} |",
        f"| eligible | {n_elig} |",
        f"| claimed (and passing) | {n_claim} |",
        f"| eligible, not claimed | {len(sel.unclaimed)} |",
        "",
        "## What is left, and why",
        "",
        f"### Eligible, not claimed ({len(sel.unclaimed)})",
        "",
    ]
    lines += _grouped(sel.unclaimed, lambda key: key) or ["(none)"]
    lines += ["", f"### Outside the standard domain ({len(sel.nonstandard)})", ""]
    lines += _grouped(sel.nonstandard, lambda dom: f"domain {dom}, {DOMAINS.get(dom, 'not the standard domain')}"
                      ) or ["(none)"]
    lines += ["", f"### Standard domain, dtypes numpy cannot represent ({standard - n_elig})", "",
              f"{len(sel.dtype_and_ops)} of them also use ops without a numpy kernel:", ""]
    lines += _grouped(sel.dtype_and_ops, lambda key: key) or ["(none)"]
    lines += ["", f"The other {len(sel.excluded)} have a kernel for every op:", ""]
    lines += [f"- `{n}`: {why}" for n, why in sorted(sel.excluded.items())]
    lines += ["", "## Cases per op (a claimed case counts once for each op it uses, subgraphs included)", "",
              "| op | cases |", "|---|---|"]
    lines += [f"| {op} | {n} |" for op, n in sorted(ops.items())]
    lines += ["", "## Claimed cases", ""]
    lines += [f"- `{c.name}`" for c in sorted(sel.claimed, key=lambda c: c.name)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", help="write the markdown listing to this path")
    ap.add_argument("--run", action="store_true", help="run every claimed case and report failures")
    args = ap.parse_args(argv)
    sel = select()
    failures = []
    if args.run:
        for c in sel.claimed:
            try:
                run_case(c)
            except Exception as exc:  # report all, do not stop at the first
                log.debug("conformance case %s failed", c.name, exc_info=True)
                failures.append((c.name, f"{type(exc).__name__}: {str(exc)[:300]}"))
        for name, why in failures:
            print(f"FAIL {name}: {why}")
        print(f"{len(sel.claimed) - len(failures)} passed, {len(failures)} failed")
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(render(sel))
        print(f"wrote {args.write}: {len(sel.claimed)} cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
