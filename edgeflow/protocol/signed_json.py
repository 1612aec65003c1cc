"""Signed JSON: the one wrapper every signed control message travels in.

Round announcements (:mod:`.rounds`), fleet commands, acks, births and deaths
(:mod:`.fleet`) and the command inside an OTA offer (:mod:`.ota`) all use it.
The *exact* body text travels inside the wrapper, so the signature covers bytes
and not a re-serialisation, and another implementation (C firmware) verifies
without canonical-JSON rules::

    {"v": 1, "ctx": "cmd/v1", "body": "<json text>", "key_id": "<hex>", "sig": "<hex>"}

with ``sig`` = Ed25519 over ``signing_message(ctx, SHA-256(body))``. Contexts
keep one kind of message from being replayed as another; :func:`open_signed`
checks the version, the context, that ``key_id`` (when present) names the
expected key, and the signature, in that order (docs/wire-format.md §9).

Parsing never lets a hostile payload raise anything but :class:`CodecError` or
:class:`SignatureError`, each with a ``reason``: "bad_message", "unsigned",
"bad_signature" or "wrong_key".
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from ..codecs.untrusted import loads_untrusted
from ..errors import CodecError, SignatureError
from ..signing import PrivateKey, PublicKey, signing_message

__all__ = ["MAX_CONTROL_BYTES", "loads", "open_signed", "peek_signed", "sign_body", "with_reason"]

MAX_CONTROL_BYTES = 1 << 20
"""Largest signed control message accepted."""


def with_reason(exc: Exception, reason: str) -> Exception:
    """``exc`` with its ``reason`` attribute set (the code an ack or a refusal counter reports)."""
    exc.reason = reason  # type: ignore[attr-defined]
    return exc


def loads(data: bytes | str, what: str = "message") -> Any:
    """``json.loads`` that fails only with CodecError (``reason`` "bad_message"), whatever the input
    (deep nesting, bad UTF-8, huge numbers: :func:`edgeflow.codecs.untrusted.loads_untrusted`)."""
    return loads_untrusted(data, what)


def sign_body(body: Mapping[str, Any], key: PrivateKey, context: str) -> bytes:
    """The signed JSON wrapper around ``body`` (see the module docstring)."""
    text = json.dumps(dict(body), sort_keys=True, separators=(",", ":"))
    sig = key.sign(signing_message(context, hashlib.sha256(text.encode("utf-8")).digest()))
    wrapper = {"v": 1, "ctx": context, "body": text, "key_id": key.public_key.key_id_hex, "sig": sig.hex()}
    return json.dumps(wrapper, separators=(",", ":")).encode("utf-8")


def peek_signed(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(wrapper, body) without checking the signature: to learn who claims to have sent it.

    Raises CodecError with ``reason`` "bad_message" (not JSON) or "unsigned"
    (JSON, but no signature wrapper).
    """
    if len(data) > MAX_CONTROL_BYTES:
        raise with_reason(CodecError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}"), "bad_message")
    wrapper = loads(data)
    if not isinstance(wrapper, dict):
        raise with_reason(CodecError("message is not a JSON object"), "bad_message")
    if "sig" not in wrapper or "body" not in wrapper:
        raise with_reason(
            CodecError("message is not signed: expected the signed wrapper {v, ctx, body, key_id, sig}"), "unsigned"
        )
    text = wrapper.get("body")
    try:
        body = loads(text, "signed body") if isinstance(text, str) else None
    except CodecError:
        body = None
    if not isinstance(body, dict):
        raise with_reason(CodecError("signed message body is not a JSON object"), "bad_message")
    return wrapper, body


def open_signed(data: bytes, key: PublicKey, context: str) -> dict[str, Any]:
    """Verify and return the body; SignatureError/CodecError carry ``reason``."""
    wrapper, body = peek_signed(data)
    if wrapper.get("v") != 1:
        raise with_reason(CodecError(f"signed message version {wrapper.get('v')!r} is not 1"), "bad_message")
    if wrapper.get("ctx") != context:
        raise with_reason(SignatureError(f"message signed for {wrapper.get('ctx')!r}, expected {context!r}"), "bad_signature")
    try:
        sig = bytes.fromhex(str(wrapper["sig"]))
    except ValueError:
        raise with_reason(SignatureError("signature is not hex"), "bad_signature") from None
    key_id = str(wrapper.get("key_id", ""))
    if key_id and key_id != key.key_id_hex:
        raise with_reason(SignatureError(f"signed with key {key_id}, expected key {key.key_id_hex}"), "wrong_key")
    digest = hashlib.sha256(str(wrapper["body"]).encode("utf-8")).digest()
    try:
        key.verify(signing_message(context, digest), sig)
    except SignatureError as exc:
        raise with_reason(SignatureError(str(exc)), "bad_signature") from None
    return body
