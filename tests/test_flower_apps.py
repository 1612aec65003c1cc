"""Flower-style apps as a user meets them (issue 33, docs/flower.md): ``edgeflow simulate --app FILE:client_fn``
run through the real command line (subprocess, Mosquitto started by simulate on a free port, or the embedded
broker), the one-line errors of a bad --app reference or a wrong result, text and true/false metrics, the first
parameters from a client or from an .npz, a custom strategy from a file."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from _cli import one_clear_line

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flower_quickstart"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "COLUMNS": "120"}
# a wrong result must end the run at once: a round that waited its deadline (600 s) would pass this timeout
TIMEOUT = 240


def simulate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow.cli.main", "simulate", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=TIMEOUT)


def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


TINY = """
import numpy as np

class Tiny:
    def __init__(self, pid):
        self.pid = pid
        self.w = np.zeros((4, 3), np.float32)
        self.b = np.zeros(3, np.float32)
    def get_parameters(self, config):
        return [self.w, self.b]
    def fit(self, parameters, config):
        w, b = parameters
        {fit}
    def evaluate(self, parameters, config):
        return 1.0, 5, {{"accuracy": 0.5}}

def client_fn(context):
    return Tiny(context.node_config["partition-id"])
"""


def tiny_app(tmp_path: Path, fit: str, name: str = "tiny_app.py") -> str:
    path = tmp_path / name
    path.write_text(TINY.format(fit=fit))
    return f"{path}:client_fn"


def test_the_numpy_quickstart_runs_and_learns_with_text_and_boolean_metrics_kept(tmp_path):
    out = simulate("--app", f"{EXAMPLE / 'client_app.py'}:client_fn", "--devices", "3", "--rounds", "4",
                   "--out", str(tmp_path / "run"), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    summary = json.loads(out.stdout)
    assert summary["ok"] and summary["rounds_completed"] == 4, summary
    rounds = rounds_of(tmp_path / "run")
    acc = [r["fed_eval_accuracy"] for r in rounds]
    assert acc[-1] > acc[0] + 0.4 and acc[-1] > 0.7, acc  # round 1 evaluates the initial parameters
    assert summary["final_accuracy"] == pytest.approx(acc[-1], abs=1e-4)
    for r in rounds:  # evaluate's text and true/false metrics, fit's number: kept, aggregated per round
        assert r["fed_eval_partition"] in ("part-0", "part-1", "part-2"), r
        assert 0.0 <= r["fed_eval_above_half"] <= 1.0 and math.isfinite(r["fit_train_loss"]), r
        assert r["fed_eval_clients"] == 3.0 and r["participants"] == 3
    assert rounds[-1]["fed_eval_above_half"] == 1.0 and rounds[0]["fed_eval_above_half"] == 0.0
    with np.load(tmp_path / "run" / "final_parameters.npz") as z:
        assert [(k, z[k].shape) for k in z.files] == [("p0", (64, 10)), ("p1", (10,))]


def test_the_pytorch_quickstart_runs_unchanged_in_shape(tmp_path):
    pytest.importorskip("torch")
    out = simulate("--app", f"{EXAMPLE / 'client_app_torch.py'}:client_fn", "--devices", "2", "--rounds", "3",
                   "--run-config", "local-epochs=2", "--out", str(tmp_path / "run"), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = rounds_of(tmp_path / "run")
    acc = [r["fed_eval_accuracy"] for r in rounds]
    assert acc[-1] > acc[0] + 0.2, acc
    assert json.loads((tmp_path / "run" / "config.json").read_text())["run_config"]["local-epochs"] == 2


@pytest.mark.parametrize("ref, needles", [
    ("missing.py:client_fn", ["--app 'missing.py:client_fn'", "file missing.py not found"]),
    ("{app}:nope", ["has no attribute 'nope'", "client_fn"]),
    ("no_such_module_xyz:client_fn", ["no module named 'no_such_module_xyz'"]),
    ("{app}", ["give FILE.py:NAME or module:NAME"]),
    ("{app}:CONSTANT", ["CONSTANT is an object of type int, not a function"]),
    ("{app}:raising", ["client_fn raised KeyError", "'partition-id'"]),
    ("{app}:returns_int", ["client_fn returned an object of type int", "get_parameters", "fit"]),
    ("{broken}:client_fn", ["importing", "raised ZeroDivisionError"]),
])
def test_a_bad_app_reference_is_one_line_and_exit_2(tmp_path, ref, needles):
    app = tmp_path / "app.py"
    app.write_text("CONSTANT = 3\n\ndef raising(context):\n    return {}['partition-id']\n\n"
                   "def returns_int(context):\n    return 7\n\ndef client_fn(context):\n    return None\n")
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1 / 0\n")
    out = simulate("--app", ref.format(app=app, broken=broken), "--devices", "2", "--rounds", "1",
                   "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert out.returncode == 2
    one_clear_line(out, "edgeflow simulate: error:", *needles)


@pytest.mark.parametrize("fit, needles", [
    ("return [w], 10, {}", ["Tiny.fit returned 1 arrays, the model has 2 (p0, p1)"]),
    ("return [w.T, b], 10, {}", ["'p0' with shape (3, 4), it was given (4, 3)"]),
    ("return [w, b, b], 10, {}", ["Tiny.fit returned 3 arrays, the model has 2"]),
    ("return w, 10, {}", ["Tiny.fit returned parameters of type ndarray"]),
    ("return [w, b], 10, {'blob': b'x'}", ["metric 'blob'"]),
    ("return [w, b], 10, {'note': 'x' * 300}", ["metric 'note'", "at most 256"]),
    ("return [w, b], 0, {}", ["num_examples=0"]),
])
def test_a_wrong_fit_result_stops_the_run_at_once_naming_the_tensor(tmp_path, fit, needles):
    # --deadline 600: the run must end on the device's check, not on a round's deadline (TIMEOUT < 600 s)
    out = simulate("--app", tiny_app(tmp_path, fit), "--devices", "2", "--rounds", "2", "--deadline", "600",
                   "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert out.returncode == 2
    line = one_clear_line(out, "edgeflow simulate: error: device dev00", *needles)
    assert "without waiting for the round's deadline" in line
    assert rounds_of(tmp_path / "run") == []


def test_text_and_boolean_fit_metrics_travel_and_are_aggregated(tmp_path):
    fit = ("return [w + 1, b], 10 + 10 * self.pid, "
           "{'tag': 'even' if self.pid % 2 == 0 else 'odd', 'ok': self.pid == 0, 'steps': 3}")
    out = simulate("--app", tiny_app(tmp_path, fit), "--devices", "3", "--rounds", "1", "--codec", "dense",
                   "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = rounds_of(tmp_path / "run")
    # examples 10, 20, 30: 'even' (pids 0, 2) has 40 of 60; ok only for pid 0: 10 / 60 of the examples
    assert r["fit_tag"] == "even" and r["fit_ok"] == pytest.approx(10 / 60) and r["fit_steps"] == 3.0, r
    with np.load(tmp_path / "run" / "final_parameters.npz") as z:
        assert np.allclose(z["p0"], 1.0)  # every client moved w by +1: FedAvg's mean step


def test_the_first_parameters_come_from_an_npz_or_from_a_client(tmp_path):
    app = f"{EXAMPLE / 'client_app.py'}:client_fn"
    init = tmp_path / "init.npz"
    b = np.zeros(10, np.float32)
    b[0] = 30.0  # every digit predicted a 0: the first evaluation's loss is about 30, not ln 10
    np.savez(init, np.zeros((64, 10), np.float32), b)
    from_npz = simulate("--app", app, "--initial-parameters", str(init), "--devices", "2", "--rounds", "1",
                        "--out", str(tmp_path / "a"), cwd=tmp_path)
    from_client = simulate("--app", app, "--devices", "2", "--rounds", "1", "--out", str(tmp_path / "b"), cwd=tmp_path)
    assert from_npz.returncode == 0 and from_client.returncode == 0, (from_npz.stderr, from_client.stderr)
    assert rounds_of(tmp_path / "a")[0]["fed_eval_loss"] > 20
    assert rounds_of(tmp_path / "b")[0]["fed_eval_loss"] == pytest.approx(math.log(10), abs=0.05)


@pytest.mark.parametrize("arrays, needles", [
    ([np.zeros(3, np.float32), np.zeros(10, np.float32)], ["parameter 0 (arr_0) is (3,) there and (64, 10) here"]),
    ([np.zeros((64, 10), np.float32)], ["it has 1 parameters", "gives 2"]),
    ([np.full((64, 10), np.nan, np.float32), np.zeros(10, np.float32)], ["'arr_0' holds NaN"]),
    (None, ["file not found"]),
])
def test_bad_initial_parameters_are_one_line(tmp_path, arrays, needles):
    init = tmp_path / "init.npz"
    if arrays is not None:
        np.savez(init, *arrays)
    out = simulate("--app", f"{EXAMPLE / 'client_app.py'}:client_fn", "--initial-parameters", str(init),
                   "--devices", "2", "--rounds", "1", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert out.returncode == 2
    one_clear_line(out, "edgeflow simulate: error:", *needles)


def test_a_custom_strategy_from_a_file_aggregates_the_rounds(tmp_path):
    (tmp_path / "frozen.py").write_text(textwrap.dedent("""
        import numpy as np
        from edgeflow.gateway.strategies import Median

        class Frozen(Median):
            '''Aggregates to no step at all: the global model never moves.'''
            def _reduce(self):
                return self._as_tensors(np.zeros(self._schema.size)), {"strategy_held": float(len(self._held))}
    """))
    app = f"{EXAMPLE / 'client_app.py'}:client_fn"
    out = simulate("--app", app, "--strategy", "frozen.py:Frozen", "--devices", "2", "--rounds", "3",
                   "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = rounds_of(tmp_path / "run")
    assert [r["strategy_held"] for r in rounds] == [2.0, 2.0, 2.0]
    assert len({round(r["fed_eval_loss"], 6) for r in rounds}) == 1, rounds  # nothing moved
    trimmed = simulate("--app", app, "--strategy", f"{EXAMPLE / 'strategy.py'}:TrimmedFedAvg", "--devices", "3",
                       "--rounds", "3", "--out", str(tmp_path / "run2"), cwd=tmp_path)
    assert trimmed.returncode == 0, trimmed.stderr[-3000:]
    acc = [r["fed_eval_accuracy"] for r in rounds_of(tmp_path / "run2")]
    assert acc[-1] > acc[0] + 0.4, acc


@pytest.mark.parametrize("strategy, needles", [
    ("nowhere.py:X", ["nowhere.py not found"]),  # found next to gateway.toml, as every path in it
    ("mine.py:Missing", ["has no attribute 'Missing'"]),
    ("mine.py:NotOne", ["NotOne is not an Aggregator"]),
    ("no_such_module_xyz:X", ["no module named 'no_such_module_xyz'"]),
    ("fedavgg", ["rounds.strategy must be one of", "\"module:Class\"", "'fedavgg' is unknown"]),
])
def test_a_bad_strategy_reference_is_one_line_at_config_check(tmp_path, strategy, needles):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "mine.py").write_text("class NotOne:\n    pass\n")
    (conf / "gateway.toml").write_text(f'[gateway]\ninitial_parameters = "init.npz"\n[rounds]\nstrategy = "{strategy}"\n')
    out = subprocess.run([sys.executable, "-m", "edgeflow.cli.main", "gateway", "--config", "conf/gateway.toml"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 2
    one_clear_line(out, "edgeflow gateway: error:", "rounds.strategy", *needles)


def _signed_update(tensors, metadata):
    from edgeflow.codecs import encode_update
    from edgeflow.signing import KeyRing, Signer

    signer = Signer.generate("d1")
    ring = KeyRing()
    ring.register("d1", signer.public_key)
    return ring, encode_update(tensors, "int8", round_id=1, device_id="d1", seq=1, signer=signer, num_samples=5,
                               metadata=metadata)


@pytest.mark.parametrize("tensors, metadata, reason, needle", [
    ({"p0": np.zeros((10, 64), np.float32), "p1": np.zeros(10, np.float32)}, {}, "shape_mismatch",
     "'p0' has shape (10, 64), expected (64, 10)"),
    ({"p0": np.zeros((64, 10), np.float32)}, {}, "shape_mismatch", "p1"),
    ({"p0": np.zeros((64, 10), np.float32), "p1": np.zeros(10, np.float32)}, {"metrics": {"tag": "x" * 257}},
     "bad_metadata", "metrics['tag'] is text of 257 characters"),
    ({"p0": np.zeros((64, 10), np.float32), "p1": np.zeros(10, np.float32)},
     {"eval": {"loss": 1.0, "num_examples": 3, "metrics": {"tag": "\x1b[2J"}}}, "bad_metadata", "eval.metrics['tag']"),
])
def test_the_gateway_intake_refuses_hostile_updates_to_a_parameters_only_model(tensors, metadata, reason, needle):
    """A device's own check is a convenience: the gateway's one intake (gateway/intake.py) refuses by itself."""
    from edgeflow.errors import CodecError
    from edgeflow.gateway.global_model import model_weights, parameters_model
    from edgeflow.gateway.intake import RoundView, check_update

    like = model_weights(parameters_model({"p0": np.zeros((64, 10)), "p1": np.zeros(10)}))
    ring, payload = _signed_update(tensors, metadata)
    with pytest.raises(CodecError) as e:
        check_update(payload, RoundView(1, 1, frozenset({"d1"})), keyring=ring, like=like, seq_floor=None)
    assert getattr(e.value, "reason", None) == reason and needle in str(e.value), str(e.value)


def test_the_gateway_intake_keeps_text_and_boolean_metrics():
    from edgeflow.gateway.global_model import model_weights, parameters_model
    from edgeflow.gateway.intake import RoundView, check_update

    like = model_weights(parameters_model({"p0": np.zeros((64, 10)), "p1": np.zeros(10)}))
    ring, payload = _signed_update(dict(like), {"metrics": {"tag": "odd", "ok": True, "n": 3},
                                                "eval": {"loss": 0.5, "num_examples": 4,
                                                         "metrics": {"accuracy": 0.75, "best": False}}})
    got = check_update(payload, RoundView(1, 1, frozenset({"d1"})), keyring=ring, like=like, seq_floor=None)
    assert got.meta.metrics == {"tag": "odd", "ok": True, "n": 3}
    assert got.meta.evaluation == (0.5, 4, {"accuracy": 0.75, "best": False})


def test_a_list_of_more_than_ten_arrays_keeps_its_positions():
    """p10 and p11 follow p9 (natural order), so a Flower client gets back its own list, position by position."""
    from edgeflow.federated.app import Context, make_client

    shapes = [(i + 1,) for i in range(12)]

    class Many:
        def get_parameters(self, config):
            return [np.full(s, i, np.float32) for i, s in enumerate(shapes)]

        def fit(self, parameters, config):
            assert [p.shape for p in parameters] == shapes  # position i holds the i-th array
            return [p + 1 for p in parameters], 3, {}

    client = make_client(lambda context: Many(), Context(node_id=0))
    offered = client.get_parameters({})
    assert list(offered) == [f"p{i}" for i in range(12)]
    shuffled = dict(reversed(list(offered.items())))  # the order names arrive in does not matter
    new, n, _ = client.fit(shuffled, {})
    assert n == 3 and all(np.array_equal(new[f"p{i}"], np.full(shapes[i], i + 1)) for i in range(12))


def _offer(tensors, metadata, device="d1", signer=None):
    from edgeflow.codecs import encode_update
    from edgeflow.signing import Signer

    signer = signer or Signer.generate(device)
    return signer, encode_update(tensors, "dense", round_id=0, device_id=device, seq=1, signer=signer, num_samples=1,
                                 metadata=metadata)


def test_a_devices_offer_of_first_parameters_is_checked_by_the_intake():
    """The gateway asks one device for its parameters (no model yet): only that device's signed answer to that
    request is taken (gateway/intake.py check_offer), each hostile variant refused with its reason."""
    from edgeflow.errors import CodecError, SignatureError
    from edgeflow.gateway.intake import check_offer
    from edgeflow.signing import KeyRing, Signer

    good = {"p0": np.ones((4, 3), np.float32), "p1": np.zeros(3, np.float32)}
    d1, d2 = Signer.generate("d1"), Signer.generate("d2")
    ring = KeyRing()
    ring.register("d1", d1.public_key)
    ring.register("d2", d2.public_key)
    ok = {"round_nonce": "abcd", "offer": True}
    got = check_offer(_offer(good, ok, signer=d1)[1], keyring=ring, device="d1", nonce="abcd")
    assert set(got) == {"p0", "p1"} and np.array_equal(got["p0"], good["p0"])
    hostile = [
        (_offer(good, ok, "d2", d2)[1], "not_selected"),  # another device answers in its place
        (_offer(good, {**ok, "round_nonce": "ffff"}, signer=d1)[1], "wrong_round"),  # a replay of an older request
        (_offer(good, {"round_nonce": "abcd"}, signer=d1)[1], "wrong_round"),  # an update, not an offer
        (_offer(good, ok, signer=Signer.generate("d1"))[1], None),  # d1's name, not d1's key
        (b"\x00" * 64, None),
    ]
    for payload, reason in hostile:
        with pytest.raises((CodecError, SignatureError)) as e:
            check_offer(payload, keyring=ring, device="d1", nonce="abcd")
        if reason is not None:
            assert getattr(e.value, "reason", None) == reason, str(e.value)


def test_federated_evaluate_rounds_aggregate_text_and_boolean_metrics():
    """fraction_evaluate's reports (gateway/evaluate_rounds.py) take the same metric types as updates."""
    from edgeflow.gateway.evaluate_rounds import aggregate_evaluations
    from edgeflow.protocol.rounds import EvaluationReport

    reports = [EvaluationReport(1, "n", 2, 1.0, 10, {"accuracy": 0.5, "site": "north", "ok": True}),
               EvaluationReport(1, "n", 2, 3.0, 30, {"accuracy": 0.9, "site": "south", "ok": False})]
    out = aggregate_evaluations(reports)
    assert out["dist_eval_loss"] == pytest.approx(2.5) and out["dist_eval_accuracy"] == pytest.approx(0.8)
    assert out["dist_eval_site"] == "south" and out["dist_eval_ok"] == pytest.approx(0.25)
    signed = EvaluationReport.from_body({"round_id": 1, "nonce": "n", "model_version": 2, "loss": 1.0,
                                         "num_examples": 3, "metrics": {"site": "north", "ok": True}})
    assert signed.metrics == {"site": "north", "ok": True}
