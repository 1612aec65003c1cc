"""``edgeflow run MODEL --input x.npy``: one inference."""

from __future__ import annotations

ORDER = 30


def add_runtime_args(p) -> None:
    p.add_argument("--profile", help="device profile name or .toml path (default: detected from this host)")
    p.add_argument("--backend", choices=["ort", "numpy"], help="force a backend instead of the profile's order")
    from ._common import count_arg

    p.add_argument("--threads", type=count_arg, help="override the profile's thread count (1 or more)")
    p.add_argument("--allow-over-budget", action="store_true",
                   help="run even if the planned peak memory exceeds the profile's budget")
    from ._common import add_shape_arg

    add_shape_arg(p)


def register(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run a model once on an input file",
        description="Run MODEL on the array(s) in --input (.npy for a single-input model, .npz with "
        "one array per input name) using the profile's backend, and print or save the outputs. "
        "The arrays fix the inputs' dynamic dims; --shape may state them too. Arrays are cast to the "
        "model's dtypes: a lossy cast (float64 to float32) is said once on stderr, integers that would "
        "wrap are refused, and NaN/Inf values are refused unless --allow-nonfinite.",
    )
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--input", "-i", required=True, help=".npy (single input) or .npz (named inputs)")
    p.add_argument("--output", "-o", help="save all outputs to this .npz file")
    add_runtime_args(p)
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="feed NaN/Inf values as they are (refused by default: a NaN in the data usually "
                   "means a broken preprocessing step, and the model's output would be garbage)")
    p.add_argument("--json", action="store_true", help="print outputs as JSON")
    p.set_defaults(func=cmd)


def cmd(args) -> int:
    import numpy as np

    from ..runtime.session import load
    from ._common import check_output_path, console, emit_json, load_arrays, model_and_shapes

    if args.output:
        check_output_path(args.output)
    feeds = load_arrays(args.input)
    model, shapes = model_and_shapes(args.model, args.shape, feeds, infer_shapes=False)  # onnxruntime gets the model as given
    if not args.allow_nonfinite:
        from ..runtime.backends.base import check_finite

        check_finite(feeds if isinstance(feeds, dict) else {args.input: feeds},
                     fix="or pass --allow-nonfinite if the model expects them")
    batch = (feeds if isinstance(feeds, np.ndarray) else next(iter(feeds.values()), np.zeros(1))).shape[:1] or (1,)
    rt = load(model, args.profile, backend=args.backend, threads=args.threads, input_shapes=shapes,
              shapes_source="--shape" if args.shape else "the --input array",
              batch_size=int(batch[0]), allow_over_budget=args.allow_over_budget)
    outs = rt.run(feeds)
    if args.output:
        np.savez(args.output, **outs)
    if args.json:
        emit_json({"backend": rt.backend_name, "profile": rt.profile.name,
                   "outputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype), "data": v} for k, v in outs.items()}})
        return 0
    c = console()
    c.print(f"profile {rt.profile.name}, backend {rt.backend_name}")
    for k, v in outs.items():
        line = f"  {k}: {v.dtype} {list(v.shape)}"
        if v.ndim == 2 and np.issubdtype(v.dtype, np.floating):
            line += f"  argmax {np.argmax(v, axis=1)[:16].tolist()}"
        c.print(line)
    if args.output:
        c.print(f"saved {args.output}")
    return 0
