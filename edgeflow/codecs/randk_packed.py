"""Random-k with shared-seed indices and 1-8 bit values: no bytes spent on indices.

``topk-packed`` spends about a byte per kept entry on its index (a gap
varint; at 1% density the information-theoretic floor is about 8 bits an
index, so better index coding cannot do much better). ``randk-packed`` sends
no indices at all: each section carries a 32-bit seed, and sender and
receiver derive the same index set from it (Stich et al. 2018,
"Sparsified SGD with memory", rand-k with error feedback). Every entry then
costs only its value bits: at 1 bit (signs times mean |x|) a byte carries 8
entries, where ``topk-packed`` carries fewer than one.

The index set is a Bernoulli sample: entry ``i`` is kept when the ``i``-th
raw 64-bit output of ``numpy.random.PCG64(seed)``, shifted right by 48, is
below ``density`` (a u16: the kept share is ``density / 65536``; 0 stands
for 65536, every entry). PCG64's
raw stream is fixed by numpy's stream-compatibility policy (NEP 19) and
read in blocks of :data:`_BLOCK`, which does not change it, so the set does
not depend on the numpy version or on memory. The kept count is what the
sample gives (about ``ratio x n``, possibly 0 for a tiny tensor); error
feedback carries everything not sent, as for top-k.

Values are quantized as in ``topk-packed`` (:func:`quantize_bits`: unbiased
stochastic rounding, or signs times mean |x| at 1 bit); the quantization
error goes back into the residual.

Section layout: u8 bits | u16 density | u32 seed | ``<f4`` scale | the k
codes packed LSB-first in ``ceil(k * bits / 8)`` bytes (k = the sample's
size). A receiver derives k from the seed before reading the codes, so a
code section of the wrong length, a code the encoder never writes, an
unknown bit width or a non-finite or too-large scale
is refused (``tests/test_codec_randk_packed.py``). Decoding costs one PRNG
draw per declared element (bounded by ``max_elements`` / the model's shapes
the gateway passes), in blocks, so a hostile seed cannot make it allocate
more than the output.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from edgeflow.codecs.packing import pack_bits, unpack_bits
from edgeflow.codecs.registry import Codec, EncodeContext, check_layout, register_codec
from edgeflow.codecs.rejects import codec_error
from edgeflow.codecs.topk_packed import _check_scale, dequantize_bits, qmax_of, quantize_bits

__all__ = ["RandKPackedCodec", "sample_indices"]

_HEAD = struct.Struct("<BHIf")
_BLOCK = 1 << 16
DEFAULT_BITS = 1
DEFAULT_RATIO = 0.1


def sample_indices(seed: int, size: int, density: int) -> np.ndarray:
    """The sorted indices kept for ``seed`` in a tensor of ``size`` entries at ``density``/65536."""
    if density <= 0 or size == 0:
        return np.zeros(0, dtype=np.int64)
    gen = np.random.PCG64(seed)
    limit = np.uint64(density)
    out = []
    for first in range(0, size, _BLOCK):
        n = min(_BLOCK, size - first)
        keys = gen.random_raw(n) >> np.uint64(48)
        out.append(np.flatnonzero(keys < limit) + first)
    return np.concatenate(out).astype(np.int64, copy=False)


def _density_of(ratio: float) -> int:
    return max(1, min(1 << 16, round(ratio * (1 << 16))))


def check_randk_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    ratio = opts.pop("ratio", DEFAULT_RATIO)
    bits = opts.pop("bits", DEFAULT_BITS)
    if opts:
        msg = f"unknown option(s) {', '.join(sorted(opts))} for codec {name!r}; valid options: ratio, bits, layout"
        raise codec_error("bad_option", msg)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating, np.integer)) \
            or not 0.0 < float(ratio) <= 1.0:
        raise codec_error("bad_option", f"codec {name!r}: ratio must be a number in (0, 1], got {ratio!r}")
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 8:
        raise codec_error("bad_option", f"codec {name!r}: bits must be an integer in 1..8, got {bits!r}")
    return {"ratio": float(ratio), "bits": int(bits)}


class RandKPackedCodec(Codec):
    name = "randk-packed"
    codec_id = 7
    option_names = ("ratio", "bits", "layout")
    uses_feedback = True
    envelope_version = 2

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        out = check_randk_options(self.name, check_layout(self.name, options))
        return {**out, "layout": options["layout"]} if "layout" in options else out

    def encode(self, x: np.ndarray, ctx: EncodeContext, residual: np.ndarray | None = None):
        bits = ctx.options.get("bits", DEFAULT_BITS)
        density = _density_of(ctx.options.get("ratio", DEFAULT_RATIO))
        acc = x + residual if residual is not None else x
        seed = int(ctx.rng.integers(0, 1 << 32))
        idx = sample_indices(seed, acc.size, density)
        scale, codes = quantize_bits(acc[idx], bits, ctx.rng)
        parts = [_HEAD.pack(bits, density & 0xFFFF if density < (1 << 16) else 0, seed, scale),
                 pack_bits(codes, bits)]
        new_residual = None
        if ctx.feedback:
            new_residual = acc.copy() if acc is x else acc
            new_residual[idx] -= dequantize_bits(scale, codes, bits)
        return parts, new_residual

    def decode(self, section: memoryview, size: int) -> np.ndarray:
        if len(section) < _HEAD.size:
            raise codec_error("malformed", f"randk-packed section is {len(section)} bytes, shorter than its "
                                           f"{_HEAD.size}-byte header")
        bits, density, seed, scale = _HEAD.unpack_from(section, 0)
        if not 1 <= bits <= 8:
            raise codec_error("malformed", f"randk-packed section declares {bits} bits per value; 1..8 exist")
        _check_scale(scale, bits, "randk-packed")
        idx = sample_indices(seed, size, density or (1 << 16))
        codes = unpack_bits(section[_HEAD.size :], idx.size, bits, "randk-packed section")
        if bits > 1 and idx.size and int(codes.max()) > 2 * qmax_of(bits):
            raise codec_error("malformed", "randk-packed section holds a code the encoder never produces")
        out = np.zeros(size, dtype=np.float32)
        out[idx] = dequantize_bits(scale, codes, bits)
        return out


register_codec(RandKPackedCodec())
