"""Secure aggregation by pairwise masking (Bonawitz et al., CCS 2017), message level: the protocol both ends share.

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
    round 1b client -> server  ShareCheck          the shares it could not authenticate (and, to
                                                   accuse, its session encryption key as evidence)
             server -> all     FinalHolders        the holders less the guilty: whom to mask against
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
2^-(f+1) per client (deterministic rounding). This class's default: k = 64,
f = 32 (resolution 2.3e-10), clip = 1024; :meth:`SecAggConfig.compact` (the
gateway's default since issue 34): k = 32 and the most f the session's
client count and clip leave, half the bytes on the wire. The weight w itself is appended as one
more masked coordinate, so the server also learns ``sum_u w_u`` and can divide.

**Threat model and limits.** Honest-but-curious server and clients, plus
the one active attack the unmasking step invites: with ``threshold`` > n/2
and every client answering at most one UnmaskRequest per session, and never
with both kinds of share for the same peer, the server cannot obtain both
b_u and u's mask key, so it cannot unmask a single client by lying about who
dropped. Not covered: a server that invents clients (AdvertiseKeys must be
authenticated, e.g. signed with the devices' Ed25519 keys from
:mod:`edgeflow.signing` - the orchestrator's job), Bonawitz's consistency
check round, malicious clients sending garbage within the session's bounds
(secure aggregation hides inputs; what is checked: a declared weight within the
``weight_cap``, the unmasked weight total equal to the declared ones, the sum
within ``norm_bound`` times the weight total, and each key share's
authenticity, with the sender of a bad one identified by the ``ShareCheck``
round -- robust aggregation and per-update range checks are impossible on
masked data without zero-knowledge proofs), and
collusion of the server with >= threshold clients. A masked vector is
uniform in the ring, so it does not compress: 8 bytes/parameter (k = 64) or
4 (k = 32) on the wire.
"""


from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edgeflow.errors import AggregationError, ConfigError

__all__ = [
    "AdvertiseKeys",
    "EncryptedShare",
    "FinalHolders",
    "FixedPoint",
    "KeyDirectory",
    "Layout",
    "MaskedInput",
    "ParticipantKeys",
    "SecAggConfig",
    "SecAggError",
    "ShareBundle",
    "ShareCheck",
    "ShareKeys",
    "UnmaskRequest",
    "UnmaskResponse",
    "prg_mask",
    "weight_fraction",
]

PROTO = b"edgeflow-secagg/v1"
KEY_BYTES = 32
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
    weight_cap: float | None = None
    """Each client's weight is at most this (the gateway's cap on claimed samples). With it, a client masks
    ``(w / weight_cap) * x`` and ``w / weight_cap`` (so any honest weight up to the cap fits the fixed point
    exactly) and declares ``w`` in the clear; the server checks the unmasked weight total against the
    declared ones. None: the legacy encoding (``w * x`` and ``w``, refused where they would be clipped)."""
    norm_bound: float | None = None
    """Honest clients clip their delta to this L2 norm; the server refuses an unmasked sum longer than
    ``norm_bound`` times the survivors' (normalized) weight total. None: no such check."""

    def __post_init__(self) -> None:
        if self.ring_bits not in (32, 64):
            raise ConfigError(f"ring_bits must be 32 or 64, got {self.ring_bits}")
        if not isinstance(self.threshold, int) or self.threshold < 2:
            raise ConfigError(f"threshold must be an int >= 2, got {self.threshold!r}")
        if not 0 <= self.frac_bits < self.ring_bits - 1:
            raise ConfigError(f"frac_bits must be in [0, {self.ring_bits - 1}), got {self.frac_bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"clip must be > 0, got {self.clip}")
        for name in ("weight_cap", "norm_bound"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ConfigError(f"{name} must be a number > 0 or None, got {v!r}")
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

    @classmethod
    def compact(cls, num_clients: int, max_dropout_fraction: float = 0.3, *, clip: float = 16.0,
                **kwargs) -> SecAggConfig:
        """:meth:`for_clients` in the narrowest ring that holds the sum: 32 bits, and the most fractional
        bits ``f`` with ``num_clients * clip * 2^f < 2^31`` (value bits + log2(n) + sign). A masked vector
        then costs 4 bytes per parameter, half of the 64-bit default. ``clip`` bounds each weighted value:
        with a ``weight_cap`` a client masks ``(w / cap) * x`` with ``w / cap <= 1``, so ``clip`` must hold
        the largest coordinate of an honest delta (with ``norm_bound``, ``max(1, norm_bound)`` does);
        a client whose value exceeds it refuses to send (SecAggError), it is never clipped."""
        if not (isinstance(clip, (int, float)) and not isinstance(clip, bool) and math.isfinite(clip) and clip > 0):
            raise ConfigError(f"clip must be a number > 0, got {clip!r}")
        n = max(int(num_clients), 2)
        frac = min(math.ceil(31 - math.log2(n * float(clip))) - 1, 30)
        if frac < 0:
            raise ConfigError(f"{n} clients with values up to +-{clip:g} do not fit a 32-bit ring; "
                              "use ring_bits=64 (for_clients) or a smaller clip")
        return cls.for_clients(num_clients, max_dropout_fraction, ring_bits=32, frac_bits=frac, clip=float(clip),
                               **kwargs)

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
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=session_id, info=PROTO + b"|" + label).derive(seed)
    itemsize = bits // 8
    enc = Cipher(algorithms.AES(key), modes.CTR(b"\0" * 16)).encryptor()
    raw = enc.update(bytes(length * itemsize)) + enc.finalize()
    return np.frombuffer(raw, dtype=np.dtype(f"<u{itemsize}")).astype(np.dtype(f"u{itemsize}"), copy=False)


def pub_bytes(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def priv_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def load_pub(data: bytes, who: str) -> X25519PublicKey:
    try:
        return X25519PublicKey.from_public_bytes(bytes(data))
    except ValueError as exc:
        raise SecAggError(f"{who}: not a 32-byte X25519 public key") from exc


def agree(private: X25519PrivateKey, public: X25519PublicKey, session_id: bytes, label: bytes) -> bytes:
    try:
        shared = private.exchange(public)
    except ValueError as exc:  # low-order point
        raise SecAggError("X25519 agreement failed: peer key is a low-order point") from exc
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=session_id, info=PROTO + b"|" + label).derive(shared)


def pairwise_seed(private: X25519PrivateKey, public: X25519PublicKey, session_id: bytes) -> bytes:
    return agree(private, public, session_id, b"pairwise-seed")


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
class ShareCheck:
    """Round 1b, client -> server: the client checked every share addressed to it. ``accused``: the senders
    whose share failed authentication (or had the wrong length); when it accuses anyone it reveals its
    session-only encryption private key ``enc_private_key`` as evidence: the server recomputes each
    pairwise AES key and tries the accused sender's ciphertext, which it saw signed by that sender."""

    client_id: str
    session_id: bytes
    accused: tuple[str, ...] = ()
    enc_private_key: bytes = b""


@dataclass(frozen=True)
class FinalHolders:
    """Round 1b, server -> all: the clients every remaining client masks against (the share holders less
    those a checked complaint found guilty, and less those that sent no check), and who was left out."""

    session_id: bytes
    holders: tuple[str, ...]
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True)
class MaskedInput:
    """Round 2, client -> server: the masked, fixed-point update (uniform in the ring), and, when the
    session has a ``weight_cap``, the client's weight declared in the clear (at most the cap)."""

    client_id: str
    session_id: bytes
    masked: np.ndarray
    weight: float | None = None


def weight_fraction(config: SecAggConfig, weight: float) -> float:
    """The value a client masks as its weight coordinate: ``weight / weight_cap`` (in [0, 1])."""
    assert config.weight_cap is not None
    return float(weight) / float(config.weight_cap)


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


def share_ad(session_id: bytes, sender: str, recipient: str) -> bytes:
    return PROTO + b"|" + session_id + b"|" + sender.encode() + b"\0" + recipient.encode()


@dataclass(frozen=True)
class Layout:
    """The flattening of a model's tensors that every participant uses: ``names`` in
    order, each one's ``shapes[name]`` and ``offsets[name]`` = (start, end) in the flat vector."""

    names: tuple[str, ...]
    shapes: Mapping[str, tuple[int, ...]]
    offsets: Mapping[str, tuple[int, int]]
    size: int

    @classmethod
    def of(cls, layout: Sequence[tuple[str, tuple[int, ...]]]) -> Layout:
        names, shapes, offsets, pos = [], {}, {}, 0
        for name, shape in layout:
            shape = tuple(int(s) for s in shape)
            if name in shapes:
                raise SecAggError(f"layout names tensor {name!r} twice")
            n = math.prod(shape)
            names.append(name)
            shapes[name] = shape
            offsets[name] = (pos, pos + n)
            pos += n
        return cls(tuple(names), shapes, offsets, pos)
