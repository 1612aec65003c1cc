"""Sequence and Optional ops.

A value of ONNX sequence type is a Python ``list`` of arrays; a value of
optional type is ``None`` (empty) or the value itself. Kernels never mutate
a sequence they receive: SequenceInsert/Erase return new lists, because the
input sequence may still be read elsewhere (e.g. a Loop's carried value).

Positions are int64 scalars (or 1-element tensors); negative positions count
from the back, as in the spec.
"""

from __future__ import annotations

import numpy as np

from .registry import ANY_TYPE, register


def _position(pos, length: int, *, insert: bool) -> int:
    a = np.asarray(pos)
    if a.size != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"a sequence position must be one integer, got {a.dtype} of shape {a.shape}")
    p = int(a.reshape(-1)[0])
    hi = length if insert else length - 1
    if not -length <= p <= hi:
        raise IndexError(f"sequence position {p} is out of range for a sequence of length {length}")
    return p + length if p < 0 else p


def _sequence(seq, op: str) -> list:
    if not isinstance(seq, list):
        raise TypeError(f"{op} expects a sequence, got {type(seq).__name__}")
    return seq


@register("SequenceEmpty", dtypes=ANY_TYPE, since=11)
def sequence_empty(*, dtype: int = 1) -> list:
    return []


@register("SequenceConstruct", dtypes=ANY_TYPE, since=11)
def sequence_construct(*tensors) -> list:
    return list(tensors)


@register("SequenceInsert", dtypes=ANY_TYPE, since=11)
def sequence_insert(seq, tensor, position=None) -> list:
    out = list(_sequence(seq, "SequenceInsert"))
    if position is None:
        out.append(tensor)
    else:
        out.insert(_position(position, len(out), insert=True), tensor)
    return out


@register("SequenceAt", dtypes=ANY_TYPE, since=11)
def sequence_at(seq, position):
    seq = _sequence(seq, "SequenceAt")
    return seq[_position(position, len(seq), insert=False)]


@register("SequenceErase", dtypes=ANY_TYPE, since=11)
def sequence_erase(seq, position=None) -> list:
    out = list(_sequence(seq, "SequenceErase"))
    if not out:
        raise IndexError("SequenceErase on an empty sequence")
    del out[-1 if position is None else _position(position, len(out), insert=False)]
    return out


@register("SequenceLength", dtypes=ANY_TYPE, since=11)
def sequence_length(seq) -> np.ndarray:
    return np.array(len(_sequence(seq, "SequenceLength")), np.int64)


@register("SplitToSequence", dtypes=ANY_TYPE, since=11)
def split_to_sequence(x, split=None, *, axis: int = 0, keepdims: int = 1) -> list:
    x = np.asarray(x)
    ax = axis % x.ndim
    dim = x.shape[ax]
    if split is None:
        parts = np.split(x, dim, axis=ax) if dim else []
        return [p.squeeze(ax) for p in parts] if not keepdims else list(parts)
    s = np.asarray(split)
    if s.ndim == 0:
        size = int(s)
        if size <= 0:
            raise ValueError(f"SplitToSequence split must be > 0, got {size}")
        lengths = [size] * (dim // size) + ([dim % size] if dim % size else [])
    else:
        lengths = [int(v) for v in s.reshape(-1)]
        if sum(lengths) != dim or any(v < 0 for v in lengths):
            raise ValueError(f"SplitToSequence split {lengths} does not add up to dimension {dim} of axis {ax}")
    cuts = np.cumsum(lengths)[:-1]
    return list(np.split(x, cuts, axis=ax))


@register("ConcatFromSequence", dtypes=ANY_TYPE, since=11)
def concat_from_sequence(seq, *, axis: int, new_axis: int = 0) -> np.ndarray:
    seq = _sequence(seq, "ConcatFromSequence")
    if not seq:
        raise ValueError("ConcatFromSequence on an empty sequence")
    if new_axis:
        return np.stack(seq, axis=axis)
    return np.concatenate(seq, axis=axis)


@register("Optional", dtypes=ANY_TYPE, since=15)
def optional(x=None, *, type=None):  # noqa: A002 - the ONNX attribute's name
    return x


@register("OptionalHasElement", dtypes=ANY_TYPE, since=15)
def optional_has_element(x=None) -> np.ndarray:
    return np.array(x is not None)


@register("OptionalGetElement", dtypes=ANY_TYPE, since=15)
def optional_get_element(x):
    if x is None:
        raise ValueError("OptionalGetElement on an empty optional (it holds no value)")
    return x
