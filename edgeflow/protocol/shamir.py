"""Shamir t-of-n secret sharing over the prime field GF(2^256 + 297).

Secure aggregation shares two 32-byte secrets per client (its mask key and
its self-mask seed) so that the server can finish a round when clients drop
out. Why this field: 2^256 + 297 is the smallest prime above 2^256, so any
32-byte secret is one field element (no chunking), a share is 33 bytes (the
narrowest that holds the field), and Python's big integers do the arithmetic
exactly. Secrecy does not depend on the field's size beyond holding the
secret: fewer than ``threshold`` shares are uniformly distributed whatever
the secret. (Before issue 34 the field was GF(2^521 - 1) with 66-byte shares:
every client sends each peer one share pair and answers the unmasking round
with one share per peer, so the shares were a third of a 20-device round's
overhead.)

Shamir's scheme gives no integrity: fewer than ``threshold`` shares, or a
corrupted share, silently reconstruct garbage. :func:`combine_shares`
therefore refuses fewer than ``threshold`` shares and, given more, checks
that the extra ones lie on the same polynomial.
"""

from __future__ import annotations

import secrets as _secrets
from collections.abc import Sequence
from dataclasses import dataclass

from edgeflow.errors import AggregationError, ConfigError

__all__ = ["PRIME", "SHARE_BYTES", "Share", "combine_shares", "split_secret"]

PRIME = (1 << 256) + 297
SHARE_BYTES = 33
MAX_SECRET_BYTES = 32


@dataclass(frozen=True)
class Share:
    """The point (x, f(x)) of the sharing polynomial f; x in 1..n, never 0."""

    x: int
    y: int

    def y_bytes(self) -> bytes:
        return self.y.to_bytes(SHARE_BYTES, "big")

    @classmethod
    def from_y_bytes(cls, x: int, data: bytes) -> Share:
        if len(data) != SHARE_BYTES:
            raise AggregationError(f"a Shamir share is {SHARE_BYTES} bytes, got {len(data)}")
        y = int.from_bytes(data, "big")
        if y >= PRIME:
            raise AggregationError("a Shamir share is not a field element (value >= p = 2^256 + 297)")
        return cls(x, y)


def split_secret(secret: bytes, threshold: int, num_shares: int, *, xs: Sequence[int] | None = None) -> list[Share]:
    """Split ``secret`` into ``num_shares`` shares, any ``threshold`` of which rebuild it.

    ``xs`` are the evaluation points (default 1..num_shares): secure
    aggregation uses the participants' indices so a share's x says whose it is.
    """
    if not isinstance(secret, (bytes, bytearray)) or len(secret) > MAX_SECRET_BYTES:
        raise ConfigError(f"a secret must be at most {MAX_SECRET_BYTES} bytes")
    if not 1 <= threshold <= num_shares:
        raise ConfigError(f"need 1 <= threshold <= num_shares, got threshold={threshold}, num_shares={num_shares}")
    points = list(xs) if xs is not None else list(range(1, num_shares + 1))
    if len(points) != num_shares or len(set(points)) != num_shares or any(not 0 < x < PRIME for x in points):
        raise ConfigError("share points must be num_shares distinct integers in 1..p-1")
    coeffs = [int.from_bytes(secret, "big")] + [_secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = []
    for x in points:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        shares.append(Share(x, y))
    return shares


def _lagrange_at(points: Sequence[Share], at: int) -> int:
    total = 0
    for i, si in enumerate(points):
        num, den = 1, 1
        for j, sj in enumerate(points):
            if i != j:
                num = num * (at - sj.x) % PRIME
                den = den * (si.x - sj.x) % PRIME
        total = (total + si.y * num * pow(den, -1, PRIME)) % PRIME
    return total


def combine_shares(shares: Sequence[Share], threshold: int, secret_len: int = 32, *, verify: bool = True) -> bytes:
    """Rebuild the ``secret_len``-byte secret from at least ``threshold`` shares.

    With ``verify`` up to two shares beyond the first ``threshold`` must
    agree with the polynomial those define; a mismatch (a corrupted or forged
    share) raises instead of returning a wrong secret. One honest extra share
    already exposes any corrupted share in the basis: a wrong basis defines
    another polynomial, which passes through the extra point only by chance
    (probability 1/p).
    """
    uniq: dict[int, Share] = {}
    for s in shares:
        if s.x in uniq and uniq[s.x].y != s.y:
            raise AggregationError(f"two different Shamir shares for point x={s.x}")
        uniq[s.x] = s
    pts = list(uniq.values())
    if len(pts) < threshold:
        raise AggregationError(f"{len(pts)} distinct shares cannot rebuild a secret shared {threshold}-of-n")
    base = pts[:threshold]
    value = _lagrange_at(base, 0)
    if verify:
        for extra in pts[threshold:threshold + 2]:
            if _lagrange_at(base, extra.x) != extra.y:
                raise AggregationError(f"Shamir share for x={extra.x} is inconsistent with the others (corrupted?)")
    if value >= 1 << (8 * secret_len):
        raise AggregationError("rebuilt value does not fit the secret length: wrong or corrupted shares")
    return value.to_bytes(secret_len, "big")
