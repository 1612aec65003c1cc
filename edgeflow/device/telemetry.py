"""What a device reports every telemetry interval, and how it measures it.

Latency percentiles come from the inferences served since the previous
report (a bounded window, so a burst cannot grow memory); memory is the
current resident set (``/proc/self/statm``) and the peak; CPU is this
process's CPU time over wall time since the previous report, in percent of
one core; queue depth is what the agent has waiting; battery is read from a
file when one is configured — a sysfs ``power_supply`` directory
(``capacity``, ``status``) or a plain file holding a percentage — or from a
callback. Battery is reported as a fraction 0..1 (the round selection's
unit).

:class:`TelemetryService` is the agent's reporter: every ``telemetry_interval_s`` (or at once after a
:meth:`~TelemetryService.wake`: a new connection, a changed training state or interval) it publishes
:meth:`~TelemetryService.body` on the device's ``telemetry`` topic, from its own timer thread.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EdgeflowError
from ..timing import peak_rss_bytes
from .core import AgentCore

log = logging.getLogger("edgeflow.device")

__all__ = ["TelemetryCollector", "TelemetryService", "read_battery", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set size (Linux ``/proc``; the peak elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def read_battery(path: str | os.PathLike[str]) -> tuple[float | None, bool | None]:
    """(level 0..1, charging) from a sysfs power_supply dir or a file with a percentage."""
    p = Path(path)
    try:
        if p.is_dir():
            level = float((p / "capacity").read_text().strip()) / 100.0
            try:
                status = (p / "status").read_text().strip().lower()
                charging: bool | None = status in ("charging", "full")
            except OSError:
                charging = None
            return max(0.0, min(1.0, level)), charging
        text = p.read_text().strip().split()
        level = float(text[0])
        level = level / 100.0 if level > 1.0 else level
        charging = None if len(text) < 2 else text[1].lower() in ("charging", "full", "1", "true")
        return max(0.0, min(1.0, level)), charging
    except (OSError, ValueError, IndexError):
        return None, None


class TelemetryCollector:
    """Collects inference latencies between reports and builds the telemetry body."""

    def __init__(self, *, window: int = 2048, battery_file: str | None = None,
                 battery_fn: Callable[[], float | None] | None = None) -> None:
        self._lat: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._count = 0
        self._errors = 0
        self.battery_file = battery_file
        self.battery_fn = battery_fn
        self._last_wall = time.monotonic()
        self._last_cpu = time.process_time()

    def record(self, latency_ms: float, *, ok: bool = True) -> None:
        with self._lock:
            if ok:
                self._lat.append(float(latency_ms))
                self._count += 1
            else:
                self._errors += 1

    def snapshot(self, *, queue_depth: int = 0) -> dict[str, Any]:
        """The measured part of a telemetry message; resets the latency window."""
        with self._lock:
            lat = list(self._lat)
            self._lat.clear()
            count, errors = self._count, self._errors
            self._count = self._errors = 0
        wall, cpu = time.monotonic(), time.process_time()
        dt = wall - self._last_wall
        cpu_pct = 100.0 * (cpu - self._last_cpu) / dt if dt > 0 else 0.0
        self._last_wall, self._last_cpu = wall, cpu
        out: dict[str, Any] = {
            "inferences": count,
            "inference_errors": errors,
            "latency_p50_ms": float(np.percentile(lat, 50)) if lat else None,
            "latency_p95_ms": float(np.percentile(lat, 95)) if lat else None,
            "rss_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
            "cpu_percent": round(cpu_pct, 2),
            "queue_depth": int(queue_depth),
        }
        level, charging = None, None
        if self.battery_fn is not None:
            try:
                value = self.battery_fn()
                level = None if value is None else float(value)
            except Exception:  # noqa: BLE001 - a broken battery callback must not stop telemetry
                log.debug("battery callback failed; battery level unknown", exc_info=True)
                level = None
        elif self.battery_file:
            level, charging = read_battery(self.battery_file)
        if level is not None:
            out["battery"] = round(level, 4)
            if charging is not None:
                out["charging"] = charging
        return out


class TelemetryService:
    """Telemetry for a :class:`~edgeflow.device.agent.DeviceAgent` (``agent.telemetry``): the collector the
    agent's inferences feed (:meth:`record`), the body of a report and the thread that sends it."""

    def __init__(self, agent: AgentCore, collector: TelemetryCollector) -> None:  # the agent's public core (device/core.py)
        self.agent = agent
        self.collector = collector
        self._wake = threading.Event()
        self._seq = 0
        self._seq_lock = threading.Lock()
        self.record = collector.record
        """``record(latency_ms, ok=True)``: one inference for the next report (the collector's own method)."""

    @property
    def battery_file(self) -> str | None:
        return self.collector.battery_file

    @battery_file.setter
    def battery_file(self, value: str | None) -> None:
        self.collector.battery_file = value

    def wake(self) -> None:
        """Send the next report now (and stop waiting, when the agent stops)."""
        self._wake.set()

    def reset_seq(self) -> None:
        """A new birth: the reports' ``seq`` counts from 1 again."""
        with self._seq_lock:
            self._seq = 0

    def _next_seq(self) -> int:
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def body(self) -> dict[str, Any]:
        a = self.agent
        code, detail = a.train_status()
        body = {"device": a.device_id, "ts": time.time(), "seq": self._next_seq(), "bdseq": a.bdseq,
                "model_version": a.model_version, "training": code == "training", "train": code,
                **({"train_detail": detail} if detail else {}),
                **self.collector.snapshot(queue_depth=a.inference.queue.qsize() + a.ota.queue.qsize())}
        p = a.participant
        if p is not None:
            try:
                st = p.status()
                part = {k: st[k] for k in ("rounds_trained", "last_round", "last_loss") if k in st}
                errors = st.get("errors") or []
                if errors:
                    part["last_error"] = str(errors[-1])
                body["participant"] = part
            except Exception:  # noqa: BLE001 - telemetry must not die with the participant
                log.debug("participant status failed; telemetry goes out without it", exc_info=True)
        return body

    def loop(self) -> None:
        a = self.agent
        while not a.stopping:
            self._wake.wait(max(0.05, float(a.options.telemetry_interval_s)))
            self._wake.clear()
            if a.stopping:
                return
            if not a.transport.is_connected:
                continue
            try:
                data = json.dumps(self.body(), separators=(",", ":")).encode("utf-8")
                a.transport.publish(a.topic("telemetry"), data, qos=int(a.options.telemetry_qos))
            except EdgeflowError as exc:
                log.debug("%s: telemetry not sent: %s", a.device_id, exc)
