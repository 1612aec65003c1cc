"""Issue 20's device and fleet findings, each reproduced as an attack against a real Mosquitto (the
generated TLS + ACL config, or a wide-open anonymous one) and shown to hold:

- 5: bdseq rises on every connection, so a device comes back after a broker-side timeout;
- 7: replayed OTA offers and rollbacks (also after an agent restart) and downgrades are refused;
- 8: births from unknown ids are ignored and deaths are signed, on an open broker too;
- 9: one device cannot exhaust the gateway: packet limit, telemetry bounds, per-device reassembly
  budgets without cross-device eviction, retained chunks refused;
- 10: inference replies and acks over 256 KiB pass the ACL (chunked);
- 11: a failed health check keeps the rollback target;
- 12: 60k-deep JSON and ``1e400`` are refused cleanly (an answer, no traceback).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
import zlib
from typing import Any

import numpy as np
import pytest
from _brokers import mosquitto_factory  # noqa: F401
from _fleet import FAST, FLEET, PROFILE, artifact, fleet_env, mlp_bytes, wait_until  # noqa: F401

from edgeflow.device.agent import AgentOptions, DeviceAgent
from edgeflow.protocol.fleet import Ack, Birth, Command, Death, encode_tensor, sign_inference_request
from edgeflow.protocol.ota import OtaOffer, deploy_command
from edgeflow.protocol.signed_json import sign_body
from edgeflow.device.replay import SeenCommands
from edgeflow.errors import CodecError, TransportError
from edgeflow.gateway.fleet import FleetManager, FleetOptions
from edgeflow.gateway.ota import RolloutPolicy
from edgeflow.gateway.store import GatewayStore
from edgeflow.artifact import build_artifact, make_golden
from edgeflow.signing import KeyRing, PrivateKey, Signer
from edgeflow.transport.chunking import Splitter
from edgeflow.transport.mqtt import MqttTransport
from edgeflow.transport.topics import chunk_topic, device_topic

pytestmark = pytest.mark.integration


def _ack_of(payload: bytes) -> Ack:
    return Ack.from_body(json.loads(json.loads(payload)["body"]))


def _listen(env, topic: str) -> tuple[list[Any], MqttTransport]:
    got: list[Any] = []
    t = env.transport("tester", connect=False)
    t.subscribe(topic, got.append)
    t.connect()
    return got, t


@pytest.fixture
def fm(fleet_env):
    return fleet_env.gateway()


@pytest.fixture
def no_tracebacks(caplog):
    """Fail if anything logged an exception (a traceback) while the test ran."""
    caplog.set_level(logging.WARNING)
    yield caplog
    crashes = [r for r in caplog.records if r.exc_info and r.name.startswith("edgeflow")]
    assert not crashes, [f"{r.name}: {r.getMessage()}" for r in crashes]


# ------------------------------------------------------------------ 5: bdseq on every re-birth


class FreezableProxy:
    """TCP proxy to the broker whose connections can be frozen: bytes stop flowing both ways but the sockets stay
    open, like a stalled network, and new connections are refused until :meth:`release`. The broker's keepalive
    then expires (it publishes the will) before the client can reconnect."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._conns: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self._stop = threading.Event()
        self.refusing = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self.refusing.is_set():
                c.close()
                continue
            u = socket.create_connection(("127.0.0.1", self.upstream))
            frozen = threading.Event()
            self._conns.append((c, u, frozen))
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b, frozen), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, frozen: threading.Event) -> None:
        src.settimeout(0.1)
        while not self._stop.is_set():
            if frozen.is_set():
                time.sleep(0.05)
                continue
            try:
                data = src.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                data = b""
            if not data or frozen.is_set():
                if not data:
                    for s in (src, dst):
                        try:
                            s.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                    return
                continue
            try:
                dst.sendall(data)
            except OSError:
                return

    def freeze(self) -> None:
        self.refusing.set()
        for _, _, frozen in self._conns:
            frozen.set()

    def release(self) -> None:
        self.refusing.clear()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for c, u, _ in self._conns:
            for s in (c, u):
                try:
                    s.close()
                except OSError:
                    pass


def test_a_device_comes_back_after_a_broker_side_timeout(fleet_env, fm) -> None:
    """Finding 5: the broker timed the device out (will published), the agent reconnected with the same bdseq
    and the gateway kept it offline (a birth must outrank its death). Now every connection has a new bdseq."""
    proxy = FreezableProxy(fleet_env.broker.port)
    dev = fleet_env.new_id()
    events: list[Any] = []
    fm.add_listener(lambda e: e.device_id == dev and events.append(e))
    a = DeviceAgent.from_credentials(fleet_env.fleet_dir.device_dir(dev), broker=f"mqtts://127.0.0.1:{proxy.port}",
                                     profile=PROFILE, state_dir=fleet_env.root / "state" / dev,
                                     options=AgentOptions(telemetry_interval_s=0.5, health_runs=1),
                                     keepalive=2, **FAST)
    fleet_env.made.append(a)
    try:
        a.start()
        assert fm.wait_online([dev], 10)
        first = a.bdseq
        proxy.freeze()  # the network stalls: the broker's keepalive (3 s) expires and it publishes the will
        assert wait_until(lambda: any(e.kind == "death" and e.data["bdseq"] == first for e in events), 30), events
        assert not fm.is_online(dev)
        proxy.release()  # the network is back: the agent reconnects (its own keepalive gave up meanwhile)
        back = lambda: fm.is_online(dev) and (fm.birth(dev) or Birth("", "", "", 0, "")).bdseq == a.bdseq > first  # noqa: E731
        assert wait_until(back, 20), ("the device did not come back", events, fleet_env.broker.log()[-2000:])
        time.sleep(1.0)
        assert fm.is_online(dev) and fm.device(dev).online, "a late copy of the old will must not undo it"
        assert json.loads((fleet_env.root / "state" / dev / "agent.json").read_text())["bdseq"] >= a.bdseq
    finally:
        a.crash()
        proxy.close()


def test_bdseq_is_persisted_before_every_connection_attempt(tmp_path) -> None:
    """Unit path: each read of the will (one per connection attempt) takes a new, persisted bdseq."""
    from edgeflow.device.agent import _SessionWill

    class T:  # the attributes DeviceAgent touches before connect
        will = None
        is_connected = False

    signer = Signer.generate("dev-x")
    a = DeviceAgent(T(), device_id="dev-x", fleet=FLEET, profile=PROFILE, signer=signer,
                    fleet_key=PrivateKey.generate().public_key, state_dir=tmp_path)
    w = _SessionWill(a)
    seqs = []
    for _ in range(3):
        death = Death.verify(w.payload, signer.public_key)
        seqs.append(death.bdseq)
        assert death.bdseq == a.bdseq and death.reason == "lost"
        assert json.loads((tmp_path / "agent.json").read_text())["bdseq"] == a.bdseq
    assert seqs == sorted(set(seqs))
    b = DeviceAgent(T(), device_id="dev-x", fleet=FLEET, profile=PROFILE, signer=signer,
                    fleet_key=PrivateKey.generate().public_key, state_dir=tmp_path)
    assert Death.verify(_SessionWill(b).payload, signer.public_key).bdseq > seqs[-1], "across restarts too"


# ------------------------------------------------------------------ 7: replays and downgrades


def test_replayed_offer_and_rollback_cannot_downgrade_after_an_agent_restart(fleet_env, fm, no_tracebacks) -> None:
    """Finding 7: after an agent restart a captured OTA offer and the rollout's long-lived rollback took a
    device from v4 back to v3. Seen ids now persist, stale rollbacks and downgrades are refused."""
    dev = fleet_env.new_id()
    state = fleet_env.root / "state" / dev
    a = fleet_env.agent(dev, state=state)
    assert fm.wait_online([dev], 10)
    offers: list[Any] = []
    cmds: list[Any] = []
    spy = fleet_env.transport("tester", connect=False)  # what an eavesdropper on an open broker captures
    spy.subscribe(device_topic(FLEET, dev, "ota").value, offers.append)
    spy.subscribe(device_topic(FLEET, dev, "cmd").value, cmds.append)
    spy.connect()
    for v in (3, 4):
        assert fm.send_ota(dev, artifact(fleet_env, v), version=v).wait(30).ok
    # the conditional rollback a rollout sends when v4's report is late; then v4 again
    r = fm.send_command(dev, "rollback", {"from_version": 4}, ttl_s=RolloutPolicy().rollback_ttl_s).wait(30)
    assert r.ok and a.model_version == 3
    assert fm.send_ota(dev, artifact(fleet_env, 4, seed=44), version=4).wait(30).ok and a.model_version == 4
    assert wait_until(lambda: len(offers) == 3 and len(cmds) == 1, 10)
    captured_v3, captured_rollback = offers[0].payload, cmds[0].payload

    a.stop()  # the agent restarts: nothing it remembered in memory survives
    b = fleet_env.agent(dev, state=state)
    assert fm.wait_online([dev], 10) and b.model_version == 4
    acks, tester = _listen(fleet_env, device_topic(FLEET, dev, "cmd/ack").value)
    tester.publish(device_topic(FLEET, dev, "ota").value, captured_v3).wait(10)
    tester.publish(device_topic(FLEET, dev, "cmd").value, captured_rollback).wait(10)
    assert wait_until(lambda: len(acks) >= 2, 15)
    got = [_ack_of(m.payload) for m in acks]
    assert b.model_version == 4, "a replay rolled the device back"
    # the same ack as the first time (ids and acks persisted), nothing ran again
    first_v3 = Command.verify(OtaOffer.from_bytes(captured_v3).command, fleet_env.fleet_dir.fleet_key().public_key)
    assert {g.id for g in got} == {first_v3.id, Command.verify(captured_rollback,
                                                                fleet_env.fleet_dir.fleet_key().public_key).id}
    assert b.counters["deploys"] == 0 and b.counters["rollbacks"] == 0
    assert (state / "seen.json").exists()

    # A fresh, validly signed offer of an older version (an operator's mistake, or a re-signed capture):
    # refused unless the deploy says so.
    old = fm.send_ota(dev, artifact(fleet_env, 3), version=3).wait(30)
    assert not old.ok and old.code == "downgrade" and b.model_version == 4
    ok = fm.send_ota(dev, artifact(fleet_env, 3), version=3, allow_downgrade=True).wait(30)
    assert ok.ok and b.model_version == 3
    # A rollback issued before the running model was installed is stale (captured earlier, delivered now).
    late = Command.make("rollback", dev, FLEET, {}, ttl_s=3600)
    late = Command(late.name, late.device, late.fleet, late.args, late.id, late.issued - 600, late.expires)
    tester.publish(device_topic(FLEET, dev, "cmd").value, late.sign(fleet_env.fleet_dir.fleet_key())).wait(10)
    assert wait_until(lambda: any(_ack_of(m.payload).id == late.id for m in acks), 10)
    stale = next(_ack_of(m.payload) for m in acks if _ack_of(m.payload).id == late.id)
    assert stale.code == "stale" and b.model_version == 3
    assert RolloutPolicy().rollback_ttl_s <= 3600, "rollouts send short-lived rollbacks"


def test_seen_commands_persist_atomically_expire_and_stay_bounded(tmp_path) -> None:
    now = [1000.0]
    path = tmp_path / "seen.json"
    s = SeenCommands(path, clock_skew_s=10, max_entries=4, max_acks=2, clock=lambda: now[0])
    assert s.remember("a", 990, 1100) and not s.remember("a", 990, 1100)
    s.set_ack("a", b"signed ack")
    again = SeenCommands(path, clock_skew_s=10, clock=lambda: now[0])
    assert "a" in again and again.ack("a") == b"signed ack", "survives a restart"
    for i, cid in enumerate("bcdef"):
        assert s.remember(cid, 991 + i, 1100)
    assert len(s) <= 4 and "a" not in s and s.floor >= 990
    assert s.below_floor(990) and not s.below_floor(1200), "forgotten ids cannot be replayed: older ones refused"
    now[0] = 1200.0  # past expires + skew: ids leave the file
    s.remember("g", 1195, 1300)
    assert len(s) == 1 and "g" in s
    assert not list(tmp_path.glob("*.tmp"))
    path.write_text("{ not json")
    broken = SeenCommands(path, clock=lambda: 5000.0)
    assert broken.below_floor(4999), "an unreadable file refuses everything issued before it was found broken"


# ------------------------------------------------------------------ 8: open broker


def _open_fleet(broker, tmp_path, n: int = 2):
    fleet_key = PrivateKey.generate()
    signers = {f"real-{i}": Signer.generate(f"real-{i}") for i in range(n)}
    ring = KeyRing({d: s.public_key for d, s in signers.items()})
    gw = MqttTransport(broker.host, broker.port, client_id="gw", **FAST)
    fm = FleetManager(gw, GatewayStore(tmp_path / "gw.sqlite"), FLEET, fleet_key,
                      FleetOptions(command_timeout_s=20), keyring=ring)
    fm.start()
    gw.connect()
    agents = []
    for d, s in signers.items():
        t = MqttTransport(broker.host, broker.port, client_id=d, **FAST)
        agents.append(DeviceAgent(t, device_id=d, fleet=FLEET, profile=PROFILE, signer=s,
                                  fleet_key=fleet_key.public_key, state_dir=tmp_path / d,
                                  options=AgentOptions(telemetry_interval_s=0.3, health_runs=1)).start())
    return fm, gw, agents, fleet_key


def test_on_an_open_broker_fake_births_and_forged_deaths_change_nothing(mosquitto_factory, tmp_path,
                                                                        no_tracebacks) -> None:
    """Finding 8: 50 fake births made a round select 53 and a fake canary halted `fleet deploy`; a forged
    death kept a live device out of rounds. Unknown ids are ignored; deaths must verify and be current."""
    broker = mosquitto_factory()  # anonymous, no ACL: anyone publishes anywhere
    fm, gw, agents, fleet_key = _open_fleet(broker, tmp_path)
    ids = [a.device_id for a in agents]
    attacker = MqttTransport(broker.host, broker.port, client_id="attacker", **FAST).connect()
    try:
        assert fm.wait_online(ids, 10)
        evil = PrivateKey.generate()
        for i in range(50):  # signed by their own keys, claiming to be new devices (and one canary)
            fake = f"fake-{i:02d}"
            b = Birth(fake, FLEET, PROFILE, int(time.time() * 1000), evil.public_key.hex, can_train=True, seq=1)
            attacker.publish(device_topic(FLEET, fake, "birth").value, b.sign(evil), retain=True)
            attacker.publish(device_topic(FLEET, fake, "telemetry").value, json.dumps({"battery": 1.0}))
        # a birth for a real id signed by the attacker, and one with an unsigned body
        victim = agents[0]
        forged = Birth(victim.device_id, FLEET, PROFILE, victim.bdseq + 1, evil.public_key.hex, model_version=9, seq=9)
        attacker.publish(device_topic(FLEET, victim.device_id, "birth").value, forged.sign(evil))
        # deaths: unsigned (what every device sent before), wrongly signed, and a replay of an old real one
        live = victim.bdseq
        attacker.publish(device_topic(FLEET, victim.device_id, "death").value,
                         json.dumps({"device": victim.device_id, "bdseq": live + 10, "reason": "lost"}))
        attacker.publish(device_topic(FLEET, victim.device_id, "death").value,
                         Death(victim.device_id, live + 10).sign(evil))
        captured = Death(victim.device_id, live - 5, "shutdown", time.time()).sign(victim.signer.key)
        attacker.publish(device_topic(FLEET, victim.device_id, "death").value, captured).wait(10)
        assert wait_until(lambda: fm.stats().get("births_unknown", 0) >= 50 and fm.stats().get("deaths_bad", 0) >= 2
                          and fm.stats().get("deaths_stale", 0) >= 1 and fm.stats().get("births_bad", 0) >= 1, 15), \
            fm.stats()
        time.sleep(0.5)
        assert sorted(r.device_id for r in fm.devices()) == sorted(ids), "only provisioned devices are registered"
        assert sorted(c.device_id for c in fm.round_candidates()) == sorted(ids)
        assert fm.is_online(victim.device_id) and fm.device(victim.device_id).model_version is None
        assert fm.stats().get("telemetry_unknown", 0) >= 1 and not fm.store.telemetry("fake-00")
        # a replayed *older* birth of the victim cannot roll the registry back either
        old_birth = victim.birth(1).sign(victim.signer.key)  # seq 1 of this session; the device is at a later one
        victim.publish_birth()
        assert wait_until(lambda: (fm.birth(victim.device_id) or Birth("", "", "", 0, "")).seq >= 2, 10)
        attacker.publish(device_topic(FLEET, victim.device_id, "birth").value, old_birth).wait(10)
        assert wait_until(lambda: fm.stats().get("births_stale", 0) >= 1, 10)
        # the real shutdown still works
        victim.stop()
        assert fm.wait_online([victim.device_id], 10, online=False)
    finally:
        attacker.close(timeout=1)
        for a in agents:
            a.crash()
        fm.stop()
        gw.close(timeout=1)


# ------------------------------------------------------------------ 9: memory and disk


def test_one_device_cannot_flood_the_gateway_with_telemetry(fleet_env, no_tracebacks) -> None:
    """Finding 9: a 100 MB telemetry message pinned 1.16 GB of gateway RAM and added 247 MB to SQLite."""
    store = GatewayStore(fleet_env.root / "flood.sqlite", telemetry_keep=50)
    fm = fleet_env.gateway(store=store, telemetry_rate_hz=5.0)
    dev = fleet_env.new_id()
    t = fleet_env.transport(dev, fleet_env.device_password(dev), max_payload=4 * 1024 * 1024)
    topic = device_topic(FLEET, dev, "telemetry").value
    # The broker's packet limit (max_packet_size, 1 MiB) stops a big message before the gateway sees it: the
    # broker disconnects the sender.
    with pytest.raises(TransportError):
        t.publish(topic, b"{" + b" " * (2 << 20) + b"}", raw=True).wait(10)
    assert wait_until(lambda: t.is_connected, 10)
    t.publish(topic, json.dumps({"device": dev, "junk": "x" * 200_000}), raw=True).wait(10)  # under the packet limit
    assert wait_until(lambda: fm.stats().get("telemetry_oversized", 0) >= 1, 10), fm.stats()
    body = {"device": dev, "ts": time.time(), "seq": 1, "bdseq": 1, "battery": 0.5, "extra": ["y" * 1000] * 10,
            "nested": {"a": {"b": 1}}, "latency_p50_ms": 1e300}
    for _ in range(200):  # a flood: rate-limited per device
        t.publish(topic, json.dumps(body), qos=0)
    t.flush(10)
    assert wait_until(lambda: fm.stats().get("telemetry_rate_limited", 0) > 100, 10), fm.stats()
    assert wait_until(lambda: len(store.telemetry(dev, limit=1000)) >= 1, 10)
    rows = store.telemetry(dev, limit=1000)
    assert len(rows) <= 50, "rows per device are bounded"
    kept = rows[-1][1]
    assert set(kept) <= {"device", "ts", "seq", "bdseq", "battery", "latency_p50_ms"} and "extra" not in kept
    assert max(len(json.dumps(r[1])) for r in rows) < 1024, "each kept row is small"
    assert "latency_p50_ms" not in kept, "absurd values are dropped"


def _junk_chunk(total: int, index: int = 0, chunk_size: int = 64 * 1024) -> bytes:
    data = os.urandom(min(chunk_size, total))
    count = -(-total // chunk_size)
    return struct.pack("!4sBB2x16sIIQI32sI", b"EFCK", 1, 0, os.urandom(16), index, count, total, chunk_size,
                       os.urandom(32), zlib.crc32(data)) + data


def test_junk_transfers_of_one_device_do_not_evict_anothers_update(fleet_env, no_tracebacks) -> None:
    """Finding 9: junk transfers from one device evicted others' in-progress updates (201 MB pinned)."""
    gw = fleet_env.transport("gateway", connect=False)
    got: list[Any] = []
    gw.subscribe(f"edgeflow/{FLEET}/+/update", got.append)
    gw.connect()
    attacker, honest = fleet_env.new_id(), fleet_env.new_id()
    at = fleet_env.transport(attacker, fleet_env.device_password(attacker))
    ho = fleet_env.transport(honest, fleet_env.device_password(honest), max_payload=64 * 1024)
    payload = os.urandom(1_000_000)
    split = Splitter(payload, 64 * 1024)
    topic = device_topic(FLEET, honest, "update").value
    for i in range(split.count - 1):  # the honest device's update is under way ...
        ho.publish(chunk_topic(topic, i), split.frame(i), raw=True).wait(10)
    junk_topic = device_topic(FLEET, attacker, "update").value
    for i in range(40):  # ... while the attacker opens 40 transfers of 16 MB each (640 MB declared)
        at.publish(chunk_topic(junk_topic, 0), _junk_chunk(16 << 20), raw=True).wait(10)
    assert wait_until(lambda: gw.stats().get("reassembly_chunks", 0) >= split.count - 1 + 40, 20), gw.stats()
    held = gw.stats()["reassembly_bytes"]
    assert held <= (128 << 20) + 2 * len(payload), f"one device holds {held} bytes of gateway memory"
    ho.publish(chunk_topic(topic, split.count - 1), split.frame(split.count - 1), raw=True).wait(10)
    assert wait_until(lambda: any(m.topic == topic for m in got), 10), "the honest update was evicted"
    assert next(m for m in got if m.topic == topic).payload == payload
    assert gw.stats().get("reassembly_evicted", 0) >= 30, "the attacker's transfers evicted only each other"


def test_retained_chunks_a_device_leaves_are_refused_by_receivers(fleet_env, no_tracebacks) -> None:
    """Finding 9: a device left 2,000 retained 64 KiB chunks on its own update/_chunk/i; every (re)subscribing
    gateway buffered them. Receivers now refuse retained chunks on device channels."""
    fleet_env._release("gateway")  # no receiver is connected now (a connected one clears the junk as it comes)
    dev = fleet_env.new_id()
    t = fleet_env.transport(dev, fleet_env.device_password(dev))
    topic = device_topic(FLEET, dev, "update").value
    for i in range(20):
        t.publish(chunk_topic(topic, i), _junk_chunk(20 * 64 * 1024, i), retain=True, raw=True).wait(10)
    # a gateway (re)subscribing now: a clean session, so only the retained store can deliver these chunks
    gw = fleet_env.transport("gateway", connect=False, clean_start=True, session_expiry_s=0)
    gw.subscribe(f"edgeflow/{FLEET}/+/update", lambda m: None)
    gw.connect()
    try:
        assert wait_until(lambda: gw.stats().get("reassembly_retained_refused", 0) >= 20, 15), gw.stats()
        assert gw.stats()["reassembly_bytes"] == 0
    finally:
        for i in range(20):  # the operator clears them (the broker keeps retained messages until then)
            gw.publish(chunk_topic(topic, i), b"", retain=True, raw=True).wait(10)


# ------------------------------------------------------------------ 10: chunked replies through the ACL


def test_inference_replies_and_acks_over_256_kib_pass_the_generated_acl(fleet_env, fm) -> None:
    """Finding 10: the ACL missed infer/reply/_chunk/+ and cmd/ack/_chunk/+: a large reply never arrived."""
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    assert fm.send_ota(dev, artifact(fleet_env, 1), version=1).wait(30).ok
    replies: list[Any] = []
    app = fleet_env.transport("tester", connect=False)
    app.subscribe(device_topic(FLEET, dev, "infer/reply").value, replies.append)
    app.connect()
    x = np.random.default_rng(3).random((8000, 64)).astype(np.float32)  # 8000 x 10 float32 out: 427 KB of JSON
    app.publish(device_topic(FLEET, dev, "infer").value,
                sign_inference_request({"id": "big", "input": encode_tensor(x)}, fleet_env.fleet_dir.fleet_key(),
                                       device=dev)).wait(30)
    assert wait_until(lambda: replies, 30), "the chunked reply never arrived"
    (msg,) = replies
    assert msg.chunks >= 2 and len(msg.payload) > 256 * 1024 and msg.json()["ok"]
    # An ack over 256 KiB (e.g. a status with a long log), sent with the device's credentials on its cmd/ack.
    # (The agent steps aside: the broker gives each device user one connection.)
    a.crash()
    assert fm.wait_online([dev], 10, online=False)
    pc = fm.send_command(dev, "status")
    dt = fleet_env.transport(dev, fleet_env.device_password(dev))
    big = Ack(pc.id, "status", dev, True, "ok", "", {"log": "z" * 300_000}).sign(a.signer.key)
    delivery = dt.publish(device_topic(FLEET, dev, "cmd/ack").value, big)
    delivery.wait(30)
    assert delivery.total >= 2, "the ack travelled in chunks"
    ack = pc.wait(30)
    assert ack.ok and ack.result["log"] == "z" * 300_000


# ------------------------------------------------------------------ 11: the rollback target survives


def test_a_failed_health_check_keeps_the_rollback_target(fleet_env, fm) -> None:
    """Finding 11 (device side): staging v3 overwrote v1's slot, so after v3 failed its check there was
    nothing to roll back to. The staging slot is now never the rollback target."""
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    for v in (1, 2):
        assert fm.send_ota(dev, artifact(fleet_env, v), version=v).wait(30).ok
    x = np.random.default_rng(7).random((1, 64)).astype(np.float32)
    wrong_golden = make_golden(mlp_bytes(99), PROFILE, x)  # expected outputs of another model: the check fails
    bad = build_artifact(mlp_bytes(3), version=3, profile=PROFILE, key=fleet_env.fleet_dir.fleet_key(), fleet=FLEET,
                         golden=wrong_golden)
    r = fm.send_ota(dev, bad, version=3).wait(30)
    assert not r.ok and r.code == "health_check_failed" and a.model_version == 2
    back = fm.command(dev, "rollback")
    assert back.ok and back.result["model_version"] == 1 and a.model_version == 1


# ------------------------------------------------------------------ 12: hostile JSON


def test_deep_json_and_huge_numbers_are_refused_cleanly(fleet_env, fm, no_tracebacks) -> None:
    """Finding 12: RecursionError (60k-deep JSON) and OverflowError (bdseq 1e400) escaped `except ValueError`:
    no ack, no reply, a traceback in the log."""
    a = fleet_env.agent()
    dev = a.device_id
    assert fm.wait_online([dev], 10)
    acks, tester = _listen(fleet_env, device_topic(FLEET, dev, "cmd/ack").value)
    replies: list[Any] = []
    tester.subscribe(device_topic(FLEET, dev, "infer/reply").value, replies.append)
    deep = b"[" * 60_000 + b"]" * 60_000
    tester.publish(device_topic(FLEET, dev, "cmd").value, deep).wait(10)
    tester.publish(device_topic(FLEET, dev, "infer").value, deep).wait(10)
    inner = '{"v":1,"ctx":"cmd/v1","body":"' + "[" * 60_000 + '","key_id":"","sig":"00"}'
    tester.publish(device_topic(FLEET, dev, "cmd").value, inner.encode()).wait(10)
    huge = sign_body({"name": "status", "device": dev, "fleet": FLEET, "args": {}, "id": "h" * 32,
                      "issued": time.time(), "expires": 1e308 * 10}, fleet_env.fleet_dir.fleet_key(), "cmd/v1")
    tester.publish(device_topic(FLEET, dev, "cmd").value, huge).wait(10)
    assert wait_until(lambda: len(acks) >= 3 and replies, 15), (len(acks), replies)
    codes = [_ack_of(m.payload).code for m in acks]
    assert codes.count("bad_message") >= 3, codes
    assert not replies[0].json()["ok"] and replies[0].json()["code"] == "unsigned"  # refused before any parsing
    # the gateway's side: births, deaths and telemetry with 1e400 and deep nesting (signed by the real device,
    # sent with its credentials: a compromised device). The agent goes first (one connection per device user).
    a.crash()
    assert fm.wait_online([dev], 10, online=False)
    dt = fleet_env.transport(dev, fleet_env.device_password(dev))
    for kind, raw in (("birth", sign_body({"device": dev, "bdseq": 1e400}, a.signer.key, "birth/v1")),
                      ("birth", b'{"v":1,"ctx":"birth/v1","body":"' + b"[" * 60_000 + b'","sig":"00"}'),
                      ("death", sign_body({"device": dev, "bdseq": 1e400}, a.signer.key, "death/v1")),
                      ("telemetry", b'{"device":"x","ts":1e400,"seq":1e400,"bdseq":1e400}'),
                      ("telemetry", deep[:20_000] + deep[-20_000:])):
        dt.publish(device_topic(FLEET, dev, kind).value, raw).wait(10)
    assert wait_until(lambda: fm.stats().get("births_bad", 0) >= 2 and fm.stats().get("deaths_bad", 0) >= 1
                      and fm.stats().get("telemetry_bad", 0) + fm.stats().get("telemetry_oversized", 0) >= 1, 15), \
        fm.stats()
    dt.close(timeout=1)
    again = fleet_env.agent(dev)  # the registry still works for the real device
    assert fm.wait_online([dev], 10) and again.transport.is_connected


def test_messages_refuse_hostile_json_with_codec_errors_only() -> None:
    from edgeflow.protocol.signed_json import loads, peek_signed

    for bad in (b"[" * 60_000, b'{"a":' * 60_000, b"\xff\xfe", b"1e400", b'{"v":1,"body":"' + b"[" * 60_000 + b'"}'):
        with pytest.raises(CodecError) as err:
            peek_signed(bad)
        assert getattr(err.value, "reason", None) in ("bad_message", "unsigned")
    assert loads(b"1e400") == float("inf")  # valid JSON; the fields that use it refuse it
    bad_fields = [{"device": "d", "bdseq": 1e400}, {"device": "d", "bdseq": "7"}, {"device": "d", "bdseq": True},
                  {"device": "d" * 100, "bdseq": 1}, {"device": "d", "bdseq": -1}]
    for body in bad_fields:
        with pytest.raises(CodecError):
            Birth.from_body(body)
        with pytest.raises(CodecError):
            Death.from_body(body)
    for extra in ({"versions": {"x": "y" * 1000}}, {"telemetry_interval_s": float("nan")}, {"seq": 2 ** 70},
                  {"commands": ["x"] * 100}, {"model_version": 1.5}):
        with pytest.raises(CodecError):
            Birth.from_body({"device": "d", "bdseq": 1, **extra})
    with pytest.raises(CodecError):
        Command.from_body({"name": "x", "device": "d", "fleet": "f", "id": "1", "issued": 1e400, "expires": 1})
    k = PrivateKey.generate()
    with pytest.raises(CodecError, match="exceeds"):
        Birth.verify(Birth("d", "f", "p", 1, k.public_key.hex, versions={f"k{i}": "v" * 60 for i in range(300)}).sign(k),
                     k.public_key)


def test_devices_provisioned_while_the_gateway_runs_are_picked_up(fleet_env) -> None:
    """Registration is provisioning only; a gateway started before a device was provisioned re-reads the key
    ring when the unknown id shows up (rate-limited) instead of needing a restart."""
    t = fleet_env.transport("admin", connect=False)
    ring = KeyRing()  # what the gateway loaded at its start: not this device yet
    fm = FleetManager(t, GatewayStore(":memory:"), FLEET, fleet_env.fleet_dir.fleet_key(),
                      FleetOptions(keyring_reload_s=0.2), keyring=ring, keyring_loader=fleet_env.fleet_dir.keyring)
    fleet_env.made.append(fm)
    fleet_env.managers["admin"] = fm
    fm.start()
    t.connect()
    a = fleet_env.agent()
    assert fm.wait_online([a.device_id], 10)
    assert ring.get(a.device_id) == a.signer.public_key, "the shared key ring (rounds use it too) was updated"
