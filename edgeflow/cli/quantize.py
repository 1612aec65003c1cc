"""``edgeflow quantize MODEL --profile NAME --calibration data.npz -o out.onnx``."""

from __future__ import annotations

ORDER = 45


def register(sub) -> None:
    p = sub.add_parser(
        "quantize",
        help="quantize a model for a board (int8 static/dynamic or fp16) and report the cost",
        description="Quantize MODEL the way --profile's board runs fastest (its [quantization] "
        "section), calibrating on --calibration (.npz with one array per input, or .npy for a "
        "single-input model, or for a single-input model the x/y .npz that `edgeflow train` reads). An "
        "array named by --labels-key in that file (default 'labels', or y of an x/y file) is taken as class "
        "labels: the report then gives accuracy and per-layer sensitivity.",
    )
    p.add_argument("model", help="fp32 .onnx file")
    p.add_argument("--profile", required=True, help="device profile name or .toml path")
    p.add_argument("--calibration", "-c",
                   help=".npz/.npy calibration samples (a few hundred), or a folder of images / 16 kHz .wav files")
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
    p.add_argument("--bias-correction", choices=["auto", "on", "off"], default="auto",
                   help="take each int8 conv's mean output error on the calibration data out of its bias, conv by "
                   "conv (onnxruntime, QDQ): auto = only as one more variant the bench gate measures (--max-loss); "
                   "on = always; off = never (default: auto)")
    p.add_argument("--backend", choices=["ort", "numpy"], help="backend for the report (default: the profile's)")
    gg = p.add_argument_group(
        "bench-gated choice (int8 only where it pays; on by default for static int8 on every profile)",
        "The layers that cost the most accuracy stay fp32 until the loss on the evaluation samples is within "
        "--max-loss (default 1); no int8 model within it: the result is --fallback, and the report says why. Where "
        "the profile's board is this host (same architecture and CPU features, its first backend), int8 is also "
        "timed against fp32 (batch 1): kinds of layers (depthwise/1x1/kxk Conv, MatMul, Gemm) that make the model "
        "slower in int8 stay fp32, and where no int8 model is 1.1x faster than fp32 the result is --fallback. "
        "Another board's model is chosen on accuracy alone and not timed (this host's timings are not the board's; "
        "a numpy board gets --fallback: numpy has no integer GEMM) unless --time-on-host. The report also says "
        "whether the evaluation samples are enough to show a loss within --max-loss (95%% confidence).")
    gg.add_argument("--max-loss", type=_percent, metavar="PCT",
                    help="largest loss allowed, in percent (default 1): top-1 accuracy points with labels, else 100 - "
                    "top-1 agreement with fp32 (classifiers) or 100 x (1 - cosine) of the output; 1 = 99%% agreement "
                    "or cosine 0.99")
    gg.add_argument("--time-on-host", action="store_true",
                    help="time the candidates and the latency on this host even when the profile's board is another "
                    "machine (the figures are then this host's, and the report says so)")
    gg.add_argument("--no-gate", action="store_true",
                    help="write static int8 without checking its loss or speed against fp32 (the report says so)")
    gg.add_argument("--loss", choices=["auto", "cosine", "top1", "sequence", "ctc", "boxes", "yolox"], default="auto",
                    help="how --max-loss is measured: auto (as above), cosine, top1, sequence (100 - %% of samples "
                    "whose per-step argmax over the last axis equals fp32's), ctc (100 - %% of samples whose greedy "
                    "CTC decoding, blank 0, gives fp32's text: for text recognizers), boxes (detectors whose output is "
                    "(N, anchors, cx cy w h objectness classes...) in pixels: 100 - %% of boxes matched to fp32's at "
                    "IoU >= 0.5) or yolox (the same on YOLOX's raw head, grid-decoded first)")
    gg.add_argument("--fallback", choices=["weight-only", "fp32"], default="weight-only",
                    help="what to write when int8 does not pay: weight-only int8 (4x smaller weights, fp32 "
                    "arithmetic and speed) or the fp32 model (default: weight-only)")
    g = p.add_argument_group("preprocessing of image/audio folders (default: from the model's input shape)")
    g.add_argument("--preprocess", metavar="TOML", help="a recipe file with an [image] or [audio] table "
                   "(see docs/quantization.md)")
    g.add_argument("--resize", metavar="N|H,W", help="resize the shorter side to N, or to exactly H,W")
    g.add_argument("--crop", metavar="N|H,W", help="center crop after resizing")
    g.add_argument("--scale", type=float, help="multiply pixel values (0..255) by this first (default 1/255)")
    g.add_argument("--mean", metavar="M[,M,M]", help="subtract per channel after scaling")
    g.add_argument("--std", metavar="S[,S,S]", help="divide per channel after subtracting the mean")
    g.add_argument("--channels", choices=["RGB", "BGR", "L"], help="channel order (L = grey)")
    g.add_argument("--layout", choices=["NCHW", "NHWC"], help="tensor layout")
    g.add_argument("--sample-rate", type=int, help="audio: resample .wav files to this rate (default 16000)")
    g.add_argument("--window", type=int, help="audio: samples per input (default: the input's last dimension)")
    g.add_argument("--hop", type=int, help="audio: step between windows (default: --window)")
    p.add_argument("--report", help="also write the report as JSON to this file")
    from ._common import add_shape_arg

    add_shape_arg(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd)


def _percent(text: str) -> float:
    import argparse
    import math

    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and 0 <= v <= 100):
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage: give a number from 0 to 100, e.g. --max-loss 1")
    return v


_IMAGE_FLAGS = ("resize", "crop", "scale", "mean", "std", "channels", "layout")
_AUDIO_FLAGS = ("sample_rate", "window", "hop")


def _prep(args):
    """The preprocessing recipe from --preprocess and/or the flags (flags win)."""
    from dataclasses import fields, replace

    from ..errors import InputError
    from ..data.preprocess import AudioPrep, ImagePrep, load_prep, prep_from_dict

    base = load_prep(args.preprocess) if args.preprocess else None
    img = {k: getattr(args, k) for k in _IMAGE_FLAGS if getattr(args, k) is not None}
    aud = {k: getattr(args, k) for k in _AUDIO_FLAGS if getattr(args, k) is not None}
    if img and aud:
        raise InputError("image flags (--resize/--crop/--mean/...) and audio flags (--sample-rate/--window/--hop) "
                         "cannot be mixed")
    if not img and not aud:
        return base
    cls = ImagePrep if img else AudioPrep
    if base is not None and not isinstance(base, cls):
        raise InputError(f"{args.preprocess} is a recipe for {'audio' if img else 'images'}, but "
                         f"{'image' if img else 'audio'} flags were given")
    flags = prep_from_dict(cls, img or aud, source="flags")
    if base is None:
        return flags
    given = {f.name: getattr(flags, f.name) for f in fields(cls) if f.name in (img or aud)}
    return replace(base, **given)


def _split_labels(path: str | None, key: str):
    """Arrays of a data file, with the labels array (if any) taken out (a folder passes through)."""
    if path is None:
        return None, None
    import os

    if os.path.isdir(path):
        return path, None
    import numpy as np

    from ..quantization.data import load_arrays

    data = load_arrays(path)
    if isinstance(data, np.ndarray):
        return data, None
    labels = data.pop(key, None)
    y = data.get("y")
    if labels is None and set(data) == {"x", "y"} and y.ndim == 1 and y.dtype.kind in "iu":
        labels = data.pop("y")  # the x/y files `edgeflow train` reads: y holds the class labels
    return data, labels


def cmd(args) -> int:
    import json

    from rich.progress import SpinnerColumn, TextColumn

    from ..quantization import quantize
    from ._common import check_output_path, console, emit_json, model_with_shapes, spinner

    if args.no_gate and args.max_loss is not None:
        from ..errors import InputError

        raise InputError("--no-gate and --max-loss contradict each other: --max-loss sets the gate's limit, "
                         "--no-gate turns the gate off; give one")
    check_output_path(args.output)
    if args.report:
        check_output_path(args.report, "--report")
    prep = _prep(args)
    model = model_with_shapes(args.model, args.shape) if args.shape else args.model
    cal, cal_labels = _split_labels(args.calibration, args.labels_key)
    ev, ev_labels = _split_labels(args.eval, args.labels_key)
    labels = ev_labels if args.eval else cal_labels
    with spinner(SpinnerColumn(), TextColumn("{task.description}"), disable=args.json) as prog:
        prog.add_task(f"quantizing {args.model} for {args.profile}", total=None)
        result = quantize(
            model, args.profile, calibration=cal, method=args.method, engine=args.engine,
            keep_fp32=args.keep_fp32, keep_first=args.keep_first, keep_last=args.keep_last,
            eval_data=ev, labels=labels, percentile=args.percentile,
            sensitivity=False if args.no_sensitivity else None, backend=args.backend,
            output=args.output, preprocess=prep, fallback=args.fallback, loss=args.loss,
            max_loss=None if args.no_gate else ("auto" if args.max_loss is None else args.max_loss),
            time_on_host=args.time_on_host or None,
            bias_correction={"auto": None, "on": True, "off": False}[args.bias_correction],
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
