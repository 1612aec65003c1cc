"""QLinearMatMul and QLinearConv: integer in, integer out (QOperator format).

``y = saturate(rint(acc * a_scale * b_scale / y_scale) + y_zero_point)``
where ``acc`` is the exact int32 product of the zero-point-shifted inputs
(plus the int32 bias for QLinearConv). The multiplier is formed in the
scales' precision and applied to ``float32(acc)``, as onnxruntime does.
"""

from __future__ import annotations

import numpy as np

from .int_gemm import _row_param, int_conv, int_matmul, requantize
from .registry import register

_INT8 = frozenset({"int8", "uint8"})


def _out_dtype(y_zero_point, x: np.ndarray) -> np.dtype:
    return np.asarray(y_zero_point).dtype if y_zero_point is not None else x.dtype


@register("QLinearMatMul", since=10, dtypes=_INT8)
def qlinear_matmul(
    a: np.ndarray,
    a_scale: np.ndarray,
    a_zero_point: np.ndarray,
    b: np.ndarray,
    b_scale: np.ndarray,
    b_zero_point: np.ndarray,
    y_scale: np.ndarray,
    y_zero_point: np.ndarray,
) -> np.ndarray:
    acc = int_matmul(a, b, a_zero_point, b_zero_point)
    mult = _row_param(a_scale, a) * np.asarray(b_scale) / np.asarray(y_scale)
    return requantize(acc, mult.astype(np.float32), y_zero_point, _out_dtype(y_zero_point, a))


@register("QLinearConv", since=10, dtypes=_INT8)
def qlinear_conv(
    x: np.ndarray,
    x_scale: np.ndarray,
    x_zero_point: np.ndarray,
    w: np.ndarray,
    w_scale: np.ndarray,
    w_zero_point: np.ndarray,
    y_scale: np.ndarray,
    y_zero_point: np.ndarray,
    b: np.ndarray | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: tuple[int, ...] | None = None,
    group: int = 1,
    kernel_shape: tuple[int, ...] | None = None,
    pads: tuple[int, ...] | None = None,
    strides: tuple[int, ...] | None = None,
) -> np.ndarray:
    acc = int_conv(
        x, w, x_zero_point, w_zero_point, auto_pad=auto_pad, dilations=dilations,
        group=group, kernel_shape=kernel_shape, pads=pads, strides=strides,
    )
    chan = (1, -1) + (1,) * (acc.ndim - 2)
    if b is not None:
        acc += np.asarray(b, dtype=np.int32).reshape(chan)
    ws = np.asarray(w_scale)
    mult = np.asarray(x_scale) * (ws.reshape(chan) if ws.size > 1 else ws) / np.asarray(y_scale)
    return requantize(acc, mult.astype(np.float32), y_zero_point, _out_dtype(y_zero_point, x))
