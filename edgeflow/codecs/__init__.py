"""Update codecs: compress, sign and validate model updates for the wire.

>>> data = encode_update({"w": w}, "int8", round_id=3, device_id="pi-7", seq=12, signer=signer)
>>> update = decode_update(data, verifier=keyring, replay_guard=guard)

Codecs, by registry name: ``dense`` (fp32, lossless), ``fp16``, ``int8``
(per-tensor scale, unbiased stochastic rounding), ``topk`` (sparsification
with error feedback), ``topk-int8`` (both) and ``topk-packed`` (top-k with
gap-coded varint indices and 1-8 bit values), ``randk-packed`` (random-k
with indices derived from a seed, 1-8 bit values); ``auto`` picks one of them per
update from the model's size and an optional byte budget. See docs/codecs.md.
"""

from __future__ import annotations

from edgeflow.codecs import auto, dense, fp16, int8, randk_packed, topk, topk_int8, topk_packed  # noqa: F401  (register the codecs)
from edgeflow.codecs.envelope import MAGIC, VERSION, EnvelopeHeader, TensorSpec
from edgeflow.codecs.feedback import ErrorFeedback
from edgeflow.codecs.registry import Codec, EncodeContext, available_codecs, get_codec, register_codec
from edgeflow.codecs.rejects import RejectStats, rejections
from edgeflow.codecs.update import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ELEMENTS,
    MAX_VALUE,
    Update,
    decode_update,
    encode_update,
    peek_update,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ELEMENTS",
    "MAGIC",
    "MAX_VALUE",
    "VERSION",
    "Codec",
    "EncodeContext",
    "EnvelopeHeader",
    "ErrorFeedback",
    "RejectStats",
    "TensorSpec",
    "Update",
    "available_codecs",
    "decode_update",
    "encode_update",
    "get_codec",
    "peek_update",
    "register_codec",
    "rejections",
]
