"""Federated rounds over a faulty network: lossy/slow links, a 30 s site partition, a broker restart.

    python benchmarks/network_faults.py                       # all scenarios, 10 devices, 10 rounds
    python benchmarks/network_faults.py --scenarios clean lossy --json out.json
    python benchmarks/network_faults.py --store postgresql://postgres@127.0.0.1:5432/test

What runs: a real Mosquitto (persistence on, so a restart keeps sessions), the real gateway
(:class:`~edgeflow.gateway.rounds.RoundManager` on a SQLite or PostgreSQL state, connected to the
broker directly) and N real devices (:class:`~edgeflow.federated.Client`: each its own MQTT
connection with a persistent session, local training on a Dirichlet shard of scikit-learn's
digits, signed dense updates). The devices are two sites of N/2; each site reaches the broker
through its own listener of ``tests/_faultproxy.py`` (asyncio TCP proxy, loopback only: this
kernel has no netem). ``--max-payload`` (4 KB) makes every update (26 KB) and the global model
chunked, so resumption after a cut is exercised on every fault.

Scenarios (the same seed, data and configuration each time; only the network differs):

- ``clean``: both sites through a fault-free proxy;
- ``lossy``: site B (half the devices) has 200 +- 50 ms per segment and 10 % of segments lost
  (each loss stalls the stream one retransmission timeout, 200 ms doubling: what TCP makes of it);
- ``partition``: site A is cut off for ``--partition-s`` (30) seconds, starting in round 2 while
  an update is half transferred (the gateway holds some of its chunks);
- ``broker_restart``: Mosquitto is stopped at the same instant and started again ``--down-s`` later;
- ``model_cut``: the other direction: right after round 1 closes, site A's link is cut (one
  connection, deterministically at a byte count: ``FaultProxy.cut_after``) when half of the new
  retained, chunked global model has passed towards the device. The device reconnects, resumes its
  persistent session and must complete the same transfer from the chunks it kept plus the ones the
  broker still owed it (``model_cut`` in the result: chunks before the cut, after it, duplicates).

A round closes when every device reported or at its deadline with at least half of them
(``quorum 0.5``, ``min_clients N/2``). Reported per scenario: rounds completed (closed) out of
those run, time to the target accuracy (wall time from the first announcement to the end of the
first round whose global model reaches ``--target`` on the held-out split), total time, and the
accounting that shows nothing was lost or counted twice:

- every round's new model equals FedAvg (with the round's norm bound and sample cap) over the
  deltas of exactly the devices the gateway counted, each once (max abs. error reported);
- ``lost``: updates the broker acknowledged to a device at least 1 s before their round closed
  that the gateway did not count (must be 0);
- ``resent_frames`` / ``reconnects`` on the devices and the reassembler's duplicate chunks: the
  chunked transfers that were cut resumed (only unacknowledged frames are sent again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

FLEET = "faults"
SCENARIOS = ("clean", "lossy", "partition", "broker_restart", "model_cut")
LOSSY = {"delay_ms": 200.0, "jitter_ms": 50.0, "loss": 0.10}
FAST = {"reconnect_min_s": 0.1, "reconnect_max_s": 2.0, "connect_timeout_s": 5.0}


class _Recorded:
    """A device transport that notes when the broker acknowledged each update (all its chunks),
    and every global model it delivered (SHA-256, chunk count, transfer id, chunk counters then)."""

    def __init__(self, transport: Any, log: list[tuple[str, int, float]], device: str) -> None:
        self._t = transport
        self._log = log
        self._device = device
        self.round_of_next: int | None = None
        self.models: list[dict[str, Any]] = []
        self.update_sent: dict[int, threading.Event] = {}  # round -> set when this device sends its update

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def subscribe(self, topic: Any, handler: Any, **kw: Any) -> Any:
        if str(topic).endswith("/gateway/model"):
            inner = handler

            def handler(msg: Any, inner: Any = inner) -> Any:
                if msg.payload:
                    st = self._t.stats()
                    self.models.append({"sha256": hashlib.sha256(msg.payload).hexdigest(), "chunks": msg.chunks,
                                        "transfer_id": msg.transfer_id,
                                        "reassembly_chunks": st.get("reassembly_chunks", 0),
                                        "reassembly_duplicates": st.get("reassembly_duplicates", 0)})
                return inner(msg)
        return self._t.subscribe(topic, handler, **kw)

    def publish(self, topic: str, payload: Any, **kw: Any) -> Any:
        d = self._t.publish(topic, payload, **kw)
        if topic.endswith("/update") and self.round_of_next is not None:
            r = self.round_of_next
            self.update_sent.setdefault(r, threading.Event()).set()

            def done(dl: Any, r: int = r) -> None:
                if dl.succeeded:
                    self._log.append((self._device, r, time.time()))
            d.add_progress_callback(done)
            if d.succeeded:
                done(d)
        return d


def run_scenario(scenario: str, *, devices: int = 10, rounds: int = 10, target: float = 0.9,
                 store: str | None = None, seed: int = 0, max_payload: int = 4096, deadline_s: float = 10.0,
                 partition_s: float = 30.0, down_s: float = 3.0, workdir: str | Path | None = None,
                 epochs: int = 2, layers: tuple[int, ...] = (64, 64, 32, 10)) -> dict[str, Any]:
    import numpy as np

    from _faultproxy import FaultProxy, Faults
    from edgeflow import zoo
    from edgeflow.data.datasets import dirichlet_partition, load_digits
    from edgeflow.federated import Client
    from edgeflow.protocol.rounds import TrainConfig
    from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.gateway.strategies import bounded_mean
    from edgeflow.signing import KeyRing, PrivateKey, Signer
    from edgeflow.transport import MqttTransport
    from edgeflow.transport.broker import MosquittoBroker, find_mosquitto

    if scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    tmp = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"ef-faults-{scenario}-"))
    tmp.mkdir(parents=True, exist_ok=True)
    broker = MosquittoBroker(binary=find_mosquitto(), persistence=True, workdir=tmp / "broker").start()
    proxy = FaultProxy((broker.host, broker.port), seed=seed).start()
    ports = {"site-a": proxy.listen("site-a"),
             "site-b": proxy.listen("site-b", Faults(**LOSSY) if scenario == "lossy" else None)}
    fleet_key = PrivateKey.generate()
    model = zoo.mlp(tuple(layers), seed=seed)  # the default is zoo.digits_mlp's
    split = load_digits(seed=seed).flat()
    parts = dirichlet_partition(split.y_train, devices, alpha=1.0, seed=seed + 1)
    ring = KeyRing()
    acks: list[tuple[str, int, float]] = []
    # model_cut: the armed cut (model version, size, SHA-256, each device's chunk counters then) and
    # each device's chunk counters at its first disconnect after it (on the transport's worker
    # thread, in order with the messages it handled)
    cut: dict[str, Any] = {}
    cut_seen: dict[str, dict[str, int]] = {}

    def on_connection(did: str, t: Any, ev: Any) -> None:
        if cut and not ev.connected and did not in cut_seen:
            st = t.stats()
            cut_seen[did] = {"chunks": st.get("reassembly_chunks", 0),
                             "duplicates": st.get("reassembly_duplicates", 0)}
    deltas: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    clients: list[Client] = []
    recorders: list[_Recorded] = []
    site_of: dict[str, str] = {}
    for i, idx in enumerate(parts):
        did = f"d{i:02d}"
        site = "site-a" if i < devices // 2 else "site-b"
        site_of[did] = site
        s = Signer.generate(did)
        ring.register(did, s.public_key)
        t = MqttTransport("127.0.0.1", ports[site], client_id=f"{FLEET}-{did}", clean_start=False,
                          max_payload=max_payload, name=did, **FAST)
        rec = _Recorded(t, acks, did)
        recorders.append(rec)
        t.add_connection_listener(lambda ev, did=did, t=t: on_connection(did, t, ev))

        def hook(delta: dict, round_id: int, did: str = did, rec: _Recorded = rec) -> dict:
            deltas[(did, round_id)] = {k: np.array(v, dtype=np.float64) for k, v in delta.items()}
            rec.round_of_next = round_id
            return delta
        clients.append(Client(rec, fleet=FLEET, device_id=did, signer=s, fleet_key=fleet_key.public_key,
                              model=model, data=(split.x_train[idx], split.y_train[idx]), seed=seed * 100 + i,
                              transform_update=hook))
    state = store or str(tmp / "gateway.sqlite")
    gstore = GatewayStore(state)
    gt = MqttTransport(broker.host, broker.port, client_id=f"{FLEET}-gateway", clean_start=False,
                       max_payload=max_payload, name="gateway", **FAST)
    cfg = RoundConfig(rounds=rounds, min_clients=max(1, devices // 2), quorum=0.5, deadline_s=deadline_s,
                      max_extensions=0, strategy="fedavg", strategy_params={"stage": 0}, seed=seed,
                      wait_for_devices_s=30.0, publish_timeout_s=60.0,
                      train=TrainConfig(epochs=epochs, batch_size=16, lr=0.1, codec="dense"))
    counted: dict[int, list[str]] = {}
    closed_at: dict[int, float] = {}
    checks: list[float] = []
    befores: list[dict[str, np.ndarray]] = []
    history: list[Any] = []
    states: dict[int, str] = {}

    rm = RoundManager(gt, gstore, fleet=FLEET, fleet_key=fleet_key, keyring=ring, model=model, config=cfg,
                      candidates=lambda: [Candidate(c.device_id) for c in clients],
                      eval_data=(split.x_test, split.y_test))

    def on_round(m: Any) -> None:
        closed_at[m.round_id] = time.time()
        who = sorted(rm.open.snapshot().reported)
        counted[m.round_id] = who
        history.append(m)
        rec = gstore.round(m.round_id)
        states[m.round_id] = rec.state if rec is not None else "?"
        if states[m.round_id] == "closed" and befores:
            before = befores[-1]
            step = bounded_mean([deltas[(d, m.round_id)] for d in who],
                                [len(clients[int(d[1:])].x) for d in who],
                                m.extra.get("norm_bound"), m.extra.get("sample_cap"))
            err = max(float(np.max(np.abs(rm.weights[k].astype(np.float64) - (before[k].astype(np.float64)
                                                                                + step[k])))) for k in step)
            checks.append(err)
        befores.append({k: v.copy() for k, v in rm.weights.items()})
    rm.on_round = on_round

    if scenario == "model_cut":
        models_published: list[str] = []
        publish = rm.publish_reliably

        def publish_reliably(topic: str, payload: bytes, what: str, **kw: Any) -> bool:
            if topic.endswith("/gateway/model"):
                models_published.append(hashlib.sha256(payload).hexdigest())
                if len(models_published) == 2 and not cut:  # the model round 1 produced, as it goes out
                    counters = {c.device_id: c.transport.stats() for c in clients}
                    cut.update(version=rm.version, bytes=len(payload), sha256=models_published[-1],
                               next_round=gstore.last_round_id() + 1,
                               armed={d: {"chunks": st.get("reassembly_chunks", 0),
                                          "duplicates": st.get("reassembly_duplicates", 0)}
                                      for d, st in counters.items()})
                    proxy.cut_after("site-a", len(payload) // 2)
            return publish(topic, payload, what, **kw)
        rm.publish_reliably = publish_reliably

    fault_log: list[str] = []
    fault_error: list[BaseException] = []  # the fault itself failed (a broker that did not come back)
    fault_at: dict[str, Any] = {}  # when the fault fired: the round, the gateway's partial update then
    t_start = [time.time()]
    stop = threading.Event()

    def faults() -> None:
        # wait for round 2 to open (its announcement is what the devices follow)
        # mid-round 2, mid-transfer: the gateway holds a partly reassembled update (chunks on their way)
        # The trigger is an event (a device hands its round-2 update to its transport), not a poll of the
        # gateway: a poll could miss a short round on a loaded machine and report a run with no fault
        # in it as the fault's result. Then up to 0.5 s for the gateway to hold a partial update.
        sent = [rec.update_sent.setdefault(2, threading.Event()) for rec in recorders]
        while not stop.is_set() and not any(e.wait(0.05) for e in sent):
            pass
        if stop.is_set():
            return
        t_sent = time.monotonic()
        while gt.stats().get("reassembly_bytes", 0) == 0 and time.monotonic() - t_sent < 0.5:
            time.sleep(0.001)
        fault_at.update(round=2, gateway_partial_bytes=gt.stats().get("reassembly_bytes", 0))
        if scenario == "partition":
            fault_log.append(f"{time.time() - t_start[0]:.2f} s: site-a partitioned for {partition_s:g} s")
            proxy.partition("site-a", True)
            stop.wait(partition_s)
            proxy.partition("site-a", False)
            fault_log.append(f"{time.time() - t_start[0]:.2f} s: site-a healed")
        elif scenario == "broker_restart":
            fault_log.append(f"{time.time() - t_start[0]:.2f} s: broker stopped")
            try:
                broker.restart(down_s=down_s)
            except Exception as exc:  # re-raised by run_scenario: the rounds cannot go on without a broker
                fault_error.append(exc)
                rm.stop()
                return
            fault_log.append(f"{time.time() - t_start[0]:.2f} s: broker back")

    out: dict[str, Any] = {"scenario": scenario, "devices": devices, "rounds": rounds, "store": gstore.engine,
                           "max_payload": max_payload, "deadline_s": deadline_s, "layers": list(layers)}
    try:
        for c in clients:
            c.start()
            c.transport.connect(timeout=30)
        rm.start()
        gt.connect(timeout=30)
        befores.append({k: v.copy() for k, v in rm.weights.items()})
        ft = threading.Thread(target=faults, daemon=True)
        ft.start()
        t0 = t_start[0] = time.time()
        rm.run()
        total = time.time() - t0
        stop.set()
        ft.join(partition_s + 10)
        if fault_error:
            raise fault_error[0]
        if scenario in ("partition", "broker_restart") and not fault_at:
            raise RuntimeError(f"{scenario}: the fault was never injected (no device sent a round-2 update); "
                               "run at least 2 rounds")
        if scenario == "model_cut":
            time.sleep(1.0)  # whatever the broker still re-sends after the model (duplicates) is counted
        # -- accounting ----------------------------------------------------------------------
        lost = []
        for did, r, t_ack in acks:
            if r in closed_at and t_ack < closed_at[r] - 1.0 and did not in counted.get(r, ()):
                lost.append((did, r))
        twice = sum(len(v) - len(set(v)) for v in counted.values())
        reached = None
        for m in history:
            if states.get(m.round_id) == "closed" and m.accuracy is not None and m.accuracy >= target:
                reached = closed_at[m.round_id] - t0
                break
        dev_stats = [c.transport.stats() for c in clients]
        site_b = [s for c, s in zip(clients, dev_stats) if site_of[c.device_id] == "site-b"]
        site_a = [s for c, s in zip(clients, dev_stats) if site_of[c.device_id] == "site-a"]
        out.update({
            "rounds_completed": sum(1 for v in states.values() if v == "closed"),
            "rounds_failed": sum(1 for v in states.values() if v != "closed"),
            "participants": [m.participants for m in history],
            "accuracy": [None if m.accuracy is None else round(m.accuracy, 4) for m in history],
            "round_s": [round(m.round_s, 2) for m in history],
            "round_closed_at_s": [round(closed_at[m.round_id] - t0, 2) for m in history],
            "round_s_median": round(statistics.median(m.round_s for m in history), 2) if history else None,
            "total_s": round(total, 1),
            "target": target,
            "time_to_target_s": None if reached is None else round(reached, 1),
            "final_accuracy": None if not history or history[-1].accuracy is None else round(history[-1].accuracy, 4),
            "updates_acked": len(acks),
            "updates_counted": sum(len(v) for v in counted.values()),
            "late_at_gateway": sum(m.late for m in history),
            "duplicates_at_gateway": sum(m.duplicates for m in history),
            "counted_twice": twice,
            "lost": len(lost),
            "aggregate_max_abs_error": max(checks) if checks else None,
            "aggregate_checked_rounds": len(checks),
            "device_reconnects": {"site-a": sum(s.get("reconnects", 0) for s in site_a),
                                  "site-b": sum(s.get("reconnects", 0) for s in site_b)},
            "device_resent_frames": sum(s.get("resent_frames", 0) for s in dev_stats),
            "gateway_resent_frames": gt.stats().get("resent_frames", 0),
            "gateway_reconnects": gt.stats().get("reconnects", 0),
            "reassembly_duplicate_chunks": gt.stats().get("reassembly_duplicates", 0)
            + sum(s.get("reassembly_duplicates", 0) for s in dev_stats),
            "transfers_completed_devices": sum(s.get("transfers_completed", 0) for s in dev_stats),
            "proxy": dict(proxy.stats),
            "faults": fault_log,
            "fault_at": fault_at,
        })
        if scenario == "model_cut":
            out["model_cut"] = _model_cut_report(cut, cut_seen, clients, counted, dev_stats)
            if cut_seen:
                fault_log.append(f"site-a cut after {cut['bytes'] // 2} of model v{cut['version']}'s "
                                 f"{cut['bytes']} bytes: {', '.join(sorted(cut_seen))} disconnected")
    finally:
        stop.set()
        rm.stop()
        for c in clients:
            c.stop(timeout=2)
            c.transport.close(timeout=1, flush=False)
        gt.close(timeout=1, flush=False)
        proxy.stop()
        broker.stop()
        gstore.close()
    return out


def _model_cut_report(cut: dict[str, Any], seen: dict[str, dict[str, int]], clients: list[Any],
                      counted: dict[int, list[str]], dev_stats: list[dict[str, int]]) -> dict[str, Any]:
    """Per device the cut disconnected: how the half-delivered global model completed.

    ``chunks_before_cut``: chunks of the model the device handled before its disconnect;
    ``chunks_after_cut``: those it handled after it until the model was delivered; ``duplicates``:
    chunks it got twice until the model was delivered (re-sent by the broker: in flight,
    unacknowledged at the cut), ``duplicates_to_end`` until the end of the run. Resumed means
    ``chunks_before_cut + chunks_after_cut - duplicates == chunks`` with ``chunks_after_cut <
    chunks``: the same transfer finished from the kept chunks, not a restart from chunk 0.
    """
    if not cut:
        return {"armed": False}
    devices = {}
    for c, st in zip(clients, dev_stats):
        did = c.device_id
        if did not in seen:
            continue
        armed, at_cut = cut["armed"][did], seen[did]
        got = [m for m in c.transport.models if m["sha256"] == cut["sha256"]]
        d: dict[str, Any] = {"delivered": len(got), "reconnects": st.get("reconnects", 0),
                             "chunks_before_cut": at_cut["chunks"] - armed["chunks"],
                             "counted_next_round": counted.get(cut["next_round"], []).count(did)}
        if got:
            m = got[0]
            d.update(chunks=m["chunks"], chunks_after_cut=m["reassembly_chunks"] - at_cut["chunks"],
                     duplicates=m["reassembly_duplicates"] - armed["duplicates"])
        d["duplicates_to_end"] = st.get("reassembly_duplicates", 0) - armed["duplicates"]  # also those after delivery
        devices[did] = d
    return {"armed": True, "model_version": cut["version"], "model_bytes": cut["bytes"], "sha256": cut["sha256"],
            "cut_after_bytes": cut["bytes"] // 2, "next_round": cut["next_round"], "devices": devices}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--store", default=None, help="state URL (default: a SQLite file in a temp dir)")
    ap.add_argument("--max-payload", type=int, default=4096)
    ap.add_argument("--deadline-s", type=float, default=10.0)
    ap.add_argument("--partition-s", type=float, default=30.0)
    ap.add_argument("--down-s", type=float, default=3.0)
    ap.add_argument("--layers", default="64,64,32,10",
                    help="MLP layer sizes (the model's size: 64,256,64,10 makes the global model 135 KB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    rows = []
    for sc in args.scenarios:
        store = args.store
        if store and store.startswith("postgres"):
            import uuid

            store = f"{store}{'&' if '?' in store else '?'}schema=ef_bench_{uuid.uuid4().hex[:8]}"
        r = run_scenario(sc, devices=args.devices, rounds=args.rounds, target=args.target, store=store,
                         seed=args.seed, max_payload=args.max_payload, deadline_s=args.deadline_s,
                         partition_s=args.partition_s, down_s=args.down_s,
                         layers=tuple(int(x) for x in args.layers.split(",")))
        if store and store.startswith("postgres"):
            from edgeflow.gateway.store import GatewayStore

            s = GatewayStore(store)
            s.drop_schema()
            s.close()
        rows.append(r)
        print(json.dumps({k: r[k] for k in ("scenario", "rounds_completed", "time_to_target_s", "total_s",
                                            "participants", "lost", "counted_twice", "aggregate_max_abs_error",
                                            "device_resent_frames", "device_reconnects")}), flush=True)
    clean = next((r for r in rows if r["scenario"] == "clean"), None)
    for r in rows:
        if clean is not None and r is not clean and clean["time_to_target_s"] and r["time_to_target_s"]:
            r["time_to_target_vs_clean"] = round(r["time_to_target_s"] / clean["time_to_target_s"], 2)
    doc = {"benchmark": "network_faults", "rows": rows,
           "config": {"devices": args.devices, "rounds": args.rounds, "lossy": LOSSY, "partition_s": args.partition_s,
                      "down_s": args.down_s, "max_payload": args.max_payload, "deadline_s": args.deadline_s,
                      "layers": args.layers}}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    else:
        print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
