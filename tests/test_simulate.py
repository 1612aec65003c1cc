"""`edgeflow simulate`: the run folder's files and their contents."""

from __future__ import annotations

import json

import pytest

from edgeflow.cli.main import main

pytestmark = pytest.mark.integration


def test_simulate_writes_a_complete_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["simulate", "--devices", "12", "--rounds", "3", "--codec", "int8", "--byzantine", "0.25",
               "--strategy", "trimmed-mean", "--strategy-param", "proportion=0.25", "--dropout", "0.2",
               "--deadline", "3", "--epochs", "2", "--seed", "5", "--out", str(out), "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)  # --json: stdout is one JSON document, the broker line is on stderr
    assert "broker: " in captured.err
    assert summary["rounds_completed"] == 3 and summary["devices"] == 12
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round_id"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r["selected"] == 12 and 0 < r["participants"] <= 12
        assert r["participants"] + r["dropped"] == r["selected"]
        assert 0.0 <= r["accuracy"] <= 1.0 and r["bytes_in"] > 0
    assert summary["final_accuracy"] == round(rounds[-1]["accuracy"], 4)
    devices = json.loads((out / "devices.json").read_text())
    assert len(devices) == 12 and sum(d["byzantine"] for d in devices) == 3
    assert sum(d["bytes_sent"] for d in devices) == summary["uploaded_bytes"]
    config = json.loads((out / "config.json").read_text())
    assert config["strategy"] == "trimmed-mean" and config["strategy_params"] == {"proportion": 0.25}
    assert config["skip_rate"] == 0.2
    import onnx

    onnx.checker.check_model(onnx.load(out / "final_model.onnx"))
    report = (out / "report.html").read_text()
    assert report.count("<tr>") >= 3 + 12 + 1  # rounds, devices, summary
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "pip install" in report
        return
    for name in ("accuracy", "bytes", "participants", "latency"):
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
        assert f"src='{name}.png'" in report


def test_simulate_reads_a_toml_config_and_flags_override(tmp_path, capsys):
    conf = tmp_path / "sim.toml"
    conf.write_text('devices = 4\nrounds = 5\ncodec = "dense"\nstrategy = "fedavgm"\n'
                    '[strategy_params]\nserver_momentum = 0.5\n')
    out = tmp_path / "run"
    assert main(["simulate", "--config", str(conf), "--rounds", "2", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rounds_completed"] == 2 and summary["devices"] == 4 and summary["strategy"] == "fedavgm"


def test_simulate_bad_settings_are_named(tmp_path, capsys):
    conf = tmp_path / "bad.toml"
    conf.write_text("devices = 4\ncolour = 'red'\n")
    assert main(["simulate", "--config", str(conf), "--out", str(tmp_path / "r")]) == 2
    assert "unknown setting(s) ['colour']" in capsys.readouterr().err
    assert main(["simulate", "--byzantine", "1.5", "--out", str(tmp_path / "r")]) == 2
    assert "byzantine must be in [0, 1)" in capsys.readouterr().err
