"""The Transport contract (edgeflow/transport/base.py), one suite for every implementation.

Each test runs against:

- ``loopback``: :class:`~edgeflow.transport.loopback.LoopbackTransport` on an in-process hub;
- ``mqtt``: :class:`~edgeflow.transport.mqtt.MqttTransport` on a private Mosquitto (persistence on);
- ``nats``: :class:`~edgeflow.transport.nats.NatsTransport` on a private nats-server with JetStream,
  configured by :func:`edgeflow.broker.nats.nats_fleet_config` (accounts, users, permissions, a
  system account) with a :class:`~edgeflow.transport.nats.WillKeeper` beside it.

Real servers on free loopback ports, real sockets; transports are built through
:func:`~edgeflow.transport.factory.transport_from_url` where a URL exists, as edgeflow builds them.
Where an implementation cannot keep a clause, the test says so with ``pytest.skip`` and the reason
(the loopback hub has no access control).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from _brokers import FAST, MOSQUITTO, Inbox, stays, wait_until
from edgeflow.broker.mosquitto import fleet_acl
from edgeflow.errors import TransportError
from edgeflow.transport.message import Will

FLEET = "lab"
DEVICES = ("dev1", "dev2")
OPERATORS = ("admin", "gateway")


def _topic(device: str, channel: str) -> str:
    return f"edgeflow/{FLEET}/{device}/{channel}"


class Env:
    """One implementation with its server. ``make`` builds an operator's transport (not connected)."""

    name = ""
    has_access_control = True
    idempotent_receipt = False
    """Does a handler see a message once even across reconnects? (The contract only promises at
    least once; the NATS transport drops resent copies by Nats-Msg-Id.)"""
    passwords: dict[str, str] = {}

    def make(self, client_id: str, *, user: str = "admin", **options: Any) -> Any:  # pragma: no cover
        raise NotImplementedError("need make")

    def restart(self) -> None:  # pragma: no cover
        raise NotImplementedError("need restart")

    def stop(self) -> None:
        pass


class LoopbackEnv(Env):
    name = "loopback"
    has_access_control = False

    def __init__(self) -> None:
        from edgeflow.transport.loopback import LoopbackBroker

        self.hub = LoopbackBroker()
        self.made: list[Any] = []

    def make(self, client_id: str, *, user: str = "admin", **options: Any) -> Any:
        options = {k: v for k, v in options.items() if k in ("will", "max_payload", "clean_start")}
        t = self.hub.transport(client_id, **options)
        self.made.append(t)
        return t

    def restart(self) -> None:
        for t in self.made:
            if t.is_connected:
                self.hub.disconnect(t.client_id, reconnect_after=0.3, reason="broker restart")


class MqttEnv(Env):
    name = "mqtt"

    def __init__(self) -> None:
        from edgeflow.transport.broker import MosquittoBroker

        self.passwords = {u: secrets.token_hex(8) for u in DEVICES + OPERATORS}
        self.broker = MosquittoBroker(binary=MOSQUITTO, users=self.passwords, persistence=True,
                                      max_queued_messages=100_000,
                                      acl=fleet_acl(FLEET, operators=OPERATORS, devices=DEVICES)).start()

    def make(self, client_id: str, *, user: str = "admin", **options: Any) -> Any:
        from edgeflow.transport.factory import transport_from_url

        return transport_from_url(self.broker.url, client_id=client_id, username=user,
                                  password=self.passwords[user], **FAST, **options)

    def restart(self) -> None:
        self.broker.restart(down_s=0.3)

    def stop(self) -> None:
        self.broker.stop()


class NatsEnv(Env):
    name = "nats"
    idempotent_receipt = True

    def __init__(self) -> None:
        from edgeflow.broker.nats import KEEPER_USER, nats_fleet_config
        from edgeflow.transport.broker import NatsServer
        from edgeflow.transport.nats import WillKeeper

        self.passwords = {u: secrets.token_hex(8) for u in DEVICES + OPERATORS}
        keeper_password = secrets.token_hex(8)
        self.config = nats_fleet_config(FLEET, {d: self.passwords[d] for d in DEVICES},
                                        {o: self.passwords[o] for o in OPERATORS}, keeper_password=keeper_password)
        self.server = NatsServer(extra_config=self.config.text).start()
        # the gateway's transport creates the streams; the keeper and devices need them to exist
        self.make("stream-maker", user="gateway").connect().close()
        self.keeper = WillKeeper(self.server.url, system_user=KEEPER_USER, system_password=keeper_password,
                                 user="gateway", password=self.passwords["gateway"],
                                 may_publish=self.config.may_publish).start()

    def make(self, client_id: str, *, user: str = "admin", **options: Any) -> Any:
        from edgeflow.transport.factory import transport_from_url

        return transport_from_url(self.server.url, client_id=client_id, username=user,
                                  password=self.passwords[user], reconnect_min_s=0.05, reconnect_max_s=0.5,
                                  connect_timeout_s=5.0, **options)

    def restart(self) -> None:
        self.server.restart(down_s=0.3)

    def stop(self) -> None:
        self.keeper.stop()
        self.server.stop()


def _nats_server() -> str | None:
    from edgeflow.transport.broker import find_nats_server

    return find_nats_server()


@pytest.fixture(params=["loopback", "mqtt", "nats"])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    if request.param == "mqtt" and MOSQUITTO is None:
        pytest.skip("mosquitto is not installed")
    if request.param == "nats":
        pytest.importorskip("nats", reason="nats-py is not installed (pip install -e '.[nats]')")
        if _nats_server() is None:
            pytest.skip("nats-server is not installed")
    e: Env = {"loopback": LoopbackEnv, "mqtt": MqttEnv, "nats": NatsEnv}[request.param]()
    yield e
    e.stop()


@pytest.fixture
def make(env: Env) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def build(client_id: str, *, connect: bool = True, **options: Any) -> Any:
        t = env.make(client_id, **options)
        made.append(t)
        if connect:
            t.connect(10)
        return t

    yield build
    for t in made:
        t.close(timeout=1.0, flush=False)


# ---------------------------------------------------------------- ordering and duplicates

def test_messages_arrive_once_each_in_publish_order(make) -> None:
    gw, dev = make("gw"), make("pub")
    inbox = Inbox()
    gw.subscribe(f"edgeflow/{FLEET}/+/telemetry", inbox)
    sent = [f"m{i}".encode() for i in range(200)]
    deliveries = [dev.publish(_topic("dev1", "telemetry"), p, qos=1) for p in sent]
    for d in deliveries:
        d.wait(20)
    got = inbox.wait(len(sent), timeout=20)
    stays(lambda: len(inbox.messages), for_s=0.3, reason="a message was delivered twice")
    assert [m.payload for m in got] == sent


def test_delivery_of_a_closed_transport_fails_and_publish_refuses(make) -> None:
    t = make("short")
    t.close()
    with pytest.raises(TransportError):
        t.publish(_topic("dev1", "telemetry"), b"x")


# ---------------------------------------------------------------- retained

def test_retained_message_reaches_a_later_subscriber_and_an_empty_one_clears_it(make) -> None:
    pub = make("retainer")
    topic = _topic("dev1", "birth")
    pub.publish(topic, b"old", retain=True).wait(10)
    pub.publish(topic, b"online", retain=True).wait(10)
    first = Inbox()
    make("late-1").subscribe(topic, first)
    (msg,) = first.wait(1)
    assert (msg.payload, msg.retain) == (b"online", True)

    live_empty = Inbox()
    watcher = make("watcher")
    watcher.subscribe(topic, live_empty, include_empty=True)
    live_empty.wait(1)  # its retained copy
    pub.publish(topic, b"", retain=True).wait(10)
    got = live_empty.wait(2)
    assert got[-1].payload == b""  # the clearing message reaches include_empty handlers

    later = Inbox()
    make("late-2").subscribe(topic, later, include_empty=True)
    pub.publish(_topic("dev1", "telemetry"), b"barrier").wait(10)
    barrier = Inbox()
    make("late-3").subscribe(_topic("dev1", "telemetry"), barrier)
    stays(lambda: len(later.messages), for_s=0.5, reason="a cleared retained message was delivered")


# ---------------------------------------------------------------- wildcards and shared subscriptions

def test_plus_and_hash_filters(make) -> None:
    # two clients: overlapping filters in one MQTT client bring one copy per subscription (MQTT 5)
    sub1, sub2, pub = make("wild-sub1"), make("wild-sub2"), make("wild-pub")
    plus, hash_ = Inbox(), Inbox()
    sub1.subscribe(f"edgeflow/{FLEET}/+/telemetry", plus)
    sub2.subscribe(f"edgeflow/{FLEET}/dev2/#", hash_)
    for topic in (_topic("dev1", "telemetry"), _topic("dev2", "telemetry"), _topic("dev2", "cmd/ack"),
                  f"edgeflow/{FLEET}/dev2"):
        pub.publish(topic, topic.encode()).wait(10)
    plus.wait(2)
    assert sorted(plus.topics()) == [_topic("dev1", "telemetry"), _topic("dev2", "telemetry")]
    hash_.wait(3)
    assert sorted(hash_.topics()) == sorted([_topic("dev2", "telemetry"), _topic("dev2", "cmd/ack"),
                                             f"edgeflow/{FLEET}/dev2"])  # '#' matches the parent too
    stays(lambda: (len(plus.messages), len(hash_.messages)), for_s=0.3, reason="a filter matched too much")


def test_shared_subscription_hands_each_message_to_one_member(make) -> None:
    a, b, pub = make("member-a"), make("member-b"), make("shared-pub")
    ia, ib = Inbox(), Inbox()
    flt = f"$share/workers/edgeflow/{FLEET}/+/update"
    a.subscribe(flt, ia)
    b.subscribe(flt, ib)
    sent = {f"u{i}".encode() for i in range(60)}
    for p in sorted(sent):
        pub.publish(_topic("dev1", "update"), p).wait(10)
    assert wait_until(lambda: len(ia.messages) + len(ib.messages) >= len(sent), 20)
    stays(lambda: len(ia.messages) + len(ib.messages), for_s=0.3, reason="a shared message reached two members")
    got = [m.payload for m in ia.messages + ib.messages]
    assert sorted(got) == sorted(sent)
    assert ia.messages and ib.messages, "one member got everything: the group did not share"


# ---------------------------------------------------------------- large payloads

def test_large_payload_is_chunked_and_arrives_whole(make) -> None:
    gw = make("big-gw", max_payload=64 * 1024)
    dev = make("big-dev", max_payload=64 * 1024)
    inbox = Inbox()
    gw.subscribe(f"edgeflow/{FLEET}/+/update", inbox)
    payload = os.urandom(3 * 1024 * 1024 + 17)
    d = dev.publish(_topic("dev1", "update"), payload)
    d.wait(60)
    (msg,) = inbox.wait(1, timeout=60)
    assert msg.payload == payload and msg.chunks > 1
    assert d.total in (1, msg.chunks)  # progress per chunk (the loopback hub acknowledges the whole at once)


def test_retained_chunked_payload_reaches_a_later_subscriber(make) -> None:
    gw = make("model-gw", max_payload=32 * 1024)
    model = os.urandom(300 * 1024)
    gw.publish(f"edgeflow/{FLEET}/gateway/model", model, retain=True).wait(30)
    inbox = Inbox()
    make("model-dev").subscribe(f"edgeflow/{FLEET}/gateway/model", inbox)
    (msg,) = inbox.wait(1, timeout=30)
    assert msg.payload == model and msg.retain and msg.chunks > 1


# ---------------------------------------------------------------- reconnect mid-transfer

def test_server_restart_in_the_middle_of_a_chunked_transfer(env, make) -> None:
    receiver = make("gw-r", connect=False)
    inbox = Inbox()
    receiver.subscribe(f"edgeflow/{FLEET}/+/update", inbox)  # before connect: made on connect
    receiver.connect(10)
    sender = make("dev-r", max_payload=32 * 1024, max_inflight=4)
    payload = os.urandom(4 * 1024 * 1024)
    a_third = threading.Event()
    delivery = sender.publish(_topic("dev1", "update"), payload)
    if delivery.total > 1:  # the loopback hub has no per-chunk progress: it restarts at once
        delivery.add_progress_callback(lambda d: a_third.set() if d.acked >= d.total // 3 else None)
        assert a_third.wait(30)
        assert delivery.acked < delivery.total, "the transfer finished before the restart; make it longer"
    env.restart()
    delivery.wait(60)
    (msg,) = inbox.wait(1, timeout=60)
    assert msg.payload == payload
    stays(lambda: len(inbox.messages), for_s=0.3, reason="the payload was delivered twice")


def test_messages_published_while_the_subscriber_reconnects_are_not_lost(env, make) -> None:
    receiver = make("gw-gap")
    inbox = Inbox()
    receiver.subscribe(f"edgeflow/{FLEET}/+/telemetry", inbox)
    sender = make("dev-gap")
    first = [f"a{i}".encode() for i in range(20)]
    for p in first:
        sender.publish(_topic("dev1", "telemetry"), p).wait(10)
    inbox.wait(len(first))
    env.restart()
    then = [f"b{i}".encode() for i in range(20)]
    for p in then:
        sender.publish(_topic("dev1", "telemetry"), p)
    assert sender.flush(60)
    assert wait_until(lambda: {m.payload for m in inbox.messages} >= set(first + then), 60), "messages were lost"
    got = [m.payload for m in inbox.messages]
    assert set(got) == set(first + then)
    if env.idempotent_receipt:
        stays(lambda: len(inbox.messages), for_s=0.5, reason="a message was delivered twice")
        assert sorted(got) == sorted(first + then)


# ---------------------------------------------------------------- permissions

def test_a_device_may_not_publish_as_another_device(env, make) -> None:
    if not env.has_access_control:
        pytest.skip(f"{env.name} has no access control (an in-process hub for unit tests)")
    gw = make("gw-acl", user="gateway")
    inbox = Inbox()
    gw.subscribe(f"edgeflow/{FLEET}/+/telemetry", inbox)
    dev1 = make("dev1", user="dev1")
    dev1.publish(_topic("dev1", "telemetry"), b"mine").wait(10)
    with pytest.raises(TransportError, match="(?i)not authori"):
        dev1.publish(_topic("dev2", "telemetry"), b"forged").wait(10)
    (msg,) = inbox.wait(1)
    assert msg.payload == b"mine"
    stays(lambda: len(inbox.messages), for_s=0.3, reason="the forged message reached the gateway")


# ---------------------------------------------------------------- will

def test_will_is_published_after_an_abort_and_not_after_a_clean_close(make) -> None:
    gw = make("gw-will", user="gateway")
    inbox = Inbox()
    gw.subscribe(f"edgeflow/{FLEET}/+/death", inbox)
    clean = make("dev2", user="dev2", will=Will(_topic("dev2", "death"), b"dev2 gone", retain=True))
    clean.close()
    crashed = make("dev1", user="dev1", will=Will(_topic("dev1", "death"), b"dev1 gone", retain=True))
    crashed.close(abort=True)
    (msg,) = inbox.wait(1, timeout=20)
    assert (msg.topic, msg.payload) == (_topic("dev1", "death"), b"dev1 gone")
    later = Inbox()
    make("late-will").subscribe(f"edgeflow/{FLEET}/+/death", later)
    (kept,) = later.wait(1)
    assert kept.retain and kept.payload == b"dev1 gone"
    stays(lambda: len(inbox.messages), for_s=0.5, reason="a will was published after a clean close")
