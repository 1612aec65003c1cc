"""Training data: arrays, ``.npz`` files and generators, batched and shuffled.

Separate from the trainer on purpose: a device's data pipeline (reading
sensor logs, a camera roll, a federated partition) is written and tested on
its own, and the trainer only ever sees ``(x_batch, y_batch)`` pairs.

- :class:`Dataset` — validated in-memory arrays (``from_arrays``, ``load_npz``).
- :class:`DataLoader` — batches of a dataset, reshuffled every epoch from a
  seeded generator (so a run is reproducible), or of a *generator source*:
  a callable returning an iterator of ``(x, y)`` chunks (any chunk length),
  re-sliced into fixed-size batches; a bare iterator is good for one epoch.
- :func:`check_labels` / :func:`check_inputs` — the error messages say which
  sample is wrong and what was expected.

``.npz`` files are read with ``allow_pickle=False``: data from a device
never executes code on load. Before anything is read, :func:`check_array_file`
checks what each ``.npy`` header and zip entry *declares* (no object dtypes,
sizes within :func:`max_array_bytes` and within what the file holds, no
extreme compression ratio), so that a zip bomb or a header claiming 4 TB is a
one-line refusal, not a full inflation or an allocation failure.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, Union

import numpy as np

from ..errors import InputError, ShapeError

#: Key pairs tried, in order, when a .npz file does not name its arrays.
NPZ_KEYS: tuple[tuple[str, str], ...] = (
    ("x", "y"), ("x_train", "y_train"), ("inputs", "labels"), ("data", "labels"), ("images", "labels"),
    ("features", "targets"), ("X", "y"),
)

Chunk = tuple[np.ndarray, np.ndarray]
ChunkSource = Union[Callable[[], Iterable[Chunk]], Iterator[Chunk]]


@dataclass(frozen=True)
class Dataset:
    """Inputs ``x`` (N, ...) and targets ``y`` (N,) class indices or (N, ...) values."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.x.ndim < 1 or self.y.ndim < 1:
            raise ShapeError(f"x and y need a leading sample dimension; got shapes {self.x.shape} and {self.y.shape}")
        if len(self.x) != len(self.y):
            raise ShapeError(f"x has {len(self.x)} samples but y has {len(self.y)}; they must match")

    def __len__(self) -> int:
        return len(self.x)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def subset(self, index: np.ndarray | Sequence[int]) -> "Dataset":
        idx = np.asarray(index, dtype=np.int64)
        return Dataset(self.x[idx], self.y[idx])

    def split(self, fraction: float, *, seed: int = 0) -> tuple["Dataset", "Dataset"]:
        """(rest, held-out ``fraction``) after a seeded shuffle."""
        if not 0.0 < fraction < 1.0:
            raise InputError(f"split fraction must be in (0, 1), got {fraction}")
        perm = np.random.default_rng(seed).permutation(len(self))
        k = max(1, int(round(len(self) * fraction)))
        return self.subset(perm[k:]), self.subset(perm[:k])


def from_arrays(x: np.ndarray, y: np.ndarray, *, dtype: str | np.dtype = "float32") -> Dataset:
    """Validate and convert: float inputs of ``dtype``, int64 class labels (or float targets)."""
    x = np.asarray(x)
    y = np.asarray(y)
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise InputError(f"x must be numeric, got dtype {x.dtype}")
    x = np.ascontiguousarray(x, dtype=dtype)
    if x.size and not np.isfinite(x).all():
        bad = int(np.argwhere(~np.isfinite(x.reshape(len(x), -1)))[0][0])
        raise InputError(f"x contains NaN or infinity (first at sample {bad}); clean or drop those samples")
    if np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        y = y.astype(np.int64)
    elif np.issubdtype(y.dtype, np.floating):
        y = np.ascontiguousarray(y, dtype=dtype)
        if y.size and not np.isfinite(y).all():
            raise InputError("y contains NaN or infinity; clean or drop those samples")
    else:
        raise InputError(f"y must be integer class labels or float targets, got dtype {y.dtype}")
    return Dataset(x, y)


def open_arrays(path: str | os.PathLike, *, what: str = "data", error: type[Exception] = InputError):
    """``np.load`` of a .npy/.npz file without pickle, every failure as ``error``.

    Returns the array (.npy) or the open NpzFile (.npz, read lazily: use it
    as a context manager). ``what`` names the file in the messages.
    """
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} file not found: {p}")
    check_array_file(p, error=error)
    try:
        return np.load(p, allow_pickle=False)
    except _CORRUPT as exc:
        raise error(f"{p}: not a readable .npy/.npz file of plain arrays ({exc}); save it with np.save/np.savez") from exc
    except OSError as exc:
        raise error(f"{p}: cannot read ({exc})") from exc


_CORRUPT = (ValueError, EOFError, zipfile.BadZipFile, zlib.error)
"""What np.load and NpzFile raise on a damaged or foreign file (a truncated zip, a bad header)."""

MAX_ARRAY_MB_ENV = "EDGEFLOW_MAX_ARRAY_MB"
"""Overrides :func:`max_array_bytes`: the most a .npy/.npz file may declare, in MiB."""

MAX_COMPRESSION_RATIO = 100
"""A compressed .npz entry that inflates more than this many times (and past :data:`RATIO_FREE_BYTES`) is
refused as a zip bomb; real arrays compress far less, and np.savez (uncompressed) is never refused for it."""

RATIO_FREE_BYTES = 16 * 2**20
"""Entries that inflate to at most this are never refused for their ratio (small all-zero arrays are fine)."""


def max_array_bytes() -> int:
    """The most one .npy/.npz file may declare: ``EDGEFLOW_MAX_ARRAY_MB``, else half of this host's memory."""
    env = os.environ.get(MAX_ARRAY_MB_ENV, "").strip()
    if env:
        try:
            return max(1, int(env)) * 2**20
        except ValueError:
            pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return 4 * 2**30


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**40 else f"{n / 2**40:,.1f} TiB"


def _npy_header(fp, name: str, error: type[Exception]) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) a .npy stream declares, read without reading the data."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, dtype = fmt.read_array_header_2_0(fp)
        elif version == (3, 0):  # 2.0 with utf-8 field names (numpy has no public reader for it)
            shape, dtype = _npy_header_3_0(fp)
        else:
            raise ValueError(f"unknown .npy format version {version[0]}.{version[1]}")
    except _CORRUPT as exc:
        raise error(f"{name}: not a readable .npy array ({exc}); save it with np.save/np.savez") from exc
    return tuple(int(d) for d in shape), np.dtype(dtype)


def _npy_header_3_0(fp) -> tuple[tuple[int, ...], np.dtype]:
    import ast
    import struct

    raw = fp.read(4)
    if len(raw) != 4:
        raise EOFError("the .npy header is cut short")
    (length,) = struct.unpack("<I", raw)
    if length > 1 << 20:
        raise ValueError(f"a .npy header of {length} bytes")
    text = fp.read(length)
    if len(text) != length:
        raise EOFError("the .npy header is cut short")
    try:
        d = ast.literal_eval(text.decode("utf-8"))
    except (SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        raise ValueError(f"the .npy header does not parse ({type(exc).__name__})") from None
    if not isinstance(d, dict) or not {"descr", "shape", "fortran_order"} <= set(d):
        raise ValueError("the .npy header lacks descr/shape/fortran_order")
    shape = d["shape"]
    if not (isinstance(shape, tuple) and all(isinstance(x, int) and x >= 0 for x in shape)):
        raise ValueError(f"the .npy header's shape is not a tuple of sizes: {str(shape)[:40]}")
    try:
        dtype = np.lib.format.descr_to_dtype(d["descr"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the .npy header's dtype is not one numpy reads ({exc})") from None
    return shape, dtype


def _check_declared(name: str, shape: tuple[int, ...], dtype: np.dtype, holds: int, total: int, limit: int,
                    error: type[Exception]) -> int:
    """The bytes an array declares, refused (``error``) when it holds objects, exceeds ``limit`` (with ``total``
    declared before it) or more than the ``holds`` bytes of data actually there."""
    if dtype.hasobject:
        raise error(f"{name}: holds Python objects (dtype {dtype}), not plain arrays; objects are never unpickled, "
                    "save numeric arrays")
    count = 1
    for d in shape:
        count *= d  # Python ints: no overflow on a forged shape
    nbytes = count * dtype.itemsize
    if total + nbytes > limit:
        raise error(f"{name}: declares an array of shape {shape} {dtype} ({_mib(nbytes)}), past the limit of "
                    f"{_mib(limit)} for one array file; split the data, or set {MAX_ARRAY_MB_ENV} if the host has "
                    "the memory")
    if nbytes > holds:
        raise error(f"{name}: its header declares {_mib(nbytes)} of data (shape {shape} {dtype}) but the file "
                    f"holds {_mib(holds)}; the file is truncated or forged, save it again with np.save/np.savez")
    return nbytes


def check_array_file(path: str | os.PathLike, *, limit: int | None = None,
                     error: type[Exception] = InputError) -> None:
    """Refuse a .npy/.npz file whose declared contents are hostile, before any of it is read.

    Decided by the file's magic, as ``np.load`` does. A .npy: the header's
    shape and dtype (no objects; size within ``limit`` and within the file).
    A .npz: the zip directory's declared sizes in total within ``limit``, each
    compressed entry inflating at most :data:`MAX_COMPRESSION_RATIO` times
    (a zip bomb), and each .npy entry's header as for a .npy file (within the
    entry's declared size, which also caps what inflating it can produce).
    """
    p = Path(path)
    limit = max_array_bytes() if limit is None else int(limit)
    try:
        with open(p, "rb") as f:
            magic = f.read(6)
            f.seek(0)
            if magic == np.lib.format.MAGIC_PREFIX:
                shape, dtype = _npy_header(f, str(p), error)
                _check_declared(str(p), shape, dtype, os.fstat(f.fileno()).st_size - f.tell(), 0, limit, error)
                return
        if not magic.startswith(b"PK"):
            return  # neither: np.load refuses it (no pickles) with its own message
        with zipfile.ZipFile(p) as z:
            infos = z.infolist()
            declared = sum(i.file_size for i in infos)
            if declared > limit:
                raise error(f"{p}: its entries declare {_mib(declared)} in all, past the limit of {_mib(limit)} for "
                            f"one array file; split the data, or set {MAX_ARRAY_MB_ENV} if the host has the memory")
            total = 0
            for info in infos:
                where = f"{p} entry {info.filename!r}"
                if (info.compress_type != zipfile.ZIP_STORED and info.file_size > RATIO_FREE_BYTES
                        and info.file_size > MAX_COMPRESSION_RATIO * max(1, info.compress_size)):
                    raise error(f"{where}: inflates {info.compress_size:,} bytes to {_mib(info.file_size)} "
                                f"({info.file_size // max(1, info.compress_size):,}:1, a zip bomb?); refusing to "
                                "inflate it; save real data with np.savez (uncompressed) if it is this repetitive")
                if not info.filename.endswith(".npy"):
                    continue
                with z.open(info) as m:
                    shape, dtype = _npy_header(m, where, error)
                    holds = info.file_size - m.tell()
                total += _check_declared(where, shape, dtype, holds, total, limit, error)
    except error:
        raise
    except _CORRUPT as exc:
        raise error(f"{p}: not a readable .npy/.npz file of plain arrays ({exc}); save it with np.save/np.savez") \
            from exc
    except OSError as exc:
        raise error(f"{p}: cannot read ({exc})") from exc


def read_arrays(path: str | os.PathLike, *, what: str = "data",
                error: type[Exception] = InputError) -> "np.ndarray | dict[str, np.ndarray]":
    """A .npy file (one array) or every array of a .npz file by name; never unpickles."""
    data = open_arrays(path, what=what, error=error)
    if isinstance(data, np.ndarray):
        return data
    with data:
        try:
            return {k: data[k] for k in data.files}
        except _CORRUPT as exc:  # object arrays need pickle, which is refused; or a damaged member
            raise error(f"{path}: not a readable .npz file of plain arrays ({exc}); save numeric arrays") from exc


def load_npz(path: str | os.PathLike, *, x_key: str | None = None, y_key: str | None = None,
             dtype: str | np.dtype = "float32") -> Dataset:
    """A dataset from a ``.npz`` file (never unpickles).

    Without keys, the first pair of :data:`NPZ_KEYS` present is used.
    """
    p = Path(path)
    archive = open_arrays(p)
    if isinstance(archive, np.ndarray):
        raise InputError(f"{p}: a single .npy array has no labels; save x and y with np.savez(path, x=..., y=...)")
    with archive:
        names = list(archive.files)
        if x_key is None or y_key is None:
            pair = next(((a, b) for a, b in NPZ_KEYS if a in names and b in names), None)
            if pair is None:
                raise InputError(
                    f"{p}: cannot tell inputs from labels among arrays {names}; name them x and y "
                    "(np.savez(path, x=..., y=...)) or pass x_key/y_key (--x-key/--y-key)"
                )
            x_key = x_key or pair[0]
            y_key = y_key or pair[1]
        for k in (x_key, y_key):
            if k not in names:
                raise InputError(f"{p}: no array named {k!r}; it has {names}")
        try:
            x, y = archive[x_key], archive[y_key]
        except _CORRUPT as exc:  # object arrays need pickle, which is refused; or a damaged member
            raise InputError(f"{p}: not a .npz file of plain arrays ({exc}); save numeric arrays") from exc
        return from_arrays(x, y, dtype=dtype)


def save_npz(path: str | os.PathLike, data: Dataset) -> None:
    np.savez(path, x=data.x, y=data.y)


def check_labels(y: np.ndarray, n_classes: int) -> None:
    """Class labels must be integers in [0, n_classes)."""
    if not np.issubdtype(y.dtype, np.integer):
        raise InputError(f"class labels must be integers, got dtype {y.dtype}")
    if y.ndim != 1:
        raise ShapeError(f"class labels must have shape (N,), got {y.shape}")
    if y.size == 0:
        return
    bad = np.flatnonzero((y < 0) | (y >= n_classes))
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"label {int(y[i])} at sample {i} is out of range [0, {n_classes - 1}] for a {n_classes}-class "
            f"model ({bad.size} bad label(s) in all); relabel or drop them"
        )


def check_inputs(x: np.ndarray, expected: Sequence[int | str | None], name: str = "input") -> None:
    """``x`` must match the model input's rank and every static dimension."""
    exp = tuple(expected)
    shown = "(" + ", ".join(str(d) if isinstance(d, int) and d > 0 else "N" if i == 0 else "?"
                            for i, d in enumerate(exp)) + ")"
    if x.ndim != len(exp):
        raise ShapeError(f"{name!r} expects shape {shown} (rank {len(exp)}); got {x.shape} (rank {x.ndim})")
    for i, (got, want) in enumerate(zip(x.shape, exp)):
        if isinstance(want, int) and want > 0 and got != want:
            raise ShapeError(f"{name!r} expects shape {shown}; got {x.shape} (dimension {i} is {got}, not {want})")


class DataLoader:
    """Batches of a :class:`Dataset` or of a generator source.

    Each pass (``iter(loader)``) is one epoch. Arrays are reshuffled every
    epoch from ``np.random.default_rng(seed)`` — epoch k of two loaders with
    the same seed yields the same batches.
    """

    def __init__(
        self,
        source: "Dataset | tuple[np.ndarray, np.ndarray] | ChunkSource",
        batch_size: int = 32,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        sample_shape: Sequence[int] | None = None,
    ) -> None:
        if int(batch_size) < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.sample_shape = None if sample_shape is None else tuple(sample_shape)
        self._rng = np.random.default_rng(seed)
        self._used_iterator = False
        if isinstance(source, tuple) and len(source) == 2 and all(isinstance(a, np.ndarray) for a in source):
            source = from_arrays(*source)
        self.dataset: Dataset | None = source if isinstance(source, Dataset) else None
        self._source = None if self.dataset is not None else source
        if self.dataset is None and not (callable(source) or isinstance(source, Iterator)):
            raise InputError(
                f"cannot load data from {type(source).__name__}: give a Dataset, (x, y) arrays, "
                "a callable returning (x, y) chunks, or an iterator of them"
            )

    @property
    def num_samples(self) -> int | None:
        """Samples per epoch, when known (arrays); None for generators."""
        return None if self.dataset is None else len(self.dataset)

    def __len__(self) -> int:
        n = self.num_samples
        if n is None:
            raise TypeError("a generator-backed DataLoader has no length")
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Chunk]:
        if self.dataset is not None:
            return self._array_batches(self.dataset)
        return self._stream_batches()

    def _array_batches(self, d: Dataset) -> Iterator[Chunk]:
        n, b = len(d), self.batch_size
        order = self._rng.permutation(n) if self.shuffle else None
        stop = n - n % b if self.drop_last else n
        for start in range(0, stop, b):
            if order is None:
                yield d.x[start:start + b], d.y[start:start + b]
            else:
                idx = order[start:start + b]
                yield d.x[idx], d.y[idx]

    def _chunks(self) -> Iterator[Chunk]:
        src = self._source
        if isinstance(src, Iterator):
            if self._used_iterator:
                raise InputError(
                    "this data iterator is exhausted after one epoch; pass a callable that returns a fresh "
                    "iterator (e.g. lambda: my_generator()) to train several epochs"
                )
            self._used_iterator = True
            return src
        return iter(src())  # type: ignore[operator]

    def _stream_batches(self) -> Iterator[Chunk]:
        bx: list[np.ndarray] = []
        by: list[np.ndarray] = []
        have = 0
        for k, item in enumerate(self._chunks()):
            try:
                x, y = item
            except (TypeError, ValueError):
                raise InputError(f"data chunk {k} is not an (x, y) pair") from None
            x, y = np.asarray(x), np.asarray(y)
            if self.sample_shape is not None and x.shape == self.sample_shape:
                x, y = x[None], y.reshape((1,) + y.shape)  # a single sample
            d = from_arrays(x, y, dtype=x.dtype if np.issubdtype(x.dtype, np.floating) else "float32")
            bx.append(d.x)
            by.append(d.y)
            have += len(d)
            while have >= self.batch_size:
                xs, ys = np.concatenate(bx), np.concatenate(by)
                yield xs[: self.batch_size], ys[: self.batch_size]
                bx, by = [xs[self.batch_size:]], [ys[self.batch_size:]]
                have -= self.batch_size
        if have and not self.drop_last:
            yield np.concatenate(bx), np.concatenate(by)


def as_loader(data, batch_size: int, *, shuffle: bool = True, seed: int = 0) -> DataLoader:
    """Anything :class:`DataLoader` accepts, or a ``.npz`` path, or a loader (returned as is)."""
    if isinstance(data, DataLoader):
        return data
    if isinstance(data, (str, os.PathLike)):
        data = load_npz(data)
    return DataLoader(data, batch_size, shuffle=shuffle, seed=seed)
