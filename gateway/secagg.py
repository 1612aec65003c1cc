"""Secure aggregation by pairwise masking (Bonawitz et al., CCS 2017), message level.

The gateway learns ``sum_u w_u x_u`` over the clients that finished the round
and nothing else about any single ``x_u`` (within the threat model below).
Each client adds to its fixed-point update a self mask PRG(b_u) and, for every
other participant v, +PRG(s_uv) if u's index < v's and -PRG(s_uv) otherwise,
where s_uv comes from an X25519 agreement between u's and v's mask keys:
pairwise masks cancel in the sum, self masks are removed with b_u rebuilt from
Shamir shares, and a client that dropped after sharing keys has its pairwise
masks removed with its mask key rebuilt from shares.

The protocol is four explicit exchanges (the orchestrator carries them over
MQTT; nothing here does I/O)::

    round 0  client -> server  AdvertiseKeys       two X25519 public keys
             server -> all     KeyDirectory        everyone's keys, indices, layout
    round 1  client -> server  ShareKeys           t-of-n shares of (mask key, b_u),
                                                   one AES-GCM ciphertext per peer
             server -> each    ShareBundle         the ciphertexts addressed to it
    round 2  client -> server  MaskedInput         y_u = x_u + masks (mod 2^k)
             server -> all     UnmaskRequest       who survived, who dropped
    round 3  client -> server  UnmaskResponse      b-shares of survivors,
                                                   key-shares of the dropped
             server            finish()            -> SecAggResult (the sum)

**Fixed point.** Masked arithmetic must be exact, so values live in the ring
Z_(2^k) (k = 32 or 64, numpy's wrapping unsigned integers). A client encodes
``v = clip(w * x, -clip, clip)`` as ``round(v * 2^f)``; the server decodes the
sum as a signed integer over 2^f. The config refuses settings where
``max_clients * clip * 2^f`` could overflow 2^(k-1). Error per value <=
2^-(f+1) per client (deterministic rounding). Default: k = 64, f = 32
(resolution 2.3e-10), clip = 1024. The weight w itself is appended as one
more masked coordinate, so the server also learns ``sum_u w_u`` and can divide.

**Threat model and limits.** Honest-but-curious server and clients, plus
the one active attack the unmasking step invites: with ``threshold`` > n/2
and every client answering at most one UnmaskRequest per session, and never
with both kinds of share for the same peer, the server cannot obtain both
b_u and u's mask key, so it cannot unmask a single client by lying about who
dropped. Not covered: a server that invents clients (AdvertiseKeys must be
authenticated, e.g. signed with the devices' Ed25519 keys from
:mod:`edgeflow.signing` - the orchestrator's job), Bonawitz's consistency
check round, malicious clients sending garbage (the sum is then garbage:
secure aggregation hides inputs, it cannot validate them - robust
aggregation and per-update checks are impossible on masked data), and
collusion of the server with >= threshold clients. A masked vector is
uniform in the ring, so it does not compress: 8 bytes/parameter (k = 64) or
4 (k = 32) on the wire.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edgeflow.errors import AggregationError, ConfigError
from edgeflow.gateway.aggregation import Schema, TensorSpec, Weights
from edgeflow.gateway.shamir import SHARE_BYTES, Share, combine_shares, split_secret

__all__ = [
    "AdvertiseKeys",
    "EncryptedShare",
    "FixedPoint",
    "KeyDirectory",
    "MaskedInput",
    "ParticipantKeys",
    "SecAggClient",
    "SecAggConfig",
    "SecAggError",
    "SecAggResult",
    "SecAggServer",
    "ShareBundle",
    "ShareKeys",
    "UnmaskRequest",
    "UnmaskResponse",
    "prg_mask",
]

_PROTO = b"edgeflow-secagg/v1"
_KEY_BYTES = 32
_WEIGHT_NAME = "__secagg_weight__"


class SecAggError(AggregationError):
    """A secure-aggregation round cannot proceed (too many dropouts, bad message, protocol order)."""


# ---------------------------------------------------------------------------
# Configuration and fixed point
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SecAggConfig:
    """Protocol parameters, fixed by the server and sent in the KeyDirectory.

    ``threshold`` t: shares needed to rebuild a secret = the minimum number of
    clients that must survive to the end; up to n - t may drop out.
    """

    threshold: int
    ring_bits: int = 64
    frac_bits: int = 32
    clip: float = 1024.0
    max_clients: int = 1 << 16

    def __post_init__(self) -> None:
        if self.ring_bits not in (32, 64):
            raise ConfigError(f"ring_bits must be 32 or 64, got {self.ring_bits}")
        if not isinstance(self.threshold, int) or self.threshold < 2:
            raise ConfigError(f"threshold must be an int >= 2, got {self.threshold!r}")
        if not 0 <= self.frac_bits < self.ring_bits - 1:
            raise ConfigError(f"frac_bits must be in [0, {self.ring_bits - 1}), got {self.frac_bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"clip must be > 0, got {self.clip}")
        if self.max_clients < self.threshold:
            raise ConfigError(f"max_clients ({self.max_clients}) < threshold ({self.threshold})")
        bound = self.max_clients * self.clip * 2.0 ** self.frac_bits
        if bound >= 2.0 ** (self.ring_bits - 1):
            raise ConfigError(
                f"fixed point overflows: max_clients * clip * 2^frac_bits = 2^{math.log2(bound):.1f} "
                f">= 2^{self.ring_bits - 1}; lower clip, frac_bits or max_clients, or use ring_bits=64"
            )

    @classmethod
    def for_clients(cls, num_clients: int, max_dropout_fraction: float = 0.3, **kwargs) -> SecAggConfig:
        """t = n - floor(fraction * n), requiring t > n/2 (see the threat model)."""
        if not 0 <= max_dropout_fraction < 0.5:
            raise ConfigError(
                f"max_dropout_fraction must be in [0, 0.5) so that threshold > n/2, got {max_dropout_fraction}")
        threshold = num_clients - math.floor(max_dropout_fraction * num_clients)
        kwargs.setdefault("max_clients", max(num_clients, 2))
        return cls(threshold=threshold, **kwargs)

    @property
    def fixed_point(self) -> FixedPoint:
        return FixedPoint(self.ring_bits, self.frac_bits, self.clip)


@dataclass(frozen=True)
class FixedPoint:
    """float <-> Z_(2^bits) with ``frac`` fractional bits, clipped to [-clip, clip]."""

    bits: int
    frac: int
    clip: float

    @property
    def udtype(self) -> np.dtype:
        return np.dtype(np.uint64 if self.bits == 64 else np.uint32)

    @property
    def sdtype(self) -> np.dtype:
        return np.dtype(np.int64 if self.bits == 64 else np.int32)

    def encode(self, values: np.ndarray) -> np.ndarray:
        v = np.clip(np.asarray(values, dtype=np.float64), -self.clip, self.clip)
        return np.rint(v * 2.0 ** self.frac).astype(self.sdtype).view(self.udtype)

    def decode(self, ring: np.ndarray) -> np.ndarray:
        return ring.view(self.sdtype).astype(np.float64) / 2.0 ** self.frac


def prg_mask(seed: bytes, length: int, bits: int, session_id: bytes, label: bytes) -> np.ndarray:
    """``length`` uniform ring elements from a 32-byte seed: AES-256-CTR keyed by
    HKDF-SHA256(seed, salt=session, info=protocol|label). The label separates
    self masks from pairwise masks; the session makes every round's masks new."""
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=session_id, info=_PROTO + b"|" + label).derive(seed)
    itemsize = bits // 8
    enc = Cipher(algorithms.AES(key), modes.CTR(b"\0" * 16)).encryptor()
    raw = enc.update(bytes(length * itemsize)) + enc.finalize()
    return np.frombuffer(raw, dtype=np.dtype(f"<u{itemsize}")).astype(np.dtype(f"u{itemsize}"), copy=False)


def _pub_bytes(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _priv_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def _load_pub(data: bytes, who: str) -> X25519PublicKey:
    try:
        return X25519PublicKey.from_public_bytes(bytes(data))
    except ValueError as exc:
        raise SecAggError(f"{who}: not a 32-byte X25519 public key") from exc


def _agree(private: X25519PrivateKey, public: X25519PublicKey, session_id: bytes, label: bytes) -> bytes:
    try:
        shared = private.exchange(public)
    except ValueError as exc:  # low-order point
        raise SecAggError("X25519 agreement failed: peer key is a low-order point") from exc
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=session_id, info=_PROTO + b"|" + label).derive(shared)


def _pairwise_seed(private: X25519PrivateKey, public: X25519PublicKey, session_id: bytes) -> bytes:
    return _agree(private, public, session_id, b"pairwise-seed")


# ---------------------------------------------------------------------------
# Messages (round by round)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvertiseKeys:
    """Round 0, client -> server: fresh keys for this session only."""

    client_id: str
    enc_public_key: bytes
    """X25519 key for encrypting shares between clients (c_u)."""
    mask_public_key: bytes
    """X25519 key for the pairwise mask agreement (s_u)."""


@dataclass(frozen=True)
class ParticipantKeys:
    client_id: str
    index: int
    enc_public_key: bytes
    mask_public_key: bytes


@dataclass(frozen=True)
class KeyDirectory:
    """Round 0, server -> every advertiser: who takes part, their keys and index
    (the Shamir point and mask sign order), and the tensor layout to flatten."""

    session_id: bytes
    round_id: int
    config: SecAggConfig
    participants: tuple[ParticipantKeys, ...]
    layout: tuple[tuple[str, tuple[int, ...]], ...]

    def participant(self, client_id: str) -> ParticipantKeys:
        for p in self.participants:
            if p.client_id == client_id:
                return p
        raise SecAggError(f"client {client_id!r} is not in the key directory")


@dataclass(frozen=True)
class EncryptedShare:
    sender: str
    recipient: str
    ciphertext: bytes
    """nonce (12) | AES-256-GCM(share of mask key | share of b_u), AD = session|sender|recipient."""


@dataclass(frozen=True)
class ShareKeys:
    """Round 1, client -> server: one encrypted share pair per other participant."""

    client_id: str
    session_id: bytes
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True)
class ShareBundle:
    """Round 1, server -> one client: the shares addressed to it, and U2 (the
    clients whose shares were delivered: the ones it must mask against)."""

    recipient: str
    session_id: bytes
    shares: tuple[EncryptedShare, ...]
    share_holders: tuple[str, ...]


@dataclass(frozen=True)
class MaskedInput:
    """Round 2, client -> server: the masked, fixed-point update (uniform in the ring)."""

    client_id: str
    session_id: bytes
    masked: np.ndarray


@dataclass(frozen=True)
class UnmaskRequest:
    """Round 3, server -> survivors: who sent masked input (U3) and who did not."""

    session_id: bytes
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class UnmaskResponse:
    """Round 3, client -> server: shares of b_v for survivors, of mask keys for the dropped."""

    client_id: str
    session_id: bytes
    seed_shares: dict[str, bytes] = field(default_factory=dict)
    key_shares: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class SecAggResult:
    """The unmasked sum: ``sum`` = sum_u w_u x_u per tensor (float64), ``total_weight`` = sum_u w_u."""

    sum: dict[str, np.ndarray]
    total_weight: float
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]

    @property
    def num_clients(self) -> int:
        return len(self.survivors)

    def mean(self) -> dict[str, np.ndarray]:
        if not self.total_weight > 0:
            raise SecAggError(f"total weight is {self.total_weight}; cannot average")
        return {k: v / self.total_weight for k, v in self.sum.items()}


def _layout_schema(layout: Sequence[tuple[str, tuple[int, ...]]]) -> Schema:
    return Schema({name: TensorSpec(tuple(shape), np.dtype(np.float32)) for name, shape in layout})


# ---------------------------------------------------------------------------
# Client
# ---------------------------------------------------------------------------


class SecAggClient:
    """One client's side of one session. Create a new one every round: keys and
    the self-mask seed must never be reused across sessions."""

    def __init__(self, client_id: str) -> None:
        if not client_id:
            raise ConfigError("a secure-aggregation client needs a non-empty client_id")
        self.client_id = client_id
        self._enc_key = X25519PrivateKey.generate()
        self._mask_key = X25519PrivateKey.generate()
        self._self_seed = os.urandom(_KEY_BYTES)
        self._directory: KeyDirectory | None = None
        self._holders: tuple[str, ...] = ()
        self._received: dict[str, tuple[bytes, bytes]] = {}  # sender -> (key share, seed share)
        self._own_shares: tuple[bytes, bytes] | None = None
        self._masked_sent = False
        self._unmasked = False

    def advertise(self) -> AdvertiseKeys:
        return AdvertiseKeys(self.client_id, _pub_bytes(self._enc_key.public_key()),
                             _pub_bytes(self._mask_key.public_key()))

    def share_keys(self, directory: KeyDirectory) -> ShareKeys:
        """Split the mask key and self-mask seed t-of-n and encrypt one share pair per peer."""
        if self._directory is not None:
            raise SecAggError(f"client {self.client_id!r}: share_keys() already called in this session")
        me = directory.participant(self.client_id)
        cfg = directory.config
        n = len(directory.participants)
        if n < cfg.threshold:
            raise SecAggError(f"key directory lists {n} clients, fewer than the threshold {cfg.threshold}")
        if cfg.threshold <= n // 2:
            raise SecAggError(f"threshold {cfg.threshold} <= n/2 for n={n}: refusing (the server could unmask a client)")
        if me.mask_public_key != _pub_bytes(self._mask_key.public_key()) or \
                me.enc_public_key != _pub_bytes(self._enc_key.public_key()):
            raise SecAggError(f"client {self.client_id!r}: the directory lists keys that are not mine")
        ids = [p.client_id for p in directory.participants]
        idx = [p.index for p in directory.participants]
        if len(set(ids)) != n or len(set(idx)) != n or min(idx) < 1:
            raise SecAggError("key directory has duplicate client ids or indices")
        if len({p.mask_public_key for p in directory.participants}) != n:
            raise SecAggError("key directory repeats a public key")
        xs = [p.index for p in directory.participants]
        key_shares = split_secret(_priv_bytes(self._mask_key), cfg.threshold, n, xs=xs)
        seed_shares = split_secret(self._self_seed, cfg.threshold, n, xs=xs)
        out = []
        for p, ks, ss in zip(directory.participants, key_shares, seed_shares):
            if p.client_id == self.client_id:
                self._own_shares = (ks.y_bytes(), ss.y_bytes())
                continue
            key = _agree(self._enc_key, _load_pub(p.enc_public_key, p.client_id), directory.session_id, b"share-key")
            nonce = os.urandom(12)
            ad = _share_ad(directory.session_id, self.client_id, p.client_id)
            ct = AESGCM(key).encrypt(nonce, ks.y_bytes() + ss.y_bytes(), ad)
            out.append(EncryptedShare(self.client_id, p.client_id, nonce + ct))
        self._directory = directory
        return ShareKeys(self.client_id, directory.session_id, tuple(out))

    def masked_input(self, bundle: ShareBundle, update: Weights, weight: float = 1.0) -> MaskedInput:
        """Decrypt the shares received, then mask ``weight * update`` (plus ``weight`` itself).

        ``update`` is a delta with the directory's layout (float arrays). Use
        weight = num_samples for FedAvg, 1.0 for an unweighted sum; values
        beyond the configured clip range are clipped.
        """
        d = self._require_directory()
        if self._masked_sent:
            raise SecAggError(f"client {self.client_id!r}: masked input already sent in this session")
        if bundle.recipient != self.client_id or bundle.session_id != d.session_id:
            raise SecAggError(f"client {self.client_id!r}: share bundle is for {bundle.recipient!r} / another session")
        holders = tuple(bundle.share_holders)
        known = {p.client_id for p in d.participants}
        if self.client_id not in holders or not set(holders) <= known or len(set(holders)) != len(holders):
            raise SecAggError(f"client {self.client_id!r}: share holder list is inconsistent with the directory")
        if len(holders) < d.config.threshold:
            raise SecAggError(f"only {len(holders)} clients shared keys; at least {d.config.threshold} are needed")
        received: dict[str, tuple[bytes, bytes]] = {}
        for es in bundle.shares:
            if es.recipient != self.client_id or es.sender not in holders or es.sender in received:
                raise SecAggError(f"client {self.client_id!r}: unexpected share from {es.sender!r}")
            peer = d.participant(es.sender)
            key = _agree(self._enc_key, _load_pub(peer.enc_public_key, peer.client_id), d.session_id, b"share-key")
            try:
                pt = AESGCM(key).decrypt(es.ciphertext[:12], es.ciphertext[12:],
                                         _share_ad(d.session_id, es.sender, self.client_id))
            except InvalidTag as exc:
                raise SecAggError(f"client {self.client_id!r}: share from {es.sender!r} fails authentication") from exc
            if len(pt) != 2 * SHARE_BYTES:
                raise SecAggError(f"share from {es.sender!r} has the wrong length")
            received[es.sender] = (pt[:SHARE_BYTES], pt[SHARE_BYTES:])
        missing = [h for h in holders if h != self.client_id and h not in received]
        if missing:
            raise SecAggError(f"client {self.client_id!r}: no share from {missing[0]!r}, who is listed as a holder")
        self._received = received
        self._holders = holders

        schema = _layout_schema(d.layout)
        if not math.isfinite(weight):
            raise SecAggError(f"weight must be finite, got {weight}")
        flat = np.empty(schema.size + 1, dtype=np.float64)
        for name in schema.names:
            if name not in update:
                raise SecAggError(f"client {self.client_id!r}: update lacks tensor {name!r}")
            arr = np.asarray(update[name])
            if arr.shape != schema.specs[name].shape:
                raise SecAggError(f"client {self.client_id!r}: tensor {name!r} has shape {arr.shape}, "
                                  f"expected {schema.specs[name].shape}")
            a, b = schema.offsets[name]
            flat[a:b] = arr.reshape(-1)
        if len(update) != len(schema.names):
            raise SecAggError(f"client {self.client_id!r}: update has tensors outside the layout")
        if not np.isfinite(flat[:-1]).all():
            raise SecAggError(f"client {self.client_id!r}: update has NaN or Inf")
        flat[:-1] *= weight
        flat[-1] = weight
        fp = d.config.fixed_point
        y = fp.encode(flat)
        y += prg_mask(self._self_seed, y.size, fp.bits, d.session_id, b"self-mask")
        me = d.participant(self.client_id)
        for h in holders:
            if h == self.client_id:
                continue
            peer = d.participant(h)
            seed = _pairwise_seed(self._mask_key, _load_pub(peer.mask_public_key, h), d.session_id)
            mask = prg_mask(seed, y.size, fp.bits, d.session_id, b"pairwise-mask")
            if me.index < peer.index:
                y += mask
            else:
                y -= mask
        self._masked_sent = True
        return MaskedInput(self.client_id, d.session_id, y)

    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Reveal b-shares of survivors and key-shares of dropped clients - once,
        never both for one client, and only if enough clients survived."""
        d = self._require_directory()
        if not self._masked_sent:
            raise SecAggError(f"client {self.client_id!r}: unmask before masked_input")
        if self._unmasked:
            raise SecAggError(f"client {self.client_id!r}: already answered an unmask request in this session")
        if request.session_id != d.session_id:
            raise SecAggError("unmask request is for another session")
        survivors, dropped = set(request.survivors), set(request.dropped)
        if survivors & dropped:
            raise SecAggError(f"unmask request lists {sorted(survivors & dropped)[0]!r} as both survived and dropped")
        if self.client_id not in survivors:
            raise SecAggError(f"client {self.client_id!r}: unmask request does not list me as a survivor")
        if survivors | dropped != set(self._holders):
            raise SecAggError("unmask request does not partition the clients that shared keys")
        if len(survivors) < d.config.threshold:
            raise SecAggError(f"only {len(survivors)} survivors, fewer than the threshold {d.config.threshold}")
        assert self._own_shares is not None
        shares = dict(self._received)
        shares[self.client_id] = self._own_shares
        self._unmasked = True
        return UnmaskResponse(
            self.client_id, d.session_id,
            seed_shares={u: shares[u][1] for u in request.survivors},
            key_shares={u: shares[u][0] for u in request.dropped},
        )

    def _require_directory(self) -> KeyDirectory:
        if self._directory is None:
            raise SecAggError(f"client {self.client_id!r}: share_keys() has not been called")
        return self._directory


def _share_ad(session_id: bytes, sender: str, recipient: str) -> bytes:
    return _PROTO + b"|" + session_id + b"|" + sender.encode() + b"\0" + recipient.encode()


# ---------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------


class SecAggServer:
    """The gateway's side of one session: routes messages, tracks dropouts, unmasks the sum.

    ``layout`` is the model's tensor layout (a weights dict or name -> shape);
    its order defines the flattening every client uses. Phases run in order;
    a message in the wrong phase, from an unknown client or for another
    session raises :class:`SecAggError`. Dropout is simply not sending: the
    ``*_`` methods that close a phase take whoever has answered by then.
    """

    PHASES = ("advertise", "share", "masked", "unmask", "done")

    def __init__(self, config: SecAggConfig, layout: Mapping[str, np.ndarray] | Mapping[str, tuple[int, ...]],
                 *, round_id: int = 0, session_id: bytes | None = None) -> None:
        self.config = config
        items = []
        for name, v in layout.items():
            shape = tuple(int(s) for s in (v.shape if isinstance(v, np.ndarray) else v))
            items.append((str(name), shape))
        self.layout: tuple[tuple[str, tuple[int, ...]], ...] = tuple(items)
        self._schema = _layout_schema(self.layout)
        self.round_id = int(round_id)
        self.session_id = session_id if session_id is not None else os.urandom(16) + self.round_id.to_bytes(8, "big")
        self.phase = "advertise"
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._directory: KeyDirectory | None = None
        self._shares: dict[str, ShareKeys] = {}
        self._holders: tuple[str, ...] = ()
        self._masked: dict[str, np.ndarray] = {}
        self._survivors: tuple[str, ...] = ()
        self._dropped: tuple[str, ...] = ()
        self._responses: dict[str, UnmaskResponse] = {}

    # round 0
    def receive_advertise(self, msg: AdvertiseKeys) -> None:
        self._phase("advertise")
        if not msg.client_id:
            raise SecAggError("advertise message without a client id")
        if msg.client_id in self._adverts:
            raise SecAggError(f"client {msg.client_id!r} advertised twice")
        _load_pub(msg.enc_public_key, msg.client_id)
        _load_pub(msg.mask_public_key, msg.client_id)
        if len(self._adverts) >= self.config.max_clients:
            raise SecAggError(f"more than max_clients={self.config.max_clients} clients advertised")
        self._adverts[msg.client_id] = msg

    def key_directory(self) -> KeyDirectory:
        """Close round 0: index the advertisers (sorted by id) and publish their keys."""
        self._phase("advertise")
        n = len(self._adverts)
        self._need(n, "advertised keys")
        if self.config.threshold <= n // 2:
            raise SecAggError(f"threshold {self.config.threshold} must exceed n/2 = {n / 2} for n={n} advertisers")
        parts = tuple(ParticipantKeys(cid, i + 1, a.enc_public_key, a.mask_public_key)
                      for i, (cid, a) in enumerate(sorted(self._adverts.items())))
        self._directory = KeyDirectory(self.session_id, self.round_id, self.config, parts, self.layout)
        self.phase = "share"
        return self._directory

    # round 1
    def receive_share_keys(self, msg: ShareKeys) -> None:
        self._phase("share")
        d = self._dir()
        self._session(msg.session_id)
        d.participant(msg.client_id)
        if msg.client_id in self._shares:
            raise SecAggError(f"client {msg.client_id!r} sent shares twice")
        others = {p.client_id for p in d.participants} - {msg.client_id}
        recips = [s.recipient for s in msg.shares]
        if any(s.sender != msg.client_id for s in msg.shares) or set(recips) != others or len(recips) != len(others):
            raise SecAggError(f"client {msg.client_id!r}: shares must go to every other participant exactly once")
        self._shares[msg.client_id] = msg

    def share_bundles(self) -> dict[str, ShareBundle]:
        """Close round 1: U2 = clients that sent shares; route each its shares from U2."""
        self._phase("share")
        holders = tuple(sorted(self._shares))
        self._need(len(holders), "shared keys")
        self._holders = holders
        bundles = {}
        for h in holders:
            mine = tuple(s for sender in holders if sender != h for s in self._shares[sender].shares if s.recipient == h)
            bundles[h] = ShareBundle(h, self.session_id, mine, holders)
        self.phase = "masked"
        return bundles

    # round 2
    def receive_masked_input(self, msg: MaskedInput) -> None:
        self._phase("masked")
        self._session(msg.session_id)
        if msg.client_id not in self._holders:
            raise SecAggError(f"masked input from {msg.client_id!r}, who did not share keys")
        if msg.client_id in self._masked:
            raise SecAggError(f"client {msg.client_id!r} sent masked input twice")
        fp = self.config.fixed_point
        y = np.asarray(msg.masked)
        if y.dtype != fp.udtype or y.shape != (self._schema.size + 1,):
            raise SecAggError(f"masked input from {msg.client_id!r} is {y.dtype}{y.shape}, "
                              f"expected {fp.udtype}({self._schema.size + 1},)")
        self._masked[msg.client_id] = y

    def unmask_request(self) -> UnmaskRequest:
        """Close round 2: U3 = clients whose masked input arrived; the rest of U2 dropped."""
        self._phase("masked")
        survivors = tuple(sorted(self._masked))
        if len(survivors) < self.config.threshold:
            raise SecAggError(
                f"only {len(survivors)} of {len(self._holders)} clients sent masked input; at least "
                f"{self.config.threshold} must survive to unmask (this configuration tolerates "
                f"{len(self._directory.participants) - self.config.threshold if self._directory else 0} dropouts)"
            )
        self._survivors = survivors
        self._dropped = tuple(h for h in self._holders if h not in self._masked)
        self.phase = "unmask"
        return UnmaskRequest(self.session_id, survivors, self._dropped)

    # round 3
    def receive_unmask(self, msg: UnmaskResponse) -> None:
        self._phase("unmask")
        self._session(msg.session_id)
        if msg.client_id not in self._survivors:
            raise SecAggError(f"unmask response from {msg.client_id!r}, who is not a survivor")
        if msg.client_id in self._responses:
            raise SecAggError(f"client {msg.client_id!r} answered unmask twice")
        if set(msg.seed_shares) != set(self._survivors) or set(msg.key_shares) != set(self._dropped):
            raise SecAggError(f"unmask response from {msg.client_id!r} does not cover survivors/dropped exactly")
        self._responses[msg.client_id] = msg

    def finish(self) -> SecAggResult:
        """Remove every mask and return the sum; needs >= threshold unmask responses."""
        self._phase("unmask")
        d = self._dir()
        t = self.config.threshold
        if len(self._responses) < t:
            raise SecAggError(
                f"only {len(self._responses)} unmask responses; {t} shares are needed to rebuild each secret "
                f"(too many clients dropped during unmasking)"
            )
        fp = self.config.fixed_point
        idx = {p.client_id: p.index for p in d.participants}
        total = np.zeros(self._schema.size + 1, dtype=fp.udtype)
        for y in self._masked.values():
            total += y
        for u in self._survivors:  # self masks
            shares = [Share.from_y_bytes(idx[r.client_id], r.seed_shares[u]) for r in self._responses.values()]
            seed = combine_shares(shares, t, _KEY_BYTES)
            total -= prg_mask(seed, total.size, fp.bits, self.session_id, b"self-mask")
        for u in self._dropped:  # pairwise masks the survivors added against a dropped client
            shares = [Share.from_y_bytes(idx[r.client_id], r.key_shares[u]) for r in self._responses.values()]
            sk_bytes = combine_shares(shares, t, _KEY_BYTES)
            sk = X25519PrivateKey.from_private_bytes(sk_bytes)
            if _pub_bytes(sk.public_key()) != d.participant(u).mask_public_key:
                raise SecAggError(f"rebuilt mask key of dropped client {u!r} does not match its public key")
            for v in self._survivors:
                seed = _pairwise_seed(sk, _load_pub(d.participant(v).mask_public_key, v), self.session_id)
                mask = prg_mask(seed, total.size, fp.bits, self.session_id, b"pairwise-mask")
                if idx[v] < idx[u]:  # v added +mask
                    total -= mask
                else:
                    total += mask
        values = fp.decode(total)
        self.phase = "done"
        sums = {n: values[a:b].reshape(self._schema.specs[n].shape).copy()
                for n, (a, b) in self._schema.offsets.items()}
        return SecAggResult(sums, float(values[-1]), self._survivors, self._dropped)

    # helpers
    @property
    def survivors(self) -> tuple[str, ...]:
        return self._survivors

    @property
    def dropped(self) -> tuple[str, ...]:
        return self._dropped

    def _dir(self) -> KeyDirectory:
        if self._directory is None:
            raise SecAggError("key directory not published yet")
        return self._directory

    def _need(self, n: int, what: str) -> None:
        if n < self.config.threshold:
            raise SecAggError(f"only {n} clients {what}; the threshold is {self.config.threshold}")

    def _phase(self, expected: str) -> None:
        if self.phase != expected:
            raise SecAggError(f"secure aggregation is in phase {self.phase!r}, not {expected!r}")

    def _session(self, session_id: bytes) -> None:
        if session_id != self.session_id:
            raise SecAggError("message belongs to another secure-aggregation session")
