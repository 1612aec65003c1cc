"""Signal, text and linear-algebra kernels: DFT/STFT against the DFT sum,
windows against their formulas, MelWeightMatrix and TfIdfVectorizer against
onnx's reference evaluator on configurations the node cases do not cover,
Einsum against np.einsum, Det."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from edgeflow.kernels import KernelError, get_kernel

RNG = np.random.default_rng(17)


def k(op, opset=20, dtype=None):
    return get_kernel(op, opset=opset, dtype=dtype)


@pytest.mark.parametrize("complex_in", [False, True])
@pytest.mark.parametrize("inverse", [0, 1])
@pytest.mark.parametrize("axis", [1, 2, -2, -3])
@pytest.mark.parametrize("length", [None, 4, 9])
def test_dft_against_the_sum(complex_in, inverse, axis, length):
    x = RNG.standard_normal((2, 6, 5, 2 if complex_in else 1))
    sig = x[..., 0] + (1j * x[..., 1] if complex_in else 0)
    ax = axis % 4
    n = sig.shape[ax] if length is None else length
    # zero-pad or trim to n, then the DFT sum
    s = np.moveaxis(sig, ax, -1)
    s = np.concatenate([s, np.zeros(s.shape[:-1] + (max(n - s.shape[-1], 0),))], -1)[..., :n]
    sign = 1 if inverse else -1
    w = np.exp(sign * 2j * np.pi * np.outer(np.arange(n), np.arange(n)) / n) / (n if inverse else 1)
    want = np.moveaxis(s @ w.T, -1, ax)
    dl = None if length is None else np.array(length, np.int64)
    for got in (k("DFT", 20)(x, dl, np.array(axis), inverse=inverse), k("DFT", 17)(x, dl, axis=axis, inverse=inverse)):
        assert got.shape == want.shape + (2,) and got.dtype == x.dtype
        np.testing.assert_allclose(got[..., 0] + 1j * got[..., 1], want, atol=1e-12)


def test_dft_onesided_and_irfft_roundtrip():
    x = RNG.standard_normal((3, 8, 1)).astype(np.float32)
    spec = k("DFT", 20)(x, None, np.array(1), onesided=1)
    assert spec.shape == (3, 5, 2) and spec.dtype == np.float32
    back = k("DFT", 20)(spec, None, np.array(1), inverse=1, onesided=1)
    assert back.shape == (3, 8, 1)
    np.testing.assert_allclose(back, x, atol=1e-5)
    with pytest.raises(KernelError, match="real input"):
        k("DFT", 20)(spec, None, np.array(1), onesided=1)
    with pytest.raises(KernelError, match="axis"):
        k("DFT", 20)(x, None, np.array(2))


def test_dft_float16_and_64():
    for dt in (np.float16, np.float64):
        x = RNG.standard_normal((1, 4, 2)).astype(dt)
        y = k("DFT", 20)(x)
        assert y.dtype == dt


@pytest.mark.parametrize("with_window", [False, True])
@pytest.mark.parametrize("onesided", [1, 0])
def test_stft_against_frames(with_window, onesided):
    x = RNG.standard_normal((2, 37, 1))
    flen, step = 8, 5
    win = np.hanning(flen) if with_window else None
    y = k("STFT", 17)(x, np.array(step), win, np.array(flen), onesided=onesided)
    frames = (37 - flen) // step + 1
    bins = flen // 2 + 1 if onesided else flen
    assert y.shape == (2, frames, bins, 2)
    for f in range(frames):
        seg = x[:, f * step:f * step + flen, 0] * (1 if win is None else win)
        want = np.fft.fft(seg, axis=-1)[:, :bins]
        np.testing.assert_allclose(y[:, f, :, 0] + 1j * y[:, f, :, 1], want, atol=1e-12)
    with pytest.raises(KernelError, match="window"):
        k("STFT", 17)(x, np.array(step), np.ones(3), np.array(flen))


@pytest.mark.parametrize("periodic", [1, 0])
@pytest.mark.parametrize("size", [1, 2, 10])
def test_windows(periodic, size):
    n = np.arange(size)
    denom = size if periodic else size - 1
    ph = 2 * np.pi * n / denom if denom else np.zeros(size)
    want = {
        "HannWindow": 0.5 - 0.5 * np.cos(ph),
        "HammingWindow": 25 / 46 - 21 / 46 * np.cos(ph),
        "BlackmanWindow": 0.42 - 0.5 * np.cos(ph) + 0.08 * np.cos(2 * ph),
    }
    for op, w in want.items():
        got = k(op, 17)(np.array(size), periodic=periodic)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, w if denom else np.ones(size), atol=1e-6)
        assert k(op, 17)(np.array(size), output_datatype=11, periodic=periodic).dtype == np.float64
    if not periodic and size > 2:
        np.testing.assert_allclose(k("HannWindow", 17)(np.array(size), periodic=0), np.hanning(size), atol=1e-7)


def _reference(node: onnx.NodeProto, feeds: dict, opset: int):
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for n, v in feeds.items()]
    outputs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in node.output]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, feeds)


@pytest.mark.parametrize("mels,n_fft,rate,lo,hi", [(8, 64, 16000, 0.0, 8000.0), (20, 512, 22050, 30.0, 7000.0),
                                                  (3, 16, 8000, 100.0, 3000.0)])
def test_mel_weight_matrix_matches_the_reference(mels, n_fft, rate, lo, hi):
    feeds = {"m": np.array(mels, np.int64), "n": np.array(n_fft, np.int64), "r": np.array(rate, np.int64),
             "lo": np.array(lo, np.float32), "hi": np.array(hi, np.float32)}
    node = helper.make_node("MelWeightMatrix", list(feeds), ["y"])
    (want,) = _reference(node, feeds, 17)
    got = k("MelWeightMatrix", 17)(*feeds.values())
    assert got.shape == (n_fft // 2 + 1, mels) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-6)


TFIDF = [
    dict(mode="TF", min_gram_length=1, max_gram_length=1, max_skip_count=0, ngram_counts=[0],
         ngram_indexes=[0, 1, 2], pool_int64s=[2, 3, 5]),
    dict(mode="TFIDF", min_gram_length=1, max_gram_length=3, max_skip_count=2, ngram_counts=[0, 3, 7],
         ngram_indexes=[0, 1, 2, 3, 4, 5, 6], pool_int64s=[2, 3, 5, 2, 3, 5, 6, 2, 3, 5],
         weights=[0.5, 1, 2, 1, 0.25, 3, 1]),
    dict(mode="IDF", min_gram_length=2, max_gram_length=2, max_skip_count=4, ngram_counts=[0, 2],
         ngram_indexes=[2, 0, 1, 3], pool_int64s=[4, 6, 4, 6, 6, 4], weights=[2, 3, 4, 5]),
    dict(mode="IDF", min_gram_length=1, max_gram_length=2, max_skip_count=1, ngram_counts=[0, 2],
         ngram_indexes=[0, 1, 2, 3], pool_int64s=[4, 6, 4, 6, 6, 4]),
]


@pytest.mark.parametrize("attrs", TFIDF)
@pytest.mark.parametrize("shape", [(12,), (3, 9)])
def test_tfidf_matches_the_reference(attrs, shape):
    x = RNG.integers(2, 7, size=shape).astype(np.int64)
    if attrs["mode"] == "IDF" and "weights" not in attrs:
        # the reference evaluator fails on IDF without weights: its TF counts, thresholded, are the answer
        node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], **dict(attrs, mode="TF"))
        want = (_reference(node, {"x": x}, 9)[0] > 0).astype(np.float32)
    else:
        node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)
        (want,) = _reference(node, {"x": x}, 9)
    got = k("TfIdfVectorizer", 9, "int64")(x, **{a: tuple(v) if isinstance(v, list) else v for a, v in attrs.items()})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want)


def test_tfidf_rejects_bad_attributes():
    with pytest.raises(KernelError, match="mode"):
        k("TfIdfVectorizer", 9, "int64")(np.ones(3, np.int64), mode="BM25", min_gram_length=1, max_gram_length=1,
                                         max_skip_count=0, ngram_counts=(0,), ngram_indexes=(0,), pool_int64s=(1,))


EINSUMS = [
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]), ("ij,jk", [(3, 4), (4, 5)]), ("ij,jk->ki", [(3, 4), (4, 5)]),
    ("ab,ab->", [(3, 4), (3, 4)]), ("ab,cd->abcd", [(2, 3), (4, 5)]), ("abz,cb->ca", [(2, 3, 7), (4, 3)]),
    ("i,i", [(5,), (5,)]), ("Ab,bA->A", [(3, 4), (4, 3)]), ("ii->i", [(4, 4)]), ("ii", [(4, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]), ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("bij , bjk -> bik", [(2, 3, 4), (2, 4, 5)]), ("ba,ab->b", [(3, 4), (4, 3)]), ("iij,j->i", [(3, 3, 4), (4,)]),
]


@pytest.mark.parametrize("eq,shapes", EINSUMS)
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_einsum_matches_numpy(eq, shapes, dtype):
    xs = [RNG.integers(-3, 4, size=s).astype(dtype) for s in shapes]
    got = k("Einsum", 12, np.dtype(dtype).name)(*xs, equation=eq)
    want = np.einsum(eq.replace(" ", ""), *xs)
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_einsum_errors_name_the_equation():
    a = np.ones((2, 3), np.float32)
    with pytest.raises(KernelError, match="2 operand terms for 1 inputs"):
        k("Einsum", 12)(a, equation="ij,jk->ik")
    with pytest.raises(KernelError, match="does not fit"):
        k("Einsum", 12)(a, a, equation="ij,jk->ik")
    with pytest.raises(KernelError, match="only letters"):
        k("Einsum", 12)(a, equation="i1->i")
    with pytest.raises(KernelError, match="empty"):
        k("Einsum", 12)(a, equation=" ")


def test_det():
    x = RNG.standard_normal((2, 3, 4, 4))
    np.testing.assert_allclose(k("Det", 22)(x), np.linalg.det(x))
    assert k("Det", 22)(x.astype(np.float16)).dtype == np.float16
    with pytest.raises(KernelError, match="M, M"):
        k("Det", 22)(np.ones((2, 3)))
