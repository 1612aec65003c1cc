"""Federated fine-tuning of a real pretrained model (issue 15), short: PP-OCR's
MobileNetV3 with a fresh 10-class head, adapted to digits by 10 non-IID
devices over a real Mosquitto, int8-compressed signed updates, head only.

The full-size run (accuracy against central training, bytes per round) is
``python benchmarks/federated_finetune.py``; see docs/training.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _brokers import mosquitto_factory  # noqa: F401  (fixture)
from edgeflow import model_suite as ms
from edgeflow.data.datasets import load_digits
from edgeflow.sim.simulation import SimConfig, SimulatedFleet

pytestmark = pytest.mark.integration

NAME = "ocr-cls-ppocr-mobile-v2"


def test_ten_devices_fine_tune_the_head_of_a_pretrained_model(mosquitto_factory):  # noqa: F811
    try:
        ms.fetch([NAME])
    except ms.ModelDownloadError as exc:
        pytest.skip(f"{NAME} is not cached and cannot be downloaded: {exc}")
    broker = mosquitto_factory()
    cfg = SimConfig(devices=10, rounds=3, model=NAME, train_mode="head", input_size=48, alpha=0.5, seed=0,
                    codec="int8", epochs=2, batch_size=8, lr=0.3, momentum=0.9, max_samples=24,
                    quorum=1.0, min_clients=10, deadline_s=120)
    with SimulatedFleet(cfg, broker.url) as fleet:
        head = fleet.trainable_names
        assert head == ["fc_0.w_0", "fc_0.b_0"]
        assert set(fleet.rounds.weights) == set(head)  # only the head is federated
        start_acc, _ = fleet.rounds.evaluate()
        metrics = fleet.run()
        up, dense = fleet.upload_bytes()
        final = fleet.rounds.current_model()
    assert [m.participants for m in metrics] == [10, 10, 10]
    whole = len(fleet.model.SerializeToString())
    per_round = up / len(metrics)
    assert per_round < 0.01 * whole * cfg.devices  # vs every device sending the whole model
    assert up < 0.5 * dense  # int8 vs dense fp32 of the head
    assert metrics[-1].accuracy >= start_acc + 0.1, (start_acc, [m.accuracy for m in metrics])
    base = {t.name: t for t in fleet.model.graph.initializer}
    from onnx import numpy_helper

    changed = [t.name for t in final.graph.initializer
               if not np.array_equal(numpy_helper.to_array(t), numpy_helper.to_array(base[t.name]))]
    assert sorted(changed) == sorted(head)  # the pretrained body is untouched


# --- the benchmark's CLI (benchmarks/federated_finetune.py; issue 34 item 3) ---

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "federated_finetune.py"


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_federated_finetune", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def test_label_skew_counts_the_classes_that_hold_90_percent_of_a_shard():
    skew = _bench().label_skew
    one_class = (None, np.full(50, 3))
    uniform = (None, np.repeat(np.arange(10), 10))
    two_heavy = (None, np.array([0] * 45 + [1] * 45 + list(range(2, 10))))
    assert skew([one_class, uniform, two_heavy]) == [1, 9, 2]


@pytest.mark.parametrize("args, names", [
    (["--strategy", "nope"], "strategy 'nope' is unknown"),
    (["--strategy-param", "server_lr"], "--strategy-param: 'server_lr' is not KEY=VALUE"),
    (["--strategy", "fedavgm", "--strategy-param", "server_lr=-1"], "server_lr must be > 0"),
    (["--recommended", "--strategy", "fedadam"], "drop --strategy fedadam or --recommended"),
])
def test_bad_strategy_settings_are_one_line_and_exit_2(args, names, mosquitto_factory):  # noqa: F811
    if "server_lr=-1" in args and not ms.cached(NAME):
        pytest.skip(f"{NAME} is not cached (the aggregator is built after the model)")
    broker = mosquitto_factory()
    r = _cli(*args, "--rounds", "1", "--no-central", "--broker", broker.url)
    assert r.returncode == 2, r.stderr
    assert names in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_recommended_is_fedavgm_with_nesterov_and_explicit_params_win():
    parse = _bench().parse_args
    args = parse(["--recommended", "--strategy-param", "server_momentum=0.95"])
    assert (args.strategy, args.strategy_params) == ("fedavgm", {"nesterov": True, "server_momentum": 0.95})
    args = parse(["--recommended", "--strategy-param", "nesterov=false"])
    assert args.strategy_params == {"nesterov": False}
    plain = parse([])
    assert (plain.strategy, plain.strategy_params) == ("fedavg", {})  # the benchmark's default stays FedAvg


def test_strategy_and_drift_reach_the_run(mosquitto_factory):  # noqa: F811
    try:
        ms.fetch([NAME])
    except ms.ModelDownloadError as exc:
        pytest.skip(f"{NAME} is not cached and cannot be downloaded: {exc}")
    broker = mosquitto_factory()
    r = _cli("--mode", "head", "--rounds", "1", "--lr", "0.3", "--strategy", "fedavgm",
             "--strategy-param", "server_lr=2", "--strategy-param", "server_momentum=0", "--drift",
             "--no-central", "--json", "--broker", broker.url)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["strategy"] == "fedavgm" and out["strategy_params"] == {"server_lr": 2, "server_momentum": 0}
    assert out["data_passes"] == 1 and out["federated"]["participants"] == [10]
    d = out["drift"]
    assert len(d["local_accuracy"]) == 10 and all(0 <= a <= 1 for a in d["local_accuracy"])
    assert sum(d["shard_sizes"]) == len(load_digits(seed=0).y_train)  # the shards partition the training set
    assert all(1 <= k <= 10 for k in d["classes_for_90pct"])
    assert 0 <= d["mean_model_accuracy"] <= 1
