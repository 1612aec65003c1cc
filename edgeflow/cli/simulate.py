"""``edgeflow simulate``: federated learning at scale on one machine, for research."""

from __future__ import annotations

import contextlib

ORDER = 2

# flag -> (SimConfig field, type, help)
FLAGS: dict[str, tuple[str, type, str]] = {
    "--devices": ("devices", int, "simulated devices, each with its own MQTT connection (default 20)"),
    "--rounds": ("rounds", int, "federated rounds (default 10)"),
    "--model": ("model", str, "mlp, cnn, or a real-model suite name to fine-tune on digits, e.g. "
                "ocr-cls-ppocr-mobile-v2 (default mlp)"),
    "--train-mode": ("train_mode", str, "what devices train: full, head, bias (biases + head), last:N "
                     "(default full)"),
    "--input-size": ("input_size", int, "real models: digits resized to this square size (default 48)"),
    "--alpha": ("alpha", float, "Dirichlet label skew: smaller = more non-IID (default 0.3)"),
    "--seed": ("seed", int, "fixes data split, device behaviour and sampling (default 0)"),
    "--codec": ("codec", str, "update codec: dense fp16 int8 topk topk-int8 topk-packed, or auto (picks by "
                "model size; --codec-opt budget=BYTES caps each update) (default int8)"),
    "--downlink": ("downlink", str, "what devices receive of each new model: full, or delta-int8 (a signed int8 delta "
                   "from the previous version; the full model stays retained for devices that missed one) "
                   "(default full)"),
    "--strategy": ("strategy", str, "fedavg fedprox fedavgm fedadam fedyogi fedadagrad median trimmed-mean krum "
                   "multi-krum fedavg-krum krum-reputation, or auto (krum-reputation; FedAvg with --secagg, "
                   "--mode async or central DP) (default fedavg)"),
    "--fraction": ("fraction", float, "share of online devices selected per round (default 1.0)"),
    "--min-clients": ("min_clients", int, "fewest devices a round may start with (default 2)"),
    "--overselect": ("overselect", float, "select this many times more devices than needed (default 1.0)"),
    "--quorum": ("quorum", float, "share of the selected that must report by the deadline (default 0.6)"),
    "--deadline": ("deadline_s", float, "seconds a round waits for updates (default 30)"),
    "--max-extensions": ("max_extensions", int, "deadline extensions below quorum (default 2)"),
    "--epochs": ("epochs", int, "local epochs per round (default 2)"),
    "--batch-size": ("batch_size", int, "local batch size (default 16)"),
    "--lr": ("lr", float, "local learning rate (default 0.1)"),
    "--momentum": ("momentum", float, "local SGD momentum (default 0)"),
    "--proximal-mu": ("proximal_mu", float, "FedProx proximal term (default 0)"),
    "--dropout": ("skip_rate", float, "per round, the probability a selected device drops out (default 0)"),
    "--vanish": ("dropout", float, "share of devices whose connection is cut for good in --vanish-round"),
    "--vanish-round": ("dropout_round", int, "round in which --vanish devices disappear (default 1)"),
    "--byzantine": ("byzantine", float, "share of devices sending malicious updates (default 0)"),
    "--attack": ("attack", str, "flip, scale or noise (default flip)"),
    "--attack-scale": ("attack_scale", float, "strength of the attack (default 10)"),
    "--stragglers": ("stragglers", float, "share of slow devices (default 0)"),
    "--straggler-delay": ("straggler_delay_s", float, "extra seconds a straggler takes (default 0)"),
    "--mode": ("mode", str, "sync or async (FedBuff) (default sync)"),
    "--async-buffer": ("async_buffer", int, "async: aggregate every K updates (default 15; at most the devices)"),
    "--app": ("app", str, "FILE.py:client_fn or module:client_fn: each device runs the client your Flower-style "
              "client_fn(context) returns, on its own data (docs/flower.md); --model is then unused"),
    "--initial-parameters": ("initial_parameters", str, "with --app: .npz holding the first global parameters "
                             "(np.savez(path, *arrays)); default: one client's get_parameters, as Flower"),
}
SPARSE = ("topk", "topk-int8")
COORDINATE_ROBUST = ("median", "trimmed-mean")


def register(sub) -> None:
    import argparse
    import textwrap

    description = textwrap.fill(
        "Run a gateway and many simulated devices (each a real MQTT client on the chosen "
        "broker) on non-IID shards of scikit-learn's digits. Every knob of the gateway is a flag or a "
        "key of a TOML file (--config). Writes a run folder: config.json, metrics.jsonl (one line per "
        "round), devices.jsonl and devices.json (one record per device), summary.json, "
        "final_model.onnx, SVG charts of accuracy, bytes and participants per round (accuracy.svg, "
        "bytes.svg, participants.svg), report.html with them inline, report.md and, when matplotlib is "
        "installed (pip install '.[report]'), PNG plots of accuracy, bytes, participants and latency.", 78)
    hint = textwrap.fill(
        "With --dropout, --vanish or --stragglers some selected devices never report, so each round waits "
        "for its --deadline (default 30 s) before it closes on the quorum: lower --deadline to what one "
        "local training takes here (a few seconds for the digits models).", 78)
    p = sub.add_parser(
        "simulate",
        help="federated learning at scale: many devices, faults, attacks, strategies",
        description=description,
        epilog="example (faults and attacks):\n  edgeflow simulate --devices 200 --rounds 30 --codec int8 "
        "--dropout 0.2 \\\n      --byzantine 0.1 --strategy trimmed-mean --deadline 10\n\n"
        "example (your Flower-style client, docs/flower.md):\n  edgeflow simulate --app "
        "examples/flower_quickstart/client_app.py:client_fn --devices 4 --rounds 5\n\n" + hint,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML file with any of the settings below (flags override it)")
    for flag, (_, typ, text) in FLAGS.items():
        p.add_argument(flag, type=typ, help=text)
    p.add_argument("--codec-opt", action="append", default=[], metavar="K=V",
                   help="codec option, e.g. ratio=0.05 (repeatable)")
    p.add_argument("--strategy-param", action="append", default=[], metavar="K=V",
                   help="strategy parameter, e.g. proportion=0.2 or num_byzantine=4 (repeatable)")
    p.add_argument("--run-config", metavar="'K=V ...'", help="with --app: context.run_config, as Flower's "
                   "--run-config, e.g. 'local-epochs=2 lr=0.05'")
    p.add_argument("--dp-clip", type=float, help="central DP: clip each update to this L2 norm")
    p.add_argument("--dp-noise", type=float, help="central DP: noise multiplier")
    p.add_argument("--dp-delta", type=float, default=1e-5, help="central DP: delta for the reported epsilon")
    p.add_argument("--secagg", action="store_true", help="secure aggregation (pairwise masking)")
    p.add_argument("--profiles", help="comma-separated device profiles, assigned in turn (default x86-gateway)")
    p.add_argument("--broker", help="broker URL, or 'mosquitto' / 'embedded' (default: auto)")
    p.add_argument("--out", help="run folder (default runs/<timestamp>)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--http", metavar="ADDR", help="serve the dashboard (/) and Prometheus metrics (/metrics) on "
                   "HOST:PORT while the simulation runs, e.g. 127.0.0.1:9100 (docs/operations.md)")
    p.set_defaults(func=cmd)


def _read_config_file(path) -> dict:
    """The settings of a --config TOML file, checked: top-level keys that SimConfig (or broker) knows."""
    import dataclasses
    import sys

    from ..errors import ConfigError
    from ..sim.simulation import SimConfig

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            settings = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    known = set(SimConfig.__dataclass_fields__) | {"broker"}
    tables = {f.name for f in dataclasses.fields(SimConfig) if "dict" in str(f.type)}  # codec_opts = {...}
    stray = sorted(k for k, v in settings.items() if isinstance(v, dict) and k not in tables)
    if stray:
        example = next((f"{k} = {v!r}".replace("'", '"') for k, v in settings[stray[0]].items()
                        if k in known and not isinstance(v, dict)), "rounds = 10")
        raise ConfigError(f"{path}: simulate's TOML has no tables ({', '.join(f'[{k}]' for k in stray)}): "
                          f"put the settings at the top level, e.g. {example}, not under a [section] "
                          "(only codec_opts, strategy_params, dp, secagg and run_config take tables)")
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {unknown}; known: {sorted(known)}")
    return settings


def build_config(args):
    from ..errors import ConfigError
    from ..sim.simulation import SimConfig
    from ._common import parse_key_values

    settings: dict = _read_config_file(args.config) if args.config else {}
    for flag, (field, _, _) in FLAGS.items():
        v = getattr(args, flag.lstrip("-").replace("-", "_"))
        if v is not None:
            settings[field] = v
    if args.codec_opt:
        settings["codec_opts"] = {**settings.get("codec_opts", {}), **parse_key_values(args.codec_opt, "--codec-opt")}
    if args.strategy_param:
        settings["strategy_params"] = {**settings.get("strategy_params", {}), **parse_key_values(args.strategy_param, "--strategy-param")}
    if args.run_config:
        from ..federated.app import parse_config_text

        settings["run_config"] = {**settings.get("run_config", {}), **parse_config_text(args.run_config, "--run-config")}
    if args.dp_clip is not None or args.dp_noise is not None:
        if args.dp_clip is None or args.dp_noise is None:
            raise ConfigError("central DP needs both --dp-clip and --dp-noise")
        settings["dp"] = {"clip_norm": args.dp_clip, "noise_multiplier": args.dp_noise, "delta": args.dp_delta}
    if args.secagg:
        settings["secagg"] = {"max_dropout_fraction": 0.3}
    if args.profiles:
        settings["profiles"] = tuple(s.strip() for s in args.profiles.split(",") if s.strip())
    broker = settings.pop("broker", None)
    settings.setdefault("model", "mlp")
    settings.setdefault("rounds", 10)
    try:
        cfg = SimConfig(**settings)
    except TypeError as exc:
        raise ConfigError(f"simulation settings: {exc}") from exc
    return cfg, args.broker or broker


def _samples(client) -> int | None:
    """A device's local examples: its data, or what its app's last fit said it used."""
    if client.y is not None:
        return len(client.y)
    return (client.last_fit or {}).get("num_examples")


def save_final_model(fleet, out) -> None:
    """final_model.onnx; an app run (parameters only, no ONNX model) also final_parameters.npz, its arrays in order."""
    import numpy as np
    import onnx

    onnx.save(fleet.rounds.current_model(), out / "final_model.onnx")
    if fleet.cfg.app:
        np.savez(out / "final_parameters.npz", **fleet.rounds.weights)


def cmd(args) -> int:
    import sys
    import time
    from pathlib import Path

    from ..sim.demo import describe_broker, select_broker
    from ._common import console

    cfg, broker_spec = build_config(args)
    apps, initial = _prepare_clients(cfg)
    _check_http(args)
    c = console(min_width=120)
    out = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    # with --json, stdout carries only the JSON document: the broker line and warnings go to stderr
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else c.print
    broker = select_broker(broker_spec)
    try:
        say(describe_broker(broker))
        _warn_about_settings(cfg, say)
        conf = _write_config(cfg, broker, out)
        t0 = time.perf_counter()
        rounds, devices, up, dense, strategy = _run_fleet(cfg, args, broker, out, apps, initial, say)
        wall = time.perf_counter() - t0
        summary = _summary(cfg, rounds, wall, up, dense, strategy)
        plots, report = _write_run_folder(out, conf, rounds, devices, summary)
    finally:
        broker.stop()
    return _report_outcome(args, cfg, c, out, summary, wall, plots, report)


def _prepare_clients(cfg):
    """The stock clients' data, or the user's app clients and their first model: built and checked
    before a broker or the progress bar starts, so that a mistake is one line."""
    from ..data.datasets import require_digits

    if not cfg.app:
        require_digits()
    apps = initial = None
    if cfg.app:
        from ..sim.simulation import initial_model, make_apps

        apps = make_apps(cfg)
        initial = initial_model(cfg, apps)
    return apps, initial


def _check_http(args) -> None:
    """A bad --http address or a missing prometheus_client, before anything starts."""
    if args.http:
        from ..gateway.web import parse_listen
        from ..gateway.web.metrics import require_prometheus

        parse_listen(args.http)
        require_prometheus()


def _warn_about_settings(cfg, say) -> None:
    if cfg.codec in SPARSE and cfg.strategy in COORDINATE_ROBUST:
        say(f"warning: {cfg.strategy} over {cfg.codec} updates: coordinate-wise robust statistics of sparse "
            "updates are mostly zero, so the model barely moves; use int8/fp16/dense or a mean-type strategy")
    if (cfg.skip_rate or cfg.dropout or cfg.stragglers) and cfg.deadline_s >= 20:
        say(f"note: with devices that drop out or straggle, a round waits its whole deadline "
            f"({cfg.deadline_s:g} s) before closing on the quorum; --deadline 5 is enough for the digits models")


def _write_config(cfg, broker, out) -> dict:
    """config.json: the settings and the broker's URL."""
    import dataclasses
    import json

    conf = {**dataclasses.asdict(cfg), "broker": broker.url}
    (out / "config.json").write_text(json.dumps(conf, indent=2, default=list) + "\n")
    return conf


@contextlib.contextmanager
def _error_line_alone(progress):
    """On an EdgeflowError the progress bar is erased, so that the error's line stands alone (not under a
    half-drawn bar)."""
    from ..errors import EdgeflowError

    try:
        yield
    except EdgeflowError:
        progress.live.transient = True
        raise


def _run_fleet(cfg, args, broker, out, apps, initial, say):
    """The rounds under a progress bar: (round metrics, device records, uploaded bytes, dense bytes, strategy)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from ..sim.simulation import SimulatedFleet
    from ._common import console

    rounds: list[dict] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console(stderr=True), disable=args.json)
    with progress:
        on_round = _round_recorder(cfg, out, rounds, progress, progress.add_task("rounds", total=cfg.rounds))
        (out / "metrics.jsonl").write_text("")
        with _error_line_alone(progress):  # e.g. an app that does not fit its model
            fleet = SimulatedFleet(cfg, broker.url, on_round=on_round, apps=apps, initial=initial,
                                   protocol=getattr(broker, "protocol", "auto") or "auto")
        if fleet.rounds.strategy_choice.auto:
            say(fleet.rounds.strategy_choice.describe())
        devices, up, dense, strategy = _run_rounds(fleet, args, out, progress, say)
    return rounds, devices, up, dense, strategy


def _round_recorder(cfg, out, rounds: list[dict], progress, task):
    """on_round: each round's metrics appended to ``rounds`` and metrics.jsonl, and the bar advanced."""
    import json

    def on_round(m) -> None:
        if cfg.app and m.accuracy is None:  # an app run: the clients' own evaluation (docs/flower.md)
            acc = m.extra.get("fed_eval_accuracy")
            m.accuracy = acc if isinstance(acc, float) else None
        rounds.append(m.to_dict())
        with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(m.to_dict()) + "\n")
        acc = "n/a" if m.accuracy is None else f"{m.accuracy:.3f}"
        progress.update(task, advance=1, description=f"rounds (accuracy {acc})")

    return on_round


def _run_rounds(fleet, args, out, progress, say):
    """Run the fleet (with the dashboard on --http), save the final model, and close the fleet:
    (device records, uploaded bytes, dense bytes, strategy)."""
    web = None
    try:
        if args.http:
            from ..gateway.web import WebServer

            web = WebServer(fleet, args.http).start()
            say(f"dashboard {web.url}  metrics {web.url}metrics")
        with _error_line_alone(progress):
            fleet.run()
        strategy = fleet.rounds.strategy_name
        save_final_model(fleet, out)
        devices = _device_records(fleet)
        up, dense = fleet.upload_bytes()
    finally:
        if web is not None:
            web.stop()
        fleet.close()
    return devices, up, dense, strategy


def _device_records(fleet) -> list[dict]:
    return [{
        "device": d.device_id, "profile": d.profile, "samples": _samples(d.client),
        "byzantine": d.byzantine, "straggler": d.straggler, "vanished": d.vanished,
        "updates_sent": d.client.stats.updates_sent, "bytes_sent": d.client.stats.bytes_sent,
        "mean_train_ms": 1000 * d.client.stats.train_s_total / max(1, d.client.stats.rounds_trained),
    } for d in fleet.devices]


def _summary(cfg, rounds: list[dict], wall: float, up: int, dense: int, strategy) -> dict:
    from ..timing import peak_rss_bytes

    accs = [r["accuracy"] for r in rounds if r.get("accuracy") is not None]
    return {
        "devices": cfg.devices, "rounds_completed": len(rounds),
        "final_accuracy": round(accs[-1], 4) if accs else None,
        "best_accuracy": round(max(accs), 4) if accs else None, "wall_s": round(wall, 2),
        "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1), "uploaded_bytes": up, "dense_bytes": dense,
        "upload_ratio": round(up / dense, 4) if dense else None, "strategy": strategy, "codec": cfg.codec,
    }


def _write_run_folder(out, conf: dict, rounds: list[dict], devices: list[dict], summary: dict):
    """devices.jsonl, devices.json, summary.json, the charts and the report: (plots, report path)."""
    import json

    from ..sim.report import make_plots, write_jsonl, write_report

    write_jsonl(out / "devices.jsonl", devices)
    (out / "devices.json").write_text(json.dumps(devices, indent=1) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plots = make_plots(out, rounds, devices)
    report = write_report(out, conf, rounds, devices, summary, plots)
    return plots, report


def _report_outcome(args, cfg, c, out, summary: dict, wall: float, plots, report) -> int:
    """The summary (JSON with --json, else two lines) and the exit status: 1 when no accuracy came."""
    import json
    import sys

    # an app's clients may report no accuracy: the run failed when no round completed
    failed = summary["rounds_completed"] == 0 if cfg.app else summary["final_accuracy"] is None
    if args.json:
        print(json.dumps({**summary, "ok": not failed, "run_folder": str(out), "report": str(report)}, indent=2))
    else:
        unseen = ("not reported (secure aggregation sends no client metrics)" if cfg.secagg else
                  "not reported (no 'accuracy' in the clients' evaluate)")
        acc = ("none (no round completed)" if failed else unseen
               if summary["final_accuracy"] is None else f"{summary['final_accuracy']:.3f}")
        up = summary["uploaded_bytes"]
        c.print(f"{summary['rounds_completed']} rounds on {cfg.devices} devices in {wall:.1f} s, peak RSS "
                f"{summary['peak_rss_mb']} MiB; final accuracy {acc}; uploaded "
                f"{up / 1024:.0f} KiB ({(summary['upload_ratio'] or 0):.1%} of dense)")
        c.print(f"run folder: {out}  (report: {report}, SVG charts{'' if plots else '; PNG plots: pip install matplotlib'})")
    if failed:
        print("edgeflow simulate: error: no round completed, so there is no accuracy to report; see "
              f"{out / 'metrics.jsonl'} and the log (-v); lower --min-clients/--quorum or raise --deadline",
              file=sys.stderr)
        return 1
    return 0
