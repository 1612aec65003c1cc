"""The numpy backend's execution plan (issue 30: per-node Python overhead).

A session runs its graph's :class:`~edgeflow.runtime.control_flow.Plan`,
built at load: per node the bound kernel, its attributes and slot indices
into a list. These tests check that a run does no name lookups any more
(node names are not read), that it frees values after their last reader,
that subgraph scopes keep their precedence (outer < initializers <
inputs), that the plan follows a graph whose nodes were replaced, that the
BLAS thread count is not re-derived every run, and that outputs equal the
name-based loop (:func:`run_nodes`) bit for bit.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from edgeflow.errors import BackendError
from edgeflow.runtime.backends import numpy_backend as nb
from edgeflow.runtime.backends.numpy_backend import NumpyBackend, execute
from edgeflow.runtime.backends.base import SessionOptions
from edgeflow.runtime.control_flow import run_nodes
from edgeflow.runtime.graph import compile_graph

F = T.FLOAT


def vi(name, shape, dtype=F):
    return h.make_tensor_value_info(name, dtype, shape)


def const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def model_of(nodes, inputs, outputs, inits=(), opset=17):
    g = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    onnx.checker.check_model(m, full_check=True)
    return m


def small_net():
    """Two outputs, an omitted optional input (Clip min ''), a multi-output node (Split)
    with an unused output, a dangling intermediate."""
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["a"]),
        h.make_node("Add", ["a", "b"], ["c"]),
        h.make_node("Clip", ["c", "", "hi"], ["d"]),
        h.make_node("Tanh", ["a"], ["z"]),
        h.make_node("Split", ["d"], ["s0", "s1", "s2"], axis=1, num_outputs=3),
        h.make_node("Mul", ["s0", "s2"], ["y"]),
    ]
    rng = np.random.default_rng(0)
    inits = [const("w", rng.standard_normal((4, 6))), const("b", rng.standard_normal(6)), const("hi", 0.5)]
    m = model_of(nodes, [vi("x", [2, 4])], [vi("y", [2, 2]), vi("z", [2, 6])], inits, opset=18)
    return m, {"x": rng.standard_normal((2, 4)).astype(np.float32)}


def test_a_run_reads_no_value_names_of_the_nodes():
    # what a run needs per node is in the plan; the name lists are read at load only
    m, feeds = small_net()
    sess = NumpyBackend().load(m, SessionOptions(threads=1))
    want = sess.run(feeds)
    for node in sess.graph.nodes:
        node.inputs = node.outputs = node.free_after = None  # any name lookup in a run now fails
    got = sess.run(feeds)
    assert set(got) == {"y", "z"}
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_outputs_equal_the_name_based_loop_bit_for_bit():
    m, feeds = small_net()
    g = compile_graph(m)
    env = dict(g.initializers)
    env.update(feeds)
    ref = run_nodes(g.nodes, env)
    got = NumpyBackend().load(m).run(feeds)
    for k in ("y", "z"):
        assert got[k].dtype == ref[k].dtype and got[k].tobytes() == ref[k].tobytes()


def _wrap(node, fn):
    inner = node.kernel.forward
    node.kernel = type(node.kernel)(**{**node.kernel.__dict__, "forward": lambda *a, **k: fn(inner(*a, **k))})


def test_values_are_released_after_their_last_reader():
    # the first node's output is read by later nodes, but not by the last one: while the last
    # node runs, nothing may still hold it (peak memory is planned on these lifetimes)
    m, feeds = small_net()
    sess = NumpyBackend().load(m)
    nodes = sess.graph.nodes
    first, last = nodes[0], nodes[-1]
    assert not set(first.outputs) & {"y", "z"} and not set(first.outputs) & set(last.inputs)
    held, alive_at_last = [], []
    _wrap(first, lambda out: held.append(weakref.ref(out)) or out)
    _wrap(last, lambda out: (gc.collect(), alive_at_last.append(held[-1]() is not None))[0] or out)
    sess.graph._plan = None  # rebuilt with the wrapped kernels
    sess.run(feeds)
    assert alive_at_last == [False]


def test_the_plan_follows_replaced_nodes():
    m, feeds = small_net()
    g = compile_graph(m)
    p1 = g.plan()
    assert g.plan() is p1
    g.nodes = list(g.nodes)  # an optimizer pass replacing the list
    assert g.plan() is not p1


def test_runtime_errors_still_name_the_node_and_shapes():
    m = model_of([h.make_node("Add", ["x", "y"], ["z"], name="add1")],
                 [vi("x", ["n"]), vi("y", ["m"])], [vi("z", ["k"])])
    sess = NumpyBackend().load(m)
    with pytest.raises(BackendError, match=r"node 'add1' \(Add\) failed on input shapes \[\(3,\), \(4,\)\]"):
        sess.run({"x": np.zeros(3, np.float32), "y": np.zeros(4, np.float32)})


# -- subgraph scopes --------------------------------------------------------------------


def _if_model(shadow: str):
    """If whose then-branch reads 'v': from the outer graph, or shadowed by the branch's own initializer."""
    then_inits = [const("v", [100.0])] if shadow == "initializer" else []
    then_g = h.make_graph([h.make_node("Add", ["x", "v"], ["t"])], "then", [], [vi("t", [1])], then_inits)
    else_g = h.make_graph([h.make_node("Sub", ["x", "v"], ["e"])], "else", [], [vi("e", [1])])
    return model_of(
        [h.make_node("Neg", ["x"], ["v"]), h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
        [vi("c", [], T.BOOL), vi("x", [1])], [vi("y", [1])])


@pytest.mark.parametrize("shadow", ["none", "initializer"])
def test_subgraph_scope_precedence(shadow):
    x = np.array([3.0], np.float32)
    sess = NumpyBackend().load(_if_model(shadow), SessionOptions())
    then = sess.run({"c": np.array(True), "x": x})["y"]
    other = sess.run({"c": np.array(False), "x": x})["y"]
    np.testing.assert_array_equal(then, [103.0] if shadow == "initializer" else [0.0])
    np.testing.assert_array_equal(other, [6.0])


def test_loop_body_input_shadows_an_outer_value_of_the_same_name():
    # the body's carried input is called 'acc' like an outer value: the input wins
    body = h.make_graph(
        [h.make_node("Identity", ["cond_in"], ["cond_out"]), h.make_node("Add", ["acc", "one"], ["acc_out"])],
        "body", [vi("i", [], T.INT64), vi("cond_in", [], T.BOOL), vi("acc", [1])],
        [vi("cond_out", [], T.BOOL), vi("acc_out", [1])])
    m = model_of(
        [h.make_node("Neg", ["x"], ["acc"]),
         h.make_node("Loop", ["n", "", "x"], ["y"], body=body),
         h.make_node("Add", ["y", "acc"], ["z"])],
        [vi("n", [], T.INT64), vi("x", [1])], [vi("z", [1])], [const("one", [1.0])])
    out = NumpyBackend().load(m).run({"n": np.array(4, np.int64), "x": np.array([2.0], np.float32)})["z"]
    np.testing.assert_array_equal(out, [(2.0 + 4) - 2.0])


def test_execute_returns_the_outputs_by_name():
    m, feeds = small_net()
    g = compile_graph(m)
    env = execute(g, feeds)
    assert {"y", "z"} <= set(env)


# -- per-run work -----------------------------------------------------------------------


def test_blas_thread_count_is_not_rederived_every_run(monkeypatch):
    m, feeds = small_net()
    sess = NumpyBackend().load(m, SessionOptions(threads=1))
    sess.run(feeds)  # sets the pool once
    calls = []
    real = os.cpu_count
    monkeypatch.setattr(os, "cpu_count", lambda: calls.append(1) or real())
    for _ in range(3):
        sess.run(feeds)
    assert calls == []
    assert nb._BLAS_THREADS == 1


# -- hot kernels --------------------------------------------------------------------------


def test_a_conv_with_huge_im2col_columns_builds_them_a_band_at_a_time():
    # basic-pitch's 3x39 conv on few channels: its whole column matrix was 162 MiB, built
    # and streamed back from memory (68 ms of the model's 88 ms); here 29 MiB of columns
    # would be built at once before the fix: the kernel must stay far below that, exactly
    import tracemalloc

    from kernels.conv import conv

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 64, 256)).astype(np.float32)
    w = rng.standard_normal((8, 4, 3, 39)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    attrs = dict(kernel_shape=(3, 39), pads=(1, 19, 1, 19), strides=(1, 1), dilations=(1, 1))
    tracemalloc.start()
    try:
        y = conv(x, w, b, **attrs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB"
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (19, 19)))
    ref = np.zeros((8, 64, 256))
    for i in range(3):
        for j in range(39):
            ref += np.einsum("mc,chw->mhw", w[:, :, i, j].astype(np.float64), xp[0, :, i:i + 64, j:j + 256])
    ref += b[:, None, None]
    assert y.shape == (1, 8, 64, 256) and y.dtype == np.float32
    np.testing.assert_allclose(y[0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("strides,dilations,pads", [((1, 1), (1, 1), (1, 19, 1, 19)), ((2, 3), (1, 1), (0, 2, 1, 0)),
                                                    ((1, 2), (2, 1), (2, 0, 0, 3))])
def test_banded_conv_equals_the_one_gemm_im2col(monkeypatch, strides, dilations, pads):
    from kernels import conv as kc

    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 3, 21, 40)).astype(np.float32)
    w = rng.standard_normal((5, 3, 3, 7)).astype(np.float32)
    attrs = dict(kernel_shape=(3, 7), pads=pads, strides=strides, dilations=dilations)
    ref = kc.conv(x, w, **attrs)
    monkeypatch.setattr(kc, "_BAND_OVER", 0)
    monkeypatch.setattr(kc, "_BAND_BYTES", 3 * 21 * 4 * 2)  # a few rows a band, and a ragged last band
    got = kc.conv(x, w, **attrs)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def _depthwise_ref(x, w, stride, pad):
    c, k = x.shape[1], w.shape[-1]
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh = (xp.shape[2] - k) // stride + 1
    ow = (xp.shape[3] - k) // stride + 1
    ref = np.zeros((1, c, oh, ow))
    for i in range(k):
        for j in range(k):
            ref += w[None, :, 0, i, j, None, None] * xp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
    return ref


@pytest.mark.parametrize("c,hw,k,stride", [(48, (61, 61), 5, 1), (7, (3, 96), 5, 1), (130, (14, 14), 3, 1),
                                           (96, (64, 64), 5, 2), (5, (9, 31), 3, 2)])
def test_depthwise_conv_banded_by_bytes_is_exact(monkeypatch, c, hw, k, stride):
    from kernels import conv as kc

    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, c) + hw).astype(np.float32)
    w = rng.standard_normal((c, 1, k, k)).astype(np.float32)
    ref = _depthwise_ref(x, w, stride, k // 2)
    attrs = dict(group=c, kernel_shape=(k, k), pads=(k // 2,) * 4, strides=(stride, stride), dilations=(1, 1))
    for band_bytes in (1 << 20, 1):  # the tuned band and one channel a band
        monkeypatch.setattr(kc, "_DW_BAND_BYTES", band_bytes)
        y = kc.conv(x, w, **attrs)
        assert y.shape == ref.shape and y.flags.c_contiguous
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_stride1_depthwise_on_a_large_image_takes_the_banded_gemv_plan():
    # the shifted multiply-adds streamed C x image-sized temporaries 2 x 25 times (slanet's
    # 48x122x122 5x5: 15 ms); the banded GEMVs measured 7 ms
    from kernels.conv import _plan

    _, mode = _plan((1, 48, 122, 122), (48, 1, 5, 5), 48, "NOTSET", (1, 1), (5, 5), (2, 2, 2, 2), (1, 1))
    assert mode == "depthwise_columns"


def test_strided_depthwise_builds_at_most_about_a_mebibyte_of_columns():
    # 64 channels a band was 6.5 MiB of columns here (24 MiB on slanet's 96x122x122 5x5 stride 2)
    import tracemalloc

    from kernels.conv import conv

    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 96, 64, 64)).astype(np.float32)
    w = rng.standard_normal((96, 1, 5, 5)).astype(np.float32)
    attrs = dict(group=96, kernel_shape=(5, 5), pads=(2, 2, 2, 2), strides=(2, 2), dilations=(1, 1))
    tracemalloc.start()
    try:
        y = conv(x, w, **attrs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # padded input 1.8 MiB + output 0.4 MiB + one band of columns (~1 MiB)
    assert peak < 4.5 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    np.testing.assert_allclose(y, _depthwise_ref(x, w, 2, 2), rtol=1e-5, atol=1e-5)
