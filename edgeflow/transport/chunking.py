"""Splitting payloads into broker-sized chunks and putting them back together.

Pure (no paho, no sockets, injectable clock) so that every edge case is a
unit test. Brokers cap message size (AWS IoT Core 128 KB, Azure IoT Hub
256 KB, Mosquitto ``message_size_limit``/``max_packet_size``), while a global
model is megabytes, so large payloads travel as numbered chunks.

Each chunk's MQTT payload is an 80-byte header followed by the data::

    magic "EFCK" | version u8 | flags u8 | 2 zero bytes | transfer id (16 B, random)
    index u32 | count u32 | total size u64 | chunk size u32
    SHA-256 of the whole payload (32 B) | CRC-32 of this chunk's data u32

The receiver (:class:`Reassembler`):

- places chunks by index, so any arrival order works;
- ignores duplicates (QoS 1 redelivers after a reconnect), including late
  duplicates of transfers it already completed (a bounded LRU of recent
  transfer ids), so a payload is delivered once ("exactly once in effect");
- checks every chunk's CRC and that all chunks agree on count/size/hash,
  and the SHA-256 of the reassembled whole before delivering it;
- bounds memory honestly: a transfer's buffer is allocated whole when its
  first chunk arrives (the declared size, plus one byte per chunk to
  remember which arrived), and that is what is charged, per transfer, per
  *sender* and in total; drops transfers with no progress for
  ``timeout_s``, freeing their buffers;
- never lets one sender's transfers evict another's: a sender over its own
  budget (bytes or number of transfers) loses its own oldest transfer; when
  the total is full, the new transfer is refused, not someone else's. The
  sender of a payload is read from its topic (``edgeflow/<fleet>/<device>``,
  :func:`edgeflow.transport.topics.sender_of`), which the broker ACL makes
  trustworthy: only that device (and the operators) may write there;
- refuses retained chunks on channels that the topic scheme does not mark
  retained and chunked (:func:`edgeflow.transport.topics.retained_chunks_allowed`),
  so a device cannot park payloads in the broker's retained store for every
  later subscriber to buffer.

Resuming after a reconnect needs no protocol of its own: the sender resends
only chunks the broker did not acknowledge, the broker queues chunks for a
persistent-session subscriber while it is away, and the reassembler keeps
partial transfers across the subscriber's reconnects.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from edgeflow.errors import CodecError
from edgeflow.transport.topics import retained_chunks_allowed, sender_of

__all__ = [
    "HEADER_SIZE",
    "ChunkHeader",
    "Reassembled",
    "Reassembler",
    "Splitter",
    "TransferProgress",
    "is_chunk_frame",
    "parse_chunk",
]

log = logging.getLogger("edgeflow.transport")

MAGIC = b"EFCK"
VERSION = 1
_HEADER = struct.Struct("!4sBB2x16sIIQI32sI")
HEADER_SIZE = _HEADER.size
MAX_CHUNKS = 1 << 24
MIN_CHUNK_DATA = 64


def codec_error(reason: str, message: str) -> CodecError:
    """A CodecError with a machine-readable ``reason`` (same convention as edgeflow.codecs)."""
    err = CodecError(message)
    err.reason = reason  # type: ignore[attr-defined]
    return err


@dataclass(frozen=True)
class ChunkHeader:
    transfer_id: bytes
    index: int
    count: int
    total_size: int
    chunk_size: int
    sha256: bytes
    crc32: int

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC, VERSION, 0, self.transfer_id, self.index, self.count, self.total_size,
            self.chunk_size, self.sha256, self.crc32,
        )

    def expected_length(self) -> int:
        if self.index < self.count - 1:
            return self.chunk_size
        return self.total_size - self.chunk_size * (self.count - 1)


def is_chunk_frame(data: bytes | memoryview) -> bool:
    return len(data) >= HEADER_SIZE and bytes(data[:4]) == MAGIC


def parse_chunk(frame: bytes | bytearray | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Validate one chunk on its own; raise CodecError (with ``reason``) if it is bad."""
    mv = memoryview(frame).cast("B")
    if len(mv) < HEADER_SIZE:
        raise codec_error("truncated", f"chunk is {len(mv)} bytes, shorter than its {HEADER_SIZE}-byte header")
    magic, version, flags, tid, index, count, total, csize, sha, crc = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise codec_error("bad_magic", "not an edgeflow chunk (bad magic)")
    if version != VERSION or flags:
        raise codec_error("unsupported_version", f"chunk format version {version} flags {flags} unknown; upgrade")
    if count < 1 or count > MAX_CHUNKS or index >= count or csize < 1:
        raise codec_error("malformed", f"chunk {index}/{count} with chunk size {csize} is impossible")
    if math.ceil(total / csize) != count and not (total == 0 and count == 1):
        raise codec_error("malformed", f"{total} bytes in chunks of {csize} is not {count} chunks")
    header = ChunkHeader(tid, index, count, total, csize, sha, crc)
    data = mv[HEADER_SIZE:]
    if len(data) != header.expected_length():
        msg = f"chunk {index}/{count} carries {len(data)} bytes, expected {header.expected_length()}"
        raise codec_error("truncated", msg)
    if zlib.crc32(data) != crc:
        raise codec_error("checksum", f"chunk {index}/{count} failed its CRC-32 check")
    return header, data


class Splitter:
    """Plan the chunks of one payload; frames are built lazily, one at a time.

    ``max_message`` is the largest MQTT payload the broker accepts; each
    frame (header + data) fits in it.
    """

    def __init__(self, payload: bytes, max_message: int, *, transfer_id: bytes | None = None) -> None:
        chunk_size = max_message - HEADER_SIZE
        if chunk_size < MIN_CHUNK_DATA:
            msg = f"max message size {max_message} is too small to chunk (need at least {HEADER_SIZE + MIN_CHUNK_DATA})"
            raise ValueError(msg)
        self.payload = payload
        self.chunk_size = chunk_size
        self.total_size = len(payload)
        self.count = max(1, math.ceil(len(payload) / chunk_size))
        if self.count > MAX_CHUNKS:
            msg = f"payload of {len(payload)} bytes needs {self.count} chunks, more than {MAX_CHUNKS}"
            raise ValueError(msg)
        self.transfer_id = transfer_id if transfer_id is not None else os.urandom(16)
        if len(self.transfer_id) != 16:
            msg = "transfer id must be 16 bytes"
            raise ValueError(msg)
        self.sha256 = hashlib.sha256(payload).digest()
        self._view = memoryview(payload)

    def frame(self, index: int) -> bytes:
        if not 0 <= index < self.count:
            msg = f"chunk index {index} out of range 0..{self.count - 1}"
            raise IndexError(msg)
        data = self._view[index * self.chunk_size : (index + 1) * self.chunk_size]
        header = ChunkHeader(
            self.transfer_id, index, self.count, self.total_size, self.chunk_size, self.sha256, zlib.crc32(data)
        )
        return header.pack() + data

    def frame_size(self, index: int) -> int:
        start = index * self.chunk_size
        return HEADER_SIZE + max(0, min(self.chunk_size, self.total_size - start))

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[bytes]:
        for i in range(self.count):
            yield self.frame(i)


DEFAULT_SENDER_BYTES = 64 << 20
"""Smallest default per-sender budget (64 MiB): the gateway's 1 GiB default total gives 128 MiB per device."""
TRANSFER_OVERHEAD = 1024
"""Bytes charged per transfer on top of its buffer: the transfer's own bookkeeping (objects, dict entries)."""


@dataclass
class _Transfer:
    header: ChunkHeader
    sender: str
    buf: bytearray
    have: bytearray
    cost: int
    received: int = 0
    started: float = 0.0
    last_seen: float = 0.0
    retained: bool = True
    duplicates: int = 0
    meta: Any = None


@dataclass(frozen=True)
class Reassembled:
    """A complete, verified payload."""

    key: str
    transfer_id: bytes
    payload: bytes
    chunks: int
    retain: bool
    meta: Any
    duplicates: int
    seconds: float


@dataclass(frozen=True)
class TransferProgress:
    key: str
    transfer_id: bytes
    received: int
    count: int
    bytes: int
    idle_s: float


class Reassembler:
    """Collect chunks per (key, transfer id) and return whole payloads.

    Not thread-safe: the transport feeds it from its single worker thread.
    ``key`` is the base topic; two publishers on different topics never mix.
    Budgets (see the module docstring): ``max_transfer_bytes`` per transfer,
    ``max_sender_bytes`` and ``max_sender_transfers`` per sender
    (``sender_of(key)``; default budget an eighth of the total but at least
    :data:`DEFAULT_SENDER_BYTES`, so no single sender fills it),
    ``max_total_bytes`` and ``max_transfers`` in all.
    ``stats`` counts ``chunks``, ``duplicates``, ``completed``, ``expired``,
    ``evicted`` (a sender's own oldest transfer, to make room for its new
    one), ``refused_full``, ``retained_refused``, ``rejected`` and
    ``sha_mismatch``.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 300.0,
        max_transfer_bytes: int = 1 << 30,
        max_total_bytes: int = 1 << 30,
        max_transfers: int = 1024,
        max_sender_bytes: int | None = None,
        max_sender_transfers: int = 16,
        completed_cache: int = 256,
        max_completed: int = 65536,
        sender_of: Callable[[str], str] = sender_of,
        allow_retained: Callable[[str], bool] = retained_chunks_allowed,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_transfer_bytes = max_transfer_bytes
        self.max_total_bytes = max_total_bytes
        self.max_transfers = max_transfers
        if max_sender_bytes is None:
            max_sender_bytes = min(max_total_bytes, max(DEFAULT_SENDER_BYTES, max_total_bytes // 8))
        self.max_sender_bytes = max_sender_bytes
        self.max_sender_transfers = max_sender_transfers
        self.completed_cache = completed_cache
        self.max_completed = max_completed
        self._completed_n = 0
        self.sender_of = sender_of
        self.allow_retained = allow_retained
        self.clock = clock
        self._transfers: OrderedDict[tuple[str, bytes], _Transfer] = OrderedDict()
        self._by_sender: dict[str, OrderedDict[tuple[str, bytes], None]] = {}
        self._sender_bytes: Counter[str] = Counter()
        self._completed: dict[str, OrderedDict[tuple[str, bytes], float]] = {}
        self._bytes = 0
        self.stats: Counter[str] = Counter()

    @property
    def bytes_buffered(self) -> int:
        """Bytes held for incomplete transfers (allocated buffers plus bookkeeping)."""
        return self._bytes

    def sender_bytes(self, sender: str) -> int:
        return self._sender_bytes.get(sender, 0)

    def __len__(self) -> int:
        return len(self._transfers)

    def pending(self) -> list[TransferProgress]:
        now = self.clock()
        return [
            TransferProgress(k, tid, t.received, t.header.count, t.cost, now - t.last_seen)
            for (k, tid), t in self._transfers.items()
        ]

    def missing(self, key: str, transfer_id: bytes) -> list[int]:
        t = self._transfers.get((key, transfer_id))
        if t is None:
            return []
        return [i for i in range(t.header.count) if not t.have[i]]

    def _drop(self, tkey: tuple[str, bytes], why: str) -> None:
        t = self._transfers.pop(tkey, None)
        if t is None:
            return
        self._release(tkey, t)
        self.stats[why] += 1
        log.warning(
            "dropped chunked transfer %s on %s (%s): %d of %d chunks had arrived",
            tkey[1].hex(), tkey[0], why, t.received, t.header.count,
        )

    def _release(self, tkey: tuple[str, bytes], t: _Transfer) -> None:
        self._bytes -= t.cost
        self._sender_bytes[t.sender] -= t.cost
        if self._sender_bytes[t.sender] <= 0:
            del self._sender_bytes[t.sender]
        own = self._by_sender.get(t.sender)
        if own is not None:
            own.pop(tkey, None)
            if not own:
                del self._by_sender[t.sender]
        t.buf = bytearray()
        t.have = bytearray()

    def expire(self, now: float | None = None) -> list[tuple[str, bytes]]:
        """Drop transfers idle for longer than ``timeout_s``; return their keys."""
        now = self.clock() if now is None else now
        dead = [k for k, t in self._transfers.items() if now - t.last_seen > self.timeout_s]
        for k in dead:
            self._drop(k, "expired")
        horizon = max(self.timeout_s * 4, 3600.0)
        for sender in list(self._completed):
            done = self._completed[sender]
            while done and now - next(iter(done.values())) > horizon:
                done.popitem(last=False)
                self._completed_n -= 1
            if not done:
                del self._completed[sender]
        return dead

    def _refuse(self, reason: str, stat: str, message: str) -> CodecError:
        self.stats[stat] += 1
        return codec_error(reason, message)

    def _open(self, key: str, sender: str, header: ChunkHeader, meta: Any, now: float) -> _Transfer:
        """A new transfer's buffer, within its sender's budget and the total; never at another sender's cost."""
        if header.total_size > self.max_transfer_bytes:
            raise self._refuse("oversized", "rejected", (
                f"chunked transfer on {key} declares {header.total_size} bytes, over the "
                f"{self.max_transfer_bytes}-byte limit; raise max_transfer_bytes on the receiver"))
        cost = header.total_size + header.count + TRANSFER_OVERHEAD
        if cost > self.max_sender_bytes:
            raise self._refuse("oversized", "rejected", (
                f"chunked transfer on {key} needs {cost} bytes, over the {self.max_sender_bytes}-byte budget "
                "of one sender; raise max_sender_bytes on the receiver"))
        self.expire(now)
        own = self._by_sender.setdefault(sender, OrderedDict())
        while own and (len(own) >= self.max_sender_transfers or self._sender_bytes[sender] + cost > self.max_sender_bytes):
            self._drop(next(iter(own)), "evicted")  # the sender's own oldest transfer, nobody else's
            own = self._by_sender.setdefault(sender, OrderedDict())
        if self._bytes + cost > self.max_total_bytes or len(self._transfers) >= self.max_transfers:
            if not own:
                del self._by_sender[sender]
            raise self._refuse("oversized", "refused_full", (
                f"reassembly buffers are full ({self._bytes} of {self.max_total_bytes} bytes, "
                f"{len(self._transfers)} transfers); the transfer on {key} is refused (other senders' transfers "
                "are never evicted for it); raise max_total_bytes on the receiver"))
        t = _Transfer(header=header, sender=sender, buf=bytearray(header.total_size), have=bytearray(header.count),
                      cost=cost, started=now, last_seen=now, meta=meta)
        tkey = (key, header.transfer_id)
        self._transfers[tkey] = t
        own[tkey] = None
        self._bytes += cost
        self._sender_bytes[sender] += cost
        return t

    def add(
        self, key: str, frame: bytes | bytearray | memoryview, *, retain: bool = False, meta: Any = None,
        now: float | None = None,
    ) -> Reassembled | None:
        """Feed one chunk frame; return the payload when this chunk completes it.

        Raises CodecError for a chunk that is bad on its own, inconsistent
        with the transfer it claims to belong to (the transfer itself goes
        on), over a budget (reason ``oversized``) or retained where the topic
        scheme expects no retained chunks (reason ``retained``). Returns None
        for accepted, duplicate or late chunks.
        """
        now = self.clock() if now is None else now
        try:
            header, data = parse_chunk(frame)
        except Exception:
            self.stats["rejected"] += 1
            raise
        if retain and not self.allow_retained(key):
            raise self._refuse("retained", "retained_refused", (
                f"retained chunk on {key}: this channel carries no retained chunked payloads (someone left it in "
                "the broker's retained store); clear it with an empty retained message"))
        tkey = (key, header.transfer_id)
        sender = self.sender_of(key)
        self.stats["chunks"] += 1
        done = self._completed.get(sender)
        if done is not None and tkey in done:
            self.stats["duplicates"] += 1
            return None
        t = self._transfers.get(tkey)
        if t is None:
            t = self._open(key, sender, header, meta, now)
        elif (t.header.count, t.header.total_size, t.header.chunk_size, t.header.sha256) != (
            header.count, header.total_size, header.chunk_size, header.sha256,
        ):
            self.stats["rejected"] += 1
            msg = f"chunk {header.index} of transfer {header.transfer_id.hex()} on {key} disagrees with earlier chunks"
            raise codec_error("malformed", msg)
        t.last_seen = now
        self._transfers.move_to_end(tkey)
        if t.have[header.index]:
            t.duplicates += 1
            self.stats["duplicates"] += 1
            return None
        start = header.index * header.chunk_size
        t.buf[start:start + len(data)] = data
        t.have[header.index] = 1
        t.received += 1
        t.retained = t.retained and retain
        if header.index == 0 and meta is not None:
            t.meta = meta
        if t.received < header.count:
            return None
        return self._finish(tkey, t, now)

    def _finish(self, tkey: tuple[str, bytes], t: _Transfer, now: float) -> Reassembled | None:
        del self._transfers[tkey]
        buf = t.buf
        self._release(tkey, t)
        if hashlib.sha256(buf).digest() != t.header.sha256:
            self.stats["sha_mismatch"] += 1
            log.warning(
                "chunked transfer %s on %s failed its SHA-256 check; discarded", tkey[1].hex(), tkey[0]
            )
            return None
        payload = bytes(buf)
        del buf
        done = self._completed.setdefault(t.sender, OrderedDict())
        done[tkey] = now
        self._completed_n += 1
        while len(done) > self.completed_cache:
            done.popitem(last=False)
            self._completed_n -= 1
        while self._completed_n > self.max_completed:  # many senders (fake ids on an open broker): oldest first
            oldest = next(iter(self._completed))
            self._completed[oldest].popitem(last=False)
            self._completed_n -= 1
            if not self._completed[oldest]:
                del self._completed[oldest]
        self.stats["completed"] += 1
        return Reassembled(
            key=tkey[0], transfer_id=tkey[1], payload=payload, chunks=t.header.count, retain=t.retained,
            meta=t.meta, duplicates=t.duplicates, seconds=now - t.started,
        )
