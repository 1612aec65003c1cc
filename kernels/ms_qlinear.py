"""com.microsoft QLinear* ops that onnxruntime's static quantizer writes in
the QOperator format: QLinearAdd, QLinearMul, QLinearSigmoid,
QLinearLeakyRelu, QLinearGlobalAveragePool and QLinearConcat.

Inputs and outputs are uint8/int8 with per-tensor scales and zero points.
The arithmetic follows onnxruntime's MLAS kernels so that the integers agree:

- Add / Mul: float32 ``(a - za) * (sa / sc) + (b - zb) * (sb / sc)`` (Mul:
  ``(a - za) * (b - zb) * (sa * sb / sc)``), rounded half to even, plus zc;
- unary ops (Sigmoid, LeakyRelu) and Concat's requantization: a 256-entry
  table, each entry dequantized, mapped, and quantized back;
- GlobalAveragePool: the int32 sum over the window, ``(sum - zx * n) * sx /
  (sy * n)`` in float32, rounded, plus zy.
"""

from __future__ import annotations

import numpy as np

from ._nn import OpError
from .registry import ANY_TYPE, register

MS = "com.microsoft"
_INT8 = frozenset({"int8", "uint8"})
_RANGE = {np.dtype(np.uint8): (0, 255), np.dtype(np.int8): (-128, 127)}


def _scalar(v, name: str, op: str, dtype=None):
    a = np.asarray(v)
    if a.size != 1:
        raise OpError(f"{op}: {name} must be a single value (per-tensor quantization), got shape {a.shape}")
    if dtype is not None and a.dtype != dtype:
        raise OpError(f"{op}: {name} must be {np.dtype(dtype).name} like its tensor, got {a.dtype.name}")
    return a.reshape(())


def _zp(zp, x: np.ndarray, name: str, op: str):
    return np.zeros((), x.dtype) if zp is None else _scalar(zp, name, op, x.dtype)


def _int8(x, op: str, name: str = "the input") -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in _RANGE:
        raise OpError(f"{op}: {name} must be uint8 or int8, got {x.dtype.name}")
    return x


def _store(q: np.ndarray, zp, dtype) -> np.ndarray:
    lo, hi = _RANGE[np.dtype(dtype)]
    r = np.rint(q) + np.float32(zp)
    return np.clip(r, lo, hi).astype(dtype)


def _binary(op, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point, mul: bool):
    a, b = _int8(a, op, "A"), _int8(b, op, "B")
    if a.dtype != b.dtype:
        raise OpError(f"{op}: A and B must have one type, got {a.dtype.name} and {b.dtype.name}")
    try:
        shape = np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise OpError(f"{op}: A {a.shape} and B {b.shape} do not broadcast") from None
    sa, sb, sc = (_scalar(s, n, op).astype(np.float32) for s, n in ((a_scale, "A_scale"), (b_scale, "B_scale"),
                                                                   (c_scale, "C_scale")))
    za, zb = _zp(a_zero_point, a, "A_zero_point", op), _zp(b_zero_point, b, "B_zero_point", op)
    zc = _zp(c_zero_point, a, "C_zero_point", op)
    fa = a.astype(np.float32) - np.float32(za)
    fb = b.astype(np.float32) - np.float32(zb)
    if mul:
        y = fa * fb * np.float32(sa * sb / sc)
    else:
        y = fa * np.float32(sa / sc) + fb * np.float32(sb / sc)
    return _store(np.broadcast_to(y, shape), zc, a.dtype)


@register("QLinearAdd", domain=MS, dtypes=_INT8)
def qlinear_add(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point=None):
    return _binary("QLinearAdd", a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point, False)


@register("QLinearMul", domain=MS, dtypes=_INT8)
def qlinear_mul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point=None):
    return _binary("QLinearMul", a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point, True)


def _table(op, x, x_scale, x_zero_point, y_scale, y_zero_point, fn) -> np.ndarray:
    """``fn`` applied through a 256-entry table indexed by the input's bytes."""
    x = _int8(x, op, "X")
    sx, sy = _scalar(x_scale, "X_scale", op).astype(np.float32), _scalar(y_scale, "Y_scale", op).astype(np.float32)
    zx, zy = _zp(x_zero_point, x, "X_zero_point", op), _zp(y_zero_point, x, "Y_zero_point", op)
    lo, hi = _RANGE[x.dtype]
    levels = np.arange(lo, hi + 1, dtype=np.float32)
    with np.errstate(over="ignore"):
        table = _store(fn((levels - np.float32(zx)) * sx).astype(np.float32) / sy, zy, x.dtype)
    return table[x.astype(np.int16) - lo]


@register("QLinearSigmoid", domain=MS, dtypes=_INT8)
def qlinear_sigmoid(x, x_scale, x_zero_point, y_scale, y_zero_point=None):
    return _table("QLinearSigmoid", x, x_scale, x_zero_point, y_scale, y_zero_point,
                  lambda v: 1.0 / (1.0 + np.exp(-v)))


@register("QLinearLeakyRelu", domain=MS, dtypes=_INT8)
def qlinear_leaky_relu(x, x_scale, x_zero_point, y_scale, y_zero_point=None, *, alpha: float = 0.01):
    a = np.float32(alpha)
    return _table("QLinearLeakyRelu", x, x_scale, x_zero_point, y_scale, y_zero_point,
                  lambda v: np.where(v >= 0, v, v * a))


@register("QLinearGlobalAveragePool", domain=MS, dtypes=_INT8)
def qlinear_global_average_pool(x, x_scale, x_zero_point, y_scale, y_zero_point, *, channels_last: int = 0):
    op = "QLinearGlobalAveragePool"
    x = _int8(x, op, "X")
    if x.ndim < 3:
        raise OpError(f"{op}: X must be (N, C, spatial...) (or channels last), rank >= 3; got {x.shape}")
    sx, sy = _scalar(x_scale, "x_scale", op).astype(np.float32), _scalar(y_scale, "y_scale", op).astype(np.float32)
    zx, zy = _zp(x_zero_point, x, "x_zero_point", op), _zp(y_zero_point, x, "y_zero_point", op)
    axes = tuple(range(1, x.ndim - 1)) if channels_last else tuple(range(2, x.ndim))
    n = int(np.prod([x.shape[a] for a in axes]))
    if n == 0:
        raise OpError(f"{op}: X {x.shape} has an empty spatial window")
    acc = x.sum(axis=axes, keepdims=True, dtype=np.int64) - np.int64(zx) * n
    y = acc.astype(np.float32) * np.float32(sx / (sy * np.float32(n)))
    return _store(y, zy, x.dtype)


@register("QLinearConcat", domain=MS, dtypes=ANY_TYPE)
def qlinear_concat(y_scale, y_zero_point, *inputs, axis: int):
    """Inputs after Y's scale and zero point come in threes (X, X_scale, X_zero_point); each X is
    requantized to Y's scale and zero point (unchanged where its own are the same)."""
    op = "QLinearConcat"
    if not inputs or len(inputs) % 3:
        raise OpError(f"{op}: inputs after Y_scale and Y_zero_point must be (X, X_scale, X_zero_point) triples, "
                      f"got {len(inputs)} inputs")
    zy = np.asarray(y_zero_point)
    if zy.dtype not in _RANGE:
        raise OpError(f"{op}: Y_zero_point must be uint8 or int8, got {zy.dtype.name}")
    sy = _scalar(y_scale, "Y_scale", op).astype(np.float32)
    zy = _scalar(zy, "Y_zero_point", op)
    parts = []
    for k in range(0, len(inputs), 3):
        x, sx, zx = _int8(inputs[k], op, f"input {k // 3}"), inputs[k + 1], inputs[k + 2]
        if x.dtype != zy.dtype:
            raise OpError(f"{op}: input {k // 3} is {x.dtype.name}, Y is {zy.dtype.name}")
        same = np.float32(_scalar(sx, "X_scale", op)) == sy and _zp(zx, x, "X_zero_point", op) == zy
        parts.append(x if same else _table(op, x, sx, zx, sy, zy, lambda v: v))
    r = parts[0].ndim
    if not -r <= int(axis) < r:
        raise OpError(f"{op}: axis={axis} is out of range for rank {r}")
    try:
        return np.concatenate(parts, axis=int(axis))
    except ValueError:
        raise OpError(f"{op}: inputs {[p.shape for p in parts]} cannot be joined along axis {axis}") from None
