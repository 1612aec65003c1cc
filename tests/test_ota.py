"""OTA artifacts, A/B slots and the health check, without a broker.

The power-cut tests here interrupt the slot writer at each step inside the
process (an exception from the crash hook); tests/test_ota_crash.py kills a
real agent process at the same steps.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time

import numpy as np
import pytest
from _fleet import PROFILE, artifact, mlp_bytes

from edgeflow import zoo
from edgeflow.device.health import check_model
from edgeflow.device.slots import SlotStore
from edgeflow.errors import FleetError, SignatureError
from edgeflow.artifact import MAGIC, Golden, build_artifact, make_golden, parse_artifact, verify_artifact
from edgeflow.profiles import get_profile
from edgeflow.signing import PrivateKey


@pytest.fixture(scope="module")
def key() -> PrivateKey:
    return PrivateKey.generate()


def test_artifact_round_trip_and_manifest(key: PrivateKey) -> None:
    model = mlp_bytes(1)
    data = artifact(key, 3, seed=1)
    art = verify_artifact(data, key.public_key, profile=PROFILE, fleet="lab")
    m = art.manifest
    assert art.verified and art.model == model and art.version == 3
    assert (m.profile, m.size, m.sha256, m.fleet) == (PROFILE, len(model), hashlib.sha256(model).hexdigest(), "lab")
    assert m.key_id == key.public_key.key_id_hex
    g = art.golden()
    assert g is not None and g.inputs["input"].shape == (1, 64) and g.expected["logits"].shape == (1, 10)
    assert art.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("where", ["manifest", "model", "golden", "signature"])
def test_any_flipped_byte_is_refused(key: PrivateKey, where: str) -> None:
    data = bytearray(artifact(key, 1))
    (mlen,) = struct.unpack_from(">I", data, len(MAGIC))
    start = len(MAGIC) + 4
    offsets = {
        "manifest": start + mlen // 2,
        "signature": start + mlen + 10,
        "model": start + mlen + 64 + 8 + 100,
        "golden": len(data) - 20,
    }
    data[offsets[where]] ^= 0x01
    with pytest.raises((SignatureError, FleetError)):
        verify_artifact(bytes(data), key.public_key, profile=PROFILE)


def test_wrong_key_truncation_profile_and_garbage(key: PrivateKey) -> None:
    data = artifact(key, 1)
    other = PrivateKey.generate()
    with pytest.raises(SignatureError) as e:
        verify_artifact(data, other.public_key)
    assert e.value.reason == "wrong_key"
    # A manifest that names the right key id but is signed by another key: the signature decides.
    forged = build_artifact(mlp_bytes(), version=9, profile=PROFILE, key=other)
    forged = forged.replace(other.public_key.key_id_hex.encode(), key.public_key.key_id_hex.encode())
    with pytest.raises(SignatureError) as e:
        verify_artifact(forged, key.public_key)
    assert e.value.reason == "bad_signature"
    with pytest.raises(FleetError, match="truncated"):
        verify_artifact(data[:-5], key.public_key)
    with pytest.raises(FleetError, match="profile 'raspberry-pi-4'.*'jetson-orin-nano'") as e:
        verify_artifact(data, key.public_key, profile="jetson-orin-nano")
    assert e.value.reason == "wrong_profile"
    with pytest.raises(FleetError, match="fleet"):
        verify_artifact(data, key.public_key, fleet="other")
    with pytest.raises(FleetError, match="bad magic"):
        parse_artifact(b"not an artifact at all")


def test_golden_survives_npz_round_trip() -> None:
    g = Golden({"input": np.ones((2, 3), np.float32)}, {"y": np.arange(4.0)}, 0.5, 0.25, 12.0)
    back = Golden.from_bytes(g.to_bytes(), **g.limits())
    assert np.array_equal(back.inputs["input"], g.inputs["input"]) and np.array_equal(back.expected["y"], g.expected["y"])
    assert back.limits() == {"atol": 0.5, "rtol": 0.25, "latency_budget_ms": 12.0}


# ------------------------------------------------------------------ health


def test_health_check_passes_and_reports_each_failure(tmp_path) -> None:
    prof = get_profile(PROFILE)
    model = mlp_bytes(2)
    x = np.random.default_rng(0).random((1, 64)).astype(np.float32)
    good = make_golden(model, PROFILE, x)
    rep = check_model(model, prof, good, runs=2)
    assert rep.ok and rep.stage == "done" and rep.latency_p50_ms is not None and rep.max_abs_error < 1e-4

    wrong = Golden(good.inputs, {"logits": good.expected["logits"] + 1.0}, good.atol, good.rtol, 1000.0)
    rep = check_model(model, prof, wrong, runs=1)
    assert not rep.ok and rep.stage == "golden" and "differs" in rep.reason and rep.max_abs_error == pytest.approx(1.0)

    slow = Golden(good.inputs, good.expected, good.atol, good.rtol, latency_budget_ms=1e-6)
    rep = check_model(model, prof, slow, runs=1)
    assert not rep.ok and rep.stage == "latency" and "exceeds the budget" in rep.reason

    rep = check_model(model, prof, good, memory_budget_mb=0)
    assert not rep.ok and rep.stage == "load" and "budget" in rep.reason

    rep = check_model(b"\x08\x07garbage", prof, None)
    assert not rep.ok and rep.stage == "load"

    rep = check_model(zoo.digits_cnn().SerializeToString(), prof, None, runs=1)
    assert rep.ok, rep.reason  # no golden data: a random input with finite outputs


# ------------------------------------------------------------------- slots


class Cut(Exception):
    """Stands for the power going off."""


def _install(store: SlotStore, data: bytes, key: PrivateKey, *, cut_at: str | None = None) -> None:
    """What the agent does, with an optional cut after one step."""
    art = verify_artifact(data, key.public_key)

    def hook(step: str) -> None:
        if step == cut_at:
            raise Cut(step)

    slot = store.stage(data, art.model, hook=hook)
    hook("checked")
    store.activate(slot)
    hook("swapped")


@pytest.mark.parametrize("cut_at", ["staging", "staged", "checked", "swapped", None])
def test_a_cut_at_any_step_leaves_the_old_or_the_new_model(tmp_path, key: PrivateKey, cut_at: str | None) -> None:
    store = SlotStore(tmp_path)
    v1, v2, v3 = (artifact(key, v, golden=False) for v in (1, 2, 3))
    _install(store, v1, key)
    _install(store, v2, key)  # now active = v2, previous = v1: the next deploy overwrites v1's slot
    try:
        _install(store, v3, key, cut_at=cut_at)
    except Cut:
        pass
    fresh = SlotStore(tmp_path)  # "after the reboot"
    model, notes = fresh.boot(key.public_key, PROFILE)
    assert model is not None and not notes
    expect = 3 if cut_at in ("swapped", None) else 2
    assert model.version == expect
    assert model.model_path.read_bytes() == mlp_bytes(expect)
    p = fresh.pointer()
    if expect == 2:
        # the staging slot is neither the model nor its rollback target: v1 is still there to roll back to
        # (with two slots the cut-off deploy had destroyed it; issue 20)
        assert p.previous is not None and fresh.verify_slot(p.previous, key.public_key).version == 1
        assert p.inactive() not in (p.active, p.previous)
    else:
        assert fresh.verify_slot(p.previous, key.public_key).version == 2


def test_boot_falls_back_when_the_active_slot_is_corrupt(tmp_path, key: PrivateKey) -> None:
    store = SlotStore(tmp_path)
    for v in (1, 2):
        _install(store, artifact(key, v, golden=False), key)
    active = store.slot_dir(store.pointer().active) / "artifact.efota"
    data = bytearray(active.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot on the active model
    active.write_bytes(bytes(data))
    model, notes = store.boot(key.public_key, PROFILE)
    assert model is not None and model.version == 1
    assert any("fell back" in n for n in notes)
    assert store.pointer().active == model.slot and store.pointer().previous is None
    # the extracted model.onnx is rewritten from the verified artifact if it was tampered with
    model.model_path.write_bytes(b"tampered")
    again = store.verify_slot(model.slot, key.public_key)
    assert again.model_path.read_bytes() == mlp_bytes(1)


def test_rollback_needs_a_previous_model_and_pointer_file_is_atomic(tmp_path, key: PrivateKey) -> None:
    store = SlotStore(tmp_path)
    _install(store, artifact(key, 1, golden=False), key)
    with pytest.raises(FleetError, match="no previous model"):
        store.rollback()
    _install(store, artifact(key, 2, golden=False), key)
    p = store.rollback()
    assert store.verify_slot(p.active, key.public_key).version == 1
    assert json.loads(store.pointer_path.read_text())["active"] == p.active
    assert not list(tmp_path.rglob("*.tmp")), "no temporary files left behind"


def test_bdseq_grows_across_restarts(tmp_path) -> None:
    a = SlotStore(tmp_path).next_bdseq()
    b = SlotStore(tmp_path).next_bdseq()
    assert b > a
    time.sleep(0.005)
    (tmp_path / "agent.json").unlink()  # state lost: the clock still keeps it above the old one
    assert SlotStore(tmp_path).next_bdseq() > a


def test_hostile_manifests_are_bad_artifacts_not_crashes(key: PrivateKey) -> None:
    """Issue 20, finding 12: deep nesting and 1e400 in an artifact's manifest are refusals, not tracebacks."""
    import struct

    from edgeflow.artifact import MAGIC, parse_artifact

    for manifest in (b"[" * 60_000 + b"]" * 4_000, b'{"version": 1e400, "profile": "x", "size": 0, "sha256": ""}',
                     b"[1, 2]"):
        manifest = manifest[:60_000]
        data = MAGIC + struct.pack(">I", len(manifest)) + manifest + b"\0" * 64 + struct.pack(">Q", 0) + struct.pack(">Q", 0)
        with pytest.raises(FleetError) as err:
            parse_artifact(data)
        assert err.value.reason == "bad_artifact"  # type: ignore[attr-defined]
