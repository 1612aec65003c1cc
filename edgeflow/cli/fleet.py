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
    d.add_argument("--state", help="record the finished rollout in the gateway's state (its existing SQLite file or "
                   "[store] url) instead of the fleet directory's rollouts.sqlite; there `fleet rollouts` and "
                   "`fleet status` can tell which global model version the artifact was built from")
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

    h = fs.add_parser("history", help="one device's history from the gateway's state: birth, telemetry, "
                      "artifact versions over time, rollouts, rounds",
                      description=_wrap("What the gateway's state recorded about DEVICE, read-only: its registry entry "
                      "and latest birth, the telemetry kept ([store] telemetry_keep rows, 500 by default), the "
                      "artifact versions it ran over that time, the rollouts that offered it one (recorded by "
                      "`fleet deploy`, in the gateway's state or the fleet directory), and the rounds that selected "
                      "it. The output ends with what is not recorded."),
                      epilog="examples:\n  edgeflow fleet history cam-1 --state gateway.sqlite\n"
                      "  edgeflow fleet history cam-1 --config gateway.toml --last 50 --json",
                      formatter_class=_raw_formatter())
    h.add_argument("device", help="the device id (as `fleet status` lists it)")
    _state_args(h)
    h.add_argument("--dir", default=None, help="fleet directory whose rollouts.sqlite also holds rollouts (default "
                   "$EDGEFLOW_FLEET_DIR or ./fleet, when it exists)")
    h.add_argument("--last", type=int, default=10, metavar="N", help="telemetry rows to list, newest last (default "
                   "10; every kept row is counted and used for the version history)")
    h.add_argument("--json", action="store_true", help="print only JSON on stdout")
    h.set_defaults(func=cmd_history)

    ro = fs.add_parser("rollouts", help="the OTA rollouts `fleet deploy` recorded: artifact, source model, outcome",
                       description=_wrap("Every rollout `edgeflow fleet deploy` finished (completed or halted), oldest "
                       "first: the artifact version it shipped and, with the gateway's state (--state/--config), the "
                       "global model version it was built from (\"artifact v2 (= model v4)\": matched by the "
                       "model's SHA-256), the targets, canary and waves, per-state device counts, failure rate and "
                       "why it halted. Read from the fleet directory's rollouts.sqlite and from the gateway's state "
                       "(where `fleet deploy --state` records them)."),
                       epilog="examples:\n  edgeflow fleet rollouts --dir fleet\n"
                       "  edgeflow fleet rollouts --dir fleet --state gateway.sqlite --last 3\n"
                       "  edgeflow fleet rollouts --config gateway.toml --json",
                       formatter_class=_raw_formatter())
    _state_args(ro, required=False)
    ro.add_argument("--dir", default=None, help="fleet directory (default $EDGEFLOW_FLEET_DIR or ./fleet): its "
                    "rollouts.sqlite is where `fleet deploy` records rollouts without --state")
    ro.add_argument("--last", type=int, metavar="N", help="only the newest N rollouts")
    ro.add_argument("--json", action="store_true", help="print only JSON on stdout")
    ro.set_defaults(func=cmd_rollouts)

    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _wrap(text: str) -> str:
    import textwrap

    return textwrap.fill(text, 100)


def _raw_formatter():
    import argparse

    return argparse.RawDescriptionHelpFormatter


def _state_args(p, *, required: bool = True) -> None:
    need = "" if required else " (optional: adds the global model versions)"
    p.add_argument("--state", help="the gateway's state: its SQLite file ([gateway] state) or [store] url, read-only"
                   + need)
    p.add_argument("--config", "-c", metavar="GATEWAY_TOML", help="read the state gateway.toml names ([gateway] "
                   "state or [store] url) instead of --state")


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
        from ..transport.factory import transport_from_url
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
        self.transport = transport_from_url(url, **kwargs)
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

    def __init__(self, path: Any, *, flag: str = "--state", hint: str | None = None) -> None:
        import sqlite3
        from pathlib import Path
        from urllib.parse import quote

        from ..errors import ConfigError, StateError
        from ..gateway.store import StoreTarget, parse_store_url

        hint = hint or ("--state is the gateway's state: its file ([gateway] state) or its [store] url in "
                        "gateway.toml; it is only read, never created")
        if isinstance(path, StoreTarget):  # from gateway.toml (--config): its [gateway] state or [store] url
            target = path
            path = target.display or target.path
        else:
            try:
                target = parse_store_url(path)
            except ConfigError as exc:
                raise ConfigError(f"{flag}: {exc}") from None
        self.path, self._pg, self._flag = target.display or path, target.engine == "postgresql", flag
        if self._pg:
            self._db = self._open_postgres(target, hint)
            return
        p = Path(target.path)
        if not p.exists():
            raise StateError(f"{flag} {path}: no such file; {hint}")
        if not p.is_file():
            raise StateError(f"{flag} {path}: not a file; {hint}")
        try:
            with open(p, "rb") as fh:
                head = fh.read(16)
        except OSError as exc:
            raise StateError(f"{flag} {path}: cannot be read ({exc.strerror})") from None
        if head != b"SQLite format 3\x00":
            raise StateError(f"{flag} {path}: not an SQLite file, so not a gateway state; {hint}")
        try:
            self._db = sqlite3.connect(f"file:{quote(str(p.resolve()))}?mode=ro", uri=True, check_same_thread=False)
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.Error as exc:
            raise StateError(f"{flag} {path}: cannot be read as SQLite ({exc})") from None
        self.tables = tables
        if not {"devices", "telemetry", "meta"} <= tables:
            self._db.close()
            raise StateError(f"{flag} {path}: an SQLite file but not a gateway state (tables "
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
            raise StateError(f"{self._flag} {self.path}: cannot connect to PostgreSQL ({' '.join(str(exc).split())[:300]}); "
                             "check that the server runs and the URL's host, port, user and database") from None
        try:
            db.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            tables = {r[0] for r in db.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema=%s", (schema,))}
            if not {"devices", "telemetry", "meta"} <= tables:
                raise StateError(f"{self._flag} {self.path}: schema {schema!r} holds no gateway state (tables "
                                 f"{sorted(tables)[:5]}); use the gateway's [store] url, with its ?schema=; {hint}")
            db.execute(f'SET search_path TO "{schema}"')
            self.tables = tables
        except psycopg.Error as exc:
            db.close()
            raise StateError(f"{self._flag} {self.path}: cannot be read ({' '.join(str(exc).split())[:300]})") from None
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
                raise StateError(f"{self._flag} {self.path}: cannot be read ({' '.join(str(exc).split())[:300]})") from None
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StateError(f"{self._flag} {self.path}: cannot be read ({exc})") from None

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

    # -- history (edgeflow rounds, fleet history, fleet rollouts): read as stored, never migrated --------
    def rounds(self) -> list[Any]:
        from ..gateway.store import GatewayStore

        if "rounds" not in self.tables:
            return []
        return [GatewayStore._round(r) for r in self._q(f"SELECT {GatewayStore._ROUND_COLS} FROM rounds "
                                                         "ORDER BY round_id")]

    def models(self) -> list[dict[str, Any]]:
        """The gateway's global model versions (no weights): version, created, sha256, size, round_id."""
        if "models" not in self.tables:
            return []
        return [{"version": int(r[0]), "created": float(r[1]), "sha256": r[2], "size": int(r[3]),
                 "round_id": None if r[4] is None else int(r[4])}
                for r in self._q("SELECT version, created, sha256, size, round_id FROM models ORDER BY version")]

    def model_onnx(self, version: int) -> bytes | None:
        rows = self._q("SELECT onnx FROM models WHERE version=?", (int(version),))
        return bytes(rows[0][0]) if rows else None

    def rollouts(self) -> list[dict[str, Any]] | None:
        """The recorded rollouts, oldest first; None when the state predates the table (schema < 4)."""
        from ..gateway.store import GatewayStore

        if "rollouts" not in self.tables:
            return None
        return [GatewayStore.rollout_row(r) for r in self._q(f"SELECT {GatewayStore._ROLLOUT_COLS} FROM rollouts "
                                                              "ORDER BY started, rollout_id")]

    def device(self, device_id: str) -> Any:
        from ..gateway.store import GatewayStore

        rows = self._q("SELECT device_id, profile, public_key, online, first_seen, last_seen, model_version, birth, "
                       "bdseq FROM devices WHERE device_id=?", (device_id,))
        return GatewayStore._device(rows[0]) if rows else None

    def telemetry(self, device_id: str, limit: int | None = None) -> list[tuple[float, dict[str, Any]]]:
        """The device's stored telemetry, oldest first (the newest ``limit`` rows)."""
        sql = "SELECT ts, data FROM telemetry WHERE device_id=? ORDER BY ts DESC"
        rows = self._q(sql + (" LIMIT ?" if limit is not None else ""),
                       (device_id, int(limit)) if limit is not None else (device_id,))
        out = []
        for ts, data in reversed(rows):
            try:
                d = json.loads(data)
            except ValueError:
                continue
            out.append((float(ts), d if isinstance(d, dict) else {}))
        return out

    def close(self) -> None:
        self._db.close()


def state_reader(args: Any) -> _StateReader:
    """The gateway's state named by ``--state`` or by ``--config gateway.toml`` (its [gateway] state or
    [store] url), opened read-only; one line when neither or both are given."""
    from ..errors import ConfigError

    state, config = getattr(args, "state", None), getattr(args, "config", None)
    if state and config:
        raise ConfigError("give --state or --config, not both (--config reads [gateway] state or [store] url "
                          "from gateway.toml)")
    if config:
        from ..gateway.service import load_config

        return _StateReader(load_config(config).store_target(), flag=f"--config {config}: state",
                            hint=f"has `edgeflow gateway --config {config}` run yet? ([gateway] state or [store] url "
                            "names the state; it is only read, never created)")
    if not state:
        raise ConfigError("which gateway? give --state gateway.sqlite (the gateway's [gateway] state file, or its "
                          "[store] url) or --config gateway.toml")
    return _StateReader(state)


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


def _add_versions(rows: list[dict[str, Any]], mapping: dict[int, dict[str, Any]]) -> None:
    """Name the device's version for what it is: ``artifact_version`` (the OTA artifact it runs, the same number
    as its ``model_version`` field, kept for scripts) and ``artifact_model_version`` (the gateway's global model
    that artifact was built from, when a recorded rollout says so)."""
    for r in rows:
        v = r["model_version"]
        r["artifact_version"] = v
        r["artifact_model_version"] = (mapping.get(v) or {}).get("model_version") if isinstance(v, int) else None


def _versions_line(rows: list[dict[str, Any]], models: list[dict[str, Any]] | None,
                   mapping: dict[int, dict[str, Any]]) -> str | None:
    """``gateway: global model v4 (round 3); devices run artifact v1 (= model v1) on 2``: the three counters."""
    from ._history import global_model_line

    parts = []
    if models is not None:
        parts.append(f"gateway: global {global_model_line(models)}" if models else "gateway: no global model yet")
    runs: dict[Any, int] = {}
    for r in rows:
        if r["model_version"] is not None:
            runs[r["model_version"]] = runs.get(r["model_version"], 0) + 1
    if runs:
        parts.append("devices run " + ", ".join(f"{_artifact_words(v, mapping)} on {n}" for v, n in
                                                  sorted(runs.items(), key=lambda kv: str(kv[0]))))
    return "; ".join(parts) or None


def _print_table(rows: list[dict[str, Any]], rounds: dict[str, Any] | None, versions: str | None = None) -> None:
    from ._common import console, fit_table, human_bytes

    c = console()
    cols = [("device", 0, "left"), ("profile", 3, "left"), ("health", 0, "left"), ("artifact", 0, "left"),
            ("trains", 1, "left"), ("backend", 4, "left"), ("p50/p95 ms", 2, "right"), ("RSS", 5, "right"),
            ("CPU %", 6, "right"), ("battery", 7, "right"), ("seen", 4, "right"), ("key", 8, "left")]
    cells = []
    for r in rows:
        lat = "-" if r["latency_p50_ms"] is None and r["latency_p95_ms"] is None else "/".join(
            "-" if v is None else f"{v:.2f}" for v in (r["latency_p50_ms"], r["latency_p95_ms"]))
        cells.append([
            _shown(r["device"]), _shown(r["profile"] or "-"), _shown(r["health"]),
            "-" if r["model_version"] is None else f"v{_shown(r['model_version'])}" + (
                "" if r.get("artifact_model_version") is None else f" (= model v{r['artifact_model_version']})"),
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
    if versions:
        c.print(versions)


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
    models: list[dict[str, Any]] | None = None
    if args.state:
        reader = _StateReader(args.state)
        try:
            rows = _rows(reader, reader.latest_telemetry)
            rounds = reader.rounds_status()
            models = reader.models()
            rollouts, _ = _rollouts_from(args, reader, strict=False)
            _match_models(rollouts, models, reader)
        finally:
            reader.close()
    else:
        s = _Session(args, purpose="status", telemetry=True, expect=args.expect or 0)
        try:
            rows = _rows(s.fm, s.fm.latest_telemetry)
        finally:
            s.close()
        rollouts, _ = _rollouts_from(args, None, strict=False)
    mapping = _artifact_models(rollouts, models or [])
    _add_versions(rows, mapping)
    if args.json:
        gm = None if not models else {"model_version": models[-1]["version"], "round": models[-1]["round_id"]}
        emit_json({"devices": rows, **({"rounds": rounds, "global_model": gm} if args.state else {})})
    else:
        _print_table(rows, rounds, _versions_line(rows, models, mapping))
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
    from ..gateway.ota import Rollout
    from ._common import console, emit_json

    model, policy, calibration, golden = _check_deploy_args(args)
    _check_record_target(args)
    s = _Session(args, purpose="deploy")
    try:
        targets, deployable, skipped = _deploy_targets(s, args)
        version = args.version
        if version is None:
            known = [r.model_version for r in s.fm.devices() if r.model_version is not None]
            version = max(known, default=0) + 1
        notes: list[str] = []
        masters: dict[str, bytes] | None = None if args.no_train_master else {}
        artifacts = _deploy_artifacts(s, args, model, deployable, version, calibration, golden, notes, masters)
        c = console(stderr=True)
        _say_deploy_plan(c, args, notes, skipped, version, deployable, artifacts)

        def progress(rep, r) -> None:
            if not args.json:
                c.print(f"  wave {r.wave}: {_shown(r.device_id):<20} {_shown(r.state):<9} {_shown(r.error)}")

        report = Rollout(s.fm, artifacts, targets, policy, on_progress=progress, masters=masters).run()
    finally:
        s.close()
    out = report.to_dict()
    out["notes"] = notes
    out["skipped"] = skipped
    _record_deploy(args, out, model)
    if args.json:
        emit_json(out)
    else:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts().items()))
        console().print(f"rollout of artifact v{version}: [bold]{_shown(report.state)}[/] ({_shown(counts)}; failure "
                        f"rate {report.failure_rate:.0%})" + (f"\n  {_shown(report.halted_reason)}"
                                                              if report.halted_reason else ""))
        if out["recorded_in"]:
            console().print(f"recorded in {_shown(out['recorded_in'])}: `edgeflow fleet rollouts` lists it")
    return 0 if report.state == "completed" and report.failure_rate == 0 else 1


def _deploy_targets(s, args) -> tuple[list, list, dict[str, str]]:
    """The devices ``--to`` selects, those an artifact can be built for, and why the others are skipped."""
    from ..errors import FleetError
    from ..gateway.ota import profile_problem, select_devices

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
    return targets, deployable, skipped


def _deploy_artifacts(s, args, model: bytes, deployable: list, version: int, calibration, golden,
                      notes: list[str], masters: dict[str, bytes] | None) -> dict:
    """One signed artifact per profile of the deployable devices (quantized for it with ``--quantize``)."""
    from pathlib import Path

    from ..gateway.ota import build_artifacts

    artifacts = build_artifacts(
        model, {r.profile for r in deployable}, s.fleet_dir.fleet_key(), version=version, fleet=s.fleet_dir.fleet,
        name=Path(args.model).stem, quantize=args.quantize, calibration=calibration,
        golden_inputs=golden, atol=args.atol, rtol=args.rtol,
        latency_budget_ms=args.latency_budget_ms, notes=notes, masters=masters,
    )
    if args.quantize and args.no_train_master:
        notes.append("no fp32 training masters (--no-train-master): boards on the quantized model do not take "
                     "part in federated rounds")
    return artifacts


def _say_deploy_plan(c, args, notes: list[str], skipped: dict[str, str], version: int, deployable: list,
                     artifacts: dict) -> None:
    """The build's notes, the devices skipped and why, and what is about to be deployed (on stderr)."""
    for n in notes:
        c.print(f"  {_shown(n)}")
    if skipped and not args.json:
        c.print(f"skipping {len(skipped)} device(s) whose profile no artifact can be built for:")
        for d, why in sorted(skipped.items()):
            c.print(f"  {_shown(d)}: {_shown(why)}")
    if not args.json:
        c.print(f"deploying artifact v{version} to {len(deployable)} device(s) "
                f"({_shown(', '.join(sorted(artifacts)))})")


def _record_deploy(args, out: dict, model: bytes) -> None:
    """The rollout into the record (``out["recorded_in"]``): it happened whatever the record does, so a
    failed record is one line on stderr, not the exit code."""
    import hashlib
    from pathlib import Path

    from ..errors import StateError
    from ._common import console

    try:
        out["source"] = {"file": Path(args.model).name, "sha256": hashlib.sha256(model).hexdigest(),
                         "weights_sha256": weights_fingerprint(model)}
        out["recorded_in"] = _record_rollout(args, out, source_sha256=out["source"]["sha256"],
                                             name=Path(args.model).name)
    except StateError as exc:
        out["recorded_in"] = None
        console(stderr=True).print(f"edgeflow fleet deploy: warning: the rollout was not recorded: {_shown(exc)}")


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
            c.print(f"{_shown(d)}: {state} runs artifact v{_shown(a['result'].get('model_version'))} "
                    f"{_shown(a.get('error', ''))}")
    return 0 if all(a["ok"] for a in results.values()) else 1


def cmd_cmd(args) -> int:
    from ..errors import ConfigError
    from ._common import console, emit_json, parse_key_values

    cmd_args = parse_key_values(args.kv, "fleet cmd")
    if args.args:
        try:
            extra = json.loads(args.args)
        except ValueError as exc:
            raise ConfigError(f"--args is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ConfigError("--args must be a JSON object")
        cmd_args.update(extra)
    known = _fleet_dir(args).devices()
    if args.device not in known:  # one line now, not a 30 s wait for an ack that cannot come
        import difflib

        close = difflib.get_close_matches(args.device, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"device '{_shown(args.device)}' is not provisioned in this fleet; {hint}"
                          "`edgeflow fleet status` lists the devices, `edgeflow fleet provision` adds one")
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


# ------------------------------------------------------------------ history: rollouts and one device
#
# Three version counters, named apart in every line below: the gateway's global model ("model vN", one
# more per round that produces a model), the OTA artifact `fleet deploy` ships ("artifact vN", what a
# device runs and reports as its model_version), and the mapping between them, which only a recorded
# rollout knows: the SHA-256 of the model an artifact was built from, matched against the gateway's models.

ROLLOUT_LOG = "rollouts.sqlite"
"""Where `fleet deploy` records a rollout without --state: a gateway-format state in the fleet directory."""


def _fleet_log_path(dir_arg: str | None, *, must_exist: bool = False) -> Any:
    """The fleet directory's rollout log (a Path), or None when there is no fleet directory there."""
    from pathlib import Path

    from ..errors import ConfigError
    from .broker_config import fleet_dir_arg

    d = Path(fleet_dir_arg(dir_arg)).expanduser()
    if not (d / "fleet.json").is_file():
        if must_exist or dir_arg:
            raise ConfigError(f"--dir {d}: not a fleet directory (no fleet.json); give the one `edgeflow "
                              "broker-config --dir` made")
        return None
    return d / ROLLOUT_LOG


def _record_rollout(args: Any, out: dict[str, Any], *, source_sha256: str, name: str) -> str:
    """Store the finished rollout's report in one transaction: in the gateway's state (``--state``) or the
    fleet directory's rollout log. Returns where (for the message); raises StateError when it cannot."""
    import secrets

    from ..gateway.store import GatewayStore

    target = args.state or str(_fleet_log_path(args.dir, must_exist=True))
    store = GatewayStore(target, check=False)
    try:
        rid = time.strftime("%Y%m%d-%H%M%S", time.gmtime(out.get("started") or time.time())) + \
            f"-{secrets.token_hex(3)}"
        store.add_rollout(out, rollout_id=rid, source_sha256=source_sha256, name=name, selector=args.to)
        return f"{store.path} (rollout {rid})"
    finally:
        store.close()


def _check_record_target(args: Any) -> None:
    """Before any device is touched: a --state that is a missing file is refused (a deploy never creates the
    gateway's state), and without --state the fleet directory must be one."""
    from pathlib import Path

    from ..errors import ConfigError, StateError
    from ..gateway.store import parse_store_url

    if not args.state:
        _fleet_log_path(args.dir, must_exist=True)
        return
    try:
        target = parse_store_url(args.state)
    except ConfigError as exc:
        raise ConfigError(f"--state: {exc}") from None
    if target.engine == "sqlite" and (target.path == ":memory:" or not Path(target.path).is_file()):
        raise StateError(f"--state {args.state}: no such file; a rollout is recorded in the gateway's existing "
                         "state (start the gateway first), or leave out --state to record it in the fleet directory")


def _rollouts_from(args: Any, reader: Any | None, *, strict: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """Recorded rollouts from the gateway's state (``reader``) and the fleet directory's log, merged by id,
    oldest first; with the places read. ``strict=False`` (status): a log that cannot be read is a warning
    on stderr, and the versions are shown without the mapping."""
    if not strict:
        from ..errors import EdgeflowError
        from ._common import console

        try:
            return _rollouts_from(args, reader)
        except EdgeflowError as exc:
            console(stderr=True).print(f"warning: rollouts not read, so artifacts are not mapped to global model "
                                       f"versions: {_shown(exc)}")
            return [], []
    found: dict[str, dict[str, Any]] = {}
    read: list[str] = []
    if reader is not None:
        rows = reader.rollouts()
        read.append(f"{reader.path}" + ("" if rows is not None else " (no rollouts table: an older state)"))
        for r in rows or []:
            found[r["rollout_id"]] = {**r, "recorded_in": reader.path}
    log = _fleet_log_path(getattr(args, "dir", None))
    if log is not None and log.is_file():
        fr = _StateReader(str(log), flag="rollout log")
        try:
            read.append(str(log))
            for r in fr.rollouts() or []:
                found.setdefault(r["rollout_id"], {**r, "recorded_in": str(log)})
        finally:
            fr.close()
    return sorted(found.values(), key=lambda r: (r["started"], r["rollout_id"])), read


def weights_fingerprint(onnx_bytes: bytes) -> str | None:
    """SHA-256 over a model's initializers (name, dtype, shape, values), or None when it does not parse.
    The gateway stores its initial model as loaded (re-serialized: other bytes than the file), so an artifact
    built from that file matches it by weights, not by the file's SHA-256."""
    import hashlib

    try:
        import onnx
        from onnx import numpy_helper

        m = onnx.load_model_from_string(bytes(onnx_bytes))
        h = hashlib.sha256()
        for t in sorted(m.graph.initializer, key=lambda t: t.name):
            a = numpy_helper.to_array(t)
            h.update(f"{t.name}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
        return h.hexdigest()
    except Exception as exc:  # noqa: BLE001 - a model that does not parse is simply not matched by weights
        logging.getLogger(__name__).debug("no weights fingerprint: %s", exc)
        return None


def _match_models(rollouts: list[dict[str, Any]], models: list[dict[str, Any]], reader: Any | None) -> None:
    """Give each rollout ``model``: the gateway's model it was built from (by SHA-256, or for the gateway's
    initial models, stored without a round, by weights), or None."""
    by_sha = {m["sha256"]: m for m in models}
    seeds: dict[str, dict[str, Any]] | None = None
    for r in rollouts:
        m = by_sha.get(r["source_sha256"])
        want = ((r.get("report") or {}).get("source") or {}).get("weights_sha256")
        if m is None and want and reader is not None and models:
            if seeds is None:
                seeds = {}
                for sm in models:
                    blob = reader.model_onnx(sm["version"]) if sm["round_id"] is None else None
                    fp = weights_fingerprint(blob) if blob else None
                    if fp:
                        seeds.setdefault(fp, sm)
            m = seeds.get(want)
        r["model"] = m


def _artifact_models(rollouts: list[dict[str, Any]], models: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """artifact version -> {"model_version", "round", "source_sha256", "name"} from the newest rollout of it
    (model_version None when that model is not one of the gateway's, or the gateway's state was not read)."""
    by_sha = {m["sha256"]: m for m in models}
    out: dict[int, dict[str, Any]] = {}
    for r in rollouts:  # oldest first: the newest rollout of a version wins
        m = r["model"] if "model" in r else by_sha.get(r["source_sha256"])
        out[r["artifact_version"]] = {"model_version": None if m is None else m["version"],
                                      "round": None if m is None else m["round_id"],
                                      "source_sha256": r["source_sha256"], "name": r["name"]}
    return out


def _artifact_words(version: Any, mapping: dict[int, dict[str, Any]]) -> str:
    """``artifact v2 (= model v4)``; ``artifact v1`` when the mapping is not known."""
    if version is None:
        return "no artifact"
    m = mapping.get(version) if isinstance(version, int) else None
    if m and m["model_version"] is not None:
        return f"artifact v{_shown(version)} (= model v{m['model_version']})"
    return f"artifact v{_shown(version)}"


def _rollout_row(r: dict[str, Any], mapping_models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rep = r["report"]
    m = r["model"] if "model" in r else mapping_models.get(r["source_sha256"])
    counts = rep.get("counts") if isinstance(rep.get("counts"), dict) else {}
    waves = rep.get("waves") if isinstance(rep.get("waves"), list) else []
    return {
        "rollout_id": r["rollout_id"], "artifact_version": r["artifact_version"],
        "model_version": None if m is None else m["version"], "model_round": None if m is None else m["round_id"],
        "source_sha256": r["source_sha256"], "name": r["name"], "targets": r["selector"], "state": r["state"],
        "started": round(r["started"], 3), "finished": None if r["finished"] is None else round(r["finished"], 3),
        "devices": len(rep.get("devices") or {}), "canary": len(waves[0]) if waves else 0, "waves": len(waves),
        "counts": counts, "failure_rate": rep.get("failure_rate"), "halted_reason": rep.get("halted_reason") or None,
        "skipped": sorted((rep.get("skipped") or {}).keys()) if isinstance(rep.get("skipped"), dict) else [],
        "recorded_in": r["recorded_in"],
    }


def cmd_rollouts(args) -> int:
    from ..errors import StateError
    from ._common import console, emit_json, fit_table
    from ._history import check_last, global_model_line, when

    check_last(args.last)
    reader = state_reader(args) if (args.state or args.config) else None
    try:
        rollouts, read = _rollouts_from(args, reader)
        models = reader.models() if reader is not None else []
        _match_models(rollouts, models, reader)
    finally:
        if reader is not None:
            reader.close()
    if not read:
        from .broker_config import fleet_dir_arg

        raise StateError(f"no rollouts recorded: no fleet directory at {fleet_dir_arg(args.dir)} and no --state; give "
                         "--dir FLEET_DIR (where `fleet deploy` records rollouts) or --state gateway.sqlite")
    total = len(rollouts)
    if args.last is not None:
        rollouts = rollouts[-args.last:]
    by_sha = {m["sha256"]: m for m in models}
    rows = [_rollout_row(r, by_sha) for r in rollouts]
    if args.json:
        emit_json({"read": read, "rollouts_recorded": total, "gateway_state_read": reader is not None,
                   "rollouts": rows})
        return 0
    c = console()
    c.print("rollouts from " + ", ".join(_shown(x) for x in read))
    if reader is not None and models:
        c.print(f"gateway: global {global_model_line(models)}")
    if not rows:
        c.print("no rollouts recorded yet (`edgeflow fleet deploy` records each one when it finishes)")
        return 0
    cells = []
    for r in rows:
        if r["model_version"] is not None:
            src = f"= model v{r['model_version']}"
        else:
            src = _shown(r["name"] or "-") + ("" if reader is None else " (not a gateway model)")
        counts = ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items()))
        fr = r["failure_rate"]
        cells.append([_shown(r["rollout_id"]), f"artifact v{r['artifact_version']}", src, _shown(r["state"]),
                      _shown(counts or "-"), "-" if not isinstance(fr, (int, float)) else f"{fr:.0%}",
                      f"{r['canary']}+{max(0, r['waves'] - 1)}", _shown(r["targets"] or "-"), when(r["started"])])
    cols = [("rollout", 3, "left"), ("artifact", 0, "left"), ("built from", 0, "left"), ("state", 0, "left"),
            ("devices", 1, "left"), ("failed", 2, "right"), ("canary+waves", 5, "right"), ("targets", 4, "left"),
            ("started", 3, "left")]
    title = f"the newest {len(rows)} of {total} rollout(s)" if total > len(rows) else f"{len(rows)} rollout(s)"
    c.print(fit_table(title, cols, cells, c.width))
    for r in rows:
        if r["halted_reason"]:
            c.print(f"rollout {_shown(r['rollout_id'])} (artifact v{r['artifact_version']}) halted: "
                    f"{_shown(r['halted_reason'])}")
    if reader is None:
        c.print("which global model each artifact was built from: add --state gateway.sqlite (or --config)")
    return 0


_TELEMETRY_FIELDS = ("model_version", "training", "train", "inferences", "inference_errors", "latency_p50_ms",
                     "latency_p95_ms", "rss_bytes", "cpu_percent", "battery", "queue_depth")

NOT_RECORDED = (
    "births before the latest one: the registry keeps only the newest birth (and its bdseq)",
    "telemetry older than the newest [store] telemetry_keep rows (500 by default) per device",
    "whether the device's update was aggregated in a given round: a round stores only its counts and the "
    "devices it selected (the device's own telemetry counts rounds_trained)",
    "rollouts run by other tools than `fleet deploy`, or deployed without recording (older edgeflow)",
)


def _version_spans(telemetry: list[tuple[float, dict[str, Any]]]) -> list[dict[str, Any]]:
    """[{"artifact_version", "from", "to", "reports"}]: the artifact versions the device reported, in order."""
    spans: list[dict[str, Any]] = []
    for ts, t in telemetry:
        v = t.get("model_version")
        v = v if isinstance(v, int) and not isinstance(v, bool) else None
        if spans and spans[-1]["artifact_version"] == v:
            spans[-1]["to"], spans[-1]["reports"] = round(ts, 3), spans[-1]["reports"] + 1
        else:
            spans.append({"artifact_version": v, "from": round(ts, 3), "to": round(ts, 3), "reports": 1})
    return spans


def _vword(v: Any) -> str:
    return "none" if v is None else f"v{_shown(v)}"


def cmd_history(args) -> int:
    from ..errors import ConfigError
    from ._common import emit_json

    if args.last < 0:
        raise ConfigError(f"--last {args.last}: give how many telemetry rows to list, 0 or more")
    h = _read_history(args)
    if args.json:
        emit_json(h.record())
        return 0
    h.print()
    return 0


class _History:
    """One device's history as the gateway's state holds it (``edgeflow fleet history``)."""

    def __init__(self, args, rec, telemetry, rounds, models, rollouts, read) -> None:
        self.device, self.last = args.device, args.last
        self.rec, self.telemetry, self.models, self.read = rec, telemetry, models, read
        self.mapping = _artifact_models(rollouts, models)
        self.spans = _version_spans(telemetry)
        for sp in self.spans:
            m = self.mapping.get(sp["artifact_version"]) if sp["artifact_version"] is not None else None
            sp["model_version"] = None if m is None else m["model_version"]
        self.offered = []
        for r in rollouts:
            d = (r["report"].get("devices") or {}).get(args.device)
            if isinstance(d, dict):
                self.offered.append(self._offer(r, d))
        self.selected = [r.round_id for r in rounds if isinstance(r.selected, list) and args.device in r.selected]
        last_t = telemetry[-1][1] if telemetry else {}
        self.part = last_t.get("participant") if isinstance(last_t.get("participant"), dict) else {}
        self.rows = [{"ts": round(ts, 3), **{k: t.get(k) for k in _TELEMETRY_FIELDS if k in t},
                      **({"rounds_trained": t["participant"].get("rounds_trained")}
                         if isinstance(t.get("participant"), dict) else {})}
                     for ts, t in (telemetry[-args.last:] if args.last else [])]

    @staticmethod
    def _offer(r: dict, d: dict) -> dict:
        """What one rollout offered the device, and what became of it."""
        return {"rollout_id": r["rollout_id"], "artifact_version": r["artifact_version"],
                "model_version": (r.get("model") or {}).get("version"),
                "started": round(r["started"], 3), "rollout_state": r["state"], "state": d.get("state"),
                "code": d.get("code") or None, "error": d.get("error") or None, "wave": d.get("wave"),
                "from_version": d.get("from_version"), "to_version": d.get("model_version"),
                "evidence": d.get("evidence") or None, "rolled_back": bool(d.get("rolled_back"))}

    def record(self) -> dict:
        """The ``--json`` document."""
        rec, telemetry, models, part = self.rec, self.telemetry, self.models, self.part
        return {
            "device": rec.device_id, "profile": rec.profile, "online": rec.online,
            "first_seen": round(rec.first_seen, 3), "last_seen": round(rec.last_seen, 3),
            "artifact_version": rec.model_version,
            "artifact_model_version": (self.mapping.get(rec.model_version) or {}).get("model_version")
            if rec.model_version is not None else None,
            "global_model_version": models[-1]["version"] if models else None,
            "birth": {"bdseq": rec.bdseq, "latest": rec.birth},
            "telemetry": {"kept": len(telemetry), "first": round(telemetry[0][0], 3) if telemetry else None,
                          "last": round(telemetry[-1][0], 3) if telemetry else None, "rows": self.rows},
            "artifact_versions": self.spans, "rollouts": self.offered,
            "rounds": {"selected_in": self.selected, "rounds_trained": part.get("rounds_trained"),
                       "last_round": part.get("last_round"), "last_loss": part.get("last_loss")},
            "rollouts_read_from": self.read, "not_recorded": list(NOT_RECORDED),
        }

    def print(self) -> None:
        """The history for a person: the device, its telemetry, artifact versions, rollouts and rounds."""
        from ._common import console
        from ._history import global_model_line, when

        c = console()
        rec, mapping, models = self.rec, self.mapping, self.models
        b = rec.birth if isinstance(rec.birth, dict) else {}
        c.print(f"[bold]{_shown(rec.device_id)}[/] ({_shown(rec.profile or '-')}): "
                f"{'online' if rec.online else 'offline'}, runs {_artifact_words(rec.model_version, mapping)}; "
                + (f"gateway: global {global_model_line(models)}" if models else "the gateway has no global model yet"))
        c.print(f"  registered {when(rec.first_seen)}, last seen {when(rec.last_seen)} (the state holds what the "
                "gateway saw while it ran)")
        c.print(f"  latest birth (bdseq {_shown(rec.bdseq)}): backend {_shown(b.get('backend') or '-')}, "
                f"edgeflow {_shown((b.get('versions') or {}).get('edgeflow') or '-')}, "
                f"can train {_shown(b.get('can_train'))}, trust {_shown(b.get('trust') or '-')}")
        self._print_telemetry(c)
        c.print("artifact versions over the kept telemetry:" if self.spans else "artifact versions: no telemetry kept")
        for sp in self.spans:
            v = "none" if sp["artifact_version"] is None else _artifact_words(sp["artifact_version"], mapping)
            c.print(f"  {when(sp['from'])} .. {when(sp['to'])}: {v} ({sp['reports']} report(s))")
        c.print(f"rollouts that offered it an artifact: {len(self.offered)}" + ("" if self.offered else " recorded"))
        for o in self.offered:
            err = f": {_shown(o['code'])} {_shown(o['error'] or '')}" if o["code"] and o["state"] != "ok" else ""
            c.print(f"  {when(o['started'])} rollout {_shown(o['rollout_id'])}: artifact v{o['artifact_version']} "
                    f"{_shown(o['state'])} ({_vword(o['from_version'])} -> {_vword(o['to_version'])}){err}")
        part = self.part
        c.print(f"rounds that selected it: {', '.join(map(str, self.selected)) if self.selected else 'none'}; it "
                f"reports rounds_trained {_shown(part.get('rounds_trained', '-'))}, last round "
                f"{_shown(part.get('last_round', '-'))}")
        c.print("not recorded: " + _shown("; ".join(NOT_RECORDED), 2000))

    def _print_telemetry(self, c) -> None:
        """How many reports are kept, and the last ``--last`` of them, one line each."""
        from ._common import human_bytes
        from ._history import when

        telemetry = self.telemetry
        c.print(f"telemetry: {len(telemetry)} report(s) kept" + (f", {when(telemetry[0][0])} .. "
                                                               f"{when(telemetry[-1][0])}" if telemetry else ""))
        for r in self.rows:
            lat = r.get("latency_p50_ms")
            av = r.get("model_version")
            c.print(f"  {when(r['ts'])}  {'no artifact' if av is None else f'artifact v{_shown(av)}'}  "
                    f"inferences {_shown(r.get('inferences', '-'))}  "
                    f"p50 {'-' if not isinstance(lat, (int, float)) else f'{lat:.2f} ms'}  "
                    f"RSS {human_bytes(r['rss_bytes']) if isinstance(r.get('rss_bytes'), int) else '-'}  "
                    f"train {_shown(r.get('train', '-'))}")


def _read_history(args) -> _History:
    """Everything the history shows, read from the state in one go (the device must be in the registry)."""
    from ..errors import FleetError
    from ..protocol.fleet import printable

    reader = state_reader(args)
    try:
        rec = reader.device(args.device)
        if rec is None:
            known = [r.device_id for r in reader.devices()]
            hint = (f"known: {printable(', '.join(known[:8]), 200)}{' ...' if len(known) > 8 else ''}" if known
                    else "the registry is empty (no device has announced itself to this gateway)")
            raise FleetError(f"device {printable(args.device, 80)!s} is not in the registry of {reader.path}; {hint} "
                             "(`edgeflow fleet status --state` lists them)")
        telemetry = reader.telemetry(args.device)
        rounds = reader.rounds()
        models = reader.models()
        rollouts, read = _rollouts_from(args, reader)
        _match_models(rollouts, models, reader)
    finally:
        reader.close()
    return _History(args, rec, telemetry, rounds, models, rollouts, read)
