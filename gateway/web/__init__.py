"""The operator's web view of a gateway: Prometheus ``/metrics``, a live dashboard at ``/`` (read-only for anyone;
deploy, rollback and commands for a fleet operator logged in over HTTPS: ``actions.py``, ``auth.py``).

    from edgeflow.gateway.web import WebServer
    with WebServer(gateway, "127.0.0.1:9100"):   # --http ADDR, or [http] listen in gateway.toml
        gateway.run_rounds()

``prometheus_client`` is the one dependency (``pip install 'edgeflow[web]'``), imported when a server is made.
docs/operations.md lists the metrics and shows the dashboard.
"""

from __future__ import annotations

from .server import DEFAULT_LISTEN, WebServer, parse_listen, web_options
from .view import WebView

__all__ = ["DEFAULT_LISTEN", "WebServer", "WebView", "parse_listen", "web_options"]
