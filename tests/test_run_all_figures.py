"""benchmarks/run_all.py turns each benchmark's JSON into RESULTS.md rows.

The recorded input is real: every benchmark's --json output from a full run on
the project machine (2026-12-04; the swarm row from a 100-device run), saved in
tests/data/run_all_results.json. A reader that returns nothing or raises on its
own benchmark's output would leave that benchmark out of RESULTS.md (as
fig_real_models did: it returned None).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "data" / "run_all_results.json").read_text())


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["run_all"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


RUN_ALL = _run_all()
BENCHES = RUN_ALL.benches(False)


def test_every_benchmark_has_a_recorded_output() -> None:
    assert {b.name for b in BENCHES} == set(RECORDED)


@pytest.mark.parametrize("bench", BENCHES, ids=[b.name for b in BENCHES])
def test_each_reader_turns_its_benchmark_output_into_rows(bench) -> None:
    figures = bench.figures(RECORDED[bench.name])
    assert isinstance(figures, list) and figures, f"{bench.name}: no rows"
    for f in figures:
        assert isinstance(f, RUN_ALL.Figure)
        row = f.row()
        assert row.startswith("| ") and row.count("|") == 8, row
        assert "could not read" not in f.what


def test_the_real_model_summary_rows_are_there() -> None:
    figures = RUN_ALL.fig_real_models(RECORDED["real_models"])
    whats = [f.what for f in figures]
    assert any(w.startswith("median numpy/ort latency ratio") for w in whats)
    assert any(w.startswith("worst numpy/ort latency ratio") for w in whats)
    assert len(figures) == len(RECORDED["real_models"]["rows"]) + 2


def test_the_summary_rows_name_the_targets_they_were_judged_by() -> None:
    data = json.loads(json.dumps(RECORDED["real_models"]))
    data["summary"].update(median_ratio=1.7, worst_ratio=3.4, median_target=1.6, worst_target=3.0,
                           median_met=False, worst_met=False)
    rows = {f.what.split(" latency")[0]: f.row() for f in RUN_ALL.fig_real_models(data)}
    assert "| <= 1.6 (every model) | **FAIL** |" in rows["median numpy/ort"]
    assert "| <= 3 (every model) | **FAIL** |" in rows["worst numpy/ort"]


def test_a_speedup_timed_off_the_board_is_not_judged_against_the_boards_target() -> None:
    real = [dict(r) for r in RECORDED["quantization"]["real"]]
    assert real and any(r["kind"] == "conv" for r in real)
    for r in real:
        r["host"] = "this host is x86_64, the profile 'raspberry-pi-4' is aarch64" \
            if r["profile"] == "raspberry-pi-4" else None
    figures = RUN_ALL.fig_quantization({**RECORDED["quantization"], "real": real})
    medians = {f.what.split(":")[0]: f for f in figures if "median int8 speedup" in f.what}
    pi = next(f for k, f in medians.items() if "raspberry-pi-4" in k)
    assert pi.ok is None and "not on the board" in pi.what and pi.target == ">= 2.0 (on the board)"
    x86 = next(f for k, f in medians.items() if "x86-gateway" in k)
    assert x86.ok is not None and x86.target == ">= 2.0"


def test_a_rerun_keeps_the_sections_other_benchmarks_wrote(tmp_path):
    """fl_vs_flower.py's section (it needs Flower's own venv) is not run_all's to erase; its own sections are
    rewritten, not doubled."""
    ra = _run_all()
    path = tmp_path / "RESULTS.md"
    path.write_text("# old\n\n## Summary\n\nold rows\n\n## edgeflow vs Flower\n\n"
                    f"{ra.KEPT_MARK}: rerun fl_vs_flower.py.\n\n| a | b |\n\n## Stale\n\nold text\n")
    for _ in range(2):
        ra.write_results(path, [], {}, {"cpu": "x"}, False, "2026-12-05 21:00 UTC", 60.0)
    text = path.read_text()
    assert text.count("## edgeflow vs Flower") == 1 and "| a | b |" in text
    assert "old rows" not in text and "## Stale" not in text
