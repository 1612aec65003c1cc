"""The run folder of ``edgeflow simulate``: metrics, model, charts and an HTML report.

Layout of ``runs/<name>/``::

    config.json      every setting of the run (re-run with --config config.json)
    metrics.jsonl    one JSON object per round (the gateway's RoundMetrics)
    devices.json     per device: profile, samples, bytes sent, training time, faults
    summary.json     final accuracy, wall time, peak memory, upload ratio
    final_model.onnx the last global model
    accuracy.svg, bytes.svg, participants.svg   charts per round, always (no dependency)
    accuracy.png, bytes.png, participants.png, latency.png   (with matplotlib)
    report.html      all of the above on one page, the SVG charts inline
    report.md        the summary, the charts (as the .svg files) and the rounds table

The SVG charts are drawn here, with the standard library only (:func:`svg_chart`): one
point (or bar) per round, so every run has pictures. matplotlib is an optional extra
(``pip install '.[report]'``) for the PNG versions and the per-device latency plot.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Sequence

PLOTS = ("accuracy", "bytes", "participants", "latency")
CHARTS = ("accuracy", "bytes", "participants")
"""The SVG charts every run gets (:func:`write_charts`)."""

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e")


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def make_plots(folder: Path, rounds: list[dict[str, Any]], devices: list[dict[str, Any]]) -> list[str]:
    """PNG plots into ``folder``; returns the file names written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    r = [m["round_id"] for m in rounds]

    from matplotlib.ticker import MaxNLocator

    def save(name: str, fig) -> None:
        for a in fig.axes:
            a.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        fig.savefig(folder / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(f"{name}.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(r, [m.get("accuracy") or 0.0 for m in rounds], marker="o")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title("global model accuracy per round")
    save("accuracy", fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(r, [m["bytes_in"] / 1024 for m in rounds], label="uploaded")
    ax.plot(r, [m["dense_bytes"] / 1024 for m in rounds], color="C3", marker=".", label="dense fp32 equivalent")
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("KiB")
    ax.legend()
    ax.set_title("bytes uploaded per round")
    save("bytes", fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(r, [m["selected"] for m in rounds], label="selected", marker=".")
    ax.plot(r, [m["participants"] for m in rounds], label="aggregated", marker="o")
    ax.plot(r, [m["dropped"] for m in rounds], label="dropped", marker="x")
    ax.set_xlabel("round")
    ax.set_ylabel("devices")
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title("participants per round")
    save("participants", fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    vals = [d["mean_train_ms"] for d in devices]
    colors = ["C3" if d.get("byzantine") else ("C1" if d.get("straggler") else "C0") for d in devices]
    ax.bar(range(len(devices)), vals, color=colors)
    ax.set_xlabel("device (red: Byzantine, orange: straggler)")
    ax.set_ylabel("ms per local training")
    ax.set_title("local training latency per device")
    save("latency", fig)
    return written


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    out, t = [], first
    while t <= hi + 1e-9 * step:
        out.append(round(t, 10))
        t += step
    return out


def _fmt_tick(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{v:g}"


def svg_chart(title: str, xs: Sequence[int], series: Sequence[tuple[str, Sequence[Any], str]], *,
              ylabel: str, xlabel: str = "round", y_range: tuple[float, float] | None = None,
              log: bool = False, width: int = 560, height: int = 300) -> str:
    """One chart as a standalone SVG document (standard library only).

    ``series``: ``(label, values, kind)`` with ``kind`` "line" (a polyline and one ``<circle
    class="point">`` per value) or "bar" (one ``<rect class="bar">`` per value); ``values`` align
    with ``xs``, and a missing value (None, NaN) draws nothing for that round. ``log``: a
    logarithmic y axis (positive values only). Every point and bar has a ``<title>`` tooltip and
    ``data-round``/``data-value`` attributes."""
    chart = _Chart(xs, series, log=log, y_range=y_range, width=width, height=height)
    out = chart.frame(title, xlabel, ylabel)
    n_bars = sum(1 for _, _, k in series if k == "bar")
    bar_i = 0
    for si, (label, ys, kind) in enumerate(series):
        color = _COLORS[si % len(_COLORS)]
        if kind == "bar":
            out += chart.bars(label, ys, color, bar_i, n_bars)
            bar_i += 1
        else:
            out += chart.line(label, ys, color)
        lx = chart.left + 8 + si * 150
        out.append(f'<rect x="{lx}" y="{chart.top - 14}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{lx + 14}" y="{chart.top - 5}">{html.escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


class _Chart:
    """The plot area of one chart: its y range and ticks, and the data -> pixel maps."""

    left, right, top, bottom = 64, 16, 40, 44

    def __init__(self, xs: Sequence[int], series: Sequence[tuple[str, Sequence[Any], str]], *, log: bool,
                 y_range: tuple[float, float] | None, width: int, height: int) -> None:
        self.xs, self.log, self.width, self.height = xs, log, width, height
        self.pw, self.ph = width - self.left - self.right, height - self.top - self.bottom
        vals = [v for _, ys, _ in series for v in (_finite(y) for y in ys) if v is not None and (not log or v > 0)]
        if y_range is not None:
            lo, hi = y_range
        elif vals:
            lo, hi = (min(vals), max(vals)) if log else (min(0.0, min(vals)), max(vals))
        else:
            lo, hi = (1.0, 10.0) if log else (0.0, 1.0)
        if log:
            lo, hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
            if hi <= lo:
                hi = lo * 10
            self.yticks = [10.0 ** e for e in range(int(round(math.log10(lo))), int(round(math.log10(hi))) + 1)]
        else:
            if hi <= lo:
                hi = lo + 1.0
            self.yticks = _nice_ticks(lo, hi)
            lo, hi = min(lo, self.yticks[0]), max(hi, self.yticks[-1])
        self.lo, self.hi = lo, hi
        self.x_lo, self.x_hi = (min(xs), max(xs)) if xs else (0, 1)
        self.slot = self.pw / max(1, len(xs))

    def ty(self, v: float) -> float:
        top, ph, lo, hi = self.top, self.ph, self.lo, self.hi
        if self.log:
            return top + ph - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * ph
        return top + ph - (v - lo) / (hi - lo) * ph

    def tx(self, x: float) -> float:
        left, pw, slot = self.left, self.pw, self.slot
        if len(self.xs) > 1:
            return left + slot / 2 + (x - self.x_lo) / max(1, self.x_hi - self.x_lo) * (pw - slot)
        return left + pw / 2

    def frame(self, title: str, xlabel: str, ylabel: str) -> list[str]:
        """The document's head, title, grid with y ticks, x ticks, axes and axis labels."""
        e = html.escape
        left, top, pw, ph, width, height = self.left, self.top, self.pw, self.ph, self.width, self.height
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
               f'viewBox="0 0 {width} {height}" role="img" aria-label="{e(title)}" '
               'font-family="sans-serif" font-size="11">',
               f"<title>{e(title)}</title>",
               f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
               f'<text x="{width / 2:.1f}" y="16" text-anchor="middle" font-size="13">{e(title)}</text>']
        for t in self.yticks:
            y = self.ty(t)
            out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                       f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{e(_fmt_tick(t))}</text>')
        xs = self.xs
        step = max(1, math.ceil(len(xs) / 12))
        for i, x in enumerate(xs):
            if i % step == 0 or i == len(xs) - 1:
                out.append(f'<text x="{self.tx(x):.1f}" y="{top + ph + 14}" text-anchor="middle">{int(x)}</text>')
        out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}" stroke="#444"/>'
                   f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="#444"/>')
        out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 6}" text-anchor="middle">{e(xlabel)}</text>')
        out.append(f'<text transform="translate(14 {top + ph / 2:.1f}) rotate(-90)" text-anchor="middle">'
                   f"{e(ylabel)}{' (log scale)' if self.log else ''}</text>")
        return out

    def _values(self, ys: Sequence[Any]) -> list[tuple[Any, float]]:
        """(x, value) for each value that can be drawn (finite; positive on a log axis)."""
        drawn = []
        for x, y in zip(self.xs, ys):
            v = _finite(y)
            if v is None or (self.log and v <= 0):
                continue
            drawn.append((x, v))
        return drawn

    def bars(self, label: str, ys: Sequence[Any], color: str, bar_i: int, n_bars: int) -> list[str]:
        """One ``<rect class="bar">`` per value, side by side with the other bar series."""
        e = html.escape
        base = self.ty(self.lo) if self.log else self.ty(max(self.lo, 0.0))
        out = []
        for x, v in self._values(ys):
            tip = f"<title>round {int(x)}: {e(label)} {v:.4g}</title>"
            bw = self.slot * 0.8 / max(1, n_bars)
            bx = self.tx(x) - self.slot * 0.4 + bar_i * bw
            top_y = self.ty(v)
            out.append(f'<rect class="bar" data-series="{e(label)}" data-round="{int(x)}" data-value="{v:.6g}" '
                       f'x="{bx:.1f}" y="{min(top_y, base):.1f}" width="{max(bw, 1):.1f}" '
                       f'height="{abs(base - top_y):.1f}" fill="{color}">{tip}</rect>')
        return out

    def line(self, label: str, ys: Sequence[Any], color: str) -> list[str]:
        """A polyline through the values and one ``<circle class="point">`` per value."""
        e = html.escape
        pts = [(self.tx(x), self.ty(v), x, v, f"<title>round {int(x)}: {e(label)} {v:.4g}</title>")
               for x, v in self._values(ys)]
        out = []
        if len(pts) > 1:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="'
                       + " ".join(f"{px:.1f},{py:.1f}" for px, py, *_ in pts) + '"/>')
        for px, py, x, v, tip in pts:
            out.append(f'<circle class="point" data-series="{e(label)}" data-round="{int(x)}" data-value="{v:.6g}" '
                       f'cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}">{tip}</circle>')
        return out


def charts(rounds: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The run's charts as SVG documents: {"accuracy": ..., "bytes": ..., "participants": ...}."""
    xs = [int(m["round_id"]) for m in rounds]
    kib = [[None if _finite(m.get(k)) is None else float(m[k]) / 1024 for m in rounds] for k in
           ("bytes_in", "dense_bytes")]
    spread = [v for v in kib[0] + kib[1] if v is not None and v > 0]
    log = bool(spread) and max(spread) / min(spread) > 20
    return {
        "accuracy": svg_chart("global model accuracy per round", xs, [("test accuracy",
                              [m.get("accuracy") for m in rounds], "line")], ylabel="test accuracy", y_range=(0.0, 1.0)),
        "bytes": svg_chart("bytes uploaded per round", xs, [("uploaded", kib[0], "bar"),
                           ("dense fp32 equivalent", kib[1], "line")], ylabel="KiB", log=log),
        "participants": svg_chart("participants per round", xs, [
            ("selected", [m.get("selected") for m in rounds], "line"),
            ("aggregated", [m.get("participants") for m in rounds], "line"),
            ("dropped", [m.get("dropped") for m in rounds], "line")], ylabel="devices"),
    }


def write_charts(folder: Path, rounds: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Write ``<name>.svg`` for each of :data:`CHARTS` into ``folder``; returns the SVG documents."""
    out = charts(rounds)
    for name, svg in out.items():
        (Path(folder) / f"{name}.svg").write_text(svg + "\n", encoding="utf-8")
    return out


def _table(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{fmt(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_report(folder: Path, config: dict[str, Any], rounds: list[dict[str, Any]],
                 devices: list[dict[str, Any]], summary: dict[str, Any], plots: list[str]) -> Path:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>edgeflow simulate report</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;"
        "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}"
        "img{max-width:48%;margin:1%}figure.chart{display:inline-block;margin:1%}</style></head><body>",
        "<h1>edgeflow simulate</h1>",
        "<h2>Summary</h2>", _table([summary], list(summary)),
    ]
    svgs = write_charts(folder, rounds)
    parts.append("<h2>Charts</h2>" + "".join(f"<figure class='chart' id='chart-{n}'>{svg}</figure>"
                                             for n, svg in svgs.items()))
    if plots:
        parts.append("<h2>Plots</h2>" + "".join(f"<img src='{p}' alt='{p[:-4]}'>" for p in plots))
    else:
        parts.append("<p><em>PNG versions of the charts and the per-device latency plot need matplotlib: "
                     "<code>pip install '.[report]'</code>, then re-run.</em></p>")
    parts += [
        "<h2>Rounds</h2>",
        _table(rounds, ["round_id", "model_version", "selected", "participants", "dropped", "late", "rejected",
                        "bytes_in", "dense_bytes", "aggregation_s", "round_s", "mean_client_loss", "accuracy"]),
        "<h2>Devices</h2>",
        _table(devices, ["device", "profile", "samples", "byzantine", "straggler", "updates_sent", "bytes_sent",
                         "mean_train_ms"]),
        "<h2>Configuration</h2>", f"<pre>{html.escape(json.dumps(config, indent=2))}</pre>",
        "</body></html>",
    ]
    path = folder / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    write_markdown(folder, rounds, summary, list(svgs))
    return path


def _md_cell(v: Any) -> str:
    text = f"{v:.4g}" if isinstance(v, float) else str(v)
    return html.escape(text).replace("|", "\\|").replace("\n", " ")


def write_markdown(folder: Path, rounds: Sequence[dict[str, Any]], summary: dict[str, Any],
                   charts_written: Sequence[str]) -> Path:
    """``report.md``: the summary, the SVG charts (as image links to the files beside it) and the rounds."""
    cols = ["round_id", "model_version", "selected", "participants", "dropped", "bytes_in", "round_s", "accuracy"]
    lines = ["# edgeflow simulate", "", "| " + " | ".join(summary) + " |", "|" + "---|" * len(summary),
             "| " + " | ".join(_md_cell(v) for v in summary.values()) + " |", "", "## Charts", ""]
    lines += [f"![{n}]({n}.svg)" for n in charts_written]
    lines += ["", "## Rounds", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_md_cell(r.get(c, "")) for c in cols) + " |" for r in rounds]
    path = Path(folder) / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
