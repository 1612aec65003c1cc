"""The JetStream side of the NATS transport: the streams edgeflow uses, outgoing frames, headers.

- :func:`ensure_streams`: ``<PREFIX>_LIVE`` (``<prefix>.>``, bounded in age and bytes: every
  QoS 1 publish gets a PubAck from it and a reconnecting subscriber replays its gap from it),
  ``<PREFIX>_RETAINED`` (one message per subject: the retained store) and ``<PREFIX>_WILLS``
  (one will record per connected client); an existing stream is left as its operator set it;
- :class:`NatsFrame`: an outbox frame with the ``Nats-Msg-Id`` that makes its resends
  recognisable (JetStream's duplicate window and the receivers drop the copies);
- :func:`headers_out` / :func:`headers_in`: edgeflow's MQTT 5 properties as NATS headers and back.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from edgeflow.errors import TransportError
from edgeflow.transport.message import MessageProperties
from edgeflow.transport.nats.subjects import StreamNames
from edgeflow.transport.outbox import Frame

__all__ = ["NatsFrame", "ensure_streams", "headers_in", "headers_out"]


@dataclass
class NatsFrame(Frame):
    """An outbox frame with the id that makes its resends recognisable."""

    msg_id: str = field(default_factory=lambda: uuid.uuid4().hex)


async def ensure_streams(js: Any, names: StreamNames, *, live_max_age_s: float, live_max_bytes: int) -> None:
    """Create the three streams when missing (an existing stream is left as its operator set it)."""
    p = names.prefix
    wanted = [
        StreamConfig(name=names.live, subjects=[f"{p}.>"], max_age=live_max_age_s, max_bytes=live_max_bytes,
                     discard=DiscardPolicy.OLD, storage=StorageType.FILE, duplicate_window=120.0),
        StreamConfig(name=names.retained, subjects=[f"{p}_retained.>"], max_msgs_per_subject=1,
                     storage=StorageType.FILE, duplicate_window=120.0),
        StreamConfig(name=names.wills, subjects=[f"{p}_will.>"], max_msgs_per_subject=1, storage=StorageType.FILE),
    ]
    for cfg in wanted:
        try:
            await js.stream_info(cfg.name)
            continue
        except nats.js.errors.NotFoundError:
            pass
        try:
            await js.add_stream(cfg)
        except (nats.js.errors.APIError, nats.errors.TimeoutError, asyncio.TimeoutError) as exc:  # denied: no answer
            msg = (f"JetStream stream {cfg.name} is missing and this user may not create it ({exc!r}); "
                   "start the gateway (or any transport with stream rights) once, or create it with the nats CLI")
            raise TransportError(msg) from None


def headers_out(frame: NatsFrame) -> dict[str, str]:
    h = {"Nats-Msg-Id": frame.msg_id}
    for key, value in (frame.properties or {}).items():
        if key == "correlation_data":
            h["Ef-Correlation-Data"] = base64.b64encode(bytes(value)).decode()
        elif key == "user_properties":
            items = value.items() if isinstance(value, dict) else value
            h["Ef-User-Properties"] = json.dumps({str(k): str(v) for k, v in items})
        elif key == "message_expiry_s":
            h["Ef-Message-Expiry"] = str(int(value))
        else:
            h["Ef-" + key.replace("_", "-").title()] = str(value)
    return h


def headers_in(headers: dict[str, str] | None) -> MessageProperties:
    out: MessageProperties = {}
    if not headers:
        return out
    for name, value in headers.items():
        if name == "Ef-Correlation-Data":
            out["correlation_data"] = base64.b64decode(value)
        elif name == "Ef-User-Properties":
            out["user_properties"] = dict(json.loads(value))
        elif name == "Ef-Message-Expiry":
            out["message_expiry_s"] = int(value)
        elif name == "Ef-Response-Topic":
            out["response_topic"] = value
        elif name == "Ef-Content-Type":
            out["content_type"] = value
    return out
