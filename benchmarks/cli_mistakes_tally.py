"""Tally of the user mistakes in tests/test_cli_mistakes.py (MISTAKES) against a checkout: each row is
run through that checkout's `edgeflow` command and classed clear (non-zero exit, one stderr line
holding the row's needles), unclear (non-zero exit, more lines or not naming the problem),
traceback (a traceback or "a bug in edgeflow") or silent (exit 0).

    python benchmarks/cli_mistakes_tally.py                       # this checkout
    git worktree add /tmp/wt-old 8cea145 && python benchmarks/cli_mistakes_tally.py --checkout /tmp/wt-old

The other checkout's edgeflow/ is put first on PYTHONPATH (kernels/ and gateway/ come from the
editable install); prints one line per mistake and the counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def classify(rc: int | None, err: str, needles: list[str]) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    if rc == 0:
        return "silent"
    if "Traceback" in err or "a bug in edgeflow" in err:
        return "traceback"
    if rc is not None and len(lines) == 1 and all(n in lines[0] for n in needles):
        return "clear"
    return "unclear"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", default=str(ROOT), help="the checkout whose edgeflow/ runs (default: this one)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_cli_mistakes import MISTAKES, make_scratch

    env = {**os.environ, "PYTHONPATH": args.checkout}
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="edgeflow-mistakes-") as tmp:
        d = Path(tmp)
        make_scratch(d)
        for mid, argv, needles in MISTAKES:
            try:
                out = subprocess.run([sys.executable, "-m", "edgeflow"] + argv.format(d=d).split(), capture_output=True,
                                     text=True, timeout=120, cwd=args.checkout, env=env)
                rc, err = out.returncode, out.stderr
            except subprocess.TimeoutExpired:
                rc, err = None, ""
            kind = classify(rc, err, needles)
            counts[kind] = counts.get(kind, 0) + 1
            last = [x for x in err.splitlines() if x.strip()][-1:] or [""]
            print(f"{kind:9} {mid}: exit {rc}: {last[0][:160]}", flush=True)
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
