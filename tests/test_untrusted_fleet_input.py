"""Issue 31: untrusted data reaching the device and the operator's CLI.

1. an inference request's tensor is checked before anything is allocated (a 67-byte request asked a
   device for 2 GB: a string dtype of the sender's size);
2. profile names a device claims are validated identifiers: an invalid (a path) or unknown one skips
   that device in a deploy, the rest goes on, and no claimed name is opened as a file;
3. strings a device supplies (birth, telemetry, acks) cannot reach the operator's terminal as escape
   sequences or rich markup.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
from _fleet import FLEET, PROFILE, fleet_env, mlp_bytes, wait_until  # noqa: F401
from edgeflow.gateway.ota import Rollout, RolloutPolicy, build_artifacts
from edgeflow.gateway.store import DeviceRecord, GatewayStore

from edgeflow.artifact import ANY_PROFILE, build_artifact, parse_artifact
from edgeflow.cli.main import main
from edgeflow.device.inference import InferenceService
from edgeflow.errors import CodecError, ProfileError
from edgeflow.profiles import builtin_profile, check_profile_name, get_profile
from edgeflow.protocol.fleet import (
    BIRTH_CONTEXT,
    decode_tensor,
    encode_tensor,
    printable,
    sign_inference_request,
)
from edgeflow.protocol.signed_json import sign_body
from edgeflow.signing import PrivateKey
from edgeflow.transport.message import Message
from edgeflow.transport.topics import device_topic

# ------------------------------------------------------------------ 1. inference requests

HOSTILE_TENSORS = [
    # dtype whose item size the sender chooses; shape claims one element, 'data' one short string
    {"dtype": "S2000000000", "shape": [1], "data": ["a"]},  # was: 2.0 GB allocated
    {"dtype": "<U99999999", "shape": [1], "data": ["a"]},  # was: 400 MB
    {"dtype": "(100000000,)f8", "shape": [1], "data": [1]},  # a sub-array dtype: 800 MB per element
    {"dtype": "V2000000000", "shape": [1], "b64": ""},
    {"dtype": "O", "shape": [1], "data": [1]},
    {"dtype": "<c8", "shape": [1], "data": [1]},
    # shapes that lie about the payload
    {"dtype": "<f4", "shape": [4096, 4096, 4096], "b64": "AAAAAA=="},
    {"dtype": "<f4", "shape": [-1], "b64": "AAAAAA=="},  # was: accepted (reshape(-1))
    {"dtype": "<f4", "shape": [3], "b64": "AAAAAA=="},
    {"dtype": "<f4", "shape": [True], "data": [1]},
    {"dtype": "<f8", "shape": [2, 2], "data": [[1, 2]]},
]


@pytest.mark.parametrize("tensor", HOSTILE_TENSORS, ids=lambda t: f"{t['dtype']}-{t['shape']}")
def test_hostile_tensor_is_one_codec_error_before_any_allocation(tensor) -> None:
    request = json.dumps({"id": "q", "input": tensor}, separators=(",", ":"))
    assert len(request) < 205
    tracemalloc.start()
    try:
        with pytest.raises(CodecError) as info:
            decode_tensor(json.loads(request)["input"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"{peak} bytes allocated for a {len(request)}-byte request"
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("tensor refused:") and "numeric dtype" in msg
    assert getattr(info.value, "reason", "") == "bad_message"


def test_tensor_over_the_size_limit_is_refused_before_decoding() -> None:
    big = np.zeros((1024, 1024), np.float32)  # 4 MiB, honest payload
    enc = encode_tensor(big)
    assert decode_tensor(enc).shape == (1024, 1024)
    with pytest.raises(CodecError, match="over the limit of 1048576 bytes"):
        decode_tensor(enc, max_bytes=1 << 20)


def test_good_tensors_still_decode() -> None:
    for a in (np.arange(6, dtype="<f4").reshape(2, 3), np.zeros((0, 4), np.uint8), np.array([True, False]),
              np.arange(4, dtype=">i2"), np.arange(3, dtype=np.float16)):
        b = decode_tensor(encode_tensor(a))
        assert b.dtype == a.dtype and b.shape == a.shape and (b == a).all()
    assert decode_tensor({"dtype": "<f4", "shape": [2, 2], "data": [[1, 2], [3, 4]]}).tolist() == [[1, 2], [3, 4]]


FLEET_KEY = PrivateKey.generate()


class _FakeAgent:
    """What InferenceService uses of a DeviceAgent's core (edgeflow/device/core.py): the transport, topics,
    the stopping flag and run_named."""

    stopping = False

    def __init__(self) -> None:
        self.replies: list[dict] = []
        self.runs = 0
        self.model_version = 1
        self.device_id = "dev"
        self.fleet_key = FLEET_KEY.public_key
        self.options = SimpleNamespace(infer_keys=())
        self.counters = {"infer_refused": 0}
        self.transport = SimpleNamespace(publish=lambda topic, body, **kw: self.replies.append(json.loads(body)))

    def topic(self, channel: str) -> str:
        return f"edgeflow/lab/dev/{channel}"

    def run_named(self, feeds):
        self.runs += 1
        return {"y": np.ones(2, np.float32)}


def test_device_answers_the_hostile_inference_request_with_one_clear_error() -> None:
    agent = _FakeAgent()
    svc = InferenceService(agent, 4)
    hostile = sign_inference_request({"id": "evil", "input": {"dtype": "S2000000000", "shape": [1], "data": ["a"]}},
                                     FLEET_KEY, device="dev")
    good = sign_inference_request({"id": "ok", "input": encode_tensor(np.zeros((1, 2), np.float32))}, FLEET_KEY,
                                  device="dev")
    tracemalloc.start()
    try:
        svc.on_request(Message("edgeflow/lab/dev/infer", hostile))
        svc.on_request(Message("edgeflow/lab/dev/infer", good))
        svc.queue.put(None)
        svc.loop()  # runs both, returns at the None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak
    by_id = {r["id"]: r for r in agent.replies}
    assert not by_id["evil"]["ok"] and "S2000000000" in by_id["evil"]["error"]
    assert by_id["evil"]["error"].startswith("CodecError: tensor refused: dtype")
    assert by_id["ok"]["ok"] and agent.runs == 1, "the hostile request never reached the model"


# ------------------------------------------------------------------ 2. claimed profile names

BAD_NAMES = ["../../etc/passwd", "/etc/passwd", "a/b", "..", "pi..4", "Raspberry-Pi-4", "", "x" * 65,
             "\x1b[2J", "pi-4.toml/..", "-pi", "pi 4", "[/]"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_invalid_profile_names_are_refused_by_the_one_validator(name) -> None:
    with pytest.raises(ProfileError, match="is not a valid profile name") as info:
        builtin_profile(name)
    assert "\x1b" not in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ProfileError):
        check_profile_name(name)


def test_valid_names_pass_and_paths_stay_the_operators(tmp_path) -> None:
    for name in ("raspberry-pi-4", "x86-gateway", "a", "board_2.v1"):
        assert check_profile_name(name) == name
    assert builtin_profile("raspberry-pi-4").name == "raspberry-pi-4"
    with pytest.raises(ProfileError, match="unknown device profile 'no-such-board'"):
        builtin_profile("no-such-board")
    with pytest.raises(ProfileError, match="is not a valid profile name"):
        get_profile("Raspberry Pi 4")  # not a path, not a name: one line, no lookup
    # the operator's own --profile path still works (get_profile), a claimed one never does (builtin_profile)
    src = get_profile("raspberry-pi-4")
    toml = (tmp_path / "myboard.toml")
    toml.write_text(_profile_toml("myboard", src))
    assert get_profile(str(toml)).name == "myboard"
    with pytest.raises(ProfileError, match="is not a valid profile name"):
        builtin_profile(str(toml))


def _profile_toml(name: str, p) -> str:
    return (f'name = "{name}"\ndescription = "d"\narch = "{p.arch}"\ncores = {p.cores}\nmemory_mb = {p.memory_mb}\n'
            f'memory_budget_mb = {p.memory_budget_mb}\nthreads = {p.threads}\nbackends = ["numpy"]\n')


def test_build_artifacts_skips_claimed_paths_and_unknown_profiles(tmp_path, monkeypatch) -> None:
    """A device claiming a path made the operator's machine open that file as a profile; an unknown
    name aborted the whole build."""
    evil = tmp_path / "evil.toml"  # a file that *is* a valid profile: the old code built an artifact for it
    evil.write_text(_profile_toml("evil", get_profile(PROFILE)))
    from edgeflow import profiles

    opened: list[str] = []
    real = profiles.load_profile_file
    monkeypatch.setattr(profiles, "load_profile_file", lambda p: opened.append(str(p)) or real(p))
    notes: list[str] = []
    key = PrivateKey.generate()
    arts = build_artifacts(mlp_bytes(), [PROFILE, str(evil), "../../etc/passwd", "no-such-board"], key,
                           version=3, fleet=FLEET, notes=notes, golden=True)
    assert set(arts) == {PROFILE} and parse_artifact(arts[PROFILE]).manifest.profile == PROFILE
    assert not [p for p in opened if "evil" in p or "passwd" in p], opened
    text = "\n".join(notes)
    assert "'../../etc/passwd' is not a valid profile name" in text and "unknown device profile 'no-such-board'" in text
    assert str(evil) in text


class _FakeFleet:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def send_ota(self, device, art, **kw):
        self.sent.append(device)
        ack = SimpleNamespace(ok=True, code="ok", error="", result={"model_version": 3})
        return SimpleNamespace(wait=lambda timeout=None: ack, sent=time.monotonic())


def test_rollout_skips_claimed_invalid_profiles_even_with_an_any_artifact() -> None:
    key = PrivateKey.generate()
    art = build_artifact(mlp_bytes(), version=3, profile=ANY_PROFILE, key=key, fleet=FLEET)
    recs = [DeviceRecord(d, p, "", True, 0.0, 0.0, None, {}, 0)
            for d, p in (("good", PROFILE), ("evil", "../../etc/passwd"), ("odd", "no-such-board"))]
    fleet = _FakeFleet()
    rep = Rollout(fleet, {ANY_PROFILE: art}, recs, RolloutPolicy(canary=1.0)).run()
    assert sorted(fleet.sent) == ["good", "odd"], "a valid but unknown name takes the 'any' artifact"
    assert rep.devices["evil"].state == "skipped" and "not a valid profile name" in rep.devices["evil"].error
    assert rep.state == "completed"


# ------------------------------------------------------------------ 3. terminal output

HOSTILE = {"osc": "\x1b]0;pwned\x07", "clear": "\x1b[2J", "close": "[/]", "style": "[bold red]x"}


def test_printable_escapes_controls_c1_and_bidi() -> None:
    assert printable("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert printable("\x9b2J") == "\\x9b2J" and printable("a\u202eb") == "a\\u202eb"
    assert printable("a\\x1b") == "a\\\\x1b", "a device's own backslash is not mistaken for an escape"
    assert printable("ok [/]") == "ok [/]" and printable("x" * 10, 4) == "xxxx..."


def _hostile_state(path) -> list[str]:
    store = GatewayStore(path)
    ids = ["dev-a", "dev-b", "dev-c"]
    for i, d in enumerate(ids):
        hostile = i == 1
        birth = {"device": d, "fleet": FLEET, "profile": HOSTILE["close"] + HOSTILE["osc"] if hostile else PROFILE,
                 "bdseq": 1, "public_key": "", "model_version": 1, "backend": HOSTILE["style"] if hostile else "ort",
                 "versions": {"edgeflow": HOSTILE["clear"] if hostile else "1"}, "can_train": True,
                 "train": "off", "train_detail": HOSTILE["clear"] + HOSTILE["style"] if hostile else "",
                 "trust": "registered", "ts": time.time()}
        store.upsert_birth(d, birth, profile=birth["profile"], model_version=1, bdseq=1)
        store.add_telemetry(d, {"ts": time.time(), "train": "[/]\x1b[31m" if hostile else "off",
                                "train_detail": HOSTILE["osc"] + "[/]" if hostile else "no data",
                                "latency_p50_ms": 1.0, "latency_p95_ms": 2.0})
    store.close()
    return ids


def test_fleet_status_shows_hostile_device_strings_escaped(tmp_path, capfd, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # every column of the table shown
    ids = _hostile_state(tmp_path / "gw.db")
    capfd.readouterr()
    rc = main(["fleet", "status", "--state", str(tmp_path / "gw.db")])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert all(d in out for d in ids), "the rest of the fleet is listed"
    assert "[/]\\x1b]0;pwned\\x07" in out  # the profile, shown as the text it is
    assert "[bold red]x" in out  # markup shown, not applied
    assert "\\x1b[2J[bold red]x" in out or "\\x1b]0;pwned\\x07[/]" in out  # the train detail line

    rc = main(["fleet", "status", "--state", str(tmp_path / "gw.db"), "--json"])
    out, err = capfd.readouterr()
    assert rc == 0 and "\x1b" not in out
    rows = {r["device"]: r for r in json.loads(out)["devices"]}
    assert set(rows) == set(ids) and rows["dev-b"]["profile"] == "[/]\x1b]0;pwned\x07"


# ------------------------------------------------------------------ 2 + 3 over the broker


def _forge_birth(env, device: str, **fields) -> None:
    """A birth signed with the device's own key (a compromised or buggy board): what the red team sent."""
    d = env.fleet_dir.device_dir(device)
    key = PrivateKey.load(d / "device.key")
    body = {"device": device, "fleet": FLEET, "profile": PROFILE, "bdseq": int(time.time() * 1000),
            "public_key": key.public_key.hex, "seq": 1, "ts": time.time(),
            **fields}
    t = env.transport(device, env.device_password(device))
    t.publish(device_topic(FLEET, device, "birth").value, sign_body(body, key, BIRTH_CONTEXT), qos=1,
              retain=True).wait(5)
    t.publish(device_topic(FLEET, device, "telemetry").value,
              json.dumps({"device": device, "ts": time.time(), "train": "off",
                          "train_detail": HOSTILE["osc"] + HOSTILE["close"]}), qos=1).wait(5)


@pytest.mark.integration
def test_deploy_to_all_skips_claimed_bad_profiles_and_status_stays_clean(fleet_env, tmp_path, capfd,
                                                                         monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    good = fleet_env.agent()
    evil, odd = fleet_env.new_id(), fleet_env.new_id()
    _forge_birth(fleet_env, evil, profile="../../etc/passwd", backend=HOSTILE["clear"])
    _forge_birth(fleet_env, odd, profile="no-such-board", backend=HOSTILE["style"] + HOSTILE["close"])
    fm = fleet_env.gateway()
    assert wait_until(lambda: {good.device_id, evil, odd} <= {r.device_id for r in fm.online_devices()}, 10)
    common = ["--dir", str(fleet_env.fleet_dir.path), "--broker", fleet_env.url, "--user", "cli", "--wait", "3"]

    capfd.readouterr()
    rc = main(["fleet", "status", *common])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "\x1b" not in out + err and all(d in out for d in (good.device_id, evil, odd))
    assert "../../etc/passwd" in out and "\\x1b[2J" in out and "[bold red]x[/]" in out

    model = tmp_path / "m.onnx"
    model.write_bytes(mlp_bytes(1))
    rc = main(["fleet", "deploy", str(model), "--to", "all", "--canary", "1", "--timeout", "30", *common, "--json"])
    out, err = capfd.readouterr()
    rep = json.loads(out)
    assert rc == 0, err
    assert rep["state"] == "completed" and rep["counts"] == {"ok": 1, "skipped": 2}, rep["counts"]
    assert good.model_version == 1
    assert set(rep["skipped"]) == {evil, odd}
    assert "not a valid profile name" in rep["skipped"][evil] and "unknown device profile" in rep["skipped"][odd]
    assert rep["devices"][evil]["state"] == "skipped"

    rc = main(["fleet", "deploy", str(model), "--to", "all", "--canary", "1", "--timeout", "30", *common])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "\x1b" not in out + err
    assert "skipping 2 device(s)" in err and evil in err and odd in err and "'../../etc/passwd'" in err


# ------------------------------------------------------------------ 1b. inference requests are signed

def _refusal(payload: bytes, *, now: float | None = None, keys=None) -> str:
    from edgeflow.protocol.fleet import open_inference_request

    keys = keys if keys is not None else {FLEET_KEY.public_key.key_id_hex: FLEET_KEY.public_key}
    with pytest.raises(Exception) as e:
        open_inference_request(payload, keys, device="dev", now=now)
    return getattr(e.value, "reason", "?")


def test_unsigned_forged_replayed_and_tampered_requests_are_refused_before_anything_runs() -> None:
    """Issue 31: a 205-byte unsigned inference request cost a device 2.3 GB; requests must be signed by the
    fleet key (or an app key the device was given), addressed to the device and fresh."""
    import time as _t

    from edgeflow.protocol.fleet import open_inference_request

    req = {"id": "q", "input": encode_tensor(np.zeros((1, 2), np.float32))}
    good = sign_inference_request(req, FLEET_KEY, device="dev")
    keys = {FLEET_KEY.public_key.key_id_hex: FLEET_KEY.public_key}
    assert open_inference_request(good, keys, device="dev")["id"] == "q"
    assert _refusal(json.dumps(req).encode()) == "unsigned"
    assert _refusal(sign_inference_request(req, PrivateKey.generate(), device="dev")) == "unauthorized"
    assert _refusal(sign_inference_request(req, FLEET_KEY, device="dev2")) == "wrong_device"
    assert _refusal(good, now=_t.time() + 3600) == "expired"  # a captured request replayed an hour later
    assert _refusal(sign_inference_request(req, FLEET_KEY, device="dev", now=_t.time() + 3600)) == "expired"
    assert _refusal(good[:-3] + b"99}") == "bad_signature"  # the body changed after signing
    assert _refusal(good[:9] + b"{}") in ("bad_message", "unsigned")  # a truncated header
    app = PrivateKey.generate()  # an app key the device was given
    assert open_inference_request(sign_inference_request(req, app, device="dev"),
                                  {**keys, app.public_key.key_id_hex: app.public_key}, device="dev")["id"] == "q"


def test_the_device_answers_an_unsigned_request_and_never_runs_it() -> None:
    agent = _FakeAgent()
    svc = InferenceService(agent, 4)
    svc.on_request(Message("edgeflow/lab/dev/infer", json.dumps({"id": "x", "input": encode_tensor(
        np.zeros((1, 2), np.float32))}).encode()))
    svc.queue.put(None)
    svc.loop()
    assert agent.runs == 0 and agent.replies[0]["code"] == "unsigned" and agent.counters["infer_refused"] == 1
