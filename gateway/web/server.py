"""One small HTTP server for the operator: the dashboard (``/``), its JSON (``/api/...``) and ``/metrics``.

Read-only by design: it serves GET and HEAD; every other method is answered 405 with the CLI command that
does the action (deploy, rollback and commands stay with ``edgeflow fleet``, which holds the operator's
credentials). Nothing here changes the fleet, so no credential is asked for; the data (device ids, versions,
telemetry) is readable by anyone who reaches the address, so the default listen address is loopback and a
wider one is logged as such. Bound to a loopback address, requests whose ``Host`` is not a loopback name are
refused (a web page elsewhere cannot read the fleet through DNS rebinding).

Every response carries a Content-Security-Policy that allows only this server's own script and style (no
inline script), ``nosniff`` and ``frame-ancestors 'none'``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from edgeflow.errors import ConfigError

from .view import WebView

log = logging.getLogger("edgeflow.gateway.web")

DEFAULT_LISTEN = "127.0.0.1:9100"
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"), "/style.css": ("style.css", "text/css; charset=utf-8")}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
READ_ONLY = ("read-only: the dashboard takes no actions over HTTP; deploy, roll back and send commands with "
             "`edgeflow fleet deploy|rollback|cmd` (docs/fleet.md)")
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


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
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, json.dumps(_clean(obj), separators=(",", ":")).encode(), "application/json")

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
            else:
                self._error(404, "not found: the dashboard is /, the metrics /metrics")
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:  # noqa: BLE001 - a bug in a page must not stop the server
            log.exception("web view: %s failed", path)
            self._error(500, "internal error (see the gateway's log)")

    do_HEAD = do_GET  # noqa: N815

    def _refuse(self) -> None:
        self._error(405, READ_ONLY, {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], view: WebView, metrics: Any, loopback_only: bool) -> None:
        self.address_family = __import__("socket").AF_INET6 if ":" in addr[0] else __import__("socket").AF_INET
        super().__init__(addr, _Handler)
        self.view = view
        self.metrics = metrics
        self.loopback_only = loopback_only


class WebServer:
    """``WebServer(target, "127.0.0.1:9100").start()``; ``url``; ``stop()``. ``target``: a Gateway, a
    SimulatedFleet, a RoundManager/FleetManager, or a function returning one once it exists."""

    def __init__(self, target: Any, listen: str = DEFAULT_LISTEN, *, what: str = "--http") -> None:
        from .metrics import GatewayMetrics, require_prometheus

        require_prometheus()
        self.host, self.port = parse_listen(listen, what)
        self.what = what
        self.view = WebView(target)
        self.metrics = GatewayMetrics(self.view)
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    def start(self) -> "WebServer":
        try:
            self._server = _Server((self.host, self.port), self.view, self.metrics, is_loopback(self.host))
        except OSError as exc:
            raise ConfigError(f"{self.what} {self.host}:{self.port}: cannot listen ({exc.strerror or exc}); "
                              "pick another port or stop what uses it") from None
        self.port = self._server.server_address[1]
        if not is_loopback(self.host):
            log.warning("web view on %s:%d: the dashboard and /metrics (read-only) are readable by anyone who "
                        "can reach this address", self.host, self.port)
        t = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
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
        for t in self._threads:
            t.join(timeout=2)
        self._threads.clear()

    def __enter__(self) -> "WebServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
