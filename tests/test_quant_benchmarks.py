"""Smoke tests of the quantization benchmarks' helpers (benchmarks/quantization.py,
benchmarks/numpy_int8.py): CTC decoding, one real-model row of each, on the smallest
models and the fewest runs (the figures themselves are the benchmarks' job)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeflow import model_suite

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _cached(name: str) -> bool:
    try:
        return model_suite.cached(name)
    except Exception:  # noqa: BLE001 - no manifest or cache: skip
        return False


def _onehot(seq: list[int], classes: int = 6) -> np.ndarray:
    x = np.zeros((len(seq), classes), np.float32)
    x[np.arange(len(seq)), seq] = 1.0
    return x


def test_ctc_decode_merges_repeats_drops_blanks_and_strips_spaces():
    ctc_decode = _bench("quantization").ctc_decode
    space = 5  # the last class: the space PaddleOCR appends
    seqs = [
        [1, 1, 0, 1, 2, 2, 0],  # repeats merge; a blank between two 1s keeps both
        [space, space, 3, 0, space, 4, space],  # spaces at the ends go, the inner one stays
        [0, 0, 0, 0, 0, 0, 0],  # nothing
    ]
    got = ctc_decode(np.stack([_onehot(s) for s in seqs]))
    assert got == [(1, 1, 2), (3, space, 4), ()]


@pytest.mark.skipif(not _cached("oww-embedding"), reason="the real-model cache lacks oww-embedding (edgeflow models fetch)")
def test_real_rows_gives_one_consistent_row_per_model_and_profile(capsys):
    pytest.importorskip("onnxruntime")
    q = _bench("quantization")
    rows = q.real_rows([("oww-embedding", "conv", "cosine")], ["x86-gateway"], n_cal=4, n_eval=2, runs=1, rounds=1)
    (row,) = rows
    assert row["model"] == "oww-embedding" and row["profile"] == "x86-gateway"
    assert row["choice"] in ("int8", "weight-only", "fp32") and row["reason"]
    if row["host"] is None:  # this host is an x86-gateway board: the gate timed int8 and kept its re-timing
        assert row["choice"] != "int8" or row["gate_confirmed_speedup"] >= 1.1
    else:  # e.g. no VNNI here: the gate does not time another board's speed, and the row says whose host it was
        assert row["gate_confirmed_speedup"] is None and "x86-gateway" in row["host"]
    assert 0 < row["size_ratio"] < 0.5 and row["fp32_ms"] > 0 and row["int8_ms"] > 0
    assert 0.9 < row["fidelity"] <= 1.0 + 1e-6 and row["fidelity_ok"] == (row["fidelity"] >= 0.99)
    q.print_real(rows)
    out = capsys.readouterr().out
    assert "oww-embedding" in out and "x86-gateway: median int8 speedup on the conv nets" in out


@pytest.mark.skipif(not _cached("ocr-cls-ppocr-mobile-v2"),
                    reason="the real-model cache lacks ocr-cls-ppocr-mobile-v2 (edgeflow models fetch)")
def test_numpy_int8_bench_model_row():
    b = _bench("numpy_int8")
    row = b.bench_model("ocr-cls-ppocr-mobile-v2", "x86-gateway", runs=1, rounds=1, calib_samples=2)
    assert row["fp32_ms"] > 0 and row["weight_only_ms"] > 0
    assert row["weight_only_size_ratio"] < 0.5 and row["weight_only_cosine"] > 0.99
    assert ("static_ms" in row) != ("static_error" in row)  # static int8 either ran or says why not
    table = b.markdown([row])
    assert "| ocr-cls-ppocr-mobile-v2 |" in table


def test_the_benchmark_scripts_still_parse_their_flags():
    import subprocess

    for script in ("quantization.py", "numpy_int8.py"):
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and "usage" in out.stdout, out.stderr


@pytest.mark.skipif(not _cached("ocr-cls-ppocr-mobile-v2"),
                    reason="the real-model cache lacks ocr-cls-ppocr-mobile-v2 (edgeflow models fetch)")
def test_the_hardswish_lever_rows_and_the_op_profile(capsys):
    pytest.importorskip("onnxruntime")
    q = _bench("quantization")
    (row,) = q.hardswish_rows(["ocr-cls-ppocr-mobile-v2"], n_cal=4, n_eval=2, runs=1, rounds=1)
    # Paddle's x * Clip(x + 3, 0, 6) / 6 is fused (27 HardSigmoid + Mul) and every one runs in int8 when on
    assert row["float_acts"] == 27 and row["float_acts_hsw"] == 0, row
    assert row["note"].startswith("27 HardSwish/HardSigmoid run in int8")
    assert min(row["fp32_ms"], row["fp32_unfused_ms"], row["int8_ms"], row["int8_hsw_ms"]) > 0
    q.print_op_times("ocr-cls-ppocr-mobile-v2", n_cal=2)
    out = capsys.readouterr().out
    assert "fp32: total" in out and "QLinearConv" in out and "convs: depthwise" in out


@pytest.mark.skipif(not _cached("ocr-cls-ppocr-mobile-v2"),
                    reason="the real-model cache lacks ocr-cls-ppocr-mobile-v2 (edgeflow models fetch)")
def test_the_bias_correction_rows(capsys):
    pytest.importorskip("onnxruntime")
    q = _bench("quantization")
    rows = q.bias_rows([("ocr-cls-ppocr-mobile-v2", "conv", "top1")], n_cal=4, n_eval=2, methods=("minmax",))
    (row,) = rows
    assert int(row["corrected"]) > 0, row  # its int8 convs had their biases corrected
    assert 0 <= row["fidelity"] <= 100 and 0 <= row["fidelity_bc"] <= 100
    q.print_bias(rows)
    assert "ocr-cls-ppocr-mobile-v2" in capsys.readouterr().out
