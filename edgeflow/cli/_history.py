"""Helpers the history commands share (`edgeflow rounds`, `fleet history`, `fleet rollouts`, `fleet status`)."""

from __future__ import annotations

import time
from typing import Any


def check_last(last: int | None) -> None:
    from ..errors import ConfigError

    if last is not None and last < 1:
        raise ConfigError(f"--last {last}: give how many of the newest to show, 1 or more")


def when(ts: float | None) -> str:
    """A stored timestamp as local time, to the second."""
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))


def global_model_line(models: list[dict[str, Any]]) -> str | None:
    """``model v4 (round 3)``: the gateway's newest global model and the round that made it."""
    if not models:
        return None
    m = models[-1]
    made = f"round {m['round_id']}" if m["round_id"] is not None else "the initial model, before any round"
    return f"model v{m['version']} ({made})"
