"""ONNX's own backend node tests, run on the numpy backend.

Every node case whose ops all have numpy kernels is claimed and must pass
(see edgeflow/runtime/conformance.py for the rule and docs/conformance.md for the list).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeflow.runtime import conformance

SELECTION = conformance.select()
DOC = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"

# Ops the runtime-core issue requires the numpy backend to claim.
REQUIRED_OPS = set(
    "Add Sub Mul Div MatMul Gemm Conv MaxPool AveragePool GlobalAveragePool Relu LeakyRelu Sigmoid Tanh "
    "Softmax LogSoftmax Flatten Reshape Transpose Concat BatchNormalization Clip Identity Dropout Constant "
    "Shape Gather Unsqueeze Squeeze ReduceMean".split()
)


def test_enough_cases_are_claimed():
    # issue 13: of the node cases numpy can represent (standard domain, numpy dtypes), at least 90%
    eligible = set(SELECTION.eligible)
    assert len(eligible) > 1000, "the eligibility rule lost most of the onnx wheel's cases"
    assert {c.name for c in SELECTION.claimed} <= eligible
    assert len(SELECTION.claimed) >= 0.9 * len(eligible), (len(SELECTION.claimed), len(eligible))
    # every node case is accounted for: claimed, eligible but not claimed (with a reason), or not eligible
    accounted = len(eligible) + len(SELECTION.nonstandard) + len(SELECTION.excluded) + len(SELECTION.dtype_and_ops)
    assert accounted == SELECTION.total
    assert len(SELECTION.claimed) + len(SELECTION.unclaimed) == len(eligible)
    assert all(why for why in SELECTION.unclaimed.values())
    covered = {n.op_type for c in SELECTION.claimed for n in c.model.graph.node}
    assert REQUIRED_OPS <= covered, f"required ops without a conformance case: {REQUIRED_OPS - covered}"


def test_docs_list_matches_the_selection():
    text = DOC.read_text()
    listed = {line[3:-1] for line in text.splitlines() if line.startswith("- `test_")}
    listed = {n.split("`")[0] for n in listed}
    stale = "docs/conformance.md is stale: run python -m edgeflow.runtime.conformance --write docs/conformance.md"
    assert listed >= {c.name for c in SELECTION.claimed}, stale
    counts = (f"claims {len(SELECTION.claimed)} of the {len(SELECTION.eligible)} eligible cases",
              f"| outside the standard domain | {len(SELECTION.nonstandard)} |")
    assert all(c in text for c in counts), stale
    for name in list(SELECTION.unclaimed) + list(SELECTION.nonstandard):  # what is left is listed, with why
        assert f"`{name}`" in text, stale


@pytest.mark.parametrize("case", SELECTION.claimed, ids=lambda c: c.name)
def test_node_case(case):
    conformance.run_case(case)
