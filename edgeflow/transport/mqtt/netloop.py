"""The network loop: the only thread that ever calls into paho.

It runs its own select loop over paho's socket and a wake-up socket pair
(paho's documented external-loop API: ``socket``/``want_write``/
``loop_read``/``loop_write``/``loop_misc``), connects and reconnects with
exponential backoff and jitter, hands queued frames to paho within an
in-flight window, and turns PUBACKs into delivery progress. Keeping paho on
one thread avoids its lock-ordering pitfalls (``on_publish`` runs under
paho's message lock). Other threads reach it through :meth:`NetLoop.call`
(a command queue drained at the top of every iteration) and :meth:`wake`.

Sessions and resume. The transport, not paho, owns retransmission: each
connection gets a fresh paho client, and frames the broker had not
acknowledged (PUBACK) go back to the head of the outbox and are re-sent
after reconnect; acknowledged ones never are, so an interrupted chunked
publish resumes where it stopped. A frame, SUBSCRIBE or UNSUBSCRIBE handed
to paho while the connection drops waits for the next connection.

Protocol. MQTT 5 first; if the broker answers "unsupported protocol
version" (or does not answer the very first CONNECT within 2 s) the loop
falls back to MQTT 3.1.1 (no properties, no PUBACK reason codes: an
ACL-denied publish then looks delivered).

The connection state lives in :class:`~edgeflow.transport.mqtt.state.Link`
(see there for the transitions); paho and socket errors become
:class:`~edgeflow.errors.TransportError` here.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from edgeflow.errors import ClientIdTakenError, ConfigError, TransportError
from edgeflow.transport.backoff import Backoff
from edgeflow.transport.base import WillSpec
from edgeflow.transport.message import ConnectionEvent, TlsConfig
from edgeflow.transport.mqtt.dispatch import Dispatcher, Inbound
from edgeflow.transport.topics import CHUNK_LEVEL, retained_chunks_allowed
from edgeflow.transport.mqtt.options import (
    FATAL_CONNACK,
    PUBACK_HINTS,
    LOST_QUIET_S,
    REFUSAL_LIMIT,
    RETRY_RC,
    SESSION_TAKEN_OVER,
    TAKEOVER_INCUMBENT_FACTOR,
    TAKEOVER_INCUMBENT_S,
    TAKEOVER_LIMIT,
    TAKEOVER_SHORT_S,
    V5,
    V5_PROBE_S,
    V311,
    fmt_reason,
    props_in,
    props_out,
    rc_value,
)
from edgeflow.transport.dispatching import Counters
from edgeflow.transport.mqtt.state import ConnState, Link
from edgeflow.transport.mqtt.subscriptions import SubscriptionTable
from edgeflow.transport.outbox import Frame, Outbox

__all__ = ["NetLoop", "Owner"]

log = logging.getLogger("edgeflow.transport")


class Owner(Protocol):
    """What the network loop reads from its transport (the facade): the connection settings,
    read when a client is built, and two call-backs."""

    host: str
    port: int
    client_id: str
    username: str | None
    password: str | None
    tls: TlsConfig | None
    websockets: bool
    ws_path: str
    ws_headers: dict[str, str] | None
    protocol_choice: str
    keepalive: int
    clean_start: bool
    session_expiry_s: int
    will: WillSpec | None
    max_inflight: int
    connect_timeout_s: float
    max_pending_messages: int
    name: str

    @property
    def url(self) -> str: ...

    @property
    def protocol_version(self) -> str: ...

    def make_client(self) -> paho.Client: ...

    def notify_connection(self, event: ConnectionEvent) -> None: ...


class NetLoop:
    """The network thread of one :class:`~edgeflow.transport.mqtt.facade.MqttTransport`.

    ``owner`` gives the connection settings (read when a client is built, so
    a will set after construction counts) and builds the paho client
    (``owner.make_client``, which tests may wrap).
    """

    def __init__(self, owner: Owner, link: Link, outbox: Outbox, subs: SubscriptionTable,
                 dispatcher: Dispatcher, counters: Counters, backoff: Backoff, protocol: int) -> None:
        self.t = owner
        self.link = link
        self.outbox = outbox
        self.subs = subs
        self.dispatcher = dispatcher
        self._inbound = dispatcher.queue.put
        self._count = counters.add
        self.backoff = backoff
        self.protocol = protocol
        self.client: paho.Client | None = None

        self._cmds: deque[Callable[[], None]] = deque()
        self._inflight: dict[int, Frame] = {}
        self._early_acks: dict[int, object] = {}
        self._pending_subacks: dict[int, list[str]] = {}
        self._pending_unsubacks: dict[int, list[str]] = {}
        self._handing: Frame | None = None
        self.server_max_packet: int | None = None
        self._server_receive_max: int | None = None
        self._resubscribe = False
        """Work left for the loop after a CONNACK: (re)subscribe, send pending unsubscribes."""
        self.abort = False
        """close(abort=True): drop the TCP connection without DISCONNECT."""
        self._probe = False
        """After a protocol error: frames go out one at a time (see _requeue_inflight)."""
        self._client_used = False
        self._paho_error: str | None = None
        self._connected_at: float | None = None
        self._takeovers = 0
        """Session takeovers in a row (see options.TAKEOVER_LIMIT)."""
        self._incumbent = False
        """This process once held a connection TAKEOVER_INCUMBENT_S or longer (see options)."""
        self._lost_at: float | None = None
        """monotonic() when an established connection was lost (None: connected)."""
        self._lost_reason = ""
        self._lost_warned = False
        self._warned_error = ""
        """The last failed attempt's error that was warned about: the same error again is logged at INFO
        (a gateway started before its broker says "connection refused" once, not once per retry)."""
        self._refusals = 0
        """Refusals no retry can fix (bad password, TLS verification) before the first connection."""
        self.gave_up: TransportError | None = None
        """Set when the loop stopped reconnecting for good: the client id is taken (ClientIdTakenError), or
        the broker refused the first connection :data:`REFUSAL_LIMIT` times in a way no retry fixes."""

        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    # -------------------------------------------------------------- calls

    def wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the network thread (soon, in order)."""
        self._cmds.append(fn)
        self.wake()

    def close_sockets(self) -> None:
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def fail_inflight(self) -> None:
        """After the loop ended: deliveries still in flight fail."""
        for frame in list(self._inflight.values()):
            if frame.delivery is not None:
                frame.delivery.fail(TransportError(f"transport closed before {frame.topic} was acknowledged"))
        self._inflight.clear()

    # ------------------------------------------------------- paho client

    def build_client(self) -> paho.Client:
        """A fresh paho client for one connection attempt, with this attempt's will."""
        t = self.t
        kwargs: dict[str, object] = {
            "callback_api_version": paho.CallbackAPIVersion.VERSION2,
            "client_id": t.client_id,
            "protocol": self.protocol,
            "transport": "websockets" if t.websockets else "tcp",
            "manual_ack": True,
            "reconnect_on_failure": False,
        }
        if self.protocol != V5:
            kwargs["clean_session"] = t.clean_start
        client = paho.Client(**kwargs)  # type: ignore[arg-type]
        client.enable_logger(logging.getLogger("edgeflow.transport.paho"))
        client.max_inflight_messages_set(0)  # our own window; paho must never queue internally
        client.connect_timeout = t.connect_timeout_s
        if t.websockets:
            client.ws_set_options(path=t.ws_path, headers=t.ws_headers)
        if t.username is not None:
            client.username_pw_set(t.username, t.password)
        if t.tls is not None:
            if t.tls.context is not None:
                client.tls_set_context(t.tls.context)
            else:
                try:
                    client.tls_set(
                        ca_certs=t.tls.ca_file,
                        certfile=t.tls.cert_file,
                        keyfile=t.tls.key_file,
                        cert_reqs=ssl.CERT_REQUIRED,
                        tls_version=ssl.PROTOCOL_TLS_CLIENT,
                    )
                except (OSError, ssl.SSLError, ValueError) as exc:
                    msg = f"cannot load TLS files (ca {t.tls.ca_file}, cert {t.tls.cert_file}): {exc}"
                    raise ConfigError(msg) from exc
            if t.tls.insecure:
                client.tls_insecure_set(True)
        if t.will is not None:
            w = t.will
            props = None
            if self.protocol == V5 and w.delay_s:
                props = Properties(PacketTypes.WILLMESSAGE)
                props.WillDelayInterval = int(w.delay_s)
            payload = w.payload  # read once per attempt (a per-session will computes it on each read): see Will
            if callable(payload):
                payload = payload()
            client.will_set(w.topic, payload, qos=w.qos, retain=w.retain, properties=props)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_unsubscribe = self._on_unsubscribe
        client.on_message = self._on_message
        client.on_log = self._on_log
        if self.protocol == V5:
            props = Properties(PacketTypes.CONNECT)
            if t.session_expiry_s > 0:
                props.SessionExpiryInterval = t.session_expiry_s
            client.connect_async(t.host, t.port, t.keepalive, clean_start=t.clean_start, properties=props)
        else:
            client.connect_async(t.host, t.port, t.keepalive)
        return client

    # -------------------------------------------------------------- loop

    def run(self) -> None:
        try:
            self._loop()
        except Exception:  # pragma: no cover - a bug; make it visible instead of silently dying
            log.exception("edgeflow MQTT network thread crashed; the transport is stopped")
            self.link.fail(TransportError("the MQTT network thread crashed; see the log"))

    def _loop(self) -> None:
        assert self.client is not None
        link = self.link
        while True:
            while self._cmds:
                self._cmds.popleft()()
            client = self.client
            if link.ended:
                self._shutdown_connection(client)
                return
            sock = client.socket()
            now = time.monotonic()
            if sock is None:
                if self.gave_up is not None:  # no more attempts; close() ends the loop
                    self._idle(0.5)
                    continue
                self._warn_if_still_lost()
                if now < link.next_attempt:
                    self._idle(link.next_attempt - now)
                    continue
                self._attempt(client)
                continue
            if link.state is ConnState.CONNECTING and link.attempt_started is not None:
                probing = self.t.protocol_choice == "auto" and self.protocol == V5 and not link.ever_connected
                limit = min(self.t.connect_timeout_s, V5_PROBE_S) if probing else self.t.connect_timeout_s
                if now - link.attempt_started > limit:
                    if probing:
                        # MQTT 3.1.1-only brokers such as amqtt may never answer an MQTT 5 CONNECT.
                        self._fallback(f"no CONNACK to an MQTT 5 CONNECT within {limit:.1f} s")
                    else:
                        self._attempt_failed(TransportError(f"no CONNACK from {self.t.url} within {limit} s"))
                        self._drop_socket(client)
                    continue
            if link.state is ConnState.CONNECTED:
                if self._resubscribe:
                    self._resubscribe = False
                    self._subscribe_after_connect()
                self._pump(client)
            want_write = client.want_write()
            timeout = 0.5 if link.state is ConnState.CONNECTED else 0.05
            try:
                readable, writable, _ = select.select(
                    [sock, self._wake_r], [sock] if want_write else [], [], timeout
                )
            except (OSError, ValueError):
                readable, writable = [sock], []
            if self._wake_r in readable:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            pending = getattr(sock, "pending", None)
            if sock in readable or (pending is not None and pending() > 0):
                client.loop_read()
            if client.socket() is not None and (sock in writable or client.want_write()):
                client.loop_write()
            if client.socket() is not None:
                client.loop_misc()

    def _idle(self, seconds: float) -> None:
        try:
            readable, _, _ = select.select([self._wake_r], [], [], max(0.0, min(seconds, 0.5)))
        except (OSError, ValueError):
            return
        if readable:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    # -------------------------------------------------------- connecting

    def _attempt(self, client: paho.Client) -> None:
        if self._client_used:
            # A fresh paho client per connection: un-acked frames are re-sent from our own queue,
            # so paho must not also replay its copies of them.
            client = self.client = self.t.make_client()
        self._client_used = True
        self._paho_error = None
        self.link.attempt_started = time.monotonic()
        self.link.to(ConnState.CONNECTING)
        url = self.t.url
        try:
            client.reconnect()
        except ssl.SSLCertVerificationError as exc:
            self._attempt_failed(TransportError(self._verify_failed(url, exc)), fatal=True)
        except ssl.SSLError as exc:
            if "ALERT" in str(exc).upper():
                # Over websockets paho reads the HTTP upgrade reply inside reconnect(), so the server's
                # alert (no or bad client certificate) surfaces here rather than as a disconnect.
                msg = (
                    f"the TLS listener at {url} rejected this client ({exc}); it probably requires a "
                    "client certificate signed by its CA: connect to a listener that takes passwords (the one "
                    "`edgeflow broker-config` writes), or give a client certificate and key "
                    "(TlsConfig(cert_file=..., key_file=...) in Python)"
                )
                self._attempt_failed(TransportError(msg), fatal=True)
                return
            msg = f"TLS handshake with {url} failed: {exc}; check the broker's TLS listener and client certificate"
            self._attempt_failed(TransportError(msg))
        except ConnectionRefusedError:
            msg = f"connection refused by {url}: no MQTT broker is listening there; start one or fix host/port"
            self._attempt_failed(TransportError(msg))
        except socket.gaierror as exc:
            msg = f"cannot resolve broker host {self.t.host!r}: {exc}; check the host name"
            self._attempt_failed(TransportError(msg))
        except (OSError, ValueError) as exc:
            msg = f"cannot connect to {url}: {exc}"
            self._attempt_failed(TransportError(msg))

    def _verify_failed(self, url: str, exc: ssl.SSLCertVerificationError) -> str:
        """The line for a broker certificate that did not verify: it names the CA file used, or says
        that none was given (the system's trust store was used), and where the fleet's CA lives."""
        tls = self.t.tls
        ca = getattr(tls, "ca_file", None)
        if ca:
            which = f"against the CA file {ca}"
            fix = ("give the CA that signed the broker certificate (the fleet directory's broker/ca.crt from "
                   "`edgeflow broker-config`; TlsConfig(ca_file=...) in Python)")
        else:
            which = "against the system's trust store: no CA file was given"
            fix = ("give the CA that signed the broker certificate: the fleet directory's broker/ca.crt from "
                   "`edgeflow broker-config` (a device's credentials folder gets a copy as ca.crt; "
                   "TlsConfig(ca_file=...) in Python)")
        return (f"TLS certificate of {url} failed verification {which} ({exc.verify_message}); {fix}, and "
                "connect by a host name in that certificate")

    def _attempt_failed(self, err: TransportError, *, fatal: bool = False) -> None:
        link = self.link
        if not link.connecting:
            return  # this attempt's outcome is already known
        link.attempt_started = None
        link.last_error = err
        self._takeovers = 0  # the broker was away (restart, outage): not a client id taken by another connection
        self._count("connect_failures")
        if fatal and not link.ever_connected:
            link.fatal = err
            self._refusals += 1
            if self._refusals >= REFUSAL_LIMIT:  # a refusal no retry fixes: say it once more and stop trying
                self.gave_up = err
                link.attempt_started = None
                link.to(ConnState.BACKING_OFF)
                log.debug("%s: giving up after %d refusals: %s", self.t.name, self._refusals, err)
                return
        delay = self.backoff.next()
        link.next_attempt = time.monotonic() + delay
        link.to(ConnState.BACKING_OFF)
        level = logging.ERROR if fatal else logging.INFO if self._lost_recently() else logging.WARNING
        if level == logging.WARNING:
            if str(err) == self._warned_error:
                level = logging.INFO
            self._warned_error = str(err)
        log.log(level, "%s: %s (retrying in %.1f s)", self.t.name, err, delay)

    def _lost_recently(self) -> bool:
        """An established connection is lost and not back yet: its retries are logged at INFO, so a
        device stopped together with its broker (``kill $(jobs -p)``) stops without warnings; a loss
        that lasts :data:`LOST_QUIET_S` is warned about once (:meth:`_warn_if_still_lost`), not per retry."""
        return self._lost_at is not None

    def _warn_if_still_lost(self) -> None:
        if self._lost_at is not None and not self._lost_warned and time.monotonic() - self._lost_at >= LOST_QUIET_S:
            self._lost_warned = True
            log.warning("%s: connection to %s lost %.0f s ago (%s); still reconnecting (last: %s)", self.t.name,
                        self.t.url, time.monotonic() - self._lost_at, self._lost_reason, self.link.last_error)

    def _drop_socket(self, client: paho.Client) -> None:
        """Close the TCP connection without DISCONNECT (paho then reports connection lost)."""
        sock = client.socket()
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            client.loop_read()
        except Exception:  # noqa: BLE001 - paho may raise on a dead socket; it is being dropped anyway
            log.debug("reading a dropped socket failed", exc_info=True)

    def _shutdown_connection(self, client: paho.Client) -> None:
        if client.socket() is None:
            return
        if self.abort:
            self._drop_socket(client)
            return
        if self.link.up:
            client.disconnect()
            for _ in range(20):
                if client.socket() is None or not client.want_write():
                    break
                client.loop_write()
        self._drop_socket(client)

    def _fallback(self, why: str) -> None:
        """Switch to MQTT 3.1.1 and retry at once (only before the first successful connect)."""
        log.info("%s: %s; falling back to MQTT 3.1.1", self.t.name, why)
        old = self.client
        self.protocol = V311
        self.link.attempt_started = None
        self.link.next_attempt = 0.0
        self.link.to(ConnState.BACKING_OFF)
        self.client = self.t.make_client()
        self._client_used = False
        if old is not None:
            self._drop_socket(old)
        self._count("protocol_fallbacks")

    def _on_connect(self, client: paho.Client, userdata: object, flags: object, reason: ReasonCode,
                    properties: Properties | None) -> None:
        if client is not self.client:
            return
        link = self.link
        if reason.is_failure:
            value = rc_value(reason)
            if value == 132 and self.t.protocol_choice == "auto" and self.protocol == V5 and not link.ever_connected:
                link.attempt_started = None
                link.next_attempt = 0.0
                link.to(ConnState.BACKING_OFF)
                self._cmds.append(lambda: self._fallback("broker does not support MQTT 5"))
                return
            fatal = value in FATAL_CONNACK
            hint = FATAL_CONNACK.get(value, "")
            who = f" as user {self.t.username!r}" if self.t.username else " anonymously"
            fix = "; check username/password and the broker's password file and ACL" if fatal else ""
            msg = f"broker at {self.t.url} refused the connection{who}: {hint or fmt_reason(reason)}{fix}"
            self._attempt_failed(TransportError(msg), fatal=fatal)
            return
        link.attempt_started = None
        link.generation += 1
        self.backoff.reset()
        link.session_present = bool(getattr(flags, "session_present", False))
        if properties is not None:
            self.server_max_packet = getattr(properties, "MaximumPacketSize", None)
            self._server_receive_max = getattr(properties, "ReceiveMaximum", None)
        if link.ever_connected:
            self._count("reconnects")
        link.ever_connected = True
        link.last_error = None
        self._connected_at = time.monotonic()
        self._resubscribe = True
        self._lost_at = None
        self._warned_error = ""
        link.to(ConnState.CONNECTED)
        log.info(
            "%s: connected to %s (MQTT %s, session %s)", self.t.name, self.t.url, self.t.protocol_version,
            "resumed" if link.session_present else "new",
        )
        self.t.notify_connection(ConnectionEvent(True, link.session_present, "connected"))

    def _on_disconnect(self, client: paho.Client, userdata: object, flags: object, reason: ReasonCode,
                       properties: Properties | None) -> None:
        if client is not self.client:
            return
        link = self.link
        was_up = link.up
        if was_up:
            link.to(ConnState.BACKING_OFF)  # the next attempt's time is set below
        self._requeue_inflight(protocol_error=rc_value(reason) == 130)
        self._pending_subacks.clear()
        self._pending_unsubacks.clear()
        if link.ended:
            return
        url = self.t.url
        if not was_up:
            detail = self._paho_error or fmt_reason(reason)
            tls_refusal = self.t.tls is not None and "ALERT" in detail.upper()
            if tls_refusal:
                msg = (
                    f"the TLS listener at {url} rejected this client ({detail}); it probably requires a "
                    "client certificate signed by its CA: connect to a listener that takes passwords (the one "
                    "`edgeflow broker-config` writes), or give a client certificate and key "
                    "(TlsConfig(cert_file=..., key_file=...) in Python)"
                )
                self._attempt_failed(TransportError(msg), fatal=True)
                return
            if (
                self.t.protocol_choice == "auto" and self.protocol == V5 and not link.ever_connected
                and link.connecting
            ):
                link.attempt_started = None
                link.next_attempt = 0.0
                link.to(ConnState.BACKING_OFF)
                self._cmds.append(lambda: self._fallback("broker closed the connection before CONNACK"))
                return
            self._attempt_failed(TransportError(f"broker at {url} closed the connection before CONNACK ({detail})"))
            return
        value = rc_value(reason)
        # 0x8E: the broker says another connection took the session; 128 with no socket error: the broker
        # closed the connection without a word, as Mosquitto 2.0 does to the older of two same-id clients
        if (value == SESSION_TAKEN_OVER or (value == 128 and self._paho_error is None)) and self._taken_over(url):
            return
        delay = self.backoff.next()
        link.next_attempt = time.monotonic() + delay
        link.last_error = TransportError(f"connection to {url} lost: {fmt_reason(reason)}")
        link.notify()
        self._lost_at, self._lost_reason, self._lost_warned = time.monotonic(), fmt_reason(reason), False
        log.info("%s: connection lost (%s); reconnecting in %.1f s", self.t.name, fmt_reason(reason), delay)
        self.t.notify_connection(ConnectionEvent(False, False, fmt_reason(reason)))

    def _taken_over(self, url: str) -> bool:
        """The broker ended an accepted connection: told "session taken over" (0x8E) or closed it
        without a reason. Count it if the connection was short-lived (one that ran
        :data:`TAKEOVER_SHORT_S` or longer starts the count again); at :data:`TAKEOVER_LIMIT` in a row
        stop reconnecting for good (True): two processes with one client id would take it from each
        other forever, and the one that came second (whose connections never last) is the one that stops."""
        up_for = time.monotonic() - self._connected_at if self._connected_at is not None else 0.0
        self._incumbent = self._incumbent or up_for >= TAKEOVER_INCUMBENT_S
        self._takeovers = self._takeovers + 1 if up_for < TAKEOVER_SHORT_S else 0
        self._count("short_sessions")
        if self._takeovers < TAKEOVER_LIMIT * (TAKEOVER_INCUMBENT_FACTOR if self._incumbent else 1):
            return False
        err = ClientIdTakenError(
            f"client id {self.t.client_id!r} is in use by another connection to {url}: the broker ended this "
            f"client's session {TAKEOVER_LIMIT} times in a row within {TAKEOVER_SHORT_S:g} s of accepting it "
            "(MQTT reason 0x8E, session taken over; Mosquitto 2.0 closes without a reason); the same device or "
            "gateway runs twice: stop the other process (or give each its own credentials)")
        self.gave_up = err
        self.link.last_error = err
        self.link.fail(err)
        log.error("%s: %s", self.t.name, err)
        self.t.notify_connection(ConnectionEvent(False, False, str(err)))
        return True

    def _on_log(self, client: paho.Client, userdata: object, level: int, buf: str) -> None:
        """Keep paho's last error (e.g. a TLS alert it swallowed) to explain the next disconnect."""
        if level == paho.MQTT_LOG_ERR and client is self.client:
            self._paho_error = buf

    # ------------------------------------------------------------ publish

    def _pump(self, client: paho.Client) -> None:
        window = 1 if self._probe else self.t.max_inflight
        if self._server_receive_max:
            window = min(window, int(self._server_receive_max))
        link = self.link
        outbox = self.outbox
        inflight = self._inflight
        while len(inflight) < window and link.up and client is self.client and client.socket() is not None:
            frame = outbox.pop()
            if frame is None:
                return
            if self.server_max_packet and frame.size + len(frame.topic.encode("utf-8")) + 16 > self.server_max_packet:
                # The broker would drop the connection, and paho would re-send the message after every
                # reconnect: fail it here instead of looping forever.
                outbox.release(frame)
                self._count("publish_failures")
                msg = (
                    f"message of {frame.size} bytes on {frame.topic} exceeds the broker's maximum packet size "
                    f"({self.server_max_packet} bytes); publish without raw=True so it is chunked, or lower max_payload"
                )
                log.warning("%s: %s", self.t.name, msg)
                if frame.delivery is not None:
                    frame.delivery.fail(TransportError(msg))
                continue
            # paho writes to the socket inside publish(); if that write finds the connection gone it
            # runs on_disconnect before publish() returns. ``_handing`` lets _requeue_inflight put this
            # frame back in the queue together with the ones in flight, in order.
            self._handing = frame
            try:
                info = client.publish(
                    frame.topic, frame.payload(), qos=frame.qos, retain=frame.retain,
                    properties=props_out(frame.properties, self.protocol),  # type: ignore[arg-type]
                )
            except (ValueError, ConfigError) as exc:
                if self._handing is None:  # requeued by a disconnect inside publish(); retried on reconnect
                    continue
                self._handing = None
                outbox.release(frame)
                self._count("publish_failures")
                if frame.delivery is not None:
                    frame.delivery.fail(TransportError(f"cannot publish to {frame.topic}: {exc}"))
                continue
            requeued = self._handing is None
            self._handing = None
            if info.rc in RETRY_RC:
                # Not a final error: the connection is (being) lost. The frame waits for the next
                # connection, like every other unacknowledged frame.
                if not requeued:
                    self._requeue([frame], handing=frame)
                return
            if requeued:
                # publish() reported success although the connection dropped during it; the frame is
                # queued again (paho's copy dies with this client) and is sent after reconnect.
                return
            if info.rc != paho.MQTT_ERR_SUCCESS:
                outbox.release(frame)
                self._count("publish_failures")
                if frame.delivery is not None:
                    frame.delivery.fail(TransportError(f"paho refused publish to {frame.topic}: {paho.error_string(info.rc)}"))
                continue
            self._count("published_frames")
            early = self._early_acks.pop(info.mid, None)
            if early is not None:
                self._complete(frame, early)
            else:
                inflight[info.mid] = frame

    def _on_publish(self, client: paho.Client, userdata: object, mid: int, reason: object,
                    properties: Properties | None) -> None:
        frame = self._inflight.pop(mid, None)
        if frame is None:
            self._early_acks[mid] = reason
            return
        self._complete(frame, reason)

    def _complete(self, frame: Frame, reason: object) -> None:
        self.outbox.release(frame)
        failed = isinstance(reason, ReasonCode) and reason.is_failure
        if failed:
            value = rc_value(reason)
            if frame.delivery is None:
                log.debug("%s: best-effort publish to %s refused: %s", self.t.name, frame.topic, fmt_reason(reason))
                return
            self._count("publish_rejected")
            hint = PUBACK_HINTS.get(value, "see the broker log")
            msg = f"broker rejected publish to {frame.topic}: {fmt_reason(reason)}; {hint}"
            log.warning("%s: %s", self.t.name, msg)
            frame.delivery.fail(TransportError(msg))
            return
        self._count("acked_frames")
        self._probe = False
        if frame.delivery is not None:
            frame.delivery.frame_acked(frame.index)

    def _requeue_inflight(self, *, protocol_error: bool) -> None:
        """Put un-acknowledged frames back at the front of the queue, to re-send after reconnect.

        QoS 0 frames are dropped (at most once). A connection that paho
        dropped with a protocol error while frames were in flight may have
        been killed by one of them: Mosquitto answers a message over its
        ``message_size_limit`` with a PUBACK reason code (0x95) that paho
        cannot parse. Re-sending such a frame would loop forever, so after a
        protocol error frames are re-sent one at a time ("probe mode"), and a
        frame that is alone in flight at a second protocol error fails.
        """
        frames = list(self._inflight.values())
        handing = self._handing
        if handing is not None:  # on_disconnect from inside publish(): the frame being handed over
            frames.append(handing)
            self._handing = None
        self._inflight.clear()
        self._early_acks.clear()
        keep: list[Frame] = []
        for frame in frames:
            if frame.qos == 0:
                self.outbox.release(frame)
                if frame.delivery is not None:
                    frame.delivery.fail(TransportError(f"connection lost before QoS 0 message on {frame.topic} was sent"))
                continue
            if protocol_error and self._probe and len(frames) == 1:
                self.outbox.release(frame)
                self._count("publish_failures")
                msg = (
                    f"the broker dropped the connection twice while receiving a {frame.size}-byte message on "
                    f"{frame.topic}; it probably refuses it (message_size_limit?): lower max_payload so it is "
                    "chunked smaller; not retrying"
                )
                log.warning("%s: %s", self.t.name, msg)
                if frame.delivery is not None:
                    frame.delivery.fail(TransportError(msg))
                continue
            keep.append(frame)
        if protocol_error and keep:
            self._probe = True
        self._requeue(keep, handing=handing)

    def _requeue(self, frames: list[Frame], *, handing: Frame | None = None) -> None:
        """Put frames back at the head of the queue, in order, for the next connection.

        ``resent_frames`` counts the frames that reached paho and will go out
        a second time; ``handoff_retries`` the frame whose hand-over to paho
        met a lost connection (publish() returned "connection lost"/"no
        connection"): it waits for the next connection instead of failing
        its delivery.
        """
        if not frames:
            return
        self.outbox.push_front(frames)
        retried = sum(1 for f in frames if f is handing)
        self._count("resent_frames", len(frames) - retried)
        if retried:
            self._count("handoff_retries", retried)

    # ------------------------------------------------- (un)subscriptions

    def _subscribe_after_connect(self) -> None:
        now, moot, todo = self.subs.after_connect(self.link.session_present)
        if now:
            self.send_unsubscribe(now)  # the broker kept the subscriptions: remove them now
        if moot:
            self.subs.unsubscribed(moot)  # a new session has none
        if todo:
            self.send_subscribe(todo)

    def send_subscribe(self, filters: list[str]) -> None:
        if not self.link.up or self.client is None:
            return
        items = self.subs.to_subscribe(filters, self.link.generation)
        if not items:
            return
        if self.protocol == V5:
            req: list[tuple[str, object]] = [(f, SubscribeOptions(qos=q, retainAsPublished=_rap(f))) for f, q in items]
        else:
            req = list(items)  # type: ignore[arg-type]
        rc, mid = self.client.subscribe(req)  # type: ignore[arg-type]
        if rc == paho.MQTT_ERR_SUCCESS:
            self._pending_subacks[mid] = [f for f, _ in items]
        elif rc not in RETRY_RC:
            err = TransportError(f"paho refused to subscribe {[f for f, _ in items]}: {paho.error_string(rc)}")
            log.warning("%s: %s", self.t.name, err)
            self.subs.subscribe_failed([f for f, _ in items], err)
        # else: the connection is being lost; re-sent on the next connection (new generation)

    def _on_subscribe(self, client: paho.Client, userdata: object, mid: int, reasons: list[ReasonCode],
                      properties: Properties | None) -> None:
        filters = self._pending_subacks.pop(mid, [])
        refusals: list[TransportError | None] = []
        for f, rc in zip(filters, reasons):
            if isinstance(rc, ReasonCode) and rc.is_failure:
                err = TransportError(
                    f"broker refused subscription to {f}: {fmt_reason(rc)}; check the broker ACL for this user"
                )
                log.warning("%s: %s", self.t.name, err)
                refusals.append(err)
            else:
                refusals.append(None)
        self.subs.subacked(filters, refusals)

    def send_unsubscribe(self, filters: list[str]) -> None:
        if not self.link.up or self.client is None:
            return  # sent by _subscribe_after_connect if the session is resumed
        filters, again = self.subs.to_unsubscribe(filters)
        self.subs.unsubscribed(again)  # subscribed again before the UNSUBSCRIBE went out: nothing to remove
        if not filters:
            return
        rc, mid = self.client.unsubscribe(filters)
        if rc == paho.MQTT_ERR_SUCCESS:
            self._pending_unsubacks[mid] = filters
        elif rc not in RETRY_RC:
            log.warning("%s: paho refused to unsubscribe %s: %s", self.t.name, filters, paho.error_string(rc))
            self.subs.unsubscribed(filters)
        # else: the connection is being lost; retried after reconnect (resumed session) or moot (new one)

    def _on_unsubscribe(self, client: paho.Client, userdata: object, mid: int, *args: object) -> None:
        if client is not self.client:
            return
        self.subs.unsubscribed(self._pending_unsubacks.pop(mid, []))

    # ----------------------------------------------------------- receive

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        self._count("received_frames")
        try:
            topic = msg.topic
        except UnicodeDecodeError:
            self._count("bad_topic")
            if msg.qos:
                client.ack(msg.mid, msg.qos)
            return
        if msg.qos == 0 and self.dispatcher.qsize() >= self.t.max_pending_messages:
            self._count("qos0_dropped")
            return
        self._inbound(Inbound(topic, bytes(msg.payload), msg.qos, bool(msg.retain), msg.mid,
                                    self.link.generation, props_in(getattr(msg, "properties", None))))

    def ack_later(self, raw: Inbound) -> None:
        """From the worker thread: acknowledge ``raw`` (its handler returned) on the network thread."""
        self._cmds.append(lambda: self.ack(raw))
        self.wake()

    def ack(self, raw: Inbound) -> None:
        """Acknowledge a handled QoS 1 message (network thread), if its connection still stands."""
        if raw.qos and self.link.up and raw.generation == self.link.generation and self.client is not None:
            self.client.ack(raw.mid, raw.qos)


def _rap(filter: str) -> bool:
    """Subscribe ``filter`` with MQTT 5's retain-as-published? Only the chunk filters of channels that never
    carry retained chunks (every device channel): a device that publishes retained junk chunks there is then
    seen doing it live too (the flag is kept), so the receiver refuses the chunk and clears the topic at the
    broker at once instead of only when it next subscribes. Honest traffic there is never retained."""
    tail = f"/{CHUNK_LEVEL}/+"
    if not filter.endswith(tail) or filter.startswith("$share/"):
        return False
    levels = filter[: -len(tail)].split("/")
    if len(levels) >= 3 and levels[2] == "+":
        levels[2] = "x"  # any device: the channel decides
    if "+" in levels or "#" in levels:
        return False
    return not retained_chunks_allowed("/".join(levels))
