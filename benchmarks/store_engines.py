"""The gateway state on SQLite vs PostgreSQL: telemetry writes and ingestion claims, same machine.

    python benchmarks/store_engines.py                                  # PostgreSQL at 127.0.0.1:5432/test
    python benchmarks/store_engines.py --pg postgresql://USER@HOST/DB --json out.json

What is measured is the store's own API (gateway/store/), each engine in a fresh state:

- **telemetry**: ``add_telemetry_batch`` of B rows (the fleet writer's batches; B = 1 is one
  transaction per message), 2,000 devices, history bounded to 500 rows per device; rows/s.
- **claims**: ``claim()`` of distinct (round, device) updates with a 7 KB envelope (a signed int8
  digits-MLP update), by 1 and by 4 writer processes at once (ingestion workers; each its own
  connection); claims/s, and a check that every update was stored exactly once.

SQLite runs with WAL and ``synchronous=NORMAL`` on local disk (its defaults here: a commit does
not wait for fsync); PostgreSQL is the server this machine runs, once as configured (every commit
waits for its WAL flush) and once with ``synchronous_commit=off`` set in the URL (the same
durability as SQLite's setting). All share the machine's 2 cores with the client.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

PG_DEFAULT = os.environ.get("EDGEFLOW_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


ENGINES = ("sqlite", "postgresql", "postgresql-async")
"""postgresql-async: ``options=-c synchronous_commit=off`` in the URL: a commit returns before its WAL
is flushed, the same durability as SQLite's WAL + synchronous=NORMAL (a power cut may lose the last
commits, never corrupt the state)."""


def _target(engine: str, workdir: Path, pg: str, tag: str) -> str:
    if engine == "sqlite":
        return str(workdir / f"{tag}.sqlite")
    url = f"{pg}{'&' if '?' in pg else '?'}schema=ef_bench_{tag}"
    if engine == "postgresql-async":
        url += "&options=-c%20synchronous_commit%3Doff"
    return url


def _drop(url: str) -> None:
    from edgeflow.gateway.store import GatewayStore

    if url.startswith("postgres"):
        s = GatewayStore(url)
        s.drop_schema()
        s.close()


def bench_telemetry(url: str, batch: int, rows: int, devices: int = 2000) -> float:
    from edgeflow.gateway.store import GatewayStore

    s = GatewayStore(url, telemetry_keep=500)
    with s.tx() as db:
        db.many("INSERT INTO devices (device_id, first_seen, last_seen) VALUES (?, ?, ?)",
                [(f"d{i:05d}", 0.0, 0.0) for i in range(devices)])
    body = {"seq": 1, "bdseq": 1, "model_version": 1, "inferences": 10, "latency_p50_ms": 1.2,
            "latency_p95_ms": 2.5, "rss_bytes": 50_000_000, "cpu_percent": 3.0, "queue_depth": 0, "battery": 0.9}
    items = [(f"d{i % devices:05d}", {**body, "ts": 1e9 + i}, 1e9 + i) for i in range(rows)]
    t0 = time.perf_counter()
    for i in range(0, rows, batch):
        s.add_telemetry_batch(items[i:i + batch])
    dt = time.perf_counter() - t0
    assert s.telemetry_count() == min(rows, devices * 500)
    s.close()
    return rows / dt


def _claimer(url: str, worker: str, devices: list[str], envelope: bytes, start: Any, out: Any) -> None:
    from edgeflow.gateway.store import GatewayStore

    s = GatewayStore(url, shared=True)
    start.wait()
    t0 = time.perf_counter()
    res = {"ok": 0, "duplicate": 0, "late": 0}
    for d in devices:
        res[s.claim(1, d, 1, 30, envelope, worker)] += 1
    out.put((worker, time.perf_counter() - t0, res))
    s.close()


def bench_claims(url: str, writers: int, updates: int, envelope: bytes) -> dict[str, Any]:
    from edgeflow.gateway.store import GatewayStore

    s = GatewayStore(url)
    s.open_round(1, 1, time.time() + 3600, {}, [])
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    ids = [f"d{i:05d}" for i in range(updates)]
    procs = [ctx.Process(target=_claimer, args=(url, f"w{w}", ids[w::writers], envelope, start, out))
             for w in range(writers)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # every writer connected and waiting
    t0 = time.perf_counter()
    start.set()
    got = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    ok = sum(r["ok"] for _, _, r in got)
    stored = s.update_count(1)
    claimed = sum(len(v) for v in s.claims(1).values())
    s.close()
    return {"writers": writers, "updates": updates, "claims_per_s": round(updates / wall, 1),
            "ok": ok, "stored": stored, "claimed": claimed, "exactly_once": ok == stored == claimed == updates}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg", default=PG_DEFAULT)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--updates", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import numpy as np

    from edgeflow import zoo
    from edgeflow.codecs import encode_update
    from edgeflow.gateway.rounds import model_weights
    from edgeflow.signing import Signer

    rng = np.random.default_rng(0)
    delta = {k: (rng.standard_normal(v.shape) * 0.01).astype(np.float32)
             for k, v in model_weights(zoo.digits_mlp(seed=0)).items()}
    envelope = encode_update(delta, "int8", round_id=1, device_id="d", seq=1, signer=Signer.generate("d"),
                             num_samples=30)
    work = Path(tempfile.mkdtemp(prefix="ef-store-bench-"))
    rows: list[dict[str, Any]] = []
    for engine in ENGINES:
        for batch in (1, 100, 1000):
            n = min(args.rows, 2000) if batch == 1 else args.rows
            rates = []
            for rep in range(args.repeats):
                url = _target(engine, work, args.pg, f"t{batch}_{rep}_{uuid.uuid4().hex[:6]}")
                try:
                    rates.append(bench_telemetry(url, batch, n))
                finally:
                    _drop(url)
            rows.append({"what": "telemetry", "engine": engine, "batch": batch, "rows": n,
                         "rows_per_s": round(statistics.median(rates), 1)})
            print(json.dumps(rows[-1]), flush=True)
        for writers in (1, 4):
            res = []
            for rep in range(args.repeats):
                url = _target(engine, work, args.pg, f"c{writers}_{rep}_{uuid.uuid4().hex[:6]}")
                try:
                    res.append(bench_claims(url, writers, args.updates, envelope))
                finally:
                    _drop(url)
            med = sorted(res, key=lambda r: r["claims_per_s"])[len(res) // 2]
            rows.append({"what": "claims", "engine": engine, "envelope_bytes": len(envelope), **med,
                         "all_exactly_once": all(r["exactly_once"] for r in res)})
            print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for r in rows:
        key = (r["what"], r.get("batch", r.get("writers")))
        summary.setdefault(key, {})[r["engine"]] = r.get("rows_per_s", r.get("claims_per_s"))
    ratios = [{"what": w, "size": k, **{e: v.get(e) for e in ENGINES},
               "pg_over_sqlite": round(v["postgresql"] / v["sqlite"], 2) if v.get("sqlite") else None,
               "pg_async_over_sqlite": round(v["postgresql-async"] / v["sqlite"], 2) if v.get("sqlite") else None}
              for (w, k), v in summary.items()]
    doc = {"benchmark": "store_engines", "rows": rows, "ratios": ratios, "cpus": os.cpu_count()}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    else:
        print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
