"""What a logged-in operator can do from the dashboard: deploy a global model version, roll back, send a command.

Each action is the gateway's own entry point, called on the one :class:`~edgeflow.gateway.fleet.FleetManager`
the web view is attached to (the one that holds the fleet key and the broker session), never a copy of it:

- **deploy** ``{"model_version": N, "to": SELECTOR}``: the global model version N from the gateway's store
  (``store.model(N)``), one signed artifact per target profile (:func:`~edgeflow.gateway.ota.build_artifacts`),
  rolled out by ``FleetManager.deploy`` (canary, waves, evidence, halt: :mod:`edgeflow.gateway.ota`) in a
  background thread; the answer (202) names the artifact version, the dashboard's rollouts show the progress,
  and the finished report is recorded in the store's rollouts (``edgeflow fleet rollouts --state`` lists it,
  with the operator). The artifact version is the next after the highest one the devices run, as
  ``edgeflow fleet deploy`` picks it. One deploy at a time (409 while one runs).
- **rollback** ``{"to": SELECTOR}`` or ``{"device": ID}``: the signed ``rollback`` command to each matching
  online device (``FleetManager.send_command``), waiting for the acks.
- **command** ``{"device": ID, "name": NAME, "args": {...}}``: one of the agent's commands
  (:data:`~edgeflow.protocol.fleet.COMMANDS` but ``deploy``, which travels as an OTA offer) to a known device,
  waiting for its ack.

Every field is checked before anything is sent (:class:`ActionError` with the HTTP status and one line). Every
action, refused or done, is audited: a log line on ``edgeflow.gateway.web.audit`` with the operator's name and
the client address, and the newest :data:`AUDIT_KEEP` entries in memory (``GET /api/audit``).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import deque
from typing import Any, Callable

from edgeflow.errors import ConfigError, EdgeflowError, FleetError

audit_log = logging.getLogger("edgeflow.gateway.web.audit")
log = logging.getLogger("edgeflow.gateway.web")

AUDIT_KEEP = 500
MAX_ARGS_BYTES = 4096
DASHBOARD_COMMANDS = ("status", "set_config", "train_start", "train_stop", "reboot", "rollback")
"""The agent's commands a dashboard may send (``deploy`` goes as an OTA offer: the deploy action)."""


class ActionError(EdgeflowError):
    """An action refused before anything was sent: ``status`` is the HTTP code, the message says why and the fix."""

    def __init__(self, status: int, message: str, *, retry_after: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class Audit:
    """The action log: every entry logged at INFO with the operator, and the newest kept for ``/api/audit``."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=AUDIT_KEEP)
        self.clock = clock
        self._lock = threading.Lock()

    def record(self, operator: str | None, action: str, outcome: str, client: str, **detail: Any) -> dict[str, Any]:
        entry = {"ts": self.clock(), "operator": operator, "action": action, "outcome": outcome, "client": client,
                 **detail}
        with self._lock:
            self.entries.append(entry)
        # operator (a refused log-in's name is whatever was sent) and outcome as JSON strings: one line, always
        audit_log.info("dashboard action: operator=%s action=%s outcome=%s client=%s %s", json.dumps(operator),
                       action, json.dumps(outcome), client, json.dumps(detail, default=str, sort_keys=True)[:1000])
        return entry

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.entries)


def _field(body: dict[str, Any], name: str, kind: type, what: str) -> Any:
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, kind):
        raise ActionError(400, f"{name!r} must be {what}, got {str(v)[:40]!r}")
    return v


def _device_id(body: dict[str, Any]) -> str:
    from edgeflow.transport.topics import validate_id

    dev = _field(body, "device", str, "a device id")
    try:
        validate_id(dev, "device id")
    except (ConfigError, ValueError) as exc:
        raise ActionError(400, str(exc)) from None
    return dev


def _selector(body: dict[str, Any]) -> str:
    from edgeflow.gateway.ota import parse_selector

    to = _field(body, "to", str, "a selector such as all, profile=raspberry-pi-4 or device=cam-1")
    if len(to) > 500:
        raise ActionError(400, "'to' is longer than 500 characters")
    try:
        parse_selector(to)
    except (ConfigError, ValueError) as exc:
        raise ActionError(400, f"'to': {exc}") from None
    return to


class FleetActions:
    """Deploy, rollback and command through the attached gateway (``view.fleet``, ``view.store``)."""

    def __init__(self, view: Any, audit: Audit, *, policy: Any = None, command_timeout_s: float = 30.0) -> None:
        self.view = view
        self.audit = audit
        self.policy = policy
        self.command_timeout_s = command_timeout_s
        self._deploying: threading.Thread | None = None
        self._lock = threading.Lock()

    def _fleet(self) -> Any:
        if not self.view.resolve() or self.view.fleet is None or not hasattr(self.view.fleet, "send_command"):
            raise ActionError(503, "this server has no fleet to act on (a simulation, or the gateway is starting)")
        return self.view.fleet

    def models(self) -> list[dict[str, Any]]:
        """The global model versions a deploy can name (newest last)."""
        store = self.view.store
        if store is None or not hasattr(store, "model_versions"):
            return []
        return [{"version": m["version"], "round_id": m["round_id"], "sha256": m["sha256"], "size": m["size"]}
                for m in store.model_versions()][-50:]

    # -- deploy ------------------------------------------------------------------------------------------
    def deploy(self, operator: str, body: dict[str, Any], client: str) -> dict[str, Any]:
        from edgeflow.gateway.ota import build_artifacts, profile_problem, select_devices

        fm = self._fleet()
        version = _field(body, "model_version", int, "a global model version (a whole number)")
        to = _selector(body)
        stored = self.view.store.model(version) if version >= 0 and self.view.store is not None else None
        if stored is None:
            known = [m["version"] for m in self.models()]
            raise ActionError(404, f"no global model v{version} in the gateway's store (it has "
                                   f"{', '.join(f'v{v}' for v in known) or 'none'})")
        targets = select_devices(fm.devices(), to, online=fm.is_online)
        profiles = {r.profile for r in targets if profile_problem(r.profile) is None}
        if not profiles:
            raise ActionError(409, f"no online device matching {to!r} claims a profile an artifact can be built for")
        onnx_bytes, sha = stored
        artifact_version = max((r.model_version for r in fm.devices() if r.model_version is not None), default=0) + 1
        with self._lock:
            if self._deploying is not None and self._deploying.is_alive():
                raise ActionError(409, "a rollout started from the dashboard is still running: wait for it "
                                       "(its progress is under rollouts)")
            notes: list[str] = []
            artifacts = build_artifacts(onnx_bytes, profiles, fm.fleet_key, version=artifact_version, fleet=fm.fleet,
                                        name=f"global-model-v{version}", notes=notes)
            detail = {"model_version": version, "artifact_version": artifact_version, "to": to,
                      "targets": len(targets)}
            self.audit.record(operator, "deploy", "started", client, **detail)
            t = threading.Thread(target=self._run_deploy, args=(fm, artifacts, to, operator, client, detail, sha),
                                 name="edgeflow-web-deploy", daemon=True)
            self._deploying = t
            t.start()
        return {"started": True, **detail, "notes": notes}

    def _run_deploy(self, fm: Any, artifacts: dict[str, bytes], to: str, operator: str, client: str,
                    detail: dict[str, Any], sha: str) -> None:
        try:
            report = fm.deploy(artifacts, to, self.policy)
        except EdgeflowError as exc:
            self.audit.record(operator, "deploy", "failed", client, error=str(exc)[:300], **detail)
            return
        except Exception as exc:  # noqa: BLE001 - a background rollout: logged and audited, never silent
            log.exception("dashboard deploy failed")
            self.audit.record(operator, "deploy", "failed", client, error=repr(exc)[:300], **detail)
            return
        out = report.to_dict()
        out["operator"] = operator
        out["source"] = {"global_model_version": detail["model_version"], "sha256": sha}
        self._record(out, sha, detail)
        self.audit.record(operator, "deploy", report.state, client, counts=report.counts(), **detail)

    def _record(self, out: dict[str, Any], sha: str, detail: dict[str, Any]) -> None:
        store = self.view.store
        if store is None or not hasattr(store, "add_rollout"):
            return
        rid = time.strftime("%Y%m%d-%H%M%S", time.gmtime(out.get("started") or time.time())) + \
            f"-{secrets.token_hex(3)}"
        try:
            store.add_rollout(out, rollout_id=rid, source_sha256=sha, name=f"global model v{detail['model_version']}",
                              selector=detail["to"])
        except EdgeflowError:
            log.warning("dashboard deploy: the rollout was not recorded in the store", exc_info=True)

    def wait_deploy(self, timeout: float | None = None) -> bool:
        """Wait for the running dashboard rollout (tests, shutdown); True when none runs."""
        t = self._deploying
        if t is not None:
            t.join(timeout)
        return t is None or not t.is_alive()

    # -- rollback and commands ---------------------------------------------------------------------------
    def rollback(self, operator: str, body: dict[str, Any], client: str) -> dict[str, Any]:
        from edgeflow.gateway.ota import select_devices

        fm = self._fleet()
        if "device" in body:
            ids = [_device_id(body)]
            if fm.device(ids[0]) is None:
                raise ActionError(404, f"no device {ids[0]!r} in the registry")
        else:
            ids = [r.device_id for r in select_devices(fm.devices(), _selector(body), online=fm.is_online)]
        if not ids:
            raise ActionError(409, "no online device matches: nothing to roll back")
        pending = {d: fm.send_command(d, "rollback", {}, timeout_s=self.command_timeout_s) for d in ids}
        results = {d: self._ack(pc) for d, pc in pending.items()}
        self.audit.record(operator, "rollback", "ok" if all(a["ok"] for a in results.values()) else "failed",
                          client, devices=ids[:50], codes={d: a["code"] for d, a in list(results.items())[:50]})
        return {"results": results}

    def command(self, operator: str, body: dict[str, Any], client: str) -> dict[str, Any]:
        fm = self._fleet()
        dev = _device_id(body)
        name = _field(body, "name", str, f"one of {', '.join(DASHBOARD_COMMANDS)}")
        if name not in DASHBOARD_COMMANDS:
            raise ActionError(400, f"unknown command {name[:40]!r}: the dashboard sends "
                                   f"{', '.join(DASHBOARD_COMMANDS)} (a model goes out with deploy)")
        args = body.get("args", {})
        if not isinstance(args, dict) or len(json.dumps(args)) > MAX_ARGS_BYTES:
            raise ActionError(400, f"'args' must be a JSON object of at most {MAX_ARGS_BYTES} bytes")
        if fm.device(dev) is None:
            raise ActionError(404, f"no device {dev!r} in the registry")
        ack = self._ack(fm.send_command(dev, name, args, timeout_s=self.command_timeout_s))
        self.audit.record(operator, "command", "ok" if ack["ok"] else "failed", client, device=dev, name=name,
                          code=ack["code"])
        return {"device": dev, "name": name, "ack": ack}

    @staticmethod
    def _ack(pc: Any) -> dict[str, Any]:
        try:
            return pc.wait().to_dict()
        except FleetError as exc:
            return {"ok": False, "code": "timeout", "error": str(exc), "result": {}}
