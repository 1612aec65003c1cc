"""QuantizeLinear, DequantizeLinear and DynamicQuantizeLinear (integer types).

The arithmetic follows the ONNX spec (and onnx.reference) step by step,
because a quantized model is only portable if every runtime rounds the same
way: ``x / scale`` is a true division in the scale's precision (not a
multiplication by a reciprocal, which rounds differently for ~1 in 10^3
values), rounding is half-to-even (``np.rint``), the zero point is added
after rounding, and the result saturates to the target type's range.

Granularity follows the shape of the scale: a scalar (per tensor), a 1-D
vector along ``axis`` (per channel) or a tensor of the input's rank with one
dimension divided into blocks of ``block_size`` (blocked).

float8 / int4 / int2 targets have no numpy dtype and are rejected with a
clear error (the conformance runner excludes those cases by dtype).
"""

from __future__ import annotations

import numpy as np

from .registry import FLOAT_TYPES, register
from .shape_ops import TENSOR_TYPES

# ONNX TensorProto element type -> numpy dtype, for ``output_dtype`` and
# ``precision`` attributes (one table for the whole kernel library).
ONNX_DTYPES: dict[int, np.dtype] = TENSOR_TYPES

#: Saturation range of every integer type QuantizeLinear can produce.
QUANT_RANGES: dict[np.dtype, tuple[int, int]] = {
    np.dtype(np.uint8): (0, 255),
    np.dtype(np.int8): (-128, 127),
    np.dtype(np.uint16): (0, 65535),
    np.dtype(np.int16): (-32768, 32767),
}

_DEQUANT_TYPES = frozenset({"int8", "uint8", "int16", "uint16", "int32"})


def onnx_dtype(code: int, what: str) -> np.dtype:
    try:
        return ONNX_DTYPES[int(code)]
    except KeyError:
        raise ValueError(
            f"{what}={code} names an ONNX type with no numpy representation "
            "(float8, int4, int2, float4 are not supported by the numpy kernels)"
        ) from None


def broadcast_param(value: np.ndarray, shape: tuple[int, ...], axis: int, block_size: int = 0) -> np.ndarray:
    """Reshape a scale / zero point so that it broadcasts against ``shape``.

    Scalar (or one element): per tensor. 1-D: per axis. Same rank as the
    input: blocked along ``axis`` (each entry repeated ``block_size`` times,
    the last block possibly shorter).
    """
    value = np.asarray(value)
    if value.ndim == 0:
        return value
    if value.size == 1 and not block_size:
        return value.reshape(())
    ndim = len(shape)
    ax = axis + ndim if axis < 0 else axis
    if not 0 <= ax < max(ndim, 1):
        raise ValueError(f"axis {axis} is out of range for an input of rank {ndim}")
    if not block_size:
        if value.ndim != 1:
            raise ValueError(
                f"a per-axis scale / zero point must be 1-D; got shape {value.shape} "
                "(set block_size for blocked quantization)"
            )
        if value.size != shape[ax]:
            raise ValueError(
                f"per-axis scale / zero point has {value.size} entries but axis {axis} "
                f"of the input has {shape[ax]}"
            )
        dims = [1] * ndim
        dims[ax] = value.size
        return value.reshape(dims)
    if block_size < 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if value.ndim != ndim:
        raise ValueError(
            f"a blocked scale must have the input's rank {ndim}; got shape {value.shape}"
        )
    rep = np.repeat(value, block_size, axis=ax)
    if rep.shape[ax] < shape[ax]:
        raise ValueError(
            f"blocked scale of shape {value.shape} with block_size {block_size} covers "
            f"{rep.shape[ax]} entries of axis {axis}, the input has {shape[ax]}"
        )
    rep = np.take(rep, np.arange(shape[ax]), axis=ax)
    if rep.shape != tuple(shape):
        raise ValueError(
            f"blocked scale shape {value.shape} must equal the input shape {tuple(shape)} "
            f"except along axis {axis}"
        )
    return rep


def saturate_round(q: np.ndarray, zero_point, dtype: np.dtype) -> np.ndarray:
    """``saturate(rint(q) + zero_point)`` cast to ``dtype``; ``q`` is float.

    Rounding and clipping happen in floating point: adding an integer zero
    point to an integer-valued float is exact below 2**24 (float32), and
    values beyond the target range saturate before the cast, so no float ->
    int conversion ever overflows (NaN maps to the zero point's type's 0).
    """
    lo, hi = QUANT_RANGES[dtype]
    r = np.asarray(np.rint(q))
    if zero_point is not None:
        r += zero_point
    np.clip(r, lo, hi, out=r)
    return r.astype(dtype)


def quantize(x: np.ndarray, scale, zero_point, dtype: np.dtype) -> np.ndarray:
    """Per-tensor (or pre-broadcast) quantization: saturate(rint(x / scale) + zp)."""
    return saturate_round(np.divide(x, scale), zero_point, dtype)


@register("QuantizeLinear", since=10, dtypes=FLOAT_TYPES | {"int32"})
def quantize_linear(
    x: np.ndarray,
    y_scale: np.ndarray,
    y_zero_point: np.ndarray | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
    precision: int = 0,
    saturate: int = 1,  # only meaningful for float8 outputs
) -> np.ndarray:
    if y_zero_point is not None:
        dtype = np.asarray(y_zero_point).dtype
        if output_dtype and onnx_dtype(output_dtype, "output_dtype") != dtype:
            raise ValueError(
                f"output_dtype {onnx_dtype(output_dtype, 'output_dtype')} does not match "
                f"the zero point's dtype {dtype}"
            )
    elif output_dtype:
        dtype = onnx_dtype(output_dtype, "output_dtype")
    else:
        dtype = np.dtype(np.uint8)
    if dtype not in QUANT_RANGES:
        raise ValueError(f"QuantizeLinear cannot produce {dtype}; integer targets are {sorted(map(str, QUANT_RANGES))}")
    scale = broadcast_param(y_scale, x.shape, axis, block_size)
    zp = None if y_zero_point is None else broadcast_param(y_zero_point, x.shape, axis, block_size)
    if precision:
        p = onnx_dtype(precision, "precision")
        q = x.astype(p) / scale.astype(p)
    else:
        q = x / scale
    if zp is not None:
        zp = zp.astype(q.dtype)
    return saturate_round(q, zp, dtype)


@register("DequantizeLinear", since=10, dtypes=_DEQUANT_TYPES)
def dequantize_linear(
    x: np.ndarray,
    x_scale: np.ndarray,
    x_zero_point: np.ndarray | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
) -> np.ndarray:
    """``(x - zero_point) * scale`` computed in float32, cast to the scale's
    dtype (or ``output_dtype``), as the spec and onnx.reference do."""
    if x_zero_point is not None and np.asarray(x_zero_point).dtype != x.dtype:
        raise ValueError(f"zero point dtype {np.asarray(x_zero_point).dtype} differs from the input's {x.dtype}")
    out_dtype = onnx_dtype(output_dtype, "output_dtype") if output_dtype else np.asarray(x_scale).dtype
    scale = broadcast_param(x_scale, x.shape, axis, block_size)
    if x_zero_point is not None and np.any(x_zero_point):
        zp = broadcast_param(x_zero_point, x.shape, axis, block_size)
        dx = np.asarray(np.subtract(x, zp, dtype=np.float32))  # a 0-d input gives a scalar
    else:
        dx = x.astype(np.float32)
    y = np.multiply(dx, scale, out=dx) if scale.dtype == np.float32 else dx * scale
    return y.astype(out_dtype, copy=False)


@register("DynamicQuantizeLinear", since=11, dtypes={"float32"})
def dynamic_quantize_linear(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 quantization with scale and zero point from this tensor's range.

    The range always includes 0 (so zero is exact), and a constant-zero input
    gets scale 1 rather than a division by zero — both as in the spec.
    """
    qmin, qmax = 0, 255
    if x.size == 0:
        raise ValueError("DynamicQuantizeLinear needs a non-empty input")
    hi = np.float32(max(0.0, float(np.max(x))))
    lo = np.float32(min(0.0, float(np.min(x))))
    scale = np.float32(1.0 if hi == lo else (hi - lo)) / np.float32(qmax - qmin)
    zp_f = np.float32(qmin) - lo / scale
    zp = np.float32(np.rint(min(max(zp_f, np.float32(qmin)), np.float32(qmax))))
    y = saturate_round(np.divide(x, scale), zp, np.dtype(np.uint8))
    return y, np.array(scale, dtype=x.dtype), np.array(zp, dtype=np.uint8)
