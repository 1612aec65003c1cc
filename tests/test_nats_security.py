"""NATS per-device credentials on a real nats-server (config from edgeflow/broker/nats.py).

Each check runs the hostile input itself: a device subscribing to another device's commands, a
device storing a will that names another device's topic, a client that does not trust the
server's certificate, a wrong password, a malformed URL.
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install -e '.[nats]')")

from _brokers import Inbox, stays, wait_until  # noqa: E402
from edgeflow.broker.mosquitto import make_fleet_ca  # noqa: E402
from edgeflow.broker.nats import KEEPER_USER, NatsTls, nats_fleet_config  # noqa: E402
from edgeflow.errors import ConfigError, TransportError  # noqa: E402
from edgeflow.transport.broker import NatsServer, find_nats_server  # noqa: E402
from edgeflow.transport.factory import transport_from_url  # noqa: E402
from edgeflow.transport.message import TlsConfig, Will  # noqa: E402
from edgeflow.transport.nats import NatsTransport, WillKeeper  # noqa: E402

pytestmark = pytest.mark.skipif(find_nats_server() is None, reason="nats-server is not installed")

FLEET = "lab"


class Fleet:
    def __init__(self, tls: NatsTls | None = None) -> None:
        self.pw = {u: secrets.token_hex(8) for u in ("dev1", "dev2", "gateway")}
        self.keeper_pw = secrets.token_hex(8)
        self.config = nats_fleet_config(FLEET, {"dev1": self.pw["dev1"], "dev2": self.pw["dev2"]},
                                        {"gateway": self.pw["gateway"]}, keeper_password=self.keeper_pw, tls=tls)
        self.server = NatsServer(extra_config=self.config.text, tls_scheme=tls is not None).start()
        self.made: list[Any] = []

    def transport(self, user: str, client_id: str | None = None, **kw: Any) -> Any:
        t = transport_from_url(self.server.url, client_id=client_id or user, username=user, password=self.pw[user],
                               reconnect_min_s=0.05, connect_timeout_s=5.0, **kw)
        self.made.append(t)
        return t

    def close(self) -> None:
        for t in self.made:
            t.close(timeout=1.0, flush=False)
        self.server.stop()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    f.transport("gateway", "stream-maker").connect()  # the gateway creates the streams
    yield f
    f.close()


def test_a_device_may_not_subscribe_to_another_devices_commands(fleet: Fleet) -> None:
    dev1 = fleet.transport("dev1").connect()
    dev1.subscribe(f"edgeflow/{FLEET}/dev1/cmd", Inbox())  # its own: allowed
    with pytest.raises(TransportError, match="not authorized"):
        dev1.subscribe(f"edgeflow/{FLEET}/dev2/cmd", Inbox())
    with pytest.raises(TransportError, match="not authorized"):
        dev1.subscribe(f"edgeflow/{FLEET}/#", Inbox())


def test_a_device_may_not_write_another_devices_retained_birth(fleet: Fleet) -> None:
    dev1 = fleet.transport("dev1").connect()
    with pytest.raises(TransportError, match="not authorized"):
        dev1.publish(f"edgeflow/{FLEET}/dev2/birth", b"fake", retain=True).wait(10)
    later = Inbox()
    fleet.transport("gateway", "gw-late").connect().subscribe(f"edgeflow/{FLEET}/+/birth", later)
    stays(lambda: len(later.messages), for_s=0.3, reason="the forged retained birth was stored")


def test_the_keeper_refuses_a_will_that_names_another_devices_topic(fleet: Fleet) -> None:
    keeper = WillKeeper(fleet.server.url, system_user=KEEPER_USER, system_password=fleet.keeper_pw, user="gateway",
                        password=fleet.pw["gateway"], may_publish=fleet.config.may_publish).start()
    try:
        gw = fleet.transport("gateway", "gw").connect()
        deaths = Inbox()
        gw.subscribe(f"edgeflow/{FLEET}/+/death", deaths)
        hostile = fleet.transport("dev1", will=Will(f"edgeflow/{FLEET}/dev2/death", b"dev2 is dead", retain=True))
        hostile.connect().close(abort=True)
        assert wait_until(lambda: keeper.stats["refused"] == 1, 10), dict(keeper.stats)
        honest = fleet.transport("dev2", will=Will(f"edgeflow/{FLEET}/dev2/death", b"really gone", retain=True))
        honest.connect().close(abort=True)
        (msg,) = deaths.wait(1)
        assert msg.payload == b"really gone"
    finally:
        keeper.stop()


def test_stopping_the_keeper_while_a_will_waits_out_its_delay_leaves_no_task_pending(
        fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    """A CI run's NATS close test caught "Task was destroyed but it is pending" from a keeper of an
    earlier test: that keeper was stopped while it handled a disconnect, and its task was dropped
    with its loop. Stopping ends the wills being handled (the delayed one is not published)."""
    keeper = WillKeeper(fleet.server.url, system_user=KEEPER_USER, system_password=fleet.keeper_pw, user="gateway",
                        password=fleet.pw["gateway"], may_publish=fleet.config.may_publish).start()
    gw = fleet.transport("gateway", "gw").connect()
    deaths = Inbox()
    gw.subscribe(f"edgeflow/{FLEET}/+/death", deaths)
    fleet.transport("dev1", will=Will(f"edgeflow/{FLEET}/dev1/death", b"gone", delay_s=60)).connect().close(abort=True)
    assert wait_until(lambda: keeper.pending == 1, 10), dict(keeper.stats)
    caplog.set_level(logging.ERROR, logger="asyncio")
    keeper.stop()
    assert keeper.pending == 0
    keeper.__dict__.clear()  # drop its loop and tasks now: a task dropped pending is reported by gc
    gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    assert deaths.messages == []


def test_a_device_without_the_stream_rights_gets_one_clear_error(tmp_path: Path) -> None:
    f = Fleet()  # no gateway has created the streams yet
    try:
        with pytest.raises(TransportError, match="may not create"):
            f.transport("dev1").connect(10)
    finally:
        f.close()


def test_wrong_password_is_refused_at_once(fleet: Fleet) -> None:
    t = NatsTransport("127.0.0.1", fleet.server.port, client_id="dev1", username="dev1", password="wrong")
    with pytest.raises(TransportError, match="(?i)authori"):
        t.connect(10)


@pytest.mark.parametrize("url", ["nats://", "nats://host:notaport", "nats://host/path", "tls://:4222"])
def test_malformed_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        transport_from_url(url)


def test_unknown_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        transport_from_url("nats://127.0.0.1:4222", colour="red")
    with pytest.raises(ConfigError, match="websockets"):
        transport_from_url("nats://127.0.0.1:4222", websockets=True)


def test_tls_with_the_fleet_ca(tmp_path: Path) -> None:
    ca, cert, key = make_fleet_ca(tmp_path / "ca", ["127.0.0.1", "localhost"])
    f = Fleet(tls=NatsTls(str(cert), str(key), str(ca)))
    try:
        gw = f.transport("gateway", "gw", tls=TlsConfig(ca_file=str(ca))).connect(10)
        inbox = Inbox()
        gw.subscribe(f"edgeflow/{FLEET}/+/telemetry", inbox)
        f.transport("dev1", tls=TlsConfig(ca_file=str(ca))).connect(10).publish(
            f"edgeflow/{FLEET}/dev1/telemetry", b"over tls").wait(10)
        assert inbox.wait(1)[0].payload == b"over tls"
        other_ca, _c, _k = make_fleet_ca(tmp_path / "other", ["127.0.0.1"])
        with pytest.raises(TransportError, match="(?i)certificate"):
            f.transport("dev2", tls=TlsConfig(ca_file=str(other_ca))).connect(10)
    finally:
        f.close()


def test_a_device_with_its_generated_rights_can_do_what_the_agent_does(fleet: Fleet) -> None:
    """Everything the device agent and the federated client subscribe and publish, as user dev1."""
    gw = fleet.transport("gateway", "gw", max_payload=16 * 1024).connect()
    model = os.urandom(100 * 1024)
    gw.publish(f"edgeflow/{FLEET}/gateway/model", model, retain=True).wait(20)  # retained, chunked
    updates = Inbox()
    gw.subscribe(f"edgeflow/{FLEET}/+/update", updates)
    dev = fleet.transport("dev1", max_payload=16 * 1024,
                          will=Will(f"edgeflow/{FLEET}/dev1/death", b"gone", retain=True)).connect()
    got = {c: Inbox() for c in ("model", "round", "secagg")}
    for channel, inbox in got.items():
        dev.subscribe(f"edgeflow/{FLEET}/gateway/{channel}", inbox)
    for channel in ("cmd", "ota", "infer"):
        dev.subscribe(f"edgeflow/{FLEET}/dev1/{channel}", Inbox())
    assert got["model"].wait(1)[0].payload == model
    dev.publish(f"edgeflow/{FLEET}/dev1/birth", b"online", retain=True).wait(10)
    update = os.urandom(60 * 1024)
    dev.publish(f"edgeflow/{FLEET}/dev1/update", update).wait(20)  # chunked
    assert updates.wait(1)[0].payload == update
    assert dev.stats().get("subscribe_errors", 0) == 0
