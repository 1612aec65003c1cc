"""The run folder of ``edgeflow simulate``: metrics, model, plots and an HTML report.

Layout of ``runs/<name>/``::

    config.json      every setting of the run (re-run with --config config.json)
    metrics.jsonl    one JSON object per round (the gateway's RoundMetrics)
    devices.json     per device: profile, samples, bytes sent, training time, faults
    summary.json     final accuracy, wall time, peak memory, upload ratio
    final_model.onnx the last global model
    accuracy.png, bytes.png, participants.png, latency.png   (with matplotlib)
    report.html      all of the above on one page

matplotlib is an optional extra (``pip install '.[report]'``): without it the
HTML report is written with tables only and says how to get the plots.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Sequence

PLOTS = ("accuracy", "bytes", "participants", "latency")


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
        "img{max-width:48%;margin:1%}</style></head><body>",
        "<h1>edgeflow simulate</h1>",
        "<h2>Summary</h2>", _table([summary], list(summary)),
    ]
    if plots:
        parts.append("<h2>Plots</h2>" + "".join(f"<img src='{p}' alt='{p[:-4]}'>" for p in plots))
    else:
        parts.append("<p><em>Plots need matplotlib: <code>pip install '.[report]'</code>, then re-run.</em></p>")
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
    return path
