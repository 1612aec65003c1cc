"""The published test vectors (tests/vectors/) against edgeflow's own code.

- the stored vectors are intact (manifest sizes and SHA-256s);
- edgeflow decodes every vector to the values the manifest lists;
- the version guard: regenerating every vector from the current code gives
  the stored bytes, unless a format version was bumped; a difference with
  unchanged versions fails with "the wire format changed without bumping
  the version" (the guard itself is tested by changing the format here);
- docs/wire-format.md lists the same versions as the code.

The independent implementation's side is tests/test_independent_client.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeflow.codecs import decode_update
from edgeflow.protocol.fleet import ACK_CONTEXT, BIRTH_CONTEXT, Command, Death
from edgeflow.protocol.ota import OtaOffer
from edgeflow.protocol.signed_json import open_signed
from edgeflow.errors import CodecError, SignatureError
from edgeflow.protocol import secagg_wire as secure
from edgeflow.protocol.rounds import RoundAnnouncement
from edgeflow.protocol import secagg_wire
from edgeflow.artifact import verify_artifact
from edgeflow.signing import KeyRing, PrivateKey
from edgeflow.transport.chunking import Reassembler, parse_chunk
from edgeflow.transport.topics import split_chunk_topic

HERE = Path(__file__).resolve().parent
VECTORS = HERE / "vectors"
DOC = HERE.parent / "docs" / "wire-format.md"


def _load_generator():
    spec = importlib.util.spec_from_file_location("edgeflow_wire_vectors_generate", VECTORS / "generate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


@pytest.fixture(scope="module")
def stored() -> tuple[dict[str, bytes], dict[str, Any]]:
    return gen.stored(VECTORS)


def _keys(manifest: dict[str, Any]) -> dict[str, PrivateKey]:
    return {role: PrivateKey.from_bytes(bytes.fromhex(k["seed"])) for role, k in manifest["keys"].items()}


def _values(desc: dict[str, Any]) -> np.ndarray:
    if "f32" in desc:
        return np.frombuffer(bytes.fromhex(desc["f32"]), dtype="<f4")
    out = np.zeros(desc["size"], np.float32)
    for i, h in desc["nonzero"]:
        out[i] = np.frombuffer(bytes.fromhex(h), dtype="<f4")[0]
    return out


# ------------------------------------------------------------------ integrity


def test_manifest_lists_every_file_with_its_hash(stored) -> None:
    files, manifest = stored
    listed = {v["file"]: v for v in manifest["vectors"] if "file" in v}
    assert set(listed) == set(files), "every .bin file is a listed vector and vice versa"
    for name, v in listed.items():
        assert v["size"] == len(files[name]) and v["sha256"] == hashlib.sha256(files[name]).hexdigest(), name
    kinds = {v["kind"] for v in manifest["vectors"]}
    assert {"envelope", "chunk", "chunked_transfer", "signed_json", "secagg", "ota_artifact", "ota_offer",
            "model_delta"} <= kinds
    codecs = {v["envelope"]["codec"] for v in manifest["vectors"] if v["kind"] == "envelope"}
    assert codecs == {"dense", "fp16", "int8", "topk", "topk-int8", "topk-packed", "randk-packed"}, \
        "one vector per codec at least"
    versions = {v["envelope"]["version"] for v in manifest["vectors"] if v["kind"] == "envelope"}
    assert versions == {1, 2, 3}, "every envelope version has vectors"
    assert any(v["kind"] == "envelope" and v["envelope"]["signed_by"] for v in manifest["vectors"])


# ------------------------------------------------------------------ decode direction


def _shapes(e: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """A version-3 vector's layout (the receiver's model: names and shapes); None for versions 1 and 2."""
    return {name: tuple(shape) for name, shape in e["layout"]["tensors"]} if e["version"] == 3 else None


def test_edgeflow_decodes_every_envelope_vector(stored) -> None:
    files, manifest = stored
    keys = _keys(manifest)
    ring = KeyRing({"dev-1": keys["device"].public_key, "gateway": keys["fleet"].public_key})
    for v in (v for v in manifest["vectors"] if v["kind"] in ("envelope", "model_delta")):
        e = v["envelope"]
        upd = decode_update(files[v["file"]], verifier=ring if e["signed_by"] else None,
                            require_signature=bool(e["signed_by"]), expected_shapes=_shapes(e))
        assert (upd.round_id, upd.seq, upd.device_id, upd.codec) == (e["round_id"], e["seq"], e["device_id"],
                                                                     e["codec"]), v["name"]
        if e["version"] == 1:
            assert upd.metadata == (json.loads(e["metadata_json"]) if e["metadata_json"] else {}), v["name"]
        else:
            assert upd.metadata == e["metadata"], v["name"]
        assert [t["name"] for t in e["tensors"]] == list(upd.tensors)
        for t in e["tensors"]:
            got = upd.tensors[t["name"]]
            assert got.dtype.name == t["dtype"] and list(got.shape) == t["shape"], (v["name"], t["name"])
            want = _values(t["decoded"])
            np.testing.assert_array_equal(got.astype(np.float32).reshape(-1), want, err_msg=f"{v['name']}/{t['name']}")


def test_edgeflow_rejects_every_altered_signed_vector(stored) -> None:
    files, manifest = stored
    keys = _keys(manifest)
    ring = KeyRing({"dev-1": keys["device"].public_key, "gateway": keys["fleet"].public_key})
    signed = [v for v in manifest["vectors"] if v["kind"] in ("envelope", "model_delta") and v["envelope"]["signed_by"]]
    assert {v["envelope"]["version"] for v in signed} == {1, 2, 3} and "model-delta" in {v["name"] for v in signed}
    for v in signed:
        data = bytearray(files[v["file"]])
        data[-1] ^= 0x80  # inside the Ed25519 signature
        with pytest.raises(SignatureError):
            decode_update(bytes(data), verifier=ring, expected_shapes=_shapes(v["envelope"]))
        data = bytearray(files[v["file"]])
        # the round id (version 1: u64 at 12; version 2: the varint after the header length's varint at 7):
        # the CRC catches it before the signature is even checked
        e = v["envelope"]
        data[20 if e["version"] == 1 else 7 + (e["header_length"].bit_length() + 6) // 7] ^= 0x01
        with pytest.raises(CodecError, match="CRC"):
            decode_update(bytes(data), verifier=ring, expected_shapes=_shapes(e))


def test_the_compact_vectors_pin_down_every_metadata_tag_and_packed_field(stored) -> None:
    """Binary metadata (docs §7.6) and topk-packed sections (§8.6) as the manifest lists them."""
    from edgeflow.codecs.metadata import pack_metadata, unpack_metadata

    files, manifest = stored
    compact = [v for v in manifest["vectors"] if v["kind"] == "envelope" and v["envelope"]["version"] == 2
               and v["envelope"]["codec"] == "topk-packed"]
    assert {"envelope-topk-packed", "envelope-topk-packed-signed", "envelope-topk-packed-edge"} <= {
        v["name"] for v in compact}
    tags, bits, ks = set(), set(), set()
    for v in compact:
        e = v["envelope"]
        raw = bytes.fromhex(e["metadata_hex"])
        assert unpack_metadata(raw) == e["metadata"] and pack_metadata(e["metadata"]) == raw, v["name"]
        assert raw in files[v["file"]]
        tags |= _metadata_tags(raw) if raw else set()
        for t in e["tensors"]:
            p = t["topk_packed"]
            assert p["k"] == len(p["indices"]) == len(p["gaps"]) == len(p["codes"]), (v["name"], t["name"])
            assert [sum(p["gaps"][: i + 1]) - 1 for i in range(p["k"])] == p["indices"]
            bits.add(p["bits"])
            ks.add(p["k"])
    assert tags == set(range(12)), f"metadata tags without a vector: {sorted(set(range(12)) - tags)}"
    assert {1, 2, 3, 4, 5, 8} <= bits and 0 in ks


def test_the_randk_vectors_pin_down_the_pcg64_sample_and_the_packed_codes(stored) -> None:
    """randk-packed (docs §8.7): the section's fields, the raw PCG64 outputs and the sampled indices as listed."""
    from edgeflow.codecs.randk_packed import sample_indices

    files, manifest = stored
    randk = [v for v in manifest["vectors"] if v["kind"] == "envelope" and v["envelope"]["codec"] == "randk-packed"]
    assert {v["envelope"]["version"] for v in randk} == {2, 3}
    densities, ks, bits = set(), set(), set()
    for v in randk:
        e, data = v["envelope"], files[v["file"]]
        for t in e["tensors"]:
            r, n = t["randk_packed"], int(np.prod(t["shape"]))
            section = data[t["offset"]:t["offset"] + t["length"]]
            assert struct.unpack_from("<BHI", section) == (r["bits"], r["density"], r["seed"]), (v["name"], t["name"])
            assert section[7:11].hex() == r["scale"] and len(section) == 11 + (r["k"] * r["bits"] + 7) // 8
            raw = np.random.PCG64(r["seed"]).random_raw(min(n, 4)) if n else []
            assert [f"{int(x):016x}" for x in raw] == r["pcg64_raw"], (v["name"], t["name"])
            assert sample_indices(r["seed"], n, r["density"] or 1 << 16).tolist() == r["indices"]
            assert r["k"] == len(r["indices"]) == len(r["codes"])
            codes = int.from_bytes(section[11:], "little")
            assert [(codes >> (i * r["bits"])) & ((1 << r["bits"]) - 1) for i in range(r["k"])] == r["codes"]
            decoded = _values(t["decoded"])
            assert set(np.flatnonzero(decoded).tolist()) <= set(r["indices"])
            densities.add(r["density"])
            ks.add(r["k"])
            bits.add(r["bits"])
    assert 0 in densities and 0 in ks and {1, 2, 3} <= bits  # density 65536 written as 0, an empty sample


def test_the_layout_digest_vectors_name_the_layout_and_need_it(stored) -> None:
    """Version 3 (docs §7.7): digest, dtype code and section lengths as listed; refused without the model."""
    from edgeflow.codecs import peek_update
    from edgeflow.codecs.envelope import layout_digest

    files, manifest = stored
    v3 = [v for v in manifest["vectors"] if v["kind"] == "envelope" and v["envelope"]["version"] == 3]
    assert {v["envelope"]["codec"] for v in v3} == {"topk-packed", "randk-packed"}
    for v in v3:
        e, data = v["envelope"], files[v["file"]]
        lay = e["layout"]
        shapes = [(name, tuple(shape)) for name, shape in lay["tensors"]]
        assert layout_digest(shapes).hex() == lay["digest"]
        assert hashlib.sha256(b"edgeflow:layout/v1\0" + bytes.fromhex(lay["hashed"])).digest()[:8].hex() == lay["digest"]
        head = peek_update(data)
        assert (head.version, head.layout.hex(), head.tensors) == (3, lay["digest"], ())
        assert list(head.section_lengths) == lay["section_lengths"] == [t["length"] for t in e["tensors"]]
        at = data.index(bytes.fromhex(lay["digest"])) + 8
        assert data[at] == lay["dtype_code"] and data[at + 1] == len(shapes)  # dtype, then the tensor count
        assert [t["name"] for t in e["tensors"]] == sorted(t["name"] for t in e["tensors"])  # sections in name order
        with pytest.raises(CodecError) as err:
            decode_update(data)
        assert err.value.reason == "shape_mismatch"  # type: ignore[attr-defined]
        other = dict(shapes)
        first = next(iter(other))
        other[first] = other[first][::-1] if len(other[first]) > 1 else (*other[first], 1)
        with pytest.raises(CodecError, match="another model layout"):
            decode_update(data, expected_shapes=other)


def _weights_of(listed: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    return {t["name"]: np.frombuffer(bytes.fromhex(t["f32"]), "<f4").reshape(t["shape"]) for t in listed}


def test_the_model_delta_vector_applies_to_its_base_exactly(stored) -> None:
    """§10.5: applied to the listed base the delta gives the listed result, bit for bit, with both digests;
    anything else is refused with the spec's reason."""
    from edgeflow.codecs.model_delta import apply_model_delta, weights_digest

    files, manifest = stored
    (v,) = [v for v in manifest["vectors"] if v["kind"] == "model_delta"]
    d, data = v["delta"], files[v["file"]]
    assert v["topic"] == "edgeflow/lab/gateway/model_delta"
    ring = KeyRing({"gateway": _keys(manifest)["fleet"].public_key})
    base = _weights_of(d["base"])
    assert weights_digest(base) == d["base_sha256"]
    got = apply_model_delta(data, weights=base, version=d["base_version"], epoch=d["epoch"], keyring=ring)
    assert (got.version, got.epoch, got.digest) == (d["model_version"], d["epoch"], d["model_sha256"])
    want = _weights_of(d["result"])
    for name, w in want.items():
        assert got.weights[name].view(np.uint32).tolist() == w.view(np.uint32).tolist(), name
    assert any(not np.array_equal(want[k], _weights_of(d["new"])[k]) for k in want)  # fp16 is lossy: result != new
    meta = decode_update(data).metadata
    assert {k: meta[k] for k in ("kind", "model_version", "epoch", "base_version", "base_sha256", "model_sha256")} == {
        "kind": "model_delta", "model_version": d["model_version"], "epoch": d["epoch"],
        "base_version": d["base_version"], "base_sha256": d["base_sha256"], "model_sha256": d["model_sha256"]}
    for kw, reason in (({"epoch": d["epoch"] + 1}, "epoch"), ({"version": d["base_version"] - 1}, "wrong_base"),
                       ({"weights": want}, "base_digest")):
        args = {"weights": base, "version": d["base_version"], "epoch": d["epoch"], **kw}
        with pytest.raises(CodecError) as err:
            apply_model_delta(data, keyring=ring, **args)
        assert err.value.reason == reason  # type: ignore[attr-defined]


def _metadata_tags(raw: bytes) -> set[int]:
    """Every tag in a binary metadata value (a walk written from docs §7.6, independent of the reader)."""
    seen: set[int] = set()

    def varint(pos: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = raw[pos]
            value, shift, pos = value | (byte & 0x7F) << shift, shift + 7, pos + 1
            if byte < 0x80:
                return value, pos

    def value(pos: int) -> int:
        tag = raw[pos]
        seen.add(tag)
        pos += 1
        if tag in (3, 4):
            return varint(pos)[1]
        if tag in (5, 6):
            return pos + (4 if tag == 5 else 8)
        if tag in (7, 8, 11):
            n, pos = varint(pos)
            return pos + n
        if tag in (9, 10):
            n, pos = varint(pos)
            for _ in range(n):
                if tag == 10:
                    key, pos = varint(pos)
                    if key == 0:
                        n_key, pos = varint(pos)
                        pos += n_key
                pos = value(pos)
        return pos

    assert value(0) == len(raw)
    return seen


def test_edgeflow_reassembles_the_chunked_vector_in_any_order(stored) -> None:
    files, manifest = stored
    (t,) = [v for v in manifest["vectors"] if v["kind"] == "chunked_transfer"]
    chunks = {v["file"]: v for v in manifest["vectors"] if v["kind"] == "chunk"}
    r = Reassembler()
    done = None
    for f in reversed(t["chunk_files"]):
        base, index = split_chunk_topic(chunks[f]["topic"])
        assert base == t["base_topic"] and index == chunks[f]["index"]
        header, data = parse_chunk(files[f])
        assert header.transfer_id.hex() == t["transfer_id"] and header.count == t["count"]
        assert f"{header.crc32:08x}" == chunks[f]["crc32"] and len(data) == chunks[f]["data_length"]
        done = r.add(base, files[f]) or done
    assert done is not None and done.payload == files[t["payload_file"]]
    assert hashlib.sha256(done.payload).hexdigest() == t["payload_sha256"]


def test_edgeflow_opens_every_control_vector(stored) -> None:
    files, manifest = stored
    keys = _keys(manifest)
    fleet, device = keys["fleet"].public_key, keys["device"].public_key
    by_name = {v["name"]: v for v in manifest["vectors"]}
    ann = RoundAnnouncement.verify(files["round-announcement.bin"], fleet)
    assert ann.to_body() == by_name["round-announcement"]["body"]
    cmd = Command.verify(files["command.bin"], fleet)
    assert cmd.name == by_name["command"]["body"]["name"]
    assert open_signed(files["ack-refusal.bin"], device, ACK_CONTEXT) == by_name["ack-refusal"]["body"]
    assert open_signed(files["birth.bin"], device, BIRTH_CONTEXT) == by_name["birth"]["body"]
    assert Death.verify(files["death.bin"], device) == Death.from_body(by_name["death"]["body"])
    for name in ("secagg-advertise", "secagg-masked"):
        frame = secure.unseal(files[f"{name}.bin"], device)
        msg = secagg_wire.decode_message(frame)
        assert msg.client_id == "dev-1" and frame[5] == by_name[name]["frame_kind"]
    art = verify_artifact(files["ota-artifact.bin"], fleet, profile="raspberry-pi-4", fleet="lab")
    assert art.manifest_bytes.decode() == by_name["ota-artifact"]["manifest_text"]
    offer = OtaOffer.from_bytes(files["ota-offer.bin"])
    assert offer.artifact == files["ota-artifact.bin"]
    assert Command.verify(offer.command, fleet).args["artifact_sha256"] == art.sha256


# ------------------------------------------------------------------ the version guard


def guard(files: dict[str, bytes], manifest: dict[str, Any], old_files: dict[str, bytes],
          old_manifest: dict[str, Any]) -> None:
    """Fail if regenerated vectors differ from the stored ones (see the module docstring)."""
    now, then = manifest["versions"], old_manifest["versions"]
    old_vectors = {v["name"]: v for v in old_manifest["vectors"]}
    problems, bumped = [], []
    for v in manifest["vectors"]:
        old = old_vectors.get(v["name"])
        changed_versions = sorted(k for k in v["depends"] if now.get(k) != then.get(k))
        if old is None:
            problems.append(f"{v['name']}: new vector, not in the stored manifest")
            continue
        new_bytes, old_bytes = files.get(v.get("file", "")), old_files.get(old.get("file", ""))
        if new_bytes == old_bytes and v == old:
            continue
        if changed_versions:
            bumped.append(f"{v['name']} ({', '.join(f'{k} {then.get(k)!r} -> {now.get(k)!r}' for k in changed_versions)})")
            continue
        if new_bytes != old_bytes and new_bytes is not None and old_bytes is not None:
            at = next((i for i, (x, y) in enumerate(zip(new_bytes, old_bytes)) if x != y),
                      min(len(new_bytes), len(old_bytes)))
            problems.append(f"{v['name']}: bytes differ from offset {at} (now {len(new_bytes)} bytes, "
                            f"stored {len(old_bytes)}) while {v['depends']} are unchanged")
        else:
            problems.append(f"{v['name']}: manifest fields differ while {v['depends']} are unchanged")
    gone = sorted(set(old_vectors) - {v["name"] for v in manifest["vectors"]})
    problems += [f"{name}: stored vector no longer generated" for name in gone]
    if problems:
        pytest.fail(
            "the wire format changed without bumping the version:\n  " + "\n  ".join(problems)
            + "\nIf the change is intended, bump the version of the format that changed (docs/wire-format.md, "
            "'Versioning'), then regenerate with `python tests/vectors/generate.py` and update the spec."
        )
    if bumped or now != then:
        changed = ", ".join(f"{k} {then.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(now) | set(then))
                            if now.get(k) != then.get(k))
        pytest.fail(
            f"a wire-format version was bumped ({changed}), so the stored vectors are out of date"
            + (": " + "; ".join(bumped) if bumped else "")
            + "\nregenerate them with `python tests/vectors/generate.py`, update docs/wire-format.md, and commit both."
        )


def test_vectors_match_the_code(stored) -> None:
    files, manifest = gen.build_all()
    guard(files, manifest, *stored)


def test_the_generator_is_deterministic() -> None:
    a, ma = gen.build_all()
    b, mb = gen.build_all()
    assert a == b and gen.manifest_text(ma) == gen.manifest_text(mb)


@pytest.mark.parametrize("change", ["codec id", "envelope layout", "chunk byte order", "fp16 rounding",
                                    "signed json", "round body", "packed scale byte order", "metadata key table",
                                    "randk header byte order", "randk index stream", "layout digest",
                                    "layout digest size", "weights digest", "delta metadata"])
def test_the_guard_catches_a_format_change_without_a_version_bump(stored, monkeypatch, change) -> None:
    from edgeflow.codecs import envelope, fp16
    from edgeflow.codecs.dense import DenseCodec
    from edgeflow.protocol import rounds as messages
    from edgeflow.protocol import signed_json
    from edgeflow.transport import chunking

    if change == "codec id":
        from edgeflow.codecs import registry

        monkeypatch.setattr(DenseCodec, "codec_id", 9)
        monkeypatch.setitem(registry._BY_ID, 9, registry._BY_ID[1])
    elif change == "envelope layout":
        monkeypatch.setattr(envelope, "_FIXED", struct.Struct("<QQHHI4x"))  # 4 more header bytes
    elif change == "chunk byte order":
        monkeypatch.setattr(chunking, "_HEADER", struct.Struct("<4sBB2x16sIIQI32sI"))
    elif change == "fp16 rounding":
        def truncating(self, x, ctx, residual=None):  # round towards zero instead of to nearest
            h = x.astype("<f2")
            h = np.where(np.abs(h.astype(np.float32)) > np.abs(x), np.nextafter(h, np.float16(0)), h).astype("<f2")
            return [memoryview(h).cast("B")], None

        monkeypatch.setattr(fp16.Fp16Codec, "encode", truncating)
    elif change == "signed json":
        real_dumps = json.dumps
        monkeypatch.setattr(signed_json.json, "dumps", lambda obj, **kw: real_dumps(obj, **{**kw, "separators": (", ", ": ")}))
    elif change == "packed scale byte order":
        from edgeflow.codecs import topk_packed

        monkeypatch.setattr(topk_packed, "_BITS_SCALE", struct.Struct(">Bf"))
    elif change == "metadata key table":
        from edgeflow.codecs import metadata

        swapped = (metadata.KEYS[1], metadata.KEYS[0], *metadata.KEYS[2:])  # num_samples <-> loss
        monkeypatch.setattr(metadata, "KEYS", swapped)
        monkeypatch.setattr(metadata, "_KEY_INDEX", {k: i + 1 for i, k in enumerate(swapped)})
    elif change == "round body":
        real_body = messages.RoundAnnouncement.to_body
        monkeypatch.setattr(messages.RoundAnnouncement, "to_body", lambda self: {**real_body(self), "extra": 1})
    elif change == "randk header byte order":
        from edgeflow.codecs import randk_packed

        monkeypatch.setattr(randk_packed, "_HEAD", struct.Struct(">BHIf"))
    elif change == "randk index stream":  # another PRNG (or seeding) for the sample
        from edgeflow.codecs import randk_packed

        real_sample = randk_packed.sample_indices
        monkeypatch.setattr(randk_packed, "sample_indices", lambda seed, n, density: real_sample(seed ^ 1, n, density))
    elif change == "layout digest":
        real_digest = envelope.layout_digest
        monkeypatch.setattr(envelope, "layout_digest", lambda shapes: real_digest(list(shapes)[::-1] + [("x", ())]))
    elif change == "layout digest size":  # 16 bytes of SHA-256, written and read consistently by edgeflow
        monkeypatch.setattr(envelope, "LAYOUT_DIGEST_SIZE", 16)
    elif change == "weights digest":
        from edgeflow.codecs import model_delta

        monkeypatch.setattr(model_delta, "DIGEST_CONTEXT", b"edgeflow-weights-v2\0")
    elif change == "delta metadata":
        from edgeflow.codecs import model_delta

        monkeypatch.setattr(model_delta, "DELTA_KIND", "delta")
    caught_by_reference = {"packed scale byte order": "topk-packed reference layout disagrees",
                           "randk header byte order": "randk-packed reference layout disagrees",
                           "randk index stream": "randk-packed reference layout disagrees",
                           "layout digest": "layout digest reference disagrees",
                           "layout digest size": "layout digest reference disagrees",
                           "weights digest": "weights digest reference disagrees"}
    if change in caught_by_reference:  # the generator's step-by-step reference of the spec catches it first
        with pytest.raises(AssertionError, match=caught_by_reference[change]):
            gen.build_all()
        return
    files, manifest = gen.build_all()
    with pytest.raises(pytest.fail.Exception, match="the wire format changed without bumping the version"):
        guard(files, manifest, *stored)


@pytest.mark.parametrize("bump", ["envelope", "spec"])
def test_the_guard_asks_for_regeneration_after_a_version_bump(stored, monkeypatch, bump) -> None:
    """An incompatible change bumps the format's version, a compatible one the spec revision (§2)."""
    from edgeflow.codecs import envelope

    if bump == "envelope":
        old = envelope.VERSION
        new = 4  # the next free envelope version: 2 is the compact envelope (§7.6), 3 the layout digest
        monkeypatch.setattr(envelope, "VERSION", new)
        monkeypatch.setitem(envelope.SIGN_CONTEXTS, new, envelope.SIGN_CONTEXT)
    else:
        old = gen.SPEC_REVISION
        new = old + 1
        monkeypatch.setattr(gen, "SPEC_REVISION", new)
    files, manifest = gen.build_all()
    with pytest.raises(pytest.fail.Exception, match=rf"(?s)version was bumped.*{bump} {old} -> {new}.*generate\.py") as err:
        guard(files, manifest, *stored)
    assert "without bumping" not in str(err.value)


# ------------------------------------------------------------------ the document


def test_the_spec_lists_the_versions_the_code_has() -> None:
    text = DOC.read_text(encoding="utf-8")
    table = dict(re.findall(r"^\| `([a-z_]+)` \| `([^`]*)` \|", text, flags=re.M))
    versions = {k: str(v) for k, v in gen.current_versions().items()}
    assert table == versions, "the 'Versioning' table of docs/wire-format.md must list exactly the code's versions"
    assert f"revision {gen.SPEC_REVISION}" in text.splitlines()[2]


def test_the_spec_names_every_vector() -> None:
    text = DOC.read_text(encoding="utf-8")
    _, manifest = gen.stored(VECTORS)
    missing = [v["name"] for v in manifest["vectors"] if f"`{v['name']}`" not in text]
    assert not missing, f"docs/wire-format.md does not describe vectors {missing}"
