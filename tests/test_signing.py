"""Ed25519 keys on disk, signatures, the key ring and the replay guard."""

from __future__ import annotations

import hashlib
import stat
import threading
from pathlib import Path

import pytest

from edgeflow.errors import ConfigError, SignatureError
from edgeflow.signing import (
    KeyRing,
    PrivateKey,
    PublicKey,
    ReplayGuard,
    Signer,
    signing_message,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("fmt", ["pem", "hex", "raw"])
def test_private_key_files_round_trip_with_0600(tmp_path: Path, fmt: str) -> None:
    key = PrivateKey.generate()
    path = key.save(tmp_path / f"device.{fmt}", format=fmt)
    assert mode(path) == 0o600
    loaded = PrivateKey.load(path)
    assert loaded.public_key == key.public_key
    sig = loaded.sign(b"hello")
    key.public_key.verify(b"hello", sig)


def test_private_key_is_not_overwritten_by_accident(tmp_path: Path) -> None:
    path = PrivateKey.generate().save(tmp_path / "k.pem")
    with pytest.raises(ConfigError, match="already exists.*overwrite=True"):
        PrivateKey.generate().save(path)
    other = PrivateKey.generate()
    other.save(path, overwrite=True)
    assert PrivateKey.load(path).public_key == other.public_key and mode(path) == 0o600


@pytest.mark.parametrize("fmt", ["pem", "hex", "raw"])
def test_public_key_files(tmp_path: Path, fmt: str) -> None:
    pub = PrivateKey.generate().public_key
    assert PublicKey.load(pub.save(tmp_path / f"pub.{fmt}", format=fmt)) == pub


def test_public_key_encodings() -> None:
    pub = PrivateKey.generate().public_key
    assert len(pub.raw) == 32 and len(pub.hex) == 64
    assert PublicKey.from_hex(pub.hex) == PublicKey.from_bytes(pub.raw) == PublicKey.coerce(pub.hex) == pub
    assert pub.key_id == hashlib.sha256(pub.raw).digest()[:8]
    with pytest.raises(ConfigError, match="32 raw bytes"):
        PublicKey.from_bytes(b"short")
    with pytest.raises(ConfigError, match="not hex"):
        PublicKey.from_hex("zz" * 32)


def test_loading_garbage_says_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key at all")
    with pytest.raises(ConfigError, match="neither PEM, hex nor 32 raw bytes"):
        PrivateKey.load(bad)
    with pytest.raises(ConfigError, match="cannot read private key file"):
        PrivateKey.load(tmp_path / "missing.key")


def test_sign_and_verify_bytes() -> None:
    key = PrivateKey.generate()
    sig = key.sign(b"artifact")
    key.public_key.verify(b"artifact", sig)
    with pytest.raises(SignatureError, match="does not verify"):
        key.public_key.verify(b"artifacT", sig)
    with pytest.raises(SignatureError, match="64 bytes"):
        key.public_key.verify(b"artifact", sig[:10])
    with pytest.raises(SignatureError):
        PrivateKey.generate().public_key.verify(b"artifact", sig)


def test_signing_message_separates_purposes() -> None:
    digest = hashlib.sha256(b"model").digest()
    a, b = signing_message("update/v1", digest), signing_message("ota/v1", digest)
    assert a != b and a.endswith(digest)
    key = PrivateKey.generate()
    with pytest.raises(SignatureError):
        key.public_key.verify(b, key.sign(a))
    with pytest.raises(ValueError, match="32-byte"):
        signing_message("x", b"short")


def test_keyring_verifies_by_claimed_device(tmp_path: Path) -> None:
    alice, bob = Signer.generate("alice"), Signer.generate("bob")
    ring = KeyRing({"alice": alice.public_key})
    ring.register("bob", bob.public_key.hex)
    assert ring.verify("alice", b"m", alice.sign(b"m")) == alice.public_key
    with pytest.raises(SignatureError, match="does not verify"):
        ring.verify("alice", b"m", bob.sign(b"m"))  # bob cannot speak for alice
    with pytest.raises(SignatureError, match="no public key registered for device 'carol'"):
        ring.verify("carol", b"m", bob.sign(b"m"))
    with pytest.raises(SignatureError, match="signed with key .* but its registered key"):
        ring.verify("alice", b"m", bob.sign(b"m"), key_id=bob.key_id)
    loaded = KeyRing.load(ring.save(tmp_path / "ring.json"))
    assert loaded.devices() == ["alice", "bob"] and loaded.get("bob") == bob.public_key


def test_keyring_rotation_must_be_explicit() -> None:
    ring = KeyRing()
    k1, k2 = PrivateKey.generate().public_key, PrivateKey.generate().public_key
    ring.register("d", k1)
    ring.register("d", k1)  # same key again is fine
    with pytest.raises(ConfigError, match="replace=True"):
        ring.register("d", k2)
    ring.register("d", k2, replace=True)
    assert ring.get("d") == k2 and "d" in ring and len(ring) == 1
    ring.unregister("d")
    assert "d" not in ring


def test_keyring_file_errors(tmp_path: Path) -> None:
    p = tmp_path / "ring.json"
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        KeyRing.load(p)
    p.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KeyRing.load(p)


def test_replay_guard_rejects_replays_and_accepts_reordering() -> None:
    guard = ReplayGuard(window=4)
    for seq in (3, 1, 2):  # out of order, all new
        guard.check_and_record("d", 7, seq)
    with pytest.raises(SignatureError, match="replayed update from device 'd': round 7 seq 2") as err:
        guard.check_and_record("d", 7, 2)
    assert err.value.reason == "replay"  # type: ignore[attr-defined]
    guard.check_and_record("d", 8, 0)  # a new round may restart the sequence
    guard.check_and_record("other", 7, 2)  # devices are independent
    assert guard.seen("d", 7, 3) and not guard.seen("d", 9, 0)


def test_replay_guard_window_and_stale_updates() -> None:
    guard = ReplayGuard(window=3)
    for seq in range(10):
        guard.check_and_record("d", 1, seq)
    guard.check("d", 1, 10)  # check alone records nothing
    guard.check("d", 1, 10)
    with pytest.raises(SignatureError, match="older than the last 3") as err:
        guard.check_and_record("d", 1, 5)  # fell out of the window: cannot tell, so refuse
    assert err.value.reason == "stale"  # type: ignore[attr-defined]
    with pytest.raises(SignatureError):
        guard.check_and_record("d", 0, 99)  # an older round is older, whatever its seq


def test_replay_guard_memory_is_bounded() -> None:
    guard = ReplayGuard(window=2, max_devices=3)
    for i in range(10):
        guard.check_and_record(f"d{i}", 1, 1)
    assert len(guard) == 3
    assert guard.seen("d9", 1, 1) and not guard.seen("d0", 1, 1)  # least recently active forgotten


def test_replay_guard_is_atomic_under_threads() -> None:
    guard = ReplayGuard()
    accepted: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for seq in range(200):
            try:
                guard.check_and_record("d", 1, seq)
            except SignatureError:
                continue
            with lock:
                accepted.append(seq)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(accepted) == list(range(200)), "each (round, seq) accepted exactly once"
