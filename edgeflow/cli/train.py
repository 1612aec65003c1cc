"""``edgeflow train MODEL --data data.npz --epochs N --profile NAME -o trained.onnx``."""

from __future__ import annotations

ORDER = 47


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train or fine-tune a model on local data (numpy, no PyTorch)",
        description="Train MODEL's weights on the arrays in --data (.npz with x and y, or name them "
        "with --x-key/--y-key) on the numpy kernels, checking the step's planned memory against the "
        "profile's training budget, and write the trained model to -o. Freeze layers with --freeze "
        "PREFIX to fine-tune only the head.",
    )
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--data", "-d", required=True, help=".npz file with inputs and labels (x, y)")
    p.add_argument("--x-key", help="name of the inputs array in --data (default: auto)")
    p.add_argument("--y-key", help="name of the labels array in --data (default: auto)")
    p.add_argument("--output", "-o", required=True, help="where to write the trained .onnx model")
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


def cmd(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from ..data import DataLoader, load_npz
    from ..errors import InputError
    from ..profiles import detect
    from ..train import Trainer
    from ._common import (check_output_path, console, emit_json, human_bytes, model_with_shapes,
                          require_static_shapes, spinner)

    check_output_path(args.output)
    if args.epochs < 1 or args.batch_size < 1:
        raise InputError("--epochs and --batch-size must be >= 1")
    data = load_npz(args.data, x_key=args.x_key, y_key=args.y_key)
    val = load_npz(args.val, x_key=args.x_key, y_key=args.y_key) if args.val else None
    if args.val_fraction:
        if val is not None:
            raise InputError("give --val or --val-fraction, not both")
        data, val = data.split(args.val_fraction, seed=args.seed)
    profile = args.profile if args.profile is not None else detect()
    model = model_with_shapes(args.model, args.shape)
    require_static_shapes(model, args.batch_size)
    if args.new_head:
        from ..train.transfer import new_head

        model = new_head(model, args.new_head, seed=args.seed)
    budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    trainer = Trainer(
        model, loss=args.loss, optimizer=args.optimizer, lr=args.lr,
        momentum=args.momentum if args.optimizer == "sgd" else 0.0, weight_decay=args.weight_decay,
        trainable=args.trainable, freeze=args.freeze, batch_size=args.batch_size, seed=args.seed,
        clip_norm=args.clip_norm, qat=args.qat, profile=profile, grad_accumulation=args.grad_accumulation,
        mode=args.mode, budget_bytes=budget,
    )
    if args.resume:
        from ..train.checkpoint import load_state, state_path

        load_state(trainer, state_path(args.output))
    loader = DataLoader(data, args.batch_size, shuffle=True, seed=args.seed)
    out = console()
    plan = trainer.memory.plan if trainer.memory else trainer.plan_memory()
    if not args.json:
        out.print(f"{args.model}: {len(trainer.trainable_names)} trainable weight(s), {len(data)} samples, "
                  f"profile {trainer.profile.name if trainer.profile else '-'}")
        if args.mode:
            out.print(f"  mode {trainer.mode}: {trainer.describe_trainable()}", soft_wrap=True)
        micro = f", micro-batches of {trainer.micro_batch}" if trainer.micro_batch < args.batch_size else ""
        out.print(f"  planned step memory {human_bytes(plan.peak_bytes)} at batch {args.batch_size}{micro}")

    steps = len(loader)
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

        history = trainer.fit(loader, args.epochs, validation=None if val is None else (val.x, val.y),
                              on_batch=on_batch, on_epoch=on_epoch)
    trainer.export(args.output)
    from ..train.checkpoint import save_state, state_path

    save_state(trainer, state_path(args.output))
    if args.json:
        emit_json({"model": args.model, "output": args.output, "profile": trainer.profile.name if trainer.profile else None,
                   "trainable": trainer.trainable_names, "micro_batch": trainer.micro_batch,
                   "mode": str(trainer.mode), "step": trainer.global_step,
                   "memory_plan": plan.to_dict(), **history.to_dict()})
        return 0
    out.print(f"saved {args.output}")
    return 0
