"""A device stopped together with its broker, as a user meets it (`kill $(jobs -p)`, Ctrl-C in a
shell running both): the real `edgeflow device` process and a private Mosquitto, nothing mocked.

Before issue 33 the device logged reconnect warnings while it stopped. Now a lost connection and its
retries are logged at INFO, and one warning says so if it is still lost after LOST_QUIET_S (3 s):
stopping both at once is quiet, an outage is still a warning line (one, not one per retry).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
from _brokers import Inbox, mosquitto_factory, transport_factory  # noqa: F401

from edgeflow.broker.mosquitto import FleetDir
from edgeflow.transport.mqtt.options import LOST_QUIET_S

pytestmark = pytest.mark.integration


class _Device:
    """`edgeflow device` connected to a broker and done starting (its birth seen there, its start lines
    printed); ``lines`` collects what it says on stderr."""

    def __init__(self, tmp_path, broker, transport_factory) -> None:  # noqa: F811
        fd = FleetDir(tmp_path / "fleet").init("lab")
        fd.provision("dev-a", profile="x86-gateway")
        watcher = transport_factory(broker)
        inbox = Inbox()
        watcher.subscribe("edgeflow/lab/#", inbox)
        self.proc = subprocess.Popen([sys.executable, "-m", "edgeflow", "device", "--credentials",
                                      str(fd.device_dir("dev-a")), "--broker", f"mqtt://127.0.0.1:{broker.port}",
                                      "--state", str(tmp_path / "st")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.started = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        inbox.wait_for(lambda m: "dev-a" in m.topic, timeout=60)
        watcher.close(timeout=1.0, flush=False)
        assert self.started.wait(60), self.lines

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "federated rounds:" in line:  # the last of its start lines
                self.started.set()

    def wait(self, start: int) -> str:
        """What it printed from line ``start`` on, once it exited 0."""
        try:
            self.proc.wait(30)  # a hang detector, not a speed target
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the device did not stop on SIGTERM: {self.lines[-20:]}") from None
        self._reader.join(10)
        assert self.proc.returncode == 0, self.lines
        return "".join(self.lines[start:])


def test_a_device_stopped_with_its_broker_stops_without_warnings(tmp_path, mosquitto_factory,  # noqa: F811
                                                                 transport_factory):  # noqa: F811
    broker = mosquitto_factory(allow_anonymous=True)
    dev = _Device(tmp_path, broker, transport_factory)
    start = len(dev.lines)
    dev.proc.send_signal(signal.SIGTERM)  # both at once, as `kill $(jobs -p)` does
    broker.stop()
    err = dev.wait(start)
    assert "WARNING" not in err and "ERROR" not in err and "Traceback" not in err, err


def test_an_outage_is_still_a_warning_once_it_lasts(tmp_path, mosquitto_factory, transport_factory):  # noqa: F811
    broker = mosquitto_factory(allow_anonymous=True)
    dev = _Device(tmp_path, broker, transport_factory)
    start = len(dev.lines)
    broker.stop()
    time.sleep(LOST_QUIET_S + 3.0)  # the outage outlasts the quiet time, several retries included
    dev.proc.send_signal(signal.SIGTERM)
    err = dev.wait(start)
    warnings = [line for line in err.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "lost" in warnings[0] and "still reconnecting" in warnings[0], err


def test_a_broker_that_is_not_there_yet_is_one_warning_not_one_per_retry(caplog):
    """A gateway or device started before its broker: the first refusal is a warning, the same refusal
    on each retry is INFO (before: a warning per retry, 7 lines in the 30 s a gateway waits)."""
    import logging
    import socket

    from edgeflow.errors import TransportError
    from edgeflow.transport import MqttTransport

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = MqttTransport("127.0.0.1", port, client_id="lab-gateway", name="lab-gateway")
    with caplog.at_level(logging.INFO, logger="edgeflow.transport"):
        with pytest.raises(TransportError, match="connection refused"):
            t.connect(timeout=4.0)
    t.close(timeout=1)
    refused = [r for r in caplog.records if "connection refused" in r.getMessage()]
    assert len(refused) >= 3, [r.getMessage() for r in caplog.records]  # it did retry
    assert [r.levelno for r in refused].count(logging.WARNING) == 1, [(r.levelname, r.getMessage()) for r in refused]
