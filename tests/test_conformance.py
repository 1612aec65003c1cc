"""ONNX's own backend node tests, run on the numpy backend.

Every node case whose ops all have numpy kernels is claimed and must pass
(see edgeflow/conformance.py for the rule and docs/conformance.md for the list).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeflow import conformance

SELECTION = conformance.select()
DOC = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"

# Ops the runtime-core issue requires the numpy backend to claim.
REQUIRED_OPS = set(
    "Add Sub Mul Div MatMul Gemm Conv MaxPool AveragePool GlobalAveragePool Relu LeakyRelu Sigmoid Tanh "
    "Softmax LogSoftmax Flatten Reshape Transpose Concat BatchNormalization Clip Identity Dropout Constant "
    "Shape Gather Unsqueeze Squeeze ReduceMean".split()
)


def test_enough_cases_are_claimed():
    assert len(SELECTION.claimed) >= 500
    covered = {n.op_type for c in SELECTION.claimed for n in c.model.graph.node}
    assert REQUIRED_OPS <= covered, f"required ops without a conformance case: {REQUIRED_OPS - covered}"


def test_docs_list_matches_the_selection():
    listed = {line[3:-1] for line in DOC.read_text().splitlines() if line.startswith("- `test_")}
    listed = {n.split("`")[0] for n in listed}
    assert listed >= {c.name for c in SELECTION.claimed}, (
        "docs/conformance.md is stale: run python -m edgeflow.conformance --write docs/conformance.md"
    )


@pytest.mark.parametrize("case", SELECTION.claimed, ids=lambda c: c.name)
def test_node_case(case):
    conformance.run_case(case)
