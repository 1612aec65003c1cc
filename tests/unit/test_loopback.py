"""The loopback hub keeps the MQTT semantics edgeflow relies on (no broker, no sleeps:
``hub.settle()`` returns once everything published was handled)."""

from __future__ import annotations

import threading

import pytest

from edgeflow.errors import ConfigError, TransportError
from edgeflow.transport.loopback import LinkState, LoopbackBridge, LoopbackBroker
from edgeflow.transport.message import ConnectionEvent, Message, Will


class Box:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.threads: set[str] = set()

    def __call__(self, msg: Message) -> None:
        self.threads.add(threading.current_thread().name)
        self.messages.append(msg)

    def payloads(self) -> list[bytes]:
        return [m.payload for m in self.messages]


@pytest.fixture
def hub():
    h = LoopbackBroker()
    yield h
    for t in list(h._transports):
        t.close(flush=False)


def test_wildcards_dollar_topics_and_order(hub):
    box, dollar = Box(), Box()
    sub = hub.transport("sub")
    sub.subscribe("a/+/c", box)
    sub.subscribe("a/#", box)  # overlapping: one copy per client, every matching handler is called
    sub.subscribe("#", dollar)
    sub.connect()
    pub = hub.transport("pub").connect()
    for i in range(50):
        pub.publish(f"a/{i}/c", str(i))
    pub.publish("$SYS/x", b"sys")
    pub.publish("b", b"other")
    hub.settle()
    assert box.payloads()[::2] == [str(i).encode() for i in range(50)]  # arrival order, twice each
    assert len(box.messages) == 100 and len(box.threads) == 1 and "loopback" in next(iter(box.threads))
    assert b"sys" not in dollar.payloads() and dollar.payloads()[-1] == b"other"
    with pytest.raises(ConfigError):
        sub.subscribe("a/#/c", box)
    with pytest.raises(ConfigError, match="wildcard"):
        pub.publish("a/+", b"x")
    with pytest.raises(ConfigError, match="_chunk"):
        pub.publish("a/_chunk/1", b"x")
    with pytest.raises(ConfigError, match="qos"):
        pub.publish("a", b"x", qos=2)
    with pytest.raises(ConfigError, match="property"):
        pub.publish("a", b"x", properties={"colour": "red"})  # type: ignore[typeddict-unknown-key]


def test_retained_messages_and_clearing(hub):
    pub = hub.transport("pub").connect()
    pub.publish("m/model", b"v1", retain=True)
    pub.publish("m/model", b"v2", retain=True)
    pub.publish("m/round", b"r1", retain=True)
    late, empties = Box(), Box()
    t = hub.transport("late")
    t.subscribe("m/+", late)
    t.connect()
    hub.settle()
    assert sorted((m.topic, m.payload, m.retain) for m in late.messages) == [("m/model", b"v2", True),
                                                                               ("m/round", b"r1", True)]
    t.subscribe("m/round", empties, include_empty=True)
    pub.publish("m/round", b"", retain=True)  # clears the retained message
    pub.publish("m/model", b"v3")  # live: retain False, the retained v2 stays
    hub.settle()
    assert [m.payload for m in empties.messages] == [b"r1", b""]
    assert late.messages[-1].payload == b"v3" and not late.messages[-1].retain
    assert b"" not in late.payloads()  # only handlers with include_empty see the empty message
    assert hub.retained("m/#") == {"m/model": b"v2"}


def test_qos_is_the_lower_of_publish_and_subscription(hub):
    box = Box()
    t = hub.transport("s")
    t.subscribe("q/0", box, qos=0)
    t.subscribe("q/1", box)
    t.connect()
    p = hub.transport("p").connect()
    p.publish("q/0", b"a", qos=1)
    p.publish("q/1", b"b", qos=0)
    p.publish("q/1", b"c", qos=1)
    hub.settle()
    assert [(m.payload, m.qos) for m in box.messages] == [(b"a", 0), (b"b", 0), (b"c", 1)]


def test_offline_publish_is_queued_and_sent_in_order(hub):
    box = Box()
    s = hub.transport("s")
    s.subscribe("x", box)
    s.connect()
    p = hub.transport("p")
    deliveries = [p.publish("x", str(i)) for i in range(5)]
    assert not any(d.done for d in deliveries) and p.stats()["queued_messages"] == 5
    p.connect()
    for d in deliveries:
        d.wait(1)
    hub.settle()
    assert box.payloads() == [b"0", b"1", b"2", b"3", b"4"]
    q = hub.transport("q")
    pending = q.publish("x", b"never")
    q.close()
    with pytest.raises(TransportError, match="closed before"):
        pending.wait(1)
    with pytest.raises(TransportError, match="closed"):
        q.publish("x", b"after")


def test_persistent_session_queues_while_away_and_redelivers_unacked(hub):
    box = Box()
    gate, entered = threading.Event(), threading.Event()

    def slow(msg: Message) -> None:
        if msg.payload == b"m0" and not gate.is_set():
            entered.set()
            gate.wait(5)
        box(msg)

    s = hub.transport("gw")
    s.subscribe("u", slow)
    s.connect()
    p = hub.transport("dev").connect()
    p.publish("u", b"m0")
    assert entered.wait(5)
    hub.disconnect("gw", reconnect_after=None)  # while m0's handler runs: m0 is not acknowledged
    p.publish("u", b"m1")  # queued by the hub for the absent persistent session
    p.publish("u", b"q0", qos=0)  # QoS 0 to an absent client is lost
    assert s.state is LinkState.DOWN and not s.is_connected
    gate.set()
    hub.reconnect("gw")
    hub.settle()
    assert box.payloads() == [b"m0", b"m0", b"m1"]  # at least once: m0 again on the resumed session
    assert hub.stats["dropped_offline"] == 1 and s.stats()["reconnects"] == 1


def test_clean_start_forgets_the_session(hub):
    box = Box()
    s = hub.transport("c", clean_start=True)
    s.subscribe("u", box)
    s.connect()
    s.close()
    hub.transport("p").connect().publish("u", b"while away")
    again = hub.transport("c", clean_start=True)
    again.subscribe("u", box)
    again.connect()
    hub.settle()
    assert box.messages == []


def test_duplicate_delivery_for_idempotence_tests():
    hub = LoopbackBroker(duplicate_qos1=lambda m: m.topic == "dup")
    box = Box()
    s = hub.transport("s")
    s.subscribe("#", box)
    s.connect()
    p = hub.transport("p").connect()
    p.publish("dup", b"1")
    p.publish("once", b"2")
    p.publish("dup", b"3", qos=0)
    hub.settle()
    assert box.payloads() == [b"1", b"1", b"2", b"3"]


def test_shared_subscriptions_split_the_load(hub):
    boxes = [Box(), Box(), Box()]
    members = []
    for i, b in enumerate(boxes):
        t = hub.transport(f"m{i}")
        t.subscribe("$share/g/t/+/x", b)
        members.append(t.connect())
    plain = Box()
    hub.transport("all").connect().subscribe("t/+/x", plain)
    p = hub.transport("p").connect()
    p.publish("t/r/x", b"retained", retain=True)
    for i in range(30):
        p.publish(f"t/{i}/x", str(i))
    hub.settle()
    got = sorted(m.payload for b in boxes for m in b.messages)
    assert len(got) == 31 and len(set(got)) == 31  # each message to exactly one member
    assert all(len(b.messages) >= 10 for b in boxes)
    assert len(plain.messages) == 31  # a plain subscription still sees everything
    members[0].close()
    n = [len(b.messages) for b in boxes]
    for i in range(4):
        p.publish(f"t/{i}/x", b"after")
    hub.settle()
    assert len(boxes[0].messages) == n[0] and sum(len(b.messages) for b in boxes[1:]) == sum(n[1:]) + 4
    late = Box()
    hub.transport("late").connect().subscribe("$share/g2/t/+/x", late)
    hub.settle()
    assert late.messages == []  # retained messages are not sent to shared subscriptions
    with pytest.raises(ConfigError, match="'#'"):
        p.subscribe("$share/g/t/#", late)


def test_wills_fire_on_abort_and_on_a_lost_connection_not_on_a_clean_close(hub):
    deaths = Box()
    hub.transport("gw").connect().subscribe("d/+", deaths)
    n = iter(range(100))
    calls: list[int] = []

    def payload() -> bytes:
        calls.append(next(n))
        return f"death-{calls[-1]}".encode()

    a = hub.transport("a", will=Will("d/a", payload, retain=True))
    a.connect()
    hub.disconnect("a", reconnect_after=0.0)  # lost: will of session 0, then a new session (will 1)
    assert a.wait_connected(5)
    a.close(abort=True)  # like a power cut: will of session 1
    b = hub.transport("b", will=Will("d/b", b"bye"))
    b.connect()
    b.close()  # clean: no will
    hub.settle()
    assert deaths.payloads() == [b"death-0", b"death-1"] and calls == [0, 1]
    assert hub.retained("d/#") == {"d/a": b"death-1"}


def test_a_second_connection_takes_the_session_over(hub):
    deaths, events = Box(), []
    hub.transport("gw").connect().subscribe("d", deaths)
    old = hub.transport("dev", will=Will("d", b"old will"))
    old.add_connection_listener(events.append)
    old.connect()
    new = hub.transport("dev").connect()
    hub.settle()
    assert old.state is LinkState.DOWN and new.is_connected and hub.connected() == ["dev", "gw"]
    assert deaths.payloads() == [b"old will"]
    assert [e.connected for e in events] == [True, False] and "taken over" in events[-1].reason


def test_connection_events_come_in_order_with_messages(hub):
    seen: list[object] = []
    t = hub.transport("t")
    t.subscribe("x", lambda m: seen.append(m.payload))
    t.add_connection_listener(lambda e: seen.append(e))
    t.connect()
    p = hub.transport("p").connect()
    p.publish("x", b"1")
    hub.settle()  # handled and acknowledged: not delivered again after the reconnect
    hub.disconnect("t")
    assert t.wait_connected(5)
    p.publish("x", b"2")
    hub.settle()
    kinds = [("event", s.connected, s.session_present) if isinstance(s, ConnectionEvent) else s for s in seen]
    assert kinds == [("event", True, False), b"1", ("event", False, False), ("event", True, True), b"2"]


def test_max_payload_chunks_like_the_real_transport_and_raw_messages_are_refused():
    hub = LoopbackBroker(max_payload=4096)
    box = Box()
    s = hub.transport("s")
    s.subscribe("big", box)
    s.connect()
    p = hub.transport("p", max_payload=2048).connect()
    p.publish("big", bytes(10_000)).wait(1)
    d = p.publish("big", bytes(5000), raw=True)
    with pytest.raises(TransportError, match="larger than the broker accepts"):
        d.wait(1)
    hub.settle()
    (m,) = box.messages
    assert m.chunks == 5 and m.transfer_id and len(m.payload) == 10_000 and m.qos == 1


def test_drop_and_delay_faults(hub):
    box = Box()
    s = hub.transport("s")
    s.subscribe("#", box)
    s.connect()
    p = hub.transport("p").connect()
    silent = hub.drop("lost/+", times=1)
    p.publish("lost/1", b"gone").wait(1)  # acknowledged, never delivered
    p.publish("lost/2", b"kept").wait(1)  # times=1: the rule is used up
    hub.drop(lambda m: m.payload == b"refused", error="not authorized")
    with pytest.raises(TransportError, match="not authorized"):
        p.publish("x", b"refused").wait(1)
    hub.delay("slow", 0.2)
    slow = p.publish("slow", b"late")
    p.publish("fast", b"first")
    hub.settle()  # waits for the delayed message too
    assert slow.done and box.payloads() == [b"kept", b"first", b"late"]
    assert silent.hits == 1 and hub.stats["dropped"] == 2


def test_a_bridge_maps_prefixes_both_ways_and_keeps_retained():
    from edgeflow.broker.bridge import BridgeSpec, bridge_topics

    site, central = LoopbackBroker(name="site"), LoopbackBroker(name="central")
    root = central.transport("root").connect()
    root.publish("edgeflow/f/gateway/model", b"global", retain=True)
    bridge = LoopbackBridge(site, central, bridge_topics(BridgeSpec("f", "site-a", "central"))).start()
    central.settle()
    site.settle()  # the retained model crossed the bridge before the site gateway connects
    down, up = Box(), Box()
    sg = site.transport("site-gw")
    sg.subscribe("edgeflow/f/_uplink/gateway/+", down)
    sg.connect()
    root.subscribe("edgeflow/f/+/update", up)
    sg.publish("edgeflow/f/_uplink/site-a/update", b"partial")
    sg.publish("edgeflow/f/site-a/telemetry", b"stays local")
    root.publish("edgeflow/f/gateway/round", b"r1", retain=True)
    for h in (central, site, central):
        h.settle()
    assert [(m.topic, m.payload) for m in down.messages] == [("edgeflow/f/_uplink/gateway/model", b"global"),
                                                              ("edgeflow/f/_uplink/gateway/round", b"r1")]
    assert down.messages[0].retain  # came from the retained store
    assert site.retained("edgeflow/f/_uplink/#") == {"edgeflow/f/_uplink/gateway/model": b"global",
                                                     "edgeflow/f/_uplink/gateway/round": b"r1"}
    assert [(m.topic, m.payload) for m in up.messages] == [("edgeflow/f/site-a/update", b"partial")]
    assert bridge.forwarded == {"in": 2, "out": 1}
    bridge.stop()
