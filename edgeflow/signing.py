"""Ed25519 device keys, signatures and replay protection.

Every device owns one Ed25519 key pair. The private key never leaves the
device; the gateway keeps a :class:`KeyRing` of registered public keys and
accepts an update only if it verifies against the key registered for the
device id that the update *claims* to come from. :class:`ReplayGuard` then
makes sure a captured, validly signed update cannot be fed in twice.

The API signs and verifies plain bytes so that other features (signed OTA
model deployment: a signature over the SHA-256 of an artifact plus its
manifest) reuse it unchanged. Callers that sign large data should sign a
short, domain-separated digest built with :func:`signing_message` rather than
the data itself: Ed25519 hashes its input twice with SHA-512, and a context
string keeps a signature made for one purpose ("update/v1") from being
replayed as another ("ota/v1").

Why Ed25519: 32-byte public keys fit a provisioning QR code or a TOML line,
64-byte signatures add little to a 10 KB sparse update, signing is fast on a
Cortex-A7, and there are no parameters to get wrong.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import hashlib
import hmac
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from edgeflow.errors import ConfigError, SignatureError

BACKEND_ENV = "EDGEFLOW_SIGNING"
"""``EDGEFLOW_SIGNING=pure`` forces the pure-Python Ed25519 even where
``cryptography`` is installed (tests, and boards where it is broken);
``cryptography`` or unset: use ``cryptography`` when it imports."""

_crypto = None
if os.environ.get(BACKEND_ENV, "").strip().lower() not in ("pure", "python", "pure-python"):
    try:  # a board may have no cryptography wheel (riscv64 on PyPI): see BACKEND
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

        _crypto = True
    except ImportError as _exc:
        _crypto = None
        logging.getLogger(__name__).warning(
            "no usable cryptography package (%s): Ed25519 signs and verifies with edgeflow's pure-Python "
            "RFC 8032 code", _exc)

BACKEND = "cryptography" if _crypto else "pure-python"
"""Which Ed25519 implementation signs and verifies here: ``"cryptography"``
(OpenSSL) or ``"pure-python"`` (RFC 8032 in Python integers, this module's
``_ed25519_*`` functions: about 10x slower, not constant-time)."""

__all__ = [
    "BACKEND",
    "KEY_ID_SIZE",
    "PUBLIC_KEY_SIZE",
    "SIGNATURE_SIZE",
    "KeyRing",
    "PrivateKey",
    "PublicKey",
    "ReplayGuard",
    "Signer",
    "Verifier",
    "signing_message",
]

SIGNATURE_SIZE = 64
PUBLIC_KEY_SIZE = 32
PRIVATE_KEY_SIZE = 32
KEY_ID_SIZE = 8
"""A key id is the first 8 bytes of SHA-256(raw public key): enough to tell
keys apart in a fleet and in error messages, short enough to ship in every
signed envelope."""


def _signature_error(reason: str, message: str) -> SignatureError:
    err = SignatureError(message)
    err.reason = reason  # type: ignore[attr-defined]
    return err


def signing_message(context: str, digest: bytes) -> bytes:
    """Return the bytes to sign for ``digest`` (a SHA-256) under ``context``.

    The result is ``b"edgeflow:" + context + b"\\0" + digest``. Signing this
    instead of the raw data keeps signing time independent of the data size
    and binds the signature to one purpose.
    """
    if len(digest) != 32:
        msg = f"signing_message expects a 32-byte SHA-256 digest, got {len(digest)} bytes"
        raise ValueError(msg)
    if "\0" in context:
        msg = "signing context must not contain NUL"
        raise ValueError(msg)
    return b"edgeflow:" + context.encode("utf-8") + b"\0" + digest


def _key_id(raw_public: bytes) -> bytes:
    return hashlib.sha256(raw_public).digest()[:KEY_ID_SIZE]


def _write_private(path: Path, data: bytes, overwrite: bool) -> None:
    """Write ``data`` so that the file is never readable by others, even briefly."""
    if path.exists() and not overwrite:
        msg = f"key file {path} already exists; pass overwrite=True to replace it"
        raise ConfigError(msg)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read_key_file(path: str | os.PathLike[str], what: str) -> bytes:
    p = Path(path)
    try:
        return p.read_bytes()
    except OSError as exc:
        msg = f"cannot read {what} file {p}: {exc.strerror or exc}; check the path and its permissions"
        raise ConfigError(msg) from exc


def _maybe_hex(data: bytes, size: int) -> bytes | None:
    text = data.strip()
    if len(text) == 2 * size:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
    return None


# ---------------------------------------------------------------- key encodings
# Ed25519 keys in PEM have one fixed DER form each (RFC 8410): a 12-byte
# SubjectPublicKeyInfo prefix before the 32 public bytes, a 16-byte PKCS#8
# (version 1, no attributes) prefix before the 32 secret bytes. Writing them
# here gives the same bytes as cryptography's serializers (tested), and lets
# the pure-Python path read and write the files without an ASN.1 library.

_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
_PKCS8_PREFIX = bytes.fromhex("302e020100300506032b657004220420")
_ED25519_OID = bytes.fromhex("06032b6570")  # 1.3.101.112


def _pem(label: str, der: bytes) -> bytes:
    body = base64.b64encode(der).decode("ascii")
    lines = [body[i:i + 64] for i in range(0, len(body), 64)]
    return (f"-----BEGIN {label}-----\n" + "\n".join(lines) + f"\n-----END {label}-----\n").encode("ascii")


def _unpem(data: bytes, path: object, what: str) -> tuple[str, bytes]:
    """(label, DER) of the first PEM block in ``data``; ConfigError if it is not one."""
    text = data.decode("ascii", "replace").strip()
    first, _, rest = text.partition("\n")
    label = first.strip()[len("-----BEGIN "):].rstrip("-").strip()
    end = f"-----END {label}-----"
    if not first.startswith("-----BEGIN ") or end not in rest:
        msg = f"{path} is not a valid PEM {what}: no matching END line"
        raise ConfigError(msg)
    body = "".join(line.strip() for line in rest[: rest.index(end)].splitlines())
    try:
        return label, base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as exc:
        msg = f"{path} is not a valid PEM {what}: {exc}"
        raise ConfigError(msg) from exc


def _der_key(der: bytes, prefix: bytes, path: object, what: str) -> bytes:
    if len(der) == len(prefix) + 32 and der.startswith(prefix):
        return der[len(prefix):]
    if _ED25519_OID not in der[:20]:
        msg = f"{path} holds a key that is not Ed25519 (not the Ed25519 OID 1.3.101.112), not an Ed25519 {what}"
    else:
        msg = f"{path} is not an Ed25519 {what} in the plain RFC 8410 form; re-export it unencrypted"
    raise ConfigError(msg)


class PublicKey:
    """An Ed25519 public key: 32 raw bytes, shown as hex, identified by :attr:`key_id`."""

    __slots__ = ("_key", "_raw")

    def __init__(self, raw: bytes, native: object = None) -> None:
        """Use :meth:`from_bytes`, :meth:`from_hex`, :meth:`load` or :attr:`PrivateKey.public_key`."""
        self._raw = bytes(raw)
        self._key = native  # cryptography's Ed25519PublicKey, or the decoded point (pure path)

    @classmethod
    def from_bytes(cls, raw: bytes) -> PublicKey:
        if len(raw) != PUBLIC_KEY_SIZE:
            msg = f"an Ed25519 public key is {PUBLIC_KEY_SIZE} raw bytes, got {len(raw)}"
            raise ConfigError(msg)
        raw = bytes(raw)
        if _crypto:
            return cls(raw, Ed25519PublicKey.from_public_bytes(raw))
        return cls(raw, None)  # decoded on first verify: a bad encoding then fails that signature

    @classmethod
    def from_hex(cls, text: str) -> PublicKey:
        try:
            raw = bytes.fromhex(text.strip())
        except ValueError as exc:
            msg = f"public key {text!r} is not hex; expected {2 * PUBLIC_KEY_SIZE} hex digits"
            raise ConfigError(msg) from exc
        return cls.from_bytes(raw)

    @classmethod
    def coerce(cls, value: PublicKey | bytes | str) -> PublicKey:
        """Accept a PublicKey, 32 raw bytes or a hex string."""
        if isinstance(value, PublicKey):
            return value
        if isinstance(value, str):
            return cls.from_hex(value)
        return cls.from_bytes(bytes(value))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PublicKey:
        """Load a PEM (SubjectPublicKeyInfo), hex or 32-byte raw public key file."""
        data = _read_key_file(path, "public key")
        if data.lstrip().startswith(b"-----BEGIN"):
            if not _crypto:
                _, der = _unpem(data.lstrip(), path, "public key")
                return cls.from_bytes(_der_key(der, _SPKI_PREFIX, path, "public key"))
            try:
                key = serialization.load_pem_public_key(data)
            except ValueError as exc:
                msg = f"{path} is not a valid PEM public key: {exc}"
                raise ConfigError(msg) from exc
            if not isinstance(key, Ed25519PublicKey):
                msg = f"{path} holds a {type(key).__name__}, not an Ed25519 public key"
                raise ConfigError(msg)
            return cls(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw), key)
        raw = _maybe_hex(data, PUBLIC_KEY_SIZE)
        if raw is None and len(data) == PUBLIC_KEY_SIZE:
            raw = data
        if raw is None:
            msg = f"{path} is neither PEM, hex nor {PUBLIC_KEY_SIZE} raw bytes; regenerate the key"
            raise ConfigError(msg)
        return cls.from_bytes(raw)

    def save(self, path: str | os.PathLike[str], *, format: str = "pem", overwrite: bool = False) -> Path:
        """Write the key as ``"pem"``, ``"hex"`` or ``"raw"``. Public keys are not secret (mode 0644)."""
        p = Path(path)
        if p.exists() and not overwrite:
            msg = f"key file {p} already exists; pass overwrite=True to replace it"
            raise ConfigError(msg)
        if format == "pem":
            data = _pem("PUBLIC KEY", _SPKI_PREFIX + self._raw)
        elif format == "hex":
            data = (self.hex + "\n").encode("ascii")
        elif format == "raw":
            data = self._raw
        else:
            msg = f"unknown key format {format!r}; use 'pem', 'hex' or 'raw'"
            raise ConfigError(msg)
        p.write_bytes(data)
        os.chmod(p, 0o644)
        return p

    @property
    def raw(self) -> bytes:
        return self._raw

    @property
    def hex(self) -> str:
        return self._raw.hex()

    @property
    def key_id(self) -> bytes:
        return _key_id(self._raw)

    @property
    def key_id_hex(self) -> str:
        return self.key_id.hex()

    def verify(self, data: bytes, signature: bytes) -> None:
        """Raise :class:`SignatureError` unless ``signature`` is valid for ``data``."""
        if len(signature) != SIGNATURE_SIZE:
            msg = f"an Ed25519 signature is {SIGNATURE_SIZE} bytes, got {len(signature)}"
            raise _signature_error("bad_signature", msg)
        if isinstance(self._key, (tuple, type(None))):
            if self._key is None:
                self._key = _ed_decode_point(self._raw) or ()
            ok = bool(self._key) and _ed25519_verify_point(self._key, self._raw, bytes(data), bytes(signature))
        else:
            try:
                self._key.verify(bytes(signature), bytes(data))
                ok = True
            except InvalidSignature:
                ok = False
        if not ok:
            msg = f"signature does not verify with key {self.key_id_hex}; the data was altered or signed by another key"
            raise _signature_error("bad_signature", msg)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicKey) and hmac.compare_digest(self._raw, other._raw)

    def __hash__(self) -> int:
        return hash(self._raw)

    def __repr__(self) -> str:
        return f"PublicKey({self.hex})"


class PrivateKey:
    """An Ed25519 private key. Saved files are created with mode 0600."""

    __slots__ = ("_key", "_public", "_secret")

    def __init__(self, secret: bytes, native: object = None) -> None:
        """Use :meth:`generate`, :meth:`from_bytes` or :meth:`load`."""
        self._secret = bytes(secret)
        self._key = native  # cryptography's Ed25519PrivateKey, or None (pure path)
        self._public: PublicKey | None = None

    @classmethod
    def generate(cls) -> PrivateKey:
        if _crypto:
            key = Ed25519PrivateKey.generate()
            return cls(key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                         serialization.NoEncryption()), key)
        return cls(os.urandom(PRIVATE_KEY_SIZE))

    @classmethod
    def from_bytes(cls, raw: bytes) -> PrivateKey:
        if len(raw) != PRIVATE_KEY_SIZE:
            msg = f"an Ed25519 private key is {PRIVATE_KEY_SIZE} raw bytes, got {len(raw)}"
            raise ConfigError(msg)
        raw = bytes(raw)
        return cls(raw, Ed25519PrivateKey.from_private_bytes(raw) if _crypto else None)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrivateKey:
        """Load a PEM (PKCS#8, unencrypted), hex or 32-byte raw private key file."""
        data = _read_key_file(path, "private key")
        if data.lstrip().startswith(b"-----BEGIN"):
            if not _crypto:
                label, der = _unpem(data.lstrip(), path, "private key")
                if "ENCRYPTED" in label:
                    msg = f"{path} is not an unencrypted PEM private key: it is encrypted"
                    raise ConfigError(msg)
                return cls.from_bytes(_der_key(der, _PKCS8_PREFIX, path, "private key"))
            try:
                key = serialization.load_pem_private_key(data, password=None)
            except (ValueError, TypeError) as exc:
                msg = f"{path} is not an unencrypted PEM private key: {exc}"
                raise ConfigError(msg) from exc
            if not isinstance(key, Ed25519PrivateKey):
                msg = f"{path} holds a {type(key).__name__}, not an Ed25519 private key"
                raise ConfigError(msg)
            return cls(key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                         serialization.NoEncryption()), key)
        raw = _maybe_hex(data, PRIVATE_KEY_SIZE)
        if raw is None and len(data) == PRIVATE_KEY_SIZE:
            raw = data
        if raw is None:
            msg = f"{path} is neither PEM, hex nor {PRIVATE_KEY_SIZE} raw bytes; regenerate the key"
            raise ConfigError(msg)
        return cls.from_bytes(raw)

    def save(self, path: str | os.PathLike[str], *, format: str = "pem", overwrite: bool = False) -> Path:
        """Write the key as ``"pem"`` (PKCS#8), ``"hex"`` or ``"raw"``, mode 0600."""
        p = Path(path)
        if format == "pem":
            data = _pem("PRIVATE KEY", _PKCS8_PREFIX + self._secret)
        elif format == "hex":
            data = (self.raw().hex() + "\n").encode("ascii")
        elif format == "raw":
            data = self.raw()
        else:
            msg = f"unknown key format {format!r}; use 'pem', 'hex' or 'raw'"
            raise ConfigError(msg)
        _write_private(p, data, overwrite)
        return p

    def raw(self) -> bytes:
        """The 32 secret bytes. A method, not a property, so it is not printed by accident."""
        return self._secret

    @property
    def public_key(self) -> PublicKey:
        if self._public is None:
            if self._key is not None:
                pub = self._key.public_key()
                self._public = PublicKey(pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw),
                                         pub)
            else:
                self._public = PublicKey(_ed25519_public(self._secret))
        return self._public

    def sign(self, data: bytes) -> bytes:
        if self._key is not None:
            return self._key.sign(bytes(data))
        return _ed25519_sign(self._secret, self.public_key.raw, bytes(data))

    def __repr__(self) -> str:
        return f"PrivateKey(public={self.public_key.hex})"


@dataclass(frozen=True)
class Signer:
    """A device's identity for signing: its device id and private key."""

    device_id: str
    key: PrivateKey

    @classmethod
    def generate(cls, device_id: str) -> Signer:
        return cls(device_id, PrivateKey.generate())

    @classmethod
    def load(cls, device_id: str, path: str | os.PathLike[str]) -> Signer:
        return cls(device_id, PrivateKey.load(path))

    @property
    def public_key(self) -> PublicKey:
        return self.key.public_key

    @property
    def key_id(self) -> bytes:
        return self.key.public_key.key_id

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)


class KeyRing:
    """Registered device public keys; verifies signatures by claimed device id.

    Thread-safe. One key per device: registering a new key for a known device
    requires ``replace=True`` so that a key rotation is always deliberate.
    """

    def __init__(self, keys: dict[str, PublicKey | bytes | str] | None = None) -> None:
        self._keys: dict[str, PublicKey] = {}
        self._lock = threading.Lock()
        for device_id, key in (keys or {}).items():
            self.register(device_id, key)

    def register(self, device_id: str, public_key: PublicKey | bytes | str, *, replace: bool = False) -> PublicKey:
        key = PublicKey.coerce(public_key)
        if not device_id:
            msg = "device id must be a non-empty string"
            raise ConfigError(msg)
        with self._lock:
            old = self._keys.get(device_id)
            if old is not None and old != key and not replace:
                msg = (
                    f"device {device_id!r} already has key {old.key_id_hex}; "
                    "pass replace=True to rotate it to the new key"
                )
                raise ConfigError(msg)
            self._keys[device_id] = key
        return key

    def unregister(self, device_id: str) -> None:
        with self._lock:
            self._keys.pop(device_id, None)

    def get(self, device_id: str) -> PublicKey | None:
        with self._lock:
            return self._keys.get(device_id)

    def devices(self) -> list[str]:
        with self._lock:
            return sorted(self._keys)

    def __contains__(self, device_id: object) -> bool:
        with self._lock:
            return device_id in self._keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def verify(self, device_id: str, data: bytes, signature: bytes, *, key_id: bytes | None = None) -> PublicKey:
        """Check ``signature`` over ``data`` with ``device_id``'s key; return that key.

        ``key_id`` (from the signed message, if it carries one) only improves
        the error message when a device signed with a key it was not
        registered with; it is not trusted for anything else.
        """
        key = self.get(device_id)
        if key is None:
            msg = f"no public key registered for device {device_id!r}; register it with KeyRing.register()"
            raise _signature_error("unknown_device", msg)
        if key_id is not None and not hmac.compare_digest(key_id, key.key_id):
            msg = (
                f"device {device_id!r} signed with key {bytes(key_id).hex()} but its registered key is "
                f"{key.key_id_hex}; re-register the device or fix its key file"
            )
            raise _signature_error("wrong_key", msg)
        key.verify(data, signature)
        return key

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``{device_id: public key hex}`` as JSON."""
        p = Path(path)
        with self._lock:
            data = {d: k.hex for d, k in sorted(self._keys.items())}
        p.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyRing:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            msg = f"cannot read key ring {p}: {exc.strerror or exc}"
            raise ConfigError(msg) from exc
        except ValueError as exc:
            msg = f"key ring {p} is not valid JSON: {exc}"
            raise ConfigError(msg) from exc
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            msg = f"key ring {p} must be a JSON object mapping device id to public key hex"
            raise ConfigError(msg)
        return cls(data)


Verifier = KeyRing
"""The name the codecs use for "something that verifies device signatures"."""


class _DeviceHistory:
    __slots__ = ("floor", "seen", "sorted")

    def __init__(self) -> None:
        self.floor: tuple[int, int] | None = None
        self.seen: set[tuple[int, int]] = set()
        self.sorted: list[tuple[int, int]] = []


class ReplayGuard:
    """Reject a (device, round id, sequence number) seen before.

    Per device it remembers the ``window`` newest accepted ``(round, seq)``
    pairs plus a floor: the newest pair that fell out of the window. A pair
    is accepted if it is above the floor and not remembered, so updates that
    arrive out of order (QoS 1 redelivery after a reconnect) are still
    accepted once, while anything older than the window is refused as stale.
    Memory is bounded by ``window * max_devices`` pairs; the least recently
    active device is forgotten first, so size ``max_devices`` above the
    fleet size.
    """

    def __init__(self, *, window: int = 256, max_devices: int = 100_000) -> None:
        if window < 1 or max_devices < 1:
            msg = "ReplayGuard window and max_devices must be >= 1"
            raise ConfigError(msg)
        self.window = window
        self.max_devices = max_devices
        self._devices: OrderedDict[str, _DeviceHistory] = OrderedDict()
        self._lock = threading.Lock()

    def _reason(self, hist: _DeviceHistory | None, pair: tuple[int, int]) -> str | None:
        if hist is None:
            return None
        if pair in hist.seen:
            return "replay"
        if hist.floor is not None and pair <= hist.floor:
            return "stale"
        return None

    def _raise(self, reason: str, device_id: str, round_id: int, seq: int) -> None:
        if reason == "replay":
            msg = (
                f"replayed update from device {device_id!r}: round {round_id} seq {seq} was already accepted; "
                "the device must use a new sequence number for every update"
            )
        else:
            msg = (
                f"stale update from device {device_id!r}: round {round_id} seq {seq} is older than the "
                f"last {self.window} accepted; it is refused as a possible replay"
            )
        raise _signature_error(reason, msg)

    def check(self, device_id: str, round_id: int, seq: int) -> None:
        """Raise :class:`SignatureError` if the triple would be a replay; record nothing."""
        pair = (int(round_id), int(seq))
        with self._lock:
            reason = self._reason(self._devices.get(device_id), pair)
        if reason:
            self._raise(reason, device_id, round_id, seq)

    def seen(self, device_id: str, round_id: int, seq: int) -> bool:
        with self._lock:
            return self._reason(self._devices.get(device_id), (int(round_id), int(seq))) is not None

    def check_and_record(self, device_id: str, round_id: int, seq: int) -> None:
        """Atomically check and remember the triple (raise if it is a replay)."""
        pair = (int(round_id), int(seq))
        with self._lock:
            hist = self._devices.get(device_id)
            reason = self._reason(hist, pair)
            if reason is None:
                if hist is None:
                    hist = _DeviceHistory()
                    self._devices[device_id] = hist
                    while len(self._devices) > self.max_devices:
                        self._devices.popitem(last=False)
                self._devices.move_to_end(device_id)
                bisect.insort(hist.sorted, pair)
                hist.seen.add(pair)
                if len(hist.sorted) > self.window:
                    oldest = hist.sorted.pop(0)
                    hist.seen.discard(oldest)
                    hist.floor = oldest if hist.floor is None else max(hist.floor, oldest)
        if reason:
            self._raise(reason, device_id, round_id, seq)

    def forget(self, device_id: str) -> None:
        with self._lock:
            self._devices.pop(device_id, None)

    def __len__(self) -> int:
        """Number of devices with a remembered history."""
        with self._lock:
            return len(self._devices)


# ---------------------------------------------------------------- pure-Python Ed25519
# RFC 8032, section 5.1, for boards without a cryptography wheel (riscv64 on
# PyPI). Points in extended twisted Edwards coordinates (X, Y, Z, T) with
# x = X/Z, y = Y/Z, x*y = T/Z. Fixed-base multiples of B come from a table of
# 64 radix-16 windows (built once, about 1,000 point additions); the
# variable-base multiple of a public key uses a 4-bit window. Verification
# is the cofactorless check OpenSSL makes: encode([S]B - [k]A) must equal the
# signature's R bytes, with S < L, so both paths accept exactly the same
# signatures (tests/test_signing.py compares them). Python integers are not
# constant-time: this path leaks timing, which matters for signing on a board
# an attacker can time closely; use cryptography where it exists.

_P = 2**255 - 19
_L = 2**252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, _P - 2, _P) % _P
_D2 = 2 * _D % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)
_IDENTITY = (0, 1, 1, 0)


def _ed_add(a: tuple, b: tuple) -> tuple:
    x1, y1, z1, t1 = a
    x2, y2, z2, t2 = b
    aa = (y1 - x1) * (y2 - x2) % _P
    bb = (y1 + x1) * (y2 + x2) % _P
    cc = t1 * _D2 * t2 % _P
    dd = 2 * z1 * z2 % _P
    e, f, g, h = bb - aa, dd - cc, dd + cc, bb + aa
    return (e * f % _P, g * h % _P, f * g % _P, e * h % _P)


def _ed_double(a: tuple) -> tuple:
    x1, y1, z1, _ = a
    aa = x1 * x1 % _P
    bb = y1 * y1 % _P
    cc = 2 * z1 * z1 % _P
    h = aa + bb
    e = h - (x1 + y1) * (x1 + y1)
    g = aa - bb
    f = cc + g
    return (e * f % _P, g * h % _P, f * g % _P, e * h % _P)


def _ed_recover_x(y: int, sign: int) -> int | None:
    if y >= _P:
        return None
    x2 = (y * y - 1) * pow(_D * y * y + 1, _P - 2, _P) % _P
    if x2 == 0:
        return None if sign else 0
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P:
        x = x * _SQRT_M1 % _P
    if (x * x - x2) % _P:
        return None
    if (x & 1) != sign:
        x = _P - x
    return x


def _ed_decode_point(data: bytes) -> tuple | None:
    """The point a 32-byte encoding names, or None (RFC 8032 5.1.3: y < p, x recoverable)."""
    if len(data) != 32:
        return None
    y = int.from_bytes(data, "little")
    sign = y >> 255
    y &= (1 << 255) - 1
    x = _ed_recover_x(y, sign)
    if x is None:
        return None
    return (x, y, 1, x * y % _P)


def _ed_encode_point(a: tuple) -> bytes:
    zinv = pow(a[2], _P - 2, _P)
    x, y = a[0] * zinv % _P, a[1] * zinv % _P
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


_GY = 4 * pow(5, _P - 2, _P) % _P
_GX = _ed_recover_x(_GY, 0)
_BASE = (_GX, _GY, 1, _GX * _GY % _P)
_BASE_TABLE: list[list[tuple]] = []
_TABLE_LOCK = threading.Lock()


def _ed_base_table() -> list[list[tuple]]:
    """_BASE_TABLE[i][j] = j * 16**i * B for i < 64, j < 16."""
    if not _BASE_TABLE:
        with _TABLE_LOCK:
            if not _BASE_TABLE:
                rows, p = [], _BASE
                for _ in range(64):
                    row = [_IDENTITY, p]
                    for _ in range(14):
                        row.append(_ed_add(row[-1], p))
                    rows.append(row)
                    p = _ed_add(row[-1], p)  # 16 * p
                _BASE_TABLE.extend(rows)
    return _BASE_TABLE


def _ed_mul_base(s: int) -> tuple:
    table = _ed_base_table()
    q = _IDENTITY
    s %= _L
    for i in range(64):
        j = (s >> (4 * i)) & 15
        if j:
            q = _ed_add(q, table[i][j])
    return q


def _ed_mul(s: int, a: tuple) -> tuple:
    window = [_IDENTITY, a]
    for _ in range(14):
        window.append(_ed_add(window[-1], a))
    q = _IDENTITY
    for shift in range((s.bit_length() + 3) // 4 * 4 - 4, -4, -4):
        q = _ed_double(_ed_double(_ed_double(_ed_double(q))))
        j = (s >> shift) & 15
        if j:
            q = _ed_add(q, window[j])
    return q


def _ed_expand(secret: bytes) -> tuple[int, bytes]:
    h = hashlib.sha512(secret).digest()
    a = int.from_bytes(h[:32], "little")
    a &= (1 << 254) - 8
    a |= 1 << 254
    return a, h[32:]


def _ed_hash_int(*parts: bytes) -> int:
    return int.from_bytes(hashlib.sha512(b"".join(parts)).digest(), "little") % _L


def _ed25519_public(secret: bytes) -> bytes:
    """RFC 8032 5.1.5: the public key of a 32-byte secret."""
    a, _ = _ed_expand(secret)
    return _ed_encode_point(_ed_mul_base(a))


def _ed25519_sign(secret: bytes, public: bytes, message: bytes) -> bytes:
    """RFC 8032 5.1.6 (``public`` must be ``_ed25519_public(secret)``)."""
    a, prefix = _ed_expand(secret)
    r = _ed_hash_int(prefix, message)
    rs = _ed_encode_point(_ed_mul_base(r))
    k = _ed_hash_int(rs, public, message)
    return rs + ((r + k * a) % _L).to_bytes(32, "little")


def _ed25519_verify_point(a: tuple, public: bytes, message: bytes, signature: bytes) -> bool:
    """RFC 8032 5.1.7, cofactorless, with the public key already decoded to ``a``."""
    s = int.from_bytes(signature[32:], "little")
    if s >= _L:
        return False
    k = _ed_hash_int(signature[:32], public, message)
    neg_a = ((_P - a[0]) % _P, a[1], a[2], (_P - a[3]) % _P)
    check = _ed_add(_ed_mul_base(s), _ed_mul(k, neg_a))
    return hmac.compare_digest(_ed_encode_point(check), signature[:32])


def _ed25519_verify(public: bytes, message: bytes, signature: bytes) -> bool:
    a = _ed_decode_point(public)
    return a is not None and len(signature) == SIGNATURE_SIZE and _ed25519_verify_point(a, public, message, signature)
