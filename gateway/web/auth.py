"""Who may act from the dashboard: operator log-in, sessions, CSRF tokens and the failed-log-in limit.

The credential is the fleet's own: an operator user of the fleet directory (``operators/<user>.json``, the
password ``edgeflow fleet`` connects to the broker with; ``admin`` and any operator ``broker-config`` made, but
not ``gateway``, the service's own user, nor the session users ``admin-2``...). Nothing new to hand out or
revoke: re-running ``edgeflow broker-config --force`` gives an operator a new password, and the next log-in
needs it.

- :class:`OperatorCredentials` checks a user name and password: the name must be one of the fleet's operators
  (checked against ``fleet.json`` before any file is opened, so a name such as ``../../x`` never reaches the
  file system), and the password is compared as SHA-256 digests with :func:`hmac.compare_digest`
  (constant time, whatever the lengths); an unknown user costs the same comparison.
- :class:`Sessions` keeps the logged-in operators in memory: a random 256-bit token (the cookie), a
  per-session CSRF token (synchronizer token: returned to the page, required in the ``X-CSRF-Token`` header
  of every POST), an idle timeout and an absolute lifetime; looked up by the token's SHA-256 digest.
- :class:`LoginLimiter`: failed log-ins per client address and per user name within a window; past the
  limit, log-in is refused (429 with Retry-After) until the window has passed, even with the right password.

``clock`` (seconds, ``time.time`` by default) is a parameter so that expiry is testable without waiting.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from edgeflow.errors import ConfigError

SESSION_COOKIE = "__Host-edgeflow_session"
"""``__Host-``: the browser keeps it only if Secure, Path=/ and without Domain (no subdomain can set it)."""
_USER_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SESSION_USER = re.compile(r"^(.+)-\d+$")
_NOT_AN_OPERATOR = {"gateway"}


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class OperatorCredentials:
    """``check(user, password) -> bool`` against the fleet directory's operator credentials."""

    def __init__(self, fleet_dir: str | Path) -> None:
        from edgeflow.broker.mosquitto import FleetDir

        self.fd = FleetDir(fleet_dir)
        if not self.fd.exists:
            raise ConfigError(f"{fleet_dir}: not a fleet directory (no fleet.json): the dashboard's operators are "
                              "the fleet's; give the directory `edgeflow broker-config --dir` made")
        if not self.users():
            raise ConfigError(f"{fleet_dir}: the fleet directory names no operator who may log in (admin...); "
                              "re-run `edgeflow broker-config`")

    def users(self) -> list[str]:
        """Operators who may log in: the fleet's operators but the gateway's user and the session users."""
        known = {str(u) for u in self.fd.meta().get("operators", ())}

        def session_user(u: str) -> bool:
            m = _SESSION_USER.match(u)
            return m is not None and m.group(1) in known

        return sorted(u for u in known if u not in _NOT_AN_OPERATOR and not session_user(u))

    def check(self, user: Any, password: Any) -> bool:
        if not isinstance(user, str) or not isinstance(password, str):
            return False
        stored: str | None = None
        if _USER_OK.match(user) and user in self.users():
            try:
                stored = str(self.fd.operator(user)["password"])
            except (ConfigError, KeyError, TypeError, ValueError):
                stored = None  # no file for a listed name: refused like an unknown user
        expected = _digest(stored) if stored else secrets.token_bytes(32)  # same work for an unknown user
        return hmac.compare_digest(_digest(password), expected) and stored is not None


@dataclass
class Session:
    operator: str
    csrf: str
    created: float
    last_used: float


class Sessions:
    """Logged-in operators (see the module docstring): ``idle_s`` without a request, or ``max_age_s`` after log-in,
    ends a session."""

    def __init__(self, *, idle_s: float = 900.0, max_age_s: float = 8 * 3600.0,
                 clock: Callable[[], float] = time.time, limit: int = 1000) -> None:
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.clock = clock
        self.limit = limit
        self._by_digest: dict[bytes, Session] = {}
        self._lock = threading.Lock()

    def create(self, operator: str) -> tuple[str, Session]:
        token = secrets.token_urlsafe(32)
        now = self.clock()
        s = Session(operator, secrets.token_urlsafe(32), now, now)
        with self._lock:
            self._expire(now)
            while len(self._by_digest) >= self.limit:  # the oldest session goes first
                self._by_digest.pop(next(iter(self._by_digest)))
            self._by_digest[_digest(token)] = s
        return token, s

    def get(self, token: str | None) -> Session | None:
        """The live session of ``token`` (its idle time restarts), or None (unknown, expired, logged out)."""
        if not token:
            return None
        now = self.clock()
        with self._lock:
            self._expire(now)
            s = self._by_digest.get(_digest(token))
            if s is not None:
                s.last_used = now
            return s

    def end(self, token: str | None) -> None:
        if token:
            with self._lock:
                self._by_digest.pop(_digest(token), None)

    def _expire(self, now: float) -> None:
        dead = [k for k, s in self._by_digest.items()
                if now - s.last_used > self.idle_s or now - s.created > self.max_age_s]
        for k in dead:
            del self._by_digest[k]

    @staticmethod
    def csrf_ok(session: Session, token: Any) -> bool:
        return isinstance(token, str) and hmac.compare_digest(_digest(token), _digest(session.csrf))


class LoginLimiter:
    """At most ``attempts`` failed log-ins per client address and per user name in ``window_s``."""

    def __init__(self, *, attempts: int = 5, window_s: float = 300.0, clock: Callable[[], float] = time.time,
                 max_keys: int = 100_000) -> None:
        self.attempts = attempts
        self.window_s = window_s
        self.max_keys = max_keys
        self.clock = clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _keys(self, client: str, user: Any) -> list[str]:
        return [f"addr:{client}", f"user:{str(user)[:64]}"]

    def retry_after(self, client: str, user: Any) -> float:
        """Seconds until a log-in from ``client`` as ``user`` is taken again (0: now)."""
        now = self.clock()
        wait = 0.0
        with self._lock:
            for k in self._keys(client, user):
                q = self._failures.get(k)
                while q and now - q[0] > self.window_s:
                    q.popleft()
                if q is not None and len(q) >= self.attempts:
                    wait = max(wait, self.window_s - (now - q[0]))
        return wait

    def failed(self, client: str, user: Any) -> None:
        now = self.clock()
        with self._lock:
            for k in self._keys(client, user):
                q = self._failures.pop(k, None) or deque(maxlen=self.attempts)
                q.append(now)
                self._failures[k] = q  # re-inserted: the dict's order is the order of the last failure
            if len(self._failures) > self.max_keys:  # bounded memory under a spray of addresses and names:
                for k in [k for k, q in self._failures.items() if now - q[-1] > self.window_s]:
                    del self._failures[k]  # first what has expired anyway,
                while len(self._failures) > self.max_keys:  # then the keys whose last failure is the oldest
                    del self._failures[next(iter(self._failures))]
