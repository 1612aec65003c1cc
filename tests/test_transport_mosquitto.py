"""MqttTransport against real Mosquitto processes (no mocks).

Each test starts its own broker on a free loopback port, with exactly the
auth/ACL/limits it needs (see tests/_brokers.py).
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time

import numpy as np
import pytest
from _brokers import (  # noqa: F401  (fixtures)
    Inbox,
    stays,
    mosquitto_factory,
    requires_mosquitto,
    tls_material,
    transport_factory,
    wait_until,
)

from edgeflow.codecs import available_codecs, decode_update, encode_update
from edgeflow.errors import ConfigError, TransportError
from edgeflow.signing import KeyRing, ReplayGuard, Signer
from edgeflow.transport import TlsConfig, Will, device_filter, device_topic, gateway_topic
from edgeflow.transport.broker import free_port
from edgeflow.transport.chunking import Splitter
from edgeflow.transport.topics import chunk_topic

pytestmark = [pytest.mark.integration, requires_mosquitto]

FLEET = "lab"


def update_topic(device: str) -> str:
    return device_topic(FLEET, device, "update").value


def test_round_trip_of_every_codec(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory()
    gateway = transport_factory(broker, client_id="gateway", max_payload=64 * 1024)
    device = transport_factory(broker, client_id="pi-7", max_payload=64 * 1024)
    inbox = Inbox()
    gateway.subscribe(device_filter(FLEET, "update"), inbox)

    rng = np.random.default_rng(0)
    weights = {"fc1.weight": (rng.standard_normal((256, 200)) * 0.05).astype(np.float32),
               "fc1.bias": np.zeros(256, np.float32)}
    signer = Signer.generate("pi-7")
    ring, guard = KeyRing({"pi-7": signer.public_key}), ReplayGuard()
    sent = {}
    for seq, codec in enumerate(c for c in available_codecs() if c != "auto"):  # auto sends one of the others
        data = encode_update(weights, codec, round_id=1, device_id="pi-7", seq=seq, signer=signer, rng=seq,
                             num_samples=32)
        sent[codec] = data
        device.publish(update_topic("pi-7"), data).wait(10)
    messages = inbox.wait(len(sent))
    assert [m.topic for m in messages] == [update_topic("pi-7")] * len(sent)
    assert any(m.chunks > 1 for m in messages) and any(m.chunks == 1 for m in messages)
    for msg in messages:
        up = decode_update(msg.payload, verifier=ring, replay_guard=guard,
                           expected_shapes={k: v.shape for k, v in weights.items()})
        assert msg.payload == sent[up.codec]
        assert up.num_samples == 32 and up.signed_by == signer.key_id.hex()
        err = np.linalg.norm(up.tensors["fc1.weight"] - weights["fc1.weight"]) / np.linalg.norm(weights["fc1.weight"])
        bound = {"dense": 1e-7, "fp16": 1e-3, "int8": 0.02, "topk": 1.0, "topk-int8": 1.0, "topk-packed": 1.0,
                 "randk-packed": 1.0}.get(up.codec)
        assert bound is not None, f"no error bound for codec {up.codec!r}: add one to this table"
        assert err < bound, (up.codec, err)


def test_50mb_update_is_chunked_through_a_size_limited_broker(mosquitto_factory, transport_factory) -> None:
    limit = 1024 * 1024
    broker = mosquitto_factory(message_size_limit=limit)
    receiver = transport_factory(broker, client_id="gw", max_reassembly_bytes=128 << 20)
    sender = transport_factory(broker, client_id="dev", max_payload=limit // 2, max_queued_bytes=128 << 20)
    inbox = Inbox()
    receiver.subscribe(device_filter(FLEET, "update"), inbox)

    # The limit is real: one 2 MB message is refused (the broker drops the connection) and never arrives.
    with pytest.raises(TransportError, match="probably refuses it"):
        sender.publish(update_topic("dev"), os.urandom(2 * limit), raw=True).wait(20)

    payload = os.urandom(50 * 1024 * 1024)
    started = time.monotonic()
    delivery = sender.publish(update_topic("dev"), payload)
    delivery.wait(60)
    (msg,) = inbox.wait(1, timeout=60)
    elapsed = time.monotonic() - started
    assert msg.payload == payload and msg.chunks == delivery.total >= 100
    assert inbox.topics() == [update_topic("dev")]  # the refused 2 MB message never arrived
    assert receiver.stats()["reassembly_bytes"] == 0, "buffers are freed after reassembly"
    assert elapsed < 30, f"50 MB took {elapsed:.1f} s"


def test_broker_restart_in_the_middle_of_a_chunked_transfer(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory(persistence=True, max_queued_messages=100_000)
    inbox = Inbox()
    receiver = transport_factory(broker, client_id="gw", connect=False)
    receiver.subscribe(device_filter(FLEET, "update"), inbox)  # before connect: nothing queued is missed
    receiver.connect()
    sender = transport_factory(broker, client_id="dev", max_payload=32 * 1024, max_inflight=4)

    payload = os.urandom(4 * 1024 * 1024)
    paused = threading.Event()

    def pause_at_a_third(d) -> None:  # runs on the sender's network thread, right after a PUBACK
        if d.acked >= d.total // 3 and not paused.is_set():
            broker.pause()  # freeze the broker at a known point, then restart it below
            paused.set()

    delivery = sender.publish(update_topic("dev"), payload, retain=False)
    delivery.add_progress_callback(pause_at_a_third)
    assert paused.wait(20)
    acked_at_stop = delivery.acked
    assert 0 < acked_at_stop < delivery.total
    broker.restart(down_s=0.3)  # SIGTERM (Mosquitto saves sessions and queues), then start on the same port

    delivery.wait(30)
    (msg,) = inbox.wait(1, timeout=30)
    assert msg.payload == payload
    s = sender.stats()
    assert s["reconnects"] >= 1 and receiver.stats()["reconnects"] >= 1
    # only frames that were in flight (at most the window of 4) were sent twice
    assert s["resent_frames"] <= 4
    assert s["published_frames"] == delivery.total + s["resent_frames"]
    assert s["acked_frames"] == delivery.total
    stays(lambda: len(inbox.messages), for_s=0.2,
          reason="delivered again although only chunks may have been redelivered")
    assert len(inbox.messages) == 1


def test_duplicated_and_reordered_chunks(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory()
    receiver = transport_factory(broker, client_id="gw")
    raw_sender = transport_factory(broker, client_id="dev")
    inbox = Inbox()
    receiver.subscribe(device_filter(FLEET, "update"), inbox)

    payload = os.urandom(300_000)
    frames = list(enumerate(Splitter(payload, 8 * 1024)))
    rnd = random.Random(5)
    order = frames + rnd.sample(frames, 10)
    rnd.shuffle(order)
    for index, frame in order:  # raw: bypass the transport's own chunker and send chunk frames by hand
        raw_sender.publish(chunk_topic(update_topic("dev"), index), frame, raw=True)
    assert raw_sender.flush(20)
    (msg,) = inbox.wait(1)
    assert msg.payload == payload and msg.chunks == len(frames)
    assert wait_until(lambda: receiver.stats().get("reassembly_duplicates", 0) >= 1, 5)
    # the duplicates that arrive after completion are dropped as well: still one message
    raw_sender.publish(chunk_topic(update_topic("dev"), 0), frames[0][1], raw=True).wait(5)
    raw_sender.publish(update_topic("dev"), b"sentinel").wait(5)
    inbox.wait_for(lambda m: m.payload == b"sentinel")
    assert [m.payload for m in inbox.messages] == [payload, b"sentinel"]


def test_wrong_password_is_refused(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory(users={"pi-7": "correct horse"})
    started = time.monotonic()
    with pytest.raises(TransportError, match="refused the connection as user 'pi-7'.*check username/password"):
        transport_factory(broker, username="pi-7", password="wrong", connect_timeout_s=10).connect()
    assert time.monotonic() - started < 5, "an auth refusal is final, not retried until the timeout"
    with pytest.raises(TransportError, match="anonymously"):
        transport_factory(broker).connect()
    ok = transport_factory(broker, username="pi-7", password="correct horse")
    assert ok.is_connected


def test_acl_denied_publish_does_not_reach_subscribers(mosquitto_factory, transport_factory) -> None:
    acl = """
user gateway
topic readwrite edgeflow/#

user pi-7
topic write edgeflow/lab/pi-7/#
topic read edgeflow/lab/gateway/#
"""
    broker = mosquitto_factory(users={"gateway": "g", "pi-7": "p"}, acl=acl)
    gateway = transport_factory(broker, client_id="gateway", username="gateway", password="g")
    device = transport_factory(broker, client_id="pi-7", username="pi-7", password="p")
    inbox = Inbox()
    gateway.subscribe("edgeflow/lab/#", inbox)

    with pytest.raises(TransportError, match="Not authorized.*check the broker ACL"):
        device.publish(update_topic("pi-8"), b"forged update for another device").wait(5)
    with pytest.raises(TransportError, match="Not authorized"):
        device.publish(update_topic("pi-8"), os.urandom(600_000)).wait(5)  # chunked: also refused
    device.publish(update_topic("pi-7"), b"own update").wait(5)
    inbox.wait_for(lambda m: m.payload == b"own update")
    assert inbox.topics() == [update_topic("pi-7")]
    assert device.stats()["publish_rejected"] >= 2

    # Mosquitto grants any SUBSCRIBE and applies the read ACL per message: a device does not see
    # other devices' updates, only what the ACL lets it read.
    spy = Inbox()
    device.subscribe(device_filter(FLEET, "update"), spy)
    device.subscribe(gateway_topic(FLEET, "state").value, spy)
    gateway.publish(update_topic("pi-9"), b"someone else's update").wait(5)
    gateway.publish(gateway_topic(FLEET, "state").value, b"sentinel").wait(5)
    spy.wait_for(lambda m: m.payload == b"sentinel")
    assert [m.payload for m in spy.messages] == [b"sentinel"]


def test_retained_chunked_model_reaches_late_subscribers(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory()
    gateway = transport_factory(broker, client_id="gateway", max_payload=64 * 1024)
    model_topic = gateway_topic(FLEET, "model").value
    model_v1 = os.urandom(1_000_000)
    d = gateway.publish(model_topic, model_v1, retain=True)
    d.wait(10)
    assert d.total > 10

    late = Inbox()
    transport_factory(broker, client_id="late-1").subscribe(model_topic, late)
    (msg,) = late.wait(1)
    assert msg.payload == model_v1 and msg.retain

    model_v2 = os.urandom(300_000)  # fewer chunks: the extra retained chunks of v1 must not linger
    gateway.publish(model_topic, model_v2, retain=True).wait(10)
    later = Inbox()
    transport_factory(broker, client_id="late-2").subscribe(model_topic, later)
    (msg,) = later.wait(1)
    assert msg.payload == model_v2

    gateway.publish(model_topic, b"small model", retain=True).wait(10)
    latest = Inbox()
    t = transport_factory(broker, client_id="late-3")
    t.subscribe(model_topic, latest)
    latest.wait_for(lambda m: m.payload == b"small model")
    gateway.publish(model_topic, b"sentinel").wait(5)
    latest.wait_for(lambda m: m.payload == b"sentinel")
    assert [m.payload for m in latest.messages] == [b"small model", b"sentinel"], "no stale chunked model"


def test_last_will_on_crash_but_not_on_clean_close(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory()
    inbox = Inbox()
    gateway = transport_factory(broker, client_id="gateway")
    gateway.subscribe(device_filter(FLEET, "death"), inbox)
    will = lambda d: Will(device_topic(FLEET, d, "death").value, b'{"online": false}', retain=False)  # noqa: E731
    crashing = transport_factory(broker, client_id="pi-1", will=will("pi-1"))
    polite = transport_factory(broker, client_id="pi-2", will=will("pi-2"))
    polite.close()
    crashing.close(abort=True)  # TCP dropped without DISCONNECT, like a power cut
    msg = inbox.wait(1)[0]
    assert msg.topic == device_topic(FLEET, "pi-1", "death").value and msg.json() == {"online": False}
    gateway.publish(device_topic(FLEET, "pi-3", "death").value, b"sentinel").wait(5)
    inbox.wait_for(lambda m: m.payload == b"sentinel")
    assert [m.topic.split("/")[2] for m in inbox.messages] == ["pi-1", "pi-3"]


def test_persistent_session_queues_messages_while_away(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory()
    topic = device_topic(FLEET, "pi-7", "cmd").value
    first = transport_factory(broker, client_id="pi-7", connect=False)
    first.subscribe(topic, Inbox())
    first.connect()
    first.close()  # session (subscription + queue) stays on the broker for session_expiry_s

    gateway = transport_factory(broker, client_id="gateway", max_payload=16 * 1024)
    for i in range(3):
        gateway.publish(topic, f"cmd {i}".encode()).wait(5)
    big = os.urandom(100_000)
    gateway.publish(topic, big).wait(5)

    inbox = Inbox()
    again = transport_factory(broker, client_id="pi-7", connect=False)
    again.subscribe(topic, inbox)  # handler first, then connect: queued messages need a handler
    again.connect()
    got = inbox.wait(4)
    assert [m.payload for m in got] == [b"cmd 0", b"cmd 1", b"cmd 2", big]


def test_offline_queue_is_bounded_and_drains_on_connect(mosquitto_factory, transport_factory) -> None:
    port = free_port()
    from edgeflow.transport.mqtt import MqttTransport

    device = MqttTransport("127.0.0.1", port, client_id="pi-7", max_queued_bytes=100_000,
                           reconnect_min_s=0.05, reconnect_max_s=0.2)
    try:
        device.connect(wait=False)
        deliveries = [device.publish(update_topic("pi-7"), os.urandom(30_000)) for _ in range(3)]
        with pytest.raises(TransportError, match="queue full.*unreachable.*max_queued_bytes"):
            device.publish(update_topic("pi-7"), os.urandom(30_000))
        assert device.queued_bytes == 90_000 and not device.is_connected
        assert wait_until(lambda: "connection refused" in str(device.last_error), 5)

        broker = mosquitto_factory(port=port)
        inbox = Inbox()
        transport_factory(broker, client_id="gateway").subscribe(device_filter(FLEET, "update"), inbox)
        for d in deliveries:
            d.wait(10)
        assert device.queued_bytes == 0
    finally:
        device.close()


def test_slow_handler_does_not_block_keepalive(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory()
    slow = Inbox(delay_s=2.5)  # well over 1.5 x keepalive: a blocked network thread would be cut off
    sub = transport_factory(broker, client_id="gw", keepalive=1)
    sub.subscribe("edgeflow/lab/+/telemetry", slow)
    pub = transport_factory(broker, client_id="pi")
    pub.publish(device_topic(FLEET, "pi", "telemetry").value, b"t1").wait(5)
    slow.wait(1, timeout=10)
    assert sub.stats().get("reconnects", 0) == 0 and sub.is_connected


def test_handler_errors_do_not_stop_delivery(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory()
    t = transport_factory(broker)
    inbox = Inbox()

    def broken(msg) -> None:
        raise RuntimeError("bug in handler")

    t.subscribe("edgeflow/lab/+/telemetry", broken)
    t.subscribe("edgeflow/lab/+/telemetry", inbox)
    for i in range(2):
        t.publish(device_topic(FLEET, "pi", "telemetry").value, str(i)).wait(5)
    inbox.wait(2)
    assert t.stats()["handler_errors"] == 2


def test_interleaved_chunked_updates_from_many_devices(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory()
    inbox = Inbox()
    transport_factory(broker, client_id="gw").subscribe(device_filter(FLEET, "update"), inbox)
    payloads = {f"pi-{i}": os.urandom(1_000_000 + i) for i in range(3)}
    devices = {d: transport_factory(broker, client_id=d, max_payload=32 * 1024) for d in payloads}
    deliveries = [devices[d].publish(update_topic(d), p) for d, p in payloads.items()]
    for d in deliveries:
        d.wait(20)
    got = {m.topic.split("/")[2]: m.payload for m in inbox.wait(3)}
    assert got == payloads


def test_mqtt5_properties_for_request_response(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory()
    device = transport_factory(broker, client_id="pi")
    gateway = transport_factory(broker, client_id="gw")
    cmd_topic = device_topic(FLEET, "pi", "cmd").value
    ack_topic = device_topic(FLEET, "pi", "cmd/ack").value

    def on_cmd(msg) -> None:
        device.publish(msg.properties["response_topic"], b"done",
                       properties={"correlation_data": msg.properties["correlation_data"]})

    device.subscribe(cmd_topic, on_cmd)
    acks = Inbox()
    gateway.subscribe(ack_topic, acks)
    gateway.publish(cmd_topic, b'{"op": "reboot"}', properties={
        "response_topic": ack_topic, "correlation_data": b"req-42", "user_properties": {"k": "v"}}).wait(5)
    (ack,) = acks.wait(1)
    assert ack.payload == b"done" and ack.properties["correlation_data"] == b"req-42"
    with pytest.raises(ConfigError, match="unknown MQTT property 'bogus'"):
        gateway.publish(cmd_topic, b"x", properties={"bogus": 1})


def test_tls_with_client_certificates(mosquitto_factory, transport_factory, tls_material) -> None:
    from edgeflow.transport.broker import TlsFiles

    m = tls_material
    broker = mosquitto_factory(plain=False, tls=TlsFiles(str(m.server_cert), str(m.server_key), str(m.ca_cert),
                                                        require_certificate=True))
    ok = transport_factory(broker, port=broker.tls_port, client_id="tls-ok",
                           tls=TlsConfig(ca_file=str(m.ca_cert), cert_file=str(m.client_cert),
                                         key_file=str(m.client_key)))
    inbox = Inbox()
    ok.subscribe("edgeflow/lab/#", inbox)
    ok.publish(update_topic("pi"), hashlib.sha256(b"x").digest()).wait(5)
    inbox.wait(1)
    assert ok.url.startswith("mqtts://")

    from _brokers import make_tls_material

    other = make_tls_material(m.dir / "other")
    with pytest.raises(TransportError, match="certificate .* failed verification.*ca_file"):
        transport_factory(broker, port=broker.tls_port, tls=TlsConfig(ca_file=str(other.ca_cert))).connect()
    started = time.monotonic()
    with pytest.raises(TransportError, match="requires a client certificate.*cert_file"):
        transport_factory(broker, port=broker.tls_port, tls=TlsConfig(ca_file=str(m.ca_cert))).connect()
    assert time.monotonic() - started < 2, "a TLS refusal is final, not retried until the timeout"


def test_websockets_listener(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory(websockets=True)
    t = transport_factory(broker, port=broker.ws_port, websockets=True, max_payload=16 * 1024)
    inbox = Inbox()
    t.subscribe("edgeflow/lab/#", inbox)
    payload = os.urandom(100_000)
    t.publish(update_topic("pi"), payload).wait(5)
    assert inbox.wait(1)[0].payload == payload
    assert t.url.startswith("ws://")


def test_chunks_fit_the_maximum_packet_size_the_broker_announces(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory(max_packet_size=64 * 1024)
    t = transport_factory(broker)  # default max_payload (256 KiB) is above the broker's limit
    inbox = Inbox()
    t.subscribe("edgeflow/lab/#", inbox)
    payload = os.urandom(300_000)
    d = t.publish(update_topic("pi"), payload)
    d.wait(10)
    assert d.total >= 5 and inbox.wait(1)[0].payload == payload
    with pytest.raises(TransportError, match="exceeds the broker's maximum packet size"):
        t.publish(update_topic("pi"), payload, raw=True).wait(5)
    assert t.is_connected and t.stats().get("reconnects", 0) == 0


def test_connection_listener_sees_reconnects(mosquitto_factory, transport_factory) -> None:
    broker = mosquitto_factory(persistence=True)
    events = []
    births = Inbox()
    watcher = transport_factory(broker, client_id="watcher")
    watcher.subscribe(device_topic(FLEET, "pi", "birth").value, births)
    device = transport_factory(broker, client_id="pi", connect=False)

    def on_change(ev) -> None:
        events.append(ev)
        if ev.connected:
            device.publish(device_topic(FLEET, "pi", "birth").value, b'{"online": true}', retain=True)

    device.add_connection_listener(on_change)
    device.connect()
    births.wait(1)
    broker.restart()
    assert wait_until(lambda: sum(e.connected for e in events) == 2, 10)
    assert [e.connected for e in events] == [True, False, True]
    assert events[0].session_present is False and events[2].session_present is True
    births.wait(2)
