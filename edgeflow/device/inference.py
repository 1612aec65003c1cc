"""The device's inference service: requests on its ``infer`` topic, answered on ``infer/reply``.

A request ``{"id", "input": tensor}`` (or ``"inputs": {name: tensor}``), signed by the fleet key or an app
key the device was given (:func:`edgeflow.protocol.fleet.sign_inference_request`: an unsigned, expired,
misaddressed or foreign-signed request is answered ``ok: false`` with its reason and never run), is queued (at most
``AgentOptions.infer_queue``; beyond that the answer is ``busy``) and run on the agent's
active model by one worker thread; the reply carries the model's own output names, the model
version and the latency, or ``ok: false`` with the reason. Every request gets an answer.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from typing import Any

import numpy as np

from ..errors import CodecError, EdgeflowError, FleetError, SignatureError
from ..protocol.fleet import decode_tensor, encode_tensor, open_inference_request
from ..signing import PublicKey
from ..transport.message import Message
from .core import AgentCore

log = logging.getLogger("edgeflow.device")


class InferenceService:
    """Inference over MQTT for a :class:`~edgeflow.device.agent.DeviceAgent` (``agent.inference``)."""

    def __init__(self, agent: AgentCore, maxsize: int) -> None:  # the agent's public core (device/core.py)
        self.agent = agent
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, maxsize))

    def keys(self) -> dict[str, PublicKey]:
        """Who may ask for inferences: the fleet key and the app keys in ``AgentOptions.infer_keys``."""
        a = self.agent
        out = {a.fleet_key.key_id_hex: a.fleet_key}
        for hex_key in a.options.infer_keys:
            k = PublicKey.from_hex(hex_key)
            out[k.key_id_hex] = k
        return out

    def on_request(self, msg: Message) -> None:
        try:
            req = open_inference_request(msg.payload, self.keys(), device=self.agent.device_id)
        except (CodecError, SignatureError) as exc:
            self.agent.counters["infer_refused"] += 1
            self.reply({"id": None, "ok": False, "code": getattr(exc, "reason", "bad_message"), "error": str(exc)},
                       msg)
            return
        try:
            self.queue.put_nowait((req, msg))
        except queue.Full:
            self.reply({"id": req.get("id"), "ok": False, "code": "busy",
                         "error": f"inference queue is full ({self.queue.maxsize}); retry later"}, msg)

    def reply(self, body: dict[str, Any], msg: Message) -> None:
        props = {}
        if "correlation_data" in msg.properties:
            props["correlation_data"] = msg.properties["correlation_data"]
        try:
            self.agent.transport.publish(self.agent.topic("infer/reply"), json.dumps(body, separators=(",", ":")), qos=1,
                                   properties=props or None)
        except EdgeflowError as exc:
            log.warning("%s: inference reply not sent: %s", self.agent.device_id, exc)

    def loop(self) -> None:
        while not self.agent.stopping:
            item = self.queue.get()
            if item is None or self.agent.stopping:
                return
            req, msg = item
            rid = req.get("id")
            try:
                if "inputs" in req:
                    feeds = {str(k): decode_tensor(v) for k, v in dict(req["inputs"]).items()}
                elif "input" in req:
                    feeds = decode_tensor(req["input"])
                else:
                    raise FleetError("inference request needs 'input' (one tensor) or 'inputs' (name -> tensor)")
                t0 = time.perf_counter()
                outs = self.agent.run_named(feeds)  # keyed by the model's own output names
                ms = round((time.perf_counter() - t0) * 1000.0, 3)
                self.reply({"id": rid, "ok": True, "model_version": self.agent.model_version, "latency_ms": ms,
                             "outputs": {k: encode_tensor(np.asarray(v)) for k, v in outs.items()}}, msg)
            except Exception as exc:  # noqa: BLE001 - every request gets an answer
                log.warning("inference request %s failed: %s: %s", rid, type(exc).__name__, exc)
                self.reply({"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"}, msg)
