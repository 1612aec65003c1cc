"""Shared helpers for tests that need a real MQTT broker.

Import what you need in a test module (pytest puts tests/ on sys.path)::

    from _brokers import Inbox, mosquitto_factory, transport_factory, requires_mosquitto  # noqa: F401

Fixtures imported this way are registered for that module. Everything here
starts real processes and sockets on free loopback ports and cleans up after
itself; nothing is mocked.

- :func:`mosquitto_factory` -> ``make(**MosquittoBroker options)``: a private
  Mosquitto with auth/ACL/TLS/size limit/persistence, stopped at teardown.
- :func:`transport_factory` -> ``make(broker, **MqttTransport options)``: a
  connected transport with fast reconnect settings, closed at teardown.
- :class:`Inbox`: a handler that records messages and waits for them.
- :func:`make_tls_material`: a CA, a server certificate for 127.0.0.1 /
  localhost and a client certificate, written as PEM files.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from edgeflow.transport.broker import MosquittoBroker, find_mosquitto
from edgeflow.transport.message import Message

__all__ = [
    "MOSQUITTO",
    "FAST",
    "Inbox",
    "TlsMaterial",
    "make_tls_material",
    "mosquitto_factory",
    "requires_mosquitto",
    "tls_material",
    "transport_factory",
    "stays",
    "wait_until",
]

MOSQUITTO = find_mosquitto()
requires_mosquitto = pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto is not installed")

FAST: dict[str, Any] = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.5, "connect_timeout_s": 5.0}
"""MqttTransport options that make reconnect tests quick."""


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def stays(value: Callable[[], Any], *, for_s: float = 0.3, reason: str, interval: float = 0.01) -> None:
    """Assert that ``value()`` keeps its current value for ``for_s`` seconds.

    The one bounded wait of a *negative* assertion ("nothing more arrived"):
    no event can say that something will never come, so it watches for
    ``for_s`` and fails as soon as the value changes. ``reason`` says what a
    change would mean (it is the failure message). Positive waits use
    :func:`wait_until` or :meth:`Inbox.wait`, which end on the event.
    """
    start = value()
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        now = value()
        if now != start:
            pytest.fail(f"{reason}: {start!r} became {now!r}")
        time.sleep(interval)


class Inbox:
    """A message handler that keeps what it receives, for assertions."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.messages: list[Message] = []
        self.delay_s = delay_s
        self._cond = threading.Condition()

    def __call__(self, msg: Message) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._cond:
            self.messages.append(msg)
            self._cond.notify_all()

    def wait(self, count: int = 1, timeout: float = 10.0) -> list[Message]:
        """Wait until at least ``count`` messages arrived; fail the test otherwise."""
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.messages) >= count, timeout)
            got = list(self.messages)
        if not ok:
            pytest.fail(f"expected {count} message(s) within {timeout} s, got {len(got)}: {[m.topic for m in got]}")
        return got

    def wait_for(self, predicate: Callable[[Message], bool], timeout: float = 10.0) -> Message:
        with self._cond:
            ok = self._cond.wait_for(lambda: any(predicate(m) for m in self.messages), timeout)
            found = [m for m in self.messages if predicate(m)]
        if not ok:
            pytest.fail(f"no matching message within {timeout} s")
        return found[0]

    def topics(self) -> list[str]:
        with self._cond:
            return [m.topic for m in self.messages]


@pytest.fixture
def mosquitto_factory() -> Iterator[Callable[..., MosquittoBroker]]:
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed")
    started: list[MosquittoBroker] = []

    def make(**options: Any) -> MosquittoBroker:
        broker = MosquittoBroker(binary=MOSQUITTO, **options).start()
        started.append(broker)
        return broker

    yield make
    for b in started:
        b.stop()


@pytest.fixture
def transport_factory() -> Iterator[Callable[..., Any]]:
    from edgeflow.transport.mqtt import MqttTransport

    made: list[MqttTransport] = []

    def make(broker: Any, *, connect: bool = True, port: int | None = None, **options: Any) -> MqttTransport:
        opts: dict[str, Any] = {**FAST, "protocol": getattr(broker, "protocol", "auto"), **options}
        t = MqttTransport(broker.host, port or broker.port, **opts)
        made.append(t)
        if connect:
            t.connect()
        return t

    yield make
    for t in made:
        t.close(timeout=1.0, flush=False)


@dataclass(frozen=True)
class TlsMaterial:
    """PEM files: a CA, a server certificate (127.0.0.1, localhost) and a client certificate."""

    dir: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _cert(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None, issuer_key: ec.EllipticCurvePrivateKey,
    *, ca: bool, san: list[x509.GeneralName] | None = None, usage: Any = None,
) -> x509.Certificate:
    now = _dt.datetime.now(_dt.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_tls_material(directory: Path, *, client_name: str = "device-1") -> TlsMaterial:
    """Write a fresh CA, server and client certificate into ``directory`` (P-256 keys: fast)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("edgeflow test CA", ca_key, None, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert(
        "localhost", server_key, ca.subject, ca_key, ca=False,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _cert(client_name, client_key, ca.subject, ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    paths = {}
    for name, data in (
        ("ca.crt", ca.public_bytes(serialization.Encoding.PEM)),
        ("ca.key", _key_pem(ca_key)),
        ("server.crt", server.public_bytes(serialization.Encoding.PEM)),
        ("server.key", _key_pem(server_key)),
        ("client.crt", client.public_bytes(serialization.Encoding.PEM)),
        ("client.key", _key_pem(client_key)),
    ):
        p = directory / name
        p.write_bytes(data)
        p.chmod(0o600)
        paths[name] = p
    return TlsMaterial(
        directory, paths["ca.crt"], paths["ca.key"], paths["server.crt"], paths["server.key"],
        paths["client.crt"], paths["client.key"],
    )


@pytest.fixture(scope="session")
def tls_material(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return make_tls_material(tmp_path_factory.mktemp("tls"))
