"""Top-k sparsification with int8 values: the smallest updates on the wire.

Same selection and error feedback as ``topk``; the kept values are then
quantized like ``int8`` (one scale per tensor, stochastic rounding), and the
quantization error of the kept entries also goes back into the residual.
At 1% density a 1M-parameter update is about 30 KB instead of 4 MB.

Section layout: the ``topk`` header (k, index width), ``<f4`` scale, 4 zero
bytes, the indices padded to 4 bytes, then k int8 values.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from edgeflow.codecs.int8 import check_q, check_scale, dequantize_int8, quantize_int8
from edgeflow.codecs.registry import Codec, EncodeContext, register_codec
from edgeflow.codecs.rejects import codec_error
from edgeflow.codecs.topk import check_topk_options, header, pack_indices, parse_indices, select_topk, topk_count

__all__ = ["TopKInt8Codec"]

_SCALE = struct.Struct("<f4x")


class TopKInt8Codec(Codec):
    name = "topk-int8"
    codec_id = 5
    option_names = ("ratio", "k")
    uses_feedback = True

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return check_topk_options(self.name, options)

    def encode(self, x: np.ndarray, ctx: EncodeContext, residual: np.ndarray | None = None):
        acc = x + residual if residual is not None else x
        k = topk_count(acc.size, ctx.options)
        idx = select_topk(acc, k)
        scale, q = quantize_int8(acc[idx], ctx.rng)
        width, raw_idx = pack_indices(idx, acc.size)
        new_residual = None
        if ctx.feedback:
            new_residual = acc.copy() if acc is x else acc
            new_residual[idx] -= dequantize_int8(scale, q)
        return [header(k, width), _SCALE.pack(scale), raw_idx, memoryview(q).cast("B")], new_residual

    def decode(self, section: memoryview, size: int) -> np.ndarray:
        if len(section) < 16:
            raise codec_error("malformed", f"topk-int8 section is {len(section)} bytes, shorter than its header")
        (scale,) = _SCALE.unpack_from(section, 8)
        if bytes(section[12:16]) != b"\0\0\0\0":
            raise codec_error("malformed", "topk-int8 section has non-zero reserved bytes")
        check_scale(scale, "topk-int8 section")
        idx, at = parse_indices(section, size, 1, "topk-int8", header_size=16)
        q = np.frombuffer(section, dtype=np.int8, count=idx.size, offset=at)
        check_q(q, "topk-int8 section")
        out = np.zeros(size, dtype=np.float32)
        out[idx] = dequantize_int8(scale, q)
        return out


register_codec(TopKInt8Codec())
