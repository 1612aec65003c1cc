"""The topic scheme, Topic/TopicFilter validation and matching, broker URLs."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from edgeflow.errors import ConfigError
from edgeflow.transport.topics import (
    CHUNK_LEVEL,
    DEVICE_CHANNELS,
    GATEWAY_CHANNELS,
    Topic,
    TopicFilter,
    chunk_filter,
    chunk_topic,
    device_filter,
    device_topic,
    gateway_topic,
    parse_topic,
    split_chunk_topic,
    validate_id,
)
from edgeflow.transport.url import parse_broker_url


@pytest.mark.parametrize(
    ("filter_", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a", True),  # '#' also matches the parent level (MQTT 4.7.1.2)
        ("a/#", "a/b/c", True),
        ("#", "a/b", True),
        ("+/+", "a/b", True),
        ("+", "a/b", False),
        ("a/+/c", "a//c", True),  # empty levels are levels
        ("#", "$SYS/broker/uptime", False),  # wildcards at the start skip $-topics
        ("+/broker/uptime", "$SYS/broker/uptime", False),
        ("$SYS/#", "$SYS/broker/uptime", True),
        ("edgeflow/lab/+/update", "edgeflow/lab/pi-7/update", True),
        ("edgeflow/lab/+/update", "edgeflow/lab/pi-7/update/_chunk/3", False),
    ],
)
def test_filter_matching(filter_: str, topic: str, expected: bool) -> None:
    assert TopicFilter(filter_).matches(topic) is expected
    assert Topic(topic).matches(filter_) is expected


@pytest.mark.parametrize("bad", ["a/#/b", "a#", "a/b+", "+a", "", "a\0b"])
def test_invalid_filters_are_rejected(bad: str) -> None:
    with pytest.raises(ConfigError):
        TopicFilter(bad)


@pytest.mark.parametrize("bad", ["a/+", "a/#", "", "x\0"])
def test_invalid_topics_are_rejected(bad: str) -> None:
    with pytest.raises(ConfigError):
        Topic(bad)


def test_topic_is_frozen_and_hashable() -> None:
    t = Topic("edgeflow/lab/pi/update")
    with pytest.raises(AttributeError):
        t.value = "x"  # type: ignore[misc]
    assert {t, Topic("edgeflow/lab/pi/update")} == {t}
    assert t.levels == ("edgeflow", "lab", "pi", "update")


def test_scheme_builders_and_parse_round_trip() -> None:
    for channel in DEVICE_CHANNELS:
        topic = device_topic("lab", "pi-7", channel)
        assert topic.value == f"edgeflow/lab/pi-7/{channel}"
        info = parse_topic(topic)
        assert info is not None and (info.fleet, info.device, info.channel) == ("lab", "pi-7", channel)
        assert device_filter("lab", channel).matches(topic)
        assert not device_filter("lab", channel, device="pi-8").matches(topic)
    for channel in GATEWAY_CHANNELS:
        topic = gateway_topic("lab", channel)
        info = parse_topic(topic)
        assert info is not None and info.is_gateway and info.channel == channel


@pytest.mark.parametrize("topic", ["other/lab/pi/update", "edgeflow/lab/pi/nonsense", "edgeflow/lab/gateway/update",
                                   "edgeflow/lab", "edgeflow/l+b/pi/update"])
def test_parse_topic_rejects_foreign_topics(topic: str) -> None:
    assert parse_topic(topic) is None


def test_ids_are_validated_with_a_helpful_message() -> None:
    with pytest.raises(ConfigError, match="letters, digits"):
        device_topic("lab", "pi/7", "update")
    with pytest.raises(ConfigError, match="reserved"):
        device_topic("lab", "gateway", "update")
    with pytest.raises(ConfigError, match="unknown device channel"):
        device_topic("lab", "pi", "updates")
    with pytest.raises(ConfigError):
        validate_id("-leading-dash")
    assert validate_id("a" * 64) == "a" * 64
    with pytest.raises(ConfigError):
        validate_id("a" * 65)


def test_chunk_topics() -> None:
    base = "edgeflow/lab/gateway/model"
    assert chunk_topic(base, 12) == f"{base}/{CHUNK_LEVEL}/12"
    assert split_chunk_topic(chunk_topic(base, 12)) == (base, 12)
    assert split_chunk_topic(base) is None
    assert split_chunk_topic("_chunk/3") is None
    assert split_chunk_topic(f"{base}/_chunk/x") is None
    assert split_chunk_topic(f"{base}/_chunk/-1") is None
    f = chunk_filter("edgeflow/lab/+/update")
    assert f is not None and f.matches("edgeflow/lab/pi/update/_chunk/0")
    assert chunk_filter("edgeflow/lab/#") is None  # '#' already covers the chunk topics


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(alphabet="abc", min_size=0, max_size=2), min_size=1, max_size=4),
    st.lists(st.sampled_from(["a", "b", "+", ""]), min_size=1, max_size=4),
    st.booleans(),
)
def test_matching_agrees_with_a_reference(topic_levels: list[str], filter_levels: list[str], hash_tail: bool) -> None:
    """Compare with a straightforward recursive definition of MQTT matching."""
    topic = "/".join(topic_levels)
    flt = "/".join(filter_levels + (["#"] if hash_tail else []))
    assume(topic and flt)  # MQTT forbids empty topic names and filters

    def ref(f: list[str], t: list[str]) -> bool:
        if not f:
            return not t
        if f[0] == "#":
            return True
        if not t:
            return False
        return (f[0] == "+" or f[0] == t[0]) and ref(f[1:], t[1:])

    assert TopicFilter(flt).matches(topic) is ref(flt.split("/"), topic.split("/"))


@pytest.mark.parametrize(
    ("url", "host", "port", "tls", "ws"),
    [
        ("mqtt://127.0.0.1:1884", "127.0.0.1", 1884, False, False),
        ("mqtt://broker", "broker", 1883, False, False),
        ("mqtts://broker", "broker", 8883, True, False),
        ("ws://broker:9001/mqtt", "broker", 9001, False, True),
        ("wss://broker/ws", "broker", 443, True, True),
        ("tcp://[::1]:1883", "::1", 1883, False, False),
    ],
)
def test_parse_broker_url(url: str, host: str, port: int, tls: bool, ws: bool) -> None:
    addr = parse_broker_url(url)
    assert (addr.host, addr.port, addr.tls, addr.websockets) == (host, port, tls, ws)


def test_broker_url_credentials_and_errors() -> None:
    addr = parse_broker_url("mqtt://dev%40lab:p%3Ass@h:1")
    assert (addr.username, addr.password) == ("dev@lab", "p:ss")
    for bad in ("broker:1883", "http://x", "mqtt://:1883", "mqtt://h:99999", "mqtt://h/path"):
        with pytest.raises(ConfigError, match="expected|path|port|scheme|host"):
            parse_broker_url(bad)
