"""Top-k with gap-coded indices and 1-8 bit values: the fewest bytes per kept entry.

Selection and error feedback are ``topk``'s (the device keeps what it did
not send and adds it next round). The bytes per kept entry are what change:

- indices are sent as gaps between consecutive sorted indices, each an
  unsigned LEB128 varint (:mod:`edgeflow.codecs.packing`): at 1% density the
  mean gap is 100, one byte, where ``topk`` spends 2 or 4;
- values are quantized to ``bits`` bits (default 4) with one scale per
  tensor and unbiased stochastic rounding (QSGD-style, Alistarh et al. 2017):
  ``q = floor(x / scale + u)`` in ``[-qmax, qmax]``, ``qmax = 2**(bits-1) - 1``;
  ``bits=1`` sends signs with ``scale = mean |x|`` (signSGD with error
  feedback, Karimireddy et al. 2019). The quantization error of the kept
  entries goes back into the residual like the dropped entries.

``min_k`` (default 1) keeps at least that many entries of every tensor: a
ratio of 2% leaves a 10-value bias one entry per round.

``momentum`` (default 0: off) is DGC's momentum correction on the device
(Lin et al., ICLR 2018, "Deep Gradient Compression"), with a round's update
standing for the gradient: the device keeps a velocity ``u`` beside the
residual ``v``; each round ``u = momentum * u + update``, ``v = v + u``, the
top-k of ``v`` is sent and subtracted from ``v`` as above, and ``u`` is zeroed
where an entry was sent (momentum factor masking), so what was sent stops
moving. Top-k then ships where the update keeps heading, not only where it
is large this round; the server's aggregation is unchanged (plain FedAvg).
The per-tensor state is ``[v, u]``, twice the tensor's size.

Section layout: varint k | u8 bits | ``<f4`` scale | k varint gaps | the k
codes packed LSB-first in ``ceil(k * bits / 8)`` bytes. Gap i is
``index[i] - index[i-1]`` (``index[-1] = -1``), so a gap of 0 would be a
repeated index and is refused; codes are ``q + qmax`` and the all-ones code
is never produced (a corrupt section shows it).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from edgeflow.codecs.dense import MAX_VALUE
from edgeflow.codecs.packing import pack_bits, read_varints, unpack_bits, varint, varint_bytes
from edgeflow.codecs.registry import Codec, EncodeContext, check_layout, register_codec
from edgeflow.codecs.rejects import codec_error
from edgeflow.codecs.topk import check_topk_options, select_topk, topk_count

__all__ = ["TopKPackedCodec", "dequantize_bits", "quantize_bits"]

_BITS_SCALE = struct.Struct("<Bf")
DEFAULT_BITS = 4


def qmax_of(bits: int) -> int:
    return 1 if bits == 1 else (1 << (bits - 1)) - 1


def quantize_bits(x: np.ndarray, bits: int, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """``(scale, codes)``: codes in ``[0, 2 * qmax]`` (bits >= 2, unbiased) or signs (bits == 1)."""
    if x.size == 0:
        return 0.0, np.zeros(0, dtype=np.uint8)
    if bits == 1:
        scale = np.float32(np.mean(np.abs(x)))
        return float(scale), (x >= 0).astype(np.uint8)
    qmax = qmax_of(bits)
    amax = max(float(x.max()), -float(x.min()))
    scale = np.float32(amax / qmax)
    if amax == 0.0 or scale == 0.0:
        return 0.0, np.full(x.size, qmax, dtype=np.uint8)
    v = x * (np.float32(1.0) / scale)
    v += rng.random(v.size, dtype=np.float32)
    np.floor(v, out=v)
    np.clip(v, -qmax, qmax, out=v)
    return float(scale), (v + qmax).astype(np.uint8)


def dequantize_bits(scale: float, codes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 1:
        out = codes.astype(np.float32) * np.float32(2.0) - np.float32(1.0)
    else:
        out = codes.astype(np.float32) - np.float32(qmax_of(bits))
    out *= np.float32(scale)
    return out


def check_packed_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    bits = opts.pop("bits", DEFAULT_BITS)
    min_k = opts.pop("min_k", 1)
    out = check_topk_options(name, opts)
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 8:
        raise codec_error("bad_option", f"codec {name!r}: bits must be an integer in 1..8, got {bits!r}")
    if isinstance(min_k, bool) or not isinstance(min_k, (int, np.integer)) or int(min_k) < 1:
        raise codec_error("bad_option", f"codec {name!r}: min_k must be an integer >= 1, got {min_k!r}")
    out["bits"] = int(bits)
    out["min_k"] = int(min_k)
    return out


def _check_momentum(name: str, momentum: Any) -> float:
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float, np.floating)) \
            or not 0.0 <= float(momentum) < 1.0:
        raise codec_error("bad_option", f"codec {name!r}: momentum must be a number in [0, 1) (0: off; DGC uses "
                                        f"0.5-0.9), got {momentum!r}")
    return float(momentum)


def _check_scale(scale: float, bits: int, what: str = "topk-packed") -> None:
    if not np.isfinite(scale) or scale < 0.0:
        raise codec_error("non_finite", f"{what} section has scale {scale!r}; a scale must be finite and >= 0")
    if qmax_of(bits) * scale > MAX_VALUE * (1.0 + 1e-6):
        msg = (f"{what} section has scale {scale:.3g} at {bits} bits: its largest value exceeds the "
               f"{MAX_VALUE:g} any update may carry; the sender diverged or is hostile")
        raise codec_error("out_of_range", msg)


def _indices_from_gaps(gaps: np.ndarray, size: int) -> np.ndarray:
    if gaps.size and int(gaps.min()) == 0:
        raise codec_error("malformed", "topk-packed section repeats an index (a gap of 0); the data is corrupt")
    if gaps.size and int(gaps.max()) > size:
        raise codec_error("malformed", f"topk-packed section has an index gap beyond the tensor's {size} entries")
    idx = np.cumsum(gaps, dtype=np.uint64) - np.uint64(1)
    if idx.size and int(idx[-1]) >= size:
        raise codec_error("malformed", f"topk-packed section indexes entry {int(idx[-1])} of a tensor of {size}")
    return idx.astype(np.int64)


class TopKPackedCodec(Codec):
    name = "topk-packed"
    codec_id = 6
    option_names = ("ratio", "k", "bits", "min_k", "layout", "momentum")
    uses_feedback = True
    envelope_version = 2  # the compact envelope: this codec exists for updates where every byte counts

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        opts = dict(options)
        momentum = _check_momentum(self.name, opts.pop("momentum", 0.0))
        out = check_packed_options(self.name, check_layout(self.name, opts))
        if momentum:
            out["momentum"] = momentum
        return {**out, "layout": options["layout"]} if "layout" in options else out

    def state_size(self, size: int, options: dict[str, Any]) -> int:
        return 2 * size if options.get("momentum") else size  # [residual, velocity] with momentum correction

    def encode(self, x: np.ndarray, ctx: EncodeContext, residual: np.ndarray | None = None):
        momentum = ctx.options.get("momentum", 0.0)
        velocity = None
        if momentum:  # DGC: u = m u + x; v = v + u; send top-k of v (the module docstring)
            velocity = np.array(residual[x.size:]) if residual is not None else np.zeros_like(x)
            velocity *= np.float32(momentum)
            velocity += x
            residual = residual[:x.size] if residual is not None else None
            x = velocity
        bits = ctx.options.get("bits", DEFAULT_BITS)
        acc = x + residual if residual is not None else x
        k = max(topk_count(acc.size, ctx.options), min(acc.size, ctx.options.get("min_k", 1)))
        idx = select_topk(acc, k)
        scale, codes = quantize_bits(acc[idx], bits, ctx.rng)
        gaps = np.diff(idx, prepend=-1)
        parts = [varint(k), _BITS_SCALE.pack(bits, scale), varint_bytes(gaps), pack_bits(codes, bits)]
        new_residual = None
        if ctx.feedback:
            new_residual = acc.copy() if acc is x else acc
            new_residual[idx] -= dequantize_bits(scale, codes, bits)
            if velocity is not None:
                velocity[idx] = 0.0  # momentum factor masking: a sent entry stops moving
                new_residual = np.concatenate([new_residual, velocity])
        return parts, new_residual

    def decode(self, section: memoryview, size: int) -> np.ndarray:
        (k,), at = read_varints(section, 1, "topk-packed section")
        k = int(k)
        if k > size:
            raise codec_error("malformed", f"topk-packed section declares {k} entries for a tensor of {size}")
        if len(section) < at + _BITS_SCALE.size:
            raise codec_error("malformed", f"topk-packed section is {len(section)} bytes, shorter than its header")
        bits, scale = _BITS_SCALE.unpack_from(section, at)
        if not 1 <= bits <= 8:
            raise codec_error("malformed", f"topk-packed section declares {bits} bits per value; 1..8 exist")
        _check_scale(scale, bits)
        at += _BITS_SCALE.size
        gaps, used = read_varints(section[at:], k, "topk-packed section")
        idx = _indices_from_gaps(gaps, size)
        codes = unpack_bits(section[at + used :], k, bits, "topk-packed section")
        if bits > 1 and k and int(codes.max()) > 2 * qmax_of(bits):
            raise codec_error("malformed", "topk-packed section holds a code the encoder never produces")
        out = np.zeros(size, dtype=np.float32)
        out[idx] = dequantize_bits(scale, codes, bits)
        return out


register_codec(TopKPackedCodec())
