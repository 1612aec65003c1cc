"""NatsTransport keeps the Transport protocol's signatures (as tests/unit/test_transport_protocol.py
checks for MqttTransport and LoopbackTransport), and builds without a server."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install -e '.[nats]')")

from edgeflow.errors import TransportError  # noqa: E402
from edgeflow.transport.base import Transport  # noqa: E402
from edgeflow.transport.factory import transport_class, transport_from_url  # noqa: E402
from edgeflow.transport.nats import NatsTransport  # noqa: E402
from edgeflow.transport.url import parse_broker_url  # noqa: E402

METHODS = [name for name, value in vars(Transport).items() if callable(value) and not name.startswith("_")]


@pytest.mark.parametrize("name", METHODS)
def test_natstransport_keeps_the_protocol_signature(name: str) -> None:
    want = inspect.signature(getattr(Transport, name))
    got = inspect.signature(getattr(NatsTransport, name))
    assert [(p.name, p.kind, p.default, p.annotation) for p in got.parameters.values()] == \
        [(p.name, p.kind, p.default, p.annotation) for p in want.parameters.values()], name
    want_ret = "NatsTransport" if want.return_annotation == "Transport" else want.return_annotation
    assert got.return_annotation == want_ret, name


def test_the_factory_picks_nats_by_scheme_and_reads_the_url() -> None:
    assert transport_class("nats://h:4222") is NatsTransport
    assert transport_class("tls://h:4222") is NatsTransport
    t = transport_from_url("tls://u%40x:p%3Aw@gw.example:4223", client_id="pi-7")
    assert isinstance(t, Transport)
    assert (t.url, t.username, t.password, t.tls is not None) == ("tls://gw.example:4223", "u@x", "p:w", True)
    a = parse_broker_url("nats://10.0.0.1")
    assert (a.port, a.is_nats, a.url) == (4222, True, "nats://10.0.0.1:4222")


def test_unreachable_server_is_a_transport_error_after_the_timeout() -> None:
    t = NatsTransport("127.0.0.1", 1, client_id="nobody", reconnect_min_s=0.05)
    with pytest.raises(TransportError, match="could not connect to NATS at nats://127.0.0.1:1"):
        t.connect(1.0)


def test_publish_while_offline_queues_and_close_fails_the_delivery() -> None:
    t = NatsTransport("127.0.0.1", 1, client_id="offline")
    d = t.publish("edgeflow/lab/pi-7/telemetry", b"x")
    assert not d.done and t.queued_bytes == 1
    t.close(timeout=1.0)
    with pytest.raises(TransportError, match="closed before"):
        d.wait(1)


def test_a_nats_url_without_nats_py_names_the_extra() -> None:
    """The module made unimportable, as a missing one is: a ConfigError naming the extra, not an ImportError."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['nats'] = None\n"
            "from edgeflow.errors import ConfigError\n"
            "from edgeflow.transport.factory import transport_from_url\n"
            "try:\n    transport_from_url('nats://127.0.0.1:4222')\n"
            "except ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "needs nats-py" in out.stdout and "pip install 'edgeflow[nats]'" in out.stdout
