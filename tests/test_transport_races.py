"""A connection lost at the moment work is handed to paho (issue: broker restart mid-transfer).

paho writes a PUBLISH to the socket inside ``Client.publish()``. When that
write finds the connection gone, paho runs ``on_disconnect`` and returns
"connection lost" (and every later call, "no connection") before the
transport has recorded the frame as in flight. The transport must treat
these results as "not now" — the work waits for the next connection — and
fail a delivery only on a final error.

These tests make the race happen every time: a wrapped paho client cuts its
own TCP connection (``shutdown``, exactly what a reset by the peer leaves)
right before it hands over the N-th PUBLISH, SUBSCRIBE or UNSUBSCRIBE. The
broker is a real Mosquitto; the transports reconnect on their own.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
from _brokers import FAST, Inbox, mosquitto_factory, requires_mosquitto, stays, transport_factory, wait_until  # noqa: F401

from edgeflow.transport import device_filter, device_topic
from edgeflow.transport.mqtt import MqttTransport

pytestmark = [pytest.mark.integration, requires_mosquitto]

FLEET = "lab"


class CuttingTransport(MqttTransport):
    """An MqttTransport whose paho client drops its connection right before chosen calls.

    ``cut["publish"] = {10}`` cuts before the 10th PUBLISH handed to paho (counted
    over the transport's life, across reconnects); likewise "subscribe" and
    "unsubscribe".
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cut: dict[str, set[int]] = {"publish": set(), "subscribe": set(), "unsubscribe": set()}
        self.calls: dict[str, int] = {"publish": 0, "subscribe": 0, "unsubscribe": 0}
        self.cuts_done: list[tuple[str, int]] = []

    def make_client(self):  # noqa: ANN202 - paho.Client
        client = super().make_client()
        for name in ("publish", "subscribe", "unsubscribe"):
            setattr(client, name, self._wrap(client, name, getattr(client, name)))
        return client

    def _wrap(self, client, name: str, fn):  # noqa: ANN001, ANN202
        def call(*args: Any, **kwargs: Any):  # noqa: ANN202
            self.calls[name] += 1
            if self.calls[name] in self.cut[name]:
                sock = client.socket()
                sock = getattr(sock, "_socket", sock)  # under paho's websocket wrapper: the TCP socket
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)  # the next write fails: EPIPE -> paho "connection lost"
                    self.cuts_done.append((name, self.calls[name]))
            return fn(*args, **kwargs)

        return call


@pytest.fixture
def cutting_factory():
    made: list[MqttTransport] = []

    def make(broker: Any, **options: Any) -> CuttingTransport:
        t = CuttingTransport(broker.host, broker.port, **{**FAST, **options})
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(timeout=1.0, flush=False)


def _topic(device: str) -> str:
    return device_topic(FLEET, device, "update").value


@pytest.mark.parametrize("cut_at", [1, 2, 10, 33])
def test_connection_lost_while_a_chunk_is_handed_to_paho(mosquitto_factory, transport_factory, cutting_factory, cut_at):
    broker = mosquitto_factory(max_queued_messages=100_000)
    inbox = Inbox()
    receiver = transport_factory(broker, client_id="gw")
    receiver.subscribe(device_filter(FLEET, "update"), inbox)
    sender = cutting_factory(broker, client_id="dev", max_payload=16 * 1024, max_inflight=4)
    sender.connect()
    sender.cut["publish"] = {cut_at}

    payload = os.urandom(40 * 16 * 1024)
    delivery = sender.publish(_topic("dev"), payload)
    delivery.wait(30)  # raised "paho refused publish ...: The connection was lost." before the fix

    assert sender.cuts_done == [("publish", cut_at)]
    (msg,) = inbox.wait(1, timeout=30)
    assert msg.payload == payload
    s = sender.stats()
    assert s["reconnects"] >= 1
    assert s["handoff_retries"] == 1, s
    assert s.get("publish_failures", 0) == 0
    assert s["acked_frames"] == delivery.total
    stays(lambda: len(inbox.messages), for_s=0.2, reason="the transfer was delivered a second time")
    assert len(inbox.messages) == 1


def test_connection_lost_while_single_messages_are_handed_to_paho(mosquitto_factory, transport_factory, cutting_factory):
    broker = mosquitto_factory()
    inbox = Inbox()
    receiver = transport_factory(broker, client_id="gw")
    receiver.subscribe(device_filter(FLEET, "update"), inbox)
    sender = cutting_factory(broker, client_id="dev", max_inflight=3)
    sender.connect()
    sender.cut["publish"] = {4, 9}  # twice, on two different connections

    deliveries = [sender.publish(_topic("dev"), f"m{i}".encode()) for i in range(12)]
    for d in deliveries:
        d.wait(30)
    assert [name for name, _ in sender.cuts_done] == ["publish", "publish"]
    want = {f"m{i}".encode() for i in range(12)}
    assert inbox.wait_for(lambda _m: {m.payload for m in inbox.messages} >= want, timeout=30)
    assert sender.stats()["handoff_retries"] == 2


def test_connection_lost_while_subscribing(mosquitto_factory, transport_factory, cutting_factory):
    broker = mosquitto_factory()
    gw = cutting_factory(broker, client_id="gw")
    gw.connect()
    gw.cut["subscribe"] = {gw.calls["subscribe"] + 1}
    inbox = Inbox()
    # the SUBACK comes on the next connection: subscribe() waits for it instead of failing
    gw.subscribe(device_filter(FLEET, "update"), inbox, timeout=30)
    assert gw.cuts_done and gw.cuts_done[0][0] == "subscribe"
    dev = transport_factory(broker, client_id="dev")
    dev.publish(_topic("dev"), b"hello").wait(10)
    (msg,) = inbox.wait(1, timeout=10)
    assert msg.payload == b"hello"


def test_connection_lost_while_unsubscribing_keeps_the_unsubscribe(mosquitto_factory, transport_factory, cutting_factory):
    """A persistent session survives the drop, and with it the broker's subscription:
    the UNSUBSCRIBE must be sent again on the resumed session."""
    broker = mosquitto_factory()
    gw = cutting_factory(broker, client_id="gw")
    gw.connect()
    seen: list[bytes] = []
    sub = gw.subscribe(device_filter(FLEET, "update"), lambda m: seen.append(m.payload))
    gw.cut["unsubscribe"] = {gw.calls["unsubscribe"] + 1}
    gw.unsubscribe(sub, timeout=30)  # returns once the broker acknowledged, on the next connection
    assert gw.cuts_done and gw.cuts_done[0][0] == "unsubscribe"
    assert gw.stats()["reconnects"] >= 1

    # at the broker: a witness on the same filter gets the message, gw (same session) gets nothing
    before = gw.stats().get("received_frames", 0)
    witness_inbox = Inbox()
    witness = transport_factory(broker, client_id="witness")
    witness.subscribe(device_filter(FLEET, "update"), witness_inbox)
    dev = transport_factory(broker, client_id="dev")
    dev.publish(_topic("dev"), b"after").wait(10)
    witness_inbox.wait(1, timeout=10)
    stays(lambda: gw.stats().get("received_frames", 0), for_s=0.3,
          reason="the broker still delivers to the unsubscribed filter")
    assert gw.stats().get("received_frames", 0) == before
    assert seen == []


def test_unsubscribe_waits_for_the_unsuback(mosquitto_factory, transport_factory):
    broker = mosquitto_factory()
    gw = transport_factory(broker, client_id="gw")
    seen: list[bytes] = []
    sub = gw.subscribe(device_filter(FLEET, "update"), lambda m: seen.append(m.payload))
    before = gw.stats().get("received_frames", 0)
    gw.unsubscribe(sub)  # when it returns, the broker has removed the subscription
    witness_inbox = Inbox()
    witness = transport_factory(broker, client_id="witness")
    witness.subscribe(device_filter(FLEET, "update"), witness_inbox)
    dev = transport_factory(broker, client_id="dev")
    dev.publish(_topic("dev"), b"late").wait(10)
    witness_inbox.wait(1, timeout=10)
    stays(lambda: gw.stats().get("received_frames", 0), for_s=0.3,
          reason="unsubscribe() returned before the broker removed the subscription")
    assert gw.stats().get("received_frames", 0) == before
    assert seen == []


def test_final_errors_still_fail_the_delivery(mosquitto_factory, transport_factory):
    """Only "no connection now" is retried: a payload over the broker's limit still fails at once."""
    broker = mosquitto_factory(message_size_limit=4096)
    dev = transport_factory(broker, client_id="dev", max_inflight=1)
    d = dev.publish(_topic("dev"), os.urandom(8000), raw=True)
    with pytest.raises(Exception, match="larger|message_size_limit|refuse|maximum packet"):
        d.wait(20)


def test_connection_lost_during_a_handover_over_websockets(mosquitto_factory, transport_factory, cutting_factory):
    """The same race on the websockets path (paho's websocket wrapper raises the same errors)."""
    broker = mosquitto_factory(websockets=True)
    inbox = Inbox()
    receiver = transport_factory(broker, client_id="gw")
    receiver.subscribe(device_filter(FLEET, "update"), inbox)
    sender = cutting_factory(broker, client_id="dev-ws", websockets=True, max_payload=8 * 1024, max_inflight=4)
    sender.port = broker.ws_port
    sender.connect()
    sender.cut["publish"] = {5}
    payload = os.urandom(20 * 8 * 1024)
    delivery = sender.publish(_topic("dev-ws"), payload)
    delivery.wait(30)
    assert sender.cuts_done == [("publish", 5)]
    (msg,) = inbox.wait(1, timeout=30)
    assert msg.payload == payload
    assert sender.stats()["handoff_retries"] == 1
