"""Ops that move or re-view data without arithmetic: Flatten, Reshape,
Transpose, Concat, Split, Slice, Shape, Size, Gather, Unsqueeze, Squeeze,
Expand, Tile, Compress, NonZero, ReverseSequence, Identity, Constant, Cast,
CastLike, BitCast.

Where ONNX moved an attribute to an input (Squeeze/Unsqueeze axes at opset
13, Split at 13), both versions are registered and the registry picks by the
model's opset.

Backwards of the data-moving ops are the inverse moves: reshape the
gradient back, transpose by the inverse permutation, split a Concat's
gradient at the input boundaries.
"""

from __future__ import annotations

import functools

import numpy as np

from .registry import ANY_TYPE, KernelError, register

# TensorProto.DataType enum -> numpy dtype, for Cast's ``to`` attribute. The
# kernel library cannot import onnx, so the (stable, spec-defined) numbers are
# written out here.
TENSOR_TYPES: dict[int, np.dtype] = {
    1: np.dtype(np.float32),
    2: np.dtype(np.uint8),
    3: np.dtype(np.int8),
    4: np.dtype(np.uint16),
    5: np.dtype(np.int16),
    6: np.dtype(np.int32),
    7: np.dtype(np.int64),
    9: np.dtype(np.bool_),
    10: np.dtype(np.float16),
    11: np.dtype(np.float64),
    12: np.dtype(np.uint32),
    13: np.dtype(np.uint64),
}


def _axes(axes, ndim: int) -> list[int]:
    return sorted(int(a) % ndim for a in np.asarray(axes).reshape(-1))


@register("Flatten", dtypes=ANY_TYPE)
def flatten(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    axis = axis % x.ndim if x.ndim and axis < 0 else axis
    lead = int(np.prod(x.shape[:axis], dtype=np.int64))
    return x.reshape(lead, -1) if x.size or lead else x.reshape(lead, 0)


def _reshape_back(grads, inputs, outputs, **attrs):
    dy = grads[0]
    return (None if dy is None else dy.reshape(inputs[0].shape),) + (None,) * (len(inputs) - 1)


flatten.backward(_reshape_back, uses="inputs")


@register("Reshape", dtypes=ANY_TYPE, since=5)
def reshape(x: np.ndarray, shape: np.ndarray, *, allowzero: int = 0) -> np.ndarray:
    target = [int(s) for s in np.asarray(shape).reshape(-1)]
    if not allowzero:
        target = [x.shape[i] if s == 0 else s for i, s in enumerate(target)]
    return x.reshape(target)


reshape.backward(_reshape_back, uses="inputs")


@register("Transpose", dtypes=ANY_TYPE)
def transpose(x: np.ndarray, *, perm: list[int] | None = None) -> np.ndarray:
    return np.transpose(x, perm if perm else None)


@transpose.backward(uses="none")
def _(grads, inputs, outputs, *, perm=None):
    dy = grads[0]
    if dy is None:
        return (None,)
    if not perm:
        return (np.transpose(dy),)  # reversing the axes is its own inverse
    return (np.transpose(dy, np.argsort(perm)),)


@register("Concat", dtypes=ANY_TYPE)
def concat(*inputs: np.ndarray, axis: int) -> np.ndarray:
    return np.concatenate(inputs, axis=axis)


@concat.backward(uses="inputs")
def _(grads, inputs, outputs, *, axis):
    dy = grads[0]
    if dy is None:
        return (None,) * len(inputs)
    cuts = np.cumsum([x.shape[axis] for x in inputs])[:-1]
    return tuple(np.split(dy, cuts, axis=axis))


def _split_points(length: int, split, num_outputs: int) -> list[int]:
    if split is not None:
        sizes = [int(s) for s in np.asarray(split).reshape(-1)]
    else:
        chunk = -(-length // num_outputs)
        sizes = [min(chunk, length - i * chunk) for i in range(num_outputs)]
    return list(np.cumsum(sizes)[:-1])


@functools.lru_cache(maxsize=4096)
def _split_index(shape: tuple, axis: int, split: tuple | None, n: int) -> tuple:
    """One index per part, for these shapes and constants (np.split's parts, as slices)."""
    probe = _probe(shape)
    np.split(probe, _split_points(probe.shape[axis], split, n), axis=axis)  # refuses what np.split refuses
    ax = axis % len(shape)
    cuts = [0, *(int(c) for c in _split_points(shape[ax], split, n)), shape[ax]]
    head = (slice(None),) * ax
    return tuple(head + (slice(a, b),) for a, b in zip(cuts[:-1], cuts[1:]))


def _split(x: np.ndarray, axis: int, split, n: int) -> tuple[np.ndarray, ...]:
    key = None if split is None else _key(split)
    return tuple(x[i] for i in _split_index(x.shape, int(axis), key, n))


@register("Split", dtypes=ANY_TYPE, since=13)
def split(
    x: np.ndarray, split: np.ndarray | None = None, *, axis: int = 0,
    num_outputs: int | None = None, n_outputs: int = 1,
) -> tuple[np.ndarray, ...]:
    return _split(x, axis, split, num_outputs or n_outputs)


@register("Split", dtypes=ANY_TYPE, since=2)
def split_v2(x: np.ndarray, *, axis: int = 0, split: list[int] | None = None, n_outputs: int = 1):
    return _split(x, axis, split, n_outputs)


@register("Slice", dtypes=ANY_TYPE, since=10)
def slice_(
    x: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    axes: np.ndarray | None = None,
    steps: np.ndarray | None = None,
) -> np.ndarray:
    return x[_slice_index(x.shape, _key(starts), _key(ends), None if axes is None else _key(axes),
                          None if steps is None else _key(steps))]


@functools.lru_cache(maxsize=4096)
def _slice_index(shape: tuple, starts: tuple, ends: tuple, axes: tuple | None, steps: tuple | None) -> tuple:
    """Slice's index for these shapes and constants, computed once (see :func:`_key`)."""
    axes = range(len(starts)) if axes is None else axes
    steps = (1,) * len(starts) if steps is None else steps
    index = [slice(None)] * len(shape)
    for s, e, a, st in zip(starts, ends, axes, steps):
        dim = shape[int(a)]
        s, e, st = int(s), int(e), int(st)
        # Clamp huge sentinel values (INT64_MAX/MIN) the way the spec does.
        s = max(-dim - 1, min(dim, s))
        e = max(-dim - 1, min(dim, e))
        if st < 0 and e < -dim:
            e = None  # slice to the very beginning
        index[int(a) % len(shape)] = slice(s, e, st)
    return tuple(index)


@register("Shape", dtypes=ANY_TYPE)
def shape(x: np.ndarray, *, start: int = 0, end: int | None = None) -> np.ndarray:
    return np.array(x.shape[start:end], dtype=np.int64)


@register("Size", dtypes=ANY_TYPE)
def size(x: np.ndarray) -> np.ndarray:
    return np.array(x.size, dtype=np.int64)


@register("Gather", dtypes=ANY_TYPE)
def gather(x: np.ndarray, indices: np.ndarray, *, axis: int = 0) -> np.ndarray:
    idx = np.asarray(indices)
    dim = x.shape[axis]
    if idx.ndim == 0 and idx.dtype.kind in "iu":
        # one index: a basic-indexing copy of that slice. np.take first copies a non-contiguous x
        # whole (an unrolled RNN's per-step Gather from a transposed (20, 1, 4096): 53 us, this ~3)
        i = int(idx)
        if i < -dim or i >= dim:
            raise IndexError(f"Gather index out of range [-{dim}, {dim - 1}] on axis {axis}")
        return x[(slice(None),) * (axis % x.ndim) + (i,)].copy()
    if idx.size and (idx.min() < -dim or idx.max() >= dim):
        raise IndexError(f"Gather index out of range [-{dim}, {dim - 1}] on axis {axis}")
    return np.take(x, idx.astype(np.intp), axis=axis)  # intp: 32-bit numpy (armv7) refuses int64 here


@gather.backward(uses="inputs")
def _(grads, inputs, outputs, *, axis=0):
    dy, (x, indices) = grads[0], inputs[:2]
    if dy is None:
        return (None, None)
    # repeated indices (an embedding row used twice) accumulate
    ax = axis % x.ndim
    g = np.zeros(x.shape, dtype=dy.dtype)
    idx = np.asarray(indices).astype(np.int64) % x.shape[ax]
    np.add.at(g, (slice(None),) * ax + (idx,), dy)
    return (g, None)


def _key(a) -> tuple:
    """An axes/starts/... input as a hashable tuple of ints (the memo key of the shape ops)."""
    return tuple(a.reshape(-1).tolist()) if isinstance(a, np.ndarray) else tuple(np.asarray(a).reshape(-1).tolist())


def _probe(shape: tuple) -> np.ndarray:
    """An array of ``shape`` that holds no memory (a broadcast scalar), for working out shapes."""
    return np.broadcast_to(np.int8(0), shape)


@functools.lru_cache(maxsize=4096)
def _unsqueezed(shape: tuple, axes: tuple) -> tuple:
    out_rank = len(shape) + len(axes)
    return np.expand_dims(_probe(shape), tuple(_axes(axes, out_rank))).shape


@functools.lru_cache(maxsize=4096)
def _squeezed(shape: tuple, axes: tuple | None) -> tuple:
    probe = _probe(shape)
    return (np.squeeze(probe) if axes is None else np.squeeze(probe, axis=tuple(_axes(axes, len(shape))))).shape


# Squeeze, Unsqueeze and Slice run with the same shapes and constant axes every call: the
# output shape (or index) is computed once per (shape, axes) by the very numpy functions
# that computed it per call (np.expand_dims/np.squeeze on a probe array; they raise on bad
# axes as before), then it is one reshape/index: 0.3-1 us instead of 3-9 us of Python
# per node, which a streaming model's step pays dozens of times (dtln: 30 such nodes).


@register("Unsqueeze", dtypes=ANY_TYPE, since=13)
def unsqueeze(x: np.ndarray, axes: np.ndarray) -> np.ndarray:
    return x.reshape(_unsqueezed(x.shape, _key(axes)))


unsqueeze.backward(_reshape_back, uses="inputs")


@register("Unsqueeze", dtypes=ANY_TYPE, since=1)
def unsqueeze_v1(x: np.ndarray, *, axes: list[int]) -> np.ndarray:
    return unsqueeze.forward(x, np.asarray(axes))


unsqueeze_v1.backward(_reshape_back, uses="inputs")


@register("Squeeze", dtypes=ANY_TYPE, since=13)
def squeeze(x: np.ndarray, axes: np.ndarray | None = None) -> np.ndarray:
    return x.reshape(_squeezed(x.shape, None if axes is None else _key(axes)))


squeeze.backward(_reshape_back, uses="inputs")


@register("Squeeze", dtypes=ANY_TYPE, since=1)
def squeeze_v1(x: np.ndarray, *, axes: list[int] | None = None) -> np.ndarray:
    return squeeze.forward(x, None if axes is None else np.asarray(axes))


squeeze_v1.backward(_reshape_back, uses="inputs")


@register("Expand", dtypes=ANY_TYPE, since=8)
def expand(x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    target = np.broadcast_shapes(x.shape, tuple(int(s) for s in np.asarray(shape).reshape(-1)))
    return np.broadcast_to(x, target).copy()


@register("Identity", dtypes=ANY_TYPE)
def identity(x: np.ndarray) -> np.ndarray:
    return x


@identity.backward(uses="none")
def _(grads, inputs, outputs):
    return (grads[0],)


@register("Constant", dtypes=ANY_TYPE)
def constant(
    *,
    value: np.ndarray | None = None,
    value_float: float | None = None,
    value_floats: list[float] | None = None,
    value_int: int | None = None,
    value_ints: list[int] | None = None,
) -> np.ndarray:
    if value is not None:
        return np.asarray(value)
    if value_float is not None:
        return np.array(value_float, dtype=np.float32)
    if value_floats is not None:
        return np.array(value_floats, dtype=np.float32)
    if value_int is not None:
        return np.array(value_int, dtype=np.int64)
    if value_ints is not None:
        return np.array(value_ints, dtype=np.int64)
    raise ValueError("Constant needs one of value, value_float(s), value_int(s)")


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if x.dtype == dtype:
        return x
    if np.issubdtype(dtype, np.integer) and np.issubdtype(x.dtype, np.floating):
        with np.errstate(invalid="ignore"):
            return np.trunc(x).astype(dtype)
    return x.astype(dtype)


def _tensor_type(op: str, to: int) -> np.dtype:
    try:
        return TENSOR_TYPES[int(to)]
    except KeyError:
        raise KernelError(f"{op} to tensor type {to} is not supported by the numpy kernels") from None


@register("Cast", dtypes=ANY_TYPE)
def cast(x: np.ndarray, *, to: int, saturate: int = 1, round_mode: str = "up") -> np.ndarray:
    # ``saturate`` and ``round_mode`` only affect float8/float4 targets, which
    # numpy cannot represent (the graph is refused before it gets here).
    return _cast(x, _tensor_type("Cast", to))


@register("CastLike", since=15, dtypes=ANY_TYPE)
def cast_like(x: np.ndarray, like: np.ndarray, *, saturate: int = 1, round_mode: str = "up") -> np.ndarray:
    return _cast(x, like.dtype)


@register("BitCast", since=26, dtypes=ANY_TYPE)
def bit_cast(x: np.ndarray, *, to: int) -> np.ndarray:
    dtype = _tensor_type("BitCast", to)
    if dtype.itemsize != x.dtype.itemsize:
        raise KernelError(
            f"BitCast: {x.dtype} ({x.dtype.itemsize * 8} bits) and {dtype} ({dtype.itemsize * 8} bits) "
            "differ in width; BitCast needs types of one width"
        )
    return (x if x.flags.c_contiguous else x.copy()).view(dtype)


@register("Tile", since=6, dtypes=ANY_TYPE)
def tile(x: np.ndarray, repeats: np.ndarray) -> np.ndarray:
    reps = [int(r) for r in np.asarray(repeats).reshape(-1)]
    if len(reps) != x.ndim:
        raise KernelError(f"Tile: repeats has {len(reps)} entries for an input of rank {x.ndim}")
    if any(r < 0 for r in reps):
        raise KernelError(f"Tile: repeats must be non-negative, got {reps}")
    return np.tile(x, reps)


@register("Compress", since=9, dtypes=ANY_TYPE)
def compress(x: np.ndarray, condition: np.ndarray, *, axis: int | None = None) -> np.ndarray:
    cond = np.asarray(condition).reshape(-1).astype(bool, copy=False)
    if axis is None:
        flat = x.reshape(-1)
        return flat[: cond.size][cond[: flat.size]]
    if not -x.ndim <= axis < x.ndim:
        raise KernelError(f"Compress: axis {axis} is out of range for rank {x.ndim}")
    n = x.shape[axis]
    if cond.size > n:
        raise KernelError(f"Compress: condition has {cond.size} entries, axis {axis} has {n}")
    return np.compress(cond, x, axis=axis)


@register("NonZero", since=9, dtypes=ANY_TYPE)
def nonzero(x: np.ndarray) -> np.ndarray:
    if x.ndim == 0:
        return np.zeros((0, int(bool(x))), dtype=np.int64)
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


@register("ReverseSequence", since=10, dtypes=ANY_TYPE)
def reverse_sequence(
    x: np.ndarray, sequence_lens: np.ndarray, *, batch_axis: int = 1, time_axis: int = 0
) -> np.ndarray:
    if {batch_axis, time_axis} != {0, 1}:
        raise KernelError(
            f"ReverseSequence: batch_axis and time_axis must be 0 and 1 (either way), got {batch_axis}, {time_axis}"
        )
    t_len, b_len = x.shape[time_axis], x.shape[batch_axis]
    lens = np.asarray(sequence_lens).reshape(-1).astype(np.int64)
    if lens.size != b_len or (lens.size and (lens.min() < 0 or lens.max() > t_len)):
        raise KernelError(
            f"ReverseSequence: sequence_lens must hold {b_len} lengths in [0, {t_len}], got {lens.tolist()}"
        )
    t = np.arange(t_len)[:, None]  # (T, B): source time step of each output step
    src = np.where(t < lens[None, :], lens[None, :] - 1 - t, t)
    if time_axis == 1:
        src = src.T
    src = src.reshape(src.shape + (1,) * (x.ndim - 2))
    return np.take_along_axis(x, np.broadcast_to(src, x.shape), axis=time_axis)


# ---------------------------------------------------------------- backwards (transfer learning)
# Kept apart from the forwards above; each names its forward.


def _split_back(grads, inputs, outputs, axis):
    x = inputs[0]
    ax = axis % x.ndim
    parts = []
    for dy, y in zip(grads, outputs):
        parts.append(dy if dy is not None else np.zeros(y.shape, dtype=x.dtype))
    return (np.concatenate(parts, axis=ax) if parts else None,) + (None,) * (len(inputs) - 1)


@split.backward(uses="all")
def _(grads, inputs, outputs, *, axis=0, num_outputs=None):
    return _split_back(grads, inputs, outputs, axis)


@split_v2.backward(uses="all")
def _(grads, inputs, outputs, *, axis=0, split=None):
    return _split_back(grads, inputs, outputs, axis)


@slice_.backward(uses="inputs")
def _(grads, inputs, outputs):
    dy, x = grads[0], inputs[0]
    rest = (None,) * (len(inputs) - 1)
    if dy is None:
        return (None,) + rest
    # Slice a grid of flat positions the same way: it names where each output element came from.
    where = slice_.forward(np.arange(x.size).reshape(x.shape), *inputs[1:])
    g = np.zeros(x.size, dtype=dy.dtype)
    g[where.reshape(-1)] = dy.reshape(-1)  # a slice never repeats a position
    return (g.reshape(x.shape),) + rest


@expand.backward(uses="inputs")
def _(grads, inputs, outputs):
    from .elementwise import reduce_to_shape  # in-function: the forwards above need nothing from it

    dy, x = grads[0], inputs[0]
    return (None if dy is None else reduce_to_shape(dy, x.shape), None)


@tile.backward(uses="inputs")
def _(grads, inputs, outputs):
    dy, x = grads[0], inputs[0]
    if dy is None:
        return (None, None)
    reps = [int(r) for r in np.asarray(inputs[1]).reshape(-1)]
    # (r0, d0, r1, d1, ...) then sum over the repeat axes
    split_shape = [v for r, d in zip(reps, x.shape) for v in (r, d)]
    g = dy.reshape(split_shape).sum(axis=tuple(range(0, 2 * x.ndim, 2)))
    return (g, None)


@cast.backward(uses="inputs")
def _(grads, inputs, outputs, *, to, saturate=1, round_mode="up"):
    dy, x = grads[0], inputs[0]
    if dy is None or not np.issubdtype(x.dtype, np.floating):
        return (None,)
    return (dy.astype(x.dtype, copy=False),)


@cast_like.backward(uses="inputs")
def _(grads, inputs, outputs, *, saturate=1, round_mode="up"):
    dy, x = grads[0], inputs[0]
    if dy is None or not np.issubdtype(x.dtype, np.floating):
        return (None, None)
    return (dy.astype(x.dtype, copy=False), None)
