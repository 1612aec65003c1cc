"""A locked-down Mosquitto for one fleet, and the fleet directory that feeds it.

What the generated broker enforces:

- **TLS only**: one TLS listener (server certificate from the operator, or
  a fleet CA made here); no plain listener unless asked for (loopback test
  set-ups). Optional client certificates (``require_certificate``).
- **no anonymous access**: ``allow_anonymous false``; one user per device
  (user name = device id) plus the operator users (``gateway`` for the
  gateway service, ``admin`` for the ``edgeflow fleet`` CLI), each with its
  own password, stored as Mosquitto ``$7$`` PBKDF2-SHA512 hashes.
- **client id = user name** (``use_username_as_clientid``): a device cannot
  take over another device's session by connecting with its client id.
- **ACL**: a device publishes only on its own channels and reads only its
  own commands, OTA offers, inference requests and the fleet's gateway
  topics; operators read and write the fleet's tree. Derived from the topic
  table of :mod:`edgeflow.transport.topics` (every chunk channel included).
  See :func:`fleet_acl`.
- **limits**: ``max_packet_size`` (one message, default 1 MiB: the
  transport chunks anything larger), ``max_queued_messages`` and
  ``max_queued_bytes`` per client; ``max_connections`` on every listener,
  sized to the fleet (:func:`fleet_max_connections`), so idle sockets opened
  without a credential are refused at that count instead of using up the
  broker's open files (its ``LimitNOFILE``, see docs/fleet.md). ``max_connections`` bounds a listener,
  not a peer: ``broker/nftables.conf`` (:mod:`edgeflow.broker.firewall`) limits the connections per
  source address in the kernel, so one address cannot fill a listener with idle sockets (the slow
  loris Mosquitto would only drop after about 95 s). Mosquitto 2.0 cannot forbid retain per
  topic (its ACL has no retain flag) nor bound the retained store; receivers
  refuse retained chunks the topic scheme does not expect
  (:func:`edgeflow.transport.topics.retained_chunks_allowed`).
- **paths and user**: every path in the config is absolute (the broker can
  be started from any directory). Mosquitto started as root drops to the
  ``user`` the config names *before* it reads any file, so broker-config
  gives that user read access to exactly the files it needs (see
  :func:`broker_user`): run as root, the broker runs as ``mosquitto``
  (``--broker-user`` to choose another; ``root`` only when asked for); run as
  another user, the config names that user.
- **files**: every file is written to a fresh temporary file (``O_EXCL``,
  ``O_NOFOLLOW``) renamed over its name, its mode set explicitly whatever
  the umask (secrets 0600, public certificates and keys 0644); a link at
  one of those names is replaced, never followed. Run as root, broker-config
  hands the broker user only a log file and a persistence directory it
  created itself; a link, a hard link or a file of someone else's at those
  paths is refused (ConfigError) and left as it is.
- **names**: operators (``gateway``, ``admin`` and every fleet.json operator,
  with their session users ``NAME-2``, ``NAME-3`` ...) and devices are
  disjoint name spaces: a device id in the operators' one is refused when
  provisioned and when the password file and ACL are written
  (:func:`operator_namespace`).

The broker is one layer. Commands and models are also signed by the fleet
key and the agent refuses anything else, so a misconfigured broker (or a
stolen device password) still cannot steer devices.

Fleet directory (``edgeflow broker-config --dir FLEET`` creates it)::

    fleet.json          {"fleet", "broker", "operators", "listener", "tls_hosts"}: what the next run reuses
    fleet.key/fleet.pub the fleet signing key (commands, OTA artifacts)
    keyring.json        device public keys (device id -> hex)
    operators/<user>.json  operator MQTT credentials (0600)
    broker/             mosquitto.conf, passwd, acl, ca.crt, ca.key, server.crt, server.key, nftables.conf
    devices/<id>/       a device's credentials directory, to copy onto the board
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..signing import KeyRing, PrivateKey, PublicKey
from ..transport.broker import mosquitto_password_hash
from ..transport.topics import (
    DEVICE_CHANNEL_SPECS,
    GATEWAY,
    GATEWAY_CHANNEL_SPECS,
    validate_id,
)
from .firewall import ConnectionLimits, nftables_ruleset, per_source_limit

__all__ = [
    "DEFAULT_MAX_PACKET",
    "OPERATORS",
    "BrokerFiles",
    "FleetDir",
    "ListenerSettings",
    "broker_user",
    "check_ports_free",
    "fleet_acl",
    "fleet_max_connections",
    "make_fleet_ca",
    "operator_namespace",
    "read_password_file",
    "render_config",
    "write_password_file",
]

ADMIN_SESSIONS = 4
"""Operator users made for the ``edgeflow fleet`` CLI: ``admin``, ``admin-2`` .. ``admin-4``. The
generated broker sets ``use_username_as_clientid`` (no device can take over another's session), so
two connections as one user would knock each other off: each command claims a free one
(:meth:`FleetDir.claim_operator`), and up to this many run at once."""

OPERATORS = ("gateway", "admin", *(f"admin-{i}" for i in range(2, ADMIN_SESSIONS + 1)))

DEFAULT_MAX_PACKET = 1 << 20
"""Largest MQTT packet the generated broker accepts (payload, topic and headers): 1 MiB. MQTT 5 clients
learn it from the CONNACK and chunk below it; the transport's default chunk is 256 KiB."""
DEFAULT_MAX_QUEUED_BYTES = 1 << 30
DEFAULT_MAX_QUEUED_MESSAGES = 10000

MIN_MAX_CONNECTIONS = 256
"""The smallest ``max_connections`` sized automatically: a small fleet still has room for reconnects,
tools and the boards provisioned before the broker's next restart (Mosquitto does not reload it on HUP)."""
OPEN_FILES_MARGIN = 64
"""Open files the broker needs besides its client sockets (listening sockets, log, persistence, the files
it reloads): LimitNOFILE >= max_connections x listeners + this (:meth:`BrokerFiles.open_files`)."""


def fleet_max_connections(clients: int) -> int:
    """``max_connections`` per listener for a fleet of ``clients`` MQTT users (devices + operator users):
    those plus a quarter (at least 64) for reconnects and boards provisioned before the next restart,
    rounded up to a multiple of :data:`MIN_MAX_CONNECTIONS` (so provisioning one more board rarely
    changes it: Mosquitto applies a new value only on restart)."""
    clients = max(0, int(clients))
    want = clients + max(64, clients // 4)
    return max(1, -(-want // MIN_MAX_CONNECTIONS)) * MIN_MAX_CONNECTIONS


_SESSION_SUFFIX = re.compile(r"(.+)-[0-9]+")


def operator_namespace(operators: Iterable[str] = OPERATORS):
    """A test ``name -> bool``: is ``name`` an operator's, now or later?

    The operators' name space holds ``gateway``, ``admin`` and every name in ``operators``, each with
    its session users (``NAME-2``, ``NAME-3`` ...: :meth:`FleetDir.claim_operator` uses them and a
    later broker-config may add more). A device is never given one of those names: as ``admin-5`` it
    would become, with its own password, the operator session user a later run adds, with the
    operators' rights over the whole fleet.
    """
    bases = {GATEWAY, "admin"}
    for op in operators:
        m = _SESSION_SUFFIX.fullmatch(op)
        bases.add(m.group(1) if m else op)

    def owned(name: str) -> bool:
        m = _SESSION_SUFFIX.fullmatch(name)
        return name in bases or bool(m and m.group(1) in bases)

    return owned


def _namespace_error(device: str, what: str) -> ConfigError:
    return ConfigError(f"device id {device!r} is in the operators' name space (gateway, admin, each operator "
                       f"user and its session users NAME-2, NAME-3 ...): {what}")


def _device_rules(root: str) -> list[str]:
    out = []
    for spec in DEVICE_CHANNEL_SPECS:
        access = "write" if spec.writer == "device" else "read"
        out += [f"pattern {access} {root}/%u/{level}" for level in spec.levels()]
    return out


def fleet_acl(fleet: str, operators: Iterable[str] = OPERATORS, devices: Iterable[str] = ()) -> str:
    """Mosquitto ACL text for ``fleet``, derived from the topic table (:data:`DEVICE_CHANNEL_SPECS`).

    Patterns (``%u`` = the user name = the device id) give each device its
    own channels: write where the device is the writer, read where the
    gateway or an application is; a chunked channel includes its
    ``<channel>/_chunk/+`` topics. Reading the gateway's topics is granted
    per device user (``user <id>`` blocks), since a pattern without ``%u``
    draws Mosquitto's warning and would apply to every user. Operators read
    and write the fleet's tree.
    """
    validate_id(fleet, "fleet id")
    root = f"edgeflow/{fleet}"
    ops = list(operators)
    owned = operator_namespace(ops)
    devices = set(devices)
    for dev in sorted(devices):
        if owned(dev):
            raise _namespace_error(dev, "its ACL entry would give a device operator rights; revoke it "
                                        "(`edgeflow fleet revoke ID`) and provision the board under another id")
    lines = [f"# edgeflow fleet {fleet}: generated by `edgeflow broker-config`; do not edit by hand",
             "# devices (user name = device id): own channels only"]
    lines += _device_rules(root)
    gateway_reads = [f"topic read {root}/{GATEWAY}/{level}" for spec in GATEWAY_CHANNEL_SPECS for level in spec.levels()]
    lines.append("")
    for dev in sorted(devices):
        lines += [f"user {validate_id(dev, 'device id')}", *gateway_reads, ""]
    for user in ops:
        lines += [f"user {user}", f"topic readwrite {root}/#", ""]
    return "\n".join(lines)


def read_password_file(path: Path) -> dict[str, str]:
    """{user: hash line} of an existing Mosquitto password file (empty if none)."""
    out: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        user, sep, h = line.strip().partition(":")
        if sep and user and not user.startswith("#"):
            out[user] = h
    return out


def write_password_file(path: Path, users: Mapping[str, str], *, hashed: Mapping[str, str] | None = None) -> Path:
    """Write ``users`` ({name: password}, hashed here) plus already ``hashed`` entries, mode 0600
    (whatever the umask; a link at ``path`` is replaced, not followed: :func:`_write_file`)."""
    entries = dict(hashed or {})
    for user, pw in users.items():
        if ":" in user or not user or any(c.isspace() for c in user):
            raise ConfigError(f"MQTT user name {user!r} must be non-empty and contain no ':' or white space")
        entries[user] = mosquitto_password_hash(pw)
    if not path.parent.exists():
        _make_dirs(path.parent)
    _write_file(path, "".join(f"{u}:{h}\n" for u, h in sorted(entries.items())).encode(), 0o600)
    return path


@dataclass
class ListenerSettings:
    """Where and how the broker listens (persisted in fleet.json; a rerun starts from the stored ones)."""

    host: str = "0.0.0.0"
    port: int = 8883
    certfile: str = ""
    """Server certificate (PEM); empty: the fleet CA's. An operator's file is copied into broker/ (the broker
    may only read its own directory once it dropped root), so rerun broker-config after renewing it."""
    keyfile: str = ""
    cafile: str | None = None
    require_certificate: bool = False
    websockets_port: int | None = None
    """A TLS websockets listener as well (browsers, networks that only pass 443)."""
    plain_port: int | None = None
    """A plain listener bound to 127.0.0.1 only (local tools on the gateway host); never on a network."""
    max_packet_size: int | None = None
    """Bytes; None: :data:`DEFAULT_MAX_PACKET`."""
    max_queued_messages: int | None = None
    max_queued_bytes: int | None = None
    max_connections: int | None = None
    """Connections each listener accepts (``max_connections``); None: sized to the fleet by
    :meth:`FleetDir.write_broker_config` (:func:`fleet_max_connections`)."""
    per_source_connections: int | None = None
    """Connections one source address may hold on the network listeners (broker/nftables.conf); None:
    :func:`edgeflow.broker.firewall.per_source_limit` of the operator users."""
    persistence_dir: str | None = None
    log_file: str | None = None
    user: str | None = None
    """The system user the broker runs as (its ``user`` line); None: see :func:`broker_user`."""
    extra: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ListenerSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(d).items() if k in known})

    def validate(self) -> ListenerSettings:
        """Check ports, limits and every named file before anything is written (ConfigError, one line)."""
        ports = {"--port": self.port, "--websockets": self.websockets_port, "--local-port": self.plain_port}
        seen: dict[int, str] = {}
        for flag, port in ports.items():
            if port is None and flag != "--port":
                continue
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise ConfigError(f"{flag} {port!r} is not a TCP port: use 1-65535")
            if port in seen:
                raise ConfigError(f"{flag} {port} is already the {seen[port]} port: give each listener its own")
            seen[port] = flag
        for name, value, low in (("max_packet_size", self.max_packet_size, 64 * 1024),
                                 ("max_queued_messages", self.max_queued_messages, 1),
                                 ("max_queued_bytes", self.max_queued_bytes, 1 << 20),
                                 ("max_connections", self.max_connections, 1),
                                 ("per_source_connections", self.per_source_connections, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"{name} {value!r} is too small or not a whole number: use at least {low}")
        if bool(self.certfile) != bool(self.keyfile):
            raise ConfigError("--cert and --key go together: give both, or neither to use the fleet CA")
        if self.certfile:
            _check_cert_and_key(self.certfile, self.keyfile)
        if self.cafile:
            _check_pem_cert(self.cafile, "--ca")
        if self.require_certificate and not self.cafile and self.certfile:
            raise ConfigError("--require-certificate needs the CA that signs client certificates (--ca)")
        for flag, value in (("--persistence", self.persistence_dir), ("--log-file", self.log_file)):
            if value:
                parent = Path(value).expanduser().absolute().parent
                if not parent.is_dir():
                    raise ConfigError(f"{flag} {value}: directory {parent} does not exist; create it first")
        if self.user is not None:
            validate_system_user(self.user)
        return self


def _check_pem_cert(path: str, flag: str):
    from cryptography import x509

    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{flag} {path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise ConfigError(f"{flag} {path} is not a PEM certificate") from None


def _check_cert_and_key(certfile: str, keyfile: str) -> None:
    from cryptography.hazmat.primitives import serialization

    cert = _check_pem_cert(certfile, "--cert")
    p = Path(keyfile).expanduser()
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"--key {keyfile}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"--key {keyfile}: cannot read it ({exc.strerror})") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"--key {keyfile} is not an unencrypted PEM private key") from None
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.PEM
    if key.public_key().public_bytes(enc, pub) != cert.public_key().public_bytes(enc, pub):
        raise ConfigError(f"--key {keyfile} does not belong to the certificate {certfile}")


def validate_system_user(name: str) -> str:
    if not name or any(c.isspace() for c in name):
        raise ConfigError(f"--broker-user {name!r} is not a user name")
    return name


def _passwd(name: str):
    import pwd

    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"--broker-user {name}: no such system user; create it (useradd --system {name}) "
                          "or name an existing one") from None


def broker_user(settings: ListenerSettings) -> str:
    """The ``user`` line of the config: who the broker runs as.

    - run by a non-root user: that user (Mosquitto ignores ``user`` unless
      started as root; started as root later, it drops to the user that owns
      the files). Naming another user needs root (to give it the files).
    - run by root: ``settings.user`` or ``mosquitto`` (the Debian package's
      user). ``root`` runs the broker as root and is used only when asked for.
    """
    if not hasattr(os, "geteuid"):  # pragma: no cover - Windows ignores `user`
        return settings.user or "mosquitto"
    import pwd

    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid()).pw_name
        if settings.user not in (None, me):
            raise ConfigError(f"--broker-user {settings.user}: only root can hand the broker's files to another "
                              f"user; run broker-config as root, or leave --broker-user out (the broker runs as {me})")
        return me
    return settings.user or "mosquitto"


def check_ports_free(settings: ListenerSettings, previous: ListenerSettings | None = None) -> None:
    """Refuse (ConfigError, one line) a listener port another process already listens on.

    A bind attempt per listener (the address the broker will bind, ``SO_REUSEADDR`` as Mosquitto sets
    it, so connections in TIME_WAIT do not count). Ports the ``previous`` settings (the last run's)
    already had on the same address are skipped: the broker running on that config holds them, and a
    rerun (``fleet provision``) must not be refused for it. An address that is not this machine's
    (the config is made for another host) or a port that needs root is left to the broker to report.
    """
    def listeners(s: ListenerSettings | None) -> dict[tuple[str, int], str]:
        if s is None:
            return {}
        out = {(s.host, s.port): "--port"}
        if s.websockets_port:
            out[(s.host, s.websockets_port)] = "--websockets"
        if s.plain_port:
            out[("127.0.0.1", s.plain_port)] = "--local-port"
        return out

    before = listeners(previous)
    for (host, port), flag in listeners(settings).items():
        if (host, port) in before:
            continue
        problem = _bind_problem(host, port)
        if problem is not None:
            raise ConfigError(f"{flag} {port}: {problem} on {host} (`ss -ltnp 'sport = :{port}'` shows by whom): "
                              f"stop that process or choose another port with {flag}")


def _bind_problem(host: str, port: int) -> str | None:
    """Why the broker could not listen on ``host``:``port`` now, or None (free, or not decidable here)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return None  # a name this machine cannot resolve: the config is for another host
    for family, kind, proto, _, addr in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return "the port is already in use"
                return None  # EADDRNOTAVAIL (another host's address), EACCES (a port below 1024): the broker's to say
    return None


def _reachable(path: Path, uid: int, gids: set[int]) -> tuple[bool, Path | None]:
    """Can (uid, gids) traverse every directory above ``path``? The first one it cannot, if any."""
    for d in reversed(path.parents):
        if not d.exists():  # created later by mkdir(parents=True): 0777 & ~umask, owned by whoever runs it
            break
        st = d.stat()
        mode = st.st_mode
        if uid == 0 or mode & stat.S_IXOTH:
            continue
        if st.st_uid == uid and mode & stat.S_IXUSR:
            continue
        if st.st_gid in gids and mode & stat.S_IXGRP:
            continue
        return False, d
    return True, None


# ------------------------------------------------------- files: never through a link

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _link_error(path: Path | str, flag: str = "") -> ConfigError:
    what = f"{flag} {path}" if flag else str(path)
    return ConfigError(f"{what} is a symbolic link: broker-config never writes, chowns or chmods through a link "
                       f"(it could hand another file to the broker); remove the link (rm {path}) and run again")


def _refuse_links(paths: Iterable[Path]) -> None:
    for path in paths:
        st = _lstat(path)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise _link_error(path)


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with exactly ``mode``, whatever the umask.

    A fresh temporary file next to it (``O_CREAT|O_EXCL|O_NOFOLLOW``, never an existing file or a
    link), its mode set on the descriptor, renamed over ``path``: a link at ``path`` is replaced by the
    file, never followed, and a reader sees the old or the new contents, never half of them.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _make_dirs(path: Path, mode: int = 0o700) -> None:
    """``mkdir -p`` whatever the umask: ``path`` gets ``mode``, missing directories above it 0755 (so
    the broker's user can pass through them); existing ones are left as they are."""
    missing = []
    for d in (path, *path.parents):
        if _lstat(d) is not None:
            break
        missing.append(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        _chmod_own(d, mode if d == path else 0o755)


def _chmod_own(path: Path, mode: int) -> None:
    """chmod of a file or directory in the fleet directory, through a descriptor opened without following
    a link (a link there is a ConfigError)."""
    fd = _open_nofollow(path)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _open_nofollow(path: Path, flag: str = "") -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_error(path, flag) from None
        raise


def _grant(path: Path, gid: int, mode: int) -> None:
    """Give root:``gid`` and ``mode`` to one of the fleet directory's own entries: through a descriptor
    opened without following a link; a link or a hard-linked file is refused, unchanged."""
    fd = _open_nofollow(path)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            raise ConfigError(f"{path} has {st.st_nlink} hard links: broker-config does not chown a file linked "
                              "elsewhere; remove it and run again (it is regenerated)")
        os.fchown(fd, 0, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _foreign(path: Path, st: os.stat_result, flag: str, uid: int, user: str, kind: str) -> ConfigError | None:
    """Why the existing ``path`` (lstat ``st``) cannot be left to the broker user, or None when it is
    already that user's own plain file/directory (then nothing is changed)."""
    if stat.S_ISLNK(st.st_mode):
        return _link_error(path, flag)
    if not (stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)):
        return ConfigError(f"{flag} {path} exists and is not a {kind}; remove it or choose another path")
    if st.st_uid != uid:
        return ConfigError(f"{flag} {path} exists and belongs to uid {st.st_uid}, not to the broker user {user!r}: "
                           f"broker-config only hands over a {kind} it creates; remove it (it is created for "
                           f"{user}) or chown it to {user} yourself")
    return None


def _hand_over(path: Path, flag: str, uid: int, gid: int, user: str, *, directory: bool) -> None:
    """Create ``path`` (file 0640 or directory 0700) for the broker user, or leave an existing one that is
    already that user's. Never follows a link, never chowns or chmods what it did not create."""
    kind = "directory" if directory else "file"
    st = _lstat(path)
    if st is not None:
        problem = _foreign(path, st, flag, uid, user, kind)
        if problem is not None:
            raise problem
        return
    try:
        if directory:
            os.mkdir(path, 0o700)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    except FileExistsError:
        raise ConfigError(f"{flag} {path} appeared while broker-config ran; check who else writes there "
                          "and run again") from None
    except NotADirectoryError:  # replaced by a link between mkdir and open
        raise _link_error(path, flag) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():  # not the one just made (swapped in between): leave it alone
            raise ConfigError(f"{flag} {path} was replaced while broker-config ran; check who else writes there "
                              "and run again")
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o700 if directory else 0o640)
    finally:
        os.close(fd)


def render_config(fleet: str, settings: ListenerSettings, *, password_file: str, acl_file: str) -> str:
    """The text of mosquitto.conf (Mosquitto 2.0). Paths are written as given: pass absolute ones."""
    s = settings
    if not s.certfile or not s.keyfile:
        raise ConfigError("the TLS listener needs a server certificate and key (--cert/--key, or let "
                          "broker-config make a fleet CA)")
    lines = [
        f"# Mosquitto for edgeflow fleet {fleet}: generated by `edgeflow broker-config`.",
        "# Regenerate instead of editing; reload after provisioning with: kill -HUP <mosquitto pid>",
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {password_file}",
        f"acl_file {acl_file}",
        "allow_zero_length_clientid false",
        "max_inflight_messages 20",
        f"max_queued_messages {int(s.max_queued_messages or DEFAULT_MAX_QUEUED_MESSAGES)}",
        f"max_queued_bytes {int(s.max_queued_bytes or DEFAULT_MAX_QUEUED_BYTES)}",
        f"max_packet_size {int(s.max_packet_size or DEFAULT_MAX_PACKET)}",
    ]
    if s.persistence_dir:
        lines += ["persistence true", f"persistence_location {s.persistence_dir.rstrip('/')}/"]
    if s.log_file:
        lines += [f"log_dest file {s.log_file}", "log_type error", "log_type warning", "log_type notice",
                  "log_type information", "connection_messages true", "log_timestamp true"]
    if s.user:
        lines.append(f"user {s.user}")
    lines += s.extra

    # Per listener: connections past it are closed at once (before TLS), so idle sockets cannot use up
    # the broker's open files and stop every listener; LimitNOFILE must exceed the sum (docs/fleet.md).
    max_conn = f"max_connections {int(s.max_connections or MIN_MAX_CONNECTIONS)}"

    def tls(port: int, host: str) -> list[str]:
        out = [f"listener {port} {host}", max_conn, "use_username_as_clientid true",
               f"certfile {s.certfile}", f"keyfile {s.keyfile}", "tls_version tlsv1.2"]
        if s.cafile:
            out.append(f"cafile {s.cafile}")
        if s.require_certificate:
            if not s.cafile:
                raise ConfigError("require_certificate needs the CA that signs client certificates (--ca)")
            out.append("require_certificate true")
        return out

    lines += [""] + tls(s.port, s.host)
    if s.websockets_port:
        lines += [""] + tls(s.websockets_port, s.host) + ["protocol websockets"]
    if s.plain_port:
        lines += ["", f"listener {s.plain_port} 127.0.0.1", max_conn, "use_username_as_clientid true"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- TLS material


def _write_secret(path: Path, data: bytes, mode: int = 0o600) -> None:
    if not path.parent.exists():
        _make_dirs(path.parent)
    _write_file(path, data, mode)


def _new_ca(now: _dt.datetime, days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgeflow fleet CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_name, ca


def make_fleet_ca(directory: Path, hosts: Iterable[str], *, days: int = 825) -> tuple[Path, Path, Path]:
    """A fleet CA (made once, then reused) and a server certificate for ``hosts`` (names or IPs).

    Returns (ca.crt, server.crt, server.key). P-256 keys: fast TLS handshakes
    on small boards. The CA key stays in ``directory`` (0600) so later server
    certificates are issued by the CA the devices already trust.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = _dt.datetime.now(_dt.timezone.utc)
    pem = serialization.Encoding.PEM
    pkcs8 = (serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    if (directory / "ca.key").exists() and (directory / "ca.crt").exists():
        # Re-issue only the server certificate: devices keep trusting the CA they were given.
        ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
        ca = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
        ca_name = ca.subject
    else:
        ca_key, ca_name, ca = _new_ca(now, days)
        _write_secret(directory / "ca.key", ca_key.private_bytes(*pkcs8))
        _write_secret(directory / "ca.crt", ca.public_bytes(pem), 0o644)
    names: list[x509.GeneralName] = []
    hosts = list(hosts) or ["localhost", "127.0.0.1"]
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_secret(directory / "server.key", key.private_bytes(*pkcs8))
    _write_secret(directory / "server.crt", cert.public_bytes(pem), 0o644)
    return directory / "ca.crt", directory / "server.crt", directory / "server.key"


# -------------------------------------------------------------- fleet directory


@dataclass(frozen=True)
class BrokerFiles:
    config: Path
    password_file: Path
    acl_file: Path
    ca_file: Path | None
    max_connections: int = MIN_MAX_CONNECTIONS
    """``max_connections`` of each listener in the config."""
    listeners: int = 1
    firewall: Path | None = None
    """broker/nftables.conf: the per-source limits to load with ``nft -f`` (:mod:`edgeflow.broker.firewall`)."""
    per_source: int = 0
    """Connections per source address that ruleset allows on the network listeners."""

    @property
    def open_files(self) -> int:
        """The smallest ``LimitNOFILE`` (``ulimit -n``) the broker should run with for this config."""
        return self.max_connections * self.listeners + OPEN_FILES_MARGIN


class FleetDir:
    """The operator's fleet directory (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().absolute()
        """Absolute: every path written into the broker's config and the devices' credentials is."""

    # -- layout
    @property
    def meta_path(self) -> Path:
        return self.path / "fleet.json"

    @property
    def broker_dir(self) -> Path:
        return self.path / "broker"

    @property
    def keyring_path(self) -> Path:
        return self.path / "keyring.json"

    def device_dir(self, device_id: str) -> Path:
        return self.path / "devices" / validate_id(device_id, "device id")

    @property
    def exists(self) -> bool:
        return self.meta_path.exists()

    def meta(self) -> dict[str, Any]:
        try:
            return json.loads(self.meta_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{self.path} is not a fleet directory (no fleet.json); create it with "
                              f"`edgeflow broker-config --dir {self.path} --fleet NAME`") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {self.meta_path}: {exc}") from exc

    @property
    def fleet(self) -> str:
        return str(self.meta()["fleet"])

    @property
    def broker_url(self) -> str | None:
        """The URL devices are given: ``--broker-url`` if one was set, else ``mqtts://HOST:PORT`` from the
        TLS listener (HOST: the first ``--public-host``, else the first name in the server certificate);
        None before broker-config wrote a listener."""
        meta = self.meta()
        if meta.get("broker"):
            return str(meta["broker"])
        listener = meta.get("listener")
        if not listener:
            return None
        s = ListenerSettings.from_dict(listener)
        hosts = list(meta.get("tls_hosts") or [])
        host = hosts[0] if hosts else (s.host if s.host not in ("0.0.0.0", "::", "") else socket.gethostname())
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"mqtts://{host}:{int(s.port)}"

    def listener_settings(self) -> ListenerSettings:
        """The settings of the last run (defaults for a directory that has none yet)."""
        meta = self.meta() if self.exists else {}
        s = ListenerSettings.from_dict(meta.get("listener") or {})
        b = self.broker_dir
        # Older fleet.json files stored the fleet CA's own files as if an operator had given them.
        if s.certfile and Path(s.certfile) == b / "server.crt":
            s.certfile, s.keyfile = "", ""
            if s.cafile and Path(s.cafile) == b / "ca.crt":
                s.cafile = None
        return s

    def fleet_key(self) -> PrivateKey:
        return PrivateKey.load(self.path / "fleet.key")

    def _save_meta(self, meta: Mapping[str, Any]) -> None:
        """fleet.json, 0600 whatever the umask (the operator's settings; the broker never reads it)."""
        _write_file(self.meta_path, (json.dumps(meta, indent=2) + "\n").encode(), 0o600)

    def _save_keyring(self, ring: KeyRing) -> None:
        """keyring.json, 0644 whatever the umask: public keys only, read by the gateway service's user,
        writable by the fleet directory's owner alone (a writable key ring would let anyone add a device)."""
        data = {d: ring.get(d).hex for d in sorted(ring.devices())}
        _write_file(self.keyring_path, (json.dumps(data, indent=2) + "\n").encode(), 0o644)

    def fleet_public_key(self) -> PublicKey:
        return PublicKey.load(self.path / "fleet.pub")

    def keyring(self) -> KeyRing:
        return KeyRing.load(self.keyring_path) if self.keyring_path.exists() else KeyRing()

    def operator(self, user: str = "admin") -> dict[str, str]:
        """{"username", "password"} of an operator user."""
        p = self.path / "operators" / f"{user}.json"
        try:
            return json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"no credentials for operator {user!r} in {self.path}/operators; "
                              "re-run `edgeflow broker-config`") from None

    def claim_operator(self, user: str = "admin", *, wait_s: float = 600.0) -> tuple[dict[str, str], Any]:
        """Credentials of ``user`` or of a free one of its session users (``user-2`` ...), and the lock
        that holds it (close it to release; :data:`ADMIN_SESSIONS`).

        A lock file per operator user (``operators/.USER.lock``, ``flock``) marks it taken while a
        command runs on this machine, so commands started at once connect as different users and
        never share a broker session. When all are taken the call waits (logging why) for one to
        be released, at most ``wait_s`` seconds; then it is a ConfigError naming the fix.
        """
        import logging

        known = set(self.meta().get("operators", ())) if self.exists else set()
        pool = [user] + [f"{user}-{i}" for i in range(2, 100) if f"{user}-{i}" in known]
        try:
            import fcntl
        except ImportError:  # no flock (Windows): one session user, as before
            return self.operator(user), None
        creds = self.operator(user)  # a missing operator is its ConfigError before any lock is taken
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            for name in pool:
                lock_path = self.path / "operators" / f".{name}.lock"
                try:
                    lock = os.fdopen(os.open(lock_path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600),
                                     "r+b")  # held until released
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise _link_error(lock_path) from None
                    raise
                try:
                    fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    lock.close()
                    continue
                return (creds if name == user else self.operator(name)), lock
            if time.monotonic() > deadline:
                raise ConfigError(f"all {len(pool)} session(s) of operator {user!r} are in use by other "
                                  f"`edgeflow fleet` commands for {wait_s:g} s; wait for them, or re-run "
                                  "`edgeflow broker-config` (it adds session users) and reload the broker")
            if not said:
                logging.getLogger("edgeflow.fleet").warning(
                    "all %d session(s) of operator %r are in use by other `edgeflow fleet` commands: "
                    "waiting for one", len(pool), user)
                said = True
            time.sleep(0.2)

    def ca_file(self) -> Path | None:
        p = self.broker_dir / "ca.crt"
        return p if p.exists() else None

    def devices(self) -> list[str]:
        d = self.path / "devices"
        return sorted(p.name for p in d.iterdir() if (p / "device.json").exists()) if d.exists() else []

    # -- creation
    def init(self, fleet: str, *, broker: str | None = None, operators: Iterable[str] = OPERATORS) -> FleetDir:
        """Create the directory, fleet key and operator credentials (keeps what exists)."""
        validate_id(fleet, "fleet id")
        meta = self.meta() if self.exists else {}
        if meta and meta.get("fleet") != fleet:
            raise ConfigError(f"{self.path} belongs to fleet {meta.get('fleet')!r}, not {fleet!r}")
        ops = sorted(set(meta.get("operators", [])) | set(operators))
        for user in ops:
            if user != GATEWAY:
                validate_id(user, "operator user name")
        new = sorted(set(ops) - set(meta.get("operators", [])))
        if self.exists and new:  # a new operator name must not take a provisioned device's (or its sessions')
            bases = {m.group(1) if (m := _SESSION_SUFFIX.fullmatch(op)) else op for op in new}
            for dev in sorted(set(self.devices()) | set(self.keyring().devices())):
                m = _SESSION_SUFFIX.fullmatch(dev)
                if dev in bases or (m and m.group(1) in bases):
                    raise ConfigError(f"operator user name(s) {', '.join(new)} would share a name space with "
                                      f"provisioned device {dev!r} (an operator owns NAME and its session users "
                                      "NAME-2, NAME-3 ...): pick another operator name")
        if not self.path.exists():
            _make_dirs(self.path, 0o700)
        _refuse_links(self._own_entries())
        meta.update({"fleet": fleet, "operators": ops})
        if broker:
            meta["broker"] = broker
        self._save_meta(meta)
        if not (self.path / "operators").exists():
            _make_dirs(self.path / "operators", 0o700)
        if not (self.path / "fleet.key").exists():
            key = PrivateKey.generate()
            key.save(self.path / "fleet.key")
            key.public_key.save(self.path / "fleet.pub", format="hex", overwrite=True)
        for user in ops:
            p = self.path / "operators" / f"{user}.json"
            if not p.exists():
                _write_secret(p, (json.dumps({"username": user, "password": secrets.token_urlsafe(24)}) + "\n").encode())
        if not self.keyring_path.exists():
            self._save_keyring(KeyRing())
        return self

    def _own_entries(self) -> list[Path]:
        """The fleet directory's entries broker-config writes, reads as its own or chowns: none may be a link."""
        b = self.broker_dir
        return [self.meta_path, self.keyring_path, self.path / "fleet.key", self.path / "fleet.pub",
                self.path / "operators", self.path / "devices", b,
                *(b / n for n in ("passwd", "acl", "mosquitto.conf", "ca.crt", "ca.key", "server.crt", "server.key",
                                  "nftables.conf"))]

    def _check_names(self, ops: list[str], devices: Iterable[str]) -> None:
        """Devices and operators in disjoint name spaces; each device's MQTT user name is its id."""
        owned = operator_namespace(ops)
        for dev in sorted(devices):
            if owned(dev):
                raise _namespace_error(dev, "as a broker user it would take an operator's name and rights; revoke "
                                            "it (`edgeflow fleet revoke ID`) and provision the board under another id")

    def write_broker_config(self, settings: ListenerSettings | None = None, *,
                            tls_hosts: Iterable[str] | None = None) -> BrokerFiles:
        """mosquitto.conf, passwd and acl for the fleet's current devices and operators.

        ``settings`` None reuses the ones stored by the last run (provisioning
        only adds users). Everything is validated first (ports, certificate
        files, the broker user and whether it can reach the directory);
        nothing is written when something is wrong. Without a certificate in
        ``settings`` a fleet CA and a server certificate for ``tls_hosts``
        (default: the stored ones, else this host's name, localhost,
        127.0.0.1) are made once and reused. Devices whose credentials have no
        broker URL yet get :attr:`broker_url`.
        """
        meta = self.meta()
        fleet, ops = meta["fleet"], list(meta.get("operators", OPERATORS))
        s, user, grant = self._checked(settings)  # raises before anything is written
        provisioned = set(self.keyring().devices())
        self._check_names(ops, set(self.devices()) | provisioned)
        b = self.broker_dir
        if not b.exists():
            _make_dirs(b, 0o700)
        hosts = list(tls_hosts) if tls_hosts is not None else None
        if not s.certfile:
            if not (b / "server.crt").exists() or hosts is not None:
                make_fleet_ca(b, hosts or list(meta.get("tls_hosts") or [socket.gethostname(), "localhost", "127.0.0.1"]))
        else:
            for src, dst in ((s.certfile, b / "server.crt"), (s.keyfile, b / "server.key")):
                if Path(src) != dst:
                    _write_secret(dst, Path(src).read_bytes())
        if s.cafile and Path(s.cafile) != b / "ca.crt":
            _write_secret(b / "ca.crt", Path(s.cafile).read_bytes(), 0o644)
        hashed = read_password_file(b / "passwd")
        users = {}
        for op in ops:
            users[op] = self.operator(op)["password"]
        for dev in self.devices():
            creds = json.loads((self.device_dir(dev) / "device.json").read_text(encoding="utf-8"))
            if creds.get("username") != dev:  # would set another user's password (an operator's, say)
                raise ConfigError(f"{self.device_dir(dev) / 'device.json'}: user name {creds.get('username')!r} is "
                                  f"not the device id {dev!r}; re-provision it (`edgeflow fleet provision {dev} --force`)")
            users[dev] = creds["password"]
        # A provisioned device whose credentials directory was moved off this machine keeps its hash.
        keep = {u: h for u, h in hashed.items() if u not in users and u in provisioned}
        write_password_file(b / "passwd", users, hashed=keep)
        ca = b / "ca.crt"
        if ca.exists():  # devices provisioned before the CA existed (or before it changed) get the current one
            ca_pem = ca.read_bytes()
            for dev in self.devices():
                dst = self.device_dir(dev) / "ca.crt"
                st = _lstat(dst)
                if st is None or stat.S_ISLNK(st.st_mode) or dst.read_bytes() != ca_pem:
                    _write_file(dst, ca_pem, 0o644)
        acl = b / "acl"
        devices = set(self.devices()) | provisioned
        _write_file(acl, fleet_acl(fleet, ops, devices).encode(), 0o600)
        meta["listener"] = dataclasses.asdict(s)
        if hosts is not None:
            meta["tls_hosts"] = hosts
        self._save_meta(meta)
        max_conn = s.max_connections or fleet_max_connections(len(devices) + len(ops))
        rendered = dataclasses.replace(s, certfile=str(b / "server.crt"), keyfile=str(b / "server.key"),
                                       cafile=str(ca) if ca.exists() else None, user=user, max_connections=max_conn)
        conf = b / "mosquitto.conf"
        _write_file(conf, render_config(fleet, rendered, password_file=str(b / "passwd"), acl_file=str(acl)).encode(),
                    0o600)
        limits = self._connection_limits(fleet, s, len(ops))
        firewall = b / "nftables.conf"
        _write_file(firewall, nftables_ruleset(limits, config_path=str(firewall)).encode(), 0o600)
        if grant is not None:
            grant()
        self._fill_broker_urls()
        listeners = 1 + bool(s.websockets_port) + bool(s.plain_port)
        return BrokerFiles(conf, b / "passwd", acl, ca if ca.exists() else None, max_conn, listeners, firewall,
                           limits.per_source)

    @staticmethod
    def _connection_limits(fleet: str, s: ListenerSettings, operator_users: int) -> ConnectionLimits:
        """The per-source limits of the network listeners (TLS, websockets; the plain one is loopback only)."""
        ports = [s.port] + ([s.websockets_port] if s.websockets_port else [])
        per_source = s.per_source_connections or per_source_limit(operator_users)
        return ConnectionLimits.for_source(fleet, ports, per_source)

    def check_broker_config(self, settings: ListenerSettings) -> None:
        """Every check :meth:`write_broker_config` makes (ports, certificate files, the broker user and
        whether it can reach the directory), without writing anything; the directory need not exist yet,
        so ``edgeflow broker-config`` runs it before :meth:`init` creates anything."""
        self._checked(settings)

    def _checked(self, settings: ListenerSettings | None) -> tuple[ListenerSettings, str, Any]:
        """The validated settings (paths made absolute), the broker's user and the step granting it access."""
        s = dataclasses.replace(settings) if settings is not None else self.listener_settings()
        s.validate()
        for attr in ("certfile", "keyfile", "cafile", "log_file", "persistence_dir"):
            v = getattr(s, attr)
            if v:
                setattr(s, attr, str(Path(v).expanduser().absolute()))
        user = broker_user(s)
        _refuse_links(self._own_entries())
        return s, user, self._broker_access(user, s)

    def _broker_access(self, user: str, s: ListenerSettings) -> Any:
        """Check that ``user`` will be able to read the broker's files; return the step that grants it.

        Only when run as root for another user: Mosquitto drops to ``user``
        before opening any file, so the fleet directory becomes traversable
        by the user's group (0710, nothing listable), broker/ and the files
        the broker reads readable by it (0750/0640, still owned by root, so
        the broker cannot rewrite its own ACL), the log file and persistence
        directory writable. The fleet CA key stays root's alone.
        """
        if not hasattr(os, "geteuid") or os.geteuid() != 0 or user == "root":
            return None
        pw = _passwd(user)
        gids = set(os.getgrouplist(user, pw.pw_gid))
        ok, blocker = _reachable(self.path, pw.pw_uid, gids)
        if not ok:
            mode = stat.filemode(blocker.stat().st_mode)
            raise ConfigError(
                f"Mosquitto started as root drops to user {user!r}, which cannot enter {blocker} ({mode}): put the "
                f"fleet directory where {user} can reach it (e.g. under /srv or /var/lib), or pass --broker-user "
                "root to run the broker as root (not recommended)")
        for flag, value, kind in (("--log-file", s.log_file, "file"), ("--persistence", s.persistence_dir, "directory")):
            if value:
                path = Path(value).expanduser().absolute()
                ok, blocker = _reachable(path, pw.pw_uid, gids)
                if not ok:
                    raise ConfigError(f"{flag} {value}: user {user!r} cannot enter {blocker}; choose a path it can reach")
                st = _lstat(path)
                problem = None if st is None else _foreign(path, st, flag, pw.pw_uid, user, kind)
                if problem is not None:
                    raise problem

        def grant() -> None:
            gid = pw.pw_gid
            _grant(Path(os.path.realpath(self.path)), gid, 0o710)  # the operator may have named it by a link
            b = self.broker_dir
            _grant(b, gid, 0o750)
            for name in ("passwd", "acl", "server.crt", "server.key", "ca.crt", "mosquitto.conf"):
                if (b / name).exists():
                    _grant(b / name, gid, 0o640)
            if (b / "ca.key").exists():
                _grant(b / "ca.key", 0, 0o600)
            # Outside the fleet directory, in places the broker user may write itself (/var/log/mosquitto):
            # created here for it, or left as they are when already its own; never through a link.
            if s.log_file:
                _hand_over(Path(s.log_file), "--log-file", pw.pw_uid, gid, user, directory=False)
            if s.persistence_dir:
                _hand_over(Path(s.persistence_dir.rstrip("/") or "/"), "--persistence", pw.pw_uid, gid, user,
                           directory=True)

        return grant

    def _fill_broker_urls(self) -> None:
        url = self.broker_url
        if not url:
            return
        for dev in self.devices():
            path = self.device_dir(dev) / "device.json"
            creds = json.loads(path.read_text(encoding="utf-8"))
            if not creds.get("broker"):
                creds["broker"] = url
                _write_secret(path, (json.dumps(creds, indent=2) + "\n").encode())

    def revoked(self) -> dict[str, Any]:
        """Revoked devices: ``{device_id: {"ts", "key", "moved_to"}}`` (fleet.json)."""
        return dict(self.meta().get("revoked") or {}) if self.exists else {}

    def revoke(self, device_id: str) -> dict[str, Any]:
        """Revoke a device (a stolen or compromised board): its key leaves the key ring (a gateway running
        with the fleet directory's key ring refuses its births, updates and acks within
        ``[fleet] keyring_reload_s``), its credentials directory moves to ``revoked/`` (so the next
        :meth:`write_broker_config` drops its password and ACL entries), and fleet.json records it.
        Provisioning the id again later makes a new key and password."""
        validate_id(device_id, "device id")
        ring = self.keyring()
        d = self.device_dir(device_id)
        key = ring.get(device_id)
        if key is None and not d.exists():
            known = ", ".join(self.devices()) or "none"
            raise ConfigError(f"device {device_id!r} is not provisioned in {self.path} (provisioned: {known})")
        moved = None
        if d.exists():
            dst = self.path / "revoked" / f"{device_id}-{int(time.time())}"
            if not dst.parent.exists():
                _make_dirs(dst.parent, 0o700)
            shutil.move(str(d), str(dst))
            moved = str(dst)
        if key is not None:
            ring.unregister(device_id)
            self._save_keyring(ring)
        meta = self.meta()
        rec = {"ts": time.time(), "key": key.hex if key is not None else None, "moved_to": moved}
        meta.setdefault("revoked", {})[device_id] = rec
        self._save_meta(meta)
        return rec

    def provision(self, device_id: str, *, profile: str | None = None, broker: str | None = None,
                  overwrite: bool = False) -> Path:
        """A credentials directory for ``device_id`` under devices/, its key in the key ring.

        The device is given ``broker`` or :attr:`broker_url`; when neither is
        known yet (no broker-config run), its ``broker`` stays null until
        :meth:`write_broker_config` fills it in. Re-run
        :meth:`write_broker_config` (``edgeflow fleet provision`` does) and
        reload Mosquitto so the new password and ACL are accepted.
        """
        from ..device.credentials import provision_device

        validate_id(device_id, "device id")
        meta = self.meta()
        if operator_namespace(meta.get("operators", OPERATORS))(device_id):
            raise _namespace_error(device_id, "a device with it would take an operator's name and rights, now or "
                                              "when a later broker-config adds that session user; pick another device id")
        if not (self.path / "devices").exists():
            _make_dirs(self.path / "devices", 0o700)
        d = self.device_dir(device_id)
        _refuse_links([d, d / "ca.crt"])
        creds = provision_device(d, device_id, meta["fleet"], self.fleet_public_key(), broker=broker or self.broker_url,
                                 profile=profile, ca_file=self.ca_file(), overwrite=overwrite)
        if (d / "ca.crt").exists():  # copied with the umask's mode: public, never writable by others
            _chmod_own(d / "ca.crt", 0o644)
        ring = self.keyring()
        ring.register(device_id, creds.key.public_key, replace=True)
        self._save_keyring(ring)
        if device_id in (meta.get("revoked") or {}):  # provisioned again: a new key, no longer revoked
            meta["revoked"].pop(device_id)
            self._save_meta(meta)
        return d
