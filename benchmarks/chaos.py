"""Issue 20's red-team attack list against one live fleet: held / degraded / broken per attack.

    python benchmarks/chaos.py                 # all 33 attacks, the table and the run time
    python benchmarks/chaos.py --only B09 B12  # some of them
    python benchmarks/chaos.py --json out.json

The fleet (tests/chaos/arena.py): Mosquitto on the config `edgeflow broker-config` generates (TLS,
per-device passwords, the ACL), devices from `fleet provision`, the gateway service built from a
gateway.toml as `edgeflow gateway` builds it (kill -9 attacks run the real `edgeflow gateway` process),
three honest device agents training on digits shards and one compromised provisioned device; an
anonymous broker for the open-broker attacks. C33 (the slow loris) runs a copy of the fleet's broker in
network namespaces with its generated nftables ruleset: it needs root, `ip netns` and `nft`.
tests/chaos/test_chaos.py runs the same attacks in CI and
fails on any that does not hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "chaos"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="attack ids (A01..C33)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--verbose", "-v", action="store_true", help="details of held attacks too")
    ap.add_argument("--log", help="write the fleet's log (INFO) to this file")
    args = ap.parse_args(argv)
    import logging

    if args.log:
        logging.basicConfig(filename=args.log, level=logging.INFO,
                            format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    else:
        logging.basicConfig(handlers=[logging.NullHandler()])

    from arena import Arena
    from attacks import ATTACKS, run

    todo = [a for a in ATTACKS if not args.only or a.id in args.only]
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgeflow-chaos-") as tmp:
        arena = Arena(Path(tmp))
        setup = time.perf_counter() - t0
        try:
            for a in todo:
                verdict, detail, secs = run(a, arena)
                rows.append({"id": a.id, "finding": a.finding, "attack": a.title, "result": verdict,
                             "seconds": round(secs, 1), "detail": detail})
                print(f"{a.id} {a.finding:5s} {verdict:9s} {secs:5.1f} s  {a.title}", flush=True)
                if detail and (verdict != "held" or args.verbose):
                    print(f"      {detail[:2000]}", flush=True)
        finally:
            arena.close()
    total = time.perf_counter() - t0
    counts = {k: sum(1 for r in rows if r["result"] == k) for k in ("held", "degraded", "broken")}
    print()
    print("| id | finding | attack | result |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['id']} | {r['finding']} | {r['attack']} | {r['result']} |")
    print()
    print(f"{counts['held']} held, {counts['degraded']} degraded, {counts['broken']} broken of {len(rows)}; "
          f"fleet set-up {setup:.0f} s, total {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "counts": counts, "seconds": round(total, 1)}, indent=2))
    return 0 if counts["held"] == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
