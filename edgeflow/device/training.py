"""The device's training service: whether this board takes part in federated rounds, and its participant.

The agent runs a participant (an ``edgeflow.federated.Client``, built by the agent's ``make_participant``)
exactly when the board can and should train: training on (``AgentOptions.train``), a profile that can
train, training data (a participant factory), a deployed model, and one that trains (fp32, or a quantized
model that came with its fp32 master). Otherwise it records why not, as one of :data:`TRAIN_STATES` and a
one-line detail (what is wrong and what to do), and announces every change at once (birth and telemetry),
so the gateway knows before it selects the next round's devices.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import EdgeflowError
from .commands import CommandFailed
from .core import AgentCore

__all__ = ["TRAIN_STATES", "Participant", "TrainingService"]

log = logging.getLogger("edgeflow.device")

TRAIN_STATES = ("training", "off", "profile", "no_data", "no_model", "quantized", "untrainable", "model_mismatch")
"""Why a device does (``training``) or does not take part in rounds; sent in telemetry as ``train`` with
``train_detail`` (one line: what is wrong and what to do), shown by ``edgeflow fleet status``."""


@runtime_checkable
class Participant(Protocol):
    """What the agent needs from a federated-learning client (``edgeflow.federated.Client``)."""

    def start(self) -> Any: ...

    def stop(self) -> Any: ...

    def status(self) -> dict[str, Any]: ...


_START_CODES = {"profile": "not_supported", "no_data": "not_supported", "no_model": "no_model",
                "quantized": "not_supported", "untrainable": "failed"}
"""``train_start`` refused: the ack's code for each reason the board cannot train."""


class TrainingService:
    """Federated-rounds participation for a :class:`~edgeflow.device.agent.DeviceAgent` (``agent.training_service``).

    The participant factory stays the agent's (``agent.make_participant``, settable); so do the options
    (``agent.options.train``) and the owner's opt-out (``edgeflow device --no-train``).
    """

    def __init__(self, agent: AgentCore) -> None:  # the agent's public core (device/core.py)
        self.agent = agent
        self.participant: Participant | None = None
        self.lock = threading.RLock()
        self.state: tuple[str, str] = ("", "")

    # ------------------------------------------------------------ the state

    def model_path(self) -> Path | None:
        """The fp32 model the participant trains: the deployed model itself, or, when the deployed model is
        quantized (manifest ``precision`` other than fp32), the fp32 master that came with it (None if none did)."""
        a = self.agent
        m = a.active_model
        if m is None:
            return None
        meta = m.artifact.manifest.meta or {}
        if str(meta.get("precision", "fp32")) == "fp32":
            return m.model_path
        source = meta.get("source_sha256")
        if not isinstance(source, str):
            return None
        return a.slots.master_model(source, a.fleet_key, a.profile.name)

    def status(self) -> tuple[str, str]:
        """(state, detail): one of :data:`TRAIN_STATES` and, unless training, what is wrong and what to do."""
        code, detail = self.state
        p = self.participant
        if code == "training" and p is not None:
            try:
                st = p.status()
            except Exception:  # noqa: BLE001 - a participant's status must not break the agent
                log.warning("participant status failed; the training state is reported without it", exc_info=True)
                st = {}
            if st.get("state") == "model_mismatch":
                return "model_mismatch", str(st.get("detail", "the gateway's model does not fit the deployed one"))
        return code or "off", detail

    def blocker(self) -> tuple[str, str] | None:
        """Why this device cannot take part in rounds now, or None."""
        a = self.agent
        if a.owner_opted_out:
            return "off", "this device was started with --no-train: its owner opted out of federated rounds"
        if not a.options.train:
            return "off", ("training is switched off on this device (train_stop or set_config train=false); "
                           f"`edgeflow fleet cmd {a.device_id} train_start` switches it on")
        if not a.profile.can_train:
            return "profile", f"profile {a.profile.name} cannot train (can_train = false in its profile)"
        if a.make_participant is None:
            return "no_data", ("this agent has no training participant: no training data (start `edgeflow device` "
                               "with --train-data x_y.npz holding arrays x and y)")
        if not getattr(a.make_participant, "needs_model", True):
            return None  # a Flower-style app (edgeflow device --app) brings its own model
        m = a.active_model
        if m is None:
            return "no_model", "no model is deployed yet; deploy one (`edgeflow fleet deploy MODEL --to ...`)"
        if self.model_path() is None:
            precision = (m.artifact.manifest.meta or {}).get("precision", "?")
            return "quantized", (f"v{m.version} is quantized ({precision}) and no fp32 master came with it, so it "
                                 "cannot train; deploy with `edgeflow fleet deploy --quantize` (it sends the master) "
                                 "or deploy the fp32 model")
        return None

    # ------------------------------------------------------- the participant

    def sync(self, *, restart: bool = False, announce: bool = True) -> tuple[str, str]:
        """Run the participant exactly when this device can and should train; record why not otherwise.

        ``restart`` makes a new participant (the model changed). When the state changes and
        ``announce``, the birth (``training``) and a telemetry message (``train``, ``train_detail``) go out
        at once, so the gateway knows before it selects the next round's devices."""
        a = self.agent
        with self.lock:
            if restart:
                self.stop_participant()
            blocker = self.blocker()
            if blocker is not None:
                self.stop_participant()
                state = blocker
            else:
                state = ("training", "")
                if self.participant is None:
                    try:
                        p = a.make_participant(a)
                        if hasattr(p, "on_state_change"):
                            p.on_state_change = self.participant_changed
                        p.start()
                        self.participant = p
                    except Exception as exc:  # noqa: BLE001 - any failure to build a trainer is "untrainable", said once
                        log.debug("participant for v%s not built", a.model_version, exc_info=True)
                        v = a.model_version
                        state = ("untrainable", f"v{v} cannot be trained here: {type(exc).__name__}: {exc}")
            changed = state != self.state
            self.state = state
        if changed:
            if state[0] == "training":
                log.info("%s: taking part in federated rounds on v%s", a.device_id, a.model_version)
            else:  # a choice or a board's nature is info; a model that should train and does not is a warning
                level = logging.WARNING if state[0] in ("quantized", "untrainable") else logging.INFO
                log.log(level, "%s: not taking part in federated rounds: %s", a.device_id, state[1])
            if announce and a.started and a.transport.is_connected:
                try:
                    a.publish_birth()
                except EdgeflowError as exc:
                    log.debug("%s: birth not re-announced: %s", a.device_id, exc)
                a.telemetry.wake()
        return state

    def restart(self) -> None:
        """A new participant for the model now deployed (or none, and why)."""
        self.sync(restart=True)

    def participant_changed(self) -> None:
        """The participant's own state changed (e.g. the gateway's model does not fit; it logged why): tell the
        gateway now."""
        a = self.agent
        if a.started and not a.stopping and a.transport.is_connected:
            try:
                a.publish_birth()
            except EdgeflowError:
                log.debug("%s: birth not re-announced after a participant change", a.device_id, exc_info=True)
            a.telemetry.wake()

    def stop_participant(self, *, locked: bool = False) -> None:
        """Stop and drop the participant (``locked``: under the service's lock, for callers outside :meth:`sync`)."""
        if locked:
            with self.lock:
                self.stop_participant()
            return
        p, self.participant = self.participant, None
        if p is not None:
            try:
                p.stop()
            except Exception:  # noqa: BLE001 - stopping is best effort
                log.exception("%s: participant failed to stop", self.agent.device_id)

    # -------------------------------------------------------------- commands

    def start_training(self) -> dict[str, Any]:
        """``train_start``: switch training on and persist it, or refuse with why this board cannot train."""
        a = self.agent
        if a.owner_opted_out:
            raise CommandFailed("not_supported", self.blocker()[1])  # type: ignore[index]
        was = a.options.train
        a.options.train = True
        code, detail = self.sync()
        if code != "training":
            a.options.train = was
            self.sync()
            raise CommandFailed(_START_CODES.get(code, "failed"), detail)
        self.persist(True)
        return {"training": True, "model_version": a.model_version}

    def stop_training(self) -> dict[str, Any]:
        """``train_stop``: switch training off and persist it."""
        a = self.agent
        was = self.status()[0] == "training"
        a.options.train = False
        self.persist(False)
        self.sync()
        return {"training": False, "was_training": was}

    def persist(self, on: bool) -> None:
        slots = self.agent.slots
        persisted = dict(slots.state().get("config") or {})
        persisted["train"] = on
        slots.save_state(config=persisted, training=on)
