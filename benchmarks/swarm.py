"""Thousands of devices on real MQTT connections, from a few processes: fleet + rounds at scale.

    python benchmarks/swarm.py                           # 5,000 devices in two network namespaces
    python benchmarks/swarm.py --devices 100 1000 5000 --rounds 3 --json out.json
    python benchmarks/swarm.py --devices 1000 --no-netns # one machine, loopback (no root needed)

The device simulator (``python benchmarks/swarm.py worker CONFIG.json``) is one asyncio process
holding thousands of MQTT 3.1.1 connections (a small client written here on asyncio streams:
CONNECT with a last will, QoS 1 PUBLISH/PUBACK with 20 in flight, SUBSCRIBE, keepalive), so
a connection costs a socket and a few KB, not two threads. Each device:

- connects with its own client id and a signed death as its will, then publishes a signed,
  retained birth (Ed25519, its own key, ``can_train``) — the gateway registers it only if the
  signature matches the key ring;
- sends telemetry (QoS 1, JSON with its timestamp) every ``--interval`` seconds, phases spread;
- follows rounds: the retained global model and the signed announcement on its own connection,
  and, when selected, answers with an update encoded and signed by its own key (int8 codec,
  a fixed delta: the federation's cost, not N trainings). Devices of one process check a given
  model or announcement signature once and share the verdict (the device side's CPU is not what
  is measured; every device still receives every byte on its own connection).

The gateway is the real service composition (:class:`~edgeflow.gateway.service.Gateway`:
FleetManager + RoundManager on one MQTT connection, state in SQLite or ``--store``
PostgreSQL) in this process; the broker is a Mosquitto of the run's own. With network
namespaces (default; root), the device processes run in two test hosts (``tests/_netns.py``) and
reach the broker over their veth links; the broker listens only on the test network.

Reported per size: connections (the workers' count and the broker's own
``$SYS/broker/clients/connected``), births registered, telemetry lag (device timestamp to
commit in the state; p50/p95/max) in a steady window of ``--window`` seconds with the whole fleet
connected and again during the rounds, round time (announce to new model acknowledged) per round
and participants, gateway CPU and RSS, broker CPU and RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
FLEET = "swarm"


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---------------------------------------------------------------------------
# A small MQTT 3.1.1 client on asyncio streams (the simulator's connections)
# ---------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n % 128, n // 128
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(b)) + b


class MiniMqtt:
    """One MQTT 3.1.1 connection: QoS 0/1 publish and subscribe, a will, keepalive."""

    def __init__(self, host: str, port: int, client_id: str, on_message: Callable[[str, bytes], Any], *,
                 keepalive: int = 120, will: tuple[str, bytes, int, bool] | None = None, inflight: int = 20) -> None:
        self.host, self.port, self.client_id = host, port, client_id
        self.on_message = on_message
        self.keepalive = keepalive
        self.will = will
        self._window = asyncio.Semaphore(inflight)
        self._pending: dict[int, asyncio.Future] = {}
        self._next = 0
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.connected = False
        self.stats = {"published": 0, "acked": 0, "received": 0}
        self._tasks: list[asyncio.Task] = []

    def _pid(self) -> int:
        self._next = self._next % 65535 + 1
        return self._next

    async def connect(self, timeout: float = 60.0) -> None:
        self.reader, self.writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), timeout)
        flags = 0x02  # clean session
        payload = _str(self.client_id)
        if self.will is not None:
            topic, body, qos, retain = self.will
            flags |= 0x04 | (qos << 3) | (0x20 if retain else 0)
            payload += _str(topic) + _str(body)
        var = _str("MQTT") + bytes([4, flags]) + struct.pack("!H", self.keepalive)
        body = var + payload
        self.writer.write(b"\x10" + _varint(len(body)) + body)
        await self.writer.drain()
        head = await asyncio.wait_for(self.reader.readexactly(4), timeout)
        if head[0] != 0x20 or head[3] != 0:
            raise ConnectionError(f"{self.client_id}: CONNACK {head.hex()}")
        self.connected = True
        self._tasks = [asyncio.ensure_future(self._read_loop()), asyncio.ensure_future(self._ping_loop())]

    async def _read_loop(self) -> None:
        r = self.reader
        assert r is not None
        try:
            while True:
                b0 = (await r.readexactly(1))[0]
                mult, length = 1, 0
                while True:
                    d = (await r.readexactly(1))[0]
                    length += (d & 0x7F) * mult
                    if not d & 0x80:
                        break
                    mult *= 128
                body = await r.readexactly(length) if length else b""
                kind = b0 >> 4
                if kind == 3:  # PUBLISH
                    qos = (b0 >> 1) & 3
                    (tl,) = struct.unpack_from("!H", body)
                    topic = body[2:2 + tl].decode()
                    pos = 2 + tl
                    if qos:
                        (pid,) = struct.unpack_from("!H", body, pos)
                        pos += 2
                    self.stats["received"] += 1
                    try:
                        self.on_message(topic, body[pos:])
                    finally:
                        if qos:
                            self.writer.write(b"\x40\x02" + struct.pack("!H", pid))
                elif kind == 4:  # PUBACK
                    (pid,) = struct.unpack("!H", body[:2])
                    fut = self._pending.pop(pid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                elif kind == 9:  # SUBACK
                    (pid,) = struct.unpack("!H", body[:2])
                    fut = self._pending.pop(pid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(body[2:])
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.connected = False
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("connection lost"))

    async def _ping_loop(self) -> None:
        while self.connected:
            await asyncio.sleep(self.keepalive / 2)
            if self.writer is not None and self.connected:
                self.writer.write(b"\xc0\x00")

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if not self.connected or self.writer is None:
            raise ConnectionError("not connected")
        t = _str(topic)
        if qos == 0:
            body = t + payload
            self.writer.write(bytes([0x30 | (1 if retain else 0)]) + _varint(len(body)) + body)
            self.stats["published"] += 1
            return
        async with self._window:
            pid = self._pid()
            fut = asyncio.get_running_loop().create_future()
            self._pending[pid] = fut
            body = t + struct.pack("!H", pid) + payload
            self.writer.write(bytes([0x32 | (1 if retain else 0)]) + _varint(len(body)) + body)
            self.stats["published"] += 1
            await self.writer.drain()
            await fut
            self.stats["acked"] += 1

    async def subscribe(self, filters: list[tuple[str, int]]) -> bytes:
        assert self.writer is not None
        pid = self._pid()
        fut = asyncio.get_running_loop().create_future()
        self._pending[pid] = fut
        body = struct.pack("!H", pid) + b"".join(_str(f) + bytes([q]) for f, q in filters)
        self.writer.write(b"\x82" + _varint(len(body)) + body)
        await self.writer.drain()
        return await fut

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.writer is not None:
            try:
                self.writer.write(b"\xe0\x00")
                self.writer.close()
            except (ConnectionError, OSError, RuntimeError):
                pass


# ---------------------------------------------------------------------------
# The device simulator (a worker process)
# ---------------------------------------------------------------------------


class _Verified:
    """Signature checks shared by the devices of one process: one per distinct payload."""

    def __init__(self, fleet_key: Any) -> None:
        from edgeflow.signing import KeyRing

        self.fleet_key = fleet_key
        self.keyring = KeyRing({"gateway": fleet_key})
        self._models: dict[bytes, int] = {}
        self._anns: dict[bytes, Any] = {}

    def model_version(self, payload: bytes) -> int:
        h = hashlib.sha256(payload).digest()
        v = self._models.get(h)
        if v is None:
            from edgeflow.codecs import decode_update

            upd = decode_update(payload, verifier=self.keyring, require_signature=True)
            v = self._models[h] = int(upd.metadata.get("model_version", upd.round_id))
        return v

    def announcement(self, payload: bytes) -> Any:
        h = hashlib.sha256(payload).digest()
        a = self._anns.get(h)
        if a is None:
            from edgeflow.protocol.rounds import RoundAnnouncement

            ann = RoundAnnouncement.verify(payload, self.fleet_key)
            a = self._anns[h] = (ann, frozenset(ann.selected))
        return a


class SimDevice:
    def __init__(self, sim: "Swarm", device_id: str, key_hex: str, n: int) -> None:
        from edgeflow.signing import PrivateKey, Signer

        self.sim, self.device_id = sim, device_id
        self.key = PrivateKey.from_bytes(bytes.fromhex(key_hex))
        self.signer = Signer(device_id, self.key)
        self.n = n
        self.bdseq = int(time.time() * 1000)
        self.seq = time.time_ns() // 1000
        self.version = -1
        self.pending: Any = None
        self.done: set[int] = set()
        self.tele_seq = 0
        self.mqtt: MiniMqtt | None = None
        self.sent_updates = 0
        self.errors = 0

    def topic(self, channel: str) -> str:
        return f"edgeflow/{FLEET}/{self.device_id}/{channel}"

    async def run(self, connect_gate: asyncio.Semaphore) -> None:
        from edgeflow.protocol.fleet import Birth, Death

        death = Death(self.device_id, self.bdseq).sign(self.key)
        self.mqtt = MiniMqtt(self.sim.host, self.sim.port, f"{FLEET}-{self.device_id}", self.on_message,
                             will=(self.topic("death"), death, 1, True))
        for attempt in range(20):
            async with connect_gate:
                try:
                    await self.mqtt.connect()
                    break
                except (OSError, ConnectionError, asyncio.TimeoutError):
                    self.sim.connect_retries += 1
            await asyncio.sleep(min(5.0, 0.2 * 2 ** attempt) * random.random())
        else:
            self.sim.failed += 1
            return
        await self.mqtt.subscribe([(f"edgeflow/{FLEET}/gateway/model", 1), (f"edgeflow/{FLEET}/gateway/round", 1)])
        birth = Birth(self.device_id, FLEET, "raspberry-pi-4", self.bdseq, self.key.public_key.hex, model_version=1,
                      telemetry_interval_s=self.sim.interval, can_train=True, training=True, seq=1).sign(self.key)
        await self.mqtt.publish(self.topic("death"), b"", retain=True)
        await self.mqtt.publish(self.topic("birth"), birth, retain=True)
        self.sim.connected += 1

    async def telemetry_loop(self) -> None:
        await asyncio.sleep(random.random() * self.sim.interval)
        while not self.sim.stopping:
            if self.mqtt is not None and self.mqtt.connected:
                self.tele_seq += 1
                body = {"device": self.device_id, "ts": time.time(), "seq": self.tele_seq, "bdseq": self.bdseq,
                        "model_version": max(self.version, 1), "inferences": 10, "latency_p50_ms": 1.2,
                        "latency_p95_ms": 2.5, "rss_bytes": 50_000_000, "cpu_percent": 3.0, "queue_depth": 0,
                        "battery": 0.9, "train": "training"}
                try:
                    await self.mqtt.publish(self.topic("telemetry"), json.dumps(body, separators=(",", ":")).encode())
                    self.sim.telemetry_sent += 1
                except ConnectionError:
                    self.errors += 1
            await asyncio.sleep(self.sim.interval)

    def on_message(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            if topic.endswith("/gateway/model"):
                self.version = max(self.version, self.sim.verified.model_version(payload))
                if self.pending is not None and self.version >= self.pending.model_version:
                    ann, self.pending = self.pending, None
                    self.sim.spawn(self.send(ann))
            elif topic.endswith("/gateway/round"):
                ann, selected = self.sim.verified.announcement(payload)
                if ann.state != "open" or ann.round_id in self.done or self.device_id not in selected:
                    return
                if self.version >= ann.model_version:
                    self.sim.spawn(self.send(ann))
                else:
                    self.pending = ann
        except Exception:  # noqa: BLE001 - a simulated device counts what it could not handle
            self.errors += 1

    async def send(self, ann: Any) -> None:
        from edgeflow.codecs import encode_update

        if ann.round_id in self.done:
            return
        self.done.add(ann.round_id)
        self.seq += 1
        payload = encode_update(self.sim.delta, ann.config.codec, round_id=ann.round_id, device_id=self.device_id,
                                seq=self.seq, signer=self.signer, num_samples=self.n,
                                metadata={"base_version": ann.model_version, "loss": 0.0,
                                          **({"round_nonce": ann.nonce} if ann.nonce else {})},
                                **ann.config.codec_opts)
        try:
            await self.mqtt.publish(self.topic("update"), payload)
            self.sent_updates += 1
        except ConnectionError:
            self.errors += 1


class Swarm:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import numpy as np

        from edgeflow import zoo
        from edgeflow.gateway.rounds import model_weights
        from edgeflow.signing import PublicKey

        self.host, self.port = cfg["host"], int(cfg["port"])
        self.interval = float(cfg["interval"])
        self.verified = _Verified(PublicKey.from_hex(cfg["fleet_pub"]))
        rng = np.random.default_rng(cfg.get("seed", 0))
        self.delta = {k: (rng.standard_normal(v.shape) * 0.01).astype(np.float32)
                      for k, v in model_weights(zoo.digits_mlp(seed=0)).items()}
        self.devices = [SimDevice(self, d, k, 10 + i % 50) for i, (d, k) in enumerate(cfg["devices"])]
        self.connected = self.failed = self.connect_retries = self.telemetry_sent = 0
        self.stopping = False
        self._bg: set[asyncio.Task] = set()

    def spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def main(self, status_path: Path, stop: asyncio.Event) -> dict[str, Any]:
        t0 = time.monotonic()
        gate = asyncio.Semaphore(100)  # connects in flight (the broker's accept backlog)
        await asyncio.gather(*(d.run(gate) for d in self.devices))
        connect_s = time.monotonic() - t0
        status_path.write_text(json.dumps({"connected": self.connected, "failed": self.failed,
                                           "connect_s": round(connect_s, 2), "pid": os.getpid()}))
        tele = [asyncio.ensure_future(d.telemetry_loop()) for d in self.devices]
        await stop.wait()
        self.stopping = True
        for t in tele:
            t.cancel()
        alive = sum(1 for d in self.devices if d.mqtt is not None and d.mqtt.connected)
        out = {"devices": len(self.devices), "connected": self.connected, "alive_at_end": alive,
               "failed": self.failed, "connect_retries": self.connect_retries, "connect_s": round(connect_s, 2),
               "telemetry_sent": self.telemetry_sent, "updates_sent": sum(d.sent_updates for d in self.devices),
               "errors": sum(d.errors for d in self.devices),
               "rss_mb": round(int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                               / 2**20, 1),
               "cpu_s": round(sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), 1),
               "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
        await asyncio.gather(*(d.mqtt.close() for d in self.devices if d.mqtt is not None), return_exceptions=True)
        return out


def worker_main(config_path: str) -> int:
    _raise_nofile()
    cfg = json.loads(Path(config_path).read_text())
    sim = Swarm(cfg)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    out = loop.run_until_complete(sim.main(Path(cfg["status"]), stop))
    Path(cfg["result"]).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------
# The orchestrator: broker, gateway, device processes
# ---------------------------------------------------------------------------


def _proc_cpu_s(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _rss_mb(pid: int | str = "self") -> float:
    try:
        return round(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, IndexError, ValueError):
        return float("nan")


def run_size(n: int, *, rounds: int, interval: float, procs: int, netns: bool, store: str | None,
             workdir: Path, settle_s: float = 10.0, window_s: float = 30.0) -> dict[str, Any]:
    _raise_nofile()
    sys.path.insert(0, str(ROOT / "tests"))
    from edgeflow import zoo
    from edgeflow.protocol.rounds import TrainConfig
    from edgeflow.gateway.fleet import FleetOptions
    from edgeflow.gateway.rounds import RoundConfig
    from edgeflow.gateway.service import Gateway
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.signing import KeyRing, PrivateKey
    from edgeflow.transport import MqttTransport
    from edgeflow.transport.broker import MosquittoBroker, find_mosquitto

    net = None
    hosts: list[Any] = []
    if netns:
        from _netns import TestNet, netns_unavailable

        why = netns_unavailable()
        if why is not None:
            raise SystemExit(f"swarm: {why}; run with --no-netns")
        net = TestNet()
        hosts = [net.host(f"s{i}") for i in range(2)]
    bind = net.gateway_ip if net is not None else "127.0.0.1"
    workdir.mkdir(parents=True, exist_ok=True)
    broker = MosquittoBroker(host=bind, binary=find_mosquitto(), workdir=workdir / "broker",
                             extra_config="max_connections -1\nsys_interval 1\nmax_queued_messages 10000\n").start()
    fleet_key = PrivateKey.generate()
    ring = KeyRing()
    keys = []
    for i in range(n):
        k = PrivateKey.generate()
        d = f"s{i:05d}"
        ring.register(d, k.public_key)
        keys.append((d, k.raw().hex()))
    gstore = GatewayStore(store or str(workdir / "gateway.sqlite"))
    gt = MqttTransport(bind, broker.port, client_id=f"{FLEET}-gateway", max_pending_messages=500_000,
                       connect_timeout_s=30)
    sysbox: dict[str, int] = {"max": 0}

    def on_sys(msg: Any) -> None:
        try:
            v = int(msg.payload)
        except ValueError:
            return
        sysbox["now"] = v
        sysbox["max"] = max(sysbox["max"], v)

    gt.subscribe("$SYS/broker/clients/connected", on_sys, qos=0)
    history: list[Any] = []
    rc = RoundConfig(rounds=rounds, min_clients=max(1, int(0.95 * n)), quorum=0.95, deadline_s=max(60.0, n / 25),
                     max_extensions=1, strategy="fedavg", fraction=1.0, wait_for_devices_s=600.0,
                     publish_timeout_s=120.0, train=TrainConfig(codec="int8"))
    gw = Gateway(gt, gstore, fleet=FLEET, fleet_key=fleet_key, keyring=ring, model=zoo.digits_mlp(seed=0), rounds=rc,
                 fleet_options=FleetOptions(lag_window=2_000_000, heartbeat_min_s=max(60.0, 6 * interval)),
                 on_round=history.append)
    children: list[subprocess.Popen] = []
    results: list[dict[str, Any]] = []
    out: dict[str, Any] = {"devices": n, "netns": netns, "store": gstore.engine, "interval_s": interval,
                           "device_procs": procs}
    try:
        gw.start()
        shares = [keys[i::procs] for i in range(procs)]
        t_conn = time.monotonic()
        for i, share in enumerate(shares):
            cfg = {"host": bind, "port": broker.port, "interval": interval, "fleet_pub": fleet_key.public_key.hex,
                   "devices": share, "seed": i, "status": str(workdir / f"w{i}.status"),
                   "result": str(workdir / f"w{i}.result")}
            path = workdir / f"w{i}.json"
            path.write_text(json.dumps(cfg))
            argv = [sys.executable, str(Path(__file__).resolve()), "worker", str(path)]
            log = open(workdir / f"w{i}.log", "wb")  # noqa: SIM115 - the child owns it
            if hosts:
                children.append(hosts[i % len(hosts)].popen(argv, stdout=log, stderr=subprocess.STDOUT))
            else:
                children.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not all((workdir / f"w{i}.status").exists() for i in range(procs)):
            if any(c.poll() is not None for c in children):
                raise RuntimeError("a device process died: " + (workdir / "w0.log").read_text()[-2000:])
            time.sleep(0.2)
        status = [json.loads((workdir / f"w{i}.status").read_text()) for i in range(procs)]
        while time.monotonic() < deadline and gw.fleet.stats().get("births", 0) < n:
            time.sleep(0.2)
        out["fleet_up_s"] = round(time.monotonic() - t_conn, 1)
        out["births_registered"] = gw.fleet.stats().get("births", 0)
        out["connected_workers"] = sum(s["connected"] for s in status)
        out["connect_failed"] = sum(s["failed"] for s in status)
        time.sleep(settle_s)  # telemetry in steady state before the measurements
        gw.fleet.reset_lag()
        w0 = gw.fleet.stats()
        time.sleep(window_s)  # the fleet alone: births done, telemetry only
        w1 = gw.fleet.stats()
        wl = w1.get("telemetry_lag_ms", {})
        out.update({"steady_window_s": window_s,
                    "steady_telemetry_lag_ms_p50": round(wl.get("p50", float("nan")), 1),
                    "steady_telemetry_lag_ms_p95": round(wl.get("p95", float("nan")), 1),
                    "steady_telemetry_lag_ms_max": round(wl.get("max", float("nan")), 1),
                    "steady_telemetry_stored_per_s": round((w1.get("telemetry_stored", 0)
                                                            - w0.get("telemetry_stored", 0)) / window_s, 1),
                    "steady_broker_clients_connected": sysbox.get("now")})
        gw.fleet.reset_lag()
        s0 = gw.fleet.stats()
        cpu0 = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        bpid = broker._state["proc"].pid
        b0 = _proc_cpu_s(bpid)
        t0 = time.monotonic()
        gw.run_rounds(rounds)
        span = time.monotonic() - t0
        s1 = gw.fleet.stats()
        lag = s1.get("telemetry_lag_ms", {})
        out.update({
            "broker_clients_connected_max": sysbox["max"],
            "broker_clients_connected_during_rounds": sysbox.get("now"),
            "round_s": [round(m.round_s, 2) for m in history],
            "round_s_median": round(sorted(m.round_s for m in history)[len(history) // 2], 2) if history else None,
            "participants": [m.participants for m in history],
            "rejected": sum(m.rejected for m in history), "duplicates": sum(m.duplicates for m in history),
            "telemetry_lag_ms_p50": round(lag.get("p50", float("nan")), 1),
            "telemetry_lag_ms_p95": round(lag.get("p95", float("nan")), 1),
            "telemetry_lag_ms_max": round(lag.get("max", float("nan")), 1),
            "telemetry_stored_during_rounds": s1.get("telemetry_stored", 0) - s0.get("telemetry_stored", 0),
            "telemetry_offered_per_s": round(n / interval, 1),
            "telemetry_stored_per_s": round((s1.get("telemetry_stored", 0) - s0.get("telemetry_stored", 0)) / span, 1),
            "telemetry_dropped": s1.get("telemetry_dropped", 0), "telemetry_rate_limited": s1.get("telemetry_rate_limited", 0),
            "rounds_phase_s": round(span, 1),
            "gateway_cpu_percent": round(100 * (sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - cpu0) / span, 1),
            "gateway_rss_mb": _rss_mb(),
            "broker_cpu_percent": round(100 * (_proc_cpu_s(bpid) - b0) / span, 1),
            "broker_rss_mb": _rss_mb(bpid),
            "online_at_end": s1.get("online"),
        })
    finally:
        for c in children:
            if c.poll() is None:
                try:
                    os.killpg(c.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for i, c in enumerate(children):
            try:
                c.wait(60)
            except subprocess.TimeoutExpired:
                c.kill()
            rp = workdir / f"w{i}.result"
            if rp.exists():
                results.append(json.loads(rp.read_text()))
        gw.stop()
        broker.stop()
        if net is not None:
            net.close()
    if results:
        out["device_side"] = {
            "connected": sum(r["connected"] for r in results), "alive_at_end": sum(r["alive_at_end"] for r in results),
            "updates_sent": sum(r["updates_sent"] for r in results),
            "telemetry_sent": sum(r["telemetry_sent"] for r in results), "errors": sum(r["errors"] for r in results),
            "connect_retries": sum(r["connect_retries"] for r in results),
            "rss_mb_total": round(sum(r["rss_mb"] for r in results), 1),
            "cpu_s_total": round(sum(r["cpu_s"] for r in results), 1),
            "per_process": [r["devices"] for r in results],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        return worker_main(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[5000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interval", type=float, default=10.0, help="telemetry interval per device (s)")
    ap.add_argument("--procs", type=int, default=2, help="device processes (split across the two hosts)")
    ap.add_argument("--no-netns", action="store_true", help="run the device processes here, on loopback")
    ap.add_argument("--store", default=None, help="gateway state URL (default: SQLite in the work dir)")
    ap.add_argument("--window", type=float, default=30.0, help="steady-state telemetry window before the rounds (s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for n in args.devices:
        work = Path(tempfile.mkdtemp(prefix=f"ef-swarm-{n}-"))
        store = args.store
        if store and store.startswith("postgres"):
            store = f"{store}{'&' if '?' in store else '?'}schema=ef_swarm_{os.getpid()}_{n}"
        r = run_size(n, rounds=args.rounds, interval=args.interval, procs=args.procs, netns=not args.no_netns,
                     store=store, workdir=work, window_s=args.window)
        if store and store.startswith("postgres"):
            from edgeflow.gateway.store import GatewayStore

            s = GatewayStore(store)
            s.drop_schema()
            s.close()
        rows.append(r)
        print(json.dumps(r), flush=True)
    doc = {"benchmark": "swarm", "rows": rows, "cpus": os.cpu_count()}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
