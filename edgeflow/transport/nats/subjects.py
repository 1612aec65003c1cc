"""MQTT-style topics and filters as NATS subjects, and back (pure: no nats import).

edgeflow's topics are MQTT topics (``edgeflow/<fleet>/<device>/<channel>``);
NATS subjects are dot-separated tokens. The mapping, under a root prefix
(``ef`` by default) so that JetStream streams can capture all of edgeflow's
traffic and nothing else on the server::

    topic  a/b/c            subject  ef.a.b.c
    filter a/+/c            subject  ef.a.*.c
    filter a/#              subjects ef.a and ef.a.>   (MQTT's '#' also matches the parent)
    filter $share/g/a/+     subject  ef.a.*  in queue group g

A level may hold characters a subject token cannot (``.``, whitespace) or
that NATS reads as wildcards (``*``, ``>``): they are escaped as ``%XX``
(``%`` itself as ``%25``); an empty level becomes the token ``%`` (which no
escaped level can produce). The mapping is one-to-one, so a received
subject always gives back the topic that was published.

Retained messages live under ``<prefix>_retained.<...>`` and last wills under
``<prefix>_will.<client>`` (see :mod:`.link` and :mod:`.will`).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgeflow.errors import ConfigError
from edgeflow.transport.topics import TopicFilter, match_filter, shared_group

__all__ = [
    "DEFAULT_PREFIX",
    "StreamNames",
    "decode_level",
    "encode_level",
    "filter_subjects",
    "retained_subject",
    "subject_topic",
    "topic_subject",
    "will_subject",
]

DEFAULT_PREFIX = "ef"
_ESCAPE = {c: f"%{ord(c):02X}" for c in "%.*> \t\r\n\f\v"}


@dataclass(frozen=True)
class StreamNames:
    """The JetStream streams of one subject prefix: ``<PREFIX>_LIVE``, ``_RETAINED``, ``_WILLS``."""

    prefix: str

    @property
    def live(self) -> str:
        return f"{self.prefix.upper().replace('-', '_')}_LIVE"

    @property
    def retained(self) -> str:
        return f"{self.prefix.upper().replace('-', '_')}_RETAINED"

    @property
    def wills(self) -> str:
        return f"{self.prefix.upper().replace('-', '_')}_WILLS"


def check_prefix(prefix: str) -> str:
    if not prefix or not all(c.isalnum() or c in "_-" for c in prefix):
        msg = f"NATS subject prefix {prefix!r} must be letters, digits, '_' or '-' (e.g. 'ef')"
        raise ConfigError(msg)
    return prefix


def encode_level(level: str) -> str:
    """One topic level as one subject token."""
    if level == "":
        return "%"
    return "".join(_ESCAPE.get(c, c) for c in level)


def decode_level(token: str) -> str:
    if token == "%":
        return ""
    if "%" not in token:
        return token
    out: list[str] = []
    i = 0
    while i < len(token):
        c = token[i]
        if c == "%" and _is_hex(token[i + 1:i + 3]):
            out.append(chr(int(token[i + 1:i + 3], 16)))
            i += 3
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _is_hex(s: str) -> bool:
    return len(s) == 2 and all(c in "0123456789ABCDEFabcdef" for c in s)


def topic_subject(topic: str, prefix: str = DEFAULT_PREFIX) -> str:
    """``a/b/c`` -> ``<prefix>.a.b.c`` (levels escaped)."""
    return ".".join([prefix, *(encode_level(x) for x in topic.split("/"))])


def subject_topic(subject: str, prefix: str = DEFAULT_PREFIX) -> str | None:
    """The topic of a subject under ``prefix`` (None for a subject outside it)."""
    head, sep, rest = subject.partition(".")
    if head != prefix or not sep:
        return None
    return "/".join(decode_level(t) for t in rest.split("."))


def retained_subject(topic: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Where the retained message of ``topic`` is kept (one per subject, JetStream)."""
    return topic_subject(topic, f"{prefix}_retained")


def will_subject(client_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Where a connection's last will is kept while it is connected."""
    return f"{prefix}_will.{encode_level(client_id)}"


def filter_subjects(f: str | TopicFilter, prefix: str = DEFAULT_PREFIX) -> tuple[str | None, list[str]]:
    """(queue group or None, the subjects a subscription to ``f`` needs).

    ``$share/<group>/<filter>`` gives the group; ``+`` becomes ``*``; a final
    ``#`` becomes ``>`` plus the parent subject (MQTT's ``a/#`` matches ``a``).
    """
    tf = f if isinstance(f, TopicFilter) else TopicFilter(f)
    inner = match_filter(tf)
    group = shared_group(tf)
    tokens = []
    levels = inner.value.split("/")
    for level in levels:
        if level == "+":
            tokens.append("*")
        elif level == "#":
            tokens.append(">")
        else:
            tokens.append(encode_level(level))
    subjects = [".".join([prefix, *tokens])]
    if levels[-1] == "#" and len(levels) > 1:
        subjects.append(".".join([prefix, *tokens[:-1]]))
    return group, subjects
