"""Training-step memory plan: agrees with what a step allocates, and the
profile budget is enforced (clear error, or micro-batches with gradient
accumulation that give the same gradient)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from edgeflow import zoo
from edgeflow.errors import MemoryBudgetError
from edgeflow.profiles import get_profile
from edgeflow.train import Trainer


def _measured_step_bytes(tr: Trainer, x, y) -> int:
    tr.step(x, y)  # optimizer state exists from here on
    tr.last_gradients = {}
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tr.step(x, y)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind,optimizer", [("mlp", "sgd"), ("mlp", "adam"), ("cnn", "sgd"), ("cnn_bn", "sgd")])
def test_plan_tracks_the_measured_step(kind, optimizer):
    if kind == "mlp":
        model, shape = zoo.mlp((784, 256, 256, 10), seed=0), (784,)
    else:
        model, shape = zoo.small_cnn((1, 20, 20), channels=(16, 32), hidden=64, batch_norm=kind == "cnn_bn"), (1, 20, 20)
    tr = Trainer(model, optimizer=optimizer, momentum=0.9 if optimizer == "sgd" else 0.0, batch_size=48)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, *shape)).astype(np.float32)
    y = rng.integers(0, 10, 48)
    plan = tr.plan_memory()
    measured = _measured_step_bytes(tr, x, y)
    planned = plan.peak_activation_bytes + plan.gradient_bytes
    assert 0.75 * measured <= planned <= 1.35 * measured, (planned, measured, plan)
    assert plan.optimizer_bytes == plan.gradient_bytes * (2 if optimizer == "adam" else 1)
    assert plan.peak_bytes > plan.weights_bytes + plan.gradient_bytes + plan.optimizer_bytes


def test_plan_grows_with_batch_and_frozen_body_keeps_less():
    m = zoo.small_cnn()
    full = Trainer(m)
    head = Trainer(m, trainable=["fc1."])
    p16, p64 = full.plan_memory(16), full.plan_memory(64)
    assert p64.peak_activation_bytes > 3 * p16.peak_activation_bytes
    assert head.plan_memory(64).kept_bytes < 0.1 * p64.kept_bytes
    assert full.plan_memory(64, save_workspace=False).kept_bytes < p64.kept_bytes  # im2col not kept


def test_over_budget_is_a_clear_error_naming_what_fits():
    prof = get_profile("raspberry-pi-zero-2w")  # 160 MiB training budget
    with pytest.raises(MemoryBudgetError, match=r"batch_size <= \d+.*grad_accumulation") as info:
        Trainer(zoo.small_cnn(), batch_size=1024, profile=prof)
    assert info.value.planned_bytes > info.value.budget_bytes == prof.train_memory_budget_bytes


def test_gradient_accumulation_fits_the_budget_and_matches_the_full_batch():
    prof = get_profile("raspberry-pi-zero-2w")
    tr = Trainer(zoo.small_cnn(), batch_size=1024, profile=prof, grad_accumulation=True)
    assert 1 <= tr.micro_batch < 1024
    assert tr.memory.plan.peak_bytes <= prof.train_memory_budget_bytes
    # same gradient as one big batch (no BatchNorm here), checked on a small model
    m = zoo.small_cnn((1, 10, 10), channels=(4, 8), hidden=16)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((20, 1, 10, 10)), rng.integers(0, 10, 20)
    whole = Trainer(m, dtype="float64")
    parts = Trainer(m, dtype="float64")
    parts.micro_batch = 6
    lw, _, gw = whole.compute_gradients(x, y)
    lp, _, gp = parts.compute_gradients(x, y)
    assert lp == pytest.approx(lw, rel=1e-12)
    for k in gw:
        np.testing.assert_allclose(gp[k], gw[k], rtol=1e-10, atol=1e-13)


def test_recomputing_im2col_gives_the_same_gradients():
    m = zoo.small_cnn((1, 10, 10), channels=(4, 8), hidden=16)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((5, 1, 10, 10)), rng.integers(0, 10, 5)
    a = Trainer(m, dtype="float64")
    b = Trainer(m, dtype="float64", save_workspace=False)
    ga, gb = a.gradients(x, y), b.gradients(x, y)
    for k in ga:
        np.testing.assert_allclose(ga[k], gb[k], rtol=1e-12)


def test_relu_outputs_kept_as_packed_masks_give_the_same_gradients(monkeypatch):
    """Bias mode keeps a Relu's output only for its own backward, which reads output > 0: it is kept as
    packed bits (1/32 of float32) and the gradients are bit for bit those of the float values; a MaxPool
    with its argmax saved keeps only its input's shape. Without saved workspace both keep values again."""
    from edgeflow.train import autograd

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float64)
    y = rng.integers(0, 10, 16)
    model = zoo.digits_cnn(seed=0)
    packed = Trainer(model, mode="bias", dtype="float64")
    assert packed.tape.packed_values == {"crelu0", "crelu1"}
    pools = [st for st in packed.tape.steps if st.node.op_type == "MaxPool"]
    assert all(st.save and st.shape_only == (0,) for st in pools)
    monkeypatch.setattr(autograd, "OUTPUT_READ_AS_POSITIVE_MASK", frozenset())
    plain = Trainer(model, mode="bias", dtype="float64")
    assert not plain.tape.packed_values
    g_packed, g_plain = packed.gradients(x, y), plain.gradients(x, y)
    for n in g_plain:
        np.testing.assert_array_equal(g_packed[n], g_plain[n], err_msg=n)
    assert packed.plan_memory().kept_bytes < plain.plan_memory().kept_bytes
    monkeypatch.undo()
    packed.tape.set_save_workspace(False)  # MaxPool recomputes its argmax from the values: nothing packed
    assert not packed.tape.packed_values and all(st.shape_only == () for st in pools)
    g = packed.gradients(x, y)
    for n in g_plain:
        np.testing.assert_allclose(g[n], g_plain[n], rtol=1e-12, atol=1e-14, err_msg=n)


def _depthwise_net(c=16, k=5):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((c, 1, k, k)).astype(np.float32), "dw.w"),
             numpy_helper.from_array(np.zeros(c, np.float32), "dw.b"),
             numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32), "dw2.w"),
             numpy_helper.from_array(rng.standard_normal((10, c)).astype(np.float32), "fc.w"),
             numpy_helper.from_array(np.zeros(10, np.float32), "fc.b")]
    nodes = [helper.make_node("Conv", ["x", "dw.w", "dw.b"], ["h"], group=c, pads=[k // 2] * 4, name="dw"),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "dw2.w"], ["h2"], group=c, pads=[1] * 4, strides=[2, 1], name="dw2"),
             helper.make_node("GlobalAveragePool", ["h2"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], transB=1, name="fc")]
    g = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, 12, 12])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_frozen_convs_run_over_groups_of_samples_with_the_same_result(monkeypatch):
    """A frozen Conv with a workspace of many times its input (here 25 and 9 columns per value) runs
    over groups of samples: same output and gradients bit for bit, a smaller measured step, and the
    plan follows."""
    from edgeflow.train import autograd

    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 16, 12, 12)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    model = _depthwise_net()
    grouped = Trainer(model, mode="head", batch_size=16)
    fwd = grouped.tape.forward(grouped.params, {"x": x})
    assert max(grouped.tape._pieces_cache.values()) > 1
    whole_out = grouped.tape.infer(grouped.params, {"x": x})  # inference runs every node whole
    np.testing.assert_array_equal(fwd.output, whole_out)
    monkeypatch.setattr(autograd, "WORKSPACE_PER_INPUT", float("inf"))
    whole = Trainer(model, mode="head", batch_size=16)
    g_whole, plan_whole = whole.gradients(x, y), whole.plan_memory()
    m_whole = _measured_step_bytes(whole, x, y)
    monkeypatch.undo()
    g = grouped.gradients(x, y)
    for n in g_whole:
        np.testing.assert_array_equal(g[n], g_whole[n], err_msg=n)
    m_grouped = _measured_step_bytes(grouped, x, y)
    assert m_grouped < 0.6 * m_whole, (m_grouped, m_whole)
    assert grouped.plan_memory().peak_bytes < plan_whole.peak_bytes


def test_hardswish_output_is_recomputed_from_its_kept_input(monkeypatch):
    """Conv -> HardSwish -> Conv: the second Conv's weight gradient reads the HardSwish output, whose
    input the HardSwish backward keeps anyway; the output is made again in the backward instead of
    kept between the passes: gradients bit for bit, less kept, and the plan follows."""
    from onnx import TensorProto, helper, numpy_helper

    from edgeflow.train import autograd

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "c1.w"),
             numpy_helper.from_array(rng.standard_normal((8,)).astype(np.float32), "c1.b"),
             numpy_helper.from_array(rng.standard_normal((8, 8, 1, 1)).astype(np.float32), "c2.w"),
             numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "fc.w")]
    nodes = [helper.make_node("Conv", ["x", "c1.w", "c1.b"], ["a"], pads=[1] * 4),
             helper.make_node("HardSwish", ["a"], ["h"]),
             helper.make_node("Conv", ["h", "c2.w"], ["b"]),
             helper.make_node("GlobalAveragePool", ["b"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc.w"], ["logits"], transB=1)]
    g = helper.make_graph(nodes, "hs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 10, 10])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((6, 3, 10, 10)) * 3
    y = rng.integers(0, 4, 6)
    again = Trainer(model, dtype="float64", batch_size=6)
    assert again.tape.recomputed_values == {"h"} and "h" not in again.tape.kept_values
    monkeypatch.setattr(autograd, "RECOMPUTE_FROM_INPUT", frozenset())
    kept = Trainer(model, dtype="float64", batch_size=6)
    assert not kept.tape.recomputed_values and "h" in kept.tape.kept_values
    g_kept, plan_kept = kept.gradients(x, y), kept.plan_memory()
    monkeypatch.undo()
    g_again = again.gradients(x, y)
    for n in g_kept:
        np.testing.assert_array_equal(g_again[n], g_kept[n], err_msg=n)
    assert again.plan_memory().kept_bytes < plan_kept.kept_bytes
