"""Parsing JSON and numbers that came from the network: one place, every failure a CodecError.

``json.loads`` on hostile bytes raises more than ``ValueError``: 60,000
nested brackets raise ``RecursionError``; a number such as ``1e400`` parses
to ``inf``, and ``int(inf)`` then raises ``OverflowError``; a float where an
integer belongs makes ``int()`` truncate silently. A handler that catches
only ``ValueError`` lets those escape into the transport's worker thread:
no ack, no reply, a traceback in the log. Every parse of device input in
edgeflow goes through these helpers instead, so a bad message is refused
with one :class:`~edgeflow.errors.CodecError` (``reason`` "bad_message")
that names what was wrong.

Shared by the gateway (rounds, updates' metadata) and the fleet protocol
(:mod:`edgeflow.protocol`); imports nothing but the standard library
and :mod:`edgeflow.errors`, so any layer may use it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from edgeflow.errors import CodecError

__all__ = ["MAX_JSON_DEPTH", "as_int", "as_number", "loads_untrusted"]

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects accepted (edgeflow's own messages use 3)."""


def _refuse(message: str) -> CodecError:
    err = CodecError(message)
    err.reason = "bad_message"  # type: ignore[attr-defined]
    return err


def _depth_ok(data: str | bytes, limit: int) -> bool:
    """True when bracket nesting (outside strings) never exceeds ``limit``: checked
    before ``json.loads`` so a hostile message costs one linear scan, not a recursion."""
    text = data.decode("utf-8", "replace") if isinstance(data, (bytes, bytearray, memoryview)) else data
    if text.count("[") + text.count("{") <= limit:
        return True
    depth = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def loads_untrusted(data: str | bytes | bytearray | memoryview, what: str = "message", *,
                    max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for bytes from the network: CodecError (reason "bad_message")
    for anything that is not JSON, nested deeper than ``max_depth``, or not UTF-8."""
    if isinstance(data, memoryview):
        data = bytes(data)
    if not _depth_ok(data, max_depth):
        raise _refuse(f"{what} nests JSON deeper than {max_depth} levels; refused")
    try:
        return json.loads(data)
    except (ValueError, RecursionError, OverflowError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
        raise _refuse(f"{what} is not valid JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


def as_int(value: Any, what: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """An integer field of an untrusted message: a JSON integer (not a bool, not a float,
    not a string), within [lo, hi] when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(f"{what} must be an integer, got {type(value).__name__} {str(value)[:40]!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"{'-inf' if lo is None else lo}..{'inf' if hi is None else hi}"
        raise _refuse(f"{what} must be in {bounds}, got {value}")
    return value


def as_number(value: Any, what: str, *, lo: float | None = None, hi: float | None = None) -> float:
    """A numeric field of an untrusted message: a finite JSON number (not a bool),
    within [lo, hi] when given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(f"{what} must be a number, got {type(value).__name__} {str(value)[:40]!r}")
    try:
        x = float(value)
    except OverflowError:  # an integer too large for a float
        raise _refuse(f"{what} is out of range ({str(value)[:40]})") from None
    if not math.isfinite(x):
        raise _refuse(f"{what} must be finite, got {x}")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise _refuse(f"{what} must be in {lo}..{hi}, got {x}")
    return x
