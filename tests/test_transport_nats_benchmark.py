"""benchmarks/transport_nats.py at CI size: round_scaling's real round (a real gateway, 20 real device
clients, signed int8 updates) on a private Mosquitto and a private nats-server with JetStream, in one
run. Both brokers must close every round with every device, and every NATS/MQTT ratio must be a
finite number; the full-size run (1,000 devices) is in docs/transport.md."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgeflow.transport.broker import find_mosquitto, find_nats_server

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(find_nats_server() is None or find_mosquitto() is None,
                                 reason="needs nats-server and mosquitto")]

ROOT = Path(__file__).resolve().parents[1]


def test_twenty_devices_two_rounds_on_both_brokers(tmp_path):
    out = tmp_path / "nats.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "transport_nats.py"), "--devices", "20",
                          "--rounds", "2", "--reps", "1", "--messages", "200", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    (r,) = data["results"]
    assert r["devices"] == 20 and not r["incomplete"]
    assert sorted(row["kind"] for row in r["rows"]) == ["mqtt", "nats"]
    for row in r["rows"]:
        assert row["connected"] == 20
        assert row["participants"] == [20, 20], row
        assert row["updates_sent"] == 40  # every device answered both rounds
        assert row["server_kb_per_conn"] >= 0 and row["client_kb_per_conn"] > 0
    assert r["control"]["kind"] == "none" and r["control"]["client_threads"] < r["rows"][0]["client_threads"]
    ratios = r["summary"]["nats_over_mqtt"]
    for key in ("round_s_median", "msgs_per_s", "server_kb_per_conn", "client_kb_per_conn", "server_peak_mb"):
        assert math.isfinite(ratios[key]) and ratios[key] > 0, (key, ratios)
    assert "NATS/MQTT" in res.stdout and "| round s (median of all rounds) |" in res.stdout


def test_fleets_alternate_abba():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import transport_nats

    assert transport_nats.abba(2) == ["mqtt", "nats", "nats", "mqtt"]
    assert transport_nats.abba(3) == ["mqtt", "nats", "nats", "mqtt", "mqtt", "nats"]
