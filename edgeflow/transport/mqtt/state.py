"""The connection's state, as one enum instead of a handful of booleans (the counters: transport/dispatching.py).

Only the network thread moves the state, except :meth:`Link.close`, which any
thread may call; every other thread reads it and waits on it::

    IDLE --connect()--> CONNECTING --CONNACK--> CONNECTED
                           |  ^                     |
          refused, timeout |  | next attempt due    | connection lost
                           v  |                     v
                        BACKING_OFF <---------------+
    any --close()--> CLOSING --network thread done--> CLOSED

While CLOSING the network thread still reports what the connection does
(:attr:`Link.closing_from`), so the shutdown knows whether to send DISCONNECT
and acknowledgements queued before ``close()`` still go out.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable

from edgeflow.errors import TransportError

__all__ = ["ConnState", "Link"]


class ConnState(enum.Enum):
    IDLE = "idle"
    """Created; :meth:`MqttTransport.connect` not called yet."""
    CONNECTING = "connecting"
    """A connection attempt is under way: socket opening, CONNECT sent, no CONNACK yet."""
    CONNECTED = "connected"
    """The broker accepted the connection: frames flow."""
    BACKING_OFF = "backing off"
    """No connection; the next attempt is due at :attr:`Link.next_attempt`."""
    CLOSING = "closing"
    """``close()`` was called: no new work is accepted, the network thread shuts down."""
    CLOSED = "closed"


_ENDED = (ConnState.CLOSING, ConnState.CLOSED)


class Link:
    """The state of one transport's connection, with what goes with it.

    ``state`` is the one source of truth; ``up``, ``ended`` and
    ``connecting`` are views of it, recomputed on every change (plain
    attributes: the hot paths read them per message). :meth:`wait` blocks
    until a predicate on the link holds (every change notifies).
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.state = ConnState.IDLE
        self.closing_from: ConnState | None = None
        """While CLOSING/CLOSED: the state the connection itself is in (or was in at the end)."""
        self.up = False
        """The MQTT connection is established (also while closing, until it is taken down)."""
        self.ended = False
        """``close()`` was called: the transport takes no new work."""
        self.connecting = False
        """A connection attempt is under way (also while closing)."""
        self.generation = 0
        """Connections made so far; an acknowledgement for an older connection is not sent."""
        self.ever_connected = False
        self.session_present = False
        self.attempt_started: float | None = None
        """monotonic() when the current attempt began (while CONNECTING)."""
        self.next_attempt = 0.0
        """monotonic() when the next attempt is due (while BACKING_OFF)."""
        self.fatal: TransportError | None = None
        """A refusal no retry can fix (before the first connection), or a crashed network thread."""
        self.last_error: TransportError | None = None

    def __repr__(self) -> str:
        extra = f" ({self.closing_from.value})" if self.closing_from is not None else ""
        return f"<Link {self.state.value}{extra} generation {self.generation}>"

    def _views(self) -> None:
        s, c = self.state, self.closing_from
        closing = s is ConnState.CLOSING
        self.up = s is ConnState.CONNECTED or (closing and c is ConnState.CONNECTED)
        self.connecting = s is ConnState.CONNECTING or (closing and c is ConnState.CONNECTING)
        self.ended = s in _ENDED
        self._cv.notify_all()

    def to(self, new: ConnState) -> None:
        """Move to ``new`` (network thread). Once closing, only the connection's own state
        (:attr:`closing_from`) follows, until CLOSED."""
        with self._cv:
            if self.state in _ENDED and new is not ConnState.CLOSED:
                self.closing_from = new
            else:
                self.state = new
            self._views()

    def close(self) -> bool:
        """Enter CLOSING from any thread; False if already closing or closed."""
        with self._cv:
            if self.state in _ENDED:
                return False
            self.closing_from = self.state
            self.state = ConnState.CLOSING
            self._views()
            return True

    def fail(self, err: TransportError) -> None:
        """A fatal error: wake everyone waiting for a connection."""
        with self._cv:
            self.fatal = err
            if self.state is ConnState.CONNECTED:
                self.state = ConnState.BACKING_OFF
            elif self.state in _ENDED:
                self.closing_from = ConnState.BACKING_OFF
            self._views()

    def notify(self) -> None:
        """Wake the waiters without a state change (an attempt failed: ``last_error`` is new)."""
        with self._cv:
            self._cv.notify_all()

    def wait(self, predicate: Callable[[Link], bool], timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: predicate(self), timeout)

    def wait_change(self, timeout: float) -> None:
        with self._cv:
            self._cv.wait(timeout)
