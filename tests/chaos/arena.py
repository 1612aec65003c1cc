"""The chaos arena: one live fleet that every attack of issue 20 runs against.

- Mosquitto on the config ``edgeflow broker-config`` generates (TLS listener, no anonymous access,
  per-device passwords, the ACL, ``max_packet_size``), devices made with ``fleet provision``
  (tests/_fleet.py);
- the gateway service (:class:`edgeflow.gateway.service.Gateway` built by ``Gateway.from_config``
  from a ``gateway.toml``, as ``edgeflow gateway`` builds it: fleet key ring loader, transfer filter,
  SQLite state) connected through a fault proxy (tests/_faultproxy.py) so a broker stall can be made;
- three honest device agents (:class:`~edgeflow.device.agent.DeviceAgent` from their credentials, each
  with a federated :class:`~edgeflow.federated.Client` on a shard of the digits) and one *compromised
  provisioned device*, ``evil``: a real agent too (so rounds select it), whose key and password the
  attacker holds and uses to publish hand-built, validly signed messages;
- an ``open`` anonymous Mosquitto for the open-broker attacks (made on demand).

Shared by tests/chaos/test_chaos.py (module-scoped: one fleet for all attacks) and benchmarks/chaos.py.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _faultproxy import FaultProxy  # noqa: E402
from _fleet import FAST, FLEET, PROFILE, artifact, make_fleet_env  # noqa: E402

HONEST = ("dev-00", "dev-01", "dev-02")
EVIL = "dev-03"
SPARE = ("dev-04", "dev-05", "dev-06", "dev-07")


class Tracebacks(logging.Handler):
    """Counts records logged with an exception (a traceback) by edgeflow loggers."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.warnings: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("edgeflow"):
            if record.exc_info:
                self.records.append(record)
            self.warnings.append(record.getMessage())


class Arena:
    def __init__(self, root: Path, *, say: Callable[[str], None] = lambda s: None) -> None:
        from edgeflow import zoo
        from edgeflow.data.datasets import dirichlet_partition, load_digits

        self.root = root
        self.say = say
        self.tb = Tracebacks()
        logging.getLogger("edgeflow").addHandler(self.tb)
        if logging.getLogger("edgeflow").level == logging.NOTSET or logging.getLogger("edgeflow").level > logging.WARNING:
            logging.getLogger("edgeflow").setLevel(logging.WARNING)
        self.env = make_fleet_env(root, pool=8)
        self.fd = self.env.fleet_dir
        self.fleet_key = self.fd.fleet_key()
        split = load_digits(seed=0).flat()
        self.split = split
        parts = dirichlet_partition(split.y_train, 4, alpha=1.0, seed=0)
        self.shards = {d: (split.x_train[idx][:200], split.y_train[idx][:200])
                       for d, idx in zip((*HONEST, EVIL), parts)}
        self.model = zoo.digits_mlp(seed=1)
        (root / "model.onnx").write_bytes(self.model.SerializeToString())
        np.savez(root / "eval.npz", x=split.x_test, y=split.y_test)
        self.toml = root / "gateway.toml"
        self.toml.write_text(f"""
[gateway]
fleet_dir = "{self.fd.path}"
state = "{root / 'gateway.sqlite'}"
model = "{root / 'model.onnx'}"
eval = "{root / 'eval.npz'}"
metrics = "{root / 'metrics.jsonl'}"

[fleet]
command_timeout_s = 20.0
keyring_reload_s = 0.5
telemetry_rate_hz = 20.0

[rounds]
rounds = 1000
min_clients = 3
quorum = 1.0
deadline_s = 15
max_extensions = 0
wait_for_devices_s = 10
publish_timeout_s = 2

[rounds.train]
epochs = 1
batch_size = 32
lr = 0.1
codec = "dense"
""", encoding="utf-8")
        self.proxy = FaultProxy(("127.0.0.1", self.env.broker.port)).start()
        self.gw_port = self.proxy.listen("gateway")
        self.gw: Any = None
        self.start_gateway()
        self.clients: dict[str, list[Any]] = {}
        self.agents: dict[str, Any] = {}
        for d in (*HONEST, EVIL):
            self.start_agent(d)
        self.deploy_v1()

    # ------------------------------------------------------------------ parts
    @property
    def gw_url(self) -> str:
        return f"mqtts://127.0.0.1:{self.gw_port}"

    def start_gateway(self, *, state: Path | None = None) -> Any:
        from edgeflow.gateway.service import Gateway, load_config

        cfg = load_config(self.toml)
        if state is not None:
            cfg.state = str(state)
        self.gw = Gateway.from_config(cfg, broker=self.gw_url)
        self._observe(self.gw.store)
        self.gw.start(timeout=30)
        return self.gw

    def _observe(self, store: Any) -> None:
        """Record every update the store accepts, (round, device) -> num_samples: a closed round's updates
        are dropped from the state, and the last reporter's update lives there only for an instant."""
        real = store.add_update
        self.accepted: dict[tuple[int, str], int] = getattr(self, "accepted", {})

        def add_update(round_id: int, device_id: str, seq: int, num_samples: int, envelope: bytes) -> bool:
            ok = real(round_id, device_id, seq, num_samples, envelope)
            if ok:
                self.accepted.setdefault((round_id, device_id), num_samples)
                self.accepted_envelopes[(round_id, device_id)] = envelope
            return ok

        self.accepted_envelopes: dict[tuple[int, str], bytes] = getattr(self, "accepted_envelopes", {})
        store.add_update = add_update

    def stop_gateway(self) -> None:
        if self.gw is not None:
            self.gw.stop()
            self.gw = None

    def participant(self, agent: Any) -> Any:
        from edgeflow.federated import Client

        d = agent.device_id
        c = Client(agent.transport, fleet=agent.fleet, device_id=d, signer=agent.signer, fleet_key=agent.fleet_key,
                   model=str(agent.train_model_path), data=self.shards[d], profile=agent.profile,
                   seed=sorted(self.shards).index(d), delay_s=2.5 if d == EVIL else 0.0,
                   epoch_file=agent.slots.root / "gateway_epoch.json")
        self.clients.setdefault(d, []).append(c)
        return c

    def start_agent(self, device_id: str, **transport: Any) -> Any:
        from edgeflow.device.agent import AgentOptions, DeviceAgent

        old = self.agents.pop(device_id, None)
        if old is not None:
            old.stop()
        opts = {**FAST, "max_payload": 4096, **transport}  # updates travel in chunks: reassembly is under attack
        a = DeviceAgent.from_credentials(self.fd.device_dir(device_id), broker=self.env.url, profile=PROFILE,
                                         state_dir=self.root / "state" / device_id,
                                         options=AgentOptions(telemetry_interval_s=1.0, health_runs=1),
                                         make_participant=self.participant if device_id in self.shards else None,
                                         **opts)
        a.start(timeout=30)
        self.agents[device_id] = a
        return a

    def client(self, device_id: str) -> Any:
        return self.clients[device_id][-1]

    def deploy_v1(self) -> None:
        from edgeflow.gateway.ota import RolloutPolicy

        fm = self.gw.fleet
        assert fm.wait_online(list(self.agents), 30), "agents did not come online"
        rep = fm.deploy({PROFILE: artifact(self.env, 1, seed=1)}, to="all",
                        policy=RolloutPolicy(canary=1, failure_threshold=0.5, report_timeout_s=60.0))
        assert rep.state == "completed", rep.halted_reason
        self.wait_trainers()

    def wait_trainers(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pool = {c.device_id: c for c in self.gw.fleet.round_candidates()}
            if all(d in pool and pool[d].can_train for d in self.shards):
                return
            time.sleep(0.1)
        raise AssertionError(f"trainers not ready: {[(c.device_id, c.why) for c in self.gw.fleet.round_candidates()]}")

    # ------------------------------------------------------------------ the attacker's tools
    @property
    def evil(self) -> Any:
        return self.agents[EVIL]

    def evil_publish(self, channel: str, payload: bytes | str, *, qos: int = 1, retain: bool = False,
                     raw: bool = False, wait: bool = True) -> Any:
        from edgeflow.transport.topics import device_topic

        if "/_chunk/" in channel:
            head, _, idx = channel.partition("/_chunk/")
            topic = f"{device_topic(FLEET, EVIL, head).value}/_chunk/{idx}"
        else:
            topic = device_topic(FLEET, EVIL, channel).value
        d = self.evil.transport.publish(topic, payload, qos=qos, retain=retain, raw=raw)
        if wait and qos:
            d.wait(15)
        return d

    def operator(self, user: str = "tester", **kw: Any) -> Any:
        return self.env.transport(user, **kw)

    def round(self, on_open: Callable[[Any], None] | None = None, *, timeout: float = 90.0) -> list[Any]:
        """Run one round on the live gateway; ``on_open(announcement)`` runs (on its own thread) as soon as
        the round's announcement is out. Returns the round's metrics (empty when it produced no model)."""
        from edgeflow.protocol.rounds import RoundAnnouncement
        from edgeflow.transport.topics import gateway_topic

        self.wait_trainers()
        seen: list[Any] = []
        done = threading.Event()
        before = self.gw.store.last_round_id()
        for key in [k for k in self.accepted if k[0] > before]:  # round ids repeat after a wipe or restore
            self.accepted.pop(key, None)
            self.accepted_envelopes.pop(key, None)

        def on_round(msg: Any) -> None:
            if not msg.payload or done.is_set():
                return
            try:
                ann = RoundAnnouncement.verify(msg.payload, self.fleet_key.public_key)
            except Exception:  # noqa: BLE001 - a stale or odd retained message
                return
            if ann.state == "open" and ann.round_id > before and not seen:
                seen.append(ann)
                done.set()
                if on_open is not None:
                    threading.Thread(target=on_open, args=(ann,), daemon=True).start()

        spy = self.operator("admin", connect=False)
        spy.subscribe(str(gateway_topic(FLEET, "round")), on_round)
        spy.connect()
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.extend(self.gw.run_rounds(1)), daemon=True)
        t.start()
        t.join(timeout)
        assert not t.is_alive(), "the round did not end"
        self.last_announcement = seen[0] if seen else None
        return out

    def counters(self) -> dict[str, int]:
        return dict(self.gw.rounds.counters_total)

    def close(self) -> None:
        logging.getLogger("edgeflow").removeHandler(self.tb)
        for a in self.agents.values():
            try:
                a.crash()
            except Exception:  # noqa: BLE001 - teardown is best effort
                pass
        try:
            self.stop_gateway()
        except Exception:  # noqa: BLE001
            pass
        self.env.close()
        self.proxy.stop()
