"""``edgeflow gateway``: run the aggregator and fleet manager service."""

from __future__ import annotations

ORDER = 55

EXAMPLE = """\
gateway.toml (every key optional except where noted; see docs/gateway.md):

  [gateway]
  fleet_dir = "fleet"            # from `edgeflow broker-config --dir fleet --fleet lab`
  state = "gateway.sqlite"       # rounds, models, registry; survives restarts
  model = "model.onnx"           # initial global model (first start only)
  eval = "eval.npz"              # optional held-out x/y: accuracy per round
  metrics = "metrics.jsonl"

  [fleet]
  heartbeat_timeout_s = 30

  [rounds]
  rounds = 20
  strategy = "fedavg"            # fedavgm fedadam fedyogi fedadagrad median trimmed-mean krum multi-krum
  # FedAvg bounds each update's norm (1.5 x the median) and sample count (3 x the median) by
  # default; strategy_params = { clip = "off", sample_multiplier = "off" } turns that off
  fraction = 0.5
  min_clients = 4                # a round that ends with fewer updates fails and publishes no model
  deadline_s = 60
  publish_timeout_s = 30         # log (and keep waiting) when the broker has not acknowledged a publish
  [rounds.train]
  epochs = 1
  lr = 0.05
  codec = "topk-int8"
  codec_opts = { ratio = 0.03 }

  # [store]                      # instead of [gateway] state: PostgreSQL, shared with the
  # url = "postgresql://postgres@127.0.0.1:5432/test?schema=lab"   # ingestion workers (docs/scaling.md)
"""

NOTES = """One gateway per state: a second `edgeflow gateway` on the same state exits at once (code 2) with
one line naming the first (host, pid, since). Read-only commands (edgeflow rounds, fleet status,
fleet history) work while a gateway runs.

exit codes: 0 rounds done (or served until Ctrl-C), 1 no round produced a model, 2 a bad setting
or the state is in use, 3 nothing to do: the state already holds [rounds] rounds closed rounds
(raise [rounds] rounds, pass --rounds N or --serve, or start a new state).
"""


def register(sub) -> None:
    import argparse

    p = sub.add_parser(
        "gateway",
        help="run the federated aggregator and fleet manager",
        description="Run rounds of federated learning over MQTT (select, announce, collect signed "
        "updates, aggregate, publish the new global model) and keep the fleet registry, liveness, "
        "telemetry and command channel. State lives in SQLite (or PostgreSQL with [store] url): a restarted gateway resumes the "
        "round it was in.",
        epilog=EXAMPLE + "\n" + NOTES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", "-c", required=True, help="gateway.toml")
    p.add_argument("--broker", help="broker URL, e.g. mqtts://broker:8883 (default: from the config or fleet dir)")
    p.add_argument("--dir", help="fleet directory (default: [gateway] fleet_dir)")
    p.add_argument("--rounds", type=int, help="run this many more rounds (default: until [rounds] rounds are done)")
    p.add_argument("--serve", action="store_true", help="after the rounds, keep serving the fleet until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print each round's metrics as one JSON line (only JSON on "
                   "stdout)")
    p.add_argument("--http", metavar="ADDR", help="serve the dashboard (/) and Prometheus metrics (/metrics) on "
                   "HOST:PORT, e.g. 127.0.0.1:9100 (default: [http] listen; read-only unless [http] actions with "
                   "tls_cert/tls_key; docs/operations.md)")
    p.add_argument("--initial-parameters", metavar="FILE.npz", help="start the rounds from these arrays instead of "
                   "[gateway] model (Flower-style apps that bring their own model, docs/flower.md; used only while the "
                   "state holds no model yet; replaces [gateway] model and initial_parameters)")
    p.add_argument("--export-model", metavar="PATH", help="write the newest global model from the state to PATH "
                   "(.onnx) and exit, e.g. to deploy what the rounds trained with `edgeflow fleet deploy`")
    p.set_defaults(func=cmd)


def _export(cfg, args) -> int:
    import hashlib
    from pathlib import Path

    from ..errors import StateError
    from ._common import check_output_path, console, emit_json

    target = cfg.store_target()
    state = target.display
    if target.engine == "sqlite" and (target.path == ":memory:" or not Path(target.path).is_file()):
        raise StateError(f"no gateway state at {state}: run `edgeflow gateway --config {args.config}` first "
                         "([gateway] state or [store] url names it)")
    check_output_path(args.export_model, "--export-model")
    from edgeflow.gateway.store import open_store

    store = open_store(target)
    try:
        latest = store.latest_model()
    finally:
        store.close()
    if latest is None:
        raise StateError(f"{state} holds no model yet")
    version, onnx_bytes, _ = latest
    Path(args.export_model).write_bytes(onnx_bytes)
    out = {"model_version": version, "path": str(args.export_model), "sha256": hashlib.sha256(onnx_bytes).hexdigest(),
           "bytes": len(onnx_bytes)}
    if args.json:
        emit_json(out)
    else:
        console().print(f"global model v{version} written to {args.export_model} ({len(onnx_bytes)} bytes)")
    return 0


def cmd(args) -> int:
    from edgeflow.gateway.service import Gateway, load_config
    from edgeflow.gateway.store.lease import take_gateway_lease

    from ._common import console

    cfg = load_config(args.config)
    if args.initial_parameters:
        cfg = _with_initial_parameters(cfg, args.initial_parameters)
    c = console()
    if args.export_model:
        return _export(cfg, args)
    listen, web_kw = _dashboard(cfg, args)
    # one gateway per state: a second one stops here, before it opens the state or takes the broker
    # session of the first (same client id); readers (rounds, fleet status/history) take no lease
    lease = take_gateway_lease(cfg.store_target())
    try:
        gw = Gateway.from_config(cfg, broker=args.broker, fleet_dir=args.dir, on_round=_round_printer(args, c))
    except BaseException:
        lease.release()
        raise
    web = None
    rc = 0
    try:
        closed_before = sum(1 for r in gw.store.rounds() if r.state == "closed")
        wanted = args.rounds if args.rounds is not None else max(0, cfg.rounds.rounds - closed_before)
        if _nothing_to_do(cfg, args, gw, wanted):
            return _rounds_done(cfg, args, closed_before)
        if listen:
            from edgeflow.gateway.web import WebServer

            web = WebServer(gw, listen, what="--http" if args.http else "[http] listen", **web_kw).start()
            _say(args, c, f"dashboard {web.url}  metrics {web.url}metrics")
        rc = _run(gw, cfg, args, c, wanted)
        if args.serve:
            gw.serve()
    except KeyboardInterrupt:
        pass
    finally:
        if web is not None:
            web.stop()
        gw.stop()
        lease.release()
    gave_up = getattr(gw.transport, "gave_up", None)
    if gave_up is not None:  # e.g. another gateway process uses this client id: its one line, exit 2
        raise gave_up
    return rc


def _with_initial_parameters(cfg, path: str):
    """The configuration with ``--initial-parameters`` instead of its model (the file checked first:
    a bad one is one line before connecting)."""
    import dataclasses
    from pathlib import Path

    from edgeflow.gateway.global_model import load_initial_parameters

    npz = Path(path).expanduser().resolve()
    load_initial_parameters(npz, what="--initial-parameters")  # a bad file is one line before connecting
    return dataclasses.replace(cfg, model=None, initial_parameters=str(npz))


def _round_printer(args, c):
    """What the command prints after each round: one JSON line (``--json``) or one sentence."""
    import json

    def on_round(m) -> None:
        if args.json:
            d = {k: round(v, 4) if isinstance(v, float) else v for k, v in m.to_dict().items()}
            print(json.dumps(d), flush=True)
        else:
            acc = "n/a" if m.accuracy is None else f"{m.accuracy:.3f}"
            c.print(f"round {m.round_id}: model v{m.model_version}, {m.participants}/{m.selected} devices, "
                    f"{m.dropped} dropped, {m.late} late, {m.rejected} rejected, "
                    f"{m.bytes_in / 1024:.1f} KiB in, accuracy {acc}, {m.round_s:.1f} s")

    return on_round


def _dashboard(cfg, args) -> tuple[str | None, dict]:
    """The dashboard's address (``--http`` or ``[http] listen``) and options, checked before connecting."""
    listen = args.http or cfg.http_listen
    if not listen:
        return listen, {}
    from edgeflow.gateway.web import parse_listen, web_options

    parse_listen(listen, "--http" if args.http else "[http] listen")  # a bad address before connecting
    return listen, web_options(cfg, args.dir)  # [http] tls_cert/tls_key/actions: checked before connecting


def _run(gw, cfg, args, c, wanted: int) -> int:
    """Start the gateway and run the rounds asked for; the exit code (not 0 when none closed with a model)."""
    _stop_when_transport_gives_up(gw)
    gw.start()
    if not args.json:
        c.print(f"gateway for fleet {gw.fleet_id} on {getattr(gw.transport, 'url', gw.transport)}: "
                f"model v{gw.rounds.version}")
    done = gw.run_rounds(args.rounds)
    if cfg.role != "site" and wanted > 0 and not any(not m.extra.get("failed") for m in (done or [])):
        return _no_round(gw)
    return 0


def _stop_when_transport_gives_up(gw) -> None:
    """Stop the gateway (from a thread of its own, not the transport's) once its transport stopped
    reconnecting for good, e.g. because another gateway of the fleet took its client id."""
    import threading

    def stop() -> None:
        gw.transport.close(timeout=1.0, flush=False)  # nothing more goes out: stop() does not wait on the broker
        gw.stop()

    def on_event(event) -> None:  # noqa: ARG001 - the transport's state says what happened
        if getattr(gw.transport, "gave_up", None) is not None:
            threading.Thread(target=stop, name="edgeflow-gateway-gave-up", daemon=True).start()

    add = getattr(gw.transport, "add_connection_listener", None)
    if add is not None:
        add(on_event)


ROUNDS_DONE = 3
"""Exit code of a gateway started on a state whose job is done ([rounds] rounds closed rounds)."""


def _nothing_to_do(cfg, args, gw, wanted: int) -> bool:
    """The job's rounds are all closed in the state, no round is open to finish, and nothing else was asked."""
    return (cfg.role != "site" and args.rounds is None and not args.serve and wanted == 0
            and not gw.store.open_rounds())


def _rounds_done(cfg, args, closed: int) -> int:
    """One line naming the state, the count and the fixes; exit code :data:`ROUNDS_DONE`."""
    import sys

    print(f"edgeflow gateway: error: nothing to do: {cfg.store_target().display} already holds {closed} closed "
          f"round(s) and [rounds] rounds = {cfg.rounds.rounds} in {args.config}; raise [rounds] rounds, run more "
          "with --rounds N, keep serving the fleet with --serve, or start a new state", file=sys.stderr)
    return ROUNDS_DONE


def _say(args, c, text: str) -> None:
    """A status line: on stdout, or on stderr with --json (stdout carries only JSON)."""
    import sys

    if args.json:
        print(text, file=sys.stderr, flush=True)
    else:
        c.print(text, highlight=False)


def _no_round(gw) -> int:
    """Exit code 1 and one line when the job asked for rounds and none produced a model: the last reason."""
    import json
    import sys

    try:
        status = json.loads(gw.store.get_meta("rounds_status") or "{}")
    except ValueError:
        status = {}
    why = status.get("reason") or "see the log above"
    print(f"edgeflow gateway: error: no round produced a model: {why}", file=sys.stderr)
    return 1
