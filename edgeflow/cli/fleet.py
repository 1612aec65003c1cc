"""``edgeflow fleet``: manage the boards of a fleet from one command.

``status`` reads the gateway's registry (``--state gateway.db``) or, without
one, listens to the broker's retained births and deaths; ``deploy``,
``rollback`` and ``cmd`` connect as the ``admin`` operator, sign with the
fleet key from the fleet directory and wait for the devices' acks;
``provision`` creates a device's credentials directory, ``revoke`` takes a
device's key and broker credentials away.

Every string a device supplied (its birth, telemetry, acks: profile, backend,
train detail, error texts) is printed through :func:`_shown`: control, C1 and
bidi characters as visible escapes, rich markup escaped, so a device can
neither write escape sequences to the operator's terminal nor break the
output for the rest of the fleet. ``--json`` output is escaped by JSON itself.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

ORDER = 70


def _shown(value: Any, limit: int = 400) -> str:
    """A device-supplied value for rich output: shown as the text it is, never interpreted.

    Control characters (ESC, BEL...), C1 controls and bidi overrides become visible escapes
    (:func:`edgeflow.protocol.fleet.printable`) and rich markup such as ``[/]`` is escaped."""
    from rich.markup import escape

    from ..protocol.fleet import printable

    return escape(printable(value, limit))


def _common(p, *, wait: float = 2.0, what: str = "the devices' retained births") -> None:
    p.add_argument("--dir", default=None, help="fleet directory (default $EDGEFLOW_FLEET_DIR or ./fleet)")
    p.add_argument("--broker", help="broker URL (default: the one in the fleet directory)")
    p.add_argument("--user", default="admin", help="operator user (default admin)")
    p.add_argument("--wait", type=float, default=wait,
                   help=f"listen at most this many seconds for {what} first (default {wait:g})")
    p.add_argument("--json", action="store_true", help="print only JSON on stdout")


def register(sub) -> None:
    p = sub.add_parser("fleet", help="status, OTA deploy, rollback and commands for a fleet of boards",
                       description=__doc__.split("\n\n")[0])
    fs = p.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND")

    s = fs.add_parser("status", help="table of devices, versions, health and why each trains or not",
                      description="Without --state: connect to the broker and listen to the devices' retained "
                      "births and their telemetry (returns as soon as every online device has reported, at most "
                      "--wait seconds). With --state: read the running gateway's registry (its SQLite file or "
                      "PostgreSQL URL), read-only, including what the federated rounds are doing.")
    _common(s, wait=12.0, what="births and one telemetry message per online device (devices report every "
            "telemetry_interval_s, 10 s by default)")
    s.add_argument("--state", help="the gateway's state: its SQLite file ([gateway] state) or its [store] url "
                   "(postgresql://USER@HOST:PORT/DB?schema=NAME), opened read-only and never created; default: ask "
                   "the broker")
    s.add_argument("--expect", type=int, metavar="N", help="wait (at most --wait s) until N devices are online and "
                   "have reported; exit code 1 when fewer are (for scripts: wait for the boards to come up)")
    s.set_defaults(func=cmd_status)

    d = fs.add_parser("deploy", help="signed OTA rollout: canary, waves, automatic rollback",
                      description="Build one signed artifact per target profile (quantized with --quantize), offer "
                      "it to the canary devices, then the rest in waves; devices health-check and roll back on "
                      "failure; the rollout halts when the failure rate passes --threshold.")
    d.add_argument("model", help="ONNX model to deploy")
    d.add_argument("--to", required=True, help="targets: 'profile=NAME', 'device=GLOB', 'version=N', ',' = and; 'all'")
    d.add_argument("--canary", default="10%", help="share ('10%%', 0.1) or count ('2') of the canary wave")
    d.add_argument("--wave-size", type=int, help="devices per wave after the canary (default: all the rest)")
    d.add_argument("--min-canaries", type=int, default=2,
                   help="the canary wave holds at least this many devices, and the rest of the fleet gets the model "
                   "only when that many canaries proved they run it (their outputs on a fresh challenge match the "
                   "gateway's; default 2, or all of a smaller rollout)")
    d.add_argument("--threshold", default="20%", help="halt when the failure rate exceeds this (default 20%%)")
    d.add_argument("--timeout", type=float, default=120.0, help="seconds each device has to report (default 120)")
    d.add_argument("--version", type=int, help="artifact version (default: newest in the fleet + 1)")
    d.add_argument("--quantize", action="store_true",
                   help="quantize per target profile (edgeflow.quantize; needs --calibration); boards that can train "
                   "also get the fp32 master they train on in federated rounds")
    d.add_argument("--calibration", help=".npy/.npz samples for static quantization (a few hundred inputs)")
    d.add_argument("--no-train-master", action="store_true",
                   help="with --quantize: send no fp32 training master (smaller download; those boards then do "
                   "not take part in federated rounds)")
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
    v.add_argument("--profile", help="the board's profile, a name from `edgeflow profile list` (stored in its "
                   "credentials)")
    v.add_argument("--broker", help="broker URL the device uses (default: the fleet's)")
    v.add_argument("--force", action="store_true", help="replace existing credentials (new key and password)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_provision)

    rv = fs.add_parser("revoke", help="revoke a device (stolen or compromised board): the gateway refuses its key, "
                       "the next broker config drops its password and ACL entries")
    rv.add_argument("device")
    rv.add_argument("--dir", default=None, help="fleet directory")
    rv.add_argument("--json", action="store_true")
    rv.set_defaults(func=cmd_revoke)

    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


# ------------------------------------------------------------------ plumbing


def _fleet_dir(args):
    from ..broker.mosquitto import FleetDir
    from .broker_config import fleet_dir_arg

    return FleetDir(fleet_dir_arg(args.dir))


def _client_id(user: str, purpose: str) -> str:
    """A client id of its own for every operator command (user, command, pid, random): two commands run
    at once never share a session. (A broker with ``use_username_as_clientid`` still makes it the user
    name: run concurrent commands as different operator users there, see docs/fleet.md.)"""
    import os
    import secrets

    return f"{user}-{purpose}-{os.getpid()}-{secrets.token_hex(3)}"


class _Session:
    """An operator connection: transport + in-memory registry fed by retained births (and telemetry)."""

    def __init__(self, args: Any, *, purpose: str, telemetry: bool = False, expect: int = 0) -> None:
        from ..errors import ConfigError
        from ..gateway.fleet import FleetManager, FleetOptions
        from ..gateway.store import GatewayStore
        from ..transport.message import TlsConfig
        from ..transport.mqtt import MqttTransport
        from ..transport.url import parse_broker_url

        if not args.wait >= 0:
            raise ConfigError(f"--wait {args.wait:g}: give the seconds to listen, 0 or more")
        fd = _fleet_dir(args)
        self.fleet_dir = fd
        url = args.broker or fd.broker_url
        if not url:
            raise ConfigError("no broker URL: pass --broker or run broker-config with --broker-url/--public-host")
        op, self._operator_lock = fd.claim_operator(args.user)
        kwargs: dict[str, Any] = {"client_id": _client_id(op["username"], purpose), "username": op["username"],
                                  "password": op["password"], "clean_start": True, "session_expiry_s": 0,
                                  "name": f"fleet-{purpose}-{op['username']}"}
        ca = fd.ca_file()
        if parse_broker_url(url).tls and ca is not None:
            kwargs["tls"] = TlsConfig(ca_file=str(ca))
        self.transport = MqttTransport.from_url(url, **kwargs)
        self.store = GatewayStore(":memory:")
        self.fm = FleetManager(self.transport, self.store, fd.fleet, fd.fleet_key(),
                               FleetOptions(record_telemetry=telemetry, heartbeat_timeout_s=3600), keyring=fd.keyring(),
                               keyring_loader=fd.keyring)
        self.fm.start()
        if not getattr(args, "verbose", 0):
            # one-shot command: the final error says why the broker could not be reached; the
            # transport's per-retry warnings would only repeat it (they show with -v)
            logging.getLogger("edgeflow.transport").setLevel(logging.ERROR)
        try:
            self.transport.connect()
            self._settle(args.wait, telemetry=telemetry, expect=expect)
        except BaseException:
            self.close()
            raise

    def _settle(self, wait: float, *, telemetry: bool, expect: int = 0) -> None:
        """Listen until the retained births stopped coming (0.5 s without a new one, after the first) and,
        with ``telemetry``, every online device has sent one telemetry message (and, with ``expect``, at
        least that many are online); at most ``wait`` seconds."""
        deadline = time.monotonic() + max(0.0, wait)
        last, seen = time.monotonic(), 0
        while time.monotonic() < deadline:
            st = self.fm.stats()
            n = st.get("births", 0) + st.get("deaths", 0)
            if n != seen:
                seen, last = n, time.monotonic()
            elif seen and time.monotonic() - last > 0.5:
                online = [r.device_id for r in self.fm.online_devices()]
                if (not telemetry or all(self.fm.latest_telemetry(d) for d in online)) and len(online) >= expect:
                    return
            time.sleep(0.05)

    def close(self) -> None:
        self.fm.stop()
        self.transport.close(timeout=2.0)
        self.store.close()
        if self._operator_lock is not None:  # the operator session user is free for the next command
            self._operator_lock.close()
            self._operator_lock = None


class _StateReader:
    """The gateway's state (``--state``), opened read-only: never created, never written. A
    file (SQLite) or a ``postgresql://`` URL ([store] url): a read-only session on its schema."""

    def __init__(self, path: str) -> None:
        import sqlite3
        from pathlib import Path
        from urllib.parse import quote

        from ..errors import ConfigError, StateError
        from ..gateway.store import parse_store_url

        hint = ("--state is the gateway's state: its file ([gateway] state) or its [store] url in gateway.toml; "
                "it is only read, never created")
        try:
            target = parse_store_url(path)
        except ConfigError as exc:
            raise ConfigError(f"--state: {exc}") from None
        self.path, self._pg = target.display or path, target.engine == "postgresql"
        if self._pg:
            self._db = self._open_postgres(target, hint)
            return
        p = Path(target.path)
        if not p.exists():
            raise StateError(f"--state {path}: no such file; {hint}")
        if not p.is_file():
            raise StateError(f"--state {path}: not a file; {hint}")
        try:
            with open(p, "rb") as fh:
                head = fh.read(16)
        except OSError as exc:
            raise StateError(f"--state {path}: cannot be read ({exc.strerror})") from None
        if head != b"SQLite format 3\x00":
            raise StateError(f"--state {path}: not an SQLite file, so not a gateway state; {hint}")
        try:
            self._db = sqlite3.connect(f"file:{quote(str(p.resolve()))}?mode=ro", uri=True, check_same_thread=False)
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.Error as exc:
            raise StateError(f"--state {path}: cannot be read as SQLite ({exc})") from None
        if not {"devices", "telemetry", "meta"} <= tables:
            self._db.close()
            raise StateError(f"--state {path}: an SQLite file but not a gateway state (tables "
                             f"{sorted(tables)[:5]}); {hint}")

    def _open_postgres(self, target: Any, hint: str) -> Any:
        """A read-only session (every transaction READ ONLY) on the URL's schema; nothing is
        created: a schema without the gateway's tables is refused."""
        from ..errors import ConfigError, StateError
        from ..gateway.store.postgres import DEFAULT_SCHEMA

        try:
            import psycopg
        except ImportError:
            raise ConfigError("--state postgresql://... needs the psycopg 3 driver: pip install "
                              "'edgeflow[postgres]'") from None
        schema = target.schema or DEFAULT_SCHEMA
        try:
            db = psycopg.connect(target.dsn, autocommit=True, connect_timeout=10,
                                 application_name="edgeflow-fleet-status")
        except psycopg.Error as exc:
            raise StateError(f"--state {self.path}: cannot connect to PostgreSQL ({' '.join(str(exc).split())[:300]}); "
                             "check that the server runs and the URL's host, port, user and database") from None
        try:
            db.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            tables = {r[0] for r in db.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema=%s", (schema,))}
            if not {"devices", "telemetry", "meta"} <= tables:
                raise StateError(f"--state {self.path}: schema {schema!r} holds no gateway state (tables "
                                 f"{sorted(tables)[:5]}); use the gateway's [store] url, with its ?schema=; {hint}")
            db.execute(f'SET search_path TO "{schema}"')
        except psycopg.Error as exc:
            db.close()
            raise StateError(f"--state {self.path}: cannot be read ({' '.join(str(exc).split())[:300]})") from None
        except BaseException:
            db.close()
            raise
        return db

    def _q(self, sql: str, args: tuple = ()) -> list:
        import sqlite3

        from ..errors import StateError

        if self._pg:
            import psycopg

            try:
                return self._db.execute(sql.replace("?", "%s"), args).fetchall()
            except psycopg.Error as exc:
                raise StateError(f"--state {self.path}: cannot be read ({' '.join(str(exc).split())[:300]})") from None
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StateError(f"--state {self.path}: cannot be read ({exc})") from None

    def devices(self) -> list[Any]:
        from ..gateway.store import GatewayStore

        return [GatewayStore._device(r) for r in self._q(
            "SELECT device_id, profile, public_key, online, first_seen, last_seen, model_version, birth, bdseq "
            "FROM devices ORDER BY device_id")]

    def latest_telemetry(self, device_id: str) -> dict[str, Any] | None:
        rows = self._q("SELECT data FROM telemetry WHERE device_id=? ORDER BY ts DESC LIMIT 1", (device_id,))
        return json.loads(rows[0][0]) if rows else None

    def rounds_status(self) -> dict[str, Any] | None:
        rows = self._q("SELECT value FROM meta WHERE key='rounds_status'")
        try:
            return json.loads(rows[0][0]) if rows else None
        except ValueError:
            return None

    def close(self) -> None:
        self._db.close()


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


TRAIN_WORDS = {"training": "yes", "off": "off", "profile": "cannot", "no_data": "no data", "no_model": "no model",
               "quantized": "int8 only", "untrainable": "fails", "model_mismatch": "mismatch"}
"""The agent's train state (edgeflow.device.agent.TRAIN_STATES) as the table shows it."""


def _r(v: Any, nd: int) -> Any:
    return None if v is None else round(float(v), nd)


def _rows(source: Any, telemetry: Any) -> list[dict[str, Any]]:
    from ..gateway.fleet import train_reason, train_state

    rows = []
    now = time.time()
    for r in source.devices():
        t = telemetry(r.device_id) or {}
        trains, why = train_reason(r.birth, t) if r.online else (False, "offline")
        state = "training" if trains else (train_state(r.birth, t)[0]
                                           or ("profile" if not r.birth.get("can_train") else None))
        rows.append({
            "device": r.device_id, "profile": r.profile, "online": r.online, "model_version": r.model_version,
            "health": _health(r.online, r.model_version, t, r.birth.get("trust", "")),
            "train": state if r.online else None, "train_detail": why or None,
            "rounds_trained": (t.get("participant") or {}).get("rounds_trained"),
            "backend": r.birth.get("backend"), "trust": r.birth.get("trust", ""),
            "last_seen_s_ago": _r(max(0.0, now - max(r.last_seen, float(t.get("ts") or 0.0))), 1),
            "latency_p50_ms": _r(t.get("latency_p50_ms"), 3), "latency_p95_ms": _r(t.get("latency_p95_ms"), 3),
            "rss_bytes": t.get("rss_bytes"), "cpu_percent": _r(t.get("cpu_percent"), 1),
            "battery": _r(t.get("battery"), 3), "queue_depth": t.get("queue_depth"),
            "edgeflow": (r.birth.get("versions") or {}).get("edgeflow"),
        })
    return rows


def _print_table(rows: list[dict[str, Any]], rounds: dict[str, Any] | None) -> None:
    from ._common import console, fit_table, human_bytes

    c = console()
    cols = [("device", 0, "left"), ("profile", 3, "left"), ("health", 0, "left"), ("model", 0, "left"),
            ("trains", 1, "left"), ("backend", 4, "left"), ("p50/p95 ms", 2, "right"), ("RSS", 5, "right"),
            ("CPU %", 6, "right"), ("battery", 7, "right"), ("seen", 4, "right"), ("key", 8, "left")]
    cells = []
    for r in rows:
        lat = "-" if r["latency_p50_ms"] is None else f"{r['latency_p50_ms']:.2f}/{r['latency_p95_ms']:.2f}"
        cells.append([
            _shown(r["device"]), _shown(r["profile"] or "-"), _shown(r["health"]),
            "-" if r["model_version"] is None else f"v{_shown(r['model_version'])}",
            _shown(TRAIN_WORDS.get(r["train"] or "", r["train"] or "-")), _shown(r["backend"] or "-"), lat,
            human_bytes(r["rss_bytes"]) if r["rss_bytes"] else "-",
            "-" if r["cpu_percent"] is None else f"{r['cpu_percent']:.1f}",
            "-" if r["battery"] is None else f"{100 * r['battery']:.0f}%",
            f"{r['last_seen_s_ago']:.0f}s", _shown(r["trust"] or "-"),
        ])
    title = f"{len(rows)} device(s), {sum(r['online'] for r in rows)} online"
    c.print(fit_table(title, cols, cells, c.width))
    why: dict[str, list[str]] = {}
    for r in rows:
        if r["online"] and r["train"] != "training" and r["train_detail"]:
            why.setdefault(r["train_detail"], []).append(r["device"])
    for detail, ids in sorted(why.items()):
        c.print(f"not training: {', '.join(_shown(d) for d in ids)}: {_shown(detail)}")
    if rounds:
        c.print(f"rounds: {_shown(rounds.get('state'))}: {_shown(rounds.get('reason', ''))}")


def _share(text: str, what: str, *, count: bool = False) -> float:
    """``'10%'``, ``0.1`` -> 0.1; with ``count``, a whole number >= 1 is a device count."""
    from ..errors import ConfigError

    s = str(text).strip()
    try:
        v = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        v = float("nan")
    if count and not s.endswith("%") and v >= 1 and v.is_integer():
        return v
    ok = 0 < v <= 1 if count else 0 <= v <= 1
    if not ok:
        kind = ("a share in (0%, 100%] like '10%' or 0.1, or a whole device count like 2" if count
                else "a share from 0% to 100%, like '20%' or 0.2")
        raise ConfigError(f"{what} {text!r} is not {kind}")
    return v


# ------------------------------------------------------------------ commands


def cmd_status(args) -> int:
    import sys

    from ..errors import ConfigError
    from ._common import emit_json

    if args.expect is not None and (args.expect < 0 or args.state):
        raise ConfigError("--expect N needs N >= 0 and listens to the broker (not with --state)")
    rounds = None
    if args.state:
        reader = _StateReader(args.state)
        try:
            rows = _rows(reader, reader.latest_telemetry)
            rounds = reader.rounds_status()
        finally:
            reader.close()
    else:
        s = _Session(args, purpose="status", telemetry=True, expect=args.expect or 0)
        try:
            rows = _rows(s.fm, s.fm.latest_telemetry)
        finally:
            s.close()
    if args.json:
        emit_json({"devices": rows, **({"rounds": rounds} if args.state else {})})
    else:
        _print_table(rows, rounds)
    online = sum(1 for r in rows if r["online"])
    if args.expect is not None and online < args.expect:
        print(f"edgeflow fleet status: {online} device(s) online after {args.wait:g} s, --expect {args.expect}; "
              "are the boards running `edgeflow device`? (raise --wait if they are slow to connect)", file=sys.stderr)
        return 1
    return 0


def _load_array(path: str | None, flag: str):
    if not path:
        return None
    from ._common import load_arrays

    return load_arrays(path)


def _check_deploy_args(args) -> tuple[bytes, Any, Any, Any]:
    """Everything about a deploy that can be checked before connecting: the numbers, the target
    selector, the model and the arrays. Returns (model bytes, policy, calibration, golden)."""
    from pathlib import Path

    from ..errors import ConfigError
    from ..gateway.ota import RolloutPolicy, parse_selector
    from ..runtime.model import load_model

    parse_selector(args.to)
    canary = _share(args.canary, "--canary", count=True)
    threshold = _share(args.threshold, "--threshold")
    for flag, v, ok in (("--timeout", args.timeout, args.timeout > 0), ("--atol", args.atol, args.atol >= 0),
                        ("--rtol", args.rtol, args.rtol >= 0),
                        ("--latency-budget-ms", args.latency_budget_ms, args.latency_budget_ms > 0),
                        ("--wave-size", args.wave_size, args.wave_size is None or args.wave_size >= 1),
                        ("--min-canaries", args.min_canaries, args.min_canaries >= 1),
                        ("--version", args.version, args.version is None or args.version >= 0)):
        if not ok:
            raise ConfigError(f"{flag} {v}: out of range (timeouts and budgets > 0, tolerances >= 0, "
                              "--wave-size and --min-canaries >= 1, --version >= 0)")
    if args.calibration and not args.quantize:
        raise ConfigError("--calibration is only used with --quantize; add --quantize or drop --calibration")
    if args.quantize and not args.calibration:
        raise ConfigError("--quantize needs --calibration SAMPLES.npy (a few hundred representative inputs, "
                          ".npy or .npz): int8 needs them, and without them the model would ship unquantized")
    path = Path(args.model)
    if not path.is_file():
        raise ConfigError(f"model file not found: {args.model}")
    load_model(str(path))  # a file that is not an ONNX model is one line here, not after connecting
    model = path.read_bytes()
    policy = RolloutPolicy(canary=canary, wave_size=args.wave_size, failure_threshold=threshold,
                           min_canaries=args.min_canaries,
                           report_timeout_s=args.timeout, revert_on_halt=args.revert_on_halt,
                           allow_downgrade=args.allow_downgrade)
    return model, policy, _load_array(args.calibration, "--calibration"), _load_array(args.golden, "--golden")


def cmd_deploy(args) -> int:
    from pathlib import Path

    from ..errors import FleetError
    from ..gateway.ota import Rollout, build_artifacts, profile_problem, select_devices
    from ._common import console, emit_json

    model, policy, calibration, golden = _check_deploy_args(args)
    s = _Session(args, purpose="deploy")
    try:
        targets = select_devices(s.fm.devices(), args.to, online=None if args.include_offline else s.fm.is_online)
        if not targets:
            raise FleetError(f"no {'known' if args.include_offline else 'online'} device matches --to {args.to!r} "
                             "(see `edgeflow fleet status`)")
        # The profile is the device's claim: an invalid name (a path) or one unknown here skips that device
        # (the Rollout reports it "skipped" with the reason); the rest of the rollout goes on.
        skipped = {r.device_id: why for r in targets if (why := profile_problem(r.profile)) is not None}
        deployable = [r for r in targets if r.device_id not in skipped]
        if not deployable:
            raise FleetError(f"none of the {len(targets)} device(s) matching --to {args.to!r} claims a profile an "
                             "artifact can be built for: " + "; ".join(f"{d}: {why}" for d, why in
                                                                      sorted(skipped.items())[:5]))
        version = args.version
        if version is None:
            known = [r.model_version for r in s.fm.devices() if r.model_version is not None]
            version = max(known, default=0) + 1
        notes: list[str] = []
        masters: dict[str, bytes] | None = None if args.no_train_master else {}
        artifacts = build_artifacts(
            model, {r.profile for r in deployable}, s.fleet_dir.fleet_key(), version=version, fleet=s.fleet_dir.fleet,
            name=Path(args.model).stem, quantize=args.quantize, calibration=calibration,
            golden_inputs=golden, atol=args.atol, rtol=args.rtol,
            latency_budget_ms=args.latency_budget_ms, notes=notes, masters=masters,
        )
        if args.quantize and args.no_train_master:
            notes.append("no fp32 training masters (--no-train-master): boards on the quantized model do not take "
                         "part in federated rounds")
        c = console(stderr=True)
        for n in notes:
            c.print(f"  {_shown(n)}")
        if skipped and not args.json:
            c.print(f"skipping {len(skipped)} device(s) whose profile no artifact can be built for:")
            for d, why in sorted(skipped.items()):
                c.print(f"  {_shown(d)}: {_shown(why)}")
        if not args.json:
            c.print(f"deploying v{version} to {len(deployable)} device(s) ({_shown(', '.join(sorted(artifacts)))})")

        def progress(rep, r) -> None:
            if not args.json:
                c.print(f"  wave {r.wave}: {_shown(r.device_id):<20} {_shown(r.state):<9} {_shown(r.error)}")

        report = Rollout(s.fm, artifacts, targets, policy, on_progress=progress, masters=masters).run()
    finally:
        s.close()
    out = report.to_dict()
    out["notes"] = notes
    out["skipped"] = skipped
    if args.json:
        emit_json(out)
    else:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts().items()))
        console().print(f"rollout of v{version}: [bold]{_shown(report.state)}[/] ({_shown(counts)}; failure rate "
                        f"{report.failure_rate:.0%})" + (f"\n  {_shown(report.halted_reason)}"
                                                         if report.halted_reason else ""))
    return 0 if report.state == "completed" and report.failure_rate == 0 else 1


def cmd_rollback(args) -> int:
    from ..errors import ConfigError, FleetError
    from ..gateway.ota import select_devices
    from ._common import console, emit_json

    if not args.devices and not args.to:
        raise ConfigError("name the devices to roll back, or give --to SELECTOR")
    s = _Session(args, purpose="rollback")
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
            state = "[green]ok[/]" if a["ok"] else f"[red]{_shown(a['code'])}[/]"
            c.print(f"{_shown(d)}: {state} v{_shown(a['result'].get('model_version'))} {_shown(a.get('error', ''))}")
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
    s = _Session(args, purpose="cmd")
    try:
        ack = s.fm.command(args.device, args.name, cmd_args, timeout_s=args.timeout)
    finally:
        s.close()
    if args.json:
        emit_json(ack.to_dict())
    else:
        c = console()
        if ack.ok:
            c.print(f"{_shown(ack.device)}: {_shown(ack.name)} [green]ok[/]")
            c.print_json(json.dumps(ack.result, default=str), ensure_ascii=True)  # every control/bidi char escaped
        else:
            c.print(f"{_shown(ack.device)}: {_shown(ack.name)} [red]{_shown(ack.code)}[/]: {_shown(ack.error)}")
    return 0 if ack.ok else 1


def _check_profile(name: str) -> None:
    """A provisioned board's profile must be one every agent knows by name (it is stored, then used on the board)."""
    import difflib

    from ..errors import ConfigError
    from ..profiles import list_profiles

    known = list_profiles()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.4)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"--profile {name!r} is not a known board profile; {hint}known: {', '.join(known)} "
                          "(`edgeflow profile list`)")


def cmd_provision(args) -> int:
    from ..transport.url import parse_broker_url
    from ._common import console, emit_json

    fd = _fleet_dir(args)
    if args.broker:
        parse_broker_url(args.broker)  # a bad URL is refused before anything is written
    if args.profile is not None:
        _check_profile(args.profile)
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


def cmd_revoke(args) -> int:
    from ._common import console, emit_json

    fd = _fleet_dir(args)
    rec = fd.revoke(args.device)
    files = fd.write_broker_config() if (fd.broker_dir / "mosquitto.conf").exists() else None
    out = {"device": args.device, **rec, "broker_config_updated": files is not None}
    if args.json:
        emit_json(out)
        return 0
    c = console()
    c.print(f"{args.device}: revoked; its key left {fd.keyring_path} (a running gateway refuses it within "
            "[fleet] keyring_reload_s, 5 s by default)")
    if rec.get("moved_to"):
        c.print(f"  its credentials moved to {rec['moved_to']}")
    if files is not None:
        c.print("broker password file and ACL rewritten without it: reload Mosquitto (kill -HUP <pid>) and, to cut "
                "a live session, restart it or disconnect the client")
    else:
        c.print("run `edgeflow broker-config` to write the broker configuration")
    return 0
