"""Aggregation: edgeflow's streaming FedAvg vs Flower's ``aggregate``, one run.

The fair comparison is the gateway's real situation: updates arrive one at a
time (here: each is a freshly allocated set of float32 arrays, as a decoder
would produce). Flower's strategy has to keep every update until it can call
``flwr.server.strategy.aggregate.aggregate(results)`` with the whole list;
edgeflow folds each update into a float64 accumulator as it arrives and drops
it. Both sides see the same updates in the same order, and the results are
checked to agree.

* time: the aggregation work only (edgeflow: every ``add`` + ``finish``;
  Flower: appending to its list + ``aggregate``), median of ``--repeats``,
  update generation excluded for both (also reported: wall time including it);
* peak memory, two ways: tracemalloc peak (numpy reports its buffers to it)
  for both in this process, and the peak RSS (VmHWM) of a separate process
  per side, minus that process's RSS after its imports.

Targets (issue 6): time <= 0.5x Flower, peak memory <= 0.1x; and 1,000
clients x 10M parameters through streaming FedAvg well under 1 GB
(measured in a subprocess, updates generated one at a time).

    python benchmarks/aggregation.py [--clients 100] [--params 1000000] [--skip-big] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _flower_env import MAKE_VENV, flower_python  # noqa: E402

TIME_TARGET, MEM_TARGET, BIG_LIMIT = 0.5, 0.1, 1 << 30


def layout(params: int) -> dict[str, tuple[int, ...]]:
    """An MLP-like set of tensors with about ``params`` parameters in total."""
    hidden = max(8, int(math.sqrt(params / 2)))
    first = max(1, params // 2 // hidden)
    rest = max(1, (params - first * hidden - 2 * hidden) // hidden)
    return {"fc1.weight": (first, hidden), "fc1.bias": (hidden,), "fc2.weight": (hidden, rest), "fc2.bias": (rest,)}


class Arrivals:
    """Updates as they would come off the wire: fresh float32 arrays each time."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.bases = [{n: (0.01 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}
                      for _ in range(4)]

    def update(self, i: int) -> dict[str, np.ndarray]:
        base = self.bases[i % 4]
        scale = np.float32(1.0 + 1e-3 * i)
        return {n: np.multiply(a, scale) for n, a in base.items()}

    @staticmethod
    def samples(i: int) -> int:
        return 20 + (i * 37) % 200


UNBOUNDED = {"clip": "off", "sample_multiplier": "off"}
"""FedAvg without its default norm bound and sample cap: the same math as Flower's ``aggregate``,
for the agreement check. The timings use the default FedAvg, which is what the gateway runs (its norm
pass doubles as the NaN/Inf scan, so it costs what ``check_finite`` costs)."""


def run_edgeflow(arr: Arrivals, clients: int, shapes, check_finite: bool = True,
                 params: dict | None = None) -> tuple[float, float, list]:
    from edgeflow.gateway.strategies import FedAvg

    agg = FedAvg(check_finite=check_finite, **(params or {}))
    agg.begin_round({n: np.zeros(s, np.float32) for n, s in shapes.items()}, 0)
    work = 0.0
    t_wall = time.perf_counter()
    for i in range(clients):
        upd = arr.update(i)
        t0 = time.perf_counter()
        agg.add(upd, arr.samples(i), client_id=f"dev-{i}")
        work += time.perf_counter() - t0
        del upd
    t0 = time.perf_counter()
    res = agg.finish()
    work += time.perf_counter() - t0
    return work, time.perf_counter() - t_wall, [res.delta[n] for n in shapes]


def run_flower(arr: Arrivals, clients: int, shapes) -> tuple[float, float, list[np.ndarray]]:
    from flwr.server.strategy.aggregate import aggregate

    results = []
    work = 0.0
    t_wall = time.perf_counter()
    for i in range(clients):
        upd = arr.update(i)
        t0 = time.perf_counter()
        results.append(([upd[n] for n in shapes], arr.samples(i)))
        work += time.perf_counter() - t0
        del upd
    t0 = time.perf_counter()
    out = aggregate(results)
    work += time.perf_counter() - t0
    return work, time.perf_counter() - t_wall, out


def run_edgeflow_trusted(arr: Arrivals, clients: int, shapes) -> tuple[float, float, list]:
    """check_finite=False: for updates that came through decode_update, which rejects NaN/Inf itself."""
    return run_edgeflow(arr, clients, shapes, check_finite=False)


RUNNERS = {"edgeflow": run_edgeflow, "flower": run_flower}


def _vm(key: str) -> int:
    """VmRSS / VmHWM of this process in bytes (Linux), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(side: str, clients: int, params: int) -> dict:
    """Run one side in this fresh process: a cold first run (timed, peak RSS), then a
    second under tracemalloc. RSS is reported above the post-import baseline."""
    shapes = layout(params)
    if side == "flower":
        from flwr.server.strategy.aggregate import aggregate  # noqa: F401 - import before the baseline
    else:
        from edgeflow.gateway.strategies import FedAvg  # noqa: F401
    arr = Arrivals(shapes)
    _reset_hwm()
    base = _vm("VmRSS")
    work, wall, _ = RUNNERS[side](arr, clients, shapes)
    peak = _vm("VmHWM")
    tracemalloc.start()
    RUNNERS[side](arr, clients, shapes)
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"side": side, "clients": clients, "params": sum(math.prod(s) for s in shapes.values()),
            "cold_work_s": work, "cold_wall_s": wall, "rss_baseline": base, "rss_peak": peak,
            "rss_above_baseline": peak - base, "traced_peak": traced_peak}


def _subprocess(side: str, clients: int, params: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--clients", str(clients), "--params", str(params)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(clients: int, params: int, repeats: int) -> dict:
    shapes = layout(params)
    arr = Arrivals(shapes)
    # correctness first
    _, _, ours = run_edgeflow(arr, clients, shapes, params=UNBOUNDED)
    _, _, theirs = run_flower(arr, clients, shapes)
    max_diff = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(ours, theirs))
    scale = max(float(np.max(np.abs(b))) for b in theirs)
    # time, interleaved so machine noise hits both
    times: dict[str, list[float]] = {"edgeflow": [], "flower": []}
    walls: dict[str, list[float]] = {"edgeflow": [], "flower": []}
    for _ in range(repeats):
        for side, fn in RUNNERS.items():
            work, wall, _ = fn(arr, clients, shapes)
            times[side].append(work)
            walls[side].append(wall)
    # tracemalloc peaks in this process
    traced = {}
    for side, fn in RUNNERS.items():
        tracemalloc.start()
        fn(arr, clients, shapes)
        traced[side] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    runs: dict[str, list[dict]] = {side: [] for side in RUNNERS}
    for _ in range(repeats):  # fresh processes, alternating
        for side in RUNNERS:
            runs[side].append(_subprocess(side, clients, params))
    rss = {side: min(r, key=lambda d: d["rss_peak"]) | {"rss_peak": max(d["rss_peak"] for d in r),
                                                         "rss_above_baseline": max(d["rss_above_baseline"] for d in r)}
           for side, r in runs.items()}
    med = {s: float(np.median(v)) for s, v in times.items()}
    cold = {s: float(np.median([d["cold_work_s"] for d in runs[s]])) for s in RUNNERS}
    trusted = float(np.median([run_edgeflow_trusted(arr, clients, shapes)[0] for _ in range(repeats)]))
    return {
        "clients": clients,
        "params": sum(math.prod(s) for s in shapes.values()),
        "max_abs_diff_vs_flower": max_diff, "flower_max_abs": scale,
        "time_s": med, "wall_s": {s: float(np.median(v)) for s, v in walls.items()},
        "time_ratio": med["edgeflow"] / med["flower"],
        "cold_time_s": cold, "cold_time_ratio": cold["edgeflow"] / cold["flower"],
        "trusted_time_s": trusted, "trusted_time_ratio": trusted / med["flower"],
        "traced_peak": traced, "traced_ratio": traced["edgeflow"] / traced["flower"],
        "rss": rss,
        "rss_ratio": rss["edgeflow"]["rss_above_baseline"] / rss["flower"]["rss_above_baseline"],
    }


def accumulator_choice(clients: int, params: int) -> list[dict]:
    """float64 accumulator (edgeflow's choice) vs float32 + Kahan compensation vs plain float32."""
    shapes = {"w": (params,)}
    arr = Arrivals(shapes)
    rows = []
    exact = np.zeros(params, np.float64)
    total = 0
    for i in range(clients):
        exact += arr.update(i)["w"].astype(np.float64) * arr.samples(i)
        total += arr.samples(i)
    exact /= total
    for mode in ("float64", "float32+kahan", "float32"):
        acc64 = np.zeros(params, np.float64) if mode == "float64" else None
        acc = np.zeros(params, np.float32)
        comp = np.zeros(params, np.float32)
        tmp64 = np.empty(params, np.float64)
        tmp = np.empty(params, np.float32)
        t_sum = np.empty(params, np.float32)
        work = 0.0
        for i in range(clients):
            u = arr.update(i)["w"]
            w = arr.samples(i)
            t0 = time.perf_counter()
            if mode == "float64":
                np.multiply(u, w, out=tmp64, dtype=np.float64)
                acc64 += tmp64
            elif mode == "float32":
                np.multiply(u, np.float32(w), out=tmp)
                acc += tmp
            else:  # Kahan: y = x - c; t = s + y; c = (t - s) - y; s = t
                np.multiply(u, np.float32(w), out=tmp)
                tmp -= comp
                np.add(acc, tmp, out=t_sum)
                np.subtract(t_sum, acc, out=comp)
                comp -= tmp
                acc, t_sum = t_sum, acc
            work += time.perf_counter() - t0
        result = acc64 / total if mode == "float64" else acc.astype(np.float64) / total
        err = float(np.max(np.abs(result - exact)) / np.max(np.abs(exact)))
        state = 8 * params if mode == "float64" else (8 if "kahan" in mode else 4) * params
        rows.append({"accumulator": mode, "fold_ms_per_update": 1e3 * work / clients, "max_rel_error": err,
                     "state_bytes_per_param": state / params})
    return rows


def big_worker(clients: int, params: int) -> dict:
    """1,000 clients x 10M params through streaming FedAvg, in this process."""
    shapes = layout(params)
    from edgeflow.gateway.strategies import FedAvg

    arr = Arrivals(shapes)
    _reset_hwm()
    base = _vm("VmRSS")
    tracemalloc.start()
    agg = FedAvg()
    agg.begin_round({n: np.zeros(s, np.float32) for n, s in shapes.items()}, 0)
    t0 = time.perf_counter()
    for i in range(clients):
        upd = arr.update(i)
        agg.add(upd, arr.samples(i), client_id=f"dev-{i}")
        del upd
    res = agg.finish()
    wall = time.perf_counter() - t0
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    peak = _vm("VmHWM")
    assert res.num_clients == clients
    return {"clients": clients, "params": sum(math.prod(s) for s in shapes.values()), "wall_s": wall,
            "rss_peak": peak, "rss_baseline_before_round": base, "rss_above_baseline": peak - base,
            "traced_peak": traced}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import flwr

        fv = flwr.__version__
    except ImportError:  # pragma: no cover
        fv = "not installed"
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}, flwr {fv}"


def _mb(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big-clients", type=int, default=1000)
    ap.add_argument("--big-params", type=int, default=10_000_000)
    ap.add_argument("--skip-big", action="store_true", help="skip the 1,000 x 10M run (about a minute)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--worker", choices=["edgeflow", "flower", "big"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "big":
        print(json.dumps(big_worker(args.clients, args.params)))
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker, args.clients, args.params)))
        return 0

    if importlib.util.find_spec("flwr") is None:  # Flower lives in its own venv: run this benchmark there
        python = None if os.environ.get("EDGEFLOW_IN_FLOWER_VENV") else flower_python(("flwr", "edgeflow"))
        if python is None:
            print(f"aggregation: Flower (the peer) is not importable here and no venv has it; make one: {MAKE_VENV}",
                  file=sys.stderr)
            return 2
        os.environ["EDGEFLOW_IN_FLOWER_VENV"] = python  # once: a venv that imports flwr does not come back here
        os.execv(python, [python, __file__, *(sys.argv[1:] if argv is None else argv)])
    cmp_ = compare(args.clients, args.params, args.repeats)
    acc_rows = accumulator_choice(args.clients, args.params)
    big = None
    if not args.skip_big:
        cmd = [sys.executable, __file__, "--worker", "big", "--clients", str(args.big_clients),
               "--params", str(args.big_params)]
        big = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])

    ok_t = cmp_["time_ratio"] <= TIME_TARGET
    ok_tc = cmp_["cold_time_ratio"] <= TIME_TARGET
    ok_m = cmp_["traced_ratio"] <= MEM_TARGET and cmp_["rss_ratio"] <= MEM_TARGET
    print(f"# aggregation: {cmp_['clients']} updates x {cmp_['params']:,} params, arriving one at a time")
    print(f"# {machine()}")
    print(f"# results agree: max |edgeflow - flower| = {cmp_['max_abs_diff_vs_flower']:.2e} "
          f"(values up to {cmp_['flower_max_abs']:.2e})")
    print()
    print("| metric | edgeflow streaming FedAvg | Flower aggregate | ratio | target | ok |")
    print("|---|---:|---:|---:|---:|:-:|")
    t = cmp_["time_s"]
    print(f"| aggregation time, warm process (median of {args.repeats}) | {t['edgeflow'] * 1e3:,.0f} ms "
          f"| {t['flower'] * 1e3:,.0f} ms | {cmp_['time_ratio']:.3f} | <= {TIME_TARGET} | {'yes' if ok_t else 'NO'} |")
    print(f"| same, check_finite=False (updates from decode_update) | {cmp_['trusted_time_s'] * 1e3:,.0f} ms "
          f"| {t['flower'] * 1e3:,.0f} ms | {cmp_['trusted_time_ratio']:.3f} | | |")
    c = cmp_["cold_time_s"]
    print(f"| aggregation time, fresh process, first round (median of {args.repeats}) | {c['edgeflow'] * 1e3:,.0f} ms | {c['flower'] * 1e3:,.0f} ms "
          f"| {cmp_['cold_time_ratio']:.3f} | <= {TIME_TARGET} | {'yes' if ok_tc else 'NO'} |")
    w = cmp_["wall_s"]
    print(f"| wall incl. generating updates | {w['edgeflow'] * 1e3:,.0f} ms | {w['flower'] * 1e3:,.0f} ms "
          f"| {w['edgeflow'] / w['flower']:.3f} | | |")
    tp = cmp_["traced_peak"]
    print(f"| peak memory, tracemalloc | {_mb(tp['edgeflow'])} | {_mb(tp['flower'])} | {cmp_['traced_ratio']:.3f} "
          f"| <= {MEM_TARGET} | {'yes' if cmp_['traced_ratio'] <= MEM_TARGET else 'NO'} |")
    r = cmp_["rss"]
    print(f"| peak RSS above post-import baseline (own process, max of {args.repeats}) | {_mb(r['edgeflow']['rss_above_baseline'])} "
          f"| {_mb(r['flower']['rss_above_baseline'])} | {cmp_['rss_ratio']:.3f} | <= {MEM_TARGET} "
          f"| {'yes' if cmp_['rss_ratio'] <= MEM_TARGET else 'NO'} |")
    print(f"| peak RSS, whole process | {_mb(r['edgeflow']['rss_peak'])} | {_mb(r['flower']['rss_peak'])} "
          f"| {r['edgeflow']['rss_peak'] / r['flower']['rss_peak']:.3f} | | |")
    print()
    print(f"accumulator choice ({args.clients} x {args.params:,}):")
    print("| accumulator | fold ms / update | max rel. error vs exact | state bytes / param |")
    print("|---|---:|---:|---:|")
    for row in acc_rows:
        print(f"| {row['accumulator']} | {row['fold_ms_per_update']:.2f} | {row['max_rel_error']:.1e} "
              f"| {row['state_bytes_per_param']:.0f} |")
    ok_b = True
    if big is not None:
        ok_b = big["rss_peak"] < BIG_LIMIT
        print()
        print(f"streaming FedAvg, {big['clients']:,} clients x {big['params']:,} params (own process, one update "
              f"at a time): {big['wall_s']:.1f} s; peak RSS {_mb(big['rss_peak'])} for the whole process "
              f"(incl. {_mb(big['rss_baseline_before_round'])} before the round: interpreter and the generator's "
              f"4 base updates), {_mb(big['rss_above_baseline'])} above that; tracemalloc peak "
              f"{_mb(big['traced_peak'])}; whole process under 1 GiB: {'yes' if ok_b else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "compare": cmp_, "accumulators": acc_rows, "big": big}, f, indent=2)
    return 0 if (ok_t and ok_tc and ok_m and ok_b) else 1


if __name__ == "__main__":
    sys.exit(main())
