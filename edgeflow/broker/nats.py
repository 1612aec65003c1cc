"""nats-server configuration for a fleet: accounts, users and subject permissions.

The NATS counterpart of :func:`edgeflow.broker.mosquitto.fleet_acl`, derived
from the same topic table (:data:`~edgeflow.transport.topics.DEVICE_CHANNEL_SPECS`
and :data:`~edgeflow.transport.topics.GATEWAY_CHANNEL_SPECS`), so the two
cannot drift apart:

- a device (user name = device id) publishes only on its own channels where
  it is the writer (live subject and, for retained channels, the retained
  subject), and its own will record; it subscribes only to its own channels
  where the gateway or an application writes, and to the gateway's channels;
  its JetStream rights are the few API calls the transport makes (stream
  info, and consumers on the retained and live streams whose filter is a
  subject it may read: the filter is part of the API subject since 2.9);
- operators (``gateway``, ``admin``, ...) read and write the fleet's tree and
  manage the streams;
- the system account holds one user, the will keeper
  (:class:`edgeflow.transport.nats.WillKeeper`), which hears the server's
  disconnect events.

TLS: give ``tls`` (server certificate, key and the fleet CA, from
:func:`edgeflow.broker.mosquitto.make_fleet_ca`) and clients connect with
``tls://``.

Leaf nodes (a site's own nats-server, bridged to the hub's; docs/transport.md,
"NATS leaf nodes"): :func:`nats_site_config` (the site's fleet account local, in
the site's JetStream domain; an ``UPLINK`` account bridged to the hub),
:func:`nats_hub_leafnodes` (the hub's leaf port; the sites log in as their
users from :func:`nats_fleet_config`'s ``sites``), :func:`nats_jetstream_block`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import quote

from edgeflow.broker.mosquitto import OPERATORS, operator_namespace
from edgeflow.errors import ConfigError
from edgeflow.transport.nats.subjects import DEFAULT_PREFIX, StreamNames, encode_level, topic_subject
from edgeflow.transport.topics import DEVICE_CHANNEL_SPECS, GATEWAY, GATEWAY_CHANNEL_SPECS, validate_id

__all__ = [
    "DEFAULT_LEAF_PORT",
    "UPLINK_ACCOUNT",
    "NatsFleetConfig",
    "NatsTls",
    "jetstream_domain",
    "nats_fleet_config",
    "nats_hub_leafnodes",
    "nats_jetstream_block",
    "nats_site_config",
    "parse_leaf_url",
    "subject_matches",
    "write_hub_config",
    "write_site_config",
]

SYSTEM_ACCOUNT = "SYS"
KEEPER_USER = "will-keeper"


@dataclass(frozen=True)
class NatsTls:
    certfile: str
    keyfile: str
    cafile: str
    verify_clients: bool = False


@dataclass(frozen=True)
class NatsFleetConfig:
    """The generated config text and the permissions in it (the will keeper checks wills against them)."""

    text: str
    publish: Mapping[str, tuple[str, ...]]
    """user -> subjects (with NATS wildcards) the user may publish to."""

    def may_publish(self, user: str | None, subject: str) -> bool:
        allowed = self.publish.get(user or "", ())
        return any(subject_matches(p, subject) for p in allowed)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` one token, ``>`` one or more at the end."""
    pt, st = pattern.split("."), subject.split(".")
    for i, p in enumerate(pt):
        if p == ">":
            return len(st) > i
        if i >= len(st) or (p != "*" and p != st[i]):
            return False
    return len(pt) == len(st)


def _q(items: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(s) for s in items) + "]"


def _levels(fleet: str, who: str, writer: bool, specs: Iterable[object], prefix: str) -> tuple[list[str], list[str]]:
    """(live subjects, retained subjects) of the channels ``specs`` under edgeflow/<fleet>/<who>."""
    live: list[str] = []
    retained: list[str] = []
    for spec in specs:
        for level in spec.levels():  # type: ignore[attr-defined]
            topic = f"edgeflow/{fleet}/{who}/{level}"
            subj = _wild(topic, prefix)
            live.append(subj)
            if spec.retained:  # type: ignore[attr-defined]
                retained.append(_wild(topic, f"{prefix}_retained"))
    return live, retained


def _wild(topic: str, prefix: str) -> str:
    """A topic pattern with MQTT ``+`` as a subject pattern (levels escaped, ``+`` -> ``*``)."""
    return ".".join([prefix, *("*" if x == "+" else encode_level(x) for x in topic.split("/"))])


def _device_permissions(fleet: str, device: str, prefix: str, api: str = "$JS.API") -> tuple[list[str], list[str]]:
    names = StreamNames(prefix)
    own_w = [s for s in DEVICE_CHANNEL_SPECS if s.writer == "device"]
    own_r = [s for s in DEVICE_CHANNEL_SPECS if s.writer != "device"]
    pub_live, pub_ret = _levels(fleet, device, True, own_w, prefix)
    sub_live, sub_ret = _levels(fleet, device, False, own_r, prefix)
    gw_live, gw_ret = _levels(fleet, GATEWAY, False, GATEWAY_CHANNEL_SPECS, prefix)
    readable_live = sub_live + gw_live
    # the retained store is read like the live subjects (MQTT's ACL read covers retained messages too)
    readable_ret = [f"{prefix}_retained." + s.split(".", 1)[1] for s in readable_live]
    del sub_ret, gw_ret
    publish = pub_live + pub_ret + [
        f"{prefix}_will.{encode_level(device)}",
        f"{api}.INFO", f"{api}.STREAM.INFO.{names.live}", f"{api}.STREAM.INFO.{names.retained}",
        f"{api}.STREAM.INFO.{names.wills}",
        *[f"{api}.CONSUMER.CREATE.{names.retained}.*.{s}" for s in readable_ret],
        *[f"{api}.CONSUMER.CREATE.{names.live}.*.{s}" for s in readable_live],
        f"{api}.CONSUMER.MSG.NEXT.{names.retained}.*", f"{api}.CONSUMER.MSG.NEXT.{names.live}.*",
        f"{api}.CONSUMER.DELETE.{names.retained}.*", f"{api}.CONSUMER.DELETE.{names.live}.*",
    ]
    subscribe = readable_live + [f"_INBOX.{encode_level(device)}.>"]
    return publish, subscribe


def _fleet_account(fleet: str, devices: Mapping[str, str], operators: Mapping[str, str], prefix: str,
                   sites: Mapping[str, str] | None = None,
                   hub_domain: str = "") -> tuple[str, list[str], dict[str, tuple[str, ...]]]:
    """(account name, the account block's lines, user -> publish allow list) of ``fleet``.

    ``sites``: leaf users, a device's rights with the JetStream API under ``$JS.<hub_domain>.API``
    (the subject a site's uplink account maps its API calls to).
    """
    validate_id(fleet, "fleet id")
    owned = operator_namespace(list(operators) or list(OPERATORS))
    publish: dict[str, tuple[str, ...]] = {}
    users: list[str] = []
    sites = sites or {}
    for dev in sorted({*devices, *sites}):
        validate_id(dev, "device id" if dev in devices else "site id")
        if owned(dev):
            raise ConfigError(f"device id {dev!r} is in the operators' name space; provision the board under another id")
        if dev in devices and dev in sites:
            raise ConfigError(f"{dev!r} is both a device and a site; give each its own id")
        api = f"$JS.{hub_domain}.API" if dev in sites else "$JS.API"
        pub, sub = _device_permissions(fleet, dev, prefix, api)
        publish[dev] = tuple(pub)
        password = devices[dev] if dev in devices else sites[dev]
        users.append(f"      {{user: {json.dumps(dev)}, password: {json.dumps(password)}, "
                     f"permissions: {{publish: {{allow: {_q(pub)}}}, subscribe: {{allow: {_q(sub)}}}}}}}")
    root = topic_subject(f"edgeflow/{fleet}", prefix)
    rroot = topic_subject(f"edgeflow/{fleet}", f"{prefix}_retained")
    for op in sorted(operators):
        pub = [f"{root}.>", f"{rroot}.>", f"{prefix}_will.>", "$JS.API.>"]
        sub = [f"{root}.>", "_INBOX.>"]
        publish[op] = tuple(pub)
        users.append(f"      {{user: {json.dumps(op)}, password: {json.dumps(operators[op])}, "
                     f"permissions: {{publish: {{allow: {_q(pub)}}}, subscribe: {{allow: {_q(sub)}}}}}}}")
    account = fleet.upper().replace(".", "_").replace("-", "_")
    lines = [f"  {account}: {{",
             "    jetstream: enabled",
             "    users: [",
             ",\n".join(users),
             "    ]",
             "  }"]
    return account, lines, publish


def _system_account(keeper_password: str) -> list[str]:
    return [f"  {SYSTEM_ACCOUNT}: {{ users: [ {{user: {json.dumps(KEEPER_USER)}, "
            f"password: {json.dumps(keeper_password)}}} ] }}"]


def _tls_block(name: str, tls: NatsTls, indent: str = "") -> list[str]:
    return [f"{indent}{name} {{", f"{indent}  cert_file: {json.dumps(tls.certfile)}",
            f"{indent}  key_file: {json.dumps(tls.keyfile)}", f"{indent}  ca_file: {json.dumps(tls.cafile)}",
            f"{indent}  verify: {'true' if tls.verify_clients else 'false'}", f"{indent}}}"]


def nats_fleet_config(
    fleet: str,
    devices: Mapping[str, str],
    operators: Mapping[str, str],
    *,
    keeper_password: str,
    prefix: str = DEFAULT_PREFIX,
    tls: NatsTls | None = None,
    max_payload: int | None = None,
    sites: Mapping[str, str] | None = None,
    hub_domain: str = "hub",
) -> NatsFleetConfig:
    """The accounts/users block of a nats-server config for ``fleet`` (append to ``jetstream``/``port``).

    ``devices`` and ``operators`` map user names to passwords (nats-server also takes bcrypt hashes
    there: ``nats server passwd``). A device id in the operators' name space is refused, as in
    :func:`~edgeflow.broker.mosquitto.fleet_acl`. ``sites``: on a hub, the sites' leaf users
    (:func:`nats_hub_leafnodes`); ``hub_domain``: this server's JetStream domain then.
    """
    _, account, publish = _fleet_account(fleet, devices, operators, prefix, sites, hub_domain)
    lines = [f"# edgeflow fleet {fleet}: generated by edgeflow.broker.nats; do not edit by hand",
             "accounts {", *account, *_system_account(keeper_password), "}",
             f"system_account: {SYSTEM_ACCOUNT}"]
    if max_payload:
        lines.append(f"max_payload: {int(max_payload)}")
    if tls is not None:
        lines += _tls_block("tls", tls)
    return NatsFleetConfig("\n".join(lines) + "\n", publish)


# ------------------------------------------------------------------ leaf nodes

UPLINK_ACCOUNT = "UPLINK"
DEFAULT_LEAF_PORT = 7422
HUB_DOMAIN = "hub"


def jetstream_domain(site_id: str) -> str:
    """The JetStream domain of a site's leaf server: its streams live there, apart from the hub's."""
    validate_id(site_id, "site id")
    return site_id.replace(".", "_")


def nats_jetstream_block(store_dir: str, domain: str | None = None) -> str:
    """``jetstream { store_dir, domain }``: the hub's domain (``hub``) or a site's (:func:`jetstream_domain`)."""
    if domain is not None and (not domain or not all(c.isalnum() or c in "_-" for c in domain)):
        raise ConfigError(f"JetStream domain {domain!r} must be letters, digits, '_' or '-'")
    inner = f"store_dir: {json.dumps(store_dir)}" + (f", domain: {json.dumps(domain)}" if domain else "")
    return f"jetstream {{ {inner} }}\n"


def nats_hub_leafnodes(*, port: int = DEFAULT_LEAF_PORT, host: str = "0.0.0.0", tls: NatsTls | None = None) -> str:
    """The hub's ``leafnodes`` block (append to its :func:`nats_fleet_config` text).

    No ``authorization`` block of its own: a site's leaf connection logs in as the site's user in
    the fleet account, made like any device's (pass the site among ``devices`` to
    :func:`nats_fleet_config`; ``edgeflow fleet provision <site>``: a site is a device of the
    root). nats-server then applies that user's permissions to the leaf connection: what it may
    publish is what the site may send into the hub (its own ``update``/``telemetry``/... subjects,
    its will record, the few JetStream API calls), what it may subscribe to is what the hub lets
    through to the site (the gateway's channels, the site's own commands, replies to its inbox).
    """
    if not 0 < int(port) < 65536:
        raise ConfigError(f"leaf node port must be in 1..65535, got {port}")
    lines = ["leafnodes {", f"  host: {json.dumps(host)}", f"  port: {int(port)}"]
    if tls is not None:
        lines += _tls_block("tls", tls, "  ")
    return "\n".join([*lines, "}"]) + "\n"


def nats_site_config(
    fleet: str,
    site_id: str,
    devices: Mapping[str, str],
    operators: Mapping[str, str],
    *,
    keeper_password: str,
    uplink_password: str,
    hub_host: str,
    hub_password: str,
    hub_port: int = DEFAULT_LEAF_PORT,
    hub_ca: str | None = None,
    hub_domain: str = HUB_DOMAIN,
    prefix: str = DEFAULT_PREFIX,
    tls: NatsTls | None = None,
) -> NatsFleetConfig:
    """A site's leaf nats-server: the site's fleet account local, an uplink account bridged to the hub.

    Two accounts, the NATS form of the Mosquitto bridge's ``_uplink`` prefix
    (:mod:`edgeflow.broker.bridge`):

    - the fleet account (``devices`` and the site gateway among ``operators``) with JetStream
      enabled here: its streams live in this server's domain (:func:`jetstream_domain`, give
      :func:`nats_jetstream_block` the same site id), so devices and the site gateway keep
      publishing, acknowledging and replaying while the uplink is down. It is not bridged: the
      site gateway's own ``gateway/round`` and ``gateway/model`` never meet the root's;
    - ``UPLINK``: one user, named like the site (the site gateway's uplink transport connects
      here with ``client_id=<site>``), without JetStream of its own, bound by the leaf ``remotes``
      entry to the hub's fleet account as the site's user there (``hub_password``). Its JetStream
      requests therefore go to the hub: a partial is acknowledged only once the hub's stream holds
      it; while the uplink is down the transport keeps it and sends it again (same
      ``Nats-Msg-Id``) when the leaf connection is back.

    ``hub_ca``: the fleet CA when the hub's leaf port has TLS (:func:`nats_hub_leafnodes` with
    ``tls``); ``tls``: this server's own client-facing TLS.
    """
    validate_id(site_id, "site id")
    if site_id == GATEWAY:
        raise ConfigError(f"site id {GATEWAY!r} is reserved")
    if site_id in devices or site_id in operators:
        raise ConfigError(f"site id {site_id!r} is also a device or operator of the site; the uplink user needs it")
    if not hub_host or any(c in hub_host for c in " \t\r\n/@:"):
        raise ConfigError(f"hub host {hub_host!r} is not a host name")
    if not 0 < int(hub_port) < 65536:
        raise ConfigError(f"hub leaf node port must be in 1..65535, got {hub_port}")
    _, account, publish = _fleet_account(fleet, devices, operators, prefix)
    uplink = [f"  {UPLINK_ACCOUNT}: {{ users: [ {{user: {json.dumps(site_id)}, "
              f"password: {json.dumps(uplink_password)}}} ],",
              f"    mappings: {{ \"$JS.API.>\": {json.dumps(f'$JS.{hub_domain}.API.>')} }} }}"]
    url = f"nats-leaf://{quote(site_id, safe='')}:{quote(hub_password, safe='')}@{hub_host}:{int(hub_port)}"
    remote = [f"    {{ url: {json.dumps(url)}, account: {UPLINK_ACCOUNT}"]
    if hub_ca is not None:
        remote[0] += f", tls: {{ ca_file: {json.dumps(hub_ca)} }}"
    remote[0] += " }"
    lines = [f"# edgeflow fleet {fleet}, site {site_id}: leaf node of the hub {hub_host}:{int(hub_port)};",
             "# generated by edgeflow.broker.nats; regenerate instead of editing",
             "accounts {", *account, *uplink, *_system_account(keeper_password), "}",
             f"system_account: {SYSTEM_ACCOUNT}",
             "leafnodes {", "  reconnect: 1", "  remotes = [", *remote, "  ]", "}"]
    if tls is not None:
        lines += _tls_block("tls", tls)
    return NatsFleetConfig("\n".join(lines) + "\n", publish)


# ------------------------------------------------------------------ from a fleet directory

HUB_CONFIG = "nats-hub.conf"
LEAF_CONFIG = "nats-leaf.conf"
UPLINK_CREDENTIALS = "nats-uplink.json"
"""At a site: the UPLINK user's name and password (the site gateway's uplink transport logs in with them)."""
_KEEPER_CREDENTIALS = "nats-keeper.json"


def parse_leaf_url(url: str) -> tuple[str, int, bool]:
    """A hub's leaf port as ``nats://HUB[:PORT]`` or ``tls://HUB[:PORT]`` -> (host, port, tls).

    The port defaults to 7422 (nats-server's leaf port, not the client port 4222). No user name or
    password in it: the site logs in with the credentials the hub's fleet directory made for it.
    """
    from urllib.parse import urlsplit

    fix = "use nats://HUB:7422, or tls://HUB:7422 for a TLS leaf port"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ConfigError(f"hub leaf URL {url!r} has a bad port; {fix}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("nats", "tls") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"hub leaf URL {url!r} is not one; {fix}")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"hub leaf URL {url!r} holds a user name or password; leave them out: the site's "
                          "password comes from its credentials file (--hub-credentials)")
    port = DEFAULT_LEAF_PORT if port is None else port
    if not 0 < port < 65536:
        raise ConfigError(f"hub leaf URL {url!r}: port must be in 1..65535; {fix}")
    return parts.hostname, port, scheme == "tls"


def _server_head(name: str, host: str, port: int) -> str:
    if not 0 < int(port) < 65536:
        raise ConfigError(f"nats-server client port must be in 1..65535, got {port}")
    return f"server_name: {json.dumps(name)}\nhost: {json.dumps(host)}\nport: {int(port)}\n"


def _stored_secret(path, user: str) -> str:
    """The password kept in ``path`` (made once, mode 0600, reused by every rerun)."""
    import secrets
    from pathlib import Path

    from edgeflow.broker.mosquitto import _write_secret

    p = Path(path)
    try:
        return str(json.loads(p.read_text(encoding="utf-8"))["password"])
    except FileNotFoundError:
        pw = secrets.token_urlsafe(24)
        p.parent.mkdir(parents=True, exist_ok=True)
        _write_secret(p, (json.dumps({"username": user, "password": pw}) + "\n").encode())
        return pw
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{p} is not a credentials file ({{\"username\", \"password\"}}); delete it to make a "
                          "new one") from None


def _fleet_users(fd) -> tuple[dict[str, str], dict[str, str]]:
    """(device -> password, operator -> password) of a fleet directory."""
    meta = fd.meta()
    operators = {op: fd.operator(op)["password"] for op in meta.get("operators", OPERATORS)}
    devices: dict[str, str] = {}
    for dev in fd.devices():
        creds = json.loads((fd.device_dir(dev) / "device.json").read_text(encoding="utf-8"))
        if creds.get("username") != dev:
            raise ConfigError(f"{fd.device_dir(dev) / 'device.json'}: user name {creds.get('username')!r} is not "
                              f"the device id {dev!r}; re-provision it (`edgeflow fleet provision {dev} --force`)")
        devices[dev] = creds["password"]
    return devices, operators


def write_hub_config(fd, sites: Iterable[str], *, leaf_port: int = DEFAULT_LEAF_PORT, host: str = "0.0.0.0",
                     port: int = 4222, store_dir: str | None = None, leaf_tls: bool = False):
    """``broker/nats-hub.conf`` (0600) of a hub's fleet directory: its devices and operators, ``sites`` as
    leaf users (each provisioned like a device: ``edgeflow fleet provision <site>``) and the leaf port.

    ``leaf_tls``: the leaf port with the fleet's server certificate (``broker/server.crt``, made by
    ``edgeflow broker-config``); the sites then connect with ``tls://``."""
    from pathlib import Path

    from edgeflow.broker.mosquitto import _write_secret

    sites = sorted(set(sites))
    devices, operators = _fleet_users(fd)
    for s in sites:
        if s not in devices:
            raise ConfigError(f"site {s!r} is not provisioned in {fd.path}: run `edgeflow fleet provision {s}` "
                              "first (a site is a device of the hub)")
    b = fd.broker_dir
    tls = None
    if leaf_tls:
        cert, key, ca = b / "server.crt", b / "server.key", b / "ca.crt"
        if not (cert.exists() and key.exists() and ca.exists()):
            raise ConfigError(f"no server certificate in {b} for a TLS leaf port: run `edgeflow broker-config` "
                              "first (it makes the fleet CA), or leave out --leaf-tls")
        tls = NatsTls(str(cert), str(key), str(ca))
    head = _server_head("hub", host, port)
    store = store_dir or str(Path(b) / "nats-js")
    cfg = nats_fleet_config(fd.fleet, {d: p for d, p in devices.items() if d not in sites}, operators,
                            keeper_password=_stored_secret(b / _KEEPER_CREDENTIALS, KEEPER_USER),
                            sites={s: devices[s] for s in sites}, hub_domain=HUB_DOMAIN)
    text = head + nats_jetstream_block(store, HUB_DOMAIN) + cfg.text + nats_hub_leafnodes(port=leaf_port, tls=tls)
    path = b / HUB_CONFIG
    _write_secret(path, text.encode())
    return path


def write_site_config(fd, hub_url: str, hub_credentials, *, hub_ca: str | None = None, host: str = "0.0.0.0",
                      port: int = 4222, store_dir: str | None = None):
    """``broker/nats-leaf.conf`` (0600) of a site's fleet directory: its devices and operators local, the
    UPLINK account a leaf of the hub at ``hub_url`` (:func:`parse_leaf_url`). ``hub_credentials``:
    the site's ``device.json`` from the hub's fleet directory (``edgeflow fleet provision <site>``
    there); the site id is its user name. The UPLINK user's password is kept in
    ``broker/nats-uplink.json``. Returns (config path, site id)."""
    from pathlib import Path

    from edgeflow.broker.mosquitto import _write_secret

    hub_host, hub_port, tls = parse_leaf_url(hub_url)
    cpath = Path(hub_credentials)
    try:
        creds = json.loads(cpath.read_text(encoding="utf-8"))
        site_id, hub_password, fleet = str(creds["username"]), str(creds["password"]), creds.get("fleet")
    except FileNotFoundError:
        raise ConfigError(f"hub credentials {cpath} not found: copy the site's device.json from the hub's fleet "
                          "directory (`edgeflow fleet provision <site>` there makes it)") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{cpath} is not a device.json (username, password) from the hub's fleet "
                          "directory") from None
    if fleet is not None and fleet != fd.fleet:
        raise ConfigError(f"{cpath} is for fleet {fleet!r}, this fleet directory is {fd.fleet!r}; a site's "
                          "fleet id is the hub's")
    if tls and hub_ca is None:
        beside = cpath.parent / "ca.crt"
        if not beside.exists():
            raise ConfigError(f"{hub_url} is a TLS leaf port: pass --hub-ca (the hub's fleet CA) or put its ca.crt "
                              f"next to {cpath}")
        hub_ca = str(beside.resolve())
    if not tls and hub_ca is not None:
        raise ConfigError(f"--hub-ca is for a TLS leaf port: use tls://{hub_host}:{hub_port}")
    devices, operators = _fleet_users(fd)
    b = fd.broker_dir
    head = _server_head(site_id, host, port)
    store = store_dir or str(Path(b) / "nats-js")
    cfg = nats_site_config(fd.fleet, site_id, devices, operators,
                           keeper_password=_stored_secret(b / _KEEPER_CREDENTIALS, KEEPER_USER),
                           uplink_password=_stored_secret(b / UPLINK_CREDENTIALS, site_id),
                           hub_host=hub_host, hub_port=hub_port, hub_password=hub_password, hub_ca=hub_ca)
    text = head + nats_jetstream_block(store, jetstream_domain(site_id)) + cfg.text
    path = b / LEAF_CONFIG
    _write_secret(path, text.encode())
    return path, site_id
