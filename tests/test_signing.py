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


# ---------------------------------------------------------------- the two Ed25519 paths
# Boards without a cryptography wheel (riscv64 on PyPI) sign and verify with the
# pure-Python RFC 8032 code in edgeflow.signing; both paths must agree bit for bit.

from edgeflow import signing as signing_mod  # noqa: E402

# RFC 8032, section 7.1: TEST 1, TEST 2, TEST 3 and TEST SHA(abc) (secret, public, message, signature).
RFC8032 = [
    ("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
     "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
     "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46b"
     "d25bf5f0595bbe24655141438e7a100b"),
    ("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
     "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
     "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c"
     "387b2eaeb4302aeeb00d291612bb0c00"),
    ("c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
     "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025", "af82",
     "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac18ff9b538d16f290ae67f760984dc659"
     "4a7c15e9716ed28dc027beceea1ec40a"),
    ("833fe62409237b9d62ec77587520911e9a759cec1d19755b7da901b96dca3d42",
     "ec172b93ad5e563bf4932c70e1245034c35467ef2efd4d64ebf819683467e2bf",
     hashlib.sha512(b"abc").hexdigest(),
     "dc2a4459e7369633a52b1bf277839a00201009a3efbf3ecb69bea2186c26b58909351fc9ac90b3ecfdfbc7c66431e030"
     "3dca179c138ac17ad9bef1177331a704"),
]


@pytest.fixture(params=["cryptography", "pure-python"])
def backend(request, monkeypatch) -> str:
    """Run a test once per Ed25519 path (the cryptography one only where it imports)."""
    if request.param == "cryptography":
        if not signing_mod._crypto:
            pytest.skip("cryptography is not installed here")
    else:
        monkeypatch.setattr(signing_mod, "_crypto", None)
    return request.param


@pytest.mark.parametrize("secret,public,message,signature", RFC8032)
def test_rfc8032_vectors(backend: str, secret: str, public: str, message: str, signature: str) -> None:
    key = PrivateKey.from_bytes(bytes.fromhex(secret))
    msg = bytes.fromhex(message)
    assert key.public_key.hex == public
    assert key.sign(msg).hex() == signature
    PublicKey.from_hex(public).verify(msg, bytes.fromhex(signature))
    with pytest.raises(SignatureError, match="does not verify"):
        PublicKey.from_hex(public).verify(msg + b"\0", bytes.fromhex(signature))


def test_pure_functions_on_rfc8032_vectors() -> None:
    for secret, public, message, signature in RFC8032:
        sk, pk, m, sig = (bytes.fromhex(v) for v in (secret, public, message, signature))
        assert signing_mod._ed25519_public(sk) == pk
        assert signing_mod._ed25519_sign(sk, pk, m) == sig
        assert signing_mod._ed25519_verify(pk, m, sig)
        assert not signing_mod._ed25519_verify(pk, m + b"x", sig)


def _flip(data: bytes, i: int, bit: int = 1) -> bytes:
    b = bytearray(data)
    b[i] ^= bit
    return bytes(b)


def test_pure_path_agrees_with_cryptography_on_valid_and_forged_signatures() -> None:
    ed = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
    from cryptography.exceptions import InvalidSignature

    def ossl_ok(pub: bytes, msg: bytes, sig: bytes) -> bool:
        try:
            ed.Ed25519PublicKey.from_public_bytes(pub).verify(sig, msg)
            return True
        except (InvalidSignature, ValueError):
            return False

    rng = __import__("random").Random(8032)
    cases = 0
    for n in range(12):
        sk = rng.randbytes(32)
        msg = rng.randbytes(n * 7)
        ref = ed.Ed25519PrivateKey.from_private_bytes(sk)
        pub = signing_mod._ed25519_public(sk)
        sig = signing_mod._ed25519_sign(sk, pub, msg)
        assert pub == PrivateKey(sk, ref).public_key.raw and sig == ref.sign(msg), "same bytes as OpenSSL"
        s_plus_l = (int.from_bytes(sig[32:], "little") + signing_mod._L).to_bytes(32, "little")
        forged = [sig, _flip(sig, n % 32), _flip(sig, 32 + n % 32), _flip(sig, 31, 0x80), sig[:32] + s_plus_l,
                  _flip(sig, 63, 0x10)]
        keys = [pub, _flip(pub, n % 32), rng.randbytes(32), _flip(pub, 31, 0x80)]
        for k in keys:
            for f in forged:
                for m in (msg, msg + b"!"):
                    assert signing_mod._ed25519_verify(k, m, f) == ossl_ok(k, m, f), (n, k.hex(), f.hex())
                    cases += 1
    assert cases == 12 * 4 * 6 * 2


def test_pem_files_are_byte_identical_and_cross_readable(tmp_path: Path, monkeypatch) -> None:
    ser = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    ed = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
    native = ed.Ed25519PrivateKey.generate()
    ossl_priv = native.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
    ossl_pub = native.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "o.key").write_bytes(ossl_priv)
    (tmp_path / "o.pub").write_bytes(ossl_pub)
    monkeypatch.setattr(signing_mod, "_crypto", None)
    key = PrivateKey.load(tmp_path / "o.key")  # the pure path reads OpenSSL's files
    assert key.public_key == PublicKey.load(tmp_path / "o.pub")
    assert key.save(tmp_path / "p.key").read_bytes() == ossl_priv  # and writes the same bytes
    assert key.public_key.save(tmp_path / "p.pub").read_bytes() == ossl_pub
    sig = key.sign(b"m")
    native.public_key().verify(sig, b"m")
    other = ed.Ed25519PrivateKey.generate().private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                                           ser.NoEncryption())
    (tmp_path / "x.key").write_bytes(other.replace(b"PRIVATE KEY-----\n", b"PRIVATE KEY-----\n!!", 1))
    with pytest.raises(ConfigError, match="not a valid PEM private key"):
        PrivateKey.load(tmp_path / "x.key")


def test_pure_path_refuses_other_key_types_in_one_line(tmp_path: Path, monkeypatch) -> None:
    ser = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    ec = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ec")
    k = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.key").write_bytes(k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                                      ser.NoEncryption()))
    (tmp_path / "ec.pub").write_bytes(k.public_key().public_bytes(ser.Encoding.PEM,
                                                                  ser.PublicFormat.SubjectPublicKeyInfo))
    monkeypatch.setattr(signing_mod, "_crypto", None)
    with pytest.raises(ConfigError, match="not Ed25519"):
        PrivateKey.load(tmp_path / "ec.key")
    with pytest.raises(ConfigError, match="not Ed25519"):
        PublicKey.load(tmp_path / "ec.pub")


def test_pure_key_objects_sign_verify_and_round_trip(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(signing_mod, "_crypto", None)
    key = PrivateKey.generate()
    assert key._key is None, "no cryptography object on the pure path"
    for fmt in ("pem", "hex", "raw"):
        loaded = PrivateKey.load(key.save(tmp_path / f"k.{fmt}", format=fmt))
        assert loaded.raw() == key.raw() and mode(tmp_path / f"k.{fmt}") == 0o600
        assert PublicKey.load(key.public_key.save(tmp_path / f"p.{fmt}", format=fmt)) == key.public_key
    sig = key.sign(b"artifact")
    key.public_key.verify(b"artifact", sig)
    with pytest.raises(SignatureError, match="does not verify"):
        key.public_key.verify(b"artifacT", sig)
    bad = PublicKey.from_bytes(bytes(31) + b"\x80")  # not a point: every signature fails, no crash
    with pytest.raises(SignatureError, match="does not verify"):
        bad.verify(b"artifact", sig)


def test_signing_env_forces_the_pure_path(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    key = PrivateKey.from_bytes(bytes.fromhex(RFC8032[1][0]))
    key.save(tmp_path / "k.pem")
    code = ("import sys; from edgeflow import signing as s; k = s.PrivateKey.load(sys.argv[1]); "
            "print(s.BACKEND, k.sign(b'\\x72').hex())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "k.pem")], capture_output=True, text=True,
                         env={**os.environ, signing_mod.BACKEND_ENV: "pure"}, timeout=60, check=True)
    assert out.stdout.split() == ["pure-python", RFC8032[1][3]]
