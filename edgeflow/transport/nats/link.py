"""The NATS connection: nats-py's asyncio client on a private event-loop thread.

Everything that touches nats-py runs on this thread (:class:`Link` owns the
loop); the facade reaches it with :meth:`Link.submit` (run a coroutine there
and wait for its result) and :meth:`Link.wake` (the sender has work).

What happens here:

- connect, with retries and backoff until the first connection; afterwards
  nats-py reconnects by itself and restores the core subscriptions, and
  the connection listeners hear every change;
- the JetStream streams are made sure of (:func:`.jetstream.ensure_streams`): the
  *live* stream (``<prefix>.>``, bounded in age and bytes) gives every QoS 1
  publish a PubAck, the *retained* stream keeps the last message per
  subject, the *wills* stream one record per connected client;
- the sender drains the outbox in order, ``max_inflight`` publishes at a
  time; an acknowledged frame is released, one whose ack did not come is
  put back at the head of the outbox in its original order and sent again
  with the same ``Nats-Msg-Id`` (JetStream and the receivers drop the copy);
- a publish the server refuses for permissions (``-ERR 'Permissions
  Violation ...'``) fails its delivery at once, naming the subject;
- subscribe: the core subscription first, then the retained messages of
  the matching subjects (a short-lived consumer on the retained stream,
  last message per subject), then the live messages that came meanwhile.
  A setup the server did not answer in time (the core subscription not
  confirmed, the retained read timed out: a server busy with a thousand
  devices connecting at once) is tried again, after :data:`RETRY_MIN_S`
  doubling to :data:`RETRY_MAX_S` (jittered), until it is made, the handler
  is unsubscribed or the transport closes; a refusal (permissions) is not;
- resume: after a reconnect, what the live stream got for each unshared
  subscription since the drop is replayed (a consumer from that moment,
  minus :data:`GAP_MARGIN_S`), then the live messages held meanwhile; the
  worker's id memory drops the ones handled before the drop. A replay that
  timed out is tried again like a subscription (the live messages go on
  meanwhile; the replayed ones come after them);
- a JetStream out of this server's reach (a site's uplink account on a leaf node, whose API calls
  are mapped to the hub's domain: the server's own domain differs from the JetStream's): the
  client's connection to its server does not drop when the leaf connection does, so nothing
  above would replay what the hub published meanwhile. The link asks the JetStream for its
  account info every ``upstream_check_s`` (one small request) and marks the upstream lost when it
  gets no answer (or a publish finds no stream); the first answer after that replays the gap
  exactly as after a reconnect (:meth:`Link._watch_upstream`);
- the last will: on every connection the transport writes its will record
  (with the server's id for this connection) to the wills stream; a clean
  close deletes it first. :mod:`.will` publishes it when the server reports
  the connection gone with the record still there.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from edgeflow.errors import TransportError
from edgeflow.transport.backoff import Backoff
from edgeflow.transport.base import WillSpec
from edgeflow.transport.message import ConnectionEvent
from edgeflow.transport.nats.dispatch import Dispatcher, Inbound, LocalHandler
from edgeflow.transport.nats.jetstream import NatsFrame, ensure_streams, headers_in, headers_out
from edgeflow.transport.nats.subjects import (
    StreamNames,
    encode_level,
    retained_subject,
    subject_topic,
    topic_subject,
    will_subject,
)
from edgeflow.transport.outbox import Outbox

__all__ = ["CloseBudget", "Link"]

log = logging.getLogger("edgeflow.transport")
T = TypeVar("T")
Parts = list[tuple[list[str], "str | None", bool]]
"""What one handler subscribes: (subjects, queue group, replay retained) per part."""
GAP_MARGIN_S = 10.0
"""How far before the moment a connection dropped the gap replay starts (clocks of client and server differ)."""
RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0
"""A subscription or gap replay whose setup timed out is tried again after RETRY_MIN_S, doubling to
RETRY_MAX_S (each wait drawn from the upper half of the step)."""
_TRANSIENT: tuple[type[BaseException], ...] = (
    TimeoutError,  # asyncio's and nats-py's timeouts (a request, a fetch, a flush)
    nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError,
    nats.errors.ConnectionDrainingError,
)
"""What the server may answer in time on a later try (no refusal among them)."""
_PONG_WAIT_S = 120
"""How long :meth:`Link._flush`'s PONG is waited for after the caller stopped waiting (nats-py finds a
connection without PONGs stale sooner: 3 pings 20 s apart; the reconnect forgets the wait)."""
_END_TASKS_S = 0.5
"""At most this much of close()'s timeout is kept for cancelling and awaiting the loop's tasks (a
cancelled task ends in a step or two; the rest is for a busy machine)."""
_PERM = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"', re.IGNORECASE)


@dataclass(frozen=True)
class CloseBudget:
    """How ``close(timeout)`` spends its timeout (monotonic clock): the flush of queued messages until
    ``flushed_by`` (the first half), the goodbye (will record deleted, nats-py's client closed) until
    ``goodbye_by``, then ending every task on the loop and closing it until ``end`` (the last
    quarter of the timeout, at most :data:`_END_TASKS_S`)."""

    flushed_by: float
    goodbye_by: float
    end: float

    @classmethod
    def of(cls, timeout: float) -> CloseBudget:
        now, timeout = time.monotonic(), max(0.0, timeout)
        end = now + timeout
        return cls(now + timeout / 2, end - min(_END_TASKS_S, timeout / 4), end)

    @staticmethod
    def left(until: float) -> float:
        return max(0.0, until - time.monotonic())


class _NotInTime(TransportError):
    """A subscription's setup (or a gap replay) the server did not answer in time: tried again.
    Never leaves this module (the facade gets the message)."""


class _Caller:
    """Whether the caller of :meth:`Link.register` still waits for its first try."""

    gone = False


class Owner(Protocol):
    """What the link reads from its facade (settings are read at each connection)."""

    servers: list[str]
    client_id: str
    username: str | None
    password: str | None
    prefix: str
    will: WillSpec | None
    max_inflight: int
    ack_timeout_s: float
    connect_timeout_s: float
    live_max_age_s: float
    live_max_bytes: int
    create_streams: bool
    upstream_check_s: float
    name: str

    def ssl_context(self) -> Any: ...

    def notify_connection(self, event: ConnectionEvent) -> None: ...


class Link:
    """The event-loop thread of one NatsTransport and the connection it holds."""

    def __init__(self, owner: Owner, outbox: Outbox, dispatcher: Dispatcher, count: Callable[..., None],
                 backoff: Backoff) -> None:
        self.t = owner
        self.outbox = outbox
        self.dispatcher = dispatcher
        self._count = count
        self.backoff = backoff
        self.names = StreamNames(owner.prefix)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"edgeflow-nats-loop-{owner.name}", daemon=True)
        self._close_by = 0.0
        """When the loop's leftover tasks must have ended (set by :meth:`_stop_loop`; monotonic clock)."""
        self._cv = threading.Condition()
        self.up = False
        self.ended = False
        self.fatal: TransportError | None = None
        self.last_error: TransportError | None = None
        self.server_max_payload: int | None = None
        self.nc: Any = None
        self.js: Any = None
        self._wake: asyncio.Event | None = None
        self._inflight: dict[int, NatsFrame] = {}
        self._retry: list[tuple[int, NatsFrame]] = []
        self._seq = 0
        self._denied_subs: set[str] = set()
        self._denied_api: set[str] = set()
        """JetStream API subjects the server refused this user to publish to (``-ERR``, lower case; event-loop thread)."""
        self._gap_retries: dict[tuple[int, str], datetime.datetime] = {}
        """(handler id, subject) -> start of the gap a pending retry replays (event-loop thread only)."""
        self._main_task: asyncio.Task[None] | None = None
        self._pending: list[tuple[LocalHandler, Parts]] = []
        """Subscriptions made while not connected (event-loop thread only)."""
        self.connected_once = False
        self._thread_lock = threading.Lock()
        self._active: list[tuple[LocalHandler, Parts]] = []
        """Subscriptions the server has (event-loop thread only): their gaps are replayed after a reconnect."""
        self._hold: list[tuple[Callable[[Inbound], None], Inbound]] | None = None
        """While reconnecting: live messages held back until the gap's messages were delivered."""
        self._down_since: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        """The link's background tasks, held (asyncio keeps only weak references); close ends them with the rest."""
        self._probing = False
        self.remote_jetstream = False
        """The JetStream is behind a leaf connection (its domain is not the server's): see _watch_upstream."""
        self._upstream_lost: float | None = None
        self._upstream_ok_at = time.time()
        """When the remote JetStream last answered a check (sent time)."""
        """When the remote JetStream was last known reachable, while it is not (event-loop thread only)."""

    # ---------------------------------------------------------------- threads

    def start_thread(self) -> None:
        with self._thread_lock:
            if not self._thread.is_alive() and not self.loop.is_closed():
                self._thread.start()

    def start(self) -> None:
        self.start_thread()
        self._main_task = asyncio.run_coroutine_threadsafe(self._start_main(), self.loop).result()

    async def _start_main(self) -> asyncio.Task[None]:
        self._wake = asyncio.Event()
        return asyncio.get_running_loop().create_task(self._main())

    def submit(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the event loop; its result, or TransportError after ``timeout``."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise TransportError(f"NATS operation did not finish within {timeout:.3g} s") from None

    def wake(self) -> None:
        if self._wake is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake.set)

    def _set(self, **values: Any) -> None:
        with self._cv:
            for k, v in values.items():
                setattr(self, k, v)
            self._cv.notify_all()

    def wait(self, predicate: Callable[[Link], bool], timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: predicate(self), timeout)

    # ------------------------------------------------------------- connection

    async def _main(self) -> None:
        while not self.ended:
            try:
                await self._connect_once()
                break
            except TransportError as exc:
                self._set(last_error=exc)
                if self._is_fatal(exc):
                    self._set(fatal=exc)
                    return
                await asyncio.sleep(self.backoff.next())
        if self.ended:
            return
        await self._sender()

    @staticmethod
    def _is_fatal(exc: TransportError) -> bool:
        text = str(exc).lower()
        return "authorization" in text or "certificate" in text or "may not create" in text

    async def _connect_once(self) -> None:
        t = self.t
        try:
            nc = await nats.connect(
                servers=t.servers, name=t.client_id, user=t.username, password=t.password, tls=t.ssl_context(),
                # allow_reconnect off for the first connection: nats-py would otherwise retry a refusal
                # (bad password, untrusted certificate) for ever; on once connected (options are read per drop)
                connect_timeout=max(1, int(t.connect_timeout_s)), allow_reconnect=False, max_reconnect_attempts=-1,
                reconnect_time_wait=1, error_cb=self._on_error, disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected, inbox_prefix=f"_INBOX.{_inbox_token(t.username or t.client_id)}",
                ping_interval=20, max_outstanding_pings=3,
            )
        except nats.errors.NoServersError as exc:
            raise TransportError(f"could not connect to NATS at {', '.join(t.servers)}: {exc}") from None
        except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
            raise TransportError(f"could not connect to NATS at {', '.join(t.servers)}: {exc!r}") from None
        nc.options["allow_reconnect"] = True
        self.nc = nc
        self.js = nc.jetstream(timeout=t.ack_timeout_s)
        self.server_max_payload = int(nc.max_payload)
        if t.create_streams:
            try:
                await ensure_streams(self.js, self.names, live_max_age_s=t.live_max_age_s,
                                     live_max_bytes=t.live_max_bytes)
            except TransportError:
                await nc.close()
                raise
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                await nc.close()
                raise TransportError(f"JetStream is not available at {', '.join(t.servers)} ({exc!r}); "
                                     "start nats-server with -js") from None
        await self._write_will()
        self.backoff.reset()
        self.connected_once = True
        await self._drain_pending()
        self._set(up=True)
        self.t.notify_connection(ConnectionEvent(True, False, "connected"))
        self._count("connects")
        if t.upstream_check_s > 0:  # in the background: the sender starts now
            self._tasks.add(asyncio.get_running_loop().create_task(self._watch_upstream()))

    async def _on_error(self, exc: Exception) -> None:
        m = _PERM.search(str(exc))
        if m is None:
            log.info("%s: NATS error: %s", self.t.name, exc)
            return
        kind, subject = m.groups()  # nats-py hands the -ERR line over in lower case: subjects compare so
        subject = subject.lower()
        if kind.lower() == "subscription":
            self._denied_subs.add(subject)
            return
        if subject.startswith("$js."):  # a JetStream API request: its caller times out, this is why
            self._denied_api.add(subject)
            return
        self._count("publish_denied")
        for frame in list(self._inflight.values()):
            if subject in (topic_subject(frame.topic, self.t.prefix).lower(),
                           retained_subject(frame.topic, self.t.prefix).lower()):
                if frame.delivery is not None:
                    frame.delivery.fail(TransportError(
                        f"publish to {frame.topic} refused: not authorized (NATS subject {subject}); "
                        "check this user's publish permissions"))

    async def _on_disconnected(self) -> None:
        if not self.connected_once:
            # a first connection that failed half way (its JetStream check timed out) and was closed:
            # nothing to replay, and a hold set here would keep every live message of the next
            # connection back for ever (no reconnect would come to release it)
            return
        if self._down_since is None:
            self._down_since = time.time()
            if self._hold is None:
                self._hold = []
        if self.up:
            self._set(up=False)
            self._count("disconnects")
            self.t.notify_connection(ConnectionEvent(False, False, "connection lost"))

    async def _on_reconnected(self) -> None:
        try:
            await self._write_will()
        except TransportError as exc:
            log.warning("%s: will record not written after reconnect: %s", self.t.name, exc)
        if self._upstream_lost is not None:  # the leaf went first: its gap is the older one
            lost, self._upstream_lost = self._upstream_lost, None
            self._down_since = lost if self._down_since is None else min(lost, self._down_since)
        await self._replay_gaps()
        await self._drain_pending()
        self._set(up=True)
        self._count("connects")
        self._count("reconnects")
        self.t.notify_connection(ConnectionEvent(True, False, "reconnected"))
        assert self._wake is not None
        self._wake.set()

    async def _write_will(self) -> None:
        will = self.t.will
        if will is None:
            return
        payload = will.payload() if callable(will.payload) else will.payload
        data = payload.encode("utf-8") if isinstance(payload, str) else bytes(payload)
        record = {"cid": self.nc.client_id, "client_id": self.t.client_id, "user": self.t.username,
                  "topic": will.topic, "payload": base64.b64encode(data).decode(), "qos": int(will.qos),
                  "retain": bool(will.retain), "delay_s": int(will.delay_s)}
        await self._ack(self.js.publish(will_subject(self.t.client_id, self.t.prefix), json.dumps(record).encode()),
                        f"will record of {self.t.client_id}")

    async def clear_will(self) -> None:
        """A clean close: delete the will record so it is never published."""
        if self.t.will is None or self.nc is None or not self.nc.is_connected:
            return
        await self._ack(self.js.publish(will_subject(self.t.client_id, self.t.prefix), b""),
                        f"will record of {self.t.client_id}")

    async def _ack(self, aw: Awaitable[Any], what: str) -> Any:
        try:
            return await aw
        except nats.errors.NoRespondersError:
            raise TransportError(f"{what}: no JetStream stream captures it (are the edgeflow streams created?)") from None
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise TransportError(f"{what} not acknowledged: {exc!r}") from None

    # ----------------------------------------------------------------- sender

    async def _sender(self) -> None:
        assert self._wake is not None
        window = asyncio.Semaphore(self.t.max_inflight)
        while not self.ended:
            await self._wake.wait()
            self._wake.clear()
            while self.up and not self.ended and not self._retry:
                await window.acquire()
                frame = self.outbox.pop()
                if frame is None:
                    window.release()
                    break
                self._seq += 1
                self._inflight[self._seq] = frame  # type: ignore[assignment]
                self._tasks.add(asyncio.get_running_loop().create_task(self._send(self._seq, frame, window)))  # type: ignore[arg-type]

    async def _send(self, seq: int, frame: NatsFrame, window: asyncio.Semaphore) -> None:
        try:
            ok = await self._publish_frame(frame)
        except asyncio.CancelledError:  # close(): the frame's delivery fails, its bytes are released
            if frame.delivery is not None:
                frame.delivery.fail(TransportError(f"transport closed before {frame.topic} was acknowledged"))
            self.outbox.release(frame)
            raise
        finally:
            window.release()
            self._inflight.pop(seq, None)
            self._tasks.discard(asyncio.current_task())  # type: ignore[arg-type]
        if ok:
            self.outbox.release(frame)
            if frame.delivery is not None:
                frame.delivery.frame_acked(frame.index)
                self._count("acked_frames")
        elif frame.delivery is not None and frame.delivery.error is not None:
            self.outbox.release(frame)
        else:
            self._retry.append((seq, frame))
        if not self._inflight and self._retry:
            self.outbox.push_front([f for _, f in sorted(self._retry, key=lambda x: x[0])])
            self._count("resent_frames", len(self._retry))
            self._retry.clear()
        assert self._wake is not None
        self._wake.set()

    async def _publish_frame(self, frame: NatsFrame) -> bool:
        """True when the server acknowledged the frame; False to try again."""
        if frame.cancelled:
            return False
        data = frame.payload()
        headers = headers_out(frame)
        subject = topic_subject(frame.topic, self.t.prefix)
        try:
            if frame.retain:
                await self.js.publish(retained_subject(frame.topic, self.t.prefix), data, headers=headers,
                                      timeout=self.t.ack_timeout_s)
            if frame.qos == 0:
                await self.nc.publish(subject, data, headers=headers)
            else:
                await self.js.publish(subject, data, headers=headers, timeout=self.t.ack_timeout_s)
            self._count("published_frames")
            return True
        except nats.errors.NoRespondersError:
            if frame.delivery is not None:
                frame.delivery.fail(TransportError(
                    f"publish to {frame.topic}: no JetStream stream captures {subject}; "
                    f"create the stream {self.names.live} (any transport with stream rights does on connect)"))
            return False
        except nats.errors.MaxPayloadError as exc:
            if frame.delivery is not None:
                frame.delivery.fail(TransportError(f"publish to {frame.topic}: {exc}; lower max_payload"))
            return False
        except nats.js.errors.NoStreamResponseError:  # what js.publish raises for "no responders" (not the above)
            # nothing captures the subject right now (a leaf node's uplink is down: the hub's stream is out of
            # reach); the server answered at once, so without a pause this would resend thousands of times a second
            self._count("no_stream_retries")
            self._lose_upstream()
            await asyncio.sleep(min(1.0, self.t.ack_timeout_s))
            return False
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
            self._count("ack_timeouts")
            log.debug("%s: no ack for %s (%r); it is sent again", self.t.name, frame.topic, exc)
            await self._probe()
            return False

    async def _probe(self) -> None:
        """After an ack timeout: is the server still answering? A silent link (a partition: no FIN,
        no RST) would otherwise be noticed only by nats-py's pings (minutes) while every frame in the
        window is resent each ``ack_timeout_s``; with no PONG either, the connection is dropped and
        remade, and the frames wait in the outbox for it."""
        if self._probing or self.nc is None or not self.nc.is_connected:
            return
        self._probing = True
        try:
            await self._flush(max(1, int(self.t.ack_timeout_s)))
        except (nats.errors.Error, asyncio.TimeoutError):
            self._count("stale_connections")
            log.info("%s: no PONG within %s s after an ack timeout; reconnecting", self.t.name, self.t.ack_timeout_s)
            await self._on_disconnected()
            await self.nc.force_reconnect()
        finally:
            self._probing = False

    async def _flush(self, timeout: float) -> None:
        """``nc.flush(timeout)`` (a PING, wait for its PONG) without nats-py 2.16's trap: its flush cancels
        the PONG's future on a timeout but leaves it queued, and the PONG that comes later makes the
        client's read loop stop (``InvalidStateError``: "nats: encountered error"), so the connection
        reads nothing more, pings included, until nats-py finds it stale a minute later. Here the PONG
        is waited for in a task of its own that outlives the timeout (the reconnect forgets it)."""
        pong = asyncio.get_running_loop().create_task(self.nc.flush(timeout=_PONG_WAIT_S))
        self._tasks.add(pong)
        pong.add_done_callback(_forget(self._tasks))
        await asyncio.wait_for(asyncio.shield(pong), timeout)

    # -------------------------------------------------------------- subscribe

    async def register(self, local: LocalHandler, parts: Parts, wait_s: float | None = None) -> str | None:
        """Subscribe now when connected, else when the connection is (re)made. Connected, waits up to
        ``wait_s`` for the first try: None when made (or pending), else why not yet (the server did not
        answer in time, or not within ``wait_s``): the subscription then stays and is tried again in the
        background (:meth:`_retry_subscription`). Raises TransportError when refused."""
        if not (self.connected_once and self._connected()):
            self._pending.append((local, parts))
            return None
        caller = _Caller()
        task = asyncio.get_running_loop().create_task(self._first_try(local, parts, caller))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved"
        try:
            return await asyncio.wait_for(asyncio.shield(task), wait_s)
        except TimeoutError:
            caller.gone = True
            return f"the server did not answer within {wait_s} s"
        except asyncio.CancelledError:
            caller.gone = True
            raise

    async def _first_try(self, local: LocalHandler, parts: Parts, caller: _Caller) -> str | None:
        """:meth:`register`'s try, run on to its end when the caller stops waiting: a timeout then
        starts the retries, a refusal is logged (nobody else hears of it)."""
        try:
            await self._subscribe_local(local, parts)
        except _NotInTime as exc:
            self._not_made_yet(local, parts, exc)
            return str(exc)
        except TransportError as exc:
            if not caller.gone:
                raise
            self._refused(local, exc)
        return None

    async def _subscribe_local(self, local: LocalHandler, parts: Parts) -> bool:
        """Make ``local``'s subscriptions; False when it was unsubscribed meanwhile (nothing kept)."""
        subs: list[Any] = []
        try:
            for subjects, group, retained in parts:
                subs += await self.subscribe(subjects, group, retained, self.dispatcher.put)
        except BaseException:  # a refusal, a timeout, or the caller gave up waiting (cancelled)
            await asyncio.shield(self.unsubscribe(subs))
            raise
        if local.removed:
            await self.unsubscribe(subs)
            return False
        local.nats_subs = subs
        self._active = [a for a in self._active if not a[0].removed] + [(local, parts)]
        return True

    async def _drain_pending(self) -> None:
        pending, self._pending = self._pending, []
        for local, parts in pending:
            if local.removed:
                continue
            try:
                await self._subscribe_local(local, parts)
            except _NotInTime as exc:
                self._not_made_yet(local, parts, exc)
            except TransportError as exc:
                self._refused(local, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background until it ends or the transport closes (shutdown cancels it)."""
        if self.ended:  # closing: shutdown may have cancelled the others already
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _not_made_yet(self, local: LocalHandler, parts: Parts, exc: TransportError) -> None:
        """A subscription's setup timed out: count it, say so once per subscription, try again later."""
        self._timed_out(local, exc)
        self._spawn(self._retry_subscription(local, parts))

    def _timed_out(self, local: LocalHandler, exc: TransportError) -> None:
        """Count a timed-out setup of ``local``; the first is a warning, the others DEBUG."""
        self._count("subscribe_timeouts")
        local.setup_timeouts += 1
        if local.setup_timeouts == 1:
            log.warning("%s: subscription to %s not made yet (%s); tried again every %s to %s s until it is",
                        self.t.name, local.sub.filter, exc, RETRY_MIN_S, RETRY_MAX_S)
        else:
            log.debug("%s: subscription to %s still not made (%s)", self.t.name, local.sub.filter, exc)

    def _refused(self, local: LocalHandler, exc: TransportError) -> None:
        """A subscription the server refused (or could not make): counted and logged, not tried again."""
        self._count("subscribe_errors")
        log.warning("%s: subscription to %s not made: %s", self.t.name, local.sub.filter, exc)

    def _connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def _retry_subscription(self, local: LocalHandler, parts: Parts) -> None:
        """Try a timed-out subscription again with backoff until it is made, refused or unsubscribed.
        Disconnected meanwhile, it waits with the others for the next connection."""
        backoff = Backoff(RETRY_MIN_S, RETRY_MAX_S)
        while not self.ended and not local.removed:
            await asyncio.sleep(backoff.next())
            if self.ended or local.removed:
                return
            if not self._connected():
                self._pending.append((local, parts))  # _on_reconnected drains it
                return
            try:
                made = await self._subscribe_local(local, parts)
            except _NotInTime as exc:
                self._timed_out(local, exc)
                continue
            except TransportError as exc:
                self._refused(local, exc)
                return
            if made:
                self._count("subscribe_retried")
                log.info("%s: subscription to %s made after %d timed-out tries", self.t.name, local.sub.filter,
                         local.setup_timeouts)
            return

    async def subscribe(self, subjects: list[str], group: str | None, retained: bool, deliver: Callable[[Inbound], None]
                        ) -> list[Any]:
        """Core subscriptions for ``subjects`` (queue ``group``), then the retained messages of the
        matching subjects, then what arrived live meanwhile. Raises TransportError when refused
        (:class:`_NotInTime` when the server did not answer in time)."""
        held: list[Inbound] | None = []
        prefix = self.t.prefix

        async def on_msg(msg: Any) -> None:
            topic = subject_topic(msg.subject, prefix)
            if topic is None:
                return
            hdrs = msg.headers or {}
            item = Inbound(topic, msg.data, 1, False, headers_in(hdrs), hdrs.get("Nats-Msg-Id"))
            self._count("received_messages")
            if held is not None:
                held.append(item)
            elif self._hold is not None:
                self._hold.append((deliver, item))
            else:
                deliver(item)

        subs: list[Any] = []
        try:
            try:
                for s in subjects:
                    self._denied_subs.discard(s.lower())
                    subs.append(await self.nc.subscribe(s, queue=group or "", cb=on_msg))
                await self._flush(max(1, int(self.t.ack_timeout_s)))
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                await self._refuse_denied(subjects, subs)  # a refusal that came meanwhile is the reason
                msg = f"subscription to {', '.join(subjects)} not confirmed by the server: {exc!r}"
                raise (_NotInTime if isinstance(exc, _TRANSIENT) else TransportError)(msg) from None
            await self._refuse_denied(subjects, subs)
            if retained:
                try:
                    replay = [item for s in subjects for item in await self._retained(s)]
                except TransportError:
                    # the server's refusal of the subscription may come after an unrelated PONG ended the
                    # flush above; when it has come by now, it is the reason
                    await self._refuse_denied(subjects, subs)
                    raise
                for item in replay:
                    deliver(item)
        except BaseException:  # nothing half made stays: the core subscriptions would hold messages for ever
            await asyncio.shield(self.unsubscribe(subs))
            raise
        pending, held = held, None
        for item in pending:
            deliver(item)
        return subs

    async def _refuse_denied(self, subjects: list[str], subs: list[Any]) -> None:
        denied = [s for s in subjects if s.lower() in self._denied_subs]
        if denied:  # subscribe() unsubscribes ``subs``
            msg = f"subscription to NATS subject {denied[0]} refused: not authorized; check this user's subscribe permissions"
            raise TransportError(msg)

    async def _retained(self, subject: str) -> list[Inbound]:
        """The last retained message of every subject matching ``subject`` (empty ones left out)."""
        rsubject = f"{self.t.prefix}_retained." + subject.split(".", 1)[1]
        return await self._fetch(self.names.retained, rsubject, f"{self.t.prefix}_retained", True,
                                 DeliverPolicy.LAST_PER_SUBJECT, None)

    async def _replay_gaps(self) -> None:
        """After a reconnect: what the live stream holds for our (unshared) subscriptions since the
        connection dropped (minus a margin for clock differences), then the messages held meanwhile.
        The ids of messages delivered before the drop are remembered, so those are not handled twice."""
        since, self._down_since = self._down_since, None
        try:
            if since is not None:
                start = datetime.datetime.fromtimestamp(since - GAP_MARGIN_S, tz=datetime.timezone.utc)
                for local, parts in list(self._active):
                    if local.removed:
                        continue
                    for subjects, group, _retained in parts:
                        if group is not None:
                            continue
                        for s in subjects:
                            try:
                                items = await self._gap(s, start)
                            except TransportError as exc:
                                if self.remote_jetstream:  # out of reach again: the next answer replays it
                                    self._count("gap_replay_errors")
                                    self._lose_upstream(since)
                                    continue
                                if isinstance(exc, _NotInTime):
                                    self._count("gap_replay_timeouts")
                                    key = (id(local), s)
                                    if key in self._gap_retries:  # one retry per subject, from the oldest gap
                                        self._gap_retries[key] = min(self._gap_retries[key], start)
                                        self._count("gap_replay_merged")
                                        continue
                                    log.warning("%s: messages missed on %s while disconnected not replayed yet "
                                                "(%s); tried again every %s to %s s until they are", self.t.name,
                                                s, exc, RETRY_MIN_S, RETRY_MAX_S)
                                    self._gap_retries[key] = start
                                    self._spawn(self._retry_gap(local, s, key))
                                    continue
                                self._count("gap_replay_errors")
                                log.warning("%s: messages missed on %s while disconnected not replayed: %s",
                                            self.t.name, s, exc)
                                continue
                            for item in items:
                                self.dispatcher.put(item)
        finally:  # whatever happened, the live messages held back go on
            hold, self._hold = self._hold, None
            for deliver, item in hold or []:
                deliver(item)

    async def _gap(self, subject: str, start: datetime.datetime) -> list[Inbound]:
        """What the live stream holds for ``subject`` since ``start`` (counted as ``gap_replayed``)."""
        items = await self._fetch(self.names.live, subject, self.t.prefix, False, DeliverPolicy.BY_START_TIME, start)
        self._count("gap_replayed", len(items))
        return items

    async def _retry_gap(self, local: LocalHandler, subject: str, key: tuple[int, str]) -> None:
        """Replay a gap whose replay timed out, with backoff, until it is done, refused, unsubscribed or
        the transport closes. The live messages went on meanwhile: a replayed message handled before
        is dropped by its id, the others come after newer live ones. While disconnected it waits; a
        later reconnect replays its own gap besides; one that times out too is merged into this retry
        (``_gap_retries[key]``: the oldest start), so reconnects do not pile retries up."""
        try:
            await self._retry_gap_loop(local, subject, key)
        finally:
            self._gap_retries.pop(key, None)

    async def _retry_gap_loop(self, local: LocalHandler, subject: str, key: tuple[int, str]) -> None:
        backoff = Backoff(RETRY_MIN_S, RETRY_MAX_S)
        tries = 1
        while not self.ended and not local.removed:
            await asyncio.sleep(backoff.next())
            if self.ended or local.removed or not self._connected():
                continue
            try:
                items = await self._gap(subject, self._gap_retries[key])
            except _NotInTime as exc:
                tries += 1
                self._count("gap_replay_timeouts")
                log.debug("%s: messages missed on %s still not replayed (%s)", self.t.name, subject, exc)
                continue
            except TransportError as exc:
                self._count("gap_replay_errors")
                log.warning("%s: messages missed on %s while disconnected not replayed: %s", self.t.name, subject, exc)
                return
            self._count("gap_replay_retried")
            log.info("%s: messages missed on %s replayed after %d timed-out tries (%d messages)", self.t.name,
                     subject, tries, len(items))
            for item in items:
                self.dispatcher.put(item)
            return

    # ------------------------------------------------------ remote JetStream

    async def _jetstream_is_remote(self) -> bool:
        """Whether the JetStream this connection uses is another server's (a leaf node's account whose
        API calls are mapped to the hub's domain): its domain differs from the server's own."""
        try:
            info = await self.js.account_info()
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.info("%s: JetStream account info not read (%r); no upstream checks", self.t.name, exc)
            return False
        here = (self.nc._server_info or {}).get("domain") or ""
        return (info.domain or "") != here

    def _lose_upstream(self, since: float | None = None) -> None:
        """The remote JetStream is out of reach; what it got since ``since`` (default: its last answer to
        a check) is replayed once it answers again."""
        if not self.remote_jetstream:
            return
        when = self._upstream_ok_at if since is None else since
        if self._upstream_lost is None:
            self._upstream_lost = when
            self._count("upstream_lost")
            log.info("%s: the JetStream behind the leaf connection does not answer; its messages are "
                     "replayed when it does", self.t.name)
        else:
            self._upstream_lost = min(self._upstream_lost, when)

    async def _watch_upstream(self) -> None:
        """Ask the remote JetStream for its account info every ``upstream_check_s``. No answer: the
        leaf connection is down (the client's own connection to the leaf server is not), so the hub's
        messages for this client's subscriptions stop; the first answer after that replays what the
        hub's live stream got for them since the last answer before (the gap replay of a reconnect:
        the ids already handled are dropped, live messages wait until the gap's are delivered).

        A leaf connection that dropped and came back between two checks, unseen, is not replayed;
        the leaf server's own reconnect delay (``reconnect``, 1 s in
        :func:`edgeflow.broker.nats.nats_site_config`) and its ping timeout make that short.
        On a JetStream of the server's own (a direct connection) it returns at once."""
        self._upstream_ok_at = time.time()
        if not await self._jetstream_is_remote():
            return
        self.remote_jetstream = True
        while not self.ended:
            await asyncio.sleep(self.t.upstream_check_s)
            if not self.up or self.nc is None or not self.nc.is_connected:
                continue  # the connection itself is down: its reconnect replays the gap
            asked = time.time()
            try:
                await self.js.account_info()
            except (nats.errors.Error, asyncio.TimeoutError):
                self._lose_upstream()
                continue
            self._upstream_ok_at = asked
            if self._upstream_lost is None or not self.up:
                continue
            lost, self._upstream_lost = self._upstream_lost, None
            self._count("upstream_back")
            if self._down_since is not None:  # a reconnect is replaying already; it takes the older gap
                self._down_since = min(self._down_since, lost)
                continue
            self._down_since = lost
            if self._hold is None:
                self._hold = []
            await self._replay_gaps()

    async def _fetch(self, stream: str, subject: str, prefix: str, retain: bool, policy: DeliverPolicy,
                     start: datetime.datetime | None) -> list[Inbound]:
        """Every message a short-lived consumer on ``stream`` with ``policy`` gives for ``subject``."""
        name = f"ef_{uuid.uuid4().hex[:16]}"
        cfg = ConsumerConfig(name=name, filter_subject=subject, deliver_policy=policy, opt_start_time=start,
                             ack_policy=AckPolicy.EXPLICIT, inactive_threshold=30.0, mem_storage=True,
                             max_ack_pending=-1)
        out: list[Inbound] = []
        psub = None
        self._denied_api = {s for s in self._denied_api if stream.lower() not in s.split(".")}
        try:
            info = await self.js.add_consumer(stream, cfg)
            pending = info.num_pending
            psub = await self.js.pull_subscribe_bind(name, stream) if pending else None
            while pending and psub is not None:
                for m in await psub.fetch(min(pending, 256), timeout=self.t.ack_timeout_s):
                    pending = m.metadata.num_pending
                    if retain and not m.data:
                        continue
                    topic = subject_topic(m.subject, prefix)
                    if topic is not None:
                        hdrs = m.headers or {}
                        out.append(Inbound(topic, m.data, 1, retain, headers_in(hdrs), hdrs.get("Nats-Msg-Id")))
            if psub is not None:
                await psub.unsubscribe()
                psub = None
            await self.js.delete_consumer(stream, name)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            if psub is not None:  # its inbox subscription would outlive the try; the consumer expires by itself
                await self.unsubscribe([psub])
            denied = sorted(s for s in self._denied_api if stream.lower() in s.split("."))
            if denied:  # the server refused the request (-ERR) and nats-py waited for an answer in vain
                raise TransportError(f"reading stream {stream} for {subject} refused: not authorized (NATS subject "
                                     f"{denied[0]}); check the user's JetStream permissions") from None
            msg = f"stream {stream} could not be read for {subject}: {exc!r}"
            if isinstance(exc, _TRANSIENT):
                raise _NotInTime(msg) from None
            raise TransportError(f"{msg}; check the user's JetStream permissions") from None
        return out

    async def unsubscribe(self, subs: list[Any]) -> None:
        for sub in subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error as exc:
                log.info("%s: unsubscribe: %s (the connection is gone; so is the subscription)", self.t.name, exc)

    # ------------------------------------------------------------------ close

    def close(self, budget: CloseBudget, *, abort: bool) -> None:
        """Say goodbye (:meth:`shutdown`), then stop the loop, end every task on it and close it, all by
        ``budget.end``; what does not end in time is logged once, with why."""
        with self._thread_lock:  # a loop never started (no connect, no subscribe) is closed here
            if not self._thread.is_alive():
                if not self.loop.is_closed():
                    self.loop.close()
                return
        try:
            self.submit(self.shutdown(abort=abort, by=budget.goodbye_by), budget.left(budget.end))
        except TransportError as exc:  # the loop did not answer in time: its tasks are ended once it stops
            self._count("close_errors")
            self.last_error = exc
            log.warning("%s: NATS close: %s; the connection is dropped with the loop", self.t.name, exc)
        self._stop_loop(budget.end)

    async def shutdown(self, *, abort: bool, by: float) -> None:
        """Stop sending and say goodbye by ``by`` (:meth:`_goodbye`). A goodbye the server does not
        answer in time is logged and the connection dropped; its tasks end with the others."""
        self.ended = True
        if self._wake is not None:
            self._wake.set()
        nc = self.nc
        if nc is None:
            return
        try:
            await asyncio.wait_for(self._goodbye(nc, abort=abort), CloseBudget.left(by))
        except TimeoutError:
            will = " (the will record stays: the will may be published)" if self.t.will and not abort else ""
            log.warning("%s: NATS close did not finish within its timeout (the server did not answer); "
                        "the connection is dropped%s", self.t.name, will)
            _drop(nc)

    async def _goodbye(self, nc: Any, *, abort: bool) -> None:
        """A clean close deletes the will record, then closes nats-py's client; an abort drops the
        connection first (the will record stays, like a crash)."""
        if abort:
            _drop(nc)
        else:
            try:
                await self.clear_will()
            except TransportError as exc:
                log.warning("%s: will record not deleted on close (%s): the will may be published", self.t.name, exc)
        try:
            await nc.close()
        except (nats.errors.Error, OSError) as exc:
            log.info("%s: NATS close: %r", self.t.name, exc)

    def fail_inflight(self) -> None:
        for frame in list(self._inflight.values()) + [f for _, f in self._retry]:
            if frame.delivery is not None:
                frame.delivery.fail(TransportError(f"transport closed before {frame.topic} was acknowledged"))
        self._inflight.clear()
        self._retry.clear()

    def _stop_loop(self, by: float) -> None:
        """Stop the loop; its thread then ends what is left on it by ``by`` and closes it (:meth:`_run`)."""
        self._close_by = by
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CloseBudget.left(by))
        if self._thread.is_alive():
            log.warning("%s: the NATS event loop did not stop within close's timeout (a busy machine, or a "
                        "callback that blocks it); its thread ends its tasks and closes it by itself", self.t.name)

    def _run(self) -> None:
        """The loop thread: run the loop until :meth:`_stop_loop`, then end every task still on it and
        close it (nats-py's close cancels its reader, pinger, flusher and subscription tasks without
        waiting for them; a loop closed with them pending has them destroyed pending)."""
        self.loop.run_forever()
        self.loop.run_until_complete(self._end_tasks(self._close_by))
        self.loop.close()

    async def _end_tasks(self, by: float) -> None:
        """Cancel every other task on this (private) loop, the link's and nats-py's, and wait for them
        until ``by``; again for tasks their cancellation started, while time is left. What still runs
        then is logged."""
        me = asyncio.current_task()
        while tasks := {t for t in asyncio.all_tasks() if t is not me}:
            for t in tasks:
                t.cancel()
            done, pending = await asyncio.wait(tasks, timeout=CloseBudget.left(by))
            for t in done:  # retrieved: no "exception was never retrieved" when they are collected
                if not t.cancelled():
                    t.exception()
            late = pending or ({t for t in asyncio.all_tasks() if t is not me} if not CloseBudget.left(by) else set())
            if late:
                names = ", ".join(sorted(t.get_coro().__qualname__ for t in late))
                log.warning("%s: %d NATS task(s) did not end within close's timeout after being cancelled (%s); "
                            "they are dropped with the loop", self.t.name, len(late), names)
                return


def _drop(nc: Any) -> None:
    """Drop nats-py's TCP connection at once, like a crash, and keep nats-py from reconnecting."""
    nc.options["allow_reconnect"] = False
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    if writer is not None:
        writer.transport.abort()


def _forget(tasks: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    """A done callback: drop the task from ``tasks`` and retrieve its outcome (nobody else waits for it)."""
    def done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()
    return done


def _inbox_token(client_id: str) -> str:
    return encode_level(client_id)
