"""One training step (forward + backward + SGD update), numpy engine vs PyTorch CPU.

    python benchmarks/training.py [--runs 50] [--batch 64] [--json]
    python benchmarks/training.py --only-real [--real-size 48] [--real-batch 16]

Both sides run single-threaded (torch.set_num_threads(1); BLAS pools capped
at 1 thread with threadpoolctl), on the same weights and the same batch,
with SGD momentum 0.9 and softmax cross-entropy. Reported: median step time
of each and the ratio numpy / torch (lower is better; the targets are 1.5x
for the MLP and 3x for the CNN).

Models: the MLP 784-512-512-10 (``zoo.mlp``) and the small CNN
(``zoo.small_cnn``: 1x28x28, Conv3x3(32)-Relu-MaxPool, Conv3x3(64)-Relu-
MaxPool, Gemm(128)-Relu-Gemm(10)), and a real pretrained MobileNet-class
network: PP-OCR's MobileNetV3 text-direction classifier from the real-model
suite (weights in Constant nodes) with a fresh 10-class head. It is turned
into a torch function by a small ONNX-op mapping (``onnx_to_torch``), so
both sides run the same graph with the same weights; its step is timed for
the full fine-tune and bias + head (target: 2x), and for every transfer
mode the planned peak memory of a step and the bytes numpy really allocates
during one (tracemalloc) are compared with the full fine-tune's (target:
bias + head <= 0.25x). The modes other than full keep HardSwish inputs in 8 bits
(``compact_activations``, docs/training.md); ``bias-exact`` is bias + head without that.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from onnx import numpy_helper


def _median_ms(fn, runs: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def _numpy_step(model, x, y):
    from edgeflow.train import Trainer

    tr = Trainer(model, optimizer="sgd", lr=0.01, momentum=0.9, batch_size=len(x))
    return lambda: tr.step(x, y)


def _torch_module(model, kind: str):
    import torch
    from torch import nn

    w = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}
    if kind == "mlp":
        layers, i = [], 0
        while f"fc{i}.weight" in w:
            lin = nn.Linear(w[f"fc{i}.weight"].shape[1], w[f"fc{i}.weight"].shape[0])
            layers += [lin, nn.ReLU()]
            i += 1
        net = nn.Sequential(*layers[:-1])
        linears = [m for m in net if isinstance(m, nn.Linear)]
        for k, lin in enumerate(linears):
            lin.weight.data.copy_(w[f"fc{k}.weight"])
            lin.bias.data.copy_(w[f"fc{k}.bias"])
        return net
    convs, i = [], 0
    while f"conv{i}.weight" in w:
        cw = w[f"conv{i}.weight"]
        c = nn.Conv2d(cw.shape[1], cw.shape[0], 3, padding=1)
        c.weight.data.copy_(cw)
        c.bias.data.copy_(w[f"conv{i}.bias"])
        convs += [c, nn.ReLU(), nn.MaxPool2d(2)]
        i += 1
    fc0 = nn.Linear(w["fc0.weight"].shape[1], w["fc0.weight"].shape[0])
    fc1 = nn.Linear(w["fc1.weight"].shape[1], w["fc1.weight"].shape[0])
    for lin, name in ((fc0, "fc0"), (fc1, "fc1")):
        lin.weight.data.copy_(w[f"{name}.weight"])
        lin.bias.data.copy_(w[f"{name}.bias"])
    return nn.Sequential(*convs, nn.Flatten(), fc0, nn.ReLU(), fc1)


def _torch_step(model, kind, x, y):
    import torch

    net = _torch_module(model, kind)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(tx), ty)
        loss.backward()
        opt.step()

    return step


# ---------------------------------------------------------------- a real pretrained model

REAL_MODEL = "ocr-cls-ppocr-mobile-v2"  # PP-OCR's MobileNetV3 (HardSwish, SE blocks), weights in Constant nodes
MODES = ("full", "bias", "bias-exact", "head", "last:4", "sparse")  # bias-exact: compact_activations=False


def _real_model(size: int, name: str = REAL_MODEL):
    from edgeflow.sim.simulation import build_model

    return build_model(name, 0, size)


def onnx_to_torch(model, trainable: set[str], bn_training: bool):
    """The ONNX graph as a torch function by a small op mapping (the ops of the suite's MobileNets).

    Returns (forward(x) -> {value: tensor}, {name: parameter}); weights are copies of the
    initializers, those in ``trainable`` with requires_grad.
    """
    import torch
    import torch.nn.functional as F
    from onnx import helper

    params = {}
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t).copy()
        v = torch.from_numpy(a)
        if t.name in trainable:
            v = torch.nn.Parameter(v)
        params[t.name] = v

    def attrs(n):
        return {a.name: helper.get_attribute_value(a) for a in n.attribute}

    def pads4(p):
        return (p[1], p[3], p[0], p[2]) if p else (0, 0, 0, 0)

    def forward(x):
        env = dict(params)
        env[model.graph.input[0].name] = x
        for n in model.graph.node:
            a = attrs(n)
            i = [env[k] if k else None for k in n.input]
            op = n.op_type
            if op == "Conv":
                p = a.get("pads", [0, 0, 0, 0])
                xin = i[0]
                if p[0] != p[2] or p[1] != p[3]:
                    xin, pad = F.pad(xin, pads4(p)), 0
                else:
                    pad = (p[0], p[1])
                y = F.conv2d(xin, i[1], i[2] if len(i) > 2 else None, stride=a.get("strides", 1), padding=pad,
                             dilation=a.get("dilations", 1), groups=a.get("group", 1))
            elif op == "BatchNormalization":
                rm, rv = i[3].clone(), i[4].clone()
                y = F.batch_norm(i[0], rm, rv, i[1], i[2], training=bn_training,
                                 momentum=1 - a.get("momentum", 0.9), eps=a.get("epsilon", 1e-5))
            elif op == "Relu":
                y = F.relu(i[0])
            elif op == "Clip":
                lo = a.get("min", None) if len(i) < 2 or i[1] is None else float(i[1])
                hi = a.get("max", None) if len(i) < 3 or i[2] is None else float(i[2])
                y = torch.clamp(i[0], lo, hi)
            elif op == "HardSigmoid":
                y = torch.clamp(i[0] * a.get("alpha", 0.2) + a.get("beta", 0.5), 0, 1)
            elif op == "HardSwish":
                y = F.hardswish(i[0])
            elif op in ("Add", "Mul", "Div", "Sub"):
                y = {"Add": torch.add, "Mul": torch.mul, "Div": torch.div, "Sub": torch.sub}[op](i[0], i[1])
            elif op == "GlobalAveragePool":
                y = i[0].mean(dim=(2, 3), keepdim=True)
            elif op == "MaxPool":
                k = a["kernel_shape"]
                y = F.max_pool2d(F.pad(i[0], pads4(a.get("pads")), value=float("-inf")), k,
                                 stride=a.get("strides", k))
            elif op == "Reshape":
                shape = [int(v) for v in i[1]]
                shape = [i[0].shape[j] if v == 0 else v for j, v in enumerate(shape)]
                y = i[0].reshape(shape)
            elif op in ("Identity", "Dropout"):  # inference semantics, as the ONNX graph states
                y = i[0]
            elif op == "Flatten":
                y = i[0].flatten(a.get("axis", 1))
            elif op == "MatMul":
                y = i[0] @ i[1]
            elif op == "Gemm":
                w = i[1].T if a.get("transB") else i[1]
                y = i[0] @ w + (i[2] if len(i) > 2 else 0)
            elif op == "Softmax":
                y = torch.softmax(i[0], a.get("axis", -1))
            elif op == "Shape":
                y = torch.tensor(i[0].shape, dtype=torch.int64)
            elif op == "Slice":
                idx = [slice(None)] * i[0].dim()
                axes = [int(v) for v in i[3]] if len(i) > 3 and i[3] is not None else range(len(i[1]))
                steps = [int(v) for v in i[4]] if len(i) > 4 and i[4] is not None else [1] * len(i[1])
                for st, en, ax, sp in zip(i[1], i[2], axes, steps):
                    idx[ax] = slice(int(st), min(int(en), 2**62), sp)
                y = i[0][tuple(idx)]
            elif op == "Concat":
                y = torch.cat([torch.as_tensor(v) for v in i], a.get("axis", 0))
            elif op == "Cast":  # Paddle's shape arithmetic (Shape -> Cast -> Slice) for the head's Reshape
                from onnx import helper as onnx_helper

                y = torch.as_tensor(i[0]).to(getattr(torch, str(onnx_helper.tensor_dtype_to_np_dtype(a["to"]))))
            else:
                raise NotImplementedError(f"onnx_to_torch: no mapping for {op}")
            env[n.output[0]] = y
        return env

    return forward, {k: v for k, v in params.items() if k in trainable}


def _torch_real_step(model, names, logits, bn_training, x, y):
    import torch

    fwd, params = onnx_to_torch(model, set(names), bn_training)
    opt = torch.optim.SGD(list(params.values()), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(fwd(tx)[logits], ty)
        loss.backward()
        opt.step()

    return step, fwd, params


def _measured_step_peak(tr, x, y) -> int:
    """Bytes numpy allocated at the worst moment of one step, above what was live before it (tracemalloc)."""
    import gc
    import tracemalloc

    tr.step(x, y)  # optimizer state exists from here on
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        tr.step(x, y)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def real_model_rows(args, torch) -> tuple[list[dict], list[dict]]:
    """Step time vs PyTorch (full fine-tune and bias) and memory per mode vs the full fine-tune."""
    from edgeflow.train import Trainer

    model = _real_model(args.real_size, args.real_model)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.real_batch, 3, args.real_size, args.real_size)).astype(np.float32)
    y = rng.integers(0, 10, args.real_batch).astype(np.int64)
    label = f"{args.real_model} 3x{args.real_size}x{args.real_size}"
    speed, memory = [], []
    trainers = {}
    for mode in MODES:
        kw = {}
        if mode == "bias-exact":  # bias + head without activation compaction: the exact gradients
            kw["compact_activations"] = False
        elif mode == "sparse":
            # a budget between head-only and bias + head: the sparse update picks what fits
            kw["budget_bytes"] = (trainers["head"].plan_memory().peak_bytes
                                  + trainers["bias"].plan_memory().peak_bytes) // 2
        tr = Trainer(model, mode=mode.removesuffix("-exact"), optimizer="sgd", lr=0.01, momentum=0.9,
                     batch_size=len(x), **kw)
        trainers[mode] = tr
        plan = tr.plan_memory()
        measured = _measured_step_peak(tr, x, y)
        np_ms = _median_ms(lambda: tr.step(x, y), args.real_runs, warmup=1)
        memory.append({"mode": mode, "tensors": len(tr.trainable_names),
                       "values": int(sum(tr.params[n].size for n in tr.trainable_names)),
                       "planned_peak_bytes": plan.peak_bytes, "kept_bytes": plan.kept_bytes,
                       "measured_step_bytes": measured, "numpy_ms": round(np_ms, 1),
                       "compacted_values": len(tr.tape.compacted_values),
                       **({"budget_bytes": kw["budget_bytes"], "sparse_k": tr.sparse_k} if mode == "sparse" else {})})
        if mode in ("full", "bias") and torch is not None:
            step, _, _ = _torch_real_step(tr.model, tr.trainable_names, tr.output_name, tr.bn_training, x, y)
            t_ms = _median_ms(step, args.real_runs, warmup=1)
            speed.append({"model": f"{label} {mode} fine-tune", "batch": len(x), "numpy_ms": round(np_ms, 1),
                          "torch_ms": round(t_ms, 1), "ratio": round(np_ms / t_ms, 2), "target": 2.0})
    full = next(r for r in memory if r["mode"] == "full")
    for r in memory:
        r["planned_vs_full"] = round(r["planned_peak_bytes"] / full["planned_peak_bytes"], 3)
        r["measured_vs_full"] = round(r["measured_step_bytes"] / max(1, full["measured_step_bytes"]), 3)
    return speed, memory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--real-model", default=REAL_MODEL,
                    help=f"a MobileNet-class suite model (default {REAL_MODEL}; or orientation-pplcnet at 224)")
    ap.add_argument("--real-size", type=int, default=48, help="input size of the real model (default 48)")
    ap.add_argument("--real-batch", type=int, default=16)
    ap.add_argument("--real-runs", type=int, default=5)
    ap.add_argument("--no-real", action="store_true", help="skip the real pretrained model")
    ap.add_argument("--only-real", action="store_true", help="time only the real pretrained model")
    args = ap.parse_args(argv)

    from threadpoolctl import threadpool_limits

    from edgeflow import zoo

    try:
        import torch
    except ImportError:
        torch = None
        print("PyTorch is not installed (pip install torch): only the numpy engine is timed", file=sys.stderr)
    if torch is not None:
        torch.set_num_threads(1)

    rng = np.random.default_rng(0)
    cases = [
        ("mlp 784-512-512-10", "mlp", zoo.mlp((784, 512, 512, 10), seed=0), (784,), 1.5),
        ("small cnn 1x28x28 (32, 64)", "cnn", zoo.small_cnn(seed=0), (1, 28, 28), 3.0),
    ]
    rows = []
    with threadpool_limits(limits=1):
        from edgeflow.runtime.backends import numpy_backend

        numpy_backend._BLAS_THREADS = None  # make the runtime's sticky setting re-apply after us
        for label, kind, model, shape, target in ([] if args.only_real else cases):
            x = rng.standard_normal((args.batch, *shape)).astype(np.float32)
            y = rng.integers(0, 10, args.batch).astype(np.int64)
            np_ms = _median_ms(_numpy_step(model, x, y), args.runs)
            t_ms = _median_ms(_torch_step(model, kind, x, y), args.runs) if torch is not None else None
            rows.append({
                "model": label, "batch": args.batch, "numpy_ms": round(np_ms, 3),
                "torch_ms": None if t_ms is None else round(t_ms, 3),
                "ratio": None if t_ms is None else round(np_ms / t_ms, 2), "target": target,
            })
        memory = []
        if not args.no_real:
            speed, memory = real_model_rows(args, torch)
            rows += speed
    if args.json:
        json.dump({"threads": 1, "torch": None if torch is None else torch.__version__,
                   "numpy": np.__version__, "rows": rows, "memory": memory}, sys.stdout, indent=2)
        print()
        return 0
    print(f"one training step (fwd+bwd+SGD momentum), 1 thread, batch {args.batch}, median of {args.runs}")
    print(f"{'model':<30} {'numpy ms':>9} {'torch ms':>9} {'ratio':>6} {'target':>7}")
    for r in rows:
        t = "-" if r["torch_ms"] is None else f"{r['torch_ms']:.2f}"
        q = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"{r['model']:<30} {r['numpy_ms']:>9.2f} {t:>9} {q:>6} {r['target']:>6.1f}x")
    if memory:
        print(f"\n{args.real_model} 3x{args.real_size}x{args.real_size}, batch {args.real_batch}: memory per mode "
              "(planned peak of a step; measured: numpy bytes allocated during a step, tracemalloc)")
        print(f"{'mode':<10} {'tensors':>7} {'values':>9} {'planned MiB':>11} {'vs full':>7} "
              f"{'measured MiB':>12} {'vs full':>7} {'step ms':>8}")
        for r in memory:
            print(f"{r['mode']:<10} {r['tensors']:>7} {r['values']:>9,} {r['planned_peak_bytes'] / 2**20:>11.1f} "
                  f"{r['planned_vs_full']:>7.3f} {r['measured_step_bytes'] / 2**20:>12.1f} "
                  f"{r['measured_vs_full']:>7.3f} {r['numpy_ms']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
