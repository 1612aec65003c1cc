"""A device's credentials directory: everything a board needs to join its fleet.

Layout (written by ``edgeflow fleet provision``, copied to the board)::

    device.json   {"device_id", "fleet", "username", "password", "broker", "profile"}  mode 0600
    device.key    the device's Ed25519 private key (PEM, 0600); signs births, acks, updates
    device.pub    its public key (registered in the gateway's key ring)
    fleet.pub     the fleet (gateway) public key: commands and OTA artifacts must verify with it
    ca.crt        CA that signed the broker's TLS certificate (optional: system store otherwise)
    client.crt    client certificate for mutual TLS (optional, with client.key)

Why a directory of plain files: it is what provisioning tools, SD-card
images and config management copy around, and each secret keeps its own
permissions.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..signing import PrivateKey, PublicKey, Signer
from ..transport.message import TlsConfig
from ..transport.topics import validate_id

__all__ = ["DeviceCredentials", "provision_device"]


@dataclass(frozen=True)
class DeviceCredentials:
    directory: Path
    device_id: str
    fleet: str
    username: str
    password: str
    broker: str | None
    profile: str | None
    key: PrivateKey
    fleet_key: PublicKey

    @property
    def signer(self) -> Signer:
        return Signer(self.device_id, self.key)

    def tls_config(self) -> TlsConfig | None:
        """TLS settings from the files present (None when there is neither CA nor client cert)."""
        ca = self.directory / "ca.crt"
        cert, key = self.directory / "client.crt", self.directory / "client.key"
        if not ca.exists() and not cert.exists():
            return None
        return TlsConfig(
            ca_file=str(ca) if ca.exists() else None,
            cert_file=str(cert) if cert.exists() else None,
            key_file=str(key) if cert.exists() and key.exists() else None,
        )

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> DeviceCredentials:
        d = Path(directory)
        meta_path = d / "device.json"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(
                f"{meta_path} not found: {d} is not a device credentials directory; "
                "create one with `edgeflow fleet provision DEVICE`"
            ) from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {meta_path}: {exc}") from exc
        for k in ("device_id", "fleet", "username", "password"):
            if not isinstance(meta.get(k), str) or not meta[k]:
                raise ConfigError(f"{meta_path}: field {k!r} is missing; re-provision the device")
        if not (d / "fleet.pub").exists():
            raise ConfigError(f"{d / 'fleet.pub'} is missing: the device cannot verify commands or models without "
                              "the fleet public key; re-provision the device")
        return cls(
            d, validate_id(meta["device_id"], "device id"), validate_id(meta["fleet"], "fleet id"),
            meta["username"], meta["password"], meta.get("broker"), meta.get("profile"),
            PrivateKey.load(d / "device.key"), PublicKey.load(d / "fleet.pub"),
        )


def provision_device(
    directory: str | os.PathLike[str],
    device_id: str,
    fleet: str,
    fleet_key: PublicKey,
    *,
    password: str | None = None,
    broker: str | None = None,
    profile: str | None = None,
    ca_file: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> DeviceCredentials:
    """Create a credentials directory with a fresh device key and MQTT password."""
    validate_id(device_id, "device id")
    validate_id(fleet, "fleet id")
    d = Path(directory)
    if (d / "device.json").exists() and not overwrite:
        raise ConfigError(f"{d} already holds credentials for a device; pass overwrite=True (--force) to replace them")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    key = PrivateKey.generate()
    key.save(d / "device.key", overwrite=True)
    key.public_key.save(d / "device.pub", format="hex", overwrite=True)
    fleet_key.save(d / "fleet.pub", format="hex", overwrite=True)
    if ca_file is not None:
        shutil.copyfile(ca_file, d / "ca.crt")
    meta = {"device_id": device_id, "fleet": fleet, "username": device_id,
            "password": password or secrets.token_urlsafe(24), "broker": broker, "profile": profile}
    path = d / "device.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    return DeviceCredentials.load(d)
