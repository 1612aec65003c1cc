"""The device's OTA service: deploy, rollback and reboot, one at a time on the agent's operations thread.

A ``deploy`` arrives as an OTA offer on the device's ``ota`` topic (the signed command with its artifact,
:class:`~edgeflow.protocol.ota.OtaOffer`); ``rollback`` and ``reboot`` arrive as commands. Each is queued
(at most 4; beyond that the answer is ``busy``) and run by one worker thread, since each swaps slots.
A deploy of an older version than the running one is refused unless the signed command allows the
downgrade, and a rollback or deploy issued before the running model was installed is refused as stale.

OTA and power cuts: see :mod:`edgeflow.device.slots` for the argument. The journal ``pending.json`` is
written before the first byte is staged and removed after the ack, so an agent restarted mid-deploy
acknowledges the interrupted command with what it actually runs now (``restarted: true``,
:meth:`OtaService.recover_pending`). Each step is an ``ota.<step>`` fault point of :mod:`edgeflow.faults`:
crash tests (``EDGEFLOW_FAULTS=ota.staged``) make the process die right after it.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import time
from typing import Any

from ..artifact import Artifact, challenge_inputs, sample_outputs, verify_artifact
from ..errors import CodecError, EdgeflowError, FleetError, SignatureError
from ..faults import fault_point
from ..protocol.fleet import Ack, Command
from ..protocol.ota import OtaOffer
from ..transport.message import Message
from .commands import CommandFailed
from .core import AgentCore
from .health import HealthReport, check_model

__all__ = ["OtaService"]

log = logging.getLogger("edgeflow.device")


class OtaService:
    """Deployments for a :class:`~edgeflow.device.agent.DeviceAgent` (``agent.ota``).

    The agent owns the model (``active_model``, ``runtime_for``, ``switch_to_active``, ``boot_model``), the
    slots and the command plumbing (``authenticate``, ``run_command``, ``ack``: its
    :class:`~edgeflow.device.core.AgentCore`); this service decides what a deploy, rollback or reboot does
    with them and in which order.
    """

    def __init__(self, agent: AgentCore, maxsize: int = 4) -> None:  # the agent's public core (device/core.py)
        self.agent = agent
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
        self.busy: set[str] = set()
        """Ids of the commands queued or running (a redelivery of one is not queued twice)."""

    # --------------------------------------------------------------- the queue

    def enqueue(self, cmd: Command, data: bytes | None, art: Artifact | None) -> None:
        a = self.agent
        if cmd.id in self.busy:
            return  # already queued (a redelivery); its ack will come
        try:
            self.queue.put_nowait((cmd, data, art))
        except queue.Full:
            a.ack(cmd.id, cmd.name, ok=False, code="busy", cache=False,
                   error="the device is busy with other deployments; retry later")
            return
        self.busy.add(cmd.id)

    def loop(self) -> None:
        a = self.agent
        while not a.stopping:
            item = self.queue.get()
            if item is None or a.stopping:
                return
            cmd, data, art = item
            try:
                if cmd.name == "deploy":  # an OTA offer, with its artifact
                    a.run_command(cmd, lambda c: self.deploy(c, data, art))
                else:
                    a.run_command(cmd, a.handler(cmd.name))
            finally:
                self.busy.discard(cmd.id)

    def _hook(self, step: str) -> None:
        fault_point(f"ota.{step}")

    # ------------------------------------------------------------ the offer

    def on_offer(self, msg: Message) -> None:
        """A message on the ``ota`` topic: verify command and artifact (quick), queue the deploy."""
        a = self.agent
        if a.stopping:
            return
        try:
            offer = OtaOffer.from_bytes(msg.payload)
        except CodecError as exc:
            a.refuse("", "deploy", "bad_message", str(exc))
            return
        cmd = a.authenticate(offer.command, expect="deploy")
        if cmd is None:
            return
        a.counters["commands"] += 1
        want = str(cmd.args.get("artifact_sha256", ""))
        if hashlib.sha256(offer.artifact).hexdigest() != want:
            a.refuse(cmd.id, cmd.name, "bad_artifact",
                      "the artifact does not match the SHA-256 the signed deploy command names")
            return
        try:
            art = verify_artifact(offer.artifact, a.fleet_key, profile=a.profile.name, fleet=a.fleet)
        except (SignatureError, FleetError) as exc:
            a.refuse(cmd.id, cmd.name, getattr(exc, "reason", "bad_artifact"), f"artifact refused: {exc}")
            return
        self.enqueue(cmd, offer.artifact, art)

    # ------------------------------------------------------- training masters

    def needed_masters(self) -> set[str]:
        """The fp32 masters the active and the rollback model train on."""
        a = self.agent
        out: set[str] = set()
        p = a.slots.pointer()
        for slot in (p.active, p.previous):
            data = None if slot is None else a.slots.read_artifact(slot)
            if data is None:
                continue
            try:
                meta = verify_artifact(data, a.fleet_key).manifest.meta or {}
            except EdgeflowError:
                continue
            if str(meta.get("precision", "fp32")) != "fp32" and isinstance(meta.get("source_sha256"), str):
                out.add(meta["source_sha256"])
        return out

    def store_master(self, art: Artifact, data: bytes) -> dict[str, Any]:
        """Keep the fp32 master of a quantized model (sent just before it): what the participant trains."""
        a = self.agent
        meta = art.manifest.meta or {}
        if meta.get("role") != "train_master" or str(meta.get("precision", "fp32")) != "fp32":
            raise CommandFailed("bad_artifact", "a training master must be an fp32 artifact built as one "
                                "(manifest meta role = train_master); build it with edgeflow.gateway.ota.build_artifacts")
        try:
            a.slots.store_master(data, art)
        except OSError as exc:
            raise CommandFailed("failed", f"the fp32 master of v{art.version} could not be written ({exc})") from None
        a.slots.prune_masters(self.needed_masters() | {art.manifest.sha256})
        a.training_service.sync()  # a quantized model that waited for its master trains now
        return {"train_master": art.manifest.sha256, "version": art.version, "model_version": a.model_version}

    # ------------------------------------------------------------ operations

    def deploy(self, cmd: Command, data: bytes, art: Artifact) -> dict[str, Any] | None:
        a = self.agent
        if cmd.args.get("role") == "train_master":
            return self.store_master(art, data)
        a.counters["deploys"] += 1
        cur = a.active_model
        old_version = None if cur is None else cur.version
        if cur is not None and cur.sha256 == art.manifest.sha256 and cur.version == art.version:
            return {"model_version": cur.version, "unchanged": True, **self.evidence(cmd, art)}
        self.check_fresh(cmd, old_version)
        if cur is not None and art.version < cur.version and cmd.args.get("allow_downgrade") is not True:
            raise CommandFailed("downgrade", f"v{art.version} is older than the running v{cur.version}: a downgrade "
                                "needs a signed rollback or a deploy that allows it (`fleet deploy --allow-downgrade`)",
                                {"model_version": cur.version, "version": art.version})
        a.slots.set_pending({"id": cmd.id, "name": "deploy", "version": art.version,
                             "sha256": art.manifest.sha256, "from_version": old_version, "ts": time.time(),
                             "issued": cmd.issued, "expires": cmd.expires})
        self._hook("received")
        slot = a.slots.stage(data, art.model, hook=self._hook)
        o = a.options
        report: HealthReport = check_model(
            a.slots.slot_dir(slot) / "model.onnx", a.profile, art.golden(),
            memory_budget_mb=o.memory_budget_mb, backend=o.backend, threads=o.threads, runs=o.health_runs,
        )
        self._hook("checked")
        if not report.ok:
            a.slots.clear_pending()
            raise CommandFailed(
                "health_check_failed", f"v{art.version} failed its health check ({report.stage}): {report.reason}; "
                f"staying on v{old_version}",
                {"model_version": old_version, "version": art.version, "rolled_back": True,
                 "health": report.to_dict()},
            )
        a.slots.activate(slot)
        a.slots.save_state(installed_issued=cmd.issued)
        self._hook("swapped")
        try:
            m = a.switch_to_active()
        except EdgeflowError as exc:
            a.slots.rollback()
            if cur is not None:
                a.switch_to_active()
            a.slots.clear_pending()
            raise CommandFailed("failed", f"v{art.version} passed its health check but did not load for serving "
                                f"({exc}); rolled back to v{old_version}",
                                {"model_version": old_version, "rolled_back": True}) from exc
        self._hook("loaded")
        a.slots.prune_masters(self.needed_masters())
        a.training_service.restart()
        return self.finish(cmd, {"model_version": m.version, "previous_version": old_version, "slot": slot,
                                 "health": report.to_dict(), **self.evidence(cmd, art)})

    def evidence(self, cmd: Command, art: Artifact) -> dict[str, Any]:
        """What the served model computes on the inputs the gateway's challenge draws (``{"evidence": ...}``,
        in the signed ack): the gateway checks it against its own run, so a device cannot claim a healthy
        install without running the model (gateway/ota.py, "canary evidence")."""
        seed = cmd.args.get("challenge")
        golden = art.golden()
        if seed is None or golden is None:
            return {}
        try:
            return {"evidence": sample_outputs(self.agent.run_named(challenge_inputs(golden, seed)), seed)}
        except EdgeflowError as exc:
            log.warning("%s: no evidence for the challenge: %s", self.agent.device_id, exc)
            return {"evidence_error": str(exc)[:300]}

    def finish(self, cmd: Command, result: dict[str, Any]) -> None:
        """Ack, then forget the journal, then re-announce: a crash in between repeats the ack, never loses it."""
        a = self.agent
        a.ack(cmd.id, cmd.name, ok=True, result=result)
        a.slots.clear_pending()
        if a.transport.is_connected:
            a.publish_birth()

    def check_fresh(self, cmd: Command, running: int | None) -> None:
        """Refuse a deploy or rollback issued before the running model was installed (both times are the
        gateway's clock): it was meant for an earlier state, e.g. a captured rollback replayed later."""
        installed = self.agent.slots.state().get("installed_issued")
        if isinstance(installed, (int, float)) and cmd.issued < float(installed):
            raise CommandFailed("stale", f"{cmd.name} issued at {cmd.issued:.0f} predates the installation of the "
                                f"running v{running} (issued at {float(installed):.0f}); send a new command",
                                {"model_version": running})

    def rollback(self, cmd: Command) -> dict[str, Any] | None:
        a = self.agent
        a.counters["rollbacks"] += 1
        cur = a.active_model
        cur_version = None if cur is None else cur.version
        self.check_fresh(cmd, cur_version)
        want_from = cmd.args.get("from_version")
        if want_from is not None and cur_version != int(want_from):
            return {"model_version": cur_version, "unchanged": True,
                    "note": f"not running v{want_from}: nothing to roll back"}
        p = a.slots.pointer()
        if p.previous is None:
            raise CommandFailed("no_model", "no previous model on this device to roll back to",
                                {"model_version": cur_version})
        try:
            prev = a.slots.verify_slot(p.previous, a.fleet_key, a.profile.name)
            a.runtime_for(prev)
        except EdgeflowError as exc:
            raise CommandFailed("failed", f"the previous model does not verify or load ({exc}); staying on "
                                f"v{cur_version}", {"model_version": cur_version}) from exc
        a.slots.set_pending({"id": cmd.id, "name": "rollback", "version": prev.version,
                             "sha256": prev.sha256, "from_version": cur_version, "ts": time.time(),
                             "issued": cmd.issued, "expires": cmd.expires})
        a.slots.rollback()
        a.slots.save_state(installed_issued=cmd.issued)
        m = a.switch_to_active()
        a.training_service.restart()
        return self.finish(cmd, {"model_version": m.version, "previous_version": cur_version})

    def reboot(self, cmd: Command) -> dict[str, Any] | None:
        """Restart the runtime: re-read config, re-verify and reload the model, restart training, re-announce."""
        a = self.agent
        a.load_config()
        a.training_service.stop_participant(locked=True)
        a.boot_model()
        a.training_service.restart()
        return self.finish(cmd, {"model_version": a.model_version, "notes": list(a.boot_notes)})

    # -------------------------------------------------------------- recovery

    def recover_pending(self) -> bytes | None:
        """The signed ack for an operation a crash interrupted (sent after connect), or None."""
        a = self.agent
        pending = a.slots.pending()
        if not pending or not pending.get("id"):
            if pending:
                a.slots.clear_pending()
            return None
        m = a.active_model
        now = None if m is None else m.version
        done = m is not None and m.version == pending.get("version") and m.sha256 == pending.get("sha256")
        name = str(pending.get("name", "deploy"))
        if done:
            ack = Ack(str(pending["id"]), name, a.device_id, True, "ok", "",
                      {"model_version": now, "previous_version": pending.get("from_version")}, time.time(), True)
        else:
            ack = Ack(str(pending["id"]), name, a.device_id, False, "interrupted",
                      f"the agent restarted during {name} of v{pending.get('version')}; it runs v{now}",
                      {"model_version": now, "version": pending.get("version"), "rolled_back": True},
                      time.time(), True)
        payload = ack.sign(a.signer.key)
        try:
            a.seen.set_ack(ack.id, payload, issued=float(pending.get("issued", 0.0) or 0.0),
                           expires=float(pending.get("expires", time.time() + 86400.0) or 0.0))
        except (OSError, TypeError, ValueError) as exc:
            log.warning("%s: recovered ack for %s not kept on disk: %s", a.device_id, ack.id, exc)
        return payload
