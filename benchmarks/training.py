"""One training step (forward + backward + SGD update), numpy engine vs PyTorch CPU.

    python benchmarks/training.py [--runs 50] [--batch 64] [--json]

Both sides run single-threaded (torch.set_num_threads(1); BLAS pools capped
at 1 thread with threadpoolctl), on the same weights and the same batch,
with SGD momentum 0.9 and softmax cross-entropy. Reported: median step time
of each and the ratio numpy / torch (lower is better; the targets are 1.5x
for the MLP and 3x for the CNN).

Models: the MLP 784-512-512-10 (``zoo.mlp``) and the small CNN
(``zoo.small_cnn``: 1x28x28, Conv3x3(32)-Relu-MaxPool, Conv3x3(64)-Relu-
MaxPool, Gemm(128)-Relu-Gemm(10)).
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", action="store_true")
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
        from edgeflow.backends import numpy_backend

        numpy_backend._BLAS_THREADS = None  # make the runtime's sticky setting re-apply after us
        for label, kind, model, shape, target in cases:
            x = rng.standard_normal((args.batch, *shape)).astype(np.float32)
            y = rng.integers(0, 10, args.batch).astype(np.int64)
            np_ms = _median_ms(_numpy_step(model, x, y), args.runs)
            t_ms = _median_ms(_torch_step(model, kind, x, y), args.runs) if torch is not None else None
            rows.append({
                "model": label, "batch": args.batch, "numpy_ms": round(np_ms, 3),
                "torch_ms": None if t_ms is None else round(t_ms, 3),
                "ratio": None if t_ms is None else round(np_ms / t_ms, 2), "target": target,
            })
    if args.json:
        json.dump({"threads": 1, "torch": None if torch is None else torch.__version__,
                   "numpy": np.__version__, "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    print(f"one training step (fwd+bwd+SGD momentum), 1 thread, batch {args.batch}, median of {args.runs}")
    print(f"{'model':<30} {'numpy ms':>9} {'torch ms':>9} {'ratio':>6} {'target':>7}")
    for r in rows:
        t = "-" if r["torch_ms"] is None else f"{r['torch_ms']:.2f}"
        q = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"{r['model']:<30} {r['numpy_ms']:>9.2f} {t:>9} {q:>6} {r['target']:>6.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
