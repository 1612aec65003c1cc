"""edgeflow.data on its own: validation, .npz loading, batching, shuffling, generators."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.data import DataLoader, Dataset, as_loader, check_inputs, check_labels, from_arrays, load_npz, save_npz
from edgeflow.errors import InputError, ShapeError


def _data(n=10):
    return from_arrays(np.arange(n * 3, dtype=np.float64).reshape(n, 3), np.arange(n) % 4)


def test_from_arrays_converts_and_validates():
    d = _data()
    assert d.x.dtype == np.float32 and d.y.dtype == np.int64 and len(d) == 10 and d.sample_shape == (3,)
    with pytest.raises(ShapeError, match="10 samples but y has 9"):
        from_arrays(np.zeros((10, 3)), np.zeros(9, np.int64))
    with pytest.raises(InputError, match="sample 2"):
        x = np.zeros((4, 3))
        x[2, 1] = np.nan
        from_arrays(x, np.zeros(4, np.int64))
    with pytest.raises(InputError, match="dtype"):
        from_arrays(np.zeros((2, 2)), np.array(["a", "b"]))
    assert from_arrays(np.zeros((2, 2)), np.zeros((2, 1))).y.dtype == np.float32


def test_npz_roundtrip_key_detection_and_no_pickle(tmp_path):
    d = _data()
    p = tmp_path / "d.npz"
    save_npz(p, d)
    back = load_npz(p)
    np.testing.assert_array_equal(back.x, d.x)
    np.testing.assert_array_equal(back.y, d.y)
    np.savez(tmp_path / "named.npz", images=d.x, labels=d.y)
    assert len(load_npz(tmp_path / "named.npz")) == 10
    np.savez(tmp_path / "odd.npz", a=d.x, b=d.y)
    with pytest.raises(InputError, match="x_key"):
        load_npz(tmp_path / "odd.npz")
    assert len(load_npz(tmp_path / "odd.npz", x_key="a", y_key="b")) == 10
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}] * 2, dtype=object), y=np.zeros(2))
    with pytest.raises(InputError, match="plain arrays"):
        load_npz(tmp_path / "obj.npz")
    with pytest.raises(InputError, match="not found"):
        load_npz(tmp_path / "missing.npz")


def test_labels_and_shapes_checks():
    check_labels(np.array([0, 3, 9]), 10)
    with pytest.raises(InputError, match=r"label 10 at sample 1 .*2 bad label"):
        check_labels(np.array([0, 10, 11]), 10)
    with pytest.raises(InputError, match="integers"):
        check_labels(np.array([0.5]), 10)
    check_inputs(np.zeros((5, 1, 8, 8)), ("N", 1, 8, 8))
    with pytest.raises(ShapeError, match=r"\(N, 1, 8, 8\).*rank"):
        check_inputs(np.zeros((5, 64)), ("N", 1, 8, 8))
    with pytest.raises(ShapeError, match="dimension 2 is 7"):
        check_inputs(np.zeros((5, 1, 7, 8)), ("N", 1, 8, 8))


def test_loader_batches_cover_every_sample_once_per_epoch():
    d = _data(10)
    loader = DataLoader(d, 4, seed=0)
    assert len(loader) == 3 and loader.num_samples == 10
    epochs = [np.concatenate([y for _, y in loader]) for _ in range(2)]
    xs = np.concatenate([x[:, 0] for x, _ in loader])
    assert sorted(xs.tolist()) == sorted(d.x[:, 0].tolist())
    for e in epochs:
        assert sorted(e.tolist()) == sorted(d.y.tolist())
    sizes = [len(x) for x, _ in DataLoader(d, 4, drop_last=True)]
    assert sizes == [4, 4]


def test_shuffle_is_seeded_and_changes_per_epoch():
    d = _data(50)

    def order(loader):
        return np.concatenate([x[:, 0] for x, _ in loader])

    a, b = DataLoader(d, 8, seed=3), DataLoader(d, 8, seed=3)
    ea1, eb1 = order(a), order(b)
    np.testing.assert_array_equal(ea1, eb1)
    assert not np.array_equal(ea1, order(a))  # the next epoch reshuffles
    np.testing.assert_array_equal(order(DataLoader(d, 8, shuffle=False)), d.x[:, 0])
    assert not np.array_equal(ea1, order(DataLoader(d, 8, seed=4)))


def test_generator_source_rebatches_and_single_samples():
    x, y = np.arange(22, dtype=np.float32).reshape(11, 2), np.arange(11)

    def chunks():
        yield x[:3], y[:3]
        yield x[3:10], y[3:10]
        yield x[10:], y[10:]

    batches = list(DataLoader(chunks, 4))
    assert [len(b[0]) for b in batches] == [4, 4, 3]
    np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), x)
    one_by_one = DataLoader(lambda: ((x[i], y[i]) for i in range(11)), 5, sample_shape=(2,))
    assert [len(b[0]) for b in one_by_one] == [5, 5, 1]
    it = DataLoader(iter([(x, y)]), 4)
    assert sum(len(b[0]) for b in it) == 11
    with pytest.raises(InputError, match="exhausted"):
        list(it)
    with pytest.raises(InputError, match="not an"):
        list(DataLoader(lambda: iter([x]), 4))
    with pytest.raises(InputError, match="cannot load"):
        DataLoader(42, 4)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="batch_size"):
        DataLoader(_data(), 0)


def test_split_and_as_loader(tmp_path):
    d = _data(20)
    rest, held = d.split(0.25, seed=0)
    assert len(rest) == 15 and len(held) == 5
    assert sorted(np.concatenate([rest.x[:, 0], held.x[:, 0]]).tolist()) == sorted(d.x[:, 0].tolist())
    save_npz(tmp_path / "d.npz", d)
    assert as_loader(tmp_path / "d.npz", 8).num_samples == 20
    loader = DataLoader(d, 8)
    assert as_loader(loader, 3) is loader
    assert isinstance(d, Dataset)
