"""WillKeeper: last wills for NATS, which has none of its own.

MQTT brokers publish a client's will when its connection ends without a
clean DISCONNECT. NATS has no will, so edgeflow builds one from two parts:

1. every :class:`~.facade.NatsTransport` with a ``will`` writes a *will
   record* to the JetStream stream ``<PREFIX>_WILLS`` on each connection
   (subject ``<prefix>_will.<client id>``, one message per subject): the
   topic, payload, QoS, retain flag, delay and the server's id for this
   connection; a clean ``close()`` deletes it (an empty record) before it
   disconnects, ``close(abort=True)`` and a crash leave it;
2. the keeper (this class) listens to the server's disconnect events
   (``$SYS.ACCOUNT.*.DISCONNECT``, which needs a system-account user: the
   config from :func:`edgeflow.broker.nats.nats_fleet_config` has one) and,
   when a connection ends whose record is still there *and names that
   connection*, publishes the will (after ``delay_s``, unless the client
   wrote a newer record meanwhile: it reconnected) and deletes the record.

A record names its connection, so the end of an old connection after the
client already reconnected publishes nothing. The keeper publishes with its
own (operator) rights, so it checks each will against the rights of the
user who stored it (``may_publish(user, subject)``, e.g.
:meth:`edgeflow.broker.nats.NatsFleetConfig.may_publish`): a device cannot
make the keeper publish where it may not publish itself.

What differs from MQTT: the will needs the keeper running (one per server,
beside the gateway or the server); a will whose connection ended while the
keeper was down, or while the server itself was down (no event is sent),
is not published.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import nats
import nats.errors
import nats.js.errors

from edgeflow.errors import TransportError
from edgeflow.transport.nats.subjects import (
    DEFAULT_PREFIX,
    StreamNames,
    retained_subject,
    topic_subject,
    will_subject,
)

__all__ = ["WillKeeper"]

log = logging.getLogger("edgeflow.transport")


class WillKeeper:
    """Publishes the wills of NATS connections that ended without a clean close (module docstring)."""

    def __init__(self, url: str, *, system_user: str, system_password: str, user: str | None = None,
                 password: str | None = None, prefix: str = DEFAULT_PREFIX, tls: Any = None,
                 may_publish: Callable[[str | None, str], bool] | None = None) -> None:
        self.url = url
        self._sys = (system_user, system_password)
        self._user = (user, password)
        self.prefix = prefix
        self.names = StreamNames(prefix)
        self.tls = tls
        self.may_publish = may_publish
        self.stats: Counter[str] = Counter()
        self.published = threading.Event()
        """Set after each will published (tests wait on it)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="edgeflow-nats-will-keeper", daemon=True)
        self._conns: list[Any] = []
        self._js: Any = None
        self._handling: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        """Wills being handled now (waiting out a delay or talking to JetStream)."""
        return len(self._handling)

    def start(self, timeout: float = 10.0) -> WillKeeper:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        try:
            fut.result(timeout)
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            self.stop()
            raise TransportError(f"will keeper could not connect to {self.url}: {exc!r}") from None
        return self

    async def _start(self) -> None:
        sys_nc = await nats.connect(self.url, user=self._sys[0], password=self._sys[1], tls=self.tls,
                                    name="edgeflow-will-keeper-sys", max_reconnect_attempts=-1)
        self._conns.append(sys_nc)
        nc = await nats.connect(self.url, user=self._user[0], password=self._user[1], tls=self.tls,
                                name="edgeflow-will-keeper", max_reconnect_attempts=-1)
        self._conns.append(nc)
        self._js = nc.jetstream(timeout=5.0)
        await sys_nc.subscribe("$SYS.ACCOUNT.*.DISCONNECT", cb=self._on_event)
        await sys_nc.flush()

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the wills still being handled (a will whose delay has not run out is not published),
        closes the connections and the event loop; no task is left pending on it."""
        async def close() -> None:
            for task in list(self._handling):
                task.cancel()
            await asyncio.gather(*self._handling, return_exceptions=True)
            for nc in self._conns:
                try:
                    await nc.close()
                except nats.errors.Error as exc:
                    log.info("will keeper: close: %r", exc)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    async def _on_event(self, msg: Any) -> None:
        try:
            client = json.loads(msg.data).get("client", {})
        except ValueError:
            self.stats["bad_events"] += 1
            return
        name, cid = client.get("name"), client.get("id")
        if name and cid is not None and self._js is not None:
            task = asyncio.get_running_loop().create_task(self._handle(str(name), int(cid), client.get("user")))
            self._handling.add(task)
            task.add_done_callback(self._handling.discard)

    async def _record(self, subject: str) -> tuple[int, dict[str, Any]] | None:
        try:
            raw = await self._js.get_last_msg(self.names.wills, subject)
        except nats.js.errors.NotFoundError:
            return None
        if not raw.data:
            return None
        return int(raw.seq), json.loads(raw.data)

    async def _handle(self, client_id: str, cid: int, user: str | None) -> None:
        subject = will_subject(client_id, self.prefix)
        try:
            found = await self._record(subject)
            if found is None:
                return
            seq, rec = found
            if rec.get("cid") != cid or rec.get("client_id") != client_id:
                self.stats["stale_events"] += 1
                return
            if int(rec.get("delay_s") or 0) > 0:
                await asyncio.sleep(int(rec["delay_s"]))
                again = await self._record(subject)
                if again is None or again[0] != seq:
                    self.stats["cancelled_by_reconnect"] += 1
                    return
            await self._publish(subject, seq, rec, user)
        except (nats.errors.Error, asyncio.TimeoutError, ValueError, KeyError) as exc:
            self.stats["errors"] += 1
            log.warning("will keeper: the will of %s was not published: %r", client_id, exc)

    async def _publish(self, subject: str, seq: int, rec: dict[str, Any], user: str | None) -> None:
        topic = str(rec["topic"])
        live = topic_subject(topic, self.prefix)
        if self.may_publish is not None and not self.may_publish(user, live):
            self.stats["refused"] += 1
            log.warning("will keeper: the will of %s names %s, where user %s may not publish; not published",
                        rec.get("client_id"), topic, user)
            await self._js.publish(subject, b"")
            return
        payload = base64.b64decode(rec.get("payload", ""))
        headers = {"Nats-Msg-Id": f"will-{rec.get('client_id')}-{seq}"}
        if rec.get("retain"):
            await self._js.publish(retained_subject(topic, self.prefix), payload, headers=headers)
        await self._js.publish(live, payload, headers=headers)
        await self._js.publish(subject, b"")
        self.stats["published"] += 1
        self.published.set()
