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

import bisect
import hashlib
import hmac
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from edgeflow.errors import ConfigError, SignatureError

__all__ = [
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


class PublicKey:
    """An Ed25519 public key: 32 raw bytes, shown as hex, identified by :attr:`key_id`."""

    __slots__ = ("_key", "_raw")

    def __init__(self, key: Ed25519PublicKey) -> None:
        self._key = key
        self._raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def from_bytes(cls, raw: bytes) -> PublicKey:
        if len(raw) != PUBLIC_KEY_SIZE:
            msg = f"an Ed25519 public key is {PUBLIC_KEY_SIZE} raw bytes, got {len(raw)}"
            raise ConfigError(msg)
        return cls(Ed25519PublicKey.from_public_bytes(bytes(raw)))

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
            try:
                key = serialization.load_pem_public_key(data)
            except ValueError as exc:
                msg = f"{path} is not a valid PEM public key: {exc}"
                raise ConfigError(msg) from exc
            if not isinstance(key, Ed25519PublicKey):
                msg = f"{path} holds a {type(key).__name__}, not an Ed25519 public key"
                raise ConfigError(msg)
            return cls(key)
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
            data = self._key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
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
        try:
            self._key.verify(bytes(signature), bytes(data))
        except InvalidSignature:
            msg = f"signature does not verify with key {self.key_id_hex}; the data was altered or signed by another key"
            raise _signature_error("bad_signature", msg) from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicKey) and hmac.compare_digest(self._raw, other._raw)

    def __hash__(self) -> int:
        return hash(self._raw)

    def __repr__(self) -> str:
        return f"PublicKey({self.hex})"


class PrivateKey:
    """An Ed25519 private key. Saved files are created with mode 0600."""

    __slots__ = ("_key",)

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> PrivateKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, raw: bytes) -> PrivateKey:
        if len(raw) != PRIVATE_KEY_SIZE:
            msg = f"an Ed25519 private key is {PRIVATE_KEY_SIZE} raw bytes, got {len(raw)}"
            raise ConfigError(msg)
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(raw)))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrivateKey:
        """Load a PEM (PKCS#8, unencrypted), hex or 32-byte raw private key file."""
        data = _read_key_file(path, "private key")
        if data.lstrip().startswith(b"-----BEGIN"):
            try:
                key = serialization.load_pem_private_key(data, password=None)
            except (ValueError, TypeError) as exc:
                msg = f"{path} is not an unencrypted PEM private key: {exc}"
                raise ConfigError(msg) from exc
            if not isinstance(key, Ed25519PrivateKey):
                msg = f"{path} holds a {type(key).__name__}, not an Ed25519 private key"
                raise ConfigError(msg)
            return cls(key)
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
            data = self._key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
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
        return self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @property
    def public_key(self) -> PublicKey:
        return PublicKey(self._key.public_key())

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(bytes(data))

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
