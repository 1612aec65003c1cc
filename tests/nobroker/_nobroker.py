"""``pytest -p _nobroker``: run tests as on a machine with no MQTT broker at all.

A measuring aid (docs/transport.md, "Tests without a broker"): with this plugin
no broker can be started or reached, so a test that needs one skips or fails,
and the tests that *pass* are the ones that run without a broker.

- the Mosquitto binary is not found (``find_mosquitto`` returns None, PATH loses
  the sbin directories), and starting :class:`MosquittoBroker` or the embedded
  amqtt :class:`EmbeddedBroker` skips the test;
- TCP connections to the well-known MQTT ports (1883, 8883) are refused;
- subprocesses (``edgeflow demo`` ...) inherit the same rules through a
  ``sitecustomize`` on PYTHONPATH.

Use: ``PYTHONPATH=tests/nobroker python -m pytest -p _nobroker tests/...``.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MQTT_PORTS = frozenset({1883, 8883})


class NoBroker(RuntimeError):
    """Raised where a broker would start (in subprocesses, where pytest.skip means nothing)."""


def _unavailable(what: str) -> None:
    if "pytest" in sys.modules and os.environ.get("EDGEFLOW_NOBROKER_SUBPROCESS") != "1":
        import pytest

        pytest.skip(f"no broker (-p _nobroker): {what}")
    raise NoBroker(f"no broker (-p _nobroker): {what}")


def install() -> None:
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join(p for p in path.split(os.pathsep) if not p.rstrip("/").endswith("sbin"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))

    real_connect = socket.socket.connect

    def connect(self: socket.socket, address: object) -> None:
        if isinstance(address, tuple) and len(address) >= 2 and address[1] in MQTT_PORTS:
            raise ConnectionRefusedError(111, f"no broker (-p _nobroker) at port {address[1]}")
        real_connect(self, address)  # type: ignore[arg-type]

    socket.socket.connect = connect  # type: ignore[method-assign]

    from edgeflow.transport import broker

    broker._MOSQUITTO_PATHS = ()  # type: ignore[attr-defined]
    broker.find_mosquitto = lambda: None  # type: ignore[assignment]
    broker.MosquittoBroker.start = lambda self: _unavailable("MosquittoBroker")  # type: ignore[method-assign]
    broker.EmbeddedBroker.start = lambda self: _unavailable("EmbeddedBroker")  # type: ignore[method-assign]


install()
