"""Conv (N-d, groups, strides, pads, dilations, auto_pad) by im2col + GEMM.

The input is padded once, viewed as sliding windows without copying
(:func:`spatial.windows`), and reshaped into a column matrix — the single
copy — so each group is one BLAS matmul whose result is already in NCHW
order. A 1x1 convolution with unit stride skips im2col entirely.
"""

from __future__ import annotations

import numpy as np

from . import spatial
from .registry import FLOAT_TYPES, register


def im2col(x: np.ndarray, g: spatial.WindowGeometry, group: int, pad_value: float = 0) -> np.ndarray:
    """(N, C, *S) -> (N, group, C/group * prod(kernel), prod(out)) columns."""
    n_batch, channels = x.shape[:2]
    xp = spatial.pad_spatial(x, g, pad_value)
    win = spatial.windows(xp, g)  # (N, C, *k, *out)
    k = int(np.prod(g.kernel))
    p = int(np.prod(g.out_shape))
    return win.reshape(n_batch, group, (channels // group) * k, p)


def conv_geometry(
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    *,
    auto_pad: str = "NOTSET",
    dilations: list[int] | None = None,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> spatial.WindowGeometry:
    return spatial.resolve(
        tuple(x_shape[2:]),
        kernel_shape or w_shape[2:],
        strides=strides,
        dilations=dilations,
        pads=pads,
        auto_pad=auto_pad,
    )


def check_conv_shapes(x: np.ndarray, w: np.ndarray, group: int) -> None:
    if x.ndim < 3 or w.ndim != x.ndim:
        raise ValueError(
            f"Conv expects input (N, C, *spatial) and weight (M, C/group, *kernel) of the "
            f"same rank; got input {x.shape} and weight {w.shape}"
        )
    if x.shape[1] != w.shape[1] * group or w.shape[0] % group:
        raise ValueError(
            f"Conv channel mismatch: input has {x.shape[1]} channels, weight {w.shape} "
            f"with group={group} expects {w.shape[1] * group}"
        )


@register("Conv", dtypes=FLOAT_TYPES)
def conv(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: list[int] | None = None,
    group: int = 1,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> np.ndarray:
    check_conv_shapes(x, w, group)
    g = conv_geometry(
        x.shape, w.shape, auto_pad=auto_pad, dilations=dilations,
        kernel_shape=kernel_shape, pads=pads, strides=strides,
    )
    n_batch = x.shape[0]
    m = w.shape[0]
    w_g = w.reshape(group, m // group, -1)  # (g, M/g, C/g * k)
    if (
        all(k == 1 for k in g.kernel)
        and all(s == 1 for s in g.strides)
        and not g.padded
    ):
        cols = x.reshape(n_batch, group, x.shape[1] // group, -1)
    else:
        cols = im2col(x, g, group)
    y = np.matmul(w_g, cols)  # (N, g, M/g, P)
    y = y.reshape((n_batch, m) + g.out_shape)
    if b is not None:
        y += b.reshape((1, m) + (1,) * len(g.out_shape))
    return y


@conv.workspace
def _conv_workspace(shapes: list, attrs: dict) -> int:
    """im2col columns: N * C * prod(kernel) * prod(out) values (4-byte estimate)."""
    x, w = shapes[0], shapes[1]
    if x is None or w is None:
        return 0
    g = conv_geometry(
        tuple(x), tuple(w), auto_pad=attrs.get("auto_pad", "NOTSET"),
        dilations=attrs.get("dilations"), kernel_shape=attrs.get("kernel_shape"),
        pads=attrs.get("pads"), strides=attrs.get("strides"),
    )
    if all(k == 1 for k in g.kernel) and all(s == 1 for s in g.strides) and not g.padded:
        return 0
    return 4 * int(x[0]) * int(x[1]) * int(np.prod(g.kernel)) * int(np.prod(g.out_shape))
