"""A minimal MQTT 3.1.1 client over a plain TCP socket (OASIS MQTT 3.1.1, sections 2-3).

Exactly what a small C client needs for edgeflow (docs/wire-format.md §4):
CONNECT/CONNACK, SUBSCRIBE/SUBACK, PUBLISH at QoS 0 and 1 in both
directions with PUBACK, PINGREQ/PINGRESP and DISCONNECT. One thread,
blocking socket with timeouts; incoming publications are queued while the
client waits for an acknowledgement, so nothing retained is lost.
"""

from __future__ import annotations

import socket
import struct
import time
from collections import deque

CONNECT, CONNACK, PUBLISH, PUBACK, SUBSCRIBE, SUBACK = 1, 2, 3, 4, 8, 9
PINGREQ, PINGRESP, DISCONNECT = 12, 13, 14


class MqttError(RuntimeError):
    pass


def _utf8(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("!H", len(raw)) + raw


def _remaining_length(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class Client:
    def __init__(self, host: str, port: int, client_id: str, *, keepalive: int = 30,
                 username: str | None = None, password: str | None = None) -> None:
        self.host, self.port, self.client_id, self.keepalive = host, port, client_id, keepalive
        self.username, self.password = username, password
        self.sock: socket.socket | None = None
        self.inbox: deque[tuple[str, bytes, bool]] = deque()
        self._next_id = 0
        self._last_send = time.monotonic()
        self._buf = b""

    # -- framing
    def _send(self, ptype: int, flags: int, body: bytes) -> None:
        assert self.sock is not None
        self.sock.sendall(bytes([(ptype << 4) | flags]) + _remaining_length(len(body)) + body)
        self._last_send = time.monotonic()

    def _parse(self) -> tuple[int, int, bytes] | None:
        """One whole packet from the buffer, or None if it has not fully arrived yet."""
        buf = self._buf
        if len(buf) < 2:
            return None
        length, mult, pos = 0, 1, 1
        while True:
            if pos >= len(buf):
                return None
            b = buf[pos]
            length += (b & 0x7F) * mult
            mult *= 128
            pos += 1
            if not b & 0x80:
                break
            if pos > 4:
                raise MqttError("malformed remaining length")
        if len(buf) < pos + length:
            return None
        self._buf = buf[pos + length:]
        return buf[0] >> 4, buf[0] & 0x0F, buf[pos:pos + length]

    def _read_packet(self, deadline: float) -> tuple[int, int, bytes]:
        assert self.sock is not None
        while True:
            packet = self._parse()
            if packet is not None:
                return packet
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no data from the broker")
            self.sock.settimeout(min(left, 1.0))
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                self._maybe_ping()
                continue
            if not data:
                raise MqttError("the broker closed the connection")
            self._buf += data

    def _packet_id(self) -> int:
        self._next_id = self._next_id % 65535 + 1
        return self._next_id

    def _maybe_ping(self) -> None:
        if time.monotonic() - self._last_send > self.keepalive / 2:
            self._send(PINGREQ, 0, b"")

    # -- dispatch: anything that is not the awaited acknowledgement
    def _handle(self, ptype: int, flags: int, body: bytes) -> tuple[int, bytes] | None:
        if ptype == PUBLISH:
            qos = (flags >> 1) & 3
            (tlen,) = struct.unpack_from("!H", body, 0)
            topic = body[2:2 + tlen].decode("utf-8")
            pos = 2 + tlen
            if qos:
                (pid,) = struct.unpack_from("!H", body, pos)
                pos += 2
                self._send(PUBACK, 0, struct.pack("!H", pid))
            self.inbox.append((topic, body[pos:], bool(flags & 1)))
            return None
        if ptype == PINGRESP:
            return None
        return ptype, body

    def _wait_for(self, ptype: int, packet_id: int | None, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            got = self._handle(*self._read_packet(deadline))
            if got is None:
                continue
            kind, body = got
            if kind == ptype and (packet_id is None or struct.unpack_from("!H", body, 0)[0] == packet_id):
                return body

    # -- the API
    def connect(self, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((self.host, self.port), timeout=timeout)
        flags = 0x02  # clean session: this client keeps no state between runs
        payload = _utf8(self.client_id)
        if self.username is not None:
            flags |= 0x80
            payload += _utf8(self.username)
            if self.password is not None:
                flags |= 0x40
                payload += _utf8(self.password)
        self._send(CONNECT, 0, _utf8("MQTT") + bytes([4, flags]) + struct.pack("!H", self.keepalive) + payload)
        body = self._wait_for(CONNACK, None, timeout)
        if len(body) != 2 or body[1] != 0:
            raise MqttError(f"CONNACK refused the connection (return code {body[1] if len(body) > 1 else '?'})")

    def subscribe(self, filters: list[str], qos: int = 1, timeout: float = 10.0) -> list[int]:
        pid = self._packet_id()
        body = struct.pack("!H", pid) + b"".join(_utf8(f) + bytes([qos]) for f in filters)
        self._send(SUBSCRIBE, 0x02, body)
        granted = list(self._wait_for(SUBACK, pid, timeout)[2:])
        if any(g == 0x80 for g in granted):
            raise MqttError(f"SUBACK refused a subscription: {granted}")
        return granted

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                timeout: float = 10.0) -> None:
        flags = (qos << 1) | (1 if retain else 0)
        if qos:
            pid = self._packet_id()
            self._send(PUBLISH, flags, _utf8(topic) + struct.pack("!H", pid) + payload)
            self._wait_for(PUBACK, pid, timeout)
        else:
            self._send(PUBLISH, flags, _utf8(topic) + payload)

    def receive(self, timeout: float) -> tuple[str, bytes, bool] | None:
        """The next publication (topic, payload, retained), or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.inbox:
            try:
                self._handle(*self._read_packet(deadline))
            except TimeoutError:
                return None
        return self.inbox.popleft()

    def disconnect(self) -> None:
        if self.sock is not None:
            try:
                self._send(DISCONNECT, 0, b"")
            finally:
                self.sock.close()
                self.sock = None
