"""RabbitMQ's MQTT plugin as a second broker implementation, for tests.

    from _rabbitmq import rabbitmq_mqtt  # noqa: F401  (fixture -> RabbitMQ, with .url / .host / .port)

The plugin speaks MQTT 3.1.1 (RabbitMQ 3.10) on port 1885 here (1883 is
Mosquitto's). If nothing answers there, the fixture enables it once, the way
.ci/run does (``rabbitmqctl eval ... tcp_listeners [1885]`` then
``rabbitmq-plugins enable rabbitmq_mqtt``; about 15 s), and skips with the
reason if RabbitMQ itself is not running or cannot be changed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache

import pytest

__all__ = ["RABBIT_MQTT_PORT", "RabbitMQ", "rabbitmq_available", "rabbitmq_mqtt"]

RABBIT_MQTT_PORT = int(os.environ.get("EDGEFLOW_TEST_RABBITMQ_MQTT_PORT", "1885"))
USER = PASSWORD = "guest"  # RabbitMQ's default user, allowed on loopback only


@dataclass(frozen=True)
class RabbitMQ:
    host: str
    port: int
    user: str = USER
    password: str = PASSWORD

    @property
    def url(self) -> str:
        return f"mqtt://{self.user}:{self.password}@{self.host}:{self.port}"

    def fleet(self, prefix: str = "rmq") -> str:
        """A fleet id of its own (RabbitMQ keeps retained messages and sessions across tests)."""
        return f"{prefix}{uuid.uuid4().hex[:8]}"


def _mqtt_connack(host: str, port: int, timeout: float = 3.0) -> bool:
    """Does an MQTT 3.1.1 CONNECT as guest get a CONNACK with return code 0?"""
    cid = b"edgeflow-probe"
    user, pw = USER.encode(), PASSWORD.encode()
    var = b"\x00\x04MQTT\x04\xc2\x00\x0a"  # protocol 4 (3.1.1), flags: user+password+clean, keepalive 10
    payload = len(cid).to_bytes(2, "big") + cid + len(user).to_bytes(2, "big") + user + len(pw).to_bytes(2, "big") + pw
    body = var + payload
    pkt = b"\x10" + bytes([len(body)]) + body
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(pkt)
            s.settimeout(timeout)
            ack = s.recv(4)
            s.sendall(b"\xe0\x00")  # DISCONNECT
    except OSError:
        return False
    return len(ack) == 4 and ack[0] == 0x20 and ack[3] == 0


def _enable_plugin() -> str | None:
    """Enable the MQTT plugin on 1885; None on success, else why not."""
    ctl, plugins = shutil.which("rabbitmqctl"), shutil.which("rabbitmq-plugins")
    if ctl is None or plugins is None:
        return "RabbitMQ is not installed (no rabbitmqctl)"
    try:
        st = subprocess.run([ctl, "status"], capture_output=True, text=True, timeout=60)
        if st.returncode != 0:
            return "RabbitMQ is not running (rabbitmqctl status failed)"
        subprocess.run([ctl, "eval", "application:load(rabbitmq_mqtt), application:set_env(rabbitmq_mqtt, "
                        f"tcp_listeners, [{RABBIT_MQTT_PORT}])."], capture_output=True, text=True, timeout=60,
                       check=True)
        subprocess.run([plugins, "enable", "rabbitmq_mqtt"], capture_output=True, text=True, timeout=120, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not enable RabbitMQ's MQTT plugin ({exc})"
    return None


@lru_cache(maxsize=1)
def rabbitmq_available() -> str | None:
    """None when RabbitMQ's MQTT listener answers (enabling it if needed), else the skip reason."""
    if _mqtt_connack("127.0.0.1", RABBIT_MQTT_PORT):
        return None
    why = _enable_plugin()
    if why is not None:
        return why
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if _mqtt_connack("127.0.0.1", RABBIT_MQTT_PORT):
            return None
        time.sleep(0.5)
    return f"RabbitMQ's MQTT plugin does not answer on 127.0.0.1:{RABBIT_MQTT_PORT} after enabling it"


@pytest.fixture
def rabbitmq_mqtt() -> RabbitMQ:
    why = rabbitmq_available()
    if why is not None:
        pytest.skip(why)
    return RabbitMQ("127.0.0.1", RABBIT_MQTT_PORT)
