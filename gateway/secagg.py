"""The gateway's side of secure aggregation: :class:`SecAggServer` routes one session's
messages, tracks dropouts and unmasks the sum (the protocol, its messages and threat
model: :mod:`edgeflow.protocol.secagg`; a device's side:
:class:`edgeflow.federated.secagg_client.SecAggClient`)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from edgeflow.protocol.secagg import (
    KEY_BYTES,
    AdvertiseKeys,
    FinalHolders,
    KeyDirectory,
    Layout,
    MaskedInput,
    ParticipantKeys,
    SecAggConfig,
    SecAggError,
    ShareBundle,
    ShareCheck,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
    agree,
    load_pub,
    pairwise_seed,
    prg_mask,
    pub_bytes,
    share_ad,
    weight_fraction,
)
from edgeflow.protocol.shamir import SHARE_BYTES, Share, combine_shares

__all__ = ["SecAggResult", "SecAggServer"]


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
        self._schema = Layout.of(self.layout)
        self.round_id = int(round_id)
        self.session_id = session_id if session_id is not None else os.urandom(16) + self.round_id.to_bytes(8, "big")
        self.phase = "advertise"
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._directory: KeyDirectory | None = None
        self._shares: dict[str, ShareKeys] = {}
        self._holders: tuple[str, ...] = ()
        self._masked: dict[str, np.ndarray] = {}
        self._weights: dict[str, float] = {}
        self._checks: dict[str, ShareCheck] = {}
        self._guilty: dict[str, str] = {}
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
        load_pub(msg.enc_public_key, msg.client_id)
        load_pub(msg.mask_public_key, msg.client_id)
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

    # round 1b (optional): complaints about shares, checked; the guilty are left out
    def receive_share_check(self, msg: ShareCheck) -> None:
        """A holder's check of the shares it got. Each accusation is verified with the evidence: the
        accuser's revealed session encryption key must be the one it advertised, and the accused sender's
        ciphertext to it (as the server received it, signed by the sender) must fail to decrypt under the
        recomputed pairwise key. A verified accusation marks the sender guilty; a false one, the accuser."""
        self._phase("masked")
        self._session(msg.session_id)
        d = self._dir()
        if msg.client_id not in self._holders:
            raise SecAggError(f"share check from {msg.client_id!r}, who did not share keys")
        if msg.client_id in self._checks:
            raise SecAggError(f"client {msg.client_id!r} sent its share check twice")
        if self._masked:
            raise SecAggError("share checks come before any masked input")
        self._checks[msg.client_id] = msg
        if not msg.accused:
            return
        me = d.participant(msg.client_id)
        try:
            sk = X25519PrivateKey.from_private_bytes(bytes(msg.enc_private_key))
        except ValueError:
            sk = None
        if sk is None or pub_bytes(sk.public_key()) != me.enc_public_key:
            self._guilty[msg.client_id] = "its evidence is not the encryption key it advertised"
            return
        for sender in msg.accused:
            if sender not in self._holders or sender == msg.client_id:
                self._guilty[msg.client_id] = f"it accused {sender!r}, who sent it no share"
                return
            ct = next((es.ciphertext for es in self._shares[sender].shares if es.recipient == msg.client_id), None)
            peer = d.participant(sender)
            key = agree(sk, load_pub(peer.enc_public_key, sender), self.session_id, b"share-key")
            ok = False
            if ct is not None and len(ct) > 12:
                try:
                    pt = AESGCM(key).decrypt(ct[:12], ct[12:], share_ad(self.session_id, sender, msg.client_id))
                    ok = len(pt) == 2 * SHARE_BYTES
                except InvalidTag:
                    ok = False
            if ok:
                self._guilty[msg.client_id] = f"it accused {sender!r}, whose share to it is sound"
                return
            self._guilty.setdefault(sender, f"its share to {msg.client_id!r} fails authentication")

    def final_holders(self) -> FinalHolders:
        """Close round 1b: the holders less the guilty and less those that sent no check; every remaining
        client masks against exactly these. Call before any masked input."""
        self._phase("masked")
        if self._masked:
            raise SecAggError("final_holders() must come before the masked inputs")
        excluded = tuple(sorted(set(self._holders) - (set(self._checks) - set(self._guilty))))
        holders = tuple(h for h in self._holders if h not in excluded)
        self._need(len(holders), "remain after the share checks")
        self._holders = holders
        return FinalHolders(self.session_id, holders, excluded)

    @property
    def guilty(self) -> dict[str, str]:
        """Clients a checked complaint found guilty, and why (for the gateway's log and counters)."""
        return dict(self._guilty)

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
        cap = self.config.weight_cap
        if cap is not None:
            w = msg.weight
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or not 0 <= w <= cap:
                raise SecAggError(f"masked input from {msg.client_id!r} declares weight {w!r}; it must be a number "
                                  f"in [0, {cap:g}] (the session's weight cap): the client is left out of the round")
            self._weights[msg.client_id] = float(w)
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
            seed = combine_shares(shares, t, KEY_BYTES)
            total -= prg_mask(seed, total.size, fp.bits, self.session_id, b"self-mask")
        for u in self._dropped:  # pairwise masks the survivors added against a dropped client
            shares = [Share.from_y_bytes(idx[r.client_id], r.key_shares[u]) for r in self._responses.values()]
            sk_bytes = combine_shares(shares, t, KEY_BYTES)
            sk = X25519PrivateKey.from_private_bytes(sk_bytes)
            if pub_bytes(sk.public_key()) != d.participant(u).mask_public_key:
                raise SecAggError(f"rebuilt mask key of dropped client {u!r} does not match its public key")
            for v in self._survivors:
                seed = pairwise_seed(sk, load_pub(d.participant(v).mask_public_key, v), self.session_id)
                mask = prg_mask(seed, total.size, fp.bits, self.session_id, b"pairwise-mask")
                if idx[v] < idx[u]:  # v added +mask
                    total -= mask
                else:
                    total += mask
        values = fp.decode(total)
        self.phase = "done"
        total_weight, scale = self._check_sum(total, values)
        sums = {n: values[a:b].reshape(self._schema.shapes[n]) * scale
                for n, (a, b) in self._schema.offsets.items()}
        return SecAggResult(sums, total_weight, self._survivors, self._dropped)

    def _check_sum(self, ring_total: np.ndarray, values: np.ndarray) -> tuple[float, float]:
        """What the unmasked sum may be, checked before anyone uses it: with a weight cap, its weight
        coordinate must equal, exactly in the ring, the survivors' declared weights as the honest encoder
        writes them (a client that masked another weight than it declared, e.g. a negative one, fails the
        round here); with a norm bound, the weighted sum cannot be longer than the bound times the weight
        total (plus the fixed point's rounding). Returns (the weight total, the factor the sums take)."""
        cfg = self.config
        if cfg.weight_cap is None:
            return float(values[-1]), 1.0
        fp = cfg.fixed_point
        expected = fp.encode(np.array([weight_fraction(cfg, self._weights[u]) for u in self._survivors]))
        want = expected.sum(dtype=fp.udtype)
        if ring_total[-1] != want:
            raise SecAggError(
                f"round {self.round_id}: the unmasked weight total {fp.decode(ring_total[-1:])[0] * cfg.weight_cap:g} "
                f"differs from the {len(self._survivors)} survivors' declared weights "
                f"({sum(self._weights[u] for u in self._survivors):g}): a client masked another weight than it "
                "declared; the sum is refused and no model is published")
        fractions = fp.decode(want.reshape(1))[0]
        if cfg.norm_bound is not None:
            norm = float(np.linalg.norm(values[:-1]))
            slack = len(self._survivors) * math.sqrt(values.size) * 2.0 ** -fp.frac
            limit = cfg.norm_bound * fractions * (1 + 1e-9) + slack
            if norm > limit:
                raise SecAggError(
                    f"round {self.round_id}: the unmasked sum has norm {norm:.6g}, above the {limit:.6g} that "
                    f"{len(self._survivors)} clients clipped to the session's norm bound {cfg.norm_bound:g} can "
                    "reach: a client sent a larger update than it may; the sum is refused and no model is published")
        return float(sum(self._weights[u] for u in self._survivors)), float(cfg.weight_cap)

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
