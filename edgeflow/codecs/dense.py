"""Dense fp32: the lossless baseline every other codec is measured against."""

from __future__ import annotations

import numpy as np

from edgeflow.codecs.registry import Codec, EncodeContext, register_codec
from edgeflow.codecs.rejects import codec_error

__all__ = ["MAX_VALUE", "DenseCodec", "check_finite", "check_values"]

MAX_VALUE = 1e9
"""Largest magnitude a decoded (or encoded) value may have.

A finite float32 can still be poison: 1e37 from one device overflows a
float32 sum of a few of them, and an int8 section with scale 3e38 decodes
q=127 to Inf. No model weight or update delta comes near 1e9, and with every
value at most 1e9 a float32 sum of 2**31 sample-weighted terms cannot
overflow (3.4e38), so the aggregator never sees Inf. Checked by every codec
on decode (reason ``out_of_range``) and by :func:`encode_update` on encode.
"""


def check_values(values: np.ndarray, what: str) -> None:
    """Refuse NaN/Inf [non_finite] and magnitudes above :data:`MAX_VALUE` [out_of_range].

    Two reductions (min, max) and no temporary: NaN propagates through both,
    so one comparison catches NaN, Inf and values that are merely too large.
    """
    if not values.size:
        return
    lo, hi = float(values.min()), float(values.max())
    if -MAX_VALUE <= lo and hi <= MAX_VALUE:
        return
    finite = np.isfinite(values)
    bad = int(values.size - np.count_nonzero(finite))
    if bad:
        msg = f"{what} holds {bad} NaN/Inf value(s); the sender's training step diverged"
        raise codec_error("non_finite", msg)
    peak = max(abs(lo), abs(hi))
    msg = (f"{what} holds a value of magnitude {peak:.3g}, above the {MAX_VALUE:g} any update may carry; "
           "the sender diverged or is hostile")
    raise codec_error("out_of_range", msg)


check_finite = check_values
"""Former name of :func:`check_values` (it now bounds the magnitude too)."""


class DenseCodec(Codec):
    name = "dense"
    codec_id = 1
    lossless = True

    def encode(self, x: np.ndarray, ctx: EncodeContext, residual: np.ndarray | None = None):
        # The array itself is the section: the envelope's single join copies it.
        return [memoryview(x.astype("<f4", copy=False)).cast("B")], None

    def decode(self, section: memoryview, size: int) -> np.ndarray:
        if len(section) != 4 * size:
            msg = f"dense section is {len(section)} bytes, expected {4 * size} for {size} float32 values"
            raise codec_error("malformed", msg)
        values = np.frombuffer(section, dtype="<f4", count=size)
        check_values(values, "dense section")
        return values.astype(np.float32)  # copy: the caller owns a writable array


register_codec(DenseCodec())
