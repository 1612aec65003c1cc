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
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from edgeflow.broker.mosquitto import OPERATORS, operator_namespace
from edgeflow.errors import ConfigError
from edgeflow.transport.nats.subjects import DEFAULT_PREFIX, StreamNames, encode_level, topic_subject
from edgeflow.transport.topics import DEVICE_CHANNEL_SPECS, GATEWAY, GATEWAY_CHANNEL_SPECS, validate_id

__all__ = ["NatsFleetConfig", "NatsTls", "nats_fleet_config", "subject_matches"]

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


def _device_permissions(fleet: str, device: str, prefix: str) -> tuple[list[str], list[str]]:
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
    api = "$JS.API"
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


def nats_fleet_config(
    fleet: str,
    devices: Mapping[str, str],
    operators: Mapping[str, str],
    *,
    keeper_password: str,
    prefix: str = DEFAULT_PREFIX,
    tls: NatsTls | None = None,
    max_payload: int | None = None,
) -> NatsFleetConfig:
    """The accounts/users block of a nats-server config for ``fleet`` (append to ``jetstream``/``port``).

    ``devices`` and ``operators`` map user names to passwords (nats-server also takes bcrypt hashes
    there: ``nats server passwd``). A device id in the operators' name space is refused, as in
    :func:`~edgeflow.broker.mosquitto.fleet_acl`.
    """
    validate_id(fleet, "fleet id")
    owned = operator_namespace(list(operators) or list(OPERATORS))
    publish: dict[str, tuple[str, ...]] = {}
    users: list[str] = []
    for dev in sorted(devices):
        validate_id(dev, "device id")
        if owned(dev):
            raise ConfigError(f"device id {dev!r} is in the operators' name space; provision the board under another id")
        pub, sub = _device_permissions(fleet, dev, prefix)
        publish[dev] = tuple(pub)
        users.append(f"      {{user: {json.dumps(dev)}, password: {json.dumps(devices[dev])}, "
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
    lines = [f"# edgeflow fleet {fleet}: generated by edgeflow.broker.nats; do not edit by hand",
             "accounts {",
             f"  {account}: {{",
             "    jetstream: enabled",
             "    users: [",
             ",\n".join(users),
             "    ]",
             "  }",
             f"  {SYSTEM_ACCOUNT}: {{ users: [ {{user: {json.dumps(KEEPER_USER)}, password: {json.dumps(keeper_password)}}} ] }}",
             "}",
             f"system_account: {SYSTEM_ACCOUNT}"]
    if max_payload:
        lines.append(f"max_payload: {int(max_payload)}")
    if tls is not None:
        lines += ["tls {", f"  cert_file: {json.dumps(tls.certfile)}", f"  key_file: {json.dumps(tls.keyfile)}",
                  f"  ca_file: {json.dumps(tls.cafile)}", f"  verify: {'true' if tls.verify_clients else 'false'}", "}"]
    return NatsFleetConfig("\n".join(lines) + "\n", publish)
