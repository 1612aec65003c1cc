"""`edgeflow simulate`'s charts without matplotlib: inline SVG in report.html, .svg files, report.md."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from edgeflow.sim.report import CHARTS, charts, svg_chart, write_report

SVG = "{http://www.w3.org/2000/svg}"


def _rounds(n: int, *, acc=lambda i: 0.1 * i) -> list[dict]:
    return [{"round_id": i, "model_version": i + 1, "selected": 6, "participants": 5, "dropped": 1, "late": 0,
             "rejected": 0, "bytes_in": 2048 * i, "dense_bytes": 102400, "aggregation_s": 0.01, "round_s": 1.5,
             "mean_client_loss": 2.0 / i, "accuracy": acc(i)} for i in range(1, n + 1)]


def _points(svg: str, cls: str, series: str | None = None) -> list[ET.Element]:
    root = ET.fromstring(svg)  # valid XML, or this raises
    assert root.tag == f"{SVG}svg"
    tag = "circle" if cls == "point" else "rect"
    return [el for el in root.iter(f"{SVG}{tag}") if el.get("class") == cls
            and (series is None or el.get("data-series") == series)]


def test_one_point_per_round_at_its_value() -> None:
    rounds = _rounds(7)
    svgs = charts(rounds)
    assert set(svgs) == set(CHARTS)
    acc = _points(svgs["accuracy"], "point")
    assert [int(p.get("data-round")) for p in acc] == list(range(1, 8))
    assert [float(p.get("data-value")) for p in acc] == pytest.approx([0.1 * i for i in range(1, 8)])
    ys = [float(p.get("cy")) for p in acc]
    assert ys == sorted(ys, reverse=True), "higher accuracy is drawn higher (SVG y grows downwards)"
    bars = _points(svgs["bytes"], "bar", "uploaded")
    assert [int(b.get("data-round")) for b in bars] == list(range(1, 8))
    assert [float(b.get("data-value")) for b in bars] == pytest.approx([2.0 * i for i in range(1, 8)])  # KiB
    heights = [float(b.get("height")) for b in bars]
    assert heights == sorted(heights) and heights[0] < heights[-1]
    assert len(_points(svgs["bytes"], "point", "dense fp32 equivalent")) == 7
    assert len(_points(svgs["participants"], "point")) == 3 * 7


def test_rounds_without_accuracy_draw_no_point_and_one_round_still_draws() -> None:
    rounds = _rounds(4, acc=lambda i: None if i == 2 else float("nan") if i == 3 else 0.5)
    acc = _points(charts(rounds)["accuracy"], "point")
    assert [p.get("data-round") for p in acc] == ["1", "4"]
    one = charts(_rounds(1))
    assert len(_points(one["accuracy"], "point")) == 1 and len(_points(one["bytes"], "bar")) == 1
    assert _points(charts([])["accuracy"], "point") == []  # an empty run still gives a valid picture


def test_labels_are_escaped() -> None:
    svg = svg_chart("<script>alert(1)</script> & co", [1, 2], [("a<b>", [1, 2], "line")], ylabel="y & <z>")
    root = ET.fromstring(svg)
    assert "<script>" not in svg and root.find(f"{SVG}title").text == "<script>alert(1)</script> & co"


def test_report_html_and_markdown_carry_the_charts(tmp_path) -> None:
    rounds = _rounds(5)
    summary = {"final_accuracy": 0.5, "rounds_completed": 5}
    path = write_report(tmp_path, {"devices": 6}, rounds, [], summary, plots=[])
    page = path.read_text(encoding="utf-8")
    for name in CHARTS:
        start = page.index(f"<figure class='chart' id='chart-{name}'>") + len(f"<figure class='chart' id='chart-{name}'>")
        inline = page[start:page.index("</figure>", start)]
        assert inline == (tmp_path / f"{name}.svg").read_text(encoding="utf-8").rstrip("\n")
    assert len(_points(page[page.index("<svg"):page.index("</svg>") + 6], "point")) == 5
    assert "pip install" in page  # the PNG extras say how to get them
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert all(f"![{n}]({n}.svg)" in md for n in CHARTS)
    table = md.split("## Rounds", 1)[1].strip().splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == [f"| {i}" for i in range(1, 6)]  # one row per round


def test_simulate_run_folder_has_svg_charts(tmp_path, capsys) -> None:
    from edgeflow.cli.main import main

    out = tmp_path / "run"
    assert main(["simulate", "--devices", "4", "--rounds", "3", "--out", str(out), "--json"]) == 0
    json.loads(capsys.readouterr().out)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    acc = _points((out / "accuracy.svg").read_text(), "point")
    assert len(acc) == len(metrics) == 3
    assert [float(p.get("data-value")) for p in acc] == pytest.approx([m["accuracy"] for m in metrics], abs=1e-5)
    assert len(_points((out / "bytes.svg").read_text(), "bar")) == 3
    assert "<svg" in (out / "report.html").read_text() and (out / "report.md").is_file()
