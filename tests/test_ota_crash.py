"""Power cut at every OTA step: a real ``edgeflow device`` process is killed (``os._exit``, the
``ota.*`` fault points of edgeflow.faults) right after each step of a deploy, restarted, and must come back on a working model — the old one
before the pointer swap, the new one after — and report the interrupted command consistently."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from _fleet import FLEET, PROFILE, artifact, fleet_env, mlp_bytes, wait_until  # noqa: F401

from edgeflow.faults import EXIT_CODE, OTA_STEPS
from edgeflow.protocol.fleet import decode_tensor, encode_tensor, sign_inference_request
from edgeflow.device.slots import SlotStore
from edgeflow.artifact import verify_artifact
from edgeflow.runtime.session import load
from edgeflow.transport.topics import device_topic

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NEW_AFTER = {"swapped", "loaded"}


def _seed(state, data: bytes, key) -> None:
    """The board's factory image: v1 installed in slot a."""
    store = SlotStore(state)
    slot = store.stage(data, verify_artifact(data, key).model)
    store.activate(slot)


def _spawn(env, device: str, state, log, crash_at: str | None) -> subprocess.Popen:
    e = dict(os.environ)
    e.pop("EDGEFLOW_FAULTS", None)
    if crash_at:
        e["EDGEFLOW_FAULTS"] = f"ota.{crash_at}"
    cmd = [sys.executable, "-m", "edgeflow.cli.main", "device", "--credentials", str(env.fleet_dir.device_dir(device)),
           "--broker", env.url, "--state", str(state), "--profile", PROFILE, "--telemetry-interval", "0.5"]
    return subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def test_agent_killed_at_each_ota_step_restarts_on_a_working_model(fleet_env, tmp_path) -> None:
    fm = fleet_env.gateway(command_timeout_s=60)
    key = fleet_env.fleet_dir.fleet_key()
    v1, v2 = artifact(fleet_env, 1), artifact(fleet_env, 2)
    devices = {point: fleet_env.new_id() for point in OTA_STEPS}
    states = {p: tmp_path / d for p, d in devices.items()}
    logs = {p: open(tmp_path / f"{p}.log", "ab") for p in OTA_STEPS}  # noqa: SIM115
    procs: dict[str, subprocess.Popen] = {}
    try:
        for p, d in devices.items():
            _seed(states[p], v1, key.public_key)
            procs[p] = _spawn(fleet_env, d, states[p], logs[p], p)
        assert fm.wait_online(list(devices.values()), 30), {p: (tmp_path / f"{p}.log").read_text() for p in procs}
        assert all(fm.device(d).model_version == 1 for d in devices.values())
        pending = {p: fm.send_ota(d, v2, version=2, timeout_s=60) for p, d in devices.items()}
        for p, proc in procs.items():
            rc = proc.wait(30)
            assert rc == EXIT_CODE, f"{p}: exit {rc}\n{(tmp_path / f'{p}.log').read_text()}"
        assert fm.wait_online(list(devices.values()), 10, online=False), "the will reports every crash"

        on_disk = {}
        for p in OTA_STEPS:  # the disk alone, before any agent touches it again
            model, notes = SlotStore(states[p]).boot(key.public_key, PROFILE)
            assert model is not None and not notes, (p, notes)
            on_disk[p] = model.version
        assert on_disk == {p: 2 if p in NEW_AFTER else 1 for p in OTA_STEPS}

        for p, d in devices.items():
            procs[p] = _spawn(fleet_env, d, states[p], logs[p], None)
        # Each restarted agent reports the interrupted deploy itself, with what it runs now.
        for p, pc in pending.items():
            ack = pc.wait(60)
            expect = 2 if p in NEW_AFTER else 1
            assert ack.restarted and ack.result["model_version"] == expect, (p, ack)
            assert ack.ok == (p in NEW_AFTER), (p, ack)
            if not ack.ok:
                assert ack.code == "interrupted" and "restarted during deploy of v2" in ack.error
        assert fm.wait_online(list(devices.values()), 30)
        assert wait_until(lambda: all(fm.device(d).model_version == on_disk[p] for p, d in devices.items()), 10)

        # ...and serves inference on that model.
        x = np.random.default_rng(3).random((2, 64)).astype(np.float32)
        replies: dict[str, dict] = {}
        app = fleet_env.transport("tester", connect=False)
        for d in devices.values():
            app.subscribe(device_topic(FLEET, d, "infer/reply").value,
                          lambda m, d=d: replies.__setitem__(d, m.json()))
        app.connect()
        for d in devices.values():
            app.publish(device_topic(FLEET, d, "infer").value,
                        sign_inference_request({"id": d, "input": encode_tensor(x)}, fleet_env.fleet_dir.fleet_key(),
                                               device=d))
        assert wait_until(lambda: len(replies) == len(devices), 20), replies
        for p, d in devices.items():
            r = replies[d]
            assert r["ok"] and r["model_version"] == on_disk[p], (p, r)
            want = load(mlp_bytes(on_disk[p]), PROFILE)(x)
            np.testing.assert_allclose(decode_tensor(r["outputs"]["logits"]), want, rtol=1e-5, atol=1e-5)

        # A crash never wedges a board: the same deploy now goes through everywhere.
        again = {p: fm.send_ota(d, v2, version=2, timeout_s=60) for p, d in devices.items()}
        for p, pc in again.items():
            ack = pc.wait(60)
            assert ack.ok and ack.result["model_version"] == 2, (p, ack)
        assert wait_until(lambda: not any((states[p] / "pending.json").exists() for p in OTA_STEPS), 5)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        for fh in logs.values():
            fh.close()
