"""A second broker implementation: RabbitMQ 3.10's MQTT plugin (MQTT 3.1.1 only).

A federated run and an OTA rollout go through it on the transport's 3.1.1 path,
and each difference docs/brokers.md names is measured here, against the real
broker: retained messages reach exact filters only, ``$share`` filters are taken
literally, an MQTT 5 CONNECT gets no CONNACK. Every
test skips with the reason if RabbitMQ is not running.
"""

from __future__ import annotations

import time

import pytest

from _brokers import FAST, Inbox, wait_until
from _fleet import PROFILE, artifact, mlp_bytes  # noqa: F401
from _rabbitmq import RabbitMQ, rabbitmq_mqtt  # noqa: F401
from edgeflow.broker.mosquitto import FleetDir
from edgeflow.device.agent import AgentOptions, DeviceAgent
from edgeflow.errors import ConfigError
from edgeflow.gateway.fleet import FleetManager, FleetOptions
from edgeflow.gateway.ota import Rollout, RolloutPolicy, build_artifacts, select_devices
from edgeflow.gateway.store import GatewayStore
from edgeflow.sim.simulation import SimConfig, SimulatedFleet
from edgeflow.transport import MqttTransport

pytestmark = pytest.mark.integration


def _t(rmq: RabbitMQ, cid: str, **kw) -> MqttTransport:
    t = MqttTransport.from_url(rmq.url, client_id=cid, **{**FAST, **kw})
    t.connect(timeout=15)
    return t


def test_federated_rounds_through_rabbitmq_on_mqtt_311(rabbitmq_mqtt, tmp_path):  # noqa: F811
    cfg = SimConfig(devices=6, rounds=4, alpha=1.0, seed=3, epochs=2, lr=0.1, deadline_s=30, codec="int8",
                    fleet=rabbitmq_mqtt.fleet("fl"))
    with SimulatedFleet(cfg, rabbitmq_mqtt.url, state_path=str(tmp_path / "gw.sqlite")) as fleet:
        history = fleet.run()
        assert fleet.gateway_transport.protocol_version == "3.1.1"  # auto fell back: no MQTT 5 here
        assert all(d.transport.protocol_version == "3.1.1" for d in fleet.devices)
        rounds = fleet.store.rounds()
    assert [m.participants for m in history] == [6, 6, 6, 6], history
    assert all(m.duplicates == 0 and m.rejected == 0 for m in history)
    assert history[-1].accuracy > history[0].accuracy and history[-1].accuracy >= 0.8, [m.accuracy for m in history]
    assert [r.state for r in rounds] == ["closed"] * 4


def test_ota_rollout_through_rabbitmq_chunked(rabbitmq_mqtt, tmp_path):  # noqa: F811
    """Signed OTA to three agents over RabbitMQ, the artifact chunked (4 KB frames)."""
    fleet = rabbitmq_mqtt.fleet("ota")
    fd = FleetDir(tmp_path / "fleet").init(fleet, operators=["gateway"])
    ids = [f"dev-{i}" for i in range(3)]
    for d in ids:
        fd.provision(d, profile=PROFILE)
    gt = MqttTransport.from_url(rabbitmq_mqtt.url, client_id=f"{fleet}-gateway", max_payload=4096, **FAST)
    fm = FleetManager(gt, GatewayStore(tmp_path / "gw.sqlite"), fleet, fd.fleet_key(),
                      FleetOptions(command_timeout_s=60.0), keyring=fd.keyring())
    agents = []
    try:
        fm.start()
        gt.connect(timeout=15)
        for d in ids:
            a = DeviceAgent.from_credentials(fd.device_dir(d), broker=rabbitmq_mqtt.url, profile=PROFILE,
                                             state_dir=tmp_path / "state" / d,
                                             options=AgentOptions(telemetry_interval_s=0.5, health_runs=2),
                                             username=rabbitmq_mqtt.user, password=rabbitmq_mqtt.password,
                                             max_payload=4096, **FAST)
            agents.append(a)
            a.start()
        assert fm.wait_online(ids, 30), fm.stats()
        assert gt.protocol_version == "3.1.1"
        key = fd.fleet_key()
        targets = select_devices(fm.devices(), f"profile={PROFILE}", online=fm.is_online)
        arts = build_artifacts(mlp_bytes(1), [PROFILE], key, version=1, fleet=fleet)
        assert len(arts[PROFILE]) > 4 * 4096  # really chunked
        rep = Rollout(fm, arts, targets, RolloutPolicy(canary=1, report_timeout_s=60)).run()
        assert rep.state == "completed" and rep.counts() == {"ok": 3}, rep.to_dict()
        assert all(a.model_version == 1 for a in agents)
        assert wait_until(lambda: all(fm.device(d).model_version == 1 for d in ids), 10)
        assert gt.stats().get("chunks_bad", 0) == 0
        assert wait_until(lambda: all(fm.latest_telemetry(d) for d in ids), 10)  # telemetry flows too
    finally:
        for a in agents:
            a.crash()
        fm.stop(timeout=2)
        gt.close(timeout=2, flush=False)


# -- the differences docs/brokers.md names, measured ---------------------------------------


def test_retained_messages_reach_exact_filters_only(rabbitmq_mqtt):  # noqa: F811
    base = f"edgeflow/{rabbitmq_mqtt.fleet('ret')}/gateway"
    pub = _t(rabbitmq_mqtt, "ret-pub", protocol="3.1.1")
    subs = []
    try:
        pub.publish(f"{base}/round", b"R", qos=1, retain=True).wait(10)
        exact, plus = Inbox(), Inbox()
        for f, box in ((f"{base}/round", exact), (f"{base}/+", plus)):
            t = MqttTransport.from_url(rabbitmq_mqtt.url, client_id=f"ret-{len(subs)}", protocol="3.1.1", **FAST)
            t.subscribe(f, box)
            t.connect(timeout=15)
            subs.append(t)
        assert exact.wait_for(lambda m: m.retain).payload == b"R"
        time.sleep(1.0)  # nothing arrives for the wildcard filter: absence is waited for, not polled
        assert plus.messages == []
    finally:
        pub.publish(f"{base}/round", b"", qos=1, retain=True).wait(10)
        for t in [pub, *subs]:
            t.close(timeout=1, flush=False)


def test_a_chunked_retained_model_needs_max_payload_above_it_on_rabbitmq(rabbitmq_mqtt):  # noqa: F811
    """The chunks of a retained transfer sit on base/_chunk/N and a subscriber gets them through
    the wildcard base/_chunk/+ : RabbitMQ never delivers retained messages there. A late
    subscriber therefore misses a chunked retained model, and gets it once it is one message."""
    base = f"edgeflow/{rabbitmq_mqtt.fleet('chk')}/gateway/model"
    blob = bytes(range(256)) * 80  # 20 KB
    made = []
    try:
        for max_payload, expect in ((4096, False), (64 * 1024, True)):
            pub = _t(rabbitmq_mqtt, f"chk-pub-{max_payload}", protocol="3.1.1", max_payload=max_payload)
            made.append(pub)
            pub.publish(base, blob, qos=1, retain=True).wait(10)
            box = Inbox()
            late = MqttTransport.from_url(rabbitmq_mqtt.url, client_id=f"chk-late-{max_payload}", protocol="3.1.1",
                                          **FAST)
            made.append(late)
            late.subscribe(base, box)
            late.connect(timeout=15)
            if expect:
                assert box.wait_for(lambda m: m.payload == blob).retain
            else:
                time.sleep(1.5)
                assert [m for m in box.messages if m.payload == blob] == []
    finally:
        clean = _t(rabbitmq_mqtt, "chk-clean", protocol="3.1.1")
        made.append(clean)
        clean.publish(base, b"", qos=1, retain=True, raw=True).wait(10)
        for i in range(6):
            clean.publish(f"{base}/_chunk/{i}", b"", qos=1, retain=True, raw=True).wait(10)
        for t in made:
            t.close(timeout=1, flush=False)


def test_share_filters_are_literal(rabbitmq_mqtt):  # noqa: F811
    fleet = rabbitmq_mqtt.fleet("sh")
    a, b, plain = Inbox(), Inbox(), Inbox()
    made = []
    try:
        for box, f in ((a, f"$share/g/edgeflow/{fleet}/+/update"), (b, f"$share/g/edgeflow/{fleet}/+/update"),
                       (plain, f"edgeflow/{fleet}/+/update")):
            t = _t(rabbitmq_mqtt, f"sh-{len(made)}", protocol="3.1.1")
            made.append(t)
            t.subscribe(f, box)  # connected: waits for the SUBACK, which grants it: the broker does not tell
        pub = _t(rabbitmq_mqtt, "sh-pub", protocol="3.1.1")
        made.append(pub)
        for i in range(5):
            pub.publish(f"edgeflow/{fleet}/d{i}/update", b"u", qos=1).wait(10)
        assert len(plain.wait(5)) == 5
        time.sleep(0.5)
        assert a.messages == [] and b.messages == []  # no member got any: the filter is a literal topic
    finally:
        for t in made:
            t.close(timeout=1, flush=False)


def test_an_mqtt5_connect_gets_no_connack_and_auto_falls_back(rabbitmq_mqtt):  # noqa: F811
    with pytest.raises(Exception):
        t5 = MqttTransport.from_url(rabbitmq_mqtt.url, client_id="v5-only", protocol="5", **FAST)
        try:
            t5.connect(timeout=5)
        finally:
            t5.close(timeout=1, flush=False)
    t = _t(rabbitmq_mqtt, "v5-auto")
    try:
        assert t.protocol_version == "3.1.1" and t.stats().get("protocol_fallbacks") == 1
    finally:
        t.close(timeout=1, flush=False)


def test_ingestion_workers_refuse_a_broker_without_mqtt5(rabbitmq_mqtt, tmp_path):  # noqa: F811
    """No shared subscriptions on RabbitMQ 3.10: a worker says so in one line instead of
    subscribing to a literal '$share/...' topic that never receives anything."""
    from edgeflow.gateway.ingest import IngestWorker, WorkerConfig
    from edgeflow.signing import KeyRing

    KeyRing().save(tmp_path / "ring.json")
    GatewayStore(tmp_path / "gw.sqlite").close()
    cfg = WorkerConfig(name="w0", broker=rabbitmq_mqtt.url, state=str(tmp_path / "gw.sqlite"),
                       fleet=rabbitmq_mqtt.fleet("ing"), keyring=str(tmp_path / "ring.json"))
    w = IngestWorker(cfg)
    with pytest.raises(ConfigError, match="shared subscriptions need MQTT 5") as e:
        w.run()
    assert "\n" not in str(e.value) and "docs/brokers.md" in str(e.value)


def test_a_16_mib_message_arrives_whole_and_a_persistent_session_keeps_its_queue(rabbitmq_mqtt):  # noqa: F811
    topic = f"edgeflow/{rabbitmq_mqtt.fleet('big')}/x"
    made = []
    try:
        sub = _t(rabbitmq_mqtt, "big-sub", protocol="3.1.1", clean_start=False)
        made.append(sub)
        box = Inbox()
        sub.subscribe(topic, box)
        pub = _t(rabbitmq_mqtt, "big-pub", protocol="3.1.1", max_payload=32 << 20)
        made.append(pub)
        blob = bytes(range(256)) * (1 << 16)  # 16 MiB, one MQTT message
        pub.publish(topic, blob, qos=1).wait(60)
        assert box.wait_for(lambda m: len(m.payload) == len(blob), 60).payload == blob
        # away with a persistent session: the broker queues for it, and delivers on return
        sub.close(timeout=2)
        made.remove(sub)
        for i in range(3):
            pub.publish(topic, f"q{i}".encode(), qos=1).wait(10)
        back = Inbox()
        sub2 = MqttTransport.from_url(rabbitmq_mqtt.url, client_id="big-sub", protocol="3.1.1", clean_start=False,
                                      **FAST)
        made.append(sub2)
        sub2.subscribe(topic, back)
        sub2.connect(timeout=15)
        assert sorted(m.payload for m in back.wait(3, 15))[:3] == [b"q0", b"q1", b"q2"]
    finally:
        for t in made:
            t.close(timeout=1, flush=False)
        c = _t(rabbitmq_mqtt, "big-sub", protocol="3.1.1", clean_start=True)  # drop the durable session
        c.close(timeout=1)
