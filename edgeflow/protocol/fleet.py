"""The fleet protocol between the gateway and device agents: births, deaths,
telemetry, commands, acknowledgements, OTA offers and inference requests.

Pure data and signing, no MQTT: the gateway's :mod:`edgeflow.gateway.fleet`
and the agent both import it, so both ends agree by construction.

Every signed message uses the one wrapper of :mod:`.signed_json` (the same as
the round announcements of :mod:`.rounds`). Commands and OTA offers are signed by the fleet key (the gateway); acks,
births and deaths by the device key. Contexts keep one kind from being
replayed as another.

Why births and deaths carry ``bdseq`` (Sparkplug B's birth/death sequence):
the broker publishes a device's last will some time after the connection
died, possibly after the device already came back. A death whose ``bdseq``
is older than the newest birth is stale and must not mark the device
offline. ``bdseq`` here is a millisecond timestamp forced to grow on *every
connection attempt* and across agent restarts (see
:meth:`edgeflow.device.slots.SlotStore.next_bdseq`), so a device that lost
its state directory still counts upwards, and a birth after a broker-side
timeout always outranks the death that timeout published.

Signed deaths: the will is signed when the connection is made (the broker
holds it until the session ends), so it carries that session's ``bdseq``
and nothing the device learns later. A captured death (retained, readable
by whoever may read the device's death topic) replays as the death of a
session that already ended: the gateway ignores it as soon as it has seen
a later birth, and the will of the *live* session is never published while
the session lives. What a replay can do: mark the device offline if the
gateway has not seen any birth newer than the captured death (e.g. an
attacker who also deleted the retained birth on an open broker); the next
birth (reconnect, deploy, ``reboot``) undoes it. ``Birth.seq`` numbers the
births of one session (1, 2, ...), so a replayed older birth of the same
session cannot roll the registry back either.

Parsing never lets a hostile payload raise anything but :class:`CodecError`
(``reason`` "bad_message"): deep nesting (RecursionError), huge numbers
(``1e400``, OverflowError) and wrong types are refusals like any other.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from ..errors import CodecError, SignatureError
from ..signing import PrivateKey, PublicKey
from .signed_json import loads, open_signed, peek_signed, sign_body
from .signed_json import with_reason as _reason

__all__ = [
    "ACK_CONTEXT",
    "BIRTH_CONTEXT",
    "CMD_CONTEXT",
    "DEATH_CONTEXT",
    "COMMANDS",
    "Ack",
    "Birth",
    "Command",
    "Death",
    "TENSOR_DTYPES",
    "decode_tensor",
    "encode_tensor",
    "printable",
]

CMD_CONTEXT = "cmd/v1"
ACK_CONTEXT = "ack/v1"
BIRTH_CONTEXT = "birth/v1"
DEATH_CONTEXT = "death/v1"
MAX_BIRTH_BYTES = 16 * 1024
MAX_INT = (1 << 63) - 1

COMMANDS = ("deploy", "rollback", "train_start", "train_stop", "set_config", "reboot", "status")
"""Commands the agent understands. ``deploy`` only arrives as an :class:`OtaOffer` on the ``ota`` channel."""


def _int(v: Any, what: str, *, low: int = 0, high: int = MAX_INT) -> int:
    """A JSON integer in [low, high] (bools, floats such as 1e400 and strings refused)."""
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"{what} must be an integer in {low}..{high}, got {str(v)[:40]!r}")
    return v


def _float(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{what} must be a number")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{what} must be finite")
    return f


def _str(v: Any, what: str, limit: int = 64, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > limit:
        raise ValueError(f"{what} must be a string of at most {limit} characters")
    return v


# --------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Command:
    """A signed instruction from the gateway to one device.

    ``expires`` (Unix time) bounds replays across agent restarts; within a
    run the agent also remembers command ids (a QoS 1 redelivery gets the
    same ack again instead of running twice).
    """

    name: str
    device: str
    fleet: str
    args: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    issued: float = field(default_factory=time.time)
    expires: float = 0.0

    @classmethod
    def make(cls, name: str, device: str, fleet: str, args: Mapping[str, Any] | None = None, *,
             ttl_s: float = 300.0) -> Command:
        now = time.time()
        return cls(name, device, fleet, dict(args or {}), uuid.uuid4().hex, now, now + ttl_s)

    def sign(self, key: PrivateKey) -> bytes:
        return sign_body(asdict(self), key, CMD_CONTEXT)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Command:
        try:
            args = body.get("args") or {}
            if not isinstance(args, dict):
                raise TypeError("args must be an object")
            return cls(str(body["name"])[:64], str(body["device"]), str(body["fleet"]), args, str(body["id"])[:128],
                       _float(body["issued"], "issued"), _float(body["expires"], "expires"))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise _reason(CodecError(f"command is missing or has a bad field ({exc!r})"), "bad_message") from exc

    @classmethod
    def verify(cls, data: bytes, fleet_key: PublicKey) -> Command:
        return cls.from_body(open_signed(data, fleet_key, CMD_CONTEXT))


@dataclass(frozen=True)
class Ack:
    """A device's answer to one command: success with a result, or a code and a clear error.

    Codes: ``ok``; refusals ``unsigned``, ``bad_signature``, ``wrong_key``,
    ``wrong_device``, ``expired``, ``bad_message``, ``bad_artifact``,
    ``wrong_profile``; ``unknown_command``, ``bad_args``, ``busy``,
    ``not_supported``, ``no_model``; failures ``health_check_failed``,
    ``interrupted`` (the agent restarted mid-operation), ``failed``.
    """

    id: str
    name: str
    device: str
    ok: bool
    code: str = "ok"
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)
    restarted: bool = False

    def sign(self, key: PrivateKey) -> bytes:
        return sign_body(asdict(self), key, ACK_CONTEXT)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Ack:
        try:
            return cls(str(body.get("id", "")), str(body.get("name", "")), str(body["device"]), bool(body["ok"]),
                       str(body.get("code", "")), str(body.get("error", "")), dict(body.get("result") or {}),
                       _float(body.get("ts", 0.0), "ts"), bool(body.get("restarted", False)))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise _reason(CodecError(f"ack is missing or has a bad field ({exc!r})"), "bad_message") from exc

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -------------------------------------------------------------- birth / death


@dataclass(frozen=True)
class Birth:
    """Retained announcement after every connect: who the device is and what it runs.

    ``seq`` numbers the births of one connection (same ``bdseq``): 1 for the
    first, then one more for every re-announcement (deploy, ``set_config``),
    so the gateway can tell a newer birth from a replayed older one.
    """

    device: str
    fleet: str
    profile: str
    bdseq: int
    public_key: str
    model_version: int | None = None
    model_sha256: str | None = None
    backend: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    telemetry_interval_s: float = 10.0
    can_train: bool = False
    training: bool = False
    commands: list[str] = field(default_factory=lambda: list(COMMANDS))
    seq: int = 0
    ts: float = field(default_factory=time.time)

    def sign(self, key: PrivateKey) -> bytes:
        return sign_body(asdict(self), key, BIRTH_CONTEXT)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Birth:
        """Every field checked and bounded: a birth is stored in the registry as it is."""
        try:
            mv = body.get("model_version")
            versions = body.get("versions") or {}
            if not isinstance(versions, dict) or len(versions) > 32:
                raise ValueError("versions must be an object of at most 32 entries")
            commands = body.get("commands") or []
            if not isinstance(commands, list) or len(commands) > 32:
                raise ValueError("commands must be a list of at most 32 names")
            sha = _str(body.get("model_sha256"), "model_sha256", 64, optional=True)
            interval = _float(body.get("telemetry_interval_s", 10.0), "telemetry_interval_s")
            if not 0.05 <= interval <= 86400:
                raise ValueError("telemetry_interval_s must be between 0.05 and 86400")
            return cls(
                _str(body["device"], "device"), _str(body.get("fleet", ""), "fleet"),
                _str(body.get("profile", ""), "profile", 128), _int(body["bdseq"], "bdseq"),
                _str(body.get("public_key", ""), "public_key", 128),
                None if mv is None else _int(mv, "model_version"), sha,
                _str(body.get("backend"), "backend", 32, optional=True),
                {_str(k, "versions key"): _str(v, "versions value") for k, v in versions.items()},
                interval, bool(body.get("can_train", False)), bool(body.get("training", False)),
                [_str(c, "command", 32) for c in commands], _int(body.get("seq", 0), "seq"),
                _float(body.get("ts", 0.0), "ts"),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise _reason(CodecError(f"birth is missing or has a bad field ({exc})"), "bad_message") from exc

    @classmethod
    def verify(cls, data: bytes, key: PublicKey) -> Birth:
        if len(data) > MAX_BIRTH_BYTES:
            raise _reason(CodecError(f"birth of {len(data)} bytes exceeds {MAX_BIRTH_BYTES}"), "bad_message")
        return cls.from_body(open_signed(data, key, BIRTH_CONTEXT))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Death:
    """Offline notice, signed by the device: the last will (``reason`` "lost", signed when the connection was
    made) or a clean shutdown ("shutdown"). See the module docstring for what a replayed one can do."""

    device: str
    bdseq: int
    reason: str = "lost"
    ts: float | None = None

    def sign(self, key: PrivateKey) -> bytes:
        return sign_body(asdict(self), key, DEATH_CONTEXT)

    @classmethod
    def from_body(cls, d: Mapping[str, Any]) -> Death:
        try:
            ts = d.get("ts")
            reason = _str(d.get("reason", "lost"), "reason", 32)
            return cls(_str(d["device"], "device"), _int(d["bdseq"], "bdseq"), reason or "lost",
                       None if ts is None else _float(ts, "ts"))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise _reason(CodecError(f"death message is malformed ({exc})"), "bad_message") from exc

    @classmethod
    def verify(cls, data: bytes, key: PublicKey) -> Death:
        """The verified death; CodecError "unsigned" for the unsigned deaths of agents before death/v1."""
        return cls.from_body(open_signed(data, key, DEATH_CONTEXT))

    @classmethod
    def from_bytes(cls, data: bytes) -> Death:
        """Parse without checking the signature (signed wrapper or the old unsigned JSON): for display only."""
        d = loads(data, "death message")
        if isinstance(d, dict) and "sig" in d and "body" in d:
            _, d = peek_signed(data)
        if not isinstance(d, dict):
            raise _reason(CodecError("death message is not a JSON object"), "bad_message")
        return cls.from_body(d)


# -------------------------------------------------------------- display


_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(value: Any, limit: int = 400) -> str:
    """A value a device supplied (birth, telemetry, ack) as text that is safe on an operator's terminal.

    Every character that is not printable becomes a visible escape: C0 controls and ESC (``\\x1b``), DEL,
    C1 controls (``\\x9b``), bidi overrides and other format characters (``\\u202e``), line and paragraph
    separators; a backslash is doubled, so an escape shown is never the device's own text. At most
    ``limit`` characters are kept (then ``...``). Rich markup is *not* escaped here: the CLI escapes it
    where it prints through rich (``edgeflow.cli.fleet``); JSON output needs neither.
    """
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > limit > 0
    if cut:
        text = text[:limit]
    if not (text.isprintable() and "\\" not in text):
        out = []
        for ch in text:
            if ch in _ESCAPES:
                out.append(_ESCAPES[ch])
            elif ch.isprintable():
                out.append(ch)
            else:
                n = ord(ch)
                out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
        text = "".join(out)
    return text + ("..." if cut else "")


# ----------------------------------------------------------------- inference


def encode_tensor(a: np.ndarray) -> dict[str, Any]:
    """JSON-safe tensor: dtype, shape and base64 of the C-order bytes (no pickles, any MQTT version)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


TENSOR_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64")
"""The element types a tensor on the wire may have: numbers and booleans only (no strings, bytes,
objects, datetimes, records or sub-arrays, whose item size the sender would choose)."""
MAX_TENSOR_BYTES = 32 * 1024 * 1024
"""The most bytes one decoded tensor may take (the smallest built-in board budget is 96 MiB)."""
MAX_TENSOR_DIMS = 32


def _tensor_error(msg: str) -> CodecError:
    return _reason(CodecError(f"tensor refused: {msg}; send {{dtype, shape, b64|data}} with a numeric dtype "
                              f"({', '.join(TENSOR_DTYPES)})"), "bad_message")


def decode_tensor(d: Mapping[str, Any], *, max_bytes: int = MAX_TENSOR_BYTES) -> np.ndarray:
    """The array an :func:`encode_tensor` dict (or ``{dtype, shape, data}``) describes, checked before
    anything is allocated: a numeric dtype of :data:`TENSOR_DTYPES`, at most :data:`MAX_TENSOR_DIMS`
    non-negative dimensions, ``shape``'s element count times the item size within ``max_bytes``, and
    ``b64`` exactly that many bytes (``data`` exactly that many elements). Anything else is one
    :class:`CodecError` (``reason`` "bad_message") naming the problem."""
    if not isinstance(d, Mapping):
        raise _tensor_error(f"expected an object, got {type(d).__name__}")
    raw = d.get("dtype")
    if not isinstance(raw, str) or len(raw) > 16:
        raise _tensor_error(f"dtype {str(raw)[:40]!r} is not a short dtype string such as '<f4'")
    try:
        dtype = np.dtype(raw)
    except (TypeError, ValueError) as exc:
        raise _tensor_error(f"dtype {raw!r} is not a numpy dtype ({exc})") from None
    if dtype.name not in TENSOR_DTYPES or dtype.fields is not None or dtype.subdtype is not None:
        raise _tensor_error(f"dtype {raw!r} ({dtype.name}) is not accepted")
    shape_in = d.get("shape")
    if not isinstance(shape_in, (list, tuple)) or len(shape_in) > MAX_TENSOR_DIMS:
        raise _tensor_error(f"shape must be a list of at most {MAX_TENSOR_DIMS} dimensions")
    if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_INT for s in shape_in):
        raise _tensor_error(f"shape {str(shape_in)[:80]} must hold whole numbers >= 0")
    shape = tuple(shape_in)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes > max_bytes:
        raise _tensor_error(f"shape {list(shape)[:8]} of {dtype.name} is {nbytes} bytes, over the limit of "
                            f"{max_bytes} bytes per tensor")
    try:
        if "b64" in d:
            b64 = d["b64"]
            want = 4 * ((nbytes + 2) // 3)
            if not isinstance(b64, str) or len(b64) != want:
                got = len(b64) if isinstance(b64, str) else type(b64).__name__
                raise _tensor_error(f"b64 of {got} characters does not encode the {nbytes} bytes that shape "
                                    f"{list(shape)[:8]} of {dtype.name} declares ({want} characters)")
            buf = base64.b64decode(b64, validate=True)
            if len(buf) != nbytes:
                raise _tensor_error(f"b64 decodes to {len(buf)} bytes, shape {list(shape)[:8]} of {dtype.name} "
                                    f"declares {nbytes}")
            return np.frombuffer(buf, dtype=dtype).reshape(shape).copy()
        data = d.get("data")
        if shape and not isinstance(data, list) or not shape and not isinstance(data, (int, float)):
            raise _tensor_error("give the values as 'b64' (the C-order bytes) or 'data' (nested lists of numbers, "
                                "or one number for shape [])")
        if shape and len(data) != shape[0]:
            raise _tensor_error(f"data holds {len(data)} rows, shape {list(shape)[:8]} declares {shape[0]}")
        a = np.asarray(data, dtype=dtype)
        if a.shape != shape:
            raise _tensor_error(f"data has shape {list(a.shape)[:8]}, the message declares {list(shape)[:8]}")
        return a
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError, MemoryError, binascii.Error) as exc:
        raise _tensor_error(str(exc)[:200]) from None


# ----------------------------------------------------------------- signed inference requests

INFER_CONTEXT = "infer/v1"
INFER_MAGIC = b"EFIR\x01"
INFER_CLOCK_SKEW_S = 300.0
"""How far in the future a request's ``issued`` may lie (the sender's clock ahead of the device's)."""


def sign_inference_request(request: Mapping[str, Any], key: PrivateKey, *, device: str, ttl_s: float = 60.0,
                           now: float | None = None) -> bytes:
    """An inference request as the device takes it: a header signed with ``key`` (the fleet key, or an app key
    the device was given) that names the device, a validity window and the sha256 of the request's JSON,
    followed by that JSON (any size: only the header is signed). Layout: ``EFIR\\x01`` | u32 header length |
    signed header | request JSON."""
    body = json.dumps(dict(request), separators=(",", ":")).encode("utf-8")
    t = time.time() if now is None else now
    header = sign_body({"device": device, "id": str(request.get("id", "")), "issued": t, "expires": t + ttl_s,
                        "sha256": hashlib.sha256(body).hexdigest()}, key, INFER_CONTEXT)
    return INFER_MAGIC + len(header).to_bytes(4, "big") + header + body


def open_inference_request(data: bytes, keys: Mapping[str, PublicKey], *, device: str,
                           now: float | None = None) -> dict[str, Any]:
    """The request of a signed inference message, after every check: the header is signed by one of ``keys``
    (key id hex -> key), names this ``device``, is within its validity window, and the request is the one it
    hashes. Refusals are CodecError/SignatureError with a ``reason`` (``unsigned``, ``unauthorized``, ...)."""
    data = bytes(data)
    if not data.startswith(INFER_MAGIC) or len(data) < len(INFER_MAGIC) + 4:
        raise _reason(SignatureError("inference requests must be signed (edgeflow.protocol.fleet."
                                     "sign_inference_request with the fleet key or an app key the device knows)"),
                      "unsigned")
    start = len(INFER_MAGIC) + 4
    n = int.from_bytes(data[len(INFER_MAGIC):start], "big")
    if n > 4096 or start + n > len(data):
        raise _reason(CodecError("inference request header is truncated or too long"), "bad_message")
    header, body = data[start:start + n], data[start + n:]
    wrapper, _ = peek_signed(header)
    key = keys.get(str(wrapper.get("key_id", "")))
    if key is None:
        raise _reason(SignatureError("inference request signed by a key this device does not accept"), "unauthorized")
    h = open_signed(header, key, INFER_CONTEXT)
    if h.get("device") != device:
        raise _reason(SignatureError(f"inference request addressed to {str(h.get('device'))[:64]!r}, not to this "
                                     "device"), "wrong_device")
    t = time.time() if now is None else now
    issued, expires = _float(h.get("issued"), "issued"), _float(h.get("expires"), "expires")
    if not issued - INFER_CLOCK_SKEW_S <= t <= expires:
        raise _reason(SignatureError("inference request expired or not yet valid (check the sender's clock)"),
                      "expired")
    if hashlib.sha256(body).hexdigest() != h.get("sha256"):
        raise _reason(SignatureError("inference request does not match its signed hash"), "bad_signature")
    req = loads(body, "inference request")
    if not isinstance(req, dict):
        raise _reason(CodecError("inference request must be a JSON object"), "bad_message")
    return req
