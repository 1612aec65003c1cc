"""Signed OTA artifacts: one file that carries a model to a board and proves who built it.

The gateway builds one artifact per target profile; the device verifies it
against the fleet public key *before writing anything*, and keeps the whole
artifact in its model slot so it can verify the slot again on every start.

Layout (all integers big-endian)::

    magic      6 bytes   b"EFOTA\\x01"
    mlen       u32       length of the manifest
    manifest   mlen      canonical JSON (sorted keys, no spaces), UTF-8
    signature  64        Ed25519 over signing_message("ota/v1", SHA-256(manifest))
    model_len  u64       must equal manifest["size"]
    model      model_len the ONNX bytes; SHA-256 = manifest["sha256"]
    golden_len u64       0 when the artifact has no golden input
    golden     golden_len an .npz (no pickles) of golden inputs and expected outputs;
                          SHA-256 = manifest["golden"]["sha256"]

Why sign the manifest and not the bytes: the manifest names the model's
SHA-256 (and the golden data's), so one signature over a few hundred bytes
binds everything, signing time does not grow with the model, and the
version/profile/size a device acts on are exactly the signed ones. The
``"ota/v1"`` context keeps a signature over a manifest from being replayed
as any other kind of signed message (commands use ``"cmd/v1"``).

Golden data is what the device's health check runs: inputs and the outputs
the gateway computed for the same model and profile, with the tolerance and
latency budget to hold them to (see :mod:`edgeflow.device.health`).
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .errors import FleetError, SignatureError
from .signing import SIGNATURE_SIZE, PrivateKey, PublicKey, signing_message

__all__ = [
    "ANY_PROFILE",
    "CONTEXT",
    "FORMAT",
    "MAGIC",
    "Artifact",
    "Golden",
    "Manifest",
    "build_artifact",
    "make_golden",
    "parse_artifact",
    "verify_artifact",
]

MAGIC = b"EFOTA\x01"
FORMAT = "edgeflow-ota/1"
CONTEXT = "ota/v1"
ANY_PROFILE = "any"
"""A manifest profile that every device accepts (models that need no per-board build)."""
MAX_MANIFEST = 64 * 1024


def _err(reason: str, message: str, cls: type[Exception] = FleetError) -> Exception:
    exc = cls(message)
    exc.reason = reason  # type: ignore[attr-defined]
    return exc


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class Golden:
    """Golden inputs, the outputs expected for them, and the limits of the health check."""

    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    atol: float = 1e-3
    rtol: float = 1e-3
    latency_budget_ms: float = 1000.0

    def to_bytes(self) -> bytes:
        arrays = {f"in.{k}": np.ascontiguousarray(v) for k, v in self.inputs.items()}
        arrays.update({f"out.{k}": np.ascontiguousarray(v) for k, v in self.expected.items()})
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, *, atol: float, rtol: float, latency_budget_ms: float) -> Golden:
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                inputs = {k[3:]: z[k] for k in z.files if k.startswith("in.")}
                expected = {k[4:]: z[k] for k in z.files if k.startswith("out.")}
        except (ValueError, OSError) as exc:
            raise _err("bad_artifact", f"golden data in the artifact is not a readable .npz ({exc})") from exc
        if not inputs:
            raise _err("bad_artifact", "golden data in the artifact has no inputs")
        return cls(inputs, expected, float(atol), float(rtol), float(latency_budget_ms))

    def limits(self) -> dict[str, float]:
        return {"atol": self.atol, "rtol": self.rtol, "latency_budget_ms": self.latency_budget_ms}


@dataclass(frozen=True)
class Manifest:
    """What the signature vouches for. ``sha256`` is the model's, as hex."""

    version: int
    profile: str
    size: int
    sha256: str
    name: str = "model"
    fleet: str = ""
    created: float = 0.0
    key_id: str = ""
    golden: dict[str, Any] | None = None
    """``{"sha256", "size", "atol", "rtol", "latency_budget_ms"}`` or None."""
    meta: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format, "version": self.version, "profile": self.profile, "size": self.size,
            "sha256": self.sha256, "name": self.name, "fleet": self.fleet, "created": self.created,
            "key_id": self.key_id, "golden": self.golden, "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        try:
            m = cls(
                version=int(d["version"]), profile=str(d["profile"]), size=int(d["size"]), sha256=str(d["sha256"]),
                name=str(d.get("name", "model")), fleet=str(d.get("fleet", "")), created=float(d.get("created", 0.0)),
                key_id=str(d.get("key_id", "")), golden=d.get("golden"), meta=dict(d.get("meta") or {}),
                format=str(d.get("format", "")),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise _err("bad_artifact", f"OTA manifest is missing or has a bad field ({exc!r})") from exc
        if m.format != FORMAT:
            raise _err("bad_artifact", f"OTA manifest format {m.format!r} is not {FORMAT!r}; update the device agent")
        return m

    def accepts_profile(self, profile: str) -> bool:
        return self.profile in (profile, ANY_PROFILE)


@dataclass(frozen=True)
class Artifact:
    """A parsed artifact. ``verified`` is True only when :func:`verify_artifact` produced it."""

    manifest: Manifest
    manifest_bytes: bytes
    signature: bytes
    model: bytes
    golden_bytes: bytes
    sha256: str
    """SHA-256 of the whole artifact file (what commands refer to)."""
    verified: bool = False

    @property
    def version(self) -> int:
        return self.manifest.version

    def golden(self) -> Golden | None:
        g = self.manifest.golden
        if not g or not self.golden_bytes:
            return None
        return Golden.from_bytes(self.golden_bytes, atol=g.get("atol", 1e-3), rtol=g.get("rtol", 1e-3),
                                 latency_budget_ms=g.get("latency_budget_ms", 1000.0))


def build_artifact(
    model: bytes,
    *,
    version: int,
    profile: str,
    key: PrivateKey,
    fleet: str = "",
    name: str = "model",
    golden: Golden | None = None,
    meta: Mapping[str, Any] | None = None,
    created: float | None = None,
) -> bytes:
    """Sign ``model`` (ONNX bytes) for ``profile`` as OTA artifact ``version``; returns the artifact bytes."""
    if not isinstance(model, (bytes, bytearray, memoryview)) or not len(model):
        raise _err("bad_artifact", "build_artifact needs the model as non-empty ONNX bytes")
    if int(version) < 0:
        raise _err("bad_artifact", f"artifact version must be >= 0, got {version}")
    model = bytes(model)
    golden_bytes = golden.to_bytes() if golden is not None else b""
    manifest = Manifest(
        version=int(version), profile=profile, size=len(model), sha256=hashlib.sha256(model).hexdigest(),
        name=name, fleet=fleet, created=time.time() if created is None else float(created),
        key_id=key.public_key.key_id_hex,
        golden=(
            {"sha256": hashlib.sha256(golden_bytes).hexdigest(), "size": len(golden_bytes), **golden.limits()}
            if golden is not None else None
        ),
        meta=dict(meta or {}),
    )
    mbytes = _canonical(manifest.to_dict())
    sig = key.sign(signing_message(CONTEXT, hashlib.sha256(mbytes).digest()))
    return b"".join([
        MAGIC, struct.pack(">I", len(mbytes)), mbytes, sig,
        struct.pack(">Q", len(model)), model, struct.pack(">Q", len(golden_bytes)), golden_bytes,
    ])


def parse_artifact(data: bytes) -> Artifact:
    """Split an artifact into its parts and check sizes and hashes; the signature is NOT checked."""
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise _err("bad_artifact", "not an edgeflow OTA artifact (bad magic); build it with edgeflow fleet deploy")
    off = len(MAGIC)
    try:
        (mlen,) = struct.unpack_from(">I", data, off)
        off += 4
        if mlen > MAX_MANIFEST:
            raise _err("bad_artifact", f"OTA manifest of {mlen} bytes is larger than {MAX_MANIFEST}")
        mbytes = data[off:off + mlen]
        off += mlen
        sig = data[off:off + SIGNATURE_SIZE]
        off += SIGNATURE_SIZE
        (model_len,) = struct.unpack_from(">Q", data, off)
        off += 8
        model = data[off:off + model_len]
        off += model_len
        (golden_len,) = struct.unpack_from(">Q", data, off)
        off += 8
        golden = data[off:off + golden_len]
        off += golden_len
    except struct.error as exc:
        raise _err("bad_artifact", f"OTA artifact is truncated ({len(data)} bytes)") from exc
    if len(mbytes) != mlen or len(sig) != SIGNATURE_SIZE or len(model) != model_len or len(golden) != golden_len:
        raise _err("bad_artifact", f"OTA artifact is truncated ({len(data)} bytes)")
    if off != len(data):
        raise _err("bad_artifact", f"OTA artifact has {len(data) - off} unexpected trailing bytes")
    try:
        doc = json.loads(mbytes)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply (hostile input)
        raise _err("bad_artifact", f"OTA manifest is not JSON we accept ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise _err("bad_artifact", "OTA manifest is not a JSON object")
    manifest = Manifest.from_dict(doc)
    if manifest.size != len(model):
        raise _err("bad_artifact", f"manifest says {manifest.size} model bytes, artifact holds {len(model)}")
    if hashlib.sha256(model).hexdigest() != manifest.sha256:
        raise _err("bad_artifact", "model bytes do not match the manifest's SHA-256: the artifact is corrupt")
    g = manifest.golden
    if g:
        if hashlib.sha256(golden).hexdigest() != g.get("sha256") or len(golden) != g.get("size"):
            raise _err("bad_artifact", "golden data does not match the manifest's SHA-256: the artifact is corrupt")
    elif golden:
        raise _err("bad_artifact", "artifact carries golden data the manifest does not name")
    return Artifact(manifest, mbytes, sig, model, golden, hashlib.sha256(data).hexdigest())


def verify_artifact(
    data: bytes,
    fleet_key: PublicKey,
    *,
    profile: str | None = None,
    fleet: str | None = None,
) -> Artifact:
    """Parse and verify: signature by ``fleet_key``, hashes, and (if given) the target profile and fleet.

    Raises :class:`~edgeflow.errors.SignatureError` (``reason`` "bad_signature" or
    "wrong_key") or :class:`~edgeflow.errors.FleetError` (``reason``
    "bad_artifact", "wrong_profile", "wrong_fleet").
    """
    art = parse_artifact(data)
    m = art.manifest
    if m.key_id and m.key_id != fleet_key.key_id_hex:
        raise _err("wrong_key", f"artifact was signed with key {m.key_id}, the fleet key is {fleet_key.key_id_hex}; "
                   "it was not built by this fleet's gateway", SignatureError)
    try:
        fleet_key.verify(signing_message(CONTEXT, hashlib.sha256(art.manifest_bytes).digest()), art.signature)
    except SignatureError as exc:
        raise _err("bad_signature", f"OTA artifact signature is invalid: {exc}", SignatureError) from exc
    if profile is not None and not m.accepts_profile(profile):
        raise _err("wrong_profile", f"artifact v{m.version} is built for profile {m.profile!r}, this device is "
                   f"{profile!r}; deploy with --to 'profile={profile}'")
    if fleet is not None and m.fleet and m.fleet != fleet:
        raise _err("wrong_fleet", f"artifact is for fleet {m.fleet!r}, this device is in fleet {fleet!r}")
    return Artifact(m, art.manifest_bytes, art.signature, art.model, art.golden_bytes, art.sha256, verified=True)


def make_golden(
    model: bytes,
    profile: str,
    inputs: Mapping[str, np.ndarray] | np.ndarray | None = None,
    *,
    batch: int = 1,
    seed: int = 0,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    latency_budget_ms: float = 1000.0,
    backend: str | None = None,
) -> Golden:
    """Golden data for ``model``: ``inputs`` (or seeded random ones of the declared shapes) and
    the outputs this machine computes for them with ``profile``'s backend.

    Run where the artifact is built (the gateway), so the device checks that
    *its* backend reproduces the gateway's numbers within ``atol``/``rtol``.
    """
    from .runtime.memory import concrete_shapes
    from .runtime.session import load

    rt = load(model, profile, backend=backend, batch_size=batch, allow_over_budget=True)
    if inputs is None:
        rng = np.random.default_rng(seed)
        feeds: dict[str, np.ndarray] = {}
        for name, shape in concrete_shapes(rt.inputs, batch).items():
            dtype = np.dtype(next(t.dtype for t in rt.inputs if t.name == name) or "float32")
            if np.issubdtype(dtype, np.floating):
                feeds[name] = rng.random(shape).astype(dtype)
            else:
                feeds[name] = rng.integers(0, 10, shape).astype(dtype)
    elif isinstance(inputs, np.ndarray):
        feeds = {rt.inputs[0].name: inputs}
    else:
        feeds = dict(inputs)
    expected = rt.run(feeds)
    return Golden(feeds, {k: np.asarray(v) for k, v in expected.items()}, atol, rtol, latency_budget_ms)


# -- canary evidence ---------------------------------------------------------------------------------

EVIDENCE_SAMPLES = 64
"""Output values per output a device returns as evidence that it ran the offered model."""


def _challenge_rng(seed: str, *salt: str) -> np.random.Generator:
    if not (isinstance(seed, str) and 16 <= len(seed) <= 64 and all(c in "0123456789abcdef" for c in seed)):
        raise FleetError(f"a challenge must be 16-64 lowercase hex digits, got {str(seed)[:40]!r}")
    digest = hashlib.sha256("\x00".join((seed, *salt)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "big"))


def challenge_inputs(golden: "Golden", seed: str) -> dict[str, np.ndarray]:
    """Inputs nobody can know before the gateway draws ``seed``: the golden inputs, each float sample mixed
    with the others and with noise (a seeded convex combination plus 5% of their spread), integer inputs
    (token ids) permuted along their last axis. The same on the device and on the gateway."""
    out: dict[str, np.ndarray] = {}
    for name in sorted(golden.inputs):
        x = np.asarray(golden.inputs[name])
        rng = _challenge_rng(seed, "in", name)
        if x.ndim == 0 or x.size == 0:
            out[name] = x
        elif x.dtype.kind == "f":
            n = len(x)
            mix = rng.dirichlet(np.ones(n), size=n) if n > 1 else np.ones((1, 1))
            base = np.tensordot(mix, x.astype(np.float64), axes=1)
            spread = float(np.std(x)) or 1.0
            out[name] = (base + rng.normal(0.0, 0.05 * spread, x.shape)).astype(x.dtype)
        elif x.dtype.kind in "iu":
            out[name] = np.take_along_axis(x, np.argsort(rng.random(x.shape), axis=-1), axis=-1)
        else:
            out[name] = x
    return out


def sample_outputs(outputs: Mapping[str, np.ndarray], seed: str, k: int = EVIDENCE_SAMPLES) -> dict[str, list]:
    """``k`` values of each output at positions drawn from ``seed`` (JSON-ready: non-finite values as text)."""
    out: dict[str, list] = {}
    for name in sorted(outputs):
        flat = np.asarray(outputs[name]).ravel()
        if flat.dtype.kind not in "fiub" or flat.size == 0:
            out[name] = []
            continue
        idx = _challenge_rng(seed, "out", name).choice(flat.size, min(k, flat.size), replace=False)
        vals = flat[np.sort(idx)].astype(np.float64)
        out[name] = [float(v) if np.isfinite(v) else str(v) for v in vals]
    return out


def evidence_problem(expected: Mapping[str, list], got: Any, atol: float, rtol: float) -> str | None:
    """Why ``got`` (a device's evidence) does not show the outputs the gateway computed, or None."""
    if not isinstance(got, dict):
        return "no evidence in the acknowledgement (a device that did not run the model, or an old edgeflow)"
    for name, want in expected.items():
        have = got.get(name)
        if not isinstance(have, list) or len(have) != len(want):
            return f"output {name!r}: {0 if not isinstance(have, list) else len(have)} values, expected {len(want)}"
        for i, (w, h) in enumerate(zip(want, have)):
            if isinstance(w, str) or isinstance(h, str):
                if w != h:
                    return f"output {name!r} value {i}: {h!r}, the gateway computed {w!r}"
                continue
            if not isinstance(h, (int, float)) or isinstance(h, bool) or not abs(h - w) <= atol + rtol * abs(w):
                return f"output {name!r} value {i}: {h!r}, the gateway computed {w:.6g} (atol {atol:g}, rtol {rtol:g})"
    return None
