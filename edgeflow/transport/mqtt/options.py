"""Option checks, protocol constants, and the mapping of paho's values into edgeflow's.

Every paho value that reaches the rest of edgeflow passes through here:
reason codes become text for :class:`~edgeflow.errors.TransportError`
messages, MQTT 5 properties become :class:`MessageProperties` and back.
"""

from __future__ import annotations

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edgeflow.errors import ConfigError
from edgeflow.transport.limits import check_limits
from edgeflow.transport.message import MessageProperties

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "FATAL_CONNACK",
    "PUBACK_HINTS",
    "LOST_QUIET_S",
    "REFUSAL_LIMIT",
    "RETRY_RC",
    "SESSION_TAKEN_OVER",
    "TAKEOVER_INCUMBENT_FACTOR",
    "TAKEOVER_INCUMBENT_S",
    "TAKEOVER_LIMIT",
    "TAKEOVER_SHORT_S",
    "V311",
    "V5",
    "V5_PROBE_S",
    "check_options",
    "check_ws_options",
    "fmt_reason",
    "props_in",
    "props_out",
    "rc_value",
]

DEFAULT_MAX_PAYLOAD = 256 * 1024
FATAL_CONNACK = {
    133: "the broker rejected the client id",
    134: "bad user name or password",
    135: "not authorized",
    138: "this client is banned",
    140: "bad authentication method",
}
PUBACK_HINTS = {
    135: "check the broker ACL: this user may not publish to that topic",
    149: "the message is larger than the broker accepts: lower max_payload so it is chunked",
    151: "the broker's quota is exceeded: publish less often",
    153: "the broker rejected the payload format",
}
LOST_QUIET_S = 3.0
"""A lost connection (and its retries) is logged at INFO; if it is still lost after this long, one warning
says so: a process stopped together with its broker stops quietly, an outage is still a warning."""
REFUSAL_LIMIT = 3
"""Refusals no retry fixes (bad password, not authorized, TLS verification) before any connection was
made, after which a transport that connects in the background (``connect(wait=False)``: a device) stops
trying; ``connect()`` that waits raises at the first."""
SESSION_TAKEN_OVER = 0x8E
"""DISCONNECT reason: another connection with this client id took the session (MQTT 5)."""
TAKEOVER_LIMIT = 5
"""Session takeovers (or silent closes of a fresh connection by the broker) in a row after which the transport stops reconnecting (ClientIdTakenError)."""
TAKEOVER_SHORT_S = 10.0
"""A takeover counts towards :data:`TAKEOVER_LIMIT` only if its connection was up less than this:
two processes with one client id take the session from each other within a reconnect delay, so a
connection that ran for a while before it was taken over (the first one, when a second process
starts) starts the count again, and the newcomer is the one that stops."""
TAKEOVER_INCUMBENT_S = 5.0
"""A process that once held a connection this long held the client id first (the incumbent): it stops
only after ``TAKEOVER_INCUMBENT_FACTOR`` times as many takeovers in a row, so in a war of two processes
the newcomer (whose connections last one reconnect delay) always gives up first, also when a failed
attempt restarted its count or the incumbent's first connection was younger than TAKEOVER_SHORT_S."""
TAKEOVER_INCUMBENT_FACTOR = 4
V5_PROBE_S = 2.0
"""How long a first MQTT 5 CONNECT waits for CONNACK before falling back to 3.1.1 (protocol="auto")."""
V5 = paho.MQTTv5
V311 = paho.MQTTv311
RETRY_RC = frozenset({paho.MQTT_ERR_NO_CONN, paho.MQTT_ERR_CONN_LOST})
"""paho results that mean "no connection right now": the work waits for the next connection.
Everything else paho returns on publish/subscribe/unsubscribe is final."""


def check_options(*, protocol: str, max_payload: int, max_inflight: int, port: int, ws_path: str,
                  ws_headers: dict[str, str] | None) -> None:
    """ConfigError for a constructor argument that cannot work (one line naming the fix)."""
    if protocol not in ("auto", "5", "3.1.1"):
        msg = f"protocol must be 'auto', '5' or '3.1.1', got {protocol!r}"
        raise ConfigError(msg)
    check_limits(max_payload=max_payload, max_inflight=max_inflight, port=port, server="broker")
    check_ws_options(ws_path, ws_headers)


def check_ws_options(path: str, headers: dict[str, str] | None) -> None:
    """Refuse what would corrupt the HTTP upgrade request (paho writes both into it verbatim)."""
    bad = ("\r", "\n", " ", "\t", "\0")
    if not isinstance(path, str) or not path.startswith("/") or any(c in path for c in bad):
        msg = f"websockets path {path!r} must start with '/' and contain no spaces or line breaks"
        raise ConfigError(msg)
    for key, value in (headers or {}).items():
        if (not isinstance(key, str) or not isinstance(value, str) or not key or ":" in key
                or any(c in key + value for c in ("\r", "\n", "\0"))):
            msg = f"websockets header {key!r}: {value!r} is not a valid HTTP header"
            raise ConfigError(msg)


def fmt_reason(rc: object) -> str:
    if isinstance(rc, ReasonCode):
        return f"{rc.getName()} (reason code {rc.value})"
    return str(rc)


def rc_value(rc: object) -> int:
    return int(rc.value) if isinstance(rc, ReasonCode) else int(rc)  # type: ignore[call-overload]


def props_out(props: MessageProperties | None, protocol: int) -> Properties | None:
    """edgeflow's properties as paho's PUBLISH properties (None on MQTT 3.1.1)."""
    if not props or protocol != V5:
        return None
    p = Properties(PacketTypes.PUBLISH)
    for key, value in props.items():
        if key == "response_topic":
            p.ResponseTopic = str(value)
        elif key == "correlation_data":
            p.CorrelationData = bytes(value)  # type: ignore[arg-type]
        elif key == "content_type":
            p.ContentType = str(value)
        elif key == "message_expiry_s":
            p.MessageExpiryInterval = int(value)  # type: ignore[call-overload]
        elif key == "user_properties":
            items = value.items() if isinstance(value, dict) else value
            p.UserProperty = [(str(k), str(v)) for k, v in items]  # type: ignore[union-attr]
    return p


def props_in(props: Properties | None) -> MessageProperties:
    """paho's received properties as edgeflow's (empty on MQTT 3.1.1)."""
    out: MessageProperties = {}
    if props is None:
        return out
    for attr, key in (
        ("ResponseTopic", "response_topic"),
        ("CorrelationData", "correlation_data"),
        ("ContentType", "content_type"),
        ("MessageExpiryInterval", "message_expiry_s"),
    ):
        if hasattr(props, attr):
            out[key] = getattr(props, attr)  # type: ignore[literal-required]
    if hasattr(props, "UserProperty"):
        out["user_properties"] = dict(props.UserProperty)
    return out
