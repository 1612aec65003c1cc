"""Issue 31, finding "8 of 14 bad gateway.toml variants start anyway": every key of gateway.toml is checked
against one schema (gateway/service.py SCHEMA) before anything is built; a bad one is one ConfigError line
naming the dotted key and what it must be, and ``edgeflow gateway --config bad.toml`` exits 2 with that line.
The examples shipped in the docs and in ``edgeflow gateway --help`` still load."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from edgeflow.cli.main import main
from edgeflow.errors import ConfigError
from edgeflow.gateway.fleet import FleetOptions
from edgeflow.gateway.hierarchy import HierarchyOptions
from edgeflow.gateway.round_config import RoundConfig
from edgeflow.gateway.service import SCHEMA, GatewayConfig, load_config
from edgeflow.protocol.rounds import TrainConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"

# (id, gateway.toml text, the dotted key the error must name, what it must say is expected)
BAD = [
    ("max_payload-string", '[gateway]\nmax_payload = "4000"\n', "gateway.max_payload", "an integer"),
    ("max_payload-tiny", "[gateway]\nmax_payload = 100\n", "gateway.max_payload", "an integer in ["),
    ("state-number", "[gateway]\nstate = 5\n", "gateway.state", "a non-empty string"),
    ("broker-http", '[gateway]\nbroker = "http://broker:1883"\n', "gateway.broker", "mqtt://"),
    ("fleet-id", '[gateway]\nfleet = "my fleet/a"\n', "gateway.fleet", "is not valid"),
    ("metrics-empty", '[gateway]\nmetrics = ""\n', "gateway.metrics", "a non-empty string"),
    ("role-enum", '[gateway]\nrole = "leaf"\n', "gateway.role must be one of flat, site, root", "(role 'leaf' is unknown)"),
    ("heartbeat-string", '[fleet]\nheartbeat_factor = "3"\n', "fleet.heartbeat_factor", "a number > 0"),
    ("liveness-zero", "[fleet]\nliveness_check_s = 0\n", "fleet.liveness_check_s", "a number > 0"),
    ("telemetry_queue-negative", "[fleet]\ntelemetry_queue = -5\n", "fleet.telemetry_queue", "an integer >= 1"),
    ("record_registry-string", '[fleet]\nrecord_registry = "yes"\n', "fleet.record_registry", "true or false"),
    ("heartbeat_timeout-negative", "[fleet]\nheartbeat_timeout_s = -1\n", "fleet.heartbeat_timeout_s", "> 0"),
    ("fleet-unknown", "[fleet]\nheartbeat = 3\n", "fleet.heartbeat", "the keys of [fleet] are"),
    ("train-unknown", "[rounds.train]\nepoch = 3\n", "rounds.train.epoch", "unknown setting(s) ['epoch']"),
    ("async_buffer-zero", "[rounds]\nasync_buffer = 0\n", "rounds.async_buffer", "an integer >= 1"),
    ("max_extensions-negative", "[rounds]\nmax_extensions = -1\n", "rounds.max_extensions", "an integer >= 0"),
    ("wait-negative", "[rounds]\nwait_for_devices_s = -5\n", "rounds.wait_for_devices_s", "a number >= 0"),
    ("min_battery-fraction", "[rounds]\nmin_battery = 2\n", "rounds.min_battery", "a number in [0, 1]"),
    ("max_clients-zero", "[rounds]\nmax_clients = 0\n", "rounds.max_clients", "an integer >= 1"),
    ("max_clients-below-min", "[rounds]\nmin_clients = 4\nmax_clients = 2\n", "rounds.max_clients",
     ">= rounds.min_clients"),
    ("max_staleness-negative", "[rounds]\nmax_staleness = -1\n", "rounds.max_staleness", "an integer >= 0"),
    ("staleness-enum", '[rounds]\nstaleness = "linear"\n', "rounds.staleness must be one of constant, exponential", "'linear' is unknown"),
    ("strategy-enum", '[rounds]\nstrategy = "fedfoo"\n', "rounds.strategy must be one of bulyan", "'fedfoo' is unknown"),
    ("strategy_params-unknown", '[rounds]\nstrategy_params = { nope = 1 }\n', "rounds.strategy_params",
     "has no parameter 'nope'"),
    ("seed-negative", "[rounds]\nseed = -1\n", "rounds.seed", "an integer >= 0"),
    ("min_clients-zero", "[rounds]\nmin_clients = 0\n", "rounds.min_clients", "an integer >= 1"),
    ("fraction-range", "[rounds]\nfraction = 1.5\n", "rounds.fraction", "a number in (0, 1]"),
    ("deadline-inf", "[rounds]\ndeadline_s = inf\n", "rounds.deadline_s", "a number > 0"),
    ("rounds-float", "[rounds]\nrounds = 3.0\n", "rounds.rounds", "an integer >= 0"),
    ("optimizer-enum", '[rounds.train]\noptimizer = "adamax"\n', "rounds.train.optimizer must be one of sgd, adam, adamw", "'adamax' is unknown"),
    ("codec_opts-range", '[rounds.train]\ncodec = "topk"\ncodec_opts = { ratio = 5 }\n', "rounds.train.codec_opts",
     "ratio must be in (0, 1]"),
    ("epochs-zero", "[rounds.train]\nepochs = 0\n", "rounds.train.epochs", "an integer >= 1"),
    ("dp-clip", "[rounds]\ndp = { clip_norm = -1.0, noise_multiplier = 1.0 }\n", "rounds.dp.clip_norm", "> 0"),
    ("dp-missing", "[rounds]\ndp = { noise_multiplier = 1.0 }\n", "rounds.dp.clip_norm", "is required"),
    ("secagg-dropout", "[rounds]\nsecagg = { max_dropout_fraction = 0.9 }\n", "rounds.secagg.max_dropout_fraction",
     "a number in [0, 0.5)"),
    ("secagg-ring", "[rounds]\nsecagg = { ring_bits = 48 }\n", "rounds.secagg.ring_bits", "one of 32, 64"),
    ("margin-string", '[gateway]\nrole = "site"\n[hierarchy]\nsite_id = "site-a"\nforward_margin_s = "2"\n',
     "hierarchy.forward_margin_s", "a number >= 0"),
    ("sites-string", '[gateway]\nrole = "root"\n[hierarchy]\nsites = "site-a"\n', "hierarchy.sites",
     "a list of non-empty strings"),
    ("uplink-url", '[gateway]\nrole = "site"\n[hierarchy]\nsite_id = "a"\nuplink = "central:1883"\n',
     "hierarchy.uplink", "\"bridge\" or the central broker's URL"),
    ("telemetry_keep-bool", "[store]\ntelemetry_keep = true\n", "store.telemetry_keep", "an integer in [1, 1000000]"),
    ("section-not-table", "gateway = 5\n", "gateway must be a table", ""),
    ("section-unknown", "[round]\nrounds = 3\n", "unknown section [round]", "[rounds]"),
]


@pytest.mark.parametrize("text,key,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_key_is_one_line_naming_it(tmp_path, text, key, expected):
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    msg = str(ei.value)
    assert "\n" not in msg and key in msg and expected in msg, msg


CLI = ("max_payload-string", "liveness-zero", "async_buffer-zero", "strategy_params-unknown", "dp-clip",
       "margin-string", "section-not-table")


@pytest.mark.parametrize("text,key", [b[1:3] for b in BAD if b[0] in CLI], ids=[b[0] for b in BAD if b[0] in CLI])
def test_edgeflow_gateway_exits_2_with_one_line(tmp_path, capsys, text, key):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text, encoding="utf-8")
    assert main(["gateway", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("edgeflow gateway: error:") and key in err, err
    assert "Traceback" not in err


def test_every_problem_in_one_line(tmp_path):
    cfg = tmp_path / "gateway.toml"
    cfg.write_text("[fleet]\nliveness_check_s = 0\n[rounds]\nasync_buffer = 0\nstaleness = 'x'\n", encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    msg = str(ei.value)
    assert all(k in msg for k in ("fleet.liveness_check_s", "rounds.async_buffer", "rounds.staleness")), msg


def test_a_file_that_is_not_utf8_is_one_line(tmp_path):
    cfg = tmp_path / "gateway.toml"
    cfg.write_bytes(b"[gateway]\nstate = \"\xff\xfe\"\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(cfg)


def test_the_schema_names_every_field_of_the_config_classes():
    """A field added to a config dataclass without a schema entry (or a schema key for a field that is gone)
    fails here, so the schema cannot silently fall behind."""
    skip = {"fleet_options", "rounds", "hierarchy", "store_url", "telemetry_keep", "http_listen", "http_tls_cert",
            "http_tls_key", "http_actions", "base_dir"}
    assert set(SCHEMA["gateway"]) == {f.name for f in dataclasses.fields(GatewayConfig)} - skip
    assert set(SCHEMA["fleet"]) == {f.name for f in dataclasses.fields(FleetOptions)}
    assert set(SCHEMA["rounds"]) == {f.name for f in dataclasses.fields(RoundConfig)}
    assert set(SCHEMA["rounds.train"]) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(SCHEMA["hierarchy"]) == {f.name for f in dataclasses.fields(HierarchyOptions)}


def test_every_default_passes_its_own_rule():
    for section, cls in (("fleet", FleetOptions()), ("rounds", RoundConfig()), ("rounds.train", TrainConfig()),
                         ("hierarchy", HierarchyOptions())):
        for name, rule in SCHEMA[section].items():
            v = getattr(cls, name)
            if dataclasses.is_dataclass(v):
                continue
            assert rule.ok(v), (section, name, v)


def _doc_examples() -> dict[str, str]:
    from edgeflow.cli.gateway import EXAMPLE

    out = {"cli-help": "\n".join(line[2:] for line in EXAMPLE.splitlines()[1:])}
    fleet_md = (DOCS / "fleet.md").read_text(encoding="utf-8")
    out["fleet.md"] = re.search(r"cat > gateway.toml <<'EOF'\n(.*?)\nEOF", fleet_md, re.S).group(1)
    scaling = (DOCS / "scaling.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```toml\n(.*?)```", scaling, re.S)
    two = next(b for b in blocks if "# root gateway.toml" in b)
    col = two.splitlines()[0].index("# site A")
    out["scaling.md root"] = "\n".join(line[:col].rstrip() for line in two.splitlines())
    out["scaling.md site"] = "\n".join(line[col:] for line in two.splitlines())
    out["scaling.md store"] = next(b for b in blocks if b.startswith("[store]"))
    gateway_md = (DOCS / "gateway.md").read_text(encoding="utf-8")
    for i, b in enumerate(re.findall(r"```toml\n(.*?)```", gateway_md, re.S)):
        out[f"gateway.md {i}"] = b
    return out


@pytest.mark.parametrize("name", sorted(_doc_examples()))
def test_the_shipped_examples_still_load(tmp_path, name):
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(_doc_examples()[name], encoding="utf-8")
    load_config(cfg)
