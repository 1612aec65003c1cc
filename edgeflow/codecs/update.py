"""encode_update / decode_update: the one API devices and the gateway call.

Decoding is all-or-nothing: every check (size, structure, CRC, signature,
shapes, per-tensor validation, replay) runs before anything is returned or
recorded, and the replay guard is updated last, so a rejected envelope
leaves no trace except a log line and a counter in
:data:`edgeflow.codecs.rejections`. Any unexpected exception from a corrupt
envelope is converted to :class:`~edgeflow.errors.CodecError`; the decoder
never raises anything else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeflow.codecs.envelope import (
    MAX_DEVICE_ID,
    MAX_METADATA,
    MAX_NDIM,
    SIG_BLOCK,
    VERSION_LAYOUT,
    EnvelopeHeader,
    SectionInput,
    build_envelope,
    check_crc,
    dtype_code,
    parse_envelope,
    signed_message,
)
from edgeflow.codecs.dense import MAX_VALUE
from edgeflow.codecs.feedback import ErrorFeedback
from edgeflow.codecs.metadata import pack_metadata
from edgeflow.codecs.registry import Codec, EncodeContext, codec_by_id, get_codec
from edgeflow.codecs.rejects import RejectStats, codec_error, reason_of, rejections
from edgeflow.errors import CodecError, SignatureError
from edgeflow.signing import KeyRing, ReplayGuard, Signer

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_ELEMENTS", "MAX_VALUE", "Update", "decode_update", "encode_update", "peek_update"]

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_ELEMENTS = 1 << 28  # 1 GiB of float32 once decoded
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Update:
    """A decoded, validated update."""

    tensors: dict[str, np.ndarray]
    round_id: int
    device_id: str
    seq: int
    codec: str
    metadata: dict[str, Any] = field(default_factory=dict)
    signed_by: str | None = None
    """Hex key id of the verified signer, or None when no verifier was given."""
    wire_bytes: int = 0

    @property
    def num_samples(self) -> int | None:
        value = self.metadata.get("num_samples")
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _encode_error(reason: str, message: str) -> CodecError:
    return codec_error(reason, message)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= _U64:
        raise _encode_error("bad_input", f"{name} must be an integer in 0..2**64-1, got {value!r}")
    return int(value)


def _metadata_json(metadata: Mapping[str, Any] | None) -> bytes:
    if not metadata:
        return b""
    try:
        text = json.dumps(dict(metadata), separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _encode_error("bad_input", f"metadata must be JSON-serializable without NaN: {exc}") from None
    raw = text.encode("utf-8")
    if len(raw) > MAX_METADATA:
        raise _encode_error("too_large", f"metadata is {len(raw)} bytes of JSON; keep it under {MAX_METADATA}")
    return raw


def _as_rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng)


def encode_update(
    tensors: Mapping[str, np.ndarray],
    codec: str = "int8",
    *,
    round_id: int,
    device_id: str,
    seq: int,
    signer: Signer | None = None,
    state: ErrorFeedback | None = None,
    metadata: Mapping[str, Any] | None = None,
    num_samples: int | None = None,
    rng: np.random.Generator | int | None = None,
    **codec_opts: Any,
) -> bytes:
    """Encode named float arrays into one envelope (signed if ``signer`` is given).

    ``state`` is the device's :class:`ErrorFeedback` for sparsifying codecs
    (ignored by the others). ``rng`` (a Generator or a seed) drives
    stochastic rounding; pass a seed for reproducible bytes. ``num_samples``
    is a shortcut for ``metadata["num_samples"]`` (used to weight the
    federated average). ``codec_opts`` go to the codec, e.g. ``ratio=0.01``; ``layout="digest"``
    (compact codecs and ``auto``) sends an 8-byte digest of the model's layout instead of the tensor
    names, dtypes and shapes (envelope version 3: the receiver must decode with ``expected_shapes``).
    """
    impl = get_codec(codec)
    options = impl.check_options(codec_opts)
    by_digest = options.pop("layout", "names") == "digest"
    round_id = _check_int("round_id", round_id)
    seq = _check_int("seq", seq)
    _check_sender(device_id, signer)
    meta = dict(metadata or {})
    if num_samples is not None:
        meta["num_samples"] = _check_int("num_samples", num_samples)
    meta_json = _metadata_json(meta)
    # Validate everything before encoding anything, so a bad tensor cannot
    # leave the error-feedback state half-updated.
    flat = _checked_tensors(tensors)
    meta_bytes = _metadata_bytes(meta, meta_json)
    if impl.selector:  # "auto": pick the real codec from the tensors' sizes (edgeflow.codecs.auto)
        def overhead(version: int) -> int:
            v = VERSION_LAYOUT if by_digest else version
            return _overhead(v, impl.codec_id, round_id, seq, device_id, meta_bytes[v], flat, signer)

        impl, options = impl.resolve([x.size for *_, x in flat], options, overhead)
    version = VERSION_LAYOUT if by_digest else impl.envelope_version
    feedback = state if state is not None and impl.uses_feedback else None
    ctx = EncodeContext(rng=_as_rng(rng), options=options, feedback=feedback is not None)
    sections, new_residuals = _encoded_sections(impl, flat, ctx, feedback)
    data = build_envelope(
        codec_id=impl.codec_id,
        round_id=round_id,
        seq=seq,
        device_id=device_id,
        metadata_json=meta_bytes[version],
        sections=sections,
        signer=signer,
        version=version,
    )
    if feedback is not None:
        feedback.commit(new_residuals)
    return data


_Flat = list[tuple[str, int, tuple[int, ...], np.ndarray]]
"""Checked tensors: name, dtype code, shape, values as flat float32."""


def _check_sender(device_id: str, signer: Signer | None) -> None:
    """The device id is a bounded non-empty string, and the signer's."""
    if not isinstance(device_id, str) or not device_id or len(device_id.encode("utf-8")) > MAX_DEVICE_ID:
        raise _encode_error("bad_input", f"device_id must be a non-empty string of at most {MAX_DEVICE_ID} bytes")
    if signer is not None and signer.device_id != device_id:
        msg = f"signer belongs to device {signer.device_id!r} but the update claims device {device_id!r}"
        raise _encode_error("bad_input", msg)


def _checked_tensors(tensors: Mapping[str, np.ndarray]) -> _Flat:
    """Every tensor checked (name, float dtype, rank, finite and bounded values) before any is encoded."""
    if not isinstance(tensors, Mapping):
        raise _encode_error("bad_input", "tensors must be a dict of name -> numpy array")
    if len(tensors) > 0xFFFF:
        raise _encode_error("too_large", f"{len(tensors)} tensors in one update; the envelope holds at most 65535")
    flat: _Flat = []
    for name, array in tensors.items():
        if not isinstance(name, str) or not name or len(name.encode("utf-8")) > 0xFFFF:
            raise _encode_error("bad_input", f"tensor names must be non-empty strings, got {name!r}")
        arr = np.asarray(array)
        if not np.issubdtype(arr.dtype, np.floating):
            raise _encode_error("bad_input", f"tensor {name!r} has dtype {arr.dtype}; only float tensors can be sent")
        if arr.ndim > MAX_NDIM:
            raise _encode_error("bad_input", f"tensor {name!r} has {arr.ndim} dimensions (max {MAX_NDIM})")
        code = dtype_code(arr.dtype)
        x = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
        if x.size and not np.isfinite(x).all():
            msg = f"tensor {name!r} holds NaN/Inf (after conversion to float32); fix the training step before sending"
            raise _encode_error("non_finite", msg)
        if x.size and max(-float(x.min()), float(x.max())) > MAX_VALUE:
            msg = (f"tensor {name!r} holds a value of magnitude {max(-float(x.min()), float(x.max())):.3g}; "
                   f"receivers refuse updates beyond {MAX_VALUE:g} (the training step diverged)")
            raise _encode_error("out_of_range", msg)
        flat.append((name, code, tuple(int(d) for d in arr.shape), x))
    return flat


def _metadata_bytes(meta: Mapping[str, Any], meta_json: bytes) -> dict[int, bytes]:
    """The metadata as each envelope version carries it (JSON in version 1, binary after), bounded."""
    meta_bytes = {1: meta_json, 2: pack_metadata(meta)}
    meta_bytes[VERSION_LAYOUT] = meta_bytes[2]
    if len(meta_bytes[2]) > MAX_METADATA:
        msg = f"metadata is {len(meta_bytes[2])} bytes in binary; keep it under {MAX_METADATA}"
        raise _encode_error("too_large", msg)
    return meta_bytes


def _encoded_sections(impl: Codec, flat: _Flat, ctx: EncodeContext,
                      feedback: ErrorFeedback | None) -> tuple[list[SectionInput], dict[str, np.ndarray]]:
    """Each tensor through the codec (with its error-feedback residual), and the new residuals."""
    sections: list[SectionInput] = []
    new_residuals: dict[str, np.ndarray] = {}
    for name, code, shape, x in flat:
        residual = feedback.residual(name, impl.state_size(x.size, ctx.options)) if feedback is not None else None
        parts, new_res = impl.encode(x, ctx, residual)
        if feedback is not None and new_res is not None:
            new_residuals[name] = new_res
        sections.append(SectionInput(name, code, shape, parts))
    return sections, new_residuals


def _overhead(version: int, codec_id: int, round_id: int, seq: int, device_id: str, meta_json: bytes,
              flat: Sequence[tuple[str, int, tuple[int, ...], np.ndarray]], signer: Signer | None) -> int:
    """Bytes of an envelope of this ``version`` for these tensors with empty sections (signature included)."""
    empty = [SectionInput(name, code, shape, []) for name, code, shape, _ in flat]
    data = build_envelope(codec_id=codec_id, round_id=round_id, seq=seq, device_id=device_id,
                          metadata_json=meta_json, sections=empty, version=version)
    return len(data) + (SIG_BLOCK if signer is not None else 0)


def peek_update(
    data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> EnvelopeHeader:
    """Parse the header only (device, round, seq, codec id, tensor specs); nothing is verified."""
    if len(data) > max_bytes:
        raise codec_error("oversized", f"envelope is {len(data)} bytes, over the {max_bytes}-byte limit")
    try:
        return parse_envelope(data, max_elements=max_elements)
    except CodecError:
        raise
    except Exception as exc:  # corrupt input must only ever raise CodecError
        raise codec_error("malformed", f"envelope is corrupt ({type(exc).__name__}: {exc})") from None


def _check_shapes(header: EnvelopeHeader, expected: Mapping[str, Sequence[int]]) -> None:
    got = {t.name: t.shape for t in header.tensors}
    want = {name: tuple(int(d) for d in shape) for name, shape in expected.items()}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(n for n in set(got) & set(want) if got[n] != want[n])
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"unexpected {extra}")
        for n in wrong[:5]:
            parts.append(f"{n!r} has shape {got[n]}, expected {want[n]}")
        msg = (
            f"update from {header.device_id!r} does not match the model: {'; '.join(parts)}; "
            "the device trains a different model version"
        )
        raise codec_error("shape_mismatch", msg)


def _decode(
    data: bytes | bytearray | memoryview,
    *,
    verifier: KeyRing | None,
    replay_guard: ReplayGuard | None,
    expected_shapes: Mapping[str, Sequence[int]] | None,
    max_bytes: int,
    max_elements: int,
    require_signature: bool,
) -> Update:
    size = len(data)
    if size > max_bytes:
        msg = f"envelope is {size} bytes, over the {max_bytes}-byte limit; raise max_bytes if the model is that large"
        raise codec_error("oversized", msg)
    mv = memoryview(data).cast("B")
    layout = None if expected_shapes is None else [(n, tuple(s)) for n, s in expected_shapes.items()]
    header = parse_envelope(mv, max_elements=max_elements, layout=layout)
    if header.layout is not None and layout is None:
        msg = (f"update from {header.device_id!r} names its tensors by a layout digest (envelope version 3); "
               "decode it with expected_shapes (the model's tensor shapes), or have the device send layout='names'")
        raise codec_error("shape_mismatch", msg)
    impl = codec_by_id(header.codec_id)
    check_crc(mv, header)
    signed_by = None
    if verifier is not None:
        if not header.signed:
            msg = f"update from {header.device_id!r} is not signed; this receiver accepts signed updates only"
            raise codec_error("unsigned", msg, SignatureError)
        key = verifier.verify(
            header.device_id, signed_message(mv, header), header.signature or b"", key_id=header.key_id
        )
        signed_by = key.key_id_hex
    elif require_signature and not header.signed:
        raise codec_error("unsigned", f"update from {header.device_id!r} is not signed", SignatureError)
    if expected_shapes is not None:
        _check_shapes(header, expected_shapes)
    tensors: dict[str, np.ndarray] = {}
    for spec in header.tensors:
        section = mv[spec.offset : spec.offset + spec.length]
        try:
            flat = impl.decode(section, spec.size)
        except CodecError as exc:
            raise codec_error(reason_of(exc), f"tensor {spec.name!r}: {exc}") from None
        if flat.shape != (spec.size,) or flat.dtype != np.float32:  # a codec bug, not bad input
            msg = f"codec {impl.name!r} returned {flat.shape} {flat.dtype} for tensor {spec.name!r} of {spec.size}"
            raise codec_error("malformed", msg)
        out = flat.reshape(spec.shape)
        tensors[spec.name] = out if spec.dtype == np.float32 else out.astype(spec.dtype)
    if replay_guard is not None:
        replay_guard.check_and_record(header.device_id, header.round_id, header.seq)
    return Update(
        tensors=tensors,
        round_id=header.round_id,
        device_id=header.device_id,
        seq=header.seq,
        codec=impl.name,
        metadata=header.metadata,
        signed_by=signed_by,
        wire_bytes=size,
    )


def decode_update(
    data: bytes | bytearray | memoryview,
    *,
    verifier: KeyRing | None = None,
    replay_guard: ReplayGuard | None = None,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    require_signature: bool = False,
    stats: RejectStats | None = None,
    source: str = "",
) -> Update:
    """Validate and decode an envelope, or raise :class:`CodecError` (never anything else).

    ``verifier`` (a :class:`~edgeflow.signing.KeyRing`) makes a valid
    signature by the claimed device mandatory. ``replay_guard`` rejects a
    (device, round, seq) seen before; it is updated only if everything else
    passed. ``expected_shapes`` ({name: shape}) must match the envelope
    exactly. ``max_bytes`` bounds the envelope, ``max_elements`` the decoded
    size (checked from the header before any allocation). Each rejection is
    logged and counted in ``stats`` (default :data:`rejections`) under the
    error's ``reason``; ``source`` (e.g. the MQTT topic) goes into the log.
    """
    counters = rejections if stats is None else stats
    try:
        return _decode(
            data,
            verifier=verifier,
            replay_guard=replay_guard,
            expected_shapes=expected_shapes,
            max_bytes=max_bytes,
            max_elements=max_elements,
            require_signature=require_signature,
        )
    except CodecError as exc:
        counters.record(reason_of(exc), str(exc), source=source)
        raise
    except Exception as exc:  # noqa: BLE001 - corrupt input must only ever raise CodecError
        err = codec_error("malformed", f"envelope is corrupt ({type(exc).__name__}: {exc})")
        counters.record("malformed", str(err), source=source)
        raise err from None

