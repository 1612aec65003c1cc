"""Shared geometry of sliding-window ops (Conv, pooling, their int8 and
backward variants): padding resolution, output sizes, and window views.

Kept in one place because ONNX's rules for ``auto_pad``, ``ceil_mode`` and
dilations are easy to get subtly wrong, and every windowed op must agree.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided


@dataclass(frozen=True)
class WindowGeometry:
    """Resolved geometry of one sliding-window op over ``n`` spatial dims."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    out_shape: tuple[int, ...]
    # Padding added past ``pads_end`` only so that ceil_mode's last window
    # fits a strided view; it never counts as a real (padded) cell.
    ceil_extra: tuple[int, ...] = ()

    @property
    def padded(self) -> bool:
        return any(self.pads_begin) or any(self.pads_end)

    @functools.cached_property
    def offset_slices(self) -> tuple[tuple[slice, ...], ...]:
        """``(Ellipsis, *window_slices(offset))`` for every kernel offset, in
        row-major offset order (computed once per geometry)."""
        return tuple(
            (Ellipsis,) + window_slices(self, off)
            for off in itertools.product(*(range(k) for k in self.kernel))
        )


def resolve(
    in_shape: tuple[int, ...],
    kernel: tuple[int, ...] | list[int],
    *,
    strides: list[int] | None = None,
    dilations: list[int] | None = None,
    pads: list[int] | None = None,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
) -> WindowGeometry:
    """Compute padding and output size the way the ONNX spec defines them.

    Memoised: a model calls each windowed op with the same shapes every run,
    and resolving costs a few microseconds of Python per call.
    """
    try:  # attributes arrive as tuples from the executor: hash them directly
        return _resolve(in_shape, kernel, strides, dilations, pads, auto_pad, ceil_mode)
    except TypeError:  # lists (a direct caller): make them hashable
        t = lambda v: None if v is None else tuple(int(i) for i in v)  # noqa: E731
        return _resolve(tuple(in_shape), t(kernel), t(strides), t(dilations), t(pads), auto_pad, int(ceil_mode))


@functools.lru_cache(maxsize=1024)
def _resolve(in_shape, kernel, strides, dilations, pads, auto_pad, ceil_mode) -> WindowGeometry:
    n = len(in_shape)
    kernel = tuple(int(k) for k in kernel)
    strides_t = tuple(strides) if strides else (1,) * n
    dil = tuple(dilations) if dilations else (1,) * n
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    eff = tuple((k - 1) * d + 1 for k, d in zip(kernel, dil))
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = tuple(math.ceil(i / s) for i, s in zip(in_shape, strides_t))
        total = [max(0, (o - 1) * s + e - i) for o, s, e, i in zip(out, strides_t, eff, in_shape)]
        if auto_pad == "SAME_UPPER":
            begin = tuple(t // 2 for t in total)
        else:
            begin = tuple(t - t // 2 for t in total)
        end = tuple(t - b for t, b in zip(total, begin))
        return WindowGeometry(kernel, strides_t, dil, begin, end, out)
    if auto_pad == "VALID":
        begin = end = (0,) * n
    else:
        p = list(pads) if pads else [0] * (2 * n)
        begin, end = tuple(p[:n]), tuple(p[n:])
    out_l = []
    extra = [0] * n
    for ax in range(n):
        span = in_shape[ax] + begin[ax] + end[ax] - eff[ax]
        if ceil_mode:
            o = -(-span // strides_t[ax]) + 1
            # The last window must start inside the input or left padding.
            if (o - 1) * strides_t[ax] >= in_shape[ax] + begin[ax]:
                o -= 1
            # Extend the end padding so the last window fits the view; the
            # extra cells are padding (excluded from averages, -inf for max).
            need = (o - 1) * strides_t[ax] + eff[ax] - (in_shape[ax] + begin[ax])
            extra[ax] = max(0, need - end[ax])
        else:
            o = span // strides_t[ax] + 1
        out_l.append(max(o, 0))
    end_total = tuple(e + x for e, x in zip(end, extra))
    return WindowGeometry(kernel, strides_t, dil, tuple(begin), end_total, tuple(out_l), tuple(extra))


def pad_spatial(x: np.ndarray, g: WindowGeometry, value: float = 0.0) -> np.ndarray:
    """Pad the trailing spatial dims of an (N, C, *spatial) array."""
    if not g.padded:
        return x
    # Allocate-and-assign: np.pad costs ~20 us of Python per call, which is
    # a third of a small convolution's time at batch 1.
    shape = x.shape[:2] + tuple(s + b + e for s, b, e in zip(x.shape[2:], g.pads_begin, g.pads_end))
    out = np.zeros(shape, x.dtype) if value == 0 else np.full(shape, value, x.dtype)
    inner = tuple(slice(b, b + s) for b, s in zip(g.pads_begin, x.shape[2:]))
    out[(slice(None), slice(None)) + inner] = x
    return out


def windows(xp: np.ndarray, g: WindowGeometry) -> np.ndarray:
    """A read-only strided view (N, C, *kernel, *out) over padded input.

    No data is copied; the caller reshapes (which copies once) or reduces.
    """
    n = len(g.kernel)
    sN, sC, *s_sp = xp.strides
    shape = xp.shape[:2] + g.kernel + g.out_shape
    strides = (
        (sN, sC)
        + tuple(s * d for s, d in zip(s_sp, g.dilations))
        + tuple(s * st for s, st in zip(s_sp, g.strides))
    )
    assert len(shape) == 2 + 2 * n
    if xp.flags.c_contiguous and xp.size:
        # the ndarray constructor makes the same view in a third of as_strided's time
        v = np.ndarray(shape, xp.dtype, buffer=xp, strides=strides)
        v.flags.writeable = False
        return v
    return as_strided(xp, shape=shape, strides=strides, writeable=False)


def window_slices(g: WindowGeometry, offset: tuple[int, ...]) -> tuple[slice, ...]:
    """Slices selecting, for one kernel offset, the input cell of every output.

    ``xp[(..., *window_slices(g, off))]`` has shape (N, C, *out): looping over
    kernel offsets with such slices is the fast way to pool in numpy.
    """
    return tuple(
        slice(o * d, o * d + (out - 1) * s + 1, s)
        for o, d, s, out in zip(offset, g.dilations, g.strides, g.out_shape)
    )
