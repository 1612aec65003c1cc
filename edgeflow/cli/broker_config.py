"""``edgeflow broker-config``: a locked-down Mosquitto configuration for a fleet."""

from __future__ import annotations

ORDER = 80


def register(sub) -> None:
    p = sub.add_parser(
        "broker-config",
        help="write a TLS + ACL Mosquitto config for the fleet",
        description="Create (or update) the fleet directory: fleet signing key, operator credentials, a fleet CA "
        "and server certificate unless --cert/--key are given, and broker/mosquitto.conf with a TLS listener, no "
        "anonymous access, one password per provisioned device and ACLs that confine each device to its own "
        "topics. Run it again after `edgeflow fleet provision` and reload Mosquitto (kill -HUP).",
    )
    p.add_argument("--dir", default=None, help="fleet directory (default $EDGEFLOW_FLEET_DIR or ./fleet)")
    p.add_argument("--fleet", help="fleet id (required when creating the directory)")
    p.add_argument("--host", default="0.0.0.0", help="address the TLS listener binds (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8883, help="TLS listener port (default 8883)")
    p.add_argument("--public-host", action="append", default=None,
                   help="host name or IP devices use to reach the broker (certificate SAN; repeatable)")
    p.add_argument("--broker-url", help="URL devices are given, e.g. mqtts://gw.local:8883")
    p.add_argument("--cert", help="server certificate (PEM) instead of the fleet CA's")
    p.add_argument("--key", help="server key (PEM) for --cert")
    p.add_argument("--ca", help="CA certificate devices should trust (and that signs client certificates)")
    p.add_argument("--require-certificate", action="store_true", help="require client certificates (mutual TLS)")
    p.add_argument("--websockets", type=int, metavar="PORT", help="also a TLS websockets listener on PORT")
    p.add_argument("--local-port", type=int, metavar="PORT",
                   help="also a plain listener on 127.0.0.1:PORT for tools on the gateway host")
    p.add_argument("--persistence", metavar="DIR", help="keep sessions and queued messages in DIR")
    p.add_argument("--log-file", help="Mosquitto log file")
    p.add_argument("--bridge-site", metavar="SITE",
                   help="instead: write broker/bridge-SITE.conf, the bridge a site broker opens to this (central) "
                   "fleet's broker; SITE must be provisioned (`edgeflow fleet provision SITE`); docs/scaling.md")
    p.add_argument("--central", metavar="URL", help="with --bridge-site: the central broker's URL "
                   "(default: the fleet directory's broker URL)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd)


def bridge_cmd(args, fd) -> int:
    from ..bridgeconfig import bridge_from_fleet_dir, write_bridge
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


def cmd(args) -> int:
    from ..brokerconfig import FleetDir, ListenerSettings
    from ..errors import ConfigError
    from ._common import console, emit_json

    fd = FleetDir(fleet_dir_arg(args.dir))
    if getattr(args, "bridge_site", None):
        return bridge_cmd(args, fd)
    if not fd.exists and not args.fleet:
        raise ConfigError(f"{fd.path} is not a fleet directory yet: pass --fleet NAME to create it")
    hosts = args.public_host
    url = args.broker_url
    if url is None and hosts:
        url = f"mqtts://{hosts[0]}:{args.port}"
    fd.init(args.fleet or fd.fleet, broker=url)
    if bool(args.cert) != bool(args.key):
        raise ConfigError("--cert and --key go together")
    settings = ListenerSettings(host=args.host, port=args.port, certfile=args.cert or "", keyfile=args.key or "",
                                cafile=args.ca, require_certificate=args.require_certificate,
                                websockets_port=args.websockets, plain_port=args.local_port,
                                persistence_dir=args.persistence, log_file=args.log_file)
    files = fd.write_broker_config(settings, tls_hosts=hosts)
    out = {"fleet": fd.fleet, "dir": str(fd.path), "config": str(files.config), "password_file": str(files.password_file),
           "acl_file": str(files.acl_file), "ca_file": str(files.ca_file) if files.ca_file else None,
           "devices": fd.devices(), "broker": fd.broker_url}
    if args.json:
        emit_json(out)
        return 0
    c = console()
    c.print(f"fleet [bold]{out['fleet']}[/]: {len(out['devices'])} device(s) provisioned")
    c.print(f"  config   {out['config']}")
    c.print(f"  passwd   {out['password_file']}   acl {out['acl_file']}")
    if out["ca_file"]:
        c.print(f"  CA       {out['ca_file']} (copied into every device's credentials)")
    c.print(f"run:  mosquitto -c {out['config']}      reload after provisioning:  kill -HUP <pid>")
    return 0
