"""The operator's commands: broker-config, fleet provision/status/deploy/rollback/cmd."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _fleet import BROKER_USER, PROFILE, fleet_env, mlp_bytes, wait_until  # noqa: F401

from edgeflow.cli.main import main
from edgeflow.gateway.store import GatewayStore


def _run(capsys, *argv: str) -> tuple[int, object]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr().out
    try:
        return rc, json.loads(out)
    except ValueError:
        return rc, out


def test_broker_config_and_provision_commands(tmp_path, capsys) -> None:
    d = str(tmp_path / "fleet")
    rc, out = _run(capsys, "broker-config", "--dir", d, "--fleet", "farm", "--port", "18883",
                   "--public-host", "gw.farm.local", "--websockets", "18884", "--json",
                   *(["--broker-user", BROKER_USER] if BROKER_USER else []))
    assert rc == 0 and out["fleet"] == "farm" and out["broker"] == "mqtts://gw.farm.local:18883"
    conf = Path(out["config"]).read_text()
    assert "listener 18883 0.0.0.0" in conf and "listener 18884 0.0.0.0" in conf and "allow_anonymous false" in conf
    rc, out = _run(capsys, "fleet", "provision", "cam-1", "--dir", d, "--profile", "raspberry-pi-5", "--json")
    assert rc == 0 and out["broker_config_updated"]
    creds = json.loads((Path(out["credentials"]) / "device.json").read_text())
    assert creds["broker"] == "mqtts://gw.farm.local:18883" and creds["profile"] == "raspberry-pi-5"
    assert "cam-1:" in (tmp_path / "fleet" / "broker" / "passwd").read_text()
    assert "listener 18884" in Path(tmp_path / "fleet" / "broker" / "mosquitto.conf").read_text(), "settings kept"
    assert main(["fleet", "provision", "cam-1", "--dir", d]) == 2, "existing credentials are not overwritten"
    assert main(["broker-config", "--dir", str(tmp_path / "nope")]) == 2, "a new directory needs --fleet"


@pytest.mark.integration
def test_fleet_status_cmd_deploy_rollback(fleet_env, tmp_path, capsys) -> None:
    store = GatewayStore(tmp_path / "gw.db")
    fm = fleet_env.gateway(store=store)
    agents = [fleet_env.agent() for _ in range(2)]
    ids = sorted(a.device_id for a in agents)
    assert fm.wait_online(ids, 10)
    common = ["--dir", str(fleet_env.fleet_dir.path), "--broker", fleet_env.url, "--user", "cli", "--wait", "3"]

    rc, out = _run(capsys, "fleet", "status", *common, "--json")
    rows = {r["device"]: r for r in out["devices"]}
    assert rc == 0 and all(rows[d]["online"] and rows[d]["profile"] == PROFILE for d in ids)
    assert {rows[d]["health"] for d in ids} == {"no model"}
    rc, out = _run(capsys, "fleet", "status", *common)
    assert rc == 0 and ids[0] in out and "no model" in out

    rc, ack = _run(capsys, "fleet", "cmd", ids[0], "set_config", "telemetry_interval_s=0.75", *common, "--json")
    assert rc == 0 and ack["ok"] and ack["result"]["config"]["telemetry_interval_s"] == 0.75
    rc, ack = _run(capsys, "fleet", "cmd", ids[0], "explode", *common, "--json")
    assert rc == 1 and ack["code"] == "unknown_command"

    model = tmp_path / "digits.onnx"
    model.write_bytes(mlp_bytes(1))
    sel = "device=" + "|".join(ids)
    rc, rep = _run(capsys, "fleet", "deploy", str(model), "--to", sel, "--canary", "1", "--timeout", "30", *common,
                   "--json")
    assert rc == 0 and rep["state"] == "completed" and rep["version"] == 1 and rep["counts"] == {"ok": 2}
    assert [len(w) for w in rep["waves"]] == [2]  # two devices: both are canaries (--min-canaries 2)
    assert {d["evidence"] for d in rep["devices"].values()} == {"verified"}
    assert all(a.model_version == 1 for a in agents)

    calib = tmp_path / "calib.npy"
    np.save(calib, np.random.default_rng(0).random((64, 64)).astype(np.float32))
    rc, rep = _run(capsys, "fleet", "deploy", str(model), "--to", f"profile={PROFILE},{sel}", "--quantize",
                   "--calibration", str(calib), "--atol", "0.05", "--rtol", "0.05", *common, "--json")
    assert rc == 0 and rep["version"] == 2 and rep["counts"] == {"ok": 2}, rep
    assert any("quantized" in n for n in rep["notes"]), rep["notes"]
    precision = agents[0].active_model.artifact.manifest.meta["precision"]
    assert precision != "fp32" and agents[0].model_version == 2

    rc, res = _run(capsys, "fleet", "rollback", ids[0], *common, "--json")
    assert rc == 0 and res[ids[0]]["ok"] and res[ids[0]]["result"]["model_version"] == 1
    rc, res = _run(capsys, "fleet", "rollback", "--to", sel, "--from-version", "2", *common, "--json")
    assert rc == 0 and res[ids[0]]["result"].get("unchanged") and res[ids[1]]["result"]["model_version"] == 1

    # The gateway's registry file, read by a separate process while the gateway runs.
    assert wait_until(lambda: all(store.device(d).model_version == 1 for d in ids), 5)
    rc, out = _run(capsys, "fleet", "status", "--state", str(tmp_path / "gw.db"), "--json")
    rows = {r["device"]: r for r in out["devices"]}
    assert rc == 0 and all(rows[d]["model_version"] == 1 and rows[d]["health"] == "ok" for d in ids)
    rc, rep = _run(capsys, "fleet", "deploy", str(model), "--to", "profile=coral-dev-board", *common, "--json")
    assert rc == 2, "no matching device is an error, not an empty rollout"
