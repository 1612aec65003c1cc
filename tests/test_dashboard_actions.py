"""Actions from the dashboard over real HTTPS sockets (urllib, a certificate from a fleet CA): log-in with the
fleet directory's operator credentials, the session cookie, the CSRF token, the Origin check, plain HTTP, expiry,
the failed-log-in limit and hostile bodies are each tried with the hostile request itself; the good path
deploys a global model version to the running loopback fleet, rolls it back and sends a device command, and
every step is in the audit with the operator's name."""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="the web view needs prometheus_client (pip install 'edgeflow[web]')")

sys.path.insert(0, str(Path(__file__).parent))
from _fleet import wait_until  # noqa: E402
from _webfleet import HOSTILE_ID, web_fleet  # noqa: E402


class Clock:
    """The servers' clock: tests move it instead of sleeping through an expiry."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def _fleet_dir(root: Path):
    from edgeflow.broker.mosquitto import FleetDir, make_fleet_ca

    fd = FleetDir(root / "fleet").init("lab")
    (root / "tls").mkdir()
    ca, cert, key = make_fleet_ca(root / "tls", ["localhost", "127.0.0.1"])
    return fd, ca, cert, key


class Client:
    """An HTTPS client that trusts the test CA and keeps the session cookie the way a browser would."""

    def __init__(self, base: str, ca: Path | None) -> None:
        self.base = base
        self.ctx = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
        self.cookie: str | None = None
        self.csrf: str | None = None
        self.origin = base.rstrip("/")

    def request(self, path: str, body: object = None, *, method: str | None = None, headers: dict | None = None,
                raw: bytes | None = None, csrf: bool = True, origin: bool = True):
        h = {"Content-Type": "application/json"}
        if origin:
            h["Origin"] = self.origin
        if self.cookie:
            h["Cookie"] = self.cookie
        if csrf and self.csrf:
            h["X-CSRF-Token"] = self.csrf
        h.update(headers or {})
        h = {k: v for k, v in h.items() if v is not None}
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.base + path, data=data, headers=h,
                                     method=method or ("POST" if data is not None else "GET"))
        try:
            with urllib.request.urlopen(req, timeout=60, context=self.ctx) as r:
                return r.status, r.headers, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read() or b"null")

    def login(self, user: str, password: str):
        code, headers, out = self.request("api/login", {"user": user, "password": password})
        if code == 200:
            self.cookie = headers["Set-Cookie"].split(";")[0]
            self.csrf = out["csrf"]
        return code, headers, out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("actions")
    fd, ca, cert, key = _fleet_dir(root)
    clock = Clock()
    with web_fleet(root, tls_cert=cert, tls_key=key, operators=fd.path, clock=clock, login_attempts=100,
                   command_timeout_s=20) as wf:
        wf.fd, wf.ca, wf.cert, wf.key, wf.clock = fd, ca, cert, key, clock
        wf.admin = fd.operator("admin")["password"]
        yield wf


def _client(site) -> Client:
    return Client(site.url, site.ca)


def _logged_in(site) -> Client:
    c = _client(site)
    assert c.login("admin", site.admin)[0] == 200
    return c


def _sent(site) -> tuple:
    st = site.fm.stats()
    return st.get("commands_sent", 0), st.get("ota_sent", 0), len(site.store.rollouts())


ACTIONS = [("api/deploy", {"model_version": 1, "to": "all"}),
           ("api/rollback", {"to": "all"}),
           ("api/command", {"device": "x", "name": "reboot"})]


def test_the_server_speaks_tls_and_the_read_only_view_needs_no_login(site):
    assert site.url.startswith("https://127.0.0.1:")
    c = _client(site)
    code, headers, state = c.request("api/state")
    assert code == 200 and headers["Strict-Transport-Security"].startswith("max-age=")
    assert {d["device_id"] for d in state["devices"]} == {*site.agents, HOSTILE_ID}
    code, _, info = c.request("api/session")
    assert code == 200 and info == {"actions": True, "operator": None}
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to the TLS port: no answer
        urllib.request.urlopen(site.url.replace("https://", "http://") + "api/state", timeout=10)


@pytest.mark.parametrize("path,body", ACTIONS)
def test_no_credential_no_action(site, path, body):
    before = _sent(site)
    anon = _client(site)
    assert anon.request(path, body)[0] == 401
    forged = _client(site)
    forged.cookie, forged.csrf = "__Host-edgeflow_session=" + "A" * 43, "B" * 43
    code, _, out = forged.request(path, body)
    assert code == 401 and "log in first" in out["error"]
    assert anon.request("api/audit")[0] == 401
    assert _sent(site) == before


@pytest.mark.parametrize("user,password", [
    ("admin", "wrong"), ("admin", ""), ("admin", None), ("gateway", "GW"), ("admin-2", "S2"),
    ("../../fleet", "x"), ("nobody", "x"), (["admin"], "x"), ("admin\x00", "x"),
])
def test_a_wrong_or_foreign_credential_gets_no_session(site, user, password):
    creds = {"GW": site.fd.operator("gateway")["password"], "S2": site.fd.operator("admin-2")["password"]}
    c = _client(site)
    code, headers, out = c.request("api/login", {"user": user, "password": creds.get(password, password)})
    assert code == 401 and "wrong user name or password" in out["error"]
    assert "Set-Cookie" not in headers
    assert any(e["action"] == "login" and e["outcome"] == "failed" for e in site.server.audit.list())


def test_the_session_cookie_is_httponly_secure_samesite_strict(site):
    c = _client(site)
    code, headers, out = c.login("admin", site.admin)
    assert code == 200 and out["operator"] == "admin" and len(out["csrf"]) >= 40
    cookie = headers["Set-Cookie"]
    assert cookie.startswith("__Host-edgeflow_session=")
    for flag in ("HttpOnly", "Secure", "SameSite=Strict", "Path=/"):
        assert flag in cookie, flag
    assert "Domain" not in cookie
    code, _, info = c.request("api/session")
    assert code == 200 and info["operator"] == "admin" and info["csrf"] == c.csrf
    assert [m["version"] for m in info["models"]] == [m["version"] for m in site.store.model_versions()]


@pytest.mark.parametrize("path,body", ACTIONS + [("api/logout", {})])
def test_a_missing_or_wrong_csrf_token_is_refused(site, path, body):
    c = _logged_in(site)
    other = _logged_in(site)
    before = _sent(site)
    for token in (None, "", "x" * 43, other.csrf, c.csrf.upper() if c.csrf != c.csrf.upper() else c.csrf[::-1]):
        code, _, out = c.request(path, body, headers={"X-CSRF-Token": token}, csrf=False)
        assert code == 403 and "X-CSRF-Token" in out["error"], token
    assert _sent(site) == before
    assert c.request("api/session")[2]["operator"] == "admin"  # the session itself is still good


@pytest.mark.parametrize("path,body", ACTIONS + [("api/login", None)])
def test_a_cross_origin_post_is_refused(site, path, body):
    c = _logged_in(site)
    body = body if body is not None else {"user": "admin", "password": site.admin}
    port = site.server.port
    before = _sent(site)
    for hdr in ({"Origin": "https://evil.example"}, {"Origin": "null"}, {"Origin": f"http://127.0.0.1:{port}"},
                {"Origin": f"https://127.0.0.1:{port}.evil.example"},
                {"Origin": None, "Referer": "https://evil.example/dashboard"},
                {"Origin": None, "Referer": None}):
        code, headers, out = c.request(path, body, headers=hdr)
        assert code == 403 and "cross-origin" in out["error"], hdr
        assert "Set-Cookie" not in headers
    assert _sent(site) == before
    # the same request from the server's own page (a Referer, as some browsers send instead of Origin) passes
    if path == "api/command":
        ok = c.request(path, {"device": site.agents[0], "name": "status"},
                       headers={"Origin": None, "Referer": site.url + "#/devices"})
        assert ok[0] == 200 and ok[2]["ack"]["ok"]


def test_a_form_post_and_hostile_bodies_are_refused_before_anything_is_sent(site):
    c = _logged_in(site)
    before = _sent(site)
    form = c.request("api/command", raw=b"device=x&name=reboot",
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form[0] == 415
    assert c.request("api/command", raw=b"{not json")[0] == 400
    assert c.request("api/command", raw=b"[1, 2]")[0] == 400
    assert c.request("api/command", raw=b" " * (70 * 1024))[0] == 413
    for path, body, code, words in [
        ("api/deploy", {"model_version": "1; DROP TABLE models", "to": "all"}, 400, "model_version"),
        ("api/deploy", {"model_version": True, "to": "all"}, 400, "model_version"),
        ("api/deploy", {"model_version": 999, "to": "all"}, 404, "no global model v999"),
        ("api/deploy", {"model_version": -1, "to": "all"}, 404, "no global model"),
        ("api/deploy", {"model_version": 1, "to": "colour=red"}, 400, "'to'"),
        ("api/deploy", {"model_version": 1, "to": "device=nobody"}, 409, "no online device"),
        ("api/command", {"device": HOSTILE_ID, "name": "status"}, 400, "device id"),
        ("api/command", {"device": "../../etc", "name": "status"}, 400, "device id"),
        ("api/command", {"device": site.agents[0], "name": "deploy"}, 400, "unknown command"),
        ("api/command", {"device": site.agents[0], "name": "rm -rf /"}, 400, "unknown command"),
        ("api/command", {"device": site.agents[0], "name": "status", "args": [1]}, 400, "args"),
        ("api/command", {"device": site.agents[0], "name": "set_config", "args": {"k": "x" * 5000}}, 400, "args"),
        ("api/command", {"device": "ghost-1", "name": "status"}, 404, "no device"),
        ("api/rollback", {"device": "ghost-1"}, 404, "no device"),
        ("api/rollback", {"to": "device=ghost-*"}, 409, "nothing to roll back"),
    ]:
        got, _, out = c.request(path, body)
        assert got == code and words in out["error"], (path, body, got, out)
    assert _sent(site) == before


def test_plain_http_refuses_every_action_even_on_loopback(site):
    from edgeflow.gateway.web import WebServer

    plain = WebServer(site.server.view._target, "127.0.0.1:0", operators=site.fd.path).start()
    try:
        c = Client(plain.url, None)
        assert plain.url.startswith("http://")
        before = _sent(site)
        code, headers, out = c.request("api/login", {"user": "admin", "password": site.admin})
        assert code == 403 and "need HTTPS" in out["error"] and "Set-Cookie" not in headers
        c.cookie = "__Host-edgeflow_session=whatever"
        for path, body in ACTIONS:
            assert c.request(path, body)[0] == 403
        info = c.request("api/session")[2]
        assert info["actions"] is False and "need HTTPS" in info["why"]
        assert _sent(site) == before
    finally:
        plain.stop()


def test_an_expired_or_ended_session_is_refused(site):
    c = _logged_in(site)
    body = {"device": site.agents[0], "name": "status"}
    site.clock.t += 600  # inside the idle limit (900 s): the session lives and its idle time restarts
    assert c.request("api/command", body)[0] == 200
    site.clock.t += 901
    code, _, out = c.request("api/command", body)
    assert code == 401 and "expired" in out["error"]
    assert c.request("api/session")[2]["operator"] is None

    d = _logged_in(site)
    assert d.request("api/logout", {})[0] == 200
    assert d.request("api/command", body)[0] == 401
    assert any(e["action"] == "logout" and e["operator"] == "admin" for e in site.server.audit.list())


def test_the_absolute_lifetime_ends_a_busy_session(site):
    started = site.clock.t
    c = _logged_in(site)
    body = {"device": site.agents[0], "name": "status"}
    for _ in range(45):  # busy every 12 minutes for over 8 hours: never idle, still ends
        site.clock.t += 720
        if c.request("api/command", body)[0] == 401:
            break
    else:
        pytest.fail("the session outlived its 8 h lifetime")
    assert 8 * 3600 < site.clock.t - started <= 8 * 3600 + 720


def test_failed_log_ins_are_limited_even_for_the_right_password(site):
    from edgeflow.gateway.web import WebServer

    clock = Clock()
    srv = WebServer(site.server.view._target, "127.0.0.1:0", operators=site.fd.path, tls_cert=site.cert,
                    tls_key=site.key, login_attempts=3, login_window_s=300, clock=clock).start()
    try:
        c = Client(srv.url, site.ca)
        for _ in range(3):
            assert c.login("admin", "guess")[0] == 401
        code, headers, out = c.login("admin", site.admin)
        assert code == 429 and int(headers["Retry-After"]) > 0 and "too many failed log-ins" in out["error"]
        assert c.cookie is None
        clock.t += 301
        assert c.login("admin", site.admin)[0] == 200
    finally:
        srv.stop()


def test_an_operator_sends_a_command_and_it_is_audited(site):
    c = _logged_in(site)
    code, _, out = c.request("api/command", {"device": site.agents[0], "name": "status"})
    assert code == 200 and out["ack"]["ok"] and out["ack"]["device"] == site.agents[0]
    assert out["ack"]["result"]["model_version"] is not None
    code, _, audit = c.request("api/audit")
    last = [e for e in audit["entries"] if e["action"] == "command"][-1]
    assert (last["operator"], last["device"], last["name"], last["outcome"]) == ("admin", site.agents[0], "status",
                                                                                "ok")


def test_an_operator_deploys_a_global_model_version_then_rolls_it_back(site):
    c = _logged_in(site)
    running = {d: site.fm.device(d).model_version for d in site.agents}
    assert set(running.values()) == {1}
    latest = site.store.model_versions()[-1]["version"]
    code, _, out = c.request("api/deploy", {"model_version": latest, "to": "all"})
    assert code == 202 and out["artifact_version"] == 2 and out["model_version"] == latest
    assert site.server.actions.wait_deploy(timeout=120)
    # the rollout ends on the devices' acks; the registry follows each device's birth, sent after its ack
    assert wait_until(lambda: {d: site.fm.device(d).model_version for d in site.agents}
                      == dict.fromkeys(site.agents, 2), 20), {d: site.fm.device(d).model_version for d in site.agents}
    recorded = site.store.rollouts()[-1]
    assert recorded["artifact_version"] == 2 and recorded["state"] == "completed"
    assert recorded["report"]["operator"] == "admin" and recorded["name"] == f"global model v{latest}"
    assert recorded["source_sha256"] == site.store.model(latest)[1]
    state = c.request("api/state")[2]
    assert state["rollouts"][-1]["version"] == 2 and state["rollouts"][-1]["state"] == "completed"

    code, _, out = c.request("api/rollback", {"to": "all"})
    assert code == 200 and all(a["ok"] for a in out["results"].values()), out
    assert {d: a["result"]["model_version"] for d, a in out["results"].items()} == dict.fromkeys(site.agents, 1)
    entries = [(e["operator"], e["action"], e["outcome"]) for e in site.server.audit.list()]
    assert ("admin", "deploy", "started") in entries and ("admin", "deploy", "completed") in entries
    assert ("admin", "rollback", "ok") in entries


def test_a_read_only_server_still_has_no_action(tmp_path):
    """Without operators the dashboard stays read-only (405 naming the CLI), whatever is sent."""
    with web_fleet(tmp_path, rounds=1, agents=1) as wf:
        c = Client(wf.url, None)
        for path, body in [*ACTIONS, ("api/login", {"user": "admin", "password": "x"})]:
            code, headers, out = c.request(path, body)
            assert code == 405 and "edgeflow fleet deploy|rollback|cmd" in out["error"]
        assert c.request("api/session")[2]["actions"] is False


def _gateway_cli(*args: str, cwd: Path):
    import subprocess

    return subprocess.run([sys.executable, "-m", "edgeflow", "gateway", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.mark.parametrize("http,words", [
    ('tls_cert = "c.pem"\n', "go together"),
    ('actions = true\n', "needs http.tls_cert"),
    ('tls_cert = "junk.pem"\ntls_key = "junk.pem"\nactions = true\n', "not a PEM certificate"),
    ('tls_cert = "missing.pem"\ntls_key = "k.pem"\n', "no such file"),
    ('actions = "yes"\n', "http.actions"),
])
def test_gateway_toml_http_settings_that_cannot_work_are_one_line(tmp_path, http, words):
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    (tmp_path / "k.pem").write_text("x\n")
    (tmp_path / "gateway.toml").write_text(f'[gateway]\nfleet_dir = "fleet"\n[http]\nlisten = "127.0.0.1:0"\n{http}')
    r = _gateway_cli("--config", "gateway.toml", cwd=tmp_path)
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_gateway_toml_turns_on_https_and_the_fleet_operators(tmp_path, site):
    from edgeflow.gateway.service import load_config
    from edgeflow.gateway.web import WebServer, web_options

    (tmp_path / "gateway.toml").write_text(
        f'[gateway]\nfleet_dir = "{site.fd.path}"\n[http]\nlisten = "127.0.0.1:0"\n'
        f'tls_cert = "{site.cert}"\ntls_key = "{site.key}"\nactions = true\n')
    cfg = load_config(tmp_path / "gateway.toml")
    kw = web_options(cfg)
    assert Path(kw["operators"]) == Path(site.fd.path) and Path(kw["tls_cert"]) == Path(site.cert)
    srv = WebServer(site.server.view._target, cfg.http_listen, **kw).start()
    try:
        c = Client(srv.url, site.ca)
        assert srv.url.startswith("https://") and c.login("admin", site.admin)[0] == 200
        code, _, out = c.request("api/command", {"device": site.agents[0], "name": "status"})
        assert code == 200 and out["ack"]["ok"]
    finally:
        srv.stop()
    (tmp_path / "gateway.toml").write_text(f'[gateway]\nfleet_dir = "{tmp_path / "nothing"}"\n[http]\n'
                                           f'tls_cert = "{site.cert}"\ntls_key = "{site.key}"\nactions = true\n')
    from edgeflow.errors import ConfigError

    with pytest.raises(ConfigError, match="not a fleet directory"):
        web_options(load_config(tmp_path / "gateway.toml"))


def test_a_hostile_user_name_stays_one_audit_line(site, caplog):
    c = _client(site)
    name = 'x\ndashboard action: operator="admin" action=deploy outcome="completed"\x1b[2J'
    with caplog.at_level("INFO", logger="edgeflow.gateway.web.audit"):
        assert c.request("api/login", {"user": name, "password": "x"})[0] == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "edgeflow.gateway.web.audit"]
    assert lines and all("\n" not in m and "\x1b" not in m for m in lines), lines
    assert site.server.audit.list()[-1]["operator"] == name[:64]  # kept as data, shown escaped


def test_the_log_in_limit_holds_under_a_spray_of_names_and_addresses():
    from edgeflow.gateway.web.auth import LoginLimiter

    clock = Clock()
    lim = LoginLimiter(attempts=3, window_s=300, clock=clock, max_keys=50)
    for _ in range(3):
        lim.failed("10.0.0.1", "admin")
    for i in range(20):  # other names from other addresses: admin's count is kept
        lim.failed(f"10.1.0.{i}", f"user{i}")
    assert lim.retry_after("10.9.9.9", "admin") > 0 and lim.retry_after("10.0.0.1", "someone") > 0
    for i in range(1000):  # a spray past the bound: memory stays bounded, the newest sprayers are still counted
        for _ in range(3):
            lim.failed(f"10.2.{i // 250}.{i % 250}", f"spray{i}")
    assert lim.retry_after("10.2.3.249", "other") > 0 and lim.retry_after("10.8.8.8", "spray999") > 0
    assert lim.retry_after("10.8.8.8", "fresh-user") == 0
    clock.t += 301
    assert lim.retry_after("10.2.3.249", "spray999") == 0


@pytest.mark.integration
def test_actions_on_a_real_mosquitto_fleet(tmp_path_factory):
    """Nothing in-process: Mosquitto with the config broker-config generates (TLS, passwords, ACL), the gateway's
    FleetManager and two device agents on real MQTT connections, the dashboard on a certificate of the same fleet
    CA, and the fleet directory's own admin password. Deploy global model v1, then `status` to a board."""
    import hashlib
    from types import SimpleNamespace

    from _fleet import FLEET, make_fleet_env, mlp_bytes

    from edgeflow.gateway.store import GatewayStore
    from edgeflow.gateway.web import WebServer

    env = make_fleet_env(tmp_path_factory.mktemp("realfleet"), pool=4)
    srv = None
    try:
        store = GatewayStore(":memory:")
        model = mlp_bytes(3)
        assert store.add_model(model, hashlib.sha256(model).hexdigest()) == 1
        fm = env.gateway(store=store)
        agents = [env.agent() for _ in range(2)]
        ids = [a.device_id for a in agents]
        assert fm.wait_online(ids, timeout=30), "the agents did not come online"
        broker = env.fleet_dir.broker_dir
        srv = WebServer(SimpleNamespace(fleet=fm, store=store, transport=fm.transport, fleet_id=FLEET),
                        "127.0.0.1:0", tls_cert=broker / "server.crt", tls_key=broker / "server.key",
                        operators=env.fleet_dir.path, command_timeout_s=20).start()
        c = Client(srv.url, Path(env.ca))
        assert c.login("admin", "not-the-password")[0] == 401
        assert c.login("admin", env.fleet_dir.operator("admin")["password"])[0] == 200
        code, _, out = c.request("api/deploy", {"model_version": 1, "to": "all"})
        assert code == 202 and out["artifact_version"] == 1, out
        assert srv.actions.wait_deploy(timeout=120)
        assert wait_until(lambda: all(fm.device(d).model_version == 1 for d in ids), 20)
        assert store.rollouts()[-1]["state"] == "completed"
        code, _, out = c.request("api/command", {"device": ids[0], "name": "status"})
        assert code == 200 and out["ack"]["ok"] and out["ack"]["result"]["model_version"] == 1
        assert {("admin", "deploy", "completed"), ("admin", "command", "ok")} <= {
            (e["operator"], e["action"], e["outcome"]) for e in srv.audit.list()}
    finally:
        if srv is not None:
            srv.stop()
        env.close()


@pytest.mark.integration
def test_edgeflow_gateway_serves_the_actions_from_gateway_toml(tmp_path_factory):
    """The whole path through the CLI: `edgeflow gateway --serve` with [http] tls_cert/tls_key/actions on a real
    Mosquitto fleet; an operator logs in with the fleet directory's admin password, deploys the gateway's global
    model to a board over MQTT and asks it for its status."""
    import re
    import signal
    import subprocess
    import threading

    from _fleet import make_fleet_env, mlp_bytes

    root = tmp_path_factory.mktemp("cli-actions")
    env = make_fleet_env(root, pool=2)
    gw = None
    try:
        (root / "model.onnx").write_bytes(mlp_bytes(5))
        broker = env.fleet_dir.broker_dir
        (root / "gw.toml").write_text(
            '[gateway]\nstate = "gw.sqlite"\nmodel = "model.onnx"\n[rounds]\nrounds = 1\nmin_clients = 1\n'
            f'[http]\nlisten = "127.0.0.1:0"\ntls_cert = "{broker / "server.crt"}"\n'
            f'tls_key = "{broker / "server.key"}"\nactions = true\n')
        board = env.agent()
        gw = subprocess.Popen([sys.executable, "-m", "edgeflow", "gateway", "--config", str(root / "gw.toml"),
                               "--dir", str(env.fleet_dir.path), "--broker", env.url, "--rounds", "0", "--serve"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)
        lines: list[str] = []
        found = threading.Event()

        def read() -> None:
            assert gw.stdout is not None
            for line in gw.stdout:
                lines.append(line)
                if "dashboard https://" in line:
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        assert found.wait(90), "".join(lines)
        url = re.search(r"dashboard (https://\S+/)", "".join(lines)).group(1)
        c = Client(url, Path(env.ca))
        assert c.login("admin", env.fleet_dir.operator("admin")["password"])[0] == 200
        assert wait_until(lambda: board.device_id in {d["device_id"] for d in c.request("api/state")[2]["devices"]
                                                      if d["online"]}, 30), "the board never showed as online"
        models = c.request("api/session")[2]["models"]
        assert models, "the gateway's store holds no global model"
        code, _, out = c.request("api/deploy", {"model_version": models[-1]["version"], "to": "all"})
        assert code == 202 and out["targets"] == 1 and out["artifact_version"] == 1, out  # the board ran none before
        assert wait_until(lambda: any(r["state"] == "completed" for r in c.request("api/state")[2]["rollouts"]), 90)
        code, _, out = c.request("api/command", {"device": board.device_id, "name": "status"})
        assert code == 200 and out["ack"]["ok"] and out["ack"]["result"]["model_version"] == 1, out
    finally:
        if gw is not None and gw.poll() is None:
            gw.send_signal(signal.SIGINT)
            try:
                gw.wait(20)
            except subprocess.TimeoutExpired:
                gw.kill()
                gw.wait()
        env.close()
