"""Start an MQTT broker for demos and tests: Mosquitto, or amqtt embedded.

``start_broker(url)`` picks, in order: the broker at ``url`` if one is
given; else a private Mosquitto (when the binary is installed) on a free
loopback port; else amqtt running in a background thread of this process
(amqtt is a dev dependency). Every launcher returns an object with
``.url``, ``.kind``, ``.host``, ``.port``, ``.stop()`` and context-manager
support, waits until the port accepts connections before returning, and
removes its temporary files on stop (or at interpreter exit).

:class:`MosquittoBroker` writes a config file into a temporary directory
with the features the tests and demos need: password file (give ``users``
and it is generated), ACL file (give the text), TLS listener,
``message_size_limit``/``max_packet_size``, a websockets listener (plain,
or TLS with ``ws_tls=True``: the ``wss://`` devices behind HTTPS-only
firewalls use) and persistence (so :meth:`MosquittoBroker.restart` keeps sessions and queued
messages, as a production broker restart would).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeflow.errors import ConfigError, TransportError
from edgeflow.transport.url import parse_broker_url

__all__ = [
    "EmbeddedBroker",
    "ExternalBroker",
    "MosquittoBroker",
    "NatsServer",
    "find_nats_server",
    "TlsFiles",
    "find_mosquitto",
    "free_port",
    "mosquitto_password_hash",
    "start_broker",
    "wait_for_port",
]

log = logging.getLogger("edgeflow.transport.broker")

_MOSQUITTO_PATHS = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto")


_LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int | None:
    """The first port Linux hands out as a connection's source port, or None where it cannot be read."""
    try:
        return int(_LOCAL_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a broker this process starts.

    Below the kernel's ephemeral range where it can be read: a port the OS picks for ``bind(0)`` is an
    ephemeral one, and a broker restarted on it can find it taken by a connection's source port. Seen
    here: while a test's Mosquitto restarted, a client reconnecting to 127.0.0.1:34155 got 34155 as its
    own source port and connected to itself (TCP simultaneous open; paho read its own CONNECT back,
    "Unrecognised command 16"), and the broker's restart failed with "Address already in use"."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    if low is not None and low > 10_000:
        for port in random.sample(range(10_000, low), min(200, low - 10_000)):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float = 10.0, *, alive: Any = None) -> bool:
    """Poll until ``host:port`` accepts TCP connections; stop early if ``alive()`` turns False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        try:
            with socket.create_connection((host, port), timeout=0.25):
                return True
        except OSError:
            time.sleep(0.02)
    return False


def find_mosquitto() -> str | None:
    """Path of the mosquitto binary: PATH first, then the usual sbin directories."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for p in _MOSQUITTO_PATHS:
        if os.access(p, os.X_OK):
            return p
    return None


def mosquitto_password_hash(password: str, *, iterations: int = 101, salt: bytes | None = None) -> str:
    """A Mosquitto 2 password-file hash (``$7$``: PBKDF2-SHA512), like ``mosquitto_passwd`` writes."""
    salt = os.urandom(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, iterations, 64)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


@dataclass(frozen=True)
class TlsFiles:
    """Server side TLS for :class:`MosquittoBroker`.

    ``cafile`` is needed to verify client certificates; with
    ``require_certificate`` clients must present one signed by it.
    """

    certfile: str
    keyfile: str
    cafile: str | None = None
    require_certificate: bool = False


class _BrokerBase:
    kind = ""
    host = "127.0.0.1"
    port = 0
    protocol = "auto"
    """The ``protocol`` to give MqttTransport for this broker ("3.1.1" for amqtt)."""

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def stop(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError("need stop")

    def start(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError("need start")

    def __enter__(self) -> Any:
        return self.start()  # start() is a no-op when already running

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self.url}>"


class ExternalBroker(_BrokerBase):
    """A broker someone else runs; ``stop`` does nothing."""

    kind = "external"

    def __init__(self, url: str) -> None:
        self.address = parse_broker_url(url)
        self.host = self.address.host
        self.port = self.address.port
        self._url = url

    @property
    def url(self) -> str:
        return self._url

    @property
    def kind_of_server(self) -> str:
        """``nats`` for a NATS URL, else ``mqtt``."""
        return "nats" if self.address.is_nats else "mqtt"

    def start(self) -> ExternalBroker:
        return self

    def stop(self) -> None:
        pass


def _terminate(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGCONT)  # in case a test paused it
        proc.terminate()
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
    except OSError:
        pass


def _cleanup(state: dict[str, Any]) -> None:
    _terminate(state.get("proc"))
    fh = state.get("log")
    if fh is not None:
        fh.close()
    workdir = state.get("workdir")
    if workdir and state.get("owned"):
        shutil.rmtree(workdir, ignore_errors=True)


class MosquittoBroker(_BrokerBase):
    """A private Mosquitto process with a generated config (see the module docstring).

    Ports default to free loopback ports. ``users`` ({name: password})
    generates the password file; ``acl`` is the text of an ACL file. With
    users or a password file, anonymous access is off unless
    ``allow_anonymous=True``. ``persistence=True`` keeps sessions and queued
    QoS 1 messages across :meth:`restart`.
    """

    kind = "mosquitto"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        users: Mapping[str, str] | None = None,
        password_file: str | os.PathLike[str] | None = None,
        acl: str | None = None,
        acl_file: str | os.PathLike[str] | None = None,
        allow_anonymous: bool | None = None,
        tls: TlsFiles | None = None,
        tls_port: int | None = None,
        plain: bool = True,
        websockets: bool = False,
        ws_port: int | None = None,
        ws_tls: bool = False,
        message_size_limit: int | None = None,
        max_packet_size: int | None = None,
        persistence: bool = False,
        max_queued_messages: int | None = None,
        max_inflight_messages: int | None = None,
        extra_config: str = "",
        binary: str | None = None,
        startup_timeout: float = 10.0,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        if users is not None and password_file is not None:
            raise ConfigError("give either users or password_file, not both")
        if acl is not None and acl_file is not None:
            raise ConfigError("give either acl or acl_file, not both")
        if not plain and tls is None and not websockets:
            raise ConfigError("a broker without a plain listener needs tls or websockets")
        if ws_tls and (tls is None or not websockets):
            raise ConfigError("ws_tls needs websockets=True and tls=TlsFiles(...) (the websockets listener's certificate)")
        self.binary = binary or find_mosquitto()
        if self.binary is None:
            msg = "mosquitto is not installed (apt install mosquitto / brew install mosquitto), or pass binary="
            raise TransportError(msg)
        self.host = host
        self._auto_ports = port is None
        self.port = port or 0
        self.tls = tls
        self.tls_port = tls_port or 0
        self.plain = plain
        self.websockets = websockets
        self.ws_port = ws_port or 0
        self.ws_tls = ws_tls
        self.users = dict(users) if users else None
        self.password_file = Path(password_file) if password_file else None
        self.acl = acl
        self.acl_file = Path(acl_file) if acl_file else None
        anonymous_default = users is None and password_file is None
        self.allow_anonymous = anonymous_default if allow_anonymous is None else allow_anonymous
        self.message_size_limit = message_size_limit
        self.max_packet_size = max_packet_size
        self.persistence = persistence
        self.max_queued_messages = max_queued_messages
        self.max_inflight_messages = max_inflight_messages
        self.extra_config = extra_config
        self.startup_timeout = startup_timeout
        owned = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="edgeflow-mosquitto-")) if owned else Path(workdir)  # type: ignore[arg-type]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._state: dict[str, Any] = {"proc": None, "log": None, "workdir": str(self.workdir), "owned": owned}
        self._finalizer = weakref.finalize(self, _cleanup, self._state)

    # -- config
    @property
    def config_path(self) -> Path:
        return self.workdir / "mosquitto.conf"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    @property
    def output_path(self) -> Path:
        """stdout/stderr of the process: errors printed before the log file is open."""
        return self.workdir / "mosquitto.out"

    @property
    def url(self) -> str:
        if self.plain:
            return f"mqtt://{self.host}:{self.port}"
        if self.tls is not None:
            return self.tls_url
        return self.ws_url

    @property
    def tls_url(self) -> str:
        return f"mqtts://{self.host}:{self.tls_port}"

    @property
    def ws_url(self) -> str:
        """``ws://`` or, with ``ws_tls``, ``wss://`` URL of the websockets listener."""
        return f"{'wss' if self.ws_tls else 'ws'}://{self.host}:{self.ws_port}/mqtt"

    def _write_password_file(self) -> Path:
        path = self.workdir / "passwd"
        lines = [f"{user}:{mosquitto_password_hash(pw)}\n" for user, pw in (self.users or {}).items()]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.writelines(lines)
        return path

    def _config_text(self) -> str:
        lines = ["# written by edgeflow.transport.broker.MosquittoBroker", "per_listener_settings false"]
        lines.append(f"allow_anonymous {'true' if self.allow_anonymous else 'false'}")
        if self.users is not None:
            lines.append(f"password_file {self._write_password_file()}")
        elif self.password_file is not None:
            lines.append(f"password_file {self.password_file}")
        if self.acl is not None:
            acl_path = self.workdir / "acl"
            acl_path.write_text(self.acl.strip() + "\n", encoding="utf-8")
            os.chmod(acl_path, 0o600)
            lines.append(f"acl_file {acl_path}")
        elif self.acl_file is not None:
            lines.append(f"acl_file {self.acl_file}")
        if self.message_size_limit is not None:
            lines.append(f"message_size_limit {int(self.message_size_limit)}")
        if self.max_packet_size is not None:
            lines.append(f"max_packet_size {int(self.max_packet_size)}")
        if self.max_queued_messages is not None:
            lines.append(f"max_queued_messages {int(self.max_queued_messages)}")
        if self.max_inflight_messages is not None:
            lines.append(f"max_inflight_messages {int(self.max_inflight_messages)}")
        if self.persistence:
            store = self.workdir / "store"
            store.mkdir(exist_ok=True)
            lines += ["persistence true", f"persistence_location {store}/"]
        lines += [f"log_dest file {self.log_path}", "log_type error", "log_type warning", "log_type notice",
                  "log_type information", "connection_messages true", "log_timestamp true"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            lines.append("user root")  # otherwise mosquitto drops to user 'mosquitto' and cannot read workdir
        if self.extra_config:
            lines.append(self.extra_config.strip())
        if self.plain:
            lines.append(f"listener {self.port} {self.host}")
        if self.tls is not None:
            lines += [f"listener {self.tls_port} {self.host}", f"certfile {self.tls.certfile}",
                      f"keyfile {self.tls.keyfile}"]
            if self.tls.cafile:
                lines.append(f"cafile {self.tls.cafile}")
            if self.tls.require_certificate:
                lines.append("require_certificate true")
        if self.websockets:
            # Mosquitto 2.0.11 refuses to start when a websockets listener is its only one
            # ("Unable to start any listening sockets"): keep plain or tls alongside.
            lines += [f"listener {self.ws_port} {self.host}", "protocol websockets"]
            if self.ws_tls and self.tls is not None:
                lines += [f"certfile {self.tls.certfile}", f"keyfile {self.tls.keyfile}"]
                if self.tls.cafile:
                    lines.append(f"cafile {self.tls.cafile}")
                if self.tls.require_certificate:
                    lines.append("require_certificate true")
        return "\n".join(lines) + "\n"

    def _ports(self) -> list[int]:
        ports = []
        if self.plain:
            ports.append(self.port)
        if self.tls is not None:
            ports.append(self.tls_port)
        if self.websockets:
            ports.append(self.ws_port)
        return ports

    # -- process
    @property
    def running(self) -> bool:
        proc = self._state["proc"]
        return proc is not None and proc.poll() is None

    @property
    def pid(self) -> int | None:
        proc = self._state["proc"]
        return proc.pid if proc is not None else None

    def log(self) -> str:
        """The broker's log so far (for test failure messages)."""
        parts = []
        for path in (self.output_path, self.log_path):
            try:
                parts.append(path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                pass
        return "".join(parts)

    def start(self) -> MosquittoBroker:
        if self.running:
            return self
        for attempt in range(3):
            if self._auto_ports:
                if self.plain and not self.port:
                    self.port = free_port(self.host)
                if self.tls is not None and not self.tls_port:
                    self.tls_port = free_port(self.host)
                if self.websockets and not self.ws_port:
                    self.ws_port = free_port(self.host)
            self.config_path.write_text(self._config_text(), encoding="utf-8")
            if self._state["log"] is None:
                self._state["log"] = open(self.output_path, "ab")  # noqa: SIM115 - closed in _cleanup
            proc = subprocess.Popen(  # noqa: S603 - our own binary and config
                [self.binary, "-c", str(self.config_path)],
                stdout=self._state["log"],
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            self._state["proc"] = proc
            ok = all(
                wait_for_port(self.host, p, self.startup_timeout, alive=lambda: proc.poll() is None)
                for p in self._ports()
            )
            if ok:
                log.debug("mosquitto %s started on %s (pid %d)", self.binary, self._ports(), proc.pid)
                return self
            _terminate(proc)
            text = self.log()
            if self._auto_ports and "Address already in use" in text and attempt < 2:
                self.port = self.tls_port = self.ws_port = 0
                continue
            tail = "\n".join(text.strip().splitlines()[-15:])
            msg = (
                f"mosquitto did not start (exit code {proc.poll()}); config {self.config_path}; "
                f"last log lines:\n{tail}"
            )
            raise TransportError(msg)
        raise TransportError("mosquitto could not find a free port")  # pragma: no cover

    def stop(self, *, cleanup: bool = True) -> None:
        """Stop the broker (SIGTERM: Mosquitto saves its persistence file) and remove temp files."""
        _terminate(self._state["proc"])
        self._state["proc"] = None
        if cleanup:
            self._finalizer()

    def restart(self, *, down_s: float = 0.0) -> MosquittoBroker:
        """Stop and start again on the same ports and persistence directory."""
        _terminate(self._state["proc"])
        self._state["proc"] = None
        if down_s:
            time.sleep(down_s)
        auto = self._auto_ports
        self._auto_ports = False
        try:
            return self.start()
        finally:
            self._auto_ports = auto

    def pause(self) -> None:
        """SIGSTOP the broker: connections stay open but nothing is answered (a hung broker)."""
        proc = self._state["proc"]
        if proc is not None:
            proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        proc = self._state["proc"]
        if proc is not None:
            proc.send_signal(signal.SIGCONT)


def find_nats_server() -> str | None:
    """Path of the nats-server binary (PATH, then /usr/sbin and /usr/local/bin)."""
    found = shutil.which("nats-server")
    if found:
        return found
    for p in ("/usr/sbin/nats-server", "/usr/local/bin/nats-server", "/usr/bin/nats-server"):
        if os.access(p, os.X_OK):
            return p
    return None


class NatsServer(_BrokerBase):
    """A private nats-server with JetStream on a free loopback port (tests, demos, benchmarks).

    ``extra_config`` is appended to the generated config (accounts, users and
    permissions from :func:`edgeflow.broker.nats.nats_config`, TLS blocks,
    ``max_payload``). The JetStream store lives in the work directory, so
    :meth:`restart` keeps the streams (retained messages, will records).
    """

    kind = "nats"

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, extra_config: str = "",
                 binary: str | None = None, startup_timeout: float = 10.0,
                 workdir: str | os.PathLike[str] | None = None, tls_scheme: bool = False) -> None:
        self.binary = binary or find_nats_server()
        if self.binary is None:
            raise TransportError("nats-server is not installed (apt install nats-server), or pass binary=")
        self.host = host
        self._auto_port = port is None
        self.port = port or 0
        self.extra_config = extra_config
        self.startup_timeout = startup_timeout
        self.tls_scheme = tls_scheme
        owned = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="edgeflow-nats-")) if owned else Path(workdir)  # type: ignore[arg-type]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._state: dict[str, Any] = {"proc": None, "log": None, "workdir": str(self.workdir), "owned": owned}
        self._finalizer = weakref.finalize(self, _cleanup, self._state)

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls_scheme else 'nats'}://{self.host}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / "nats.conf"

    @property
    def output_path(self) -> Path:
        return self.workdir / "nats.out"

    def _config_text(self) -> str:
        store = str(self.workdir / "jetstream").replace("\\", "/")
        return (f"host: {self.host}\nport: {self.port}\nserver_name: edgeflow_{self.port}\n"
                f'jetstream {{ store_dir: "{store}" }}\n{self.extra_config}\n')

    @property
    def running(self) -> bool:
        proc = self._state["proc"]
        return proc is not None and proc.poll() is None

    def log(self) -> str:
        try:
            return self.output_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def start(self) -> NatsServer:
        if self.running:
            return self
        for attempt in range(3):
            if self._auto_port and not self.port:
                self.port = free_port(self.host)
            self.config_path.write_text(self._config_text(), encoding="utf-8")
            if self._state["log"] is None:
                self._state["log"] = open(self.output_path, "ab")  # noqa: SIM115 - closed in _cleanup
            proc = subprocess.Popen(  # noqa: S603 - our own binary and config
                [self.binary, "-c", str(self.config_path)], stdout=self._state["log"], stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)
            self._state["proc"] = proc
            if wait_for_port(self.host, self.port, self.startup_timeout, alive=lambda: proc.poll() is None):
                return self
            _terminate(proc)
            text = self.log()
            if self._auto_port and "address already in use" in text.lower() and attempt < 2:
                self.port = 0
                continue
            tail = "\n".join(text.strip().splitlines()[-15:])
            raise TransportError(f"nats-server did not start (exit code {proc.poll()}); config {self.config_path}; "
                                 f"last log lines:\n{tail}")
        raise TransportError("nats-server could not find a free port")  # pragma: no cover

    def stop(self, *, cleanup: bool = True) -> None:
        _terminate(self._state["proc"])
        self._state["proc"] = None
        if cleanup:
            self._finalizer()

    def restart(self, *, down_s: float = 0.0) -> NatsServer:
        """Stop and start again on the same port and JetStream store."""
        _terminate(self._state["proc"])
        self._state["proc"] = None
        if down_s:
            time.sleep(down_s)
        auto = self._auto_port
        self._auto_port = False
        try:
            return self.start()
        finally:
            self._auto_port = auto


class EmbeddedBroker(_BrokerBase):
    """amqtt's broker in a background thread with its own event loop (MQTT 3.1.1 only).

    For machines without Mosquitto. No auth, ACL, size limit or persistence
    is configured; amqtt answers MQTT 5 connects with "unsupported protocol
    version", so clients should use ``protocol="3.1.1"`` (see :attr:`protocol`).
    """

    kind = "amqtt"
    protocol = "3.1.1"

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 10.0,
                 config: dict[str, Any] | None = None) -> None:
        self.host = host
        self.port = port or 0
        self._auto_port = port is None
        self.startup_timeout = startup_timeout
        self._extra = dict(config or {})
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None
        self._error: BaseException | None = None
        self._ready = threading.Event()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._broker is not None

    def _config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        cfg.update(self._extra)
        return cfg

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        # amqtt lets exceptions of aborted connections escape to the loop (e.g. a client that
        # hangs up during CONNECT); keep them out of the application's error log.
        loop.set_exception_handler(lambda _loop, ctx: log.debug("amqtt: %s", ctx.get("message")))

        async def boot() -> None:
            from amqtt.broker import Broker

            broker = Broker(self._config())
            await broker.start()
            self._broker = broker

        try:
            loop.run_until_complete(boot())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            log.debug("embedded broker failed to start: %s", exc)
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def start(self) -> EmbeddedBroker:
        if self.running:
            return self
        try:
            import amqtt.broker  # noqa: F401
        except ImportError as exc:
            msg = ("amqtt is not installed: pip install 'edgeflow[sim]' (from a checkout: pip install '.[sim]'), "
                   "or install mosquitto, or pass a broker URL")
            raise TransportError(msg) from exc
        if self._auto_port:
            self.port = free_port(self.host)
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name=f"edgeflow-amqtt-{self.port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.startup_timeout) or self._error is not None:
            err = self._error
            self.stop()
            msg = f"embedded amqtt broker did not start on {self.host}:{self.port}: {err}"
            raise TransportError(msg) from err
        return self  # broker.start() returns once the listener is bound

    def stop(self) -> None:
        loop, broker, thread = self._loop, self._broker, self._thread
        if loop is not None and broker is not None and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(_shutdown_amqtt(broker), loop).result(15)
            except Exception as exc:  # noqa: BLE001 - stopping is best effort
                log.warning("embedded amqtt broker did not shut down cleanly: %r", exc)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(10)
        self._broker = None
        self._thread = None
        self._loop = None


async def _shutdown_amqtt(broker: Any) -> None:
    """Shut amqtt down; if that fails (it can, with clients still connected), close its listeners anyway."""
    try:
        await asyncio.wait_for(broker.shutdown(), 10)
        return
    except Exception as exc:  # noqa: BLE001 - fall through to closing the sockets ourselves
        log.debug("amqtt shutdown failed (%r); closing its listeners directly", exc)
    for server in list(getattr(broker, "_servers", {}).values()):
        instance = getattr(server, "instance", None)
        if instance is not None:
            instance.close()
            try:
                await asyncio.wait_for(instance.wait_closed(), 2)
            except Exception:  # noqa: BLE001 - connections of dead clients may linger; the socket is closed
                log.debug("embedded broker: connections still closing at shutdown", exc_info=True)
    current = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is not current:
            task.cancel()


def start_broker(url: str | None = None, **mosquitto_options: Any) -> ExternalBroker | MosquittoBroker | EmbeddedBroker:
    """Return a running broker: ``url`` if given, else Mosquitto if installed, else embedded amqtt.

    ``url`` may be any URL :func:`~edgeflow.transport.factory.transport_from_url` serves (an MQTT
    broker or a NATS server: ``nats://127.0.0.1:4222``); it is used as it is.
    ``mosquitto_options`` go to :class:`MosquittoBroker` when one is started.
    """
    if url:
        return ExternalBroker(url)
    binary = find_mosquitto()
    if binary is not None:
        return MosquittoBroker(binary=binary, **mosquitto_options).start()
    if mosquitto_options:
        log.warning("mosquitto is not installed; ignoring broker options %s for the embedded broker",
                    sorted(mosquitto_options))
    try:
        import amqtt  # noqa: F401
    except ImportError:
        msg = (
            "no MQTT broker available: install mosquitto (apt install mosquitto), "
            "pip install 'edgeflow[sim]' for an embedded one (amqtt), or pass a broker URL"
        )
        raise TransportError(msg) from None
    return EmbeddedBroker().start()
