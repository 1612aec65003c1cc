"""Dense fp32: the lossless baseline every other codec is measured against."""

from __future__ import annotations

import numpy as np

from edgeflow.codecs.registry import Codec, EncodeContext, register_codec
from edgeflow.codecs.rejects import codec_error

__all__ = ["DenseCodec", "check_finite"]


def check_finite(values: np.ndarray, what: str) -> None:
    """Reject NaN/Inf: one NaN in an update poisons the federated average."""
    if values.size and not np.isfinite(values).all():
        bad = int(values.size - np.count_nonzero(np.isfinite(values)))
        msg = f"{what} holds {bad} NaN/Inf value(s); the sender's training step diverged"
        raise codec_error("non_finite", msg)


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
        check_finite(values, "dense section")
        return values.astype(np.float32)  # copy: the caller owns a writable array


register_codec(DenseCodec())
