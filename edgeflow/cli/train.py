"""``edgeflow train MODEL --data data.npz --epochs N --profile NAME -o trained.onnx``."""

from __future__ import annotations

import numpy as np

ORDER = 47


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train or fine-tune a model on local data (numpy, no PyTorch)",
        description="Train MODEL's weights on the arrays in --data (.npz with x and y, or name them "
        "with --x-key/--y-key; for a model with several inputs, one array per input name plus y) on the "
        "numpy kernels, checking the step's planned memory against the profile's training budget, and "
        "write the trained model to -o (the optimizer state beside it, for --resume). Input dims the "
        "model leaves open besides the batch are taken from --data. Freeze layers with --freeze PREFIX "
        "to fine-tune only the head.",
    )
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--data", "-d", required=True, help=".npz file with inputs and labels (x, y)")
    p.add_argument("--x-key", help="name of the inputs array in --data (default: auto)")
    p.add_argument("--y-key", help="name of the labels array in --data (default: auto)")
    p.add_argument("--input", metavar="NAME",
                   help="the model input that --data's x feeds (a model with several inputs: the other "
                   "inputs take the arrays of --data named after them)")
    p.add_argument("--output", "-o", required=True, help="where to write the trained .onnx model")
    p.add_argument("--target", metavar="OUTPUT",
                   help="the model output the labels train (required when the model has several outputs; the "
                   "new head of --new-head replaces the layer that produces it)")
    p.add_argument("--epochs", "-e", type=int, default=1)
    p.add_argument("--batch-size", "-b", type=int, default=32)
    p.add_argument("--profile", help="device profile name or .toml path (default: detected from this host)")
    p.add_argument("--loss", default="cross_entropy", help="cross_entropy (default), mse, bce, bce_probs")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    p.add_argument("--lr", type=float, help="learning rate (default: 0.01 for SGD, 0.001 for Adam)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--weight-decay", type=float, help="weight decay")
    p.add_argument("--freeze", action="append", default=[], metavar="PREFIX",
                   help="do not train weights whose names start with PREFIX (repeatable)")
    p.add_argument("--trainable", action="append", metavar="PREFIX",
                   help="train only weights whose names start with PREFIX (repeatable)")
    p.add_argument("--mode", help="transfer learning: full (default), head, bias (biases + head, TinyTL), "
                   "last:N (the last N layers), sparse (what fits --budget-mib or the profile's training budget)")
    p.add_argument("--budget-mib", type=float, help="training memory budget for --mode sparse (default: the profile's)")
    p.add_argument("--exact-activations", action="store_true",
                   help="keep every activation a backward reads exact (by default --mode head/bias/last:N/sparse "
                   "keep HardSwish/HardSigmoid inputs in 8 bits: less memory, gradients within a stated bound)")
    p.add_argument("--new-head", type=int, metavar="CLASSES",
                   help="replace the last Gemm/MatMul/1x1-Conv layer by a fresh one with CLASSES outputs")
    p.add_argument("--resume", action="store_true",
                   help="continue from the optimizer state and step saved beside -o by an earlier run")
    p.add_argument("--clip-norm", type=float, help="clip gradients to this global L2 norm")
    p.add_argument("--qat", action="store_true", help="quantization-aware training (int8 fake-quant)")
    p.add_argument("--grad-accumulation", action="store_true",
                   help="if a batch does not fit the memory budget, accumulate smaller micro-batches")
    p.add_argument("--val", help=".npz file of validation data (evaluated after each epoch)")
    p.add_argument("--val-fraction", type=float, help="hold out this fraction of --data for validation")
    p.add_argument("--seed", type=int, default=0)
    from ._common import add_shape_arg

    add_shape_arg(p)
    p.add_argument("--json", action="store_true", help="print the training history as JSON")
    p.set_defaults(func=cmd)


def _read(path: str, inputs, args):
    """(x, y) of a .npz: x an array (one input, or --input with nothing else) or a dict by input name."""
    from ..data import load_npz
    from ..train.feeds import read_split

    if len(inputs) == 1 and args.input in (None, inputs[0].name):
        d = load_npz(path, x_key=args.x_key, y_key=args.y_key)
        return d.x, d.y
    return read_split(path, inputs, input_name=args.input, x_key=args.x_key, y_key=args.y_key)


def _by_input(x, inputs, name: str | None) -> dict:
    if isinstance(x, dict):
        return x
    return {name or inputs[0].name: x}


def _fill_from_data(model, x, inputs, input_name: str | None):
    """Fix the dims the model (and --shape) leave open besides the batch from the training data, as
    ``run --input`` does; the batch stays open so that a last, smaller batch trains too."""
    from ..data import check_inputs
    from ..runtime.model import fix_input_shapes

    fill = {}
    feeds = _by_input(x, inputs, input_name)
    for t in inputs:
        arr = feeds.get(t.name)
        open_ = [i for i, d in enumerate(t.shape) if i > 0 and not (isinstance(d, int) and d >= 0)]
        if arr is None or not open_:
            continue
        check_inputs(np.asarray(arr), (None, *t.shape[1:]), t.name)  # the rank and the fixed dims
        fill[t.name] = [None] + [int(np.shape(arr)[i]) if i in open_ else None for i in range(1, len(t.shape))]
    return fix_input_shapes(model, fill, source="the --data array") if fill else model


def _check_shapes(model, x, batch_size: int, input_name: str | None) -> None:
    """Dims still open besides the batch, or a fixed batch the batches would not match: one line each."""
    from ..data import check_inputs
    from ..errors import InputError, ShapeError
    from ..runtime.model import graph_inputs

    inputs = graph_inputs(model)
    feeds = _by_input(x, inputs, input_name)
    missing = [t.name for t in inputs if t.name not in feeds]
    if missing:
        example = ", ".join(f"{t.name}=..." for t in inputs)
        raise InputError(f"--data has no array for the model's input(s) {missing}: save one array per input "
                         f"name plus the labels (np.savez(path, {example}, y=...))")
    for t in inputs:
        hint = "x".join(["?"] + [str(d) if isinstance(d, int) and d >= 0 else f"<{d or f'dim{i}'}>"
                                 for i, d in enumerate(t.shape[1:], 1)])
        dyn = [i for i, d in enumerate(t.shape) if i > 0 and not (isinstance(d, int) and d >= 0)]
        if dyn:
            names = ", ".join(f"{i} ({t.shape[i]!r})" if t.shape[i] else str(i) for i in dyn)
            raise ShapeError(f"input {t.name!r} has dynamic dim(s) {names}; give its shape with --shape "
                             f"{t.name}={hint} (? leaves the batch open)")
        arr = feeds.get(t.name)
        if arr is None:
            continue
        check_inputs(np.asarray(arr), (None, *t.shape[1:]), t.name)  # before the first step: dims --shape fixed
        b = t.shape[0] if t.shape else None
        if isinstance(b, int) and b > 0 and batch_size < b:
            raise ShapeError(f"input {t.name!r} has a fixed batch of {b} in the model: --batch-size must be at "
                             f"least {b} (steps run in micro-batches of {b}), got {batch_size}; or leave the batch "
                             f"open with --shape {t.name}={hint}")


def cmd(args) -> int:
    from ..data import DataLoader, from_arrays
    from ..train.checkpoint import load_state, save_state, state_path
    from ._common import check_output_path, console, emit_json

    check_output_path(args.output)
    model, x, y, val = _model_and_data(args)
    n = len(y)
    trainer = _trainer(args, model)
    state_file = state_path(args.output)
    resumed = None
    if args.resume:
        resumed = int(load_state(trainer, state_file)["global_step"])
    if isinstance(x, dict):
        data = (x, y)  # several inputs: the trainer batches every array by sample
        steps = -(-n // args.batch_size)
    else:
        data = DataLoader(from_arrays(x, y), args.batch_size, shuffle=True, seed=args.seed)
        steps = len(data)
    out = console()
    plan = trainer.memory.plan if trainer.memory else trainer.plan_memory()
    if not args.json:
        _describe(out, args, trainer, plan, n, resumed, state_file)
    history = _fit(out, args, trainer, data, steps, val)
    trainer.export(args.output)
    npz, meta = save_state(trainer, state_file)
    if args.json:
        emit_json({"model": args.model, "output": args.output, "profile": trainer.profile.name if trainer.profile else None,
                   "trainable": trainer.trainable_names, "micro_batch": trainer.micro_batch,
                   "fixed_batch": trainer.fixed_batch, "skipped_samples": trainer.skipped_samples,
                   "mode": str(trainer.mode), "step": trainer.global_step, "resumed_from": resumed,
                   "state": [str(npz), str(meta)], "memory_plan": plan.to_dict(), **history.to_dict()})
        return 0
    if trainer.skipped_samples:
        out.print(f"  {trainer.skipped_samples} sample(s) left out over the run: batches that were not a multiple of "
                  f"the model's fixed batch of {trainer.fixed_batch} (choose --batch-size and the data size as "
                  "multiples of it to use every sample)", soft_wrap=True)
    out.print(f"saved {args.output}")
    out.print(f"train state (step {trainer.global_step}) saved to {npz} and {meta.name}; continue with --resume")
    return 0


def _model_and_data(args):
    """The model (shapes given, open dimensions taken from the data) and the training and validation data,
    every mismatch one InputError before training starts."""
    from ..data import Dataset
    from ..errors import InputError
    from ..runtime.model import graph_inputs
    from ._common import model_with_shapes

    if args.epochs < 1 or args.batch_size < 1:
        raise InputError("--epochs and --batch-size must be >= 1")
    model = model_with_shapes(args.model, args.shape)
    inputs = graph_inputs(model)
    if args.input is not None and args.input not in {t.name for t in inputs}:
        raise InputError(f"--input {args.input!r} is not an input of the model; its inputs: {[t.name for t in inputs]}")
    x, y = _read(args.data, inputs, args)
    val = _read(args.val, inputs, args) if args.val else None
    if args.val_fraction:
        if val is not None:
            raise InputError("give --val or --val-fraction, not both")
        keep, held = (d.x for d in Dataset(np.arange(len(y)), np.asarray(y)).split(args.val_fraction, seed=args.seed))
        take = (lambda a, i: {k: v[i] for k, v in a.items()}) if isinstance(x, dict) else (lambda a, i: a[i])
        x, y, val = take(x, keep), y[keep], (take(x, held), y[held])
    model = _fill_from_data(model, x, inputs, args.input)
    _check_shapes(model, x, args.batch_size, args.input)
    return model, x, y, val


def _trainer(args, model):
    """The Trainer the options describe (a new head first with ``--new-head``), on the profile given or detected."""
    from ..profiles import detect
    from ..train import Trainer

    profile = args.profile if args.profile is not None else detect()
    if args.new_head:
        from ..train.transfer import new_head

        model = new_head(model, args.new_head, seed=args.seed, output=args.target)
    budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    return Trainer(
        model, loss=args.loss, optimizer=args.optimizer, lr=args.lr,
        momentum=args.momentum if args.optimizer == "sgd" else 0.0, weight_decay=args.weight_decay,
        trainable=args.trainable, freeze=args.freeze, batch_size=args.batch_size, seed=args.seed,
        clip_norm=args.clip_norm, qat=args.qat, profile=profile, grad_accumulation=args.grad_accumulation,
        mode=args.mode, budget_bytes=budget, input=args.input, output=args.target,
        compact_activations=False if args.exact_activations else None,
    )


def _describe(out, args, trainer, plan, n: int, resumed: int | None, state_file) -> None:
    """What will train, on what, resumed from where, and the planned memory of one step."""
    from ._common import human_bytes

    out.print(f"{args.model}: {len(trainer.trainable_names)} trainable weight(s), {n} samples, "
              f"profile {trainer.profile.name if trainer.profile else '-'}")
    if resumed is not None:
        out.print(f"  resumed from step {resumed} ({state_file}.npz)")
    if args.mode:
        out.print(f"  mode {trainer.mode}: {trainer.describe_trainable()}", soft_wrap=True)
    micro = f", micro-batches of {trainer.micro_batch}" if trainer.micro_batch < args.batch_size else ""
    compact = len(trainer.tape.compacted_values)
    compact = (f", {compact} activation(s) kept in 8/16 bits (--exact-activations: exact)" if compact else "")
    out.print(f"  planned step memory {human_bytes(plan.peak_bytes)} at batch {args.batch_size}{micro}{compact}")
    if trainer.fixed_batch:
        out.print(f"  the model fixes a batch of {trainer.fixed_batch}: each step of {args.batch_size} samples runs "
                  f"as micro-batches of {trainer.fixed_batch} with gradient accumulation (the exported graph is "
                  "unchanged)", soft_wrap=True)


def _fit(out, args, trainer, data, steps: int, val):
    """Train for ``--epochs`` with a progress bar per epoch and one line per finished epoch."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from ._common import spinner

    with spinner(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 TextColumn("loss {task.fields[loss]}"), disable=args.json) as prog:
        state = {"task": None, "epoch": 0}

        def on_batch(r):
            if state["task"] is None:
                state["epoch"] += 1
                state["task"] = prog.add_task(f"epoch {state['epoch']}/{args.epochs}", total=steps, loss="-")
            prog.update(state["task"], advance=1, loss=f"{r.loss:.4f}")

        def on_epoch(e):
            if state["task"] is not None:
                prog.remove_task(state["task"])
                state["task"] = None
            if not args.json:
                acc = "" if e.accuracy is None else f"  accuracy {100 * e.accuracy:.2f}%"
                vl = "" if e.val_loss is None else f"  val_loss {e.val_loss:.4f}"
                va = "" if e.val_accuracy is None else f"  val_accuracy {100 * e.val_accuracy:.2f}%"
                out.print(f"epoch {e.epoch}/{args.epochs}  loss {e.loss:.4f}{acc}{vl}{va}  ({e.seconds:.1f} s)",
                          soft_wrap=True)

        return trainer.fit(data, args.epochs, validation=val, on_batch=on_batch, on_epoch=on_epoch)
