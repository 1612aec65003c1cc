"""The sender's queue of frames not yet acknowledged, bounded in bytes.

Everything a client publishes goes through here, online or offline: a
frame counts against ``max_bytes`` from ``put`` until the broker's PUBACK
(or a failure) releases it. When the broker is unreachable the queue fills
and ``put`` refuses new messages with a TransportError that says so, rather
than growing until a 512 MB board runs out of memory. A chunked payload is
admitted all or nothing, so a half-queued model never exists.

Frames are handed to paho in FIFO order; ordering across topics is
preserved, so "publish the model, then announce the round" stays in order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from edgeflow.errors import TransportError
from edgeflow.transport.message import Delivery

__all__ = ["Frame", "Outbox"]


@dataclass
class Frame:
    """One MQTT message to send. ``delivery`` None marks a best-effort housekeeping frame."""

    topic: str
    qos: int
    retain: bool
    size: int
    index: int
    delivery: Delivery | None
    data: bytes | None = None
    build: Callable[[], bytes] | None = None
    properties: dict[str, Any] | None = None

    def payload(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.build is not None
        return self.build()

    @property
    def cancelled(self) -> bool:
        return self.delivery is not None and self.delivery.error is not None


class Outbox:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            msg = "max_queued_bytes must be >= 1"
            raise ValueError(msg)
        self.max_bytes = max_bytes
        self._queue: deque[Frame] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._empty = threading.Condition(self._lock)

    @property
    def queued_bytes(self) -> int:
        """Bytes queued or in flight (not yet acknowledged)."""
        with self._lock:
            return self._bytes

    @property
    def waiting(self) -> int:
        """Frames not yet handed to the network."""
        with self._lock:
            return len(self._queue)

    def put(self, frames: Iterable[Frame], *, online: bool) -> None:
        batch = list(frames)
        size = sum(f.size for f in batch)
        with self._lock:
            if self._bytes + size > self.max_bytes:
                state = "the broker is unreachable" if not online else "the broker is slower than the publisher"
                msg = (
                    f"outgoing queue full: {self._bytes} bytes queued, this message needs {size}, limit "
                    f"{self.max_bytes} ({state}); wait for deliveries, drop the message, or raise max_queued_bytes"
                )
                raise TransportError(msg)
            self._queue.extend(batch)
            self._bytes += size

    def push_front(self, frames: list[Frame]) -> None:
        """Return un-acknowledged frames to the head of the queue, in their original order.

        Their bytes were never released, so the byte budget is unchanged.
        """
        with self._lock:
            self._queue.extendleft(reversed(frames))

    def pop(self) -> Frame | None:
        """Next frame to send, skipping (and releasing) frames of failed deliveries."""
        with self._lock:
            while self._queue:
                frame = self._queue.popleft()
                if frame.cancelled:
                    self._release_locked(frame)
                    continue
                return frame
            return None

    def release(self, frame: Frame) -> None:
        with self._lock:
            self._release_locked(frame)

    def _release_locked(self, frame: Frame) -> None:
        self._bytes -= frame.size
        if self._bytes <= 0:
            self._bytes = 0
            self._empty.notify_all()

    def drain(self) -> list[Frame]:
        """Remove and return every waiting frame (used on close)."""
        with self._lock:
            frames = list(self._queue)
            self._queue.clear()
            for f in frames:
                self._release_locked(f)
            return frames

    def abandon(self) -> None:
        """On close: remove every waiting frame and fail its delivery ("transport closed before ...")."""
        for frame in self.drain():
            if frame.delivery is not None:
                frame.delivery.fail(TransportError(f"transport closed before {frame.topic} was delivered"))

    def wait_empty(self, timeout: float | None) -> bool:
        with self._lock:
            return self._empty.wait_for(lambda: self._bytes == 0, timeout)
