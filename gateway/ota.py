"""OTA rollouts: per-profile signed artifacts, canary first, then waves, halted by failures.

A rollout of version V to a set of devices:

1. **artifacts** — :func:`build_artifacts` makes one per target profile:
   the model (quantized for the profile when asked), golden data computed
   here for the health check, signed with the fleet key
   (:mod:`edgeflow.artifact`).
2. **canary** — the first ``canary`` share of the targets (at least one
   device) gets V. Each device verifies, stages, health-checks, swaps and
   acks; a device whose check fails stays on its old model (the ack says
   ``rolled_back``).
3. **waves** — the rest, ``wave_size`` at a time. After every wave the
   failure rate over all devices done so far is compared with
   ``failure_threshold``; above it the rollout **halts** (the remaining
   devices are not touched; ``revert_on_halt`` also rolls back the ones
   already on V).
4. **timeouts** — a device that does not report within
   ``report_timeout_s`` counts as failed and gets a *conditional* rollback
   (``rollback {"from_version": V}``, TTL ``rollback_ttl_s``, one hour): if
   it did switch to V and only the report was lost, it goes back; if it
   never switched, the command is a no-op. An agent that restarted
   mid-deploy reports the interrupted command itself when it comes back.
   The TTL is short on purpose: a captured copy of this rollback is a valid
   signed command until it expires (devices also remember its id and refuse
   a rollback issued before their running model was installed).
5. **downgrades** — devices refuse a version older than the one they run
   unless the policy says ``allow_downgrade`` (``fleet deploy
   --allow-downgrade``): a replayed or mistaken old offer cannot roll a
   device back.

**Canary evidence** (issue 31: a lying canary that acked every offer ok opened the whole fleet to a bad
rollout). Each offer carries a fresh random challenge in its signed deploy command. The device, once the
offered model serves, runs it on inputs drawn from the challenge (the golden inputs mixed with seeded noise,
:func:`edgeflow.artifact.challenge_inputs`) and returns 64 of each output's values at positions the challenge
draws, in its signed ack. The gateway runs the artifact's model on the same inputs and compares within the
golden tolerance: a device that did not run the offered model cannot produce them, and its ok turns into
``failed`` (``bad_evidence``, with a conditional rollback). The waves after the canary go out only when
``min_canaries`` (default 2, or all of a smaller rollout) canaries succeeded with verified evidence, so one
compromised device cannot green-light a rollout on its own. What it does not cover: a compromised device that
does run the model can produce the evidence and still lie about its health; k of n canaries bounds that.

The selection syntax of ``--to`` is :func:`parse_selector`.

Profile names come from the devices' births, so they are checked before use
(:func:`profile_problem`): a device claiming an invalid name (a path such as
``../../etc/passwd``) or a profile this gateway does not know gets no
artifact and is **skipped** with the reason, the rest of the rollout goes on;
no name a device sends is ever opened as a file.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from edgeflow.artifact import ANY_PROFILE, build_artifact, parse_artifact
from edgeflow.errors import ConfigError, FleetError, ProfileError
from edgeflow.profiles import builtin_profile, check_profile_name

from .store import DeviceRecord

__all__ = [
    "DeviceResult",
    "Rollout",
    "RolloutPolicy",
    "RolloutReport",
    "build_artifacts",
    "parse_selector",
    "plan_waves",
    "profile_problem",
    "select_devices",
]

log = logging.getLogger("edgeflow.gateway.ota")

SUCCESS = ("ok", "unchanged")
FAILURE = ("failed", "refused", "timeout")


@dataclass
class RolloutPolicy:
    canary: float = 0.1
    """Share of the targets in the canary wave (0 < canary <= 1), or a device count when >= 1 and whole."""
    wave_size: int | None = None
    """Devices per wave after the canary; None sends the rest in one wave."""
    failure_threshold: float = 0.2
    """Halt when failed / finished exceeds this (0 halts on the first failure)."""
    report_timeout_s: float = 120.0
    rollback_timeouts: bool = True
    revert_on_halt: bool = False
    command_ttl_s: float | None = None
    rollback_ttl_s: float = 3600.0
    """How long the conditional rollback for a device that did not report stays valid (was 24 h: a captured
    copy could roll a device back a day later; issue 20)."""
    allow_downgrade: bool = False
    """Let devices install a version older than the one they run (they refuse it otherwise)."""
    min_canaries: int = 2
    """The canary wave holds at least this many devices (all of them in a smaller rollout), and the waves after
    it go out only when that many canaries showed evidence the gateway checked: one lying canary cannot open the
    fleet to a bad rollout (issue 31)."""
    evidence: bool = True
    """Each offer carries a fresh challenge; a device's ok counts only with the outputs of the offered model on
    the challenge's inputs, checked against the gateway's own run (``canary evidence`` in the module docstring)."""

    def canary_count(self, n: int) -> int:
        if n == 0:
            return 0
        if isinstance(self.min_canaries, bool) or not isinstance(self.min_canaries, int) or self.min_canaries < 1:
            raise ConfigError(f"min_canaries must be a whole number >= 1, got {self.min_canaries!r}")
        c = self.canary
        if c >= 1 and float(c).is_integer():
            share = min(n, int(c))
        elif not 0 < c <= 1:
            raise ConfigError(f"canary must be a share in (0, 1] or a whole device count, got {c}")
        else:
            share = min(n, max(1, math.ceil(c * n - 1e-9)))
        return max(share, min(n, self.min_canaries))


@dataclass
class DeviceResult:
    device_id: str
    profile: str
    wave: int = -1
    state: str = "pending"
    """pending, ok, unchanged, failed, refused, timeout, skipped, reverted."""
    code: str = ""
    error: str = ""
    from_version: int | None = None
    model_version: int | None = None
    rolled_back: bool = False
    seconds: float | None = None
    health: dict[str, Any] | None = None
    train_master: str = ""
    """The fp32 training master sent with a quantized model: "ok", or what went wrong ("" when none)."""
    evidence: str = ""
    """"verified" when the device's outputs on the challenge matched the gateway's, else why not ("": not asked)."""


@dataclass
class RolloutReport:
    version: int
    state: str = "running"
    """running, completed, halted."""
    waves: list[list[str]] = field(default_factory=list)
    devices: dict[str, DeviceResult] = field(default_factory=dict)
    failure_rate: float = 0.0
    halted_reason: str = ""
    started: float = field(default_factory=time.time)
    finished: float | None = None

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.devices.values():
            out[r.state] = out.get(r.state, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        """The report with figures rounded (seconds to the millisecond, the failure rate to 4 places)."""
        d = asdict(self)
        d["counts"] = self.counts()
        d["failure_rate"] = round(self.failure_rate, 4)
        for r in d["devices"].values():
            if r["seconds"] is not None:
                r["seconds"] = round(r["seconds"], 3)
        return d


# -------------------------------------------------------------- selection


def parse_selector(text: str) -> dict[str, list[str]]:
    """``"profile=raspberry-pi-4,device=pi-*"`` -> {"profile": [...], "device": [...]}; ``"all"`` -> {}.

    Keys: ``profile`` (exact names, ``|`` for several), ``device`` (glob
    patterns, ``|`` for several), ``version`` (current model version,
    ``none`` for devices without a model). Terms are AND-ed.
    """
    text = (text or "").strip()
    if text in ("", "all", "*"):
        return {}
    out: dict[str, list[str]] = {}
    for term in text.split(","):
        key, sep, value = term.strip().partition("=")
        key = key.strip()
        if not sep or key not in ("profile", "device", "version") or not value.strip():
            raise ConfigError(f"bad target {term!r} in --to {text!r}; use e.g. 'profile=raspberry-pi-4', "
                              "'device=pi-*', 'version=3', combined with ',' or 'all'")
        out.setdefault(key, []).extend(v.strip() for v in value.split("|") if v.strip())
    return out


def select_devices(records: Iterable[DeviceRecord], selector: str | Mapping[str, list[str]], *,
                   online: Callable[[str], bool] | None = None) -> list[DeviceRecord]:
    """Records matching ``selector`` (and ``online(id)`` when given), sorted by device id."""
    sel = parse_selector(selector) if isinstance(selector, str) else dict(selector)
    out = []
    for r in records:
        if "profile" in sel and r.profile not in sel["profile"]:
            continue
        if "device" in sel and not any(fnmatch.fnmatchcase(r.device_id, p) for p in sel["device"]):
            continue
        if "version" in sel:
            v = "none" if r.model_version is None else str(r.model_version)
            if v not in sel["version"]:
                continue
        if online is not None and not online(r.device_id):
            continue
        out.append(r)
    return sorted(out, key=lambda r: r.device_id)


def plan_waves(device_ids: Sequence[str], canary_count: int, wave_size: int | None) -> list[list[str]]:
    """[canary, wave 1, wave 2, ...] in the given order."""
    ids = list(device_ids)
    if not ids:
        return []
    c = max(1, min(len(ids), canary_count))
    waves = [ids[:c]]
    rest = ids[c:]
    step = len(rest) if not wave_size else max(1, int(wave_size))
    for i in range(0, len(rest), step or 1):
        waves.append(rest[i:i + step])
    return waves


# -------------------------------------------------------------- artifacts


def profile_problem(profile: object, *, known: bool = True) -> str | None:
    """Why no artifact can be built for (or sent to) a device claiming ``profile``; None when one can.

    The name must be a valid profile name (:func:`edgeflow.profiles.check_profile_name`) and, with
    ``known``, a built-in profile here (or :data:`~edgeflow.artifact.ANY_PROFILE`). The reason quotes
    the name with ``repr`` (control characters escaped)."""
    if profile == ANY_PROFILE:
        return None
    try:
        if known:
            builtin_profile(profile, "device profile")
        else:
            check_profile_name(profile, "device profile")
    except ProfileError as exc:
        return str(exc)
    return None



def build_artifacts(
    model: bytes,
    profiles: Iterable[str],
    key: Any,
    *,
    version: int,
    fleet: str = "",
    name: str = "model",
    quantize: bool = False,
    calibration: Any = None,
    golden_inputs: Any = None,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    latency_budget_ms: float = 1000.0,
    golden: bool = True,
    notes: list[str] | None = None,
    masters: dict[str, bytes] | None = None,
) -> dict[str, bytes]:
    """One signed artifact per profile; with ``quantize`` each is quantized for its profile.

    Quantization uses ``edgeflow.quantize`` (the profile's scheme) with the
    ``calibration`` samples; when the quantizer is not available or the
    profile runs unquantized, the fp32 model is shipped and a line is added
    to ``notes`` saying so.

    A profile that :func:`profile_problem` refuses (a device's invalid or unknown claim) gets no
    artifact and a line in ``notes``; the devices claiming it are skipped by the :class:`Rollout`.

    ``masters``: a dict that receives, for every profile that can train and got
    a quantized model, the signed fp32 *training master* (the source model,
    manifest meta ``role: train_master``; the quantized artifact names it by
    its ``source_sha256``). A :class:`Rollout` given them sends each device its
    master just before the quantized model, so the device keeps training in
    federated rounds on fp32 while it serves int8. Without masters, devices on
    a quantized model do not train (they report ``train: quantized``).
    """
    import hashlib

    from edgeflow.artifact import make_golden

    notes = notes if notes is not None else []
    out: dict[str, bytes] = {}
    source_sha = hashlib.sha256(model).hexdigest()
    for profile in sorted(set(profiles), key=str):
        problem = profile_problem(profile)
        if problem is not None:
            notes.append(f"no artifact for a device's profile: {problem}; its devices are skipped")
            continue
        body, how = model, "fp32"
        if quantize:
            body, how = _quantized(model, profile, calibration, notes)
        g = None
        if golden:
            g = make_golden(body, profile if profile != ANY_PROFILE else "x86-gateway", golden_inputs, atol=atol,
                            rtol=rtol, latency_budget_ms=latency_budget_ms)
        out[profile] = build_artifact(body, version=version, profile=profile, key=key, fleet=fleet, name=name,
                                      golden=g, meta={"source_sha256": source_sha, "precision": how})
        if masters is not None and how != "fp32" and _can_train(profile):
            masters[profile] = build_artifact(model, version=version, profile=profile, key=key, fleet=fleet,
                                              name=f"{name}-fp32-master", golden=None,
                                              meta={"source_sha256": source_sha, "precision": "fp32",
                                                    "role": "train_master"})
    if masters:
        notes.append(f"fp32 training masters for {', '.join(sorted(masters))}: devices there train on fp32 and "
                     "serve the quantized model")
    return out


def _can_train(profile: str) -> bool:
    from edgeflow.errors import EdgeflowError

    try:
        return bool(builtin_profile(profile).can_train)
    except EdgeflowError:
        return False


def _quantized(model: bytes, profile: str, calibration: Any, notes: list[str]) -> tuple[bytes, str]:
    try:
        from edgeflow.quantization.api import quantize
    except ImportError as exc:
        notes.append(f"{profile}: quantization is not available here ({exc}); shipping the fp32 model")
        return model, "fp32"
    from edgeflow.errors import EdgeflowError

    try:
        q = quantize(model, profile, calibration=calibration, sensitivity=False, latency_runs=0)
    except EdgeflowError as exc:
        notes.append(f"{profile}: not quantized ({exc}); shipping the fp32 model")
        return model, "fp32"
    notes.append(f"{profile}: quantized ({getattr(q.report, 'method', 'int8')})")
    return q.model.SerializeToString(), str(getattr(q.report, "method", "quantized"))


# ---------------------------------------------------------------- rollout


class Rollout:
    """One rollout of signed per-profile artifacts to ``targets``. :meth:`run` blocks until done."""

    def __init__(
        self,
        fleet: Any,
        artifacts: Mapping[str, bytes],
        targets: Sequence[DeviceRecord],
        policy: RolloutPolicy | None = None,
        *,
        on_progress: Callable[[RolloutReport, DeviceResult], Any] | None = None,
        masters: Mapping[str, bytes] | None = None,
    ) -> None:
        """``masters``: fp32 training masters by profile (from :func:`build_artifacts`), sent to each
        device just before its quantized artifact."""
        if not artifacts:
            raise FleetError("a rollout needs at least one artifact")
        versions = {parse_artifact(a).version for a in artifacts.values()}
        if len(versions) != 1:
            raise FleetError(f"artifacts of one rollout must share a version, got {sorted(versions)}")
        self.fleet = fleet
        self.artifacts = dict(artifacts)
        self.targets = list(targets)
        self.policy = policy or RolloutPolicy()
        self.version = versions.pop()
        self.on_progress = on_progress
        self.masters = dict(masters or {})
        self.report = RolloutReport(self.version)

    def _artifact_for(self, profile: str) -> bytes | None:
        return self.artifacts.get(profile, self.artifacts.get(ANY_PROFILE))

    def _progress(self, r: DeviceResult) -> None:
        if self.on_progress is not None:
            try:
                self.on_progress(self.report, r)
            except Exception:  # noqa: BLE001 - a progress display must not break the rollout
                log.exception("rollout progress callback failed")

    def run(self) -> RolloutReport:
        rep, pol = self.report, self.policy
        eligible = []
        for rec in self.targets:
            r = DeviceResult(rec.device_id, rec.profile, from_version=rec.model_version)
            rep.devices[rec.device_id] = r
            invalid = profile_problem(rec.profile, known=False)
            if invalid is not None or self._artifact_for(rec.profile) is None:
                r.state = "skipped"
                r.error = invalid or profile_problem(rec.profile) or f"no artifact for profile {rec.profile!r}"
                continue
            eligible.append(rec.device_id)
        rep.waves = plan_waves(eligible, pol.canary_count(len(eligible)), pol.wave_size)
        finished = failed = 0
        for i, wave in enumerate(rep.waves):
            self._run_wave(i, wave)
            finished += len(wave)
            failed += sum(1 for d in wave if rep.devices[d].state in FAILURE)
            rep.failure_rate = failed / finished if finished else 0.0
            over = bool(failed) and rep.failure_rate > pol.failure_threshold
            shown = self._canaries_short(wave) if i == 0 and len(rep.waves) > 1 else None
            if over or shown is not None:
                label = "canary" if i == 0 else f"wave {i}"
                rep.state = "halted"
                rep.halted_reason = (f"failure rate {rep.failure_rate:.0%} ({failed} of {finished}) after the {label} "
                                     f"exceeds the threshold of {pol.failure_threshold:.0%}") if over else str(shown)
                log.warning("rollout of v%d halted: %s", self.version, rep.halted_reason)
                for later in rep.waves[i + 1:]:
                    for d in later:
                        rep.devices[d].state, rep.devices[d].error = "skipped", "rollout halted"
                if pol.revert_on_halt:
                    self._revert(d for w in rep.waves[: i + 1] for d in w)
                break
        if rep.state == "running":
            rep.state = "completed"
        rep.finished = time.time()
        return rep

    def _canaries_short(self, wave: list[str]) -> str | None:
        """Why the canary wave does not open the rest of the fleet (None: it does): fewer than
        ``min_canaries`` of its devices succeeded with verified evidence."""
        need = min(len(wave), self.policy.min_canaries)
        good = [d for d in wave if self.report.devices[d].state in SUCCESS
                and (not self.policy.evidence or self.report.devices[d].evidence == "verified")]
        if len(good) >= need:
            return None
        why = next((f" ({d}: {self.report.devices[d].evidence})" for d in wave
                    if self.report.devices[d].state in SUCCESS and self.report.devices[d].evidence != "verified"), "")
        return (f"only {len(good)} of the {len(wave)} canaries succeeded with verified evidence{why}; "
                f"{need} are needed (min_canaries) before the rest of the fleet gets v{self.version}")

    def _expected(self, profile: str, seed: str) -> tuple[dict[str, list], float, float] | None:
        """What the offered model computes here on the challenge's inputs (None: no golden data to draw from)."""
        from edgeflow.artifact import challenge_inputs, make_golden, sample_outputs

        art = parse_artifact(self._artifact_for(profile))  # type: ignore[arg-type]
        golden = art.golden()
        if golden is None:
            return None
        run_on = profile if profile != ANY_PROFILE else "x86-gateway"  # as build_artifacts ran the golden data
        ours = make_golden(art.model, run_on, challenge_inputs(golden, seed))
        return sample_outputs(ours.expected, seed), golden.atol, golden.rtol

    def _check_evidence(self, r: DeviceResult, seed: str, result: Mapping[str, Any]) -> None:
        """Mark ``r`` verified, or failed (``bad_evidence``) with why; a device without golden data to draw
        the challenge from is marked so and counts as unverified."""
        from edgeflow.artifact import evidence_problem

        try:
            expected = self._expected(r.profile, seed)
        except Exception as exc:  # noqa: BLE001 - the gateway's own run failing must not pass the device
            log.warning("device %s: the gateway could not compute the challenge's outputs: %s", r.device_id, exc)
            r.evidence = f"not checked: the gateway's run failed ({exc})"
            return
        if expected is None:
            r.evidence = "not checked: the artifact has no golden data to draw a challenge from"
            return
        want, atol, rtol = expected
        problem = evidence_problem(want, result.get("evidence"), atol, rtol)
        if problem is None:
            r.evidence = "verified"
            return
        r.evidence = problem
        r.state, r.code = "failed", "bad_evidence"
        r.error = f"its acknowledgement does not show the offered model's outputs on the challenge: {problem}"
        log.warning("device %s: %s", r.device_id, r.error)
        if self.policy.rollback_timeouts:  # it may run v even so: roll it back if it does
            try:
                self.fleet.send_command(r.device_id, "rollback", {"from_version": self.version},
                                        ttl_s=self.policy.rollback_ttl_s, timeout_s=self.policy.rollback_ttl_s)
                r.rolled_back = True
            except Exception as exc:  # noqa: BLE001 - the failure stands; the rollback is best effort
                log.warning("device %s: rollback not sent: %s", r.device_id, exc)

    def _run_wave(self, index: int, wave: list[str]) -> None:
        rep, pol = self.report, self.policy
        pending = {}
        seeds: dict[str, str] = {}
        master_acks = {}
        for d in wave:
            r = rep.devices[d]
            r.wave = index
            art = self._artifact_for(r.profile)
            assert art is not None
            master = self.masters.get(r.profile)
            if master is not None:  # before the model: the device trains on it from the swap on
                try:
                    master_acks[d] = self.fleet.send_ota(d, master, version=self.version,
                                                         timeout_s=pol.report_timeout_s, ttl_s=pol.command_ttl_s,
                                                         role="train_master")
                except Exception as exc:  # noqa: BLE001 - serving does not need the master
                    log.warning("device %s: training master not sent: %s", d, exc)
                    r.train_master = f"not sent: {exc}"
            extra = {}
            if pol.evidence:
                seeds[d] = extra["challenge"] = secrets.token_hex(16)
            try:
                pending[d] = self.fleet.send_ota(d, art, version=self.version, timeout_s=pol.report_timeout_s,
                                                 ttl_s=pol.command_ttl_s, allow_downgrade=pol.allow_downgrade,
                                                 **extra)
            except Exception as exc:  # noqa: BLE001 - a publish failure is this device's failure
                log.warning("device %s: OTA offer not sent: %s", d, exc)
                r.state, r.code, r.error = "failed", "send_failed", str(exc)
                self._progress(r)
        deadline = time.monotonic() + pol.report_timeout_s
        for d, pc in master_acks.items():
            try:
                ack = pc.wait(max(0.0, deadline - time.monotonic()))
                rep.devices[d].train_master = "ok" if ack.ok else f"{ack.code}: {ack.error}"
            except FleetError as exc:
                rep.devices[d].train_master = f"timeout: {exc}"
        for d, pc in pending.items():
            r = rep.devices[d]
            try:
                ack = pc.wait(max(0.0, deadline - time.monotonic()))
            except FleetError as exc:
                r.state, r.code, r.error = "timeout", "timeout", str(exc)
                if pol.rollback_timeouts:
                    try:
                        self.fleet.send_command(d, "rollback", {"from_version": self.version},
                                                ttl_s=pol.rollback_ttl_s, timeout_s=pol.rollback_ttl_s)
                        r.rolled_back = True
                    except Exception as exc2:  # noqa: BLE001
                        log.warning("device %s: rollback not sent: %s", d, exc2)
                        r.error += f"; rollback not sent: {exc2}"
                self._progress(r)
                continue
            r.seconds = time.monotonic() - pc.sent
            r.code, r.error = ack.code, ack.error
            r.model_version = ack.result.get("model_version")
            r.health = ack.result.get("health")
            if ack.ok:
                r.state = "unchanged" if ack.result.get("unchanged") else "ok"
                if d in seeds:
                    self._check_evidence(r, seeds[d], ack.result)
            else:
                r.rolled_back = bool(ack.result.get("rolled_back", False))
                r.state = "failed" if ack.code in ("health_check_failed", "failed", "interrupted") else "refused"
            self._progress(r)

    def _revert(self, device_ids: Iterable[str]) -> None:
        for d in device_ids:
            r = self.report.devices[d]
            if r.state != "ok":
                continue
            try:
                ack = self.fleet.send_command(d, "rollback", {"from_version": self.version},
                                              timeout_s=self.policy.report_timeout_s).wait()
            except FleetError as exc:
                r.error = f"revert not acknowledged: {exc}"
                continue
            if ack.ok:
                r.state, r.rolled_back, r.model_version = "reverted", True, ack.result.get("model_version")
