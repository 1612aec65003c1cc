"""MatMulInteger and ConvInteger: int8/uint8 inputs, exact int32 outputs.

Both are the zero-point-shifted integer product of the spec, computed by the
exact float-BLAS helpers of :mod:`.int_gemm` (one sgemm when the reduction
provably fits float32, split or widened otherwise).
"""

from __future__ import annotations

import numpy as np

from .int_gemm import int_conv, int_matmul
from .registry import register

_INT8 = frozenset({"int8", "uint8"})


@register("MatMulInteger", since=10, dtypes=_INT8)
def matmul_integer(
    a: np.ndarray,
    b: np.ndarray,
    a_zero_point: np.ndarray | None = None,
    b_zero_point: np.ndarray | None = None,
) -> np.ndarray:
    return int_matmul(a, b, a_zero_point, b_zero_point)


@register("ConvInteger", since=10, dtypes=_INT8)
def conv_integer(
    x: np.ndarray,
    w: np.ndarray,
    x_zero_point: np.ndarray | None = None,
    w_zero_point: np.ndarray | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: tuple[int, ...] | None = None,
    group: int = 1,
    kernel_shape: tuple[int, ...] | None = None,
    pads: tuple[int, ...] | None = None,
    strides: tuple[int, ...] | None = None,
) -> np.ndarray:
    return int_conv(
        x, w, x_zero_point, w_zero_point, auto_pad=auto_pad, dilations=dilations,
        group=group, kernel_shape=kernel_shape, pads=pads, strides=strides,
    )
