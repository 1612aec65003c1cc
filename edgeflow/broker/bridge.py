"""Mosquitto bridge configuration: a site broker's uplink to the central broker.

A hierarchical fleet (docs/scaling.md) has one broker per site and one
central broker; each site broker carries a *bridge*, an MQTT connection it
opens to the central broker, and forwards exactly three channels:

==========================================  =====  ==============================================
central (remote) topic                      dir    site (local) topic
==========================================  =====  ==============================================
``edgeflow/<fleet>/gateway/round[/#]``      in     ``edgeflow/<fleet>/_uplink/gateway/round[/#]``
``edgeflow/<fleet>/gateway/model[/#]``      in     ``edgeflow/<fleet>/_uplink/gateway/model[/#]``
``edgeflow/<fleet>/<site>/update[/#]``      out    ``edgeflow/<fleet>/_uplink/<site>/update[/#]``
==========================================  =====  ==============================================

Why only these: device traffic (updates, telemetry, OTA) stays on the site
broker, which is the point of a hierarchy - the central broker carries one
partial aggregate per site and round, not one update per device. Why the
``_uplink`` prefix: the site broker has its *own* ``gateway/round`` and
``gateway/model`` (the site gateway's, for its devices), so the root's must
land elsewhere; ``_uplink`` is not a valid device id, so no device topic can
collide with it. ``/#`` covers the chunk sub-topics of chunked payloads
(MQTT's ``a/#`` also matches ``a``). Retained messages keep their flag across
a Mosquitto-to-Mosquitto bridge (``try_private``), so a restarted site
gateway finds the root's current round and model on its own broker.

The bridge logs in to the central broker as the site, with the credentials
``edgeflow fleet provision <site>`` made in the central fleet directory (a
site is a device of the root): the central broker's generated ACL then
already allows exactly these topics (write its own ``update/#``, read
``gateway/#``). ``cleansession false`` keeps the bridge's QoS 1 queue on both
sides across WAN outages.

EMQX or HiveMQ clusters need no bridge (one logical broker); see docs/emqx.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..transport.topics import GATEWAY, ROOT, validate_id
from ..transport.url import parse_broker_url

if TYPE_CHECKING:  # pragma: no cover
    from .mosquitto import FleetDir

__all__ = ["UPLINK_LEVEL", "BridgeSpec", "bridge_from_fleet_dir", "bridge_topics", "render_bridge", "write_bridge"]

UPLINK_LEVEL = "_uplink"


@dataclass(frozen=True)
class BridgeSpec:
    """One site broker's bridge to the central broker."""

    fleet: str
    site_id: str
    remote_host: str
    remote_port: int = 8883
    username: str | None = None
    password: str | None = None
    cafile: str | None = None
    """CA of the central broker's TLS listener; TLS is on when set."""
    certfile: str | None = None
    keyfile: str | None = None
    insecure: bool = False
    keepalive_s: int = 60
    qos: int = 1
    cleansession: bool = False
    restart_timeout: tuple[int, int] = (2, 30)
    """Reconnect back-off (base, cap) in seconds."""
    extra_down: tuple[str, ...] = ()
    """More root channels to mirror down, e.g. ``("gateway/state",)``."""
    name: str = ""
    extra: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        validate_id(self.fleet, "fleet id")
        validate_id(self.site_id, "site id")
        if self.site_id == GATEWAY:
            raise ConfigError(f"site id {GATEWAY!r} is reserved")
        if not self.remote_host or any(c in self.remote_host for c in " \t\r\n"):
            raise ConfigError(f"remote host {self.remote_host!r} is not a host name")
        if not 0 < int(self.remote_port) < 65536:
            raise ConfigError(f"remote port must be in 1..65535, got {self.remote_port}")
        if self.qos not in (0, 1):
            raise ConfigError(f"bridge qos must be 0 or 1 (edgeflow deduplicates QoS 1), got {self.qos}")
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("give both certfile and keyfile for a client certificate, or neither")
        for value in (self.username, self.password, self.name):
            if value is not None and any(c in value for c in " \t\r\n"):
                raise ConfigError("bridge user name, password and name may not contain spaces or line breaks")
        for ch in self.extra_down:
            if not ch.startswith(f"{GATEWAY}/") or "#" in ch[:-1] or "+" in ch or " " in ch:
                raise ConfigError(f"extra_down channel {ch!r} must be a gateway/... topic without wildcards")

    @property
    def connection_name(self) -> str:
        return self.name or f"{self.fleet}-{self.site_id}-uplink"

    @property
    def local_prefix(self) -> str:
        return f"{ROOT}/{self.fleet}/{UPLINK_LEVEL}/"

    @property
    def remote_prefix(self) -> str:
        return f"{ROOT}/{self.fleet}/"


def bridge_topics(spec: BridgeSpec) -> list[str]:
    """The bridge's ``topic`` lines (pattern, direction, QoS, local prefix, remote prefix)."""
    lp, rp, q = spec.local_prefix, spec.remote_prefix, spec.qos
    down = [f"{GATEWAY}/round", f"{GATEWAY}/model", *spec.extra_down]
    lines = [f"topic {ch}/# in {q} {lp} {rp}" for ch in down]
    lines.append(f"topic {spec.site_id}/update/# out {q} {lp} {rp}")
    return lines


def render_bridge(spec: BridgeSpec) -> str:
    """The text of the bridge section, to append to (or include from) the site broker's mosquitto.conf."""
    s = spec
    lines = [
        f"# edgeflow: site {s.site_id} of fleet {s.fleet} -> central broker {s.remote_host}:{s.remote_port}",
        "# generated by `edgeflow broker-config --bridge-site`; regenerate instead of editing",
        f"connection {s.connection_name}",
        f"address {s.remote_host}:{int(s.remote_port)}",
        f"remote_clientid {s.username or s.site_id}",
        f"local_clientid {s.connection_name}-local",
        f"cleansession {'true' if s.cleansession else 'false'}",
        f"keepalive_interval {int(s.keepalive_s)}",
        f"restart_timeout {int(s.restart_timeout[0])} {int(s.restart_timeout[1])}",
        "start_type automatic",
        "try_private true",
        "notifications false",
        "bridge_protocol_version mqttv311",
    ]
    if s.username:
        lines.append(f"remote_username {s.username}")
    if s.password:
        lines.append(f"remote_password {s.password}")
    if s.cafile:
        lines += [f"bridge_cafile {s.cafile}", "bridge_tls_version tlsv1.2",
                  f"bridge_insecure {'true' if s.insecure else 'false'}"]
        if s.certfile:
            lines += [f"bridge_certfile {s.certfile}", f"bridge_keyfile {s.keyfile}"]
    lines += bridge_topics(s)
    lines += list(s.extra)
    return "\n".join(lines) + "\n"


def bridge_from_fleet_dir(fd: "FleetDir", site_id: str, central_url: str | None = None) -> BridgeSpec:
    """A bridge for ``site_id`` from the central fleet directory: the site's provisioned
    credentials (``devices/<site>/device.json``) and the fleet CA, to ``central_url``
    (default: the fleet directory's broker URL)."""
    url = central_url or fd.broker_url
    if not url:
        raise ConfigError("no central broker URL: pass one, or store it in the fleet directory (--broker-url)")
    addr = parse_broker_url(url)
    if addr.websockets:
        raise ConfigError("Mosquitto bridges speak plain MQTT or MQTT over TLS, not websockets: use mqtts://")
    creds_path = fd.device_dir(site_id) / "device.json"
    try:
        creds = json.loads(creds_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"site {site_id!r} is not provisioned in {fd.path}: run "
                          f"`edgeflow fleet provision {site_id}` first (a site is a device of the root)") from None
    ca = fd.ca_file() if addr.tls else None
    return BridgeSpec(fleet=fd.fleet, site_id=site_id, remote_host=addr.host, remote_port=addr.port,
                      username=creds.get("username", site_id), password=creds.get("password"),
                      cafile=str(ca) if ca is not None else None)


def write_bridge(fd: "FleetDir", spec: BridgeSpec) -> Path:
    """Write ``broker/bridge-<site>.conf`` (mode 0600: it holds the site's password)."""
    import os

    path = fd.broker_dir / f"bridge-{spec.site_id}.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fh, "w", encoding="utf-8") as f:
        f.write(render_bridge(spec))
    return path
