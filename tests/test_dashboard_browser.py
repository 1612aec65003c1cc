"""The dashboard in a real browser: headless Chromium (Debian's ``chromium``, driven by playwright without its
own browser download) loads the page of a running loopback fleet and sees its devices, rounds, rollout and a
device's telemetry; a device id carrying HTML and script is shown as text and never runs; the page logs no
error (a CSP violation would be one). Over HTTPS with the fleet's operators, an operator logs in through the
form, sends a device command and deploys a global model version by pressing the buttons, and the fleet runs it.
Screenshots go to $EDGEFLOW_SCREENSHOT_DIR (CI keeps them) or tmp_path; their paths are printed.

CI installs the browser and playwright (.ci/run): ``apt-get install -y chromium`` and ``pip install playwright``
(never ``playwright install``). $EDGEFLOW_CHROMIUM names another executable.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="the web view needs prometheus_client (pip install 'edgeflow[web]')")
pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright; .ci/run does)")

CHROMIUM = os.environ.get("EDGEFLOW_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium executable (apt-get install -y chromium, or set "
                       "EDGEFLOW_CHROMIUM)"),
    pytest.mark.slow,
]

sys.path.insert(0, str(Path(__file__).parent))
from _fleet import wait_until  # noqa: E402
from _webfleet import HOSTILE_BACKEND, HOSTILE_ID, HOSTILE_PROFILE, web_fleet  # noqa: E402


def _shots(tmp_path: Path) -> Path:
    d = Path(os.environ.get("EDGEFLOW_SCREENSHOT_DIR") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_the_dashboard_shows_the_fleet_in_chromium(tmp_path):
    from playwright.sync_api import sync_playwright

    shots = _shots(tmp_path)
    with web_fleet(tmp_path) as wf, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            problems: list[str] = []
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
            page.goto(wf.url, wait_until="domcontentloaded")
            page.wait_for_selector("body[data-loaded='1']", timeout=20_000)

            # the fleet table: every device, the hostile one as literal text
            rows = page.locator("#devices tbody tr")
            assert rows.count() == 3
            ids = sorted(rows.locator("td:first-child").all_text_contents())
            assert ids == sorted([*wf.agents, HOSTILE_ID])
            hostile = page.locator("#devices tbody tr", has_text="onerror")
            cells = hostile.locator("td").all_text_contents()
            assert cells[0] == HOSTILE_ID and cells[2] == HOSTILE_PROFILE and cells[3] == HOSTILE_BACKEND
            assert page.locator("#devices img, #devices script, #injected").count() == 0
            assert page.evaluate("window.__pwned === undefined")
            agent = page.locator(f"#devices tbody tr[data-device='{wf.agents[0]}'] td").all_text_contents()
            assert agent[1] == "ok" and agent[2] == "raspberry-pi-4" and agent[4] == "v1"

            # the summary and the round charts (a point per round)
            assert page.locator(".card[data-key='rounds closed'] b").text_content() == "2"
            assert page.locator("#chart-accuracy svg circle").count() == 2
            assert page.locator("#chart-bytes svg circle").count() == 2
            main = shots / "dashboard-fleet.png"
            page.screenshot(path=str(main), full_page=True)
            print(f"screenshot: {main}")

            page.goto(wf.url + "#/rounds")
            page.wait_for_selector("#rounds tbody tr")
            assert page.locator("#rounds tbody tr").count() == 2
            assert page.locator("#rounds tbody tr").first.locator("td").first.text_content() == "2"

            page.goto(wf.url + "#/rollouts")
            page.wait_for_selector("#rollouts .rollout")
            assert "completed" in page.locator("#rollouts .rollout").first.text_content()
            assert "2/2 devices" in page.locator("#rollouts .rollout").first.text_content()

            # a device's page: its facts and telemetry (reached by clicking its link)
            page.goto(wf.url)
            page.wait_for_selector("#devices tbody tr")
            page.locator(f"#devices tbody tr[data-device='{wf.agents[0]}'] a").click()
            page.wait_for_selector("#telemetry tbody tr", timeout=10_000)
            assert page.locator("#device-id").text_content() == wf.agents[0]
            assert page.locator("#telemetry tbody tr").count() >= 1
            assert page.locator("#device-chart-caption").text_content() == "telemetry: cpu_percent"
            assert page.locator("#chart-device svg circle").count() >= 1
            dev = shots / "dashboard-device.png"
            page.screenshot(path=str(dev), full_page=True)
            print(f"screenshot: {dev}")

            # the hostile device's page too: its id in the URL and the heading, as text
            page.goto(wf.url)
            page.wait_for_selector("#devices tbody tr")
            hostile.locator("a").click()
            page.wait_for_selector("#device-facts dd")
            assert page.locator("#device-id").text_content() == HOSTILE_ID
            assert page.evaluate("window.__pwned === undefined")
            assert page.locator("main img, main script").count() == 0
            assert not problems, problems
        finally:
            browser.close()


def test_a_thousand_devices_in_chromium(tmp_path):
    """1,000 registry rows: the table draws 500 and says how many more; the filter finds any one."""
    import time

    from playwright.sync_api import sync_playwright

    shots = _shots(tmp_path)
    with web_fleet(tmp_path, rounds=1, agents=1) as wf, sync_playwright() as pw:
        profiles = ("raspberry-pi-4", "raspberry-pi-5", "jetson-orin-nano", "x86-gateway")
        for i in range(1000 - 2):
            p = profiles[i % 4]
            wf.store.upsert_birth(f"sim-{i:04d}", {"profile": p, "backend": "ort", "can_train": True}, profile=p,
                                  model_version=1 + i % 3)
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            t0 = time.perf_counter()
            page.goto(wf.url, wait_until="domcontentloaded")
            page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
            print(f"1000 devices: page loaded and drawn in {time.perf_counter() - t0:.2f} s")
            assert page.locator(".card[data-key='devices'] b").text_content() == "1000"
            assert page.locator("#devices tbody tr").count() == 500
            assert page.locator("#devices-more").text_content() == "500 more not shown: filter to narrow"
            page.fill("#filter", "sim-0777")
            assert page.locator("#devices tbody tr").count() == 1
            page.fill("#filter", "")
            shot = shots / "dashboard-1000-devices.png"
            page.screenshot(path=str(shot))
            print(f"screenshot: {shot}")
        finally:
            browser.close()


def test_an_operator_logs_in_and_acts_in_chromium(tmp_path):
    """HTTPS (a fleet-CA certificate), the fleet directory's admin: log in through the form, send `status` from a
    device's page, deploy the newest global model from the fleet page; the devices run it and the audit names admin."""
    from playwright.sync_api import expect, sync_playwright

    from edgeflow.broker.mosquitto import FleetDir, make_fleet_ca

    shots = _shots(tmp_path)
    fd = FleetDir(tmp_path / "fleet").init("lab")
    (tmp_path / "tls").mkdir()
    _, cert, key = make_fleet_ca(tmp_path / "tls", ["localhost", "127.0.0.1"])
    with web_fleet(tmp_path, tls_cert=cert, tls_key=key, operators=fd.path) as wf, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            ctx = browser.new_context(viewport={"width": 1280, "height": 900}, ignore_https_errors=True)
            page = ctx.new_page()
            problems: list[str] = []
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(wf.url, wait_until="domcontentloaded")
            expect(page.locator("#login-form")).to_be_visible(timeout=20_000)
            expect(page.locator("#actions")).to_be_hidden()
            page.fill("#login-user", "admin")
            page.fill("#login-password", fd.operator("admin")["password"])
            page.click("#login-button")
            expect(page.locator("#actions")).to_be_visible(timeout=10_000)
            assert page.locator("#operator-name").text_content() == "admin"
            expect(page.locator("#login-form")).to_be_hidden()
            assert page.evaluate("document.cookie") == ""  # HttpOnly: the page's script cannot read the session

            # a device's page: send `status`, read the ack
            page.locator(f"#devices tbody tr[data-device='{wf.agents[0]}'] a").click()
            expect(page.locator("#command-form")).to_be_visible(timeout=10_000)
            page.select_option("#command-name", "status")
            page.click("#command-button")
            expect(page.locator("#action-result")).to_contain_text("status ok", timeout=30_000)
            shot = shots / "dashboard-action-command.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")

            # the fleet page: deploy the newest global model to every device
            latest = wf.store.model_versions()[-1]["version"]
            page.goto(wf.url + "#/")
            page.wait_for_selector("#deploy-form")
            assert page.locator("#deploy-version option").first.text_content() == f"v{latest}"
            page.click("#deploy-button")
            expect(page.locator("#action-result")).to_contain_text("as artifact v2", timeout=30_000)
            assert wf.server.actions.wait_deploy(timeout=120)
            # the registry follows each device's birth, which comes after its ack
            assert wait_until(lambda: {wf.fm.device(d).model_version for d in wf.agents} == {2}, 20)
            page.goto(wf.url + "#/rollouts")
            expect(page.locator("#rollouts .rollout").first).to_contain_text("artifact v2", timeout=20_000)
            expect(page.locator("#rollouts .rollout").first).to_contain_text("completed")
            shot = shots / "dashboard-action-deploy.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")

            done = {(e["operator"], e["action"], e["outcome"]) for e in wf.server.audit.list()}
            assert {("admin", "login", "ok"), ("admin", "command", "ok"), ("admin", "deploy", "completed")} <= done
            page.click("#logout-button")
            expect(page.locator("#login-form")).to_be_visible(timeout=10_000)
            expect(page.locator("#actions")).to_be_hidden()
            assert not problems, problems
        finally:
            browser.close()
