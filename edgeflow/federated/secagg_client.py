"""One device's side of a secure-aggregation session (Bonawitz et al.; the protocol and its
threat model: :mod:`edgeflow.protocol.secagg`). The gateway's side is
:class:`edgeflow.gateway.secagg.SecAggServer`; :class:`edgeflow.federated.Client` carries
the messages over MQTT."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import ConfigError
from ..protocol.secagg import (
    KEY_BYTES,
    AdvertiseKeys,
    EncryptedShare,
    FinalHolders,
    KeyDirectory,
    Layout,
    MaskedInput,
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
    priv_bytes,
    pub_bytes,
    share_ad,
    weight_fraction,
)
from ..protocol.shamir import SHARE_BYTES, split_secret

__all__ = ["SecAggClient"]

Weights = Mapping[str, np.ndarray]


class SecAggClient:
    """One client's side of one session. Create a new one every round: keys and
    the self-mask seed must never be reused across sessions."""

    def __init__(self, client_id: str) -> None:
        if not client_id:
            raise ConfigError("a secure-aggregation client needs a non-empty client_id")
        self.client_id = client_id
        self._enc_key = X25519PrivateKey.generate()
        self._mask_key = X25519PrivateKey.generate()
        self._self_seed = os.urandom(KEY_BYTES)
        self._directory: KeyDirectory | None = None
        self._holders: tuple[str, ...] = ()
        self._received: dict[str, tuple[bytes, bytes]] = {}  # sender -> (key share, seed share)
        self._own_shares: tuple[bytes, bytes] | None = None
        self._masked_sent = False
        self._unmasked = False
        self._checked: tuple[tuple[str, ...], dict[str, tuple[bytes, bytes]], tuple[str, ...]] | None = None

    def advertise(self) -> AdvertiseKeys:
        return AdvertiseKeys(self.client_id, pub_bytes(self._enc_key.public_key()),
                             pub_bytes(self._mask_key.public_key()))

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
        if me.mask_public_key != pub_bytes(self._mask_key.public_key()) or \
                me.enc_public_key != pub_bytes(self._enc_key.public_key()):
            raise SecAggError(f"client {self.client_id!r}: the directory lists keys that are not mine")
        ids = [p.client_id for p in directory.participants]
        idx = [p.index for p in directory.participants]
        if len(set(ids)) != n or len(set(idx)) != n or min(idx) < 1:
            raise SecAggError("key directory has duplicate client ids or indices")
        if len({p.mask_public_key for p in directory.participants}) != n:
            raise SecAggError("key directory repeats a public key")
        xs = [p.index for p in directory.participants]
        key_shares = split_secret(priv_bytes(self._mask_key), cfg.threshold, n, xs=xs)
        seed_shares = split_secret(self._self_seed, cfg.threshold, n, xs=xs)
        out = []
        for p, ks, ss in zip(directory.participants, key_shares, seed_shares):
            if p.client_id == self.client_id:
                self._own_shares = (ks.y_bytes(), ss.y_bytes())
                continue
            key = agree(self._enc_key, load_pub(p.enc_public_key, p.client_id), directory.session_id, b"share-key")
            nonce = os.urandom(12)
            ad = share_ad(directory.session_id, self.client_id, p.client_id)
            ct = AESGCM(key).encrypt(nonce, ks.y_bytes() + ss.y_bytes(), ad)
            out.append(EncryptedShare(self.client_id, p.client_id, nonce + ct))
        self._directory = directory
        return ShareKeys(self.client_id, directory.session_id, tuple(out))

    def _open_bundle(self, bundle: ShareBundle) -> tuple[tuple[str, ...], dict[str, tuple[bytes, bytes]], list[str]]:
        """Check a bundle's frame and decrypt every share in it: (holders, good shares by sender, senders whose
        share failed authentication or had the wrong length)."""
        d = self._require_directory()
        if bundle.recipient != self.client_id or bundle.session_id != d.session_id:
            raise SecAggError(f"client {self.client_id!r}: share bundle is for {bundle.recipient!r} / another session")
        holders = tuple(bundle.share_holders)
        known = {p.client_id for p in d.participants}
        if self.client_id not in holders or not set(holders) <= known or len(set(holders)) != len(holders):
            raise SecAggError(f"client {self.client_id!r}: share holder list is inconsistent with the directory")
        if len(holders) < d.config.threshold:
            raise SecAggError(f"only {len(holders)} clients shared keys; at least {d.config.threshold} are needed")
        received: dict[str, tuple[bytes, bytes]] = {}
        bad: list[str] = []
        for es in bundle.shares:
            if es.recipient != self.client_id or es.sender not in holders or es.sender in received \
                    or es.sender in bad:
                raise SecAggError(f"client {self.client_id!r}: unexpected share from {es.sender!r}")
            peer = d.participant(es.sender)
            key = agree(self._enc_key, load_pub(peer.enc_public_key, peer.client_id), d.session_id, b"share-key")
            try:
                pt = AESGCM(key).decrypt(es.ciphertext[:12], es.ciphertext[12:],
                                         share_ad(d.session_id, es.sender, self.client_id))
            except InvalidTag:
                bad.append(es.sender)
                continue
            if len(pt) != 2 * SHARE_BYTES:
                bad.append(es.sender)
                continue
            received[es.sender] = (pt[:SHARE_BYTES], pt[SHARE_BYTES:])
        missing = [h for h in holders if h != self.client_id and h not in received and h not in bad]
        if missing:
            raise SecAggError(f"client {self.client_id!r}: no share from {missing[0]!r}, who is listed as a holder")
        return holders, received, bad

    def check_bundle(self, bundle: ShareBundle) -> ShareCheck:
        """Round 1b: check every share addressed to this client and name the senders whose share fails
        authentication. To accuse, the client reveals its session-only encryption key, so the server can
        verify the accusation (and finds the accuser guilty instead if the share was sound). What that
        reveals: one share of each peer's two secrets, below the threshold t > n/2 (and this key is never
        used again: a new client per session)."""
        d = self._require_directory()
        if self._checked is not None or self._masked_sent:
            raise SecAggError(f"client {self.client_id!r}: shares already checked in this session")
        holders, received, bad = self._open_bundle(bundle)
        self._checked = (holders, received, tuple(bad))
        return ShareCheck(self.client_id, d.session_id, tuple(bad), priv_bytes(self._enc_key) if bad else b"")

    def masked_input(self, bundle: ShareBundle | FinalHolders, update: Weights, weight: float = 1.0) -> MaskedInput:
        """Mask the weighted update and its weight against the session's holders.

        ``bundle``: the server's :class:`FinalHolders` after :meth:`check_bundle` (a client whose shares
        failed is then left out by the server, and the others go on), or the :class:`ShareBundle` itself
        (no check round: any bad share is an error here, as before).
        ``update`` is a delta with the directory's layout (float arrays). Use
        weight = num_samples for FedAvg, 1.0 for an unweighted sum; it must be finite and >= 0.
        With the session's ``weight_cap`` the weight is capped at it, the client masks
        ``(w / cap) * x`` and ``w / cap`` and declares ``w`` (the server checks the total); with
        ``norm_bound`` the delta is first clipped to that norm. A weighted value beyond the
        fixed-point range is refused (SecAggError), never clipped silently.
        """
        d = self._require_directory()
        if self._masked_sent:
            raise SecAggError(f"client {self.client_id!r}: masked input already sent in this session")
        self._holders, self._received = self._mask_against(bundle)
        cfg = d.config
        if not math.isfinite(weight) or weight < 0:
            raise SecAggError(f"client {self.client_id!r}: weight must be a finite number >= 0, got {weight}")
        if cfg.weight_cap is not None and weight > cfg.weight_cap:
            weight = float(cfg.weight_cap)  # the session's cap on a client's weight (the gateway's sample cap)
        y = self._masked(self._weighted(update, weight))
        self._masked_sent = True
        return MaskedInput(self.client_id, d.session_id, y, weight=weight if cfg.weight_cap is not None else None)

    def _mask_against(self, bundle: ShareBundle | FinalHolders) -> tuple[tuple[str, ...], dict[str, tuple[bytes, bytes]]]:
        """The holders to mask against and their shares received: the server's final list, checked
        against what :meth:`check_bundle` found, or the bundle itself (every share must authenticate)."""
        d = self._require_directory()
        if not isinstance(bundle, FinalHolders):
            holders, received, bad = self._open_bundle(bundle)
            if bad:
                raise SecAggError(f"client {self.client_id!r}: share from {bad[0]!r} fails authentication")
            return holders, received
        if self._checked is None:
            raise SecAggError(f"client {self.client_id!r}: final holders before check_bundle()")
        checked, received, bad = self._checked
        holders = tuple(bundle.holders)
        if bundle.session_id != d.session_id or self.client_id not in holders \
                or not set(holders) <= set(checked) or len(set(holders)) != len(holders):
            raise SecAggError(f"client {self.client_id!r}: final holders are inconsistent with the shares")
        kept_bad = sorted(set(bad) & set(holders))
        if kept_bad:
            raise SecAggError(f"client {self.client_id!r}: the server keeps {kept_bad[0]!r}, whose share to "
                              "this client failed authentication; refusing to mask")
        if len(holders) < d.config.threshold:
            raise SecAggError(f"only {len(holders)} holders remain; at least {d.config.threshold} are needed")
        return holders, {k: v for k, v in received.items() if k in holders}

    def _weighted(self, update: Weights, weight: float) -> np.ndarray:
        """The update in the directory's layout, clipped to the session's norm bound, times its weight
        (or its fraction of the cap), with that factor as the last value; refused beyond the fixed point."""
        d = self._require_directory()
        schema = Layout.of(d.layout)
        cfg = d.config
        flat = np.empty(schema.size + 1, dtype=np.float64)
        for name in schema.names:
            if name not in update:
                raise SecAggError(f"client {self.client_id!r}: update lacks tensor {name!r}")
            arr = np.asarray(update[name])
            if arr.shape != schema.shapes[name]:
                raise SecAggError(f"client {self.client_id!r}: tensor {name!r} has shape {arr.shape}, "
                                  f"expected {schema.shapes[name]}")
            a, b = schema.offsets[name]
            flat[a:b] = arr.reshape(-1)
        if len(update) != len(schema.names):
            raise SecAggError(f"client {self.client_id!r}: update has tensors outside the layout")
        if not np.isfinite(flat[:-1]).all():
            raise SecAggError(f"client {self.client_id!r}: update has NaN or Inf")
        if cfg.norm_bound is not None:  # the session's norm bound: the server checks the sum against it
            norm = float(np.linalg.norm(flat[:-1]))
            if norm > cfg.norm_bound:
                flat[:-1] *= cfg.norm_bound / norm
        scale = weight_fraction(cfg, weight) if cfg.weight_cap is not None else weight
        flat[:-1] *= scale
        flat[-1] = scale
        over = float(np.max(np.abs(flat))) if flat.size else 0.0
        if over > cfg.clip:  # the fixed point would clip it: refuse rather than send another update
            raise SecAggError(f"client {self.client_id!r}: weighted update reaches {over:g}, beyond the session's "
                              f"fixed-point range +-{cfg.clip:g}; the gateway must set secagg weight_cap (or a larger "
                              "clip)")
        return flat

    def _masked(self, flat: np.ndarray) -> np.ndarray:
        """The fixed-point vector plus the self mask and, per other holder, the pairwise mask
        (added towards a higher index, subtracted towards a lower one)."""
        d = self._require_directory()
        fp = d.config.fixed_point
        y = fp.encode(flat)
        y += prg_mask(self._self_seed, y.size, fp.bits, d.session_id, b"self-mask")
        me = d.participant(self.client_id)
        for h in self._holders:
            if h == self.client_id:
                continue
            peer = d.participant(h)
            seed = pairwise_seed(self._mask_key, load_pub(peer.mask_public_key, h), d.session_id)
            mask = prg_mask(seed, y.size, fp.bits, d.session_id, b"pairwise-mask")
            if me.index < peer.index:
                y += mask
            else:
                y -= mask
        return y

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
