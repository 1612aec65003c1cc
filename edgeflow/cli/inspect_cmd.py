"""``edgeflow inspect MODEL``: what is in a model and what can run it."""

from __future__ import annotations

ORDER = 20


def register(sub) -> None:
    from ._common import add_shape_arg

    p = sub.add_parser(
        "inspect",
        help="ops, parameters, size, and which backends can run a model",
        description="Load and check an ONNX model, then list its inputs/outputs, op counts, "
        "parameter count and size (initializers and Constant-node weights), which installed backends "
        "can run it (and which ops stop the others), and the numpy backend's planned peak memory at "
        "the given batch size. --optimized adds the node count per op before and after the optimizer.",
    )
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--batch", type=int, default=1, help="batch size for the memory plan (default 1)")
    add_shape_arg(p)
    p.add_argument("--optimized", action="store_true",
                   help="show node counts per op: the model, after the optimizer's portable passes, "
                   "and as the numpy backend runs it (fused)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd)


def _numpy_counts(graph) -> dict[str, int]:
    import collections

    c = collections.Counter(
        (n.kernel.op_type if not n.domain else f"{n.domain}::{n.kernel.op_type}") for n in graph.nodes
    )
    return dict(sorted(c.items()))


def cmd(args) -> int:
    from ..runtime.backends import backend_names, get_backend
    from ..errors import BackendError, EdgeflowError
    from ..runtime.graph import compile_graph
    from ..runtime.memory import plan_memory
    from ..runtime.model import model_info
    from ..runtime.optimize import optimize
    from ._common import console, emit_json, human_bytes, model_with_shapes

    if args.batch < 1:
        from ..errors import InputError

        raise InputError(f"--batch {args.batch}: the batch size for the memory plan must be 1 or more")
    model = model_with_shapes(args.model, args.shape)
    info = model_info(model)
    backends = {}
    for name in backend_names():
        try:
            missing = get_backend(name).unsupported_ops(model)
            backends[name] = {"available": True, "can_run": not missing, "unsupported_ops": missing}
        except BackendError as exc:
            backends[name] = {"available": False, "can_run": False, "reason": str(exc)}
    plan = graph = None
    try:
        graph = compile_graph(model)
        plan = plan_memory(graph, args.batch).to_dict()
    except EdgeflowError as exc:
        plan = {"error": str(exc)}
    optimized = None
    if args.optimized:
        report = optimize(model).report
        optimized = {**report.to_dict(), "numpy": _numpy_counts(graph) if graph is not None else None}
    if args.json:
        out = {"model": str(args.model), **info.to_dict(), "backends": backends, "memory_plan": plan}
        if optimized is not None:
            out["optimized"] = optimized
        emit_json(out)
        return 0
    c = console(min_width=100)
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
    elif plan:
        c.print(f"  no numpy memory plan: {plan['error']}", markup=False, soft_wrap=True)
    if optimized is not None:
        _print_optimized(c, optimized)
    return 0


def _print_optimized(c, opt: dict) -> None:
    numpy = opt["numpy"]
    removed = ", ".join(f"{k} -{v}" for k, v in opt["removed_by_pass"].items() if v) or "nothing to remove"
    line = f"  optimizer: {opt['nodes_before']} -> {opt['nodes_after']} nodes ({removed})"
    if numpy is not None:
        line += f"; the numpy backend runs {sum(numpy.values())} (fused)"
    c.print(line, markup=False)
    ops = sorted(set(opt["before"]) | set(opt["after"]) | set(numpy or {}))
    width = max([len(o) for o in ops] + [2])
    head = f"    {'op':<{width}}  {'model':>6}  {'optimized':>9}"
    c.print(head + (f"  {'numpy':>6}" if numpy is not None else ""), markup=False)
    for op in ops:
        b, a = (str(x) if x else "-" for x in (opt["before"].get(op), opt["after"].get(op)))
        row = f"    {op:<{width}}  {b:>6}  {a:>9}"
        if numpy is not None:
            row += f"  {numpy.get(op) or '-':>6}"
        c.print(row, markup=False)
