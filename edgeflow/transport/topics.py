"""The one MQTT topic scheme of edgeflow, and validated topics and filters.

Scheme (``<fleet>`` and ``<device>`` are ids: letters, digits, ``_ . -``,
1 to 64 characters, starting with a letter or digit; ``gateway`` is not a
valid device id)::

    edgeflow/<fleet>/<device>/birth       device -> all    retained, online + capabilities
    edgeflow/<fleet>/<device>/death       broker -> all    retained last will, offline
    edgeflow/<fleet>/<device>/telemetry   device -> gw     metrics, QoS 0 or 1
    edgeflow/<fleet>/<device>/update      device -> gw     signed model updates (envelopes)
    edgeflow/<fleet>/<device>/evaluate    device -> gw     signed evaluation reports (federated evaluate rounds)
    edgeflow/<fleet>/<device>/cmd         gw -> device     commands
    edgeflow/<fleet>/<device>/cmd/ack     device -> gw     command results
    edgeflow/<fleet>/gateway/model        gw -> devices    retained global model (chunked)
    edgeflow/<fleet>/gateway/round        gw -> devices    retained current round
    edgeflow/<fleet>/gateway/state        gw -> all        retained gateway status
    edgeflow/<fleet>/<device>/secagg      device -> gw     secure-aggregation protocol messages
    edgeflow/<fleet>/<device>/ota         gw -> device     signed OTA deployment (command + artifact, chunked)
    edgeflow/<fleet>/<device>/infer       app -> device    inference request
    edgeflow/<fleet>/<device>/infer/reply device -> app    inference result
    edgeflow/<fleet>/gateway/secagg       gw -> devices    secure-aggregation broadcasts (not retained)

Why this shape: the device id is always the third level, so one broker ACL
pattern (``pattern write edgeflow/+/%u/#`` with the device id as user
name) confines each device to its own subtree, and the gateway subscribes
to ``edgeflow/<fleet>/+/update`` to hear every device.

Payloads larger than the broker's limit travel as chunks on the reserved
sub-topic ``<topic>/_chunk/<index>`` (see :mod:`edgeflow.transport.chunking`);
applications never publish to or see ``_chunk`` levels. The sub-topic sits
under the message's own topic so that ACLs granting ``<topic>/#`` cover it,
and each index has its own topic so that a retained chunked payload keeps
every chunk retained (one retained message per topic).

:class:`Topic` and :class:`TopicFilter` are frozen and validated on
construction, in the spirit of aiomqtt's ``Topic``/``Wildcard``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgeflow.errors import ConfigError

__all__ = [
    "CHUNK_LEVEL",
    "DEVICE_CHANNELS",
    "DEVICE_CHANNEL_SPECS",
    "GATEWAY",
    "GATEWAY_CHANNELS",
    "GATEWAY_CHANNEL_SPECS",
    "ChannelSpec",
    "ROOT",
    "Topic",
    "TopicFilter",
    "TopicInfo",
    "chunk_filter",
    "chunk_topic",
    "device_filter",
    "device_topic",
    "gateway_topic",
    "channel_spec",
    "parse_topic",
    "SHARED_PREFIX",
    "match_filter",
    "retained_chunks_allowed",
    "sender_of",
    "shared_group",
    "split_chunk_topic",
    "validate_id",
]

ROOT = "edgeflow"
GATEWAY = "gateway"
CHUNK_LEVEL = "_chunk"
MAX_TOPIC_BYTES = 65535


@dataclass(frozen=True)
class ChannelSpec:
    """One channel of the scheme: who writes it, whether it is retained, whether it may be chunked.

    The broker ACL (:func:`edgeflow.broker.mosquitto.fleet_acl`), the receivers'
    retained-chunk policy (:func:`retained_chunks_allowed`) and the topic
    table of docs/transport.md are all derived from :data:`DEVICE_CHANNEL_SPECS`
    and :data:`GATEWAY_CHANNEL_SPECS`, so they cannot drift apart.
    """

    name: str
    writer: str
    """``device`` (the device itself; for ``death`` the broker publishes its will), ``gateway`` (operators)
    or ``app`` (operators and applications with operator credentials)."""
    reader: str
    retained: bool
    chunked: bool
    qos: str
    content: str

    def levels(self) -> tuple[str, ...]:
        """The topic suffixes the channel occupies: itself and, when chunked, its chunk topics."""
        return (self.name, f"{self.name}/{CHUNK_LEVEL}/+") if self.chunked else (self.name,)


DEVICE_CHANNEL_SPECS: tuple[ChannelSpec, ...] = (
    ChannelSpec("birth", "device", "all", True, False, "1", "signed birth: online, capabilities"),
    ChannelSpec("death", "device", "all", True, False, "1", "signed last will (published by the broker): offline"),
    ChannelSpec("telemetry", "device", "gateway", False, False, "0/1", "metrics"),
    ChannelSpec("update", "device", "gateway", False, True, "1", "signed update envelope (docs/codecs.md)"),
    ChannelSpec("evaluate", "device", "gateway", False, False, "1", "signed evaluation report (federated evaluate)"),
    ChannelSpec("cmd", "gateway", "device", False, True, "1", "signed command"),
    ChannelSpec("cmd/ack", "device", "gateway", False, True, "1", "signed command result"),
    ChannelSpec("secagg", "device", "gateway", False, True, "1", "secure-aggregation protocol messages"),
    ChannelSpec("ota", "gateway", "device", False, True, "1", "signed OTA deployment (docs/fleet.md)"),
    ChannelSpec("infer", "app", "device", False, True, "1", "inference request (docs/fleet.md)"),
    ChannelSpec("infer/reply", "device", "app", False, True, "1", "inference result"),
)
GATEWAY_CHANNEL_SPECS: tuple[ChannelSpec, ...] = (
    ChannelSpec("model", "gateway", "devices", True, True, "1", "global model"),
    ChannelSpec("model_delta", "gateway", "devices", True, True, "1", "global model as a signed delta from the previous version"),
    ChannelSpec("round", "gateway", "devices", True, True, "1", "current round (signed)"),
    ChannelSpec("state", "gateway", "all", True, True, "1", "gateway status"),
    ChannelSpec("secagg", "gateway", "devices", False, True, "1", "secure-aggregation broadcasts"),
)
DEVICE_CHANNELS = tuple(c.name for c in DEVICE_CHANNEL_SPECS)
GATEWAY_CHANNELS = tuple(c.name for c in GATEWAY_CHANNEL_SPECS)
_SPECS = {False: {c.name: c for c in DEVICE_CHANNEL_SPECS}, True: {c.name: c for c in GATEWAY_CHANNEL_SPECS}}

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def _check_common(value: object, what: str) -> str:
    if not isinstance(value, str):
        msg = f"{what} must be a str, got {type(value).__name__}"
        raise ConfigError(msg)
    if not value:
        msg = f"{what} must not be empty"
        raise ConfigError(msg)
    if len(value.encode("utf-8")) > MAX_TOPIC_BYTES:
        msg = f"{what} is longer than MQTT's {MAX_TOPIC_BYTES} bytes"
        raise ConfigError(msg)
    if "\0" in value:
        msg = f"{what} {value!r} contains NUL, which MQTT forbids"
        raise ConfigError(msg)
    return value


@dataclass(frozen=True)
class Topic:
    """A concrete topic name (no wildcards)."""

    value: str

    def __post_init__(self) -> None:
        _check_common(self.value, "topic")
        if "+" in self.value or "#" in self.value:
            msg = f"topic {self.value!r} contains a wildcard (+ or #); wildcards belong in subscription filters"
            raise ConfigError(msg)

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(self.value.split("/"))

    def matches(self, filter: str | TopicFilter) -> bool:
        f = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
        return f.matches(self)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TopicFilter:
    """A subscription filter: ``+`` matches one level, a trailing ``#`` any number (including none)."""

    value: str

    def __post_init__(self) -> None:
        _check_common(self.value, "topic filter")
        levels = self.value.split("/")
        for i, level in enumerate(levels):
            if "#" in level and (level != "#" or i != len(levels) - 1):
                msg = f"topic filter {self.value!r}: '#' must be a whole level and the last one"
                raise ConfigError(msg)
            if "+" in level and level != "+":
                msg = f"topic filter {self.value!r}: '+' must be a whole level"
                raise ConfigError(msg)

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(self.value.split("/"))

    @property
    def has_wildcards(self) -> bool:
        return "+" in self.value or "#" in self.value

    def matches(self, topic: str | Topic) -> bool:
        name = topic.value if isinstance(topic, Topic) else Topic(topic).value
        t_levels = name.split("/")
        f_levels = self.value.split("/")
        # MQTT 4.7.2: filters starting with a wildcard do not match $-topics ($SYS/...).
        if name.startswith("$") and f_levels[0] in ("+", "#"):
            return False
        for i, f in enumerate(f_levels):
            if f == "#":
                return True
            if i >= len(t_levels):
                return False
            if f != "+" and f != t_levels[i]:
                return False
        return len(t_levels) == len(f_levels)

    def __str__(self) -> str:
        return self.value


def validate_id(value: str, what: str = "id") -> str:
    """Check a fleet or device id (one topic level; see the module docstring)."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        msg = (
            f"{what} {value!r} is not valid: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
        raise ConfigError(msg)
    return value


def _channel(channel: str, allowed: tuple[str, ...], who: str) -> str:
    if channel not in allowed:
        msg = f"unknown {who} channel {channel!r}; use one of {', '.join(allowed)}"
        raise ConfigError(msg)
    return channel


def device_topic(fleet: str, device: str, channel: str) -> Topic:
    validate_id(fleet, "fleet id")
    validate_id(device, "device id")
    if device == GATEWAY:
        msg = f"device id {GATEWAY!r} is reserved for the gateway's own topics; pick another device id"
        raise ConfigError(msg)
    return Topic(f"{ROOT}/{fleet}/{device}/{_channel(channel, DEVICE_CHANNELS, 'device')}")


def gateway_topic(fleet: str, channel: str) -> Topic:
    validate_id(fleet, "fleet id")
    return Topic(f"{ROOT}/{fleet}/{GATEWAY}/{_channel(channel, GATEWAY_CHANNELS, 'gateway')}")


def device_filter(fleet: str, channel: str, device: str = "+") -> TopicFilter:
    """Filter for one channel of all devices (``device="+"``) or of one device."""
    validate_id(fleet, "fleet id")
    if device != "+":
        validate_id(device, "device id")
    return TopicFilter(f"{ROOT}/{fleet}/{device}/{_channel(channel, DEVICE_CHANNELS, 'device')}")


@dataclass(frozen=True)
class TopicInfo:
    """What :func:`parse_topic` found in an edgeflow topic."""

    fleet: str
    device: str | None
    channel: str

    @property
    def is_gateway(self) -> bool:
        return self.device is None


def parse_topic(topic: str | Topic) -> TopicInfo | None:
    """Split an edgeflow topic into fleet, device and channel; None if it is not one."""
    name = topic.value if isinstance(topic, Topic) else topic
    levels = name.split("/")
    if len(levels) < 4 or levels[0] != ROOT or not _ID.fullmatch(levels[1]) or not _ID.fullmatch(levels[2]):
        return None
    channel = "/".join(levels[3:])
    if levels[2] == GATEWAY:
        return TopicInfo(levels[1], None, channel) if channel in GATEWAY_CHANNELS else None
    return TopicInfo(levels[1], levels[2], channel) if channel in DEVICE_CHANNELS else None


def chunk_topic(base: str, index: int) -> str:
    """Topic that carries chunk ``index`` of a payload published on ``base``."""
    return f"{base}/{CHUNK_LEVEL}/{int(index)}"


def split_chunk_topic(topic: str) -> tuple[str, int] | None:
    """``("a/b", 3)`` for ``"a/b/_chunk/3"``; None for any other topic."""
    head, sep, index = topic.rpartition("/")
    if not sep or not index.isdigit() or len(index) > 9:
        return None
    base, sep, level = head.rpartition("/")
    if not sep or level != CHUNK_LEVEL or not base:
        return None
    return base, int(index)


def chunk_filter(filter: str | TopicFilter) -> TopicFilter | None:
    """The extra filter that also receives the chunks of messages matching ``filter``.

    None when ``filter`` ends in ``#``, which already matches the chunk
    sub-topics.
    """
    f = filter if isinstance(filter, TopicFilter) else TopicFilter(filter)
    if f.value.endswith("#"):
        return None
    return TopicFilter(f"{f.value}/{CHUNK_LEVEL}/+")


SHARED_PREFIX = "$share/"


def match_filter(f: TopicFilter) -> TopicFilter:
    """The filter a message's topic is matched against: ``f`` itself, or for an MQTT 5
    shared subscription ``$share/<group>/<filter>`` the inner ``<filter>`` (the broker
    delivers messages under their own topic, without the share prefix).

    A shared filter ending in ``#`` is refused: it would share the chunk sub-topics of
    chunked payloads too, and the broker would hand different chunks of one transfer
    to different members, none of which could reassemble it.
    """
    if not f.value.startswith(SHARED_PREFIX):
        return f
    parts = f.value.split("/", 2)
    if len(parts) < 3 or not parts[1] or "+" in parts[1] or "#" in parts[1] or not parts[2]:
        msg = f"shared subscription {f.value!r} must be $share/<group>/<filter> (group without wildcards)"
        raise ConfigError(msg)
    inner = TopicFilter(parts[2])
    if inner.value.endswith("#"):
        msg = (
            f"shared subscription {f.value!r}: a filter ending in '#' would share chunk sub-topics, so chunks of "
            "one transfer would reach different members; name the channel (e.g. .../+/update)"
        )
        raise ConfigError(msg)
    return inner


def shared_group(f: TopicFilter) -> str | None:
    """The group of a ``$share/<group>/<filter>`` subscription (None for a plain filter)."""
    return f.value.split("/", 2)[1] if f.value.startswith(SHARED_PREFIX) else None


def has_reserved_level(topic: str) -> bool:
    return CHUNK_LEVEL in topic.split("/")


def channel_spec(topic: str | Topic) -> ChannelSpec | None:
    """The :class:`ChannelSpec` of an edgeflow topic (None for any other topic)."""
    info = parse_topic(topic)
    if info is None:
        return None
    return _SPECS[info.is_gateway].get(info.channel)


def retained_chunks_allowed(base: str) -> bool:
    """May a chunked payload on ``base`` arrive from the broker's retained store?

    Only channels that are both retained and chunked by design (the
    gateway's) carry retained chunks. Anything else retained under a
    ``_chunk`` level of a device channel was put there by someone the scheme
    does not expect (a device filling the broker's retained store through its
    own ``update`` chunks): receivers refuse it instead of buffering it.
    Topics outside the scheme (bridge prefixes, applications) are not judged.
    """
    try:
        spec = channel_spec(base)
    except ConfigError:
        return True
    return True if spec is None else spec.retained and spec.chunked


def sender_of(base: str) -> str:
    """Who a payload on ``base`` is charged to: ``edgeflow/<fleet>/<device>`` (the ACL confines each
    device to its own subtree, so the topic names the sender), else the topic itself."""
    levels = base.split("/")
    if len(levels) >= 4 and levels[0] == ROOT:
        return "/".join(levels[:3])
    return base
