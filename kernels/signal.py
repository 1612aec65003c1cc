"""Signal processing: DFT (opset 17 and 20), STFT, HannWindow,
HammingWindow, BlackmanWindow and MelWeightMatrix.

Complex values travel as a trailing axis of 2 (real, imaginary); real
signals have a trailing axis of 1. The transforms run on numpy's pocketfft
and return the input's float dtype.
"""

from __future__ import annotations

import math

import numpy as np

from .registry import ANY_TYPE, FLOAT_TYPES, KernelError, register
from .shape_ops import TENSOR_TYPES


def _scalar_int(op: str, name: str, v) -> int:
    a = np.asarray(v)
    if a.size != 1:
        raise KernelError(f"{op}: {name} must be a scalar, got shape {a.shape}")
    return int(a.reshape(-1)[0])


def _to_complex(op: str, x: np.ndarray) -> tuple[np.ndarray, bool]:
    """(signal without the trailing axis, is_complex)."""
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise KernelError(f"{op}: the last axis must be 1 (real) or 2 (real, imaginary), got shape {x.shape}")
    if x.shape[-1] == 1:
        return x[..., 0], False
    work = np.float64 if x.dtype == np.float64 else np.float32
    return x[..., 0].astype(work) + 1j * x[..., 1].astype(work), True


def _from_complex(y: np.ndarray, dtype) -> np.ndarray:
    return np.stack([y.real, y.imag], axis=-1).astype(dtype, copy=False)


def _dft(x: np.ndarray, dft_length, axis: int, inverse: int, onesided: int) -> np.ndarray:
    r = x.ndim
    if not (-r <= axis <= -2 or 0 <= axis <= r - 2):
        raise KernelError(f"DFT: axis {axis} is out of range for rank {r} (the last axis holds the complex parts)")
    axis %= r
    sig, is_complex = _to_complex("DFT", x)
    n_in = x.shape[axis]
    if dft_length is None:
        n = 2 * (n_in - 1) if inverse and onesided else n_in
    else:
        n = _scalar_int("DFT", "dft_length", dft_length)
    if n < 1:
        raise KernelError(f"DFT: dft_length must be positive, got {n}")
    if inverse:
        if onesided:
            # IRFFT: a one-sided complex spectrum in, a real signal out
            return np.fft.irfft(sig, n=n, axis=axis)[..., None].astype(x.dtype, copy=False)
        return _from_complex(np.fft.ifft(sig, n=n, axis=axis), x.dtype)
    if onesided:
        if is_complex:
            raise KernelError("DFT: onesided=1 needs a real input (trailing axis of 1)")
        return _from_complex(np.fft.rfft(sig, n=n, axis=axis), x.dtype)
    return _from_complex(np.fft.fft(sig, n=n, axis=axis), x.dtype)


@register("DFT", since=20, dtypes=FLOAT_TYPES)
def dft(
    x: np.ndarray, dft_length: np.ndarray | None = None, axis: np.ndarray | None = None,
    *, inverse: int = 0, onesided: int = 0,
) -> np.ndarray:
    ax = -2 if axis is None else _scalar_int("DFT", "axis", axis)
    return _dft(x, dft_length, ax, inverse, onesided)


@register("DFT", since=17, dtypes=FLOAT_TYPES)
def dft_v17(
    x: np.ndarray, dft_length: np.ndarray | None = None, *, axis: int = 1, inverse: int = 0, onesided: int = 0
) -> np.ndarray:
    return _dft(x, dft_length, axis, inverse, onesided)


@register("STFT", since=17, dtypes=FLOAT_TYPES)
def stft(
    signal: np.ndarray,
    frame_step: np.ndarray,
    window: np.ndarray | None = None,
    frame_length: np.ndarray | None = None,
    *,
    onesided: int = 1,
) -> np.ndarray:
    """[batch, length, 1|2] -> [batch, frames, bins, 2]."""
    if signal.ndim != 3:
        raise KernelError(f"STFT: signal must be [batch, length, 1 or 2], got shape {signal.shape}")
    sig, is_complex = _to_complex("STFT", signal)
    length = sig.shape[1]
    step = _scalar_int("STFT", "frame_step", frame_step)
    if frame_length is not None:
        flen = _scalar_int("STFT", "frame_length", frame_length)
    elif window is not None:
        flen = int(np.asarray(window).shape[0])
    else:
        flen = length
    if window is not None and (np.ndim(window) != 1 or np.shape(window)[0] != flen):
        raise KernelError(f"STFT: window must be 1-D of length {flen}, got shape {np.shape(window)}")
    if step < 1 or not 1 <= flen <= length:
        raise KernelError(f"STFT: need frame_step >= 1 and 1 <= frame_length <= {length}; got {step}, {flen}")
    if onesided and is_complex:
        raise KernelError("STFT: onesided=1 needs a real signal (trailing axis of 1)")
    frames = np.lib.stride_tricks.sliding_window_view(sig, flen, axis=1)[:, ::step]  # [B, F, flen]
    if window is not None:
        frames = frames * np.asarray(window).astype(frames.real.dtype, copy=False)
    spec = np.fft.rfft(frames, n=flen, axis=-1) if onesided else np.fft.fft(frames, n=flen, axis=-1)
    return _from_complex(spec, signal.dtype)


def _window(op: str, size, periodic: int, output_datatype: int, terms: tuple[float, ...]) -> np.ndarray:
    """sum_k (-1)^k a_k cos(2 pi k n / N): the generalized cosine windows."""
    n = _scalar_int(op, "size", size)
    if n < 0:
        raise KernelError(f"{op}: size must be non-negative, got {n}")
    try:
        dtype = TENSOR_TYPES[int(output_datatype)]
    except KeyError:
        raise KernelError(f"{op}: output_datatype {output_datatype} is not supported") from None
    denom = n if periodic else n - 1
    if denom <= 0:
        return np.ones(n, dtype=dtype)
    phase = 2 * np.pi * np.arange(n, dtype=np.float64) / denom
    w = np.zeros(n, dtype=np.float64)
    for k, a in enumerate(terms):
        w += (-1) ** k * a * np.cos(k * phase)
    return w.astype(dtype)


@register("HannWindow", since=17, dtypes=ANY_TYPE)
def hann_window(size: np.ndarray, *, output_datatype: int = 1, periodic: int = 1) -> np.ndarray:
    return _window("HannWindow", size, periodic, output_datatype, (0.5, 0.5))


@register("HammingWindow", since=17, dtypes=ANY_TYPE)
def hamming_window(size: np.ndarray, *, output_datatype: int = 1, periodic: int = 1) -> np.ndarray:
    return _window("HammingWindow", size, periodic, output_datatype, (25 / 46, 21 / 46))


@register("BlackmanWindow", since=17, dtypes=ANY_TYPE)
def blackman_window(size: np.ndarray, *, output_datatype: int = 1, periodic: int = 1) -> np.ndarray:
    return _window("BlackmanWindow", size, periodic, output_datatype, (0.42, 0.5, 0.08))


@register("MelWeightMatrix", since=17, dtypes=ANY_TYPE)
def mel_weight_matrix(
    num_mel_bins: np.ndarray,
    dft_length: np.ndarray,
    sample_rate: np.ndarray,
    lower_edge_hertz: np.ndarray,
    upper_edge_hertz: np.ndarray,
    *,
    output_datatype: int = 1,
) -> np.ndarray:
    """[dft_length // 2 + 1, num_mel_bins] triangular filters peaking at 1.

    The band edges are ``num_mel_bins + 2`` points equally spaced on the mel
    scale ``2595 log10(1 + f / 700)`` and snapped down to DFT bins, as
    onnxruntime and the ONNX reference compute them.
    """
    mels = _scalar_int("MelWeightMatrix", "num_mel_bins", num_mel_bins)
    n_fft = _scalar_int("MelWeightMatrix", "dft_length", dft_length)
    rate = _scalar_int("MelWeightMatrix", "sample_rate", sample_rate)
    lo, hi = float(np.asarray(lower_edge_hertz).reshape(-1)[0]), float(np.asarray(upper_edge_hertz).reshape(-1)[0])
    if mels < 1 or n_fft < 1 or rate < 1 or not 0 <= lo < hi:
        raise KernelError(
            f"MelWeightMatrix: need num_mel_bins, dft_length, sample_rate >= 1 and 0 <= lower < upper hertz; "
            f"got {mels}, {n_fft}, {rate}, {lo}, {hi}"
        )
    try:
        dtype = TENSOR_TYPES[int(output_datatype)]
    except KeyError:
        raise KernelError(f"MelWeightMatrix: output_datatype {output_datatype} is not supported") from None
    lo_mel = 2595 * math.log10(1 + lo / 700)
    hi_mel = 2595 * math.log10(1 + hi / 700)
    points = np.arange(mels + 2) * ((hi_mel - lo_mel) / (mels + 2)) + lo_mel
    hz = 700 * (np.power(10.0, points / 2595) - 1)
    edges = np.floor((n_fft + 1) * hz / rate).astype(np.int64)
    left, center, right = edges[None, :-2], edges[None, 1:-1], edges[None, 2:]
    j = np.arange(n_fft // 2 + 1)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        rising = np.where(center > left, (j - left) / np.maximum(center - left, 1), 1.0)
        falling = (right - j) / np.maximum(right - center, 1)
    out = np.where(
        (right > center) & (j >= center) & (j < right), falling,
        np.where((j >= left) & (j <= center) & ((center > left) | (j == center)), rising, 0.0),
    )
    return out.astype(dtype)
