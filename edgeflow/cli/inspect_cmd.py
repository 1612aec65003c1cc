"""``edgeflow inspect MODEL``: what is in a model and what can run it."""

from __future__ import annotations

ORDER = 20


def register(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="ops, parameters, size, and which backends can run a model",
        description="Load and check an ONNX model, then list its inputs/outputs, op counts, "
        "parameter count and size, which installed backends can run it (and which ops stop the "
        "others), and the numpy backend's planned peak memory at the given batch size.",
    )
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--batch", type=int, default=1, help="batch size for the memory plan (default 1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd)


def cmd(args) -> int:
    from ..backends import backend_names, get_backend
    from ..errors import BackendError, EdgeflowError
    from ..graph import compile_graph
    from ..memory import plan_memory
    from ..model import load_model, model_info
    from ._common import console, emit_json, human_bytes

    model = load_model(args.model)
    info = model_info(model)
    backends = {}
    for name in backend_names():
        try:
            missing = get_backend(name).unsupported_ops(model)
            backends[name] = {"available": True, "can_run": not missing, "unsupported_ops": missing}
        except BackendError as exc:
            backends[name] = {"available": False, "can_run": False, "reason": str(exc)}
    plan = None
    try:
        plan = plan_memory(compile_graph(model), args.batch).to_dict()
    except EdgeflowError as exc:
        plan = {"error": str(exc)}
    if args.json:
        emit_json({"model": str(args.model), **info.to_dict(), "backends": backends, "memory_plan": plan})
        return 0
    c = console()
    c.print(f"[bold]{args.model}[/bold]  opsets {info.opsets}  ir {info.ir_version}  {info.producer}")
    for t in info.inputs:
        c.print(f"  input  {t.name}: {t.dtype} {list(t.shape)}")
    for t in info.outputs:
        c.print(f"  output {t.name}: {t.dtype} {list(t.shape)}")
    c.print(f"  parameters: {info.num_parameters:,} ({human_bytes(info.parameter_bytes)}), "
            f"file {human_bytes(info.file_bytes)}, {info.node_count} nodes")
    c.print("  ops: " + ", ".join(f"{op} x{n}" for op, n in info.op_counts.items()))
    for name, b in backends.items():
        if not b["available"]:
            c.print(f"  backend {name}: not available ({b['reason']})")
        elif b["can_run"]:
            c.print(f"  backend {name}: can run")
        else:
            c.print(f"  backend {name}: cannot run {', '.join(b['unsupported_ops'])}")
    if plan and "error" not in plan:
        c.print(f"  planned peak memory at batch {args.batch}: {human_bytes(plan['peak_bytes'])} "
                f"(weights {human_bytes(plan['weights_bytes'])}, activations peak at {plan['peak_node']})")
    return 0
