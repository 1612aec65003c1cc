"""A fault-injecting TCP proxy (asyncio, standard library only) for real network faults.

This kernel has no netem (``tc qdisc add ... netem``: "Specified qdisc kind is
unknown"), and Toxiproxy's Go module cannot be fetched here, so faults are made
in user space between the clients and the broker::

    proxy = FaultProxy(("127.0.0.1", broker.port)).start()
    lossy = proxy.listen("lossy", Faults(delay_ms=200, jitter_ms=50, loss=0.10))
    clean = proxy.listen("clean")
    ...  # devices connect to 127.0.0.1:<lossy> or <clean> instead of the broker
    proxy.partition("site-a", True); time.sleep(30); proxy.partition("site-a", False)
    proxy.stop()

What each fault is, faithfully to what TCP makes of it (the byte stream is
never corrupted, as TCP never lets it be):

- **delay** ``delay_ms ± jitter_ms`` (uniform): every segment (at most
  ``mss`` bytes) is released that long after it arrived, in order — latency,
  not a bandwidth cap: segments in flight overlap.
- **loss** ``loss``: a segment is lost with that probability; TCP retransmits
  it after one retransmission timeout (Linux's minimum RTO, ``rto_ms`` = 200
  ms), doubling while the retransmission is lost again. The proxy holds the
  segment that long, and everything behind it waits (head-of-line blocking):
  what an application sees of packet loss on TCP.
- **partition**: nothing passes in either direction — the proxy stops reading
  and writing that listener's connections (the senders' socket buffers fill,
  as with unacknowledged segments), and accepts new connections without
  connecting them upstream (a SYN into the void). Lifting it lets the queued
  bytes through, unless an endpoint gave up meanwhile (keepalive), in which
  case its close is passed on.
- **reset** (:meth:`FaultProxy.reset`): every connection of a listener is cut
  at once (a NAT timeout, a cable pulled); :meth:`FaultProxy.cut_after` cuts the
  first connection that passes N more bytes towards its client (a link that drops
  in the middle of a transfer, deterministically).

A broker restart needs nothing here: when the upstream closes, the proxy closes
the client side too, and a client reconnecting during the outage is connected
and then closed at once (connection refused upstream).

Everything listens on ``listen_host`` (loopback by default, or an address in a
test's network namespace) and connects only to the given upstream.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["FaultProxy", "Faults"]


@dataclass(frozen=True)
class Faults:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    rto_ms: float = 200.0
    mss: int = 1448

    def __post_init__(self) -> None:
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if self.jitter_ms > self.delay_ms:
            raise ValueError("jitter_ms must not exceed delay_ms")


@dataclass
class _Listener:
    name: str
    faults: Faults
    port: int = 0
    server: Any = None
    open_: asyncio.Event | None = None  # set: not partitioned
    conns: set[Any] = field(default_factory=set)
    cut_after: int | None = None  # armed by cut_after(): bytes still to pass downstream before the cut
    cut_seen: dict[int, int] = field(default_factory=dict)


class FaultProxy:
    """Several listeners, each with its own :class:`Faults`, all forwarding to one upstream."""

    def __init__(self, upstream: tuple[str, int], *, listen_host: str = "127.0.0.1", seed: int = 0) -> None:
        self.upstream = upstream
        self.listen_host = listen_host
        self.stats: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._listeners: dict[str, _Listener] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # -- lifecycle (the loop runs in its own thread; the methods below are thread-safe) --------
    def start(self) -> "FaultProxy":
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        assert self._loop is not None, "start() the proxy first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        if self._loop is None:
            return
        try:
            self._call(self._close_all(), 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            self._loop = None

    async def _close_all(self) -> None:
        for lst in self._listeners.values():
            lst.server.close()
            lst.open_.set()  # nothing stays held
            for w in list(lst.conns):
                w.transport.abort()
        for lst in self._listeners.values():
            await lst.server.wait_closed()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=5)
            for t in pending:  # pragma: no cover - a delivery still sleeping out a long stall
                t.cancel()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- listeners and faults -----------------------------------------------------------------
    def listen(self, name: str, faults: Faults | None = None, port: int = 0) -> int:
        """Open listener ``name`` (a free port unless ``port``); returns its port."""
        return self._call(self._listen(name, faults or Faults(), port))

    async def _listen(self, name: str, faults: Faults, port: int) -> int:
        lst = _Listener(name, faults, open_=asyncio.Event())
        lst.open_.set()
        lst.server = await asyncio.start_server(lambda r, w: self._serve(lst, r, w), self.listen_host, port,
                                                reuse_address=True)
        lst.port = lst.server.sockets[0].getsockname()[1]
        self._listeners[name] = lst
        return lst.port

    def port(self, name: str) -> int:
        return self._listeners[name].port

    def set_faults(self, name: str, **changes: Any) -> None:
        lst = self._listeners[name]
        lst.faults = replace(lst.faults, **changes)

    def partition(self, name: str, on: bool) -> None:
        """Cut listener ``name`` off (True) or heal it (False)."""
        lst = self._listeners[name]
        assert self._loop is not None
        self._loop.call_soon_threadsafe(lst.open_.clear if on else lst.open_.set)
        self.stats["partitions" if on else "heals"] += 1

    def reset(self, name: str) -> int:
        """Abort every connection of listener ``name``; returns how many."""
        return self._call(self._reset(name))

    async def _reset(self, name: str) -> int:
        lst = self._listeners[name]
        n = 0
        for w in list(lst.conns):
            w.transport.abort()
            n += 1
        self.stats["resets"] += n
        return n

    def cut_after(self, name: str, nbytes: int) -> None:
        """Cut (abort) the first connection of listener ``name`` that passes ``nbytes`` more bytes
        towards its client from now on: a link that drops in the middle of a transfer, at a byte
        count instead of an instant."""
        lst = self._listeners[name]
        assert self._loop is not None

        def arm() -> None:
            lst.cut_seen = {}
            lst.cut_after = int(nbytes)
        self._loop.call_soon_threadsafe(arm)

    def connections(self, name: str) -> int:
        return len(self._listeners[name].conns) // 2

    # -- the data path -----------------------------------------------------------------------
    async def _serve(self, lst: _Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["accepted"] += 1
        lst.conns.add(writer)
        up_w = None
        try:
            await lst.open_.wait()  # a partitioned listener never connects upstream
            try:
                up_r, up_w = await asyncio.open_connection(*self.upstream)
            except OSError:
                self.stats["upstream_refused"] += 1
                return
            lst.conns.add(up_w)
            await asyncio.gather(self._pump(lst, reader, up_w, "up"), self._pump(lst, up_r, writer, "down"))
        finally:
            for w in (writer, up_w):
                if w is not None:
                    lst.conns.discard(w)
                    w.close()

    async def _pump(self, lst: _Listener, src: asyncio.StreamReader, dst: asyncio.StreamWriter, way: str) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        last = 0.0

        async def deliver() -> None:
            while True:
                item = await queue.get()
                if item is None:
                    return
                due, seg = item
                while True:
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if lst.open_.is_set():
                        break
                    await lst.open_.wait()  # held through the partition
                dst.write(seg)
                try:
                    await dst.drain()
                except (ConnectionError, OSError):
                    return
                self.stats[f"bytes_{way}"] += len(seg)
                if way == "down" and lst.cut_after is not None:
                    seen = lst.cut_seen[id(dst)] = lst.cut_seen.get(id(dst), 0) + len(seg)
                    if seen >= lst.cut_after:
                        lst.cut_after = None
                        self.stats["cuts"] += 1
                        dst.transport.abort()  # the client side; its pump then closes the upstream side
                        return

        out = asyncio.ensure_future(deliver())
        try:
            while True:
                if not lst.open_.is_set():
                    await lst.open_.wait()
                try:
                    data = await src.read(65536)
                except (ConnectionError, OSError):
                    break
                if not data:
                    break
                f = lst.faults
                for i in range(0, len(data), f.mss):
                    seg = data[i:i + f.mss]
                    extra = 0.0
                    if f.delay_ms:
                        extra += (f.delay_ms + self._rng.uniform(-f.jitter_ms, f.jitter_ms)) / 1000.0
                    rto = f.rto_ms / 1000.0
                    while f.loss and self._rng.random() < f.loss:  # lost; its retransmission may be lost too
                        extra += rto
                        rto *= 2
                        self.stats["segments_lost"] += 1
                    due = max(last, loop.time() + extra)
                    last = due
                    self.stats["segments"] += 1
                    queue.put_nowait((due, seg))
                    if out.done():
                        break
                if out.done():
                    break
        finally:
            queue.put_nowait(None)
            try:
                await asyncio.wait_for(out, timeout=30)
            except asyncio.TimeoutError:
                out.cancel()
            try:
                dst.write_eof() if dst.can_write_eof() else None
            except (OSError, RuntimeError):
                pass
            dst.close()
