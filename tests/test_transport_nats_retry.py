"""A NATS subscription whose setup times out is tried again (issue 35).

At 1,000 devices connecting at once, one device's read of the retained stream (the short-lived
consumer on ``EF_RETAINED`` that gives it the global model) timed out; the transport logged
"subscription ... not made" and never tried again, so that device never trained. The same held
for the gap replay after a reconnect (a consumer on ``EF_LIVE``): a timed-out replay was dropped.

The timeouts here are real: the devices reach a real nats-server through :class:`JsApiSink`, a
proxy that speaks enough of the NATS client protocol to swallow the first N JetStream API
requests that create a consumer on a given stream. The server never sees them, so nats-py's
request times out exactly as when an overloaded server does not answer in time; or it holds what
the server sends for a while (a PONG that comes late). A permission refusal (the server's
``-ERR 'Permissions Violation'``) is not retried.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install -e '.[nats]')")

from _brokers import Inbox, stays, wait_until  # noqa: E402
from edgeflow.errors import TransportError  # noqa: E402
from edgeflow.transport.broker import NatsServer, find_nats_server  # noqa: E402
from edgeflow.transport.nats import NatsTransport  # noqa: E402

pytestmark = pytest.mark.skipif(find_nats_server() is None, reason="nats-server is not installed")

MODEL = "edgeflow/lab/gateway/model"
ROUND = "edgeflow/lab/gateway/round"
FAST: dict[str, Any] = {"ack_timeout_s": 0.5, "reconnect_min_s": 0.05, "connect_timeout_s": 5.0,
                        "upstream_check_s": 0}


class JsApiSink:
    """A TCP proxy to a nats-server that drops the first ``drops[stream]`` client requests creating a
    consumer on ``stream`` (``PUB``/``HPUB $JS.API.CONSUMER.[DURABLE.]CREATE.<stream>...``), and the
    first ``drops["info:<stream>"]`` asking for that stream's info; every
    other byte passes unchanged. ``refuse`` closes new connections at once (the server away);
    :meth:`cut` aborts the open ones; :meth:`hold` keeps what the server sends until released."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.drops: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.refuse = False
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="js-api-sink", daemon=True)

    def start(self) -> JsApiSink:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def hold(self, on: bool) -> None:
        self._loop.call_soon_threadsafe(self._down_open.clear if on else self._down_open.set)

    async def _listen(self) -> int:
        self._down_open = asyncio.Event()
        self._down_open.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def cut(self) -> None:
        async def abort() -> None:
            for w in list(self._writers):
                w.transport.abort()
        asyncio.run_coroutine_threadsafe(abort(), self._loop).result(10)

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _swallow(self, subject: str) -> bool:
        words = subject.split(".")
        if words[:4] == ["$JS", "API", "STREAM", "INFO"] and len(words) == 5:
            stream: str | None = f"info:{words[4]}"  # drops["info:EF_LIVE"]: the stream checks on connect
        elif words[:3] != ["$JS", "API", "CONSUMER"]:
            return False
        else:
            stream = words[5] if words[3:5] == ["DURABLE", "CREATE"] else words[4] if words[3] == "CREATE" else None
        if stream is None:
            return False
        self.seen[stream] = self.seen.get(stream, 0) + 1
        if self.drops.get(stream, 0) <= 0:
            return False
        self.drops[stream] -= 1
        self.dropped[stream] = self.dropped.get(stream, 0) + 1
        return True

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        if self.refuse:
            cwriter.transport.abort()
            return
        sreader, swriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers.update((cwriter, swriter))

        async def down() -> None:  # server -> client: as is
            while data := await sreader.read(65536):
                await self._down_open.wait()
                cwriter.write(data)
                await cwriter.drain()

        async def up() -> None:  # client -> server: command by command
            while line := await creader.readline():
                words = line.split()
                body = b""
                if words and words[0].upper() in (b"PUB", b"HPUB"):
                    body = await creader.readexactly(int(words[-1]) + 2)
                    if self._swallow(words[1].decode()):
                        continue
                swriter.write(line + body)
                await swriter.drain()

        tasks = [asyncio.ensure_future(down()), asyncio.ensure_future(up())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (cwriter, swriter):
                w.transport.abort()
                self._writers.discard(w)


@pytest.fixture
def server() -> Iterator[NatsServer]:
    srv = NatsServer().start()
    NatsTransport(port=srv.port, client_id="stream-maker").connect(10).close()  # the streams exist
    yield srv
    srv.stop()


@pytest.fixture
def sink(server: NatsServer) -> Iterator[JsApiSink]:
    s = JsApiSink(server.port).start()
    yield s
    s.stop()


@pytest.fixture
def made() -> Iterator[list[NatsTransport]]:
    ts: list[NatsTransport] = []
    yield ts
    for t in ts:
        t.close(timeout=2.0, flush=False)


def _publish_model(server: NatsServer, payload: bytes) -> None:
    with NatsTransport(port=server.port, client_id="gateway") as gw:
        gw.publish(MODEL, payload, retain=True).wait(10)


def test_a_device_whose_retained_read_times_out_at_connect_still_gets_the_model(
        server: NatsServer, sink: JsApiSink, made: list[NatsTransport]) -> None:
    """The benchmark's device: it subscribes before connecting; the first two reads of the retained
    stream get no answer. It must still receive the retained global model (the old transport logged
    "not made" and never asked again)."""
    _publish_model(server, b"global model v1")
    sink.drops["EF_RETAINED"] = 2
    dev = NatsTransport(port=sink.port, client_id="dev-1", **FAST)
    made.append(dev)
    inbox = Inbox()
    dev.subscribe(MODEL, inbox)
    dev.connect(10)
    msg = inbox.wait(1, timeout=20)[0]
    assert (msg.payload, msg.retain) == (b"global model v1", True)
    assert sink.dropped["EF_RETAINED"] == 2
    assert wait_until(lambda: dev.stats().get("subscribe_retried") == 1, 5)  # counted once made, after the delivery
    st = dev.stats()
    assert st["subscribe_timeouts"] == 2 and st.get("subscribe_errors", 0) == 0
    # made once: live messages come once, the retained one is not read again
    with NatsTransport(port=server.port, client_id="gateway") as gw:
        gw.publish(MODEL, b"global model v2", retain=True).wait(10)
    assert [m.payload for m in inbox.wait(2)] == [b"global model v1", b"global model v2"]


def test_a_connected_subscribe_that_times_out_says_so_and_is_made_later(
        server: NatsServer, sink: JsApiSink, made: list[NatsTransport]) -> None:
    _publish_model(server, b"global model v1")
    dev = NatsTransport(port=sink.port, client_id="dev-2", **FAST).connect(10)
    made.append(dev)
    sink.drops["EF_RETAINED"] = 1
    inbox = Inbox()
    with pytest.raises(TransportError, match="retried in the background"):
        dev.subscribe(MODEL, inbox)
    assert inbox.wait(1, timeout=20)[0].payload == b"global model v1"
    assert wait_until(lambda: dev.stats().get("subscribe_retried") == 1, 5)


def test_a_subscribe_that_outlasts_its_timeout_stays_and_is_made_later(
        server: NatsServer, sink: JsApiSink, made: list[NatsTransport]) -> None:
    """The caller's ``timeout`` ends before the server's (JetStream API) timeout: the try goes on
    after the caller was told, and its timeout starts the retries (the old transport cancelled it
    and dropped the subscription)."""
    _publish_model(server, b"global model v1")
    dev = NatsTransport(port=sink.port, client_id="dev-5", **{**FAST, "ack_timeout_s": 2.0}).connect(10)
    made.append(dev)
    sink.drops["EF_RETAINED"] = 1
    inbox = Inbox()
    with pytest.raises(TransportError, match=r"within 0.5 s\); it stays and is retried in the background"):
        dev.subscribe(MODEL, inbox, timeout=0.5)
    assert inbox.wait(1, timeout=20)[0].payload == b"global model v1"
    assert wait_until(lambda: dev.stats().get("subscribe_retried") == 1, 5)
    assert dev.stats()["subscribe_timeouts"] == 1


def test_a_pong_that_comes_after_the_flush_timed_out_does_not_deafen_the_connection(
        server: NatsServer, sink: JsApiSink, made: list[NatsTransport]) -> None:
    """The core subscription's PING/PONG times out (the server's answers held for a while), then the
    PONG comes. nats-py's own flush left the cancelled future queued and the late PONG stopped its
    read loop: the connection stayed "connected" and read nothing, the retries timed out until
    nats-py's pings found it stale (a minute). Seen with 1,000 devices and a 0.5 s ack timeout."""
    _publish_model(server, b"global model v1")
    dev = NatsTransport(port=sink.port, client_id="dev-6", **FAST).connect(10)  # flush timeout: 1 s
    made.append(dev)
    sink.hold(True)
    inbox = Inbox()
    with pytest.raises(TransportError, match="not confirmed by the server.*retried in the background"):
        dev.subscribe(MODEL, inbox)
    sink.hold(False)  # the PONG (and whatever else was held) arrives late
    assert inbox.wait(1, timeout=15)[0].payload == b"global model v1"
    assert wait_until(lambda: dev.stats().get("subscribe_retried") == 1, 5)


def test_a_first_connect_whose_stream_check_timed_out_does_not_hold_live_messages_back(
        server: NatsServer, sink: JsApiSink, made: list[NatsTransport]) -> None:
    """The first connection's stream check times out, so that connection is closed and the next one
    made. Closing it ran the disconnect handler, which started holding live messages back until a
    reconnect's replay; no reconnect came, so the device never saw a live message (22 of 1,000
    devices in a run with a 0.5 s ack timeout never got the round announcement)."""
    _publish_model(server, b"global model v1")
    sink.drops["info:EF_LIVE"] = 1
    dev = NatsTransport(port=sink.port, client_id="dev-7", **FAST)
    made.append(dev)
    models, rounds = Inbox(), Inbox()
    dev.subscribe(MODEL, models)
    dev.subscribe(ROUND, rounds)
    dev.connect(10)
    assert sink.dropped["info:EF_LIVE"] == 1 and dev.stats()["connects"] == 1
    assert models.wait(1)[0].payload == b"global model v1"
    with NatsTransport(port=server.port, client_id="gateway") as gw:
        gw.publish(ROUND, b"round 1").wait(10)
    assert rounds.wait(1, timeout=10)[0].payload == b"round 1"


def test_an_unsubscribe_stops_the_retries(server: NatsServer, sink: JsApiSink, made: list[NatsTransport]) -> None:
    _publish_model(server, b"global model v1")
    sink.drops["EF_RETAINED"] = 1_000
    dev = NatsTransport(port=sink.port, client_id="dev-3", **FAST).connect(10)
    made.append(dev)
    inbox = Inbox()
    with pytest.raises(TransportError, match="retried in the background"):
        dev.subscribe(MODEL, inbox)
    assert wait_until(lambda: dev.stats().get("subscribe_timeouts", 0) >= 2, 20)
    dev.unsubscribe(MODEL)
    before = sink.seen["EF_RETAINED"]
    # one attempt may be in flight; without the unsubscribe two more would come within 4 s
    # (the steps after two timeouts: 1 s and 2 s, each plus the 0.5 s timeout)
    stays(lambda: sink.seen["EF_RETAINED"] - before >= 2, for_s=6.0,
          reason="the subscription was still retried after its unsubscribe")
    assert not inbox.messages


def test_a_gap_replay_that_times_out_is_retried(server: NatsServer, sink: JsApiSink,
                                                made: list[NatsTransport]) -> None:
    """A round announcement published while the device was away comes from the live stream's
    replay after the reconnect; the first replay gets no answer. The old transport dropped it."""
    dev = NatsTransport(port=sink.port, client_id="dev-4", **FAST).connect(10)
    made.append(dev)
    inbox = Inbox()
    dev.subscribe(ROUND, inbox)
    sink.refuse = True
    sink.cut()
    assert wait_until(lambda: not dev.is_connected, 10)
    with NatsTransport(port=server.port, client_id="gateway") as gw:
        gw.publish(ROUND, b"round 7").wait(10)
    sink.drops["EF_LIVE"] = 1
    sink.refuse = False
    assert inbox.wait(1, timeout=30)[0].payload == b"round 7"
    assert sink.dropped["EF_LIVE"] == 1
    st = dev.stats()
    assert st["gap_replay_timeouts"] == 1 and st["gap_replay_retried"] == 1 and st["gap_replayed"] == 1


def _outage(sink: JsApiSink, dev: NatsTransport, during: Any = None) -> None:
    sink.refuse = True
    sink.cut()
    assert wait_until(lambda: not dev.is_connected, 10)
    if during is not None:
        during()
    sink.refuse = False
    assert wait_until(lambda: dev.is_connected, 20)


def test_gap_replays_that_keep_timing_out_are_one_retry_from_the_oldest_gap(
        server: NatsServer, sink: JsApiSink, made: list[NatsTransport]) -> None:
    """Three outages whose replays all time out: one retry per subject (not one more per reconnect),
    replaying from the first outage, so what was published then still arrives."""
    dev = NatsTransport(port=sink.port, client_id="dev-8", **FAST).connect(10)
    made.append(dev)
    inbox = Inbox()
    dev.subscribe(ROUND, inbox)
    sink.drops["EF_LIVE"] = 1_000

    def announce() -> None:
        with NatsTransport(port=server.port, client_id="gateway") as gw:
            gw.publish(ROUND, b"round 1").wait(10)

    _outage(sink, dev, announce)
    assert wait_until(lambda: dev.stats().get("gap_replay_timeouts", 0) >= 1, 10)
    for merged in (2, 4):  # two subjects each time: the topic's and its chunk sub-filter's
        _outage(sink, dev)
        assert wait_until(lambda: dev.stats().get("gap_replay_merged", 0) == merged, 10)
    sink.drops["EF_LIVE"] = 0
    assert inbox.wait(1, timeout=30)[0].payload == b"round 1"
    assert wait_until(lambda: dev.stats().get("gap_replay_retried") == 2, 15)  # one per subject
    assert dev.stats()["gap_replay_merged"] == 4


DENIED_CONFIG = """
accounts {
  FLEET {
    jetstream: enabled
    users: [
      {user: admin, password: admin}
      {user: dev, password: dev, permissions: {
        publish: {allow: ["ef.>", "$JS.API.INFO"]}
        subscribe: {allow: ["ef.>", "_INBOX.>"]}
      }}
    ]
  }
}
"""


def test_a_refused_retained_read_fails_at_once_and_is_not_retried(made: list[NatsTransport]) -> None:
    """The user may subscribe to the subject but not create consumers (the JetStream API denied):
    the server's refusal is the error, named as such, and the subscription is not retried."""
    srv = NatsServer(extra_config=DENIED_CONFIG).start()
    try:
        NatsTransport(port=srv.port, client_id="stream-maker", username="admin", password="admin").connect(10).close()
        dev = NatsTransport(port=srv.port, client_id="dev", username="dev", password="dev", create_streams=False,
                            **{**FAST, "ack_timeout_s": 1.0}).connect(10)
        made.append(dev)
        with pytest.raises(TransportError, match="not authorized"):
            dev.subscribe(MODEL, Inbox())
        assert dev.stats().get("subscribe_timeouts", 0) == 0
    finally:
        for t in made:
            t.close(timeout=2.0, flush=False)
        made.clear()
        srv.stop()
