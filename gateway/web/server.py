"""One small HTTP(S) server for the operator: the dashboard (``/``), its JSON (``/api/...``) and ``/metrics``.

Reading needs no credential: the dashboard, ``/api/state``, ``/api/device`` and ``/metrics`` change nothing;
the data (device ids, versions, telemetry) is readable by anyone who reaches the address, so the default
listen address is loopback and a wider one is logged as such. Bound to a loopback address, requests whose
``Host`` is not a loopback name are refused (a web page elsewhere cannot read the fleet through DNS rebinding).

Actions (deploy, rollback, a device command: :mod:`.actions`) exist only when the server is given the fleet's
operators (``operators=FLEET_DIR``), and are taken only

- over **TLS** (``tls_cert``/``tls_key``): a POST over plain HTTP is refused (403) whatever the address,
  loopback included, so a password or session cookie never travels in clear, and the cookie is ``Secure``;
- from a **logged-in operator** (``POST /api/login`` with the user and password of an operator of the fleet
  directory, :mod:`.auth`): a session cookie (``__Host-`` prefixed, HttpOnly, Secure, SameSite=Strict),
  idle and absolute expiry, ``POST /api/logout``; failed log-ins are limited per address and per user (429);
- with **CSRF protection**: every POST must come from this server's own origin (``Origin``, else ``Referer``,
  equal to ``https://`` + the request's ``Host``; neither: refused), carry ``Content-Type:
  application/json``, and, once logged in, the session's token in ``X-CSRF-Token`` (synchronizer token,
  compared in constant time).

Without ``operators`` the server is read-only: every method but GET and HEAD is answered 405 with the CLI
command that does the action (``edgeflow fleet deploy|rollback|cmd``).

Every response carries a Content-Security-Policy that allows only this server's own script and style (no
inline script), ``nosniff`` and ``frame-ancestors 'none'``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import ssl
import threading
import time
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from edgeflow.errors import ConfigError

from .actions import DASHBOARD_COMMANDS, ActionError, Audit, FleetActions
from .auth import SESSION_COOKIE, LoginLimiter, OperatorCredentials, Sessions
from .view import WebView

log = logging.getLogger("edgeflow.gateway.web")

DEFAULT_LISTEN = "127.0.0.1:9100"
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"), "/style.css": ("style.css", "text/css; charset=utf-8")}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
READ_ONLY = ("read-only: the dashboard takes no actions over HTTP; deploy, roll back and send commands with "
             "`edgeflow fleet deploy|rollback|cmd` (docs/fleet.md)")
NEED_TLS = ("actions need HTTPS: start the dashboard with a TLS certificate ([http] tls_cert and tls_key, see "
            "docs/operations.md) and open it at https://")
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
MAX_BODY = 64 * 1024
ACTION_PATHS = {"/api/deploy": "deploy", "/api/rollback": "rollback", "/api/command": "command"}


def parse_listen(text: object, what: str = "--http") -> tuple[str, int]:
    """``HOST:PORT`` (``127.0.0.1:9100``, ``[::1]:9100``, ``0.0.0.0:9100``, ``:9100`` = all interfaces,
    port 0 = any free port) -> (host, port); ConfigError naming ``what`` otherwise."""
    example = f"{what} must be HOST:PORT, e.g. 127.0.0.1:9100 (or :9100 for every interface)"
    if not isinstance(text, str) or not text.strip() or not text.isprintable():
        raise ConfigError(f"{example}, got {text!r}")
    s = text.strip()
    if s.startswith("["):
        host, sep, port = s[1:].partition("]:")
    else:
        host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit() or ":" in host and not s.startswith("["):
        raise ConfigError(f"{example}, got {text!r}")
    p = int(port)
    if not 0 <= p <= 65535:
        raise ConfigError(f"{what}: port {p} is not in 0-65535")
    if host and not host.replace(".", "").replace("-", "").replace(":", "").isalnum():
        raise ConfigError(f"{what}: {host!r} is not a host name or address")
    return host or "0.0.0.0", p


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _clean(x: Any) -> Any:
    """JSON without NaN/Infinity (browsers' JSON.parse refuses them)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    return str(x)


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"
    timeout = 60  # an idle keep-alive connection lets its thread go after a minute
    server_version = "edgeflow-web"
    sys_version = ""

    def log_message(self, fmt: str, *args: Any) -> None:  # the access log is debug noise
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, code: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        if isinstance(self.connection, ssl.SSLSocket):
            self.send_header("Strict-Transport-Security", "max-age=31536000")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj: Any, extra: dict[str, str] | None = None) -> None:
        self._send(code, json.dumps(_clean(obj), separators=(",", ":")).encode(), "application/json", extra)

    def _error(self, code: int, message: str, extra: dict[str, str] | None = None) -> None:
        self._send(code, (json.dumps({"error": message}) + "\n").encode(), "application/json", extra)

    def _host_ok(self) -> bool:
        if not self.server.loopback_only:
            return True
        host = (self.headers.get("Host") or "").strip().lower()
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        return name in _LOOPBACK_NAMES

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if not self._host_ok():
            self._error(421, "this server answers only to localhost (it is bound to a loopback address)")
            return
        url = urlsplit(self.path)
        path = url.path
        view = self.server.view
        try:
            if path in STATIC:
                name, ctype = STATIC[path]
                self._send(200, _asset(name), ctype)
            elif path == "/metrics":
                from prometheus_client.exposition import CONTENT_TYPE_LATEST

                self._send(200, self.server.metrics.exposition(), CONTENT_TYPE_LATEST)
            elif path == "/api/state":
                self._json(200, view.state())
            elif path == "/api/device":
                ids = parse_qs(url.query).get("id", [])
                if len(ids) != 1 or not ids[0]:
                    self._error(400, "give one device: /api/device?id=DEVICE_ID")
                    return
                dev = view.device(ids[0])
                if dev is None:
                    self._error(404, "no such device")
                else:
                    self._json(200, dev)
            elif path == "/healthz":
                self._json(200, {"ok": True, "attached": view.attached})
            elif path == "/api/session":
                self._session_info()
            elif path == "/api/audit":
                session = self._session()
                if session is None:
                    self._error(401, "log in first (POST /api/login)")
                else:
                    self._json(200, {"entries": self.server.audit.list()[-200:]})
            else:
                self._error(404, "not found: the dashboard is /, the metrics /metrics")
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:  # noqa: BLE001 - a bug in a page must not stop the server
            log.exception("web view: %s failed", path)
            self._error(500, "internal error (see the gateway's log)")

    do_HEAD = do_GET  # noqa: N815

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):  # the handshake in this connection's thread, bounded in time
            self.request.settimeout(10)
            self.request.do_handshake()
        super().setup()

    def _refuse(self) -> None:
        self._error(405, READ_ONLY, {"Allow": "GET, HEAD"})

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    # -- actions (see the module docstring) -----------------------------------------------------------------
    @property
    def _tls(self) -> bool:
        return isinstance(self.connection, ssl.SSLSocket)

    def _client(self) -> str:
        return str(self.client_address[0])

    def _cookie(self) -> str | None:
        try:
            jar = SimpleCookie(self.headers.get("Cookie") or "")
        except CookieError:
            return None
        morsel = jar.get(SESSION_COOKIE)
        return morsel.value if morsel is not None else None

    def _session(self) -> Any:
        if self.server.sessions is None or not self._tls:
            return None
        return self.server.sessions.get(self._cookie())

    def _session_info(self) -> None:
        srv = self.server
        if srv.actions is None:  # read-only: the page shows no operator panel
            self._json(200, {"actions": False})
            return
        if not self._tls:
            self._json(200, {"actions": False, "why": NEED_TLS})
            return
        session = self._session()
        if session is None:  # 200, not 401: the page asks this on every load, before any log-in
            self._json(200, {"actions": True, "operator": None})
            return
        self._json(200, {"actions": True, "operator": session.operator, "csrf": session.csrf,
                         "models": srv.actions.models(), "commands": list(DASHBOARD_COMMANDS)})

    def _same_origin(self) -> bool:
        """The request comes from a page of this server: Origin (else Referer) is https:// + our Host."""
        host = (self.headers.get("Host") or "").strip().lower()
        if not host:
            return False
        origin = self.headers.get("Origin")
        if origin is None:
            ref = self.headers.get("Referer")
            if not ref:
                return False
            parts = urlsplit(ref)
            origin = f"{parts.scheme}://{parts.netloc}"
        return origin.strip().lower() == f"https://{host}"

    def _body(self) -> dict[str, Any]:
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise ActionError(415, "send the request as JSON (Content-Type: application/json)")
        try:
            n = int(self.headers.get("Content-Length") or "0")
        except ValueError:
            raise ActionError(400, "bad Content-Length") from None
        if not 0 < n <= MAX_BODY:
            if MAX_BODY < n <= 16 * MAX_BODY:  # read (bounded) so that the client gets the answer, not a reset
                self.rfile.read(n)
            raise ActionError(413, f"the request body must be 1 to {MAX_BODY} bytes of JSON")
        try:
            body = json.loads(self.rfile.read(n))
        except (ValueError, UnicodeDecodeError):
            raise ActionError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise ActionError(400, "the request body must be a JSON object")
        return body

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        srv = self.server
        path = urlsplit(self.path).path
        if srv.actions is None:
            self._refuse()
            return
        if not self._host_ok():
            self._error(421, "this server answers only to localhost (it is bound to a loopback address)")
            return
        if path not in ACTION_PATHS and path not in ("/api/login", "/api/logout"):
            self._error(404, "not found: the actions are POST /api/login, /api/logout, " + ", ".join(ACTION_PATHS))
            return
        self.close_connection = True  # an unread body must not be taken for the next request
        try:
            self._check_channel(path)
            if path == "/api/login":
                self._login(self._body())
                return
            session = self._operator_session(path)
            if path == "/api/logout":
                srv.sessions.end(self._cookie())
                srv.audit.record(session.operator, "logout", "ok", self._client())
                self._json(200, {"logged_out": True}, {"Set-Cookie": self._cookie_header("", 0)})
                return
            what = ACTION_PATHS[path]
            result = getattr(srv.actions, what)(session.operator, self._body(), self._client())
            self._json(202 if what == "deploy" else 200, result)
        except ActionError as exc:
            extra = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            self._error(exc.status, str(exc), extra)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:  # noqa: BLE001 - a bug in an action must not stop the server
            log.exception("web view: POST %s failed", path)
            self._error(500, "internal error (see the gateway's log)")

    def _check_channel(self, path: str) -> None:
        """Step 1 of every POST: over TLS, from this server's own page (ActionError 403 otherwise, audited)."""
        what = path.rsplit("/", 1)[-1]
        if not self._tls:
            self.server.audit.record(None, what, "refused", self._client(), why="plain http")
            raise ActionError(403, NEED_TLS)
        if not self._same_origin():
            self.server.audit.record(None, what, "refused", self._client(), why="cross-origin",
                                     origin=str(self.headers.get("Origin"))[:200])
            raise ActionError(403, "cross-origin request refused: actions are taken only from this server's own "
                                   "page (Origin must be this server's https:// address)")

    def _operator_session(self, path: str) -> Any:
        """Step 2 (all but log-in): a live session (401) whose CSRF token the request carries (403, audited)."""
        session = self._session()
        if session is None:
            raise ActionError(401, "log in first (POST /api/login): no session, or it expired or was ended")
        if not self.server.sessions.csrf_ok(session, self.headers.get("X-CSRF-Token")):
            self.server.audit.record(session.operator, path.rsplit("/", 1)[-1], "refused", self._client(), why="csrf")
            raise ActionError(403, "missing or wrong X-CSRF-Token: reload the dashboard and try again")
        return session

    def _cookie_header(self, token: str, max_age: int) -> str:
        return f"{SESSION_COOKIE}={token}; Path=/; Max-Age={max_age}; Secure; HttpOnly; SameSite=Strict"

    def _login(self, body: dict[str, Any]) -> None:
        srv = self.server
        user, password = body.get("user"), body.get("password")
        shown = str(user)[:64]
        wait = srv.limiter.retry_after(self._client(), user)
        if wait > 0:
            srv.audit.record(shown, "login", "refused", self._client(), why="too many failed log-ins")
            raise ActionError(429, f"too many failed log-ins: try again in {math.ceil(wait)} s",
                              retry_after=math.ceil(wait))
        if not srv.credentials.check(user, password):
            srv.limiter.failed(self._client(), user)
            srv.audit.record(shown, "login", "failed", self._client())
            raise ActionError(401, "wrong user name or password (an operator of the fleet directory: "
                                   "operators/<user>.json)")
        token, session = srv.sessions.create(str(user))
        srv.audit.record(session.operator, "login", "ok", self._client())
        self._json(200, {"operator": session.operator, "csrf": session.csrf},
                   {"Set-Cookie": self._cookie_header(token, int(srv.sessions.max_age_s))})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], view: WebView, metrics: Any, loopback_only: bool,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.address_family = __import__("socket").AF_INET6 if ":" in addr[0] else __import__("socket").AF_INET
        super().__init__(addr, _Handler)
        self.view = view
        self.metrics = metrics
        self.loopback_only = loopback_only
        self.ssl_context = ssl_context
        self.actions: FleetActions | None = None
        self.audit = Audit()
        self.sessions: Sessions | None = None
        self.credentials: OperatorCredentials | None = None
        self.limiter: LoginLimiter | None = None

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        if self.ssl_context is not None:  # the handshake runs in the connection's own thread (_Handler.setup)
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ssl.SSLError, OSError)):  # a failed handshake (plain HTTP to the TLS port...), a drop
            log.debug("web view: connection from %s ended: %s", client_address[0], exc)
            return
        log.exception("web view: request from %s failed", client_address[0])


def tls_context(cert: str | Path, key: str | Path, what: str = "[http]") -> ssl.SSLContext:
    """A server context (TLS 1.2 or newer) from a PEM certificate (chain) and its key; ConfigError naming the fix."""
    for name, p in (("tls_cert", cert), ("tls_key", key)):
        if not Path(p).is_file():
            raise ConfigError(f"{what} {name}: no such file {str(p)!r}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{what} tls_cert/tls_key: {cert} and {key} are not a PEM certificate and its key "
                          f"({exc})") from None
    return ctx


def web_options(config: Any, fleet_dir: str | Path | None = None) -> dict[str, Any]:
    """:class:`WebServer` keyword arguments from gateway.toml's ``[http]`` (a ``GatewayConfig``): ``tls_cert`` and
    ``tls_key`` resolved against the config's folder; with ``actions = true`` the operators of the fleet directory
    (``fleet_dir``, i.e. ``--dir``, else ``[gateway] fleet_dir``). Everything is checked now, before the gateway
    connects: a bad file is one ConfigError line."""
    kw: dict[str, Any] = {}
    if config.http_tls_cert or config.http_tls_key:
        kw["tls_cert"], kw["tls_key"] = config.path(config.http_tls_cert), config.path(config.http_tls_key)
        if kw["tls_cert"] is None or kw["tls_key"] is None:
            raise ConfigError("[http] tls_cert and tls_key go together: a PEM certificate and its private key")
        tls_context(kw["tls_cert"], kw["tls_key"], "[http]")
    if config.http_actions:
        if "tls_cert" not in kw:
            raise ConfigError("[http] actions = true needs tls_cert and tls_key: the dashboard acts only over HTTPS")
        fd = fleet_dir or (config.path(config.fleet_dir) if config.fleet_dir else None)
        if fd is None:
            raise ConfigError("[http] actions = true: the operators who may log in are the fleet directory's; pass "
                              "--dir or set [gateway] fleet_dir")
        OperatorCredentials(fd)
        kw["operators"] = fd
    return kw


class WebServer:
    """``WebServer(target, "127.0.0.1:9100").start()``; ``url``; ``stop()``. ``target``: a Gateway, a
    SimulatedFleet, a RoundManager/FleetManager, or a function returning one once it exists.

    ``tls_cert``/``tls_key``: serve HTTPS. ``operators``: the fleet directory whose operators may log in and act
    (deploy, rollback, commands; only over HTTPS). ``rollout_policy`` (an ``ota.RolloutPolicy``),
    ``command_timeout_s``, ``session_idle_s``, ``session_max_s``, ``login_attempts`` per ``login_window_s`` and
    ``clock`` tune the actions."""

    def __init__(self, target: Any, listen: str = DEFAULT_LISTEN, *, what: str = "--http",
                 tls_cert: str | Path | None = None, tls_key: str | Path | None = None,
                 operators: str | Path | None = None, rollout_policy: Any = None, command_timeout_s: float = 30.0,
                 session_idle_s: float = 900.0, session_max_s: float = 8 * 3600.0, login_attempts: int = 5,
                 login_window_s: float = 300.0, clock: Callable[[], float] = time.time) -> None:
        from .metrics import GatewayMetrics, require_prometheus

        require_prometheus()
        self.host, self.port = parse_listen(listen, what)
        self.what = what
        if (tls_cert is None) != (tls_key is None):
            raise ConfigError(f"{what}: give both tls_cert and tls_key (a certificate and its private key), or neither")
        self.ssl_context = tls_context(tls_cert, tls_key, what) if tls_cert is not None else None
        self.view = WebView(target)
        self.metrics = GatewayMetrics(self.view)
        self.credentials = OperatorCredentials(operators) if operators is not None else None
        self.audit = Audit(clock)
        self.actions = (FleetActions(self.view, self.audit, policy=rollout_policy, command_timeout_s=command_timeout_s)
                        if self.credentials is not None else None)
        self.sessions = Sessions(idle_s=session_idle_s, max_age_s=session_max_s, clock=clock)
        self.limiter = LoginLimiter(attempts=login_attempts, window_s=login_window_s, clock=clock)
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/"

    def start(self) -> "WebServer":
        try:
            self._server = _Server((self.host, self.port), self.view, self.metrics, is_loopback(self.host),
                                   self.ssl_context)
        except OSError as exc:
            raise ConfigError(f"{self.what} {self.host}:{self.port}: cannot listen ({exc.strerror or exc}); "
                              "pick another port or stop what uses it") from None
        srv = self._server
        srv.actions, srv.audit, srv.sessions = self.actions, self.audit, self.sessions
        srv.credentials, srv.limiter = self.credentials, self.limiter
        self.port = srv.server_address[1]
        if not is_loopback(self.host):
            log.warning("web view on %s:%d: the dashboard and /metrics (read-only) are readable by anyone who "
                        "can reach this address", self.host, self.port)
        if self.actions is not None and not self.tls:
            log.warning("web view: operators are configured but there is no TLS certificate: every action is "
                        "refused until tls_cert and tls_key are given")
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2},
                             name="edgeflow-web", daemon=True)
        t.start()
        self._threads.append(t)
        if not self.view.attached:  # the gateway does not exist yet (edgeflow demo): attach as soon as it does
            a = threading.Thread(target=self._attach, name="edgeflow-web-attach", daemon=True)
            a.start()
            self._threads.append(a)
        return self

    def _attach(self) -> None:
        while not self._stop.wait(0.05):
            try:
                if self.view.resolve():
                    return
            except Exception:  # noqa: BLE001 - retried: the target may be half built
                log.debug("web view: attach failed, retrying", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.actions is not None:
            self.actions.wait_deploy(timeout=5)
        for t in self._threads:
            t.join(timeout=2)
        self._threads.clear()

    def __enter__(self) -> "WebServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
