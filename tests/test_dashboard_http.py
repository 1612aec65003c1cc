"""The dashboard's rules over plain HTTP (urllib): a server started without operators is read-only (no method
but GET/HEAD does anything, no action endpoint exists; the actions' own rules are tests/test_dashboard_actions.py),
loopback binding answers only loopback Host names, every response carries a strict CSP,
and device strings leave only as JSON data (the page sets them with textContent; its script is checked for
the HTML sinks)."""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="the web view needs prometheus_client (pip install 'edgeflow[web]')")

sys.path.insert(0, str(Path(__file__).parent))
from _webfleet import HOSTILE_BACKEND, HOSTILE_ID, web_fleet  # noqa: E402

STATIC = Path(__file__).resolve().parents[1] / "gateway" / "web" / "static"


def _req(url: str, method: str = "GET", headers: dict | None = None, data: bytes | None = None):
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture(scope="module")
def wf(tmp_path_factory):
    with web_fleet(tmp_path_factory.mktemp("http")) as w:
        yield w


def _strict_json(body: bytes):
    def no_constant(name):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(body, parse_constant=no_constant)


def test_pages_and_data_are_served_with_a_strict_policy(wf):
    for path, ctype in (("", "text/html"), ("app.js", "text/javascript"), ("style.css", "text/css"),
                        ("api/state", "application/json"), ("metrics", "text/plain")):
        code, headers, body = _req(wf.url + path)
        assert code == 200 and headers["Content-Type"].startswith(ctype), (path, code, headers)
        csp = headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert "frame-ancestors 'none'" in csp and headers["X-Content-Type-Options"] == "nosniff"
        assert headers["X-Frame-Options"] == "DENY"
    state = _strict_json(_req(wf.url + "api/state")[2])
    assert {d["device_id"] for d in state["devices"]} == {*wf.agents, HOSTILE_ID}
    assert [r["round_id"] for r in state["rounds"]] == [m.round_id for m in wf.rounds.history]
    assert state["rollouts"][0]["state"] == "completed" and state["rollouts"][0]["done"] == 2


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
@pytest.mark.parametrize("path", ["", "api/state", "api/deploy", "api/rollback", "api/device?id=dev-01", "metrics"])
def test_no_method_but_get_does_anything(wf, method, path):
    before = (wf.rounds.version, len(wf.server.view.rollout_log.list()), len(wf.fm.devices()))
    body = json.dumps({"to": "all", "command": "reboot"}).encode()
    code, headers, out = _req(wf.url + path, method, {"Content-Type": "application/json",
                                                      "Authorization": "Bearer anything"}, body)
    assert code == 405 and headers["Allow"] == "GET, HEAD"
    assert "edgeflow fleet deploy|rollback|cmd" in _strict_json(out)["error"]
    assert (wf.rounds.version, len(wf.server.view.rollout_log.list()), len(wf.fm.devices())) == before


def test_there_is_no_action_endpoint(wf):
    for path in ("api/deploy", "api/rollback", "api/command", "api/cmd", "deploy", "api/devices/dev-01/reboot"):
        assert _req(wf.url + path)[0] == 404


def test_a_loopback_server_answers_only_loopback_host_names(wf):
    port = wf.server.port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"[::1]:{port}"):
        assert _req(wf.url + "api/state", headers={"Host": host})[0] == 200, host
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"10.0.0.1:{port}"):
        code, _, body = _req(wf.url + "api/state", headers={"Host": host})
        assert code == 421 and b"devices" not in body, host


def test_a_server_on_every_interface_takes_any_host_and_says_so(tmp_path, caplog):
    from edgeflow.gateway.web import WebServer

    with web_fleet(tmp_path, rounds=1, agents=1) as w:
        with caplog.at_level("WARNING", logger="edgeflow.gateway.web"):
            srv = WebServer(w.server.view._target, "0.0.0.0:0").start()
        try:
            assert _req(srv.url + "api/state", headers={"Host": "gateway.lan"})[0] == 200
            assert any("readable by anyone" in r.getMessage() for r in caplog.records)
        finally:
            srv.stop()


def test_device_strings_travel_as_json_data_only(wf):
    from urllib.parse import quote

    code, headers, body = _req(wf.url + "api/device?id=" + quote(HOSTILE_ID))
    assert code == 200 and headers["Content-Type"] == "application/json"
    dev = _strict_json(body)
    assert dev["device_id"] == HOSTILE_ID and dev["backend"] == HOSTILE_BACKEND and dev["online"] is False
    assert _req(wf.url + "api/device?id=nobody")[0] == 404
    assert _req(wf.url + "api/device")[0] == 400
    agent = _strict_json(_req(wf.url + "api/device?id=" + wf.agents[0])[2])
    assert agent["telemetry"] and agent["model_version"] == 1 and agent["health"] == "ok"


def test_the_page_script_uses_no_html_sink():
    """The rule the dashboard keeps: device data only through textContent/createTextNode."""
    js = (STATIC / "app.js").read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "setAttribute(\"on", "srcdoc"):
        assert sink not in js, sink
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    assert not re.search(r"<script(?![^>]*\bsrc=)", html), "inline script: the CSP would block it"
    assert not re.search(r"\son[a-z]+\s*=", html), "inline event handler: the CSP would block it"
