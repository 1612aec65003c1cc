"""Per-source connection limits in front of the broker: the nftables ruleset ``edgeflow broker-config`` writes.

Mosquitto's ``max_connections`` bounds a listener, not a peer: one address that opens idle TCP
sockets and never sends CONNECT holds the listener's slots until Mosquitto drops them (about 95 s
with 2.0, which has no setting for it). The kernel can refuse such a peer before the broker sees
it. :func:`nftables_ruleset` renders, for the broker's network listeners, a table that

- accepts loopback (tools on the broker's host) without counting it;
- refuses (TCP reset) a source's new connections past ``new_per_minute`` a minute, after a burst of
  ``burst`` (a per-address ``limit rate`` in a dynamic set whose entries time out): handshake floods
  and reconnect storms;
- refuses (TCP reset) a source's connection past ``per_source`` open at once (a per-address
  ``ct count`` in a dynamic set): the slow loris. With ``per_source`` below ``max_connections``
  one address can no longer fill the listener.

The table is named per fleet and the file replaces it atomically (``nft -f`` loads the whole file
as one transaction: declare, delete, define), so applying it again after a rerun never stacks rules
and leaves every other table alone. IPv4 and IPv6 sources are counted apart.

Sizing (:func:`per_source_limit`): a device keeps one connection; the operator users (the gateway
service, ``edgeflow fleet`` sessions) may all come from one host; a few more cover a board whose
old connection the broker has not yet noticed gone. Boards behind one NAT address share the count:
raise it for such sites (``--per-source-connections``, docs/fleet.md). Pure functions: settings in,
text out; nothing here runs ``nft``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["RECONNECT_MARGIN", "ConnectionLimits", "nftables_ruleset", "per_source_limit", "table_name"]

RECONNECT_MARGIN = 4
"""Connections per source beyond the operator users: a board reconnecting before the broker noticed its
old TCP connection gone, a bridge, a tool."""
MIN_PER_SOURCE = 8
RATE_PER_SOURCE = 4
"""New connections a minute per allowed open connection (:attr:`ConnectionLimits.new_per_minute`)."""


def per_source_limit(operator_users: int) -> int:
    """Connections one address may hold open: every operator user at once (they share the gateway
    host's address) plus :data:`RECONNECT_MARGIN`, at least :data:`MIN_PER_SOURCE`."""
    return max(MIN_PER_SOURCE, int(operator_users) + RECONNECT_MARGIN)


@dataclass(frozen=True)
class ConnectionLimits:
    """What the ruleset enforces; :meth:`for_source` derives the rates from ``per_source``."""

    fleet: str
    ports: tuple[int, ...]
    """The broker's network listener ports (TLS, websockets); a loopback-only listener needs none."""
    per_source: int
    new_per_minute: int
    burst: int

    @classmethod
    def for_source(cls, fleet: str, ports: Iterable[int], per_source: int) -> ConnectionLimits:
        """``per_source`` open connections per address; new ones at ``4 x per_source`` a minute after a burst of
        ``2 x per_source`` (every operator user and a few boards reconnecting at once fit in the burst; a flood
        is cut after it)."""
        return cls(fleet, tuple(ports), int(per_source), RATE_PER_SOURCE * int(per_source), 2 * int(per_source))

    def validate(self) -> ConnectionLimits:
        if not self.ports:
            raise ConfigError("the firewall ruleset needs at least one listener port")
        for port in self.ports:
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise ConfigError(f"listener port {port!r} is not a TCP port: use 1-65535")
        for name, value in (("per_source_connections", self.per_source), ("new_per_minute", self.new_per_minute),
                            ("burst", self.burst)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} {value!r} is too small or not a whole number: use at least 1")
        return self


def table_name(fleet: str) -> str:
    """``edgeflow_broker_<fleet>``: nftables identifiers take letters, digits and ``_`` (others become ``_``)."""
    return "edgeflow_broker_" + re.sub(r"[^A-Za-z0-9_]", "_", fleet)


def nftables_ruleset(limits: ConnectionLimits, *, config_path: str = "") -> str:
    """The ``nft -f`` file for ``limits`` (see the module docstring); ``config_path`` only goes into its comments."""
    lim = limits.validate()
    table = f"inet {table_name(lim.fleet)}"
    ports = ", ".join(str(p) for p in sorted(set(lim.ports)))
    dport = f"tcp dport {{ {ports} }} ct state new"
    path = config_path or "nftables.conf"
    rate = f"limit rate over {lim.new_per_minute}/minute burst {lim.burst} packets"
    lines = [
        f"# edgeflow fleet {lim.fleet}: per-source connection limits for the broker's listeners ({ports}).",
        "# Generated by `edgeflow broker-config`; regenerate instead of editing (docs/fleet.md).",
        f"# Apply (root):  nft -f {path}     remove:  nft delete table {table}",
        "# Loading it again replaces this table only, in one transaction.",
        f"table {table}",
        f"delete table {table}",
        f"table {table} {{",
        f"\tcomment \"edgeflow fleet {lim.fleet}: at most {lim.per_source} connections per source address, "
        f"{lim.new_per_minute} new a minute (burst {lim.burst})\"",
    ]
    for fam in ("v4", "v6"):
        kind = "ipv4_addr" if fam == "v4" else "ipv6_addr"
        lines += [f"\tset open_{fam} {{ type {kind}; size 65535; flags dynamic; }}",
                  f"\tset new_{fam} {{ type {kind}; size 65535; flags dynamic,timeout; timeout 2m; }}"]
    lines += [
        "\tchain input {",
        "\t\ttype filter hook input priority filter; policy accept;",
        "\t\tiif \"lo\" accept",
        # rate first: a refused SYN is never counted as open
        f"\t\t{dport} update @new_v4 {{ ip saddr {rate} }} counter reject with tcp reset comment \"new_rate\"",
        f"\t\t{dport} update @new_v6 {{ ip6 saddr {rate} }} counter reject with tcp reset comment \"new_rate\"",
        f"\t\t{dport} add @open_v4 {{ ip saddr ct count over {lim.per_source} }} counter reject with tcp reset "
        "comment \"per_source\"",
        f"\t\t{dport} add @open_v6 {{ ip6 saddr ct count over {lim.per_source} }} counter reject with tcp reset "
        "comment \"per_source\"",
        "\t}",
        "}",
    ]
    return "\n".join(lines) + "\n"
