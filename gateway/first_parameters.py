"""The first global model from a device, as Flower's server asks one client for ``get_parameters``.

A gateway started with neither ``[gateway] model`` nor ``[gateway] initial_parameters`` (and no model in its
state) asks one device that can train for its parameters before the first round: a signed announcement of mode
``"parameters"`` (round 0) selecting that device, which answers on its ``update`` channel with its
``get_parameters`` as a signed dense update echoing the request's nonce (edgeflow/federated/client.py). The
offer is checked by the one intake (:func:`edgeflow.gateway.intake.check_offer`) and becomes model v1, a
parameters-only model (:func:`~edgeflow.gateway.global_model.parameters_model`). A device that does not answer
within ``deadline_s``, or answers wrongly, is passed over for another.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import time
from typing import Any

from edgeflow.errors import CodecError, ConfigError, SignatureError
from edgeflow.protocol.rounds import RoundAnnouncement

from .global_model import model_weights, parameters_model
from .intake import check_offer

log = logging.getLogger("edgeflow.gateway.rounds")

__all__ = ["FirstParameters"]


class FirstParameters:
    """The first-parameters request of a :class:`~edgeflow.gateway.rounds.RoundManager` (``rm.first_parameters``)."""

    def __init__(self, manager: Any) -> None:  # the RoundManager (which imports this module)
        self.m = manager
        self._asked: tuple[str, str] | None = None  # (device, nonce) while waiting
        self._inbox: "queue.Queue[bytes]" = queue.Queue()

    def take(self, sender: str | None, payload: bytes) -> bool:
        """An update-channel message: True when it is the asked device's answer (queued for :meth:`adopt`)."""
        asked = self._asked
        if asked is None or sender != asked[0]:
            return False
        self._inbox.put(payload)
        return True

    def adopt(self) -> bool:
        """Ask devices in turn until one offers valid parameters; store them as model v1. False if stopped."""
        m = self.m
        while not m.stopping.is_set():
            device = self._pick()
            if device is None:
                m.stopping.wait(0.5)
                continue
            weights = self._ask(device)
            if weights is None:
                continue
            try:
                model = parameters_model(weights, source=f"parameters offered by {device}")
            except ConfigError as exc:
                log.warning("first parameters from %s refused: %s", device, exc)
                continue
            blob = model.SerializeToString()
            m.version = m.store.add_model(blob, hashlib.sha256(blob).hexdigest())
            m.base_model, m.weights = model, model_weights(model)
            log.info("first global model v%d: %d tensors offered by %s", m.version, len(m.weights), device)
            return True
        return False

    def _pick(self) -> str | None:
        eligible = sorted(c.device_id for c in self.m.candidates() if c.can_train)
        if not eligible:
            return None
        return eligible[int(self.m._rng.integers(len(eligible)))]

    def _ask(self, device: str) -> dict | None:
        m = self.m
        nonce = secrets.token_hex(8)
        now = time.time()
        ann = RoundAnnouncement(round_id=0, model_version=0, deadline=now + m.config.deadline_s, selected=(device,),
                                config=m.config.train, mode="parameters", issued=now, epoch=m.epoch, nonce=nonce)
        while not self._inbox.empty():
            self._inbox.get_nowait()
        self._asked = (device, nonce)
        try:
            log.info("no model yet: asking %s for its parameters (as Flower asks one client)", device)
            if not m.publish_round(ann):
                return None
            end = time.monotonic() + m.config.deadline_s
            while not m.stopping.is_set() and time.monotonic() < end:
                try:
                    payload = self._inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    return check_offer(payload, keyring=m.keyring, device=device, nonce=nonce,
                                       source=f"gateway<-{device} (parameters)")
                except (CodecError, SignatureError) as exc:
                    log.warning("parameters from %s refused (%s): %s", device, getattr(exc, "reason", "invalid"), exc)
                    return None
            if not m.stopping.is_set():
                log.warning("%s offered no parameters within deadline_s = %g s; asking another device (boards "
                            "running `edgeflow device --app` offer them; an ONNX fleet needs [gateway] model)",
                            device, m.config.deadline_s)
            return None
        finally:
            self._asked = None
