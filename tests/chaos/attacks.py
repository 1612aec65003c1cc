"""Issue 20's whole attack list, each a function of the live :class:`~arena.Arena` that returns a verdict.

``held``: every check passed. ``degraded``: the fleet survived but a secondary check failed (e.g. a
traceback logged, a resource not given back). ``broken``: a primary check failed or the attack raised.
The ids: A01-A08 held in the original run, B09-B26 are the findings (``F<n>``) that degraded or broke.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from arena import EVIL, FLEET, HONEST, PROFILE, SPARE, Arena, artifact

ATTACKS: list["Attack"] = []


@dataclass
class Attack:
    id: str
    finding: str
    title: str
    fn: Callable[["Checks", Arena], None]


@dataclass
class Checks:
    primary: list[str] = field(default_factory=list)
    secondary: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def must(self, ok: Any, what: str) -> bool:
        if not ok:
            self.primary.append(what)
        return bool(ok)

    def should(self, ok: Any, what: str) -> bool:
        if not ok:
            self.secondary.append(what)
        return bool(ok)

    @property
    def verdict(self) -> str:
        return "broken" if self.primary else "degraded" if self.secondary else "held"


def attack(id: str, finding: str, title: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        ATTACKS.append(Attack(id, finding, title, fn))
        return fn
    return deco


def run(a: Attack, arena: Arena) -> tuple[str, str, float]:
    """(verdict, detail, seconds) of one attack; tracebacks logged meanwhile make it degraded."""
    c = Checks()
    _ARENA[:] = [arena]
    n_tb = len(arena.tb.records)
    t0 = time.perf_counter()
    try:
        a.fn(c, arena)
    except Exception as exc:  # noqa: BLE001 - the attack broke something (or the harness): report it
        import traceback

        c.primary.append(f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
    new_tb = arena.tb.records[n_tb:]
    c.should(not new_tb, "tracebacks logged: " + "; ".join(f"{r.name}: {r.getMessage()}" for r in new_tb[:3]))
    try:
        if arena.gw is not None:
            c.should(arena.gw.transport.is_connected or wait_until(lambda: arena.gw.transport.is_connected, 20),
                     "gateway disconnected after the attack")
    except Exception:  # noqa: BLE001
        pass
    detail = "; ".join(c.primary + c.secondary + c.notes)
    return c.verdict, detail, time.perf_counter() - t0


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


# ------------------------------------------------------------------ helpers

def _topic(dev: str, ch: str) -> str:
    from edgeflow.transport.topics import device_topic

    return device_topic(FLEET, dev, ch).value


def _envelope(arena: Arena, ann: Any, tensors: dict[str, np.ndarray] | None = None, *, signer: Any = None,
              codec: str = "dense", sections: Any = None, seq: int | None = None, round_id: int | None = None,
              **meta: Any) -> bytes:
    from _secfleet import dense_sections, envelope

    signer = signer or arena.evil.signer
    md = {"num_samples": 77, "base_version": ann.model_version, "loss": 1.0,
          **({"round_nonce": ann.nonce} if ann.nonce else {}), **meta}
    md = {k: v for k, v in md.items() if v is not _DROP}
    if sections is None:
        sections = dense_sections(tensors if tensors is not None else _delta(arena))
    return envelope(signer, ann.round_id if round_id is None else round_id,
                    seq if seq is not None else _seq(), sections, metadata=md, codec=codec)


_DROP = object()
_ARENA: list[Arena] = []


def _seq() -> int:
    """A seq just above the compromised device's own client's, which then skips past it: a hostile update that
    is accepted never pushes the device's replay floor above its honest client's next updates."""
    cl = _ARENA[0].client(EVIL)
    cl._seq += 2
    return cl._seq - 1


def _delta(arena: Arena, scale: float = 1e-3, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in arena.gw.rounds.weights.items()}


def _ok(m: list[Any]) -> bool:
    """The round produced a model (a failed round returns metrics too, marked failed)."""
    return bool(m) and not m[0].extra.get("failed")


def _finite(arena: Arena) -> bool:
    from edgeflow.gateway.rounds import model_weights

    return all(np.isfinite(v).all() for v in model_weights(arena.gw.rounds.current_model()).values())


def _ping(arena: Arena, dev: str = HONEST[0], timeout: float = 30) -> bool:
    try:
        return arena.gw.fleet.command(dev, "status", timeout_s=timeout).ok
    except Exception:  # noqa: BLE001
        return False


def _junk_chunk(total: int, index: int = 0, chunk_size: int = 64 * 1024, *, magic: bytes = b"EFCK",
                count: int | None = None, tid: bytes | None = None) -> bytes:
    data = os.urandom(min(chunk_size, total))
    count = -(-total // chunk_size) if count is None else count
    return struct.pack("!4sBB2x16sIIQI32sI", magic, 1, 0, tid or os.urandom(16), index, count, total, chunk_size,
                       os.urandom(32), zlib.crc32(data)) + data


def _evil_round(arena: Arena, send: Callable[[Any], None]) -> tuple[list[Any], Any, int | None]:
    """One round in which the compromised device sends ``send(announcement)`` before its own honest update
    (its client waits 2.5 s). Returns the metrics, the announcement and the num_samples of the update the
    gateway accepted from the compromised device (None if none); ``arena.last_stored`` holds the round's
    accepted envelopes by device."""
    sent = threading.Event()

    def on_open(ann: Any) -> None:
        try:
            send(ann)
        finally:
            sent.set()

    metrics = arena.round(on_open)
    sent.wait(30)
    ann = arena.last_announcement
    rid = ann.round_id if ann is not None else -1
    arena.last_stored = {d: _Stored(arena.accepted[(r, d)], env) for (r, d), env in arena.accepted_envelopes.items()
                         if r == rid}
    return metrics, ann, arena.accepted.get((rid, EVIL))


@dataclass
class _Stored:
    num_samples: int
    envelope: bytes


# ------------------------------------------------------------------ A01-A08: held in the original run

@attack("A01", "-", "fuzzing every topic")
def a01_fuzz(c: Checks, arena: Arena) -> None:
    rng = np.random.default_rng(1)
    before = arena.gw.fleet.stats()
    chans = ("birth", "death", "telemetry", "update", "cmd/ack", "secagg", "infer/reply")
    for ch in chans:
        for i in range(15):
            kind = i % 5
            payload = (bytes(rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8)) if kind == 0 else
                       b'{"v":1,"ctx":"x","body":"{}","sig":"00"}' if kind == 1 else
                       json.dumps({"device": EVIL, "bdseq": int(rng.integers(-5, 5)), "x": [None] * 5}).encode()
                       if kind == 2 else b"\x00" * int(rng.integers(1, 100)) if kind == 3 else b"null")
            arena.evil_publish(ch, payload, qos=1)
    arena.evil_publish("update/_chunk/0", os.urandom(500), raw=True)
    c.must(_ping(arena), "the gateway stopped answering")
    c.must(arena.gw.fleet.is_online(EVIL), "garbage on the compromised device's topics took it offline")
    after = arena.gw.fleet.stats()
    num = lambda d: sum(v for v in d.values() if isinstance(v, (int, float)))  # noqa: E731
    c.should(num(after) > num(before), "nothing was counted")


@attack("A02", "-", "chunk-header checks")
def a02_chunk_headers(c: Checks, arena: Arena) -> None:
    gt = arena.gw.transport
    bad0 = gt.stats().get("chunks_bad", 0)
    frames = [
        _junk_chunk(100_000, magic=b"XXXX"),               # bad magic
        _junk_chunk(100_000, index=9, count=2),            # index beyond count
        _junk_chunk(1 << 40),                              # 1 TiB declared
        _junk_chunk(100_000)[:30],                         # truncated header
        _junk_chunk(10, count=0),                          # zero chunks
    ]
    bad = bytearray(_junk_chunk(100_000))
    bad[-1] ^= 0xFF                                        # crc mismatch
    frames.append(bytes(bad))
    for i, f in enumerate(frames):
        arena.evil_publish(f"update/_chunk/{i}", f, raw=True)
    c.must(wait_until(lambda: gt.stats().get("chunks_bad", 0) - bad0 >= 5, 10),
           f"malformed chunks not refused: {gt.stats()}")
    c.must(gt.stats().get("reassembly_bytes", 0) < 64 << 20, "junk headers pinned memory")
    c.must(_ping(arena), "the gateway stopped answering")


@attack("A03", "-", "replayed and reordered updates")
def a03_replay(c: Checks, arena: Arena) -> None:
    got: dict[str, Any] = {}

    def send(ann: Any) -> None:
        older, newer = _seq(), _seq()
        got["first"] = _envelope(arena, ann, seq=newer)
        arena.evil_publish("update", got["first"])
        arena.evil_publish("update", got["first"])                          # the same again
        arena.evil_publish("update", _envelope(arena, ann, seq=older, num_samples=78))  # an older seq after it
        got["ann"] = ann

    m, ann, ns = _evil_round(arena, send)
    c.must(_ok(m), "the round produced no model")
    c.must(m and m[0].participants == 4, f"participants {m[0].participants if m else None}, want 4")
    c.must(ns == 77, f"the first valid update was not the one kept (num_samples {ns})")
    # the captured update replayed into the next round
    def replay(ann2: Any) -> None:
        arena.evil_publish("update", got["first"])
    m2, ann2, ns2 = _evil_round(arena, replay)
    c.must(_ok(m2), "the next round produced no model")
    c.must(ns2 is not None and ns2 != 77, f"a replayed update was accepted into a later round ({ns2})")


@attack("A04", "-", "forged and wrong-key signatures")
def a04_signatures(c: Checks, arena: Arena) -> None:
    from edgeflow.protocol.fleet import Birth
    from edgeflow.signing import PrivateKey, Signer

    stranger = Signer("dev-03", PrivateKey.generate())
    bb = arena.gw.fleet.stats().get("births_bad", 0)
    fake_birth = Birth(EVIL, FLEET, PROFILE, arena.evil.bdseq + 100, stranger.public_key.hex, seq=99)
    arena.evil_publish("birth", fake_birth.sign(stranger.key))
    c.must(wait_until(lambda: arena.gw.fleet.stats().get("births_bad", 0) > bb, 10), "a wrongly signed birth passed")

    def send(ann: Any) -> None:
        arena.evil_publish("update", _envelope(arena, ann, signer=stranger))            # wrong key
        arena.evil_publish("update", _envelope(arena, ann, signer=Signer("dev-00", arena.evil.signer.key)))  # spoof
        raw = bytearray(_envelope(arena, ann))
        raw[len(raw) // 2] ^= 1                                                         # a flipped bit
        arena.evil_publish("update", bytes(raw))

    m, ann, ns = _evil_round(arena, send)
    c.must(_ok(m), "the round produced no model")
    c.must(ns is not None and ns != 77, f"a forged update was accepted ({ns})")
    c.must(arena.gw.fleet.is_online(EVIL) and (arena.gw.fleet.birth(EVIL).bdseq == arena.evil.bdseq),
           "a forged birth changed the registry")


@attack("A05", "-", "16 kinds of bad values")
def a05_bad_values(c: Checks, arena: Arena) -> None:
    n_sent = []

    def send(ann: Any) -> None:
        w = _delta(arena)
        k0 = sorted(w)[0]

        def with_(v: Any) -> dict[str, np.ndarray]:
            d = dict(w)
            d[k0] = v
            return d
        shape = w[k0].shape
        variants = [
            dict(tensors=with_(np.full(shape, np.nan, np.float32))),
            dict(tensors=with_(np.full(shape, np.inf, np.float32))),
            dict(tensors=with_(np.full(shape, -np.inf, np.float32))),
            dict(tensors=with_(np.full(shape, 3e38, np.float32))),
            dict(tensors=with_(np.zeros((3, 3), np.float32))),                      # wrong shape
            dict(tensors={**w, "no_such_weight": np.zeros(3, np.float32)}),        # unknown tensor
            dict(round_id=ann.round_id + 1000),                                    # another round
            dict(base_version=ann.model_version - 1),                              # stale base
            dict(num_samples=0),
            dict(num_samples=1.5),
            dict(num_samples=True),
            dict(num_samples=-5),
            dict(loss="x"),
            dict(loss=float("nan")),
            dict(round_nonce="00" * 8),                                            # another round's nonce
            dict(seq=(1 << 63) + 5),                                               # above the store's 64 bits
        ]
        for v in variants:
            try:
                arena.evil_publish("update", _envelope(arena, ann, **v))
                n_sent.append(1)
            except Exception as exc:  # noqa: BLE001 - a variant the builder itself refuses is not sent
                c.notes.append(f"not sent: {exc}")

    r0 = sum(v for k, v in arena.counters().items() if k.startswith(("rejected", "late")))
    m, ann, ns = _evil_round(arena, send)
    c.must(_ok(m), "the round produced no model")
    c.must(ns is not None and ns != 77, f"a bad value was accepted ({ns})")
    c.must(_finite(arena), "the model is not finite")
    refused = sum(v for k, v in arena.counters().items() if k.startswith(("rejected", "late"))) - r0
    c.must(refused >= len(n_sent), f"{refused} of {len(n_sent)} bad updates counted as refused")
    c.must(len(n_sent) >= 15, f"only {len(n_sent)} of 16 variants could be sent")


@attack("A06", "-", "the ACL")
def a06_acl(c: Checks, arena: Arena) -> None:
    from edgeflow.errors import TransportError

    seen: list[Any] = []
    spy = arena.operator("tester", connect=False)
    for t in (_topic(HONEST[0], "update"), _topic(HONEST[0], "cmd"), f"edgeflow/{FLEET}/gateway/model",
              f"edgeflow/{FLEET}/gateway/round", "edgeflow/other/dev-03/update"):
        spy.subscribe(t, seen.append)
    spy.connect()
    t = arena.evil.transport
    marker = b"EVIL-" + os.urandom(8)
    for topic in (_topic(HONEST[0], "update"), _topic(HONEST[0], "cmd"), f"edgeflow/{FLEET}/gateway/model",
                  f"edgeflow/{FLEET}/gateway/round", "edgeflow/other/dev-03/update"):
        try:
            t.publish(topic, marker, qos=1, raw=True).wait(10)
        except TransportError:
            pass  # MQTT 5: the broker says "not authorized"
    stolen: list[Any] = []
    t.subscribe(_topic(HONEST[0], "cmd"), stolen.append)
    time.sleep(0.3)
    c.must(_ping(arena, HONEST[0]), "the honest device stopped answering")
    time.sleep(0.5)
    c.must(not [m for m in seen if m.payload == marker], "a publish outside the device's subtree passed the ACL")
    c.must(not stolen, "the device read another device's commands")
    arena.evil_publish("telemetry", json.dumps({"device": EVIL, "ts": time.time()}), qos=1)


@attack("A07", "-", "tampered artifacts and path traversal")
def a07_artifacts(c: Checks, arena: Arena) -> None:
    from edgeflow.artifact import build_artifact
    from edgeflow.signing import PrivateKey

    from _fleet import mlp_bytes

    dev = HONEST[2]
    a = arena.agents[dev]
    v0 = a.model_version
    good = artifact(arena.env, 50, seed=1)
    tampered = bytearray(good)
    tampered[len(tampered) // 2] ^= 0x40
    other = build_artifact(mlp_bytes(1), version=51, profile=PROFILE, key=PrivateKey.generate(), fleet=FLEET)
    traversal = build_artifact(mlp_bytes(1), version=52, profile="../../../../tmp/edgeflow-chaos", key=arena.fleet_key,
                               fleet=FLEET)
    codes = []
    for art, v in ((bytes(tampered), 50), (other, 51), (traversal, 52)):
        r = arena.gw.fleet.send_ota(dev, art, version=v).wait(30)
        codes.append(r.code)
        c.must(not r.ok, f"artifact v{v} was installed")
    c.must(a.model_version == v0, f"the device left v{v0}")
    c.must(not Path("/tmp/edgeflow-chaos").exists(), "a file was written outside the state directory")
    c.notes.append(f"codes {codes}")


@attack("A08", "-", "kill -9 with 3 of 4 updates stored; a full disk; a connection storm")
def a08_host_faults(c: Checks, arena: Arena) -> None:
    # (1) kill -9 with 3 of 4 updates stored: the real `edgeflow gateway` process, killed at that step
    r = _gateway_process(arena, "rounds.update_stored@{next}:3")
    c.must(r.returncode == 137, f"the gateway process did not die where asked (rc {r.returncode}): {r.stdout[-800:]}")
    arena.start_gateway()
    rec = [x for x in arena.gw.store.rounds() if x.state == "open"]
    m = arena.gw.run_rounds(1) if rec else []
    c.must(rec and m and m[0].participants >= 3, f"the open round was not finished after the restart: {m}")
    # (2) a full disk: SQLite refuses every write that needs a new page (SQLITE_FULL) while a round runs
    db = _sqlite_of(arena.gw.store)
    if c.must(db is not None, "cannot reach the state's SQLite connection"):
        rm = arena.gw.rounds
        # under the store's lock: the gateway's threads share this connection, and VACUUM inside one of their
        # transactions fails ("cannot VACUUM from within a transaction": once in a clean-clone CI run)
        with arena.gw.store._lock:
            db.execute("VACUUM")  # no free pages left to reuse
            pages = db.execute("PRAGMA page_count").fetchone()[0]
            db.execute(f"PRAGMA max_page_count = {pages}")
        s0 = arena.counters().get("rejected_store", 0)
        keep = rm.config.deadline_s
        rm.config.deadline_s = 4.0
        try:
            for i in range(50):
                arena.evil_publish("telemetry", json.dumps({"device": EVIL, "ts": time.time(), "seq": i,
                                                            "battery": 0.5}), qos=1)
            m_full = arena.round()
            c.must(_ping(arena), "the gateway stopped answering on a full disk")
        finally:
            db.execute("PRAGMA max_page_count = 1073741823")
            rm.config.deadline_s = keep
        refused = arena.counters().get("rejected_store", 0) - s0
        c.must(refused > 0, "the disk never looked full to the gateway (nothing was tested)")
        c.must(not _ok(m_full), "a round stored a model on a full disk")
        c.notes.append(f"full disk: {refused} updates refused by the store, the round failed cleanly")
        m = arena.round()
        c.must(_ok(m), "no round after the disk had room again")
    # (3) a connection storm: 150 connects with wrong passwords and 30 with the compromised device's own
    import paho.mqtt.client as mqtt  # the storm is raw connects, not edgeflow transports

    def storm(i: int) -> None:
        cl = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"storm-{i}", protocol=mqtt.MQTTv5)
        cl.tls_set(ca_certs=arena.env.ca)
        cl.username_pw_set(f"dev-0{i % 8}", "wrong")
        try:
            cl.connect("127.0.0.1", arena.env.broker.port, 5)
            cl.loop(0.2)
            cl.disconnect()
        except Exception:  # noqa: BLE001 - refused is the expected outcome
            pass
    ths = [threading.Thread(target=storm, args=(i,)) for i in range(150)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    c.must(_ping(arena), "the gateway stopped answering after the storm")
    c.must(arena.gw.fleet.wait_online(list(HONEST), 20), "honest devices went offline in the storm")


def _sqlite_of(store: Any) -> Any:
    import sqlite3

    for obj in (store, *vars(store).values()):
        for v in ([obj] + list(getattr(obj, "__dict__", {}).values())):
            if isinstance(v, sqlite3.Connection):
                return v
    return None


def _gateway_process(arena: Arena, faults: str, rounds: int = 1) -> subprocess.CompletedProcess:
    """Stop the in-process gateway; run `edgeflow gateway` as its own process with EDGEFLOW_FAULTS."""
    nxt = arena.gw.store.last_round_id() + 1
    arena.wait_trainers()
    arena.stop_gateway()
    env = {**os.environ, "EDGEFLOW_FAULTS": faults.format(next=nxt)}
    return subprocess.run([sys.executable, "-m", "edgeflow", "gateway", "-c", str(arena.toml), "--broker",
                           arena.gw_url, "--rounds", str(rounds)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)


# ------------------------------------------------------------------ B09-B26: the findings

@attack("B09", "F1", "Inf-decoding update (int8 scale 3e38, q=127; dense 1e37)")
def b09_inf(c: Checks, arena: Arena) -> None:
    from _secfleet import int8_sections

    def send(ann: Any) -> None:
        shapes = {k: v.shape for k, v in arena.gw.rounds.weights.items()}
        arena.evil_publish("update", _envelope(arena, ann, codec="int8", sections=int8_sections(shapes, 3e38, 127)))
        arena.evil_publish("update", _envelope(arena, ann, {k: np.full(s, 1e37, np.float32) for k, s in shapes.items()}))

    m, ann, ns = _evil_round(arena, send)
    c.must(_ok(m), "the round produced no model")
    c.must(_finite(arena), "the stored model is not finite")
    c.must(ns is not None and ns != 77, f"an Inf-decoding update was accepted ({ns})")
    c.must(arena.gw.rounds.publish_model(), "the model could not be published")


@attack("B10", "F2", "kill -9 between storing the round's model and closing the round")
def b10_kill_at_commit(c: Checks, arena: Arena) -> None:
    from edgeflow.errors import StateError

    r = _gateway_process(arena, "store.finish_round")
    c.must(r.returncode == 137, f"the gateway process did not die where asked (rc {r.returncode}): {r.stdout[-800:]}")
    try:
        arena.start_gateway()
    except StateError as exc:
        c.must(False, f"the restart refused to start: {exc}")
        return
    st = arena.gw.store
    versions = [mv["version"] for mv in st.model_versions()]
    c.must(len(versions) == len(set(versions)), "duplicate model versions")
    m = arena.gw.run_rounds(1)
    c.must(_ok(m), "no round after the restart")
    c.must(not st.open_rounds(), "a round stayed open")


@attack("B11", "F3", "bad metadata (loss \"x\", negative num_samples) before a valid update")
def b11_metadata(c: Checks, arena: Arena) -> None:
    def send(ann: Any) -> None:
        arena.evil_publish("update", _envelope(arena, ann, loss="x"))
        arena.evil_publish("update", _envelope(arena, ann, num_samples=-5))

    m, ann, ns = _evil_round(arena, send)
    c.must(_ok(m), "the round produced no model")
    c.must(ns is not None and ns > 0 and ns != 77,
           f"the device's later valid update was not counted (its bad one was stored: {ns})")
    c.must(m and m[0].participants == 4, f"participants {m[0].participants if m else None}, want 4")


@attack("B12", "F4", "a stalled broker (publishes wait for their acks)")
def b12_stall(c: Checks, arena: Arena) -> None:
    out: list[Any] = []
    arena.wait_trainers()
    arena.proxy.partition("gateway", True)        # nothing passes: the round's announcement waits for its PUBACK
    t = threading.Thread(target=lambda: out.extend(arena.round()), daemon=True)
    t.start()
    time.sleep(8.0)                                # 4x publish_timeout_s
    c.must(t.is_alive() or out, "the round gave up during the stall")
    arena.proxy.partition("gateway", False)
    t.join(90)
    c.must(_ok(out), "no round after the stall")
    c.should(any("not acknowledged" in w or "waiting" in w for w in arena.tb.warnings[-200:]),
             "the wait was not logged")


@attack("B13", "F4", "one device floods telemetry")
def b13_flood(c: Checks, arena: Arena) -> None:
    fm = arena.gw.fleet
    r0 = fm.stats().get("telemetry_rate_limited", 0)
    t = arena.evil.transport
    body = json.dumps({"device": EVIL, "ts": time.time(), "seq": 1, "battery": 0.5}).encode()
    end = time.monotonic() + 3.0
    n = 0
    while time.monotonic() < end:
        t.publish(_topic(EVIL, "telemetry"), body, qos=0, raw=True)
        n += 1
    t.flush(20)
    t0 = time.monotonic()
    c.must(_ping(arena, HONEST[1]), "the gateway stopped answering during the flood")
    c.notes.append(f"{n} messages in 3 s; command answered in {time.monotonic() - t0:.1f} s")
    c.must(fm.stats().get("telemetry_rate_limited", 0) > r0, "the flood was not rate-limited")
    rows = arena.gw.store.telemetry(EVIL, limit=100_000)
    c.must(len(rows) <= arena.gw.store.telemetry_keep, f"{len(rows)} telemetry rows kept")


@attack("B14", "F5", "a broker-side timeout (will published, device reconnects)")
def b14_bdseq(c: Checks, arena: Arena) -> None:
    from edgeflow.device.agent import AgentOptions, DeviceAgent

    dev = SPARE[0]
    port = arena.proxy.listen(f"dev-{dev}")
    a = DeviceAgent.from_credentials(arena.fd.device_dir(dev), broker=f"mqtts://127.0.0.1:{port}", profile=PROFILE,
                                     state_dir=arena.root / "state" / dev,
                                     options=AgentOptions(telemetry_interval_s=0.5, health_runs=1), keepalive=2,
                                     reconnect_min_s=0.05, reconnect_max_s=0.5, connect_timeout_s=5)
    fm = arena.gw.fleet
    try:
        a.start(timeout=20)
        c.must(fm.wait_online([dev], 15), "the device did not come online")
        first = a.bdseq
        arena.proxy.partition(f"dev-{dev}", True)
        c.must(wait_until(lambda: not fm.is_online(dev), 30), "the broker's will did not take it offline")
        arena.proxy.partition(f"dev-{dev}", False)
        back = wait_until(lambda: fm.is_online(dev) and a.bdseq > first, 30)
        c.must(back, "the device stayed offline after reconnecting")
        time.sleep(1.0)
        c.must(fm.is_online(dev), "a late copy of the old will took it offline again")
    finally:
        a.crash()


@attack("B15", "F6", "poisoning under default FedAvg (x1000 delta, 10^6 claimed samples)")
def b15_poison(c: Checks, arena: Arena) -> None:
    from edgeflow.codecs import decode_update
    from edgeflow.gateway.rounds import model_weights

    w0 = {k: v.copy() for k, v in model_weights(arena.gw.rounds.current_model()).items()}

    def send(ann: Any) -> None:
        arena.evil_publish("update", _envelope(arena, ann, _delta(arena, scale=1.0, seed=3), num_samples=1_000_000))

    m, ann, ns = _evil_round(arena, send)
    c.must(_ok(m), "the round produced no model")
    w1 = model_weights(arena.gw.rounds.current_model())
    step = float(np.sqrt(sum(float(((w1[k] - w0[k]) ** 2).sum()) for k in w0)))
    honest = []
    for dev, u in arena.last_stored.items():
        if dev != EVIL:
            upd = decode_update(u.envelope, verifier=arena.gw.fleet.keyring, require_signature=True)
            honest.append(float(np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in upd.tensors.values()))))
    c.notes.append(f"global step {step:.3f}, honest norms {[round(h, 3) for h in honest]}, "
                   f"clipped {m[0].extra.get('clipped') if m else None}, capped {m[0].extra.get('capped') if m else None}")
    c.must(ns == 1_000_000, f"the attack did not get in (nothing was tested): {ns}")
    c.must(honest and step <= 1.5 * max(honest), "the attacker's update dominated the model")


@attack("B16", "F6", "a round below min_clients (only the attacker reports)")
def b16_min_clients(c: Checks, arena: Arena) -> None:
    rm = arena.gw.rounds
    keep = rm.config.deadline_s
    honest = [arena.client(d) for d in HONEST]
    delays = [h.delay_s for h in honest]
    rm.config.deadline_s = 4.0
    for h in honest:
        h.delay_s = 6.0
    try:
        def send(ann: Any) -> None:
            arena.evil_publish("update", _envelope(arena, ann, num_samples=50))
        v0 = rm.version
        m, ann, ns = _evil_round(arena, send)
    finally:
        rm.config.deadline_s = keep
        for h, d in zip(honest, delays):
            h.delay_s = d
    rec = arena.gw.store.round(ann.round_id)
    c.must(_ok(m) is False and rm.version == v0, "a round with 1 of 4 updates produced a model")
    c.must(rec is not None and rec.state == "failed" and "min_clients" in json.dumps(rec.metrics),
           f"the round's record does not say why: {rec}")
    time.sleep(3.0)  # the honest devices' late updates arrive and are dropped


@attack("B17", "F7", "replayed OTA offer and rollback after an agent restart")
def b17_replay_ota(c: Checks, arena: Arena) -> None:
    from edgeflow.gateway.ota import RolloutPolicy

    dev = HONEST[1]
    fm = arena.gw.fleet
    offers: list[Any] = []
    cmds: list[Any] = []
    spy = arena.operator("tester", connect=False)  # an eavesdropper with operator read access
    spy.subscribe(_topic(dev, "ota"), offers.append)
    spy.subscribe(_topic(dev, "cmd"), cmds.append)
    spy.connect()
    base = max(arena.agents[dev].model_version or 1, 1)
    v3, v4 = base + 101, base + 102
    c.must(fm.send_ota(dev, artifact(arena.env, v3, seed=1), version=v3).wait(30).ok, "deploy v3")
    c.must(fm.send_ota(dev, artifact(arena.env, v4, seed=1), version=v4).wait(30).ok, "deploy v4")
    r = fm.send_command(dev, "rollback", {"from_version": v4}, ttl_s=RolloutPolicy().rollback_ttl_s).wait(30)
    c.must(r.ok, "rollback")
    c.must(fm.send_ota(dev, artifact(arena.env, v4, seed=1), version=v4).wait(30).ok, "deploy v4 again")
    wait_until(lambda: len(offers) >= 3 and any(m.payload for m in cmds), 10)
    captured = [m.payload for m in offers][:1] + [m.payload for m in cmds if m.payload][-1:]
    a = arena.start_agent(dev)              # restart: nothing in memory survives
    c.must(fm.wait_online([dev], 20) and a.model_version == v4, "the restarted agent is not on v4")
    spy.publish(_topic(dev, "ota"), captured[0]).wait(10)
    spy.publish(_topic(dev, "cmd"), captured[1]).wait(10)
    time.sleep(2.0)
    c.must(a.model_version == v4, f"a replay moved the device to v{a.model_version}")
    c.must(a.counters["deploys"] == 0 and a.counters["rollbacks"] == 0, f"a replay ran: {a.counters}")
    arena.wait_trainers()


def _open_fleet(arena: Arena) -> tuple[Any, Any, Any, Any]:
    """An anonymous Mosquitto (anyone publishes anywhere), a FleetManager with the fleet's key ring and one
    real agent on it."""
    from edgeflow.device.agent import AgentOptions, DeviceAgent
    from edgeflow.gateway.fleet import FleetManager, FleetOptions
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.transport.broker import MosquittoBroker, find_mosquitto
    from edgeflow.transport.mqtt import MqttTransport

    broker = MosquittoBroker(binary=find_mosquitto()).start()
    gt = MqttTransport(broker.host, broker.port, client_id="open-gw", reconnect_min_s=0.05, reconnect_max_s=0.5)
    fm = FleetManager(gt, GatewayStore(":memory:"), FLEET, arena.fleet_key, FleetOptions(),
                      keyring=arena.fd.keyring(), keyring_loader=arena.fd.keyring)
    fm.start()
    gt.connect()
    dev = SPARE[1]
    a = DeviceAgent.from_credentials(arena.fd.device_dir(dev), broker=broker.url, profile=PROFILE,
                                     state_dir=arena.root / "open" / dev,
                                     options=AgentOptions(telemetry_interval_s=0.5, health_runs=1),
                                     reconnect_min_s=0.05, reconnect_max_s=0.5)
    a.start(timeout=20)
    return broker, fm, gt, a


@attack("B18", "F8", "open broker: 50 fake births (round selection, deploy targets)")
def b18_fake_births(c: Checks, arena: Arena) -> None:
    from edgeflow.protocol.fleet import Birth
    from edgeflow.signing import PrivateKey
    from edgeflow.transport.mqtt import MqttTransport

    broker, fm, gt, a = _open_fleet(arena)
    att = MqttTransport(broker.host, broker.port, client_id="attacker").connect()
    try:
        c.must(fm.wait_online([a.device_id], 15), "the real device did not come online")
        k = PrivateKey.generate()
        for i in range(50):
            fake = f"fake-{i:02d}"
            b = Birth(fake, FLEET, PROFILE, int(time.time() * 1000), k.public_key.hex, can_train=True, seq=1)
            att.publish(_topic(fake, "birth"), b.sign(k), retain=True)
            att.publish(_topic(fake, "birth"), json.dumps({"device": fake, "bdseq": 1, "profile": PROFILE}))
        att.flush(10)
        c.must(wait_until(lambda: fm.stats().get("births_unknown", 0) >= 50, 15), f"not counted: {fm.stats()}")
        time.sleep(0.5)
        c.must([r.device_id for r in fm.devices()] == [a.device_id], "fake ids were registered")
        c.must([x.device_id for x in fm.round_candidates()] == [a.device_id], "a round would select fake ids")
        from edgeflow.gateway.ota import select_devices

        targets = select_devices(fm.devices(), "all", online=fm.is_online)
        c.must([getattr(t, "device_id", t) for t in targets] == [a.device_id], f"deploy would target {targets}")
    finally:
        for i in range(50):
            att.publish(_topic(f"fake-{i:02d}", "birth"), b"", retain=True)
        att.close(timeout=1)
        a.crash()
        fm.stop()
        gt.close(timeout=1)
        broker.stop()


@attack("B19", "F8", "open broker: a forged death of a live device")
def b19_forged_death(c: Checks, arena: Arena) -> None:
    from edgeflow.protocol.fleet import Death
    from edgeflow.signing import PrivateKey
    from edgeflow.transport.mqtt import MqttTransport

    broker, fm, gt, a = _open_fleet(arena)
    att = MqttTransport(broker.host, broker.port, client_id="attacker").connect()
    try:
        dev = a.device_id
        c.must(fm.wait_online([dev], 15), "the real device did not come online")
        att.publish(_topic(dev, "death"), json.dumps({"device": dev, "bdseq": a.bdseq + 10, "reason": "lost"}))
        att.publish(_topic(dev, "death"), Death(dev, a.bdseq + 10).sign(PrivateKey.generate())).wait(10)
        c.must(wait_until(lambda: fm.stats().get("deaths_bad", 0) >= 2, 10), f"not refused: {fm.stats()}")
        time.sleep(0.5)
        c.must(fm.is_online(dev), "a forged death took the live device offline")
    finally:
        att.close(timeout=1)
        a.crash()
        fm.stop()
        gt.close(timeout=1)
        broker.stop()


@attack("B20", "F9", "a 100 MB message (broker packet limit, bounded telemetry)")
def b20_big_message(c: Checks, arena: Arena) -> None:
    conf = (arena.fd.broker_dir / "mosquitto.conf").read_text()
    c.must("max_packet_size" in conf, "the generated config sets no max_packet_size")
    from edgeflow.errors import TransportError
    from edgeflow.transport.mqtt import MqttTransport
    from edgeflow.transport.message import TlsConfig

    dev = SPARE[2]
    creds = json.loads((arena.fd.device_dir(dev) / "device.json").read_text())
    t = MqttTransport.from_url(arena.env.url, client_id=dev, username=dev, password=creds["password"],
                               tls=TlsConfig(ca_file=arena.env.ca), max_payload=128 << 20,
                               reconnect_min_s=0.05, reconnect_max_s=0.5)
    t.connect()
    try:
        rss0 = _rss_mb()
        try:
            t.publish(_topic(dev, "telemetry"), b"{" + b" " * (100 << 20) + b"}", raw=True).wait(20)
            refused = False
        except TransportError:
            refused = True
        c.must(refused, "the broker took a 100 MB packet")
        c.should(_rss_mb() - rss0 < 400, f"gateway process grew by {_rss_mb() - rss0:.0f} MB")
        c.must(_ping(arena), "the gateway stopped answering")
        rows = arena.gw.store.telemetry(dev, limit=100_000)
        c.must(all(len(json.dumps(r[1])) < 4096 for r in rows), "a huge telemetry row was stored")
    finally:
        t.close(timeout=1, flush=False)


def _rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@attack("B21", "F9", "junk transfers from one device while the others' chunked updates are under way")
def b21_junk_transfers(c: Checks, arena: Arena) -> None:
    gt = arena.gw.transport

    def send(ann: Any) -> None:
        for _ in range(40):  # 40 transfers of 16 MB declared each (640 MB): only their first chunks
            arena.evil_publish("update/_chunk/0", _junk_chunk(16 << 20), raw=True)

    m, ann, ns = _evil_round(arena, send)
    c.must(m and m[0].participants == 4, f"an honest chunked update was lost: {m[0].participants if m else None}")
    held = gt.stats().get("reassembly_bytes", 0)
    c.must(held <= 130 << 20, f"one device holds {held >> 20} MiB of gateway memory")
    c.must(all(d in arena.last_stored for d in HONEST), "an honest update is missing")


@attack("B22", "F9", "retained chunks left on the device's own chunk topics")
def b22_retained(c: Checks, arena: Arena) -> None:
    base = "update"
    n = 30
    gt = arena.gw.transport
    held0 = gt.stats().get("reassembly_bytes", 0)
    for i in range(n):
        arena.evil_publish(f"{base}/_chunk/{i}", _junk_chunk(n * 64 * 1024, i), retain=True, raw=True)
    time.sleep(1.0)
    grew = gt.stats().get("reassembly_bytes", 0) - held0
    c.must(grew < 1 << 20, f"retained junk pinned {grew} bytes of gateway memory")
    c.notes.append(f"cleared at once by the gateway: {gt.stats().get('retained_cleared', 0)}")
    # what the broker keeps: a newcomer (fresh session) subscribing now
    spy = arena.operator("tester", connect=False, clean_start=True, session_expiry_s=0)
    spy.subscribe(_topic(EVIL, base), lambda m: None)  # chunks of update arrive on update/_chunk/+
    spy.connect()
    time.sleep(1.5)
    st = spy.stats()
    leftover = st.get("retained_cleared", 0) + st.get("reassembly_retained_refused", 0)
    c.should(leftover == 0, f"the broker still stored {leftover} retained junk chunks for a newcomer (receivers "
             "refuse them; Mosquitto 2.0 cannot bound its retained store)")
    for i in range(n):  # the operator's clean-up
        spy.publish(f"{_topic(EVIL, base)}/_chunk/{i}", b"", retain=True, raw=True).wait(10)


@attack("B23", "F10", "an inference reply over 256 KiB through the ACL")
def b23_big_reply(c: Checks, arena: Arena) -> None:
    from edgeflow.protocol.fleet import encode_tensor, sign_inference_request

    dev = HONEST[0]
    replies: list[Any] = []
    app = arena.operator("tester", connect=False)
    app.subscribe(_topic(dev, "infer/reply"), replies.append)
    app.connect()
    x = np.random.default_rng(3).random((8000, 64)).astype(np.float32)
    app.publish(_topic(dev, "infer"),
                sign_inference_request({"id": "big", "input": encode_tensor(x)}, arena.fleet_key, device=dev)).wait(30)
    c.must(wait_until(lambda: replies, 40), "the chunked reply never arrived")
    if replies:
        c.must(len(replies[0].payload) > 256 * 1024 and replies[0].json().get("ok"), "bad reply")


@attack("B24", "F11", "restore and wipe: devices follow, captured updates and models stay refused")
def b24_restore(c: Checks, arena: Arena) -> None:
    import shutil

    from edgeflow.transport.topics import gateway_topic

    captured: dict[str, Any] = {}
    spy = arena.operator("tester", connect=False)
    spy.subscribe(str(gateway_topic(FLEET, "model")), lambda m: captured.__setitem__("model", m.payload))
    spy.connect()
    wait_until(lambda: "model" in captured, 10)
    old_model = captured.get("model")

    def capture(ann: Any) -> None:
        captured["update"] = _envelope(arena, ann, num_samples=60)
        captured["ann"] = ann
    m, _, _ = _evil_round(arena, capture)
    c.must(_ok(m), "no round before the wipe")
    state = Path(arena.gw.store.target.path) if hasattr(arena.gw.store, "target") else arena.root / "gateway.sqlite"
    arena.stop_gateway()
    backup = arena.root / "backup.sqlite"
    shutil.copyfile(state, backup)
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(state) + suffix)
        if p.exists():
            p.unlink()
    arena.start_gateway()                         # wiped: round ids and versions start again
    first_new = arena.gw.store.last_round_id() + 1

    def replay(ann: Any) -> None:
        if ann.round_id == captured["ann"].round_id:
            captured["same_id"] = True
        arena.evil_publish("update", captured["update"])
    for _ in range(8):                            # until the wiped state reaches the captured round id
        m, ann, ns = _evil_round(arena, replay)
        c.must(m and m[0].participants == 4, f"devices did not follow the wiped gateway (round {ann.round_id})")
        if not m or captured.get("same_id"):
            break
    c.must(ns != 60, "a captured update was accepted after the wipe")
    c.notes.append(f"new rounds from {first_new}, replay at round {ann.round_id}")
    # restore the older backup: a new epoch again, devices follow
    arena.stop_gateway()
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(state) + suffix)
        if p.exists():
            p.unlink()
    shutil.copyfile(backup, state)
    arena.start_gateway()
    m = arena.round()
    c.must(m and m[0].participants == 4, "devices did not follow the restored gateway")
    # a device restarts, then an older epoch's model is replayed as retained: it stays refused
    dev = HONEST[2]
    arena.start_agent(dev)
    arena.wait_trainers()
    cl = arena.client(dev)
    rej0 = cl.stats.rejected_messages
    if c.must(old_model, "no model captured"):
        spy.publish(str(gateway_topic(FLEET, "model")), old_model, retain=True).wait(10)
        c.must(wait_until(lambda: cl.stats.rejected_messages > rej0, 10),
               "a restarted device took an older epoch's model")
    arena.gw.rounds.publish_model()


@attack("B25", "F11", "state damage at start (truncated, overwritten mid-file)")
def b25_state_damage(c: Checks, arena: Arena) -> None:
    import shutil

    from edgeflow.errors import StateError
    from edgeflow.gateway.store import GatewayStore

    import sqlite3

    src = arena.root / "damage-src.sqlite"
    arena.gw.store.backup(src) if hasattr(arena.gw.store, "backup") else _sqlite_backup(arena, src)
    db = sqlite3.connect(str(src))  # no free pages: the bytes overwritten mid-file are in use, whatever the layout
    db.execute("VACUUM")
    db.close()
    for damage in ("truncated", "overwritten"):
        p = arena.root / f"damaged-{damage}.sqlite"
        shutil.copyfile(src, p)
        data = bytearray(p.read_bytes())
        if damage == "truncated":
            p.write_bytes(bytes(data[: len(data) // 2]))
        else:
            mid = len(data) // 2
            data[mid: mid + 8192] = os.urandom(8192)
            p.write_bytes(bytes(data))
        try:
            GatewayStore(p).close()
            c.must(False, f"{damage}: the damage went undetected")
        except StateError as exc:
            msg = str(exc)
            c.must("\n" not in msg and "docs/security.md" in msg, f"{damage}: not one line with the recovery: {msg}")
    bad_toml = arena.root / "gateway-damaged.toml"
    bad_toml.write_text(arena.toml.read_text().replace(str(arena.root / "gateway.sqlite"),
                                                       str(arena.root / "damaged-overwritten.sqlite")))
    r = subprocess.run([sys.executable, "-m", "edgeflow", "gateway", "-c", str(bad_toml), "--broker", arena.gw_url,
                        "--rounds", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    c.must(r.returncode != 0 and "Traceback" not in r.stdout and "damaged" in r.stdout,
           f"the CLI did not refuse in one line: rc {r.returncode}: {r.stdout[-500:]}")


def _sqlite_backup(arena: Arena, dst: Path) -> None:
    import sqlite3

    db = _sqlite_of(arena.gw.store)
    out = sqlite3.connect(str(dst))
    db.backup(out)
    out.close()


@attack("B26", "F12", "hostile JSON (60k-deep, 1e400) and a failed health check")
def b26_smaller(c: Checks, arena: Arena) -> None:
    from edgeflow.protocol.fleet import Ack
    from edgeflow.protocol.signed_json import sign_body
    from edgeflow.artifact import build_artifact, make_golden

    from _fleet import mlp_bytes

    dev = HONEST[0]
    acks: list[Any] = []
    app = arena.operator("tester", connect=False)
    app.subscribe(_topic(dev, "cmd/ack"), acks.append)
    app.connect()
    deep = b"[" * 60_000 + b"]" * 60_000
    app.publish(_topic(dev, "cmd"), deep).wait(10)
    huge = sign_body({"name": "status", "device": dev, "fleet": FLEET, "args": {}, "id": "h" * 32,
                      "issued": time.time(), "expires": 1e308 * 10}, arena.fleet_key, "cmd/v1")
    app.publish(_topic(dev, "cmd"), huge).wait(10)
    c.must(wait_until(lambda: len(acks) >= 2, 15), f"{len(acks)} answers to 2 hostile commands")
    codes = [Ack.from_body(json.loads(json.loads(m.payload)["body"])).code for m in acks]
    c.must(codes.count("bad_message") >= 2, f"codes {codes}")
    k = arena.evil.signer.key
    for kind, raw in (("birth", sign_body({"device": EVIL, "bdseq": 1e400}, k, "birth/v1")),
                      ("birth", b'{"v":1,"ctx":"birth/v1","body":"' + b"[" * 60_000 + b'","sig":"00"}'),
                      ("death", sign_body({"device": EVIL, "bdseq": 1e400}, k, "death/v1")),
                      ("telemetry", b'{"device":"x","ts":1e400,"seq":1e400,"bdseq":1e400}'),
                      ("cmd/ack", deep), ("update", deep)):
        arena.evil_publish(kind, raw, raw=True)
    c.must(_ping(arena), "the gateway stopped answering")
    c.must(arena.gw.fleet.is_online(EVIL), "hostile JSON took the device offline")
    # a failed health check keeps the rollback target
    dev2 = HONEST[2]
    a = arena.agents[dev2]
    fm = arena.gw.fleet
    v = max(a.model_version or 1, 1)
    c.must(fm.send_ota(dev2, artifact(arena.env, v + 1, seed=1), version=v + 1).wait(30).ok, "deploy")
    x = np.random.default_rng(7).random((1, 64)).astype(np.float32)
    bad = build_artifact(mlp_bytes(1), version=v + 2, profile=PROFILE, key=arena.fleet_key, fleet=FLEET,
                         golden=make_golden(mlp_bytes(99), PROFILE, x))
    r = fm.send_ota(dev2, bad, version=v + 2).wait(30)
    c.must(not r.ok and r.code == "health_check_failed" and a.model_version == v + 1, f"bad deploy: {r.code}")
    back = fm.command(dev2, "rollback")
    c.must(back.ok and a.model_version == v, f"no rollback target after the failed check: {back.code}")
    arena.wait_trainers()


# -- issue 31: the second red team's findings that fit the arena ---------------------------------------

@attack("C27", "I31", "a 205-byte inference request asking a device for a 2 GB string tensor, unsigned and signed")
def c27_hostile_inference(c: Checks, arena: Arena) -> None:
    from edgeflow.protocol.fleet import sign_inference_request

    dev = HONEST[0]
    replies: list[Any] = []
    app = arena.operator("tester", connect=False)
    app.subscribe(_topic(dev, "infer/reply"), replies.append)
    app.connect()
    hostile = {"id": "evil", "input": {"dtype": "S2000000000", "shape": [1], "data": ["a"]}}
    app.publish(_topic(dev, "infer"), json.dumps(hostile)).wait(10)  # unsigned: refused before parsing
    app.publish(_topic(dev, "infer"), sign_inference_request(hostile, arena.fleet_key, device=dev)).wait(10)
    c.must(wait_until(lambda: len(replies) >= 2, 15), f"{len(replies)} answers to 2 hostile requests")
    bodies = [m.json() for m in replies]
    c.must(all(not b.get("ok") for b in bodies), f"a hostile request was served: {bodies}")
    c.must(any(b.get("code") == "unsigned" for b in bodies), f"the unsigned request was not refused as such: {bodies}")
    c.must(any("tensor refused: dtype" in str(b.get("error")) for b in bodies), f"the dtype was not refused: {bodies}")
    c.must(_ping(arena, dev), "the device stopped answering")


@attack("C28", "I31", "a lying canary acks every offer ok (no evidence, or the golden outputs copied)")
def c28_lying_canary(c: Checks, arena: Arena) -> None:
    from edgeflow.artifact import sample_outputs
    from edgeflow.gateway.ota import Rollout, RolloutPolicy, build_artifacts

    fm = arena.gw.fleet
    ota = arena.evil.ota

    def lie(cmd, data, art):  # the compromised device claims a healthy install of whatever it is offered
        ota.finish(cmd, {"model_version": art.version, "health": {"ok": True},
                         "evidence": sample_outputs(art.golden().expected, cmd.args.get("challenge", "0" * 32))})

    honest_before = {d: arena.agents[d].model_version for d in HONEST}
    version = max(v or 0 for v in honest_before.values()) + 10
    recs = {r.device_id: r for r in fm.devices()}
    ota.deploy, real = lie, ota.deploy
    try:
        rep = Rollout(fm, build_artifacts(_mlp(7), [PROFILE], arena.fleet_key, version=version, fleet=FLEET),
                      [recs[EVIL], *(recs[d] for d in HONEST)],
                      RolloutPolicy(report_timeout_s=60.0, failure_threshold=0.9)).run()
    finally:
        ota.deploy = real
    r = rep.devices[EVIL]
    c.must(r.state == "failed" and r.code == "bad_evidence", f"the liar's ok was taken: {r.state} {r.code}")
    c.must(rep.state == "halted", f"the rollout went on past a lying canary: {rep.state}")
    c.must(all(arena.agents[d].model_version == honest_before[d] for d in HONEST[1:]),
           "devices after the canary wave got the model")


@attack("C29", "I31", "a model whose Loop runs 2**62 times, offered to a device")
def c29_endless_loop(c: Checks, arena: Arena) -> None:
    from test_untrusted_model_limits import loop_model

    dev = HONEST[1]
    t0 = time.monotonic()
    r, before = _offer_unchecked(arena, dev, loop_model(), 20)
    c.must(not r.ok and arena.agents[dev].model_version == before,
           f"the endless model was installed: {r.code} {r.error}")
    c.should(time.monotonic() - t0 < 180, f"the health check took {time.monotonic() - t0:.0f} s")
    c.must(_ping(arena, dev), "the device stopped answering")


def _offer_unchecked(arena: Arena, dev: str, model: Any, bump: int) -> tuple[Any, int | None]:
    """Offer ``model`` to ``dev`` as a signed artifact without golden data (computing it would run the hostile
    model here): the device's own health check is what must refuse it. Returns (ack, the version before)."""
    from edgeflow.artifact import build_artifact

    before = arena.agents[dev].model_version
    art = build_artifact(model.SerializeToString(), version=(before or 0) + bump, profile=PROFILE,
                         key=arena.fleet_key, fleet=FLEET)
    return arena.gw.fleet.send_ota(dev, art, version=(before or 0) + bump).wait(240), before


def _mlp(seed: int) -> bytes:
    from _fleet import mlp_bytes

    return mlp_bytes(seed)


ESCAPES = {"osc": "\x1b]0;pwned\x07", "clear": "\x1b[2J", "close": "[/]", "style": "[bold red]x"}


def _forge_birth(arena: Arena, device: str, **fields: Any) -> Any:
    """A birth signed with a provisioned device's own key and sent with its password (a compromised board)."""
    from edgeflow.protocol.fleet import BIRTH_CONTEXT
    from edgeflow.protocol.signed_json import sign_body
    from edgeflow.signing import PrivateKey

    key = PrivateKey.load(arena.fd.device_dir(device) / "device.key")
    body = {"device": device, "fleet": FLEET, "profile": PROFILE, "bdseq": int(time.time() * 1000),
            "public_key": key.public_key.hex, "seq": 1, "ts": time.time(), **fields}
    t = arena.env.transport(device, arena.env.device_password(device))
    t.publish(_topic(device, "birth"), sign_body(body, key, BIRTH_CONTEXT), qos=1, retain=True).wait(10)
    return t


@attack("C30", "I31", "claimed profiles that are a path and an unknown board, strings with escapes and markup")
def c30_claimed_profiles_and_escapes(c: Checks, arena: Arena) -> None:
    from edgeflow.gateway.ota import RolloutPolicy, build_artifacts

    fm = arena.gw.fleet
    evil, odd = SPARE[0], SPARE[1]
    ts = [_forge_birth(arena, evil, profile="../../etc/passwd", backend=ESCAPES["clear"] + ESCAPES["osc"]),
          _forge_birth(arena, odd, profile="no-such-board", backend=ESCAPES["style"] + ESCAPES["close"])]
    try:
        c.must(wait_until(lambda: {evil, odd} <= {r.device_id for r in fm.online_devices()}, 15),
               "the forged births never registered")
        state = arena.root / "gateway.sqlite"
        out = subprocess.run([sys.executable, "-m", "edgeflow", "fleet", "status", "--state", str(state)],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"})
        c.must(out.returncode == 0, f"fleet status rc {out.returncode}: {out.stderr[-300:]}")
        c.must("\x1b" not in out.stdout + out.stderr and "\x07" not in out.stdout, "an escape reached the terminal")
        c.should("\\x1b[2J" in out.stdout, "the hostile backend is not shown escaped")
        version = max((arena.agents[d].model_version or 0) for d in HONEST) + 30
        rep = fm.deploy(build_artifacts(_mlp(3), [PROFILE], arena.fleet_key, version=version, fleet=FLEET),
                        to="all", policy=RolloutPolicy(report_timeout_s=60.0, failure_threshold=0.5))
        skipped = {d for d, r in rep.devices.items() if r.state == "skipped"}
        c.must({evil, odd} <= skipped, f"claimed profiles not skipped: {sorted(skipped)}")
        c.must(rep.state == "completed" and all(arena.agents[d].model_version == version for d in HONEST),
               f"the rest of the fleet did not get the model: {rep.state} {rep.halted_reason}")
    finally:
        for t, d in zip(ts, (evil, odd)):  # the forged births go, as an operator would clear them
            t.publish(_topic(d, "birth"), b"", qos=1, retain=True).wait(10)
            t.close(timeout=2)


@attack("C31", "I31", "retained junk on the compromised device's channels, across a gateway restart")
def c31_retained_junk(c: Checks, arena: Arena) -> None:
    arena.evil_publish("telemetry", b"\x00" * 200_000, retain=True, raw=True)
    arena.evil_publish("cmd/ack", b'{"not": "an ack"}', retain=True, raw=True)
    before = arena.gw.fleet.stats().get("retained_junk_cleared", 0)
    arena.stop_gateway()
    arena.start_gateway()  # the retained messages arrive with its subscriptions: it clears what does not parse
    c.must(wait_until(lambda: arena.gw.fleet.stats().get("retained_junk_cleared", 0) >= 2, 20),
           f"retained junk not cleared: {arena.gw.fleet.stats().get('retained_junk_cleared', 0)} (before the restart "
           f"{before})")
    seen: list[Any] = []
    app = arena.operator("tester", connect=False)
    app.subscribe(_topic(EVIL, "telemetry"), lambda m: seen.append(m) if m.retain and m.payload else None)
    app.connect()
    c.must(_ping(arena), "the gateway stopped answering after the restart")
    c.must(not seen, "the junk is still retained at the broker")
    arena.wait_trainers()


@attack("C32", "I31", "a model that allocates 1.6 GB at run time, offered to a board with a 1 GB budget")
def c32_runtime_allocation(c: Checks, arena: Arena) -> None:
    from test_untrusted_model_limits import alloc_model

    dev = HONEST[2]
    r, before = _offer_unchecked(arena, dev, alloc_model(), 40)
    c.must(not r.ok and arena.agents[dev].model_version == before,
           f"the allocating model was installed: {r.code} {r.error}")
    c.should("memory" in str(r.error), f"the refusal does not name the memory: {r.error}")
    c.must(_ping(arena, dev), "the device stopped answering")


@attack("C33", "I31", "one address holds idle sockets within max_connections (slow loris) while a device connects")
def c33_slow_loris_within_the_limit(c: Checks, arena: Arena) -> None:
    """The arena's fleet directory, copied, regenerated for a broker in a network namespace of its own
    (max_connections 16) with the broker/nftables.conf it writes loaded there; an attacker address opens
    3 x per-source idle sockets, an honest device connects over TLS from another address."""
    import dataclasses
    import shutil

    from _netns import TestNet
    from test_broker_firewall import Attacker, device_transport, nft_unavailable, rule_counters

    from edgeflow.broker.firewall import table_name
    from edgeflow.broker.mosquitto import FleetDir
    from edgeflow.transport.broker import find_mosquitto, wait_for_port

    why = nft_unavailable() or (None if find_mosquitto() else "mosquitto is not installed")
    if not c.must(why is None, f"cannot stage the attack: {why}"):
        return
    fd = FleetDir(shutil.copytree(arena.fd.path, arena.root / "c33-fleet", dirs_exist_ok=True))
    net = TestNet()
    try:
        broker, attacker = net.host("broker"), net.host("attacker")
        s = dataclasses.replace(fd.listener_settings(), host="0.0.0.0", port=8883, websockets_port=None,
                                plain_port=None, max_connections=16, persistence_dir=None,
                                log_file=str(arena.root / "c33-mosquitto.log"))
        files = fd.write_broker_config(s, tls_hosts=[broker.ip])
        proc = broker.popen([find_mosquitto(), "-c", str(files.config)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c.must(wait_for_port(broker.ip, 8883, 10, alive=lambda: proc.poll() is None), "the broker did not start")
        loaded = broker.run(["nft", "-f", str(files.firewall)], timeout=30)
        c.must(loaded.returncode == 0, f"nft -f refused the generated ruleset: {loaded.stderr.strip()}")
        flood = Attacker(attacker, broker.ip, 8883, 3 * files.per_source)
        try:
            c.must(flood.result["held"] <= files.per_source < 16, f"one address holds {flood.result}")
            t0 = time.monotonic()
            dev = device_transport(fd, HONEST[0], broker.ip, 8883, 10)
            try:
                dev.connect()
                dev.publish(_topic(HONEST[0], "telemetry"), b"{}").wait(5)
            finally:
                dev.close(timeout=1)
            took = time.monotonic() - t0
            c.should(took < 2, f"the device needed {took:.1f} s")
            c.notes.append(f"attacker {flood.result['held']} held, {flood.result['reset']} reset; device in "
                           f"{took:.2f} s; {rule_counters(broker, table_name(FLEET))}")
        finally:
            flood.stop()
    finally:
        net.close()
