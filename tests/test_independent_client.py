"""A second implementation of the wire format, written from docs/wire-format.md only.

``tests/independent/`` is a device in plain Python (struct, hashlib, zlib,
json, socket; its own Ed25519 and its own MQTT 3.1.1 client). It runs in a
subprocess with ``python -I -S``, so neither edgeflow nor numpy can be
imported, and an import check pins what it uses. It must round-trip every
vector byte for byte and take part in a federated round against the real
gateway (``RoundManager`` over Mosquitto), whose aggregate must contain its
update exactly.
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from _brokers import mosquitto_factory  # noqa: F401
from edgeflow.protocol.rounds import TrainConfig
from edgeflow.gateway.rounds import Candidate, RoundConfig, RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.errors import SignatureError
from edgeflow.signing import KeyRing, PrivateKey
from edgeflow.transport import MqttTransport

HERE = Path(__file__).resolve().parent
CLIENT_DIR = HERE / "independent"
CLIENT = CLIENT_DIR / "efclient.py"
VECTORS = HERE / "vectors"
ALLOWED = {"argparse", "hashlib", "json", "math", "os", "socket", "struct", "sys", "time", "zlib",
           "__future__", "collections", "ed25519", "efwire", "mqtt311"}
"""What the independent client may import: the standard library's byte and hash tools, and itself."""


def run_client(*args: str, cwd: Path, timeout: float = 60.0) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-I", "-S", str(CLIENT), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    return proc.returncode, result, proc.stdout + proc.stderr


def test_the_client_imports_nothing_but_the_standard_library() -> None:
    files = sorted(CLIENT_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"efclient.py", "efwire.py", "ed25519.py", "mqtt311.py"}
    for f in files:
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
                continue  # selfcheck probes (and must fail to import) edgeflow and numpy
            else:
                continue
            bad = [n for n in names if n not in ALLOWED]
            assert not bad, f"{f.name}:{node.lineno} imports {bad}; the independent client may use only {sorted(ALLOWED)}"


def test_the_client_runs_without_edgeflow_or_numpy(tmp_path: Path) -> None:
    rc, result, out = run_client("selfcheck", cwd=tmp_path)
    assert rc == 0, out
    assert result["edgeflow_importable"] is False and result["numpy_importable"] is False
    assert result["no_site"] and result["isolated"]


def test_the_client_round_trips_every_vector(tmp_path: Path) -> None:
    rc, result, out = run_client("vectors", str(VECTORS), cwd=tmp_path)
    assert rc == 0 and result["failures"] == [], out
    manifest = json.loads((VECTORS / "manifest.json").read_text())
    assert result["vectors"] == len(manifest["vectors"])
    assert result["kinds"]["envelope"] >= 5 and result["kinds"]["chunk"] >= 2
    assert result["checks"] > 300


def test_the_client_notices_a_wrong_vector(tmp_path: Path) -> None:
    """The round trip is a real check: one changed expectation and one forged signature are reported."""
    d = tmp_path / "vectors"
    shutil.copytree(VECTORS, d)
    manifest = json.loads((d / "manifest.json").read_text())
    by_name = {v["name"]: v for v in manifest["vectors"]}
    t = by_name["envelope-int8"]["envelope"]["tensors"][0]
    t["int8"]["uniform"] = "00000000" + t["int8"]["uniform"][8:]  # a different draw for value 0
    signed = by_name["envelope-dense-signed"]
    data = bytearray((d / signed["file"]).read_bytes())
    data[-1] ^= 0x01  # last byte of the Ed25519 signature
    (d / signed["file"]).write_bytes(bytes(data))

    packed = by_name["envelope-topk-packed"]["envelope"]["tensors"][0]["topk_packed"]
    packed["codes"][0] ^= 1  # an expectation the section does not hold
    by_name["envelope-topk-packed-signed"]["envelope"]["metadata"]["loss"] = 0.5
    randk = by_name["envelope-randk-packed"]["envelope"]["tensors"][2]["randk_packed"]
    randk["pcg64_raw"][1] = f"{int(randk['pcg64_raw'][1], 16) ^ 1:016x}"  # another PRNG output
    randk["indices"][0] += 1
    by_name["envelope-layout-digest"]["envelope"]["layout"]["tensors"][0][1] = [1, 3]  # another model's shape
    delta = by_name["model-delta"]["delta"]
    delta["result"][0]["f32"] = f"{int(delta['result'][0]['f32'][:2], 16) ^ 1:02x}" + delta["result"][0]["f32"][2:]
    v3 = by_name["envelope-layout-digest-randk"]
    data3 = bytearray((d / v3["file"]).read_bytes())
    data3[v3["envelope"]["tensors"][0]["offset"] + 1] ^= 0x01  # the density of the first section
    (d / v3["file"]).write_bytes(bytes(data3))
    v3["sha256"] = hashlib.sha256(bytes(data3)).hexdigest()

    signed["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (d / "manifest.json").write_text(json.dumps(manifest))
    rc, result, out = run_client("vectors", str(d), cwd=tmp_path)
    assert rc == 1, out
    failures = "\n".join(result["failures"])
    assert "envelope-int8 encoded from the inputs" in failures
    assert "envelope-dense-signed: WireError: bad envelope signature" in failures
    assert "envelope-topk-packed/fc.weight codes" in failures
    assert "envelope-topk-packed-signed metadata decoded" in failures
    assert "envelope-randk-packed/w pcg64 raw outputs" in failures
    assert "envelope-randk-packed/w indices" in failures
    assert "envelope-layout-digest layout digest" in failures
    assert "model-delta result:" in failures
    assert "envelope-layout-digest-randk: WireError: CRC-32 mismatch" in failures


PACKED_CASES = [  # (bits, options): every bit width the codec has a distinct path for, ratio and min_k
    (1, {"k": 5}), (2, {"ratio": 0.05}), (3, {"ratio": 0.1, "min_k": 4}), (4, {"k": 7}), (5, {"ratio": 0.3}),
    (8, {"k": 40}),
]


def _interop_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Update-like tensors: a weight matrix (gaps over 127 at low ratios), a bias, an empty and a 0-d tensor."""
    return {"fc1.weight": (rng.standard_normal((24, 20)) * 0.05).astype(np.float32),
            "fc1.bias": (rng.standard_normal(20) * 0.01).astype(np.float32),
            "none": np.zeros((0, 3), np.float32), "scale": np.array(0.5, np.float32)}


def test_independent_topk_packed_updates_are_accepted_by_edgeflow(tmp_path: Path) -> None:
    """The independent encoder's signed compact envelopes decode in edgeflow to exactly what it sent."""
    from edgeflow.codecs import decode_update

    seed = bytes([5]) * 32
    device_key = PrivateKey.from_bytes(seed)
    rng = np.random.default_rng(34)
    jobs, inputs = [], {}
    for bits, options in PACKED_CASES:
        tensors = _interop_tensors(rng)
        name = f"ind-{bits}bit"
        inputs[name] = tensors
        jobs.append({"name": name, "codec": "topk-packed", "round_id": 40 + bits, "seq": 2**33 + bits,
                     "device_id": "ind-x", "options": {"bits": bits, **options}, "rng_seed": bits, "seed": seed.hex(),
                     "metadata": {"num_samples": 17, "loss": 0.3, "round_nonce": "0badc0de", "note": "x"},
                     "tensors": [{"name": n, "dtype_code": 2, "shape": list(a.shape),
                                  "f32": a.astype("<f4").tobytes().hex()} for n, a in tensors.items()]})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    rc, result, out = run_client("encode-updates", str(tmp_path / "jobs.json"), str(tmp_path), cwd=tmp_path)
    assert rc == 0, out
    ring = KeyRing({"ind-x": device_key.public_key})
    for bits, options in PACKED_CASES:
        name = f"ind-{bits}bit"
        data = (tmp_path / f"{name}.bin").read_bytes()
        assert data[4] == 2 and data[6] == 6, "a compact envelope (version 2) with codec 6"
        upd = decode_update(data, verifier=ring, require_signature=True)
        assert (upd.codec, upd.round_id, upd.seq, upd.device_id) == ("topk-packed", 40 + bits, 2**33 + bits, "ind-x")
        assert upd.metadata == jobs[0]["metadata"]
        for tname, x in inputs[name].items():
            got = upd.tensors[tname].reshape(-1)
            sent = np.frombuffer(bytes.fromhex(result["encoded"][name]["decoded"][tname]), "<f4")
            np.testing.assert_array_equal(got, sent, err_msg=f"{name}/{tname}")
            assert upd.tensors[tname].shape == x.shape
            _assert_packed_approximates(x.reshape(-1), got, bits, options)
        forged = bytearray(data)
        forged[-1] ^= 0x01
        with pytest.raises(SignatureError):
            decode_update(bytes(forged), verifier=ring, require_signature=True)


def _assert_packed_approximates(x: np.ndarray, got: np.ndarray, bits: int, options: dict) -> None:
    """Zero outside the k largest |x| (k from §8.6's options), within one quantization step on them."""
    if x.size == 0:
        return
    k = min(x.size, options["k"]) if "k" in options else max(1, int(np.ceil(options["ratio"] * x.size)))
    k = max(k, min(x.size, options.get("min_k", 1)))
    top = np.argsort(-np.abs(x), kind="stable")[:k]
    assert set(np.flatnonzero(got).tolist()) <= set(top.tolist())
    amax = float(np.abs(x[top]).max())
    step = amax if bits == 1 else amax / ((1 << (bits - 1)) - 1)
    assert float(np.abs(got[top] - x[top]).max()) <= step * (1 + 1e-5)


def test_edgeflow_topk_packed_updates_are_read_by_the_independent_client(tmp_path: Path) -> None:
    """edgeflow's signed compact envelopes (NumPy's RNG, error feedback state) decode identically in the
    independent client, which verifies the update/v2 signature; a tampered copy is refused."""
    from edgeflow.codecs import ErrorFeedback, decode_update, encode_update
    from edgeflow.signing import Signer

    key = PrivateKey.from_bytes(bytes([6]) * 32)
    signer = Signer("ef-dev", key)
    rng = np.random.default_rng(43)
    state = ErrorFeedback()
    files, want = [], {}
    for bits, options in PACKED_CASES:
        tensors = _interop_tensors(rng)
        data = encode_update(tensors, "topk-packed", round_id=bits, device_id="ef-dev", seq=100 + bits, signer=signer,
                             state=state, metadata={"base_version": bits, "metrics": {"acc": 0.5}, "big": 2**70},
                             rng=bits, bits=bits, **options)
        path = tmp_path / f"ef-{bits}bit.bin"
        path.write_bytes(data)
        files.append(str(path))
        want[path.name] = decode_update(data)
    tampered = bytearray(Path(files[0]).read_bytes())
    tampered[len(tampered) // 2] ^= 0x10
    (tmp_path / "tampered.bin").write_bytes(bytes(tampered))
    rc, result, out = run_client("decode-updates", key.public_key.hex, *files, str(tmp_path / "tampered.bin"),
                                 cwd=tmp_path)
    assert rc == 1 and set(result["refused"]) == {"tampered.bin"}, out
    assert set(result["decoded"]) == set(want)
    for fname, upd in want.items():
        got = result["decoded"][fname]
        assert (got["version"], got["codec"], got["round_id"], got["seq"], got["device_id"]) == (
            2, "topk-packed", upd.round_id, upd.seq, "ef-dev")
        assert got["metadata"] == upd.metadata
        for tname, arr in upd.tensors.items():
            t = got["tensors"][tname]
            assert t["shape"] == list(arr.shape) and t["dtype"] == "float32"
            np.testing.assert_array_equal(np.frombuffer(bytes.fromhex(t["f32"]), "<f4"), arr.reshape(-1),
                                          err_msg=f"{fname}/{tname}")


RANDK_CASES = [  # (codec, bits, options, layout): every randk bit width path, densities up to 1, both envelope versions
    ("randk-packed", 1, {"ratio": 0.1}, "names"), ("randk-packed", 2, {"ratio": 0.3}, "digest"),
    ("randk-packed", 3, {"ratio": 0.05}, "names"), ("randk-packed", 4, {"ratio": 1.0}, "digest"),
    ("randk-packed", 8, {"ratio": 0.5}, "names"), ("randk-packed", 5, {"ratio": 0.2}, "digest"),
    ("topk-packed", 4, {"ratio": 0.1}, "digest"), ("topk-packed", 1, {"k": 3, "min_k": 2}, "digest"),
]


def _layout(tensors: dict[str, np.ndarray]) -> list:
    return [[name, list(a.shape)] for name, a in tensors.items()]


def test_edgeflow_randk_and_layout_digest_updates_are_read_by_the_independent_client(tmp_path: Path) -> None:
    """edgeflow's signed randk-packed (codec 7, §8.7) and layout-digest (version 3, §7.7) envelopes on random inputs
    decode in the independent client, with its own PCG64 and the model's layout, to exactly edgeflow's values;
    without the layout, or tampered, they are refused."""
    from edgeflow.codecs import ErrorFeedback, decode_update, encode_update
    from edgeflow.signing import Signer

    key = PrivateKey.from_bytes(bytes([7]) * 32)
    signer = Signer("ef-dev", key)
    rng = np.random.default_rng(71)
    state = ErrorFeedback()
    files, want, shapes = [], {}, None
    for i, (codec, bits, options, layout) in enumerate(RANDK_CASES):
        tensors = _interop_tensors(rng)
        shapes = {n: a.shape for n, a in tensors.items()}
        data = encode_update(tensors, codec, round_id=i, device_id="ef-dev", seq=200 + i, signer=signer,
                             state=state, metadata={"num_samples": 3 + i}, rng=int(rng.integers(1 << 30)),
                             bits=bits, layout=layout, **options)
        assert data[4] == (3 if layout == "digest" else 2) and data[6] == (7 if codec == "randk-packed" else 6)
        path = tmp_path / f"ef-{i}-{codec}-{bits}bit-{layout}.bin"
        path.write_bytes(data)
        files.append(str(path))
        want[path.name] = decode_update(data, expected_shapes=shapes)
    (tmp_path / "layout.json").write_text(json.dumps(_layout(_interop_tensors(rng))))
    tampered = bytearray(Path(files[0]).read_bytes())
    tampered[len(tampered) // 2] ^= 0x10
    (tmp_path / "tampered.bin").write_bytes(bytes(tampered))
    rc, result, out = run_client("decode-updates", key.public_key.hex, *files, str(tmp_path / "tampered.bin"),
                                 "--layout", str(tmp_path / "layout.json"), cwd=tmp_path)
    assert rc == 1 and set(result["refused"]) == {"tampered.bin"}, out
    assert set(result["decoded"]) == set(want)
    for fname, upd in want.items():
        got = result["decoded"][fname]
        assert (got["version"], got["codec"], got["round_id"], got["seq"]) == (
            3 if fname.endswith("digest.bin") else 2, upd.codec, upd.round_id, upd.seq)
        assert got["metadata"] == upd.metadata
        assert set(got["tensors"]) == set(upd.tensors)
        for tname, arr in upd.tensors.items():
            t = got["tensors"][tname]
            assert t["shape"] == list(arr.shape)
            np.testing.assert_array_equal(np.frombuffer(bytes.fromhex(t["f32"]), "<f4"), arr.reshape(-1),
                                          err_msg=f"{fname}/{tname}")
    digest_files = [f for f in files if f.endswith("digest.bin")]
    rc, result, out = run_client("decode-updates", key.public_key.hex, *digest_files, cwd=tmp_path)  # no layout
    assert rc == 1 and not result["decoded"], out
    assert all("needs the receiver's model" in why for why in result["refused"].values()), result["refused"]
    other = _layout(_interop_tensors(rng))
    other[0][1] = other[0][1][::-1]  # the same names, one shape transposed: another model
    (tmp_path / "other.json").write_text(json.dumps(other))
    rc, result, out = run_client("decode-updates", key.public_key.hex, *digest_files, "--layout",
                                 str(tmp_path / "other.json"), cwd=tmp_path)
    assert rc == 1 and all("another model layout" in why for why in result["refused"].values()), out


def test_independent_randk_and_layout_digest_updates_are_accepted_by_edgeflow(tmp_path: Path) -> None:
    """The independent encoder's randk-packed sections (its PCG64, its seeds) and version-3 envelopes decode in
    edgeflow, given the model's shapes, to exactly what it sent."""
    from edgeflow.codecs import decode_update

    seed = bytes([8]) * 32
    ring = KeyRing({"ind-x": PrivateKey.from_bytes(seed).public_key})
    rng = np.random.default_rng(81)
    jobs, inputs = [], {}
    for i, (codec, bits, options, layout) in enumerate(RANDK_CASES):
        tensors = _interop_tensors(rng)
        name = f"ind-{i}"
        inputs[name] = tensors
        jobs.append({"name": name, "codec": codec, "round_id": 60 + i, "seq": 2**35 + i, "device_id": "ind-x",
                     "options": {"bits": bits, **options}, "rng_seed": 90 + i, "seed": seed.hex(), "layout": layout,
                     "metadata": {"num_samples": 5, "round_nonce": "00ff"},
                     "tensors": [{"name": n, "dtype_code": 2, "shape": list(a.shape),
                                  "f32": a.astype("<f4").tobytes().hex()} for n, a in tensors.items()]})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    rc, result, out = run_client("encode-updates", str(tmp_path / "jobs.json"), str(tmp_path), cwd=tmp_path)
    assert rc == 0, out
    for i, (codec, bits, options, layout) in enumerate(RANDK_CASES):
        name = f"ind-{i}"
        data = (tmp_path / f"{name}.bin").read_bytes()
        assert data[4] == (3 if layout == "digest" else 2) and data[6] == (7 if codec == "randk-packed" else 6)
        shapes = {n: a.shape for n, a in inputs[name].items()}
        upd = decode_update(data, verifier=ring, require_signature=True, expected_shapes=shapes)
        assert (upd.codec, upd.round_id, upd.seq, upd.metadata) == (codec, 60 + i, 2**35 + i, jobs[i]["metadata"])
        for tname, x in inputs[name].items():
            got = upd.tensors[tname]
            sent = np.frombuffer(bytes.fromhex(result["encoded"][name]["decoded"][tname]), "<f4")
            np.testing.assert_array_equal(got.reshape(-1), sent, err_msg=f"{name}/{tname}")
            assert got.shape == x.shape
            if codec == "randk-packed" and x.size:  # zero off the sample, within one quantization step on it
                nz = np.flatnonzero(got.reshape(-1))
                step = float(np.abs(x).max()) * (1 if bits == 1 else 1 / ((1 << (bits - 1)) - 1))
                assert float(np.abs(got.reshape(-1)[nz] - x.reshape(-1)[nz]).max(initial=0)) <= 2 * step * (1 + 1e-5)


DELTA_CODECS = [("int8", 0), ("topk-packed", 1), ("randk-packed", 2), ("dense", 3), ("fp16", 4), ("topk", 5)]


def test_the_independent_client_applies_edgeflow_model_deltas_bit_for_bit(tmp_path: Path) -> None:
    """§10.5 on random weights: every delta codec's model delta, applied by the independent client to the base,
    gives exactly apply_model_delta's weights and the announced digest; a wrong epoch or base is refused by both."""
    from edgeflow.codecs.model_delta import apply_model_delta, encode_model_delta
    from edgeflow.signing import Signer

    fleet = PrivateKey.from_bytes(bytes([9]) * 32)
    ring = KeyRing({"gateway": fleet.public_key})
    rng = np.random.default_rng(91)
    jobs, want = [], {}
    for codec, i in DELTA_CODECS:
        base = {"fc1.weight": rng.standard_normal((12, 10)).astype(np.float32),
                "fc1.bias": (rng.standard_normal(10) * 0.1).astype(np.float32),
                "scale": np.array(1.5, np.float32)}
        new = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.01).astype(np.float32)
               for k, v in base.items()}
        payload, result, digest = encode_model_delta(base, new, codec=codec, base_version=10 + i, version=11 + i,
                                                     epoch=3, signer=Signer("gateway", fleet), seed=100 + i)
        got = apply_model_delta(payload, weights=base, version=10 + i, epoch=3, keyring=ring)
        assert got.digest == digest
        want[codec] = got
        (tmp_path / f"{codec}.bin").write_bytes(payload)
        listed = [{"name": k, "shape": list(v.shape), "f32": v.astype("<f4").tobytes().hex()} for k, v in base.items()]
        for name, version, epoch in ((codec, 10 + i, 3), (f"{codec}-epoch", 10 + i, 4), (f"{codec}-base", 9 + i, 3)):
            jobs.append({"name": name, "file": str(tmp_path / f"{codec}.bin"), "fleet_key": fleet.public_key.hex,
                         "version": version, "epoch": epoch, "base": listed})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    rc, result, out = run_client("apply-deltas", str(tmp_path / "jobs.json"), cwd=tmp_path)
    assert rc == 1, out
    assert set(result["applied"]) == {c for c, _ in DELTA_CODECS}, out
    for codec, got in want.items():
        mine = result["applied"][codec]
        assert (mine["version"], mine["digest"]) == (got.version, got.digest), codec
        for name, arr in got.weights.items():
            assert mine["weights"][name] == np.asarray(arr, "<f4").tobytes().hex(), (codec, name)
        assert "epoch" in result["refused"][f"{codec}-epoch"] and "wrong_base" in result["refused"][f"{codec}-base"]


def _hostile_compact_envelopes() -> dict[str, tuple[bytes, str]]:
    """name -> (a compact envelope breaking one rule of §7.6/§8.6, what the independent client must say)."""
    from edgeflow.codecs.envelope import SectionInput, build_envelope

    def env(section: bytes, size: int = 4, meta: bytes = b"") -> bytes:
        return build_envelope(codec_id=6, round_id=1, seq=1, device_id="bad", metadata_json=meta,
                              sections=[SectionInput("w", 2, (size,), [section])], version=2)

    head = struct.pack("<Bf", 4, 0.1)
    ok = env(b"\x01" + head + b"\x01\x07")
    return {
        "gap-zero": (env(b"\x02" + head + b"\x01\x00\x77"), "gap of 0"),
        "index-past-end": (env(b"\x01" + head + b"\x05\x07"), "index out of range"),
        "padding-bits": (env(b"\x01" + head + b"\x01\xf7"), "padding bits"),
        "all-ones-code": (env(b"\x01" + head + b"\x01\x0f"), "code above 2 qmax"),
        "codes-short": (env(b"\x02" + head + b"\x01\x01"), "codes take 0 bytes"),
        "k-past-size": (env(b"\x05" + head + b"\x01" * 5 + b"\x77\x77\x07"), "k=5 > size=4"),
        "ten-byte-k": (env(b"\x80" * 9 + b"\x00" + head), "varint longer than 9"),
        "nan-scale": (env(b"\x01" + struct.pack("<Bf", 4, float("nan")) + b"\x01\x07"), "not finite"),
        "huge-scale": (env(b"\x01" + struct.pack("<Bf", 4, 1e9) + b"\x01\x07"), "beyond 10^9"),
        "zero-bits": (env(b"\x01" + struct.pack("<Bf", 0, 0.1) + b"\x01"), "bits 0 not in 1..8"),
        "meta-unknown-tag": (env(b"\x00" + head, meta=b"\x0a\x01\x01\x0c"), "unknown metadata tag 12"),
        "meta-unknown-key": (env(b"\x00" + head, meta=b"\x0a\x01\x0b\x00"), "unknown metadata key index 11"),
        "meta-repeated-key": (env(b"\x00" + head, meta=b"\x0a\x02\x01\x00\x01\x00"), "repeated metadata key"),
        "meta-nan": (env(b"\x00" + head, meta=b"\x0a\x01\x02\x05" + struct.pack("<f", float("nan"))), "NaN"),
        "meta-array": (env(b"\x00" + head, meta=b"\x09\x00"), "must be an object"),
        "meta-trailing": (env(b"\x00" + head, meta=b"\x0a\x00\x00"), "bytes after the metadata"),
        "trailing-byte": (ok + b"\x00", "its header declares"),
        "bad-crc": (ok[:-1] + bytes([ok[-1] ^ 1]), "CRC-32 mismatch"),
        # §8.6: senders write codec 6 only in version 2; this client refuses it in version 1, and edgeflow
        # (which may, §8.6) decodes it: see the test below
        "v1-with-codec-6": (build_envelope(codec_id=6, round_id=1, seq=1, device_id="bad", metadata_json=b"",
                                           sections=[SectionInput("w", 2, (4,), [b"\x01" + head + b"\x01\x07"])]),
                            "unknown codec id 6 in a version-1 envelope"),
    }


def test_both_decoders_refuse_each_hostile_compact_envelope(tmp_path: Path) -> None:
    """Each rule of §7.6/§8.6 broken once: the independent client and edgeflow both refuse it."""
    from edgeflow.codecs import decode_update
    from edgeflow.errors import CodecError

    cases = _hostile_compact_envelopes()
    for name, (data, _) in cases.items():
        (tmp_path / f"{name}.bin").write_bytes(data)
        if name == "v1-with-codec-6":
            assert decode_update(data).codec == "topk-packed"  # receivers MAY accept it (§8.6)
            continue
        with pytest.raises(CodecError):
            decode_update(data)
    rc, result, out = run_client("decode-updates", "00" * 32, *(str(tmp_path / f"{n}.bin") for n in cases),
                                 cwd=tmp_path)
    assert rc == 1 and not result["decoded"], out
    for name, (_, why) in cases.items():
        assert why in result["refused"].get(f"{name}.bin", ""), (name, result["refused"].get(f"{name}.bin"))


def softmax_regression(dim_in: int, dim_out: int, seed: int) -> onnx.ModelProto:
    """logits = x @ W + b: the model whose weights the independent client trains."""
    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((dim_in, dim_out)) * 0.1).astype(np.float32)
    b = np.zeros(dim_out, np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["logits"])],
        "softmax-regression",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dim_in])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", dim_out])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _f32(hex_text: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(hex_text), dtype="<f4").reshape(shape)


@pytest.mark.integration
def test_the_client_joins_a_federated_round_against_the_real_gateway(mosquitto_factory, tmp_path):  # noqa: F811
    """Three independent clients (int8 with a chunked update, dense, and topk-packed in a compact envelope)
    take part in one round."""
    broker = mosquitto_factory()
    fleet = "indep"
    fleet_key = PrivateKey.from_bytes(bytes(range(32)))
    seeds = {"ind-a": bytes([7]) * 32, "ind-b": bytes([9]) * 32, "ind-c": bytes([11]) * 32}
    ring = KeyRing({d: PrivateKey.from_bytes(s).public_key for d, s in seeds.items()})
    model = softmax_regression(32, 10, seed=3)
    # max_payload 1104 (the transport's minimum): the 1.3 KB global model travels as chunks.
    gw = MqttTransport.from_url(broker.url, client_id=f"{fleet}-gateway", max_payload=1104,
                                reconnect_min_s=0.05, reconnect_max_s=0.5)
    rm = RoundManager(
        gw, GatewayStore(tmp_path / "gw.sqlite"), fleet=fleet, fleet_key=fleet_key, keyring=ring, model=model,
        config=RoundConfig(rounds=1, min_clients=3, deadline_s=40, strategy="fedavg",
                           strategy_params={"stage": 0}, wait_for_devices_s=5,
                           train=TrainConfig(epochs=2, batch_size=16, lr=0.5, codec="int8")),
        candidates=lambda: [Candidate(d) for d in seeds],
    )
    before = {k: v.copy() for k, v in rm.weights.items()}
    rm.start()
    gw.connect(timeout=10)
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(rm.run(rounds=1)), daemon=True)
    runner.start()
    common = ["join", "--host", broker.host, "--port", str(broker.port), "--fleet", fleet,
              "--fleet-key", fleet_key.public_key.hex, "--timeout", "45"]
    procs = {
        "ind-a": subprocess.Popen([sys.executable, "-I", "-S", str(CLIENT), *common, "--device", "ind-a",
                                   "--seed", seeds["ind-a"].hex(), "--samples", "40", "--max-payload", "256"],
                                  cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        "ind-b": subprocess.Popen([sys.executable, "-I", "-S", str(CLIENT), *common, "--device", "ind-b",
                                   "--seed", seeds["ind-b"].hex(), "--samples", "24", "--codec", "dense"],
                                  cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        "ind-c": subprocess.Popen([sys.executable, "-I", "-S", str(CLIENT), *common, "--device", "ind-c",
                                   "--seed", seeds["ind-c"].hex(), "--samples", "32", "--codec", "topk-packed",
                                   "--codec-opts", json.dumps({"ratio": 0.2, "bits": 3, "min_k": 2})],
                                  cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }
    reports = {}
    try:
        for dev, proc in procs.items():
            out, _ = proc.communicate(timeout=60)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            assert proc.returncode == 0 and lines, f"{dev} failed:\n{out}"
            reports[dev] = json.loads(lines[-1])
        runner.join(30)
        assert not runner.is_alive(), "the gateway did not finish its round"
    finally:
        rm.stop()
        gw.close(timeout=2)
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    (metrics,) = results
    assert metrics.selected == 3 and metrics.participants == 3 and metrics.rejected == 0, metrics
    a, b, c = reports["ind-a"], reports["ind-b"], reports["ind-c"]
    assert c["codec"] == "topk-packed" and c["update_chunks"] == 0, c
    assert a["codec"] == "int8" and a["update_chunks"] >= 2, a  # announced codec; chunked update
    assert b["codec"] == "dense" and b["update_chunks"] == 0, b
    assert a["model_chunks"] >= 2, "the global model should have arrived in chunks"
    # FedAvg (exact float64 fold, stage=0): new = old + (n_a d_a + n_b d_b) / (n_a + n_b), where d is what
    # each client's envelope decodes to (int8: q * scale).
    n_a, n_b, n_c = a["num_samples"], b["num_samples"], c["num_samples"]
    for name, old in before.items():
        d_a = _f32(a["delta"][name], old.shape).astype(np.float64)
        d_b = _f32(b["delta"][name], old.shape).astype(np.float64)
        d_c = _f32(c["delta"][name], old.shape).astype(np.float64)
        assert np.abs(d_a).max() > 1e-3 and np.abs(d_b).max() > 1e-3, "the clients must really train"
        assert not np.allclose(d_a, d_b), "the two clients should send different deltas"
        # topk-packed at ratio 0.2 (min_k 2): at most a fifth of the entries, and some of them
        assert 0 < np.count_nonzero(d_c) <= max(2, int(np.ceil(0.2 * d_c.size))), name
        expected = (old.astype(np.float64) + (n_a * d_a + n_b * d_b + n_c * d_c) / (n_a + n_b + n_c)).astype(np.float32)
        # the gateway adds the float32 mean delta to the float32 weights: within an ulp of the float64 value
        np.testing.assert_allclose(rm.weights[name], expected, rtol=1e-6, atol=1e-7)
        # and both clients decoded the new global model the gateway published
        for r in (a, b, c):
            assert r["new_model_version"] == rm.version
            np.testing.assert_array_equal(_f32(r["new_model"][name], old.shape), rm.weights[name])
