"""The model delta: the global model sent as a compressed difference to the version a device holds.

The gateway publishes every new global model retained on ``gateway/model`` (the whole weights, dense),
and, with ``[rounds] downlink = "delta-<codec>"``, first a *delta* on ``gateway/model_delta``: the new
weights minus the previous version's, encoded with an update codec (``int8`` by default) in the same
signed envelope as updates (docs/wire-format.md, "Model delta"). Its metadata names

- ``kind = "model_delta"``, ``model_version`` (N) and the gateway's ``epoch``;
- ``base_version`` (N-1) and ``base_sha256``: the :func:`weights_digest` of the weights the delta
  applies to;
- ``model_sha256``: the digest of ``base + decode(delta)``, the weights a device gets by applying it.

The codecs are lossy, so the gateway does not publish ``new - base`` and keep ``new``: it adopts
``base + decode(delta)`` itself (:func:`encode_model_delta` returns those weights), so its global model,
the full model it publishes, and the weights of every device that applied the delta are the same bits,
and nobody drifts. The envelope's signature (fleet key) covers the metadata and the sections.

A device applies a delta only to exactly its base (:func:`apply_model_delta`): same epoch, base version
and base digest, the shapes of its weights, a signature of the gateway, a size no larger than the dense
model, and a result that is finite, within the codecs' value bound and has the announced digest.
Anything else is refused with a reason (:class:`~edgeflow.errors.CodecError` with ``reason``) and the
device takes the full model instead (:class:`edgeflow.federated.client.Client`). It lives with the codecs because it is an envelope of
theirs (the protocol package imports no codec).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CodecError
from ..signing import KeyRing, Signer
from .dense import MAX_VALUE
from .feedback import ErrorFeedback
from .registry import get_codec
from .rejects import codec_error
from .update import decode_update, encode_update

__all__ = ["DELTA_KIND", "DeltaResult", "apply_model_delta", "delta_codec", "encode_model_delta", "max_delta_bytes",
           "weights_digest"]

DELTA_KIND = "model_delta"
GATEWAY_ID = "gateway"
DIGEST_CONTEXT = b"edgeflow-weights-v1\0"
ENVELOPE_SLACK = 64 * 1024
"""Bytes a delta may take beyond 4 bytes per weight (names, shapes, metadata, signature): a delta larger than
that is larger than the dense model itself, and refused (``oversized``)."""
_HEX64 = re.compile(r"[0-9a-f]{64}")

Weights = Mapping[str, np.ndarray]


def weights_digest(weights: Weights) -> str:
    """SHA-256 (hex) of the canonical weights: for each name in sorted order, the UTF-8 name (u16 length
    prefix), the rank (u8), the dimensions (u32 each) and the values as little-endian float32, C order; after
    the context ``edgeflow-weights-v1\\0``. The bits count: -0.0 and 0.0 differ."""
    h = hashlib.sha256(DIGEST_CONTEXT)
    for name in sorted(weights):
        a = np.ascontiguousarray(weights[name], dtype="<f4")
        raw = name.encode("utf-8")
        h.update(struct.pack("<H", len(raw)) + raw + struct.pack(f"<B{a.ndim}I", a.ndim, *a.shape))
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def delta_codec(downlink: str) -> str | None:
    """The codec of a ``downlink`` setting: ``"full"`` -> None, ``"delta-int8"`` -> ``"int8"``. A ConfigError
    names the valid settings."""
    from ..errors import ConfigError
    from .registry import available_codecs

    if downlink == "full":
        return None
    codecs = [c for c in available_codecs() if c != "auto"]
    if isinstance(downlink, str) and downlink.startswith("delta-") and downlink[6:] in codecs:
        return downlink[6:]
    raise ConfigError(f"downlink {downlink!r} is unknown; choose full or one of "
                      f"{', '.join('delta-' + c for c in codecs)}")


def max_delta_bytes(weights: Weights) -> int:
    """The largest delta a device accepts for a model of these weights: the dense size plus
    :data:`ENVELOPE_SLACK` and the names."""
    return sum(4 * int(np.size(v)) + len(k.encode("utf-8")) + 64 for k, v in weights.items()) + ENVELOPE_SLACK


def _add(base: Weights, delta: Weights) -> dict[str, np.ndarray]:
    """``base + delta`` in float32, tensor by tensor: the one addition the gateway and every device do."""
    return {k: np.add(np.asarray(base[k], dtype=np.float32), np.asarray(delta[k], dtype=np.float32),
                      dtype=np.float32) for k in base}


def encode_model_delta(base: Weights, new: Weights, *, codec: str, base_version: int, version: int, epoch: int,
                       signer: Signer, seed: int, feedback: ErrorFeedback | None = None,
                       ) -> tuple[bytes, dict[str, np.ndarray], str]:
    """The signed delta from ``base`` (version ``base_version``) to ``new`` (``version``), and the weights a
    device reconstructs from it (``base + decode(delta)``, which the gateway must adopt as version ``version``)
    with their digest. ``seed`` fixes the stochastic rounding (the envelope is encoded twice: once to learn the
    result and its digest, once with them in the signed metadata; the same seed gives the same sections, and
    the second is decoded and checked to give the same weights). ``feedback``: the residual of codecs with error
    feedback (``topk``), what earlier deltas left out, added to this one. Raises CodecError when the tensors
    or shapes do not match."""
    if set(base) != set(new):
        raise codec_error("shape_mismatch", f"the new model's weights {sorted(set(new) ^ set(base))[:4]} are not "
                                            "in both versions")
    for k in base:
        if np.shape(base[k]) != np.shape(new[k]):
            raise codec_error("shape_mismatch", f"weight {k!r} changed shape {np.shape(base[k])} -> {np.shape(new[k])}")
    diff = {k: np.subtract(np.asarray(new[k], np.float32), np.asarray(base[k], np.float32), dtype=np.float32)
            for k in base}
    use_fb = feedback is not None and get_codec(codec).uses_feedback
    if use_fb:
        probe_state = ErrorFeedback()
        probe_state.commit({k: r.copy() for k in diff if (r := feedback.get(k)) is not None})
    meta = {"kind": DELTA_KIND, "model_version": int(version), "epoch": int(epoch), "base_version": int(base_version),
            "base_sha256": weights_digest(base)}
    common = dict(round_id=int(version), device_id=GATEWAY_ID, seq=int(version))
    probe = encode_update(diff, codec, **common, metadata=meta, rng=seed, state=probe_state if use_fb else None)
    decoded = decode_update(probe).tensors
    result = _add(base, decoded)
    digest = weights_digest(result)
    payload = encode_update(diff, codec, **common, signer=signer, metadata={**meta, "model_sha256": digest}, rng=seed,
                            state=feedback if use_fb else None)
    again = decode_update(payload).tensors
    if any(not np.array_equal(again[k].view(np.uint32), decoded[k].view(np.uint32)) for k in decoded):
        raise codec_error("malformed", f"codec {codec!r} encoded the delta differently twice under one seed; "
                                       "no delta is published")
    return payload, result, digest


@dataclass(frozen=True)
class DeltaResult:
    version: int
    epoch: int
    weights: dict[str, np.ndarray]
    digest: str
    wire_bytes: int


def _meta_int(meta: Mapping[str, Any], key: str) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise codec_error("malformed", f"model delta: metadata {key!r} is {v!r}, not an integer >= 0")
    return v


def _meta_digest(meta: Mapping[str, Any], key: str) -> str:
    v = meta.get(key)
    if isinstance(v, (bytes, bytearray)):  # the compact envelope carries hex strings as bytes
        v = bytes(v).hex()
    if not isinstance(v, str) or not _HEX64.fullmatch(v):
        raise codec_error("malformed", f"model delta: metadata {key!r} is not a SHA-256 hex digest")
    return v


def apply_model_delta(payload: bytes | bytearray | memoryview, *, weights: Weights, version: int, epoch: int,
                      digest: str | None = None, keyring: KeyRing, source: str = "") -> DeltaResult:
    """Check a delta against the model held (``weights`` of ``version`` and gateway ``epoch``; ``digest``: their
    :func:`weights_digest` when known) and return the new model, or raise CodecError with ``reason``:

    ``oversized`` (larger than the dense model), ``unsigned`` / ``bad_signature`` / ``wrong_key`` / ``unknown_device``
    (not the gateway's signature), ``malformed``, ``shape_mismatch`` (not the held weights' names and shapes),
    ``non_finite`` / ``out_of_range`` (in the delta or in the result), ``not_delta`` (another message),
    ``epoch`` (another gateway epoch), ``held`` (this version is already held: nothing to do), ``replay`` (a version
    older than the one held), ``wrong_base`` (built on another version), ``base_digest`` (the held weights are not
    its base), ``digest_mismatch`` (the result is not the announced model)."""
    upd = decode_update(payload, verifier=keyring, require_signature=True, max_bytes=max_delta_bytes(weights),
                        expected_shapes={k: np.shape(v) for k, v in weights.items()}, source=source)
    if upd.device_id != GATEWAY_ID:
        raise codec_error("wrong_key", f"model delta signed by {upd.device_id!r}, not the gateway")
    meta = upd.metadata
    if meta.get("kind") != DELTA_KIND:
        raise codec_error("not_delta", f"a message of kind {meta.get('kind')!r} on the model delta topic")
    new_version, new_epoch = _meta_int(meta, "model_version"), _meta_int(meta, "epoch")
    base_version = _meta_int(meta, "base_version")
    base_sha, model_sha = _meta_digest(meta, "base_sha256"), _meta_digest(meta, "model_sha256")
    if new_epoch != epoch:
        raise codec_error("epoch", f"model delta of gateway epoch {new_epoch}; this device follows epoch {epoch}")
    if new_version == version:
        raise codec_error("held", f"model delta to v{new_version}, the version held")
    if new_version < version:
        raise codec_error("replay", f"model delta to v{new_version}, older than the v{version} held (a replay?)")
    if base_version != version:
        raise codec_error("wrong_base", f"model delta v{base_version} -> v{new_version}; this device holds v{version}")
    if (digest or weights_digest(weights)) != base_sha:
        raise codec_error("base_digest", f"model delta v{base_version} -> v{new_version}: the weights held as "
                                         f"v{version} are not its base (digest differs)")
    result = _add(weights, upd.tensors)
    for k, v in result.items():
        if v.size and not np.isfinite(v).all():
            raise codec_error("non_finite", f"model delta v{new_version}: weight {k!r} is not finite once applied")
        if v.size and float(np.abs(v).max()) > MAX_VALUE:
            raise codec_error("out_of_range", f"model delta v{new_version}: weight {k!r} exceeds {MAX_VALUE:g} "
                                              "once applied")
    got = weights_digest(result)
    if got != model_sha:
        raise codec_error("digest_mismatch", f"model delta v{base_version} -> v{new_version}: the result's digest "
                                             f"{got[:12]} is not the announced {model_sha[:12]}")
    return DeltaResult(new_version, new_epoch, result, got, upd.wire_bytes)


def refusal(exc: CodecError) -> str:
    """The reason code of a refused delta."""
    return str(getattr(exc, "reason", "malformed"))
