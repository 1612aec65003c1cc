"""docs/fleet.md's quick start, run as a user would copy it: the shell block taken from the doc, run by
bash in a fresh directory (not the checkout), with real Mosquitto, real `edgeflow device` processes and
the real gateway. Only the port line changes (a free port instead of 8883).

The transcript (the commands as ``bash -x`` prints them, and their output) is shown on failure and
written to the file named by ``$EDGEFLOW_QUICKSTART_TRANSCRIPT`` when set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from edgeflow.transport.broker import find_mosquitto, free_port

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[1] / "docs" / "fleet.md"


def quickstart_block(text: str) -> str:
    """The first ```bash block under '## Quick start'."""
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```bash\n(.*?)```", section, re.S)
    assert m, "docs/fleet.md: the quick start has no ```bash block"
    return m.group(1)


def test_the_fleet_quick_start_runs_as_written():
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    block = quickstart_block(DOC.read_text(encoding="utf-8"))
    assert re.search(r"^PORT=8883\b", block, re.M), "the quick start sets the broker port in one line"
    assert "train_start" not in block, "boards with training data join the rounds by themselves"
    port = free_port()
    script = re.sub(r"^PORT=8883\b", f"PORT={port}", block, count=1, flags=re.M)
    # Run from a fresh directory that the broker's own user can reach (broker-config run as root
    # makes Mosquitto drop to `mosquitto`, which cannot enter pytest's private temp dirs).
    work = Path(tempfile.mkdtemp(prefix="edgeflow-quickstart-"))
    os.chmod(work, 0o755)
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "80"}
    env.pop("EDGEFLOW_FLEET_DIR", None)
    # -x: the transcript shows each command; the trap stops what the block left running if a step fails.
    wrapped = "set -eu -o pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\nset -x\n" + script
    (work / "quickstart.sh").write_text(wrapped)
    try:
        out = subprocess.run(["bash", str(work / "quickstart.sh")], cwd=work, env=env, capture_output=True,
                             text=True, timeout=600)
        transcript = out.stdout + "\n--- stderr (with the commands, as bash -x prints them) ---\n" + out.stderr
        (work / "transcript.txt").write_text(transcript)
        keep = os.environ.get("EDGEFLOW_QUICKSTART_TRANSCRIPT")
        if keep:
            Path(keep).write_text(transcript)
        assert out.returncode == 0, transcript[-8000:]
        assert "Traceback" not in out.stderr, transcript[-8000:]

        # What the block did, checked on the files it left.
        state = work / "gateway.sqlite"
        db = sqlite3.connect(f"file:{state}?mode=ro", uri=True)
        rounds = db.execute("SELECT round_id, state, metrics FROM rounds ORDER BY round_id").fetchall()
        assert [(r[0], r[1]) for r in rounds] == [(1, "closed"), (2, "closed"), (3, "closed")], rounds
        metrics = [json.loads(r[2]) for r in rounds]
        assert all(m["participants"] == 2 for m in metrics), metrics
        assert metrics[-1]["accuracy"] > metrics[0]["accuracy"] - 0.05 and metrics[-1]["accuracy"] > 0.5, metrics
        db.close()
        status = [ln for ln in out.stdout.splitlines() if "cam-1" in ln or "cam-2" in ln]
        assert status, out.stdout
        assert (work / "trained.onnx").stat().st_size > 0
        for dev in ("cam-1", "cam-2"):
            creds = json.loads((work / "fleet" / "devices" / dev / "device.json").read_text())
            assert creds["broker"] == f"mqtts://localhost:{port}"
            masters = list((work / "state" / dev / "train").iterdir())
            assert masters, f"{dev} keeps the fp32 master of its int8 model"
        # piped at 80 columns, each round is one line a script can grep (text is never wrapped; tables fit)
        round_lines = [ln for ln in out.stdout.splitlines() if re.match(r"round \d+: model v\d+, ", ln)]
        assert len(round_lines) >= 3 and all(re.search(r"KiB in, accuracy [0-9.]+, [0-9.]+ s$", ln)
                                             for ln in round_lines), out.stdout
        assert "rollout of artifact v2: completed" in out.stdout and "rollout of artifact v1: completed" in out.stdout, \
            out.stdout
        assert "cam-1: ok v1" in out.stdout or "cam-1: [green]ok" in out.stdout or "cam-1: ok" in out.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)
