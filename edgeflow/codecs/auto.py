"""``auto``: the codec chosen per update from the model's size and, if given, a byte budget.

``auto`` is a name a device or a round config may use wherever a codec name
goes; it never appears on the wire. :func:`encode_update` resolves it, from
the update's tensors, to one real codec and its options, and the envelope
names that codec:

- ``budget`` (bytes per update, everything sent included: envelope, names,
  signature) given: ``int8`` if it fits (the most faithful cheap codec),
  else ``topk-packed`` at 2 bits with as many entries as fit. A budget the
  envelope alone exceeds is refused with the smallest budget that would do.
- no budget, a small model (at most :data:`SMALL_MODEL` values, at least
  :data:`MIN_MEAN_TENSOR` values per tensor on average): the
  envelope's fixed cost dominates a dense or int8 update, so
  ``topk-packed`` (ratio :data:`SMALL_RATIO`, :data:`SMALL_BITS` bits) with
  error feedback. On the 20-device/30-round digits run (seeds 0-2) it ends
  within 0.5 point of dense's accuracy with 2.0% of dense's bytes, 1/13 of
  int8's (docs/codecs.md, benchmarks/codec_moonshot.py).
- no budget, anything else: ``int8``. Sparse updates of large models were
  not measured against dense here, and on a fine-tune of many small tensors
  (PP-OCR's MobileNetV3, biases + head: 37 tensors of 112 values on
  average) 3% top-k ended far below dense (0.416 vs 0.671 after 12 rounds,
  one seed, docs/codecs.md), so auto does not gamble accuracy on them; ask
  for ``topk-packed`` or give a budget.

``layout="digest"`` is passed through to the envelope (version 3: a layout digest instead of tensor names;
a budget is then counted against that smaller envelope). auto does not choose it by itself: the receiver
must hold the model, which one gateway path (an ingestion worker rebuilding from its store) does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from edgeflow.codecs.registry import Codec, check_layout, get_codec, register_codec
from edgeflow.codecs.rejects import codec_error

__all__ = ["SMALL_BITS", "SMALL_MODEL", "SMALL_RATIO", "AutoCodec", "choose_codec"]

SMALL_MODEL = 1 << 16
"""Largest model (values) that auto sends sparse without a budget: 256 KB of fp32."""
SMALL_RATIO = 0.03
MIN_MEAN_TENSOR = 512
"""Fewest values per tensor, on average, for auto to go sparse without a budget: at 3% the digits MLP (1,095)
stayed within 0.5 point of dense on 3 seeds and the CNN (1,713) within 0.3 on average (0.67 on its worst
seeds); the 37-tensor fine-tune (112) fell far below."""
MIN_BUDGET = 128
"""Smallest budget accepted when the options are checked (before the model is known): a signed compact
envelope with one tiny tensor and no metadata is about 100 bytes; the real floor is reported per update."""
SMALL_BITS = 2
BUDGET_BITS = 2
_SECTION_HEAD = 12  # topk-packed: varint k (<= 5 B) + bits + f32 scale, plus the section-length varint
_INT8_SECTION_HEAD = 8 + 5


def _gap_bytes(size: int, k: int) -> int:
    """Bytes per gap varint when ``k`` of ``size`` entries are kept (mean gap ``size / k``), rounded up."""
    mean_gap = size / max(k, 1)
    return max(1, math.ceil(math.log2(mean_gap * 4 + 1) / 7))  # 4x the mean covers most of the gaps


def packed_size(sizes: Sequence[int], ratio: float, bits: int) -> int:
    """An upper estimate of topk-packed's section bytes for these tensors at ``ratio``."""
    total = 0
    for n in sizes:
        k = 0 if n == 0 else max(1, min(n, math.ceil(ratio * n)))
        total += _SECTION_HEAD + k * _gap_bytes(n, k) + math.ceil(k * bits / 8)
    return total


def choose_codec(sizes: Sequence[int], options: dict[str, Any],
                 overhead: Callable[[int], int]) -> tuple[str, dict[str, Any]]:
    """The real codec and options for an update of tensors with ``sizes`` values each; ``overhead(version)``
    is what an envelope of that version costs without its sections."""
    n = sum(sizes)
    budget = options.get("budget")
    if budget is None:
        if n <= SMALL_MODEL and n >= MIN_MEAN_TENSOR * len(sizes):
            return "topk-packed", {"ratio": SMALL_RATIO, "bits": SMALL_BITS}
        return "int8", {}
    if overhead(get_codec("int8").envelope_version) + n + _INT8_SECTION_HEAD * len(sizes) <= budget:
        return "int8", {}
    packed_overhead = overhead(get_codec("topk-packed").envelope_version)
    floor = packed_overhead + packed_size(sizes, 0.0, BUDGET_BITS)
    if floor > budget:
        msg = (f"codec 'auto': a budget of {budget} bytes cannot hold this update; its envelope and one entry "
               f"per tensor need {floor} bytes: raise budget to at least {floor}")
        raise codec_error("bad_option", msg)
    lo, hi = 0.0, 1.0  # the largest ratio whose estimate fits (bisection on a monotone estimate)
    for _ in range(40):
        mid = (lo + hi) / 2
        if packed_overhead + packed_size(sizes, mid, BUDGET_BITS) <= budget:
            lo = mid
        else:
            hi = mid
    return "topk-packed", {"ratio": max(lo, 1e-12), "bits": BUDGET_BITS}


class AutoCodec(Codec):
    """Resolved by :func:`encode_update` before encoding (:func:`choose_codec`); never on the wire."""

    name = "auto"
    codec_id = 0
    option_names = ("budget", "layout")
    selector = True

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        check_layout(self.name, options)
        out = super().check_options(options)
        if "budget" in out:
            b = out["budget"]
            if isinstance(b, bool) or not isinstance(b, int) or b < MIN_BUDGET:
                msg = (f"codec 'auto': budget must be a whole number of bytes >= {MIN_BUDGET} (a signed update's "
                       f"envelope alone is about 100 B), got {b!r}")
                raise codec_error("bad_option", msg)
        return out

    def resolve(self, sizes: Sequence[int], options: dict[str, Any],
                overhead: Callable[[int], int]) -> tuple[Codec, dict[str, Any]]:
        name, opts = choose_codec(sizes, options, overhead)
        impl = get_codec(name)
        return impl, impl.check_options(opts)


register_codec(AutoCodec())
