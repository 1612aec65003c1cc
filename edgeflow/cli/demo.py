"""``edgeflow demo``: the whole product on this machine."""

from __future__ import annotations

ORDER = 1


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="see the whole product work on this machine (broker, gateway, 8 boards)",
        description="Start a broker (Mosquitto if installed, else amqtt embedded), a gateway and one "
        "simulated device per board profile, deploy a model over the air, train it with federated "
        "rounds on non-IID shards of scikit-learn's digits (compressed, signed updates), quantize it "
        "per board, roll it out, and run every board's test-set inference. Prints a table: fp32 vs "
        "deployed accuracy, latency and upload bytes per device.",
    )
    p.add_argument("--devices", type=int, default=8, help="simulated boards, one per profile (default 8)")
    p.add_argument("--rounds", type=int, default=15, help="federated rounds (default 15)")
    p.add_argument("--seed", type=int, default=0, help="fixes the data split, sampling and devices")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--codec", default="topk-int8", help="update codec (dense fp16 int8 topk topk-int8)")
    p.add_argument("--ratio", type=float, default=0.03, help="top-k share of values sent (default 0.03)")
    p.add_argument("--broker", help="broker URL, or 'mosquitto' / 'embedded' to force one (default: auto)")
    p.add_argument("--keep", metavar="DIR", help="keep the state (gateway db, device slots, metrics) in DIR")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--http", metavar="ADDR", help="serve the dashboard (/) and Prometheus metrics (/metrics) on "
                   "HOST:PORT while the demo runs, e.g. 127.0.0.1:9100 (docs/operations.md)")
    p.set_defaults(func=cmd)


def render(result, console) -> None:
    from ._common import fit_table

    cols = [("device", 0, "left"), ("profile", 2, "left"), ("backend", 3, "left"), ("trains", 4, "left"),
            ("runs", 0, "left"), ("fp32 acc", 0, "right"), ("deployed acc", 0, "right"),
            ("p50 ms", 1, "right"), ("p95 ms", 5, "right"), ("uploaded", 2, "right"), ("vs dense", 3, "right")]
    rows = []
    for r in result.devices:
        ratio = f"{r.upload_bytes / r.dense_bytes:.1%}" if r.dense_bytes else "-"
        rows.append([r.device, r.profile, r.backend, "yes" if r.trains else "no", r.precision,
                     f"{r.fp32_accuracy:.3f}", f"{r.deployed_accuracy:.3f}", f"{r.latency_p50_ms:.2f}",
                     f"{r.latency_p95_ms:.2f}", f"{r.upload_bytes / 1024:.1f} KiB" if r.trains else "-", ratio])
    t = fit_table(f"edgeflow demo: {result.rounds} federated rounds, then a quantized OTA rollout", cols, rows,
                  console.width)
    console.print(t)
    console.print(
        f"global model: accuracy {result.final_fp32_accuracy:.3f} (fp32) after {result.rounds} rounds; "
        f"uploaded {result.upload_bytes / 1024:.1f} KiB = {result.upload_ratio:.1%} of dense fp32 "
        f"({result.dense_bytes / 1024:.1f} KiB); wall time {result.wall_s:.1f} s"
    )


def cmd(args) -> int:
    import json
    import sys

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..data.datasets import require_digits
    from ..sim.demo import Demo, DemoConfig
    from ._common import console

    require_digits()  # one line, before a broker or the progress bar starts
    c = console()
    cfg = DemoConfig(devices=args.devices, rounds=args.rounds, seed=args.seed, model=args.model, codec=args.codec,
                     ratio=args.ratio, broker=args.broker, workdir=args.keep)
    # with --json, stdout carries only the JSON document: the broker line goes to stderr
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else c.print
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console(stderr=True, min_width=100), transient=False, disable=args.json)
    demo = Demo(cfg, say=say, progress=progress)
    web = None
    if getattr(args, "http", None):
        from ..gateway.web import WebServer

        # the demo builds its gateway inside run(): the view attaches as soon as it exists
        web = WebServer(lambda: getattr(demo, "gateway", None), args.http).start()
        say(f"dashboard {web.url}  metrics {web.url}metrics")
    try:
        with demo, progress:
            result = demo.run()
    finally:
        if web is not None:
            web.stop()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        render(result, c)
        for n in result.notes:
            if "fp32" in n or "not" in n:  # a board that did not get the quantized model, and why
                c.print(f"  note: {n}")
    return 0
