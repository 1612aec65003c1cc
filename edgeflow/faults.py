"""Fault points: named places where a crash test can make the process die like a power cut.

Production code marks the steps whose ordering matters for crash safety with
``fault_point("rounds.committed")``; nothing happens unless the process was
started with the environment variable ``EDGEFLOW_FAULTS`` naming that point::

    EDGEFLOW_FAULTS="rounds.committed"            # die the first time it is reached
    EDGEFLOW_FAULTS="rounds.update_stored@2:3"    # the 3rd time, counting only key 2 (round 2)
    EDGEFLOW_FAULTS="a,b:2"                       # several points

Dying is ``os._exit(137)``: no ``finally`` blocks, no buffered writes flushed,
no MQTT DISCONNECT (so the broker publishes the will and keeps unacknowledged
messages for the persistent session) - what ``kill -9`` or a power cut does,
at an exact step instead of a random instant. The plan is read once at import;
with the variable unset each call is one test of an empty dict (tens of
nanoseconds). These points are the one deliberate test hook in production code
(docs/architecture.md, "Crash-test hooks"; tests/unit/test_fault_points.py). The points edgeflow
defines are listed in :data:`POINTS` (tests/test_gateway_crash_points.py kills
the gateway at each of the ``rounds.*`` ones, tests/test_ota_crash.py a device agent
at each ``ota.*`` one, and both check that a restart recovers).
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["EXIT_CODE", "OTA_STEPS", "POINTS", "fault_point"]

EXIT_CODE = 137
POINTS = {
    "rounds.opened": "the round is stored as open, not yet announced",
    "rounds.announced": "the open round is announced (retained)",
    "rounds.update_stored": "an update is stored, not yet folded or acknowledged (key: round id)",
    "rounds.aggregated": "the round is aggregated in memory; nothing of it is stored",
    "store.finish_round": "inside the transaction that stores the model and closes the round, before COMMIT",
    "rounds.committed": "model and round committed, the model not yet published",
    "rounds.published": "the new model published, the next round not yet opened",
    "ota.received": "a device agent verified an OTA offer in memory, nothing written",
    "ota.staging": "half of the artifact is written to the inactive slot",
    "ota.staged": "the artifact is on disk in the inactive slot",
    "ota.checked": "the staged model passed its health check",
    "ota.swapped": "the active-slot pointer is swapped to the new model",
    "ota.loaded": "the new model serves; the deploy is not yet acknowledged",
}
OTA_STEPS = tuple(p.split(".", 1)[1] for p in POINTS if p.startswith("ota."))
"""The steps of an OTA deploy, in order (tests/test_ota_crash.py kills a device agent after each)."""


def _parse(spec: str) -> dict[tuple[str, str | None], int]:
    plan: dict[tuple[str, str | None], int] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        name, _, key = name.partition("@")
        plan[(name, key or None)] = int(count) if count else 1
    return plan


_PLAN = _parse(os.environ.get("EDGEFLOW_FAULTS", ""))
_HITS: dict[tuple[str, str | None], int] = {}
_LOCK = threading.Lock()


def fault_point(name: str, key: object = None) -> None:
    """Die here if ``EDGEFLOW_FAULTS`` asks for it (see the module docstring); else nothing."""
    if not _PLAN:
        return
    keys = [(name, None)] if key is None else [(name, None), (name, str(key))]
    for k in keys:
        want = _PLAN.get(k)
        if want is None:
            continue
        with _LOCK:
            _HITS[k] = _HITS.get(k, 0) + 1
            hit = _HITS[k] == want
        if hit:
            sys.stderr.write(f"edgeflow fault point {name}{'' if key is None else f'@{key}'} reached: exiting\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE)
