"""Codec interface and the registry that finds codecs by name or wire id.

A codec turns one flat float32 tensor into a byte section of the envelope
and back. Everything else (names, shapes, dtypes, signing, validation of the
envelope) is the envelope's job, so a codec module stays a page long.

Wire ids are part of the format: never renumber them, only add.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edgeflow.codecs.rejects import codec_error

__all__ = ["LAYOUTS", "Codec", "EncodeContext", "available_codecs", "check_layout", "codec_by_id", "get_codec",
           "register_codec"]

LAYOUTS = ("names", "digest")
"""Values of the envelope option ``layout`` (compact codecs): ``names`` (versions 1/2: names, dtypes and
shapes in the header) or ``digest`` (version 3: an 8-byte digest of the layout the receiver's model has)."""


def check_layout(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` less a valid ``layout`` (put back by the caller); a bad value is one CodecError line."""
    layout = options.get("layout", "names")
    if layout not in LAYOUTS:
        msg = (f"codec {name!r}: layout must be 'names' or 'digest' (the receiver has the model), "
               f"got {layout!r}")
        raise codec_error("bad_option", msg)
    return {k: v for k, v in options.items() if k != "layout"}


@dataclass
class EncodeContext:
    """Per-call inputs a codec may use.

    ``rng`` drives stochastic rounding, ``options`` are the codec's checked
    options, and ``feedback`` says whether the caller keeps an error-feedback
    state, i.e. whether ``encode`` must return the new residual.
    """

    rng: np.random.Generator
    options: dict[str, Any] = field(default_factory=dict)
    feedback: bool = False


class Codec:
    """Base class. Subclasses set ``name``, ``codec_id`` and implement encode/decode.

    ``encode`` receives a 1-D, C-contiguous, finite float32 array and, for
    codecs with ``uses_feedback``, the device's state for that tensor (or
    None): :meth:`state_size` floats, the residual unless the codec says
    more. It returns the section as a list of buffers (joined once by the
    envelope, so a dense codec can hand over the array without a copy) and
    the new state (None for codecs without error feedback).

    ``decode`` receives the section and the declared element count and must
    return a 1-D float32 array of exactly that many finite values, or raise
    a CodecError with a reason: it must validate its own section layout,
    because the section comes straight from the network.
    """

    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = 0
    option_names: ClassVar[tuple[str, ...]] = ()
    uses_feedback: ClassVar[bool] = False
    lossless: ClassVar[bool] = False
    selector: ClassVar[bool] = False
    """True for a name that picks a real codec per update (``auto``): in the name registry only, with
    ``resolve(sizes, options, overhead)``; never on the wire."""
    envelope_version: ClassVar[int] = 1
    """The envelope a sender writes with this codec: 1, or 2 (compact, docs/wire-format.md) for codecs
    newer than version 1 receivers (which could not decode them anyway)."""

    def state_size(self, size: int, options: dict[str, Any]) -> int:
        """Floats of error-feedback state this codec keeps for a tensor of ``size`` values with these
        (checked) options: the residual's ``size``, more for a codec that also keeps a velocity."""
        return size

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            valid = ", ".join(self.option_names) or "none"
            msg = f"unknown option(s) {', '.join(unknown)} for codec {self.name!r}; valid options: {valid}"
            raise codec_error("bad_option", msg)
        return dict(options)

    def encode(
        self, x: np.ndarray, ctx: EncodeContext, residual: np.ndarray | None = None
    ) -> tuple[list[Any], np.ndarray | None]:
        raise NotImplementedError(f"codec {self.name!r} needs encode")

    def decode(self, section: memoryview, size: int) -> np.ndarray:
        raise NotImplementedError(f"codec {self.name!r} needs decode")


_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}


def register_codec(codec: Codec) -> Codec:
    if codec.selector and codec.name:
        _BY_NAME[codec.name] = codec
        return codec
    if not codec.name or not 0 < codec.codec_id < 256:
        msg = f"codec {codec!r} needs a name and a wire id in 1..255"
        raise ValueError(msg)
    other = _BY_ID.get(codec.codec_id)
    if other is not None and other.name != codec.name:
        msg = f"codec id {codec.codec_id} is taken by {other.name!r}"
        raise ValueError(msg)
    _BY_NAME[codec.name] = codec
    _BY_ID[codec.codec_id] = codec
    return codec


def available_codecs() -> list[str]:
    return sorted(_BY_NAME, key=lambda n: (_BY_NAME[n].selector, _BY_NAME[n].codec_id))


def get_codec(name: str) -> Codec:
    try:
        return _BY_NAME[name]
    except KeyError:
        msg = f"unknown codec {name!r}; available codecs: {', '.join(available_codecs())}"
        raise codec_error("unknown_codec", msg) from None


def codec_by_id(codec_id: int) -> Codec:
    try:
        return _BY_ID[codec_id]
    except KeyError:
        msg = (
            f"unknown codec id {codec_id} in envelope; this edgeflow knows "
            f"{', '.join(f'{c.codec_id}={c.name}' for c in _BY_ID.values())}: upgrade the receiver "
            "or make the device use a codec both sides support"
        )
        raise codec_error("unknown_codec", msg) from None
