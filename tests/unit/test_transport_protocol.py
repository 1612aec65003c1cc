"""The Transport seam: both implementations keep the protocol's signatures, and the
protocol itself is typed without ``Any`` (no broker needed)."""

from __future__ import annotations

import inspect
import typing

import pytest

from edgeflow.transport.base import Transport, WillSpec
from edgeflow.transport.loopback import LoopbackBroker, LoopbackTransport
from edgeflow.transport.message import Will
from edgeflow.transport.mqtt import MqttTransport
from edgeflow.transport.nats import NatsTransport

METHODS = [name for name, value in vars(Transport).items()
           if callable(value) and not name.startswith("_")]
IMPLEMENTATIONS = [MqttTransport, NatsTransport, LoopbackTransport]


def test_the_protocol_has_the_methods_edgeflow_uses():
    assert set(METHODS) == {"connect", "wait_connected", "close", "flush", "publish", "subscribe", "unsubscribe",
                            "add_connection_listener", "stats"}
    assert isinstance(vars(Transport)["is_connected"], property)


def _hints(obj: object) -> dict[str, object]:
    import edgeflow.transport.base as base

    return typing.get_type_hints(obj, vars(base))


@pytest.mark.parametrize("name", METHODS)
def test_protocol_signatures_have_no_any(name):
    hints = _hints(getattr(Transport, name))
    for arg, hint in hints.items():
        assert "Any" not in repr(hint), f"Transport.{name}({arg}) is typed {hint!r}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_implementations_keep_the_protocol_signature(impl, name):
    want = inspect.signature(getattr(Transport, name))
    got = inspect.signature(getattr(impl, name))
    want_params = [(p.name, p.kind, p.default, p.annotation) for p in want.parameters.values()]
    got_params = [(p.name, p.kind, p.default, p.annotation) for p in got.parameters.values()]
    assert got_params == want_params, f"{impl.__name__}.{name}{got} differs from Transport.{name}{want}"
    if want.return_annotation == "Transport":
        assert got.return_annotation == impl.__name__
    else:
        assert got.return_annotation == want.return_annotation, name


def test_both_implementations_are_transports():
    t = MqttTransport("127.0.0.1", 1, client_id="never-connected")
    lb = LoopbackBroker().transport("x")
    assert isinstance(t, Transport) and isinstance(lb, Transport)
    assert isinstance(Will("a/b", b"x"), WillSpec)
    t.close()
    lb.close()


def test_the_seam_and_the_loopback_do_not_load_paho():
    import subprocess
    import sys

    code = ("import sys, edgeflow.transport as t; t.LoopbackTransport; import edgeflow.transport.base; "
            "print('paho' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
