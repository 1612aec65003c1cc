"""What the gateway sends devices of each new global model: the full weights, and with
``[rounds] downlink = "delta-<codec>"`` first a signed delta from the previous version
(:mod:`edgeflow.codecs.model_delta`, docs/wire-format.md "Model delta").

The round manager calls two functions: :meth:`ModelDownlink.prepare` when it stages a new version
(the weights it returns are the ones to adopt: ``base + decode(delta)``, so the gateway holds the bits
devices reconstruct) and :meth:`ModelDownlink.publish` when it publishes a version (the delta, if one
was prepared for exactly these weights, then the full model, retained as before: late joiners,
restarted devices and devices that missed a version take it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from edgeflow.codecs import ErrorFeedback
from edgeflow.errors import CodecError
from edgeflow.codecs.model_delta import delta_codec, encode_model_delta, weights_digest
from edgeflow.transport.topics import gateway_topic

log = logging.getLogger("edgeflow.gateway.downlink")

__all__ = ["ModelDownlink"]


@dataclass
class _Pending:
    version: int
    epoch: int
    weights: Mapping[str, np.ndarray]
    payload: bytes
    digest: str


class ModelDownlink:
    """The downlink of one round manager: ``mode`` is ``"full"`` or ``"delta-<codec>"``."""

    def __init__(self, mode: str = "full") -> None:
        self.mode = mode
        self.codec = delta_codec(mode)
        self.feedback = ErrorFeedback()
        self._published: tuple[int, int, Mapping[str, np.ndarray], str] | None = None
        """(version, epoch, weights, digest) of the model published last: the base of the next delta."""
        self._pending: _Pending | None = None
        self.deltas_published = 0
        self.delta_bytes = 0

    def prepare(self, rm: Any, new: Mapping[str, np.ndarray], version: int) -> dict[str, np.ndarray]:
        """The weights to adopt as ``version``: ``new`` itself, or (delta downlink, the previous version published
        by this process and the same tensors) what a device holding the previous version reconstructs from the
        delta, which is then held for :meth:`publish`."""
        self._pending = None
        base = self._published
        if self.codec is None or base is None or base[1] != rm.epoch or base[0] >= version:
            return dict(new)
        try:
            payload, result, digest = encode_model_delta(
                base[2], new, codec=self.codec, base_version=base[0], version=version, epoch=rm.epoch,
                signer=rm.signer, seed=(rm.config.seed * 1_000_003 + version) % 2**63, feedback=self.feedback)
        except CodecError as exc:
            log.warning("model v%d: no delta from v%d (%s); devices take the full model", version, base[0], exc)
            return dict(new)
        self._pending = _Pending(version, rm.epoch, result, payload, digest)
        return result

    def publish(self, rm: Any) -> bool:
        """Publish the delta prepared for the manager's current model (if it is exactly those weights, of this
        epoch), retained on ``gateway/model_delta``; remember the model as the next delta's base. Call before
        publishing the full model. False only when the manager stopped while waiting for the broker."""
        pending, self._pending = self._pending, None
        ok = True
        if self.codec is not None:
            if pending is not None and pending.version == rm.version and pending.epoch == rm.epoch \
                    and pending.weights is rm.weights:
                ok = rm.publish_reliably(str(gateway_topic(rm.fleet, "model_delta")), pending.payload,
                                         f"model delta v{pending.version}")
                self.deltas_published += 1
                self.delta_bytes += len(pending.payload)
                digest = pending.digest
            else:  # no delta for this version: clear the retained one (another epoch's, or an older base)
                ok = rm.publish_reliably(str(gateway_topic(rm.fleet, "model_delta")), b"",
                                         f"model v{rm.version}: no delta")
                digest = weights_digest(rm.weights)
            self._published = (rm.version, rm.epoch, rm.weights, digest)
        return ok
