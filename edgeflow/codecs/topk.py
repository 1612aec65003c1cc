"""Top-k sparsification with error feedback.

Only the ``k`` largest-magnitude entries of each tensor are sent (``ratio``
of the entries, default 1%, or an absolute ``k``). What is not sent is not
lost: with an :class:`~edgeflow.codecs.feedback.ErrorFeedback` state the
remainder is kept on the device and added to the next round's update, so
every coordinate is eventually transmitted (error feedback, Stich et al.
2018). Without a state the dropped mass is simply discarded.

Section layout: ``<I`` k, ``<B`` index width (2 or 4 bytes), 3 zero bytes,
k strictly increasing indices, zero padding to a multiple of 4, k ``<f4``
values. Indices are 16-bit for tensors of at most 65536 entries.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from edgeflow.codecs.dense import check_values
from edgeflow.codecs.registry import Codec, EncodeContext, register_codec
from edgeflow.codecs.rejects import codec_error

__all__ = ["TopKCodec", "check_topk_options", "parse_indices", "select_topk", "topk_count"]

_HEAD = struct.Struct("<IB3x")


def _align4(n: int) -> int:
    return (n + 3) & ~3


def check_topk_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - {"ratio", "k"})
    if unknown:
        msg = f"unknown option(s) {', '.join(unknown)} for codec {name!r}; valid options: ratio, k"
        raise codec_error("bad_option", msg)
    if "ratio" in options and "k" in options:
        raise codec_error("bad_option", f"codec {name!r}: give either ratio or k, not both")
    out: dict[str, Any] = {}
    if "k" in options:
        k = options["k"]
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
            raise codec_error("bad_option", f"codec {name!r}: k must be an integer >= 1, got {k!r}")
        out["k"] = int(k)
    else:
        ratio = options.get("ratio", 0.01)
        if not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
            raise codec_error("bad_option", f"codec {name!r}: ratio must be in (0, 1], got {ratio!r}")
        out["ratio"] = float(ratio)
    return out


def topk_count(size: int, options: dict[str, Any]) -> int:
    if size == 0:
        return 0
    if "k" in options:
        return min(size, options["k"])
    return max(1, min(size, math.ceil(options["ratio"] * size)))


def select_topk(acc: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the ``k`` largest |acc| (argpartition: O(n), no full sort)."""
    n = acc.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    idx = np.argpartition(np.abs(acc), n - k)[n - k :]
    idx.sort()
    return idx


def index_dtype(size: int) -> str:
    return "<u2" if size <= 0x10000 else "<u4"


def pack_indices(idx: np.ndarray, size: int) -> tuple[int, bytes]:
    dt = index_dtype(size)
    raw = idx.astype(dt).tobytes()
    pad = _align4(len(raw)) - len(raw)
    return int(np.dtype(dt).itemsize), raw + b"\0" * pad


def parse_indices(
    section: memoryview, size: int, value_bytes: int, what: str, header_size: int = _HEAD.size
) -> tuple[np.ndarray, int]:
    """Validate a sparse section's header and indices; return (indices, offset of values).

    The section starts with the (k, width) header; indices start at
    ``header_size`` (codecs may put more fixed fields after the header).
    """
    if len(section) < header_size:
        raise codec_error("malformed", f"{what} section is {len(section)} bytes, shorter than its header")
    k, width = _HEAD.unpack_from(section, 0)
    if width not in (2, 4):
        raise codec_error("malformed", f"{what} section declares index width {width}; only 2 and 4 exist")
    if k > size:
        raise codec_error("malformed", f"{what} section declares {k} entries for a tensor of {size}")
    values_at = header_size + _align4(k * width)
    expected = values_at + k * value_bytes
    if len(section) != expected:
        msg = f"{what} section is {len(section)} bytes, expected {expected} for {k} entries"
        raise codec_error("malformed", msg)
    idx = np.frombuffer(section, dtype="<u2" if width == 2 else "<u4", count=k, offset=header_size)
    if k and (int(idx[-1]) >= size or (k > 1 and not bool(np.all(idx[1:] > idx[:-1])))):
        msg = f"{what} section indices are not strictly increasing below {size}; the data is corrupt"
        raise codec_error("malformed", msg)
    return idx, values_at


def header(k: int, width: int) -> bytes:
    return _HEAD.pack(k, width)


class TopKCodec(Codec):
    name = "topk"
    codec_id = 4
    option_names = ("ratio", "k")
    uses_feedback = True

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return check_topk_options(self.name, options)

    def encode(self, x: np.ndarray, ctx: EncodeContext, residual: np.ndarray | None = None):
        acc = x + residual if residual is not None else x
        k = topk_count(acc.size, ctx.options)
        idx = select_topk(acc, k)
        values = acc[idx].astype("<f4")
        width, raw_idx = pack_indices(idx, acc.size)
        new_residual = None
        if ctx.feedback:
            new_residual = acc.copy() if acc is x else acc
            new_residual[idx] = 0.0
        return [header(k, width), raw_idx, memoryview(values).cast("B")], new_residual

    def decode(self, section: memoryview, size: int) -> np.ndarray:
        idx, at = parse_indices(section, size, 4, "topk")
        values = np.frombuffer(section, dtype="<f4", count=idx.size, offset=at)
        check_values(values, "topk section")
        out = np.zeros(size, dtype=np.float32)
        out[idx] = values
        return out


register_codec(TopKCodec())
