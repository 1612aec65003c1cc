"""``edgeflow broker-config``: a locked-down Mosquitto configuration for a fleet."""

from __future__ import annotations

import argparse

ORDER = 80


def register(sub) -> None:
    p = sub.add_parser(
        "broker-config",
        help="write a TLS + ACL Mosquitto config for the fleet",
        description="Create (or update) the fleet directory: fleet signing key, operator credentials, a fleet CA "
        "and server certificate unless --cert/--key are given, and broker/mosquitto.conf with a TLS listener, no "
        "anonymous access, one password per provisioned device, ACLs that confine each device to its own "
        "topics and message/queue limits, plus broker/nftables.conf, a firewall ruleset limiting the connections "
        "each source address may open to the broker's listeners (load it with nft -f). Every path in it is absolute. A rerun keeps the settings of the last "
        "one (stored in fleet.json) except those given again; `edgeflow fleet provision` reruns it for you. "
        "Reload Mosquitto afterwards (kill -HUP). A listener port that another process already listens on is "
        "refused before anything is written.",
    )
    p.add_argument("--dir", default=None, help="fleet directory (default $EDGEFLOW_FLEET_DIR or ./fleet)")
    p.add_argument("--fleet", help="fleet id (required when creating the directory)")
    p.add_argument("--host", default=None, help="address the TLS listener binds (default 0.0.0.0; with "
                   "--leaf-port/--leaf-of: nats-server's client listener)")
    p.add_argument("--port", type=int, default=None, help="TLS listener port (default 8883; with "
                   "--leaf-port/--leaf-of: nats-server's client port, default 4222)")
    p.add_argument("--public-host", action="append", default=None,
                   help="host name or IP devices use to reach the broker (certificate SAN, device URL; repeatable)")
    p.add_argument("--broker-url", help="URL devices are given (default mqtts://PUBLIC-HOST:PORT)")
    p.add_argument("--cert", help="server certificate (PEM) instead of the fleet CA's (copied into broker/)")
    p.add_argument("--key", help="server key (PEM) for --cert")
    p.add_argument("--ca", help="CA certificate devices should trust (and that signs client certificates)")
    p.add_argument("--require-certificate", action=argparse.BooleanOptionalAction, default=None,
                   help="require client certificates (mutual TLS)")
    p.add_argument("--websockets", type=int, metavar="PORT", help="also a TLS websockets listener on PORT")
    p.add_argument("--local-port", type=int, metavar="PORT",
                   help="also a plain listener on 127.0.0.1:PORT for tools on the gateway host")
    p.add_argument("--max-packet-size", type=int, metavar="BYTES",
                   help="largest MQTT packet the broker accepts (default 1 MiB; larger payloads travel in chunks)")
    p.add_argument("--max-queued-bytes", type=int, metavar="BYTES",
                   help="bytes queued per client while it is away or slow (default 1 GiB)")
    p.add_argument("--max-connections", type=int, metavar="N",
                   help="connections each listener accepts; more are closed at once (default: sized to the fleet, "
                   "devices + operator users + a quarter, at least 256). The broker's open-file limit "
                   "(systemd LimitNOFILE) must exceed N x listeners + 64: docs/fleet.md")
    p.add_argument("--per-source-connections", type=int, metavar="N",
                   help="connections one source address may hold open on the broker's network listeners, enforced "
                   "by broker/nftables.conf (default: operator users + 4, at least 8; a device uses one). Raise it "
                   "for sites whose boards share one NAT address: docs/fleet.md")
    p.add_argument("--persistence", metavar="DIR", help="keep sessions and queued messages in DIR (with "
                   "--leaf-port/--leaf-of: the JetStream store, default broker/nats-js)")
    p.add_argument("--log-file", help="Mosquitto log file")
    p.add_argument("--broker-user", metavar="USER",
                   help="system user the broker runs as (default: mosquitto when broker-config runs as root, "
                   "else the user running it); it is given read access to the broker's files")
    p.add_argument("--bridge-site", metavar="SITE",
                   help="instead: write broker/bridge-SITE.conf, the bridge a site broker opens to this (central) "
                   "fleet's broker; SITE must be provisioned (`edgeflow fleet provision SITE`); docs/scaling.md")
    p.add_argument("--central", metavar="URL", help="with --bridge-site: the central broker's URL "
                   "(default: the fleet directory's broker URL)")
    p.add_argument("--leaf-port", type=int, metavar="PORT",
                   help="instead: write broker/nats-hub.conf, a nats-server config for this (hub) fleet with a leaf "
                   "node port PORT (7422 is nats-server's) for the sites named by --leaf-site; docs/transport.md, "
                   "'NATS leaf nodes'")
    p.add_argument("--leaf-site", action="append", default=None, metavar="SITE",
                   help="with --leaf-port: a site that connects as a leaf node (provisioned: `edgeflow fleet "
                   "provision SITE`; repeatable)")
    p.add_argument("--leaf-tls", action="store_true",
                   help="with --leaf-port: TLS on the leaf port, with the fleet's server certificate")
    p.add_argument("--leaf-of", metavar="URL",
                   help="instead: write broker/nats-leaf.conf, a nats-server config for this site's fleet directory "
                   "that is a leaf node of the hub's leaf port URL (nats://HUB:7422, tls://HUB:7422)")
    p.add_argument("--hub-credentials", metavar="FILE",
                   help="with --leaf-of: the site's device.json from the hub's fleet directory")
    p.add_argument("--hub-ca", metavar="FILE", help="with --leaf-of tls://...: the hub's fleet CA "
                   "(default: ca.crt next to --hub-credentials)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd)


def leaf_cmd(args, fd) -> int:
    """--leaf-port (the hub) or --leaf-of (a site): a nats-server config from the fleet directory."""
    from ..broker.nats import parse_leaf_url, write_hub_config, write_site_config
    from ..errors import ConfigError
    from ._common import console, emit_json

    if args.leaf_port is not None and args.leaf_of:
        raise ConfigError("--leaf-port (the hub's config) and --leaf-of (a site's) are for different servers; "
                          "give one")
    host, port, store = args.host or "0.0.0.0", args.port or 4222, args.persistence
    if args.leaf_of:
        parse_leaf_url(args.leaf_of)  # a bad URL is the first thing said
        if args.leaf_site or args.leaf_tls:
            raise ConfigError("--leaf-site and --leaf-tls go with --leaf-port (the hub), not --leaf-of")
        if not args.hub_credentials:
            raise ConfigError("--leaf-of needs --hub-credentials FILE: the site's device.json from the hub's fleet "
                              "directory (`edgeflow fleet provision SITE` there)")
        path, site = write_site_config(fd, args.leaf_of, args.hub_credentials, hub_ca=args.hub_ca, host=host,
                                       port=port, store_dir=store)
        out = {"fleet": fd.fleet, "site": site, "config": str(path), "hub": args.leaf_of,
               "uplink_credentials": str(fd.broker_dir / "nats-uplink.json")}
    else:
        if args.hub_credentials or args.hub_ca:
            raise ConfigError("--hub-credentials and --hub-ca go with --leaf-of (a site), not --leaf-port")
        if not args.leaf_site:
            raise ConfigError("--leaf-port needs at least one --leaf-site SITE (a site provisioned in this "
                              "fleet directory)")
        path = write_hub_config(fd, args.leaf_site, leaf_port=args.leaf_port, host=host, port=port, store_dir=store,
                                leaf_tls=args.leaf_tls)
        out = {"fleet": fd.fleet, "sites": sorted(set(args.leaf_site)), "config": str(path),
               "leaf_port": args.leaf_port}
    if args.json:
        emit_json(out)
        return 0
    c = console()
    c.print(f"nats-server config for {'site ' + out['site'] if 'site' in out else 'the hub'} of fleet "
            f"[bold]{out['fleet']}[/]: {path}")
    if "site" in out:
        c.print(f"  the site gateway's uplink transport logs in as {out['site']} with {out['uplink_credentials']}")
    c.print(f"run:  nats-server -c {path}")
    return 0


def bridge_cmd(args, fd) -> int:
    from ..broker.bridge import bridge_from_fleet_dir, write_bridge
    from ._common import console, emit_json

    spec = bridge_from_fleet_dir(fd, args.bridge_site, args.central)
    path = write_bridge(fd, spec)
    out = {"fleet": fd.fleet, "site": spec.site_id, "bridge": str(path), "central": f"{spec.remote_host}:{spec.remote_port}",
           "ca_file": spec.cafile}
    if args.json:
        emit_json(out)
    else:
        console().print(f"bridge for site [bold]{spec.site_id}[/] -> {out['central']}: {path}\n"
                        f"append it to the site broker's mosquitto.conf (or include_dir its folder)")
    return 0


def fleet_dir_arg(value: str | None) -> str:
    import os

    return value or os.environ.get("EDGEFLOW_FLEET_DIR") or "fleet"


_FLAGS = {"host": "host", "port": "port", "cert": "certfile", "key": "keyfile", "ca": "cafile",
          "require_certificate": "require_certificate", "websockets": "websockets_port", "local_port": "plain_port",
          "max_packet_size": "max_packet_size", "max_queued_bytes": "max_queued_bytes", "max_connections": "max_connections",
          "per_source_connections": "per_source_connections",
          "persistence": "persistence_dir", "log_file": "log_file", "broker_user": "user"}


def settings_from_args(args, fd):
    """The stored settings of the fleet directory, overridden by the flags given on this command line."""
    import dataclasses

    from ..broker.mosquitto import ListenerSettings

    base = fd.listener_settings() if fd.exists else ListenerSettings()
    changes = {field: getattr(args, flag) for flag, field in _FLAGS.items() if getattr(args, flag, None) is not None}
    return dataclasses.replace(base, **changes)


def cmd(args) -> int:
    from ..broker.mosquitto import FleetDir, check_ports_free
    from ..errors import ConfigError
    from ..transport.topics import validate_id
    from ..transport.url import parse_broker_url
    from ._common import console, emit_json

    fd = FleetDir(fleet_dir_arg(args.dir))
    if getattr(args, "bridge_site", None):
        return bridge_cmd(args, fd)
    if getattr(args, "leaf_of", None) or getattr(args, "leaf_port", None) is not None:
        return leaf_cmd(args, fd)
    for flag, mode in (("leaf_site", "--leaf-port"), ("leaf_tls", "--leaf-port"), ("hub_credentials", "--leaf-of"),
                       ("hub_ca", "--leaf-of")):
        if getattr(args, flag, None):
            raise ConfigError(f"--{flag.replace('_', '-')} goes with {mode}")
    if not fd.exists and not args.fleet:
        raise ConfigError(f"{fd.path} is not a fleet directory yet: pass --fleet NAME to create it")
    # everything is checked before anything is written: settings, the broker's user and its access
    if args.broker_url:
        parse_broker_url(args.broker_url)
    hosts = args.public_host
    url = args.broker_url
    if fd.exists and args.fleet and args.fleet != fd.fleet:
        raise ConfigError(f"{fd.path} belongs to fleet {fd.fleet!r}, not {args.fleet!r}")
    validate_id(args.fleet or fd.fleet, "fleet id")
    settings = settings_from_args(args, fd)
    fd.check_broker_config(settings)
    check_ports_free(settings, fd.listener_settings() if fd.exists and fd.meta().get("listener") else None)
    before = _max_connections_in(fd.broker_dir / "mosquitto.conf")
    fd.init(args.fleet or fd.fleet, broker=url)
    files = fd.write_broker_config(settings, tls_hosts=hosts)
    out = {"fleet": fd.fleet, "dir": str(fd.path), "config": str(files.config), "password_file": str(files.password_file),
           "acl_file": str(files.acl_file), "ca_file": str(files.ca_file) if files.ca_file else None,
           "devices": fd.devices(), "broker": fd.broker_url, "max_connections": files.max_connections,
           "limit_nofile": files.open_files, "firewall": str(files.firewall) if files.firewall else None,
           "per_source_connections": files.per_source, "restart_needed": before not in (None, files.max_connections)}
    if args.json:
        emit_json(out)
        return 0
    c = console()
    c.print(f"fleet [bold]{out['fleet']}[/]: {len(out['devices'])} device(s) provisioned")
    c.print(f"  config   {out['config']}")
    c.print(f"  passwd   {out['password_file']}   acl {out['acl_file']}")
    if out["ca_file"]:
        c.print(f"  CA       {out['ca_file']} (copied into every device's credentials)")
    c.print(f"  devices connect to {out['broker']}")
    c.print(f"  limits   max_connections {files.max_connections} per listener: run the broker with "
            f"LimitNOFILE={files.open_files} or more (docs/fleet.md)")
    if files.firewall:
        c.print(f"  firewall {files.firewall}: at most {files.per_source} connections per source address; load it "
                f"as root:  nft -f {files.firewall}  (docs/fleet.md)")
    c.print(f"run:  mosquitto -c {out['config']}      reload after provisioning:  kill -HUP <pid>")
    if out["restart_needed"]:
        c.print(f"max_connections changed ({before} -> {files.max_connections}): restart Mosquitto, a reload "
                "does not apply it")
    return 0


def _max_connections_in(conf) -> int | None:
    """``max_connections`` of the config written last time (None: none yet, or none in it)."""
    try:
        text = conf.read_text(encoding="utf-8")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "max_connections" and value.strip().isdigit():
            return int(value)
    return None
