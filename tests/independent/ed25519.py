"""Ed25519 (RFC 8032, section 5.1), pure Python, from the RFC's reference algorithm.

Written for the independent client: no third-party code, only ``hashlib``'s
SHA-512. Extended twisted Edwards coordinates (X, Y, Z, T) with x = X/Z,
y = Y/Z, x*y = T/Z; constant time is NOT a goal (a test client, not a
device). Verification is the RFC's cofactorless check [S]B = R + [k]A,
which is also what OpenSSL (edgeflow's ``cryptography``) does.
"""

from __future__ import annotations

import hashlib

P = 2**255 - 19
L = 2**252 + 27742317777372353535851937790883648493  # the group order (RFC 8032 "L")
D = -121665 * pow(121666, P - 2, P) % P
SQRT_M1 = pow(2, (P - 1) // 4, P)

Point = tuple[int, int, int, int]


def _sha512_int(data: bytes) -> int:
    return int.from_bytes(hashlib.sha512(data).digest(), "little")


def _add(a: Point, b: Point) -> Point:
    x1, y1, z1, t1 = a
    x2, y2, z2, t2 = b
    A = (y1 - x1) * (y2 - x2) % P
    B = (y1 + x1) * (y2 + x2) % P
    C = 2 * t1 * t2 * D % P
    Dd = 2 * z1 * z2 % P
    E, F, G, H = B - A, Dd - C, Dd + C, B + A
    return (E * F % P, G * H % P, F * G % P, E * H % P)


def _double(a: Point) -> Point:
    x1, y1, z1, _ = a
    A = x1 * x1 % P
    B = y1 * y1 % P
    C = 2 * z1 * z1 % P
    H = A + B
    E = H - (x1 + y1) * (x1 + y1)
    G = A - B
    F = C + G
    return (E * F % P, G * H % P, F * G % P, E * H % P)


def _mul(s: int, a: Point) -> Point:
    q: Point = (0, 1, 1, 0)  # the neutral element
    for bit in bin(s)[2:]:
        q = _double(q)
        if bit == "1":
            q = _add(q, a)
    return q


def _equal(a: Point, b: Point) -> bool:
    return (a[0] * b[2] - b[0] * a[2]) % P == 0 and (a[1] * b[2] - b[1] * a[2]) % P == 0


def _recover_x(y: int, sign: int) -> int | None:
    if y >= P:
        return None
    x2 = (y * y - 1) * pow(D * y * y + 1, P - 2, P) % P
    if x2 == 0:
        return None if sign else 0
    x = pow(x2, (P + 3) // 8, P)
    if (x * x - x2) % P:
        x = x * SQRT_M1 % P
    if (x * x - x2) % P:
        return None
    if (x & 1) != sign:
        x = P - x
    return x


_GY = 4 * pow(5, P - 2, P) % P
_GX = _recover_x(_GY, 0)
assert _GX is not None
B: Point = (_GX, _GY, 1, _GX * _GY % P)


def _compress(a: Point) -> bytes:
    zinv = pow(a[2], P - 2, P)
    x, y = a[0] * zinv % P, a[1] * zinv % P
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def _decompress(data: bytes) -> Point | None:
    if len(data) != 32:
        return None
    y = int.from_bytes(data, "little")
    sign = y >> 255
    y &= (1 << 255) - 1
    x = _recover_x(y, sign)
    if x is None:
        return None
    return (x, y, 1, x * y % P)


def _expand(secret: bytes) -> tuple[int, bytes]:
    if len(secret) != 32:
        raise ValueError("an Ed25519 secret key is 32 bytes")
    h = hashlib.sha512(secret).digest()
    a = int.from_bytes(h[:32], "little")
    a &= (1 << 254) - 8
    a |= 1 << 254
    return a, h[32:]


def public_key(secret: bytes) -> bytes:
    a, _ = _expand(secret)
    return _compress(_mul(a, B))


def sign(secret: bytes, message: bytes) -> bytes:
    a, prefix = _expand(secret)
    pub = _compress(_mul(a, B))
    r = _sha512_int(prefix + message) % L
    rs = _compress(_mul(r, B))
    k = _sha512_int(rs + pub + message) % L
    s = (r + k * a) % L
    return rs + s.to_bytes(32, "little")


def verify(public: bytes, message: bytes, signature: bytes) -> bool:
    if len(public) != 32 or len(signature) != 64:
        return False
    a = _decompress(public)
    r = _decompress(signature[:32])
    if a is None or r is None:
        return False
    s = int.from_bytes(signature[32:], "little")
    if s >= L:
        return False
    k = _sha512_int(signature[:32] + public + message) % L
    return _equal(_mul(s, B), _add(r, _mul(k, a)))
