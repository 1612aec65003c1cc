"""An edgeflow device written only from docs/wire-format.md: no edgeflow, no numpy.

    python -I -S efclient.py selfcheck
    python -I -S efclient.py vectors tests/vectors
    python -I -S efclient.py encode-updates jobs.json OUT_DIR     # envelope files from float32 inputs
    python -I -S efclient.py decode-updates <public key hex> FILE... [--layout LAYOUT.json]
    python -I -S efclient.py apply-deltas jobs.json                # model deltas (§10.5) applied to a base
    python -I -S efclient.py join --host 127.0.0.1 --port 1883 --fleet lab --device ind-a \\
        --seed <64 hex> --fleet-key <64 hex> [--codec int8] [--max-payload 256]

``vectors`` decodes every test vector, checks it against the manifest, and
re-encodes it twice (from the decoded fields and from the listed inputs),
byte for byte. ``join`` takes part in one federated round against a real
gateway over MQTT 3.1.1: it verifies the fleet-signed announcement and
global model, runs a few steps of SGD on the model's softmax-regression
layer in plain Python, encodes and signs the delta, publishes it, and waits
for the next global model. Every outcome is printed as one JSON object.

Python's ``-I -S`` flags keep site-packages (and with it edgeflow and numpy)
off ``sys.path``; the test also checks the imports of these files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ed25519  # noqa: E402
import efwire as w  # noqa: E402
import mqtt311  # noqa: E402

# ------------------------------------------------------------------ vectors


def _values_from(desc: dict) -> list[float]:
    if "f32" in desc:
        return w.f32_list(bytes.fromhex(desc["f32"]))
    out = [0.0] * desc["size"]
    for i, h in desc["nonzero"]:
        out[i] = w.f32_list(bytes.fromhex(h))[0]
    return out


def _uniforms(desc: dict | None):
    return iter(w.f32_list(bytes.fromhex(desc["uniform"])) if desc else [])


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.count = 0

    def eq(self, what: str, got, want) -> None:
        self.count += 1
        if got != want:
            self.failures.append(f"{what}: got {str(got)[:120]!r}, want {str(want)[:120]!r}")


def _keys(manifest: dict, c: Check) -> dict[str, tuple[bytes, bytes]]:
    out = {}
    for role, k in manifest["keys"].items():
        seed = bytes.fromhex(k["seed"])
        pub = ed25519.public_key(seed)
        c.eq(f"{role} public key", pub.hex(), k["public_key"])
        c.eq(f"{role} key id", w.key_id(pub).hex(), k["key_id"])
        out[role] = (seed, pub)
    return out


def vector_uniform(seed: int, i: int) -> float:
    h = hashlib.sha256(seed.to_bytes(8, "little") + i.to_bytes(8, "little")).digest()
    return int.from_bytes(h[:3], "big") / float(1 << 24)


def vector_seed(seed: int, j: int) -> int:
    """§8.7: the vectors' j-th randk seed."""
    return int.from_bytes(hashlib.sha256(b"randk-seed" + seed.to_bytes(8, "little") + j.to_bytes(8, "little"))
                          .digest()[:4], "little")


def _packed(t: dict) -> dict:
    return t.get("int8") or t.get("topk_int8") or t.get("topk_packed") or t.get("randk_packed") or {}


def check_envelope(v: dict, data: bytes, keys: dict, c: Check) -> dict:
    e = v["envelope"]
    layout = None
    if e["version"] == w.VERSION_LAYOUT:  # §7.7: the receiver's model names the tensors
        lay = e["layout"]
        layout = [(name, shape) for name, shape in lay["tensors"]]
        c.eq(f"{v['name']} layout hashed", w.layout_hashed(layout).hex(), lay["hashed"])
        c.eq(f"{v['name']} layout digest", w.layout_digest(layout).hex(), lay["digest"])
        try:
            w.parse_envelope(data)
            c.eq(f"{v['name']} refused without the model", "decoded", "refused")
        except w.WireError:
            c.eq(f"{v['name']} refused without the model", "refused", "refused")
    env = w.parse_envelope(data, layout=layout)
    if layout is not None:
        c.eq(f"{v['name']} layout digest read", env["layout_digest"].hex(), e["layout"]["digest"])
        c.eq(f"{v['name']} dtype code", env["dtype_code"], e["layout"]["dtype_code"])
        c.eq(f"{v['name']} section lengths", env["section_lengths"], e["layout"]["section_lengths"])
    compact = e["version"] in (w.VERSION_COMPACT, w.VERSION_LAYOUT)
    meta_field = "metadata_hex" if compact else "metadata_json"
    for field in ("version", "flags", "codec", "codec_id", "round_id", "seq", "device_id", meta_field,
                  "header_length", "crc_offset"):
        c.eq(f"{v['name']} {field}", env[field], e[field])
    c.eq(f"{v['name']} crc32", f"{env['crc32']:08x}", e["crc32"])
    secret = None
    if e["signed_by"]:
        secret, pub = keys[e["signed_by"]]
        w.verify_envelope(env, pub)
        c.eq(f"{v['name']} key id", env["key_id"].hex(), e["key_id"])
        c.eq(f"{v['name']} signature", env["signature"].hex(), e["signature"])
        c.eq(f"{v['name']} signing message", env["signing_message"].hex(), e["signing_message"])
    c.eq(f"{v['name']} tensor count", len(env["tensors"]), len(e["tensors"]))
    rebuilt, from_inputs = [], []
    for t, want in zip(env["tensors"], e["tensors"]):
        for field in ("name", "dtype", "dtype_code", "shape", "offset", "length"):
            c.eq(f"{v['name']}/{want['name']} {field}", t[field], want[field])
        c.eq(f"{v['name']}/{want['name']} decoded values", w.f32_bytes(t["values"]),
             w.f32_bytes(_values_from(want["decoded"])))
        rebuilt.append((t["name"], t["dtype_code"], t["shape"], w.encode_section(env["codec"], t["fields"])))
        extra = _packed(want) or None
        options = e.get("options")
        if env["codec"] == "topk-packed":
            _check_packed_fields(f"{v['name']}/{want['name']}", t["fields"], want["topk_packed"], c)
        elif env["codec"] == "randk-packed":
            r = want["randk_packed"]
            _check_randk_fields(f"{v['name']}/{want['name']}", t["fields"], r, c)
            c.eq(f"{v['name']}/{want['name']} seed follows §8.7", r["seed"],
                 vector_seed(e["rng_seed"], len(from_inputs)))
            options = {**(options or {}), "seed": r["seed"]}  # the sender's choice, as the uniforms are
        fields = w.encode_values(env["codec"], _values_from(want["input"]), uniforms=_uniforms(extra),
                                 k=e.get("k"), options=options)
        from_inputs.append((t["name"], t["dtype_code"], t["shape"], w.encode_section(env["codec"], fields)))
    listed = b"".join(bytes.fromhex(_packed(t).get("uniform", "")) for t in e["tensors"])
    if e["rng_seed"] is not None:  # §8.3: the vectors' uniforms come from a SHA-256 counter
        derived = [vector_uniform(e["rng_seed"], i) for i in range(len(listed) // 4)]
        c.eq(f"{v['name']} uniforms follow §8.3", w.f32_bytes(derived), listed)
    if compact:  # §7.6: binary metadata, members in the sender's order (the manifest keeps it)
        c.eq(f"{v['name']} metadata decoded", env["metadata"], e["metadata"])
        meta = w.pack_metadata(e["metadata"])
        c.eq(f"{v['name']} metadata re-encoded", meta.hex(), e["metadata_hex"])
        build = w.build_layout_envelope if layout is not None else w.build_compact_envelope
    else:
        meta = w.metadata_json(json.loads(e["metadata_json"])) if e["metadata_json"] else b""
        c.eq(f"{v['name']} metadata is canonical", meta.decode(), e["metadata_json"])
        build = w.build_envelope
    for label, parts in (("re-encoded from its fields", rebuilt), ("encoded from the inputs", from_inputs)):
        out = build(env["codec"], env["round_id"], env["seq"], env["device_id"], meta, parts, secret)
        c.eq(f"{v['name']} {label}", out.hex(), data.hex())
    return env


def _check_randk_fields(what: str, got: dict, want: dict, c: Check) -> None:
    """§8.7 field by field, and the first raw PCG64 outputs of the seed."""
    for field in ("k", "bits", "density", "seed", "indices", "codes"):
        c.eq(f"{what} {field}", got[field], want[field])
    c.eq(f"{what} scale", w.f32_bytes([got["scale"]]).hex(), want["scale"])
    gen = w.PCG64(want["seed"])
    c.eq(f"{what} pcg64 raw outputs", [f"{gen.next():016x}" for _ in want["pcg64_raw"]], want["pcg64_raw"])


def _weights(listed: list) -> list:
    return [(t["name"], t["shape"], w.f32_list(bytes.fromhex(t["f32"]))) for t in listed]


def check_delta(v: dict, data: bytes, keys: dict, c: Check) -> None:
    """§10.5: the envelope as any vector, then the delta applied to the listed base."""
    check_envelope(v, data, keys, c)
    d = v["delta"]
    base = _weights(d["base"])
    c.eq(f"{v['name']} base digest", w.weights_digest(base), d["base_sha256"])
    meta, result = w.apply_model_delta(data, keys["fleet"][1], base, d["base_version"], d["epoch"])
    for k in w.DELTA_KEYS[1:]:
        c.eq(f"{v['name']} metadata {k}", meta[k], d[k])
    c.eq(f"{v['name']} result", [(n, s, w.f32_bytes(x).hex()) for n, s, x in result],
         [(t["name"], t["shape"], t["f32"]) for t in d["result"]])
    c.eq(f"{v['name']} result digest", w.weights_digest(result), d["model_sha256"])
    for label, args in (("another epoch", (d["base_version"], d["epoch"] + 1)),
                        ("another base", (d["base_version"] - 1, d["epoch"]))):
        try:
            w.apply_model_delta(data, keys["fleet"][1], base, *args)
            c.eq(f"{v['name']} refused for {label}", "applied", "refused")
        except w.WireError:
            c.eq(f"{v['name']} refused for {label}", "refused", "refused")


def _check_packed_fields(what: str, got: dict, want: dict, c: Check) -> None:
    """§8.6 field by field: k, bits, scale, indices (from the gaps) and codes."""
    for field in ("k", "bits", "indices", "codes"):
        c.eq(f"{what} {field}", got[field], want[field])
    c.eq(f"{what} scale", w.f32_bytes([got["scale"]]).hex(), want["scale"])


def check_vectors(directory: str) -> dict:
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    c = Check()
    keys = _keys(manifest, c)
    files: dict[str, bytes] = {}
    kinds: dict[str, int] = {}
    for v in manifest["vectors"]:
        if "file" in v:
            with open(os.path.join(directory, v["file"]), "rb") as fh:
                files[v["file"]] = fh.read()
            c.eq(f"{v['name']} sha256", hashlib.sha256(files[v["file"]]).hexdigest(), v["sha256"])
    for v in manifest["vectors"]:
        kinds[v["kind"]] = kinds.get(v["kind"], 0) + 1
        data = files.get(v.get("file", ""), b"")
        try:
            _check_one(v, data, files, keys, c)
        except (w.WireError, ValueError, KeyError, TypeError) as exc:
            c.failures.append(f"{v['name']}: {type(exc).__name__}: {exc}")
    return {"vectors": len(manifest["vectors"]), "kinds": kinds, "checks": c.count, "failures": c.failures}


def _check_one(v: dict, data: bytes, files: dict[str, bytes], keys: dict, c: Check) -> None:
    kind = v["kind"]
    if kind == "envelope":
        check_envelope(v, data, keys, c)
    elif kind == "model_delta":
        check_delta(v, data, keys, c)
    elif kind == "chunked_payload":
        env = w.parse_envelope(data)
        w.verify_envelope(env, keys["fleet"][1])
        for field in ("round_id", "seq", "device_id", "metadata_json"):
            c.eq(f"{v['name']} {field}", env[field], v["envelope"][field])
    elif kind == "chunk":
        ch = w.parse_chunk(data)
        c.eq(f"{v['name']} index", ch["index"], v["index"])
        c.eq(f"{v['name']} count", ch["count"], v["count"])
        c.eq(f"{v['name']} crc32", f"{ch['crc32']:08x}", v["crc32"])
        c.eq(f"{v['name']} data length", len(ch["data"]), v["data_length"])
        c.eq(f"{v['name']} topic", w.split_chunk_topic(v["topic"]), ("edgeflow/lab/gateway/model", ch["index"]))
    elif kind == "chunked_transfer":
        payload = files[v["payload_file"]]
        r = w.Reassembler()
        got = None
        for f in reversed(v["chunk_files"]):  # any order must work
            got = r.add(v["base_topic"], files[f]) or got
        c.eq(f"{v['name']} reassembled", got, payload)
        c.eq(f"{v['name']} sha256", hashlib.sha256(payload).hexdigest(), v["payload_sha256"])
        frames = w.make_chunks(payload, v["max_message"], bytes.fromhex(v["transfer_id"]))
        c.eq(f"{v['name']} re-split", frames, [files[f] for f in v["chunk_files"]])
    elif kind == "signed_json":
        secret, pub = keys[v["signed_by"]]
        wrapper, body = w.open_signed_json(data, pub, v["context"])
        c.eq(f"{v['name']} body text", wrapper["body"], v["body_text"])
        c.eq(f"{v['name']} body", body, v["body"])
        digest = hashlib.sha256(wrapper["body"].encode()).digest()
        c.eq(f"{v['name']} signing message", w.signing_message(v["context"], digest).hex(), v["signing_message"])
        c.eq(f"{v['name']} re-signed", w.make_signed_json(v["body_text"], secret, v["context"]), data)
    elif kind == "json":
        body = json.loads(data)
        c.eq(f"{v['name']} body", body, v["body"])
        c.eq(f"{v['name']} re-encoded", json.dumps(body, separators=(",", ":")).encode(), data)
    elif kind == "secagg":
        secret, pub = keys[v["signed_by"]]
        s = w.open_sealed(data, pub)
        c.eq(f"{v['name']} kind", s["kind"], v["frame_kind"])
        c.eq(f"{v['name']} header", s["header_json"], v["header_json"])
        c.eq(f"{v['name']} payload", s["payload"].hex(), v["payload"])
        c.eq(f"{v['name']} re-sealed", w.make_sealed(s["kind"], s["header_json"], s["payload"], secret), data)
    elif kind == "ota_artifact":
        secret, pub = keys["fleet"]
        a = w.parse_artifact(data, pub)
        c.eq(f"{v['name']} manifest", a["manifest_text"], v["manifest_text"])
        c.eq(f"{v['name']} model", a["model"].hex(), v["model"])
        c.eq(f"{v['name']} rebuilt", w.build_artifact(a["manifest"], a["model"], a["golden"], secret), data)
    elif kind == "ota_offer":
        secret, pub = keys["fleet"]
        command, artifact = w.parse_offer(data)
        c.eq(f"{v['name']} command", command.decode(), v["command"])
        _, body = w.open_signed_json(command, pub, "cmd/v1")
        c.eq(f"{v['name']} artifact", artifact, files[v["artifact_file"]])
        c.eq(f"{v['name']} binds the artifact", body["args"]["artifact_sha256"], hashlib.sha256(artifact).hexdigest())
        c.eq(f"{v['name']} rebuilt", w.build_offer(command, artifact), data)
    else:
        c.failures.append(f"{v['name']}: unknown vector kind {kind!r} (the spec gained something this client lacks)")


# ------------------------------------------------------------------ a tiny model, trained in plain Python


class SplitMix64:
    """A small PRNG a C client would also use (Steele et al. 2014)."""

    def __init__(self, seed: int) -> None:
        self.state = seed & (2**64 - 1)

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & (2**64 - 1)
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        return z ^ (z >> 31)

    def uniform(self) -> float:
        """U[0,1) with 24 random bits: exactly a binary32 value."""
        return (self.next() >> 40) / float(1 << 24)


def local_data(device: str, n: int, dim_in: int, dim_out: int) -> list[tuple[list[float], int]]:
    """Deterministic synthetic data: labels from a fixed linear teacher shared by all devices."""
    teacher = SplitMix64(12345)
    t = [[teacher.uniform() * 2 - 1 for _ in range(dim_out)] for _ in range(dim_in)]
    rng = SplitMix64(int.from_bytes(hashlib.sha256(device.encode()).digest()[:8], "little"))
    out = []
    for _ in range(n):
        x = [rng.uniform() * 2 - 1 for _ in range(dim_in)]
        scores = [sum(x[i] * t[i][j] for i in range(dim_in)) for j in range(dim_out)]
        out.append((x, max(range(dim_out), key=scores.__getitem__)))
    return out


def sgd(weight: list[list[float]], bias: list[float], data, *, epochs: int, batch_size: int,
        lr: float) -> tuple[list[list[float]], list[float], float]:
    """Softmax regression ``logits = x @ W + b`` trained with plain mini-batch SGD."""
    W = [row[:] for row in weight]
    b = bias[:]
    dim_in, dim_out = len(W), len(b)
    losses = []
    for _ in range(max(1, epochs)):
        for start in range(0, len(data), max(1, batch_size)):
            batch = data[start:start + batch_size]
            gW = [[0.0] * dim_out for _ in range(dim_in)]
            gb = [0.0] * dim_out
            total = 0.0
            for x, y in batch:
                z = [b[j] + sum(x[i] * W[i][j] for i in range(dim_in)) for j in range(dim_out)]
                m = max(z)
                e = [math.exp(v - m) for v in z]
                s = sum(e)
                p = [v / s for v in e]
                total += -math.log(max(p[y], 1e-30))
                for j in range(dim_out):
                    g = p[j] - (1.0 if j == y else 0.0)
                    gb[j] += g
                    for i in range(dim_in):
                        gW[i][j] += g * x[i]
            k = len(batch)
            for j in range(dim_out):
                b[j] -= lr * gb[j] / k
                for i in range(dim_in):
                    W[i][j] -= lr * gW[i][j] / k
            losses.append(total / k)
    return W, b, sum(losses) / len(losses)


# ------------------------------------------------------------------ joining a round


def _flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def join(args: argparse.Namespace) -> dict:
    secret = bytes.fromhex(args.seed)
    fleet_pub = bytes.fromhex(args.fleet_key)
    root = f"edgeflow/{args.fleet}"
    model_topic, round_topic = f"{root}/gateway/model", f"{root}/gateway/round"
    update_topic = f"{root}/{args.device}/update"
    report: dict = {"device": args.device, "public_key": ed25519.public_key(secret).hex(), "events": []}
    mq = mqtt311.Client(args.host, args.port, client_id=f"{args.fleet}-{args.device}", keepalive=30)
    mq.connect()
    mq.subscribe([round_topic, model_topic, model_topic + "/_chunk/+"], qos=1)
    reasm = w.Reassembler()
    model: dict | None = None
    ann: dict | None = None
    sent: dict | None = None
    deadline = time.monotonic() + args.timeout
    try:
        while time.monotonic() < deadline:
            msg = mq.receive(timeout=max(0.1, deadline - time.monotonic()))
            if msg is None:
                break
            topic, payload, _retained = msg
            if not payload:
                continue  # a cleared retained message
            split = w.split_chunk_topic(topic)
            if split is not None:
                report["model_chunks"] = report.get("model_chunks", 0) + 1
                try:
                    whole = reasm.add(split[0], payload)
                except w.WireError as exc:
                    report["events"].append(f"chunk refused: {exc}")
                    continue
                if whole is None:
                    continue
                topic, payload = split[0], whole
            if topic == model_topic:
                env = w.parse_envelope(payload)
                w.verify_envelope(env, fleet_pub)
                if env["device_id"] != "gateway":
                    raise w.WireError("global model not sent as 'gateway'")
                version = int(env["metadata"].get("model_version", env["round_id"]))
                if model is None or version >= model["version"]:
                    model = {"version": version, "tensors": {t["name"]: t for t in env["tensors"]}}
                    report["events"].append(f"model v{version}")
            elif topic == round_topic:
                _, body = w.open_signed_json(payload, fleet_pub, "round/v1")
                ann = body
                report["events"].append(f"round {body['round_id']} {body.get('state')}")
            if sent is None and ann is not None and model is not None:
                selected = ann.get("selected") or []
                if (ann.get("state", "open") == "open" and ann.get("mode", "sync") == "sync"
                        and (not selected or args.device in selected) and model["version"] == ann["model_version"]):
                    sent = send_update(mq, args, secret, ann, model, update_topic)
                    report.update(sent)
            if sent is not None and model is not None and model["version"] > sent["base_version"]:
                report["new_model_version"] = model["version"]
                report["new_model"] = {n: w.f32_bytes(t["values"]).hex() for n, t in model["tensors"].items()}
                break
    finally:
        mq.disconnect()
    report["ok"] = sent is not None and "new_model_version" in report
    return report


def send_update(mq: mqtt311.Client, args: argparse.Namespace, secret: bytes, ann: dict, model: dict,
                topic: str) -> dict:
    cfg = ann.get("config", {})
    if cfg.get("secagg"):
        raise w.WireError("secure aggregation rounds are not implemented by this client")
    tensors = model["tensors"]
    (wname,) = [n for n, t in tensors.items() if len(t["shape"]) == 2]
    (bname,) = [n for n, t in tensors.items() if len(t["shape"]) == 1]
    dim_in, dim_out = tensors[wname]["shape"]
    flat_w = tensors[wname]["values"]
    weight = [flat_w[i * dim_out:(i + 1) * dim_out] for i in range(dim_in)]
    bias = tensors[bname]["values"]
    data = local_data(args.device, args.samples, dim_in, dim_out)
    new_w, new_b, loss = sgd(weight, bias, data, epochs=int(cfg.get("epochs", 1)),
                             batch_size=int(cfg.get("batch_size", 16)), lr=float(cfg.get("lr", 0.1)))
    delta = {wname: [w.f32(a - b) for a, b in zip(_flat(new_w), flat_w)],
             bname: [w.f32(a - b) for a, b in zip(new_b, bias)]}
    codec = args.codec or cfg.get("codec", "dense")
    rng = SplitMix64(args.rng_seed)
    uniforms = iter(rng.uniform, None)
    options = {**(cfg.get("codec_opts") or {}), **json.loads(args.codec_opts or "{}")}
    sections, sent_values = [], {}
    for name in tensors:  # the envelope lists tensors in the order the model has them
        x = delta.get(name, [0.0] * tensors[name]["size"])
        fields = w.encode_values(codec, x, uniforms=uniforms, k=options.get("k"), options=options)
        t = tensors[name]
        sections.append((name, t["dtype_code"], t["shape"], w.encode_section(codec, fields)))
        sent_values[name] = w.f32_bytes(w.section_values(codec, fields, t["size"])).hex()
    seq = args.seq if args.seq is not None else int(time.time() * 1000)
    meta_obj = {"base_version": model["version"], "loss": round(loss, 6), "num_samples": len(data)}
    if codec in w.COMPACT_ONLY:  # §8.6: topk-packed travels in the compact envelope (§7.6)
        envelope = w.build_compact_envelope(codec, int(ann["round_id"]), seq, args.device,
                                            w.pack_metadata(meta_obj), sections, secret)
    else:
        envelope = w.build_envelope(codec, int(ann["round_id"]), seq, args.device, w.metadata_json(meta_obj),
                                    sections, secret)
    if len(envelope) <= args.max_payload:
        mq.publish(topic, envelope, qos=1)
        chunks = 0
    else:
        tid = hashlib.sha256(envelope).digest()[:16]
        frames = w.make_chunks(envelope, args.max_payload, tid)
        for i, frame in enumerate(frames):
            mq.publish(f"{topic}/_chunk/{i}", frame, qos=1)
        chunks = len(frames)
    return {"round_id": int(ann["round_id"]), "base_version": model["version"], "codec": codec, "seq": seq,
            "num_samples": len(data), "loss": loss, "envelope_bytes": len(envelope), "update_chunks": chunks,
            "delta": sent_values}


# ------------------------------------------------------------------ interop: encode and decode update files


def encode_updates(spec_file: str, out_dir: str) -> dict:
    """Encode each job of a JSON file into ``out_dir/<name>.bin``; report what a receiver must decode.

    A job: name, codec, round_id, seq, device_id, metadata, options, rng_seed, seed (hex secret or null),
    layout ("names" or "digest": envelope version 3), tensors: [{name, dtype_code, shape, f32 (hex)}].
    Uniforms come from SplitMix64(rng_seed), randk seeds (§8.7) from SplitMix64(rng_seed + 1)."""
    with open(spec_file, encoding="utf-8") as fh:
        jobs = json.load(fh)
    report = {}
    for job in jobs:
        uniforms = iter(SplitMix64(job["rng_seed"]).uniform, None)
        seeds = SplitMix64(job["rng_seed"] + 1)
        sections, decoded = [], {}
        for t in job["tensors"]:
            x = w.f32_list(bytes.fromhex(t["f32"]))
            options = dict(job.get("options") or {})
            if job["codec"] == "randk-packed":
                options["seed"] = seeds.next() & 0xFFFFFFFF
            fields = w.encode_values(job["codec"], x, uniforms=uniforms, options=options)
            sections.append((t["name"], t["dtype_code"], t["shape"], w.encode_section(job["codec"], fields)))
            decoded[t["name"]] = w.f32_bytes(w.section_values(job["codec"], fields, len(x))).hex()
        secret = bytes.fromhex(job["seed"]) if job.get("seed") else None
        if job.get("layout") == "digest":
            data = w.build_layout_envelope(job["codec"], job["round_id"], job["seq"], job["device_id"],
                                           w.pack_metadata(job.get("metadata") or {}), sections, secret)
        elif job["codec"] in w.COMPACT_ONLY:
            data = w.build_compact_envelope(job["codec"], job["round_id"], job["seq"], job["device_id"],
                                            w.pack_metadata(job.get("metadata") or {}), sections, secret)
        else:
            data = w.build_envelope(job["codec"], job["round_id"], job["seq"], job["device_id"],
                                    w.metadata_json(job.get("metadata") or {}), sections, secret)
        with open(os.path.join(out_dir, job["name"] + ".bin"), "wb") as fh:
            fh.write(data)
        report[job["name"]] = {"bytes": len(data), "decoded": decoded}
    return {"encoded": report}


def decode_updates(public_key: str, paths: list[str], layout_file: str | None = None) -> dict:
    """Parse, check and verify (with ``public_key``, hex) each envelope file; the values as f32 hex.
    ``layout_file``: JSON [[name, shape], ...], the model that version-3 envelopes need (§7.7)."""
    pub = bytes.fromhex(public_key)
    layout = None
    if layout_file:
        with open(layout_file, encoding="utf-8") as fh:
            layout = [(name, shape) for name, shape in json.load(fh)]
    out, refused = {}, {}
    for path in paths:
        with open(path, "rb") as fh:
            data = fh.read()
        try:
            env = w.parse_envelope(data, layout=layout)
            w.verify_envelope(env, pub)
        except (w.WireError, ValueError) as exc:
            refused[os.path.basename(path)] = f"{type(exc).__name__}: {exc}"
            continue
        out[os.path.basename(path)] = {
            "version": env["version"], "codec": env["codec"], "round_id": env["round_id"], "seq": env["seq"],
            "device_id": env["device_id"], "metadata": env["metadata"],
            "tensors": {t["name"]: {"shape": t["shape"], "dtype": t["dtype"], "f32": w.f32_bytes(t["values"]).hex()}
                        for t in env["tensors"]}}
    return {"decoded": out, "refused": refused}


def apply_deltas(spec_file: str) -> dict:
    """§10.5 for each job of a JSON file: {name, file, fleet_key (hex), version, epoch, base: [{name, shape,
    f32}]}; the new weights (f32 hex per tensor) and their digest, or why the delta was refused."""
    with open(spec_file, encoding="utf-8") as fh:
        jobs = json.load(fh)
    applied, refused = {}, {}
    for job in jobs:
        with open(job["file"], "rb") as fh:
            data = fh.read()
        try:
            meta, result = w.apply_model_delta(data, bytes.fromhex(job["fleet_key"]), _weights(job["base"]),
                                               job["version"], job["epoch"])
        except (w.WireError, ValueError) as exc:
            refused[job["name"]] = f"{type(exc).__name__}: {exc}"
            continue
        applied[job["name"]] = {"version": meta["model_version"], "digest": w.weights_digest(result),
                                "weights": {n: w.f32_bytes(x).hex() for n, _, x in result}}
    return {"applied": applied, "refused": refused}


# ------------------------------------------------------------------ CLI


def selfcheck() -> dict:
    out = {"sys_path": sys.path, "no_site": sys.flags.no_site, "isolated": sys.flags.isolated}
    for mod in ("edgeflow", "numpy"):
        try:
            __import__(mod)
            out[f"{mod}_importable"] = True
        except ImportError:
            out[f"{mod}_importable"] = False
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="efclient")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("selfcheck")
    pv = sub.add_parser("vectors")
    pv.add_argument("directory")
    pe = sub.add_parser("encode-updates", help="encode the jobs of a JSON file into envelope files")
    pe.add_argument("jobs")
    pe.add_argument("out_dir")
    pd = sub.add_parser("decode-updates", help="decode and verify envelope files with a device's public key")
    pd.add_argument("public_key")
    pd.add_argument("files", nargs="+")
    pd.add_argument("--layout", help="JSON file [[name, shape], ...]: the model version-3 envelopes need")
    pa = sub.add_parser("apply-deltas", help="apply model delta files to listed base weights (§10.5)")
    pa.add_argument("jobs")
    pj = sub.add_parser("join")
    pj.add_argument("--host", default="127.0.0.1")
    pj.add_argument("--port", type=int, default=1883)
    pj.add_argument("--fleet", required=True)
    pj.add_argument("--device", required=True)
    pj.add_argument("--seed", required=True, help="32-byte Ed25519 secret key, hex")
    pj.add_argument("--fleet-key", required=True, help="the fleet's Ed25519 public key, hex")
    pj.add_argument("--codec", help="override the announced codec (dense, fp16, int8, topk, topk-int8, topk-packed)")
    pj.add_argument("--codec-opts", help='codec options as JSON over the announced ones, e.g. \'{"ratio": 0.1, "bits": 3}\'')
    pj.add_argument("--samples", type=int, default=48)
    pj.add_argument("--max-payload", type=int, default=256 * 1024, help="chunk updates above this many bytes")
    pj.add_argument("--rng-seed", type=int, default=1)
    pj.add_argument("--seq", type=int)
    pj.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    if args.cmd == "selfcheck":
        result = selfcheck()
        ok = not result["edgeflow_importable"] and not result["numpy_importable"]
    elif args.cmd == "vectors":
        result = check_vectors(args.directory)
        ok = not result["failures"]
    elif args.cmd == "encode-updates":
        result = encode_updates(args.jobs, args.out_dir)
        ok = True
    elif args.cmd == "decode-updates":
        result = decode_updates(args.public_key, args.files, args.layout)
        ok = not result["refused"]
    elif args.cmd == "apply-deltas":
        result = apply_deltas(args.jobs)
        ok = not result["refused"]
    else:
        result = join(args)
        ok = result["ok"]
    print(json.dumps(result, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
