"""NatsTransport.close(timeout) ends every task it started before closing its event loop.

Devices of benchmarks/transport_nats.py closing with ``timeout=0.2`` printed asyncio's "Task was
destroyed but it is pending!": the goodbye (the will record's deletion, a JetStream publish) did not
finish in time, the facade cancelled it half way and stopped the loop, so nats-py's reader, pinger,
flusher and subscription tasks (cancelled by nats-py's close without being awaited, or not
cancelled at all) and the link's sender were left pending on a closed loop. Here the server is
stopped (SIGSTOP) before the close, as a server busy with many devices does not answer in time.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install -e '.[nats]')")

from edgeflow.errors import TransportError  # noqa: E402
from edgeflow.transport.broker import NatsServer, find_nats_server  # noqa: E402
from edgeflow.transport.message import Will  # noqa: E402
from edgeflow.transport.nats import NatsTransport  # noqa: E402

pytestmark = pytest.mark.skipif(find_nats_server() is None, reason="nats-server is not installed")

MODEL = "edgeflow/lab/gateway/model"
FAST: dict[str, Any] = {"ack_timeout_s": 2.0, "reconnect_min_s": 0.05, "connect_timeout_s": 5.0}
LEFT_PENDING = ("Task was destroyed but it is pending", "was never awaited", "exception was never retrieved",
                "Event loop is closed")


class AsyncioLeftovers:
    """What asyncio reports of tasks and coroutines dropped unfinished: its logger's records,
    warnings (``coroutine ... was never awaited``) and exceptions raised in finalizers."""

    def __init__(self) -> None:
        self.reports: list[str] = []

    def __enter__(self) -> AsyncioLeftovers:
        gc.collect()  # what earlier tests left is theirs (a CI run caught a keeper of test_transport_contract here)
        self._handler = _Collect(self.reports)
        logging.getLogger("asyncio").addHandler(self._handler)
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        self._hook = sys.unraisablehook
        sys.unraisablehook = lambda u: self.reports.append(f"{u.err_msg}: {u.exc_value!r} ({u.object!r})")
        return self

    def __exit__(self, *exc: object) -> None:
        gc.collect()
        sys.unraisablehook = self._hook
        self._warnings.__exit__(None, None, None)
        logging.getLogger("asyncio").removeHandler(self._handler)
        self.reports += [str(w.message) for w in self._caught]

    def left_pending(self) -> list[str]:
        return [r for r in self.reports if any(s in r for s in LEFT_PENDING)]


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@pytest.fixture
def server() -> Iterator[NatsServer]:
    srv = NatsServer().start()
    with NatsTransport(port=srv.port, client_id="gateway", **FAST) as gw:  # the streams, a retained model
        gw.publish(MODEL, b"model", retain=True).wait(10)
    yield srv
    srv.stop()  # it sends SIGCONT first


def _pause(srv: NatsServer) -> None:
    os.kill(srv._state["proc"].pid, signal.SIGSTOP)


def _device(srv: NatsServer, name: str) -> NatsTransport:
    """A device as the benchmark's: a will, the model (a read of the retained stream), connected."""
    t = NatsTransport(port=srv.port, client_id=name, will=Will(f"edgeflow/lab/{name}/status", b"gone"), **FAST)
    got = threading.Event()
    t.subscribe(MODEL, lambda m: got.set())
    t.connect(10)
    assert got.wait(10)
    return t


def _loop_threads(name: str) -> list[threading.Thread]:
    return [th for th in threading.enumerate() if th.name == f"edgeflow-nats-loop-{name}" and th.is_alive()]


def _loop_thread_ended(name: str) -> bool:
    """Whether the transport's loop thread ends (on a busy machine it may finish after close returned)."""
    for th in _loop_threads(name):
        th.join(10)
    return not _loop_threads(name)


def test_a_close_the_server_does_not_answer_in_time_leaves_no_task_pending(
        server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edgeflow.transport")
    with AsyncioLeftovers() as leftovers:
        t = _device(server, "pi-1")
        _pause(server)
        d = t.publish("edgeflow/lab/pi-1/update", b"u" * 100)  # its PubAck will not come either
        t.close(timeout=0.2)
        with pytest.raises(TransportError, match="closed before"):
            d.wait(1)
        assert _loop_thread_ended("pi-1")
        del t
    assert leftovers.left_pending() == []
    why = [r.getMessage() for r in caplog.records if "did not finish within" in r.getMessage()]
    assert why and len(set(why)) == len(why), why  # said, once per cause


def test_a_close_on_an_answering_server_leaves_no_task_pending_and_says_nothing(
        server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="edgeflow.transport")
    with AsyncioLeftovers() as leftovers:
        t = _device(server, "pi-2")
        t.publish("edgeflow/lab/pi-2/update", b"u" * 100).wait(10)
        t.close(timeout=5.0)  # time enough for the goodbye on a busy machine: nothing to say
        assert _loop_thread_ended("pi-2")
        del t
    assert leftovers.left_pending() == []
    assert [r.getMessage() for r in caplog.records] == []


def test_a_transport_that_only_subscribed_offline_ends_its_loop_on_close() -> None:
    """subscribe() before connect() starts the loop thread; close() without a connect ended nothing."""
    with AsyncioLeftovers() as leftovers:
        t = NatsTransport("127.0.0.1", 1, client_id="offline-sub")
        t.subscribe(MODEL, lambda m: None)
        assert _loop_threads("offline-sub")
        t.close(timeout=0.2)
        assert _loop_thread_ended("offline-sub")
        del t
    assert leftovers.left_pending() == []
