"""edgeflow vs Flower, side by side: the same model, data split, clients, rounds, local epochs and learning rate.

    nice -n 10 python benchmarks/fl_vs_flower.py [--models mlp,cnn,finetune] [--alphas 0.3,0.1]
        [--clients 20] [--rounds 30] [--epochs 2] [--batch-size 16] [--lr 0.1] [--momentum 0]
        [--codecs int8,dense] [--seed 0] [--flower-python PATH]
        [--out runs/fl_vs_flower] [--svg-dir DIR] [--sanity-seeds 3] [--target-accuracy 0.9] [--json]
    python benchmarks/fl_vs_flower.py --render runs/fl_vs_flower/results.json [--target-accuracy 0.9] [--svg-dir DIR]

For each model and Dirichlet alpha the benchmark computes the data split
once (edgeflow's ``shard_data``: scikit-learn's digits, label skew by
Dirichlet(alpha), ``--seed``) and the initial model once
(``edgeflow.sim.simulation.build_model``), writes both into one .npz, and
hands that file to both sides, each in its own process:

- **Flower** (``benchmarks/_flower_side.py`` under ``--flower-python``, a
  venv of its own because Flower 1.42 pins typer < 0.21, which breaks amqtt
  here): ``flwr.simulation.run_simulation`` on Ray, FedAvg over every
  client, NumPyClients (the MLP in numpy with edgeflow's math, the CNN in
  PyTorch, the fine-tune with edgeflow's Trainer). Bytes: the serialized
  tensors of every FitIns (down) and FitRes (up).
- **edgeflow** (this file with ``--edgeflow-side``, the main interpreter):
  ``edgeflow.sim.SimulatedFleet`` - a gateway and one MQTT client per device
  on a private Mosquitto it starts - with each ``--codecs`` codec; it first
  checks that every device holds exactly the .npz's shard and that the model
  starts from the .npz's weights. Bytes: up = the gateway's ``bytes_in`` per
  round (signed update envelopes), down = the payload of every message the
  devices' transports deliver (global model, round announcements).

Reported per round: test accuracy (450 held-out digits), bytes up and down,
seconds since the rounds began; per run: wall time of the process, peak
RSS of the process tree (sampled every 0.2 s; Flower's includes Ray's
processes, edgeflow's the broker's). A sanity row first: 1 client, 1 round,
edgeflow's dense codec vs Flower's numpy MLP over a few seeds (are the mean
accuracies within 2 standard errors?), and for the MLP and the CNN both
trainers over the same batches in the same order (how far apart do the
weights end?).
Writes results.json and results.md to ``--out`` and bytes-to-accuracy SVG
charts (one per model and alpha) to ``--svg-dir`` (default: ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # _flower_side's numpy MLP, for the gradient check
from _flower_env import MAKE_VENV, flower_python  # noqa: E402

FLOWER_WHEEL_HINT = ("python -m venv --system-site-packages /work/venvs/flwr && "
                     "/work/venvs/flwr/bin/pip install 'flwr[simulation]==1.42.0'")
FINETUNE_MODEL = "ocr-cls-ppocr-mobile-v2"


class BenchmarkError(Exception):
    """A problem the user can fix; printed as one line."""


# ------------------------------------------------------------------ the split

def sim_config(spec: dict, codec: str = "dense"):
    """edgeflow's SimConfig for a spec: every device every round (quorum 1), a deadline no round reaches."""
    from edgeflow.sim.simulation import SimConfig

    model, mode = (spec["suite_model"], spec["train_mode"]) if spec["model"] == "finetune" else (spec["model"], "full")
    return SimConfig(devices=spec["clients"], rounds=spec["rounds"], model=model, train_mode=mode,
                     input_size=spec["input_size"], alpha=spec["alpha"], seed=spec["seed"], codec=codec,
                     epochs=spec["epochs"], batch_size=spec["batch_size"], lr=spec["lr"], momentum=spec["momentum"],
                     quorum=1.0, min_clients=spec["clients"], deadline_s=900.0)


def write_shared_inputs(spec: dict, folder: Path) -> Path:
    """The one split and initial model both sides get: ``data.npz`` (+ ``model.onnx`` for the fine-tune)."""
    import onnx
    from onnx import numpy_helper

    from edgeflow.sim.simulation import build_model, shard_data

    cfg = sim_config(spec)
    split, parts = shard_data(cfg)
    model = build_model(cfg.model, cfg.seed, cfg.input_size)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    if spec["model"] == "finetune":
        from edgeflow.train import Trainer

        names = list(Trainer(model, mode=cfg.train_mode).trainable_names)
        onnx_path = folder / "model.onnx"
        onnx.save(model, onnx_path)
        spec["onnx"] = str(onnx_path)
        inits = {n: np.asarray(Trainer(model, mode=cfg.train_mode).get_weights()[n]) for n in names}
    else:
        names = list(inits)
    arrays = {"x_train": split.x_train, "y_train": split.y_train, "x_test": split.x_test, "y_test": split.y_test,
              "names": np.array(names), **{f"part_{i}": p for i, p in enumerate(parts)},
              **{f"w_{n}": inits[n] for n in names}}
    path = folder / "data.npz"
    np.savez(path, **arrays)
    return path


# ------------------------------------------------------------ the two sides

def edgeflow_side(spec: dict, data_path: str, codec: str) -> dict:
    """One edgeflow run over a private Mosquitto, on exactly the .npz's shards (checked)."""
    from edgeflow.sim.simulation import SimulatedFleet
    from edgeflow.transport.broker import MosquittoBroker, find_mosquitto

    data = dict(np.load(data_path, allow_pickle=False))
    binary = find_mosquitto()
    if binary is None:
        raise BenchmarkError("no mosquitto binary: apt install mosquitto (the edgeflow side runs over real MQTT)")
    rows: list[dict] = []
    down = {"bytes": 0}
    lock = threading.Lock()
    with MosquittoBroker(binary=binary).start() as broker:
        fleet = SimulatedFleet(sim_config(spec, codec), broker.url, on_round=lambda m: rows.append(
            {"round": m.round_id, "accuracy": m.accuracy, "bytes_up": m.bytes_in, "participants": m.participants,
             "down_total": down["bytes"], "t_s": time.perf_counter() - t_rounds}))
        try:
            check_same_inputs(fleet, data)
            for d in fleet.devices:
                count_deliveries(d.transport, down, lock)
            fleet.start()
            t_rounds = time.perf_counter()
            fleet.run()
            up_total = sum(d.client.stats.bytes_sent for d in fleet.devices)
        finally:
            fleet.close()
    per_round_bytes_down(rows)
    by_topic = {k: v for k, v in down.items() if k != "bytes"}
    return {"framework": "edgeflow", "codec": codec, "rounds": rows, "bytes_up_sent_by_devices": up_total,
            "downlink_by_topic": by_topic}


def check_same_inputs(fleet, data: dict[str, np.ndarray]) -> None:
    """Every device trains on exactly its .npz shard, and the model starts from the .npz's weights."""
    from onnx import numpy_helper

    for i, d in enumerate(fleet.devices):
        idx = data[f"part_{i}"]
        if not (np.array_equal(d.client.y, data["y_train"][idx]) and np.array_equal(d.client.x, data["x_train"][idx])):
            raise BenchmarkError(f"device {i}'s shard differs from the benchmark's split: the comparison is off")
    inits = {t.name: numpy_helper.to_array(t) for t in fleet.model.graph.initializer}
    for n in data["names"]:
        if str(n) in inits and not np.array_equal(inits[str(n)], data[f"w_{n}"]):
            raise BenchmarkError(f"edgeflow's initial {n} differs from the benchmark's: the comparison is off")


def per_round_bytes_down(rows: list[dict]) -> None:
    """Each row's cumulative ``down_total`` (bytes delivered to devices so far) becomes ``bytes_down``, that
    round's own bytes."""
    prev = 0
    for r in rows:
        r["bytes_down"], prev = r["down_total"] - prev, r["down_total"]
        del r["down_total"]


def count_deliveries(transport, counter: dict, lock: threading.Lock) -> None:
    """Count the payload bytes of every message this transport hands a handler (the downlink)."""
    subscribe = transport.subscribe

    def counting_subscribe(filter, handler, **kw):
        def counted(msg):
            kind = f"down_{str(msg.topic).rsplit('/', 1)[-1]}"
            with lock:
                counter["bytes"] += len(msg.payload or b"")
                counter[kind] = counter.get(kind, 0) + len(msg.payload or b"")
                counter[kind + "_messages"] = counter.get(kind + "_messages", 0) + 1
            return handler(msg)
        return subscribe(filter, counted, **kw)

    transport.subscribe = counting_subscribe


# --------------------------------------------------- processes and memory

SIDE_TIMEOUT_S = 3600.0
"""A side still running after this long is stopped (with its whole process tree) and the run fails."""


def run_measured(cmd: list[str], out_json: Path, *, label: str) -> dict:
    """Run one side; its wall time and the peak RSS of its whole process tree (sampled every 0.2 s)."""
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "RAY_DEDUP_LOGS": "0", "PYTHONWARNINGS": "ignore"}
    log_path = out_json.with_suffix(".log")
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        root = psutil.Process(proc.pid)
        peak, seen = 0, {}
        while proc.poll() is None:
            total = 0
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            for p in tree:
                try:
                    total += p.memory_info().rss
                    seen[p.pid] = p
                except psutil.NoSuchProcess:
                    continue  # ended between listing and reading: its memory is gone too
            peak = max(peak, total)
            if time.perf_counter() - t0 > SIDE_TIMEOUT_S:
                for p in tree:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        continue  # already gone
                proc.wait()
                raise BenchmarkError(f"{label} side ran past {SIDE_TIMEOUT_S:.0f} s and was stopped; its log is "
                                     f"{log_path}; lower --clients or --rounds")
            time.sleep(0.2)
    wall = time.perf_counter() - t0
    for p in seen.values():  # what the side left running (Ray daemons) is ended: it was started by this run
        if p.pid != proc.pid and p.is_running():
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                continue  # ended between the check and the signal
    if proc.returncode != 0 or not out_json.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        raise BenchmarkError(f"{label} side failed (exit {proc.returncode}); its log {log_path} ends:\n  "
                             + "\n  ".join(tail))
    result = json.loads(out_json.read_text())
    result.update(wall_s=round(wall, 2), peak_rss_mib=round(peak / 2**20, 1))
    return result


def run_flower(spec: dict, data: Path, folder: Path, python: str) -> dict:
    spec_path = folder / "flower_spec.json"
    spec_path.write_text(json.dumps(spec))
    out = folder / "flower.json"
    return run_measured([python, str(HERE / "_flower_side.py"), str(spec_path), str(data), str(out)], out,
                        label="Flower")


def run_edgeflow(spec: dict, data: Path, folder: Path, codec: str) -> dict:
    spec_path = folder / "edgeflow_spec.json"
    spec_path.write_text(json.dumps(spec))
    out = folder / f"edgeflow_{codec}.json"
    return run_measured([sys.executable, str(Path(__file__).resolve()), "--edgeflow-side", str(spec_path), str(data),
                         codec, str(out)], out, label=f"edgeflow ({codec})")


# ----------------------------------------------------------- summarising

def summarise(run: dict) -> dict:
    rows = run["rounds"]
    accs = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
    n = max(1, len(rows))
    return {"final_accuracy": accs[-1] if accs else None, "best_accuracy": max(accs) if accs else None,
            "rounds_completed": len(rows),
            "bytes_up_per_round": round(sum(r.get("bytes_up", 0) for r in rows) / n),
            "bytes_down_per_round": round(sum(r.get("bytes_down", 0) for r in rows) / n),
            "rounds_s": round(rows[-1]["t_s"], 2) if rows else None,
            "wall_s": run["wall_s"], "peak_rss_mib": run["peak_rss_mib"],
            **({"downlink_by_topic": run["downlink_by_topic"]} if "downlink_by_topic" in run else {})}


def ratios(edge: dict, flower: dict) -> dict:
    def r(k: str) -> float | None:
        return round(edge[k] / flower[k], 3) if flower.get(k) else None

    diff = None
    if edge["final_accuracy"] is not None and flower["final_accuracy"] is not None:
        diff = round(100 * (edge["final_accuracy"] - flower["final_accuracy"]), 1)
    return {"bytes_up": r("bytes_up_per_round"), "bytes_down": r("bytes_down_per_round"), "wall_s": r("wall_s"),
            "peak_rss": r("peak_rss_mib"), "final_accuracy_points": diff}


def reach(rows: list[dict], target: float) -> tuple[int | None, int | None]:
    """The first round whose test accuracy is >= ``target``, and the bytes all clients uploaded until then."""
    total = 0
    for r in rows:
        total += r.get("bytes_up", 0)
        if (r.get("accuracy") or 0) >= target:
            return r["round"], total
    return None, None


def add_reach(result: dict) -> None:
    """Each side's round and cumulative upload to ``target_accuracy``, and edgeflow/Flower's ratio of the bytes."""
    target = result["target_accuracy"]
    for c in result["cases"]:
        for name, s in c["sides"].items():
            s["round_to_target"], s["bytes_up_to_target"] = reach(c["per_round"][name], target)
        f = c["sides"]["flower"]["bytes_up_to_target"]
        for codec, r in c["ratios"].items():
            e = c["sides"][f"edgeflow-{codec}"]["bytes_up_to_target"]
            r["bytes_up_to_target"] = round(e / f, 3) if e and f else None


def markdown(result: dict) -> str:
    out = [f"edgeflow ({result['edgeflow_tree']}) vs Flower ({result['flower']}), {result['clients']} clients, "
           f"{result['rounds']} rounds, {result['epochs']} local epoch(s), batch {result['batch_size']}, lr {result['lr']}, "
           f"seed {result['seed']}; CPU flags: {result['cpu']}; load average at start "
           f"{result['load_average_at_start'][0]:.1f}",
           f"command: `{result['command']}`", ""]
    if result.get("sanity"):
        s = result["sanity"]
        out += [f"sanity (MLP, 1 client, 1 round, edgeflow dense, seeds 0..{s['seeds'] - 1}): test accuracy Flower "
                f"{', '.join(f'{a:.3f}' for a in s['flower_accuracy'])}; edgeflow "
                f"{', '.join(f'{a:.3f}' for a in s['edgeflow_accuracy'])}; mean difference "
                f"{s['difference_points']:+.1f} points, 2 standard errors {s['two_standard_errors_points']:.1f} "
                f"({'within' if s['within_noise'] else 'NOT within'} noise). Same batches in the same order (no "
                f"shuffling, {result['epochs']} epochs on the whole training set): weights differ by at most "
                f"{s['same_order']['max_weight_difference']:.1e}, test accuracy edgeflow "
                f"{s['same_order']['edgeflow_accuracy']:.3f} vs Flower's client {s['same_order']['flower_client_accuracy']:.3f}",
                ""]
    t = result["target_accuracy"]
    out += [f"| model | alpha | side | final acc | best acc | round to {t:g} | bytes up to {t:g} | bytes up/round | "
            "bytes down/round | rounds s | wall s | peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        for name, s in c["sides"].items():
            out.append(f"| {c['model']} | {c['alpha']} | {name} | {_acc(s['final_accuracy'])} | "
                       f"{_acc(s['best_accuracy'])} | {s['round_to_target'] or 'not reached'} | "
                       f"{'n/a' if s['bytes_up_to_target'] is None else format(s['bytes_up_to_target'], ',')} | "
                       f"{s['bytes_up_per_round']:,} | {s['bytes_down_per_round']:,} | "
                       f"{s['rounds_s']:.1f} | {s['wall_s']:.1f} | {s['peak_rss_mib']:.0f} |")
    same = [c["same_order"] for c in result["cases"] if c.get("same_order")]
    for m in {s["model"]: s for s in same}.values():
        out += ["", f"{m['model']}: edgeflow's Trainer vs the Flower client over the same batches in the same order "
                f"({result['epochs']} epochs, no shuffling): weights differ by at most {m['max_weight_difference']:.1e}; "
                f"test accuracy {m['edgeflow_accuracy']:.3f} vs {m['flower_client_accuracy']:.3f}"]
    out += ["", "edgeflow / Flower (ratios; accuracy as edgeflow minus Flower, in points):", "",
            f"| model | alpha | edgeflow codec | bytes up/round | bytes up to {t:g} | bytes down/round | wall time | "
            "peak RSS | final accuracy |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        for codec, r in c["ratios"].items():
            out.append(f"| {c['model']} | {c['alpha']} | {codec} | {_x(r['bytes_up'])} | {_x(r['bytes_up_to_target'])} | "
                       f"{_x(r['bytes_down'])} | "
                       f"{_x(r['wall_s'])} | {_x(r['peak_rss'])} | {r['final_accuracy_points']:+.1f} |")
    return "\n".join(out) + "\n"


def _acc(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}x"


# ------------------------------------------------------------ the pictures

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def bytes_to_accuracy_svg(title: str, series: list[tuple[str, list[tuple[float, float]]]],
                          width: int = 620, height: int = 340) -> str:
    """Test accuracy against cumulative bytes uploaded (log x axis), one polyline per side (standard library)."""
    import html

    left, right, top, bottom = 56, 16, 44, 46
    pw, ph = width - left - right, height - top - bottom
    xs = [x for _, pts in series for x, _ in pts if x > 0]
    lo = 10 ** math.floor(math.log10(min(xs))) if xs else 1.0
    hi = 10 ** math.ceil(math.log10(max(xs))) if xs else 10.0
    hi = hi if hi > lo else lo * 10

    def tx(v: float) -> float:
        return left + (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * pw

    def ty(v: float) -> float:
        return top + ph - v * ph

    e = html.escape
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'role="img" aria-label="{e(title)}" font-family="sans-serif" font-size="11">', f"<title>{e(title)}</title>",
           f'<rect width="{width}" height="{height}" fill="#fff"/>',
           f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" font-size="13">{e(title)}</text>']
    for k in range(11):
        y = ty(k / 10)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   + (f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{k / 10:.1f}</text>' if k % 2 == 0 else ""))
    for p in range(round(math.log10(lo)), round(math.log10(hi)) + 1):
        x = tx(10.0 ** p)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{top + ph + 14}" text-anchor="middle">1e{p}</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{height - 8}" text-anchor="middle">cumulative bytes uploaded by all '
               'clients (log scale)</text>'
               f'<text transform="translate(14 {top + ph / 2:.0f}) rotate(-90)" text-anchor="middle">test accuracy</text>')
    for i, (label, pts) in enumerate(series):
        c = COLORS[i % len(COLORS)]
        pts = [(x, y) for x, y in pts if x > 0 and y is not None]
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="'
                   + " ".join(f"{tx(x):.1f},{ty(y):.1f}" for x, y in pts) + '"/>')
        out += [f'<circle cx="{tx(x):.1f}" cy="{ty(y):.1f}" r="2.5" fill="{c}" data-series="{e(label)}" '
                f'data-bytes="{x:.0f}" data-accuracy="{y:.4f}"><title>{e(label)}: {x:,.0f} B, {y:.3f}</title></circle>'
                for x, y in pts]
        lx = left + 8 + i * 190
        out.append(f'<rect x="{lx}" y="{top - 16}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{lx + 14}" y="{top - 7}">{e(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def curve(rows: list[dict]) -> list[tuple[float, float]]:
    total, pts = 0, []
    for r in rows:
        total += r.get("bytes_up", 0)
        pts.append((float(total), r.get("accuracy")))
    return pts


# ------------------------------------------------------------------ driver

def check_flower_python(python: str) -> str:
    if not Path(python).exists():
        raise BenchmarkError(f"no Flower interpreter at {python}; create its venv (Flower pins typer < 0.21, which "
                             f"breaks amqtt in edgeflow's env): {FLOWER_WHEEL_HINT}, or pass --flower-python PATH")
    probe = subprocess.run([python, "-c", "import flwr, ray; print(flwr.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise BenchmarkError(f"{python} cannot import flwr and ray (Flower's simulation needs both): "
                             f"{FLOWER_WHEEL_HINT}")
    return probe.stdout.strip()


def run_case(spec: dict, codecs: list[str], python: str, folder: Path, say) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    data = write_shared_inputs(spec, folder)
    say(f"{spec['model']} alpha {spec['alpha']}: Flower ...")
    sides = {"flower": run_flower(spec, data, folder, python)}
    for codec in codecs:
        say(f"{spec['model']} alpha {spec['alpha']}: edgeflow {codec} ...")
        sides[f"edgeflow-{codec}"] = run_edgeflow(spec, data, folder, codec)
    summary = {k: summarise(v) for k, v in sides.items()}
    same = same_order_agreement(spec, spec["model"]) if spec["model"] in ("mlp", "cnn") else None
    return {"model": spec["model"], "alpha": spec["alpha"], "spec": spec, "sides": summary, "same_order": same,
            "ratios": {c: ratios(summary[f"edgeflow-{c}"], summary["flower"]) for c in codecs},
            "per_round": {k: v["rounds"] for k, v in sides.items()}}


def sanity(base: dict, python: str, folder: Path, seeds: int, say) -> dict:
    """1 client, 1 round, dense, ``seeds`` seeds: both sides' test accuracy (one round's spread across
    shuffles is up to 25 points at lr 0.1, so the means are compared against 2 standard errors), and
    :func:`same_order_agreement` (the same math, to float32 rounding)."""
    f_acc, e_acc = [], []
    for seed in range(seeds):
        spec = {**base, "model": "mlp", "clients": 1, "rounds": 1, "alpha": 0.3, "seed": seed}
        say(f"sanity: 1 client, 1 round, seed {seed} ...")
        sub = folder / f"seed{seed}"
        sub.mkdir(parents=True, exist_ok=True)
        data = write_shared_inputs(spec, sub)
        f_acc.append(run_flower(spec, data, sub, python)["rounds"][-1]["accuracy"])
        e_acc.append(run_edgeflow(spec, data, sub, "dense")["rounds"][-1]["accuracy"])
    diff = float(np.mean(e_acc) - np.mean(f_acc))
    se = math.sqrt((np.var(f_acc, ddof=1) + np.var(e_acc, ddof=1)) / seeds) if seeds > 1 else float("nan")
    return {"seeds": seeds, "flower_accuracy": f_acc, "edgeflow_accuracy": e_acc,
            "difference_points": round(100 * diff, 1), "two_standard_errors_points": round(200 * se, 1),
            "within_noise": bool(abs(diff) <= 2 * se), "same_order": same_order_agreement(base)}


def same_order_agreement(base: dict, model: str = "mlp") -> dict:
    """edgeflow's Trainer and the Flower side's client model (numpy MLP / PyTorch CNN) from the same weights over
    the same batches in the same order (no shuffling), ``epochs`` epochs on one whole training set: the largest
    weight difference and both test accuracies."""
    from onnx import numpy_helper

    import _flower_side
    from edgeflow.sim.simulation import build_model, shard_data
    from edgeflow.train import Trainer

    cfg = sim_config({**base, "model": model, "clients": 1, "rounds": 1, "alpha": 0.3})
    split, _ = shard_data(cfg)
    onnx_model = build_model(model, cfg.seed)
    inits = {t.name: numpy_helper.to_array(t) for t in onnx_model.graph.initializer}
    names = list(inits)
    theirs = _flower_side.make_model({"model": model}, names)
    w = theirs.fit([inits[n] for n in names], split.x_train, split.y_train, {**base, "shuffle": False}, 0)
    ours = Trainer(onnx_model, lr=base["lr"], momentum=base["momentum"], batch_size=base["batch_size"])
    ours.fit((split.x_train, split.y_train), epochs=base["epochs"], shuffle=False)
    got = ours.get_weights()
    return {"model": model, "max_weight_difference": float(max(np.abs(got[n] - v).max() for n, v in zip(names, w))),
            "edgeflow_accuracy": ours.evaluate(split.x_test, split.y_test)[1],
            "flower_client_accuracy": theirs.accuracy(w, split.x_test, split.y_test)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp", help="comma-separated: mlp, cnn, finetune (default mlp)")
    ap.add_argument("--alphas", default="0.3,0.1", help="Dirichlet label skews (default 0.3,0.1)")
    ap.add_argument("--clients", type=int, default=20, help="clients (edgeflow: devices), all in every round (default 20)")
    ap.add_argument("--rounds", type=int, default=30, help="federated rounds (default 30)")
    ap.add_argument("--epochs", type=int, default=2, help="local epochs per round (default 2)")
    ap.add_argument("--batch-size", type=int, default=16, help="local batch size (default 16)")
    ap.add_argument("--lr", type=float, default=0.1, help="local SGD learning rate (default 0.1)")
    ap.add_argument("--momentum", type=float, default=0.0, help="local SGD momentum (default 0)")
    ap.add_argument("--codecs", default="int8,dense", help="edgeflow codecs to run (default int8,dense)")
    ap.add_argument("--train-mode", default="bias", help="finetune: head or bias (default bias)")
    ap.add_argument("--input-size", type=int, default=48, help="finetune: digits resized to this size (default 48)")
    ap.add_argument("--seed", type=int, default=0, help="fixes the split, the initial model and the shuffles (default 0)")
    ap.add_argument("--flower-python",
                    help="an interpreter that imports flwr and ray (default: FLOWER_PYTHON, this one, or the venv "
                         "benchmarks/_flower_env.py finds)")
    ap.add_argument("--ray-cpus", type=int, default=os.cpu_count() or 1, help="CPUs Ray may use (default: all)")
    ap.add_argument("--out", default="runs/fl_vs_flower", help="results.json and results.md go here "
                    "(default runs/fl_vs_flower)")
    ap.add_argument("--svg-dir", help="where the bytes-to-accuracy SVGs go (default --out)")
    ap.add_argument("--sanity-seeds", type=int, default=3,
                    help="seeds of the 1-client/1-round agreement check; 0 skips it (default 3)")
    ap.add_argument("--target-accuracy", type=float, default=0.9,
                    help="report the round and the bytes uploaded until the test accuracy first reaches this "
                    "(default 0.9)")
    ap.add_argument("--render", metavar="RESULTS_JSON", help="only rewrite results.md (and with --svg-dir the charts) from an earlier run's results.json")
    ap.add_argument("--json", action="store_true", help="print only the results JSON")
    ap.add_argument("--edgeflow-side", nargs=4, metavar=("SPEC", "DATA", "CODEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("clients", "rounds", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    bad = set(args.models.split(",")) - {"mlp", "cnn", "finetune"}
    if bad:
        ap.error(f"--models: unknown {sorted(bad)}; choose from mlp, cnn, finetune")
    try:
        alphas = [float(a) for a in args.alphas.split(",")]
    except ValueError:
        ap.error(f"--alphas takes comma-separated numbers, e.g. 0.3,0.1; got {args.alphas!r}")
    if not all(a > 0 for a in alphas):
        ap.error(f"--alphas must be > 0 (Dirichlet concentration), got {args.alphas!r}")
    from edgeflow.codecs import available_codecs

    unknown = [c for c in args.codecs.split(",") if c and c not in available_codecs()]
    if unknown or not args.codecs.strip(","):
        ap.error(f"--codecs: unknown {unknown or '(none)'}; choose from {', '.join(available_codecs())}")
    if args.train_mode not in ("head", "bias"):
        ap.error(f"--train-mode must be head or bias, got {args.train_mode!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.edgeflow_side:
            spec_path, data, codec, out = args.edgeflow_side
            result = edgeflow_side(json.loads(Path(spec_path).read_text()), data, codec)
            Path(out).write_text(json.dumps(result, indent=1))
            return 0
        if args.render:
            return render(Path(args.render), args.target_accuracy, args.svg_dir)
        return compare(args)
    except BenchmarkError as exc:
        print(f"fl_vs_flower: error: {exc}", file=sys.stderr)
        return 1


def write_svg(case: dict, folder: Path, clients: int) -> str:
    tag = case["model"] if case["model"] != "finetune" else f"finetune-{case['spec']['train_mode']}"
    path = folder / f"fl_vs_flower_{tag}_alpha{case['alpha']:g}.svg"
    path.write_text(bytes_to_accuracy_svg(f"{tag}, Dirichlet {case['alpha']:g}, {clients} clients: accuracy per byte "
                                          "uploaded", [(k, curve(v)) for k, v in case["per_round"].items()]))
    return str(path)


def render(path: Path, target: float, svg_dir: str | None) -> int:
    """Tables (and with ``svg_dir`` the charts) of an earlier run's results.json again, next to it."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchmarkError(f"--render {path}: cannot read a results.json: {exc}") from exc
    if not (isinstance(result, dict) and isinstance(result.get("cases"), list)
            and all(isinstance(c, dict) and {"sides", "per_round", "ratios"} <= set(c) for c in result["cases"])):
        raise BenchmarkError(f"--render {path}: not a results.json of this benchmark (no cases with sides, "
                             "per_round and ratios); point it at the results.json a run wrote")
    result["target_accuracy"] = target
    add_reach(result)
    if svg_dir:
        Path(svg_dir).mkdir(parents=True, exist_ok=True)
        for case in result["cases"]:
            case["svg"] = write_svg(case, Path(svg_dir), result["clients"])
    path.write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    (path.parent / "results.md").write_text(md)
    print(md)
    return 0


def compare(args: argparse.Namespace) -> int:
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    args.flower_python = args.flower_python or flower_python(("flwr", "ray"))
    if args.flower_python is None:
        raise BenchmarkError(f"no interpreter here imports flwr and ray (Flower's simulation needs both): {MAKE_VENV}")
    version = check_flower_python(args.flower_python)
    out = Path(args.out)
    svg_dir = Path(args.svg_dir or args.out)
    out.mkdir(parents=True, exist_ok=True)
    svg_dir.mkdir(parents=True, exist_ok=True)
    base = {"clients": args.clients, "rounds": args.rounds, "epochs": args.epochs, "batch_size": args.batch_size,
            "lr": args.lr, "momentum": args.momentum, "seed": args.seed, "train_mode": args.train_mode,
            "input_size": args.input_size, "suite_model": FINETUNE_MODEL, "ray_cpus": args.ray_cpus}
    codecs = [c for c in args.codecs.split(",") if c]
    result: dict[str, Any] = {"flower": f"flwr {version}", **{k: base[k] for k in
                              ("clients", "rounds", "epochs", "batch_size", "lr", "seed")},
                              "command": " ".join(["python benchmarks/fl_vs_flower.py", *args.argv]),
                              "cpu": cpu_flags(), "load_average_at_start": os.getloadavg(), "edgeflow_tree": git_state(),
                              "cases": []}
    with tempfile.TemporaryDirectory(prefix="fl_vs_flower-") as tmp:
        if args.sanity_seeds:
            result["sanity"] = sanity(base, args.flower_python, Path(tmp) / "sanity", args.sanity_seeds, say)
        for model in args.models.split(","):
            for alpha in (float(a) for a in args.alphas.split(",")):
                spec = {**base, "model": model, "alpha": alpha}
                case = run_case(spec, codecs, args.flower_python, Path(tmp) / f"{model}-{alpha}", say)
                case["spec"].pop("onnx", None)
                result["cases"].append(case)
                case["svg"] = write_svg(case, svg_dir, args.clients)
    result["target_accuracy"] = args.target_accuracy
    add_reach(result)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    (out / "results.md").write_text(md)
    print(json.dumps(result, indent=1) if args.json else md)
    return 0


def git_state() -> str:
    """The commit the edgeflow side ran, and whether edgeflow's code had uncommitted changes then."""
    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=HERE.parent, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "edgeflow", "gateway", "kernels")
    return f"{head}{' + uncommitted changes in edgeflow/gateway/kernels' if dirty else ''}"


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return " ".join(f for f in ("avx2", "avx512_vnni", "amx_int8") if f" {f}" in text)


if __name__ == "__main__":
    sys.exit(main())
