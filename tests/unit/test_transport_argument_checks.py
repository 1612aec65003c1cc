"""Every transport refuses the same bad arguments with the same one-line ConfigError.

The rules live once (transport/framing.py for publish, transport/dispatching.py
for subscribe, transport/limits.py for the constructor limits); these tests
feed the hostile values through each transport's public interface, offline
(nothing is sent: the checks come first).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from edgeflow.errors import ConfigError
from edgeflow.transport.loopback import LoopbackBroker
from edgeflow.transport.mqtt import MqttTransport
from edgeflow.transport.nats import NatsTransport


@pytest.fixture(params=["mqtt", "nats", "loopback"])
def transport(request) -> Iterator[object]:
    hub = LoopbackBroker()
    t = {"mqtt": lambda: MqttTransport("127.0.0.1", 1, client_id="checks"),
         "nats": lambda: NatsTransport("127.0.0.1", 1, client_id="checks"),
         "loopback": lambda: hub.transport("checks")}[request.param]()
    yield t
    if request.param == "loopback":
        t.close(flush=False)
    else:
        t.close(timeout=1.0)


@pytest.mark.parametrize("qos", [2, -1, "1"])
def test_subscribe_refuses_a_qos_other_than_0_or_1(transport, qos) -> None:
    with pytest.raises(ConfigError, match=r"qos must be 0 or 1, got"):
        transport.subscribe("a/b", lambda m: None, qos=qos)


def test_subscribe_refuses_a_handler_that_is_not_callable(transport) -> None:
    with pytest.raises(ConfigError, match=r"handler must be callable: handler\(message\)"):
        transport.subscribe("a/b", "not a function")


@pytest.mark.parametrize(("topic", "qos", "raw", "match"), [
    ("a/b", 2, False, "deduplicates QoS 1 instead of using QoS 2"),
    ("a/+", 1, False, "wildcard"),
    ("a/_chunk/0", 1, False, "'_chunk' is reserved"),
])
def test_publish_refuses_the_same_arguments_on_every_transport(transport, topic, qos, raw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        transport.publish(topic, b"x", qos=qos, raw=raw)


@pytest.mark.parametrize("cls", [MqttTransport, NatsTransport])
@pytest.mark.parametrize(("options", "match"), [
    ({"max_payload": 1103}, r"max_payload 1103 is too small; use at least 1104 bytes"),
    ({"max_inflight": 0}, r"max_inflight must be >= 1"),
    ({"port": 0}, r"port must be in 1\.\.65535, got 0"),
    ({"port": 65536}, r"port must be in 1\.\.65535, got 65536"),
])
def test_broker_transports_refuse_limits_that_cannot_work(cls, options, match) -> None:
    kwargs = {"host": "127.0.0.1", "port": 1883, **options}
    with pytest.raises(ConfigError, match=match):
        cls(**kwargs)
