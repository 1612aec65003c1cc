"""``edgeflow quantize MODEL --profile NAME --calibration data.npz -o out.onnx``."""

from __future__ import annotations

ORDER = 45


def register(sub) -> None:
    p = sub.add_parser(
        "quantize",
        help="quantize a model for a board (int8 static/dynamic or fp16) and report the cost",
        description="Quantize MODEL the way --profile's board runs fastest (its [quantization] "
        "section), calibrating on --calibration (.npz with one array per input, or .npy for a "
        "single-input model). An array named by --labels-key in that file (default 'labels') is "
        "taken as class labels: the report then gives accuracy and per-layer sensitivity.",
    )
    p.add_argument("model", help="fp32 .onnx file")
    p.add_argument("--profile", required=True, help="device profile name or .toml path")
    p.add_argument("--calibration", "-c", help=".npz/.npy calibration samples (a few hundred)")
    p.add_argument("--output", "-o", required=True, help="where to write the quantized .onnx")
    p.add_argument("--method", choices=["static", "minmax", "percentile", "entropy", "dynamic", "fp16"],
                   help="override the profile's scheme (static = the profile's calibration method)")
    p.add_argument("--engine", choices=["auto", "ort", "numpy"], default="auto",
                   help="onnxruntime.quantization or edgeflow's own numpy path (default: ort if installed)")
    p.add_argument("--eval", help=".npz/.npy held-out samples for the report (default: hold out 20%% of --calibration)")
    p.add_argument("--labels-key", default="labels", help="array in the .npz files holding class labels")
    p.add_argument("--keep-fp32", action="append", default=[], metavar="NODE", help="keep this node in fp32 (repeatable)")
    p.add_argument("--keep-first", action="store_true", help="keep the first quantizable layer in fp32")
    p.add_argument("--keep-last", action="store_true", help="keep the last quantizable layer in fp32")
    p.add_argument("--percentile", type=float, default=99.999, help="percentile calibration's cut (default 99.999)")
    p.add_argument("--no-sensitivity", action="store_true", help="skip per-layer sensitivity (one model per layer)")
    p.add_argument("--backend", choices=["ort", "numpy"], help="backend for the report (default: the profile's)")
    p.add_argument("--report", help="also write the report as JSON to this file")
    from ._common import add_shape_arg

    add_shape_arg(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd)


def _split_labels(path: str | None, key: str):
    """Arrays of a data file, with the labels array (if any) taken out."""
    if path is None:
        return None, None
    import numpy as np

    from ..quantization.data import load_arrays

    data = load_arrays(path)
    if isinstance(data, np.ndarray):
        return data, None
    labels = data.pop(key, None)
    return data, labels


def cmd(args) -> int:
    import json

    from rich.progress import Progress, SpinnerColumn, TextColumn

    from ..quantization import quantize
    from ._common import console, emit_json, model_with_shapes

    model = model_with_shapes(args.model, args.shape) if args.shape else args.model
    cal, cal_labels = _split_labels(args.calibration, args.labels_key)
    ev, ev_labels = _split_labels(args.eval, args.labels_key)
    labels = ev_labels if args.eval else cal_labels
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), transient=True,
                  console=console(stderr=True), disable=args.json) as prog:
        prog.add_task(f"quantizing {args.model} for {args.profile}", total=None)
        result = quantize(
            model, args.profile, calibration=cal, method=args.method, engine=args.engine,
            keep_fp32=args.keep_fp32, keep_first=args.keep_first, keep_last=args.keep_last,
            eval_data=ev, labels=labels, percentile=args.percentile,
            sensitivity=False if args.no_sensitivity else None, backend=args.backend,
            output=args.output,
        )
    rep = result.report.to_dict()
    rep["output"] = args.output
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=2, default=float)
    if args.json:
        emit_json(rep)
        return 0
    c = console()
    c.print(result.report.format(), markup=False, soft_wrap=True)
    c.print(f"wrote {args.output}")
    return 0
