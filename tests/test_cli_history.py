"""History from the command line (issue 32): `edgeflow rounds`, `edgeflow fleet history DEVICE`,
`edgeflow fleet rollouts`, and the versioning words of `fleet status` ("artifact v1 (= model v1)").

The gateway's state is a real one: rounds run by the real RoundManager over the loopback fleet
(tests/unit/_lbfleet.py) into a SQLite file (and a PostgreSQL schema when the test server answers),
the registry and telemetry written through the store's own API; the rollouts of the last test are
recorded by a real `edgeflow fleet deploy` against Mosquitto.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _fleet import PROFILE, fleet_env, mlp_bytes, wait_until  # noqa: F401
from _stores import pg_url  # noqa: F401

from edgeflow.cli.main import main
from edgeflow.gateway.store import GatewayStore

sys.path.insert(0, str(Path(__file__).parent / "unit"))
from _lbfleet import LoopbackFleet, digits  # noqa: E402

HOSTILE_PROFILE = "[/]\x1b]0;pwned\x07"
HOSTILE_DETAIL = "\x1b[2J[bold red]x"


def _fill(target, *, rounds: int = 2) -> list[str]:
    """``rounds`` real federated rounds (3 devices, the gateway's eval set), a failed round as the round
    manager stores one, births and telemetry for the devices and one hostile device. Returns the device ids."""
    from edgeflow.gateway.rounds import RoundManager

    def factory(transport, store, **kw):
        store.close()
        return RoundManager(transport, GatewayStore(target), **kw)

    split = digits()
    with LoopbackFleet(3, config={"rounds": rounds, "min_clients": 2}, rounds_factory=factory,
                       eval_data=(split.x_test[:200], split.y_test[:200])) as fleet:
        done = fleet.rounds.run(rounds)
        ids = [c.device_id for c in fleet.clients]
    assert len(done) == rounds and all(not m.extra.get("failed") for m in done)
    store = GatewayStore(target)
    try:
        nxt = store.last_round_id() + 1
        store.open_round(nxt, store.latest_version(), time.time() + 5, {"mode": "sync"}, ids[:2])
        store.finish_round(nxt, {"round_id": nxt, "selected": 2, "participants": 0, "failed": 1.0,
                                 "reason": "1 of 2 selected device(s) reported, min_clients is 2"}, state="failed")
        now = time.time()
        for dev in [*ids, "dev-x"]:
            prof = HOSTILE_PROFILE if dev == "dev-x" else "raspberry-pi-4"
            birth = {"device": dev, "profile": prof, "bdseq": 3, "model_version": 1, "backend": "numpy",
                     "can_train": True, "train": "training", "trust": "registered", "versions": {"edgeflow": "0.1"}}
            store.upsert_birth(dev, birth, profile=prof, model_version=1, bdseq=3)
            for k in range(4):  # no model first, then artifact v1
                store.add_telemetry(dev, {"device": dev, "ts": now - 40 + k, "model_version": None if k == 0 else 1,
                                          "inferences": k, "latency_p50_ms": 1.5, "latency_p95_ms": 2.5,
                                          "rss_bytes": 10_000_000, "train": "training",
                                          "train_detail": HOSTILE_DETAIL if dev == "dev-x" else "",
                                          "participant": {"rounds_trained": rounds, "last_round": rounds}},
                                    ts=now - 40 + k)
    finally:
        store.close()
    return ids


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> tuple[Path, list[str]]:
    path = tmp_path_factory.mktemp("history") / "gateway.sqlite"
    return path, _fill(str(path))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc: int, out: str, err: str, *words: str) -> str:
    assert rc == 2 and out == "", (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _stored(path: Path) -> tuple[list, list]:
    s = GatewayStore(str(path))
    try:
        return s.rounds(), s.model_versions()
    finally:
        s.close()


# ------------------------------------------------------------------ edgeflow rounds


def test_rounds_json_is_what_the_state_holds(state, capsys) -> None:
    path, ids = state
    rc, out, err = _run(capsys, "rounds", "--state", str(path), "--json")
    assert rc == 0, err
    doc = json.loads(out)  # only JSON on stdout
    records, models = _stored(path)
    assert [r["round"] for r in doc["rounds"]] == [1, 2, 3] and doc["rounds_stored"] == 3
    made = {m["round_id"]: m["version"] for m in models if m["round_id"] is not None}
    for row, rec in zip(doc["rounds"], records):
        assert row["state"] == rec.state and row["base_model_version"] == rec.model_version
        assert row["model_version"] == made.get(rec.round_id)
        assert row["selected"] == len(rec.selected)
    r1, r2, r3 = doc["rounds"]
    assert (r1["base_model_version"], r1["model_version"], r2["base_model_version"], r2["model_version"]) == (1, 2, 2, 3)
    for row, rec in zip((r1, r2), records):
        assert row["participants"] == 3 == row["selected"]
        assert row["accuracy"] == round(rec.metrics["accuracy"], 4) and 0 < row["accuracy"] <= 1
        assert row["loss"] == round(rec.metrics["eval_loss"], 4) and row["loss_kind"] == "eval"
        assert row["bytes_in"] == rec.metrics["bytes_in"] > 0 and row["duration_s"] >= 0
        assert row["failure_reason"] is None
    assert r3["state"] == "failed" and r3["model_version"] is None and "min_clients is 2" in r3["failure_reason"]
    assert doc["global_model"]["model_version"] == 3 and doc["global_model"]["round"] == 2


def test_rounds_table_names_the_model_versions_and_failures(state, capsys, monkeypatch) -> None:
    path, _ = state
    monkeypatch.setenv("COLUMNS", "140")
    rc, out, err = _run(capsys, "rounds", "--state", str(path))
    assert rc == 0, err
    assert f"gateway state {path}: global model v3 (round 2)" in out
    assert "v1 -> v2" in out and "v2 -> v3" in out and "v3 -> -" in out
    assert "3/3" in out and "0/2" in out
    assert "round 3 failed: 1 of 2 selected device(s) reported, min_clients is 2" in out
    rc, out, err = _run(capsys, "rounds", "--state", str(path), "--last", "1", "--json")
    assert rc == 0 and [r["round"] for r in json.loads(out)["rounds"]] == [3]
    rc, out, _ = _run(capsys, "rounds", "--state", str(path), "--last", "2")
    assert rc == 0 and "the newest 2 of 3 round(s)" in out and "v1 -> v2" not in out


def test_rounds_reads_the_state_gateway_toml_names(state, tmp_path, capsys) -> None:
    path, _ = state
    toml = tmp_path / "gateway.toml"
    toml.write_text(f'[gateway]\nstate = "{path}"\n', encoding="utf-8")
    rc, out, err = _run(capsys, "rounds", "--config", str(toml), "--json")
    assert rc == 0, err
    assert [r["round"] for r in json.loads(out)["rounds"]] == [1, 2, 3]
    toml.write_text('[gateway]\nstate = "never-ran.sqlite"\n', encoding="utf-8")
    _one_line_error(*_run(capsys, "rounds", "--config", str(toml)), "never-ran.sqlite", "no such file",
                    f"edgeflow gateway --config {toml}")
    assert not (tmp_path / "never-ran.sqlite").exists(), "reading never creates a state"


def test_rounds_bad_input_is_one_line(state, tmp_path, capsys) -> None:
    path, _ = state
    missing = tmp_path / "typo.sqlite"
    line = _one_line_error(*_run(capsys, "rounds", "--state", str(missing)), str(missing), "no such file")
    assert line.startswith("edgeflow rounds: error: ") and not missing.exists()
    _one_line_error(*_run(capsys, "rounds"), "--state", "--config")
    _one_line_error(*_run(capsys, "rounds", "--state", str(path), "--config", "g.toml"), "not both")
    _one_line_error(*_run(capsys, "rounds", "--state", str(path), "--last", "0"), "--last 0")
    junk = tmp_path / "junk.sqlite"
    junk.write_text("not a database")
    _one_line_error(*_run(capsys, "rounds", "--state", str(junk)), "not an SQLite file")


def test_rounds_on_a_state_without_rounds(tmp_path, capsys) -> None:
    GatewayStore(str(tmp_path / "new.sqlite")).close()
    rc, out, err = _run(capsys, "rounds", "--state", str(tmp_path / "new.sqlite"))
    assert rc == 0 and "no global model yet" in out and "no rounds stored yet" in out, out + err
    rc, out, _ = _run(capsys, "rounds", "--state", str(tmp_path / "new.sqlite"), "--json")
    assert rc == 0 and json.loads(out)["rounds"] == [] and json.loads(out)["global_model"] is None


def test_rounds_help_teaches_the_three_versions() -> None:
    out = subprocess.run([sys.executable, "-m", "edgeflow", "rounds", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "model vN" in text and "artifact vN" in text and "--config" in text and "examples:" in text


# ------------------------------------------------------------------ edgeflow fleet history


def test_fleet_history_of_a_device(state, capsys, monkeypatch) -> None:
    path, ids = state
    rc, out, err = _run(capsys, "fleet", "history", ids[0], "--state", str(path), "--json", "--last", "2")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["device"] == ids[0] and doc["artifact_version"] == 1 and doc["global_model_version"] == 3
    assert doc["birth"]["bdseq"] == 3 and doc["birth"]["latest"]["backend"] == "numpy"
    assert doc["telemetry"]["kept"] == 4 and len(doc["telemetry"]["rows"]) == 2
    assert [s["artifact_version"] for s in doc["artifact_versions"]] == [None, 1]
    assert [s["reports"] for s in doc["artifact_versions"]] == [1, 3]
    assert doc["rounds"]["selected_in"] == [1, 2, 3] and doc["rounds"]["rounds_trained"] == 2
    assert doc["rollouts"] == [] and doc["not_recorded"]
    monkeypatch.setenv("COLUMNS", "200")
    rc, out, err = _run(capsys, "fleet", "history", ids[2], "--state", str(path))
    assert rc == 0, err
    assert f"{ids[2]} (raspberry-pi-4): online, runs artifact v1; gateway: global model v3 (round 2)" in out
    assert "rounds that selected it: 1, 2" in out and "rounds that selected it: 1, 2, 3" not in out
    assert "telemetry: 4 report(s) kept" in out and "not recorded: " in out
    assert "[store] telemetry_keep" in out, "markup-looking text is printed as it is"


def test_fleet_history_escapes_device_strings(state, capsys, monkeypatch) -> None:
    path, _ = state
    monkeypatch.setenv("COLUMNS", "200")
    rc, out, err = _run(capsys, "fleet", "history", "dev-x", "--state", str(path), "--last", "4")
    assert rc == 0, err
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert "[/]\\x1b]0;pwned\\x07" in out  # the profile, as the text it is
    rc, out, _ = _run(capsys, "fleet", "history", "dev-x", "--state", str(path), "--json")
    assert rc == 0 and json.loads(out)["profile"] == HOSTILE_PROFILE


def test_fleet_history_bad_input(state, tmp_path, capsys) -> None:
    path, ids = state
    line = _one_line_error(*_run(capsys, "fleet", "history", "cam-9", "--state", str(path)), "cam-9",
                           "not in the registry", ids[0])
    assert line.startswith("edgeflow fleet history: error: ")
    _one_line_error(*_run(capsys, "fleet", "history", "evil\x1b[2J", "--state", str(path)), "evil\\x1b[2J")
    _one_line_error(*_run(capsys, "fleet", "history", ids[0], "--state", str(tmp_path / "nope.db")), "no such file")
    _one_line_error(*_run(capsys, "fleet", "history", ids[0]), "--state")


# ------------------------------------------------------------------ rollouts and the versioning words


def _record(path: Path, version: int, sha: str, rid: str, *, state: str = "completed", devices=(), halted="") -> None:
    s = GatewayStore(str(path))
    try:
        now = time.time()
        rep = {"version": version, "state": state, "waves": [list(devices)], "failure_rate": 0.0 if not halted else 1.0,
               "halted_reason": halted, "started": now, "finished": now + 1, "counts": {"ok": len(devices)},
               "devices": {d: {"device_id": d, "state": "ok", "code": "ok", "error": "", "wave": 0,
                               "from_version": None, "model_version": version, "evidence": "verified"}
                           for d in devices}}
        s.add_rollout(rep, rollout_id=rid, source_sha256=sha, name="model.onnx", selector="all")
    finally:
        s.close()


def test_status_and_rollouts_map_artifacts_to_global_models(tmp_path, capsys, monkeypatch) -> None:
    path = tmp_path / "gateway.sqlite"
    ids = _fill(str(path), rounds=1)
    _, models = _stored(path)
    _record(path, 1, models[0]["sha256"], "r-1", devices=ids)  # the initial model, deployed as artifact v1
    _record(path, 2, "0" * 64, "r-2", state="halted", halted="failure rate 100% > 20%")  # a model from elsewhere
    rc, out, err = _run(capsys, "fleet", "status", "--state", str(path), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    row = {r["device"]: r for r in doc["devices"]}[ids[0]]
    assert row["artifact_version"] == row["model_version"] == 1 and row["artifact_model_version"] == 1
    assert doc["global_model"] == {"model_version": 2, "round": 1}
    monkeypatch.setenv("COLUMNS", "160")
    rc, out, err = _run(capsys, "fleet", "status", "--state", str(path))
    assert rc == 0, err
    assert "v1 (= model v1)" in out and "artifact" in out
    assert "gateway: global model v2 (round 1); devices run artifact v1 (= model v1) on 4" in out

    rc, out, err = _run(capsys, "fleet", "rollouts", "--state", str(path), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [(r["rollout_id"], r["artifact_version"], r["model_version"]) for r in doc["rollouts"]] == \
        [("r-1", 1, 1), ("r-2", 2, None)]
    assert doc["rollouts"][0]["counts"] == {"ok": 3} and doc["rollouts"][1]["halted_reason"] == "failure rate 100% > 20%"
    rc, out, err = _run(capsys, "fleet", "rollouts", "--state", str(path))
    assert rc == 0, err
    assert "= model v1" in out and "not a gateway model" in out
    assert "rollout r-2 (artifact v2) halted: failure rate 100% > 20%" in out
    rc, out, _ = _run(capsys, "fleet", "rollouts", "--state", str(path), "--last", "1", "--json")
    assert [r["rollout_id"] for r in json.loads(out)["rollouts"]] == ["r-2"]


def test_rollouts_on_a_state_from_before_the_table(tmp_path, capsys) -> None:
    path = tmp_path / "old.sqlite"
    GatewayStore(str(path)).close()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE rollouts")
    db.execute("UPDATE meta SET value='3' WHERE key='schema'")
    db.commit()
    db.close()
    rc, out, err = _run(capsys, "fleet", "rollouts", "--state", str(path), "--dir", str(tmp_path / "none"))
    _one_line_error(rc, out, err, "--dir", "not a fleet directory")
    rc, out, err = _run(capsys, "fleet", "rollouts", "--state", str(path), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["rollouts"] == [] and "no rollouts table" in doc["read"][0]
    rc, out, err = _run(capsys, "fleet", "status", "--state", str(path))
    assert rc == 0, err
    s = GatewayStore(str(path))  # the gateway itself migrates it: the table appears
    try:
        assert s.schema_version() >= 4 and s.rollouts() == []
    finally:
        s.close()


def test_rollouts_without_anything_to_read(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EDGEFLOW_FLEET_DIR", raising=False)
    _one_line_error(*_run(capsys, "fleet", "rollouts"), "no rollouts recorded", "--dir", "--state")
    _one_line_error(*_run(capsys, "fleet", "rollouts", "--last", "0", "--state", "x"), "--last 0")


# ------------------------------------------------------------------ PostgreSQL


def test_rounds_history_and_status_on_postgresql(pg_url, capsys) -> None:  # noqa: F811
    ids = _fill(pg_url, rounds=2)
    rc, out, err = _run(capsys, "rounds", "--state", pg_url, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [(r["base_model_version"], r["model_version"]) for r in doc["rounds"]] == [(1, 2), (2, 3), (3, None)]
    assert all(0 < r["accuracy"] <= 1 for r in doc["rounds"][:2])
    s = GatewayStore(pg_url)
    try:
        v1 = s.model_versions()[0]["sha256"]
    finally:
        s.close()
    s = GatewayStore(pg_url)
    try:
        s.add_rollout({"version": 1, "state": "completed", "started": time.time(), "devices": {}},
                      rollout_id="pg-1", source_sha256=v1, name="model.onnx", selector="all")
    finally:
        s.close()
    rc, out, err = _run(capsys, "fleet", "rollouts", "--state", pg_url, "--json")
    assert rc == 0 and [(r["artifact_version"], r["model_version"]) for r in json.loads(out)["rollouts"]] == [(1, 1)]
    rc, out, err = _run(capsys, "fleet", "history", ids[1], "--state", pg_url, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["artifact_model_version"] == 1 and doc["rounds"]["selected_in"] == [1, 2, 3]  # 3: the failed one


# ------------------------------------------------------------------ a real deploy records its rollout


@pytest.mark.integration
def test_fleet_deploy_records_its_rollout(fleet_env, tmp_path, capsys) -> None:  # noqa: F811
    state = tmp_path / "gw.sqlite"
    store = GatewayStore(str(state))
    model = tmp_path / "digits.onnx"
    model.write_bytes(mlp_bytes(1))
    # the gateway's global model v1 is these bytes (as `edgeflow gateway --export-model` writes them)
    store.add_model(model.read_bytes(), hashlib.sha256(model.read_bytes()).hexdigest())
    fm = fleet_env.gateway(store=store)
    agents = [fleet_env.agent() for _ in range(2)]
    ids = sorted(a.device_id for a in agents)
    assert fm.wait_online(ids, 10)
    common = ["--dir", str(fleet_env.fleet_dir.path), "--broker", fleet_env.url, "--user", "cli", "--wait", "3"]
    sel = "device=" + "|".join(ids)

    rc, out, err = _run(capsys, "fleet", "deploy", str(model), "--to", sel, "--canary", "1", "--timeout", "60",
                        "--state", str(state), *common, "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["state"] == "completed" and rep["version"] == 1, (err, rep["devices"])
    assert rep["recorded_in"].startswith(str(state))
    rc, out, err = _run(capsys, "fleet", "deploy", str(model), "--to", sel, "--canary", "1", "--timeout", "60",
                        *common)  # without --state: the fleet directory's rollouts.sqlite
    assert rc == 0, err
    assert "deploying artifact v2 to 2 device(s)" in err and "rollout of artifact v2: completed" in out
    assert "recorded in " in out and "rollouts.sqlite" in out
    assert (fleet_env.fleet_dir.path / "rollouts.sqlite").is_file()

    rc, out, err = _run(capsys, "fleet", "rollouts", "--dir", str(fleet_env.fleet_dir.path), "--state", str(state),
                        "--json")
    assert rc == 0, err
    rows = json.loads(out)["rollouts"]
    assert [(r["artifact_version"], r["model_version"], r["state"]) for r in rows] == \
        [(1, 1, "completed"), (2, 1, "completed")], rows
    assert rows[0]["recorded_in"] == str(state) and rows[1]["recorded_in"].endswith("rollouts.sqlite")
    assert rows[0]["counts"] == {"ok": 2} and rows[0]["canary"] == 2

    assert wait_until(lambda: all(store.device(d).model_version == 2 for d in ids), 10)
    rc, out, err = _run(capsys, "fleet", "status", "--state", str(state), "--dir", str(fleet_env.fleet_dir.path),
                        "--json")
    assert rc == 0, err
    assert {r["device"]: r["artifact_model_version"] for r in json.loads(out)["devices"]} == {d: 1 for d in ids}
    rc, out, err = _run(capsys, "fleet", "history", ids[0], "--state", str(state), "--dir",
                        str(fleet_env.fleet_dir.path), "--json")
    assert rc == 0, err
    assert [(o["artifact_version"], o["state"]) for o in json.loads(out)["rollouts"]] == [(1, "ok"), (2, "ok")]

    # a --state that does not exist is refused before any device is touched
    rc, out, err = _run(capsys, "fleet", "deploy", str(model), "--to", sel, "--state", str(tmp_path / "typo.db"),
                        *common)
    _one_line_error(rc, out, err, "typo.db", "no such file")
    assert all(a.model_version == 2 for a in agents)


def test_an_artifact_of_the_gateways_initial_model_file_maps_by_weights(tmp_path, capsys) -> None:
    """The gateway stores its initial model as loaded (other bytes than the file): an artifact deployed from
    model.onnx is still "= model v1", matched by the weights `fleet deploy` fingerprinted."""
    import onnx

    from edgeflow import zoo
    from edgeflow.cli.fleet import weights_fingerprint
    from edgeflow.runtime.model import load_model

    f = tmp_path / "model.onnx"
    onnx.save(zoo.digits_mlp(seed=0), str(f))
    loaded = load_model(str(f)).SerializeToString()
    path = tmp_path / "gateway.sqlite"
    s = GatewayStore(str(path))
    try:
        s.add_model(loaded, hashlib.sha256(loaded).hexdigest())
        s.add_model(mlp_bytes(5), hashlib.sha256(mlp_bytes(5)).hexdigest(), round_id=1)  # other weights
        file_bytes = f.read_bytes()
        assert hashlib.sha256(file_bytes).hexdigest() != hashlib.sha256(loaded).hexdigest()
        for rid, fp in (("by-weights", weights_fingerprint(file_bytes)), ("no-fingerprint", None)):
            s.add_rollout({"version": 1, "state": "completed", "started": time.time(), "devices": {},
                           "source": {"weights_sha256": fp}}, rollout_id=rid,
                          source_sha256=hashlib.sha256(file_bytes).hexdigest(), name="model.onnx", selector="all")
    finally:
        s.close()
    rc, out, err = _run(capsys, "fleet", "rollouts", "--state", str(path), "--json")
    assert rc == 0, err
    assert {r["rollout_id"]: r["model_version"] for r in json.loads(out)["rollouts"]} == \
        {"by-weights": 1, "no-fingerprint": None}
    assert weights_fingerprint(mlp_bytes(5)) != weights_fingerprint(file_bytes)
    assert weights_fingerprint(b"not onnx") is None
