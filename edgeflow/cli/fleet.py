"""``edgeflow fleet``: manage the boards of a fleet from one command.

``status`` reads the gateway's registry (``--state gateway.db``) or, without
one, listens to the broker's retained births and deaths; ``deploy``,
``rollback`` and ``cmd`` connect as the ``admin`` operator, sign with the
fleet key from the fleet directory and wait for the devices' acks;
``provision`` creates a device's credentials directory.
"""

from __future__ import annotations

import json
import time
from typing import Any

ORDER = 70


def _common(p) -> None:
    p.add_argument("--dir", default=None, help="fleet directory (default $EDGEFLOW_FLEET_DIR or ./fleet)")
    p.add_argument("--broker", help="broker URL (default: the one in the fleet directory)")
    p.add_argument("--user", default="admin", help="operator user (default admin)")
    p.add_argument("--wait", type=float, default=2.0, help="seconds to collect device births first (default 2)")
    p.add_argument("--json", action="store_true")


def register(sub) -> None:
    p = sub.add_parser("fleet", help="status, OTA deploy, rollback and commands for a fleet of boards",
                       description=__doc__.split("\n\n")[0])
    fs = p.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND")

    s = fs.add_parser("status", help="table of devices, versions and health")
    _common(s)
    s.add_argument("--state", help="the gateway's SQLite registry (read-only); default: ask the broker")
    s.set_defaults(func=cmd_status)

    d = fs.add_parser("deploy", help="signed OTA rollout: canary, waves, automatic rollback",
                      description="Build one signed artifact per target profile (quantized with --quantize), offer "
                      "it to the canary devices, then the rest in waves; devices health-check and roll back on "
                      "failure; the rollout halts when the failure rate passes --threshold.")
    d.add_argument("model", help="ONNX model to deploy")
    d.add_argument("--to", required=True, help="targets: 'profile=NAME', 'device=GLOB', 'version=N', ',' = and; 'all'")
    d.add_argument("--canary", default="10%", help="share ('10%%', 0.1) or count ('2') of the canary wave")
    d.add_argument("--wave-size", type=int, help="devices per wave after the canary (default: all the rest)")
    d.add_argument("--threshold", default="20%", help="halt when the failure rate exceeds this (default 20%%)")
    d.add_argument("--timeout", type=float, default=120.0, help="seconds each device has to report (default 120)")
    d.add_argument("--version", type=int, help="artifact version (default: newest in the fleet + 1)")
    d.add_argument("--quantize", action="store_true", help="quantize per target profile (edgeflow.quantize)")
    d.add_argument("--calibration", help=".npy/.npz samples for static quantization")
    d.add_argument("--golden", help=".npy/.npz golden input for the health check (default: seeded random)")
    d.add_argument("--atol", type=float, default=1e-3)
    d.add_argument("--rtol", type=float, default=1e-3)
    d.add_argument("--latency-budget-ms", type=float, default=1000.0)
    d.add_argument("--revert-on-halt", action="store_true", help="roll back devices already updated if halted")
    d.add_argument("--allow-downgrade", action="store_true",
                   help="let devices install a version older than the one they run (refused otherwise)")
    d.add_argument("--include-offline", action="store_true", help="also target offline devices (queued)")
    _common(d)
    d.set_defaults(func=cmd_deploy)

    r = fs.add_parser("rollback", help="switch devices back to their previous model")
    r.add_argument("devices", nargs="*", help="device ids (or use --to)")
    r.add_argument("--to", help="target selector as for deploy")
    r.add_argument("--from-version", type=int, help="only devices running this version")
    r.add_argument("--timeout", type=float, default=60.0)
    _common(r)
    r.set_defaults(func=cmd_rollback)

    c = fs.add_parser("cmd", help="send one command and print the ack",
                      description="Commands: status, set_config KEY=VALUE..., train_start, train_stop, reboot, "
                      "rollback [from_version=N].")
    c.add_argument("device")
    c.add_argument("name")
    c.add_argument("kv", nargs="*", metavar="KEY=VALUE", help="arguments (values parsed as JSON when possible)")
    c.add_argument("--args", help="arguments as one JSON object")
    c.add_argument("--timeout", type=float, default=30.0)
    _common(c)
    c.set_defaults(func=cmd_cmd)

    v = fs.add_parser("provision", help="create a device's credentials directory and register its key")
    v.add_argument("device")
    v.add_argument("--dir", default=None, help="fleet directory")
    v.add_argument("--profile", help="the board's profile (stored in its credentials)")
    v.add_argument("--broker", help="broker URL the device uses (default: the fleet's)")
    v.add_argument("--force", action="store_true", help="replace existing credentials (new key and password)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_provision)

    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


# ------------------------------------------------------------------ plumbing


def _fleet_dir(args):
    from ..brokerconfig import FleetDir
    from .broker_config import fleet_dir_arg

    return FleetDir(fleet_dir_arg(args.dir))


class _Session:
    """An operator connection: transport + in-memory registry fed by retained births."""

    def __init__(self, args: Any, *, record: bool = True) -> None:
        from ..errors import ConfigError
        from ..gateway.fleet import FleetManager, FleetOptions
        from ..gateway.store import GatewayStore
        from ..transport.message import TlsConfig
        from ..transport.mqtt import MqttTransport
        from ..transport.url import parse_broker_url

        fd = _fleet_dir(args)
        self.fleet_dir = fd
        url = args.broker or fd.broker_url
        if not url:
            raise ConfigError("no broker URL: pass --broker or run broker-config with --broker-url/--public-host")
        op = fd.operator(args.user)
        kwargs: dict[str, Any] = {"client_id": op["username"], "username": op["username"], "password": op["password"],
                                  "clean_start": True, "session_expiry_s": 0, "name": f"fleet-cli-{op['username']}"}
        ca = fd.ca_file()
        if parse_broker_url(url).tls and ca is not None:
            kwargs["tls"] = TlsConfig(ca_file=str(ca))
        self.transport = MqttTransport.from_url(url, **kwargs)
        self.store = GatewayStore(":memory:")
        self.fm = FleetManager(self.transport, self.store, fd.fleet, fd.fleet_key(),
                               FleetOptions(record_telemetry=False, heartbeat_timeout_s=3600), keyring=fd.keyring(),
                               keyring_loader=fd.keyring)
        self.fm.start()
        self.transport.connect()
        self._settle(args.wait)

    def _settle(self, wait: float) -> None:
        """Retained births arrive right after subscribing; wait until they stop coming (at most ``wait`` s)."""
        deadline = time.monotonic() + max(0.0, wait)
        last, seen = time.monotonic(), -1
        while time.monotonic() < deadline:
            n = self.fm.stats().get("births", 0) + self.fm.stats().get("deaths", 0)
            if n != seen:
                seen, last = n, time.monotonic()
            elif time.monotonic() - last > 0.5:
                return
            time.sleep(0.05)

    def close(self) -> None:
        self.fm.stop()
        self.transport.close(timeout=2.0)
        self.store.close()


def _health(online: bool, model_version: Any, t: dict[str, Any], trust: str) -> str:
    """One word for the table: offline, untrusted, no model, no telemetry, errors, ok."""
    if not online:
        return "offline"
    if trust == "unregistered":
        return "untrusted"
    if model_version is None:
        return "no model"
    if not t:
        return "no telemetry"
    if t.get("inference_errors"):
        return "errors"
    return "ok"


def _rows(fm_or_store: Any, telemetry: Any) -> list[dict[str, Any]]:
    rows = []
    for r in fm_or_store.devices():
        t = telemetry(r.device_id) or {}
        rows.append({
            "device": r.device_id, "profile": r.profile, "online": r.online, "model_version": r.model_version,
            "health": _health(r.online, r.model_version, t, r.birth.get("trust", "")),
            "backend": r.birth.get("backend"), "trust": r.birth.get("trust", ""), "last_seen": r.last_seen,
            "training": r.birth.get("training", False), "latency_p50_ms": t.get("latency_p50_ms"),
            "latency_p95_ms": t.get("latency_p95_ms"), "rss_bytes": t.get("rss_bytes"),
            "cpu_percent": t.get("cpu_percent"), "battery": t.get("battery"), "queue_depth": t.get("queue_depth"),
            "edgeflow": (r.birth.get("versions") or {}).get("edgeflow"),
        })
    return rows


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from ._common import console, human_bytes

    t = Table(title=f"{len(rows)} device(s), {sum(r['online'] for r in rows)} online")
    for col in ("device", "profile", "health", "model"):
        t.add_column(col, no_wrap=True)
    for col in ("backend", "p50/p95 ms", "RSS", "CPU %", "battery", "seen", "key"):
        t.add_column(col)
    now = time.time()
    for r in rows:
        lat = "-" if r["latency_p50_ms"] is None else f"{r['latency_p50_ms']:.2f}/{r['latency_p95_ms']:.2f}"
        t.add_row(
            r["device"], r["profile"], f"[{'green' if r['health'] == 'ok' else 'red'}]{r['health']}[/]",
            _fmt(r["model_version"] and f"v{r['model_version']}"), _fmt(r["backend"]), lat,
            human_bytes(r["rss_bytes"]) if r["rss_bytes"] else "-", _fmt(r["cpu_percent"], ".1f"),
            _fmt(r["battery"] is not None and f"{100 * r['battery']:.0f}%" or None),
            f"{max(0.0, now - r['last_seen']):.0f}s", r["trust"] or "-",
        )
    console().print(t)


def _share(text: str, what: str) -> float:
    from ..errors import ConfigError

    s = str(text).strip()
    try:
        return float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        raise ConfigError(f"{what} {text!r} is not a share like '10%' or 0.1 (or a count)") from None


# ------------------------------------------------------------------ commands


def cmd_status(args) -> int:
    from ._common import emit_json

    if args.state:
        from ..gateway.store import GatewayStore

        store = GatewayStore(args.state)
        try:
            rows = _rows(store, lambda d: (store.telemetry(d, limit=1) or [(0, None)])[-1][1])
        finally:
            store.close()
    else:
        s = _Session(args)
        try:
            rows = _rows(s.fm, s.fm.latest_telemetry)
        finally:
            s.close()
    if args.json:
        emit_json({"devices": rows})
    else:
        _print_table(rows)
    return 0


def _load_array(path: str | None):
    if not path:
        return None
    from ._common import load_arrays

    return load_arrays(path)


def cmd_deploy(args) -> int:
    from pathlib import Path

    from ..errors import ConfigError, FleetError
    from ..gateway.ota import Rollout, RolloutPolicy, build_artifacts, select_devices
    from ._common import console, emit_json

    model = Path(args.model).read_bytes() if Path(args.model).is_file() else None
    if model is None:
        raise ConfigError(f"model file not found: {args.model}")
    policy = RolloutPolicy(canary=_share(args.canary, "--canary"), wave_size=args.wave_size,
                           failure_threshold=_share(args.threshold, "--threshold"), report_timeout_s=args.timeout,
                           revert_on_halt=args.revert_on_halt, allow_downgrade=args.allow_downgrade)
    s = _Session(args)
    try:
        targets = select_devices(s.fm.devices(), args.to, online=None if args.include_offline else s.fm.is_online)
        if not targets:
            raise FleetError(f"no {'known' if args.include_offline else 'online'} device matches --to {args.to!r} "
                             "(see `edgeflow fleet status`)")
        version = args.version
        if version is None:
            known = [r.model_version for r in s.fm.devices() if r.model_version is not None]
            version = max(known, default=0) + 1
        notes: list[str] = []
        artifacts = build_artifacts(
            model, {r.profile for r in targets}, s.fleet_dir.fleet_key(), version=version, fleet=s.fleet_dir.fleet,
            name=Path(args.model).stem, quantize=args.quantize, calibration=_load_array(args.calibration),
            golden_inputs=_load_array(args.golden), atol=args.atol, rtol=args.rtol,
            latency_budget_ms=args.latency_budget_ms, notes=notes,
        )
        c = console(stderr=True)
        for n in notes:
            c.print(f"  {n}")
        if not args.json:
            c.print(f"deploying v{version} to {len(targets)} device(s) ({', '.join(sorted(artifacts))})")

        def progress(rep, r) -> None:
            if not args.json:
                c.print(f"  wave {r.wave}: {r.device_id:<20} {r.state:<9} {r.error}")

        report = Rollout(s.fm, artifacts, targets, policy, on_progress=progress).run()
    finally:
        s.close()
    out = report.to_dict()
    out["notes"] = notes
    if args.json:
        emit_json(out)
    else:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts().items()))
        console().print(f"rollout of v{version}: [bold]{report.state}[/] ({counts}; failure rate "
                        f"{report.failure_rate:.0%})" + (f"\n  {report.halted_reason}" if report.halted_reason else ""))
    return 0 if report.state == "completed" and report.failure_rate == 0 else 1


def cmd_rollback(args) -> int:
    from ..errors import ConfigError, FleetError
    from ..gateway.ota import select_devices
    from ._common import console, emit_json

    if not args.devices and not args.to:
        raise ConfigError("name the devices to roll back, or give --to SELECTOR")
    s = _Session(args)
    try:
        ids = list(args.devices) or [r.device_id for r in select_devices(s.fm.devices(), args.to, online=s.fm.is_online)]
        cmd_args = {} if args.from_version is None else {"from_version": args.from_version}
        pending = {d: s.fm.send_command(d, "rollback", cmd_args, timeout_s=args.timeout) for d in ids}
        results = {}
        for d, pc in pending.items():
            try:
                results[d] = pc.wait().to_dict()
            except FleetError as exc:
                results[d] = {"ok": False, "code": "timeout", "error": str(exc), "result": {}}
    finally:
        s.close()
    if args.json:
        emit_json(results)
    else:
        c = console()
        for d, a in results.items():
            state = "[green]ok[/]" if a["ok"] else f"[red]{a['code']}[/]"
            c.print(f"{d}: {state} v{a['result'].get('model_version')} {a.get('error', '')}")
    return 0 if all(a["ok"] for a in results.values()) else 1


def _parse_kv(items: list[str]) -> dict[str, Any]:
    from ..errors import ConfigError

    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ConfigError(f"argument {item!r} is not KEY=VALUE")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def cmd_cmd(args) -> int:
    from ..errors import ConfigError
    from ._common import console, emit_json

    cmd_args = _parse_kv(args.kv)
    if args.args:
        try:
            extra = json.loads(args.args)
        except ValueError as exc:
            raise ConfigError(f"--args is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ConfigError("--args must be a JSON object")
        cmd_args.update(extra)
    s = _Session(args)
    try:
        ack = s.fm.command(args.device, args.name, cmd_args, timeout_s=args.timeout)
    finally:
        s.close()
    if args.json:
        emit_json(ack.to_dict())
    else:
        c = console()
        if ack.ok:
            c.print(f"{ack.device}: {ack.name} [green]ok[/]")
            c.print_json(json.dumps(ack.result, default=str))
        else:
            c.print(f"{ack.device}: {ack.name} [red]{ack.code}[/]: {ack.error}")
    return 0 if ack.ok else 1


def cmd_provision(args) -> int:
    from ..transport.url import parse_broker_url
    from ._common import console, emit_json

    fd = _fleet_dir(args)
    if args.broker:
        parse_broker_url(args.broker)  # a bad URL is refused before anything is written
    path = fd.provision(args.device, profile=args.profile, broker=args.broker, overwrite=args.force)
    files = fd.write_broker_config() if (fd.broker_dir / "mosquitto.conf").exists() else None
    broker = json.loads((path / "device.json").read_text(encoding="utf-8")).get("broker")
    out = {"device": args.device, "credentials": str(path), "broker": broker, "broker_config_updated": files is not None}
    if args.json:
        emit_json(out)
        return 0
    c = console()
    c.print(f"{args.device}: credentials in {path} (copy to the board; run `edgeflow device --credentials DIR`)")
    if broker:
        c.print(f"  the device connects to {broker}")
    else:
        c.print(f"  no broker URL yet: run `edgeflow broker-config --dir {fd.path} --public-host HOST` (it fills it "
                "in) or provision again with --broker URL --force")
    if files is not None:
        c.print("broker password file and ACL updated: reload Mosquitto (kill -HUP <pid>)")
    else:
        c.print("run `edgeflow broker-config` to write the broker configuration")
    return 0
