"""One publish, as the frames a transport queues: the rules every broker transport shares.

``publish`` on MQTT and on NATS checks the same things (QoS 0 or 1, a valid
topic, the reserved ``_chunk`` level, the properties) and turns a payload into
the same frames: one message when it fits the transport's limit, else the
chunks of :mod:`edgeflow.transport.chunking` on ``<topic>/_chunk/<i>``; a
retained payload also clears what an earlier retained payload on the topic
left behind (its retained chunks beyond the new count, or the retained
message on the topic itself). Each transport then only queues the frames
(:class:`~edgeflow.transport.outbox.Outbox`) and wakes its network loop.
"""

from __future__ import annotations

import threading

from edgeflow.errors import ConfigError
from edgeflow.transport.chunking import Splitter
from edgeflow.transport.message import Delivery, MessageProperties, check_properties
from edgeflow.transport.outbox import Frame
from edgeflow.transport.topics import Topic, chunk_topic, has_reserved_level

__all__ = ["RetainedChunks", "check_publish", "publish_frames"]


class RetainedChunks:
    """How many retained chunks this transport left on each topic (to clear them when a shorter or
    unchunked retained payload replaces them). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def replace(self, topic: str, count: int) -> int:
        """Record ``count`` chunks on ``topic`` (0: none) and return the previous count."""
        with self._lock:
            previous = self._counts.get(topic, 0)
            if count:
                self._counts[topic] = count
            else:
                self._counts.pop(topic, None)
            return previous


def check_publish(topic: str, qos: int, *, raw: bool, properties: MessageProperties | None) -> None:
    """The arguments of a publish, checked the same way on every transport (ConfigError)."""
    if qos not in (0, 1):
        raise ConfigError(f"qos must be 0 or 1, got {qos!r} (edgeflow deduplicates QoS 1 instead of using QoS 2)")
    Topic(topic)
    if not raw and has_reserved_level(topic):
        msg = f"topic {topic!r}: the level '_chunk' is reserved for edgeflow's chunked transfers; rename the topic"
        raise ConfigError(msg)
    if properties:
        check_properties(properties)


def _clear(frame: type[Frame], topic: str, start: int, stop: int) -> list[Frame]:
    """Empty retained messages that delete retained chunks ``start..stop-1`` (best effort: no delivery)."""
    return [frame(chunk_topic(topic, i), 1, True, 0, i, None, data=b"") for i in range(start, max(start, stop))]


def publish_frames(topic: str, data: bytes, *, qos: int, retain: bool, properties: MessageProperties | None,
                   raw: bool, limit: int, frame: type[Frame], retained: RetainedChunks) -> tuple[Delivery, list[Frame]]:
    """The :class:`Delivery` of one publish and the frames to queue for it (``frame``: the transport's
    frame class). ``raw`` sends the payload as one message, unchunked, whatever its size."""
    frames: list[Frame] = []
    if raw or len(data) <= limit:
        delivery = Delivery(topic, 1, len(data), qos)
        if retain and not raw:
            frames.extend(_clear(frame, topic, 0, min(retained.replace(topic, 0), 1)))
        frames.append(frame(topic, qos, retain, len(data), 0, delivery, data=data, properties=properties))  # type: ignore[arg-type]
        return delivery, frames
    splitter = Splitter(data, limit)
    delivery = Delivery(topic, splitter.count, len(data), 1, transfer_id=splitter.transfer_id.hex())
    if retain:
        frames.append(frame(topic, 1, True, 0, 0, None, data=b""))
    for i in range(splitter.count):
        frames.append(frame(chunk_topic(topic, i), 1, retain, splitter.frame_size(i), i, delivery,
                            build=(lambda s=splitter, i=i: s.frame(i)), properties=properties))  # type: ignore[arg-type]
    if retain:
        frames.extend(_clear(frame, topic, splitter.count, retained.replace(topic, splitter.count)))
    return delivery, frames
