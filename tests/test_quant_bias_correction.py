"""Empirical bias correction (edgeflow.quantization.bias_correction): the mean error an int8 conv's
output carries on the calibration data is taken out of its int32 bias, conv by conv; the gate
tries it as a variant of its own and keeps it only where its measured loss is lower."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import edgeflow
from _graphs import make, rand
from edgeflow.quantization.bias_correction import apply_corrections, bias_sites, measure_corrections
from edgeflow.quantization.data import CalibrationSet

ort = pytest.importorskip("onnxruntime")


def _offset_net(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Relu -> 1x1 Conv. The first conv writes one wide channel and three that sit near
    a constant, so its per-tensor uint8 output rounds those three the same way at every position: the
    second conv sees a shifted input everywhere."""
    rng = np.random.default_rng(seed)
    w1 = np.zeros((4, 2, 3, 3), np.float32)
    w1[0, 0, 1, 1] = 4.0  # the wide channel
    w1[1:, 1] = rand(rng, 3, 3, 3, scale=0.05)
    b1 = np.array([0.0, 0.37, 0.61, 0.23], np.float32)  # near-constant channels, off the uint8 grid
    inits = {"w1": w1, "b1": b1, "w2": rand(rng, 8, 4, 3, 3, scale=2.0), "b2": rand(rng, 8),
             "w3": rand(rng, 3, 8, 1, 1, scale=0.5), "b3": rand(rng, 3)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["y"], name="conv3")]
    return make(nodes, [("x", ["N", 2, 10, 10])], [("y", ["N", 3, 10, 10])], inits, opset=13)


def _data(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.empty((n, 2, 10, 10), np.float32)
    x[:, 0] = np.abs(rng.standard_normal((n, 10, 10))) * 3.0
    x[:, 1] = rng.standard_normal((n, 10, 10)) * 0.2
    return x


def _quantize(m, bc, **kw):
    return edgeflow.quantize(m, "x86-gateway", calibration=_data(24, 1), eval_data=_data(8, 2), backend="ort",
                             batch_size=8, latency_runs=0, sensitivity=False, min_int8_channels=0,
                             bias_correction=bc, **{"max_loss": None, **kw})


def _runner(model):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.x64quantprecision", "1")  # exact sums on any x86 host
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda feeds, names: dict(zip(names, s.run(names, feeds)))


def _mean_error(q: onnx.ModelProto, ref: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    got = _runner(q)({"x": x}, ["y"])["y"]
    want = _runner(ref)({"x": x}, ["y"])["y"]
    return (got - want).mean(axis=(0, 2, 3))


def test_the_sites_are_the_int8_convs_and_a_dropped_relu_maps_to_its_input():
    m = _offset_net()
    q = _quantize(m, False).model
    sites = {s.conv: s for s in bias_sites(q, m)}
    assert set(sites) == {"conv1", "conv2", "conv3"}
    # onnxruntime's quantizer drops the Relu after conv1 (the output's QuantizeLinear clamps at 0), so the
    # quantized conv1 writes "r1": the fp32 values to compare with are the Relu's input, "c1"
    assert (sites["conv1"].output, sites["conv1"].reference) == ("r1", "c1")
    # the conv that writes the graph output writes it before the output's QuantizeLinear/DequantizeLinear pair
    assert (sites["conv3"].output, sites["conv3"].reference) == ("y_QuantizeLinear_Input", "y")
    for s in sites.values():
        assert numpy_helper.to_array(next(t for t in q.graph.initializer if t.name == s.bias)).dtype == np.int32


def test_bias_correction_takes_the_mean_error_out_on_held_out_data():
    m = _offset_net()
    plain = _quantize(m, False)
    fixed = _quantize(m, True)
    x = _data(16, 3)  # neither the calibration nor the evaluation samples
    before = np.abs(_mean_error(plain.model, m, x))
    after = np.abs(_mean_error(fixed.model, m, x))
    assert before.max() > 0.05, before  # the offset channels do shift the output
    assert after.max() < before.max() / 4, (before, after)
    assert any("bias correction: 3 int8 conv(s)" in n for n in fixed.report.notes), fixed.report.notes
    assert not any("bias correction" in n for n in plain.report.notes)
    # only int32 biases changed: same nodes, same weights
    assert [n.op_type for n in fixed.model.graph.node] == [n.op_type for n in plain.model.graph.node]
    changed = [t.name for t, u in zip(plain.model.graph.initializer, fixed.model.graph.initializer)
               if not np.array_equal(numpy_helper.to_array(t), numpy_helper.to_array(u))]
    assert changed and all(numpy_helper.to_array(next(t for t in fixed.model.graph.initializer if t.name == c)).dtype
                           == np.int32 for c in changed), changed


def test_each_conv_is_measured_after_the_ones_before_it_are_corrected():
    """On the calibration data itself, every conv's output mean matches fp32 within one bias unit:
    a correction measured before the convs upstream were corrected would be off by what they passed on."""
    m = _offset_net()
    q = _quantize(m, False).model
    cal = CalibrationSet({"x": _data(24, 1)})
    shifts = measure_corrections(q, m, lambda: cal.batches(8), _runner)
    assert set(shifts) == {"conv1", "conv2", "conv3"}
    fixed, n = apply_corrections(q, shifts)
    assert n == 3
    from edgeflow.quantization.calibration import augment

    sites = bias_sites(fixed, m)  # conv2's Relu is dropped too: the quantized conv2 writes "r2"
    assert [(s.output, s.reference) for s in sites] == [("r1", "c1"), ("r2", "c2"), ("y_QuantizeLinear_Input", "y")]
    got = _runner(augment(fixed, [s.output for s in sites]))({"x": cal.arrays["x"]}, [s.output for s in sites])
    want = _runner(augment(m, [s.reference for s in sites]))({"x": cal.arrays["x"]}, [s.reference for s in sites])
    for s in sites:
        g, w = s.output, s.reference
        err = (got[g] - want[w]).mean(axis=(0, 2, 3))
        scale = numpy_helper.to_array(next(t for t in fixed.graph.initializer if t.name == s.scale))
        assert np.all(np.abs(err) <= scale * 0.5 + 1e-6), (g, err, scale)


def test_apply_corrections_leaves_what_it_cannot_correct():
    m = _offset_net()
    q = _quantize(m, False).model
    same, n = apply_corrections(q, {"no-such-conv": np.zeros(3), "conv3": np.zeros(5)})  # unknown; wrong length
    assert n == 0
    assert same.SerializeToString() == q.SerializeToString()


def test_the_gate_tries_a_bias_corrected_variant_and_reports_it():
    m = _offset_net()
    r = _quantize(m, None, max_loss=1.0, gate_rounds=1)
    steps = "\n".join(r.report.gate.steps)
    assert "qdq format, minmax calibration, bias-corrected, every op onnxruntime quantizes int8, all layers int8" \
        in steps, steps
    r_off = _quantize(m, False, max_loss=1.0, gate_rounds=1)
    assert "bias-corrected" not in "\n".join(r_off.report.gate.steps)


def _hswish_net() -> onnx.ModelProto:
    """Conv -> HardSigmoid/Mul (HardSwish in two ops) -> Mul(scalar) -> Conv -> Relu -> Conv, and a tensor
    that a second reader takes out of the middle of the third conv's chain."""
    rng = np.random.default_rng(4)
    inits = {"w1": rand(rng, 8, 4, 3, 3, scale=0.4), "b1": rand(rng, 8), "k": np.array([0.8], np.float32),
             "w2": rand(rng, 8, 8, 1, 1, scale=0.4), "b2": rand(rng, 8), "w3": rand(rng, 4, 8, 1, 1), "b3": rand(rng, 4)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("HardSigmoid", ["c1"], ["g1"], alpha=1 / 6, beta=0.5, name="hsig1"),
             helper.make_node("Mul", ["c1", "g1"], ["h1"], name="hswish1"),
             helper.make_node("Mul", ["h1", "k"], ["a1"], name="scale1"),
             helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3"),
             helper.make_node("Sigmoid", ["c3"], ["s3"], name="sig3"),
             helper.make_node("Add", ["s3", "c3"], ["y"], name="mix3")]
    return make(nodes, [("x", ["N", 4, 12, 12])], [("y", ["N", 4, 12, 12]), ("s3", ["N", 4, 12, 12])], inits,
                opset=13)


def test_a_layers_activation_is_the_elementwise_chain_only_it_feeds():
    from edgeflow.quantization.analysis import activations_after

    acts = activations_after(_hswish_net(), ["conv1", "conv2", "conv3", "nothing"])
    assert acts["conv1"] == ["hsig1", "hswish1", "scale1"]  # HardSwish in two ops, then a scalar Mul
    assert acts["conv2"] == ["relu2"]
    # conv3's Sigmoid output is a graph output as well as read by the Add: no single tensor leaves the chain
    assert "conv3" not in acts and "nothing" not in acts


def test_a_layer_the_gate_keeps_fp32_keeps_its_activation_float(monkeypatch):
    """A layer the gate returns to fp32 takes its HardSwish with it (onnxruntime fuses it into the fp32 conv):
    conv1's output is then not quantized just for an int8 activation to read it."""
    from edgeflow.quantization import ort_backend

    m = _hswish_net()
    x = np.random.default_rng(5).standard_normal((16, 4, 12, 12)).astype(np.float32)
    # keep_fp32 from the user keeps the layer only
    q = edgeflow.quantize(m, "x86-gateway", calibration=x, backend="ort", batch_size=4, latency_runs=0,
                          sensitivity=False, keep_fp32=["conv1"], max_loss=None).model
    assert "c1" in {n.input[0] for n in q.graph.node if n.op_type == "QuantizeLinear"}

    seen: list[tuple[list[str], onnx.ModelProto]] = []
    real = ort_backend.quantize_static_ort

    def spy(model, cal, **kw):
        out = real(model, cal, **kw)
        seen.append((list(kw["exclude"]), out))
        return out

    monkeypatch.setattr(ort_backend, "quantize_static_ort", spy)
    r = edgeflow.quantize(m, "x86-gateway", calibration=x, backend="ort", batch_size=4, latency_runs=0,
                          sensitivity=False, max_loss=0.0, gate_rounds=1, bias_correction=False)
    assert r.report.gate is not None
    # max_loss 0: the per-layer steps return layers to fp32, each with its activation
    with_conv1 = [(e, qm) for e, qm in seen if "conv1" in e]
    assert with_conv1, [e for e, _ in seen]
    for e, qm in with_conv1:
        assert {"hsig1", "hswish1", "scale1"} <= set(e), e
        assert "c1" not in {n.input[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}


def test_when_every_variant_is_over_the_loss_the_best_every_op_variant_is_checked_before_it_is_a_start():
    """The per-layer steps only return Conv/MatMul/Gemm (and their activations) to fp32: a variant with other
    ops int8 is a start only if, with all of those fp32, it is within --max-loss. The check is measured and
    said; max_loss 0 puts every variant over."""
    r = _quantize(_offset_net(), None, max_loss=0.0, gate_rounds=1)
    steps = r.report.gate.steps
    check = [s for s in steps if "with every Conv/MatMul/Gemm fp32 and the other ops int8, loss" in s]
    assert len(check) == 1, steps
    chosen = next(s for s in steps if s.endswith(" chosen"))
    if "a start the per-layer steps can finish from" in check[0]:
        assert "only Conv/MatMul/Gemm" not in chosen or "bias-corrected" not in check[0], steps
    else:
        assert "only Conv/MatMul/Gemm" in chosen, steps


def test_cli_bias_correction_on_and_off(tmp_path, capsys):
    from edgeflow.cli.main import main

    model = tmp_path / "net.onnx"
    onnx.save(_offset_net(), str(model))
    np.save(tmp_path / "cal.npy", _data(24, 1))
    for flag, said in (("on", True), ("off", False)):
        rc = main(["quantize", str(model), "--profile", "x86-gateway", "-c", str(tmp_path / "cal.npy"), "-o",
                   str(tmp_path / f"q-{flag}.onnx"), "--backend", "ort", "--no-sensitivity", "--json",
                   "--bias-correction", flag, "--no-gate"])
        assert rc == 0
        notes = json.loads(capsys.readouterr().out)["notes"]
        assert any("bias correction" in n for n in notes) is said, notes
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(model), "--profile", "x86-gateway", "-c", str(tmp_path / "cal.npy"),
              "--bias-correction", "maybe", "--no-gate"])
    assert e.value.code == 2


def test_a_fixed_batch_model_is_corrected_in_whole_batches():
    """A model whose batch is fixed at 3: the corrections run on whole batches of 3 (30 of the 32 samples
    bias correction reads), not a last batch of 2 that onnxruntime would refuse."""
    m = _offset_net()
    for t in list(m.graph.input) + list(m.graph.output):
        t.type.tensor_type.shape.dim[0].dim_value = 3
    r = edgeflow.quantize(m, "x86-gateway", calibration=_data(40, 1), eval_data=_data(6, 2), backend="ort",
                          batch_size=8, latency_runs=0, sensitivity=False, min_int8_channels=0, bias_correction=True, max_loss=None)
    assert any("bias correction: 3 int8 conv(s)" in n for n in r.report.notes), r.report.notes


def test_a_second_input_that_the_first_convs_do_not_read_is_still_fed():
    """Each pass runs only the nodes its convs need, but keeps every model input: the caller feeds them all."""
    rng = np.random.default_rng(6)
    inits = {"w1": rand(rng, 4, 2, 3, 3), "b1": rand(rng, 4), "w2": rand(rng, 4, 4, 1, 1), "b2": rand(rng, 4)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2"),
             helper.make_node("Add", ["c2", "bias_map"], ["y"], name="add")]
    m = make(nodes, [("x", ["N", 2, 10, 10]), ("bias_map", ["N", 4, 10, 10])], [("y", ["N", 4, 10, 10])], inits)
    cal = {"x": _data(16, 1), "bias_map": np.random.default_rng(2).standard_normal((16, 4, 10, 10)).astype(np.float32)}
    r = edgeflow.quantize(m, "x86-gateway", calibration=cal, backend="ort", batch_size=8, latency_runs=0,
                          sensitivity=False, min_int8_channels=0, bias_correction=True, max_loss=None)
    assert any("bias correction: 2 int8 conv(s)" in n for n in r.report.notes), r.report.notes


def test_a_run_that_fails_leaves_the_model_uncorrected_and_says_why(monkeypatch):
    from edgeflow.errors import BackendError
    from edgeflow.quantization import bias_correction

    def boom(*a, **k):
        raise BackendError("onnxruntime failed to run the model: out of memory")

    monkeypatch.setattr(bias_correction, "measure_corrections", boom)
    plain = _quantize(_offset_net(), False)
    r = _quantize(_offset_net(), True)
    assert any(n.startswith("bias correction skipped: onnxruntime failed to run the model") for n in r.report.notes)
    assert r.model.SerializeToString() == plain.model.SerializeToString()


def test_an_if_body_that_reads_an_outer_tensor_keeps_its_producer_in_the_cut():
    from edgeflow.quantization.bias_correction import _needed

    then = helper.make_graph([helper.make_node("Identity", ["outer"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Relu", ["x"], ["outer"], name="producer"),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="if"),
             helper.make_node("Relu", ["x"], ["unrelated"], name="unrelated")]
    assert [n.name for n in _needed(nodes, ["y"])] == ["producer", "if"]
