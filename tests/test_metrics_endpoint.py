"""/metrics of the web view, parsed with prometheus_client's own text parser: names and units by the
exposition conventions, the figures the gateway recorded, and no device id in any label."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="the web view needs prometheus_client (pip install 'edgeflow[web]')")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _webfleet import HOSTILE_ID, HOSTILE_PROFILE, web_fleet  # noqa: E402

UNITS = ("_seconds", "_bytes", "_ratio", "_devices", "_updates", "_messages", "_id", "_version", "_loss",
         "_participants", "_attached", "_running", "_training")


def _scrape(url: str) -> tuple[str, dict]:
    with urllib.request.urlopen(url + "metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return text, fams


def _value(fams: dict, name: str, **labels: str) -> float:
    fam = fams[name]
    for s in fam.samples:
        if s.name in (name, name + "_total") and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"{name}{labels} not in {[(s.name, s.labels) for s in fam.samples]}")


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    with web_fleet(tmp_path_factory.mktemp("metrics")) as wf:
        text, fams = _scrape(wf.url)
        text2, fams2 = _scrape(wf.url)
        yield wf, text, fams, fams2


def test_every_metric_follows_the_exposition_conventions(scraped):
    _, text, fams, _ = scraped
    assert len(fams) >= 25
    for name, fam in fams.items():
        assert name.startswith("edgeflow_"), name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), name
        elif fam.type == "gauge" and not name.endswith("_created"):
            assert name.endswith(UNITS) or name in ("edgeflow_devices",), f"{name}: no unit in the name"


def test_the_figures_are_what_the_gateway_recorded(scraped):
    wf, _, fams, fams2 = scraped
    hist = wf.rounds.history
    assert len(hist) == 2
    assert _value(fams, "edgeflow_rounds", state="closed") == 2
    assert _value(fams, "edgeflow_rounds", state="failed") == 0
    count = [s.value for s in fams["edgeflow_round_duration_seconds"].samples if s.name.endswith("_count")]
    total = [s.value for s in fams["edgeflow_round_duration_seconds"].samples if s.name.endswith("_sum")]
    assert count == [2] and total[0] == pytest.approx(sum(m.round_s for m in hist))
    assert _value(fams, "edgeflow_round_participants") == sum(m.participants for m in hist) == 6
    assert _value(fams, "edgeflow_round_update_bytes", codec="dense") == sum(m.bytes_in for m in hist)
    assert _value(fams, "edgeflow_round_last_accuracy_ratio") == pytest.approx(hist[-1].accuracy)
    assert _value(fams, "edgeflow_model_version") == wf.rounds.version
    # the registry: 2 agents online on the Pi 4 profile running v1, the hostile row offline as "other"
    assert _value(fams, "edgeflow_devices", state="online", profile="raspberry-pi-4", model_version="1") == 2
    assert _value(fams, "edgeflow_devices", state="offline", profile="other", model_version="none") == 1
    # the rollout through fleet.deploy
    assert _value(fams, "edgeflow_rollouts", state="completed") == 1
    assert _value(fams, "edgeflow_rollout_target_devices") == 2
    assert _value(fams, "edgeflow_rollout_done_devices") == 2
    assert _value(fams, "edgeflow_rollout_model_version") == 1
    assert _value(fams, "edgeflow_fleet_events", event="births") >= 2
    assert _value(fams, "edgeflow_transport_reconnects") == 0
    # the store reads of the first scrape are in the second one's histogram
    reads = [s.value for s in fams2["edgeflow_store_read_duration_seconds"].samples if s.name.endswith("_count")]
    assert reads[0] >= 1


def test_bytes_out_are_what_a_subscriber_of_the_hub_heard(scraped):
    """edgeflow_published_bytes{kind}: the payloads the gateway's two transports (the rounds', the fleet
    manager's) sent since the view attached, by channel, equal what a client of the hub heard live on the
    topics the gateway writes: the rollout's OTA offers, the two rounds' announcements and models."""
    wf = scraped[0]
    wf.lb.hub.settle()
    _, fams = _scrape(wf.url)
    wf.lb.hub.settle()
    heard_bytes, heard_messages = wf.heard.snapshot()
    sent = {s.labels["kind"]: int(s.value) for s in fams["edgeflow_published_bytes"].samples
            if s.name.endswith("_total") and s.value}
    count = {s.labels["kind"]: int(s.value) for s in fams["edgeflow_published_payloads"].samples
             if s.name.endswith("_total") and s.labels["kind"] in sent}
    assert {"model", "round", "ota"} <= set(heard_bytes), heard_bytes
    assert sent == heard_bytes
    assert count == heard_messages
    # the model when the run starts and after each round; an offer per agent
    assert count["model"] == len(wf.rounds.history) + 1 and count["ota"] == len(wf.agents)
    model = wf.lb.hub.retained(f"edgeflow/{wf.lb.fleet}/gateway/model")
    assert sent["model"] >= len(next(iter(model.values()))) > 1000  # the dense model, not a header


def test_no_device_id_or_device_string_is_a_label(scraped):
    wf, text, fams, _ = scraped
    for fam in fams.values():
        for s in fam.samples:
            for v in s.labels.values():
                assert v not in wf.agents and v != HOSTILE_ID and v != HOSTILE_PROFILE, (fam.name, s.labels)
    for d in [*wf.agents, "<img", "<script"]:
        assert d not in text


def test_label_values_are_bounded():
    from edgeflow.gateway.web.view import bounded_label

    assert bounded_label("schema") == "schema"
    assert bounded_label("dev-0042") == "other"  # not a code: a device could choose any
    assert bounded_label("x" * 41) == "other"
    assert bounded_label("raspberry-pi-4", {"raspberry-pi-4"}) == "raspberry-pi-4"
    assert bounded_label("my-own-board", {"raspberry-pi-4"}) == "other"


def test_missing_prometheus_client_is_one_clear_line(monkeypatch):
    from edgeflow.errors import ConfigError
    from edgeflow.gateway.web import WebServer

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigError, match=r"pip install 'edgeflow\[web\]'"):
        WebServer(lambda: None, "127.0.0.1:0")


def test_bad_addresses_are_refused_with_the_flag_named():
    from edgeflow.errors import ConfigError
    from edgeflow.gateway.web import parse_listen

    assert parse_listen("127.0.0.1:9100") == ("127.0.0.1", 9100)
    assert parse_listen(":9100") == ("0.0.0.0", 9100)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("9100", "localhost", "1.2.3.4:http", "1.2.3.4:70000", "", "a b:1", "::1:9100"):
        with pytest.raises(ConfigError, match="--http"):
            parse_listen(bad)


def test_cli_flag_and_config_key_errors_exit_2(tmp_path, capsys):
    from edgeflow.cli.main import main
    from edgeflow.errors import ConfigError
    from edgeflow.gateway.service import load_config

    assert main(["simulate", "--http", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--http must be HOST:PORT" in err[0]
    with pytest.raises(ConfigError, match=r"http\.listen must be HOST:PORT"):
        load_config({"http": {"listen": "9100"}})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['port'\]"):
        load_config({"http": {"port": 9100}})
    assert load_config({"http": {"listen": "127.0.0.1:9100"}}).http_listen == "127.0.0.1:9100"
    cfg = tmp_path / "gateway.toml"
    cfg.write_text('[gateway]\nfleet_dir = "nowhere"\n\n[http]\nlisten = "localhost"\n')
    assert main(["gateway", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "http.listen must be HOST:PORT" in err[0], err
    cfg.write_text('[gateway]\nfleet_dir = "nowhere"\n')
    assert main(["gateway", "--config", str(cfg), "--http", "9100"]) == 2  # before the fleet directory is read
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--http must be HOST:PORT" in err[0], err


def test_the_grafana_dashboard_uses_only_metrics_the_gateway_exports(scraped):
    import json
    import re

    _, _, fams, _ = scraped
    dash = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana-edgeflow.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\bedgeflow_[a-z0-9_]+", e)}
    assert len(names) >= 20
    for n in sorted(names):
        base = re.sub(r"_(total|bucket|count|sum)$", "", n)
        assert n in fams or base in fams, f"{n} is in docs/grafana-edgeflow.json but not on /metrics"


def test_a_server_started_before_its_gateway_exists_attaches_when_it_does():
    """edgeflow demo starts the server before its gateway is built: /metrics says so, then counts its rounds."""
    import json

    sys.path.insert(0, str(Path(__file__).parent / "unit"))
    from _lbfleet import LoopbackFleet

    from edgeflow.gateway.web import WebServer

    holder: dict = {}
    with WebServer(lambda: holder.get("fleet"), "127.0.0.1:0") as srv:
        _, fams = _scrape(srv.url)
        assert _value(fams, "edgeflow_gateway_attached") == 0 and "edgeflow_devices" not in fams
        with urllib.request.urlopen(srv.url + "api/state", timeout=10) as r:
            assert json.loads(r.read())["attached"] is False
        with LoopbackFleet(3, config={"rounds": 2}) as lb:
            holder["fleet"] = lb
            assert srv.view.ready.wait(10)  # the attach thread looks every 50 ms
            lb.rounds.run(2)
            _, fams = _scrape(srv.url)
            assert _value(fams, "edgeflow_gateway_attached") == 1
            count = [s.value for s in fams["edgeflow_round_duration_seconds"].samples if s.name.endswith("_count")]
            assert count == [2]
