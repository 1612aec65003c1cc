"""Federated fine-tuning of a real pretrained model (issue 15), short: PP-OCR's
MobileNetV3 with a fresh 10-class head, adapted to digits by 10 non-IID
devices over a real Mosquitto, int8-compressed signed updates, head only.

The full-size run (accuracy against central training, bytes per round) is
``python benchmarks/federated_finetune.py``; see docs/training.md.
"""

from __future__ import annotations

import numpy as np
import pytest

from _brokers import mosquitto_factory  # noqa: F401  (fixture)
from edgeflow import model_suite as ms
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
