"""Chunk splitting and reassembly, plus the sender's outbox and reconnect backoff (pure, no broker)."""

from __future__ import annotations

import os
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeflow.errors import CodecError, TransportError
from edgeflow.transport.backoff import Backoff
from edgeflow.transport.chunking import HEADER_SIZE, Reassembler, Splitter, is_chunk_frame, parse_chunk
from edgeflow.transport.message import Delivery
from edgeflow.transport.outbox import Frame, Outbox

TOPIC = "edgeflow/lab/gateway/model"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def frames_of(payload: bytes, max_message: int = 1024) -> list[bytes]:
    return list(Splitter(payload, max_message))


def test_split_sizes_and_headers() -> None:
    payload = os.urandom(10_000)
    s = Splitter(payload, 1024)
    frames = list(s)
    assert len(frames) == s.count == -(-10_000 // (1024 - HEADER_SIZE))
    assert all(len(f) <= 1024 for f in frames)
    assert [s.frame_size(i) for i in range(s.count)] == [len(f) for f in frames]
    headers = [parse_chunk(f)[0] for f in frames]
    assert {h.transfer_id for h in headers} == {s.transfer_id}
    assert [h.index for h in headers] == list(range(s.count))
    assert b"".join(bytes(parse_chunk(f)[1]) for f in frames) == payload
    assert is_chunk_frame(frames[0]) and not is_chunk_frame(b"plain payload" * 10)


def test_empty_payload_is_one_chunk() -> None:
    r = Reassembler()
    (frame,) = frames_of(b"")
    done = r.add(TOPIC, frame)
    assert done is not None and done.payload == b"" and done.chunks == 1


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=5000), st.integers(min_value=HEADER_SIZE + 64, max_value=900), st.randoms())
def test_reassembles_any_order_with_duplicates(payload: bytes, max_message: int, rnd: random.Random) -> None:
    frames = frames_of(payload, max_message)
    order = frames + rnd.sample(frames, k=min(len(frames), 3))  # QoS 1 redelivery
    rnd.shuffle(order)
    r = Reassembler()
    results = [res for f in order if (res := r.add(TOPIC, f)) is not None]
    assert len(results) == 1, "delivered exactly once despite duplicates"
    assert results[0].payload == payload
    assert r.bytes_buffered == 0 and len(r) == 0
    assert r.stats["duplicates"] == len(order) - len(frames)


def test_late_duplicates_of_a_completed_transfer_are_ignored() -> None:
    frames = frames_of(os.urandom(3000))
    r = Reassembler()
    done = [r.add(TOPIC, f) for f in frames]
    assert done[-1] is not None
    for f in frames:  # e.g. the retained chunks again after a re-subscribe
        assert r.add(TOPIC, f) is None
    assert len(r) == 0 and r.bytes_buffered == 0


def test_same_transfer_on_two_topics_is_two_transfers() -> None:
    frames = frames_of(os.urandom(2000))
    r = Reassembler()
    for f in frames[:-1]:
        r.add("a/x", f)
        r.add("b/x", f)
    assert r.add("a/x", frames[-1]) is not None
    assert r.add("b/x", frames[-1]) is not None


def test_interleaved_transfers() -> None:
    p1, p2 = os.urandom(4000), os.urandom(3000)
    f1, f2 = frames_of(p1), frames_of(p2)
    r = Reassembler()
    out = []
    for pair in zip(f1, f2 + [None] * len(f1)):
        for f in pair:
            if f is not None and (res := r.add(TOPIC, f)) is not None:
                out.append(res.payload)
    assert sorted(out) == sorted([p1, p2])


def test_incomplete_transfer_times_out_and_frees_memory() -> None:
    clock = Clock()
    r = Reassembler(timeout_s=30, clock=clock)
    frames = frames_of(os.urandom(5000))
    for f in frames[:-1]:
        r.add(TOPIC, f)
    assert r.bytes_buffered > 0 and len(r.pending()) == 1
    assert r.missing(TOPIC, parse_chunk(frames[0])[0].transfer_id) == [len(frames) - 1]
    clock.now += 29
    assert r.expire() == [] and len(r) == 1
    clock.now += 2
    assert len(r.expire()) == 1
    assert r.bytes_buffered == 0 and len(r) == 0 and r.stats["expired"] == 1
    # the straggler now starts a new (incomplete) transfer instead of completing a freed one
    assert r.add(TOPIC, frames[-1]) is None and len(r) == 1


def test_progress_resets_the_timeout() -> None:
    clock = Clock()
    r = Reassembler(timeout_s=10, clock=clock)
    frames = frames_of(os.urandom(5000))
    for f in frames[:-1]:
        clock.now += 8  # each chunk well within the timeout, the whole transfer well beyond it
        r.add(TOPIC, f)
        r.expire()
    assert r.add(TOPIC, frames[-1]) is not None


def _corrupt(frame: bytes, offset: int) -> bytes:
    b = bytearray(frame)
    b[offset] ^= 0x01
    return bytes(b)


def test_corrupted_chunk_is_rejected_and_the_transfer_still_completes() -> None:
    frames = frames_of(os.urandom(3000))
    r = Reassembler()
    with pytest.raises(CodecError) as err:
        r.add(TOPIC, _corrupt(frames[1], HEADER_SIZE + 5))
    assert err.value.reason == "checksum"  # type: ignore[attr-defined]
    results = [r.add(TOPIC, f) for f in frames]
    assert results[-1] is not None and r.stats["rejected"] == 1


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda f: f[:HEADER_SIZE - 1], "truncated"),
        (lambda f: b"XXXX" + f[4:], "bad_magic"),
        (lambda f: f[:4] + b"\x09" + f[5:], "unsupported_version"),
        (lambda f: f[:-1], "truncated"),
        (lambda f: f + b"\0", "truncated"),
    ],
)
def test_bad_chunks_are_rejected_with_a_reason(mutate, reason: str) -> None:
    (frame, *_rest) = frames_of(os.urandom(2000))
    with pytest.raises(CodecError) as err:
        parse_chunk(mutate(frame))
    assert err.value.reason == reason  # type: ignore[attr-defined]


def test_inconsistent_headers_are_rejected() -> None:
    payload = os.urandom(3000)
    tid = os.urandom(16)
    a = list(Splitter(payload, 1024, transfer_id=tid))
    b = list(Splitter(payload[:-1] + b"?", 1024, transfer_id=tid))  # same id, other hash
    r = Reassembler()
    r.add(TOPIC, a[0])
    with pytest.raises(CodecError, match="disagrees"):
        r.add(TOPIC, b[1])


def test_wrong_sha256_is_not_delivered() -> None:
    payload = os.urandom(2000)
    s = Splitter(payload, 1024)
    frames = list(s)
    # re-sign a frame's data consistently (CRC ok) but with different bytes: only the SHA-256 can tell
    header, data = parse_chunk(frames[0])
    forged_data = bytes(x ^ 0xFF for x in data)
    import zlib

    forged = struct.pack("!4sBB2x16sIIQI32sI", b"EFCK", 1, 0, header.transfer_id, header.index, header.count,
                         header.total_size, header.chunk_size, header.sha256, zlib.crc32(forged_data)) + forged_data
    r = Reassembler()
    out = [r.add(TOPIC, f) for f in [forged, *frames[1:]]]
    assert out == [None] * len(frames) and r.stats["sha_mismatch"] == 1 and r.bytes_buffered == 0


def test_memory_bounds() -> None:
    r = Reassembler(max_transfer_bytes=1000)
    with pytest.raises(CodecError) as err:
        r.add(TOPIC, frames_of(os.urandom(2000))[0])
    assert err.value.reason == "oversized"  # type: ignore[attr-defined]
    assert r.bytes_buffered == 0 and len(r) == 0

    # total budget full: the new transfer is refused; the stalled one of another sender is not evicted for it
    # (it was before issue 20: junk transfers of one device evicted the others' updates). It times out instead.
    r = Reassembler(max_total_bytes=8000, max_sender_bytes=4000)
    stalled = frames_of(os.urandom(2500))
    for f in stalled[:-1]:
        r.add("a", f)
    r.add("b", frames_of(os.urandom(2500))[0])
    with pytest.raises(CodecError, match="never evicted") as err:
        r.add("c", frames_of(os.urandom(2500))[0])
    assert err.value.reason == "oversized" and r.stats["evicted"] == 0 and r.stats["refused_full"] == 1
    assert r.add("a", stalled[-1]) is not None, "the stalled transfer still completes"

    r = Reassembler(max_transfers=2)
    for key in ("a", "b"):
        r.add(key, frames_of(os.urandom(2000))[0])
    with pytest.raises(CodecError):
        r.add("c", frames_of(os.urandom(2000))[0])
    assert len(r) == 2 and r.stats["evicted"] == 0


DEV_A, DEV_B = "edgeflow/lab/dev-a/update", "edgeflow/lab/dev-b/update"


def test_one_device_cannot_evict_another_devices_transfer() -> None:
    """Issue 20, finding 9: junk transfers from one device evicted others' in-progress updates."""
    r = Reassembler(max_total_bytes=64_000, max_sender_bytes=16_000, max_sender_transfers=4)
    victim = frames_of(os.urandom(6000))
    for f in victim[:-1]:
        r.add(DEV_B, f)
    for i in range(50):  # dev-a starts junk transfers as fast as it can, on its own update channel
        r.add(DEV_A if i % 2 else DEV_A + "/x", frames_of(os.urandom(3000))[0])
    assert r.sender_bytes("edgeflow/lab/dev-a") <= 16_000, "dev-a stays inside its own budget"
    assert r.stats["evicted"] >= 40, "dev-a's new transfers evicted only its own older ones"
    done = r.add(DEV_B, victim[-1])
    assert done is not None and done.payload == b"".join(parse_chunk(f)[1].tobytes() for f in victim)


def _tiny_chunks(total: int, tid: bytes) -> list[bytes]:
    """A transfer of ``total`` one-byte chunks (legal on the wire: chunk size >= 1)."""
    import hashlib
    import zlib

    payload = os.urandom(total)
    sha = hashlib.sha256(payload).digest()
    return [struct.pack("!4sBB2x16sIIQI32sI", b"EFCK", 1, 0, tid, i, total, total, 1, sha, zlib.crc32(payload[i:i + 1]))
            + payload[i:i + 1] for i in range(total)]


def test_reassembly_accounting_covers_real_memory() -> None:
    """Issue 20, finding 9: counting data bytes only was about 120x under the memory one-byte chunks pin."""
    import tracemalloc

    r = Reassembler(max_total_bytes=1 << 30)
    frames = _tiny_chunks(20_000, os.urandom(16))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for f in frames[:-1]:
            r.add(DEV_A, f)
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert r.bytes_buffered >= 40_000  # the declared size, one byte per chunk, bookkeeping
    assert used <= r.bytes_buffered + 16 * 1024, (used, r.bytes_buffered)
    assert r.add(DEV_A, frames[-1]) is not None and r.bytes_buffered == 0


def test_a_sender_over_its_budget_is_refused_up_front() -> None:
    r = Reassembler(max_total_bytes=1 << 20, max_sender_bytes=10_000)
    with pytest.raises(CodecError, match="budget of one sender") as err:
        r.add(DEV_A, frames_of(os.urandom(20_000))[0])
    assert err.value.reason == "oversized" and r.bytes_buffered == 0  # type: ignore[attr-defined]
    # one junk chunk declaring a huge payload reserves nothing beyond the budget either
    big = struct.pack("!4sBB2x16sIIQI32sI", b"EFCK", 1, 0, os.urandom(16), 0, 1 << 20, (1 << 20) * 1000, 1000,
                      b"\0" * 32, 0)
    with pytest.raises(CodecError):
        r.add(DEV_A, big)
    assert r.bytes_buffered == 0


def test_retained_chunks_are_refused_where_the_scheme_expects_none() -> None:
    """Issue 20, finding 9: a device left 2,000 retained 64 KiB chunks on its own update/_chunk/i."""
    r = Reassembler()
    frames = frames_of(os.urandom(3000))
    with pytest.raises(CodecError) as err:
        r.add(DEV_A, frames[0], retain=True)
    assert err.value.reason == "retained" and r.bytes_buffered == 0 and r.stats["retained_refused"] == 1  # type: ignore[attr-defined]
    # the gateway's retained model is what retained chunks are for; other topics are not judged
    for key in (TOPIC, "edgeflow/lab/_uplink/gateway/model", "sensors/x"):
        out = [r.add(key, f, retain=True) for f in frames]
        assert out[-1] is not None and out[-1].retain
    # live (non-retained) chunks on a device channel are of course fine
    assert [r.add(DEV_A, f) for f in frames][-1] is not None


def test_splitter_rejects_tiny_limits() -> None:
    with pytest.raises(ValueError, match="too small"):
        Splitter(b"x" * 100, HEADER_SIZE + 10)


# ------------------------------------------------------------------ outbox


def _frames(n: int, size: int, delivery: Delivery | None = None) -> list[Frame]:
    d = delivery or Delivery("t", n, n * size, 1)
    return [Frame("t", 1, False, size, i, d, data=b"x" * size) for i in range(n)]


def test_outbox_is_bounded_in_bytes_and_all_or_nothing() -> None:
    box = Outbox(1000)
    box.put(_frames(3, 200), online=False)
    assert box.queued_bytes == 600
    with pytest.raises(TransportError, match="queue full.*unreachable.*max_queued_bytes"):
        box.put(_frames(3, 200), online=False)
    assert box.queued_bytes == 600 and box.waiting == 3  # nothing of the refused batch got in
    f = box.pop()
    assert f is not None and box.waiting == 2 and box.queued_bytes == 600  # in flight still counts
    box.release(f)
    assert box.queued_bytes == 400
    box.put(_frames(3, 200), online=True)
    assert box.queued_bytes == 1000


def test_outbox_skips_frames_of_failed_deliveries() -> None:
    box = Outbox(10_000)
    d = Delivery("t", 3, 300, 1)
    box.put(_frames(3, 100, d), online=True)
    box.put(_frames(1, 100), online=True)
    first = box.pop()
    assert first is not None and first.delivery is d
    d.fail(TransportError("refused"))
    box.release(first)
    nxt = box.pop()
    assert nxt is not None and nxt.delivery is not d
    assert box.queued_bytes == 100
    assert box.drain() == [] and box.wait_empty(0) is False


def test_delivery_progress_and_errors() -> None:
    d = Delivery("t", 2, 10, 1)
    with pytest.raises(TransportError, match="not acknowledged within 0.01 s"):
        d.wait(0.01)
    d.frame_acked(0)
    d.frame_acked(0)
    assert d.acked == 1 and not d.done
    d.frame_acked(1)
    assert d.wait(0).succeeded
    bad = Delivery("t", 1, 1, 1)
    bad.fail(TransportError("nope"))
    with pytest.raises(TransportError, match="nope"):
        bad.wait(1)


# ----------------------------------------------------------------- backoff


def test_backoff_grows_caps_jitters_and_resets() -> None:
    b = Backoff(0.5, 8.0, rng=random.Random(1))
    delays = [b.next() for _ in range(8)]
    steps = [min(8.0, 0.5 * 2**i) for i in range(8)]
    assert all(s / 2 <= d <= s for d, s in zip(delays, steps))
    assert len({round(d, 6) for d in delays[4:]}) > 1, "jitter spreads clients at the cap"
    assert max(delays) <= 8.0
    b.reset()
    assert b.next() <= 0.5
    with pytest.raises(ValueError):
        Backoff(0, 1)


def test_completed_ids_are_bounded_per_sender_and_in_total() -> None:
    r = Reassembler(completed_cache=3, max_completed=10)
    for i in range(40):
        (f,) = frames_of(os.urandom(100))
        assert r.add(f"edgeflow/lab/dev-{i % 8}/update", f) is not None
    assert sum(len(d) for d in r._completed.values()) <= 10
    assert all(len(d) <= 3 for d in r._completed.values())
