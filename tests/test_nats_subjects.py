"""Topics as NATS subjects (edgeflow/transport/nats/subjects.py): hostile levels stay inside their token."""

from __future__ import annotations

import pytest

from edgeflow.broker.nats import subject_matches
from edgeflow.errors import ConfigError
from edgeflow.transport.nats.subjects import filter_subjects, subject_topic, topic_subject

HOSTILE = [
    "edgeflow/lab/dev1/telemetry",
    "a.b/c",             # a dot would split one level into two tokens
    "a/*/c", "a/>/c",    # NATS wildcards inside a level
    "a/b c/d\te",        # whitespace ends a subject on the wire
    "a//b", "/a", "a/",  # empty levels
    "a/%2E/%/c",         # the escape character itself
    "a/ü/δ",
]


@pytest.mark.parametrize("topic", HOSTILE)
def test_every_topic_maps_to_one_subject_and_back(topic: str) -> None:
    subject = topic_subject(topic)
    assert subject_topic(subject) == topic
    tokens = subject.split(".")
    assert len(tokens) == len(topic.split("/")) + 1  # the prefix, then one token per level
    assert all(t and t not in ("*", ">") and not any(c.isspace() for c in t) for t in tokens)


def test_a_level_that_looks_like_a_wildcard_does_not_match_other_subjects() -> None:
    subject = topic_subject("edgeflow/lab/*/update")
    assert not subject_matches(subject, topic_subject("edgeflow/lab/dev2/update"))
    assert subject_matches(filter_subjects("edgeflow/lab/+/update")[1][0], topic_subject("edgeflow/lab/dev2/update"))


def test_filters() -> None:
    assert filter_subjects("a/+/c") == (None, ["ef.a.*.c"])
    assert filter_subjects("a/#") == (None, ["ef.a.>", "ef.a"])  # MQTT's '#' matches the parent level too
    assert filter_subjects("$share/workers/a/+/c") == ("workers", ["ef.a.*.c"])
    assert filter_subjects("a.b/+", prefix="x") == (None, ["x.a%2Eb.*"])


def test_subjects_outside_the_prefix_are_not_topics() -> None:
    assert subject_topic("_INBOX.abc") is None
    assert subject_topic("ef_retained.a.b") is None


@pytest.mark.parametrize("bad", ["$share/+/a", "a/#/b", "a+/b"])
def test_bad_filters_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError):
        filter_subjects(bad)


def test_generated_rights_keep_a_dotted_device_id_inside_its_own_subjects() -> None:
    """A device id may contain '.', which in a subject would split a level: 'a.b' must get no right on
    the subjects of device 'a' (level 'b' under it) and the reverse."""
    from edgeflow.broker.nats import nats_fleet_config

    cfg = nats_fleet_config("lab", {"a": "pa", "a.b": "pab"}, {"gateway": "pg"}, keeper_password="k")
    assert cfg.may_publish("a.b", topic_subject("edgeflow/lab/a.b/telemetry"))
    assert not cfg.may_publish("a.b", topic_subject("edgeflow/lab/a/telemetry"))
    assert not cfg.may_publish("a", topic_subject("edgeflow/lab/a.b/telemetry"))
    assert not cfg.may_publish("a", "ef.edgeflow.lab.a.b.telemetry")  # the unescaped form is no one's
    assert cfg.may_publish("gateway", topic_subject("edgeflow/lab/a.b/cmd"))
    assert not cfg.may_publish("a", topic_subject("edgeflow/lab/a/cmd"))  # commands are the gateway's to write
    assert not cfg.may_publish("nobody", topic_subject("edgeflow/lab/a/telemetry"))
