"""Half precision: 2x smaller than fp32, deterministic, but only +-65504 of range."""

from __future__ import annotations

import numpy as np

from edgeflow.codecs.dense import check_values
from edgeflow.codecs.registry import Codec, EncodeContext, register_codec
from edgeflow.codecs.rejects import codec_error

__all__ = ["Fp16Codec"]

FP16_MAX = 65504.0


class Fp16Codec(Codec):
    name = "fp16"
    codec_id = 2

    def encode(self, x: np.ndarray, ctx: EncodeContext, residual: np.ndarray | None = None):
        with np.errstate(over="ignore"):
            half = x.astype("<f2")
        if half.size and not np.isfinite(half).all():
            peak = float(np.max(np.abs(x)))
            msg = (
                f"values up to {peak:.6g} exceed the fp16 range of +-{FP16_MAX:g}; "
                "use codec 'dense' or 'int8' (which scales per tensor)"
            )
            raise codec_error("non_finite", msg)
        return [memoryview(half).cast("B")], None

    def decode(self, section: memoryview, size: int) -> np.ndarray:
        if len(section) != 2 * size:
            msg = f"fp16 section is {len(section)} bytes, expected {2 * size} for {size} values"
            raise codec_error("malformed", msg)
        half = np.frombuffer(section, dtype="<f2", count=size)
        check_values(half, "fp16 section")
        return half.astype(np.float32)


register_codec(Fp16Codec())
