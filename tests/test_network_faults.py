"""Real network faults between devices and the broker, through tests/_faultproxy.py (this
kernel has no netem): lossy and slow links, a site partition, a broker restart, a connection
cut in the middle of a chunked OTA transfer, a cut in the middle of the retained chunked global
model. Nothing is lost, nothing counted twice, and cut chunked transfers resume.
benchmarks/network_faults.py runs the same scenarios at full size (30 s partition) and reports
rounds completed and time to target accuracy against the clean run."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path

import pytest

from _brokers import FAST, mosquitto_factory, wait_until  # noqa: F401
from _faultproxy import FaultProxy, Faults
from _fleet import FLEET, PROFILE, artifact  # noqa: F401

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("network_faults", ROOT / "benchmarks" / "network_faults.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Echo:
    """A TCP echo server on loopback (the proxy's upstream in the proxy's own tests)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c: socket.socket) -> None:
        with c:
            while data := c.recv(65536):
                c.sendall(data)


def _roundtrip(port: int, payload: bytes, timeout: float = 20.0) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        t0 = time.monotonic()
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got, time.monotonic() - t0


def test_the_proxy_delays_stalls_partitions_and_cuts_without_corrupting_the_stream():
    echo = _Echo()
    with FaultProxy(("127.0.0.1", echo.port), seed=1) as proxy:
        clean = proxy.listen("clean")
        slow = proxy.listen("slow", Faults(delay_ms=200, jitter_ms=50))
        lossy = proxy.listen("lossy", Faults(loss=0.2, mss=500))
        data = bytes(range(256)) * 40
        got, t_clean = _roundtrip(clean, data)
        assert got == data and t_clean < 0.15
        got, t_slow = _roundtrip(slow, data)
        assert got == data and 0.3 <= t_slow < 1.5  # two one-way delays of 150-250 ms each
        got, _ = _roundtrip(lossy, data)
        assert got == data and proxy.stats["segments_lost"] > 0  # stalled, retransmitted, in order

        # a partition holds both directions; healing lets the held bytes through
        s = socket.create_connection(("127.0.0.1", clean), timeout=10)
        s.sendall(b"before")
        assert s.recv(100) == b"before"
        proxy.partition("clean", True)
        time.sleep(0.2)  # let the proxy's loop apply it
        s.sendall(b"during")
        s.settimeout(1.0)
        with pytest.raises(socket.timeout):
            s.recv(100)
        proxy.partition("clean", False)
        s.settimeout(10)
        assert s.recv(100) == b"during"
        # a reset cuts every connection of the listener
        assert proxy.reset("clean") >= 1
        s.settimeout(5)
        assert s.recv(100) == b""
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["lossy", "partition", "broker_restart"])
def test_rounds_lose_nothing_and_count_nothing_twice_under_faults(scenario, tmp_path):
    """6 devices in two sites (3 + 3), 4 rounds, every update and the model chunked (4 KB): the
    lossy site (200 +- 50 ms, 10 % segments lost), an 8 s partition of site A, or a broker
    restart, each starting while an update is half transferred."""
    nf = _bench()
    r = nf.run_scenario(scenario, devices=6, rounds=4, deadline_s=5.0, partition_s=8.0, down_s=2.0,
                        workdir=tmp_path, epochs=1)
    assert r["rounds_completed"] == 4, r
    assert r["lost"] == 0 and r["counted_twice"] == 0, r
    assert r["aggregate_checked_rounds"] == 4 and r["aggregate_max_abs_error"] < 1e-5, r
    assert r["faults"] or scenario == "lossy", r
    if scenario == "lossy":
        assert r["proxy"]["segments_lost"] > 0 and r["participants"] == [6, 6, 6, 6], r
    if scenario == "partition":
        assert 3 <= min(r["participants"]) < 6, r  # a round closed without (most of) site A, at its deadline
    if scenario == "broker_restart":
        assert r["gateway_reconnects"] >= 1 and sum(r["device_reconnects"].values()) >= 6, r
        assert r["participants"] == [6, 6, 6, 6], r  # persistent sessions: every update still arrived


def test_a_half_delivered_global_model_resumes_after_a_cut(tmp_path):
    """Right after round 1 closes, site A's link is cut when half of the new global model's bytes
    (retained, 69 chunks of 2 KB) have passed towards a device. The device resumes its persistent
    session: the broker re-sends only what it had not been acknowledged (at most its in-flight
    window, Mosquitto's max_inflight_messages = 20) and the queued rest; the reassembler kept the
    chunks that arrived, so the same transfer completes, with the published SHA-256, delivered once,
    and round 2 counts the device once. A device that lost its session (the transfer restarted from
    the retained chunks: every chunk again), a reassembler that dropped its partial transfer at the
    disconnect (never completes) or a resubscription on a resumed session (the retained copies again
    after the model: ~70 duplicates) each fail here."""
    nf = _bench()
    r = nf.run_scenario("model_cut", devices=4, rounds=2, deadline_s=10.0, workdir=tmp_path, epochs=1,
                        max_payload=2048, layers=(64, 256, 64, 10))
    assert r["rounds_completed"] == 2 and r["participants"] == [4, 4], r
    assert r["lost"] == 0 and r["counted_twice"] == 0, r
    assert r["aggregate_checked_rounds"] == 2 and r["aggregate_max_abs_error"] < 1e-5, r
    cut = r["model_cut"]
    assert cut["armed"] and cut["model_version"] == 2 and cut["next_round"] == 2, cut
    assert r["proxy"]["cuts"] == 1 and len(cut["devices"]) == 1, r  # one connection cut, one device
    (_did, d), = cut["devices"].items()
    assert d["reconnects"] >= 1 and d["delivered"] == 1, d  # the published model (its SHA-256), once
    n = d["chunks"]
    assert n >= 60 and 0 < d["chunks_before_cut"] < n, d
    # every chunk arrived, each new one once: what came before the cut was kept
    assert d["chunks_before_cut"] + d["chunks_after_cut"] - d["duplicates"] == n, d
    # resumed, not restarted: only chunks the broker had not seen acknowledged come twice (Mosquitto's
    # in-flight window, 20, plus acks still queued at the cut: up to 22 seen under load), never all the
    # chunks that had arrived, as a restart from the retained copies or a second subscription would
    # (duplicates == chunks_before_cut, or more; checked by patching the transport). How many chunks the
    # device had handled at the cut depends on the load (20-32 seen: the proxy counts bytes).
    assert d["duplicates"] < d["chunks_before_cut"] and d["duplicates_to_end"] < d["chunks_before_cut"], d
    assert d["chunks_after_cut"] < n, d
    assert d["counted_next_round"] == 1, d


def test_a_chunked_ota_transfer_cut_midway_resumes(mosquitto_factory, tmp_path):  # noqa: F811
    """The device's connection is cut when half the signed artifact's bytes have passed: the broker
    keeps the rest for its persistent session, the reassembler keeps what arrived, and the
    transfer completes once, with only the missing chunks sent again."""
    from edgeflow.broker.mosquitto import FleetDir
    from edgeflow.device.agent import AgentOptions, DeviceAgent
    from edgeflow.gateway.fleet import FleetManager, FleetOptions
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.transport import MqttTransport

    broker = mosquitto_factory()
    fleet = FLEET
    fd = FleetDir(tmp_path / "fleet").init(fleet, operators=["gateway"])
    fd.provision("dev-0", profile=PROFILE)
    with FaultProxy((broker.host, broker.port), seed=3) as proxy:
        port = proxy.listen("dev", Faults(delay_ms=20, jitter_ms=10, loss=0.3, mss=512))
        gt = MqttTransport(broker.host, broker.port, client_id=f"{fleet}-gateway", max_payload=2048, **FAST)
        fm = FleetManager(gt, GatewayStore(tmp_path / "gw.sqlite"), fleet, fd.fleet_key(),
                          FleetOptions(command_timeout_s=60.0), keyring=fd.keyring())
        agent = DeviceAgent.from_credentials(fd.device_dir("dev-0"), broker=f"mqtt://127.0.0.1:{port}",
                                             profile=PROFILE, state_dir=tmp_path / "state",
                                             options=AgentOptions(telemetry_interval_s=5.0, health_runs=2), **FAST)
        try:
            fm.start()
            gt.connect(timeout=10)
            agent.start()
            assert fm.wait_online(["dev-0"], 20)
            art = artifact(fd.fleet_key(), 1)
            count = -(-len(art) // (2048 - 80))
            assert count >= 10
            st = agent.transport.stats
            reconnects = st().get("reconnects", 0)
            proxy.cut_after("dev", len(art) // 2)  # the device's link drops half-way through the artifact
            pending = fm.send_ota("dev-0", art, version=1)
            assert wait_until(lambda: proxy.stats["cuts"] == 1, 60), dict(proxy.stats)
            ack = pending.wait(90)
            assert ack.ok, ack
            assert agent.model_version == 1
            s = st()
            assert s["reconnects"] >= reconnects + 1 and s.get("reassembly_completed", 0) >= 1
            # resumed: the chunks that arrived before the cut were kept; at most the in-flight
            # window (20) came again as duplicates, never the whole artifact
            assert s["reassembly_chunks"] - s.get("reassembly_duplicates", 0) >= count
            assert s.get("reassembly_duplicates", 0) <= 20
        finally:
            agent.crash()
            fm.stop(timeout=2)
            gt.close(timeout=1, flush=False)


def test_a_broker_that_does_not_come_back_fails_the_scenario_at_once(tmp_path, monkeypatch):
    # before: the fault thread's TransportError was lost and the rounds waited for the broker until
    # pytest-timeout (600 s) cut the test
    from edgeflow.errors import TransportError
    from edgeflow.transport.broker import MosquittoBroker

    def restart(self, down_s=0.0):
        raise TransportError("mosquitto did not start (exit code 1): Address already in use")

    monkeypatch.setattr(MosquittoBroker, "restart", restart)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="Address already in use"):
        _bench().run_scenario("broker_restart", devices=2, rounds=2, deadline_s=5.0, down_s=1.0,
                              workdir=tmp_path, epochs=1)
    assert time.monotonic() - t0 < 120
