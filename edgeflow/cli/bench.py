"""``edgeflow bench MODEL``: latency p50/p95, throughput, peak memory."""

from __future__ import annotations

ORDER = 40


def register(sub) -> None:
    from .run import add_runtime_args

    p = sub.add_parser(
        "bench",
        help="measure a model's latency and memory on this machine",
        description="Run MODEL repeatedly on random inputs of the declared shapes (dynamic batch "
        "dims = --batch, other dynamic dims from --shape) and report latency p50/p95, throughput and "
        "the process's peak RSS.",
    )
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--batch", type=int, help="batch size for a dynamic first dim (default 1)")
    p.add_argument("--runs", type=int, default=50, help="timed runs (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up runs (default 5)")
    add_runtime_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd)


def random_feeds(inputs, batch: int, seed: int = 0):
    import numpy as np

    from ..runtime.memory import concrete_shapes

    rng = np.random.default_rng(seed)
    feeds = {}
    for name, shape in concrete_shapes(inputs, batch).items():
        dtype = np.dtype(next(t.dtype for t in inputs if t.name == name) or "float32")
        if np.issubdtype(dtype, np.floating):
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[name] = rng.integers(0, 10, shape).astype(dtype)
    return feeds


def cmd(args) -> int:
    from ..runtime.session import load
    from ..timing import measure, peak_rss_bytes
    from ..errors import InputError, ShapeError
    from ..runtime.model import graph_inputs, with_input_dims
    from ._common import console, emit_json, human_bytes, model_and_shapes, require_static_shapes, spinner

    if (args.batch is not None and args.batch < 1) or args.runs < 1:
        raise InputError("--batch and --runs must be >= 1")
    model, shapes = model_and_shapes(args.model, args.shape, infer_shapes=False)  # onnxruntime gets the model as given
    inputs = with_input_dims(graph_inputs(model), shapes)
    if args.batch is not None:
        for t in inputs:
            if t.shape and isinstance(t.shape[0], int) and t.shape[0] != args.batch:
                raise ShapeError(f"input {t.name!r} dim 0 is {t.shape[0]} in the model"
                                 f"{' (with --shape)' if args.shape else ''}, --batch gives {args.batch}")
    require_static_shapes(inputs, args.batch)
    batch = args.batch or 1
    rt = load(model, args.profile, backend=args.backend, threads=args.threads, input_shapes=shapes,
              shapes_source="--shape",
              batch_size=batch, allow_over_budget=args.allow_over_budget)
    feeds = random_feeds(rt.inputs, batch)
    first = next(iter(feeds.values()), None)
    batch = int(first.shape[0]) if first is not None and first.ndim else 1
    with spinner(disable=args.json) as prog:
        task = prog.add_task(f"bench {rt.backend_name} batch {batch}", total=args.runs)
        stats = measure(lambda: rt.run(feeds), runs=args.runs, warmup=args.warmup,
                        batch_size=batch, on_step=lambda: prog.advance(task))
    result = {"model": args.model, "profile": rt.profile.name, "backend": rt.backend_name,
              "input_shapes": {k: list(v.shape) for k, v in feeds.items()},
              **stats.to_dict(), "peak_rss_bytes": peak_rss_bytes(),
              "planned_peak_bytes": rt.plan.peak_bytes if rt.plan else None}
    if args.json:
        emit_json(result)
        return 0
    c = console()
    c.print(f"{args.model}: profile {rt.profile.name}, backend {rt.backend_name}, batch {batch}, {args.runs} runs")
    c.print(f"  latency p50 {stats.p50_ms:.3f} ms  p95 {stats.p95_ms:.3f} ms  mean {stats.mean_ms:.3f} ms")
    c.print(f"  throughput {stats.throughput:,.0f} samples/s")
    c.print(f"  peak RSS {human_bytes(result['peak_rss_bytes'])}"
            + (f", planned peak {human_bytes(rt.plan.peak_bytes)}" if rt.plan else ""))
    return 0
